//! Large host buffers on transparent huge pages.
//!
//! Why: with 4 KiB pages, every single-copy read of a peer's buffer (`process_vm_readv`, the
//! `read` schedules) pins and maps the source page by page, and the copy runs at about half the
//! speed of a local `memcpy` (measured here: 8 vs 13 GB/s on a 32 MiB buffer); on 2 MiB pages it
//! matches `memcpy` (14 GB/s). Parameters, gradients, optimizer state and activations are large
//! and long-lived, and walking them also costs fewer TLB misses on big pages.
//!
//! [`HugePageAlloc`] is the `meshtrain` binary's global allocator. Allocations of at least
//! [`LARGE`] bytes (alignment up to 2 MiB) are anonymous mappings of their own that start on a
//! 2 MiB boundary and are advised `MADV_HUGEPAGE`, so the kernel backs them with huge pages where
//! it can (transparent huge pages in `madvise` or `always` mode); smaller ones go to the system
//! allocator. A fresh mapping is already zero, so large zeroed allocations cost no pass.
//!
//! Invariants: which path owns a block depends only on its layout (size and alignment), never on
//! a runtime switch, so `dealloc` always returns a block to the path that made it. The switch
//! ([`set_advise`], `MESHTRAIN_HUGEPAGES=off`) only decides whether new mappings are advised.
//! Running out of address space returns null (the caller's allocation error), as the system
//! allocator does.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, Ordering};

/// Size of a huge page on x86-64 and aarch64 (4 KiB granule); also the mappings' alignment.
pub const HUGE: usize = 2 << 20;

/// Smallest allocation that gets its own huge-page mapping.
pub const LARGE: usize = HUGE;

const PAGE: usize = 4096;

static ADVISE: AtomicBool = AtomicBool::new(true);

/// Whether new large mappings are advised `MADV_HUGEPAGE` (default yes).
pub fn set_advise(on: bool) {
    ADVISE.store(on, Ordering::Relaxed);
}

/// Whether new large mappings are advised `MADV_HUGEPAGE`.
pub fn advising() -> bool {
    ADVISE.load(Ordering::Relaxed)
}

/// The kernel's transparent-huge-page mode (`always`, `madvise` or `never`), if it says.
pub fn thp_mode() -> Option<String> {
    let text = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").ok()?;
    let open = text.find('[')?;
    let close = text[open..].find(']')? + open;
    Some(text[open + 1..close].to_string())
}

/// One line for benchmark headers: what pages the large buffers get.
pub fn describe() -> String {
    let mode = thp_mode().unwrap_or_else(|| "unknown".into());
    let advice = if advising() { "advised" } else { "not advised (MESHTRAIN_HUGEPAGES=off)" };
    format!("large buffers (>= 2 MiB) on transparent huge pages: kernel mode {mode}, {advice}")
}

/// The global allocator: large blocks on 2 MiB-aligned mappings, the rest from [`System`].
pub struct HugePageAlloc;

fn is_large(layout: Layout) -> bool {
    layout.size() >= LARGE && layout.align() <= HUGE
}

fn mapped_len(size: usize) -> usize {
    size.div_ceil(PAGE) * PAGE
}

/// A fresh zeroed mapping of `size` bytes starting on a 2 MiB boundary, or null.
fn map_large(size: usize) -> *mut u8 {
    let len = mapped_len(size);
    let Some(total) = len.checked_add(HUGE) else { return std::ptr::null_mut() };
    // SAFETY: an anonymous private mapping at an address of the kernel's choosing touches no
    // existing memory; the result is checked against MAP_FAILED.
    let raw = unsafe {
        libc::mmap(std::ptr::null_mut(), total, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0)
    };
    if raw == libc::MAP_FAILED {
        return std::ptr::null_mut();
    }
    let base = raw as usize;
    let start = base.div_ceil(HUGE) * HUGE;
    let (head, tail) = (start - base, HUGE - (start - base));
    // SAFETY: `[base, base + total)` is the mapping just made and nothing else refers to it; the
    // head before `start` and the tail after `start + len` are unmapped, `[start, start + len)`
    // stays. munmap of a page-aligned part of an own mapping cannot fail but for ENOMEM on
    // splitting, which only leaves address space mapped (harmless).
    unsafe {
        if head > 0 {
            libc::munmap(raw, head);
        }
        if tail > 0 {
            libc::munmap((start + len) as *mut libc::c_void, tail);
        }
        if advising() {
            // Advice only: a kernel without THP answers EINVAL and the block keeps small pages.
            libc::madvise(start as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
        }
    }
    start as *mut u8
}

// SAFETY: every block is either the system allocator's (small layouts, in and out) or one mapping
// of its own (large layouts, see `is_large`), and the layout passed back at dealloc/realloc picks
// the same path that made it; mappings are at least as aligned as the layout asks (2 MiB).
unsafe impl GlobalAlloc for HugePageAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if is_large(layout) {
            map_large(layout.size())
        } else {
            // SAFETY: forwarded with the caller's guarantees (non-zero size).
            unsafe { System.alloc(layout) }
        }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if is_large(layout) {
            map_large(layout.size())
        } else {
            // SAFETY: as in `alloc`.
            unsafe { System.alloc_zeroed(layout) }
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if is_large(layout) {
            // SAFETY: `ptr` came from `map_large(layout.size())` (same layout, see the impl's
            // comment), which left exactly `mapped_len` bytes mapped from `ptr`.
            unsafe { libc::munmap(ptr as *mut libc::c_void, mapped_len(layout.size())) };
        } else {
            // SAFETY: forwarded; the block is the system allocator's.
            unsafe { System.dealloc(ptr, layout) }
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller guarantees `new_size` is non-zero and does not overflow when rounded
        // to `layout.align()`.
        let new = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        match (is_large(layout), is_large(new)) {
            // SAFETY: a system block that stays small: the system allocator resizes it.
            (false, false) => unsafe { System.realloc(ptr, layout, new_size) },
            _ => {
                // SAFETY: a fresh block of the new layout; the old one is valid for
                // `min(old, new)` bytes and freed by the path that made it.
                unsafe {
                    let out = self.alloc(new);
                    if !out.is_null() {
                        std::ptr::copy_nonoverlapping(ptr, out, layout.size().min(new_size));
                        self.dealloc(ptr, layout);
                    }
                    out
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Kilobytes of this process's anonymous memory on huge pages inside `[start, start + len)`.
    fn huge_kb_in(start: usize, len: usize) -> Option<u64> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
        let mut inside = false;
        let mut kb = 0;
        for line in smaps.lines() {
            if let Some((range, _)) = line.split_once(' ') {
                if let Some((a, b)) = range.split_once('-') {
                    if let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16)) {
                        inside = a < start + len && b > start;
                        continue;
                    }
                }
            }
            if inside {
                if let Some(v) = line.strip_prefix("AnonHugePages:") {
                    kb += v.trim().trim_end_matches("kB").trim().parse::<u64>().ok()?;
                }
            }
        }
        Some(kb)
    }

    #[test]
    fn large_blocks_are_aligned_zeroed_and_survive_resizing_across_the_threshold() {
        let a = HugePageAlloc;
        let big = Layout::from_size_align(3 * HUGE + 123, 64).unwrap();
        // SAFETY: layouts are non-zero; every block is freed with the layout it has.
        unsafe {
            let p = a.alloc_zeroed(big);
            assert!(!p.is_null());
            assert_eq!(p as usize % HUGE, 0, "large blocks start on a huge-page boundary");
            let s = std::slice::from_raw_parts_mut(p, big.size());
            assert!(s.iter().all(|&b| b == 0));
            for (i, b) in s.iter_mut().enumerate() {
                *b = (i % 251) as u8;
            }
            // Large -> small -> large: contents kept each time, each block freed by its own path.
            let small = a.realloc(p, big, 1000);
            assert!((0..1000).all(|i| *small.add(i) == (i % 251) as u8));
            let again = a.realloc(small, Layout::from_size_align(1000, 64).unwrap(), 5 * HUGE);
            assert!((0..1000).all(|i| *again.add(i) == (i % 251) as u8));
            assert_eq!(again as usize % HUGE, 0);
            let grown = a.realloc(again, Layout::from_size_align(5 * HUGE, 64).unwrap(), 6 * HUGE + 1);
            assert!((0..1000).all(|i| *grown.add(i) == (i % 251) as u8));
            a.dealloc(grown, Layout::from_size_align(6 * HUGE + 1, 64).unwrap());
            // Small blocks stay with the system allocator and resize in place where it can.
            let l = Layout::from_size_align(100, 8).unwrap();
            let q = a.alloc(l);
            *q = 7;
            let q = a.realloc(q, l, 200);
            assert_eq!(*q, 7);
            a.dealloc(q, Layout::from_size_align(200, 8).unwrap());
        }
    }

    #[test]
    fn advised_blocks_get_huge_pages_where_the_kernel_offers_them() {
        if !matches!(thp_mode().as_deref(), Some("madvise") | Some("always")) {
            eprintln!("SKIP: transparent huge pages are off on this machine ({:?})", thp_mode());
            return;
        }
        let a = HugePageAlloc;
        let l = Layout::from_size_align(8 * HUGE, 8).unwrap();
        // SAFETY: a non-zero layout, freed with itself.
        unsafe {
            let p = a.alloc(l);
            std::ptr::write_bytes(p, 1, l.size());
            let kb = huge_kb_in(p as usize, l.size()).expect("/proc/self/smaps readable");
            a.dealloc(p, l);
            // Memory pressure may deny some huge pages; none at all means the advice is lost.
            assert!(kb >= 2048, "no huge page in an advised 16 MiB block ({kb} kB)");
        }
    }

    #[test]
    fn describe_names_the_mode() {
        assert!(describe().contains("kernel mode"));
    }
}
