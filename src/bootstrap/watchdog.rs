//! The start-up deadline: a thread, started before `MPI_Init`, that ends this process with a
//! message naming the phase when start-up takes longer than `MESHTRAIN_BOOTSTRAP_TIMEOUT`.
//!
//! Why a thread: the deadlines of the control channel cannot cover MPI itself. A rank that died
//! before `MPI_Init` under a launcher that does not end the job (srun without
//! `--kill-on-bad-exit`, mpirun told not to abort) used to leave the others inside `MPI_Init`
//! (or the unique-id broadcast) forever, printing nothing; no call can be interrupted there.
//!
//! Invariants: each phase has its own deadline, counted from its start; the phases after MPI
//! (the control channel) get the deadline plus a grace, so that their own, more precise errors
//! (naming the rank that stalled) come first; on expiry the message goes straight to stderr and
//! the process ends with `_exit` (nothing of MPI's may run: it is what hangs).

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Exit status of a start-up that ran past its deadline.
pub const EXIT_STARTUP_TIMEOUT: i32 = 3;

#[derive(Debug)]
struct Phase {
    name: &'static str,
    limit: Duration,
    since: Instant,
    rank: Option<usize>,
    done: bool,
}

/// The running watchdog; [`Watchdog::finish`] (or dropping it) stops it.
pub struct Watchdog {
    state: Arc<(Mutex<Phase>, Condvar)>,
}

impl Watchdog {
    /// Starts watching phase `name` of at most `limit`; `rank`: this process's rank if known.
    pub fn start(name: &'static str, limit: Duration, rank: Option<usize>) -> Watchdog {
        let phase = Phase { name, limit, since: Instant::now(), rank, done: false };
        let state = Arc::new((Mutex::new(phase), Condvar::new()));
        let watched = state.clone();
        let spawned = std::thread::Builder::new().name("startup-watchdog".into()).spawn(move || watch(&watched));
        if let Err(e) = spawned {
            log::warn!("start-up watchdog not started ({e}): start-up has no deadline over MPI");
        }
        Watchdog { state }
    }

    /// Enters phase `name` of at most `limit` (from now); `rank` once known.
    pub fn phase(&self, name: &'static str, limit: Duration, rank: Option<usize>) {
        let (m, cv) = &*self.state;
        let mut p = m.lock().unwrap_or_else(|e| e.into_inner());
        (p.name, p.limit, p.since) = (name, limit, Instant::now());
        p.rank = rank.or(p.rank);
        cv.notify_all();
    }

    /// Start-up is over: the thread ends.
    pub fn finish(self) {}
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        let (m, cv) = &*self.state;
        m.lock().unwrap_or_else(|e| e.into_inner()).done = true;
        cv.notify_all();
    }
}

fn watch(state: &(Mutex<Phase>, Condvar)) {
    let (m, cv) = state;
    let mut p = m.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        if p.done {
            return;
        }
        let elapsed = p.since.elapsed();
        if elapsed >= p.limit {
            expire(&p);
        }
        let left = p.limit - elapsed;
        p = cv.wait_timeout(p, left).unwrap_or_else(|e| e.into_inner()).0;
    }
}

/// The message of a phase past its deadline.
fn message(p: &Phase) -> String {
    let who = p.rank.map_or_else(|| "rank ?".to_string(), |r| format!("rank {r}"));
    format!(
        "meshtrain: error: {who}: start-up phase `{}` did not finish within {:.0} s (MESHTRAIN_BOOTSTRAP_TIMEOUT): another rank of the job probably died or never started; ending this rank\n",
        p.name,
        p.limit.as_secs_f64()
    )
}

fn expire(p: &Phase) -> ! {
    use std::io::Write as _;
    let _ = std::io::stderr().write_all(message(p).as_bytes());
    // SAFETY: _exit ends the process at once; MPI (which may hold this process) must not run
    // any handler, and nothing here is left to flush (stderr is unbuffered).
    unsafe { libc::_exit(EXIT_STARTUP_TIMEOUT) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_message_names_the_rank_the_phase_and_the_limit() {
        let p = Phase { name: "MPI_Init", limit: Duration::from_secs(10), since: Instant::now(), rank: None, done: false };
        let m = message(&p);
        assert!(m.contains("rank ?: start-up phase `MPI_Init` did not finish within 10 s"), "{m}");
        let p = Phase { rank: Some(3), ..p };
        assert!(message(&p).contains("rank 3:"));
    }

    #[test]
    fn a_finished_watchdog_never_fires() {
        let w = Watchdog::start("test", Duration::from_millis(50), Some(0));
        w.phase("test 2", Duration::from_millis(50), None);
        w.finish();
        std::thread::sleep(Duration::from_millis(150));
    }
}
