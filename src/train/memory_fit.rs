//! Refusing up front a model that cannot fit this node's memory, instead of an allocator abort
//! (22b) or the OOM killer minutes later (d48 on 24 GiB).
//!
//! The need is a lower bound: the fp32 parameters, gradients and AdamW moments of one rank's share
//! (`1/(tp*pp)` of the model; ZeRO divides the moments, then the gradients, then the parameters
//! by `dp`), 16 bytes per parameter at ZeRO 0, times the ranks on this node, without activations,
//! buffers or the runtime. What is available is `MemAvailable` (/proc/meminfo), or less where the
//! cgroup (v2 `memory.max - memory.current`) allows less. A job over the bound cannot run, so it is
//! refused on every rank (one max-reduction) with both numbers in bytes.

use crate::comm::{Communicator, ReduceOp};
use crate::config::JobConfig;
use crate::error::{Error, Result};
use crate::model::ParamLayout;

/// Lower bound of the host bytes one rank of `cfg` holds.
pub fn rank_bytes(cfg: &JobConfig) -> u64 {
    let p = &cfg.parallel;
    let n = ParamLayout::new(&cfg.model).total_len() as u64 / (p.tp * p.pp) as u64;
    let dp = p.dp as u64;
    let share = |sharded: bool| if sharded { n.div_ceil(dp) } else { n };
    4 * share(p.zero >= 3) + 4 * share(p.zero >= 2) + 8 * share(p.zero >= 1)
}

/// Bytes this process may still allocate: `MemAvailable`, capped by the cgroup's remaining limit.
pub fn available_bytes() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib: u64 = meminfo.lines().find_map(|l| l.strip_prefix("MemAvailable:"))?.trim().trim_end_matches("kB").trim().parse().ok()?;
    let mut avail = kib * 1024;
    let read = |f: &str| std::fs::read_to_string(format!("/sys/fs/cgroup/{f}")).ok().and_then(|s| s.trim().parse::<u64>().ok());
    if let (Some(max), Some(current)) = (read("memory.max"), read("memory.current")) {
        avail = avail.min(max.saturating_sub(current));
    }
    Some(avail)
}

/// Collective over `world`: an error on every rank if some node cannot hold its ranks' share of
/// the model (`local_ranks` of them on this one).
pub fn check(world: &Communicator, cfg: &JobConfig, local_ranks: usize) -> Result<()> {
    let need = rank_bytes(cfg) * local_ranks as u64;
    let avail = available_bytes();
    let short = avail.is_some_and(|a| need > a);
    let mut flags = [i64::from(short)];
    world.all_reduce(&mut flags, ReduceOp::Max)?;
    if flags[0] == 0 {
        return Ok(());
    }
    let here = match (short, avail) {
        (true, Some(a)) => format!(
            "needs at least {need} bytes on this node ({} bytes per rank x {local_ranks} ranks: fp32 parameters, gradients and AdamW state), but {a} bytes are available",
            rank_bytes(cfg)
        ),
        _ => "does not fit the memory of another node of the job".to_string(),
    };
    Err(Error::config("model", format!("{here}; use more ranks (tp, pp, or dp with parallel.zero) or a smaller model")))
}
