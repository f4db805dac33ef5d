//! The flight record: the last [`KEEP`] communication operations of this process, for blame.
//!
//! Why: when a job fails, the rank that notices (a neighbour timing out, a link closing) is
//! rarely the rank that failed. Every operation records (communicator, sequence number, operation,
//! bytes, start, end, outcome); on the first error the record is written to the log, and the
//! bootstrap's liveness check asks every rank what it is doing now ([`in_progress`]) so that
//! rank 0 can name the rank that is dead, stopped or behind.
//!
//! Invariants: one record per process (every communicator and thread writes to it), bounded in
//! size; writing an entry is a short mutex section, no allocation beyond the ring's fixed capacity.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

/// Operations kept.
pub const KEEP: usize = 64;

#[derive(Debug, Clone)]
struct Entry {
    comm: u64,
    seq: u64,
    op: &'static str,
    bytes: usize,
    start: Instant,
    end: Option<Instant>,
    failed: Option<String>,
}

struct Record {
    entries: VecDeque<Entry>,
    /// Number of entries ever written; an entry's ticket is its number.
    written: u64,
}

static RECORD: Mutex<Record> = Mutex::new(Record { entries: VecDeque::new(), written: 0 });
static DUMPED: AtomicBool = AtomicBool::new(false);

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

fn record() -> std::sync::MutexGuard<'static, Record> {
    RECORD.lock().unwrap_or_else(|e| e.into_inner())
}

/// Notes the start (at `start`, the caller's clock reading) of operation `seq` of communicator
/// `comm`; returns its ticket for [`end`].
pub fn begin(comm: u64, seq: u64, op: &'static str, bytes: usize, start: Instant) -> u64 {
    epoch();
    let mut r = record();
    if r.entries.len() == KEEP {
        r.entries.pop_front();
    }
    r.entries.push_back(Entry { comm, seq, op, bytes, start, end: None, failed: None });
    r.written += 1;
    r.written
}

/// Notes the end (at `at`) of the operation with `ticket` (`failed`: the error).
pub fn end(ticket: u64, failed: Option<String>, at: Instant) {
    let mut r = record();
    let oldest = r.written - r.entries.len() as u64 + 1;
    if ticket >= oldest {
        let e = &mut r.entries[(ticket - oldest) as usize];
        e.end = Some(at);
        e.failed = failed;
    }
}

fn describe(e: &Entry, now: Instant) -> String {
    let t = |i: Instant| i.saturating_duration_since(epoch()).as_secs_f64();
    let state = match (&e.end, &e.failed) {
        (None, _) => format!("in progress for {:.3} s", now.saturating_duration_since(e.start).as_secs_f64()),
        (Some(end), None) => format!("done at {:.3} s", t(*end)),
        (Some(end), Some(why)) => format!("FAILED at {:.3} s: {why}", t(*end)),
    };
    format!("comm {:#x} {} #{} ({} bytes) started at {:.3} s, {state}", e.comm, e.op, e.seq, e.bytes, t(e.start))
}

/// The operations of this process not finished yet (empty: it is not communicating).
pub fn in_progress() -> Vec<String> {
    let now = Instant::now();
    record().entries.iter().filter(|e| e.end.is_none()).map(|e| describe(e, now)).collect()
}

/// The last finished operation, if any.
pub fn last_done() -> Option<String> {
    let now = Instant::now();
    record().entries.iter().rev().find(|e| e.end.is_some()).map(|e| describe(e, now))
}

/// Writes the record to the log once per process (at the first error), prefixed by `rank`.
pub fn dump_once(rank: usize) {
    if DUMPED.swap(true, Ordering::AcqRel) {
        return;
    }
    let now = Instant::now();
    let lines: Vec<String> = record().entries.iter().map(|e| describe(e, now)).collect();
    let mut text = format!("rank {rank}: flight record (last {} operations, oldest first):", lines.len());
    for l in lines {
        text.push_str("\n  ");
        text.push_str(&l);
    }
    log::error!("{text}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_keeps_the_last_operations_and_what_is_in_progress() {
        // The record is process-wide: use a communicator id no other test uses.
        let comm = 0xf117_0000;
        let mut tickets = Vec::new();
        for seq in 0..(KEEP as u64 + 5) {
            tickets.push(begin(comm, seq, "all_reduce", 4096, Instant::now()));
        }
        for &t in &tickets[..tickets.len() - 1] {
            end(t, None, Instant::now());
        }
        let open = in_progress();
        let last = format!("comm {comm:#x} all_reduce #{} ", KEEP + 4);
        assert!(open.iter().any(|l| l.starts_with(&last) && l.contains("in progress")), "{open:?}");
        end(*tickets.last().unwrap(), Some("peer rank 3 closed".into()), Instant::now());
        assert!(record().entries.len() <= KEEP);
        assert!(!in_progress().iter().any(|l| l.starts_with(&last)));
    }
}
