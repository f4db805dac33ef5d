//! A communicator: a group of ranks, its ring, its links, and the typed collective API.
//!
//! Invariants:
//! - every member calls the same collectives in the same order (SPMD); each call gets the next
//!   sequence number, which appears in every error together with the peer rank and byte count;
//! - one operation runs at a time per communicator (an internal lock); different communicators
//!   may run concurrently on different threads;
//! - the ring is data: a permutation of the members ordered by (node, world rank), checked on
//!   creation and logged once by member 0, so that a ring leaves each node at most once;
//! - links are opened in one global order of rank pairs, so creation never deadlocks; ring links
//!   at creation, the others when a direct algorithm or point-to-point call first needs them;
//! - the schedule (family and chunk) depends only on (operation, bytes, size, link kind, tuning
//!   table, configuration) ([`crate::comm::tuner`]), so it is the same on every member; any
//!   failure raises the job-wide abort so that no other rank hangs;
//!   a failure on a peer (deadline, closed link) first asks rank 0 which rank actually failed
//!   (`AbortState::blame`) and reports its verdict; every call is in the flight record
//!   ([`flight`]);
//! - every call arms its fingerprint ([`fingerprint`]) on each link; a call numbered differently,
//!   or another operation, count, element type, operator or root on a peer fails on both sides;
//! - across nodes (some node holding >= 2 members), all-reduce, reduce-scatter, all-gather,
//!   broadcast and reduce may run in stages over stage communicators made from the node map
//!   ([`hier`]); their calls are numbered, fingerprinted and recorded on those, under this
//!   communicator's lock;
//! - single-copy (read) schedules run only after a probe, made once per communicator by the
//!   first call that wants them, showed on every member that every peer's memory can be read;
//!   the probe's answer is agreed, so every member falls back to the FIFO schedules together;
//! - lifetime: a member may drop a communicator as soon as its own creation (or call) returned,
//!   while peers are still connecting to it: the transport keeps what a peer still has to attach
//!   (a shared-memory segment's name) until that peer attached, or died, or the job aborted, or
//!   the timeout passed (so the drop may wait that long, never longer); TCP delivers what was sent
//!   before the close. A member that later uses the communicator gets an error naming the member
//!   that left (closed link), or the job's abort raised by one that did, not a hang; dropping
//!   after an abort never waits.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use crate::comm::algo::direct::{self, DirectShape, Peers};
use crate::comm::algo::read;
use crate::comm::algo::split::{self, Halves};
use crate::comm::algo::ring::{self, RingShape};
use crate::comm::block_range;
use crate::comm::nodes::NodeMap;
use crate::comm::tuner::{Family, LinkKind, Tuning};
use crate::comm::tuning::CommConfig;
use crate::dtype::{DType, Element, ReduceOp, Reducer};
use crate::comm::fingerprint::{self, LinkPrints, OpKind, OpPrint};
use crate::comm::flight;
use crate::comm::primitives::{Pipe, Rx, Tx};
use crate::comm::probe::Reads;
use crate::comm::stats::{CommStats, CountedSend};
use crate::error::{Error, Result};
use crate::transport::{Connector, Link, Waiter};

mod create;
#[cfg(feature = "ofi")]
mod device_direct;
mod hier;
mod hier_blocks;
mod schedule;

/// A group of ranks that run collectives together.
pub struct Communicator {
    connector: Arc<dyn Connector>,
    id: u64,
    rank: usize,
    /// World rank of each member.
    members: Vec<usize>,
    /// Member ranks in ring order.
    ring: Vec<usize>,
    ring_pos: usize,
    cfg: CommConfig,
    /// Shared memory when every member is on one node (the tuner's link kind).
    link_kind: LinkKind,
    /// The schedule table in use (`cfg.tuning` unless [`Communicator::set_tuning`] replaced it).
    tuning: std::sync::RwLock<Option<Arc<Tuning>>>,
    /// Which members share a node.
    nodes: NodeMap,
    /// The stage communicators of the hierarchical schedules, made by the first call that runs one.
    hier: OnceLock<Box<hier::Stages>>,
    state: Mutex<State>,
    stats: Arc<CommStats>,
    /// Bytes this rank posted to members on other nodes, this communicator's stages included.
    net_sent: Arc<AtomicU64>,
}

struct State {
    /// Link with each member (by communicator rank), opened on demand.
    links: Vec<Option<MemberLink>>,
    seq: u64,
    /// Collective calls so far (the fingerprint's number; point-to-point calls do not count).
    collectives: u64,
    /// Sends to / receives from each member so far (point-to-point fingerprints).
    sends: Vec<u64>,
    recvs: Vec<u64>,
    /// The running call's fingerprint, armed on every link it opens.
    print: Option<OpPrint>,
    splits: u64,
    /// One chunk of working space for the direct reductions.
    scratch: Vec<u8>,
    /// What the single-copy probe found (`None` before it ran).
    reads: Option<Reads>,
}

/// Which family of schedules carries one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sched {
    /// Pipelined ring ([`ring`]).
    Ring,
    /// All pairs through the FIFOs ([`direct`]).
    Direct,
    /// Single copy: peers read each other's buffers ([`read`]).
    Read,
    /// Point to point: only the link the call opens itself.
    Pair,
    /// In stages over the node and cross-node communicators ([`hier`]).
    Hier,
    /// All-reduce as a reduce-scatter then an all-gather, each half with its own flat schedule
    /// ([`split`]).
    Split,
}

/// One collective call and its byte buffers, as the dispatcher sees it. `input: None` is in place.
enum Call<'a> {
    AllReduce {
        input: Option<&'a [u8]>,
        out: &'a mut [u8],
        red: Reducer,
    },
    /// `out` is this rank's block out of place, the whole `n`-element buffer in place.
    ReduceScatter {
        input: Option<&'a [u8]>,
        out: &'a mut [u8],
        n: usize,
        red: Reducer,
    },
    AllGather {
        input: Option<&'a [u8]>,
        out: &'a mut [u8],
    },
    Broadcast {
        root: usize,
        buf: &'a mut [u8],
    },
    /// `out` is only written (and may be empty) off the root.
    Reduce {
        root: usize,
        input: Option<&'a [u8]>,
        out: &'a mut [u8],
        n: usize,
        red: Reducer,
    },
}

impl Call<'_> {
    /// The call's fingerprint (without its number), `dtype` elements.
    fn print(&self, dtype: DType) -> OpPrint {
        let (kind, reduce, root) = match self {
            Call::AllReduce { red, .. } => (OpKind::AllReduce, Some(red.op), None),
            Call::ReduceScatter { red, .. } => (OpKind::ReduceScatter, Some(red.op), None),
            Call::AllGather { .. } => (OpKind::AllGather, None, None),
            Call::Broadcast { root, .. } => (OpKind::Broadcast, None, Some(*root)),
            Call::Reduce { root, red, .. } => (OpKind::Reduce, Some(red.op), Some(*root)),
        };
        let count = (self.bytes(dtype.size()) / dtype.size()) as u64;
        OpPrint { kind, dtype, reduce, root, count, seq: 0 }
    }

    fn name(&self) -> &'static str {
        match self {
            Call::AllReduce { .. } => "all_reduce",
            Call::ReduceScatter { .. } => "reduce_scatter",
            Call::AllGather { .. } => "all_gather",
            Call::Broadcast { .. } => "broadcast",
            Call::Reduce { .. } => "reduce",
        }
    }

    /// Bytes of the whole buffer the call works on (the same on every member).
    fn bytes(&self, esize: usize) -> usize {
        match self {
            Call::AllReduce { out, .. } | Call::AllGather { out, .. } => out.len(),
            Call::Broadcast { buf, .. } => buf.len(),
            Call::ReduceScatter { n, .. } | Call::Reduce { n, .. } => n * esize,
        }
    }

    /// The call on a one-rank communicator: the result is the input.
    fn single_rank(self) {
        match self {
            Call::Broadcast { .. } => {}
            Call::AllReduce { input, out, .. }
            | Call::ReduceScatter { input, out, .. }
            | Call::AllGather { input, out }
            | Call::Reduce { input, out, .. } => {
                if let Some(i) = input {
                    out.copy_from_slice(i);
                }
            }
        }
    }
}

/// A member's link and the current call's fingerprints on it (kept here: the transport carries
/// bytes and knows nothing of calls).
struct MemberLink {
    link: Link,
    prints: LinkPrints,
}

impl MemberLink {
    fn tx(&mut self) -> Tx<'_> {
        Tx::new(&mut *self.link.send, &mut self.prints.send, self.link.peer)
    }
    fn rx(&mut self) -> Rx<'_> {
        Rx::new(&mut *self.link.recv, &mut self.prints.expect, self.link.peer)
    }
}

/// The links of a communicator, addressed by member rank (for the direct schedules).
struct LinkTable<'a>(&'a mut [Option<MemberLink>]);

impl Peers for LinkTable<'_> {
    fn tx(&mut self, to: usize) -> Tx<'_> {
        self.0[to].as_mut().expect("link opened before use").tx()
    }
    fn rx(&mut self, from: usize) -> Rx<'_> {
        let l = self.0[from].as_mut().expect("link opened before use");
        let memory = l.link.memory.as_ref();
        Rx::new(&mut *l.link.recv, &mut l.prints.expect, l.link.peer).with_memory(memory)
    }
    fn pipe(&mut self, from: usize, to: usize) -> Pipe<'_> {
        ring_pipe(self.0, from, to)
    }
}

/// The pipe of a ring position: receive from `prev`, send to `next` (member ranks).
fn ring_pipe(links: &mut [Option<MemberLink>], prev: usize, next: usize) -> Pipe<'_> {
    if prev == next {
        let l = links[prev].as_mut().expect("ring link opened");
        let MemberLink { link, prints } = l;
        return Pipe {
            rx: Rx::new(&mut *link.recv, &mut prints.expect, link.peer),
            tx: Tx::new(&mut *link.send, &mut prints.send, link.peer),
        };
    }
    let [p, n] = links.get_disjoint_mut([prev, next]).expect("prev != next, both in range");
    let (p, n) = (p.as_mut().expect("ring link opened"), n.as_mut().expect("ring link opened"));
    Pipe { rx: p.rx(), tx: n.tx() }
}

/// The halves of one split all-reduce, run under its call (one number, one fingerprint).
struct SplitRun<'a> {
    comm: &'a Communicator,
    st: &'a mut State,
    dtype: DType,
    red: Reducer,
    /// (schedule, chunk bytes) of the reduce-scatter and of the all-gather.
    halves: [(Sched, usize); 2],
    w: &'a Waiter,
}

impl Halves for SplitRun<'_> {
    fn reduce_scatter(&mut self, input: Option<&[u8]>, out: &mut [u8], n: usize) -> Result<()> {
        let (sched, chunk) = self.halves[0];
        let call = Call::ReduceScatter { input, out, n, red: self.red };
        self.comm.flat_call(self.st, sched, (self.dtype, chunk), call, self.w)
    }
    fn all_gather(&mut self, buf: &mut [u8]) -> Result<()> {
        let (sched, chunk) = self.halves[1];
        self.comm.flat_call(self.st, sched, (self.dtype, chunk), Call::AllGather { input: None, out: buf }, self.w)
    }
}

/// How a call is fingerprinted and numbered (see [`crate::comm::fingerprint`]).
enum Print {
    /// A collective: numbered among the communicator's collectives.
    Collective(OpPrint),
    /// A send to a member: numbered among the sends to it.
    Send(OpPrint, usize),
    /// A receive from a member: numbered among the receives from it.
    Recv(OpPrint, usize),
}

fn p2p_print<T: Element>(count: usize) -> OpPrint {
    OpPrint { kind: OpKind::SendRecv, dtype: T::DTYPE, reduce: None, root: None, count: count as u64, seq: 0 }
}

fn bytes<T: Element>(s: &[T]) -> &[u8] {
    bytemuck::cast_slice(s)
}

fn bytes_mut<T: Element>(s: &mut [T]) -> &mut [u8] {
    bytemuck::cast_slice_mut(s)
}

/// A stable 64-bit id for a sub-communicator (FNV-1a over the parent id, split number and color).
fn child_id(parent: u64, split: u64, color: u64) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in parent.to_le_bytes().iter().chain(&split.to_le_bytes()).chain(&color.to_le_bytes()) {
        h = (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

impl Communicator {
    /// This rank within the communicator.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.members.len()
    }

    /// World rank of member `r`.
    pub fn world_rank(&self, r: usize) -> usize {
        self.members[r]
    }

    /// Shared memory (every member on one node) or network links: what the tuner tells apart.
    pub fn link_kind(&self) -> LinkKind {
        self.link_kind
    }

    /// Node of member `r` (hostname and boot id; an index every rank agrees on).
    pub fn node_of(&self, r: usize) -> usize {
        self.connector.node_of(self.members[r])
    }

    /// How long a blocking operation of this communicator waits for a peer (`MESHTRAIN_TIMEOUT`).
    pub fn timeout(&self) -> std::time::Duration {
        self.cfg.timeout
    }

    /// Bytes this rank has posted to members on other nodes for this communicator's calls (its
    /// hierarchical stages included; see [`crate::comm::stats`]).
    pub fn net_bytes_sent(&self) -> u64 {
        self.net_sent.load(Ordering::Relaxed)
    }

    /// Which members share a node.
    pub fn node_map(&self) -> &NodeMap {
        &self.nodes
    }

    /// Traffic counters of this communicator (shared: readable after the communicator moved to
    /// another thread).
    pub fn stats(&self) -> Arc<CommStats> {
        self.stats.clone()
    }

    /// What the single-copy probe found: `None` until a call wanted reads (never, with
    /// `MESHTRAIN_CMA=off`). Reads are used when they pay, or work and are forced on.
    pub fn single_copy_reads(&self) -> Option<Reads> {
        self.lock().reads.clone()
    }

    /// Member ranks in ring order.
    pub fn ring(&self) -> &[usize] {
        &self.ring
    }

    /// This rank's block of an `n`-element buffer (see [`block_range`]).
    pub fn block(&self, n: usize) -> Range<usize> {
        block_range(n, self.size(), self.rank)
    }

    fn ring_neighbours(&self) -> (usize, usize) {
        let k = self.size();
        (self.ring[(self.ring_pos + k - 1) % k], self.ring[(self.ring_pos + 1) % k])
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn waiter(&self, op: &'static str, seq: u64, bytes: usize) -> Waiter {
        Waiter::new(self.connector.rank(), op, seq, bytes, self.cfg.timeout, self.connector.abort().clone())
    }

    /// Opens the missing links to `peers` (member ranks) in the global pair order.
    fn open_links(&self, st: &mut State, peers: &[usize], w: &Waiter) -> Result<()> {
        let me = self.members[self.rank];
        let mut todo: Vec<usize> =
            peers.iter().copied().filter(|&p| p != self.rank && st.links[p].is_none()).collect();
        todo.sort_by_key(|&p| {
            let other = self.members[p];
            (me.min(other), me.max(other))
        });
        todo.dedup();
        for p in todo {
            let mut link = self.connector.connect(self.id, self.members[p], w)?;
            if self.nodes.node[p] != self.nodes.node[self.rank] {
                let Link { peer, kind, send, recv, memory } = link;
                let send = Box::new(CountedSend { inner: send, sent: self.net_sent.clone() });
                link = Link { peer, kind, send, recv, memory };
            }
            if link.send.max_chunk() < self.cfg.chunk_bytes + fingerprint::PRINT_LEN || link.send.depth() < 2 {
                return Err(w.fail(
                    link.peer,
                    "link too small for the configured chunk size and a fingerprint (or fewer than 2 slots)",
                ));
            }
            st.links[p] = Some(MemberLink { link, prints: LinkPrints::armed(st.print) });
        }
        Ok(())
    }

    /// Runs one operation: sequence number, waiter, the links and probe its schedule needs, and
    /// abort on failure. `f` gets the schedule actually used.
    fn run(
        &self,
        op: &'static str,
        bytes: usize,
        want: Sched,
        print: Print,
        f: impl FnOnce(&mut State, Sched, &Waiter) -> Result<()>,
    ) -> Result<()> {
        let mut st = self.lock();
        st.seq += 1;
        st.print = match print {
            Print::Collective(p) => {
                st.collectives += 1;
                Some(OpPrint { seq: st.collectives, ..p })
            }
            Print::Send(p, to) => {
                st.sends[to] += 1;
                Some(OpPrint { seq: st.sends[to], ..p })
            }
            Print::Recv(p, from) => {
                st.recvs[from] += 1;
                Some(OpPrint { seq: st.recvs[from], ..p })
            }
        };
        let armed = LinkPrints::armed(st.print);
        st.links.iter_mut().flatten().for_each(|l| l.prints = armed);
        let w = self.waiter(op, st.seq, bytes);
        let start = w.started();
        let ticket = flight::begin(self.id, st.seq, op, bytes, start);
        let result = (|| {
            let mut sched = want;
            if matches!(sched, Sched::Direct | Sched::Read | Sched::Split) && self.size() > 1 {
                // Checked first: once every link is open, no list of peers is built per call.
                if st.links.iter().enumerate().any(|(p, l)| p != self.rank && l.is_none()) {
                    let all: Vec<usize> = (0..self.size()).collect();
                    self.open_links(&mut st, &all, &w)?;
                }
                if sched == Sched::Read && !self.reads_work(&mut st, &w)? {
                    sched = Sched::Ring;
                }
            }
            f(&mut st, sched, &w)?;
            // A call is over once its sends have left (see `SendLink::flush`).
            st.links.iter_mut().flatten().try_for_each(|l| l.link.send.flush(&w))
        })();
        let done = std::time::Instant::now();
        self.stats.record(op, bytes, done - start);
        // The failed operation stays "in progress" in the flight record until the verdict is in,
        // so that the liveness check does not take this rank for one that stopped communicating.
        let result = result.map_err(|e| self.job_failure(e, &w));
        let done = if result.is_err() { std::time::Instant::now() } else { done };
        flight::end(ticket, result.as_ref().err().map(|e| e.to_string()), done);
        if result.is_err() {
            flight::dump_once(self.connector.rank());
        }
        result
    }

    /// Runs one collective with the schedule chosen for it.
    fn collective(&self, dtype: DType, call: Call) -> Result<()> {
        let bytes = call.bytes(dtype.size());
        let (want, chunk) = self.schedule(&call, bytes);
        if want == Sched::Hier {
            return self.hier_call(dtype, call, bytes);
        }
        let print = Print::Collective(call.print(dtype));
        self.run(call.name(), bytes, want, print, |st, sched, w| {
            if self.size() == 1 {
                call.single_rank();
                return Ok(());
            }
            self.flat_call(st, sched, (dtype, chunk), call, w)
        })
    }

    /// Runs `call` with the flat schedule `sched` (its links open, its probe made).
    fn flat_call(&self, st: &mut State, sched: Sched, dc: (DType, usize), call: Call, w: &Waiter) -> Result<()> {
        match sched {
            Sched::Ring => self.ring_call(st, dc, call, w),
            Sched::Direct => self.direct_call(st, dc, call, w),
            Sched::Read => self.read_call(st, dc, call, w),
            Sched::Split => self.split_call(st, dc.0, call, w),
            Sched::Pair | Sched::Hier => unreachable!("schedule() never picks Pair; Hier runs above"),
        }
    }

    /// The composed all-reduce: each half with the schedule the tuner picks for it at this size
    /// ([`Self::split_halves`]); a half that wants reads runs the ring where the probe says no.
    fn split_call(&self, st: &mut State, dtype: DType, call: Call, w: &Waiter) -> Result<()> {
        let Call::AllReduce { input, out, red } = call else {
            unreachable!("the tuner picks split for all-reduce only")
        };
        let mut halves = self.split_halves(out.len());
        for (sched, _) in &mut halves {
            if *sched == Sched::Read && !self.reads_work(st, w)? {
                *sched = Sched::Ring;
            }
        }
        let shape = self.direct_shape(dtype, dtype.size());
        split::all_reduce(&mut SplitRun { comm: self, st, dtype, red, halves, w }, &shape, input, out)
    }

    fn ring_call(&self, st: &mut State, (dtype, chunk): (DType, usize), call: Call, w: &Waiter) -> Result<()> {
        let (prev, next) = self.ring_neighbours();
        let (p, s) = (&mut ring_pipe(&mut st.links, prev, next), &self.ring_shape(dtype, chunk));
        let pos = |root: usize| self.ring.iter().position(|&r| r == root).expect("root is a member");
        match call {
            Call::AllReduce { input, out, red } => ring::all_reduce(p, s, input, out, &red, w),
            Call::ReduceScatter { input, out, n, red } => ring::reduce_scatter(p, s, input, out, n, &red, w),
            Call::AllGather { input, out } => ring::all_gather(p, s, input, out, w),
            Call::Broadcast { root, buf } => ring::broadcast(p, s, pos(root), buf, w),
            Call::Reduce { root, input, out, n, red } => {
                ring::reduce(p, s, pos(root), input, out, n, &red, w)
            }
        }
    }

    fn direct_call(&self, st: &mut State, (dtype, chunk): (DType, usize), call: Call, w: &Waiter) -> Result<()> {
        let State { links, scratch, .. } = st;
        let (p, s) = (&mut LinkTable(links), &self.direct_shape(dtype, chunk));
        match call {
            Call::AllReduce { input, out, red } => direct::all_reduce(p, s, input, out, scratch, &red, w),
            Call::ReduceScatter { input, out, n, red } => {
                direct::reduce_scatter(p, s, input, out, n, scratch, &red, w)
            }
            Call::AllGather { input, out } => direct::all_gather(p, s, input, out, w),
            Call::Broadcast { root, buf } => direct::broadcast(p, s, root, buf, w),
            Call::Reduce { root, input, out, n, red } => {
                direct::reduce(p, s, root, input, out, n, scratch, &red, w)
            }
        }
    }

    fn read_call(&self, st: &mut State, (dtype, chunk): (DType, usize), call: Call, w: &Waiter) -> Result<()> {
        let (p, s) = (&mut LinkTable(&mut st.links), &self.direct_shape(dtype, chunk));
        match call {
            Call::AllReduce { input, out, red } => {
                read::all_reduce(p, &self.ring_shape(dtype, chunk), s, input, out, &red, w)
            }
            Call::AllGather { input, out } => read::all_gather(p, s, input, out, w),
            Call::Broadcast { root, buf } => read::broadcast(p, s, root, buf, w),
            Call::ReduceScatter { .. } | Call::Reduce { .. } => {
                unreachable!("schedule() picks Read only where one exists")
            }
        }
    }

    /// The ring's shape with pieces of at most `chunk` bytes (at most the configured chunk).
    fn ring_shape(&self, dtype: DType, chunk: usize) -> RingShape<'_> {
        RingShape { order: &self.ring, pos: self.ring_pos, esize: dtype.size(), chunk: chunk / dtype.size() }
    }

    fn direct_shape(&self, dtype: DType, chunk: usize) -> DirectShape {
        DirectShape { k: self.size(), me: self.rank, esize: dtype.size(), chunk: chunk / dtype.size() }
    }

    /// In-place all-reduce of `buf`.
    pub fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let red = Reducer::new(T::DTYPE, op);
        self.collective(T::DTYPE, Call::AllReduce { input: None, out: bytes_mut(buf), red })
    }

    /// All-reduce of `send` into `recv` (same length).
    pub fn all_reduce_into<T: Element>(&self, send: &[T], recv: &mut [T], op: ReduceOp) -> Result<()> {
        check_len("all_reduce", "recv", recv.len(), send.len())?;
        let red = Reducer::new(T::DTYPE, op);
        self.collective(T::DTYPE, Call::AllReduce { input: Some(bytes(send)), out: bytes_mut(recv), red })
    }

    /// In-place reduce-scatter: afterwards `buf[self.block(buf.len())]` holds this rank's block of
    /// the reduction; the rest of `buf` is unspecified.
    pub fn reduce_scatter<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let (n, red) = (buf.len(), Reducer::new(T::DTYPE, op));
        self.collective(T::DTYPE, Call::ReduceScatter { input: None, out: bytes_mut(buf), n, red })
    }

    /// Reduce-scatter of `send` (n elements): `recv` receives this rank's block
    /// (`self.block(n).len()` elements).
    pub fn reduce_scatter_into<T: Element>(&self, send: &[T], recv: &mut [T], op: ReduceOp) -> Result<()> {
        check_len("reduce_scatter", "recv", recv.len(), self.block(send.len()).len())?;
        let (n, red) = (send.len(), Reducer::new(T::DTYPE, op));
        self.collective(
            T::DTYPE,
            Call::ReduceScatter { input: Some(bytes(send)), out: bytes_mut(recv), n, red },
        )
    }

    /// In-place all-gather: this rank's block `buf[self.block(buf.len())]` is sent, every other
    /// block is filled in.
    pub fn all_gather<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        self.collective(T::DTYPE, Call::AllGather { input: None, out: bytes_mut(buf) })
    }

    /// All-gather of each rank's `send` block into `recv`; `send.len()` must equal
    /// `self.block(recv.len()).len()`.
    pub fn all_gather_into<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        check_len("all_gather", "send", send.len(), self.block(recv.len()).len())?;
        self.collective(T::DTYPE, Call::AllGather { input: Some(bytes(send)), out: bytes_mut(recv) })
    }

    /// Broadcast of `buf` from member `root`.
    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.check_rank("broadcast", root)?;
        self.collective(T::DTYPE, Call::Broadcast { root, buf: bytes_mut(buf) })
    }

    /// In-place reduce onto `root`: the root's `buf` receives the result; other ranks' `buf` is
    /// left unchanged.
    pub fn reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp, root: usize) -> Result<()> {
        self.check_rank("reduce", root)?;
        let (n, red) = (buf.len(), Reducer::new(T::DTYPE, op));
        self.collective(T::DTYPE, Call::Reduce { root, input: None, out: bytes_mut(buf), n, red })
    }

    /// Reduce of `send` onto `root`'s `recv` (same length as `send` at the root; ignored, and may be
    /// empty, elsewhere).
    pub fn reduce_into<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        self.check_rank("reduce", root)?;
        if self.rank == root {
            check_len("reduce", "recv", recv.len(), send.len())?;
        }
        let out: &mut [T] = if self.rank == root { recv } else { &mut [] };
        let (n, red) = (send.len(), Reducer::new(T::DTYPE, op));
        self.collective(
            T::DTYPE,
            Call::Reduce { root, input: Some(bytes(send)), out: bytes_mut(out), n, red },
        )
    }

    /// All-to-all: `send` (n elements) is cut into `size` blocks (see [`block_range`]); block `b`
    /// goes to member `b`. `recv` holds `size` equal slots of `self.block(n).len()` elements, slot
    /// `s` receiving member `s`'s block for this rank.
    pub fn all_to_all_into<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        let expect = self.block(send.len()).len() * self.size();
        check_len("all_to_all", "recv", recv.len(), expect)?;
        let (input, out) = (bytes(send), bytes_mut(recv));
        let print = Print::Collective(OpPrint {
            kind: OpKind::AllToAll,
            dtype: T::DTYPE,
            reduce: None,
            root: None,
            count: send.len() as u64,
            seq: 0,
        });
        // The tuner picks reads or the direct exchange (all-to-all has no ring; a ring it is
        // forced to, or a read the probe turns down, runs the direct exchange).
        let choice = self.planned_schedule("all_to_all", input.len());
        let want = if choice.family == Family::Read { Sched::Read } else { Sched::Direct };
        self.run("all_to_all", input.len(), want, print, |st, sched, w| {
            if self.size() == 1 {
                out.copy_from_slice(input);
                return Ok(());
            }
            let shape = self.direct_shape(T::DTYPE, choice.chunk_bytes);
            let links = &mut LinkTable(&mut st.links);
            match sched {
                Sched::Read => read::all_to_all(links, &shape, input, out, w),
                _ => direct::all_to_all(links, &shape, input, out, w),
            }
        })
    }

    /// Sends `buf` to member `peer`, which must call [`Communicator::recv_into`] with the same
    /// length. Returns once the data is handed to the transport.
    pub fn send<T: Element>(&self, buf: &[T], peer: usize) -> Result<()> {
        self.check_peer("send", peer)?;
        let (data, chunk) = (bytes(buf), self.cfg.chunk_bytes);
        let print = Print::Send(p2p_print::<T>(buf.len()), peer);
        self.run("send", data.len(), Sched::Pair, print, |st, _, w| {
            self.open_links(st, &[peer], w)?;
            let mut tx = LinkTable(&mut st.links);
            let mut tx = tx.tx(peer);
            data.chunks(chunk).try_for_each(|c| tx.send(c, w))
        })
    }

    /// Receives `buf.len()` elements from member `peer`.
    pub fn recv_into<T: Element>(&self, buf: &mut [T], peer: usize) -> Result<()> {
        self.check_peer("recv", peer)?;
        let print = Print::Recv(p2p_print::<T>(buf.len()), peer);
        let (data, chunk) = (bytes_mut(buf), self.cfg.chunk_bytes);
        self.run("recv", data.len(), Sched::Pair, print, |st, _, w| {
            self.open_links(st, &[peer], w)?;
            let mut rx = LinkTable(&mut st.links);
            let mut rx = rx.rx(peer);
            data.chunks_mut(chunk).try_for_each(|c| rx.recv(c, w))
        })
    }

    /// Waits until every member has called `barrier`.
    pub fn barrier(&self) -> Result<()> {
        let mut token = [0u8];
        self.all_reduce(&mut token, ReduceOp::Max)
    }

    /// Splits into sub-communicators: members passing the same `color` form one, ordered by
    /// (`key`, rank here). `None` as color joins none and returns `None`. Collective over this
    /// communicator.
    pub fn split(&self, color: Option<u32>, key: i64) -> Result<Option<Communicator>> {
        let k = self.size();
        let mut table = vec![0i64; 2 * k];
        table[2 * self.rank] = color.map_or(-1, i64::from);
        table[2 * self.rank + 1] = key;
        // Each rank fills only its own two entries and the rest are zero: a sum assembles the table.
        self.all_reduce(&mut table, ReduceOp::Sum)?;
        let split = {
            let mut st = self.lock();
            st.splits += 1;
            st.splits
        };
        let Some(color) = color else { return Ok(None) };
        let mut group: Vec<usize> = (0..k).filter(|&r| table[2 * r] == i64::from(color)).collect();
        group.sort_by_key(|&r| (table[2 * r + 1], r));
        let members: Vec<usize> = group.iter().map(|&r| self.members[r]).collect();
        let rank = group.iter().position(|&r| r == self.rank).expect("this rank is in its own color");
        let id = child_id(self.id, split, u64::from(color));
        Communicator::new(self.connector.clone(), id, members, rank, self.cfg.clone()).map(Some)
    }

    fn check_rank(&self, op: &str, r: usize) -> Result<()> {
        if r >= self.size() {
            return Err(Error::InvalidArgument(format!(
                "{op}: rank {r} out of range (size {})",
                self.size()
            )));
        }
        Ok(())
    }

    fn check_peer(&self, op: &str, peer: usize) -> Result<()> {
        self.check_rank(op, peer)?;
        if peer == self.rank {
            return Err(Error::InvalidArgument(format!("{op}: peer {peer} is this rank")));
        }
        Ok(())
    }
}

fn check_len(op: &str, what: &str, got: usize, want: usize) -> Result<()> {
    if got != want {
        return Err(Error::InvalidArgument(format!("{op}: `{what}` has {got} elements, expected {want}")));
    }
    Ok(())
}
