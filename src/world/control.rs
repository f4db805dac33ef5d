//! The control channel: one authenticated TCP stream from every rank to rank 0, used to exchange
//! listener addresses at start, to spread a job-wide abort, to decide which rank failed, and to
//! leave together at the end.
//!
//! Blame: a rank whose operation fails on a peer (timeout, closed link) does not accuse that
//! neighbour at once; it reports a `Suspect` to rank 0, the arbiter, and waits for the verdict.
//! Rank 0 knows the dead ranks (their control stream closed) and otherwise pings every rank: a
//! rank that does not answer within [`PING_WAIT`] is stopped, hung or dead and is blamed; if all
//! answer, a rank that is in no communication operation (its flight record, [`flight`]) is
//! behind and is blamed. Every verdict starts with `blame: rank N:` and becomes the job-wide abort
//! reason, so every survivor names the same rank. A member that gets no verdict blames rank 0
//! itself (its reader threads answer at once unless the process is stopped or hung).
//!
//! Messages are length-prefixed JSON (at most [`MAX_MSG`] bytes). Invariants:
//! - start-up reads have a deadline (`MESHTRAIN_BOOTSTRAP_TIMEOUT`): rank 0 names the rank whose
//!   hello did not come; members wait a little longer for the table, so that rank 0 reports first;
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

use crate::comm::flight;
use crate::error::{Error, Result};
use crate::transport::net::PeerInfo;
use crate::transport::AbortState;

/// Largest control message accepted.
const MAX_MSG: usize = 16 << 20;
/// How long rank 0 waits for every rank's answer to a liveness check.
const PING_WAIT: Duration = Duration::from_secs(2);

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
    /// A member's failure on a peer, for rank 0 to arbitrate.
    Suspect(String),
    /// Rank 0's liveness check (round number).
    Ping(u64),
    /// A member's answer: the round and what it is doing.
    Pong(u64, Progress),
}

/// What a rank is doing, from its flight record.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct Progress {
    in_progress: Vec<String>,
    last_done: Option<String>,
}

impl Progress {
    fn now() -> Self {
        Progress { in_progress: flight::in_progress(), last_done: flight::last_done() }
    }
}

/// Rank 0's liveness checks: one at a time; answers by rank.
#[derive(Default)]
struct Liveness {
    one_at_a_time: Mutex<()>,
    state: Mutex<LiveState>,
    cv: Condvar,
}

#[derive(Default)]
struct LiveState {
    round: u64,
    answers: Vec<Option<Progress>>,
}

/// Reads one message before `deadline`, naming `what` when it does not come.
fn read_msg_by(s: &mut TcpStream, deadline: Instant, what: &str) -> std::result::Result<Msg, String> {
    let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    s.set_read_timeout(Some(left)).map_err(|e| format!("set read timeout: {e}"))?;
    let msg = read_msg(s).map_err(|e| match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            format!("{what} did not come within the bootstrap deadline (MESHTRAIN_BOOTSTRAP_TIMEOUT)")
        }
        std::io::ErrorKind::UnexpectedEof => format!("{what}: the connection closed (that rank failed or exited)"),
        _ => format!("{what}: {e}"),
    })?;
    s.set_read_timeout(None).map_err(|e| format!("clear read timeout: {e}"))?;
    Ok(msg)
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
    live: Arc<Liveness>,
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
        timeout: Duration,
        table: impl FnOnce(Vec<Hello>) -> Vec<PeerInfo>,
    ) -> Result<(Self, Vec<PeerInfo>)> {
        let size = streams.len();
        let deadline = Instant::now() + timeout;
        let mut streams = streams;
        let mut hellos = vec![own];
        for (r, s) in streams.iter_mut().enumerate().skip(1) {
            let s = s.as_mut().expect("a stream per rank");
            match read_msg_by(s, deadline, &format!("rank {r}'s hello")) {
                Ok(Msg::Hello(h)) if h.rank == r => hellos.push(h),
                Ok(other) => return Err(boot(0, format!("rank {r} sent {other:?} instead of its hello"))),
                Err(e) => return Err(boot(0, format!("blame: rank {r}: connected but stalled: {e}"))),
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
        let ctl = Control { rank: 0, writers, exit: Arc::default(), abort, live: Arc::default() };
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
        let (writers, live, abort) = (ctl.writers.clone(), ctl.live.clone(), Arc::downgrade(&ctl.abort));
        ctl.abort.set_arbiter(Box::new(move |what| {
            if let Some(abort) = abort.upgrade() {
                arbitrate(&writers, &live, &abort, what);
            }
            None
        }));
        Ok((ctl, peers))
    }

    fn spawn_root_reader(&self, r: usize, mut reader: TcpStream, size: usize) {
        let (writers, exit, abort) = (self.writers.clone(), self.exit.clone(), self.abort.clone());
        let live = self.live.clone();
        std::thread::spawn(move || loop {
            match read_msg(&mut reader) {
                Ok(Msg::Suspect(what)) => {
                    let (writers, live, abort) = (writers.clone(), live.clone(), abort.clone());
                    std::thread::spawn(move || arbitrate(&writers, &live, &abort, &what));
                }
                Ok(Msg::Pong(round, progress)) => {
                    let mut st = live.state.lock().unwrap_or_else(|e| e.into_inner());
                    if st.round == round && r < st.answers.len() {
                        st.answers[r] = Some(progress);
                        live.cv.notify_all();
                    }
                }
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
                Err(e) if abort.is_set() => {
                    // The job is already ending (an agreed stop or an abort with its own reason):
                    // ranks leaving now are not to blame.
                    log::debug!("control: rank {r} left after the job-wide abort: {e}");
                    return;
                }
                Err(e) => {
                    let reason =
                        format!("blame: rank {r}: died or left without finishing (its control connection closed: {e})");
                    log::error!("{reason}");
                    abort.raise(&reason);
                    return;
                }
            }
        });
    }

    /// Any rank but 0: sends `hello` to rank 0 over `stream`, waits for the table, and starts the
    /// reader.
    pub fn member(
        mut stream: TcpStream,
        hello: Hello,
        abort: Arc<AbortState>,
        timeout: Duration,
    ) -> Result<(Self, Vec<PeerInfo>)> {
        let rank = hello.rank;
        write_msg(&mut stream, &Msg::Hello(hello)).map_err(|e| boot(rank, format!("sending hello to rank 0: {e}")))?;
        let table = "the table of all ranks from rank 0 (it sends it once every rank said hello)";
        let peers = match read_msg_by(&mut stream, Instant::now() + timeout, table) {
            Ok(Msg::Table(p)) => p.into_iter().map(|p| PeerInfo { addr: p.addr, node: p.node, pid: p.pid }).collect(),
            Ok(other) => return Err(boot(rank, format!("rank 0 sent {other:?} instead of the table"))),
            Err(e) => return Err(boot(rank, e)),
        };
        let mut reader = stream.try_clone().map_err(|e| Error::io("clone control stream", e))?;
        let writers = Arc::new(vec![Mutex::new(Some(stream))]);
        let ctl = Control { rank, writers, exit: Arc::default(), abort, live: Arc::default() };
        let (exit, abort, answer) = (ctl.exit.clone(), ctl.abort.clone(), ctl.writers.clone());
        std::thread::spawn(move || loop {
            match read_msg(&mut reader) {
                Ok(Msg::Abort(reason)) => abort.set_local(&reason),
                Ok(Msg::Ping(round)) => send_to(&answer, 0, &Msg::Pong(round, Progress::now())),
                Ok(Msg::ByeAck) => {
                    exit.state.lock().unwrap_or_else(|e| e.into_inner()).acked = true;
                    exit.cv.notify_all();
                    return;
                }
                Ok(other) => log::warn!("control: unexpected message from rank 0: {other:?}"),
                Err(e) => {
                    abort.set_local(&format!("blame: rank 0: died or closed the job (control connection: {e})"));
                    exit.cv.notify_all();
                    return;
                }
            }
        });
        let writers = ctl.writers.clone();
        ctl.abort.set_notify(Box::new(move |reason| send_to(&writers, 0, &Msg::Abort(reason.to_string()))));
        let writers = ctl.writers.clone();
        ctl.abort.set_arbiter(Box::new(move |what| {
            send_to(&writers, 0, &Msg::Suspect(what.to_string()));
            // Rank 0's reader threads answer at once unless its process is stopped or hung.
            Some(format!(
                "blame: rank 0: the arbiter did not answer within {} s (stopped or hung); first report: {what}",
                crate::transport::VERDICT_WAIT.as_secs()
            ))
        }));
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

/// Rank 0: decides which rank failed after `what` was reported (by any rank) and raises the
/// verdict job-wide; nothing if the job is already aborting.
fn arbitrate(writers: &[Mutex<Option<TcpStream>>], live: &Liveness, abort: &AbortState, what: &str) {
    let _one = live.one_at_a_time.lock().unwrap_or_else(|e| e.into_inner());
    if abort.is_set() {
        return;
    }
    let size = writers.len();
    let round = {
        let mut st = live.state.lock().unwrap_or_else(|e| e.into_inner());
        st.round += 1;
        st.answers = vec![None; size];
        st.answers[0] = Some(Progress::now());
        st.round
    };
    for r in 1..size {
        send_to(writers, r, &Msg::Ping(round));
    }
    let give_up = Instant::now() + PING_WAIT;
    let mut st = live.state.lock().unwrap_or_else(|e| e.into_inner());
    while st.answers.iter().any(Option::is_none) && Instant::now() < give_up && !abort.is_set() {
        st = live.cv.wait_timeout(st, Duration::from_millis(20)).unwrap_or_else(|e| e.into_inner()).0;
    }
    let answers = std::mem::take(&mut st.answers);
    drop(st);
    if abort.is_set() {
        return;
    }
    for (r, a) in answers.iter().enumerate() {
        match a {
            Some(p) => log::error!("liveness check: rank {r}: in progress {:?}, last done {:?}", p.in_progress, p.last_done),
            None => log::error!("liveness check: rank {r}: no answer within {} s", PING_WAIT.as_secs()),
        }
    }
    let silent: Vec<usize> = (0..size).filter(|&r| answers[r].is_none()).collect();
    let idle: Vec<usize> = (0..size).filter(|&r| answers[r].as_ref().is_some_and(|p| p.in_progress.is_empty())).collect();
    let verdict = if !silent.is_empty() {
        format!(
            "blame: {}: did not answer rank 0's liveness check within {} s (stopped, hung or dead); first report: {what}",
            list(&silent),
            PING_WAIT.as_secs()
        )
    } else if !idle.is_empty() {
        let last = answers[idle[0]].as_ref().and_then(|p| p.last_done.clone()).unwrap_or_else(|| "none".into());
        format!(
            "blame: {}: alive but in no communication operation while its peers wait (behind; its last finished \
             operation: {last}); first report: {what}",
            list(&idle)
        )
    } else {
        format!("blame: no rank is dead, stopped or idle; first report: {what}")
    };
    log::error!("{verdict}");
    abort.raise(&verdict);
}

/// `rank 3` or `ranks 2, 3`.
fn list(ranks: &[usize]) -> String {
    let names: Vec<String> = ranks.iter().map(|r| r.to_string()).collect();
    format!("rank{} {}", if ranks.len() > 1 { "s" } else { "" }, names.join(", "))
}

fn boot(rank: usize, msg: String) -> Error {
    Error::Bootstrap { rank, msg }
}
