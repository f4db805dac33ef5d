//! Cost of making and dropping a communicator (`cargo bench --bench comm_create`): in-process
//! ranks (threads) on network connectors over 127.0.0.1, shared memory or TCP, split the world
//! into one child (every rank the same color) and drop it at once, 300 times. Each round starts
//! after a barrier on the world; per round the slowest rank's `split` and `drop` times count, and
//! the medians and 90th percentiles over the rounds are printed (microseconds). The split
//! includes its all-reduce of the color table on the parent and the child's ring links.

use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use meshtrain::comm::{CommConfig, Communicator};
use meshtrain::transport::net::{NetConfig, NetConnector};
use meshtrain::transport::AbortState;

const ROUNDS: usize = 300;

fn connectors(k: usize, tcp: bool) -> Vec<Arc<NetConnector>> {
    let mut cfg = NetConfig::new(IpAddr::V4(Ipv4Addr::LOCALHOST), "bench");
    cfg.force_tcp = tcp;
    let aborts = (0..k).map(|_| Arc::new(AbortState::default())).collect();
    NetConnector::local_group(*b"bench-comm-maker", &cfg, aborts)
        .expect("connectors")
        .into_iter()
        .map(Arc::new)
        .collect()
}

/// Per rank, per round: (split, drop) durations.
fn run(k: usize, tcp: bool) -> Vec<Vec<(Duration, Duration)>> {
    let conns = connectors(k, tcp);
    let cfg = CommConfig {
        chunk_bytes: 256 << 10,
        tuning: None,
        ..CommConfig::default()
    };
    std::thread::scope(|s| {
        let handles: Vec<_> = conns
            .iter()
            .enumerate()
            .map(|(rank, c)| {
                let cfg = cfg.clone();
                s.spawn(move || {
                    let world = Communicator::world(c.clone(), cfg).expect("world");
                    (0..ROUNDS)
                        .map(|_| {
                            world.barrier().expect("barrier");
                            let t = Instant::now();
                            let child = world.split(Some(0), rank as i64).expect("split");
                            let made = t.elapsed();
                            drop(child);
                            (made, t.elapsed() - made)
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank")).collect()
    })
}

fn percentile(mut v: Vec<f64>, p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn main() {
    println!(
        "{:<5} {:>5} {:>12} {:>12} {:>12} {:>12}",
        "link", "ranks", "split_p50", "split_p90", "drop_p50", "drop_p90"
    );
    for tcp in [false, true] {
        for k in [2, 4] {
            let per_rank = run(k, tcp);
            let worst = |f: fn(&(Duration, Duration)) -> Duration| -> Vec<f64> {
                (0..ROUNDS)
                    .map(|i| {
                        per_rank
                            .iter()
                            .map(|r| f(&r[i]).as_secs_f64() * 1e6)
                            .fold(0.0, f64::max)
                    })
                    .collect()
            };
            let (split, drop) = (worst(|x| x.0), worst(|x| x.1));
            println!(
                "{:<5} {:>5} {:>12.0} {:>12.0} {:>12.0} {:>12.0}",
                if tcp { "tcp" } else { "shm" },
                k,
                percentile(split.clone(), 0.5),
                percentile(split, 0.9),
                percentile(drop.clone(), 0.5),
                percentile(drop, 0.9)
            );
        }
    }
}
