//! Checks every runtime `MESHTRAIN_*` variable before MPI is touched.
//!
//! Why: a bad value found after `MPI_Init` on one rank (rank 0 before the unique-id broadcast,
//! say) left the other ranks waiting in MPI forever with no output. Checked here, before MPI, every
//! rank reads the same environment and fails the same way at once, with a message naming the
//! variable and the values it accepts.
//!
//! Invariant: this parses with the same functions the runtime later uses ([`CommConfig::from_env`],
//! [`NetConfig::with_env`], [`GpuCommConfig::from_env`] and the getters of [`crate::env`], which
//! all of them call), so nothing accepted here is rejected later; it adds only what those cannot
//! know without a network (is the bind address assignable here, does the interface exist).
//! Variables of the job configuration (`MESHTRAIN_<SECTION>_<KEY>`) are checked by the
//! configuration loader, not here.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener};

use crate::comm::device::GpuCommConfig;
use crate::comm::CommConfig;
use crate::env;
use crate::error::{Error, Result};
use crate::transport::net::NetConfig;

use super::ifaddr;

/// Validates every runtime variable; call before MPI is initialized. `config_var` says whether a
/// `MESHTRAIN_*` name is a job-configuration override.
pub fn validate_runtime_env(config_var: fn(&str) -> bool) -> Result<()> {
    let names: Vec<String> = std::env::vars_os().filter_map(|(k, _)| k.into_string().ok()).collect();
    check_names(names.iter().map(String::as_str), config_var)?;
    CommConfig::from_env()?;
    NetConfig::new(IpAddr::V4(Ipv4Addr::LOCALHOST), "").with_env()?;
    GpuCommConfig::from_env()?;
    env::bootstrap_timeout()?;
    env::stalled_bootstrap_rank()?;
    env::cpu_simd()?;
    if let Some(ip) = env::bind_addr()? {
        // Bind port 0 once and let go: an address this host does not own fails here, not after
        // MPI_Init on one rank.
        TcpListener::bind(SocketAddr::new(ip, 0)).map_err(|e| {
            Error::config("MESHTRAIN_BIND_ADDR", format!("`{ip}` cannot be bound on this host: {e} (expected {})", env::accepted("MESHTRAIN_BIND_ADDR")))
        })?;
    }
    if let Some(name) = env::socket_ifname() {
        interface_ip(&name)?;
    }
    Ok(())
}

/// A `MESHTRAIN_*` name that is neither a runtime variable, a job-config override
/// (`MESHTRAIN_<SECTION>_<KEY>`, checked by the config loader) nor a tool variable is a typo
/// that would otherwise be ignored silently: an error naming it and the nearest known name.
fn check_names<'a>(names: impl Iterator<Item = &'a str>, config_var: fn(&str) -> bool) -> Result<()> {
    env::check_names(names, config_var)
}

/// The IPv4 address of interface `name` (`MESHTRAIN_SOCKET_IFNAME`).
pub fn interface_ip(name: &str) -> Result<IpAddr> {
    ifaddr::ipv4_of(name)?.ok_or_else(|| {
        Error::config("MESHTRAIN_SOCKET_IFNAME", format!("interface `{name}` does not exist or has no IPv4 address"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The configuration's override names as the binary passes them.
    fn config_var(name: &str) -> bool {
        crate::config::is_override_var(name)
    }

    #[test]
    fn misspelled_names_are_refused_with_the_nearest_known_name() {
        let err = check_names(["PATH", "MESHTRAIN_TRANSPRT"].into_iter(), config_var).unwrap_err().to_string();
        assert!(err.contains("MESHTRAIN_TRANSPRT") && err.contains("did you mean MESHTRAIN_TRANSPORT?"), "{err}");
        let err = check_names(["MESHTRAIN_SHM_DEPHT"].into_iter(), config_var).unwrap_err().to_string();
        assert!(err.contains("did you mean MESHTRAIN_SHM_DEPTH?"), "{err}");
    }

    #[test]
    fn runtime_tool_and_config_names_pass() {
        let names = ["MESHTRAIN_TRANSPORT", "MESHTRAIN_EMU_CXX", "MESHTRAIN_TRAIN_STEPS", "MESHTRAIN_DEVICE", "OTHER"];
        check_names(names.into_iter(), config_var).unwrap();
    }
}
