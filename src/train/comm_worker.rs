//! A thread that runs one collective per job on a communicator of its own, so that data-parallel
//! communication overlaps the compute thread (gradient buckets, ZeRO-3 parameter gathers).
//!
//! Invariants: jobs run in the order they were sent (every rank sends the same jobs in the same
//! order, so the thread's collectives match across the group); the first failed collective is
//! returned and stops the thread; dropping the worker closes the job channel and joins it.

use std::sync::mpsc::{channel, Receiver, Sender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::comm::Communicator;
use crate::error::{Error, Result};

/// A finished job: its tag, its buffer after the collective, and the collective's time.
pub type Finished = (usize, Vec<f32>, Duration);

/// The worker thread and its two channels.
pub struct CommWorker {
    jobs: Option<Sender<(usize, Vec<f32>)>>,
    done: Receiver<Result<Finished>>,
    thread: Option<JoinHandle<()>>,
    what: &'static str,
}

impl CommWorker {
    /// Starts thread `name` that applies `op` on `comm` to every job's buffer; `what` names the
    /// worker in errors.
    pub fn spawn(
        name: &str,
        what: &'static str,
        comm: Communicator,
        op: impl Fn(&Communicator, &mut [f32]) -> Result<()> + Send + 'static,
    ) -> Self {
        let (jobs_tx, jobs_rx) = channel::<(usize, Vec<f32>)>();
        let (done_tx, done_rx) = channel::<Result<Finished>>();
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                for (tag, mut data) in jobs_rx {
                    let t0 = Instant::now();
                    let out = op(&comm, &mut data).map(|()| (tag, data, t0.elapsed()));
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
    pub fn send(&self, tag: usize, data: Vec<f32>) -> Result<()> {
        let tx = self.jobs.as_ref().expect("the job channel lives as long as the worker");
        tx.send((tag, data)).map_err(|_| Error::Check(format!("{} thread stopped", self.what)))
    }

    /// Waits for the next finished job (in sending order), or the thread's error.
    pub fn recv(&self) -> Result<Finished> {
        self.done.recv().map_err(|_| Error::Check(format!("{} thread stopped unexpectedly", self.what)))?
    }
}

impl Drop for CommWorker {
    fn drop(&mut self) {
        self.jobs = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
