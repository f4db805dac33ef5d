//! Which transport carries links (`MESHTRAIN_TRANSPORT`) and whether device buffers may travel
//! over libfabric without host staging (`MESHTRAIN_GPU_DIRECT`), parsed from the environment, and
//! the size syntax of the link variables (`MESHTRAIN_{SHM,TCP}_CHUNK`).
//!
//! Why a module of its own: [`super::net::NetConfig::with_env`] and the pre-MPI check of every
//! variable ([`crate::bootstrap`]) must parse these the same way, and the combination rules
//! (`MESHTRAIN_GPU_DIRECT=on` needs libfabric links) belong next to the parsing.
//!
//! Invariant: every function here only reads the environment (and sysfs for `auto`), so every rank
//! with the same environment and node type gets the same answer.

use super::ofi::{self, OfiUse};
use crate::error::{Error, Result};

/// Whether device send/recv over libfabric links post the device buffer itself (FI_HMEM
/// registration) instead of staging it through pinned host memory (`MESHTRAIN_GPU_DIRECT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GpuDirect {
    /// Direct where both ends' endpoints offer FI_HMEM; staged otherwise (the choice is logged).
    #[default]
    Auto,
    /// Always direct; an error where impossible.
    On,
    /// Always staged.
    Off,
}

impl GpuDirect {
    /// `MESHTRAIN_GPU_DIRECT` (`auto` when unset or empty).
    pub fn from_env() -> Result<GpuDirect> {
        GpuDirect::parse(var("MESHTRAIN_GPU_DIRECT").as_deref())
    }

    /// A value of `MESHTRAIN_GPU_DIRECT` (any case; `None`: unset).
    fn parse(value: Option<&str>) -> Result<GpuDirect> {
        match value.map(|v| v.to_ascii_lowercase()).as_deref() {
            None | Some("auto") => Ok(GpuDirect::Auto),
            Some("on") => Ok(GpuDirect::On),
            Some("off") => Ok(GpuDirect::Off),
            Some(other) => Err(Error::config("MESHTRAIN_GPU_DIRECT", format!("`{other}` is not auto, on or off"))),
        }
    }
}

fn var(key: &str) -> Option<String> {
    std::env::var(key).ok().filter(|v| !v.is_empty())
}

/// `MESHTRAIN_TRANSPORT` (`auto`, `shm`, `tcp`, `ofi` or `shm+ofi`, any case; see [`super::ofi`]): whether
/// pairs on one node use TCP instead of shared memory, and where libfabric carries links.
pub fn transport_from_env() -> Result<(bool, OfiUse)> {
    let transport = var("MESHTRAIN_TRANSPORT").unwrap_or_else(|| "auto".into()).to_ascii_lowercase();
    Ok(match transport.as_str() {
        "tcp" => (true, OfiUse::Never),
        "shm" => (false, OfiUse::Never),
        "ofi" => (false, OfiUse::Always),
        "shm+ofi" => (false, OfiUse::BetweenNodes),
        "auto" if ofi::fabric_nic_present() => (false, OfiUse::BetweenNodes),
        "auto" => (false, OfiUse::Never),
        _ => {
            return Err(Error::config(
                "MESHTRAIN_TRANSPORT",
                format!("{transport:?}: expected auto, shm, tcp, ofi or shm+ofi (any case)"),
            ))
        }
    })
}

/// `MESHTRAIN_GPU_DIRECT`, checked against where libfabric carries links: `on` without any
/// libfabric link (or without the `ofi` feature) is a configuration error saying why.
pub fn gpu_direct_from_env(ofi: OfiUse) -> Result<GpuDirect> {
    let transport = var("MESHTRAIN_TRANSPORT").unwrap_or_else(|| "auto".into());
    check_gpu_direct(GpuDirect::from_env()?, ofi, &transport)
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

/// `123`, `64K`, `4M`, `1G` (powers of 1024).
pub(super) fn parse_size(s: &str) -> Option<usize> {
    let s = s.trim();
    let (digits, unit) = match s.char_indices().last()? {
        (i, 'k' | 'K') => (&s[..i], 1usize << 10),
        (i, 'm' | 'M') => (&s[..i], 1 << 20),
        (i, 'g' | 'G') => (&s[..i], 1 << 30),
        _ => (s, 1),
    };
    digits.parse::<usize>().ok()?.checked_mul(unit)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_suffixes() {
        assert_eq!(parse_size("4096"), Some(4096));
        assert_eq!(parse_size("512K"), Some(512 << 10));
        assert_eq!(parse_size("2m"), Some(2 << 20));
        assert_eq!(parse_size("1G"), Some(1 << 30));
        assert_eq!(parse_size("x"), None);
        assert_eq!(parse_size(""), None);
    }

    #[test]
    fn gpu_direct_values_parse_in_any_case_and_others_name_the_variable() {
        assert_eq!(GpuDirect::parse(None).unwrap(), GpuDirect::Auto);
        assert_eq!(GpuDirect::parse(Some("AUTO")).unwrap(), GpuDirect::Auto);
        assert_eq!(GpuDirect::parse(Some("On")).unwrap(), GpuDirect::On);
        assert_eq!(GpuDirect::parse(Some("off")).unwrap(), GpuDirect::Off);
        let err = GpuDirect::parse(Some("yes")).unwrap_err().to_string();
        assert!(err.contains("MESHTRAIN_GPU_DIRECT") && err.contains("`yes` is not auto, on or off"), "{err}");
    }

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
