//! Splitting the non-GEMM layers' independent work across the CPU's cores.
//!
//! GEMMs are threaded by BLAS; the element-wise and row-wise layers (GELU, attention per batch
//! row, cross-entropy per position, AdamW per element) split their outputs into one contiguous
//! chunk per core with scoped threads. Each output element is computed by exactly the same
//! arithmetic whatever the split, so these layers' results are bitwise independent of the
//! thread count (OpenBLAS GEMMs are not: see `blas.rs`).
//! [`set_cpu_threads`] is the one knob for both kinds of threading (e.g. 1 when several ranks
//! share a node's cores: oversubscribed OpenBLAS threads spin and slow everything down).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use super::blas::set_gemm_threads;

/// Threads for the non-GEMM layers; 0 means "all available cores".
static THREADS: AtomicUsize = AtomicUsize::new(0);

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
    fn run_parts_runs_every_part_once() {
        let mut out = vec![0u32; 10];
        run_parts(out.chunks_mut(3).enumerate(), |(i, c)| {
            c.iter_mut().for_each(|x| *x += i as u32 + 1)
        });
        assert_eq!(out, [1, 1, 1, 2, 2, 2, 3, 3, 3, 4]);
    }
}
