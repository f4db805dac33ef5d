//! Parameter-server data parallelism (`parallel.dp_sync = "ps"`): the tp x pp x dp workers run
//! the model; `ps.servers` extra ranks (the last ones), or with `ps.colocate = true` a server
//! thread in every worker process (BytePS' summation service: no extra ranks, one server per
//! worker), hold the parameters and the AdamW state. Each step a worker pushes its gradients,
//! piece by piece as the backward finishes them (the readiness order of the all-reduce buckets),
//! to the servers that own the pieces; the servers sum the workers' pieces, clip by the global
//! norm (reduced among the servers), run AdamW on their pieces and send every worker the new
//! parameters ([`server`], [`client`], the links of either placement in [`link`]).
//!
//! Model shards: under TP and PP every (tp, pp) shard has its own flat buffer, cut into its own
//! pieces; the owners are chosen over all shards' pieces together, so the servers' shares stay
//! balanced, and a worker talks only about its own shard's pieces (the servers sum a piece over
//! the dp workers of its shard). The norm is the whole model's: each shard's counted spans (the
//! model's norm spans: a TP-replicated tensor is counted on one rank only) in piece order, then
//! the shards' sums over tp and then over pp, as the all-reduce step adds its partial norms
//! ([`whole_model_squares`]); the workers do not sum it again.
//!
//! Devices: the gradients reach the push as host slices: the CPU arm's without a copy, a device
//! arm's (emu, CUDA, HIP: one code path) copied device -> host entry by entry as the backward
//! hands each unit over; the pulled parameters are copied host -> device (and the 16-bit copies
//! refreshed) before the next step. A worker holds no optimizer state on its device (no AdamW
//! moments): the servers hold it.
//!
//! Pieces: the flat parameter buffer cut as the ZeRO-0 buckets are ([`super::buckets::plan_buckets`]),
//! with buckets of `min(parallel.bucket_mb, 4 MiB)`, each owned by one server: in readiness
//! order, a piece goes to the server with the fewest elements so far (the lowest index on a
//! tie), so the servers' shares differ by at most one piece.
//!
//! What is fixed-order, so that runs repeat bit for bit and match the all-reduce:
//! - a server sums a piece over the workers in worker order (0, 1, ..., dp - 1), then divides by
//!   dp once, as the all-reduce's average does; each worker first scales its gradients by
//!   1 / micro-batches in f32, as the bucket staging does;
//! - the squares of the norm are taken per (piece, counted span) with the optimizer's
//!   `sum_of_squares`, exchanged among the servers (each slot is one server's number, the others
//!   add zeros, which is exact) and added in piece order: the all-reduce step's order when the
//!   pieces are its buckets (`bucket_mb <= 4`);
//! - AdamW is the CPU arm's element expression, so where an element is updated does not matter.
//!
//! So with two workers a PS run gives the all-reduce run's bits (a sum of two terms does not
//! depend on the order), also under TP2 and PP2 (the shards' norms, too, are sums of two); with
//! more, the all-reduce's ring adds the workers in an order that rotates with the chunk, and the
//! two differ by float rounding (tests: within 1e-6 over 20 steps). On a device arm the
//! all-reduce run's norm and AdamW are device kernels (block sums, fused multiply-adds), the
//! servers' the CPU's expressions: within 1e-6, not bit for bit. Colocated servers add in the
//! same orders as as many server ranks: the same bits.
//!
//! Versions and staleness (`ps.mode`): version v is the parameters after the servers' v-th
//! update. A worker pushes the gradient of its step c tagged with the version it trained on and,
//! before its step c + 1, waits until it holds a version >= c - `staleness` (the newest the
//! servers have sent it, received by a thread of its own). The servers apply step c's update
//! once every worker's step-c gradient is in. `sync` is `staleness = 0`: every step trains on the
//! previous step's update, exactly the all-reduce's schedule. With staleness s the push, the
//! update and the pull of step c overlap the compute of up to s later steps; each step's
//! staleness (c - 1 - the version it trained on, at most s) is counted in a histogram
//! (`ps_staleness` in the metrics, and the `# done` line). The workers still agree on the loss
//! and a stop signal every step (the metrics), so a worker that is persistently slower holds the
//! others back; what staleness hides is the servers' round trip.
//!
//! Invariants: every message has a length both sides know in advance (headers of fixed size);
//! every worker sends every server the same sequence of message kinds, which the server checks;
//! each link communicator is used by one thread in each process (the worker's push thread, its
//! pull thread, its main thread for checkpoints, or the colocated server thread: [`link`]). A
//! worker's link rank is its grid rank, so a server knows every worker's shard from the config.
//! A server or worker that dies (colocated: the process with both) is named by the survivors
//! through the communicators' own deadline and peer checks.

mod client;
mod link;
mod server;

use std::ops::Range;

use super::buckets::plan_buckets;
use crate::comm::Communicator;
use crate::config::JobConfig;
use crate::error::{Error, Result};
use crate::parallel::grid::GridShape;
use crate::world::World;

pub(super) use client::PsClient;
use link::Link;
pub(super) use server::serve;

/// Largest piece: 4 MiB of f32.
pub const MAX_PIECE_ELEMS: usize = 1 << 20;

/// Worker -> server message kinds (the first word of a header).
const KIND_LOAD: i64 = 1;
const KIND_GRADS: i64 = 2;
const KIND_FETCH: i64 = 3;
const KIND_FINISH: i64 = 4;

/// Words of a worker's header: kind, step (clock), version trained on, flags.
const HEADER: usize = 4;
/// Words of a server's version header: kind (0 version, 1 finish), version, sum of squares,
/// applied (1) or skipped (0).
const VERSION_HEADER: usize = 4;

/// The pieces of a flat buffer and their servers.
#[derive(Debug, Clone, PartialEq)]
pub struct PiecePlan {
    /// Pieces, in readiness order (last elements first).
    pub pieces: Vec<Range<usize>>,
    /// Server (index among the servers) of each piece.
    pub owner: Vec<usize>,
}

impl PiecePlan {
    /// The plans of the (tp, pp) shards of `sizes[k]` elements: each shard's buffer is cut alone
    /// (its pieces are its buckets), and the owners are chosen over all shards' pieces, shard by
    /// shard in readiness order, each piece to the server with the fewest elements so far (the
    /// lowest index on a tie): the servers' shares differ by at most one piece.
    pub fn sharded(sizes: &[usize], piece_elems: usize, servers: usize) -> Vec<Self> {
        let mut load = vec![0usize; servers.max(1)];
        sizes
            .iter()
            .map(|&n| {
                let whole = 0..n;
                let pieces = plan_buckets(
                    std::slice::from_ref(&whole),
                    piece_elems.clamp(1, MAX_PIECE_ELEMS),
                );
                let owner = pieces
                    .iter()
                    .map(|p| {
                        let s = (0..load.len())
                            .min_by_key(|&s| (load[s], s))
                            .expect("at least one server");
                        load[s] += p.len();
                        s
                    })
                    .collect();
                PiecePlan { pieces, owner }
            })
            .collect()
    }

    /// The plans of `cfg` for shards of `sizes[k]` elements.
    pub fn of_job(cfg: &JobConfig, sizes: &[usize]) -> Vec<Self> {
        let bucket = ((cfg.parallel.bucket_mb * (1 << 20) as f64 / 4.0) as usize).max(1);
        PiecePlan::sharded(sizes, bucket, cfg.ps_servers())
    }

    /// Indices of the pieces server `s` owns, in piece order.
    pub fn owned(&self, s: usize) -> Vec<usize> {
        (0..self.pieces.len())
            .filter(|&p| self.owner[p] == s)
            .collect()
    }
}

/// One side's ends of the links between workers and servers ([`Link`]): separate servers are
/// the last world ranks (a link's peer `i` is rank `i` of the workers, or `workers + i` for
/// the servers); colocated, server `i` runs in worker `i`'s process.
pub struct PsLinks {
    /// Worker push thread -> server: headers and gradient pieces.
    pub push: Link,
    /// Server -> worker pull thread: versions of the parameters.
    pub pull: Link,
    /// Server -> worker main thread: checkpoint state.
    pub reply: Link,
    /// Number of workers.
    pub workers: usize,
    /// Number of servers.
    pub servers: usize,
}

/// Where worker `w` (a link rank) sits: its (tp, pp) shard `pp * tp_size + tp` and its
/// data-parallel index, from the grid of `cfg` (the workers' communicator is ordered as the
/// world, so a worker's link rank is its grid rank).
pub fn worker_place(cfg: &JobConfig, w: usize) -> (usize, usize) {
    let shape = GridShape::from_config(&cfg.parallel);
    let c = shape.coords(w);
    (c.pp * shape.tp + c.tp, c.dp)
}

/// Number of (tp, pp) shards of `cfg`.
pub fn shard_count(cfg: &JobConfig) -> usize {
    cfg.parallel.tp * cfg.parallel.pp
}

/// The whole model's sum of squares from each shard's (`shard_sq[pp * tp + tp_rank]`), added as
/// the all-reduce step adds its partial norms: over the tensor-parallel ranks first (the order
/// of the `tp` group), then over the stages (the `pp` group). Two-rank sums do not depend on the
/// order, so with tp, pp <= 2 this is the all-reduce run's number bit for bit.
pub fn whole_model_squares(shard_sq: &[f64], tp: usize) -> f64 {
    shard_sq
        .chunks(tp.max(1))
        .map(|stage| stage.iter().fold(0.0, |a, s| a + s))
        .fold(0.0, |a, s| a + s)
}

/// This rank's part in a parameter-server job.
pub enum Role {
    /// A worker: its communicator among the workers (the session's world) and the links.
    Worker(Communicator, PsLinks),
    /// A server: the communicator among the servers and the links.
    Server(Communicator, PsLinks),
    /// `ps.colocate`: a worker (as [`Role::Worker`]) whose process also runs a server (the
    /// communicator among the servers and the server's links, for [`spawn_colocated`]).
    Colocated(Communicator, PsLinks, Box<(Communicator, PsLinks)>),
}

/// Splits the world into workers and servers (collective over the world).
pub fn start(world: &World, cfg: &JobConfig) -> Result<Role> {
    let world_comm = world.communicator()?;
    super::config_agree::check(&world_comm, cfg)?;
    cfg.validate_world(world.size)?;
    let servers = cfg.ps_servers();
    let workers = world.size - if cfg.ps.colocate { 0 } else { servers };
    if world.rank == 0 {
        let mode = match cfg.ps.mode {
            crate::config::PsMode::Sync => "sync".to_string(),
            crate::config::PsMode::Async => format!("async, staleness {}", cfg.ps.staleness),
        };
        let place = match cfg.ps.colocate {
            true => "one in each worker process (colocated)".to_string(),
            false => format!("server rank(s) {}..{}", workers, world.size - 1),
        };
        println!("# parameter servers: {servers}, {place}, for {workers} worker(s), mode {mode}");
    }
    if cfg.ps.colocate {
        return start_colocated(world, world_comm);
    }
    let is_server = world.rank >= workers;
    let rank = world.rank as i64;
    let group = world_comm
        .split(Some(u32::from(is_server)), rank)?
        .expect("every rank joins");
    let base = if is_server { 0 } else { workers };
    let link = || -> Result<Link> {
        let comm = world_comm.split(Some(0), rank)?.expect("every rank joins");
        Ok(Link::Ranks {
            comm: Box::new(comm),
            base,
        })
    };
    let links = PsLinks {
        push: link()?,
        pull: link()?,
        reply: link()?,
        workers,
        servers,
    };
    Ok(if is_server {
        Role::Server(group, links)
    } else {
        Role::Worker(group, links)
    })
}

/// [`start`] with a server in every worker process: per direction, one communicator per server
/// (its process's server thread the only user there, the other processes' worker threads the
/// only users elsewhere) and an in-process channel between the worker and server of a process.
fn start_colocated(world: &World, world_comm: Communicator) -> Result<Role> {
    let (n, me, rank) = (world.size, world.rank, world.rank as i64);
    let group = world_comm.split(Some(0), rank)?.expect("every rank joins");
    // Worker side: peer s's communicator is comms[s] (s < me) or comms[s - 1] (s > me).
    let worker_via: Vec<Option<usize>> = (0..n)
        .map(|s| (s != me).then(|| if s < me { s } else { s - 1 }))
        .collect();
    let server_via: Vec<Option<usize>> = (0..n).map(|w| (w != me).then_some(0)).collect();
    let mut ends = Vec::new();
    for _direction in 0..3 {
        let (mut theirs, mut mine) = (Vec::new(), None);
        for s in 0..n {
            let c = world_comm.split(Some(0), rank)?.expect("every rank joins");
            if s == me {
                mine = Some(c);
            } else {
                theirs.push(c);
            }
        }
        ends.push((theirs, mine.expect("this process's server")));
    }
    let mut ends = ends.into_iter();
    let mut next = || ends.next().expect("three directions");
    let ((push_w, push_s), (pull_w, pull_s), (reply_w, reply_s)) = (next(), next(), next());
    // In-process ends: (sender, receiver).
    let (push_tx, push_rx) = link::local_pair();
    let (pull_tx, pull_rx) = link::local_pair();
    let (reply_tx, reply_rx) = link::local_pair();
    let wv = || worker_via.clone();
    let sv = || server_via.clone();
    let worker = PsLinks {
        push: Link::colocated(push_w, wv(), push_tx, me),
        pull: Link::colocated(pull_w, wv(), pull_rx, me),
        reply: Link::colocated(reply_w, wv(), reply_rx, me),
        workers: n,
        servers: n,
    };
    let server = PsLinks {
        push: Link::colocated(vec![push_s], sv(), push_rx, me),
        pull: Link::colocated(vec![pull_s], sv(), pull_tx, me),
        reply: Link::colocated(vec![reply_s], sv(), reply_tx, me),
        workers: n,
        servers: n,
    };
    Ok(Role::Colocated(world_comm, worker, Box::new((group, server))))
}

/// Starts the colocated server of this process on a thread of its own ([`serve`]).
pub fn spawn_colocated(
    server: Box<(Communicator, PsLinks)>,
    cfg: &JobConfig,
) -> Result<std::thread::JoinHandle<Result<()>>> {
    let (group, links) = *server;
    let cfg = cfg.clone();
    std::thread::Builder::new()
        .name("meshtrain-ps-server".into())
        .spawn(move || serve(group, links, &cfg))
        .map_err(|e| Error::Check(format!("spawning the colocated parameter server: {e}")))
}

/// Waits for the colocated server of [`spawn_colocated`] and returns its outcome.
pub fn join_colocated(server: std::thread::JoinHandle<Result<()>>) -> Result<()> {
    server.join().unwrap_or_else(|_| {
        Err(Error::Check(
            "the colocated parameter server thread panicked".into(),
        ))
    })
}

/// Spans as words: (start, end, flag) triples.
fn spans_to_words(spans: &[(Range<usize>, bool)]) -> Vec<i64> {
    spans
        .iter()
        .flat_map(|(r, f)| [r.start as i64, r.end as i64, i64::from(*f)])
        .collect()
}

/// [`spans_to_words`] back, checked against a buffer of `n` elements.
fn spans_from_words(words: &[i64], n: usize, what: &str) -> Result<Vec<(Range<usize>, bool)>> {
    words
        .chunks_exact(3)
        .map(|w| {
            let (a, b) = (w[0] as usize, w[1] as usize);
            if a > b || b > n {
                return Err(Error::Check(format!(
                    "parameter server: {what} span {a}..{b} outside the {n} parameters"
                )));
            }
            Ok((a..b, w[2] != 0))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pieces cover the buffer in readiness order, are at most 4 MiB, and the servers' shares
    /// differ by at most one piece.
    #[test]
    fn pieces_cover_the_buffer_and_are_balanced() {
        let n = 10_000_123;
        let plan = PiecePlan::sharded(&[n], usize::MAX, 3).remove(0);
        assert!(plan
            .pieces
            .iter()
            .all(|p| p.len() <= MAX_PIECE_ELEMS && !p.is_empty()));
        assert_eq!(plan.pieces[0].end, n);
        let mut covered: Vec<_> = plan.pieces.clone();
        covered.sort_by_key(|p| p.start);
        assert_eq!(covered[0].start, 0);
        assert!(covered.windows(2).all(|w| w[0].end == w[1].start));
        let share: Vec<usize> = (0..3)
            .map(|s| plan.owned(s).iter().map(|&p| plan.pieces[p].len()).sum())
            .collect();
        let (lo, hi) = (*share.iter().min().unwrap(), *share.iter().max().unwrap());
        assert!(hi - lo <= MAX_PIECE_ELEMS, "{share:?}");
        assert_eq!(share.iter().sum::<usize>(), n);
        // More servers than pieces: some own none, every piece has one.
        let small = PiecePlan::sharded(&[10], 4, 5).remove(0);
        assert_eq!(small.pieces.len(), 3);
        assert_eq!(small.owner, vec![0, 1, 2]);
    }

    /// Shards are cut alone and balanced together: every shard's pieces cover it, and the
    /// servers' shares over all shards differ by at most one piece.
    #[test]
    fn shards_are_cut_alone_and_balanced_together() {
        let sizes = [3_000_001, 2_500_000, 10, 1 << 20];
        let plans = PiecePlan::sharded(&sizes, usize::MAX, 3);
        let mut share = [0usize; 3];
        for (plan, &n) in plans.iter().zip(&sizes) {
            assert_eq!(plan.pieces.iter().map(|p| p.len()).sum::<usize>(), n);
            assert_eq!(plan.pieces[0].end, n);
            for (p, &s) in plan.pieces.iter().zip(&plan.owner) {
                share[s] += p.len();
            }
        }
        let (lo, hi) = (*share.iter().min().unwrap(), *share.iter().max().unwrap());
        assert!(hi - lo <= MAX_PIECE_ELEMS, "{share:?}");
        // One shard: the data-parallel plan.
        assert_eq!(
            PiecePlan::sharded(&[sizes[0]], 1000, 2)[0],
            PiecePlan::sharded(&sizes, 1000, 2)[0]
        );
    }

    /// The shards' squares are added over tp first, then over the stages.
    #[test]
    fn whole_model_squares_add_tp_then_pp() {
        let sq = [1e-8, 3.0, 0.1, 7.0];
        assert_eq!(
            whole_model_squares(&sq, 2).to_bits(),
            ((1e-8 + 3.0) + (0.1 + 7.0f64)).to_bits()
        );
        assert_eq!(whole_model_squares(&sq, 1), ((1e-8 + 3.0) + 0.1) + 7.0);
        assert_eq!(whole_model_squares(&[2.5], 1), 2.5);
    }

    #[test]
    fn spans_round_trip_and_bad_ones_are_named() {
        let spans = vec![(0..5, true), (5..9, false)];
        assert_eq!(
            spans_from_words(&spans_to_words(&spans), 9, "decay").unwrap(),
            spans
        );
        let err = spans_from_words(&[3, 20, 1], 9, "decay")
            .unwrap_err()
            .to_string();
        assert!(err.contains("decay span 3..20"), "{err}");
    }
}
