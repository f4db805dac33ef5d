//! Transports: how bytes move between two ranks.
//!
//! A link between two ranks is a pair of one-directional chunk FIFOs ([`SendLink`], [`RecvLink`]).
//! A sender reserves a slot, fills it in place and posts it; the receiver waits for the next chunk,
//! reads it in place and releases it. Exposing slots (instead of `send(&[u8])`) lets the collective
//! primitives fuse work: `recv_reduce_send` reads the incoming slot and the local buffer and writes the
//! sum straight into the outgoing slot, with no staging copy on shared memory.
//!
//! Invariants every transport keeps:
//! - chunks arrive in the order they were posted, each with the length it was posted with;
//! - a slot returned by `reserve`/`wait` stays valid until the matching `post`/`release`;
//! - at most [`SendLink::depth`] chunks are in flight; `reserve` blocks (through a [`Waiter`]) until
//!   the receiver has released one, so a ring of links can never deadlock on buffer space;
//! - every blocking call polls [`Waiter::check`] and the peer's liveness, so a dead peer, a deadline or
//!   a job-wide abort turns into an `Error` naming the peer instead of a hang.
//!
//! Which transport carries a pair is decided by [`LinkKind`]: shared memory for ranks on one node,
//! TCP otherwise or when `MESHTRAIN_TRANSPORT=tcp`, libfabric ([`ofi`]) when asked for or when a
//! fabric NIC is present. A
//! shared-memory link also offers [`PeerMemory`] ([`cma`]): single-copy reads of the peer's
//! buffers, for protocols that announce a buffer over the FIFO instead of copying it through.

mod accept;
pub mod cma;
pub mod handshake;
pub mod net;
pub mod ofi;
#[cfg(feature = "ofi")]
mod ofi_direct;
#[cfg(feature = "ofi")]
mod ofi_ep;
pub mod select;
pub mod shm;
pub mod tcp;
#[cfg(feature = "ofi")]
mod ofi_sys;
#[cfg(test)]
mod test_util;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
pub use cma::PeerMemory;
#[cfg(feature = "ofi")]
pub use ofi_direct::{direct_transfer, DirectLeg, DirectMr, DirectPeer, MemIface};

/// Which transport carries a link.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkKind {
    /// Shared-memory FIFO (both ranks on one node).
    Shm,
    /// TCP stream.
    Tcp,
    /// libfabric tagged messages.
    Ofi,
}

/// The sending half of a link to one peer.
pub trait SendLink: Send {
    /// Returns a writable slot of at least `len` bytes (`len <= max_chunk()`), blocking until one is
    /// free. The slot's contents are unspecified.
    fn reserve(&mut self, len: usize, w: &Waiter) -> Result<&mut [u8]>;
    /// Publishes the first `len` bytes of the slot returned by the last `reserve`.
    fn post(&mut self, len: usize, w: &Waiter) -> Result<()>;
    /// Largest chunk this link carries in one slot.
    fn max_chunk(&self) -> usize;
    /// Number of chunks that may be in flight before `reserve` blocks.
    fn depth(&self) -> usize;
    /// The link's device-direct path (libfabric links only): device buffers posted as they are.
    #[cfg(feature = "ofi")]
    fn direct(&self) -> Option<Arc<DirectPeer>> {
        None
    }
}

/// The receiving half of a link from one peer.
pub trait RecvLink: Send {
    /// Waits for the next chunk and returns its bytes (exactly as many as were posted).
    fn wait(&mut self, w: &Waiter) -> Result<&[u8]>;
    /// Frees the chunk returned by the last `wait`, making its slot available to the sender.
    fn release(&mut self, w: &Waiter) -> Result<()>;
}

/// Both directions of a connection with one peer.
pub struct Link {
    /// World rank of the peer.
    pub peer: usize,
    /// Transport carrying this link.
    pub kind: LinkKind,
    /// Outgoing FIFO.
    pub send: Box<dyn SendLink>,
    /// Incoming FIFO.
    pub recv: Box<dyn RecvLink>,
    /// Direct read access to the peer's memory, when the transport offers it (shared memory with a
    /// known peer pid). Whether reads are actually permitted is probed by the communicator.
    pub memory: Option<PeerMemory>,
}

/// Opens links between ranks. The network implementation authenticates every connection with the
/// job secret; tests may provide an in-process one.
pub trait Connector: Send + Sync {
    /// World rank of this process.
    fn rank(&self) -> usize;
    /// World size.
    fn size(&self) -> usize;
    /// Node index of `rank` (ranks with equal node index share memory).
    fn node_of(&self, rank: usize) -> usize;
    /// Opens the link with world rank `peer` for communicator `comm_id`. Both ranks of the pair must
    /// call it (in any order); it returns once the link is usable in both directions.
    fn connect(&self, comm_id: u64, peer: usize, w: &Waiter) -> Result<Link>;
    /// The job-wide abort state shared by every communicator of this process.
    fn abort(&self) -> &Arc<AbortState>;
}

/// Job-wide abort flag: set when any rank reports a failure, checked by every wait loop.
#[derive(Default)]
pub struct AbortState {
    flag: AtomicBool,
    reason: Mutex<Option<String>>,
    notify: Mutex<Option<AbortHook>>,
    arbiter: Mutex<Option<BlameHook>>,
}

/// Forwards a locally raised abort reason to the other ranks.
pub type AbortHook = Box<dyn Fn(&str) + Send + Sync>;

/// Reports a failure that involves a peer (`what`) to the job's arbiter, which decides which rank
/// actually failed and raises the job-wide abort with that verdict. Returns the verdict to use if
/// none comes within [`VERDICT_WAIT`] (a member names the silent arbiter), if any.
pub type BlameHook = Box<dyn Fn(&str) -> Option<String> + Send + Sync>;

/// How long a rank that reported a failure waits for the arbiter's verdict.
pub const VERDICT_WAIT: Duration = Duration::from_secs(6);

impl AbortState {
    /// Marks the job as aborted for `reason` (the first reason wins) without telling other ranks.
    pub fn set_local(&self, reason: &str) {
        let mut r = self.reason.lock().unwrap_or_else(|e| e.into_inner());
        if r.is_none() {
            *r = Some(reason.to_string());
        }
        self.flag.store(true, Ordering::Release);
    }

    /// Marks the job as aborted and tells every other rank (through the hook installed by the
    /// bootstrap, if any).
    pub fn raise(&self, reason: &str) {
        let first = !self.is_set();
        self.set_local(reason);
        if first {
            if let Some(hook) = self.notify.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
                hook(reason);
            }
        }
    }

    /// Installs the function that forwards a locally raised abort to the other ranks.
    pub fn set_notify(&self, hook: AbortHook) {
        *self.notify.lock().unwrap_or_else(|e| e.into_inner()) = Some(hook);
    }

    /// Installs the function that reports a failure involving a peer to the job's arbiter.
    pub fn set_arbiter(&self, hook: BlameHook) {
        *self.arbiter.lock().unwrap_or_else(|e| e.into_inner()) = Some(hook);
    }

    /// The job's verdict on a failure this rank saw (`what`, naming the peer that did not answer):
    /// reports it to the arbiter (if one is installed) and waits up to [`VERDICT_WAIT`] for the
    /// job-wide abort it raises; without one, the arbiter's fallback (if any) is raised. `None`
    /// without an arbiter or any verdict; an abort already under way is returned at once.
    pub fn blame(&self, what: &str) -> Option<String> {
        let mut fallback = None;
        if !self.is_set() {
            match self.arbiter.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
                Some(hook) => fallback = hook(what),
                None => return None,
            }
        }
        let give_up = Instant::now() + VERDICT_WAIT;
        while !self.is_set() && Instant::now() < give_up {
            std::thread::sleep(Duration::from_millis(5));
        }
        if let (false, Some(f)) = (self.is_set(), fallback) {
            self.raise(&f);
        }
        self.reason()
    }

    /// True once an abort was raised locally or reported by another rank.
    pub fn is_set(&self) -> bool {
        self.flag.load(Ordering::Acquire)
    }

    /// The abort reason, if any.
    pub fn reason(&self) -> Option<String> {
        self.reason.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// Context of one blocking operation: what it is (for error messages), its deadline and the abort
/// state. Transports call [`Waiter::check`] from every wait loop.
pub struct Waiter {
    /// World rank of this process.
    pub rank: usize,
    /// Operation name.
    pub op: &'static str,
    /// Sequence number of the operation on its communicator.
    pub seq: u64,
    /// Bytes in the operation's buffer.
    pub bytes: usize,
    /// When the operation started.
    pub start: Instant,
    /// When it must have finished.
    pub deadline: Instant,
    /// Job-wide abort state.
    pub abort: Arc<AbortState>,
}

/// One round of progress of this process's libfabric endpoint, run by every wait on any link:
/// with a manual-progress provider (the `shm` provider's large transfers, `ofi_rxm` rendezvous),
/// a peer's transfer to or from this rank may need this rank's calls into the provider to
/// complete, also while this rank waits on a shared-memory or TCP link (otherwise two ranks each
/// waiting on the other's link kind deadlock). Set once, when the endpoint opens.
static ENDPOINT_PROGRESS: std::sync::OnceLock<Box<dyn Fn() + Send + Sync>> = std::sync::OnceLock::new();

/// Installs [`ENDPOINT_PROGRESS`] (the first call wins: one endpoint per process).
#[cfg(feature = "ofi")]
pub(crate) fn set_endpoint_progress(f: Box<dyn Fn() + Send + Sync>) {
    let _ = ENDPOINT_PROGRESS.set(f);
}

impl Waiter {
    /// A waiter for `op` that times out `timeout` from now.
    pub fn new(rank: usize, op: &'static str, seq: u64, bytes: usize, timeout: Duration, abort: Arc<AbortState>) -> Self {
        let start = Instant::now();
        Waiter { rank, op, seq, bytes, start, deadline: start + timeout, abort }
    }

    /// Errors if the job was aborted or the deadline passed while waiting for `peer`; drives the
    /// libfabric endpoint's progress meanwhile ([`ENDPOINT_PROGRESS`]).
    pub fn check(&self, peer: usize) -> Result<()> {
        if let Some(progress) = ENDPOINT_PROGRESS.get() {
            progress();
        }
        if self.abort.is_set() {
            return Err(Error::Aborted {
                rank: self.rank,
                op: self.op,
                seq: self.seq,
                reason: self.abort.reason().unwrap_or_default(),
            });
        }
        let now = Instant::now();
        if now >= self.deadline {
            return Err(Error::Timeout {
                rank: self.rank,
                op: self.op,
                seq: self.seq,
                peer,
                bytes: self.bytes,
                waited_s: (now - self.start).as_secs_f64(),
            });
        }
        Ok(())
    }

    /// A `Comm` error for this operation and `peer`.
    pub fn fail(&self, peer: usize, cause: impl Into<String>) -> Error {
        Error::Comm { rank: self.rank, op: self.op, seq: self.seq, peer, bytes: self.bytes, cause: cause.into() }
    }

    /// The same operation and deadline, blind to the job-wide abort: for the waits that must still
    /// finish while an abort is under way (an owner waiting until no live peer reads its buffer).
    pub fn ignoring_abort(&self) -> Waiter {
        Waiter {
            rank: self.rank,
            op: self.op,
            seq: self.seq,
            bytes: self.bytes,
            start: self.start,
            deadline: self.deadline,
            abort: Arc::new(AbortState::default()),
        }
    }
}
