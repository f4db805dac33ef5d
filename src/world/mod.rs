//! The world: meshtrain's own network, assembled on what [`crate::bootstrap`] found out through
//! MPI, and the communicator of all ranks built on it.
//!
//! Why a layer of its own: MPI discovery sits at the bottom of the stack; building the connector,
//! the control channel and communicators needs transports and collectives, so it sits above
//! [`crate::comm`]. Nothing below imports it.
//!
//! Failure: the runtime `MESHTRAIN_*` variables are checked ([`preflight`]) before MPI carries
//! anything, and any failure of the start-up prints the error prefixed by the rank and ends the
//! whole job with `MPI_Abort`; the start-up reads on the control channel have a deadline
//! (`MESHTRAIN_BOOTSTRAP_TIMEOUT`) and name the rank that stalled.
//!
//! Sequence: rank 0 binds its listener and draws a 128-bit secret from the OS; the unique id (that
//! address + the secret) is broadcast through MPI; every rank binds its own listener and reports
//! it to rank 0 over an authenticated stream (the control channel), which answers with the table of
//! all ranks. MPI is finalized right after ([`World::end_mpi`]) or when the [`World`] drops.
//!
//! Listeners bind one address, never all interfaces unless asked: `MESHTRAIN_BIND_ADDR` (an IP,
//! `0.0.0.0` allowed), else the IPv4 address of `MESHTRAIN_SOCKET_IFNAME`, else 127.0.0.1 when the
//! whole job is on one node, else the first up, non-loopback IPv4 interface.

pub mod binding;
mod control;
mod ifaddr;
pub mod preflight;

use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;

use crate::bootstrap::{rank_hint, node_key, LaunchInfo, Mpi, UniqueId, Watchdog, UID_BYTES};
use crate::comm::{CommConfig, Communicator};
use crate::env;
use crate::error::{Error, Result};
use crate::transport::net::{NetConfig, NetConnector, PeerInfo};
use crate::transport::{AbortState, Connector, Waiter};

use control::{Control, Hello};

/// Communicator id reserved for the control channel.
const CONTROL_COMM: u64 = u64::MAX;

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
    /// MPI until [`World::end_mpi`].
    mpi: Option<Mpi>,
}

fn boot(rank: usize, msg: impl Into<String>) -> Error {
    Error::Bootstrap { rank, msg: msg.into() }
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
fn start_network(mpi: &Mpi, watch: &Watchdog) -> Result<Network> {
    let (rank, size, single_node) = (mpi.rank, mpi.size, mpi.local_size == mpi.size);
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
    mpi.broadcast_uid(&mut uid_bytes);
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

impl World {
    /// Validates the runtime environment, initializes MPI and meshtrain's own network; every rank
    /// of the job must call it. Any failure (a bad variable, found before MPI carries anything,
    /// or a failure of the network start) prints the error with the rank and aborts the whole MPI
    /// job: a rank that merely exited could leave the others waiting in MPI forever (a variable
    /// set differently on one rank, a launcher that does not end the job at a non-zero exit).
    ///
    /// `config_var` says whether a `MESHTRAIN_*` name is a job-configuration override (checked by
    /// the configuration loader), so that the misspelling check lets it pass.
    pub fn init(config_var: fn(&str) -> bool) -> Result<World> {
        // Checked before MPI_Init; the site profile is applied then too, because MPI's own
        // libfabric reads the FI_* variables it sets.
        let checked = preflight::validate_runtime_env(config_var).and_then(|()| crate::transport::ofi::apply_site_profile());
        // MPI_Init itself waits for every rank of the job: a rank that died first would leave
        // this one there forever, so the start-up deadline covers it (a bad value of the variable
        // is reported after MPI_Init below; the default bounds the wait until then).
        let limit = env::bootstrap_timeout().unwrap_or(env::DEFAULT_BOOTSTRAP_TIMEOUT);
        let watch = Watchdog::start("MPI_Init", limit, rank_hint());
        let mpi = Mpi::init(&watch, limit)?;
        let rank = mpi.rank;
        let profile = match checked {
            Ok(profile) => profile,
            Err(e) => mpi.abort(&e, &watch),
        };
        let launch = LaunchInfo::from_env();
        if let Some(p) = launch.slurm_procid.filter(|&p| p != rank) {
            log::warn!("SLURM_PROCID={p} but MPI says rank {rank}: using MPI's rank");
        }
        let net = match start_network(&mpi, &watch) {
            Ok(n) => n,
            Err(e) => mpi.abort(&e, &watch),
        };
        watch.finish();
        if rank == 0 && !mpi.defaults_set.is_empty() {
            log::info!("bootstrap: MPI defaults (MCA, unset by the user): {}", mpi.defaults_set.join(" "));
        }
        if rank == 0 && !profile.is_empty() {
            log::info!("bootstrap: MESHTRAIN_OFI_PROFILE set {}", profile.join(" "));
        }
        if mpi.local_rank == 0 {
            if let Some(advice) = binding::advice(mpi.local_size) {
                log::info!("{advice}");
            }
        }
        Ok(World {
            rank,
            size: mpi.size,
            local_rank: mpi.local_rank,
            local_size: mpi.local_size,
            nodes: net.nodes,
            launch,
            connector: Arc::new(net.connector),
            control: net.control,
            comm_cfg: net.comm_cfg,
            node_peer_pids: net.node_peer_pids,
            mpi: Some(mpi),
        })
    }

    /// Finalizes MPI once the world is up (every rank calls it at the same point): meshtrain's
    /// own transports carry everything from here, and MPI's transports, with their listening
    /// sockets (Open MPI's TCP transport listens on every interface when the job spans nodes),
    /// close. The start-up deadline covers it: a rank gone before it would hold the others in
    /// MPI_Finalize's fence.
    pub fn end_mpi(&mut self) -> Result<()> {
        match self.mpi.take() {
            Some(mpi) => mpi.finalize(),
            None => Ok(()),
        }
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
        self.mpi.as_ref().map(Mpi::world).ok_or_else(|| Error::Check("MPI was finalized after start-up".into()))
    }

    /// Frees the libfabric shared-memory regions of ranks on this node whose process is gone
    /// (killed: a SIGKILLed rank cannot remove its own; 16 MiB of tmpfs each, otherwise never
    /// freed). Call on the way out of a failed job; a live peer's regions are never touched.
    pub fn remove_dead_peer_regions(&self) {
        for &pid in &self.node_peer_pids {
            if process_gone(pid) {
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

/// Whether process `pid` has ended: no `/proc` entry, or a zombie its launcher has not reaped
/// yet (a peer killed a moment ago usually is one when the survivors notice).
fn process_gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the command name, which is in parentheses and may hold spaces.
        Ok(stat) => stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().next()).is_some_and(|state| state == "Z" || state == "X"),
        Err(_) => true,
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
    fn a_zombie_counts_as_gone_and_a_live_process_does_not() {
        assert!(!process_gone(std::process::id()));
        let mut child = std::process::Command::new("true").spawn().unwrap();
        // Not reaped yet: a zombie once it has exited.
        let pid = child.id();
        let start = std::time::Instant::now();
        while !process_gone(pid) {
            assert!(start.elapsed() < std::time::Duration::from_secs(10), "`true` never ended");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        child.wait().unwrap();
        assert!(process_gone(pid));
    }

    #[test]
    fn nodes_are_numbered_by_first_rank() {
        let h = |rank, key: &str| Hello { rank, addr: "127.0.0.1:1".parse().unwrap(), node_key: key.into(), pid: 1 };
        let t = peer_table(vec![h(2, "b"), h(0, "a"), h(1, "b"), h(3, "a")]);
        assert_eq!(t.iter().map(|p| p.node).collect::<Vec<_>>(), vec![0, 1, 1, 0]);
    }
}
