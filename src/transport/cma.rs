//! Cross Memory Attach: copying straight out of a peer process's memory (`process_vm_readv`).
//!
//! Why: a shared-memory FIFO moves every byte twice (into the slot, out of it). Between two
//! processes of one node the kernel can copy from the owner's buffer into the reader's in one pass,
//! as OpenMPI's and MPICH's shared-memory transports do for large messages. This module is only the
//! capability: [`PeerMemory`] reads a range of a peer's address space, [`allow_peer_reads`] lets
//! other processes read this one, [`copy_rates`] says whether one kernel copy beats the two
//! user-space copies of a FIFO here (on some machines, virtual ones especially, the kernel's
//! `rep movsb` copy runs at a third of an AVX `memcpy`, and loses). Which bytes may be read, and
//! for how long they stay valid, is the
//! business of the protocol built on top (`comm::primitives`): the owner announces a buffer and
//! does not touch it until every reader has said it is done.
//!
//! Invariants: a read either fills the whole destination or fails with the OS error (a partial
//! transfer is continued, never returned); it never writes outside the destination slice. Reading a
//! peer that has exited fails with `ESRCH`; reading an address the peer has unmapped fails with
//! `EFAULT`. Neither is undefined behaviour on this side: the kernel does the access.

use std::io;
use std::sync::OnceLock;
use std::time::Instant;

use super::shm::DEFAULT_SHM_CHUNK;

/// Read access to the address space of one peer process on this node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerMemory {
    pid: libc::pid_t,
}

impl PeerMemory {
    /// Access to process `pid`, or `None` when the pid is unknown (0) or names no process visible
    /// from here (another pid namespace).
    pub fn new(pid: u32) -> Option<PeerMemory> {
        let pid = libc::pid_t::try_from(pid).ok().filter(|&p| p > 0)?;
        // SAFETY: signal 0 only checks that the process exists (EPERM: it exists, not ours).
        let r = unsafe { libc::kill(pid, 0) };
        let exists = r == 0 || io::Error::last_os_error().raw_os_error() == Some(libc::EPERM);
        exists.then_some(PeerMemory { pid })
    }

    /// The peer's process id.
    pub fn pid(&self) -> u32 {
        self.pid as u32
    }

    /// Copies `dst.len()` bytes starting at address `addr` of the peer into `dst`.
    pub fn read(&self, addr: u64, dst: &mut [u8]) -> io::Result<()> {
        let mut done = 0;
        while done < dst.len() {
            let rest = &mut dst[done..];
            let local = libc::iovec {
                iov_base: rest.as_mut_ptr() as *mut libc::c_void,
                iov_len: rest.len(),
            };
            let remote = libc::iovec {
                iov_base: (addr + done as u64) as *mut libc::c_void,
                iov_len: rest.len(),
            };
            // SAFETY: `local` describes `rest`, a live exclusive slice, so the kernel writes only into
            // memory we own; the remote side is checked by the kernel against the peer's mappings.
            let n = unsafe { libc::process_vm_readv(self.pid, &local, 1, &remote, 1, 0) };
            match n {
                n if n > 0 => done += n as usize,
                0 => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "peer memory read made no progress",
                    ))
                }
                _ => {
                    let e = io::Error::last_os_error();
                    if e.kind() != io::ErrorKind::Interrupted {
                        return Err(e);
                    }
                }
            }
        }
        Ok(())
    }
}

/// Lets any process of this user read this one's memory (`prctl(PR_SET_PTRACER, ANY)`), which
/// Yama's `ptrace_scope = 1` otherwise forbids to non-ancestors. Done once per process; a kernel
/// without Yama rejects the call (`EINVAL`), which is fine: then ordinary permission checks apply.
/// Returns the error of a call that failed otherwise, so the caller can say why reads may not work.
pub fn allow_peer_reads() -> Result<(), String> {
    static DONE: OnceLock<Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| {
        // SAFETY: PR_SET_PTRACER takes one integer argument and touches no memory of ours.
        let r = unsafe { libc::prctl(libc::PR_SET_PTRACER, libc::PR_SET_PTRACER_ANY, 0, 0, 0) };
        let e = io::Error::last_os_error();
        if r == 0 || e.raw_os_error() == Some(libc::EINVAL) {
            Ok(())
        } else {
            Err(format!("prctl(PR_SET_PTRACER): {e}"))
        }
    })
    .clone()
}

/// How fast this process moves bytes between two buffers, bytes per second, both ways a
/// collective can.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CopyRates {
    /// One copy through the kernel: `process_vm_readv` of this process's own memory (the same
    /// path as reading a peer).
    pub kernel: f64,
    /// Two user-space copies through a FIFO slot: into a slot of the shared-memory transport's
    /// default size, then out of it, slot by slot.
    pub fifo: f64,
}

impl CopyRates {
    /// True when a single kernel copy moves bytes at least as fast as the FIFO's two copies.
    pub fn kernel_pays(&self) -> bool {
        self.kernel >= self.fifo
    }
}

/// Bytes moved per measurement: larger than a core's private caches, as a collective's buffers
/// are, small enough to take a few milliseconds.
const RATE_BYTES: usize = 8 << 20;

/// Measures [`CopyRates`] once per process (best of four, the first of which faults the pages
/// in; about 20 ms). `Err` if the kernel copy fails.
pub fn copy_rates() -> Result<CopyRates, String> {
    static RATES: OnceLock<Result<CopyRates, String>> = OnceLock::new();
    RATES.get_or_init(measure_rates).clone()
}

fn measure_rates() -> Result<CopyRates, String> {
    let src = vec![0x5au8; RATE_BYTES];
    let mut dst = vec![0u8; RATE_BYTES];
    let mut slot = vec![0u8; DEFAULT_SHM_CHUNK];
    let me = PeerMemory::new(std::process::id()).ok_or("this process is not visible to itself")?;
    let mut best = |copy: &mut dyn FnMut(&mut [u8]) -> io::Result<()>| {
        let mut fastest = f64::INFINITY;
        for _ in 0..4 {
            let t = Instant::now();
            copy(&mut dst)?;
            fastest = fastest.min(t.elapsed().as_secs_f64());
        }
        Ok::<f64, io::Error>(RATE_BYTES as f64 / fastest.max(1e-9))
    };
    let kernel = best(&mut |d| me.read(src.as_ptr() as u64, d))
        .map_err(|e| format!("process_vm_readv of this process: {e}"))?;
    let fifo = best(&mut |d| {
        for (out, inp) in d.chunks_mut(slot.len()).zip(src.chunks(slot.len())) {
            slot[..inp.len()].copy_from_slice(std::hint::black_box(inp));
            out.copy_from_slice(std::hint::black_box(&slot[..inp.len()]));
        }
        Ok(())
    })
    .expect("user-space copies cannot fail");
    Ok(CopyRates { kernel, fifo })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_own_memory_exactly() {
        let me = PeerMemory::new(std::process::id()).expect("this process exists");
        let src: Vec<u8> = (0..100_000u32).map(|i| (i * 31 % 251) as u8).collect();
        let mut dst = vec![0u8; 70_001];
        me.read(src.as_ptr() as u64 + 17, &mut dst).expect("read");
        assert_eq!(dst, src[17..17 + 70_001]);
        me.read(src.as_ptr() as u64, &mut []).expect("empty read");
    }

    #[test]
    fn bad_address_and_unknown_pids_fail() {
        let me = PeerMemory::new(std::process::id()).expect("this process exists");
        let mut dst = [0u8; 8];
        let err = me.read(8, &mut dst).expect_err("address 8 is never mapped");
        assert_eq!(err.raw_os_error(), Some(libc::EFAULT));
        assert!(PeerMemory::new(0).is_none());
        assert!(PeerMemory::new(u32::MAX).is_none());
    }

    #[test]
    fn copy_rates_are_measured_once_and_positive() {
        let r = copy_rates().expect("reading this process works");
        assert!(
            r.kernel > 0.0 && r.fifo > 0.0 && r.kernel.is_finite() && r.fifo.is_finite(),
            "{r:?}"
        );
        assert_eq!(copy_rates(), Ok(r), "one measurement per process");
    }

    #[test]
    fn allowing_reads_is_idempotent() {
        assert_eq!(allow_peer_reads(), allow_peer_reads());
    }
}
