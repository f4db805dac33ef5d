//! The network [`Connector`]: authenticated TCP connections between the ranks of one job, and the
//! choice of shared memory or TCP for each link.
//!
//! Why: every rank listens on one port; anything may connect to it, so each connection is
//! authenticated with the job secret ([`super::handshake`]) before it is handed to the code waiting
//! for it, and strangers are rejected without claiming anything. Links are opened pairwise: the lower
//! rank dials the higher one's listener and sends a setup message saying which transport to use; the
//! higher rank takes the stream from its accept thread. Ranks on one node (and not `force_tcp`) get a
//! shared-memory segment created by the lower rank; the stream then only serves as liveness signal.
//! libfabric links ([`super::ofi`]) exchange endpoint addresses over the stream and keep it likewise.
//!
//! Invariants: a lower rank's `connect` never waits for the higher rank's application thread (only
//! for its accept thread), and a higher rank waits only for lower ranks, so no call order of
//! `connect` among ranks can deadlock (libfabric links excepted: their address exchange waits for
//! the peer). A lower rank may drop a shared-memory link before the higher rank mapped it: its drop
//! then waits for the attach ([`super::shm`], lifetime), so the name never disappears under a
//! connecting peer. Every incoming handshake runs on its own thread with a deadline;
//! a stream is delivered once per (comm_id, from_rank, tag) and duplicates are rejected. The n-th
//! `connect(comm, peer)` on one rank pairs with the n-th on the peer (the tag counts them).

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use log::debug;
use sha2::Sha256;

use super::accept::Acceptor;
#[cfg(test)]
use super::accept::MAX_HANDSHAKES;
use super::handshake::{self, Request};
use super::shm::{self, Lingering, PeerWatch, Segment};
use super::ofi::{OfiNet, OfiUse};
use super::select::{self, GpuDirect};
use super::tcp::{self, tcp_link};
use super::{AbortState, Connector, Link, LinkKind, PeerMemory, Waiter};
use crate::env;
use crate::error::{Error, Result};

/// Tags with this bit are used by [`Connector::connect`]; raw streams use the tags below it.
pub const LINK_TAG: u32 = 1 << 31;
/// Pause between attempts to reach a listener that refused the connection.
const CONNECT_RETRY: Duration = Duration::from_millis(20);
/// Setup message kinds (first byte sent by the lower rank after the handshake).
const SETUP_SHM: u8 = 1;
const SETUP_TCP: u8 = 2;
const SETUP_OFI: u8 = 3;
const SETUP_LEN: usize = 1 + 4 + 8 + 4;

/// Settings of the network connector.
#[derive(Debug, Clone)]
pub struct NetConfig {
    /// Address the listener binds to (port chosen by the OS).
    pub bind_ip: IpAddr,
    /// Use TCP even between ranks of one node.
    pub force_tcp: bool,
    /// Where libfabric carries links (chunk and depth as for TCP).
    pub ofi: OfiUse,
    /// libfabric provider (None: libfabric's preference).
    pub ofi_provider: Option<String>,
    /// Whether device buffers may be posted to libfabric directly (`MESHTRAIN_GPU_DIRECT`).
    pub gpu_direct: GpuDirect,
    /// Limit for each handshake and link setup exchange.
    pub handshake_timeout: Duration,
    /// Slot size of shared-memory links.
    pub shm_chunk: usize,
    /// Slots per direction of shared-memory links.
    pub shm_depth: usize,
    /// Chunk size of TCP links.
    pub tcp_chunk: usize,
    /// Buffers per direction of TCP links.
    pub tcp_depth: usize,
    /// Short job identifier put into shm segment names (sanitised, may be empty).
    pub job_tag: String,
}

impl NetConfig {
    /// Defaults: 5 s handshakes, shm 512 KiB x 4, TCP 1 MiB x 4, transport chosen by node.
    pub fn new(bind_ip: IpAddr, job_tag: &str) -> NetConfig {
        NetConfig {
            bind_ip,
            force_tcp: false,
            ofi: OfiUse::Never,
            ofi_provider: None,
            gpu_direct: GpuDirect::Auto,
            handshake_timeout: Duration::from_secs(5),
            shm_chunk: shm::DEFAULT_SHM_CHUNK,
            shm_depth: shm::DEFAULT_SHM_DEPTH,
            tcp_chunk: tcp::DEFAULT_TCP_CHUNK,
            tcp_depth: tcp::DEFAULT_TCP_DEPTH,
            job_tag: job_tag.to_string(),
        }
    }

    /// Applies `MESHTRAIN_TRANSPORT` and `MESHTRAIN_GPU_DIRECT` (see [`super::select`]), the
    /// libfabric provider, `MESHTRAIN_SHM_CHUNK`, `MESHTRAIN_SHM_DEPTH`,
    /// `MESHTRAIN_TCP_CHUNK` and `MESHTRAIN_TCP_DEPTH` (sizes accept a K/M/G suffix).
    pub fn with_env(mut self) -> Result<NetConfig> {
        (self.force_tcp, self.ofi) = select::transport_from_env()?;
        self.gpu_direct = select::gpu_direct_from_env(self.ofi)?;
        self.ofi_provider = env::ofi_provider();
        let sizes = [env::shm_chunk()?, env::shm_depth()?, env::tcp_chunk()?, env::tcp_depth()?];
        let fields = [&mut self.shm_chunk, &mut self.shm_depth, &mut self.tcp_chunk, &mut self.tcp_depth];
        for (field, v) in fields.into_iter().zip(sizes) {
            if let Some(v) = v {
                *field = v;
            }
        }
        self.validate()?;
        Ok(self)
    }

    fn validate(&self) -> Result<()> {
        let check = |key: &str, v: usize, max: usize| {
            if v == 0 || v > max {
                Err(Error::config(key, format!("{v} is outside the allowed 1..={max}")))
            } else {
                Ok(())
            }
        };
        check("MESHTRAIN_SHM_CHUNK", self.shm_chunk, shm::MAX_SHM_CHUNK)?;
        check("MESHTRAIN_SHM_DEPTH", self.shm_depth, shm::MAX_SHM_DEPTH)?;
        check("MESHTRAIN_TCP_CHUNK", self.tcp_chunk, tcp::MAX_TCP_CHUNK)?;
        check("MESHTRAIN_TCP_DEPTH", self.tcp_depth, tcp::MAX_TCP_DEPTH)
    }
}

/// Where a rank listens and which node it runs on (from the bootstrap's address exchange).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerInfo {
    /// The rank's listener address.
    pub addr: SocketAddr,
    /// Node index; ranks with equal index share memory.
    pub node: usize,
    /// Process id on that node (0: unknown); used to notice a dead shared-memory peer.
    pub pid: u32,
}

/// Opens authenticated links between the ranks of one job over TCP and shared memory.
pub struct NetConnector {
    rank: usize,
    size: usize,
    secret: [u8; 16],
    cfg: NetConfig,
    abort: Arc<AbortState>,
    acceptor: Acceptor,
    peers: OnceLock<Vec<PeerInfo>>,
    /// Links opened so far per (comm_id, peer); numbers the next one.
    links_opened: Mutex<HashMap<(u64, usize), u32>>,
    shm_prefix: String,
    ofi: OfiNet,
}

impl NetConnector {
    /// Binds `cfg.bind_ip:0` and starts accepting connections for world rank `rank` of `size`.
    pub fn new(
        rank: usize,
        size: usize,
        secret: [u8; 16],
        cfg: NetConfig,
        abort: Arc<AbortState>,
    ) -> Result<Self> {
        if rank >= size {
            return Err(Error::InvalidArgument(format!(
                "rank {rank} is outside world size {size}"
            )));
        }
        cfg.validate()?;
        let bind = SocketAddr::new(cfg.bind_ip, 0);
        let acceptor = Acceptor::start(rank, size, secret, cfg.handshake_timeout, bind)?;
        let shm_prefix = shm_prefix(&cfg.job_tag, &secret);
        let ofi = OfiNet::new(rank, cfg.ofi_provider.clone(), cfg.gpu_direct);
        Ok(NetConnector {
            rank,
            size,
            secret,
            cfg,
            abort,
            acceptor,
            peers: OnceLock::new(),
            links_opened: Mutex::new(HashMap::new()),
            shm_prefix,
            ofi,
        })
    }

    /// The listener's address (to publish in the bootstrap's address exchange).
    pub fn local_addr(&self) -> SocketAddr {
        self.acceptor.local_addr()
    }

    /// Records every rank's address, node and pid; call once, with `size` entries.
    pub fn set_peers(&self, peers: Vec<PeerInfo>) -> Result<()> {
        if peers.len() != self.size {
            return Err(Error::InvalidArgument(format!(
                "{} peer entries for world size {}",
                peers.len(),
                self.size
            )));
        }
        self.peers
            .set(peers)
            .map_err(|_| Error::InvalidArgument("set_peers called twice".into()))
    }

    /// One connector per entry of `aborts` (rank = index), all in this process on node 0, that
    /// already know each other's listeners: an in-process world for tests and benchmarks, where
    /// the bootstrap's address exchange has no part. `aborts` may repeat one state or give each
    /// rank its own (as separate processes would have).
    pub fn local_group(secret: [u8; 16], cfg: &NetConfig, aborts: Vec<Arc<AbortState>>) -> Result<Vec<Self>> {
        let size = aborts.len();
        let conns = aborts
            .into_iter()
            .enumerate()
            .map(|(r, abort)| NetConnector::new(r, size, secret, cfg.clone(), abort))
            .collect::<Result<Vec<_>>>()?;
        let pid = std::process::id();
        let peers: Vec<_> = conns
            .iter()
            .map(|c| PeerInfo {
                addr: c.local_addr(),
                node: 0,
                pid,
            })
            .collect();
        for c in &conns {
            c.set_peers(peers.clone())?;
        }
        Ok(conns)
    }

    /// File-name prefix of this job's shm segments (as listed in /dev/shm).
    pub fn shm_prefix(&self) -> &str {
        &self.shm_prefix
    }

    /// Dials `addr` (rank `peer`) and authenticates a raw stream for (`comm_id`, `tag`), `tag < LINK_TAG`.
    pub fn connect_stream(
        &self,
        addr: SocketAddr,
        peer: usize,
        comm_id: u64,
        tag: u32,
        w: &Waiter,
    ) -> Result<TcpStream> {
        check_raw_tag(tag)?;
        self.dial(addr, peer, comm_id, tag, w)
    }

    /// Waits for the authenticated raw stream from rank `peer` for (`comm_id`, `tag`), `tag < LINK_TAG`.
    pub fn accept_stream(&self, peer: usize, comm_id: u64, tag: u32, w: &Waiter) -> Result<TcpStream> {
        check_raw_tag(tag)?;
        self.await_stream(peer, comm_id, tag, w)
    }

    /// Connects and authenticates; a listener that turns the connection away before its hello
    /// (all its handshake slots busy, e.g. with idle strangers) is tried again until `w`'s deadline.
    fn dial(&self, addr: SocketAddr, peer: usize, comm_id: u64, tag: u32, w: &Waiter) -> Result<TcpStream> {
        let timeout = self.cfg.handshake_timeout;
        let req = Request {
            from: self.rank as u32,
            to: peer as u32,
            comm_id,
            tag,
        };
        let mut busy = 0u32;
        let stream = loop {
            let mut stream = self.connect_tcp(addr, peer, w)?;
            match handshake::client(&mut stream, &self.secret, &req, timeout) {
                Ok(()) => break stream,
                Err(e) if e.retry => {
                    busy += 1;
                    if busy == 1 || busy % 50 == 0 {
                        log::warn!("transport: rank {}: rank {peer} at {addr} busy ({e}); trying again", self.rank);
                    }
                    w.check(peer).map_err(|_| w.fail(peer, format!("handshake with {addr}: {e} ({busy} tries)")))?;
                    std::thread::sleep(CONNECT_RETRY * busy.min(10));
                }
                Err(e) => return Err(w.fail(peer, format!("handshake with {addr}: {e}"))),
            }
        };
        let setup = |s: &TcpStream| -> std::io::Result<()> {
            s.set_nodelay(true)?;
            s.set_read_timeout(None)?;
            s.set_write_timeout(None)
        };
        setup(&stream).map_err(|e| w.fail(peer, format!("configure stream to {addr}: {e}")))?;
        Ok(stream)
    }

    /// A TCP connection to `addr`, retrying while nothing listens there yet.
    fn connect_tcp(&self, addr: SocketAddr, peer: usize, w: &Waiter) -> Result<TcpStream> {
        let timeout = self.cfg.handshake_timeout;
        let give_up = Instant::now() + timeout;
        loop {
            match TcpStream::connect_timeout(&addr, timeout) {
                Ok(s) => return Ok(s),
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused && Instant::now() < give_up => {
                    w.check(peer)?;
                    std::thread::sleep(CONNECT_RETRY);
                }
                Err(e) => return Err(w.fail(peer, format!("connect to {addr}: {e}"))),
            }
        }
    }

    fn await_stream(&self, peer: usize, comm_id: u64, tag: u32, w: &Waiter) -> Result<TcpStream> {
        self.acceptor.take((comm_id, peer, tag), peer, w)
    }

    fn peer(&self, peer: usize) -> Result<&PeerInfo> {
        self.peers
            .get()
            .map(|p| &p[peer])
            .ok_or_else(|| Error::Bootstrap {
                rank: self.rank,
                msg: format!("address of rank {peer} unknown: set_peers was not called"),
            })
    }

    /// Name of the shm segment of link `tag` between `lower` and `higher` on `comm_id`.
    fn shm_name(&self, comm_id: u64, lower: usize, higher: usize, tag: u32) -> String {
        format!(
            "/{}-{comm_id:x}-{lower}-{higher}-{:x}",
            self.shm_prefix,
            tag & !LINK_TAG
        )
    }

    /// Lower rank: announces the transport and builds its half of the link.
    fn offer_link(
        &self,
        mut stream: TcpStream,
        comm_id: u64,
        peer: usize,
        tag: u32,
        w: &Waiter,
    ) -> Result<Link> {
        let pid = self.peer(peer)?.pid;
        let same_node = self.node_of(self.rank) == self.node_of(peer);
        let use_ofi = match self.cfg.ofi {
            OfiUse::Never => false,
            OfiUse::BetweenNodes => !same_node,
            OfiUse::Always => true,
        };
        if use_ofi {
            send_setup(&mut stream, SETUP_OFI, self.cfg.tcp_chunk, self.cfg.tcp_depth)
                .map_err(|e| w.fail(peer, format!("sending ofi link setup: {e}")))?;
            return self.ofi_link(stream, peer, self.cfg.tcp_chunk, self.cfg.tcp_depth, w);
        }
        if !self.cfg.force_tcp && same_node {
            let name = self.shm_name(comm_id, self.rank, peer, tag);
            let seg = Segment::create(&name, self.cfg.shm_chunk, self.cfg.shm_depth)?;
            send_setup(&mut stream, SETUP_SHM, self.cfg.shm_chunk, self.cfg.shm_depth)
                .map_err(|e| w.fail(peer, format!("sending shm link setup: {e}")))?;
            // Dropping this side keeps the name until the peer mapped it (see `shm::Lingering`).
            let linger = Lingering { abort: self.abort.clone(), limit: w.deadline.saturating_duration_since(w.start) };
            let (send, recv) = shm::shm_link(seg, true, peer, PeerWatch::new(stream, pid), Some(linger));
            return Ok(Link {
                peer,
                kind: LinkKind::Shm,
                send: Box::new(send),
                recv: Box::new(recv),
                memory: PeerMemory::new(pid),
            });
        }
        send_setup(&mut stream, SETUP_TCP, self.cfg.tcp_chunk, self.cfg.tcp_depth)
            .map_err(|e| w.fail(peer, format!("sending tcp link setup: {e}")))?;
        let (send, recv) = tcp_link(stream, peer, self.cfg.tcp_chunk, self.cfg.tcp_depth)?;
        Ok(Link {
            peer,
            kind: LinkKind::Tcp,
            send: Box::new(send),
            recv: Box::new(recv),
            memory: None,
        })
    }

    /// Either rank: builds its half of a libfabric link (addresses go over `stream`).
    fn ofi_link(&self, stream: TcpStream, peer: usize, chunk: usize, depth: usize, w: &Waiter) -> Result<Link> {
        if chunk == 0 || chunk > tcp::MAX_TCP_CHUNK || depth == 0 || depth > tcp::MAX_TCP_DEPTH {
            return Err(w.fail(peer, format!("ofi link setup: chunk {chunk} / depth {depth} out of range")));
        }
        let here = self.node_of(self.rank);
        let pid = if self.node_of(peer) == here { self.peer(peer)?.pid } else { 0 };
        let local_rank = (0..self.rank).filter(|&r| self.node_of(r) == here).count();
        let (send, recv) = self.ofi.link(stream, peer, pid, chunk, depth, local_rank, w)?;
        Ok(Link { peer, kind: LinkKind::Ofi, send, recv, memory: None })
    }

    /// Higher rank: reads the lower rank's setup message and builds its half of the link.
    fn take_link(
        &self,
        mut stream: TcpStream,
        comm_id: u64,
        peer: usize,
        tag: u32,
        w: &Waiter,
    ) -> Result<Link> {
        let mut msg = [0u8; SETUP_LEN];
        stream
            .set_read_timeout(Some(self.cfg.handshake_timeout))
            .and_then(|_| stream.read_exact(&mut msg))
            .and_then(|_| stream.set_read_timeout(None))
            .map_err(|e| w.fail(peer, format!("reading link setup: {e}")))?;
        let pid = u32::from_le_bytes([msg[1], msg[2], msg[3], msg[4]]);
        let mut chunk = [0u8; 8];
        chunk.copy_from_slice(&msg[5..13]);
        let chunk = u64::from_le_bytes(chunk) as usize;
        let depth = u32::from_le_bytes([msg[13], msg[14], msg[15], msg[16]]) as usize;
        match msg[0] {
            SETUP_SHM => {
                let name = self.shm_name(comm_id, peer, self.rank, tag);
                let seg = match Segment::try_open(&name) {
                    Ok(Some(seg)) => seg,
                    Ok(None) => return Err(w.fail(peer, format!("rank {peer} removed its shm link segment before this rank mapped it (rank {peer} dropped the link after the job aborted, or waited in vain for this rank to attach)"))),
                    Err(e) => return Err(w.fail(peer, format!("mapping shm link: {e}"))),
                };
                seg.unlink();
                if seg.chunk() != chunk || seg.depth() != depth {
                    return Err(w.fail(peer, format!("shm segment {name} does not match the link setup")));
                }
                let (send, recv) = shm::shm_link(seg, false, peer, PeerWatch::new(stream, pid), None);
                Ok(Link {
                    peer,
                    kind: LinkKind::Shm,
                    send: Box::new(send),
                    recv: Box::new(recv),
                    memory: PeerMemory::new(pid),
                })
            }
            SETUP_TCP => {
                let (send, recv) = tcp_link(stream, peer, chunk, depth)
                    .map_err(|e| w.fail(peer, format!("tcp link setup: {e}")))?;
                Ok(Link {
                    peer,
                    kind: LinkKind::Tcp,
                    send: Box::new(send),
                    recv: Box::new(recv),
                    memory: None,
                })
            }
            SETUP_OFI => self.ofi_link(stream, peer, chunk, depth, w),
            k => Err(w.fail(peer, format!("link setup names unknown transport {k}"))),
        }
    }
}

impl Connector for NetConnector {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    /// Node of `rank` as given to `set_peers`; before that, every rank counts as its own node.
    fn node_of(&self, rank: usize) -> usize {
        self.peers
            .get()
            .and_then(|p| p.get(rank))
            .map_or(rank, |p| p.node)
    }

    fn connect(&self, comm_id: u64, peer: usize, w: &Waiter) -> Result<Link> {
        if peer >= self.size || peer == self.rank {
            return Err(Error::InvalidArgument(format!(
                "rank {} cannot open a link to rank {peer} (world size {})",
                self.rank, self.size
            )));
        }
        let index = {
            let mut opened = self.links_opened.lock().unwrap_or_else(|e| e.into_inner());
            let n = opened.entry((comm_id, peer)).or_insert(0);
            *n += 1;
            *n - 1
        };
        if index >= LINK_TAG {
            return Err(Error::InvalidArgument(format!(
                "too many links to rank {peer} on comm {comm_id:#x}"
            )));
        }
        let tag = LINK_TAG | index;
        let link = if self.rank < peer {
            let stream = self.dial(self.peer(peer)?.addr, peer, comm_id, tag, w)?;
            self.offer_link(stream, comm_id, peer, tag, w)?
        } else {
            let stream = self.await_stream(peer, comm_id, tag, w)?;
            self.take_link(stream, comm_id, peer, tag, w)?
        };
        debug!(
            "transport: rank {} linked to rank {peer} on comm {comm_id:#x} over {:?}",
            self.rank, link.kind
        );
        Ok(link)
    }

    fn abort(&self) -> &Arc<AbortState> {
        &self.abort
    }
}

fn check_raw_tag(tag: u32) -> Result<()> {
    if tag & LINK_TAG != 0 {
        return Err(Error::InvalidArgument(format!(
            "stream tag {tag:#x} is reserved for links"
        )));
    }
    Ok(())
}

fn send_setup(stream: &mut TcpStream, kind: u8, chunk: usize, depth: usize) -> std::io::Result<()> {
    let mut msg = [0u8; SETUP_LEN];
    msg[0] = kind;
    msg[1..5].copy_from_slice(&std::process::id().to_le_bytes());
    msg[5..13].copy_from_slice(&(chunk as u64).to_le_bytes());
    msg[13..17].copy_from_slice(&(depth as u32).to_le_bytes());
    stream.write_all(&msg)
}

/// `mt-<job tag>-<12 hex digits derived from the secret>`: unique per job, short, valid in a name.
fn shm_prefix(job_tag: &str, secret: &[u8; 16]) -> String {
    let tag: String = job_tag
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || *c == '_')
        .take(24)
        .collect();
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(secret).expect("HMAC takes any key length");
    mac.update(b"meshtrain shm prefix");
    let digest = mac.finalize().into_bytes();
    let hex: String = digest[..6].iter().map(|b| format!("{b:02x}")).collect();
    format!("mt-{tag}-{hex}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::test_util::{pattern, waiter};
    use std::io::ErrorKind;
    use std::net::Ipv4Addr;

    const SECRET: [u8; 16] = *b"0123456789abcdef";

    /// `size` connectors on 127.0.0.1 that know each other, all on node 0.
    fn world(size: usize, force_tcp: bool, tag: &str) -> Vec<NetConnector> {
        let mut cfg = NetConfig::new(IpAddr::V4(Ipv4Addr::LOCALHOST), tag);
        cfg.force_tcp = force_tcp;
        cfg.handshake_timeout = Duration::from_millis(400);
        let abort = Arc::new(AbortState::default());
        NetConnector::local_group(SECRET, &cfg, vec![abort; size]).expect("connectors")
    }

    fn shm_files(prefix: &str) -> Vec<String> {
        std::fs::read_dir("/dev/shm")
            .expect("list /dev/shm")
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| n.starts_with(prefix))
            .collect()
    }

    /// Sends `total` bytes to `next` while receiving as many from `prev`, posting up to `depth` chunks
    /// ahead of what was received (the most the FIFO contract lets a ring have in flight), and checks
    /// every received byte.
    fn ring_transfer(rank: usize, prev: usize, next: &mut Link, from_prev: &mut Link, total: usize) {
        let w = waiter(rank, 60);
        let (chunk, depth) = (next.send.max_chunk(), next.send.depth());
        let n = total.div_ceil(chunk);
        let len_of = |i: usize| chunk.min(total - i * chunk);
        let (mut sent, mut got) = (0, 0);
        while got < n {
            while sent < n && sent < got + depth {
                let slot = next.send.reserve(len_of(sent), &w).expect("reserve");
                slot.iter_mut()
                    .enumerate()
                    .for_each(|(j, b)| *b = pattern(rank as u8, sent, j));
                next.send.post(len_of(sent), &w).expect("post");
                sent += 1;
            }
            let data = from_prev.recv.wait(&w).expect("wait");
            assert_eq!(data.len(), len_of(got), "chunk {got} length");
            let bad = data
                .iter()
                .enumerate()
                .position(|(j, &b)| b != pattern(prev as u8, got, j));
            assert_eq!(
                bad, None,
                "rank {rank}: first wrong byte of chunk {got} from rank {prev}"
            );
            from_prev.recv.release(&w).expect("release");
            got += 1;
        }
    }

    fn ring_of_three(force_tcp: bool, tag: &str) {
        let conns = world(3, force_tcp, tag);
        let prefix = conns[0].shm_prefix().to_string();
        let want = if force_tcp { LinkKind::Tcp } else { LinkKind::Shm };
        std::thread::scope(|s| {
            for (rank, c) in conns.iter().enumerate() {
                let prefix = &prefix;
                s.spawn(move || {
                    let (next, prev) = ((rank + 1) % 3, (rank + 2) % 3);
                    let w = waiter(rank, 30);
                    let mut to_next = c.connect(7, next, &w).expect("connect next");
                    let mut from_prev = c.connect(7, prev, &w).expect("connect prev");
                    assert_eq!((to_next.kind, from_prev.kind), (want, want));
                    assert_eq!((to_next.peer, from_prev.peer), (next, prev));
                    ring_transfer(rank, prev, &mut to_next, &mut from_prev, 64 << 20);
                    // Both ends mapped every segment before any data came back, so no name is left.
                    assert_eq!(shm_files(prefix), Vec::<String>::new());
                });
            }
        });
        assert_eq!(shm_files(&prefix), Vec::<String>::new());
    }

    #[test]
    fn ring_of_three_over_tcp_does_not_deadlock() {
        ring_of_three(true, "ringtcp");
    }

    #[test]
    fn ring_of_three_over_shm_does_not_deadlock() {
        ring_of_three(false, "ringshm");
    }

    #[test]
    fn dropped_peer_link_is_reported() {
        let conns = world(2, false, "dropped");
        let w = waiter(1, 30);
        let (low, high) = std::thread::scope(|s| {
            let low = s.spawn(|| conns[0].connect(3, 1, &waiter(0, 30)).expect("low"));
            (
                low.join().expect("join"),
                conns[1].connect(3, 0, &w).expect("high"),
            )
        });
        let mut high = high;
        drop(low);
        match high.recv.wait(&w) {
            Err(Error::Comm { peer: 0, rank: 1, .. }) => {}
            other => panic!(
                "expected a Comm error naming peer 0, got {:?}",
                other.map(|b| b.len())
            ),
        }
        assert_eq!(shm_files(conns[0].shm_prefix()), Vec::<String>::new());
    }

    #[test]
    fn invalid_requests_are_rejected() {
        let conns = world(2, true, "invalid");
        let w = waiter(0, 5);
        assert!(matches!(
            conns[0].connect(1, 0, &w),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            conns[0].connect(1, 2, &w),
            Err(Error::InvalidArgument(_))
        ));
        let addr = conns[1].local_addr();
        assert!(matches!(
            conns[0].connect_stream(addr, 1, 1, LINK_TAG, &w),
            Err(Error::InvalidArgument(_))
        ));
        assert!(conns[0].set_peers(Vec::new()).is_err());
        let quick = Waiter::new(
            1,
            "accept",
            4,
            0,
            Duration::from_millis(30),
            Arc::new(AbortState::default()),
        );
        assert!(matches!(
            conns[1].accept_stream(0, 1, 1, &quick),
            Err(Error::Timeout { peer: 0, seq: 4, .. })
        ));
    }

    /// Reads until the server closes the connection; fails if it is still open after `limit`.
    fn expect_closed(mut s: TcpStream, limit: Duration, what: &str) {
        s.set_read_timeout(Some(limit)).expect("timeout");
        let mut buf = [0u8; 256];
        loop {
            match s.read(&mut buf) {
                Ok(0) => return,
                Ok(_) => {}
                Err(e) if e.kind() == ErrorKind::ConnectionReset => return,
                Err(e) => panic!("{what}: connection not closed by the server: {e}"),
            }
        }
    }

    #[test]
    fn strangers_are_rejected_and_do_not_block_legitimate_peers() {
        // RUST_LOG=warn shows the rejection reasons.
        let _ = env_logger::builder().is_test(true).try_init();
        let conns = world(3, true, "strangers");
        let addr = conns[1].local_addr();
        // Well beyond the 400 ms handshake timeout, so a pass proves the server closed the stream.
        let limit = Duration::from_secs(10);
        let raw = || TcpStream::connect(addr).expect("connect");
        std::thread::scope(|s| {
            s.spawn(|| {
                let mut c = raw();
                let mut junk = [0u8; 300];
                getrandom::getrandom(&mut junk).expect("random");
                junk[0] = b'x';
                c.write_all(&junk).expect("write junk");
                expect_closed(c, limit, "random bytes");
            });
            s.spawn(|| {
                let mut c = raw();
                c.write_all(b"GET / HTTP/1.1\r\n\r\n").expect("write http");
                expect_closed(c, limit, "http request");
            });
            s.spawn(|| {
                let mut c = raw();
                c.write_all(b"MES").expect("write partial");
                expect_closed(c, limit, "stalled half header");
            });
            s.spawn(|| {
                let mut c = raw();
                let req = Request {
                    from: 0,
                    to: 1,
                    comm_id: 1,
                    tag: 1,
                };
                let r = handshake::client(&mut c, b"not-the-secret!!", &req, limit);
                assert!(r.is_err(), "wrong secret accepted");
            });
            s.spawn(|| {
                for (from, to) in [(9, 1), (0, 2), (1, 1)] {
                    let mut c = raw();
                    let req = Request {
                        from,
                        to,
                        comm_id: 1,
                        tag: 2,
                    };
                    assert!(
                        handshake::client(&mut c, &SECRET, &req, limit).is_err(),
                        "{from}->{to} accepted"
                    );
                }
            });
            // Meanwhile a legitimate peer connects, twice with the same key; the duplicate is refused
            // and the first stream is still delivered and usable.
            let w = waiter(0, 10);
            let mut first = conns[0]
                .connect_stream(addr, 1, 1, 5, &w)
                .expect("legitimate stream");
            assert!(
                conns[0].connect_stream(addr, 1, 1, 5, &w).is_err(),
                "duplicate accepted"
            );
            let mut got = conns[1].accept_stream(0, 1, 5, &waiter(1, 10)).expect("accept");
            first.write_all(b"hello").expect("write");
            let mut buf = [0u8; 5];
            got.read_exact(&mut buf).expect("read");
            assert_eq!(&buf, b"hello");
        });
        // None of the rejected connections left a stream behind.
        assert_eq!(conns[1].acceptor.counts(), (0, 1));
    }

    /// The reproduction: more idle connections than handshake slots. Each gives its slot
    /// back after the idle limit, and the real peer, turned away while all are taken, retries.
    #[test]
    fn idle_connections_do_not_starve_real_peers() {
        let conns = world(2, true, "idle");
        let addr = conns[1].local_addr();
        let idle: Vec<TcpStream> =
            (0..MAX_HANDSHAKES + 6).map(|_| TcpStream::connect(addr).expect("idle connect")).collect();
        // Let the accept thread take them all, so the slots are full when the real peer dials.
        std::thread::sleep(Duration::from_millis(200));
        let mut first = conns[0].connect_stream(addr, 1, 1, 5, &waiter(0, 20)).expect("real peer admitted");
        let mut got = conns[1].accept_stream(0, 1, 5, &waiter(1, 20)).expect("accept");
        first.write_all(b"hello").expect("write");
        let mut buf = [0u8; 5];
        got.read_exact(&mut buf).expect("read");
        assert_eq!(&buf, b"hello");
        drop(idle);
    }
}
