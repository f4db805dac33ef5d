//! Shared-memory transport: two chunk FIFOs (one per direction) in one POSIX shm segment.
//!
//! Why: ranks on one node should move bytes at memcpy speed, with the receiver reading the sender's
//! slot in place. Layout of a segment (all offsets from the mapping base, slots 64-byte aligned):
//!
//! ```text
//! [header line: magic, version, depth, chunk]
//! [fifo 0 control: head line | tail line | depth slot lengths]   lower rank -> higher rank
//! [fifo 1 control: head line | tail line | depth slot lengths]   higher rank -> lower rank
//! [fifo 0 slots: depth x stride] [fifo 1 slots: depth x stride]   (page aligned start)
//! ```
//!
//! Invariants: `head` is written only by the FIFO's sender, `tail` only by its receiver; `tail <= head
//! <= tail + depth`; a slot's bytes and length are written before `head` is bumped (Release) and read
//! after `head` is observed (Acquire), and a slot is reused only after `tail` moved past it. Waiters
//! spin briefly, then yield, then sleep on a cross-process futex with a short timeout so that the
//! operation deadline, the job abort flag and the peer's liveness are polled; a poster issues a wake
//! only when the counter's `sleepers` word says someone sleeps. Liveness is the authenticated TCP
//! stream the link was set up over (EOF when the peer process dies, even on SIGKILL) plus
//! `kill(pid, 0)`. The segment name is unlinked as soon as both sides mapped it, so a crash leaves
//! nothing in /dev/shm; the mapping is removed when both halves of the link are dropped.
//!
//! Lifetime: the creator (the lower rank) returns from link setup without waiting for the peer, so
//! it may drop the link before the peer has even opened the segment (a communicator dropped right
//! after its creation, a point-to-point send followed by a drop). The opener sets an attach flag
//! in the header (and wakes it as a futex) once mapped; the creator's drop of its last half waits
//! for that flag before removing the name, giving up only when the peer process is gone (setup
//! stream at EOF, pid gone), the job aborted, or the operation timeout passed since the drop
//! ([`Lingering`]). So a peer attaching late still maps the segment, reads whatever was posted,
//! then sees the creator's end closed; one that finds the name gone is told the creator removed it.

use std::ffi::CString;
use std::io;
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{AbortState, RecvLink, SendLink, Waiter};
use crate::error::{Error, Result};

/// Default slot size of a shared-memory FIFO.
pub const DEFAULT_SHM_CHUNK: usize = 512 * 1024;
/// Default number of slots of a shared-memory FIFO.
pub const DEFAULT_SHM_DEPTH: usize = 4;
/// Largest accepted slot size.
pub const MAX_SHM_CHUNK: usize = 1 << 30;
/// Largest accepted number of slots.
pub const MAX_SHM_DEPTH: usize = 1024;

const MAGIC: u64 = u64::from_le_bytes(*b"MTSHMSEG");
const VERSION: u32 = 2;
const LINE: usize = 64;
const PAGE: usize = 4096;
/// Busy polls before yielding the CPU (a few microseconds).
const SPIN_ROUNDS: u32 = 256;
/// How long to keep yielding the CPU before sleeping on the futex: longer than a typical chunk copy
/// (~50 us for 512 KiB), so a streaming receiver rarely needs a futex wake, yet short enough that an
/// idle waiter soon stops competing with oversubscribed ranks for the CPU.
const YIELD_FOR: Duration = Duration::from_micros(200);
/// Longest futex sleep; bounds how late a deadline, an abort or a dead peer is noticed.
const FUTEX_SLEEP: Duration = Duration::from_millis(2);
/// How often a sleeping waiter checks the peer's liveness.
const LIVENESS_PERIOD: Duration = Duration::from_millis(5);

/// First cache line of a segment; lets the opener check it maps what the creator built.
#[repr(C)]
struct SegmentHeader {
    magic: u64,
    version: u32,
    depth: u32,
    chunk: u64,
    /// Set to 1 by the opener once it mapped the segment (zero from ftruncate until then).
    attached: AtomicU32,
}

/// A FIFO counter on its own cache line, with the 32-bit futex word sleepers wait on.
#[repr(C, align(64))]
struct Counter {
    /// Chunks posted (head) or released (tail) so far.
    value: AtomicU64,
    /// Low 32 bits of `value`, bumped after it; the futex word.
    wake_seq: AtomicU32,
    /// Number of processes sleeping (or about to sleep) on `wake_seq`.
    sleepers: AtomicU32,
}

impl Counter {
    /// Publishes `v` and wakes sleepers, if any.
    fn publish(&self, v: u64) {
        self.value.store(v, Ordering::Release);
        self.wake_seq.store(v as u32, Ordering::SeqCst);
        if self.sleepers.load(Ordering::SeqCst) > 0 {
            futex_wake(&self.wake_seq);
        }
    }
}

/// Byte offsets of the parts of a segment for a given chunk size and depth.
#[derive(Debug, Clone, Copy)]
struct Layout {
    chunk: usize,
    depth: usize,
    stride: usize,
    ctrl: [usize; 2],
    slots: [usize; 2],
    total: usize,
}

impl Layout {
    fn new(chunk: usize, depth: usize) -> Result<Layout> {
        if chunk == 0 || chunk > MAX_SHM_CHUNK || depth == 0 || depth > MAX_SHM_DEPTH {
            return Err(Error::InvalidArgument(format!(
                "shm FIFO chunk {chunk} (1..={MAX_SHM_CHUNK}) / depth {depth} (1..={MAX_SHM_DEPTH})"
            )));
        }
        let ctrl_len = 2 * LINE + round_up(depth * 8, LINE);
        let ctrl = [LINE, LINE + ctrl_len];
        let stride = round_up(chunk, LINE);
        let first_slot = round_up(ctrl[1] + ctrl_len, PAGE);
        let slots = [first_slot, first_slot + depth * stride];
        Ok(Layout {
            chunk,
            depth,
            stride,
            ctrl,
            slots,
            total: first_slot + 2 * depth * stride,
        })
    }
}

fn round_up(x: usize, to: usize) -> usize {
    x.div_ceil(to) * to
}

/// A mapped shm segment. Unmapped (and unlinked, if not done yet) on drop; the creating side's
/// drop first waits for the opener to attach ([`Linger`]).
pub(crate) struct Segment {
    base: *mut u8,
    /// Bytes mapped at `base`.
    map_len: usize,
    layout: Layout,
    name: CString,
    unlinked: AtomicBool,
    /// Set on the creating side by [`shm_link`]: what its drop waits for.
    linger: Option<Linger>,
}

/// How long the creating side of a link keeps the segment's name for a peer that has not mapped it
/// yet: until the peer attached, or its process is gone (setup stream at EOF, pid gone), or the job
/// aborts, or `limit` (the operation timeout) passed since the drop.
pub(crate) struct Lingering {
    /// The job-wide abort: once raised, nobody is waited for.
    pub abort: Arc<AbortState>,
    /// Longest wait, counted from the drop.
    pub limit: Duration,
}

/// [`Lingering`] with the peer it is about.
struct Linger {
    peer: usize,
    watch: Arc<PeerWatch>,
    abort: Arc<AbortState>,
    limit: Duration,
}

/// Longest futex sleep of a lingering drop between looks at the peer and the abort (the opener's
/// wake ends it at once).
const ATTACH_POLL: Duration = Duration::from_millis(1);

// SAFETY: the mapping is plain shared memory; all cross-thread access goes through the atomics of the
// FIFO protocol, and `base` stays valid until drop.
unsafe impl Send for Segment {}
// SAFETY: as above; `&Segment` only exposes atomics and raw slot pointers whose use the FIFO orders.
unsafe impl Sync for Segment {}

impl Segment {
    /// Creates and maps a new segment `name` (must not exist) for FIFOs of `depth` x `chunk` bytes.
    pub(crate) fn create(name: &str, chunk: usize, depth: usize) -> Result<Segment> {
        let layout = Layout::new(chunk, depth)?;
        let cname = shm_name(name)?;
        // SAFETY: `cname` is a valid NUL-terminated string; flags and mode are plain integers.
        let fd = unsafe {
            libc::shm_open(
                cname.as_ptr(),
                libc::O_CREAT | libc::O_EXCL | libc::O_RDWR,
                0o600 as libc::mode_t,
            )
        };
        if fd < 0 {
            return Err(Error::io(
                format!("shm_open(create) {name}"),
                io::Error::last_os_error(),
            ));
        }
        let seg = Self::map_fd(fd, name, cname, layout.total, layout, true);
        if let Ok(seg) = &seg {
            // SAFETY: the mapping is at least one page long and page aligned; nobody else has it yet.
            let header = unsafe { &mut *(seg.base as *mut SegmentHeader) };
            header.magic = MAGIC;
            header.version = VERSION;
            header.depth = depth as u32;
            header.chunk = chunk as u64;
        }
        seg
    }

    /// Maps the existing segment `name`, checks its header and marks it attached (which ends the
    /// creator's [`Linger`]).
    #[cfg(test)]
    pub(crate) fn open(name: &str) -> Result<Segment> {
        Self::try_open(name)?.ok_or_else(|| {
            Error::io(format!("shm_open {name}"), io::Error::from_raw_os_error(libc::ENOENT))
        })
    }

    /// As [`Segment::open`]; `None` when no segment has that name (its creator removed it, or
    /// never made it).
    pub(crate) fn try_open(name: &str) -> Result<Option<Segment>> {
        let cname = shm_name(name)?;
        // SAFETY: valid NUL-terminated name.
        let fd = unsafe { libc::shm_open(cname.as_ptr(), libc::O_RDWR, 0) };
        if fd < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENOENT) {
                return Ok(None);
            }
            return Err(Error::io(format!("shm_open {name}"), e));
        }
        // SAFETY: `fd` is open; `st` is a plain struct filled by fstat.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { libc::fstat(fd, &mut st) } != 0 {
            let e = io::Error::last_os_error();
            // SAFETY: closing the fd we opened.
            unsafe { libc::close(fd) };
            return Err(Error::io(format!("fstat shm {name}"), e));
        }
        let size = st.st_size as usize;
        if size < PAGE {
            // SAFETY: closing the fd we opened.
            unsafe { libc::close(fd) };
            return Err(Error::InvalidArgument(format!(
                "shm segment {name} is only {size} bytes"
            )));
        }
        let placeholder = Layout::new(1, 1)?;
        let mut seg = Self::map_fd(fd, name, cname, size, placeholder, false)?;
        // SAFETY: the mapping is at least one page; the creator wrote the header before sending us the
        // setup message that made us open it.
        let header = unsafe { &*(seg.base as *const SegmentHeader) };
        if header.magic != MAGIC || header.version != VERSION {
            return Err(Error::InvalidArgument(format!(
                "shm segment {name}: bad magic or version"
            )));
        }
        let layout = Layout::new(header.chunk as usize, header.depth as usize)?;
        if layout.total != size {
            return Err(Error::InvalidArgument(format!(
                "shm segment {name}: size {size} does not match chunk {} x depth {}",
                layout.chunk, layout.depth
            )));
        }
        seg.layout = layout;
        header.attached.store(1, Ordering::Release);
        futex_wake(&header.attached);
        Ok(Some(seg))
    }

    fn map_fd(
        fd: i32,
        name: &str,
        cname: CString,
        len: usize,
        layout: Layout,
        create: bool,
    ) -> Result<Segment> {
        let fail = |what: &str, e: io::Error, cname: &CString| {
            // SAFETY: closing our fd; unlinking the name we created.
            unsafe {
                libc::close(fd);
                if create {
                    libc::shm_unlink(cname.as_ptr());
                }
            }
            Error::io(format!("{what} shm {name}"), e)
        };
        // SAFETY: `fd` is an open shm object we own.
        if create && unsafe { libc::ftruncate(fd, len as libc::off_t) } != 0 {
            return Err(fail("ftruncate", io::Error::last_os_error(), &cname));
        }
        // SAFETY: mapping `len` bytes of a shm object of at least that size, shared read/write.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(fail("mmap", io::Error::last_os_error(), &cname));
        }
        // SAFETY: the mapping keeps the object alive; the fd is no longer needed.
        unsafe { libc::close(fd) };
        Ok(Segment {
            base: base as *mut u8,
            map_len: len,
            layout,
            name: cname,
            unlinked: AtomicBool::new(false),
            linger: None,
        })
    }

    /// Removes the segment's name (idempotent); the mapping stays valid.
    pub(crate) fn unlink(&self) {
        if !self.unlinked.swap(true, Ordering::AcqRel) {
            // SAFETY: valid NUL-terminated name; ENOENT (the peer unlinked first) is fine.
            unsafe { libc::shm_unlink(self.name.as_ptr()) };
        }
    }

    /// True once the opener mapped the segment.
    fn attached(&self) -> bool {
        self.attach_word().load(Ordering::Acquire) != 0
    }

    /// The header's attach flag (a futex word the opener wakes).
    fn attach_word(&self) -> &AtomicU32 {
        // SAFETY: the header is the mapping's first line, valid until drop; `attached` is only
        // accessed atomically.
        let header = unsafe { &*(self.base as *const SegmentHeader) };
        &header.attached
    }

    /// The creating side's drop: waits (see [`Lingering`]) until the peer mapped the segment, so
    /// that removing the name never races the peer's `shm_open`.
    fn await_attach(&self, l: &Linger) {
        let give_up = Instant::now() + l.limit;
        let why = loop {
            if self.attached() {
                return;
            }
            if l.abort.is_set() {
                break "the job is aborting".to_string();
            }
            if let Err(cause) = l.watch.check() {
                break cause;
            }
            if Instant::now() >= give_up {
                break format!("not attached {:.1} s after the link was dropped", l.limit.as_secs_f64());
            }
            futex_wait(self.attach_word(), 0, ATTACH_POLL);
        };
        log::debug!(
            "transport: shm link to rank {} dropped before rank {} mapped it; removing it ({why})",
            l.peer,
            l.peer
        );
    }

    /// Slot size of the FIFOs in this segment.
    pub(crate) fn chunk(&self) -> usize {
        self.layout.chunk
    }

    /// Number of slots of each FIFO in this segment.
    pub(crate) fn depth(&self) -> usize {
        self.layout.depth
    }

    fn counter(&self, fifo: usize, tail: bool) -> &Counter {
        let off = self.layout.ctrl[fifo] + if tail { LINE } else { 0 };
        // SAFETY: in bounds and 64-byte aligned by `Layout`; the memory is zero-initialised by
        // ftruncate, a valid `Counter`; only accessed through atomics.
        unsafe { &*(self.base.add(off) as *const Counter) }
    }

    fn slot_len(&self, fifo: usize, slot: usize) -> &AtomicU64 {
        let off = self.layout.ctrl[fifo] + 2 * LINE + slot * 8;
        // SAFETY: in bounds (slot < depth) and 8-byte aligned by `Layout`; accessed only atomically.
        unsafe { &*(self.base.add(off) as *const AtomicU64) }
    }

    fn slot_ptr(&self, fifo: usize, slot: usize) -> *mut u8 {
        // SAFETY: slot < depth, so the offset is inside the mapping.
        unsafe { self.base.add(self.layout.slots[fifo] + slot * self.layout.stride) }
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        if let Some(l) = self.linger.take() {
            self.await_attach(&l);
        }
        self.unlink();
        // SAFETY: unmapping exactly the region mapped in `map_fd`; no references outlive `self`
        // because every user holds an `Arc<Segment>`.
        unsafe { libc::munmap(self.base as *mut libc::c_void, self.map_len) };
    }
}

fn shm_name(name: &str) -> Result<CString> {
    if !name.starts_with('/') || name[1..].contains('/') || name.len() > 250 {
        return Err(Error::InvalidArgument(format!("bad shm segment name {name:?}")));
    }
    CString::new(name).map_err(|_| Error::InvalidArgument(format!("shm segment name {name:?} contains NUL")))
}

/// Watches whether the peer process is alive: the link's TCP stream must not be at EOF and the pid
/// must exist.
pub(crate) struct PeerWatch {
    stream: TcpStream,
    pid: Option<libc::pid_t>,
}

impl PeerWatch {
    /// Watches `stream` and process `pid` (0: unknown). A pid that does not exist right now (another
    /// pid namespace) is not used.
    pub(crate) fn new(stream: TcpStream, pid: u32) -> PeerWatch {
        let pid = (pid != 0)
            .then_some(pid as libc::pid_t)
            .filter(|&p| process_exists(p));
        PeerWatch { stream, pid }
    }

    /// `Err(cause)` once the peer is known to be gone.
    pub(crate) fn check(&self) -> std::result::Result<(), String> {
        let mut byte = 0u8;
        // SAFETY: peeking one byte into a local buffer on a socket we own; never blocks.
        let n = unsafe {
            libc::recv(
                self.stream.as_raw_fd(),
                &mut byte as *mut u8 as *mut libc::c_void,
                1,
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        if n == 0 {
            return Err("peer process died or closed the link (setup stream at EOF)".into());
        }
        if n < 0 {
            let e = io::Error::last_os_error();
            if !matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted) {
                return Err(format!("peer process died (setup stream: {e})"));
            }
        }
        if let Some(pid) = self.pid {
            if !process_exists(pid) {
                return Err(format!("peer process died (pid {pid} no longer exists)"));
            }
        }
        Ok(())
    }
}

fn process_exists(pid: libc::pid_t) -> bool {
    // SAFETY: signal 0 only checks for existence and permission.
    let r = unsafe { libc::kill(pid, 0) };
    r == 0 || io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// Rate-limits liveness checks of one half of a link.
struct Liveness {
    peer: usize,
    watch: Arc<PeerWatch>,
    next_check: Instant,
}

impl Liveness {
    /// Waits until `ready()` holds: spin, yield, then futex sleeps on `ctr` while polling the waiter
    /// and the peer.
    fn wait_until(&mut self, ctr: &Counter, ready: impl Fn() -> bool, w: &Waiter) -> Result<()> {
        for _ in 0..SPIN_ROUNDS {
            if ready() {
                return Ok(());
            }
            std::hint::spin_loop();
        }
        let yield_until = Instant::now() + YIELD_FOR;
        while Instant::now() < yield_until {
            if ready() {
                return Ok(());
            }
            std::thread::yield_now();
        }
        loop {
            if ready() {
                return Ok(());
            }
            w.check(self.peer)?;
            let now = Instant::now();
            if now >= self.next_check {
                self.next_check = now + LIVENESS_PERIOD;
                self.watch.check().map_err(|cause| w.fail(self.peer, cause))?;
            }
            ctr.sleepers.fetch_add(1, Ordering::SeqCst);
            let seen = ctr.wake_seq.load(Ordering::SeqCst);
            if !ready() {
                futex_wait(&ctr.wake_seq, seen, FUTEX_SLEEP);
            }
            ctr.sleepers.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `word` is a valid aligned u32 in a shared mapping (hence no FUTEX_PRIVATE_FLAG); the
    // kernel only reads it. Spurious returns (EAGAIN, EINTR, ETIMEDOUT) are handled by the caller's loop.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
        );
    }
}

fn futex_wake(word: &AtomicU32) {
    // SAFETY: waking waiters on a valid futex word; no memory is accessed besides the word's address.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX);
    }
}

/// Builds the two halves of a shared-memory link over `seg`. The lower rank of the pair sends on FIFO
/// 0; the higher rank sends on FIFO 1. The side that created the segment passes `linger`: dropping
/// its last half then waits for the peer to have mapped the segment before removing its name.
pub(crate) fn shm_link(
    mut seg: Segment,
    is_lower: bool,
    peer: usize,
    watch: PeerWatch,
    linger: Option<Lingering>,
) -> (ShmSend, ShmRecv) {
    let watch = Arc::new(watch);
    seg.linger = linger.map(|l| Linger { peer, watch: watch.clone(), abort: l.abort, limit: l.limit });
    let seg = Arc::new(seg);
    let (tx, rx) = if is_lower { (0, 1) } else { (1, 0) };
    let live = || Liveness {
        peer,
        watch: watch.clone(),
        next_check: Instant::now(),
    };
    let send = ShmSend {
        seg: seg.clone(),
        fifo: tx,
        head: 0,
        reserved: None,
        live: live(),
    };
    let recv = ShmRecv {
        seg,
        fifo: rx,
        tail: 0,
        current: false,
        live: live(),
    };
    (send, recv)
}

/// Sending half of a shared-memory link.
pub struct ShmSend {
    seg: Arc<Segment>,
    fifo: usize,
    /// Local copy of the FIFO's head (only this half writes it).
    head: u64,
    /// Length asked for by the last `reserve` not yet posted.
    reserved: Option<usize>,
    live: Liveness,
}

impl SendLink for ShmSend {
    fn reserve(&mut self, len: usize, w: &Waiter) -> Result<&mut [u8]> {
        let (chunk, depth) = (self.seg.chunk(), self.seg.depth() as u64);
        if len > chunk {
            return Err(Error::InvalidArgument(format!(
                "shm reserve of {len} bytes > chunk {chunk}"
            )));
        }
        let tail = self.seg.counter(self.fifo, true);
        let head = self.head;
        self.live
            .wait_until(tail, || head - tail.value.load(Ordering::Acquire) < depth, w)?;
        self.reserved = Some(len);
        let ptr = self.seg.slot_ptr(self.fifo, (head % depth) as usize);
        // SAFETY: the slot is free (tail passed it) so the receiver no longer reads it; it stays ours
        // until `post`; `len <= chunk <= stride` keeps it in bounds; `&mut self` prevents aliasing.
        Ok(unsafe { std::slice::from_raw_parts_mut(ptr, len) })
    }

    fn post(&mut self, len: usize, _w: &Waiter) -> Result<()> {
        match self.reserved.take() {
            Some(r) if len <= r => {}
            r => {
                self.reserved = r;
                return Err(Error::InvalidArgument(format!(
                    "shm post of {len} bytes after reserve of {r:?}"
                )));
            }
        }
        let slot = (self.head % self.seg.depth() as u64) as usize;
        self.seg
            .slot_len(self.fifo, slot)
            .store(len as u64, Ordering::Relaxed);
        self.head += 1;
        self.seg.counter(self.fifo, false).publish(self.head);
        Ok(())
    }

    fn max_chunk(&self) -> usize {
        self.seg.chunk()
    }

    fn depth(&self) -> usize {
        self.seg.depth()
    }
}

/// Receiving half of a shared-memory link.
pub struct ShmRecv {
    seg: Arc<Segment>,
    fifo: usize,
    /// Local copy of the FIFO's tail (only this half writes it).
    tail: u64,
    /// True between `wait` and `release`.
    current: bool,
    live: Liveness,
}

impl RecvLink for ShmRecv {
    fn wait(&mut self, w: &Waiter) -> Result<&[u8]> {
        let depth = self.seg.depth() as u64;
        let head = self.seg.counter(self.fifo, false);
        let tail = self.tail;
        self.live
            .wait_until(head, || head.value.load(Ordering::Acquire) > tail, w)?;
        let slot = (tail % depth) as usize;
        let len = self.seg.slot_len(self.fifo, slot).load(Ordering::Relaxed) as usize;
        if len > self.seg.chunk() {
            return Err(w.fail(
                self.live.peer,
                format!("shm protocol error: chunk of {len} bytes"),
            ));
        }
        self.current = true;
        // SAFETY: head > tail, so the sender finished writing this slot (Acquire above pairs with its
        // Release) and will not touch it until we bump tail in `release`; `len <= chunk` is in bounds.
        Ok(unsafe { std::slice::from_raw_parts(self.seg.slot_ptr(self.fifo, slot), len) })
    }

    fn release(&mut self, _w: &Waiter) -> Result<()> {
        if !std::mem::take(&mut self.current) {
            return Err(Error::InvalidArgument(
                "shm release without a waited chunk".into(),
            ));
        }
        self.tail += 1;
        self.seg.counter(self.fifo, true).publish(self.tail);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::test_util::{both_directions, dead_peer_reported_after_data, deadline_is_a_timeout, drain_check, pump, stream_pair, waiter};
    use std::sync::atomic::AtomicUsize;

    static NEXT: AtomicUsize = AtomicUsize::new(0);

    /// A unique segment name for this test process.
    fn unique_name() -> String {
        format!(
            "/mt-shmtest-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        )
    }

    /// Both halves of a link pair mapped in this process; the name is already unlinked.
    fn pair(chunk: usize, depth: usize) -> ((ShmSend, ShmRecv), (ShmSend, ShmRecv)) {
        let name = unique_name();
        let lower = Segment::create(&name, chunk, depth).expect("create");
        let higher = Segment::open(&name).expect("open");
        higher.unlink();
        assert!(
            !std::path::Path::new(&format!("/dev/shm{name}")).exists(),
            "name left in /dev/shm"
        );
        let (a, b) = stream_pair();
        let me = std::process::id();
        (
            shm_link(lower, true, 1, PeerWatch::new(a, me), None),
            shm_link(higher, false, 0, PeerWatch::new(b, me), None),
        )
    }

    #[test]
    fn fifo_delivers_every_byte_in_order() {
        let ((mut send, _lr), (_hs, mut recv)) = pair(4096, 3);
        let w = waiter(0, 30);
        let n = 3000;
        std::thread::scope(|s| {
            s.spawn(|| pump(&mut send, 1, n, &waiter(0, 30)));
            drain_check(&mut recv, 1, n, 4096, &w);
        });
    }

    #[test]
    fn both_directions_at_once() {
        let ((mut ls, mut lr), (mut hs, mut hr)) = pair(1000, 2);
        both_directions((&mut ls, &mut lr), (&mut hs, &mut hr), 2000, 1000);
    }

    #[test]
    fn dead_peer_is_reported_after_posted_data() {
        let ((send, lr), (hs, mut recv)) = pair(256, 4);
        dead_peer_reported_after_data(send, lr, &mut recv, 3, 256, "peer process died");
        drop(hs);
    }

    #[test]
    fn full_fifo_with_dead_receiver_fails_reserve() {
        let ((mut send, _lr), (hs, hr)) = pair(64, 2);
        let w = waiter(0, 60);
        pump(&mut send, 5, 2, &w);
        drop((hs, hr));
        match send.reserve(1, &w) {
            Err(Error::Comm { peer: 1, .. }) => {}
            other => panic!(
                "expected a Comm error naming peer 1, got {:?}",
                other.map(|b| b.len())
            ),
        }
    }

    #[test]
    fn deadline_expiry_is_a_timeout() {
        let ((_ls, _lr), (_hs, mut recv)) = pair(64, 2);
        deadline_is_a_timeout(&mut recv);
    }

    #[test]
    fn misuse_is_rejected() {
        let ((mut send, _lr), (_hs, mut recv)) = pair(64, 2);
        let w = waiter(0, 10);
        assert!(matches!(send.reserve(65, &w), Err(Error::InvalidArgument(_))));
        assert!(matches!(send.post(1, &w), Err(Error::InvalidArgument(_))));
        send.reserve(8, &w).expect("reserve");
        assert!(matches!(send.post(9, &w), Err(Error::InvalidArgument(_))));
        assert!(matches!(recv.release(&w), Err(Error::InvalidArgument(_))));
        assert!(Segment::create("no-slash", 64, 2).is_err());
    }
}
