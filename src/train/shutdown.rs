//! Graceful stop on SIGTERM and SIGUSR1 (a batch system's time limit: Slurm sends SIGTERM at the
//! limit, and `sbatch --signal=USR1@120` sends SIGUSR1 two minutes before it).
//!
//! The handler only records the signal in an atomic (async-signal-safe); nothing else happens in
//! signal context. The training loop reads the flag at every step boundary and the ranks agree on
//! it with a max-reduction over the world, so a signal that reaches one rank (or each rank at a
//! slightly different time, as `scancel`/Slurm deliver it) stops every rank after the same step:
//! each finishes that step, writes a checkpoint of it and exits 0. Blocking calls interrupted by
//! the signal are restarted (`SA_RESTART`; the transports also retry on `EINTR`).

use std::sync::atomic::{AtomicI32, Ordering};

use crate::error::{Error, Result};

/// The last stop signal received (0: none).
static RECEIVED: AtomicI32 = AtomicI32::new(0);

/// The signals that request a graceful stop.
pub const STOP_SIGNALS: [libc::c_int; 2] = [libc::SIGTERM, libc::SIGUSR1];

extern "C" fn record(signal: libc::c_int) {
    RECEIVED.store(signal, Ordering::SeqCst);
}

/// Installs the recording handler for [`STOP_SIGNALS`] in this process.
pub fn install() -> Result<()> {
    for signal in STOP_SIGNALS {
        // SAFETY: `sigaction` with a zeroed struct (a valid, empty mask), a handler that only
        // stores into an atomic (async-signal-safe) and SA_RESTART; the pointers are valid for the
        // call and the previous action is not requested.
        let rc = unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = record as extern "C" fn(libc::c_int) as libc::sighandler_t;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(signal, &action, std::ptr::null_mut())
        };
        if rc != 0 {
            let e = std::io::Error::last_os_error();
            return Err(Error::InvalidArgument(format!("installing the handler of signal {signal}: {e}")));
        }
    }
    Ok(())
}

/// The stop signal this process received, if any.
pub fn requested() -> Option<libc::c_int> {
    match RECEIVED.load(Ordering::SeqCst) {
        0 => None,
        s => Some(s),
    }
}

/// The signal's name for log lines.
pub fn name(signal: libc::c_int) -> &'static str {
    match signal {
        libc::SIGTERM => "SIGTERM",
        libc::SIGUSR1 => "SIGUSR1",
        _ => "a stop signal",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stop_signal_is_recorded_not_fatal() {
        install().unwrap();
        // SAFETY: raising a signal whose handler was installed above.
        assert_eq!(unsafe { libc::raise(libc::SIGUSR1) }, 0);
        assert_eq!(requested(), Some(libc::SIGUSR1));
        assert_eq!(name(libc::SIGUSR1), "SIGUSR1");
        RECEIVED.store(0, Ordering::SeqCst);
    }
}
