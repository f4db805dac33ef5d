//! Bootstrap: MPI discovers the ranks and carries one broadcast of the unique id; everything after
//! that is meshtrain's own ([`crate::world`] assembles the network, the control channel and the
//! communicators on top of what this module finds out).
//!
//! This is the bottom of the stack: it knows MPI, the launcher's variables and the start-up
//! deadline, and nothing of transports or collectives, so every layer above may use it.
//!
//! MPI's own listeners: [`mpi_defaults`] sets MCA defaults before `MPI_Init` (shared memory only
//! when the whole job is on one node) so that MPI opens no TCP listener on the wildcard address.
//!
//! Failure: start-up, `MPI_Init` included, runs under a watchdog thread ([`Watchdog`]) that ends
//! the rank with a message naming the phase (exit status 3) when a phase takes longer than
//! `MESHTRAIN_BOOTSTRAP_TIMEOUT`: a rank that died before `MPI_Init` under a launcher that does not
//! end the job can no longer leave the others in MPI forever. Once MPI is up, a failure ends the
//! whole job with `MPI_Abort` ([`Mpi::abort`]) after printing the error with the rank.
//!
//! Sequence (NCCL-style): MPI init; world rank/size; node-local rank/size from a shared-memory
//! split ([`Mpi::init`]); rank 0 draws the unique id (its listener's address and a secret) and MPI
//! broadcasts it ([`Mpi::broadcast_uid`]); MPI is then idle until [`Mpi::finalize`] right after
//! the world is assembled. A process started without a launcher is a world of size 1.

mod mpi_defaults;
mod watchdog;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use mpi::traits::{Communicator as _, Root as _};

use crate::env;
use crate::error::{Error, Result};

pub use watchdog::{Watchdog, EXIT_STARTUP_TIMEOUT};

/// Byte size of the serialized unique id.
pub const UID_BYTES: usize = 64;

/// The unique id rank 0 broadcasts: its listener and the job secret.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UniqueId {
    /// Rank 0's listener.
    pub addr: SocketAddr,
    /// 128-bit secret every connection must prove knowledge of.
    pub secret: [u8; 16],
}

impl UniqueId {
    /// The id as the bytes MPI broadcasts.
    pub fn to_bytes(self) -> [u8; UID_BYTES] {
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

    /// The id from the broadcast bytes.
    pub fn from_bytes(b: &[u8; UID_BYTES]) -> Result<Self> {
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
    /// Slurm's variables of this process.
    pub fn from_env() -> Self {
        let num = |k: &str| std::env::var(k).ok().and_then(|v| v.parse().ok());
        LaunchInfo {
            slurm_procid: num("SLURM_PROCID"),
            slurm_localid: num("SLURM_LOCALID"),
            slurm_ntasks: num("SLURM_NTASKS"),
            slurm_job_id: std::env::var("SLURM_JOB_ID").ok(),
        }
    }
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
pub fn node_key() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    format!("{}/{}", host.trim(), boot.trim())
}

/// How long `MPI_Abort` may take before the watchdog ends this rank itself.
const MPI_ABORT_LIMIT: Duration = Duration::from_secs(30);

/// MPI while it is up: the world communicator and the universe that finalizes MPI when dropped,
/// with what MPI found out about this process.
pub struct Mpi {
    /// World rank.
    pub rank: usize,
    /// World size.
    pub size: usize,
    /// Rank among the processes of this node.
    pub local_rank: usize,
    /// Number of processes on this node.
    pub local_size: usize,
    /// The MCA defaults set before `MPI_Init` (those the user had not set).
    pub defaults_set: Vec<String>,
    world: mpi::topology::SimpleCommunicator,
    universe: mpi::environment::Universe,
}

impl Mpi {
    /// Sets MPI's defaults and initializes MPI under `watch` (whose current phase covers
    /// `MPI_Init`), then splits the world by node under a phase of `limit`.
    pub fn init(watch: &Watchdog, limit: Duration) -> Result<Mpi> {
        let defaults_set = mpi_defaults::apply();
        let universe = mpi::initialize().ok_or_else(|| boot(0, "MPI was already initialized"))?;
        let world = universe.world();
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        watch.phase("node split (MPI_Comm_split_type)", limit, Some(rank));
        let local = world.split_shared(world.rank());
        let (local_rank, local_size) = (local.rank() as usize, local.size() as usize);
        Ok(Mpi { rank, size, local_rank, local_size, defaults_set, world, universe })
    }

    /// Broadcasts rank 0's unique id bytes to every rank (collective).
    pub fn broadcast_uid(&self, bytes: &mut [u8; UID_BYTES]) {
        self.world.process_at_rank(0).broadcast_into(&mut bytes[..]);
    }

    /// Prints `e` prefixed by the rank and aborts the whole MPI job (exit status: the error's, e.g.
    /// 2 for a bad variable): after `MPI_Init`, returning an error would leave this rank in
    /// `MPI_Finalize` and the others in the unique-id broadcast forever.
    pub fn abort(&self, e: &Error, watch: &Watchdog) -> ! {
        use std::io::Write as _;
        let _ = std::io::stderr().write_all(format!("meshtrain: error: rank {}: {e}\n", self.rank).as_bytes());
        watch.phase("MPI_Abort", MPI_ABORT_LIMIT, Some(self.rank));
        self.world.abort(e.exit_code().max(1))
    }

    /// Finalizes MPI (every rank calls it at the same point) under a deadline: a rank gone before
    /// it would hold the others in `MPI_Finalize`'s fence.
    pub fn finalize(self) -> Result<()> {
        let limit = env::bootstrap_timeout()?;
        let watch = Watchdog::start("MPI_Finalize", limit, Some(self.rank));
        drop(self.world);
        drop(self.universe);
        watch.finish();
        Ok(())
    }

    /// The MPI world, for the benchmark's `--vs-mpi` comparison only: meshtrain itself never moves
    /// data through MPI.
    pub fn world(&self) -> &mpi::topology::SimpleCommunicator {
        &self.world
    }
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
}
