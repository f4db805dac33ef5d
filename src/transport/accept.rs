//! The listening side of the network connector: accepts every incoming connection, authenticates it
//! on its own short-lived thread and files it under the key it asked for.
//!
//! Why: a rank's port is open to anything on the network. A stranger (random bytes, an HTTP probe,
//! a stalled half-header, a wrong secret, a bad or duplicate rank) must be turned away with a warning
//! naming its address and the reason, without delaying legitimate peers and without claiming a key.
//!
//! Invariants: the accept thread never blocks on a handshake (each runs on its own thread, at most
//! `MAX_HANDSHAKES` at once, each bounded by the handshake timeout, and by
//! [`handshake::IDLE_LIMIT`] until the client's first bytes arrive); a connection refused because
//! all slots are busy is closed before the server hello, which tells a real peer to retry; a key (comm_id, from_rank, tag)
//! is admitted at most once for the connector's lifetime and only after the client proved it holds
//! the secret; a stream is delivered to exactly one `take`. Dropping the [`Acceptor`] stops the
//! accept thread.

use std::collections::{HashMap, HashSet};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use log::{debug, warn};

use super::handshake::{self, Request};
use super::Waiter;
use crate::error::{Error, Result};

/// Handshakes in progress at once; further connections are refused until some finish.
pub(super) const MAX_HANDSHAKES: usize = 64;
/// Pause after a failed accept (e.g. out of file descriptors) before trying again.
const ACCEPT_RETRY: Duration = Duration::from_millis(20);
/// How often `take` polls the waiter.
const POLL: Duration = Duration::from_millis(5);

/// Identifies one authenticated stream: (comm_id, from_rank, tag).
pub(super) type StreamKey = (u64, usize, u32);

/// Streams that finished their handshake, waiting for `accept_stream`.
#[derive(Default)]
struct Inbox {
    ready: HashMap<StreamKey, TcpStream>,
    /// Every key ever admitted; a second connection with the same key is a duplicate.
    claimed: HashSet<StreamKey>,
}

/// State shared by the accept thread, the handshake threads and `Acceptor::take`.
struct Shared {
    rank: usize,
    size: usize,
    secret: [u8; 16],
    timeout: Duration,
    inbox: Mutex<Inbox>,
    arrived: Condvar,
    stopping: AtomicBool,
    in_handshake: AtomicUsize,
}

impl Shared {
    fn run(self: Arc<Self>, listener: Arc<TcpListener>) {
        loop {
            let accepted = listener.accept();
            if self.stopping.load(Ordering::Acquire) {
                return;
            }
            let (stream, addr) = match accepted {
                Ok(c) => c,
                Err(e) => {
                    warn!("transport: rank {}: accept failed: {e}", self.rank);
                    std::thread::sleep(ACCEPT_RETRY);
                    continue;
                }
            };
            if self.in_handshake.fetch_add(1, Ordering::AcqRel) >= MAX_HANDSHAKES {
                self.in_handshake.fetch_sub(1, Ordering::AcqRel);
                warn!(
                    "transport: rank {}: rejected connection from {addr}: too many handshakes",
                    self.rank
                );
                continue;
            }
            let me = self.clone();
            let spawned = std::thread::Builder::new()
                .name("mt-handshake".into())
                .stack_size(256 * 1024)
                .spawn(move || {
                    me.handle(stream, addr);
                    me.in_handshake.fetch_sub(1, Ordering::AcqRel);
                });
            if let Err(e) = spawned {
                self.in_handshake.fetch_sub(1, Ordering::AcqRel);
                warn!(
                    "transport: rank {}: rejected connection from {addr}: no thread: {e}",
                    self.rank
                );
            }
        }
    }

    /// Authenticates one incoming connection and files it in the inbox, or rejects it with a warning.
    fn handle(&self, mut stream: TcpStream, addr: SocketAddr) {
        let mut claimed = None;
        let result = handshake::server(&mut stream, &self.secret, self.timeout, |req| {
            claimed = Some(self.admit(req)?);
            Ok(())
        })
        .and_then(|req| {
            stream
                .set_nodelay(true)
                .map_err(|e| format!("TCP_NODELAY: {e}"))?;
            stream
                .set_read_timeout(None)
                .map_err(|e| format!("clear read timeout: {e}"))?;
            stream
                .set_write_timeout(None)
                .map_err(|e| format!("clear write timeout: {e}"))?;
            Ok(req)
        });
        let mut inbox = self.inbox.lock().unwrap_or_else(|e| e.into_inner());
        match (result, claimed) {
            (Ok(req), Some(key)) => {
                debug!("transport: rank {}: accepted {req:?} from {addr}", self.rank);
                inbox.ready.insert(key, stream);
                self.arrived.notify_all();
            }
            (result, claimed) => {
                if let Some(key) = claimed {
                    inbox.claimed.remove(&key);
                }
                let reason = result.err().unwrap_or_else(|| "admitted without a key".into());
                warn!(
                    "transport: rank {}: rejected connection from {addr}: {reason}",
                    self.rank
                );
            }
        }
    }

    /// Checks an authenticated request and claims its key.
    fn admit(&self, req: &Request) -> std::result::Result<StreamKey, String> {
        let (from, to) = (req.from as usize, req.to as usize);
        if to != self.rank {
            return Err(format!("request is for rank {to}, this is rank {}", self.rank));
        }
        if from >= self.size || from == self.rank {
            return Err(format!(
                "request from rank {from} (world size {}, this is rank {})",
                self.size, self.rank
            ));
        }
        let key = (req.comm_id, from, req.tag);
        let mut inbox = self.inbox.lock().unwrap_or_else(|e| e.into_inner());
        if !inbox.claimed.insert(key) {
            return Err(format!(
                "duplicate stream from rank {from} (comm {:#x}, tag {:#x})",
                req.comm_id, req.tag
            ));
        }
        Ok(key)
    }
}

/// A listening socket with its accept thread.
pub(super) struct Acceptor {
    shared: Arc<Shared>,
    listener: Arc<TcpListener>,
    local: SocketAddr,
    thread: Option<JoinHandle<()>>,
}

impl Acceptor {
    /// Binds `bind` and accepts connections for world rank `rank` of `size` with the job `secret`.
    pub(super) fn start(
        rank: usize,
        size: usize,
        secret: [u8; 16],
        timeout: Duration,
        bind: SocketAddr,
    ) -> Result<Acceptor> {
        let listener =
            TcpListener::bind(bind).map_err(|e| Error::io(format!("rank {rank}: bind {bind}"), e))?;
        let local = listener
            .local_addr()
            .map_err(|e| Error::io(format!("rank {rank}: listener address"), e))?;
        let listener = Arc::new(listener);
        let shared = Arc::new(Shared {
            rank,
            size,
            secret,
            timeout,
            inbox: Mutex::new(Inbox::default()),
            arrived: Condvar::new(),
            stopping: AtomicBool::new(false),
            in_handshake: AtomicUsize::new(0),
        });
        let (sh, lis) = (shared.clone(), listener.clone());
        let thread = std::thread::Builder::new()
            .name(format!("mt-accept-{rank}"))
            .spawn(move || sh.run(lis))
            .map_err(|e| Error::io(format!("rank {rank}: spawn accept thread"), e))?;
        Ok(Acceptor {
            shared,
            listener,
            local,
            thread: Some(thread),
        })
    }

    /// The address peers connect to.
    pub(super) fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Waits for the authenticated stream filed under `key`, polling `w` on behalf of `peer`.
    pub(super) fn take(&self, key: StreamKey, peer: usize, w: &Waiter) -> Result<TcpStream> {
        let mut inbox = self.shared.inbox.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(s) = inbox.ready.remove(&key) {
                return Ok(s);
            }
            w.check(peer)?;
            inbox = self
                .shared
                .arrived
                .wait_timeout(inbox, POLL)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Streams waiting to be taken and keys admitted so far (for tests).
    #[cfg(test)]
    pub(super) fn counts(&self) -> (usize, usize) {
        let inbox = self.shared.inbox.lock().unwrap_or_else(|e| e.into_inner());
        (inbox.ready.len(), inbox.claimed.len())
    }
}

impl Drop for Acceptor {
    fn drop(&mut self) {
        self.shared.stopping.store(true, Ordering::Release);
        // SAFETY: shutting down our own listening socket (still open: we hold an Arc to it) wakes the
        // accept thread blocked in accept(), which then sees `stopping` and returns.
        unsafe { libc::shutdown(self.listener.as_raw_fd(), libc::SHUT_RDWR) };
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
