//! Checks every runtime `MESHTRAIN_*` variable before MPI is touched.
//!
//! Why: a bad value found after `MPI_Init` on one rank (rank 0 before the unique-id broadcast,
//! say) left the other ranks waiting in MPI forever with no output. Checked here, before MPI, every
//! rank reads the same environment and fails the same way at once, with a message naming the
//! variable and the values it accepts.
//!
//! Invariant: this parses with the same functions the runtime later uses ([`CommConfig::from_env`],
//! [`NetConfig::with_env`], [`GpuCommConfig::from_env`]), so nothing accepted here is rejected
//! later; it adds only what those cannot know without a network (is the bind address assignable
//! here, does the interface exist). Variables of the job configuration (`MESHTRAIN_<SECTION>_<KEY>`)
//! are checked by the configuration loader, not here.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener};
use std::time::Duration;

use crate::comm::device::GpuCommConfig;
use crate::comm::CommConfig;
use crate::error::{Error, Result};
use crate::transport::net::NetConfig;

use super::ifaddr;

/// Runtime variables and what they accept (the README's Environment table lists the same).
pub const RUNTIME_VARS: &[(&str, &str)] = &[
    ("MESHTRAIN_TRANSPORT", "auto, shm, tcp or ofi (any case)"),
    ("MESHTRAIN_BIND_ADDR", "an IP address of this host, or 0.0.0.0"),
    ("MESHTRAIN_SOCKET_IFNAME", "the name of an interface with an IPv4 address"),
    ("MESHTRAIN_TIMEOUT", "seconds > 0"),
    ("MESHTRAIN_BOOTSTRAP_TIMEOUT", "seconds > 0"),
    ("MESHTRAIN_ALGO", "auto, ring or direct"),
    ("MESHTRAIN_CMA", "auto, on (1) or off (0)"),
    ("MESHTRAIN_SMALL_BYTES", "bytes > 0"),
    ("MESHTRAIN_CHUNK_BYTES", "a multiple of 64 bytes"),
    ("MESHTRAIN_SHM_CHUNK", "a size 1..=shm maximum (K/M/G suffix)"),
    ("MESHTRAIN_SHM_DEPTH", "slots 1..=shm maximum"),
    ("MESHTRAIN_TCP_CHUNK", "a size 1..=tcp maximum (K/M/G suffix)"),
    ("MESHTRAIN_TCP_DEPTH", "buffers 1..=tcp maximum"),
    ("MESHTRAIN_GPU_IPC", "auto, on or off"),
    ("MESHTRAIN_GPU_STAGE_CHUNK", "a size > 0 (K/M/G suffix)"),
    ("MESHTRAIN_OFI_PROVIDER", "a libfabric provider name, e.g. cxi, verbs, tcp or shm (else FI_PROVIDER)"),
    ("MESHTRAIN_OFI_PROFILE", "frontier"),
    ("MESHTRAIN_FAULT", "test only: stall-bootstrap@RANK"),
];

/// Default bound on the start-up exchange with rank 0 (`MESHTRAIN_BOOTSTRAP_TIMEOUT`).
const DEFAULT_BOOTSTRAP_TIMEOUT: Duration = Duration::from_secs(120);

fn get(key: &str) -> Option<String> {
    std::env::var(key).ok().filter(|v| !v.is_empty())
}

/// Validates every runtime variable; call before MPI is initialized.
pub fn validate_runtime_env() -> Result<()> {
    CommConfig::from_env()?;
    NetConfig::new(IpAddr::V4(Ipv4Addr::LOCALHOST), "").with_env()?;
    GpuCommConfig::from_env()?;
    bootstrap_timeout()?;
    stalled_bootstrap_rank()?;
    if let Some(ip) = bind_addr()? {
        // Bind port 0 once and let go: an address this host does not own fails here, not after
        // MPI_Init on one rank.
        TcpListener::bind(SocketAddr::new(ip, 0)).map_err(|e| {
            Error::config("MESHTRAIN_BIND_ADDR", format!("`{ip}` cannot be bound on this host: {e} (expected {})", allowed("MESHTRAIN_BIND_ADDR")))
        })?;
    }
    if let Some(name) = get("MESHTRAIN_SOCKET_IFNAME") {
        interface_ip(&name)?;
    }
    Ok(())
}

fn allowed(key: &str) -> &'static str {
    RUNTIME_VARS.iter().find(|(k, _)| *k == key).map_or("", |(_, a)| a)
}

/// `MESHTRAIN_BIND_ADDR`, parsed.
pub fn bind_addr() -> Result<Option<IpAddr>> {
    get("MESHTRAIN_BIND_ADDR")
        .map(|v| {
            v.parse()
                .map_err(|_| Error::config("MESHTRAIN_BIND_ADDR", format!("`{v}` is not an IP address (expected {})", allowed("MESHTRAIN_BIND_ADDR"))))
        })
        .transpose()
}

/// The IPv4 address of interface `name` (`MESHTRAIN_SOCKET_IFNAME`).
pub fn interface_ip(name: &str) -> Result<IpAddr> {
    ifaddr::ipv4_of(name)?.ok_or_else(|| {
        Error::config("MESHTRAIN_SOCKET_IFNAME", format!("interface `{name}` does not exist or has no IPv4 address"))
    })
}

/// How long the start-up exchange with rank 0 may take (`MESHTRAIN_BOOTSTRAP_TIMEOUT` seconds,
/// default 120).
pub fn bootstrap_timeout() -> Result<Duration> {
    match get("MESHTRAIN_BOOTSTRAP_TIMEOUT") {
        None => Ok(DEFAULT_BOOTSTRAP_TIMEOUT),
        Some(v) => v
            .parse::<f64>()
            .ok()
            .filter(|s| s.is_finite() && *s > 0.0)
            .map(Duration::from_secs_f64)
            .ok_or_else(|| Error::config("MESHTRAIN_BOOTSTRAP_TIMEOUT", format!("`{v}` is not a positive number of seconds"))),
    }
}

/// Test-only fault injection: `MESHTRAIN_FAULT=stall-bootstrap@RANK` makes world rank RANK stop
/// before its hello to rank 0 (as a stopped or wedged process would), so that the start-up
/// deadline and its message can be tested with real processes.
pub fn stalled_bootstrap_rank() -> Result<Option<usize>> {
    let Some(v) = get("MESHTRAIN_FAULT") else { return Ok(None) };
    v.strip_prefix("stall-bootstrap@")
        .and_then(|r| r.parse().ok())
        .map(Some)
        .ok_or_else(|| Error::config("MESHTRAIN_FAULT", format!("`{v}` is not {}", allowed("MESHTRAIN_FAULT"))))
}
