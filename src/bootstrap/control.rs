//! The control channel: one authenticated TCP stream from every rank to rank 0, used to exchange
//! listener addresses at start, to spread a job-wide abort, and to leave together at the end.
//!
//! Messages are length-prefixed JSON (at most [`MAX_MSG`] bytes). Invariants:
//! - rank 0 learns of a dead rank by its stream closing without a `Bye`, and tells every other rank
//!   (`Abort` naming it); a rank that raises an abort itself sends it to rank 0, which forwards it;
//!   a rank whose stream to rank 0 closes before the final `ByeAck` aborts locally;
//! - shutdown is a barrier: every rank sends `Bye` and waits for rank 0's `ByeAck`, which rank 0
//!   sends once all ranks said `Bye`, so no rank closes links that a slower peer still reads.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::transport::net::PeerInfo;
use crate::transport::AbortState;

/// Largest control message accepted.
const MAX_MSG: usize = 16 << 20;

/// What one rank tells rank 0 about itself.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Hello {
    /// World rank.
    pub rank: usize,
    /// Its data listener.
    pub addr: SocketAddr,
    /// Identifies its node (hostname and boot id).
    pub node_key: String,
    /// Process id (for shared-memory peer liveness).
    pub pid: u32,
}

/// A [`PeerInfo`] on the wire.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Peer {
    addr: SocketAddr,
    node: usize,
    pid: u32,
}

#[derive(Debug, Serialize, Deserialize)]
enum Msg {
    Hello(Hello),
    Table(Vec<Peer>),
    Abort(String),
    Bye,
    ByeAck,
}

fn write_msg(s: &mut TcpStream, m: &Msg) -> std::io::Result<()> {
    let body = serde_json::to_vec(m).map_err(std::io::Error::other)?;
    let mut frame = (body.len() as u32).to_le_bytes().to_vec();
    frame.extend_from_slice(&body);
    s.write_all(&frame)
}

fn read_msg(s: &mut TcpStream) -> std::io::Result<Msg> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_MSG {
        return Err(std::io::Error::other(format!("control message of {len} bytes exceeds {MAX_MSG}")));
    }
    let mut body = vec![0u8; len];
    s.read_exact(&mut body)?;
    serde_json::from_slice(&body).map_err(std::io::Error::other)
}

/// Shutdown bookkeeping shared with the reader threads.
#[derive(Default)]
struct Exit {
    state: Mutex<ExitState>,
    cv: Condvar,
}

#[derive(Default)]
struct ExitState {
    /// Ranks (rank 0: all others; others: just rank 0) that said goodbye.
    byes: usize,
    acked: bool,
}

/// This rank's end of the control channel.
pub struct Control {
    rank: usize,
    /// Streams to write to: rank 0 holds one per other rank (index = rank), others hold rank 0's.
    writers: Arc<Vec<Mutex<Option<TcpStream>>>>,
    exit: Arc<Exit>,
    abort: Arc<AbortState>,
}

fn send_to(writers: &[Mutex<Option<TcpStream>>], i: usize, m: &Msg) {
    if let Some(s) = writers[i].lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
        // A failed write means that rank is gone; its reader thread reports that.
        let _ = write_msg(s, m);
    }
}

impl Control {
    /// Rank 0: receives every other rank's [`Hello`] on `streams` (index = rank), answers with the
    /// full table built by `table`, and starts a reader per rank.
    pub fn root(
        streams: Vec<Option<TcpStream>>,
        own: Hello,
        abort: Arc<AbortState>,
        table: impl FnOnce(Vec<Hello>) -> Vec<PeerInfo>,
    ) -> Result<(Self, Vec<PeerInfo>)> {
        let size = streams.len();
        let mut streams = streams;
        let mut hellos = vec![own];
        for (r, s) in streams.iter_mut().enumerate().skip(1) {
            let s = s.as_mut().expect("a stream per rank");
            match read_msg(s) {
                Ok(Msg::Hello(h)) if h.rank == r => hellos.push(h),
                Ok(other) => return Err(boot(0, format!("rank {r} sent {other:?} instead of its hello"))),
                Err(e) => return Err(boot(0, format!("reading rank {r}'s hello: {e}"))),
            }
        }
        let peers = table(hellos);
        let wire: Vec<Peer> = peers.iter().map(|p| Peer { addr: p.addr, node: p.node, pid: p.pid }).collect();
        for (r, s) in streams.iter_mut().enumerate().skip(1) {
            let s = s.as_mut().expect("a stream per rank");
            write_msg(s, &Msg::Table(wire.clone())).map_err(|e| boot(0, format!("sending the table to rank {r}: {e}")))?;
        }
        let readers: Vec<Option<TcpStream>> =
            streams.iter().map(|s| s.as_ref().and_then(|s| s.try_clone().ok())).collect();
        let writers = Arc::new(streams.into_iter().map(Mutex::new).collect::<Vec<_>>());
        let ctl = Control { rank: 0, writers, exit: Arc::default(), abort };
        for (r, reader) in readers.into_iter().enumerate().skip(1) {
            let reader = reader.ok_or_else(|| boot(0, format!("cannot clone the control stream of rank {r}")))?;
            ctl.spawn_root_reader(r, reader, size);
        }
        let writers = ctl.writers.clone();
        ctl.abort.set_notify(Box::new(move |reason| {
            for r in 1..size {
                send_to(&writers, r, &Msg::Abort(reason.to_string()));
            }
        }));
        Ok((ctl, peers))
    }

    fn spawn_root_reader(&self, r: usize, mut reader: TcpStream, size: usize) {
        let (writers, exit, abort) = (self.writers.clone(), self.exit.clone(), self.abort.clone());
        std::thread::spawn(move || loop {
            match read_msg(&mut reader) {
                Ok(Msg::Abort(reason)) => {
                    abort.set_local(&reason);
                    for other in (1..size).filter(|&o| o != r) {
                        send_to(&writers, other, &Msg::Abort(reason.clone()));
                    }
                }
                Ok(Msg::Bye) => {
                    let mut st = exit.state.lock().unwrap_or_else(|e| e.into_inner());
                    st.byes += 1;
                    exit.cv.notify_all();
                    return;
                }
                Ok(other) => log::warn!("control: unexpected message from rank {r}: {other:?}"),
                Err(e) => {
                    let reason = format!("rank {r} died or left without finishing (control connection: {e})");
                    log::error!("{reason}");
                    abort.raise(&reason);
                    return;
                }
            }
        });
    }

    /// Any rank but 0: sends `hello` to rank 0 over `stream`, waits for the table, and starts the
    /// reader.
    pub fn member(mut stream: TcpStream, hello: Hello, abort: Arc<AbortState>) -> Result<(Self, Vec<PeerInfo>)> {
        let rank = hello.rank;
        write_msg(&mut stream, &Msg::Hello(hello)).map_err(|e| boot(rank, format!("sending hello to rank 0: {e}")))?;
        let peers = match read_msg(&mut stream) {
            Ok(Msg::Table(p)) => p.into_iter().map(|p| PeerInfo { addr: p.addr, node: p.node, pid: p.pid }).collect(),
            Ok(other) => return Err(boot(rank, format!("rank 0 sent {other:?} instead of the table"))),
            Err(e) => return Err(boot(rank, format!("waiting for the table from rank 0: {e}"))),
        };
        let mut reader = stream.try_clone().map_err(|e| Error::io("clone control stream", e))?;
        let writers = Arc::new(vec![Mutex::new(Some(stream))]);
        let ctl = Control { rank, writers, exit: Arc::default(), abort };
        let (exit, abort) = (ctl.exit.clone(), ctl.abort.clone());
        std::thread::spawn(move || loop {
            match read_msg(&mut reader) {
                Ok(Msg::Abort(reason)) => abort.set_local(&reason),
                Ok(Msg::ByeAck) => {
                    exit.state.lock().unwrap_or_else(|e| e.into_inner()).acked = true;
                    exit.cv.notify_all();
                    return;
                }
                Ok(other) => log::warn!("control: unexpected message from rank 0: {other:?}"),
                Err(e) => {
                    abort.set_local(&format!("rank 0 died or closed the job (control connection: {e})"));
                    exit.cv.notify_all();
                    return;
                }
            }
        });
        let writers = ctl.writers.clone();
        ctl.abort.set_notify(Box::new(move |reason| send_to(&writers, 0, &Msg::Abort(reason.to_string()))));
        Ok((ctl, peers))
    }

    /// Leaves the job together with every other rank; gives up after `timeout` (or at once if the
    /// job was aborted) so that shutdown never hangs.
    pub fn finish(&self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        let size = self.writers.len();
        if self.rank != 0 {
            send_to(&self.writers, 0, &Msg::Bye);
        }
        let mut st = self.exit.state.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            let done = if self.rank == 0 { st.byes + 1 >= size } else { st.acked };
            if done || self.abort.is_set() || Instant::now() >= deadline {
                break;
            }
            st = self.exit.cv.wait_timeout(st, Duration::from_millis(50)).unwrap_or_else(|e| e.into_inner()).0;
        }
        drop(st);
        if self.rank == 0 {
            for r in 1..size {
                send_to(&self.writers, r, &Msg::ByeAck);
            }
        }
    }
}

fn boot(rank: usize, msg: String) -> Error {
    Error::Bootstrap { rank, msg }
}
