//! Creating a communicator, and making a member's failure the job's.
//!
//! Why apart: creation (ring order, links to the ring neighbours, the schedule log) and the
//! failure path (blame a peer through rank 0's liveness check, or raise the job-wide abort) are
//! what every call relies on but none runs in its body.
//!
//! Invariants: the ring is a permutation of the members ordered by (node, world rank); creation
//! opens only the ring links, in the global pair order, and a failure to open them raises the
//! job-wide abort so that peers waiting for them are released at once, not at the timeout.

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, OnceLock};

use super::{Communicator, State};
use crate::comm::fingerprint;
use crate::comm::nodes::NodeMap;
use crate::comm::stats::CommStats;
use crate::comm::tuner::LinkKind;
use crate::comm::tuning::CommConfig;
use crate::error::{Error, Result};
use crate::transport::{Connector, Waiter};

impl Communicator {
    /// The communicator of all ranks the connector knows (id 0). Every rank must call it.
    pub fn world(connector: Arc<dyn Connector>, cfg: CommConfig) -> Result<Self> {
        let members: Vec<usize> = (0..connector.size()).collect();
        let rank = connector.rank();
        Self::new(connector, 0, members, rank, cfg)
    }

    pub(super) fn new(connector: Arc<dyn Connector>, id: u64, members: Vec<usize>, rank: usize, cfg: CommConfig) -> Result<Self> {
        Self::with_counter(connector, (id, members, rank), cfg, Arc::default())
    }

    /// A communicator whose inter-node bytes add to `net_sent`.
    pub(super) fn with_counter(
        connector: Arc<dyn Connector>,
        (id, members, rank): (u64, Vec<usize>, usize),
        cfg: CommConfig,
        net_sent: Arc<AtomicU64>,
    ) -> Result<Self> {
        let k = members.len();
        let mut ring: Vec<usize> = (0..k).collect();
        ring.sort_by_key(|&r| (connector.node_of(members[r]), members[r]));
        let mut seen = vec![false; k];
        for &r in &ring {
            assert!(r < k && !std::mem::replace(&mut seen[r], true), "ring is a permutation of the members");
        }
        let ring_pos = ring.iter().position(|&r| r == rank).expect("every member is on the ring");
        if rank == 0 {
            let text: Vec<String> = ring.iter().map(|r| r.to_string()).collect();
            log::debug!("comm {id:#x} ({k} ranks) ring 0: {}", text.join(" "));
        }
        let links = (0..k).map(|_| None).collect();
        let scratch = vec![0u8; cfg.chunk_bytes];
        let nodes = NodeMap::new(&members.iter().map(|&m| connector.node_of(m)).collect::<Vec<_>>());
        let link_kind = if nodes.nodes() == 1 { LinkKind::Shm } else { LinkKind::Net };
        let comm = Communicator {
            connector,
            id,
            rank,
            members,
            ring,
            ring_pos,
            tuning: std::sync::RwLock::new(cfg.tuning.clone()),
            cfg,
            link_kind,
            nodes,
            hier: OnceLock::new(),
            state: Mutex::new(State {
                links,
                seq: 0,
                collectives: 0,
                sends: vec![0; k],
                recvs: vec![0; k],
                print: None,
                splits: 0,
                scratch,
                reads: None,
            }),
            stats: CommStats::new(k),
            net_sent,
        };
        comm.log_schedules();
        if k > 1 {
            let (prev, next) = comm.ring_neighbours();
            let w = comm.waiter("connect", 0, 0);
            let opened = comm.open_links(&mut comm.lock(), &[prev, next], &w);
            // The peers wait for the links this member will no longer open, and a link it did
            // open may wait in its drop for the peer: the job-wide abort releases them all now
            // rather than after the timeout (as a failed call's does).
            opened.map_err(|e| comm.job_failure(e, &w))?;
        }
        Ok(comm)
    }

    /// Makes this rank's failure the job's: one involving a peer goes to [`Self::blame`] (so an
    /// abort already under way is reported as such); any other, but an abort, raises the
    /// job-wide abort itself.
    pub(super) fn job_failure(&self, e: Error, w: &Waiter) -> Error {
        match e {
            Error::Timeout { .. } | Error::Comm { .. } if !fingerprint::is_mismatch(&e) => self.blame(e, w),
            Error::Aborted { .. } => e,
            e => {
                self.connector.abort().raise(&e.to_string());
                e
            }
        }
    }

    /// A failure that involves a peer: asks the job (rank 0's liveness check) which rank actually
    /// failed before blaming the neighbour that noticed; the job's verdict becomes this rank's
    /// error, or, without one, this rank's own finding is raised job-wide.
    fn blame(&self, e: Error, w: &Waiter) -> Error {
        let abort = self.connector.abort();
        match abort.blame(&e.to_string()) {
            Some(verdict) => Error::Aborted { rank: w.rank, op: w.op, seq: w.seq, reason: verdict },
            None => {
                abort.raise(&e.to_string());
                e
            }
        }
    }
}
