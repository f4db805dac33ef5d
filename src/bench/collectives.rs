//! `meshtrain bench <collective|all>`: bandwidth and latency of the collectives, in the spirit of
//! nccl-tests, optionally side by side with the system MPI's own collective on the same buffers.
//!
//! For each size (bytes of the whole buffer, rounded down to a multiple of the element size times
//! the world size so that MPI's equal-block collectives apply): warm-up, a barrier, timed
//! iterations (time per operation = the slowest rank's average), then one more call on freshly
//! built exact inputs whose result is compared element by element (`wrong` = elements that
//! differ). MPI's collective, with `--vs-mpi`, runs under the same rule (same warm-up count,
//! buffers touched before it) so that its column agrees with the standalone program
//! benches/mpi_coll.c, the baseline the ratios are quoted against. Bus bandwidth uses the
//! usual factors: all-reduce 2(n-1)/n; all-gather, reduce-scatter, all-to-all (n-1)/n; broadcast
//! and reduce 1.
//!
//! Timed calls per size ([`CollBench::rounds_for`]): at least `--iters`, and for small buffers
//! as many as move `--iter-bytes` (at most [`MAX_ITERS`]), with a tenth as many warm-up calls. A
//! 4 KiB call takes 1-20 us here, so 20 calls after a barrier time mostly the ranks' skew leaving
//! the barrier and the first cold call; the standalone program uses the same rule.
//!
//! The copy floor: all-gather, broadcast and all-to-all only move data, and each byte of a rank's
//! output that the call fills must be written at least once: the blocks from peers, and out of
//! place (all-to-all always) also the rank's own block, copied from its input. Every rank
//! therefore also times, all ranks at once and under the same rule, a plain copy of that many
//! bytes (from a private buffer into another), and the row reports it as `copy_us`: a
//! single-copy schedule cannot be much faster than that, and `copy_us / time_us` says how close
//! the collective comes to the memory system's limit.
//!
//! Across nodes (a communicator whose members span several), each row also says how many bytes a
//! rank sent to other nodes per call (the mean over ranks and the busiest rank, counted on the
//! links: [`crate::comm::stats`]) next to the theoretical minimum of the mean: with `n` nodes of
//! `L` ranks and a buffer of `S` bytes, a node must send `2(n-1)/n·S` for all-reduce and
//! `(n-1)/n·S` for reduce-scatter, all-gather, broadcast and reduce, shared by its `L` ranks; an
//! all-to-all rank sends the blocks of the `k-L` ranks on other nodes.

use std::fmt::Write as _;
use std::time::Instant;

use half::{bf16, f16};
use mpi::collective::SystemOperation;
use mpi::traits::{CommunicatorCollectives, Root};

use crate::dtype::{exact_input, exact_result};
pub use crate::comm::stats::bus_factor;
use crate::comm::{block_range, Communicator, DType, Element, ReduceOp};
use crate::error::{Error, Result};

/// The collectives the benchmark knows, in `all` order.
pub const COLLECTIVES: [&str; 6] = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce"];

/// What to measure.
#[derive(Debug, Clone)]
pub struct CollBench {
    /// Collective names (from [`COLLECTIVES`]).
    pub colls: Vec<String>,
    /// Smallest buffer, bytes.
    pub min_bytes: usize,
    /// Largest buffer, bytes.
    pub max_bytes: usize,
    /// Size multiplier between rows.
    pub factor: usize,
    /// Element type.
    pub dtype: DType,
    /// Reduction operator.
    pub op: ReduceOp,
    /// Untimed calls per size.
    pub warmup: usize,
    /// Timed calls per size (at least).
    pub iters: usize,
    /// More timed calls for small sizes: as many as move this many bytes (0: exactly `iters`).
    pub iter_bytes: usize,
    /// In-place variants instead of separate output buffers.
    pub inplace: bool,
    /// Also time the system MPI's collective.
    pub vs_mpi: bool,
    /// Print CSV instead of a table.
    pub csv: bool,
    /// Element counts as the sizes give them, not rounded to a multiple of the world size (the
    /// ranks' blocks then differ by one element; no MPI comparison or tuning then).
    pub exact_count: bool,
}

/// Most timed calls per size under the `iter_bytes` rule.
pub const MAX_ITERS: usize = 1000;

impl CollBench {
    /// Untimed and timed calls for a buffer of `bytes` bytes: `iters` timed calls, or as many as
    /// move `iter_bytes` when that is more (at most [`MAX_ITERS`]), and `warmup` untimed calls, or
    /// a tenth of the timed ones when that is more. The same in benches/mpi_coll.c.
    pub fn rounds_for(&self, bytes: usize) -> Rounds {
        if self.iter_bytes == 0 {
            return Rounds { warmup: self.warmup, iters: self.iters.max(1) };
        }
        let iters = (self.iter_bytes / bytes.max(1)).min(MAX_ITERS).max(self.iters).max(1);
        Rounds { warmup: self.warmup.max(iters / 10), iters }
    }

    /// The rule of [`CollBench::rounds_for`] in words, for headers.
    pub fn rounds_text(&self) -> String {
        if self.iter_bytes == 0 {
            return format!("warm-up {}, {} timed calls per size", self.warmup, self.iters);
        }
        format!(
            "timed calls per size: {} or as many as move {} bytes (at most {MAX_ITERS}), warm-up {} or a tenth of them",
            self.iters, self.iter_bytes, self.warmup
        )
    }

    /// Whether the rows carry the copy floor column (some collective timed only moves data).
    pub fn has_copy_floor(&self) -> bool {
        self.colls.iter().any(|c| copy_floor_elems(c, 2, 1, 1, false).is_some())
    }
}

/// Elements of its output that `coll` on an `n`-element buffer fills on member `me` of `k` (root
/// 0), for the collectives that only move data; `None` for the others. In place, an all-gather's
/// own block is already there; out of place it is copied from the input like the rest.
fn copy_floor_elems(coll: &str, k: usize, me: usize, n: usize, inplace: bool) -> Option<usize> {
    match coll {
        "all_gather" if inplace => Some(n - block_range(n, k, me).len()),
        "all_gather" => Some(n),
        "all_to_all" => Some(block_range(n, k, me).len() * k),
        "broadcast" => Some(if me == 0 { 0 } else { n }),
        _ => None,
    }
}

/// One result row.
#[derive(Debug, Clone)]
pub struct Row {
    /// Collective.
    pub coll: String,
    /// Buffer bytes.
    pub bytes: usize,
    /// Buffer elements.
    pub count: usize,
    /// Element type.
    pub dtype: DType,
    /// Microseconds per operation (slowest rank).
    pub time_us: f64,
    /// Wrong elements in the checked result (summed over ranks).
    pub wrong: u64,
    /// MPI's microseconds per operation, when compared and supported.
    pub mpi_time_us: Option<f64>,
    /// World size.
    pub ranks: usize,
    /// Bytes per call sent to other nodes, when the members span nodes.
    pub net: Option<NetBytes>,
    /// The copy floor: microseconds for every rank to copy the bytes the collective brings it
    /// (slowest rank), for the collectives that only move data.
    pub copy_us: Option<f64>,
}

/// Bytes per call that ranks sent to other nodes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NetBytes {
    /// Mean over ranks.
    pub mean: f64,
    /// The busiest rank.
    pub max: f64,
    /// Theoretical minimum of the mean (`None` for all-to-all where nodes hold different numbers
    /// of ranks).
    pub min: Option<f64>,
}

/// The theoretical minimum of the bytes per rank sent between nodes for one call of `coll` on a
/// buffer of `bytes` bytes, `nodes` nodes of `per` ranks each (see the module header).
pub fn net_minimum(coll: &str, bytes: usize, nodes: usize, per: usize) -> f64 {
    let (s, n, l) = (bytes as f64, nodes as f64, per as f64);
    match coll {
        "all_reduce" => 2.0 * (n - 1.0) / n * s / l,
        "all_to_all" => s * (n * l - l) / (n * l),
        _ => (n - 1.0) / n * s / l,
    }
}

/// The theoretical minimum of the mean bytes per rank sent between nodes on `nodes` nodes of any
/// sizes, `ranks` ranks in all: every node must send `2(n-1)/n` of an all-reduce's buffer, so
/// `2(n-1)` buffers cross in all; for reduce-scatter, all-gather, broadcast and reduce `n-1`
/// buffers (each block reaches, or leaves for, each other node once); the mean is that over the
/// ranks (equal to [`net_minimum`] on even layouts).
pub fn net_minimum_uneven(coll: &str, bytes: usize, nodes: usize, ranks: usize) -> f64 {
    let factor = if coll == "all_reduce" { 2.0 } else { 1.0 };
    factor * (nodes as f64 - 1.0) * bytes as f64 / ranks as f64
}

impl Row {
    fn algbw(&self, us: f64) -> f64 {
        if us > 0.0 {
            self.bytes as f64 / (us * 1e3)
        } else {
            0.0
        }
    }

    /// Algorithm bandwidth, GB/s.
    pub fn algbw_gbs(&self) -> f64 {
        self.algbw(self.time_us)
    }

    /// Bus bandwidth, GB/s.
    pub fn busbw_gbs(&self) -> f64 {
        self.algbw_gbs() * bus_factor(&self.coll, self.ranks)
    }
}

const HEADER: [&str; 8] = ["coll", "bytes", "count", "dtype", "time_us", "algbw_gbs", "busbw_gbs", "wrong"];
const MPI_HEADER: [&str; 3] = ["mpi_time_us", "mpi_busbw_gbs", "speedup"];
const NET_HEADER: [&str; 3] = ["net_B_rank", "net_B_max", "net_B_min"];
const COPY_HEADER: [&str; 2] = ["copy_us", "of_copy"];

/// The header line (CSV or table) of `b`'s rows; `net`: with the inter-node byte columns (members
/// on several nodes). The copy floor's columns come last.
pub fn header(b: &CollBench, net: bool) -> String {
    let mut cols: Vec<&str> = HEADER.to_vec();
    if b.vs_mpi {
        cols.extend(MPI_HEADER);
    }
    if net {
        cols.extend(NET_HEADER);
    }
    if b.has_copy_floor() {
        cols.extend(COPY_HEADER);
    }
    if b.csv {
        cols.join(",")
    } else {
        cols.iter().map(|c| format!("{c:>14}")).collect::<Vec<_>>().join("")
    }
}

/// One row of `b` as CSV or a table line (`of_copy`: the copy floor's time over the row's).
pub fn format_row(r: &Row, b: &CollBench) -> String {
    let mut cells = vec![
        r.coll.clone(),
        r.bytes.to_string(),
        r.count.to_string(),
        r.dtype.name().to_string(),
        format!("{:.2}", r.time_us),
        format!("{:.3}", r.algbw_gbs()),
        format!("{:.3}", r.busbw_gbs()),
        r.wrong.to_string(),
    ];
    if b.vs_mpi {
        match r.mpi_time_us {
            Some(t) => {
                let busbw = r.algbw(t) * bus_factor(&r.coll, r.ranks);
                cells.extend([format!("{t:.2}"), format!("{busbw:.3}"), format!("{:.2}", t / r.time_us)]);
            }
            None => cells.extend(["".to_string(), "".to_string(), "".to_string()]),
        }
    }
    if let Some(net) = r.net {
        let min = net.min.map_or(String::new(), |m| format!("{m:.0}"));
        cells.extend([format!("{:.0}", net.mean), format!("{:.0}", net.max), min]);
    }
    if b.has_copy_floor() {
        match r.copy_us {
            Some(t) => cells.extend([format!("{t:.2}"), format!("{:.2}", t / r.time_us)]),
            None => cells.extend([String::new(), String::new()]),
        }
    }
    if b.csv {
        cells.join(",")
    } else {
        cells.iter().fold(String::new(), |mut s, c| {
            let _ = write!(s, "{c:>14}");
            s
        })
    }
}

/// Element types the benchmark can run, with their MPI equivalent where MPI has one.
pub trait BenchElement: Element {
    /// Times `iters` calls of MPI's version of `coll` (None: MPI has no such type or operator).
    fn mpi_time(mpi: &mpi::topology::SimpleCommunicator, coll: &str, op: ReduceOp, n: usize, rounds: Rounds) -> Option<f64>;
}

fn mpi_op(op: ReduceOp) -> Option<SystemOperation> {
    match op {
        ReduceOp::Sum => Some(SystemOperation::sum()),
        ReduceOp::Prod => Some(SystemOperation::product()),
        ReduceOp::Min => Some(SystemOperation::min()),
        ReduceOp::Max => Some(SystemOperation::max()),
        ReduceOp::Avg => None,
    }
}

/// Untimed and timed calls per size: the same for meshtrain's collectives, MPI's inside this
/// binary and the standalone program (benches/mpi_coll.c).
#[derive(Debug, Clone, Copy)]
pub struct Rounds {
    /// Untimed calls.
    pub warmup: usize,
    /// Timed calls (at least 1).
    pub iters: usize,
}

fn mpi_time_of<T: Element + mpi::datatype::Equivalence>(
    mpi: &mpi::topology::SimpleCommunicator,
    coll: &str,
    op: ReduceOp,
    n: usize,
    rounds: Rounds,
) -> Option<f64> {
    use mpi::traits::Communicator as _;
    let k = mpi.size() as usize;
    let input: Vec<T> = (0..n).map(|i| exact_input(op, mpi.rank() as usize, i)).collect();
    // Written element by element so that every page is touched before the warm-up, as the
    // standalone program's buffers are (a zeroed allocation would fault pages during it).
    let mut out: Vec<T> = Vec::with_capacity(n);
    out.extend((0..n).map(|_| std::hint::black_box(T::from_i64(0))));
    let block = n / k;
    let sop = mpi_op(op);
    let root = mpi.process_at_rank(0);
    let one = |out: &mut Vec<T>| -> Option<()> {
        match coll {
            "all_reduce" => mpi.all_reduce_into(&input[..], &mut out[..], sop?),
            "all_gather" => mpi.all_gather_into(&input[..block], &mut out[..]),
            "reduce_scatter" => mpi.reduce_scatter_block_into(&input[..], &mut out[..block], sop?),
            "all_to_all" => mpi.all_to_all_into(&input[..], &mut out[..]),
            "broadcast" => root.broadcast_into(&mut out[..]),
            "reduce" if mpi.rank() == 0 => root.reduce_into_root(&input[..], &mut out[..], sop?),
            "reduce" => root.reduce_into(&input[..], sop?),
            _ => return None,
        }
        Some(())
    };
    for _ in 0..rounds.warmup {
        one(&mut out)?;
    }
    mpi.barrier();
    let t0 = Instant::now();
    for _ in 0..rounds.iters {
        one(&mut out)?;
    }
    Some(t0.elapsed().as_secs_f64() * 1e6 / rounds.iters as f64)
}

macro_rules! bench_element {
    (mpi: $($t:ty),*) => {$(
        impl BenchElement for $t {
            fn mpi_time(m: &mpi::topology::SimpleCommunicator, c: &str, op: ReduceOp, n: usize, r: Rounds) -> Option<f64> {
                mpi_time_of::<$t>(m, c, op, n, r)
            }
        }
    )*};
    (no_mpi: $($t:ty),*) => {$(
        impl BenchElement for $t {
            fn mpi_time(_: &mpi::topology::SimpleCommunicator, _: &str, _: ReduceOp, _: usize, _: Rounds) -> Option<f64> {
                None
            }
        }
    )*};
}
bench_element!(mpi: f32, f64, i32, i64, u8);
bench_element!(no_mpi: bf16, f16);

/// Buffers of one collective call and the function that runs it.
struct Case<T> {
    input: Vec<T>,
    out: Vec<T>,
}

/// Element `i` of the buffer that all-gather and broadcast should leave on every rank.
fn owner_value<T: Element>(i: usize) -> T {
    exact_input(ReduceOp::Sum, 1 + i % 3, i)
}

/// Exact inputs (and an output buffer) for one call of `coll` on this rank.
fn build<T: Element>(c: &Communicator, coll: &str, op: ReduceOp, n: usize, inplace: bool) -> Case<T> {
    let (k, me) = (c.size(), c.rank());
    let filler = T::from_i64(0);
    match coll {
        "all_reduce" | "reduce" | "reduce_scatter" => {
            let input: Vec<T> = (0..n).map(|i| exact_input(op, me, i)).collect();
            let out_len = if coll == "reduce_scatter" { block_range(n, k, me).len() } else { n };
            Case { out: if inplace { input.clone() } else { vec![filler; out_len] }, input }
        }
        "all_gather" => {
            let mine = block_range(n, k, me);
            let input: Vec<T> = mine.clone().map(owner_value).collect();
            let mut out = vec![filler; n];
            if inplace {
                out[mine.clone()].copy_from_slice(&input);
            }
            Case { input, out }
        }
        "all_to_all" => {
            let input: Vec<T> = (0..n).map(|i| exact_input(ReduceOp::Sum, me, i)).collect();
            Case { input, out: vec![filler; block_range(n, k, me).len() * k] }
        }
        _ => {
            let out = if me == 0 { (0..n).map(owner_value).collect() } else { vec![filler; n] };
            Case { input: Vec::new(), out }
        }
    }
}

fn run_once<T: Element>(c: &Communicator, coll: &str, op: ReduceOp, inplace: bool, case: &mut Case<T>) -> Result<()> {
    let Case { input, out } = case;
    match (coll, inplace) {
        ("all_reduce", false) => c.all_reduce_into(input, out, op),
        ("all_reduce", true) => c.all_reduce(out, op),
        ("reduce_scatter", false) => c.reduce_scatter_into(input, out, op),
        ("reduce_scatter", true) => c.reduce_scatter(out, op),
        ("all_gather", false) => c.all_gather_into(input, out),
        ("all_gather", true) => c.all_gather(out),
        ("all_to_all", _) => c.all_to_all_into(input, out),
        ("broadcast", _) => c.broadcast(out, 0),
        ("reduce", false) => c.reduce_into(input, out, op, 0),
        ("reduce", true) => c.reduce(out, op, 0),
        _ => Err(Error::InvalidArgument(format!("unknown collective `{coll}` (known: {})", COLLECTIVES.join(", ")))),
    }
}

/// Elements of this rank's result that differ from the exact expectation.
fn count_wrong<T: Element>(c: &Communicator, coll: &str, op: ReduceOp, n: usize, inplace: bool, case: &Case<T>) -> u64 {
    let (k, me) = (c.size(), c.rank());
    let eq = |a: &T, b: &T| bytemuck::bytes_of(a) == bytemuck::bytes_of(b);
    let wrong = |got: &[T], want: &mut dyn Iterator<Item = T>| got.iter().zip(want).filter(|(g, w)| !eq(g, w)).count();
    let out = &case.out;
    let n_wrong = match coll {
        "all_reduce" => wrong(out, &mut (0..n).map(|i| exact_result(op, k, i))),
        "reduce" if me == 0 => wrong(out, &mut (0..n).map(|i| exact_result(op, k, i))),
        "reduce" => 0,
        "reduce_scatter" => {
            let mine = block_range(n, k, me);
            let got = if inplace { &out[mine.clone()] } else { &out[..] };
            wrong(got, &mut mine.map(|i| exact_result(op, k, i)))
        }
        "all_gather" | "broadcast" => wrong(out, &mut (0..n).map(owner_value)),
        "all_to_all" => {
            let mine = block_range(n, k, me);
            wrong(out, &mut (0..k).flat_map(|s| mine.clone().map(move |i| exact_input(ReduceOp::Sum, s, i))))
        }
        _ => 0,
    };
    n_wrong as u64
}

/// Microseconds per call of `coll` on `n` elements under the benchmark's rule (warm-up, barrier,
/// timed calls, the slowest rank's average); the same on every rank.
pub fn time_calls<T: Element>(c: &Communicator, b: &CollBench, coll: &str, n: usize) -> Result<f64> {
    time_and_count::<T>(c, b, coll, n).map(|(us, _)| us)
}

/// [`time_calls`] and the bytes per timed call this rank sent to other nodes.
fn time_and_count<T: Element>(c: &Communicator, b: &CollBench, coll: &str, n: usize) -> Result<(f64, f64)> {
    let mut case = build::<T>(c, coll, b.op, n, b.inplace);
    timed(c, b.rounds_for(n * T::DTYPE.size()), || run_once(c, coll, b.op, b.inplace, &mut case))
}

/// The benchmark's rule around `call`: untimed calls, a barrier, timed calls; the slowest rank's
/// microseconds per call (the same on every rank) and the bytes per timed call this rank sent to
/// other nodes (counted from after the barrier).
fn timed(c: &Communicator, rounds: Rounds, mut call: impl FnMut() -> Result<()>) -> Result<(f64, f64)> {
    for _ in 0..rounds.warmup {
        call()?;
    }
    c.barrier()?;
    let (t0, sent) = (Instant::now(), c.net_bytes_sent());
    for _ in 0..rounds.iters {
        call()?;
    }
    let per_call = (c.net_bytes_sent() - sent) as f64 / rounds.iters as f64;
    let mut time = [t0.elapsed().as_secs_f64() * 1e6 / rounds.iters as f64];
    c.all_reduce(&mut time, ReduceOp::Max)?;
    Ok((time[0], per_call))
}

/// The copy floor of `coll` on `n` elements of `esize` bytes (see the module header): every rank
/// copies the bytes the collective brings it, all at once, under the benchmark's rule; the slowest
/// rank's microseconds per copy. `None` for collectives that reduce, and on one rank.
fn copy_floor_us(c: &Communicator, b: &CollBench, coll: &str, n: usize, esize: usize) -> Result<Option<f64>> {
    let Some(elems) = copy_floor_elems(coll, c.size(), c.rank(), n, b.inplace) else { return Ok(None) };
    if c.size() < 2 {
        return Ok(None);
    }
    // Both buffers written before timing, as the collective's are.
    let src: Vec<u8> = (0..elems * esize).map(|i| (i % 251) as u8).collect();
    let mut dst: Vec<u8> = (0..elems * esize).map(|i| (i % 13) as u8).collect();
    let (us, _) = timed(c, b.rounds_for(n * esize), || {
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
        Ok(())
    })?;
    Ok(Some(us))
}

/// Mean and largest bytes per call sent between nodes, over ranks, and the minimum.
fn net_bytes(c: &Communicator, coll: &str, bytes: usize, mine: f64) -> Result<Option<NetBytes>> {
    if c.link_kind() != crate::comm::tuner::LinkKind::Net {
        return Ok(None);
    }
    let (mut sum, mut max) = ([mine], [mine]);
    c.all_reduce(&mut sum, ReduceOp::Sum)?;
    c.all_reduce(&mut max, ReduceOp::Max)?;
    let min = match c.node_map().uniform() {
        Ok((n, l)) => Some(net_minimum(coll, bytes, n, l)),
        Err(_) if coll != "all_to_all" => Some(net_minimum_uneven(coll, bytes, c.node_map().nodes(), c.size())),
        Err(_) => None,
    };
    Ok(Some(NetBytes { mean: sum[0] / c.size() as f64, max: max[0], min }))
}

/// Runs one size of one collective; every rank returns the same row.
fn bench_size<T: BenchElement>(
    c: &Communicator,
    mpi: Option<&mpi::topology::SimpleCommunicator>,
    b: &CollBench,
    coll: &str,
    n: usize,
) -> Result<Row> {
    let (us, sent) = time_and_count::<T>(c, b, coll, n)?;
    let (time, net) = ([us], net_bytes(c, coll, n * T::DTYPE.size(), sent)?);

    let mut check = build::<T>(c, coll, b.op, n, b.inplace);
    run_once(c, coll, b.op, b.inplace, &mut check)?;
    let mut wrong = [count_wrong(c, coll, b.op, n, b.inplace, &check) as i64];
    c.all_reduce(&mut wrong, ReduceOp::Sum)?;

    let mpi_time_us = match mpi {
        Some(m) => {
            let t = T::mpi_time(m, coll, b.op, n, b.rounds_for(n * T::DTYPE.size()));
            let mut t = [t.unwrap_or(f64::NAN)];
            c.all_reduce(&mut t, ReduceOp::Max)?;
            Some(t[0]).filter(|t| t.is_finite())
        }
        None => None,
    };
    let copy_us = copy_floor_us(c, b, coll, n, T::DTYPE.size())?;
    Ok(Row { coll: coll.to_string(), bytes: n * T::DTYPE.size(), count: n, dtype: T::DTYPE, time_us: time[0], wrong: wrong[0] as u64, mpi_time_us, ranks: c.size(), net, copy_us })
}

/// Element counts of the size sweep: each size rounded down to whole elements and to a multiple
/// of the world size (at least one element per rank).
pub fn counts(b: &CollBench, ranks: usize) -> Vec<usize> {
    let mut out = Vec::new();
    let mut bytes = b.min_bytes.max(1);
    while bytes <= b.max_bytes {
        let n = if b.exact_count { (bytes / b.dtype.size()).max(1) } else { (bytes / b.dtype.size() / ranks).max(1) * ranks };
        if out.last() != Some(&n) {
            out.push(n);
        }
        bytes = bytes.saturating_mul(b.factor.max(2));
    }
    out
}

/// Runs the sweep; `emit` receives each row as it completes (every rank gets every row).
pub fn run(
    c: &Communicator,
    mpi: Option<&mpi::topology::SimpleCommunicator>,
    b: &CollBench,
    mut emit: impl FnMut(&Row),
) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    for coll in &b.colls {
        if !COLLECTIVES.contains(&coll.as_str()) {
            return Err(Error::InvalidArgument(format!("unknown collective `{coll}` (known: {}, all)", COLLECTIVES.join(", "))));
        }
        for n in counts(b, c.size()) {
            let row = match b.dtype {
                DType::F32 => bench_size::<f32>(c, mpi, b, coll, n)?,
                DType::F64 => bench_size::<f64>(c, mpi, b, coll, n)?,
                DType::BF16 => bench_size::<bf16>(c, mpi, b, coll, n)?,
                DType::F16 => bench_size::<f16>(c, mpi, b, coll, n)?,
                DType::I32 => bench_size::<i32>(c, mpi, b, coll, n)?,
                DType::I64 => bench_size::<i64>(c, mpi, b, coll, n)?,
                DType::U8 => bench_size::<u8>(c, mpi, b, coll, n)?,
            };
            emit(&row);
            rows.push(row);
        }
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_factors_match_nccl_tests() {
        assert_eq!(bus_factor("all_reduce", 4), 1.5);
        assert_eq!(bus_factor("all_gather", 4), 0.75);
        assert_eq!(bus_factor("broadcast", 4), 1.0);
    }

    #[test]
    fn every_benchmarked_result_is_checked_and_right() {
        use crate::comm::testing::run_ranks;
        use crate::comm::CommConfig;
        let rows = run_ranks(3, CommConfig { chunk_bytes: 256, small_bytes: 1024, ..CommConfig::default() }, |c| {
            let b = CollBench {
                colls: COLLECTIVES.iter().map(|s| s.to_string()).collect(),
                min_bytes: 64,
                max_bytes: 8192,
                factor: 4,
                dtype: DType::BF16,
                op: ReduceOp::Avg,
                warmup: 1,
                iters: 2,
                iter_bytes: 0,
                inplace: c.size() == 3,
                vs_mpi: false,
                csv: true,
                exact_count: false,
            };
            run(&c, None, &b, |_| {}).unwrap()
        });
        assert_eq!(rows[0].len(), 6 * 4);
        assert!(rows.iter().flatten().all(|r| r.wrong == 0 && r.count % 3 == 0 && r.net.is_none()));
        // The copy floor: measured for the collectives that only move data, not for reductions.
        for r in rows.iter().flatten() {
            let moves = matches!(r.coll.as_str(), "all_gather" | "broadcast" | "all_to_all");
            assert_eq!(r.copy_us.is_some(), moves, "{}", r.coll);
            assert!(r.copy_us.is_none_or(|t| t.is_finite() && t >= 0.0));
        }
    }

    #[test]
    fn exact_counts_keep_uneven_blocks_and_check_right() {
        let b = CollBench { min_bytes: 4096, max_bytes: 16384, exact_count: true, ..sweep(&["all_gather"], 20, 0) };
        assert_eq!(counts(&b, 3), vec![1024, 4096]);
        assert_eq!(counts(&CollBench { exact_count: false, ..b }, 3), vec![1023, 4095]);
        use crate::comm::testing::run_ranks;
        use crate::comm::CommConfig;
        let rows = run_ranks(3, CommConfig { chunk_bytes: 256, small_bytes: 1024, ..CommConfig::default() }, |c| {
            let all: Vec<&str> = COLLECTIVES.to_vec();
            let b = CollBench { min_bytes: 28, max_bytes: 7000, factor: 5, vs_mpi: false, exact_count: true, warmup: 1, iters: 2, ..sweep(&all, 2, 0) };
            run(&c, None, &b, |_| {}).unwrap()
        });
        assert!(rows[0].iter().any(|r| r.count % 3 != 0), "uneven counts timed");
        assert!(rows.iter().flatten().all(|r| r.wrong == 0), "{:?}", rows[0]);
    }

    fn sweep(colls: &[&str], iters: usize, iter_bytes: usize) -> CollBench {
        CollBench {
            colls: colls.iter().map(|s| s.to_string()).collect(),
            min_bytes: 4096,
            max_bytes: 1 << 26,
            factor: 4,
            dtype: DType::F32,
            op: ReduceOp::Sum,
            warmup: 5,
            iters,
            iter_bytes,
            inplace: false,
            vs_mpi: true,
            csv: true,
            exact_count: false,
        }
    }

    #[test]
    fn small_sizes_get_more_calls_up_to_the_cap() {
        let b = sweep(&["all_reduce"], 20, 256 << 20);
        let r = |bytes| b.rounds_for(bytes);
        assert_eq!((r(4096).warmup, r(4096).iters), (100, MAX_ITERS));
        assert_eq!((r(1 << 20).warmup, r(1 << 20).iters), (25, 256));
        assert_eq!((r(16 << 20).warmup, r(16 << 20).iters), (5, 20));
        assert_eq!((r(1 << 30).warmup, r(1 << 30).iters), (5, 20));
        // --iters stays the minimum; 0 bytes means exactly --iters.
        assert_eq!(sweep(&["all_reduce"], 500, 256 << 20).rounds_for(64 << 20).iters, 500);
        let fixed = sweep(&["all_reduce"], 7, 0);
        assert_eq!((fixed.rounds_for(4096).warmup, fixed.rounds_for(4096).iters), (5, 7));
    }

    #[test]
    fn copy_floor_columns_come_last_and_only_with_data_moving_collectives() {
        assert_eq!(copy_floor_elems("all_gather", 3, 1, 10, true), Some(7));
        assert_eq!(copy_floor_elems("all_gather", 3, 1, 10, false), Some(10));
        assert_eq!(copy_floor_elems("all_to_all", 4, 0, 8, false), Some(8));
        assert_eq!(copy_floor_elems("broadcast", 3, 0, 10, false), Some(0));
        assert_eq!(copy_floor_elems("broadcast", 3, 2, 10, true), Some(10));
        assert_eq!(copy_floor_elems("reduce", 3, 2, 10, false), None);
        let reductions = sweep(&["all_reduce", "reduce"], 20, 0);
        assert!(!reductions.has_copy_floor() && !header(&reductions, false).contains("copy_us"));
        let b = sweep(&["all_reduce", "all_gather"], 20, 0);
        assert!(header(&b, true).ends_with("net_B_min,copy_us,of_copy"));
        let row = |coll: &str, copy_us| Row {
            coll: coll.into(),
            bytes: 4096,
            count: 1024,
            dtype: DType::F32,
            time_us: 4.0,
            wrong: 0,
            mpi_time_us: Some(6.0),
            ranks: 2,
            net: None,
            copy_us,
        };
        let cells = |line: String| line.split(',').count();
        let h = cells(header(&b, false));
        assert_eq!(cells(format_row(&row("all_reduce", None), &b)), h);
        let line = format_row(&row("all_gather", Some(3.0)), &b);
        assert_eq!(cells(line.clone()), h);
        assert!(line.ends_with(",6.00,0.341,1.50,3.00,0.75"), "{line}");
    }

    #[test]
    fn rows_across_nodes_report_the_bytes_between_nodes_against_the_minimum() {
        use crate::comm::fingerprint::PRINT_LEN;
        use crate::comm::testing::run_ranks_placed;
        use crate::comm::CommConfig;
        assert_eq!(net_minimum("all_reduce", 1200, 3, 2), 800.0);
        assert_eq!(net_minimum("broadcast", 1200, 2, 4), 150.0);
        assert_eq!(net_minimum("all_to_all", 1200, 2, 2), 600.0);
        // Uneven (3+2+1 ranks on 3 nodes): 2(n-1) buffers cross for an all-reduce, n-1 otherwise;
        // on an even layout the same as the per-node formula.
        assert_eq!(net_minimum_uneven("all_reduce", 1200, 3, 6), 800.0);
        assert_eq!(net_minimum_uneven("reduce_scatter", 1200, 3, 6), 400.0);
        assert_eq!(net_minimum_uneven("broadcast", 1200, 2, 8), net_minimum("broadcast", 1200, 2, 4));
        for hier in [true, false] {
            let cfg = CommConfig { hier, tuning: None, small_bytes: 0, ..CommConfig::default() };
            let (bytes, all_reduce) = (1 << 16, sweep(&["all_reduce"], 3, 0));
            let b = CollBench { min_bytes: bytes, max_bytes: bytes, warmup: 1, inplace: true, vs_mpi: false, ..all_reduce };
            let rows = run_ranks_placed(vec![0, 1, 0, 1], cfg, { let b = b.clone(); move |c| run(&c, None, &b, |_| {}).unwrap() });
            let net = rows[0][0].net.expect("the members span two nodes");
            // 2 nodes x 2 ranks, 64 KiB: the minimum is 32 KiB per rank; in stages every rank sends
            // exactly that (and one fingerprint per call); the flat ring sends 2(k-1)/k = 96 KiB
            // from each of the two ranks at the ends of the nodes, nothing from the others.
            assert_eq!(net.min, Some(32768.0));
            let print = PRINT_LEN as f64;
            if hier {
                assert_eq!((net.mean, net.max), (32768.0 + print, 32768.0 + print));
            } else {
                assert_eq!((net.mean, net.max), ((98304.0 + print) / 2.0, 98304.0 + print));
            }
            let line = format_row(&rows[0][0], &b);
            assert!(line.ends_with(&format!(",{:.0},{:.0},32768", net.mean, net.max)), "{line}");
        }
    }
}
