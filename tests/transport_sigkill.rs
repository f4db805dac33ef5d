//! A rank killed with SIGKILL must turn into an error naming it on its peer, over shared memory and
//! over TCP, and must leave nothing in /dev/shm.
//!
//! The test binary re-executes itself to get a second process: the child (selected by
//! `MESHTRAIN_TEST_CHILD`) plays rank 1, opens its link to rank 0, posts one chunk and sleeps until it
//! is killed.

use std::io::{BufRead, BufReader};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use meshtrain::transport::net::{NetConfig, NetConnector, PeerInfo};
use meshtrain::transport::{AbortState, Connector, LinkKind, Waiter};
use meshtrain::Error;

const CHILD_ENV: &str = "MESHTRAIN_TEST_CHILD";
const SECRET: [u8; 16] = *b"sigkill-secret!!";
const COMM: u64 = 0x51;

fn connector(rank: usize, force_tcp: bool, job_tag: &str) -> NetConnector {
    let mut cfg = NetConfig::new(IpAddr::V4(Ipv4Addr::LOCALHOST), job_tag);
    cfg.force_tcp = force_tcp;
    cfg.shm_chunk = 4096;
    cfg.tcp_chunk = 4096;
    NetConnector::new(rank, 2, SECRET, cfg, Arc::new(AbortState::default())).expect("connector")
}

fn waiter(rank: usize) -> Waiter {
    Waiter::new(
        rank,
        "sigkill-test",
        0,
        0,
        Duration::from_secs(30),
        Arc::new(AbortState::default()),
    )
}

/// Rank 1 in the child process: link to rank 0, post one chunk, wait to be killed.
fn child(spec: &str) {
    let mut parts = spec.split(',');
    let parent: SocketAddr = parts.next().and_then(|a| a.parse().ok()).expect("parent address");
    let force_tcp = parts.next() == Some("tcp");
    let job_tag = parts.next().expect("job tag");
    let c = connector(1, force_tcp, job_tag);
    println!("CHILD_ADDR {}", c.local_addr());
    let parent_pid = std::os::unix::process::parent_id();
    let me = PeerInfo {
        addr: c.local_addr(),
        node: 0,
        pid: std::process::id(),
    };
    c.set_peers(vec![
        PeerInfo {
            addr: parent,
            node: 0,
            pid: parent_pid,
        },
        me,
    ])
    .expect("peers");
    let w = waiter(1);
    let mut link = c.connect(COMM, 0, &w).expect("child connect");
    link.send
        .reserve(5, &w)
        .expect("reserve")
        .copy_from_slice(b"alive");
    link.send.post(5, &w).expect("post");
    std::thread::sleep(Duration::from_secs(60));
}

/// Kills and reaps the child rank however the test ends.
struct ChildRank(Child);

impl Drop for ChildRank {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn killed_peer_is_reported(force_tcp: bool) {
    let kind = if force_tcp { "tcp" } else { "shm" };
    let job_tag = format!("sigkill{kind}{}", std::process::id());
    let c = connector(0, force_tcp, &job_tag);
    let test = format!("killed_{kind}_peer_is_reported");
    let proc = Command::new(std::env::current_exe().expect("test binary"))
        .args([test.as_str(), "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, format!("{},{kind},{job_tag}", c.local_addr()))
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn child rank");
    let mut proc = ChildRank(proc);
    let lines = BufReader::new(proc.0.stdout.take().expect("child stdout")).lines();
    let addr: SocketAddr = lines
        .map_while(|l| l.ok())
        // libtest may print "test <name> ... " on the same line first.
        .find_map(|l| l.split("CHILD_ADDR ").nth(1).and_then(|a| a.trim().parse().ok()))
        .expect("child address");
    let me = PeerInfo {
        addr: c.local_addr(),
        node: 0,
        pid: std::process::id(),
    };
    c.set_peers(vec![
        me,
        PeerInfo {
            addr,
            node: 0,
            pid: proc.0.id(),
        },
    ])
    .expect("peers");
    let w = waiter(0);
    let mut link = c.connect(COMM, 1, &w).expect("parent connect");
    assert_eq!(link.kind, if force_tcp { LinkKind::Tcp } else { LinkKind::Shm });
    assert_eq!(link.recv.wait(&w).expect("first chunk"), b"alive");
    link.recv.release(&w).expect("release");
    let prefix = c.shm_prefix().to_string();
    let left: Vec<_> = std::fs::read_dir("/dev/shm")
        .expect("list /dev/shm")
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with(&prefix))
        .collect();
    assert_eq!(left, Vec::<String>::new(), "segment names left in /dev/shm");

    proc.0.kill().expect("SIGKILL the child rank");
    match link.recv.wait(&w) {
        Err(Error::Comm { rank: 0, peer: 1, .. }) => {}
        other => panic!(
            "expected a Comm error naming rank 1, got {:?}",
            other.map(|b| b.to_vec())
        ),
    }
    // The send side fails too once the FIFO is full (shm) or the socket reports the reset (tcp).
    let err = loop {
        let r = match link.send.reserve(4096, &w) {
            Ok(_) => link.send.post(4096, &w),
            Err(e) => Err(e),
        };
        if let Err(e) = r {
            break e;
        }
    };
    assert!(matches!(err, Error::Comm { rank: 0, peer: 1, .. }), "{err}");
}

#[test]
fn killed_shm_peer_is_reported() {
    match std::env::var(CHILD_ENV) {
        Ok(spec) => child(&spec),
        Err(_) => killed_peer_is_reported(false),
    }
}

#[test]
fn killed_tcp_peer_is_reported() {
    match std::env::var(CHILD_ENV) {
        Ok(spec) => child(&spec),
        Err(_) => killed_peer_is_reported(true),
    }
}
