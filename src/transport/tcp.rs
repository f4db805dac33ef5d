//! TCP transport: a chunk FIFO in each direction over one authenticated stream.
//!
//! Why: ranks on different nodes (or every pair when TCP is forced) need the same slot interface as
//! shared memory, and a ring in which every rank posts to its successor before receiving from its
//! predecessor must not deadlock on socket buffers. So posting never writes on the caller's thread:
//! a sender thread drains a queue of filled slot buffers into the socket, and a receiver thread
//! reads length-prefixed chunks into free buffers that `wait`/`release` hand out in place.
//!
//! Invariants: each direction owns at most `depth` buffers of `chunk` bytes (allocated on first
//! use); `reserve` blocks while all are queued or being written; the receiver thread stops reading
//! while all of its buffers hold unreleased chunks, which gives the peer TCP backpressure. Wire
//! format: `len: u64 LE` then `len` bytes, `len <= chunk` (both sides use the chunk size the lower
//! rank announced at setup). Chunks received before an EOF or error are still delivered; the error
//! is reported, naming the peer, by the next `wait` after them (receive side) or the next
//! `reserve`/`post` (send side). Dropping a half ends its thread: the send half after flushing what
//! was posted (then half-closes the socket), the receive half by shutting the socket's read side.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::{RecvLink, SendLink, Waiter};
use crate::error::{Error, Result};

/// Default chunk size of a TCP link.
pub const DEFAULT_TCP_CHUNK: usize = 1 << 20;
/// Default number of buffers per direction of a TCP link.
pub const DEFAULT_TCP_DEPTH: usize = 4;
/// Largest accepted chunk size.
pub const MAX_TCP_CHUNK: usize = 1 << 30;
/// Largest accepted depth.
pub const MAX_TCP_DEPTH: usize = 1024;

/// How often a blocked `reserve`/`wait` polls the waiter (deadline, abort).
const POLL: Duration = Duration::from_millis(2);

/// Bytes of the little-endian length that precedes every chunk on the wire.
const PREFIX: usize = 8;

/// A buffer and the number of payload bytes in it (after `PREFIX` bytes on the send side).
type Chunk = (Vec<u8>, usize);

/// State shared by the two halves and their threads.
struct Shared {
    stream: TcpStream,
    /// Why the sender thread stopped, if it failed.
    send_error: Mutex<Option<String>>,
    /// Why the receiver thread stopped (EOF, error, protocol violation).
    recv_error: Mutex<Option<String>>,
}

impl Shared {
    fn record(slot: &Mutex<Option<String>>, msg: String) {
        let mut s = slot.lock().unwrap_or_else(|e| e.into_inner());
        s.get_or_insert(msg);
    }

    fn cause(slot: &Mutex<Option<String>>) -> Option<String> {
        slot.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// Builds both halves of a TCP link to `peer` over `stream` and starts their threads.
pub fn tcp_link(stream: TcpStream, peer: usize, chunk: usize, depth: usize) -> Result<(TcpSend, TcpRecv)> {
    if chunk == 0 || chunk > MAX_TCP_CHUNK || depth == 0 || depth > MAX_TCP_DEPTH {
        return Err(Error::InvalidArgument(format!(
            "tcp link chunk {chunk} (1..={MAX_TCP_CHUNK}) / depth {depth} (1..={MAX_TCP_DEPTH})"
        )));
    }
    stream
        .set_nodelay(true)
        .map_err(|e| Error::io(format!("TCP_NODELAY to rank {peer}"), e))?;
    stream
        .set_read_timeout(None)
        .map_err(|e| Error::io(format!("clear read timeout to rank {peer}"), e))?;
    stream
        .set_write_timeout(None)
        .map_err(|e| Error::io(format!("clear write timeout to rank {peer}"), e))?;
    let shared = Arc::new(Shared {
        stream,
        send_error: Mutex::new(None),
        recv_error: Mutex::new(None),
    });

    let (filled_tx, filled_rx) = mpsc::channel::<Chunk>();
    let (sent_tx, sent_rx) = mpsc::channel::<Vec<u8>>();
    let sh = shared.clone();
    std::thread::Builder::new()
        .name(format!("tcp-send-{peer}"))
        .spawn(move || send_loop(&sh, filled_rx, sent_tx))
        .map_err(|e| Error::io(format!("spawn TCP sender thread for rank {peer}"), e))?;

    let (arrived_tx, arrived_rx) = mpsc::channel::<Chunk>();
    let (free_tx, free_rx) = mpsc::channel::<Vec<u8>>();
    let sh = shared.clone();
    std::thread::Builder::new()
        .name(format!("tcp-recv-{peer}"))
        .spawn(move || recv_loop(&sh, chunk, depth, free_rx, arrived_tx))
        .map_err(|e| Error::io(format!("spawn TCP receiver thread for rank {peer}"), e))?;

    let send = TcpSend {
        peer,
        chunk,
        depth,
        allocated: 0,
        free: sent_rx,
        queue: Some(filled_tx),
        current: None,
        shared: shared.clone(),
    };
    let recv = TcpRecv {
        peer,
        arrived: arrived_rx,
        free: free_tx,
        current: None,
        shared,
    };
    Ok((send, recv))
}

/// Writes queued chunks until the send half is dropped (queue closed) or the socket fails. Each send
/// buffer starts with `PREFIX` bytes reserved for the length, so a chunk goes out in one `send`
/// (which, unlike `writev`, is issued with MSG_NOSIGNAL: a closed peer is an error, not a SIGPIPE).
fn send_loop(sh: &Shared, queue: Receiver<Chunk>, sent: Sender<Vec<u8>>) {
    for (mut buf, len) in queue {
        buf[..PREFIX].copy_from_slice(&(len as u64).to_le_bytes());
        if let Err(e) = (&sh.stream).write_all(&buf[..PREFIX + len]) {
            Shared::record(&sh.send_error, format!("connection closed while sending: {e}"));
            let _ = sh.stream.shutdown(Shutdown::Both);
            return;
        }
        // The send half may be gone already; then the buffer is simply freed.
        let _ = sent.send(buf);
    }
    // Everything posted was written; tell the peer no more chunks follow.
    let _ = sh.stream.shutdown(Shutdown::Write);
}

/// Reads chunks into free buffers until EOF, an error, or the receive half is dropped.
fn recv_loop(sh: &Shared, chunk: usize, depth: usize, free: Receiver<Vec<u8>>, arrived: Sender<Chunk>) {
    let mut allocated = 0;
    loop {
        let mut buf = match free.try_recv() {
            Ok(b) => b,
            Err(TryRecvError::Empty) if allocated < depth => {
                allocated += 1;
                vec![0u8; chunk]
            }
            // All buffers hold unreleased chunks: stop reading until one comes back.
            Err(TryRecvError::Empty) => match free.recv() {
                Ok(b) => b,
                Err(_) => return,
            },
            Err(TryRecvError::Disconnected) => return,
        };
        let mut prefix = [0u8; PREFIX];
        match read_full(&sh.stream, &mut prefix) {
            Ok(true) => {}
            Ok(false) => {
                Shared::record(
                    &sh.recv_error,
                    "connection closed by the peer (process exited or link dropped)".into(),
                );
                return;
            }
            Err(e) => {
                Shared::record(&sh.recv_error, format!("connection closed while receiving: {e}"));
                return;
            }
        }
        let len = u64::from_le_bytes(prefix);
        if len > chunk as u64 {
            Shared::record(
                &sh.recv_error,
                format!("protocol error: chunk of {len} bytes > {chunk}"),
            );
            let _ = sh.stream.shutdown(Shutdown::Both);
            return;
        }
        let len = len as usize;
        match read_full(&sh.stream, &mut buf[..len]) {
            Ok(true) => {}
            Ok(false) => {
                Shared::record(
                    &sh.recv_error,
                    format!("connection closed in the middle of a {len}-byte chunk"),
                );
                return;
            }
            Err(e) => {
                Shared::record(&sh.recv_error, format!("connection closed while receiving: {e}"));
                return;
            }
        }
        if arrived.send((buf, len)).is_err() {
            return;
        }
    }
}

/// Fills `buf`; `Ok(false)` on EOF before the first byte or in the middle.
fn read_full(mut stream: &TcpStream, buf: &mut [u8]) -> io::Result<bool> {
    let mut got = 0;
    while got < buf.len() {
        match stream.read(&mut buf[got..]) {
            Ok(0) => return Ok(false),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

/// Sending half of a TCP link.
pub struct TcpSend {
    peer: usize,
    chunk: usize,
    depth: usize,
    /// Buffers created so far (at most `depth`).
    allocated: usize,
    /// Buffers the sender thread has finished writing.
    free: Receiver<Vec<u8>>,
    /// Queue to the sender thread; `None` only while dropping.
    queue: Option<Sender<Chunk>>,
    /// Buffer handed out by `reserve`, and the length asked for.
    current: Option<(Vec<u8>, usize)>,
    shared: Arc<Shared>,
}

impl TcpSend {
    fn failed(&self, w: &Waiter) -> Error {
        let cause = Shared::cause(&self.shared.send_error).unwrap_or_else(|| "connection closed".into());
        w.fail(self.peer, cause)
    }
}

impl SendLink for TcpSend {
    fn reserve(&mut self, len: usize, w: &Waiter) -> Result<&mut [u8]> {
        if len > self.chunk {
            return Err(Error::InvalidArgument(format!(
                "tcp reserve of {len} bytes > chunk {}",
                self.chunk
            )));
        }
        if Shared::cause(&self.shared.send_error).is_some() {
            return Err(self.failed(w));
        }
        if self.current.is_none() {
            let buf = loop {
                match self.free.try_recv() {
                    Ok(b) => break b,
                    Err(TryRecvError::Disconnected) => return Err(self.failed(w)),
                    Err(TryRecvError::Empty) if self.allocated < self.depth => {
                        self.allocated += 1;
                        break vec![0u8; PREFIX + self.chunk];
                    }
                    Err(TryRecvError::Empty) => {}
                }
                match self.free.recv_timeout(POLL) {
                    Ok(b) => break b,
                    Err(RecvTimeoutError::Disconnected) => return Err(self.failed(w)),
                    Err(RecvTimeoutError::Timeout) => w.check(self.peer)?,
                }
            };
            self.current = Some((buf, 0));
        }
        let (buf, reserved) = self.current.as_mut().expect("current buffer was just set");
        *reserved = len;
        Ok(&mut buf[PREFIX..PREFIX + len])
    }

    fn post(&mut self, len: usize, w: &Waiter) -> Result<()> {
        match self.current.take() {
            Some((buf, reserved)) if len <= reserved => {
                let queue = self.queue.as_ref().expect("queue lives until drop");
                queue.send((buf, len)).map_err(|_| self.failed(w))
            }
            other => {
                let r = other.as_ref().map(|c| c.1);
                self.current = other;
                Err(Error::InvalidArgument(format!(
                    "tcp post of {len} bytes after reserve of {r:?}"
                )))
            }
        }
    }

    fn max_chunk(&self) -> usize {
        self.chunk
    }

    fn depth(&self) -> usize {
        self.depth
    }
}

impl Drop for TcpSend {
    fn drop(&mut self) {
        // Closing the queue lets the sender thread flush what was posted, then half-close and exit.
        self.queue.take();
    }
}

/// Receiving half of a TCP link.
pub struct TcpRecv {
    peer: usize,
    /// Chunks read by the receiver thread, in order.
    arrived: Receiver<Chunk>,
    /// Returns released buffers to the receiver thread.
    free: Sender<Vec<u8>>,
    /// Chunk handed out by `wait` and not yet released.
    current: Option<Chunk>,
    shared: Arc<Shared>,
}

impl RecvLink for TcpRecv {
    fn wait(&mut self, w: &Waiter) -> Result<&[u8]> {
        while self.current.is_none() {
            match self.arrived.recv_timeout(POLL) {
                Ok(c) => self.current = Some(c),
                Err(RecvTimeoutError::Timeout) => w.check(self.peer)?,
                Err(RecvTimeoutError::Disconnected) => {
                    let cause =
                        Shared::cause(&self.shared.recv_error).unwrap_or_else(|| "connection closed".into());
                    return Err(w.fail(self.peer, cause));
                }
            }
        }
        let (buf, len) = self.current.as_ref().expect("current chunk was just set");
        Ok(&buf[..*len])
    }

    fn release(&mut self, _w: &Waiter) -> Result<()> {
        let (buf, _) = self
            .current
            .take()
            .ok_or_else(|| Error::InvalidArgument("tcp release without a waited chunk".into()))?;
        // The receiver thread may have stopped (EOF); then the buffer is simply freed.
        let _ = self.free.send(buf);
        Ok(())
    }
}

impl Drop for TcpRecv {
    fn drop(&mut self) {
        // Wakes the receiver thread if it is blocked in read(); if it waits for a free buffer, the
        // closed `free` channel ends it.
        let _ = self.shared.stream.shutdown(Shutdown::Read);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::test_util::{both_directions, dead_peer_reported_after_data, deadline_is_a_timeout, drain_check, pump, stream_pair, waiter};

    fn pair(chunk: usize, depth: usize) -> ((TcpSend, TcpRecv), (TcpSend, TcpRecv)) {
        let (a, b) = stream_pair();
        (
            tcp_link(a, 1, chunk, depth).expect("link a"),
            tcp_link(b, 0, chunk, depth).expect("link b"),
        )
    }

    #[test]
    fn fifo_delivers_every_byte_in_order() {
        let ((mut send, _ar), (_bs, mut recv)) = pair(3000, 3);
        std::thread::scope(|s| {
            s.spawn(|| pump(&mut send, 1, 3000, &waiter(0, 30)));
            drain_check(&mut recv, 1, 3000, 3000, &waiter(1, 30));
        });
    }

    #[test]
    fn both_directions_at_once() {
        let ((mut a_s, mut a_r), (mut b_s, mut b_r)) = pair(70_000, 2);
        both_directions((&mut a_s, &mut a_r), (&mut b_s, &mut b_r), 500, 70_000);
    }

    #[test]
    fn closed_peer_is_reported_after_posted_data() {
        let ((send, a_r), (b_s, mut recv)) = pair(256, 4);
        dead_peer_reported_after_data(send, a_r, &mut recv, 7, 256, "connection closed");
        drop(b_s);
    }

    #[test]
    fn dead_receiver_fails_the_sender() {
        let ((mut send, _a_r), peer) = pair(1 << 16, 2);
        let w = waiter(0, 60);
        drop(peer);
        // The socket buffers absorb some chunks; once the closed peer answers with a reset, the
        // sender thread stops and the next reserve or post reports it.
        let err = loop {
            let r = match send.reserve(1 << 16, &w) {
                Ok(_) => send.post(1 << 16, &w),
                Err(e) => Err(e),
            };
            if let Err(e) = r {
                break e;
            }
        };
        assert!(matches!(err, Error::Comm { peer: 1, .. }), "{err}");
    }

    #[test]
    fn deadline_expiry_is_a_timeout() {
        let ((_a_s, _a_r), (_b_s, mut recv)) = pair(64, 2);
        deadline_is_a_timeout(&mut recv);
    }

    #[test]
    fn oversized_chunk_is_a_protocol_error() {
        let (mut raw, b) = stream_pair();
        let (_b_s, mut recv) = tcp_link(b, 0, 16, 2).expect("link");
        raw.write_all(&100u64.to_le_bytes()).expect("write");
        match recv.wait(&waiter(1, 30)) {
            Err(Error::Comm { peer: 0, cause, .. }) => assert!(cause.contains("protocol error"), "{cause}"),
            other => panic!("expected a protocol error, got {:?}", other.map(|b| b.len())),
        }
    }

    #[test]
    fn misuse_is_rejected() {
        let ((mut send, _a_r), (_b_s, mut recv)) = pair(64, 2);
        let w = waiter(0, 10);
        assert!(matches!(send.reserve(65, &w), Err(Error::InvalidArgument(_))));
        assert!(matches!(send.post(1, &w), Err(Error::InvalidArgument(_))));
        send.reserve(8, &w).expect("reserve");
        assert!(matches!(send.post(9, &w), Err(Error::InvalidArgument(_))));
        assert!(matches!(recv.release(&w), Err(Error::InvalidArgument(_))));
        assert!(tcp_link(stream_pair().0, 1, 0, 2).is_err());
    }
}
