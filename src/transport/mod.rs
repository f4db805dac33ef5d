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
//!
//! # libfabric in detail
//!
//! ### libfabric
//!
//! `src/transport/ofi.rs` carries links over libfabric (Slingshot `cxi`, InfiniBand `verbs`, AWS
//! `efa`, and on any machine `tcp;ofi_rxm` and `shm`). It is the cargo feature `ofi`, on by default
//! (needs `libfabric-dev`; `--no-default-features` builds without it and asking for it is then a
//! `NotCompiled` error). The bindings are meshtrain's own: `build.rs` runs bindgen over
//! `src/transport/ofi_shim/shim.h` against the headers pkg-config finds, and compiles `shim.c`, which
//! gives the static inline `fi_*` calls an out-of-line body.
//!
//! - One RDM endpoint per process (FI_TAGGED + FI_MSG, FI_DIRECTED_RECV, FI_CONTEXT, FI_AV_TABLE, a
//!   tagged CQ of 8192 entries, FI_THREAD_DOMAIN), driven by manual progress from every wait (CQ read,
//!   `fi_cq_readerr` for failed operations); a send refused with -FI_EAGAIN goes to a backlog retried
//!   in order by every later progress call. Waits on shared-memory and TCP links progress the
//!   endpoint too: with links of both kinds (`auto` on a fabric node, `shm+ofi`) a provider that moves
//!   large messages only while both ends call into it (the `shm` provider with FI_HMEM, `ofi_rxm`
//!   rendezvous) otherwise deadlocks two ranks that each wait on the other's link kind (found on the
//!   testbed: a 4-rank all-reduce of 3 MiB hung every time before this). The `shm` provider names its
//!   region `/dev/shm/<pid>:...`, and a rank that exits on an error skips the endpoint's close: such a
//!   rank removes its region on the way out, and every rank removes a stale region under its own pid
//!   before opening its endpoint (found in CI: a pid reused from a rank that had died on an error made
//!   `fi_enable` fail with "Device or resource busy"). mr_mode: LOCAL (buffers registered, descriptors passed),
//!   ENDPOINT (`fi_mr_bind` + `fi_mr_enable`), ALLOCATED (buffers exist before registration) are
//!   honoured; VIRT_ADDR and PROV_KEY are accepted and matter to remote access only, which tagged
//!   messaging never does. Registered buffers are kept in a per-size pool reused by later links (the
//!   registration cache).
//! - A link's chunk `s` is one tagged message whose tag is the receiver's link key and `s`; the
//!   receiver keeps `depth` receives posted for the next `depth` sequence numbers, each matching one
//!   exact tag from the peer's address only, and re-posts on release, so the chunk-FIFO contract (and
//!   every collective) holds unchanged and a message with any other tag or source never becomes data.
//!   Endpoint addresses and link keys travel over the pair's authenticated TCP stream, so only job
//!   members enter the address vector; the stream stays open as liveness signal (a SIGKILLed peer is
//!   named by its neighbours within 50 ms of progress).
//! - Selection: `MESHTRAIN_TRANSPORT=ofi` puts every pair on libfabric; `auto` (the default) puts pairs
//!   on different nodes on it when `/sys/class/cxi` or `/sys/class/infiniband` lists a device, so plain
//!   machines stay on TCP (looked up in sysfs: initialising libfabric takes ~0.8 s here);
//!   `shm+ofi` does what `auto` does on a fabric node without asking sysfs. Link chunk
//!   and depth are `MESHTRAIN_TCP_CHUNK` / `MESHTRAIN_TCP_DEPTH`.
//! - Provider: `MESHTRAIN_OFI_PROVIDER`, else `FI_PROVIDER`, else libfabric's preference. When a
//!   fabric provider lists several domains (NICs, e.g. 4 cxi per Frontier node), rank `i` of a node
//!   takes domain `i mod n`; other providers use their first. Every rank logs libfabric's version,
//!   provider, fabric, domain and mr_mode; rank 0 also the FI_*/SLINGSHOT_* environment.
//! - `MESHTRAIN_OFI_PROFILE=frontier` sets, before MPI_Init and only where unset:
//!   `FI_MR_CACHE_MONITOR=userfaultfd` (the registration cache learns about freed/remapped memory
//!   without malloc hooks, which miss GPU-runtime allocations), `FI_CXI_RX_MATCH_MODE=hybrid` (tag
//!   matching falls back to software instead of failing when the NIC's match lists fill),
//!   `FI_CXI_DEFAULT_CQ_SIZE=131072` (room for the operations deep pipelines keep outstanding),
//!   `FI_CXI_DISABLE_HOST_REGISTER=1` (cxi does not register host memory with the GPU runtime, which
//!   has hung ROCm jobs), `FI_CXI_RDZV_PROTO=alt_read` (receiver-read rendezvous for large messages).
//!   None of these has been tried on Slingshot here.
//! - GPU buffers: where the provider offers FI_HMEM, the endpoint is opened with it (same provider,
//!   FI_MR_HMEM mode) and device send/recv post the device buffer itself: registered with
//!   `fi_mr_regattr` as FI_HMEM_CUDA (with the GPU ordinal), FI_HMEM_ROCR, or FI_HMEM_SYSTEM for the
//!   emu/CPU arms, honouring LOCAL, ENDPOINT (bind + enable) and PROV_KEY (else a unique requested key),
//!   cached per (address, length) until `GpuCommState::release_mappings` or drop. Both ends exchange one
//!   capability byte per link at setup (FI_HMEM endpoint, `MESHTRAIN_GPU_DIRECT` off/auto/on), so they
//!   always choose the same path; direct messages use a receive key of their own (never a chunk tag),
//!   1 MiB each, 8 in flight, exact tag and source, with the links' deadline, abort and liveness
//!   checks. Elsewhere (provider without FI_HMEM, shm/TCP links, `MESHTRAIN_GPU_DIRECT=off`) and for
//!   every other device collective, buffers stage through pinned host memory. Each rank logs the
//!   choice once per peer and direction: `device send to rank 1: FI_HMEM direct (provider shm, iface
//!   FI_HMEM_SYSTEM)` or `device send to rank 1: staged (provider tcp;ofi_rxm does not offer FI_HMEM on
//!   this rank or rank 1)`. Here only `shm` offers FI_HMEM (`fi_info -c FI_HMEM`), and only host memory
//!   has been registered: CUDA/ROCr registration is compiled but has never run (no GPU here).
//!   `meshtrain bench device-sendrecv --device emu` (ping-pong, members 0 and 1) over `shm`, 2 ranks,
//!   this VM at load ~1, median of 7 runs of 40 round trips, one-way: 1 MiB 92 us direct vs 308 us
//!   staged (3.4x), 16 MiB 3.42 ms vs 5.04 ms (1.5x). Opening the shm endpoint with FI_HMEM did not
//!   slow host all-reduce (4 MiB, 2 ranks, median of 6: 1.60 ms with, 1.98 ms without). With `shm`, a
//!   peer SIGKILLed while holding the provider's shared spin lock can leave the survivor spinning in
//!   `fi_cq_read` (2 of 8 runs; the test is `#[ignore]`d), beyond any deadline check of ours.
//! - Device collectives between nodes as FI_HMEM rings (`src/comm/device/fabric_ring.rs`): where the
//!   IPC paths do not apply and every rank's links to its ring neighbours (rank r sends to r+1 and
//!   receives from r-1) go direct, all-reduce, reduce-scatter, all-gather and broadcast on device
//!   buffers run as rings of direct transfers. All ranks agree once per communicator state (a host
//!   all-gather of one byte each) and rank 0 logs `device collectives: FI_HMEM rings over K members`
//!   or `device collectives: staged through host memory (the ring links of member 1 are not FI_HMEM
//!   direct)`, each such rank logging why. All-reduce: per piece of at most
//!   `MESHTRAIN_GPU_STAGE_CHUNK` bytes, k-1 reduce-scatter hops (send block r-s, receive block r-s-1
//!   into a device landing slot, reduce kernel into the buffer; `avg` divides the finished block),
//!   then k-1 all-gather hops of whole blocks received straight into the buffer; reduce-scatter
//!   reads its input only (partial sums go through a device accumulator slot); all-gather forwards
//!   whole blocks; broadcast is a chain from the root, receiving piece t while forwarding piece t-1.
//!   Every hop waits for the device first (a kernel's output is what is sent). Every call starts with
//!   a fingerprint hop (kind, type, operator, root, count, collective number) from each rank to the
//!   next, so a rank in another call fails every rank naming both calls before any data moves
//!   (`op mismatch: rank 1 called all_reduce #3 of 2000 f32 (sum), but peer rank 0 called
//!   all_reduce #3 of 1000 f32 (sum)`). Reduce and all-to-all stay staged. With
//!   `MESHTRAIN_TRANSPORT=auto` the links within a node are shared memory, not libfabric, so with
//!   several ranks per node the flat rings need `MESHTRAIN_TRANSPORT=ofi` (the NIC carries the
//!   intra-node hops too) or a ring order whose every hop crosses nodes; the all-reduce instead runs
//!   hierarchically (below). `MESHTRAIN_GPU_DIRECT=on` makes a rank whose ring links cannot go direct an error on
//!   every rank. Measured on emu buffers, `MESHTRAIN_TRANSPORT=ofi FI_PROVIDER=shm mpirun -np 2
//!   meshtrain bench device --device emu --coll C --min 256K --max 16M --factor 4` (20 calls, this VM
//!   at load 1.3), us per call, ring vs staged:
//!
//!   | collective | 256 KiB | 1 MiB | 4 MiB | 16 MiB |
//!   |---|---|---|---|---|
//!   | all-gather | 234 vs 197 | 276 vs 343 | 404 vs 1697 | 2962 vs 9009 |
//!   | broadcast | 158 vs 184 | 203 vs 334 | 759 vs 1473 | 4036 vs 7243 |
//!   | all-reduce | 830 vs 322 | 2637 vs 603 | 8588 vs 2483 | 34494 vs 11752 |
//!
//!   The copy-only collectives gain 1.6-4.2x from 1 MiB on (no copy through pinned memory; below
//!   that the fingerprint hop and the per-hop device wait cost more than the copies save). The
//!   all-reduce loses here because on emu the reduce kernel is emulated on the host, thread by
//!   thread, while the staged path reduces with the host's vector code; on a GPU the kernel runs at
//!   memory bandwidth, and that comparison is still to be made.
//! - Device all-reduce across nodes in three stages (`src/comm/device/hier.rs`): when a communicator
//!   spans two or more nodes (hostname and boot id) with the same number L >= 2 of ranks each, on a
//!   GPU or emu arm with IPC not off, an all-reduce is a reduce-scatter within the node (IPC or
//!   stream-ordered), an all-reduce of each rank's 1/L block between the ranks holding the same place
//!   on every node (FI_HMEM rings where those links allow, else staged), and an all-gather within the
//!   node; each rank sends 1/L of the data between nodes and the hops within a node never touch the
//!   network. Decided from the node map every rank holds; set up at the first all-reduce (two
//!   `split`s); rank 0 logs `device all-reduce: hierarchical over 2 nodes x 2 ranks (...)`; `avg`
//!   sums in both reducing stages and divides each block once. Reduce-scatter, all-gather and
//!   broadcast are not hierarchical.
//!
//! Tested (`tests/ofi_transport.rs`, in `make test`): `meshtrain selftest` (every collective, type and
//! operator, bit-exact) with `MESHTRAIN_TRANSPORT=ofi` over `tcp;ofi_rxm` and `shm` on 2, 3, 5 and 8
//! ranks; a provider that does not exist fails with an error naming it. `tests/ofi_device.rs`: the
//! emu device selftest over `shm` on 2 and 3 ranks (send/recv of counts 0, 1, 13, 4099 and 12 MB in
//! every element type, bit-exact) with every send/recv counted as direct; over `tcp;ofi_rxm` and with
//! `MESHTRAIN_GPU_DIRECT=off` every one staged, with the logged reason; `MESHTRAIN_GPU_DIRECT=on` with
//! `MESHTRAIN_TRANSPORT=tcp` or over `tcp;ofi_rxm` a configuration error on every rank. With
//! `MESHTRAIN_GPU_IPC=off`: every all-reduce, reduce-scatter, all-gather and broadcast of every type
//! and operator as FI_HMEM rings over `shm` on 2, 3 and 5 ranks, bit-exact, 4 KiB pieces (the ring
//! call count asserted); over `tcp;ofi_rxm` and with `MESHTRAIN_GPU_DIRECT=off` none, with the logged
//! reasons; a rank in another all-reduce (count, operator) an `op mismatch` naming both calls on every
//! rank; DP2 training (ZeRO-0 and ZeRO-3) on emu over rings gives the staged run's losses bit for
//! bit. Not tested:
//! cxi, verbs, efa (none here), the ENDPOINT/LOCAL registration paths (neither local provider asks for
//! them), FI_HMEM_CUDA/ROCR registration (no GPU).
//!

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
    /// Returns once every posted chunk has left this process's hands, driving the transport's
    /// progress while it waits. A communicator calls it at the end of each operation, so that a
    /// rank never moves on (to a blocking connect, to compute) while a peer still needs it to make
    /// progress on its sends. Links whose `post` completes the send themselves need nothing here.
    fn flush(&mut self, _w: &Waiter) -> Result<()> {
        Ok(())
    }
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

    /// When the operation started (the waiter's creation).
    pub fn started(&self) -> Instant {
        self.start
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
