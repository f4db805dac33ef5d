//! The tuner's side of a communicator: which schedule family and chunk a call gets
//! ([`crate::comm::tuner::choose`] over this communicator's span), the table in use, and the
//! single-copy probe that a read schedule waits for.
//!
//! Invariant: every input of the choice (call, bytes, size, link kind, node layout, table,
//! configuration) is the same on every member, so every member picks the same schedule; the probe
//! runs on every member at the same call and its answer is agreed.

use std::sync::Arc;

use super::{Call, Communicator, LinkTable, Sched, State};
use crate::comm::probe::{self, Reads};
use crate::comm::tuner::{self, Family, LinkKind, Span, Tuning};
use crate::comm::tuning::{Algo, Cma};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::transport::{cma, Waiter};

impl Communicator {
    /// The schedule family and chunk a call wants, from (call, bytes, size, link kind, node
    /// layout, table, configuration) only ([`tuner::choose`]); `run` may still fall back from
    /// `Read` to `Ring` when the probe fails.
    pub(super) fn schedule(&self, call: &Call, bytes: usize) -> (Sched, usize) {
        let c = self.planned_schedule(call.name(), bytes);
        let sched = match c.family {
            Family::Ring => Sched::Ring,
            Family::Direct => Sched::Direct,
            Family::Read => Sched::Read,
            Family::Hier => Sched::Hier,
            Family::Split => Sched::Split,
        };
        (sched, c.chunk_bytes)
    }

    /// The (schedule, chunk) of a split all-reduce's reduce-scatter and all-gather of `bytes`
    /// bytes: what the tuner picks for each collective at that size, run flat (a `hier` half, or
    /// any other the communicator cannot nest, is the ring).
    pub(super) fn split_halves(&self, bytes: usize) -> [(Sched, usize); 2] {
        ["reduce_scatter", "all_gather"].map(|coll| {
            let c = self.planned_schedule(coll, bytes);
            let sched = match c.family {
                Family::Direct => Sched::Direct,
                Family::Read => Sched::Read,
                Family::Ring | Family::Hier | Family::Split => Sched::Ring,
            };
            (sched, c.chunk_bytes)
        })
    }

    /// Whether this communicator can run the hierarchical schedules (members on several nodes,
    /// some node with >= 2 of them, `MESHTRAIN_HIER` not off).
    pub fn hierarchical(&self) -> bool {
        self.span().hier
    }

    /// What the tuner knows of this communicator.
    pub(super) fn span(&self) -> Span {
        // One node never stages; asked first, it spares a per-call explanation string.
        let hier = self.cfg.hier && self.nodes.nodes() > 1 && self.nodes.staged().is_ok();
        Span { ranks: self.size(), link: self.link_kind, hier }
    }

    /// Replaces the schedule table (`None`: the fixed rule). Every member must make the same
    /// call between the same collectives (`bench --tune` forces one candidate at a time).
    pub fn set_tuning(&self, table: Option<Arc<Tuning>>) {
        *self.tuning.write().unwrap_or_else(|e| e.into_inner()) = table;
    }

    /// The schedule table in use (`None`: the fixed rule).
    pub fn tuning(&self) -> Option<Arc<Tuning>> {
        self.tuning.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The schedule family (`ring`, `direct`, `read`, `hier`) and chunk bytes the table or configuration
    /// picks for `coll` with `bytes` bytes on this communicator (before the read probe).
    pub fn planned_schedule(&self, coll: &str, bytes: usize) -> tuner::Choice {
        // Read in place (no clone of the table's handle): this runs on every call.
        let table = self.tuning.read().unwrap_or_else(|e| e.into_inner());
        tuner::choose(&self.cfg, table.as_deref(), coll, self.span(), bytes)
    }

    /// Whether this call reads peers' buffers, probing on first use. Every member gets here on
    /// the same call (the schedule choice is the same everywhere), so they probe together and
    /// agree on the answer.
    pub(super) fn reads_work(&self, st: &mut State, w: &Waiter) -> Result<bool> {
        if st.reads.is_none() {
            if let Err(why) = cma::allow_peer_reads() {
                // Peers' reads of this rank may fail now; the probe finds out and says so.
                log::debug!("rank {}: {why}", self.rank);
            }
            let found =
                probe::probe(&mut LinkTable(&mut st.links), &self.direct_shape(DType::U8, self.cfg.chunk_bytes), w)?;
            self.log_probe(&found);
            st.reads = Some(found);
        }
        match (st.reads.as_ref().expect("probed above"), self.cfg.cma) {
            (Reads::Fail(why), Cma::On) => Err(Error::config(
                "MESHTRAIN_CMA",
                format!("single-copy reads forced on, but they do not work on comm {:#x}: {why}", self.id),
            )),
            (Reads::Fail(_), _) => Ok(false),
            (Reads::Pay, _) | (Reads::Slow(_), Cma::On) => Ok(true),
            // A measured table chose reads for this size: the copy-rate probe does not overrule it.
            (Reads::Slow(_), _) => Ok(self.tuning().is_some()),
        }
    }

    /// Logs the probe's outcome once per process (on member 0 of the first communicator that probed).
    fn log_probe(&self, found: &Reads) {
        static LOGGED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        if self.rank != 0 || LOGGED.swap(true, std::sync::atomic::Ordering::Relaxed) {
            return;
        }
        let id = self.id;
        match found {
            // Forced reads are always said at info, whatever the probe found (a user who forced
            // them looks for the line).
            Reads::Pay if self.cfg.cma == Cma::On => {
                log::info!("comm {id:#x}: single-copy reads (CMA) work and pay; MESHTRAIN_CMA=on: collectives use them")
            }
            Reads::Pay => log::debug!("comm {id:#x}: single-copy reads (CMA) work and pay; large collectives use them"),
            Reads::Slow(why) if self.cfg.cma == Cma::On => log::info!(
                "comm {id:#x}: single-copy reads (CMA) work but measured slower than copies; MESHTRAIN_CMA=on: \
                 collectives use them anyway: {why}"
            ),
            Reads::Slow(why) => log::debug!(
                "comm {id:#x}: single-copy reads (CMA) work but do not pay, collectives copy through shared \
                 memory (MESHTRAIN_CMA=on forces reads): {why}"
            ),
            Reads::Fail(why) => log::debug!(
                "comm {id:#x}: single-copy reads (CMA) unavailable, collectives copy through shared memory: {why}"
            ),
        }
    }
}

impl Communicator {
    /// Logs, once per communicator (member 0), the schedules its calls get: the table's buckets
    /// and, across nodes, whether the hierarchical schedules run (or why not).
    pub(super) fn log_schedules(&self) {
        let (k, id, link) = (self.size(), self.id, self.link_kind);
        if self.rank != 0 || k < 2 {
            return;
        }
        if let Some(t) = &self.cfg.tuning {
            log::debug!(
                "comm {id:#x} ({k} ranks, {}): schedules from {}: {}",
                link.name(),
                t.source,
                t.describe(k, link).join("; ")
            );
        }
        if self.cfg.algo == Algo::Split && self.cfg.cma != Cma::On {
            let halves = match &self.cfg.tuning {
                Some(t) => t.split_halves(k, link, 0, None),
                None => "reduce_scatter and all_gather by the fixed rule".to_string(),
            };
            log::debug!("comm {id:#x} ({k} ranks): all_reduce split (MESHTRAIN_ALGO=split): {halves}");
        }
        if link == LinkKind::Net {
            let per: Vec<String> = self.nodes.members.iter().map(|m| m.len().to_string()).collect();
            match (self.cfg.hier, self.nodes.staged()) {
                (true, Ok(n)) => log::info!(
                    "comm {id:#x} ({k} ranks): hierarchical host collectives over {n} nodes ({} ranks) \
                     (all-reduce, reduce-scatter, all-gather, broadcast, reduce: within each node, then one \
                     ring per segment between nodes)",
                    per.join("+")
                ),
                (false, _) => {
                    log::debug!("comm {id:#x} ({k} ranks): flat host collectives across nodes (MESHTRAIN_HIER=off)")
                }
                // One member per node (as the stage communicators between nodes have): nothing to
                // stage, nothing worth a line.
                (true, Err(why)) if self.nodes.members.iter().all(|m| m.len() == 1) => {
                    log::debug!("comm {id:#x} ({k} ranks): flat host collectives across nodes: {why}")
                }
                (true, Err(why)) => log::info!("comm {id:#x} ({k} ranks): flat host collectives across nodes: {why}"),
            }
        }
    }
}
