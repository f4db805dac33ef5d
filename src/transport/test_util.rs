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

/// Two ends of a loopback TCP connection.
pub fn stream_pair() -> (TcpStream, TcpStream) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let a = TcpStream::connect(listener.local_addr().expect("addr")).expect("connect");
    let (b, _) = listener.accept().expect("accept");
    (a, b)
}
