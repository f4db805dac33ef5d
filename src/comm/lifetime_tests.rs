//! Communicator lifetimes over the real transports: in-process ranks on [`NetConnector`]s (shared
//! memory, or TCP when forced), each with its own abort state, as separate processes would have.
//!
//! What must hold: a member may drop a communicator the moment its creation returned (a split
//! child, a world) while its peers are still connecting; they still complete creation and drop
//! cleanly. A member that then uses the communicator gets an error naming the rank that left,
//! never a hang and never an error about a missing shared-memory segment. Nothing is left in
//! /dev/shm.

use std::net::{IpAddr, Ipv4Addr};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use crate::comm::{CommConfig, Communicator};
use crate::error::{Error, Result};
use crate::transport::net::{NetConfig, NetConnector};
use crate::transport::{AbortState, Connector};

const SECRET: [u8; 16] = *b"lifetime-secret!";
/// Operation timeout of these tests: a failure must come well before it (no hang).
const TIMEOUT: Duration = Duration::from_secs(20);

/// `k` connectors on 127.0.0.1, all on node 0 (shared memory unless `tcp`), each with its own
/// abort state; an abort raised on one reaches the others (as the bootstrap's control channel
/// forwards it between processes).
fn connectors(k: usize, tcp: bool, tag: &str) -> Vec<Arc<NetConnector>> {
    let mut cfg = NetConfig::new(IpAddr::V4(Ipv4Addr::LOCALHOST), tag);
    cfg.force_tcp = tcp;
    let aborts: Vec<Arc<AbortState>> = (0..k).map(|_| Arc::default()).collect();
    for (r, a) in aborts.iter().enumerate() {
        let others: Vec<Weak<AbortState>> = aborts
            .iter()
            .enumerate()
            .filter(|&(o, _)| o != r)
            .map(|(_, o)| Arc::downgrade(o))
            .collect();
        a.set_notify(Box::new(move |reason| {
            others
                .iter()
                .filter_map(Weak::upgrade)
                .for_each(|o| o.set_local(reason))
        }));
    }
    NetConnector::local_group(SECRET, &cfg, aborts)
        .expect("connectors")
        .into_iter()
        .map(Arc::new)
        .collect()
}

fn comm_config() -> CommConfig {
    CommConfig {
        timeout: TIMEOUT,
        tuning: None,
        chunk_bytes: 256 << 10,
        ..CommConfig::default()
    }
}

/// Runs `f(rank, connector)` on one thread per rank; results in rank order.
fn on_ranks<R: Send>(
    conns: &[Arc<NetConnector>],
    f: impl Fn(usize, &Arc<NetConnector>) -> R + Sync,
) -> Vec<R> {
    std::thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = conns
            .iter()
            .enumerate()
            .map(|(r, c)| s.spawn(move || f(r, c)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect()
    })
}

fn world(c: &Arc<NetConnector>) -> Result<Communicator> {
    Communicator::world(c.clone(), comm_config())
}

/// Names in /dev/shm that belong to this job.
fn shm_left(prefix: &str) -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .expect("list /dev/shm")
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with(prefix))
        .collect()
}

fn label(tcp: bool) -> &'static str {
    if tcp {
        "tcp"
    } else {
        "shm"
    }
}

/// Every member splits `rounds` times and drops each child the moment its own `split` returned,
/// while slower peers may still be connecting to it. Every creation must succeed.
fn split_and_drop_at_once(k: usize, tcp: bool, rounds: usize) {
    let conns = connectors(k, tcp, &format!("split{k}{}", label(tcp)));
    let results = on_ranks(&conns, |rank, c| -> Result<()> {
        let parent = world(c)?;
        for round in 0..rounds {
            // Alternate which members form the child: everyone, then everyone but the last.
            let color = (round % 2 == 0 || rank + 1 < k).then_some(0);
            let child = parent.split(color, rank as i64)?;
            drop(child);
        }
        parent.barrier()
    });
    for (rank, r) in results.into_iter().enumerate() {
        if let Err(e) = r {
            panic!("{} k={k}: rank {rank}: {e}", label(tcp));
        }
    }
    assert_eq!(shm_left(conns[0].shm_prefix()), Vec::<String>::new(), "k={k}");
}

#[test]
fn split_children_dropped_at_once_complete_on_every_member() {
    for tcp in [false, true] {
        for k in 2..=5 {
            split_and_drop_at_once(k, tcp, 12);
        }
    }
}

/// Member 0 creates the world and drops it at once; the last member starts creating only later.
/// The late member still completes creation (member 0's drop waits for it to attach), drops
/// cleanly, and a second world over the same connectors works.
fn late_member(k: usize, tcp: bool) {
    let conns = connectors(k, tcp, &format!("late{k}{}", label(tcp)));
    let results = on_ranks(&conns, |rank, c| -> Result<()> {
        if rank == k - 1 {
            std::thread::sleep(Duration::from_millis(150));
        }
        drop(world(c)?);
        world(c)?.barrier()
    });
    for (rank, r) in results.into_iter().enumerate() {
        if let Err(e) = r {
            panic!("{} k={k}: rank {rank}: {e}", label(tcp));
        }
    }
    assert_eq!(shm_left(conns[0].shm_prefix()), Vec::<String>::new(), "k={k}");
}

#[test]
fn a_member_creating_late_attaches_after_the_creator_dropped() {
    for tcp in [false, true] {
        for k in 2..=5 {
            late_member(k, tcp);
        }
    }
}

/// Member 0 drops a fresh split child (at once, or while the others' barrier is in flight); the
/// others' barrier on it fails, before the timeout, with errors naming a peer; the first to
/// fail can only have failed on rank 0, so some member names rank 0 (the others may name a
/// member that failed before them: without the job's arbiter, as here, each names the peer it
/// saw go); nobody reports a missing segment.
fn use_after_drop(k: usize, tcp: bool, delay: Duration) {
    let conns = connectors(k, tcp, &format!("use{k}{}", label(tcp)));
    let start = Instant::now();
    let results = on_ranks(&conns, |rank, c| -> Result<()> {
        let parent = world(c)?;
        let child = parent
            .split(Some(0), rank as i64)?
            .expect("every member has color 0");
        if rank == 0 {
            std::thread::sleep(delay);
            drop(child);
            return Ok(());
        }
        let r = child.barrier();
        drop(child);
        r
    });
    assert!(start.elapsed() < TIMEOUT / 2, "k={k}: took {:?}", start.elapsed());
    let mut errors = Vec::new();
    for (rank, r) in results.into_iter().enumerate().skip(1) {
        let e = match r {
            Err(e) => e.to_string(),
            Ok(()) => panic!(
                "{} k={k}: rank {rank}: barrier after rank 0 left succeeded",
                label(tcp)
            ),
        };
        assert!(
            !e.contains("shm_open") && !e.contains("No such file"),
            "rank {rank}: {e}"
        );
        assert!(e.contains("peer rank"), "rank {rank}: {e}");
        errors.push(e);
    }
    assert!(
        errors.iter().any(|e| e.contains("peer rank 0")),
        "{} k={k}: nobody names rank 0: {errors:?}",
        label(tcp)
    );
    assert_eq!(shm_left(conns[0].shm_prefix()), Vec::<String>::new(), "k={k}");
}

#[test]
fn using_a_communicator_a_member_dropped_names_that_member() {
    for tcp in [false, true] {
        for k in 2..=5 {
            use_after_drop(k, tcp, Duration::ZERO);
            use_after_drop(k, tcp, Duration::from_millis(50));
        }
    }
}

/// After an abort nobody is waited for: member 0 drops its fresh world at once although member 1
/// has not attached; member 1, arriving later, gets the job's abort (rank 0's reason), not a bare
/// `shm_open` failure about the link rank 0 removed.
#[test]
fn a_drop_after_an_abort_does_not_wait_and_the_late_peer_is_told_why() {
    let conns = connectors(2, false, "abortdrop");
    let results = on_ranks(&conns, |rank, c| -> Result<Duration> {
        if rank == 0 {
            let w = world(c)?;
            c.abort().raise("test: rank 0 gives up");
            let t = Instant::now();
            drop(w);
            return Ok(t.elapsed());
        }
        std::thread::sleep(Duration::from_millis(300));
        world(c).map(|_| Duration::ZERO)
    });
    let took = results[0].as_ref().expect("rank 0");
    assert!(
        *took < Duration::from_millis(250),
        "rank 0's drop waited {took:?}"
    );
    match &results[1] {
        Err(Error::Aborted { rank: 1, reason, .. }) => assert_eq!(reason, "test: rank 0 gives up"),
        other => panic!("expected the job's abort, got {other:?}"),
    }
    assert_eq!(shm_left(conns[0].shm_prefix()), Vec::<String>::new());
}

/// One link, below the communicator: rank 0 opens it, posts three chunks and drops it before
/// rank 1 connected (a point-to-point send, then the communicator dropped). Rank 0's drop waits
/// for rank 1 to map the segment (shm); rank 1, connecting 200 ms later, receives every chunk as
/// over TCP, then an error naming rank 0; no name is left in /dev/shm.
fn link_dropped_before_the_peer_connected(tcp: bool) {
    let conns = connectors(2, tcp, &format!("link{}", label(tcp)));
    let waiter =
        |rank| crate::transport::Waiter::new(rank, "test", 0, 0, TIMEOUT, Arc::new(AbortState::default()));
    let chunks: [&[u8]; 3] = [b"first", b"", &[7u8; 4000]];
    std::thread::scope(|s| {
        s.spawn(|| {
            let w = waiter(0);
            let mut link = conns[0].connect(9, 1, &w).expect("rank 0 connects");
            for c in chunks {
                link.send
                    .reserve(c.len(), &w)
                    .expect("reserve")
                    .copy_from_slice(c);
                link.send.post(c.len(), &w).expect("post");
            }
        });
        std::thread::sleep(Duration::from_millis(200));
        let w = waiter(1);
        let mut link = conns[1].connect(9, 0, &w).expect("rank 1 connects late");
        for c in chunks {
            assert_eq!(link.recv.wait(&w).expect("posted chunk"), c, "{}", label(tcp));
            link.recv.release(&w).expect("release");
        }
        match link.recv.wait(&w) {
            Err(Error::Comm { peer: 0, rank: 1, .. }) => {}
            other => panic!(
                "{}: expected a Comm error naming rank 0, got {:?}",
                label(tcp),
                other.map(|b| b.len())
            ),
        }
    });
    assert_eq!(shm_left(conns[0].shm_prefix()), Vec::<String>::new());
}

#[test]
fn a_link_dropped_before_the_peer_connected_still_delivers() {
    link_dropped_before_the_peer_connected(false);
    link_dropped_before_the_peer_connected(true);
}

/// Member 1's creation fails after it opened its first ring link, to member 0 (its chunk size
/// does not fit the links). It raises the job's abort, so member 2, which waits for member 1's
/// other link, and every other member that was still connecting return an error naming that
/// failure well within the timeout instead of waiting it out; member 0 may have completed its
/// creation first. Nothing is left in /dev/shm.
fn failed_creation(k: usize, tcp: bool) {
    let conns = connectors(k, tcp, &format!("failnew{k}{}", label(tcp)));
    let start = Instant::now();
    let results = on_ranks(&conns, |rank, c| {
        let mut cfg = comm_config();
        if rank == 1 {
            // Larger than any link's slot once the fingerprint is added (shm 512 KiB, TCP 1 MiB).
            cfg.chunk_bytes = 1 << 20;
        }
        let made = Communicator::world(c.clone(), cfg).map(drop);
        (made, start.elapsed())
    });
    let what = |rank| format!("{} k={k}: rank {rank}", label(tcp));
    for (rank, (made, took)) in results.into_iter().enumerate() {
        assert!(took < TIMEOUT / 2, "{}: returned after {took:?}: {made:?}", what(rank));
        match made {
            Ok(()) => assert!(rank != 1 && rank != 2, "{}: world was created", what(rank)),
            Err(e) => {
                let msg = e.to_string();
                assert!(msg.contains("rank 1") && msg.contains("link too small"), "{}: {msg}", what(rank));
            }
        }
    }
    assert_eq!(shm_left(conns[0].shm_prefix()), Vec::<String>::new(), "k={k}");
}

#[test]
fn a_member_whose_creation_fails_aborts_the_others_promptly() {
    for tcp in [false, true] {
        for k in [3, 4, 5] {
            failed_creation(k, tcp);
        }
    }
}
