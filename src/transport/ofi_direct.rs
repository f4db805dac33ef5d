//! Device-direct transfers on a libfabric link: a device buffer (CUDA, ROCr, or host memory that
//! plays the device) registered with FI_HMEM and posted as tagged messages itself, so device
//! send/recv between nodes skip the copy through pinned host memory.
//!
//! Why here: the chunk FIFO of a link ([`super::ofi`]) owns its host buffers; a device buffer
//! belongs to the caller, so it travels beside the FIFO, on the same endpoint and peer address.
//!
//! Agreement: at link setup each side sends one capability byte ([`CAP_HMEM`]: its endpoint was
//! opened with FI_HMEM; [`CAP_ALLOWED`]: `MESHTRAIN_GPU_DIRECT` is not `off`; [`CAP_FORCED`]: it
//! is `on`). [`DirectPeer::choice`] depends only on the two bytes, so both ends of a link choose
//! the same path. (The buffer's memory interface follows the device kind, which comes from the
//! job's configuration and is the same on every rank.)
//!
//! Wire: the receiver's direct key is a receive key of its own (taken from the same counter as the
//! chunk FIFOs' keys), so direct messages live in a tag space no chunk ever uses. A transfer of
//! `len` bytes is `max(1, ceil(len / DIRECT_MSG))` messages, message `s` of the direction tagged
//! `key << SEQ_BITS | s mod 2^SEQ_BITS`; every receive matches exactly one tag from exactly the
//! peer's address, and a completion with another tag or length is an error naming the peer (a
//! stray message is never data). A call may run several legs at once (a ring hop: the send to
//! one neighbour and the receive from the other), each with its own sequence numbers and window.
//! At most [`WINDOW`] messages per leg are posted at a time; every wait
//! checks the deadline, the job-wide abort and the peer's liveness. A call returns only when all
//! its operations completed; on an error it cancels and drains them first (leaking their contexts
//! if the provider never lets go, so that no completion can land in freed memory).

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::ofi::{Waits, DRAIN_LIMIT, SEQ_MASK};
use super::ofi_ep::{iface_name, DeviceMr, Endpoint, OpSlot, BUSY};
use super::ofi_sys as sys;
use super::Waiter;
use crate::error::Result;

/// The sender's endpoint was opened with FI_HMEM.
pub(crate) const CAP_HMEM: u8 = 1;
/// `MESHTRAIN_GPU_DIRECT` is `auto` or `on` on the sender.
pub(crate) const CAP_ALLOWED: u8 = 2;
/// `MESHTRAIN_GPU_DIRECT=on` on the sender.
pub(crate) const CAP_FORCED: u8 = 4;

/// Largest single direct message (a window of them keeps the NIC busy while each completes).
const DIRECT_MSG: usize = 1 << 20;
/// Direct messages posted at once per transfer.
const WINDOW: usize = 8;

/// Memory interface of a buffer to register.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemIface {
    /// Host memory (the emu and CPU arms).
    System,
    /// CUDA device memory of the GPU with this ordinal.
    Cuda(usize),
    /// ROCr (HIP) device memory.
    Rocr,
}

impl MemIface {
    fn raw(self) -> (sys::fi_hmem_iface, i32) {
        match self {
            MemIface::System => (sys::fi_hmem_iface_FI_HMEM_SYSTEM, 0),
            MemIface::Cuda(ordinal) => (sys::fi_hmem_iface_FI_HMEM_CUDA, ordinal as i32),
            MemIface::Rocr => (sys::fi_hmem_iface_FI_HMEM_ROCR, 0),
        }
    }

    /// libfabric's name of the interface.
    pub fn name(self) -> &'static str {
        iface_name(self.raw().0)
    }
}

/// A registered range of memory; the registration is closed on drop.
pub struct DirectMr {
    ep: Arc<Endpoint>,
    mr: Option<DeviceMr>,
    addr: *mut u8,
    len: usize,
}

// SAFETY: the registration is only used through the endpoint's locked calls; `addr` is the
// caller's memory, which the caller keeps alive while the registration exists (see `register`).
unsafe impl Send for DirectMr {}

impl Drop for DirectMr {
    fn drop(&mut self) {
        if let Some(mr) = self.mr.take() {
            self.ep.close_mr(mr);
        }
    }
}

impl DirectMr {
    fn desc(&self) -> *mut std::os::raw::c_void {
        self.mr.as_ref().map_or(std::ptr::null_mut(), |m| m.desc)
    }
}

/// The device-direct side of one libfabric link (see the module header).
pub struct DirectPeer {
    waits: Waits,
    addr: u64,
    /// The peer's direct key, shifted into place (tags of messages to the peer).
    send_base: u64,
    /// This side's direct key, shifted into place (tags of messages from the peer).
    recv_base: u64,
    /// Next message sequence number to the peer and from the peer.
    seqs: Mutex<(u64, u64)>,
    mine: u8,
    theirs: u8,
}

impl DirectPeer {
    pub(crate) fn new(waits: Waits, addr: u64, send_base: u64, recv_base: u64, mine: u8, theirs: u8) -> DirectPeer {
        DirectPeer { waits, addr, send_base, recv_base, seqs: Mutex::new((0, 0)), mine, theirs }
    }

    /// The libfabric provider carrying the link.
    pub fn provider(&self) -> &str {
        &self.waits.ep.info().provider
    }

    /// `Ok` when device transfers on this link go direct, else why they are staged. The same on
    /// both ends (it depends only on the two capability bytes).
    pub fn choice(&self) -> std::result::Result<(), String> {
        choose(self.mine, self.theirs, self.waits.peer, self.provider())
    }

    /// Whether either end has `MESHTRAIN_GPU_DIRECT=on` (a staged choice is then an error).
    pub fn forced(&self) -> bool {
        (self.mine | self.theirs) & CAP_FORCED != 0
    }

    /// Registers `len` bytes at `addr` of `iface` on the link's endpoint. The caller keeps the
    /// memory allocated while the returned registration exists.
    pub fn register(&self, addr: *mut u8, len: usize, iface: MemIface) -> Result<DirectMr> {
        let (raw, device) = iface.raw();
        // A zero-length registration is refused by some providers; one byte of any allocation is
        // valid, and an empty buffer never moves data.
        let mr = self.waits.ep.register(addr, len.max(1), raw, device)?;
        Ok(DirectMr { ep: self.waits.ep.clone(), mr: Some(mr), addr, len })
    }

    /// Sends `len` bytes at `at` (the start of `mr`'s memory, for reading) to the peer.
    pub fn send(&self, mr: &DirectMr, at: *const u8, len: usize, w: &Waiter) -> Result<()> {
        direct_transfer(&[DirectLeg { link: self, mr, offset: (at as usize).wrapping_sub(mr.addr as usize), len, send: true }], w)
    }

    /// Receives exactly `len` bytes from the peer into `at` (the start of `mr`'s memory, for
    /// writing).
    pub fn recv(&self, mr: &DirectMr, at: *mut u8, len: usize, w: &Waiter) -> Result<()> {
        direct_transfer(&[DirectLeg { link: self, mr, offset: (at as usize).wrapping_sub(mr.addr as usize), len, send: false }], w)
    }

    /// The first sequence number of `messages` new messages in one direction.
    fn reserve(&self, send: bool, messages: usize) -> u64 {
        let mut seqs = self.seqs.lock().unwrap_or_else(|e| e.into_inner());
        let next = if send { &mut seqs.0 } else { &mut seqs.1 };
        let first = *next;
        *next += messages as u64;
        first
    }
}

/// One direction of a direct transfer: `len` bytes at `offset` into `mr`'s memory, sent to
/// (`send`) or received from the link's peer.
pub struct DirectLeg<'a> {
    /// The link to the peer.
    pub link: &'a DirectPeer,
    /// The registration of the memory the bytes are in.
    pub mr: &'a DirectMr,
    /// Start of the bytes, from the registration's start.
    pub offset: usize,
    /// Bytes moved.
    pub len: usize,
    /// Sent to the peer (else received from it).
    pub send: bool,
}

/// Runs every leg at once (a ring step: the send to one neighbour and the receive from the
/// other), each with its own window of posted messages, and returns when all completed. Posting
/// every leg's first window before waiting on any keeps a ring of such calls deadlock-free.
pub fn direct_transfer(legs: &[DirectLeg], w: &Waiter) -> Result<()> {
    let mut active = Vec::with_capacity(legs.len());
    for leg in legs {
        if leg.offset.checked_add(leg.len).is_none_or(|end| end > leg.mr.len) {
            let why = format!("direct transfer of {} bytes at offset {} outside its {}-byte registration", leg.len, leg.offset, leg.mr.len);
            return Err(w.fail(leg.link.waits.peer, why));
        }
        let messages = leg.len.div_ceil(DIRECT_MSG).max(1);
        let first = leg.link.reserve(leg.send, messages);
        let ops = (0..WINDOW.min(messages)).map(|_| OpSlot::new()).collect();
        active.push(Active { leg, first, messages, posted: Posted { ep: leg.link.waits.ep.clone(), ops } });
    }
    let most = active.iter().map(|a| a.messages).max().unwrap_or(0);
    for m in 0..most {
        for a in active.iter().filter(|a| m < a.messages) {
            if m >= a.window() {
                a.finish(m - a.window(), w)?;
            }
            a.post(m, w)?;
        }
    }
    for a in &active {
        for m in a.messages.saturating_sub(a.window())..a.messages {
            a.finish(m, w)?;
        }
    }
    Ok(())
}

/// A leg in flight: its messages' first sequence number and the contexts of its window.
struct Active<'a> {
    leg: &'a DirectLeg<'a>,
    first: u64,
    messages: usize,
    posted: Posted,
}

impl Active<'_> {
    fn window(&self) -> usize {
        self.posted.ops.len()
    }

    fn tag(&self, m: usize) -> u64 {
        let base = if self.leg.send { self.leg.link.send_base } else { self.leg.link.recv_base };
        base | ((self.first + m as u64) & SEQ_MASK)
    }

    /// Bytes of message `m`, relative to the leg's offset.
    fn piece(&self, m: usize) -> std::ops::Range<usize> {
        m * DIRECT_MSG..((m + 1) * DIRECT_MSG).min(self.leg.len)
    }

    fn post(&self, m: usize, w: &Waiter) -> Result<()> {
        let (leg, op, r) = (self.leg, &self.posted.ops[m % self.window()], self.piece(m));
        // SAFETY: `offset + r` lies within the registered `len` bytes (checked in
        // `direct_transfer`); the memory stays valid until every operation completed
        // (`direct_transfer` waits, or `Posted` drains).
        let at = unsafe { leg.mr.addr.add(leg.offset + r.start) };
        let (ep, addr) = (&leg.link.waits.ep, leg.link.addr);
        let posted = if leg.send {
            ep.send_raw(op, at, r.len(), leg.mr.desc(), addr, self.tag(m))
        } else {
            ep.recv_raw(op, at, r.len(), leg.mr.desc(), addr, self.tag(m))
        };
        posted.map_err(|e| w.fail(leg.link.waits.peer, e.to_string()))
    }

    fn finish(&self, m: usize, w: &Waiter) -> Result<()> {
        let op = &self.posted.ops[m % self.window()];
        let link = self.leg.link;
        link.waits.until_idle(op, w)?;
        let (got_tag, got_len) = (op.tag.load(Ordering::Relaxed), op.len.load(Ordering::Relaxed));
        let (tag, len) = (self.tag(m), self.piece(m).len());
        if !self.leg.send && (got_tag != tag || got_len != len) {
            let why = format!("stray libfabric message on the device-direct path: tag {got_tag:#x} ({got_len} bytes), expected {tag:#x} ({len} bytes)");
            return Err(w.fail(link.waits.peer, why));
        }
        Ok(())
    }
}

/// The path for capability bytes `mine` and `theirs` (symmetric in them: both ends of a link get
/// the same answer); `Err` says why the link stages.
fn choose(mine: u8, theirs: u8, peer: usize, provider: &str) -> std::result::Result<(), String> {
    let both = |bit: u8| mine & theirs & bit != 0;
    if !both(CAP_ALLOWED) {
        return Err(format!("MESHTRAIN_GPU_DIRECT=off on this rank or rank {peer}"));
    }
    if !both(CAP_HMEM) {
        return Err(format!("provider {provider} does not offer FI_HMEM on this rank or rank {peer}"));
    }
    Ok(())
}

/// The operation contexts of one transfer; on drop, cancels what is still posted and waits for it,
/// leaking the contexts if the provider does not let go in time.
struct Posted {
    ep: Arc<Endpoint>,
    ops: Vec<OpSlot>,
}

impl Posted {
    fn busy(&self) -> bool {
        self.ops.iter().any(|o| o.state.load(Ordering::Acquire) == BUSY)
    }
}

impl Drop for Posted {
    fn drop(&mut self) {
        if !self.busy() {
            return;
        }
        self.ops.iter().filter(|o| o.state.load(Ordering::Acquire) == BUSY).for_each(|o| self.ep.cancel(o));
        let give_up = Instant::now() + DRAIN_LIMIT;
        while self.busy() && Instant::now() < give_up && self.ep.progress().is_ok() {
            std::thread::yield_now();
        }
        if self.busy() {
            log::warn!("ofi: device-direct transfer failed with operations still posted; leaking their contexts");
            std::mem::forget(std::mem::take(&mut self.ops));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_ends_choose_the_same_path_for_every_pair_of_capability_bytes() {
        let all = CAP_HMEM | CAP_ALLOWED | CAP_FORCED;
        for a in 0..=all {
            for b in 0..=all {
                let direct = choose(a, b, 1, "p").is_ok();
                assert_eq!(direct, choose(b, a, 0, "p").is_ok(), "caps {a:#b} / {b:#b}");
                let want = a & b & CAP_HMEM != 0 && a & b & CAP_ALLOWED != 0;
                assert_eq!(direct, want, "caps {a:#b} / {b:#b}");
            }
        }
        let why = choose(CAP_HMEM | CAP_ALLOWED, CAP_ALLOWED, 3, "tcp;ofi_rxm").unwrap_err();
        assert_eq!(why, "provider tcp;ofi_rxm does not offer FI_HMEM on this rank or rank 3");
        let why = choose(CAP_HMEM | CAP_ALLOWED, CAP_HMEM, 2, "shm").unwrap_err();
        assert_eq!(why, "MESHTRAIN_GPU_DIRECT=off on this rank or rank 2");
    }
}
