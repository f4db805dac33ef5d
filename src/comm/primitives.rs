//! The message primitives every collective algorithm is written in.
//!
//! A [`Pipe`] is the pair (receive from one peer, send to another) a ring position or a direct
//! exchange step works with; the primitives are NCCL's: `send`, `recv`, `recv_reduce_send`,
//! `recv_reduce_copy_send`, `recv_copy_send`, `recv_reduce_copy`. Each moves exactly one message of
//! at most the operation's chunk size, reading the incoming slot and writing the outgoing slot in
//! place, so algorithms never see a transport and transports never see an algorithm.
//!
//! Invariants: both ends of a link compute the same message lengths from the same schedule, so an
//! empty message is skipped by both sides; a received length that differs from the expected one is
//! a protocol error naming the peer, never a silent truncation.

use crate::comm::dtype::Reducer;
use crate::error::Result;
use crate::transport::{RecvLink, SendLink, Waiter};

/// What a message's data is combined with: a separate input buffer, or the output buffer itself
/// (in-place operation).
#[derive(Clone, Copy)]
pub enum Input<'a> {
    /// Out-of-place: the caller's input range.
    Separate(&'a [u8]),
    /// In-place: the input is the output range.
    InPlace,
}

/// Sending half towards one peer.
pub struct Tx<'a> {
    link: &'a mut dyn SendLink,
    /// World rank of the peer (for errors).
    pub peer: usize,
}

/// Receiving half from one peer.
pub struct Rx<'a> {
    link: &'a mut dyn RecvLink,
    /// World rank of the peer (for errors).
    pub peer: usize,
}

impl<'a> Tx<'a> {
    /// Wraps a send link to world rank `peer`.
    pub fn new(link: &'a mut dyn SendLink, peer: usize) -> Self {
        Tx { link, peer }
    }

    /// Sends `src` as one message (nothing for an empty `src`).
    pub fn send(&mut self, src: &[u8], w: &Waiter) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        let slot = self.link.reserve(src.len(), w)?;
        slot[..src.len()].copy_from_slice(src);
        self.link.post(src.len(), w)
    }
}

impl<'a> Rx<'a> {
    /// Wraps a receive link from world rank `peer`.
    pub fn new(link: &'a mut dyn RecvLink, peer: usize) -> Self {
        Rx { link, peer }
    }

    /// Waits for the next message and checks that it is `len` bytes long.
    fn wait(&mut self, len: usize, w: &Waiter) -> Result<&[u8]> {
        let peer = self.peer;
        let msg = self.link.wait(w)?;
        if msg.len() != len {
            return Err(w.fail(peer, format!("protocol error: expected a {len}-byte message, got {}", msg.len())));
        }
        Ok(msg)
    }

    /// Receives one message into `dst`.
    pub fn recv(&mut self, dst: &mut [u8], w: &Waiter) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        dst.copy_from_slice(self.wait(dst.len(), w)?);
        self.link.release(w)
    }

    /// Receives one message and combines it into `acc` (`acc = acc op msg`).
    pub fn recv_reduce(&mut self, acc: &mut [u8], red: &Reducer, w: &Waiter) -> Result<()> {
        if acc.is_empty() {
            return Ok(());
        }
        red.reduce_into(acc, self.wait(acc.len(), w)?);
        self.link.release(w)
    }

    /// Receives one message, writes `msg op input` into `dst` (finalized over `ranks` contributions
    /// when `finalize` is given).
    pub fn recv_reduce_copy(
        &mut self,
        input: Input,
        dst: &mut [u8],
        red: &Reducer,
        finalize: Option<usize>,
        w: &Waiter,
    ) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        let msg = self.wait(dst.len(), w)?;
        match input {
            Input::Separate(src) => red.reduce_out(dst, msg, src),
            Input::InPlace => red.reduce_into(dst, msg),
        }
        if let Some(ranks) = finalize {
            red.finalize(dst, ranks);
        }
        self.link.release(w)
    }
}

/// A receive half and a send half used together (one ring position, one exchange step).
pub struct Pipe<'a> {
    /// Where messages come from.
    pub rx: Rx<'a>,
    /// Where messages go.
    pub tx: Tx<'a>,
}

impl<'a> Pipe<'a> {
    /// Receives one message and forwards `msg op src` without keeping it.
    pub fn recv_reduce_send(&mut self, src: &[u8], red: &Reducer, w: &Waiter) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        let msg = self.rx.wait(src.len(), w)?;
        let slot = self.tx.link.reserve(src.len(), w)?;
        red.reduce_out(&mut slot[..src.len()], msg, src);
        self.tx.link.post(src.len(), w)?;
        self.rx.link.release(w)
    }

    /// Receives one message, writes `msg op input` (finalized when asked) into `dst` and forwards it.
    pub fn recv_reduce_copy_send(
        &mut self,
        input: Input,
        dst: &mut [u8],
        red: &Reducer,
        finalize: Option<usize>,
        w: &Waiter,
    ) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        self.rx.recv_reduce_copy(input, dst, red, finalize, w)?;
        self.tx.send(dst, w)
    }

    /// Receives one message into `dst` and forwards it. The incoming slot is copied straight into
    /// the outgoing slot and `dst`, so the data is read once.
    pub fn recv_copy_send(&mut self, dst: &mut [u8], w: &Waiter) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        let msg = self.rx.wait(dst.len(), w)?;
        let slot = self.tx.link.reserve(dst.len(), w)?;
        slot[..dst.len()].copy_from_slice(msg);
        dst.copy_from_slice(msg);
        self.tx.link.post(dst.len(), w)?;
        self.rx.link.release(w)
    }
}
