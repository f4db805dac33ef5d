//! A thread that runs one collective per job with state of its own (a communicator no other
//! thread uses; for device memory also a device lane and its collective state), so that
//! data-parallel communication overlaps the compute thread (gradient buckets on host or device
//! memory).
//!
//! Invariants: jobs run in the order they were sent (every rank sends the same jobs in the same
//! order, so the thread's collectives match across the group); the first failed collective is
//! returned and stops the thread; dropping the worker closes the job channel and joins it.

use std::sync::mpsc::{channel, Receiver, Sender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// A finished job: its tag, its payload after the collective, and the collective's time.
pub type Finished<J> = (usize, J, Duration);

/// The worker thread and its two channels; `J` is a job's payload.
pub struct CommWorker<J> {
    jobs: Option<Sender<(usize, J)>>,
    done: Receiver<Result<Finished<J>>>,
    thread: Option<JoinHandle<()>>,
    what: &'static str,
}

impl<J: Send + 'static> CommWorker<J> {
    /// Starts thread `name`, which owns `state` and applies `op(state, payload)` to every job;
    /// `what` names the worker in errors.
    pub fn spawn<S: Send + 'static>(
        name: &str,
        what: &'static str,
        mut state: S,
        mut op: impl FnMut(&mut S, &mut J) -> Result<()> + Send + 'static,
    ) -> Self {
        let (jobs_tx, jobs_rx) = channel::<(usize, J)>();
        let (done_tx, done_rx) = channel::<Result<Finished<J>>>();
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                for (tag, mut data) in jobs_rx {
                    let t0 = Instant::now();
                    let out = op(&mut state, &mut data).map(|()| (tag, data, t0.elapsed()));
                    let failed = out.is_err();
                    if done_tx.send(out).is_err() || failed {
                        return;
                    }
                }
            })
            .unwrap_or_else(|e| panic!("spawning the {what} thread: {e}"));
        CommWorker { jobs: Some(jobs_tx), done: done_rx, thread: Some(thread), what }
    }

    /// Queues `data` under `tag`; fails if the thread stopped (on an error `recv` reports).
    pub fn send(&self, tag: usize, data: J) -> Result<()> {
        let tx = self.jobs.as_ref().expect("the job channel lives as long as the worker");
        tx.send((tag, data)).map_err(|_| Error::Check(format!("{} thread stopped", self.what)))
    }

    /// Waits for the next finished job (in sending order), or the thread's error.
    pub fn recv(&self) -> Result<Finished<J>> {
        self.done.recv().map_err(|_| Error::Check(format!("{} thread stopped unexpectedly", self.what)))?
    }
}

impl<J> Drop for CommWorker<J> {
    fn drop(&mut self) {
        self.jobs = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
