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
//!
//! Single-copy primitives (links that offer [`PeerMemory`]): `expose` announces a buffer's address
//! and length in a small message instead of copying the buffer; the peer's `read_exposed` copies it
//! straight out of this process into its destination and answers `done_reading`; the owner's
//! `wait_done_reading` returns once that answer arrived. The owner must not write (or free) an
//! exposed buffer before `wait_done_reading` returned for every peer it exposed it to; a peer that
//! dies in between is reported by that wait like any dead peer, so the owner never hangs. A reader
//! that fails answers `give_up_reading` instead, which releases the owner's buffer just the same
//! (the reader reports its own error).

use crate::dtype::Reducer;
use crate::comm::fingerprint::{self, OpPrint};
use crate::error::Result;
use crate::transport::{PeerMemory, RecvLink, SendLink, Waiter};

/// Bytes of an `expose` message: the buffer's address and length, little-endian u64s.
const EXPOSE_MSG: usize = 16;
/// Bytes of a `done_reading` message: the number of bytes read ([`GAVE_UP`] after a failure),
/// little-endian u64.
const DONE_MSG: usize = 8;
/// The `done_reading` value of a reader that gave up.
const GAVE_UP: u64 = u64::MAX;
/// Largest single read of a peer's memory; the deadline and the abort flag are checked between
/// reads (4 MiB take about 0.5 ms at memcpy speed).
const READ_PIECE: usize = 4 << 20;

/// A buffer a peer announced with [`Tx::expose`]: where it lies in the peer's address space.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exposed {
    /// Address of the first byte in the peer process.
    pub addr: u64,
    /// Length in bytes.
    pub len: usize,
}

impl Exposed {
    /// The bytes `r` of this buffer (`r` relative to its start, within its length).
    pub fn part(&self, r: std::ops::Range<usize>) -> Exposed {
        assert!(r.start <= r.end && r.end <= self.len, "part {r:?} of a {}-byte buffer", self.len);
        Exposed { addr: self.addr + r.start as u64, len: r.len() }
    }
}

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
    /// The call's fingerprint, put in front of its first message on this link ([`fingerprint`]).
    print: &'a mut Option<OpPrint>,
    /// Bytes in front of the message in the reserved slot (the print, or nothing).
    prefix: usize,
    /// World rank of the peer (for errors).
    pub peer: usize,
}

/// Receiving half from one peer.
pub struct Rx<'a> {
    link: &'a mut dyn RecvLink,
    /// The fingerprint the peer's first message of this call must start with ([`fingerprint`]).
    expect: &'a mut Option<OpPrint>,
    /// World rank of the peer (for errors).
    pub peer: usize,
    /// Read access to the peer's memory, when the link offers it.
    memory: Option<&'a PeerMemory>,
}

impl<'a> Tx<'a> {
    /// Wraps a send link to world rank `peer`; `print` (if armed) goes in front of the first
    /// message.
    pub fn new(link: &'a mut dyn SendLink, print: &'a mut Option<OpPrint>, peer: usize) -> Self {
        Tx { link, print, prefix: 0, peer }
    }

    /// The `len` bytes to fill for the next message; the call's fingerprint, while still due,
    /// goes in front of them in the same slot (links carry the chunk plus a print).
    fn slot(&mut self, len: usize, w: &Waiter) -> Result<&mut [u8]> {
        match self.print.take() {
            Some(p) => {
                self.prefix = fingerprint::PRINT_LEN;
                let slot = self.link.reserve(fingerprint::PRINT_LEN + len, w)?;
                slot[..fingerprint::PRINT_LEN].copy_from_slice(&p.encode());
                Ok(&mut slot[fingerprint::PRINT_LEN..fingerprint::PRINT_LEN + len])
            }
            None => Ok(&mut self.link.reserve(len, w)?[..len]),
        }
    }

    /// Publishes the `len` bytes filled through the last [`Tx::slot`].
    fn commit(&mut self, len: usize, w: &Waiter) -> Result<()> {
        let prefix = std::mem::take(&mut self.prefix);
        self.link.post(prefix + len, w)
    }

    /// Sends `src` as one message (nothing for an empty `src`).
    pub fn send(&mut self, src: &[u8], w: &Waiter) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        self.slot(src.len(), w)?.copy_from_slice(src);
        self.commit(src.len(), w)
    }

    /// Announces `buf` for a single-copy read by the peer (nothing for an empty `buf`). `buf` must
    /// stay unchanged until [`Rx::wait_done_reading`] from the same peer returned.
    pub fn expose(&mut self, buf: &[u8], w: &Waiter) -> Result<()> {
        if buf.is_empty() {
            return Ok(());
        }
        let mut msg = [0u8; EXPOSE_MSG];
        msg[..8].copy_from_slice(&(buf.as_ptr() as u64).to_le_bytes());
        msg[8..].copy_from_slice(&(buf.len() as u64).to_le_bytes());
        self.send(&msg, w)
    }

    /// Tells the peer that this rank finished reading the `len`-byte buffer the peer exposed.
    pub fn done_reading(&mut self, len: usize, w: &Waiter) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        self.send(&(len as u64).to_le_bytes(), w)
    }

    /// Tells the peer that this rank will not (or no longer) read the buffer the peer exposed to
    /// it, because this rank failed: the answer owed instead of [`Tx::done_reading`].
    pub fn give_up_reading(&mut self, w: &Waiter) -> Result<()> {
        self.send(&GAVE_UP.to_le_bytes(), w)
    }
}

impl<'a> Rx<'a> {
    /// Wraps a receive link from world rank `peer`; the peer's first message must be `expect`
    /// (if armed).
    pub fn new(link: &'a mut dyn RecvLink, expect: &'a mut Option<OpPrint>, peer: usize) -> Self {
        Rx { link, expect, peer, memory: None }
    }

    /// Adds read access to the peer's memory (for the single-copy primitives).
    pub fn with_memory(self, memory: Option<&'a PeerMemory>) -> Self {
        Rx { memory, ..self }
    }

    /// Waits for the next message and checks that it is `len` bytes long; the first message of a
    /// call must carry the peer's fingerprint in front, equal to this call's (an error names both
    /// calls).
    fn wait(&mut self, len: usize, w: &Waiter) -> Result<&[u8]> {
        let peer = self.peer;
        let expect = self.expect.take();
        let msg = self.link.wait(w)?;
        let msg = match expect {
            None => msg,
            Some(mine) => {
                let print = mine.encode();
                if msg.len() != print.len() + len || msg[..print.len()] != print {
                    return Err(w.fail(peer, fingerprint::mismatch(w.rank, &mine, peer, msg)));
                }
                &msg[print.len()..]
            }
        };
        if msg.len() != len {
            return Err(
                w.fail(peer, format!("protocol error: expected a {len}-byte message, got {}", msg.len()))
            );
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

    /// Waits for the peer's announcement of a buffer and checks that it is `len` bytes long
    /// (`len > 0`: an empty buffer is never announced).
    pub fn wait_exposed(&mut self, len: usize, w: &Waiter) -> Result<Exposed> {
        let msg = self.wait(EXPOSE_MSG, w)?;
        let addr = u64::from_le_bytes(msg[..8].try_into().expect("16-byte message"));
        let got = u64::from_le_bytes(msg[8..].try_into().expect("16-byte message"));
        self.link.release(w)?;
        if got != len as u64 {
            return Err(w.fail(self.peer, format!("protocol error: expected a {len}-byte buffer, got {got}")));
        }
        Ok(Exposed { addr, len })
    }

    /// Copies the buffer `e` of the peer into `dst` (`dst.len() == e.len`); `Err` says why not.
    pub fn try_read(&self, e: Exposed, dst: &mut [u8]) -> std::result::Result<(), String> {
        let memory = self.memory.ok_or("the link offers no access to the peer's memory")?;
        assert_eq!(dst.len(), e.len, "destination matches the exposed buffer");
        memory.read(e.addr, dst).map_err(|err| match err.raw_os_error() {
            Some(libc::ESRCH) => format!("peer process died (pid {} gone while reading it)", memory.pid()),
            _ => format!("reading {} bytes of peer process {}: {err}", e.len, memory.pid()),
        })
    }

    /// Copies the next buffer the peer exposes straight into `dst` (nothing for an empty `dst`).
    /// The caller answers with [`Tx::done_reading`] towards the same peer.
    pub fn read_exposed(&mut self, dst: &mut [u8], w: &Waiter) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        let e = self.wait_exposed(dst.len(), w)?;
        self.read(e, dst, w)
    }

    /// Copies the peer's buffer `e` (announced earlier) into `dst` (`dst.len() == e.len`).
    fn read(&self, e: Exposed, dst: &mut [u8], w: &Waiter) -> Result<()> {
        for (i, piece) in dst.chunks_mut(READ_PIECE).enumerate() {
            w.check(self.peer)?;
            self.try_read(e.part(i * READ_PIECE..i * READ_PIECE + piece.len()), piece)
                .map_err(|cause| w.fail(self.peer, cause))?;
        }
        Ok(())
    }

    /// Waits until the peer finished reading the `len`-byte buffer this rank exposed to it, or
    /// gave up reading it.
    pub fn wait_done_reading(&mut self, len: usize, w: &Waiter) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let msg = self.wait(DONE_MSG, w)?;
        let got = u64::from_le_bytes(msg.try_into().expect("8-byte message"));
        self.link.release(w)?;
        if got != len as u64 && got != GAVE_UP {
            return Err(w.fail(self.peer, format!("protocol error: peer read {got} of {len} exposed bytes")));
        }
        Ok(())
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
        red.reduce_out(self.tx.slot(src.len(), w)?, msg, src);
        self.tx.commit(src.len(), w)?;
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
        self.tx.slot(dst.len(), w)?.copy_from_slice(msg);
        dst.copy_from_slice(msg);
        self.tx.commit(dst.len(), w)?;
        self.rx.link.release(w)
    }
}
