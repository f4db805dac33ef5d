//! One direction of the worker <-> server links as one thread sees it: messages to or from a
//! peer named by its index among the servers (a worker's side) or among the workers (a
//! server's side), whether the servers are ranks of their own or threads inside the workers'
//! processes (`ps.colocate`).
//!
//! Why a type of its own: a communicator serves one thread per process (the invariant of the
//! `ps` links), and a colocated process runs both ends of every direction (its worker's push
//! thread sends where its server thread receives), and a communicator cannot send to its own
//! rank. So colocated, each server `s` has a communicator per direction that only it receives
//! (or sends) on in its process and only the workers' threads use in the others, and the
//! messages between a worker and the server of its own process go through an in-process
//! channel.
//!
//! Invariants: every message is received into a buffer of the length the sender sent (checked:
//! a local message of another length is an error, as the transports' are); a local peer that
//! has ended (its thread returned or failed) is an error naming this process's rank, never a wait.

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;

use crate::comm::stats::CommStats;
use crate::comm::{Communicator, Element};
use crate::error::{Error, Result};

/// The in-process end of a colocated link.
pub enum Local {
    Send(Sender<Vec<u8>>),
    Recv(Receiver<Vec<u8>>),
}

/// One thread's end of one direction of the links.
pub enum Link {
    /// Servers are ranks of their own: peer `i` is rank `base + i` of `comm`.
    Ranks { comm: Box<Communicator>, base: usize },
    /// Colocated: peer `i` is rank `i` of `comms[via[i]]`, or this process (`via[i]` None).
    Colocated {
        comms: Vec<Communicator>,
        via: Vec<Option<usize>>,
        local: Local,
        /// This process's rank (for errors).
        me: usize,
    },
}

/// A colocated direction's two in-process ends: (sending side's, receiving side's).
pub fn local_pair() -> (LocalEnd, LocalEnd) {
    let (tx, rx) = channel();
    (LocalEnd(Local::Send(tx)), LocalEnd(Local::Recv(rx)))
}

/// An in-process end made by [`local_pair`], for [`Link::colocated`].
pub struct LocalEnd(Local);

impl Link {
    /// A colocated link of process `me`: peer `i`'s messages go over `comms[via[i]]` (as its
    /// rank `i`), or through `local` where `via[i]` is None (see [`Link::Colocated`]).
    pub fn colocated(
        comms: Vec<Communicator>,
        via: Vec<Option<usize>>,
        local: LocalEnd,
        me: usize,
    ) -> Self {
        Link::Colocated {
            comms,
            via,
            local: local.0,
            me,
        }
    }

    /// Sends `buf` to peer `peer`.
    pub fn send<T: Element>(&self, buf: &[T], peer: usize) -> Result<()> {
        match self {
            Link::Ranks { comm, base } => comm.send(buf, base + peer),
            Link::Colocated { comms, via, local, me } => match via.get(peer) {
                Some(Some(k)) => comms[*k].send(buf, peer),
                Some(None) => match local {
                    Local::Send(tx) => tx
                        .send(bytemuck::cast_slice(buf).to_vec())
                        .map_err(|_| Error::Check(format!("rank {me}: the colocated parameter server or worker of this process has ended"))),
                    Local::Recv(_) => Err(Error::Check(format!("rank {me}: a colocated link's receiving end was asked to send"))),
                },
                None => Err(Error::Check(format!("rank {me}: parameter-server link peer {peer} out of range"))),
            },
        }
    }

    /// Receives peer `peer`'s next message into `buf` (of the length sent).
    pub fn recv_into<T: Element>(&self, buf: &mut [T], peer: usize) -> Result<()> {
        match self {
            Link::Ranks { comm, base } => comm.recv_into(buf, base + peer),
            Link::Colocated {
                comms,
                via,
                local,
                me,
            } => match via.get(peer) {
                Some(Some(k)) => comms[*k].recv_into(buf, peer),
                Some(None) => match local {
                    Local::Recv(rx) => {
                        let bytes = rx.recv().map_err(|_| {
                            Error::Check(format!("rank {me}: the colocated parameter server or worker of this process has ended"))
                        })?;
                        let dst: &mut [u8] = bytemuck::cast_slice_mut(buf);
                        if bytes.len() != dst.len() {
                            return Err(Error::Check(format!(
                                "rank {me}: a colocated parameter-server message of {} bytes where {} were expected",
                                bytes.len(),
                                dst.len()
                            )));
                        }
                        dst.copy_from_slice(&bytes);
                        Ok(())
                    }
                    Local::Send(_) => Err(Error::Check(format!(
                        "rank {me}: a colocated link's sending end was asked to receive"
                    ))),
                },
                None => Err(Error::Check(format!(
                    "rank {me}: parameter-server link peer {peer} out of range"
                ))),
            },
        }
    }

    /// Traffic counters (colocated: of the first communicator; the in-process messages move no
    /// bytes over a transport).
    pub fn stats(&self) -> Arc<CommStats> {
        match self {
            Link::Ranks { comm, .. } => comm.stats(),
            Link::Colocated { comms, .. } => comms.first().map(|c| c.stats()).unwrap_or_default(),
        }
    }
}
