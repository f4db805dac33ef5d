//! The communicator's side of the device-direct paths (libfabric links whose ends offer
//! FI_HMEM): their link objects, and calls whose bytes the caller moves itself but which are
//! numbered, timed, recorded and failing like the host operations they stand for.

use std::sync::Arc;

use super::{Communicator, Print, Sched};
use crate::dtype::DType;
use crate::comm::fingerprint::{OpKind, OpPrint};
use crate::error::Result;
use crate::transport::Waiter;

impl Communicator {
    /// The device-direct side of the link to member `peer` (opening the link if needed); `None`
    /// for links other than libfabric ones.
    pub(crate) fn direct_peer(&self, peer: usize) -> Result<Option<Arc<crate::transport::DirectPeer>>> {
        self.check_peer("device-direct", peer)?;
        let mut st = self.lock();
        let w = self.waiter("connect", st.seq, 0);
        self.open_links(&mut st, &[peer], &w)?;
        Ok(st.links[peer].as_ref().and_then(|l| l.link.send.direct()))
    }

    /// A point-to-point call (`send`, else receive) of `count` `dtype` elements with member `peer`
    /// whose bytes `f` moves itself (the device-direct path): numbered, timed, recorded and
    /// failing like [`Communicator::send`] and [`Communicator::recv_into`].
    pub(crate) fn run_direct(&self, send: bool, peer: usize, count: usize, dtype: DType, f: impl FnOnce(&Waiter) -> Result<()>) -> Result<()> {
        let p = OpPrint { kind: OpKind::SendRecv, dtype, reduce: None, root: None, count: count as u64, seq: 0 };
        let (op, print) = if send { ("send", Print::Send(p, peer)) } else { ("recv", Print::Recv(p, peer)) };
        self.run(op, count * dtype.size(), Sched::Pair, print, |_, _, w| f(w))
    }

    /// A collective whose bytes `f` moves itself over direct links (the device FI_HMEM rings),
    /// numbered, timed, recorded and failing like the host collective `print` describes; `f` gets
    /// the call's numbered print to check against the peers'.
    pub(crate) fn run_direct_collective(&self, op: &'static str, print: OpPrint, bytes: usize, f: impl FnOnce(&Waiter, &OpPrint) -> Result<()>) -> Result<()> {
        self.run(op, bytes, Sched::Pair, Print::Collective(print), |st, _, w| f(w, &st.print.unwrap_or(print)))
    }
}
