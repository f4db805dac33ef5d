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
    ("MESHTRAIN_TRANSPORT", "auto, shm, tcp, ofi or shm+ofi (any case)"),
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
    ("MESHTRAIN_GPU_ONESHOT", "a size 0..=1G (K/M/G suffix; 0 = off)"),
    ("MESHTRAIN_GPU_DIRECT", "auto, on or off (on needs libfabric links: MESHTRAIN_TRANSPORT=ofi, or auto with a fabric NIC)"),
    ("MESHTRAIN_OFI_PROVIDER", "a libfabric provider name, e.g. cxi, verbs, tcp or shm (else FI_PROVIDER)"),
    ("MESHTRAIN_OFI_PROFILE", "frontier"),
    ("MESHTRAIN_FAULT", "test only: stall-bootstrap@RANK"),
];

/// Variables read outside the runtime: by the emu device, the plots, build and test tooling.
const OTHER_VARS: &[&str] = &[
    "MESHTRAIN_EMU_CXX",
    "MESHTRAIN_EMU_CACHE",
    "MESHTRAIN_HIP_ARCH",
    "MESHTRAIN_FONT",
    "MESHTRAIN_GIT_SHA",
    "MESHTRAIN_GPU_SEED",
    "MESHTRAIN_H5PY_PYTHON",
    "MESHTRAIN_REQUIRE_H5PY",
    "MESHTRAIN_REQUIRE_HIPCC",
    "MESHTRAIN_REQUIRE_NVRTC",
    "MESHTRAIN_TEST_CHILD",
    "MESHTRAIN_SLURM_DIR",
];

/// Default bound on the start-up exchange with rank 0 (`MESHTRAIN_BOOTSTRAP_TIMEOUT`).
const DEFAULT_BOOTSTRAP_TIMEOUT: Duration = Duration::from_secs(120);

fn get(key: &str) -> Option<String> {
    std::env::var(key).ok().filter(|v| !v.is_empty())
}

/// Validates every runtime variable; call before MPI is initialized.
pub fn validate_runtime_env() -> Result<()> {
    let names: Vec<String> = std::env::vars_os().filter_map(|(k, _)| k.into_string().ok()).collect();
    check_names(names.iter().map(String::as_str))?;
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

/// A `MESHTRAIN_*` name that is neither a runtime variable, a job-config override
/// (`MESHTRAIN_<SECTION>_<KEY>`, checked by the config loader) nor a tool variable is a typo
/// that would otherwise be ignored silently: an error naming it and the nearest known name.
fn check_names<'a>(names: impl Iterator<Item = &'a str>) -> Result<()> {
    let known = || RUNTIME_VARS.iter().map(|(k, _)| *k).chain(OTHER_VARS.iter().copied());
    for name in names.filter(|n| n.starts_with("MESHTRAIN_")) {
        if known().any(|k| k == name) || crate::config::overrides::env_key(name).is_some() {
            continue;
        }
        let nearest = known().min_by_key(|k| edit_distance(k, name)).unwrap_or_default();
        return Err(Error::config(
            name,
            format!("unknown meshtrain variable (did you mean {nearest}? job-config overrides are MESHTRAIN_<SECTION>_<KEY>; README, Environment, lists the rest)"),
        ));
    }
    Ok(())
}

/// Levenshtein distance over bytes (names are ASCII).
fn edit_distance(a: &str, b: &str) -> usize {
    let b = b.as_bytes();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.bytes().enumerate() {
        let mut diag = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let next = (diag + usize::from(ca != cb)).min(row[j] + 1).min(row[j + 1] + 1);
            diag = row[j + 1];
            row[j + 1] = next;
        }
    }
    row[b.len()]
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn misspelled_names_are_refused_with_the_nearest_known_name() {
        let err = check_names(["PATH", "MESHTRAIN_TRANSPRT"].into_iter()).unwrap_err().to_string();
        assert!(err.contains("MESHTRAIN_TRANSPRT") && err.contains("did you mean MESHTRAIN_TRANSPORT?"), "{err}");
        let err = check_names(["MESHTRAIN_SHM_DEPHT"].into_iter()).unwrap_err().to_string();
        assert!(err.contains("did you mean MESHTRAIN_SHM_DEPTH?"), "{err}");
    }

    #[test]
    fn runtime_tool_and_config_names_pass() {
        let names = ["MESHTRAIN_TRANSPORT", "MESHTRAIN_EMU_CXX", "MESHTRAIN_TRAIN_STEPS", "MESHTRAIN_DEVICE", "OTHER"];
        check_names(names.into_iter()).unwrap();
    }

    #[test]
    fn edit_distance_counts_single_edits() {
        assert_eq!(edit_distance("MESHTRAIN_ALGO", "MESHTRAIN_ALGO"), 0);
        assert_eq!(edit_distance("MESHTRAIN_TRANSPORT", "MESHTRAIN_TRANSPRT"), 1);
        assert_eq!(edit_distance("abc", "acb"), 2);
        assert_eq!(edit_distance("", "abc"), 3);
    }
}
