//! Whether the single-copy schedules ([`crate::comm::algo::read`]) work, and pay, between the
//! members of a communicator.
//!
//! Why: reading a peer's memory can be forbidden (Yama ptrace scope, container seccomp, another
//! pid namespace, links that are not shared memory), and where it works the kernel's copy can be
//! slower than the two user-space copies of a FIFO. Every member probes at the same call, and the
//! answer is exchanged so that all members agree and pick the same schedules.
//!
//! Invariant: the probe is one exchange over the all-pairs links (a token inline, the same token
//! exposed, one verdict each way); it leaves no message unread.

use crate::comm::algo::direct::{DirectShape, Peers};
use crate::error::{Error, Result};
use crate::transport::{cma, Waiter};

/// What the probe found, the same on every member.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reads {
    /// Reads work and one kernel copy moves bytes at least as fast as the two user-space copies
    /// through a FIFO ([`cma::CopyRates`]).
    Pay,
    /// Reads work, but cost more than the FIFO's copies (the measured rates).
    Slow(String),
    /// Reads do not work (why).
    Fail(String),
}

impl Reads {
    /// Verdict kinds in the order in which they win a disagreement.
    fn kind(&self) -> u8 {
        match self {
            Reads::Pay => 0,
            Reads::Slow(_) => 1,
            Reads::Fail(_) => 2,
        }
    }
}

/// Bytes of a verdict: its kind and, after it, the reason (UTF-8, zero padded, cut to fit).
const VERDICT_MSG: usize = 128;

/// This rank's verdict: whether it could read every peer, and how fast its kernel copies.
fn own_verdict<P: Peers>(peers: &mut P, s: &DirectShape, w: &Waiter) -> Result<Reads> {
    let mut failure = None;
    for from in s.peers() {
        let mut rx = peers.rx(from);
        let mut want = [0u8; 16];
        rx.recv(&mut want, w)?;
        let exposed = rx.wait_exposed(want.len(), w)?;
        let mut got = [0u8; 16];
        let why = match rx.try_read(exposed, &mut got) {
            Ok(()) if got == want => continue,
            Ok(()) => "read other bytes than it exposed (a process of another pid namespace?)".to_string(),
            Err(cause) => cause,
        };
        failure.get_or_insert(format!("reading rank {from}: {why}"));
    }
    if let Some(why) = failure {
        return Ok(Reads::Fail(why));
    }
    Ok(match cma::copy_rates() {
        Err(why) => Reads::Fail(why),
        Ok(r) if r.kernel_pays() => Reads::Pay,
        Ok(r) => Reads::Slow(format!(
            "one kernel copy moves {:.1} GB/s, two FIFO copies {:.1} GB/s",
            r.kernel / 1e9,
            r.fifo / 1e9
        )),
    })
}

/// Probes: each rank exposes a random token and also sends it inline; each peer reads it through
/// memory and compares, and measures its copy rates; then every rank sends every other its
/// verdict. The answer is the worst verdict (fail over slow over pay), from the lowest rank among
/// equals, its reason prefixed with that rank (`"rank 2: ..."`). (A probe that fails on a dead
/// peer fails the job, so its token, on this stack, needs no settling.)
pub fn probe<P: Peers>(peers: &mut P, s: &DirectShape, w: &Waiter) -> Result<Reads> {
    let mut token = [0u8; 16];
    getrandom::getrandom(&mut token).map_err(|e| {
        Error::io("probe token from the OS random source", std::io::Error::other(e.to_string()))
    })?;
    for to in s.peers() {
        let mut tx = peers.tx(to);
        tx.send(&token, w)?;
        tx.expose(&token, w)?;
    }
    let mine = own_verdict(peers, s, w)?;
    let mut msg = [0u8; VERDICT_MSG];
    msg[0] = mine.kind();
    if let Reads::Slow(why) | Reads::Fail(why) = &mine {
        let len = why.len().min(VERDICT_MSG - 1);
        msg[1..1 + len].copy_from_slice(&why.as_bytes()[..len]);
    }
    for to in s.peers() {
        peers.tx(to).send(&msg, w)?;
    }
    let mut worst = (mine, s.me);
    for from in s.peers() {
        let mut v = [0u8; VERDICT_MSG];
        let mut rx = peers.rx(from);
        rx.recv(&mut v, w)?;
        let end = v[1..].iter().position(|&b| b == 0).map_or(VERDICT_MSG, |p| p + 1);
        let why = String::from_utf8_lossy(&v[1..end]).into_owned();
        let theirs = match v[0] {
            0 => Reads::Pay,
            1 => Reads::Slow(why),
            2 => Reads::Fail(why),
            k => return Err(w.fail(rx.peer, format!("protocol error: probe verdict of kind {k}"))),
        };
        let (kind, best) = (theirs.kind(), worst.0.kind());
        if kind > best || (kind == best && from < worst.1) {
            worst = (theirs, from);
        }
    }
    Ok(match worst {
        (Reads::Pay, _) => Reads::Pay,
        (Reads::Slow(why), r) => Reads::Slow(format!("rank {r}: {why}")),
        (Reads::Fail(why), r) => Reads::Fail(format!("rank {r}: {why}")),
    })
}
