//! Mutual authentication of a TCP connection between two ranks of one job.
//!
//! Why: a rank's listener is reachable by anything on the network; only processes holding the job's
//! 128-bit secret may open a link, and a connection must say which link it is for. Protocol (all
//! integers little-endian, every message fixed-size):
//!
//! ```text
//! server -> client: MAGIC(8) VERSION(4) server_nonce(32)
//! client -> server: header = MAGIC(8) VERSION(4) from(4) to(4) comm_id(8) tag(4) client_nonce(32)
//!                   HMAC-SHA256(secret, "client" || server_nonce || header)(32)
//! server -> client: HMAC-SHA256(secret, "server" || client_nonce || header)(32)
//! ```
//!
//! Invariants: every read has a deadline (a stalled peer cannot hold a handshake forever) and a fixed
//! size; the client's first bytes must come within [`IDLE_LIMIT`] (a real client answers the server
//! hello at once, so idle or half-open connections give their slot back quickly); a client turned
//! away before the server hello (all handshake slots busy) is told it may retry ([`ClientError`]); MACs are compared in constant time; the server calls the caller's admission check only
//! after the client proved it holds the secret and replies only if the check passes, so a rejected
//! connection sees EOF and claims nothing.

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use sha2::Sha256;

const MAGIC: [u8; 8] = *b"MESHTRN\x01";
const VERSION: u32 = 1;
const NONCE: usize = 32;
const MAC_LEN: usize = 32;
const HELLO_LEN: usize = 8 + 4 + NONCE;
const HEADER_LEN: usize = 8 + 4 + 4 + 4 + 8 + 4 + NONCE;
/// How long the server waits for a client's first bytes after its hello.
pub const IDLE_LIMIT: Duration = Duration::from_secs(1);

/// Why the client side failed, and whether connecting again may succeed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientError {
    /// What happened.
    pub msg: String,
    /// The server closed or reset the connection before its hello (busy: all handshake slots
    /// taken); a new connection may be admitted.
    pub retry: bool,
}

impl std::fmt::Display for ClientError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.msg)
    }
}

/// What a client asks for: the link (or raw stream) `tag` of communicator `comm_id` from world rank
/// `from` to world rank `to`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Request {
    /// Rank of the connecting process.
    pub from: u32,
    /// Rank the client believes it reaches.
    pub to: u32,
    /// Communicator the stream belongs to.
    pub comm_id: u64,
    /// Distinguishes several streams of one pair on one communicator.
    pub tag: u32,
}

impl Request {
    fn encode(&self, nonce: &[u8; NONCE]) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        h[..8].copy_from_slice(&MAGIC);
        h[8..12].copy_from_slice(&VERSION.to_le_bytes());
        h[12..16].copy_from_slice(&self.from.to_le_bytes());
        h[16..20].copy_from_slice(&self.to.to_le_bytes());
        h[20..28].copy_from_slice(&self.comm_id.to_le_bytes());
        h[28..32].copy_from_slice(&self.tag.to_le_bytes());
        h[32..].copy_from_slice(nonce);
        h
    }

    fn decode(h: &[u8; HEADER_LEN]) -> Request {
        let u32_at = |o: usize| u32::from_le_bytes([h[o], h[o + 1], h[o + 2], h[o + 3]]);
        let mut comm = [0u8; 8];
        comm.copy_from_slice(&h[20..28]);
        Request {
            from: u32_at(12),
            to: u32_at(16),
            comm_id: u64::from_le_bytes(comm),
            tag: u32_at(28),
        }
    }
}

/// Runs the client side: proves knowledge of `secret`, sends `req`, checks the server's proof.
/// Returns a human-readable reason on failure.
pub fn client(
    stream: &mut TcpStream,
    secret: &[u8; 16],
    req: &Request,
    timeout: Duration,
) -> Result<(), ClientError> {
    let deadline = Instant::now() + timeout;
    let mut hello = [0u8; HELLO_LEN];
    read_by(stream, &mut hello, deadline, "server hello").map_err(|msg| ClientError { msg, retry: true })?;
    let fatal = |msg: String| ClientError { msg, retry: false };
    if hello[..8] != MAGIC || hello[8..12] != VERSION.to_le_bytes() {
        return Err(fatal("server hello has a wrong magic or version (not a meshtrain rank?)".into()));
    }
    client_proof(stream, secret, req, &hello, deadline).map_err(fatal)
}

fn client_proof(
    stream: &mut TcpStream,
    secret: &[u8; 16],
    req: &Request,
    hello: &[u8; HELLO_LEN],
    deadline: Instant,
) -> Result<(), String> {
    let nonce = random_nonce()?;
    let header = req.encode(&nonce);
    let mut msg = [0u8; HEADER_LEN + MAC_LEN];
    msg[..HEADER_LEN].copy_from_slice(&header);
    msg[HEADER_LEN..].copy_from_slice(&proof(secret, b"client", &hello[12..], &header));
    write_by(stream, &msg, deadline)?;
    let mut reply = [0u8; MAC_LEN];
    read_by(stream, &mut reply, deadline, "server proof")
        .map_err(|e| format!("{e} (server rejected us?)"))?;
    verify(secret, b"server", &nonce, &header, &reply)
        .map_err(|_| "server proof is wrong (wrong job secret)".into())
}

/// Runs the server side: sends a nonce, reads and authenticates the client's request, asks `admit`
/// whether to take it, and only then proves itself. Returns the admitted request or the reason for
/// rejecting the connection.
pub fn server(
    stream: &mut TcpStream,
    secret: &[u8; 16],
    timeout: Duration,
    admit: impl FnOnce(&Request) -> Result<(), String>,
) -> Result<Request, String> {
    let deadline = Instant::now() + timeout;
    let nonce = random_nonce()?;
    let mut hello = [0u8; HELLO_LEN];
    hello[..8].copy_from_slice(&MAGIC);
    hello[8..12].copy_from_slice(&VERSION.to_le_bytes());
    hello[12..].copy_from_slice(&nonce);
    write_by(stream, &hello, deadline)?;
    let mut magic = [0u8; 8];
    read_by(stream, &mut magic, deadline.min(Instant::now() + IDLE_LIMIT), "client magic (idle connection)")?;
    if magic != MAGIC {
        return Err(format!(
            "bad magic \"{}\" (not a meshtrain client)",
            magic.escape_ascii()
        ));
    }
    let mut header = [0u8; HEADER_LEN];
    header[..8].copy_from_slice(&magic);
    read_by(stream, &mut header[8..], deadline, "client header")?;
    if header[8..12] != VERSION.to_le_bytes() {
        return Err("client speaks another protocol version".into());
    }
    let mut mac = [0u8; MAC_LEN];
    read_by(stream, &mut mac, deadline, "client proof")?;
    verify(secret, b"client", &nonce, &header, &mac)
        .map_err(|_| "client proof is wrong (wrong job secret)")?;
    let req = Request::decode(&header);
    admit(&req)?;
    let client_nonce = &header[HEADER_LEN - NONCE..];
    write_by(stream, &proof(secret, b"server", client_nonce, &header), deadline)?;
    Ok(req)
}

fn proof(secret: &[u8; 16], role: &[u8], nonce: &[u8], header: &[u8]) -> [u8; MAC_LEN] {
    let mut mac = keyed(secret);
    mac.update(role);
    mac.update(nonce);
    mac.update(header);
    mac.finalize().into_bytes().into()
}

fn verify(secret: &[u8; 16], role: &[u8], nonce: &[u8], header: &[u8], tag: &[u8]) -> Result<(), ()> {
    let mut mac = keyed(secret);
    mac.update(role);
    mac.update(nonce);
    mac.update(header);
    mac.verify_slice(tag).map_err(|_| ())
}

fn keyed(secret: &[u8; 16]) -> Hmac<Sha256> {
    // HMAC accepts keys of any length, so this cannot fail.
    <Hmac<Sha256> as Mac>::new_from_slice(secret).expect("HMAC takes any key length")
}

fn random_nonce() -> Result<[u8; NONCE], String> {
    let mut n = [0u8; NONCE];
    getrandom::getrandom(&mut n).map_err(|e| format!("no randomness for a nonce: {e}"))?;
    Ok(n)
}

/// Reads exactly `buf.len()` bytes before `deadline`, however slowly they trickle in.
fn read_by(stream: &mut TcpStream, buf: &mut [u8], deadline: Instant, what: &str) -> Result<(), String> {
    let mut got = 0;
    while got < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!(
                "timed out reading the {what} ({got} of {} bytes)",
                buf.len()
            ));
        }
        stream
            .set_read_timeout(Some(left))
            .map_err(|e| format!("set read timeout: {e}"))?;
        match stream.read(&mut buf[got..]) {
            Ok(0) => {
                return Err(format!(
                    "connection closed during the {what} ({got} of {} bytes)",
                    buf.len()
                ))
            }
            Ok(n) => got += n,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return Err(format!(
                    "timed out reading the {what} ({got} of {} bytes)",
                    buf.len()
                ))
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(format!("reading the {what}: {e}")),
        }
    }
    Ok(())
}

fn write_by(stream: &mut TcpStream, buf: &[u8], deadline: Instant) -> Result<(), String> {
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    stream
        .set_write_timeout(Some(left))
        .map_err(|e| format!("set write timeout: {e}"))?;
    stream.write_all(buf).map_err(|e| format!("handshake write: {e}"))
}
