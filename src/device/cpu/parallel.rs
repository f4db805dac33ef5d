//! Splitting the non-GEMM layers' independent work across the CPU's cores.
//!
//! GEMMs are threaded by BLAS; the element-wise and row-wise layers (GELU, attention per batch
//! row, cross-entropy per position, AdamW per element) split their outputs into one contiguous
//! chunk per core with scoped threads. Each output element is computed by exactly the same
//! arithmetic whatever the split, so these layers' results are bitwise independent of the
//! thread count (OpenBLAS GEMMs are not: see `blas.rs`).
//! [`set_cpu_threads`] is the one knob for both kinds of threading (e.g. 1 when several ranks
//! share a node's cores: oversubscribed OpenBLAS threads spin and slow everything down).
//! [`choose_threads`] picks its value: the job's `train.threads`, else `OMP_NUM_THREADS`, else
//! `OPENBLAS_NUM_THREADS`, else the node's cores split among its ranks. The generic OpenMP
//! variable (what launch scripts set per task) wins over the BLAS-specific one because this one
//! count drives meshtrain's own layer threads as well as BLAS's.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use super::blas::set_gemm_threads;
use crate::error::{Error, Result};

/// Threads for the non-GEMM layers; 0 means "all available cores".
static THREADS: AtomicUsize = AtomicUsize::new(0);

/// The largest thread count accepted from `train.threads` or the environment.
pub const MAX_THREADS: usize = 1024;

/// Where a rank's thread count came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ThreadSource {
    /// The job's `train.threads`.
    Config,
    /// An environment variable (`OMP_NUM_THREADS` or `OPENBLAS_NUM_THREADS`).
    Env(&'static str),
    /// The node's cores split among its ranks.
    Automatic,
}

/// A rank's thread count and where it came from (its `Display` is the log line's wording).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ThreadChoice {
    /// Threads for the GEMMs and the other layers, at least 1.
    pub threads: usize,
    /// Where the count came from.
    pub source: ThreadSource,
}

impl std::fmt::Display for ThreadChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.threads;
        match self.source {
            ThreadSource::Config => write!(f, "{n} (train.threads)"),
            ThreadSource::Env(var) => write!(f, "{n} ({var})"),
            ThreadSource::Automatic => write!(f, "{n} (automatic: the node's cores / its ranks)"),
        }
    }
}

/// The thread count of this rank: `configured` (`train.threads`, 0 = not set), else
/// `OMP_NUM_THREADS`, else `OPENBLAS_NUM_THREADS`, else `automatic` (the caller's cores per
/// rank). A variable that is set but empty counts as unset; a bad value is an error naming it.
pub fn choose_threads(configured: usize, automatic: usize) -> Result<ThreadChoice> {
    choose_threads_with(configured, automatic, |var| std::env::var(var).ok())
}

fn choose_threads_with(
    configured: usize,
    automatic: usize,
    env: impl Fn(&str) -> Option<String>,
) -> Result<ThreadChoice> {
    if configured > MAX_THREADS {
        return Err(Error::config("train.threads", format!("{configured} is above the maximum {MAX_THREADS} (0 = automatic)")));
    }
    if configured > 0 {
        return Ok(ThreadChoice { threads: configured, source: ThreadSource::Config });
    }
    for var in ["OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"] {
        let Some(value) = env(var).filter(|v| !v.trim().is_empty()) else { continue };
        // OpenMP allows a list for nested levels ("8,2"): the first level is this process's.
        let first = value.split(',').next().unwrap_or("").trim();
        return match first.parse::<usize>() {
            Ok(n) if (1..=MAX_THREADS).contains(&n) => Ok(ThreadChoice { threads: n, source: ThreadSource::Env(var) }),
            _ => Err(Error::config(var, format!("`{value}` is not a thread count 1..={MAX_THREADS} (unset it, or set train.threads)"))),
        };
    }
    Ok(ThreadChoice { threads: automatic.max(1), source: ThreadSource::Automatic })
}

/// Below this many elements of work a layer runs on the calling thread (a thread spawn costs
/// ~20 µs, the work per element is a few ns).
const MIN_PARALLEL_WORK: usize = 1 << 16;

/// Threads the CPU model uses: set by [`set_cpu_threads`], else the cores available to this
/// process (1 if unknown).
pub fn cores() -> usize {
    match THREADS.load(Ordering::Relaxed) {
        0 => available_cores(),
        n => n,
    }
}

/// The cores available to this process (1 if unknown), asked once: the standard library reads
/// the affinity mask and the cgroup quota files on every call, tens of microseconds that every
/// layer call would pay.
pub fn available_cores() -> usize {
    static CORES: OnceLock<usize> = OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// Uses `n` (at least 1) threads for the GEMMs (OpenBLAS) and for the other layers from now on.
pub fn set_cpu_threads(n: usize) {
    let n = n.max(1);
    THREADS.store(n, Ordering::Relaxed);
    set_gemm_threads(n);
}

/// Items per chunk when `items` items, each `work_per_item` elements of work, are split over
/// the cores: all items in one chunk when the total is too small to pay for threads.
pub fn chunk_items(items: usize, work_per_item: usize) -> usize {
    if items * work_per_item < MIN_PARALLEL_WORK {
        items.max(1)
    } else {
        items.div_ceil(cores()).max(1)
    }
}

/// Runs `work` on every part: the first on the calling thread, the others on scoped threads
/// (so a single part costs no thread at all). Returns when all parts are done.
pub fn run_parts<T: Send>(mut parts: impl Iterator<Item = T>, work: impl Fn(T) + Sync) {
    let first = parts.next();
    std::thread::scope(|scope| {
        let work = &work;
        for part in parts {
            scope.spawn(move || work(part));
        }
        if let Some(part) = first {
            work(part);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_work_stays_in_one_chunk_and_large_work_covers_all_items() {
        assert_eq!(chunk_items(10, 10), 10);
        assert_eq!(chunk_items(0, 10), 1);
        let per = chunk_items(1000, 1000);
        assert!(per * cores() >= 1000 && per <= 1000);
    }

    #[test]
    fn threads_come_from_the_key_then_omp_then_openblas_then_automatic() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |var: &str| pairs.iter().find(|(k, _)| *k == var).map(|(_, v)| v.to_string())
        };
        let both = env(&[("OMP_NUM_THREADS", "3"), ("OPENBLAS_NUM_THREADS", "5")]);
        let pick = |c, e| choose_threads_with(c, 7, e).unwrap();
        assert_eq!(pick(2, both), ThreadChoice { threads: 2, source: ThreadSource::Config });
        assert_eq!(pick(0, both), ThreadChoice { threads: 3, source: ThreadSource::Env("OMP_NUM_THREADS") });
        let blas = env(&[("OMP_NUM_THREADS", " "), ("OPENBLAS_NUM_THREADS", "5")]);
        assert_eq!(pick(0, blas), ThreadChoice { threads: 5, source: ThreadSource::Env("OPENBLAS_NUM_THREADS") });
        assert_eq!(pick(0, env(&[("OMP_NUM_THREADS", "4,2")])).threads, 4);
        assert_eq!(pick(0, env(&[])), ThreadChoice { threads: 7, source: ThreadSource::Automatic });
        assert_eq!(choose_threads_with(0, 0, env(&[])).unwrap().threads, 1);
        assert_eq!(pick(0, env(&[("OMP_NUM_THREADS", "3")])).to_string(), "3 (OMP_NUM_THREADS)");
    }

    #[test]
    fn bad_thread_counts_name_their_source() {
        let err = |c: usize, pairs: &[(&str, &str)]| {
            let e = choose_threads_with(c, 2, |v| pairs.iter().find(|(k, _)| *k == v).map(|(_, x)| x.to_string()));
            e.unwrap_err().to_string()
        };
        assert!(err(MAX_THREADS + 1, &[]).contains("train.threads"));
        for bad in ["0", "-1", "two", "100000"] {
            let e = err(0, &[("OMP_NUM_THREADS", bad)]);
            assert!(e.contains("OMP_NUM_THREADS") && e.contains(bad), "{e}");
        }
        assert!(err(0, &[("OPENBLAS_NUM_THREADS", "x")]).contains("OPENBLAS_NUM_THREADS"));
    }

    #[test]
    fn run_parts_runs_every_part_once() {
        let mut out = vec![0u32; 10];
        run_parts(out.chunks_mut(3).enumerate(), |(i, c)| {
            c.iter_mut().for_each(|x| *x += i as u32 + 1)
        });
        assert_eq!(out, [1, 1, 1, 2, 2, 2, 3, 3, 3, 4]);
    }
}
