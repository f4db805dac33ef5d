//! Which transport carries links (`MESHTRAIN_TRANSPORT`) and whether device buffers may travel
//! over libfabric without host staging (`MESHTRAIN_GPU_DIRECT`): the values [`crate::env`] parsed,
//! turned into link choices.
//!
//! Why a module of its own: [`super::net::NetConfig::with_env`] and the pre-MPI check of every
//! variable ([`crate::bootstrap`]) must decide these the same way, and the rules that need the
//! transport's knowledge (`auto` looks for a fabric NIC; `MESHTRAIN_GPU_DIRECT=on` needs libfabric
//! links) belong to the transport, not to the environment module.
//!
//! Invariant: every function here only reads the environment (and sysfs for `auto`), so every rank
//! with the same environment and node type gets the same answer.

use super::ofi::{self, OfiUse};
use crate::env::{self, Transport};
use crate::error::{Error, Result};

pub use crate::env::GpuDirect;

/// `MESHTRAIN_TRANSPORT` (`auto`, `shm`, `tcp`, `ofi` or `shm+ofi`, any case; see [`super::ofi`]): whether
/// pairs on one node use TCP instead of shared memory, and where libfabric carries links.
pub fn transport_from_env() -> Result<(bool, OfiUse)> {
    Ok(match env::transport()? {
        Transport::Tcp => (true, OfiUse::Never),
        Transport::Shm => (false, OfiUse::Never),
        Transport::Ofi => (false, OfiUse::Always),
        Transport::ShmOfi => (false, OfiUse::BetweenNodes),
        Transport::Auto if ofi::fabric_nic_present() => (false, OfiUse::BetweenNodes),
        Transport::Auto => (false, OfiUse::Never),
    })
}

/// `MESHTRAIN_GPU_DIRECT`, checked against where libfabric carries links: `on` without any
/// libfabric link (or without the `ofi` feature) is a configuration error saying why.
pub fn gpu_direct_from_env(ofi: OfiUse) -> Result<GpuDirect> {
    check_gpu_direct(env::gpu_direct()?, ofi, env::transport()?.name())
}

/// `mode`, or the error for `on` where libfabric carries no link (`transport`: the variable's
/// value, for the message).
fn check_gpu_direct(mode: GpuDirect, ofi: OfiUse, transport: &str) -> Result<GpuDirect> {
    if mode == GpuDirect::On {
        if !cfg!(feature = "ofi") {
            return Err(Error::config("MESHTRAIN_GPU_DIRECT", "on, but this build has no libfabric (cargo feature `ofi`)"));
        }
        if ofi == OfiUse::Never {
            return Err(Error::config(
                "MESHTRAIN_GPU_DIRECT",
                format!(
                    "on, but MESHTRAIN_TRANSPORT={transport} puts no link on libfabric, and device buffers \
                     only skip host staging over libfabric (use MESHTRAIN_TRANSPORT=ofi, or auto on a node with a fabric NIC)"
                ),
            ));
        }
    }
    Ok(mode)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_direct_on_needs_libfabric_links() {
        for mode in [GpuDirect::Auto, GpuDirect::Off] {
            assert_eq!(check_gpu_direct(mode, OfiUse::Never, "tcp").unwrap(), mode);
        }
        let err = check_gpu_direct(GpuDirect::On, OfiUse::Never, "tcp").unwrap_err().to_string();
        let why = if cfg!(feature = "ofi") { "MESHTRAIN_TRANSPORT=tcp puts no link on libfabric" } else { "no libfabric" };
        assert!(err.contains("MESHTRAIN_GPU_DIRECT") && err.contains(why), "{err}");
        if cfg!(feature = "ofi") {
            for ofi in [OfiUse::BetweenNodes, OfiUse::Always] {
                assert_eq!(check_gpu_direct(GpuDirect::On, ofi, "ofi").unwrap(), GpuDirect::On);
            }
        }
    }
}
