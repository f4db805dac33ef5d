//! Bootstrap: MPI discovers the ranks and carries one broadcast of the unique id; everything after
//! that is meshtrain's own.
//!
//! MPI's own listeners: [`mpi_defaults`] sets MCA defaults before `MPI_Init` (shared memory only
//! when the whole job is on one node) so that MPI opens no TCP listener on the wildcard address.
//!
//! Failure: start-up, `MPI_Init` included, runs under a watchdog thread ([`watchdog`]) that ends
//! the rank with a message naming the phase (exit status 3) when a phase takes longer than
//! `MESHTRAIN_BOOTSTRAP_TIMEOUT`: a rank that died before `MPI_Init` under a launcher that does not
//! end the job can no longer leave the others in MPI forever.
//!
//! Failure: the runtime `MESHTRAIN_*` variables are checked ([`preflight`]) before MPI carries
//! anything,
//! and any failure of the bootstrap prints the error prefixed by the rank and ends the whole job
//! with `MPI_Abort`; the start-up reads on the control channel have a deadline
//! (`MESHTRAIN_BOOTSTRAP_TIMEOUT`) and name the rank that stalled.
//!
//! Sequence (NCCL-style): MPI init; world rank/size; node-local rank/size from a shared-memory
//! split; rank 0 binds its listener and draws a 128-bit secret from the OS; the unique id (that
//! address + the secret) is broadcast through MPI; every rank binds its own listener and reports
//! it to rank 0 over an authenticated stream (the control channel), which answers with the table of
//! all ranks. From then on MPI is idle until `MPI_Finalize` when the [`World`] drops.
//! A process started without a launcher is a world of size 1.
//!
//! Listeners bind one address, never all interfaces unless asked: `MESHTRAIN_BIND_ADDR` (an IP,
//! `0.0.0.0` allowed), else the IPv4 address of `MESHTRAIN_SOCKET_IFNAME`, else 127.0.0.1 when the
//! whole job is on one node, else the first up, non-loopback IPv4 interface.

mod control;
pub mod preflight;
mod ifaddr;
mod mpi_defaults;
mod watchdog;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;

use mpi::traits::{Communicator as _, Root as _};

use crate::comm::{CommConfig, Communicator};
use crate::env;
use crate::error::{Error, Result};
use crate::transport::net::{NetConfig, NetConnector, PeerInfo};
use crate::transport::{AbortState, Connector, Waiter};

use control::{Control, Hello};
use watchdog::Watchdog;

/// Communicator id reserved for the control channel.
const CONTROL_COMM: u64 = u64::MAX;
/// Byte size of the serialized unique id.
const UID_BYTES: usize = 64;

/// The unique id rank 0 broadcasts: its listener and the job secret.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UniqueId {
    /// Rank 0's listener.
    pub addr: SocketAddr,
    /// 128-bit secret every connection must prove knowledge of.
    pub secret: [u8; 16],
}

impl UniqueId {
    fn to_bytes(self) -> [u8; UID_BYTES] {
        let mut b = [0u8; UID_BYTES];
        b[..16].copy_from_slice(&self.secret);
        match self.addr.ip() {
            IpAddr::V4(ip) => {
                b[16] = 4;
                b[17..21].copy_from_slice(&ip.octets());
            }
            IpAddr::V6(ip) => {
                b[16] = 6;
                b[17..33].copy_from_slice(&ip.octets());
            }
        }
        b[33..35].copy_from_slice(&self.addr.port().to_le_bytes());
        b
    }

    fn from_bytes(b: &[u8; UID_BYTES]) -> Result<Self> {
        let ip = match b[16] {
            4 => IpAddr::V4(Ipv4Addr::new(b[17], b[18], b[19], b[20])),
            6 => IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(&b[17..33]).expect("16 bytes"))),
            f => return Err(Error::Bootstrap { rank: 0, msg: format!("unique id has unknown address family {f}") }),
        };
        let port = u16::from_le_bytes([b[33], b[34]]);
        Ok(UniqueId { addr: SocketAddr::new(ip, port), secret: b[..16].try_into().expect("16 bytes") })
    }
}

/// Where the launcher says this process is (Slurm's variables when present), for logs and device
/// binding; MPI's own answers take precedence for communication.
#[derive(Debug, Clone, Default)]
pub struct LaunchInfo {
    /// `SLURM_PROCID`.
    pub slurm_procid: Option<usize>,
    /// `SLURM_LOCALID`.
    pub slurm_localid: Option<usize>,
    /// `SLURM_NTASKS`.
    pub slurm_ntasks: Option<usize>,
    /// `SLURM_JOB_ID`.
    pub slurm_job_id: Option<String>,
}

impl LaunchInfo {
    fn from_env() -> Self {
        let num = |k: &str| std::env::var(k).ok().and_then(|v| v.parse().ok());
        LaunchInfo {
            slurm_procid: num("SLURM_PROCID"),
            slurm_localid: num("SLURM_LOCALID"),
            slurm_ntasks: num("SLURM_NTASKS"),
            slurm_job_id: std::env::var("SLURM_JOB_ID").ok(),
        }
    }
}

/// This process's place in the job, and the connector every communicator is built on. Dropping it
/// leaves the job together with the other ranks and finalizes MPI.
pub struct World {
    /// World rank.
    pub rank: usize,
    /// World size.
    pub size: usize,
    /// Rank among the processes of this node.
    pub local_rank: usize,
    /// Number of processes on this node.
    pub local_size: usize,
    /// Node index of every rank.
    pub nodes: Vec<usize>,
    /// Slurm's view, if launched by srun.
    pub launch: LaunchInfo,
    connector: Arc<NetConnector>,
    control: Option<Control>,
    comm_cfg: CommConfig,
    /// Process ids of the other ranks on this node (to free what a killed one left in /dev/shm).
    node_peer_pids: Vec<u32>,
    /// MPI until [`World::end_mpi`] (the world communicator, and the universe that finalizes
    /// MPI when dropped).
    mpi: Option<(mpi::topology::SimpleCommunicator, mpi::environment::Universe)>,
}

/// The best-effort rank of this process before MPI is up (for log prefixes only).
pub fn rank_hint() -> Option<usize> {
    ["OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"]
        .iter()
        .find_map(|k| std::env::var(k).ok().and_then(|v| v.parse().ok()))
}

/// The number of processes the launcher started (Open MPI's, MPICH's or Slurm's step variables),
/// before MPI is up: lets a job that cannot fit the world be refused before anything starts. `None`
/// under a launcher that says nothing (the check then happens after start-up); 1 without any
/// launcher variable (a world of one).
pub fn size_hint() -> Option<usize> {
    let found = ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS"]
        .iter()
        .find_map(|k| std::env::var(k).ok().and_then(|v| v.trim().parse().ok()));
    match (found, rank_hint()) {
        (Some(n), _) => Some(n),
        (None, None) => Some(1),
        (None, Some(_)) => None,
    }
}

fn boot(rank: usize, msg: impl Into<String>) -> Error {
    Error::Bootstrap { rank, msg: msg.into() }
}

/// Identifies this node: the hostname plus the kernel's boot id (containers on one host share it).
fn node_key() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    format!("{}/{}", host.trim(), boot.trim())
}

/// Chooses the address this rank listens on (see the module header).
fn bind_ip(single_node: bool) -> Result<IpAddr> {
    if let Some(ip) = env::bind_addr()? {
        return Ok(ip);
    }
    if let Some(name) = env::socket_ifname() {
        return preflight::interface_ip(&name);
    }
    if single_node {
        return Ok(IpAddr::V4(Ipv4Addr::LOCALHOST));
    }
    ifaddr::first_external_ipv4()?.ok_or_else(|| {
        boot(0, "no up, non-loopback IPv4 interface found: set MESHTRAIN_SOCKET_IFNAME or MESHTRAIN_BIND_ADDR")
    })
}

/// Network settings: defaults, then the `MESHTRAIN_TRANSPORT` / `MESHTRAIN_{SHM,TCP}_{CHUNK,DEPTH}`
/// environment; links always carry at least the collectives' chunk and its fingerprint.
fn net_config(bind_ip: IpAddr, job_tag: &str, comm: &CommConfig) -> Result<NetConfig> {
    let mut cfg = NetConfig::new(bind_ip, job_tag).with_env()?;
    let message = comm.chunk_bytes + crate::comm::fingerprint::PRINT_LEN;
    cfg.shm_chunk = cfg.shm_chunk.max(message);
    cfg.tcp_chunk = cfg.tcp_chunk.max(message);
    cfg.shm_depth = cfg.shm_depth.max(2);
    cfg.tcp_depth = cfg.tcp_depth.max(2);
    Ok(cfg)
}

/// What the network part of the bootstrap hands to [`World`].
struct Network {
    connector: NetConnector,
    control: Option<Control>,
    nodes: Vec<usize>,
    comm_cfg: CommConfig,
    node_peer_pids: Vec<u32>,
}

/// Rank 0 binds first, the unique id travels through MPI, every rank binds and reports to rank 0
/// over the control channel, which answers with the table of all ranks.
fn start_network(mpi_world: &mpi::topology::SimpleCommunicator, rank: usize, size: usize, single_node: bool, watch: &Watchdog) -> Result<Network> {
    let comm_cfg = CommConfig::from_env()?;
    let boot_timeout = env::bootstrap_timeout()?;
    let abort = Arc::new(AbortState::default());
    let ip = bind_ip(single_node)?;

    // Rank 0 draws the secret and binds first; its address travels in the unique id.
    let mut uid_bytes = [0u8; UID_BYTES];
    let mut root_connector = None;
    if rank == 0 {
        let mut secret = [0u8; 16];
        getrandom::getrandom(&mut secret).map_err(|e| boot(0, format!("OS random source: {e}")))?;
        let c = NetConnector::new(0, size, secret, net_config(ip, &job_tag(), &comm_cfg)?, abort.clone())?;
        uid_bytes = UniqueId { addr: c.local_addr(), secret }.to_bytes();
        root_connector = Some(c);
    }
    watch.phase("unique-id broadcast (MPI_Bcast)", boot_timeout, Some(rank));
    mpi_world.process_at_rank(0).broadcast_into(&mut uid_bytes[..]);
    // The control channel's own deadlines name the rank that stalled: the watchdog only backs
    // them up.
    watch.phase("control channel", 2 * (boot_timeout + MEMBER_GRACE), Some(rank));
    let uid = UniqueId::from_bytes(&uid_bytes)?;
    let connector = match root_connector {
        Some(c) => c,
        None => NetConnector::new(rank, size, uid.secret, net_config(ip, &job_tag(), &comm_cfg)?, abort.clone())?,
    };
    let hello = Hello { rank, addr: connector.local_addr(), node_key: node_key(), pid: std::process::id() };
    let w = Waiter::new(rank, "bootstrap", 0, 0, boot_timeout, abort.clone());
    let (control, peers) = if size == 1 {
        (None, vec![PeerInfo { addr: hello.addr, node: 0, pid: hello.pid }])
    } else if rank == 0 {
        let mut streams = vec![None];
        for r in 1..size {
            streams.push(Some(connector.accept_stream(r, CONTROL_COMM, 0, &w)?));
        }
        let (ctl, peers) = Control::root(streams, hello, abort.clone(), boot_timeout, peer_table)?;
        (Some(ctl), peers)
    } else {
        let stream = connector.connect_stream(uid.addr, 0, CONTROL_COMM, 0, &w)?;
        if env::stalled_bootstrap_rank()? == Some(rank) {
            log::warn!("MESHTRAIN_FAULT: rank {rank} stalls before its hello to rank 0");
            loop {
                std::thread::sleep(std::time::Duration::from_secs(3600));
            }
        }
        // Rank 0 waits up to the same deadline for every rank's hello before it answers: give it
        // time to report the rank that stalled before this one gives up on rank 0.
        let (ctl, peers) = Control::member(stream, hello, abort.clone(), boot_timeout + MEMBER_GRACE)?;
        (Some(ctl), peers)
    };
    let nodes: Vec<usize> = peers.iter().map(|p| p.node).collect();
    let node_peer_pids =
        peers.iter().enumerate().filter(|&(r, p)| r != rank && p.pid != 0 && p.node == peers[rank].node).map(|(_, p)| p.pid).collect();
    connector.set_peers(peers)?;
    if rank == 0 {
        let n_nodes = nodes.iter().max().map_or(1, |m| m + 1);
        log::info!("bootstrap: {size} ranks on {n_nodes} node(s), listening on {}", uid.addr);
    }
    Ok(Network { connector, control, nodes, comm_cfg, node_peer_pids })
}

/// Extra time a member waits for rank 0's table beyond the bootstrap deadline.
const MEMBER_GRACE: std::time::Duration = std::time::Duration::from_secs(10);

/// How long `MPI_Abort` may take before the watchdog ends this rank itself.
const MPI_ABORT_LIMIT: std::time::Duration = std::time::Duration::from_secs(30);

/// Prints `e` prefixed by the rank and aborts the whole MPI job (exit status: the error's, e.g. 2
/// for a bad variable): after `MPI_Init`, returning an error would leave this rank in
/// `MPI_Finalize` and the others in the unique-id broadcast forever.
fn abort_job(mpi_world: &mpi::topology::SimpleCommunicator, rank: usize, e: &Error, watch: &Watchdog) -> ! {
    use std::io::Write as _;
    let _ = std::io::stderr().write_all(format!("meshtrain: error: rank {rank}: {e}\n").as_bytes());
    watch.phase("MPI_Abort", MPI_ABORT_LIMIT, Some(rank));
    mpi_world.abort(e.exit_code().max(1))
}

impl World {
    /// Validates the runtime environment, initializes MPI and meshtrain's own network; every rank
    /// of the job must call it. Any failure (a bad variable, found before MPI carries anything,
    /// or a failure of the network start) prints the error with the rank and aborts the whole MPI
    /// job: a rank that merely exited could leave the others waiting in MPI forever (a variable
    /// set differently on one rank, a launcher that does not end the job at a non-zero exit).
    pub fn init() -> Result<World> {
        // Checked before MPI_Init; the site profile is applied then too, because MPI's own
        // libfabric reads the FI_* variables it sets.
        let checked = preflight::validate_runtime_env().and_then(|()| crate::transport::ofi::apply_site_profile());
        // MPI_Init itself waits for every rank of the job: a rank that died first would leave
        // this one there forever, so the start-up deadline covers it (a bad value of the variable
        // is reported after MPI_Init below; the default bounds the wait until then).
        let limit = env::bootstrap_timeout().unwrap_or(env::DEFAULT_BOOTSTRAP_TIMEOUT);
        let mpi_set = mpi_defaults::apply();
        let watch = Watchdog::start("MPI_Init", limit, rank_hint());
        let universe = mpi::initialize().ok_or_else(|| boot(0, "MPI was already initialized"))?;
        let mpi_world = universe.world();
        let (rank, size) = (mpi_world.rank() as usize, mpi_world.size() as usize);
        let profile = match checked {
            Ok(profile) => profile,
            Err(e) => abort_job(&mpi_world, rank, &e, &watch),
        };
        watch.phase("node split (MPI_Comm_split_type)", limit, Some(rank));
        let local = mpi_world.split_shared(mpi_world.rank());
        let (local_rank, local_size) = (local.rank() as usize, local.size() as usize);
        let launch = LaunchInfo::from_env();
        if let Some(p) = launch.slurm_procid.filter(|&p| p != rank) {
            log::warn!("SLURM_PROCID={p} but MPI says rank {rank}: using MPI's rank");
        }
        let net = match start_network(&mpi_world, rank, size, local_size == size, &watch) {
            Ok(n) => n,
            Err(e) => abort_job(&mpi_world, rank, &e, &watch),
        };
        watch.finish();
        if rank == 0 && !mpi_set.is_empty() {
            log::info!("bootstrap: MPI defaults (MCA, unset by the user): {}", mpi_set.join(" "));
        }
        if rank == 0 && !profile.is_empty() {
            log::info!("bootstrap: MESHTRAIN_OFI_PROFILE set {}", profile.join(" "));
        }
        Ok(World {
            rank,
            size,
            local_rank,
            local_size,
            nodes: net.nodes,
            launch,
            connector: Arc::new(net.connector),
            control: net.control,
            comm_cfg: net.comm_cfg,
            node_peer_pids: net.node_peer_pids,
            mpi: Some((mpi_world, universe)),
        })
    }

    /// Finalizes MPI once the world is up (every rank calls it at the same point): meshtrain's
    /// own transports carry everything from here, and MPI's transports, with their listening
    /// sockets (Open MPI's TCP transport listens on every interface when the job spans nodes),
    /// close. The start-up deadline covers it: a rank gone before it would hold the others in
    /// MPI_Finalize's fence.
    pub fn end_mpi(&mut self) -> Result<()> {
        let Some((world, universe)) = self.mpi.take() else { return Ok(()) };
        let limit = env::bootstrap_timeout()?;
        let watch = Watchdog::start("MPI_Finalize", limit, Some(self.rank));
        drop(world);
        drop(universe);
        watch.finish();
        Ok(())
    }

    /// The communicator of all ranks. Every rank must call it, in the same order as other
    /// communicator constructors.
    pub fn communicator(&self) -> Result<Communicator> {
        Communicator::world(self.connector.clone() as Arc<dyn Connector>, self.comm_cfg.clone())
    }

    /// The communicator of all ranks with settings `cfg` instead of the environment's (e.g. one
    /// schedule forced, to measure it); every rank must pass the same `cfg`.
    pub fn communicator_with(&self, cfg: CommConfig) -> Result<Communicator> {
        Communicator::world(self.connector.clone() as Arc<dyn Connector>, cfg)
    }

    /// Collective settings taken from the environment.
    pub fn comm_config(&self) -> &CommConfig {
        &self.comm_cfg
    }

    /// The MPI world, for the benchmark's `--vs-mpi` comparison only: meshtrain itself never moves
    /// data through MPI.
    pub fn mpi_for_comparison(&self) -> Result<&mpi::topology::SimpleCommunicator> {
        self.mpi.as_ref().map(|(w, _)| w).ok_or_else(|| Error::Check("MPI was finalized after start-up".into()))
    }

    /// Frees the libfabric shared-memory regions of ranks on this node whose process is gone
    /// (killed: a SIGKILLed rank cannot remove its own; 16 MiB of tmpfs each, otherwise never
    /// freed). Call on the way out of a failed job; a live peer's regions are never touched.
    pub fn remove_dead_peer_regions(&self) {
        for &pid in &self.node_peer_pids {
            if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
                crate::transport::ofi::remove_shm_regions_of(pid);
            }
        }
    }

    /// The job-wide abort state (raised by any failing collective on any rank).
    pub fn abort_state(&self) -> &Arc<AbortState> {
        self.connector.abort()
    }
}

impl Drop for World {
    fn drop(&mut self) {
        if let Some(c) = &self.control {
            c.finish(self.comm_cfg.timeout);
        }
    }
}

/// Short job name for shared-memory segment names: Slurm's job id when there is one.
fn job_tag() -> String {
    std::env::var("SLURM_JOB_ID").unwrap_or_default()
}

/// Numbers the nodes in order of their first rank and builds the peer table.
fn peer_table(mut hellos: Vec<Hello>) -> Vec<PeerInfo> {
    hellos.sort_by_key(|h| h.rank);
    let mut keys: Vec<&str> = Vec::new();
    hellos
        .iter()
        .map(|h| {
            let node = keys.iter().position(|k| *k == h.node_key).unwrap_or_else(|| {
                keys.push(&h.node_key);
                keys.len() - 1
            });
            PeerInfo { addr: h.addr, node, pid: h.pid }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unique_id_round_trips() {
        for addr in ["10.1.2.3:4567", "[fe80::1]:9"] {
            let uid = UniqueId { addr: addr.parse().unwrap(), secret: [7; 16] };
            assert_eq!(UniqueId::from_bytes(&uid.to_bytes()).unwrap(), uid);
        }
    }

    #[test]
    fn nodes_are_numbered_by_first_rank() {
        let h = |rank, key: &str| Hello { rank, addr: "127.0.0.1:1".parse().unwrap(), node_key: key.into(), pid: 1 };
        let t = peer_table(vec![h(2, "b"), h(0, "a"), h(1, "b"), h(3, "a")]);
        assert_eq!(t.iter().map(|p| p.node).collect::<Vec<_>>(), vec![0, 1, 1, 0]);
    }
}
