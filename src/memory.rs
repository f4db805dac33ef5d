//! Resident memory: giving the pages of a buffer back to the OS, and measuring this process's
//! resident set.
//!
//! Why: ZeRO-2/3 keep only a shard of the gradients and parameters resident, but the model still
//! addresses them through one flat buffer with a layout table (offsets never change). Zeroing a
//! range with [`zero_release`] returns its whole pages to the kernel (`madvise(MADV_DONTNEED)` on
//! private anonymous memory), so a flat buffer of Ψ elements costs only the pages last written;
//! a later write faults fresh zero pages back in. Semantically `zero_release(b)` is exactly
//! `b.fill(0.0)`.
//!
//! Invariants: only pages lying entirely inside the slice are released (the slice's owner holds
//! `&mut` to all of them, so nothing else can observe the change); the partial pages at both ends
//! are zeroed by ordinary writes.

use crate::error::{Error, Result};

/// Sets every element of `buf` to zero, returning the whole pages it covers to the OS.
pub fn zero_release(buf: &mut [f32]) {
    let page = page_size();
    let start = buf.as_mut_ptr() as usize;
    let end = start + std::mem::size_of_val(buf);
    let (lo, hi) = (start.div_ceil(page) * page, end / page * page);
    if hi <= lo {
        buf.fill(0.0);
        return;
    }
    let elem = std::mem::size_of::<f32>();
    // `lo` and `hi` are page-aligned addresses inside the slice; page sizes are multiples of 4.
    let (head, tail) = ((lo - start) / elem, (hi - start) / elem);
    // SAFETY: [lo, hi) lies inside `buf`, which we borrow mutably, so no other reference can
    // observe these pages. Heap and mmap'ed allocations are private anonymous memory, for which
    // MADV_DONTNEED makes later reads return zero-filled pages: the slice stays valid and reads
    // as 0.0, which is what the function promises.
    let rc = unsafe { libc::madvise(lo as *mut libc::c_void, hi - lo, libc::MADV_DONTNEED) };
    if rc != 0 {
        // Not fatal: fall back to ordinary zeroing (the memory just stays resident).
        buf[head..tail].fill(0.0);
    }
    buf[..head].fill(0.0);
    buf[tail..].fill(0.0);
}

/// The system's page size in bytes (4096 when it cannot be read).
pub(crate) fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as usize
    } else {
        4096
    }
}

/// Reads a `kB` field of /proc/self/status, in bytes.
fn status_bytes(field: &str) -> Result<u64> {
    let path = "/proc/self/status";
    let status = std::fs::read_to_string(path).map_err(|e| Error::io(format!("read {path}"), e))?;
    status
        .lines()
        .find_map(|line| line.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .ok_or_else(|| Error::file(path, None, format!("no parsable {field} line")))
}

/// Peak resident set size of this process (VmHWM) in bytes, since start or the last
/// [`reset_peak_rss`].
pub fn peak_rss_bytes() -> Result<u64> {
    status_bytes("VmHWM:")
}

/// Current resident set size (VmRSS) in bytes.
pub fn rss_bytes() -> Result<u64> {
    status_bytes("VmRSS:")
}

/// Resets the peak resident set size to the current one (Linux `clear_refs` value 5), so that a
/// later [`peak_rss_bytes`] measures a phase (e.g. the training steps, not the set-up).
pub fn reset_peak_rss() -> Result<()> {
    let path = "/proc/self/clear_refs";
    std::fs::write(path, "5").map_err(|e| Error::io(format!("write 5 to {path}"), e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_release_zeroes_every_element_and_frees_whole_pages() {
        let n = 8 << 20; // 32 MiB
        let mut v: Vec<f32> = (0..n).map(|i| i as f32 + 1.0).collect();
        let before = rss_bytes().unwrap();
        // An unaligned sub-slice: the partial pages at both ends are zeroed by hand.
        zero_release(&mut v[3..n - 5]);
        let after = rss_bytes().unwrap();
        assert_eq!(&v[..3], &[1.0, 2.0, 3.0]);
        assert_eq!(&v[n - 5..], &[(n - 4) as f32, (n - 3) as f32, (n - 2) as f32, (n - 1) as f32, n as f32]);
        assert!(v[3..n - 5].iter().all(|&x| x == 0.0));
        // Other threads of the test binary allocate too; 32 MiB released dwarfs them.
        assert!(before > after + (24 << 20), "RSS {before} -> {after}: pages were not released");
        // The buffer is still usable.
        v[1000] = 5.0;
        assert_eq!(v[1000], 5.0);
    }

    #[test]
    fn zero_release_of_a_tiny_slice_only_zeroes() {
        let mut v = vec![1.0f32; 10];
        zero_release(&mut v[2..4]);
        assert_eq!(v, [1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]);
    }

    #[test]
    fn peak_rss_can_be_reset() {
        assert!(peak_rss_bytes().unwrap() >= rss_bytes().unwrap() / 2);
        if reset_peak_rss().is_ok() {
            let (peak, now) = (peak_rss_bytes().unwrap(), rss_bytes().unwrap());
            // Right after the reset the peak is (about) the current size.
            assert!(peak <= now + (8 << 20), "peak {peak} vs now {now}");
        }
    }
}
