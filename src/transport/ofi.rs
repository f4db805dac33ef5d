//! libfabric transport: the chunk-FIFO link contract ([`SendLink`]/[`RecvLink`]) over tagged
//! messages on one RDM endpoint per process ([`super::ofi_ep`]).
//!
//! Why: Slingshot (cxi), InfiniBand (verbs) and EFA are reached through libfabric; the collectives
//! only see slots, so a link that maps slots onto tagged sends and pre-posted tagged receives makes
//! every collective work unchanged over any provider.
//!
//! Setup: the pair's authenticated TCP stream (see [`super::net`]) carries each side's endpoint
//! address and its receive key; only such peers enter the address vector, so only job members can
//! be addressed. The stream then stays open as liveness signal, like shared-memory links.
//!
//! Wire: chunk `s` of a link travels as one tagged message with tag `key << SEQ_BITS | s mod
//! 2^SEQ_BITS`, `key` being the receiver's per-link key. The receiver keeps `depth` receives posted
//! for the next `depth` sequence numbers, each matching exactly one tag from exactly the peer's
//! address, and re-posts a slot for `s + depth` when chunk `s` is released. So chunks are delivered
//! in order whatever order the provider completes them in; a message with any other tag or source
//! never matches a posted buffer (it is never data), and a completion whose tag is not the expected
//! one is an error naming the peer. The sender owns `depth` buffers; `reserve` waits until the
//! slot's previous send completed. Every wait drives progress on the shared endpoint and checks the
//! deadline, the job-wide abort and the peer's liveness.
//!
//! Device buffers: each link also carries a device-direct side ([`super::ofi_direct`]) with a
//! receive key of its own, agreed through one capability byte per side in the setup message.
//!
//! Selection (`MESHTRAIN_TRANSPORT`): `ofi` uses libfabric for every pair; `auto` between nodes only
//! when the node has a NIC for a fabric provider (cxi, verbs, efa; see [`fabric_nic_present`]); `shm`/`tcp` never. The provider comes from
//! `MESHTRAIN_OFI_PROVIDER`, else `FI_PROVIDER`, else libfabric's preference. Without the `ofi`
//! cargo feature, asking for it is `Error::NotCompiled`.

use std::net::TcpStream;

use crate::env::{self, OfiProfile};
use crate::error::{Error, Result};

/// When links use libfabric.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OfiUse {
    /// Never (shared memory inside a node, TCP between nodes).
    Never,
    /// Between nodes (shared memory inside a node).
    BetweenNodes,
    /// For every pair, inside a node too.
    Always,
}

/// Providers that mean a real fabric NIC is present (auto mode uses libfabric only then).
pub const FABRIC_PROVIDERS: [&str; 3] = ["cxi", "verbs", "efa"];

/// Frontier (HPE Slingshot 11, cxi) settings applied by `MESHTRAIN_OFI_PROFILE=frontier`, each only
/// where the variable is unset, before MPI and libfabric initialise.
pub const FRONTIER_PROFILE: [(&str, &str, &str); 5] = [
    // The memory-registration cache must learn when the application frees or remaps memory it had
    // registered; the userfaultfd monitor does that without intercepting malloc/free (the default
    // hooks miss GPU-runtime allocations and can leave stale registrations behind).
    ("FI_MR_CACHE_MONITOR", "userfaultfd", "registration cache invalidation without malloc hooks"),
    // Let the NIC's matching engine fall back to software matching instead of failing when its
    // hardware list of posted receives or unexpected messages runs full (many ranks, many tags).
    ("FI_CXI_RX_MATCH_MODE", "hybrid", "software tag matching when hardware match resources run out"),
    // Completion queues large enough for the many operations a collective keeps outstanding; an
    // overrun CQ stalls the endpoint.
    ("FI_CXI_DEFAULT_CQ_SIZE", "131072", "completion queue large enough for deep pipelines"),
    // Do not register host memory with the GPU runtime from inside the provider (it has caused
    // hangs with ROCm); the application stages or registers explicitly.
    ("FI_CXI_DISABLE_HOST_REGISTER", "1", "no GPU-runtime registration of host memory inside cxi"),
    // Large messages use the rendezvous variant in which the receiver reads the data, which HPE
    // recommends for collective libraries on Slingshot.
    ("FI_CXI_RDZV_PROTO", "alt_read", "receiver-driven rendezvous for large messages"),
];

/// Applies the site profile named by `MESHTRAIN_OFI_PROFILE` (only `frontier` exists); call before
/// MPI_Init. Returns the variables it set.
pub fn apply_site_profile() -> Result<Vec<String>> {
    let Some(OfiProfile::Frontier) = env::ofi_profile()? else {
        return Ok(Vec::new());
    };
    let mut set = Vec::new();
    for (key, value, _) in FRONTIER_PROFILE {
        if std::env::var_os(key).is_none() {
            std::env::set_var(key, value);
            set.push(format!("{key}={value}"));
        }
    }
    Ok(set)
}

/// The FI_* and SLINGSHOT_* variables of this process, sorted, for rank 0's log.
pub fn fabric_environment() -> Vec<String> {
    let mut v: Vec<String> = std::env::vars()
        .filter(|(k, _)| k.starts_with("FI_") || k.starts_with("SLINGSHOT_") || k.starts_with("MESHTRAIN_OFI"))
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    v.sort();
    v
}

/// Removes `/dev/shm/<pid>:*`, the shared-memory regions libfabric's `shm` provider names after
/// the process id (`<pid>:0:0` with 1.17). Before this process opens its endpoint, such a region
/// can only be left by a dead process that had the same pid, and it makes `fi_enable` fail with
/// "Device or resource busy"; when this process exits on an error without closing its endpoint,
/// the region is its own (16 MiB of tmpfs each, otherwise never freed). Peers that mapped a
/// region keep their mapping.
pub fn remove_own_shm_regions() {
    remove_shm_regions_of(std::process::id());
}

/// Removes the regions that libfabric's shm provider of process `pid` created (`<pid>:...` in
/// /dev/shm); for this process's own ([`remove_own_shm_regions`]) or a dead peer's.
pub fn remove_shm_regions_of(pid: u32) {
    let prefix = format!("{pid}:");
    let Ok(dir) = std::fs::read_dir("/dev/shm") else { return };
    for entry in dir.flatten() {
        if entry.file_name().to_str().is_some_and(|n| n.starts_with(&prefix)) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

#[cfg(feature = "ofi")]
pub use imp::{fabric_nic_present, OfiNet};
#[cfg(feature = "ofi")]
pub(crate) use imp::{Waits, DRAIN_LIMIT, SEQ_MASK};

#[cfg(not(feature = "ofi"))]
pub use stub::{fabric_nic_present, OfiNet};

#[cfg(feature = "ofi")]
mod imp {
    use std::io::{Read, Write};
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::{Arc, OnceLock};
    use std::time::{Duration, Instant};

    use super::super::ofi_direct::{DirectPeer, CAP_ALLOWED, CAP_FORCED, CAP_HMEM};
    use super::super::ofi_ep::{Endpoint, OpSlot, RegBuf, BUSY, FAILED};
    use super::super::select::GpuDirect;
    use super::super::shm::PeerWatch;
    use super::super::{RecvLink, SendLink, Waiter};
    use super::*;

    /// Largest endpoint address accepted from a peer (the setup message is the address length as
    /// u16, the address, the receive key and the device-direct receive key as u32, and the
    /// device-direct capability byte; see [`super::super::ofi_direct`]).
    const MAX_NAME: usize = 1024;
    /// Low tag bits holding the chunk sequence number; the receive key sits above them.
    const SEQ_BITS: u32 = 28;
    pub(crate) const SEQ_MASK: u64 = (1 << SEQ_BITS) - 1;
    /// Receive keys fit in 20 bits, so tags fit in 48 (what cxi matches on).
    const KEY_BITS: u32 = 20;
    const MAX_KEY: u32 = (1 << KEY_BITS) - 1;
    /// How often a waiting call checks the peer's liveness.
    const LIVENESS_PERIOD: Duration = Duration::from_millis(50);
    /// Polls before a waiting call starts yielding the CPU between polls.
    const SPIN_POLLS: u32 = 200;
    /// How long a dropped link waits for its posted operations to finish before leaking them.
    pub(crate) const DRAIN_LIMIT: Duration = Duration::from_secs(2);

    /// True when this node has a NIC that a fabric provider drives: a Slingshot device
    /// (`/sys/class/cxi`) or an RDMA device (`/sys/class/infiniband`: InfiniBand, RoCE, EFA). Read
    /// from sysfs rather than by initialising libfabric, which takes ~0.8 s here and would delay
    /// every job's bootstrap on machines without such NICs.
    pub fn fabric_nic_present() -> bool {
        ["/sys/class/cxi", "/sys/class/infiniband"]
            .iter()
            .any(|d| std::fs::read_dir(d).is_ok_and(|mut entries| entries.next().is_some()))
    }

    /// The process's libfabric state: the endpoint, opened on first use, and the receive-key counter.
    pub struct OfiNet {
        rank: usize,
        provider: Option<String>,
        endpoint: OnceLock<std::result::Result<Arc<Endpoint>, String>>,
        next_key: AtomicU32,
        gpu_direct: GpuDirect,
    }

    impl OfiNet {
        pub fn new(rank: usize, provider: Option<String>, gpu_direct: GpuDirect) -> OfiNet {
            OfiNet { rank, provider, endpoint: OnceLock::new(), next_key: AtomicU32::new(1), gpu_direct }
        }

        pub(super) fn endpoint(&self, local_rank: usize) -> Result<Arc<Endpoint>> {
            self.endpoint
                .get_or_init(|| {
                    remove_own_shm_regions();
                    let ep = Endpoint::open(self.provider.as_deref(), local_rank, self.gpu_direct != GpuDirect::Off).map_err(|e| e.to_string())?;
                    self.log_open(&ep);
                    let ep = Arc::new(ep);
                    let weak = Arc::downgrade(&ep);
                    super::super::set_endpoint_progress(Box::new(move || {
                        // Failures surface in the waits on the endpoint's own links.
                        if let Some(ep) = weak.upgrade() {
                            let _ = ep.progress();
                        }
                    }));
                    Ok(ep)
                })
                .clone()
                .map_err(Error::Fabric)
        }

        fn log_open(&self, ep: &Endpoint) {
            let i = ep.info();
            let gpu = match (self.gpu_direct, i.hmem) {
                (GpuDirect::Off, _) => "staged through host memory (MESHTRAIN_GPU_DIRECT=off)",
                (_, true) => "FI_HMEM registration, posted directly where the peer offers it too",
                (_, false) => "staged through host memory (the provider does not offer FI_HMEM)",
            };
            // Rank 0 says it; every rank's own line is detail (`-v`).
            let level = if self.rank == 0 { log::Level::Info } else { log::Level::Debug };
            log::log!(
                level,
                "ofi: rank {}: libfabric {}.{}, provider {}, fabric {}, domain {}, mr_mode {}, {} tag bits; \
                 device buffers: {gpu}",
                self.rank,
                i.library_version.0,
                i.library_version.1,
                i.provider,
                i.fabric,
                i.domain,
                i.mr_mode,
                i.max_tag_bits,
            );
            if self.rank == 0 {
                log::info!("ofi: environment: {}", fabric_environment().join(" "));
            }
        }

        /// Builds this rank's halves of a libfabric link to `peer` after exchanging addresses and
        /// receive keys over the pair's authenticated `stream` (kept as liveness watch; `pid` is the
        /// peer's process id when it runs on this node, else 0).
        #[allow(clippy::too_many_arguments)]
        pub fn link(
            &self,
            mut stream: TcpStream,
            peer: usize,
            pid: u32,
            chunk: usize,
            depth: usize,
            local_rank: usize,
            w: &Waiter,
        ) -> Result<(Box<dyn SendLink>, Box<dyn RecvLink>)> {
            let ep = self.endpoint(local_rank).map_err(|e| w.fail(peer, e.to_string()))?;
            if ep.info().max_tag_bits < SEQ_BITS + KEY_BITS {
                return Err(w.fail(
                    peer,
                    format!("provider {} matches {} tag bits, links need {}", ep.info().provider, ep.info().max_tag_bits, SEQ_BITS + KEY_BITS),
                ));
            }
            // One key for the chunk FIFO, one for device-direct messages (own tag space).
            let key = self.next_key.fetch_add(2, Ordering::Relaxed);
            let direct_key = key + 1;
            if direct_key > MAX_KEY {
                return Err(w.fail(peer, "more than 2^19 libfabric links opened by this process"));
            }
            let caps = self.capabilities(&ep);
            let name = ep.name();
            let mut msg = Vec::with_capacity(11 + name.len());
            msg.extend_from_slice(&(name.len() as u16).to_le_bytes());
            msg.extend_from_slice(name);
            msg.extend_from_slice(&key.to_le_bytes());
            msg.extend_from_slice(&direct_key.to_le_bytes());
            msg.push(caps);
            stream.write_all(&msg).map_err(|e| w.fail(peer, format!("sending libfabric address: {e}")))?;
            let theirs = read_address(&mut stream, w.deadline.saturating_duration_since(Instant::now()))
                .map_err(|e| w.fail(peer, format!("reading libfabric address: {e}")))?;
            let (peer_name, peer_key, peer_direct_key) = (theirs.name, theirs.key, theirs.direct_key);
            let bad_key = |k: u32| k == 0 || k > MAX_KEY;
            if peer_name.len() != name.len() || bad_key(peer_key) || bad_key(peer_direct_key) || peer_key == peer_direct_key {
                return Err(w.fail(
                    peer,
                    format!("libfabric address of {} bytes / keys {peer_key}, {peer_direct_key}: not of this provider", peer_name.len()),
                ));
            }
            let addr = ep.insert_peer(&peer_name).map_err(|e| w.fail(peer, e.to_string()))?;
            let watch = Arc::new(PeerWatch::new(stream, pid));
            let waits = |ep: &Arc<Endpoint>| Waits { ep: ep.clone(), peer, watch: watch.clone() };
            let direct = DirectPeer::new(
                waits(&ep),
                addr,
                (peer_direct_key as u64) << SEQ_BITS,
                (direct_key as u64) << SEQ_BITS,
                caps,
                theirs.caps,
            );
            let send = OfiSend {
                direct: Arc::new(direct),
                waits: waits(&ep),
                dest: addr,
                tag_base: (peer_key as u64) << SEQ_BITS,
                seq: 0,
                slots: Slots::new(&ep, chunk, depth).map_err(|e| w.fail(peer, e.to_string()))?,
            };
            let mut recv = OfiRecv {
                waits: waits(&ep),
                src: addr,
                tag_base: (key as u64) << SEQ_BITS,
                seq: 0,
                slots: Slots::new(&ep, chunk, depth).map_err(|e| w.fail(peer, e.to_string()))?,
            };
            for s in 0..depth as u64 {
                recv.post(s).map_err(|e| w.fail(peer, e.to_string()))?;
            }
            Ok((Box::new(send), Box::new(recv)))
        }
    }

    /// What a peer sent at link setup.
    struct PeerSetup {
        name: Vec<u8>,
        key: u32,
        direct_key: u32,
        caps: u8,
    }

    impl OfiNet {
        /// This side's device-direct capability byte (see [`super::super::ofi_direct`]).
        fn capabilities(&self, ep: &Endpoint) -> u8 {
            let hmem = if ep.info().hmem { CAP_HMEM } else { 0 };
            hmem | match self.gpu_direct {
                GpuDirect::Off => 0,
                GpuDirect::Auto => CAP_ALLOWED,
                GpuDirect::On => CAP_ALLOWED | CAP_FORCED,
            }
        }
    }

    fn read_address(stream: &mut TcpStream, limit: Duration) -> std::io::Result<PeerSetup> {
        stream.set_read_timeout(Some(limit.max(Duration::from_millis(1))))?;
        let mut len = [0u8; 2];
        stream.read_exact(&mut len)?;
        let len = u16::from_le_bytes(len) as usize;
        if len == 0 || len > MAX_NAME {
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, format!("address length {len}")));
        }
        let mut name = vec![0u8; len];
        stream.read_exact(&mut name)?;
        let mut rest = [0u8; 9];
        stream.read_exact(&mut rest)?;
        stream.set_read_timeout(None)?;
        let word = |at: usize| u32::from_le_bytes([rest[at], rest[at + 1], rest[at + 2], rest[at + 3]]);
        Ok(PeerSetup { name, key: word(0), direct_key: word(4), caps: rest[8] })
    }

    /// Registered buffers and operation contexts of one direction of a link.
    struct Slots {
        ep: Arc<Endpoint>,
        bufs: Vec<RegBuf>,
        /// Operation contexts; the Vec is never resized, so their addresses stay fixed.
        ops: Vec<OpSlot>,
        chunk: usize,
    }

    impl Slots {
        fn new(ep: &Arc<Endpoint>, chunk: usize, depth: usize) -> Result<Slots> {
            let bufs = (0..depth).map(|_| ep.take_buffer(chunk)).collect::<Result<Vec<_>>>()?;
            Ok(Slots { ep: ep.clone(), bufs, ops: (0..depth).map(|_| OpSlot::new()).collect(), chunk })
        }

        fn busy(&self) -> bool {
            self.ops.iter().any(|o| o.state.load(Ordering::Acquire) == BUSY)
        }
    }

    impl Drop for Slots {
        /// Cancels posted receives and lets sends finish; buffers go back to the registration cache
        /// once no operation uses them, and are leaked (never freed under the provider) otherwise.
        fn drop(&mut self) {
            for op in &self.ops {
                if op.state.load(Ordering::Acquire) == BUSY {
                    self.ep.cancel(op);
                }
            }
            let give_up = Instant::now() + DRAIN_LIMIT;
            while self.busy() && Instant::now() < give_up {
                if self.ep.progress().is_err() {
                    break;
                }
                std::thread::yield_now();
            }
            if self.busy() {
                log::warn!("ofi: link dropped with operations still posted; leaking its {} buffers", self.bufs.len());
                std::mem::forget(std::mem::take(&mut self.bufs));
                std::mem::forget(std::mem::take(&mut self.ops));
                return;
            }
            for b in self.bufs.drain(..) {
                self.ep.give_back(b);
            }
        }
    }

    /// What every wait of a link needs: the endpoint to progress and the peer to watch.
    pub(crate) struct Waits {
        pub(crate) ep: Arc<Endpoint>,
        pub(crate) peer: usize,
        watch: Arc<PeerWatch>,
    }

    impl Waits {
        /// Drives progress until `op` is no longer busy; errors on failure, deadline, abort or a
        /// dead peer.
        pub(crate) fn until_idle(&self, op: &OpSlot, w: &Waiter) -> Result<()> {
            let mut polls = 0u32;
            let mut next_check = Instant::now() + LIVENESS_PERIOD;
            loop {
                self.ep.progress().map_err(|e| w.fail(self.peer, e.to_string()))?;
                match op.state.load(Ordering::Acquire) {
                    BUSY => {}
                    FAILED => return Err(w.fail(self.peer, op.failure())),
                    _ => return Ok(()),
                }
                polls += 1;
                if polls % 256 == 0 {
                    w.check(self.peer)?;
                    let now = Instant::now();
                    if now >= next_check {
                        next_check = now + LIVENESS_PERIOD;
                        self.watch.check().map_err(|cause| w.fail(self.peer, cause))?;
                    }
                }
                if polls > SPIN_POLLS {
                    std::thread::sleep(Duration::from_micros(50));
                }
            }
        }
    }

    struct OfiSend {
        direct: Arc<DirectPeer>,
        waits: Waits,
        dest: u64,
        tag_base: u64,
        seq: u64,
        slots: Slots,
    }

    impl SendLink for OfiSend {
        fn reserve(&mut self, len: usize, w: &Waiter) -> Result<&mut [u8]> {
            if len > self.slots.chunk {
                return Err(Error::InvalidArgument(format!("chunk of {len} bytes over the link's {}", self.slots.chunk)));
            }
            let i = (self.seq % self.slots.ops.len() as u64) as usize;
            self.waits.until_idle(&self.slots.ops[i], w)?;
            Ok(&mut self.slots.bufs[i].data[..len])
        }

        fn post(&mut self, len: usize, w: &Waiter) -> Result<()> {
            let i = (self.seq % self.slots.ops.len() as u64) as usize;
            let tag = self.tag_base | (self.seq & SEQ_MASK);
            self.waits
                .ep
                .send(&self.slots.ops[i], &self.slots.bufs[i], len, self.dest, tag)
                .map_err(|e| w.fail(self.waits.peer, e.to_string()))?;
            self.seq += 1;
            Ok(())
        }

        fn max_chunk(&self) -> usize {
            self.slots.chunk
        }

        fn depth(&self) -> usize {
            self.slots.ops.len()
        }

        /// Waits for every posted send to complete. Over a rendezvous protocol (the rxm provider's
        /// large messages) a send completes only while the sender drives progress, so a rank that
        /// left a collective with sends posted and then blocked elsewhere (a TCP handshake for the
        /// next communicator) would stall the peers still waiting for those bytes.
        fn flush(&mut self, w: &Waiter) -> Result<()> {
            for op in &self.slots.ops {
                // A failed send is reported here, not at the next call's reserve.
                if matches!(op.state.load(Ordering::Acquire), BUSY | FAILED) {
                    self.waits.until_idle(op, w)?;
                }
            }
            Ok(())
        }

        fn direct(&self) -> Option<Arc<DirectPeer>> {
            Some(self.direct.clone())
        }
    }

    struct OfiRecv {
        waits: Waits,
        src: u64,
        tag_base: u64,
        seq: u64,
        slots: Slots,
    }

    impl OfiRecv {
        fn tag(&self, seq: u64) -> u64 {
            self.tag_base | (seq & SEQ_MASK)
        }

        /// Posts the receive for chunk `seq` into its slot.
        fn post(&mut self, seq: u64) -> Result<()> {
            let i = (seq % self.slots.ops.len() as u64) as usize;
            let src = self.src;
            let tag = self.tag(seq);
            self.slots.ep.recv(&self.slots.ops[i], &mut self.slots.bufs[i], src, tag)
        }
    }

    impl RecvLink for OfiRecv {
        fn wait(&mut self, w: &Waiter) -> Result<&[u8]> {
            let i = (self.seq % self.slots.ops.len() as u64) as usize;
            let op = &self.slots.ops[i];
            self.waits.until_idle(op, w)?;
            let (tag, len) = (op.tag.load(Ordering::Relaxed), op.len.load(Ordering::Relaxed));
            if tag != self.tag(self.seq) || len > self.slots.chunk {
                return Err(w.fail(
                    self.waits.peer,
                    format!("stray libfabric message: tag {tag:#x} ({len} bytes), expected {:#x}", self.tag(self.seq)),
                ));
            }
            Ok(&self.slots.bufs[i].data[..len])
        }

        fn release(&mut self, w: &Waiter) -> Result<()> {
            let next = self.seq + self.slots.ops.len() as u64;
            self.post(next).map_err(|e| w.fail(self.waits.peer, e.to_string()))?;
            self.seq += 1;
            Ok(())
        }
    }
}

#[cfg(not(feature = "ofi"))]
mod stub {
    use super::*;
    use crate::transport::{RecvLink, SendLink, Waiter};

    /// Without the `ofi` feature no provider is ever present.
    pub fn fabric_nic_present() -> bool {
        false
    }

    /// Stand-in whose links are `Error::NotCompiled`.
    pub struct OfiNet;

    impl OfiNet {
        pub fn new(_rank: usize, _provider: Option<String>, _gpu_direct: crate::transport::select::GpuDirect) -> OfiNet {
            OfiNet
        }

        #[allow(clippy::too_many_arguments)]
        pub fn link(
            &self,
            _stream: TcpStream,
            _peer: usize,
            _pid: u32,
            _chunk: usize,
            _depth: usize,
            _local_rank: usize,
            _w: &Waiter,
        ) -> Result<(Box<dyn SendLink>, Box<dyn RecvLink>)> {
            Err(Error::NotCompiled("libfabric (cargo feature `ofi`)"))
        }
    }
}

#[cfg(test)]
mod tests {
    /// Only regions named after this process go; another pid's stays.
    #[test]
    fn own_shm_regions_are_removed_and_no_others() {
        let own = format!("/dev/shm/{}:0:7", std::process::id());
        // A pid above the kernel's maximum (4194304) belongs to no process.
        let other = "/dev/shm/4194399:0:7";
        std::fs::write(&own, b"stale").unwrap();
        std::fs::write(other, b"not ours").unwrap();
        super::remove_own_shm_regions();
        let (own_left, other_left) = (std::path::Path::new(&own).exists(), std::path::Path::new(other).exists());
        std::fs::remove_file(other).unwrap();
        assert!(!own_left, "{own} was left");
        assert!(other_left, "{other} was removed");
    }

    /// Over `tcp;ofi_rxm` a large send completes only while the sender calls into the provider.
    /// A sender that flushed may then stop doing so (a rank blocked in the TCP handshake of its
    /// next communicator) and the receiver still gets every byte; without the flush it waits for
    /// the sender until its deadline.
    #[cfg(feature = "ofi")]
    #[test]
    fn a_flushed_sender_may_stop_progressing() {
        use crate::transport::select::GpuDirect;
        use crate::transport::test_util::{pattern, stream_pair, waiter};
        const CHUNK: usize = 4 << 20;
        let provider = Some("tcp;ofi_rxm".to_string());
        let (a, b) = stream_pair();
        let (sender, receiver) = (super::OfiNet::new(0, provider.clone(), GpuDirect::Off), super::OfiNet::new(1, provider, GpuDirect::Off));
        // Every wait also drives the first endpoint this process opened (the process-wide hook);
        // the receiver's goes first, so nothing but the flush drives the sender's.
        if let Err(e) = receiver.endpoint(0) {
            eprintln!("skipped: no tcp;ofi_rxm provider: {e}");
            return;
        }
        let (done, wait_done) = std::sync::mpsc::channel::<()>();
        std::thread::scope(|s| {
            s.spawn(move || {
                let w = waiter(0, 30);
                let (mut send, _recv) = sender.link(a, 1, 0, CHUNK, 2, 0, &w).expect("sender's link");
                let slot = send.reserve(CHUNK, &w).expect("reserve");
                slot.iter_mut().enumerate().for_each(|(j, b)| *b = pattern(5, 0, j));
                send.post(CHUNK, &w).expect("post");
                send.flush(&w).expect("flush");
                // No call into the provider from here on; the links live until the receiver is done.
                let _ = wait_done.recv_timeout(std::time::Duration::from_secs(30));
            });
            let w = waiter(1, 10);
            let (_send, mut recv) = receiver.link(b, 0, 0, CHUNK, 2, 0, &w).expect("receiver's link");
            let got = recv.wait(&w).map(|g| g.to_vec());
            done.send(()).unwrap();
            let got = got.expect("the receiver waited for a sender that had flushed");
            assert_eq!(got.len(), CHUNK);
            assert!(got.iter().enumerate().all(|(j, &b)| b == pattern(5, 0, j)), "bytes differ");
        });
    }
}
