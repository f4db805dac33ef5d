//! In-process ranks for unit tests of the algorithms: threads joined by bounded in-memory FIFOs
//! that behave like transport links (ordered, `depth` messages in flight, closed on drop). The
//! links offer read access to the peer's memory (every rank is this process), unless a test asks
//! for links without it.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use crate::comm::{CommConfig, Communicator};
use crate::error::Result;
use crate::transport::{AbortState, Connector, Link, LinkKind, PeerMemory, RecvLink, SendLink, Waiter};

#[derive(Default)]
struct Fifo {
    state: Mutex<(VecDeque<Vec<u8>>, usize, bool)>, // (queued, in flight, sender gone)
    cv: Condvar,
}

struct MemSend {
    fifo: Arc<Fifo>,
    slot: Vec<u8>,
    peer: usize,
}

struct MemRecv {
    fifo: Arc<Fifo>,
    msg: Vec<u8>,
    peer: usize,
}

const DEPTH: usize = 4;
/// The default chunk plus the fingerprint in front of a call's first message.
const MAX_CHUNK: usize = (1 << 20) + crate::comm::fingerprint::PRINT_LEN;

impl SendLink for MemSend {
    fn reserve(&mut self, len: usize, w: &Waiter) -> Result<&mut [u8]> {
        let mut st = self.fifo.state.lock().unwrap();
        while st.1 >= DEPTH {
            w.check(self.peer)?;
            st = self.fifo.cv.wait_timeout(st, Duration::from_millis(5)).unwrap().0;
        }
        self.slot.resize(len, 0);
        Ok(&mut self.slot[..len])
    }
    fn post(&mut self, len: usize, _w: &Waiter) -> Result<()> {
        let mut st = self.fifo.state.lock().unwrap();
        st.0.push_back(self.slot[..len].to_vec());
        st.1 += 1;
        self.fifo.cv.notify_all();
        Ok(())
    }
    fn max_chunk(&self) -> usize {
        MAX_CHUNK
    }
    fn depth(&self) -> usize {
        DEPTH
    }
}

impl Drop for MemSend {
    fn drop(&mut self) {
        self.fifo.state.lock().unwrap().2 = true;
        self.fifo.cv.notify_all();
    }
}

impl RecvLink for MemRecv {
    fn wait(&mut self, w: &Waiter) -> Result<&[u8]> {
        let mut st = self.fifo.state.lock().unwrap();
        loop {
            if let Some(m) = st.0.pop_front() {
                self.msg = m;
                return Ok(&self.msg);
            }
            if st.2 {
                return Err(w.fail(self.peer, "peer closed the link"));
            }
            w.check(self.peer)?;
            st = self.fifo.cv.wait_timeout(st, Duration::from_millis(5)).unwrap().0;
        }
    }
    fn release(&mut self, _w: &Waiter) -> Result<()> {
        self.fifo.state.lock().unwrap().1 -= 1;
        self.fifo.cv.notify_all();
        Ok(())
    }
}

/// Shared switchboard: one FIFO per (communicator, from, to).
#[derive(Default)]
pub struct Hub {
    fifos: Mutex<HashMap<(u64, usize, usize), Arc<Fifo>>>,
}

/// A connector whose links are in-memory FIFOs through a [`Hub`].
pub struct MemConnector {
    rank: usize,
    size: usize,
    hub: Arc<Hub>,
    abort: Arc<AbortState>,
    peer_memory: bool,
    /// Node of each rank.
    nodes: Arc<Vec<usize>>,
}

impl Hub {
    fn fifo(&self, comm: u64, from: usize, to: usize) -> Arc<Fifo> {
        self.fifos.lock().unwrap().entry((comm, from, to)).or_default().clone()
    }
}

impl Connector for MemConnector {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn node_of(&self, rank: usize) -> usize {
        self.nodes[rank]
    }
    fn connect(&self, comm_id: u64, peer: usize, _w: &Waiter) -> Result<Link> {
        let send = MemSend { fifo: self.hub.fifo(comm_id, self.rank, peer), slot: Vec::new(), peer };
        let recv = MemRecv { fifo: self.hub.fifo(comm_id, peer, self.rank), msg: Vec::new(), peer };
        // Every in-process rank is this process, so single-copy reads of a peer read our own memory.
        // Links between emulated nodes offer no reads, as network links do not.
        let same_node = self.nodes[peer] == self.nodes[self.rank];
        let memory = if self.peer_memory && same_node { PeerMemory::new(std::process::id()) } else { None };
        Ok(Link { peer, kind: LinkKind::Shm, send: Box::new(send), recv: Box::new(recv), memory })
    }
    fn abort(&self) -> &Arc<AbortState> {
        &self.abort
    }
}

/// Runs `f` on `k` in-process ranks sharing one world communicator configured by `cfg`; returns
/// each rank's result in rank order.
pub fn run_ranks<R: Send + 'static>(
    k: usize,
    cfg: CommConfig,
    f: impl Fn(Communicator) -> R + Send + Sync + 'static,
) -> Vec<R> {
    spawn_ranks(vec![0; k], cfg, true, f)
}

/// As [`run_ranks`], rank `r` counting as running on node `node_of[r]` (`node_of.len()` ranks).
pub fn run_ranks_placed<R: Send + 'static>(
    node_of: Vec<usize>,
    cfg: CommConfig,
    f: impl Fn(Communicator) -> R + Send + Sync + 'static,
) -> Vec<R> {
    spawn_ranks(node_of, cfg, true, f)
}

/// As [`run_ranks`], rank `r` counting as running on node `r % nodes`.
pub fn run_ranks_on_nodes<R: Send + 'static>(
    k: usize,
    nodes: usize,
    cfg: CommConfig,
    f: impl Fn(Communicator) -> R + Send + Sync + 'static,
) -> Vec<R> {
    spawn_ranks((0..k).map(|r| r % nodes).collect(), cfg, true, f)
}

/// As [`run_ranks`], over links that cannot read the peer's memory (like TCP links).
pub fn run_ranks_without_peer_memory<R: Send + 'static>(
    k: usize,
    cfg: CommConfig,
    f: impl Fn(Communicator) -> R + Send + Sync + 'static,
) -> Vec<R> {
    spawn_ranks(vec![0; k], cfg, false, f)
}

fn spawn_ranks<R: Send + 'static>(
    nodes: Vec<usize>,
    cfg: CommConfig,
    peer_memory: bool,
    f: impl Fn(Communicator) -> R + Send + Sync + 'static,
) -> Vec<R> {
    let (k, nodes) = (nodes.len(), Arc::new(nodes));
    let hub = Arc::new(Hub::default());
    let f = Arc::new(f);
    let handles: Vec<_> = (0..k)
        .map(|rank| {
            let (hub, f, cfg, nodes) = (hub.clone(), f.clone(), cfg.clone(), nodes.clone());
            std::thread::spawn(move || {
                let abort = Arc::new(AbortState::default());
                let conn = MemConnector { rank, size: k, hub, abort, peer_memory, nodes };
                f(Communicator::world(Arc::new(conn), cfg).expect("world communicator"))
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
}
