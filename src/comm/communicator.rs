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
//! - the algorithm choice depends only on (operation, bytes, size, configuration), so it is the
//!   same on every member; any failure raises the job-wide abort so that no other rank hangs.

use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::comm::algo::direct::{self, DirectShape, Peers};
use crate::comm::algo::ring::{self, RingShape};
use crate::comm::block_range;
use crate::comm::dtype::{DType, Element, ReduceOp, Reducer};
use crate::comm::primitives::{Pipe, Rx, Tx};
use crate::comm::stats::CommStats;
use crate::error::{Error, Result};
use crate::transport::{Connector, Link, Waiter};

/// Which schedule a collective uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algo {
    /// Direct below [`CommConfig::small_bytes`], ring above (all-to-all is always direct).
    Auto,
    /// Always the ring (all-to-all stays direct).
    Ring,
    /// Always the direct all-pairs schedule.
    Direct,
}

/// Tunables shared by every member of a communicator (they must agree: take them from the same
/// environment on every rank).
#[derive(Debug, Clone)]
pub struct CommConfig {
    /// Deadline of one operation.
    pub timeout: Duration,
    /// Algorithm override (`MESHTRAIN_ALGO=auto|ring|direct`).
    pub algo: Algo,
    /// Largest message size, in bytes, for which `Auto` picks the direct schedule.
    pub small_bytes: usize,
    /// Largest message a schedule puts on a link, in bytes (every transport carries at least this).
    pub chunk_bytes: usize,
}

impl Default for CommConfig {
    fn default() -> Self {
        CommConfig { timeout: Duration::from_secs(300), algo: Algo::Auto, small_bytes: 64 << 10, chunk_bytes: 1 << 20 }
    }
}

impl CommConfig {
    /// Defaults overridden by `MESHTRAIN_TIMEOUT` (seconds), `MESHTRAIN_ALGO`,
    /// `MESHTRAIN_SMALL_BYTES` and `MESHTRAIN_CHUNK_BYTES`.
    pub fn from_env() -> Result<Self> {
        let mut c = CommConfig::default();
        let get = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let num = |k: &str, v: String| {
            v.parse::<f64>().ok().filter(|x| *x > 0.0).ok_or_else(|| Error::config(k, format!("`{v}` is not a positive number")))
        };
        if let Some(v) = get("MESHTRAIN_TIMEOUT") {
            c.timeout = Duration::from_secs_f64(num("MESHTRAIN_TIMEOUT", v)?);
        }
        if let Some(v) = get("MESHTRAIN_ALGO") {
            c.algo = match v.to_ascii_lowercase().as_str() {
                "auto" => Algo::Auto,
                "ring" => Algo::Ring,
                "direct" => Algo::Direct,
                _ => return Err(Error::config("MESHTRAIN_ALGO", format!("`{v}` is not one of auto, ring, direct"))),
            };
        }
        if let Some(v) = get("MESHTRAIN_SMALL_BYTES") {
            c.small_bytes = num("MESHTRAIN_SMALL_BYTES", v)? as usize;
        }
        if let Some(v) = get("MESHTRAIN_CHUNK_BYTES") {
            let b = num("MESHTRAIN_CHUNK_BYTES", v)? as usize;
            if b < 64 || b % 64 != 0 {
                return Err(Error::config("MESHTRAIN_CHUNK_BYTES", "must be a multiple of 64 bytes"));
            }
            c.chunk_bytes = b;
        }
        Ok(c)
    }
}

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
    state: Mutex<State>,
    stats: Arc<CommStats>,
}

struct State {
    /// Link with each member (by communicator rank), opened on demand.
    links: Vec<Option<Link>>,
    seq: u64,
    splits: u64,
    /// One chunk of working space for the direct reductions.
    scratch: Vec<u8>,
}

/// The links of a communicator, addressed by member rank (for the direct schedules).
struct LinkTable<'a>(&'a mut [Option<Link>]);

impl Peers for LinkTable<'_> {
    fn tx(&mut self, to: usize) -> Tx<'_> {
        let l = self.0[to].as_mut().expect("link opened before use");
        Tx::new(&mut *l.send, l.peer)
    }
    fn rx(&mut self, from: usize) -> Rx<'_> {
        let l = self.0[from].as_mut().expect("link opened before use");
        Rx::new(&mut *l.recv, l.peer)
    }
}

/// The pipe of a ring position: receive from `prev`, send to `next` (member ranks).
fn ring_pipe(links: &mut [Option<Link>], prev: usize, next: usize) -> Pipe<'_> {
    if prev == next {
        let l = links[prev].as_mut().expect("ring link opened");
        return Pipe { rx: Rx::new(&mut *l.recv, l.peer), tx: Tx::new(&mut *l.send, l.peer) };
    }
    let [p, n] = links.get_disjoint_mut([prev, next]).expect("prev != next, both in range");
    let (p, n) = (p.as_mut().expect("ring link opened"), n.as_mut().expect("ring link opened"));
    Pipe { rx: Rx::new(&mut *p.recv, p.peer), tx: Tx::new(&mut *n.send, n.peer) }
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
    /// The communicator of all ranks the connector knows (id 0). Every rank must call it.
    pub fn world(connector: Arc<dyn Connector>, cfg: CommConfig) -> Result<Self> {
        let members: Vec<usize> = (0..connector.size()).collect();
        let rank = connector.rank();
        Self::new(connector, 0, members, rank, cfg)
    }

    fn new(connector: Arc<dyn Connector>, id: u64, members: Vec<usize>, rank: usize, cfg: CommConfig) -> Result<Self> {
        let k = members.len();
        let mut ring: Vec<usize> = (0..k).collect();
        ring.sort_by_key(|&r| (connector.node_of(members[r]), members[r]));
        let mut seen = vec![false; k];
        for &r in &ring {
            assert!(r < k && !std::mem::replace(&mut seen[r], true), "ring is a permutation of the members");
        }
        let ring_pos = ring.iter().position(|&r| r == rank).expect("every member is on the ring");
        if rank == 0 {
            let text: Vec<String> = ring.iter().map(|r| r.to_string()).collect();
            log::info!("comm {id:#x} ({k} ranks) ring 0: {}", text.join(" "));
        }
        let links = (0..k).map(|_| None).collect();
        let scratch = vec![0u8; cfg.chunk_bytes];
        let comm = Communicator {
            connector,
            id,
            rank,
            members,
            ring,
            ring_pos,
            cfg,
            state: Mutex::new(State { links, seq: 0, splits: 0, scratch }),
            stats: CommStats::new(k),
        };
        if k > 1 {
            let (prev, next) = comm.ring_neighbours();
            let mut st = comm.lock();
            let w = comm.waiter("connect", 0, 0);
            comm.open_links(&mut st, &[prev, next], &w)?;
        }
        Ok(comm)
    }

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

    /// Traffic counters of this communicator (shared: readable after the communicator moved to
    /// another thread).
    pub fn stats(&self) -> Arc<CommStats> {
        self.stats.clone()
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
        let mut todo: Vec<usize> = peers.iter().copied().filter(|&p| p != self.rank && st.links[p].is_none()).collect();
        todo.sort_by_key(|&p| {
            let other = self.members[p];
            (me.min(other), me.max(other))
        });
        todo.dedup();
        for p in todo {
            let link = self.connector.connect(self.id, self.members[p], w)?;
            if link.send.max_chunk() < self.cfg.chunk_bytes || link.send.depth() < 2 {
                return Err(w.fail(link.peer, "link too small for the configured chunk size (or fewer than 2 slots)"));
            }
            st.links[p] = Some(link);
        }
        Ok(())
    }

    fn use_direct(&self, bytes: usize) -> bool {
        match self.cfg.algo {
            Algo::Ring => false,
            Algo::Direct => true,
            Algo::Auto => bytes <= self.cfg.small_bytes,
        }
    }

    /// Runs one operation: sequence number, waiter, and abort on failure.
    fn run(
        &self,
        op: &'static str,
        bytes: usize,
        direct: bool,
        f: impl FnOnce(&mut State, &Waiter) -> Result<()>,
    ) -> Result<()> {
        let mut st = self.lock();
        st.seq += 1;
        let w = self.waiter(op, st.seq, bytes);
        let start = std::time::Instant::now();
        let result = (|| {
            if direct && self.size() > 1 {
                let all: Vec<usize> = (0..self.size()).collect();
                self.open_links(&mut st, &all, &w)?;
            }
            f(&mut st, &w)
        })();
        self.stats.record(op, bytes, start.elapsed());
        if let Err(e) = &result {
            if !matches!(e, Error::Aborted { .. }) {
                self.connector.abort().raise(&e.to_string());
            }
        }
        result
    }

    fn ring_shape(&self, dtype: DType) -> RingShape<'_> {
        RingShape { order: &self.ring, pos: self.ring_pos, esize: dtype.size(), chunk: self.cfg.chunk_bytes / dtype.size() }
    }

    fn direct_shape(&self, dtype: DType) -> DirectShape {
        DirectShape { k: self.size(), me: self.rank, esize: dtype.size(), chunk: self.cfg.chunk_bytes / dtype.size() }
    }

    fn all_reduce_bytes(&self, dtype: DType, op: ReduceOp, input: Option<&[u8]>, out: &mut [u8]) -> Result<()> {
        let red = Reducer::new(dtype, op);
        let direct = self.use_direct(out.len());
        self.run("all_reduce", out.len(), direct, |st, w| {
            if self.size() == 1 {
                copy_separate(input, out);
                return Ok(());
            }
            if direct {
                let State { links, scratch, .. } = st;
                direct::all_reduce(&mut LinkTable(links), &self.direct_shape(dtype), input, out, scratch, &red, w)
            } else {
                let (prev, next) = self.ring_neighbours();
                let mut pipe = ring_pipe(&mut st.links, prev, next);
                ring::all_reduce(&mut pipe, &self.ring_shape(dtype), input, out, &red, w)
            }
        })
    }

    /// In-place all-reduce of `buf`.
    pub fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.all_reduce_bytes(T::DTYPE, op, None, bytes_mut(buf))
    }

    /// All-reduce of `send` into `recv` (same length).
    pub fn all_reduce_into<T: Element>(&self, send: &[T], recv: &mut [T], op: ReduceOp) -> Result<()> {
        check_len("all_reduce", "recv", recv.len(), send.len())?;
        self.all_reduce_bytes(T::DTYPE, op, Some(bytes(send)), bytes_mut(recv))
    }

    fn reduce_scatter_bytes(
        &self,
        dtype: DType,
        op: ReduceOp,
        input: Option<&[u8]>,
        out: &mut [u8],
        n: usize,
    ) -> Result<()> {
        let red = Reducer::new(dtype, op);
        let direct = self.use_direct(n * dtype.size());
        self.run("reduce_scatter", n * dtype.size(), direct, |st, w| {
            if self.size() == 1 {
                copy_separate(input, out);
                return Ok(());
            }
            if direct {
                let State { links, scratch, .. } = st;
                let s = self.direct_shape(dtype);
                direct::reduce_scatter(&mut LinkTable(links), &s, input, out, n, scratch, &red, w)
            } else {
                let (prev, next) = self.ring_neighbours();
                let mut pipe = ring_pipe(&mut st.links, prev, next);
                ring::reduce_scatter(&mut pipe, &self.ring_shape(dtype), input, out, n, &red, w)
            }
        })
    }

    /// In-place reduce-scatter: afterwards `buf[self.block(buf.len())]` holds this rank's block of
    /// the reduction; the rest of `buf` is unspecified.
    pub fn reduce_scatter<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let n = buf.len();
        self.reduce_scatter_bytes(T::DTYPE, op, None, bytes_mut(buf), n)
    }

    /// Reduce-scatter of `send` (n elements): `recv` receives this rank's block
    /// (`self.block(n).len()` elements).
    pub fn reduce_scatter_into<T: Element>(&self, send: &[T], recv: &mut [T], op: ReduceOp) -> Result<()> {
        check_len("reduce_scatter", "recv", recv.len(), self.block(send.len()).len())?;
        self.reduce_scatter_bytes(T::DTYPE, op, Some(bytes(send)), bytes_mut(recv), send.len())
    }

    fn all_gather_bytes(&self, dtype: DType, input: Option<&[u8]>, out: &mut [u8]) -> Result<()> {
        let direct = self.use_direct(out.len());
        self.run("all_gather", out.len(), direct, |st, w| {
            if self.size() == 1 {
                copy_separate(input, out);
                return Ok(());
            }
            if direct {
                direct::all_gather(&mut LinkTable(&mut st.links), &self.direct_shape(dtype), input, out, w)
            } else {
                let (prev, next) = self.ring_neighbours();
                let mut pipe = ring_pipe(&mut st.links, prev, next);
                ring::all_gather(&mut pipe, &self.ring_shape(dtype), input, out, w)
            }
        })
    }

    /// In-place all-gather: this rank's block `buf[self.block(buf.len())]` is sent, every other
    /// block is filled in.
    pub fn all_gather<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        self.all_gather_bytes(T::DTYPE, None, bytes_mut(buf))
    }

    /// All-gather of each rank's `send` block into `recv`; `send.len()` must equal
    /// `self.block(recv.len()).len()`.
    pub fn all_gather_into<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        check_len("all_gather", "send", send.len(), self.block(recv.len()).len())?;
        self.all_gather_bytes(T::DTYPE, Some(bytes(send)), bytes_mut(recv))
    }

    /// Broadcast of `buf` from member `root`.
    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.check_rank("broadcast", root)?;
        let buf = bytes_mut(buf);
        let direct = self.use_direct(buf.len());
        self.run("broadcast", buf.len(), direct, |st, w| {
            if self.size() == 1 {
                return Ok(());
            }
            if direct {
                direct::broadcast(&mut LinkTable(&mut st.links), &self.direct_shape(T::DTYPE), root, buf, w)
            } else {
                let (prev, next) = self.ring_neighbours();
                let root_pos = self.ring.iter().position(|&r| r == root).expect("root is a member");
                let mut pipe = ring_pipe(&mut st.links, prev, next);
                ring::broadcast(&mut pipe, &self.ring_shape(T::DTYPE), root_pos, buf, w)
            }
        })
    }

    fn reduce_bytes(
        &self,
        dtype: DType,
        op: ReduceOp,
        root: usize,
        input: Option<&[u8]>,
        out: &mut [u8],
        n: usize,
    ) -> Result<()> {
        self.check_rank("reduce", root)?;
        let red = Reducer::new(dtype, op);
        let direct = self.use_direct(n * dtype.size());
        self.run("reduce", n * dtype.size(), direct, |st, w| {
            if self.size() == 1 {
                copy_separate(input, out);
                return Ok(());
            }
            if direct {
                let State { links, scratch, .. } = st;
                let s = self.direct_shape(dtype);
                direct::reduce(&mut LinkTable(links), &s, root, input, out, n, scratch, &red, w)
            } else {
                let (prev, next) = self.ring_neighbours();
                let root_pos = self.ring.iter().position(|&r| r == root).expect("root is a member");
                let mut pipe = ring_pipe(&mut st.links, prev, next);
                ring::reduce(&mut pipe, &self.ring_shape(dtype), root_pos, input, out, n, &red, w)
            }
        })
    }

    /// In-place reduce onto `root`: the root's `buf` receives the result; other ranks' `buf` is
    /// left unchanged.
    pub fn reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp, root: usize) -> Result<()> {
        let n = buf.len();
        self.reduce_bytes(T::DTYPE, op, root, None, bytes_mut(buf), n)
    }

    /// Reduce of `send` onto `root`'s `recv` (same length as `send` at the root; ignored, and may be
    /// empty, elsewhere).
    pub fn reduce_into<T: Element>(&self, send: &[T], recv: &mut [T], op: ReduceOp, root: usize) -> Result<()> {
        if self.rank == root {
            check_len("reduce", "recv", recv.len(), send.len())?;
        }
        let out: &mut [T] = if self.rank == root { recv } else { &mut [] };
        self.reduce_bytes(T::DTYPE, op, root, Some(bytes(send)), bytes_mut(out), send.len())
    }

    /// All-to-all: `send` (n elements) is cut into `size` blocks (see [`block_range`]); block `b`
    /// goes to member `b`. `recv` holds `size` equal slots of `self.block(n).len()` elements, slot
    /// `s` receiving member `s`'s block for this rank.
    pub fn all_to_all_into<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        let expect = self.block(send.len()).len() * self.size();
        check_len("all_to_all", "recv", recv.len(), expect)?;
        let (input, out) = (bytes(send), bytes_mut(recv));
        self.run("all_to_all", input.len(), true, |st, w| {
            if self.size() == 1 {
                out.copy_from_slice(input);
                return Ok(());
            }
            direct::all_to_all(&mut LinkTable(&mut st.links), &self.direct_shape(T::DTYPE), input, out, w)
        })
    }

    /// Sends `buf` to member `peer`, which must call [`Communicator::recv_into`] with the same
    /// length. Returns once the data is handed to the transport.
    pub fn send<T: Element>(&self, buf: &[T], peer: usize) -> Result<()> {
        self.check_peer("send", peer)?;
        let (data, chunk) = (bytes(buf), self.cfg.chunk_bytes);
        self.run("send", data.len(), false, |st, w| {
            self.open_links(st, &[peer], w)?;
            let mut tx = LinkTable(&mut st.links);
            let mut tx = tx.tx(peer);
            data.chunks(chunk).try_for_each(|c| tx.send(c, w))
        })
    }

    /// Receives `buf.len()` elements from member `peer`.
    pub fn recv_into<T: Element>(&self, buf: &mut [T], peer: usize) -> Result<()> {
        self.check_peer("recv", peer)?;
        let (data, chunk) = (bytes_mut(buf), self.cfg.chunk_bytes);
        self.run("recv", data.len(), false, |st, w| {
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
            return Err(Error::InvalidArgument(format!("{op}: rank {r} out of range (size {})", self.size())));
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

/// A one-rank collective: the result is the input (already in place when there is no separate one).
fn copy_separate(input: Option<&[u8]>, out: &mut [u8]) {
    if let Some(i) = input {
        out.copy_from_slice(i);
    }
}

fn check_len(op: &str, what: &str, got: usize, want: usize) -> Result<()> {
    if got != want {
        return Err(Error::InvalidArgument(format!("{op}: `{what}` has {got} elements, expected {want}")));
    }
    Ok(())
}
