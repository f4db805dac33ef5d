//! Bounds-checked host memory of the `emu` device arm: every buffer lies between two
//! inaccessible guard pages, so a kernel that reads or writes past either end faults, and the
//! emulator turns the fault into an error naming the kernel and the argument (see `emu.rs`).
//!
//! Layout: `[guard page][payload pages][guard page]`, the buffer placed at the END of its
//! payload pages, 16-byte aligned (like device allocations, so the vectorised kernel paths run):
//! an access past the end hits the guard page at once when the length is a multiple of 16, and
//! lands in at most 15 bytes of padding otherwise. The padding, and the unused start of the
//! first payload page, hold a canary pattern that [`GuardedBytes::take_damage`] checks after each
//! launch, so small overruns that miss a guard page are still caught when they write.

use crate::error::{Error, Result};
use crate::memory::page_size;

/// Byte the padding around a buffer is filled with.
const CANARY: u8 = 0xA5;

/// `len` zeroed bytes between guard pages (freed on drop).
pub struct GuardedBytes {
    base: *mut u8,
    total: usize,
    start: *mut u8,
    len: usize,
    /// The payload pages: `[payload, payload + payload_len)` is readable and writable.
    payload: *mut u8,
    payload_len: usize,
}

// SAFETY: the mapping is owned by this value alone (no aliases are handed out except through
// borrows of it), so moving it to or sharing it with another thread is as safe as for a Vec.
unsafe impl Send for GuardedBytes {}
// SAFETY: as above; shared access only reads.
unsafe impl Sync for GuardedBytes {}

impl GuardedBytes {
    /// `len` zero bytes between guard pages.
    pub fn zeroed(len: usize) -> Result<Self> {
        let page = page_size();
        let padded = len.div_ceil(16) * 16;
        let payload_len = padded.div_ceil(page) * page;
        let total = payload_len + 2 * page;
        // SAFETY: a fresh anonymous mapping; the result is checked below.
        let base = unsafe {
            libc::mmap(std::ptr::null_mut(), total, libc::PROT_NONE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0)
        };
        if base == libc::MAP_FAILED {
            return Err(Error::Device(format!("emu: cannot map {total} bytes for a {len}-byte buffer")));
        }
        let base = base as *mut u8;
        // SAFETY: `payload` lies inside the mapping made above.
        let payload = unsafe { base.add(page) };
        // SAFETY: the payload pages lie inside the mapping; only they become accessible.
        if payload_len > 0 && unsafe { libc::mprotect(payload.cast(), payload_len, libc::PROT_READ | libc::PROT_WRITE) } != 0 {
            // SAFETY: unmapping the mapping made above, once.
            unsafe { libc::munmap(base.cast(), total) };
            return Err(Error::Device(format!("emu: cannot unprotect {payload_len} bytes")));
        }
        // SAFETY: `payload_len - padded` is within the payload pages.
        let start = unsafe { payload.add(payload_len - padded) };
        let g = GuardedBytes { base, total, start, len, payload, payload_len };
        // SAFETY: both padding ranges lie in the writable payload pages, outside the buffer.
        unsafe {
            std::ptr::write_bytes(payload, CANARY, payload_len - padded);
            std::ptr::write_bytes(start.add(len), CANARY, padded - len);
        }
        Ok(g)
    }

    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `start..start + len` lies in the writable payload pages owned by `self`.
        unsafe { std::slice::from_raw_parts(self.start, self.len) }
    }

    /// The bytes, mutable.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`, borrowed mutably through `self`.
        unsafe { std::slice::from_raw_parts_mut(self.start, self.len) }
    }

    /// Address of the first byte (what a kernel gets).
    pub fn address(&self) -> u64 {
        self.start as u64
    }

    /// Signed byte offset of `addr` from the buffer's start when `addr` lies in this buffer's
    /// mapping (guard pages and padding included), else `None`.
    pub fn offset_of(&self, addr: u64) -> Option<i64> {
        let (lo, hi) = (self.base as u64, self.base as u64 + self.total as u64);
        (lo..hi).contains(&addr).then(|| addr as i64 - self.start as i64)
    }

    /// The first padding byte that lost its canary, as an offset from the buffer's start (a
    /// write out of bounds that missed the guard pages); the canary is restored, so each
    /// overrun is reported once.
    pub fn take_damage(&self) -> Option<i64> {
        let before = self.start as usize - self.payload as usize;
        let after = before + self.len;
        // SAFETY: the whole payload range is mapped readable and writable and owned by `self`;
        // the padding (outside `start..start + len`) is never covered by a Rust reference.
        let payload = unsafe { std::slice::from_raw_parts(self.payload, self.payload_len) };
        let bad = payload[..before]
            .iter()
            .position(|&b| b != CANARY)
            .or_else(|| payload[after..].iter().position(|&b| b != CANARY).map(|i| after + i))?;
        // SAFETY: as above; both ranges are padding.
        unsafe {
            std::ptr::write_bytes(self.payload, CANARY, before);
            std::ptr::write_bytes(self.payload.add(after), CANARY, self.payload_len - after);
        }
        Some(bad as i64 - before as i64)
    }
}

impl Drop for GuardedBytes {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `zeroed`, unmapped once; no borrow of it outlives `self`.
        unsafe { libc::munmap(self.base.cast(), self.total) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The buffer is zeroed, 16-byte aligned, ends at (or within 15 bytes of) its guard page, and
    /// a write into the padding is reported at its offset, once.
    #[test]
    fn layout_and_canary() {
        for len in [0usize, 1, 13, 16, 4096, 4099, 10000] {
            let mut g = GuardedBytes::zeroed(len).unwrap();
            assert_eq!(g.bytes().len(), len);
            assert!(g.bytes().iter().all(|&b| b == 0));
            assert_eq!(g.address() % 16, 0);
            let end = (g.payload as u64) + g.payload_len as u64;
            assert_eq!(end - g.address(), (len.div_ceil(16) * 16) as u64);
            assert_eq!(g.take_damage(), None);
            g.bytes_mut().fill(7);
            assert_eq!(g.take_damage(), None);
            if len % 16 != 0 {
                // SAFETY: one byte past the end lies in the padding (len is not a multiple of 16).
                unsafe { *g.start.add(len) = 0 };
                assert_eq!(g.take_damage(), Some(len as i64));
                assert_eq!(g.take_damage(), None, "reported once");
            }
            assert_eq!(g.offset_of(g.address() + len as u64 + 8), Some(len as i64 + 8));
            assert_eq!(g.offset_of(g.base as u64 + g.total as u64), None);
        }
    }
}
