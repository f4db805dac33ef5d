//! Network interface addresses (getifaddrs), to pick the address a listener binds.

use std::ffi::CStr;
use std::net::{IpAddr, Ipv4Addr};

use crate::error::{Error, Result};

/// (interface name, IPv4 address, is up, is loopback) for every IPv4 address of this host.
fn ipv4_interfaces() -> Result<Vec<(String, Ipv4Addr, bool, bool)>> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a list head we own until freeifaddrs; we only read it.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(Error::io("getifaddrs", std::io::Error::last_os_error()));
    }
    let mut out = Vec::new();
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list returned by getifaddrs and not yet freed; its name is
        // a NUL-terminated string and an AF_INET address is a sockaddr_in.
        unsafe {
            let ifa = &*cur;
            if !ifa.ifa_addr.is_null() && i32::from((*ifa.ifa_addr).sa_family) == libc::AF_INET {
                let sin = &*(ifa.ifa_addr as *const libc::sockaddr_in);
                let ip = Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
                let name = CStr::from_ptr(ifa.ifa_name).to_string_lossy().into_owned();
                let flags = ifa.ifa_flags as i32;
                out.push((name, ip, flags & libc::IFF_UP != 0, flags & libc::IFF_LOOPBACK != 0));
            }
            cur = ifa.ifa_next;
        }
    }
    // SAFETY: `head` came from getifaddrs and is freed exactly once.
    unsafe { libc::freeifaddrs(head) };
    Ok(out)
}

/// IPv4 address of interface `name`, if it has one.
pub fn ipv4_of(name: &str) -> Result<Option<IpAddr>> {
    Ok(ipv4_interfaces()?.into_iter().find(|i| i.0 == name).map(|i| IpAddr::V4(i.1)))
}

/// First up, non-loopback IPv4 address, skipping container bridges (docker*, virbr*, veth*).
pub fn first_external_ipv4() -> Result<Option<IpAddr>> {
    let skip = ["docker", "virbr", "veth", "br-"];
    Ok(ipv4_interfaces()?
        .into_iter()
        .find(|(name, _, up, lo)| *up && !*lo && !skip.iter().any(|s| name.starts_with(s)))
        .map(|i| IpAddr::V4(i.1)))
}

#[cfg(test)]
mod tests {
    #[test]
    fn loopback_is_listed() {
        assert_eq!(super::ipv4_of("lo").unwrap(), Some("127.0.0.1".parse().unwrap()));
    }
}
