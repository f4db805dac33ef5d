//! Helpers shared by the transport tests: recognisable chunk contents, a sender pump and a checking
//! receiver that work over any [`SendLink`]/[`RecvLink`], and loopback stream pairs.

use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use super::{AbortState, RecvLink, SendLink, Waiter};

/// A waiter for tests that gives up after `secs` seconds.
pub fn waiter(rank: usize, secs: u64) -> Waiter {
    Waiter::new(
        rank,
        "test",
        0,
        0,
        Duration::from_secs(secs),
        Arc::new(AbortState::default()),
    )
}

/// Length of chunk `i` of a test stream: cycles through 0, the maximum and assorted sizes in between.
pub fn chunk_len(i: usize, max: usize) -> usize {
    match i % 5 {
        0 => 0,
        1 => max,
        2 => 1,
        3 => (i * 7919) % (max + 1),
        _ => max - 1,
    }
}

/// Byte `j` of chunk `i` of the stream tagged `stream`.
pub fn pattern(stream: u8, i: usize, j: usize) -> u8 {
    (i.wrapping_mul(131) ^ j.wrapping_mul(7) ^ (j >> 8) ^ stream as usize) as u8
}

/// Posts `n` chunks of the test stream `stream`.
pub fn pump(send: &mut dyn SendLink, stream: u8, n: usize, w: &Waiter) {
    let max = send.max_chunk();
    for i in 0..n {
        let len = chunk_len(i, max);
        let slot = send.reserve(len, w).expect("reserve");
        for (j, b) in slot.iter_mut().enumerate() {
            *b = pattern(stream, i, j);
        }
        send.post(len, w).expect("post");
    }
}

/// Receives `n` chunks of the test stream `stream` and checks every length and byte.
pub fn drain_check(recv: &mut dyn RecvLink, stream: u8, n: usize, max: usize, w: &Waiter) {
    for i in 0..n {
        let got = recv.wait(w).expect("wait");
        assert_eq!(got.len(), chunk_len(i, max), "length of chunk {i}");
        for (j, &b) in got.iter().enumerate() {
            assert_eq!(b, pattern(stream, i, j), "byte {j} of chunk {i}");
        }
        recv.release(w).expect("release");
    }
}

/// Both directions of a link pair at once: each side pumps `n` chunks (streams 2 and 3) while
/// draining the other's, chunks of at most `max` bytes. `low`/`high` are the two ranks' ends.
pub fn both_directions(
    (ls, lr): (&mut dyn SendLink, &mut dyn RecvLink),
    (hs, hr): (&mut dyn SendLink, &mut dyn RecvLink),
    n: usize,
    max: usize,
) {
    std::thread::scope(|s| {
        s.spawn(|| pump(ls, 2, n, &waiter(0, 30)));
        s.spawn(|| pump(hs, 3, n, &waiter(1, 30)));
        s.spawn(|| drain_check(lr, 3, n, max, &waiter(0, 30)));
        drain_check(hr, 2, n, max, &waiter(1, 30));
    });
}

/// A peer that posts `n` chunks and goes away (its `send` end and its other end `rest` dropped):
/// the receiver gets every posted chunk, then an error that names peer 0 and contains `cause`.
pub fn dead_peer_reported_after_data<S: SendLink, R>(
    mut send: S,
    rest: R,
    recv: &mut dyn RecvLink,
    n: usize,
    max: usize,
    cause_needle: &str,
) {
    let w = waiter(1, 60);
    pump(&mut send, 4, n, &w);
    drop((send, rest));
    drain_check(recv, 4, n, max, &w);
    match recv.wait(&w) {
        Err(crate::error::Error::Comm { peer: 0, cause, .. }) => {
            assert!(cause.contains(cause_needle), "{cause}")
        }
        other => panic!("expected a Comm error naming peer 0, got {:?}", other.map(|b| b.len())),
    }
}

/// A receive from peer 0 that nothing arrives for ends in a timeout naming the peer and the
/// operation's sequence number once a 50 ms deadline passes.
pub fn deadline_is_a_timeout(recv: &mut dyn RecvLink) {
    let w = Waiter::new(1, "test", 7, 0, Duration::from_millis(50), Arc::new(AbortState::default()));
    match recv.wait(&w) {
        Err(crate::error::Error::Timeout { peer: 0, seq: 7, .. }) => {}
        other => panic!("expected Timeout, got {:?}", other.map(|b| b.len())),
    }
}

/// Two ends of a loopback TCP connection.
pub fn stream_pair() -> (TcpStream, TcpStream) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let a = TcpStream::connect(listener.local_addr().expect("addr")).expect("connect");
    let (b, _) = listener.accept().expect("accept");
    (a, b)
}
