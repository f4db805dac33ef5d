//! `meshtrain bench checkpoint`: save and load bandwidth per rank against a plain sequential write
//! and read (fsynced, page cache dropped) of the same bytes on the same filesystem, and the bytes a
//! resharding load reads against the bytes it needs.
//!
//! The checkpoint is synthetic: `n_params` parameters in (rows, 1024) tensors, saved as model, m
//! and v, each rank owning its `block_range` of the flat buffers (the ZeRO layout). The resharding
//! load reads, on rank r, row block r+1 (of `size` blocks) of every 2-D model tensor, right half
//! of the columns only (as a row-parallel tensor split would), so no read is a whole shard and
//! every row is read in part. Bytes read are
//! the process's `rchar` from `/proc/self/io`: run one rank per process. Targets: save at least
//! half the sequential bandwidth; resharding reads at most 1.1x the needed bytes.

use std::fmt;
use std::io::{Read, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::checkpoint::boxes::{flat_range_slices, load_flat_range, ShardSlice};
use crate::checkpoint::index::open;
use crate::checkpoint::meta::{CkptMeta, OptimizerMeta};
use crate::checkpoint::save::save;
use crate::checkpoint::{rank_file_name, step_dir_name};
use crate::comm::{block_range, Communicator, ReduceOp};
use crate::error::{Error, Result};
use crate::model::{GptConfig, ParamEntry, TpSplit};
use crate::optim::AdamWConfig;

/// Columns of the synthetic tensors.
const WIDTH: usize = 1024;
/// Rows per synthetic tensor (16 MiB of f32).
const MAX_ROWS: usize = 4096;
/// Chunk of the sequential baseline's writes and reads.
const CHUNK: usize = 4 << 20;

/// Bandwidths are the minimum over ranks, in GB/s (1e9 bytes per second).
#[derive(Debug, Clone, serde::Serialize)]
pub struct CkptBenchReport {
    /// Ranks taking part.
    pub ranks: usize,
    /// Checkpoint bytes this rank wrote (model + m + v).
    pub bytes_per_rank: u64,
    /// Plain sequential write + fsync.
    pub seq_write_gbps: f64,
    /// `save`, including hashing, the index, fsyncs and renames.
    pub save_gbps: f64,
    /// Plain sequential read of the baseline file, page cache dropped.
    pub seq_read_gbps: f64,
    /// Loading the rank's own slices back (hash-checked), page cache dropped.
    pub load_gbps: f64,
    /// Bytes the resharding load needs on this rank.
    pub reshard_needed_bytes: u64,
    /// Bytes the process read during the resharding load (`rchar`).
    pub reshard_read_bytes: u64,
}

impl CkptBenchReport {
    /// Save bandwidth over sequential write bandwidth (target >= 0.5).
    pub fn save_ratio(&self) -> f64 {
        self.save_gbps / self.seq_write_gbps
    }

    /// Bytes read over bytes needed by the resharding load (target <= 1.1).
    pub fn reshard_ratio(&self) -> f64 {
        self.reshard_read_bytes as f64 / self.reshard_needed_bytes as f64
    }
}

impl fmt::Display for CkptBenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "checkpoint bench: {} ranks, {} bytes per rank",
            self.ranks, self.bytes_per_rank
        )?;
        writeln!(
            f,
            "  sequential write+fsync {:8.3} GB/s per rank",
            self.seq_write_gbps
        )?;
        writeln!(
            f,
            "  save                   {:8.3} GB/s per rank  ({:.0}% of sequential, target >= 50%)",
            self.save_gbps,
            100.0 * self.save_ratio()
        )?;
        writeln!(
            f,
            "  sequential read (cold) {:8.3} GB/s per rank",
            self.seq_read_gbps
        )?;
        writeln!(f, "  load (cold, verified)  {:8.3} GB/s per rank", self.load_gbps)?;
        writeln!(
            f,
            "  resharding load read {} bytes for {} needed: {:.3}x (target <= 1.1x)",
            self.reshard_read_bytes,
            self.reshard_needed_bytes,
            self.reshard_ratio()
        )
    }
}

/// The synthetic layout: (rows, WIDTH) tensors of at most MAX_ROWS rows, then one 1-D remainder.
fn synthetic_entries(n: usize) -> Vec<ParamEntry> {
    let mut entries = Vec::new();
    let mut offset = 0;
    let mut push = |shape: Vec<usize>| {
        let len = shape.iter().product();
        let name = format!("t{}", entries.len());
        entries.push(ParamEntry {
            name,
            shape,
            offset,
            len,
            layer: None,
            decay: false,
            tp_split: TpSplit::Row,
        });
        offset += len;
    };
    let mut rows = n / WIDTH;
    while rows > 0 {
        let r = rows.min(MAX_ROWS);
        push(vec![r, WIDTH]);
        rows -= r;
    }
    if n % WIDTH != 0 {
        push(vec![n % WIDTH]);
    }
    entries
}

fn rchar() -> Result<u64> {
    let text = std::fs::read_to_string("/proc/self/io").map_err(|e| Error::io("read /proc/self/io", e))?;
    text.lines()
        .find_map(|l| l.strip_prefix("rchar:"))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| Error::file("/proc/self/io", None, "no rchar line"))
}

/// Drops `path`'s clean pages from the page cache, so the next read comes from the device.
fn drop_cache(path: &Path) -> Result<()> {
    let f = std::fs::File::open(path).map_err(|e| Error::io(format!("open {}", path.display()), e))?;
    use std::os::fd::AsRawFd;
    // SAFETY: a valid open descriptor; posix_fadvise only reads its arguments.
    let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    if rc != 0 {
        return Err(Error::io(
            format!("posix_fadvise {}", path.display()),
            std::io::Error::from_raw_os_error(rc),
        ));
    }
    Ok(())
}

fn sequential_write(path: &Path, bytes: &[u8]) -> Result<()> {
    let io = |e| Error::io(format!("write {}", path.display()), e);
    let mut f = std::fs::File::create(path).map_err(io)?;
    for c in bytes.chunks(CHUNK) {
        f.write_all(c).map_err(io)?;
    }
    f.sync_all().map_err(io)
}

fn sequential_read(path: &Path, len: usize) -> Result<()> {
    let io = |e| Error::io(format!("read {}", path.display()), e);
    let mut f = std::fs::File::open(path).map_err(io)?;
    let mut buf = vec![0u8; CHUNK];
    let mut left = len;
    while left > 0 {
        let n = f.read(&mut buf[..left.min(CHUNK)]).map_err(io)?;
        if n == 0 {
            return Err(Error::file(path, Some((len - left) as u64), "short read"));
        }
        left -= n;
    }
    Ok(())
}

/// Minimum of `x` over the ranks.
fn min_over(comm: &Communicator, x: f64) -> Result<f64> {
    let mut v = [x];
    comm.all_reduce(&mut v, ReduceOp::Min)?;
    Ok(v[0])
}

/// Runs the benchmark in `dir` (created, and emptied of its own files afterwards) on every rank of
/// `comm`, for a model of `n_params` parameters.
pub fn bench_checkpoint(comm: &Communicator, dir: &Path, n_params: usize) -> Result<CkptBenchReport> {
    let k = comm.size();
    if n_params < WIDTH * k {
        return Err(Error::InvalidArgument(format!(
            "bench checkpoint: need at least {} parameters",
            WIDTH * k
        )));
    }
    std::fs::create_dir_all(dir).map_err(|e| Error::io(format!("create {}", dir.display()), e))?;
    let data = BenchData::new(comm.rank(), k, n_params);
    let seq = dir.join(format!("seq_{}.bin", rank_file_name(comm.rank())));
    let root = dir.join("ckpt");
    let rates = save_and_load(comm, &data, &seq, &root)?;
    let (needed, read) = reshard_read(comm, &data.entries, &rates.ckpt)?;

    comm.barrier()?;
    let _ = std::fs::remove_file(&seq);
    if comm.rank() == 0 {
        let _ = std::fs::remove_dir_all(&root);
    }
    Ok(CkptBenchReport {
        ranks: k,
        bytes_per_rank: data.bytes as u64,
        seq_write_gbps: min_over(comm, rates.seq_write)? / 1e9,
        save_gbps: min_over(comm, rates.save)? / 1e9,
        seq_read_gbps: min_over(comm, rates.seq_read)? / 1e9,
        load_gbps: min_over(comm, rates.load)? / 1e9,
        reshard_needed_bytes: needed,
        reshard_read_bytes: read,
    })
}

/// One rank's share of the synthetic checkpoint: parameters and both AdamW moments.
struct BenchData {
    entries: Vec<ParamEntry>,
    /// This rank's flat range.
    mine: Range<usize>,
    /// (mine.len) each: `model`, `optim/m`, `optim/v`.
    bufs: Vec<Vec<f32>>,
    /// Bytes of `bufs`.
    bytes: usize,
}

/// The tensors' prefixes in the checkpoint, in `BenchData::bufs` order.
const PREFIXES: [&str; 3] = ["model", "optim/m", "optim/v"];

impl BenchData {
    fn new(rank: usize, k: usize, n_params: usize) -> Self {
        let entries = synthetic_entries(n_params);
        let mine = block_range(n_params, k, rank);
        let bufs: Vec<Vec<f32>> =
            (0..3).map(|b| mine.clone().map(|i| ((i * 7 + b * 13) % 1009) as f32 * 1e-3 - 0.5).collect()).collect();
        let bytes = 3 * 4 * mine.len();
        BenchData { entries, mine, bufs, bytes }
    }

    /// The checkpoint slices of `bufs`.
    fn slices(&self) -> Result<Vec<ShardSlice<'_>>> {
        let mut slices = Vec::new();
        for (prefix, buf) in PREFIXES.iter().zip(&self.bufs) {
            slices.extend(flat_range_slices(prefix, &self.entries, buf, self.mine.start, self.mine.clone())?);
        }
        Ok(slices)
    }
}

/// Bytes per second of the plain file and the checkpoint, each written and read back once.
struct Rates {
    seq_write: f64,
    save: f64,
    seq_read: f64,
    load: f64,
    /// The checkpoint written.
    ckpt: PathBuf,
}

/// Writes the rank's bytes as one plain file `seq` (the baseline) and as a checkpoint under
/// `root`, then reads both back from a cold cache, checking the checkpoint's values.
fn save_and_load(comm: &Communicator, data: &BenchData, seq: &Path, root: &Path) -> Result<Rates> {
    let (rank, bytes) = (comm.rank(), data.bytes as f64);
    let raw: Vec<u8> = data.bufs.iter().flat_map(|b| bytemuck::cast_slice::<f32, u8>(b).iter().copied()).collect();
    comm.barrier()?;
    let t = Instant::now();
    sequential_write(seq, &raw)?;
    let seq_write = bytes / t.elapsed().as_secs_f64();
    drop(raw);

    let _ = std::fs::remove_dir_all(root.join(step_dir_name(1)));
    let config = GptConfig { n_layer: 0, n_head: 1, n_embd: WIDTH, vocab_size: 1, max_seq_len: 1, llama: None };
    let meta = CkptMeta::new(1, 0, config, OptimizerMeta { adamw: AdamWConfig::default(), steps_taken: 1 });
    comm.barrier()?;
    let t = Instant::now();
    let ckpt = save(comm, root, 1, &data.slices()?, &meta, 1)?;
    let save = bytes / t.elapsed().as_secs_f64();

    drop_cache(seq)?;
    let t = Instant::now();
    sequential_read(seq, data.bytes)?;
    let seq_read = bytes / t.elapsed().as_secs_f64();

    let index = open(&ckpt)?;
    drop_cache(&ckpt.join(rank_file_name(rank)))?;
    comm.barrier()?;
    let t = Instant::now();
    let mut back = vec![0f32; data.mine.len()];
    for (prefix, buf) in PREFIXES.iter().zip(&data.bufs) {
        load_flat_range(&index, prefix, &data.entries, data.mine.clone(), &mut back)?;
        if &back != buf {
            return Err(Error::Check(format!("bench checkpoint: rank {rank} read back different {prefix} values")));
        }
    }
    let load = bytes / t.elapsed().as_secs_f64();
    Ok(Rates { seq_write, save, seq_read, load, ckpt })
}

/// Resharding: reads row block `rank + 1` of every 2-D model tensor, right column half, from a
/// cold cache; returns the bytes needed and the bytes the process read.
fn reshard_read(comm: &Communicator, entries: &[ParamEntry], ckpt: &Path) -> Result<(u64, u64)> {
    let (k, next) = (comm.size(), (comm.rank() + 1) % comm.size());
    let index = open(ckpt)?;
    for r in 0..k {
        drop_cache(&ckpt.join(rank_file_name(r)))?;
    }
    comm.barrier()?;
    let before = rchar()?;
    let mut needed = 0u64;
    for e in entries.iter().filter(|e| e.shape.len() == 2) {
        let rows = block_range(e.shape[0], k, next);
        if rows.is_empty() {
            continue;
        }
        let mut out = vec![0f32; rows.len() * WIDTH / 2];
        index.load_slice(&format!("model/{}", e.name), &[rows.start, WIDTH / 2], &[rows.len(), WIDTH / 2], &mut out)?;
        needed += 4 * out.len() as u64;
    }
    Ok((needed, rchar()? - before))
}
