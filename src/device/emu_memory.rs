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
//!
//! IPC (the emu arm's stand-in for `cuIpcGetMemHandle`): a shareable buffer's payload pages are a
//! memfd mapped `MAP_SHARED` into the reservation, and its handle names (process id, descriptor);
//! a peer process of the same node opens `/proc/<pid>/fd/<fd>` and maps the same pages between
//! guard pages of its own, at the same offsets, so kernels of two processes see each other's
//! stores (what the stream-ordered collectives' flags need). A memfd leaves nothing behind when
//! the processes end, crashed or not; the exporter keeps the descriptor open while the buffer
//! lives, and a peer's mapping stays valid after that. Views ([`GuardedBytes::view`]) name part of
//! another value's memory and own nothing.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use crate::error::{Error, Result};
use crate::memory::page_size;

/// Byte the padding around a buffer is filled with.
const CANARY: u8 = 0xA5;

/// Marks an emu IPC handle (the first 8 of its 64 bytes).
const HANDLE_MAGIC: &[u8; 8] = b"MTEMUSHM";

/// What a [`GuardedBytes`] owns.
enum Owns {
    /// Its private anonymous mapping.
    Private,
    /// Its mapping of a memfd it created (shareable), and the descriptor.
    Shared(OwnedFd),
    /// Its mapping of a peer's memfd.
    Peer,
    /// Nothing: part of another value's memory.
    View,
}

/// `len` zeroed bytes between guard pages (freed on drop), or a view of such bytes.
pub struct GuardedBytes {
    base: *mut u8,
    total: usize,
    start: *mut u8,
    len: usize,
    /// The payload pages: `[payload, payload + payload_len)` is readable and writable.
    payload: *mut u8,
    payload_len: usize,
    owns: Owns,
}

// SAFETY: the mapping is owned by this value alone (no aliases are handed out except through
// borrows of it), so moving it to or sharing it with another thread is as safe as for a Vec.
unsafe impl Send for GuardedBytes {}
// SAFETY: as above; shared access only reads.
unsafe impl Sync for GuardedBytes {}

/// Payload bytes for a `len`-byte buffer (padded to 16, rounded up to pages).
fn payload_len(len: usize) -> usize {
    let page = page_size();
    (len.div_ceil(16) * 16).div_ceil(page) * page
}

impl GuardedBytes {
    /// `len` zero bytes between guard pages.
    pub fn zeroed(len: usize) -> Result<Self> {
        Self::reserve(len, payload_len(len), Owns::Private, |payload, n| {
            // SAFETY: the payload pages lie inside the reservation; only they become accessible.
            let ok = unsafe { libc::mprotect(payload.cast(), n, libc::PROT_READ | libc::PROT_WRITE) } == 0;
            ok.then_some(()).ok_or_else(|| format!("cannot unprotect {n} bytes"))
        })
        .map(Self::with_canaries)
    }

    /// `len` zero bytes between guard pages whose payload other processes can map
    /// ([`Self::export`], [`Self::open`]).
    pub fn shared(len: usize) -> Result<Self> {
        let n = payload_len(len);
        let name = CString::new("meshtrain-emu").expect("no NUL");
        // SAFETY: a valid C string; the result is checked.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(Error::Device(format!("emu: memfd_create: {}", std::io::Error::last_os_error())));
        }
        // SAFETY: `fd` was just created and is owned here alone.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: sizing the memfd created above.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), n as libc::off_t) } != 0 {
            return Err(Error::Device(format!("emu: sizing a {n}-byte memfd: {}", std::io::Error::last_os_error())));
        }
        let raw = fd.as_raw_fd();
        Self::reserve(len, n, Owns::Shared(fd), |payload, n| map_fd(payload, n, raw)).map(Self::with_canaries)
    }

    /// Maps the buffer a peer process of this node exported as `handle`.
    pub fn open(handle: &[u8; 64]) -> Result<Self> {
        let word = |i: usize| u64::from_le_bytes(handle[i..i + 8].try_into().expect("8 bytes"));
        if &handle[..8] != HANDLE_MAGIC {
            return Err(Error::Device("emu ipc: not an emu IPC handle".into()));
        }
        let (pid, fd, n, len) = (word(8) as u32, word(16) as i32, word(24) as usize, word(32) as usize);
        if n != payload_len(len) {
            return Err(Error::Device(format!("emu ipc: handle of a {len}-byte buffer claims {n} payload bytes")));
        }
        let path = format!("/proc/{pid}/fd/{fd}");
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| Error::Device(format!("emu ipc: opening {path} (is process {pid} alive, on this node?): {e}")))?;
        let size = file.metadata().map(|m| m.len()).unwrap_or(0);
        if size != n as u64 {
            return Err(Error::Device(format!("emu ipc: {path} holds {size} bytes, the handle says {n}")));
        }
        // The mapping keeps the pages; the file closes when this function returns.
        Self::reserve(len, n, Owns::Peer, |payload, n| map_fd(payload, n, file.as_raw_fd()))
    }

    /// The handle a peer passes to [`Self::open`]: (magic, pid, fd, payload bytes, length). Only
    /// for buffers made by [`Self::shared`].
    pub fn export(&self) -> Option<[u8; 64]> {
        let Owns::Shared(fd) = &self.owns else { return None };
        let mut h = [0u8; 64];
        h[..8].copy_from_slice(HANDLE_MAGIC);
        let words = [std::process::id() as u64, fd.as_raw_fd() as u64, self.payload_len as u64, self.len as u64];
        for (i, v) in words.into_iter().enumerate() {
            h[8 + 8 * i..16 + 8 * i].copy_from_slice(&v.to_le_bytes());
        }
        Some(h)
    }

    /// Bytes `range` of `self` as a value that owns nothing; faults in it are still attributed
    /// through the enclosing mapping. The caller keeps `self` alive and checked the range.
    pub fn view(&self, range: std::ops::Range<usize>) -> GuardedBytes {
        assert!(range.start <= range.end && range.end <= self.len, "emu view {range:?} outside {} bytes", self.len);
        GuardedBytes {
            base: self.base,
            total: self.total,
            // SAFETY: `range` lies inside the buffer (asserted above).
            start: unsafe { self.start.add(range.start) },
            len: range.len(),
            payload: self.payload,
            payload_len: self.payload_len,
            owns: Owns::View,
        }
    }

    /// Reserves guard pages around `n` payload bytes, makes the payload accessible with
    /// `payload_access`, and places a `len`-byte buffer at its end.
    fn reserve(
        len: usize,
        n: usize,
        owns: Owns,
        payload_access: impl FnOnce(*mut u8, usize) -> std::result::Result<(), String>,
    ) -> Result<Self> {
        let page = page_size();
        let total = n + 2 * page;
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
        if n > 0 {
            if let Err(why) = payload_access(payload, n) {
                // SAFETY: unmapping the mapping made above, once.
                unsafe { libc::munmap(base.cast(), total) };
                return Err(Error::Device(format!("emu: {why}")));
            }
        }
        let padded = len.div_ceil(16) * 16;
        // SAFETY: `n - padded` is within the payload pages.
        let start = unsafe { payload.add(n - padded) };
        Ok(GuardedBytes { base, total, start, len, payload, payload_len: n, owns })
    }

    /// Fills the padding on both sides of a new buffer with the canary.
    fn with_canaries(self) -> Self {
        let before = self.start as usize - self.payload as usize;
        let after = self.payload_len - before - self.len;
        // SAFETY: both padding ranges lie in the writable payload pages, outside the buffer.
        unsafe {
            std::ptr::write_bytes(self.payload, CANARY, before);
            std::ptr::write_bytes(self.start.add(self.len), CANARY, after);
        }
        self
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
        if matches!(self.owns, Owns::View | Owns::Peer) {
            return None; // the owner of the pages checks them
        }
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
        if matches!(self.owns, Owns::View) {
            return;
        }
        // SAFETY: the mapping made in `reserve`, unmapped once; no borrow of it outlives `self`
        // (views are borrowed from it by their users' lifetimes).
        unsafe { libc::munmap(self.base.cast(), self.total) };
    }
}

/// Maps `n` bytes of `fd` shared over the payload pages at `payload`.
fn map_fd(payload: *mut u8, n: usize, fd: i32) -> std::result::Result<(), String> {
    // SAFETY: replaces the reserved payload pages (inside a mapping owned by the caller) with the
    // descriptor's pages; the result is checked.
    let p = unsafe {
        libc::mmap(payload.cast(), n, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED | libc::MAP_FIXED, fd, 0)
    };
    if p == libc::MAP_FAILED {
        return Err(format!("mapping {n} shared bytes: {}", std::io::Error::last_os_error()));
    }
    Ok(())
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

    /// A shared buffer's handle maps the same pages (here in the same process, through
    /// /proc/self/fd like a peer would through /proc/<pid>/fd): stores show on both sides, views
    /// and mappings own nothing of the owner's canary checks; bad handles are errors naming why.
    #[test]
    fn shared_buffers_map_the_same_pages_and_bad_handles_are_errors() {
        let mut owner = GuardedBytes::shared(100).unwrap();
        assert!(GuardedBytes::zeroed(100).unwrap().export().is_none(), "private memory has no handle");
        let handle = owner.export().unwrap();
        owner.bytes_mut()[..4].copy_from_slice(&[1, 2, 3, 4]);
        let mut peer = GuardedBytes::open(&handle).unwrap();
        assert_eq!(&peer.bytes()[..4], &[1, 2, 3, 4]);
        assert_eq!(peer.address() % 16, 0);
        peer.bytes_mut()[99] = 7;
        assert_eq!(owner.bytes()[99], 7);
        let view = peer.view(96..100);
        assert_eq!(view.bytes(), &[0, 0, 0, 7]);
        assert_eq!(view.offset_of(view.address() + 4), Some(4), "faults past a view are attributed to it");
        assert_eq!((view.take_damage(), peer.take_damage(), owner.take_damage()), (None, None, None));
        drop(view);
        drop(owner);
        assert_eq!(peer.bytes()[99], 7, "a peer's mapping outlives the owner's buffer");

        let mut bad = handle;
        bad[0] ^= 1;
        assert!(GuardedBytes::open(&bad).err().unwrap().to_string().contains("not an emu IPC handle"));
        let mut dead = handle;
        dead[8..16].copy_from_slice(&(u32::MAX as u64 - 1).to_le_bytes());
        let e = GuardedBytes::open(&dead).err().unwrap().to_string();
        assert!(e.contains("/proc/4294967294/fd/") && e.contains("is process 4294967294 alive"), "{e}");
        let mut lying = handle;
        lying[24..32].copy_from_slice(&(1u64 << 40).to_le_bytes());
        assert!(GuardedBytes::open(&lying).err().unwrap().to_string().contains("claims"));
    }
}
