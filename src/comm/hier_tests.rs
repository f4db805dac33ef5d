//! The hierarchical host schedules on in-process ranks placed on emulated nodes: every collective,
//! element type, operator and count bit for bit (through [`super::selftest`]) on even layouts of
//! 2..4 nodes (round robin, blocked and shuffled member orders: each of the reduce-scatter and
//! all-gather ways, counts that divide by the world size and counts that do not) and uneven ones (3+2, 2+1, 4+2+1,
//! 1+1+3, ...), the flat fallback with one member per node or `MESHTRAIN_HIER=off`, and the bytes
//! each rank sends between nodes against the theoretical minimum.

use crate::comm::fingerprint::PRINT_LEN;
use crate::comm::selftest::check_all;
use crate::comm::testing::run_ranks_placed;
use crate::comm::tuner::Family;
use crate::comm::{Algo, CommConfig, ReduceOp};

fn cfg(algo: Algo) -> CommConfig {
    // 128-byte pieces: every stage runs many pieces; `small_bytes` makes stages pick direct for
    // small calls, so both stage schedules run.
    CommConfig { algo, small_bytes: 512, chunk_bytes: 128, tuning: None, ..CommConfig::default() }
}

/// Every collective exact on the layout `nodes` (node of each rank); returns the family the tuner
/// picked for a 4 KiB all-reduce on every rank.
fn exact_on(nodes: Vec<usize>, cfg: CommConfig) -> Vec<Family> {
    run_ranks_placed(nodes.clone(), cfg, move |c| {
        // 840 divides by every world size up to 8 (the copy-free world-order schedules); the others
        // by few or none.
        let fails = check_all(&c, &[0, 1, 2, 13, 97, 840, 1001], &ReduceOp::ALL).unwrap();
        assert_eq!(fails, Vec::<String>::new(), "layout {nodes:?}");
        c.planned_schedule("all_reduce", 4096).family
    })
}

#[test]
fn every_collective_exact_in_stages_on_even_layouts() {
    let layouts: Vec<Vec<usize>> = vec![
        vec![0, 1, 0, 1],             // 2 nodes x 2, round robin
        vec![0, 0, 1, 1],             // 2 x 2, blocked
        vec![0, 1, 2, 0, 1, 2],       // 3 x 2
        vec![1, 0, 0, 1, 1, 0],       // 2 x 3, shuffled
        vec![0, 0, 1, 1, 2, 2, 3, 3], // 4 x 2, blocked
        vec![0, 1, 0, 1, 0, 1, 0, 1], // 2 x 4
        vec![0, 0, 0, 1, 1, 1],       // 2 x 3, blocked
        vec![0, 0, 1, 1, 2, 2],       // 3 x 2, blocked
        vec![0, 0, 0, 0, 1, 1, 1, 1], // 2 x 4, blocked
        vec![0, 1, 1, 0],             // 2 x 2, neither round robin nor blocked, spread (pieces)
        vec![0, 1, 2, 2, 0, 1],       // 3 x 2, spread (pieces)
        vec![0, 1, 1, 1, 0, 0],       // 2 x 3, not spread (packed)
    ];
    for nodes in layouts {
        let picked = exact_on(nodes.clone(), cfg(Algo::Auto));
        assert!(picked.iter().all(|&f| f == Family::Hier), "{nodes:?}: {picked:?}");
    }
}

#[test]
fn every_collective_exact_in_stages_on_uneven_layouts() {
    let layouts: Vec<Vec<usize>> = vec![
        vec![0, 0, 0, 1, 1],             // 3+2, blocked
        vec![0, 1, 0, 1, 0],             // 3+2, round robin
        vec![0, 0, 1],                   // 2+1
        vec![1, 0, 0],                   // 2+1, the lone rank first
        vec![0, 0, 0, 0, 1, 1, 2],       // 4+2+1
        vec![2, 0, 1, 0, 0, 1, 0],       // 4+2+1, shuffled
        vec![0, 1, 2, 2, 2],             // 1+1+3
        vec![0, 1, 1, 1, 0, 0, 1],       // 3+4
        vec![0, 1, 2, 0, 1, 0, 2, 0],    // 4+2+2
    ];
    for nodes in layouts {
        let picked = exact_on(nodes.clone(), cfg(Algo::Auto));
        assert!(picked.iter().all(|&f| f == Family::Hier), "{nodes:?}: {picked:?}");
    }
}

#[test]
fn single_rank_nodes_and_hier_off_run_flat_and_exact() {
    for nodes in [vec![0, 1, 2], vec![1, 0]] {
        let picked = exact_on(nodes.clone(), cfg(Algo::Auto));
        assert!(picked.iter().all(|&f| f != Family::Hier), "{nodes:?}: {picked:?}");
    }
    let off = CommConfig { hier: false, ..cfg(Algo::Auto) };
    assert!(exact_on(vec![0, 1, 0, 1], off.clone()).iter().all(|&f| f != Family::Hier));
    assert!(exact_on(vec![0, 0, 1], off).iter().all(|&f| f != Family::Hier));
    // A forced flat schedule wins; every world size 1..8 on two nodes stays exact.
    assert!(exact_on(vec![0, 1, 0, 1], cfg(Algo::Ring)).iter().all(|&f| f == Family::Ring));
    for k in 1..=8 {
        exact_on((0..k).map(|r| r % 2).collect(), cfg(Algo::Auto));
    }
}

/// Bytes each rank sent between nodes for one in-place call of `coll` on `n` f32 on `nodes`.
fn net_bytes(nodes: Vec<usize>, hier: bool, coll: &'static str, n: usize) -> Vec<u64> {
    let cfg = CommConfig { hier, algo: Algo::Ring, chunk_bytes: 1 << 16, ..CommConfig::default() };
    let cfg = if hier { CommConfig { algo: Algo::Auto, tuning: None, small_bytes: 0, ..cfg } } else { cfg };
    run_ranks_placed(nodes, cfg, move |c| {
        let mut buf = vec![1.0f32; n];
        let mut call = || match coll {
            "all_reduce" => c.all_reduce(&mut buf, ReduceOp::Sum).unwrap(),
            "reduce_scatter" => c.reduce_scatter(&mut buf, ReduceOp::Sum).unwrap(),
            "all_gather" => c.all_gather(&mut buf).unwrap(),
            "reduce" => c.reduce(&mut buf, ReduceOp::Sum, 0).unwrap(),
            _ => c.broadcast(&mut buf, 0).unwrap(),
        };
        // The second call: the first also makes the stage communicators.
        call();
        let before = c.net_bytes_sent();
        call();
        c.net_bytes_sent() - before
    })
}

#[test]
fn bytes_between_nodes_meet_the_minimum_in_stages() {
    // n nodes x L ranks, N = 4 * 3 * 2 * 1000 f32 (every block even): in stages every rank sends
    // exactly the minimum share of its node, plus one fingerprint per call on its one network link.
    for (n, l) in [(2usize, 2usize), (2, 4), (3, 2)] {
        let nodes: Vec<usize> = (0..n * l).map(|r| r % n).collect();
        let (size, k, print) = (24_000usize * 4, (n * l) as f64, PRINT_LEN as u64);
        let min = |factor: f64| (factor * size as f64 / l as f64) as u64 + print;
        let nn = n as f64;
        let expect = [
            ("all_reduce", min(2.0 * (nn - 1.0) / nn)),
            ("reduce_scatter", min((nn - 1.0) / nn)),
            ("all_gather", min((nn - 1.0) / nn)),
        ];
        for (coll, want) in expect {
            let got = net_bytes(nodes.clone(), true, coll, 24_000);
            assert!(got.iter().all(|&b| b == want), "{coll} {n}x{l}: {got:?}, want {want} each");
        }
        // Broadcast: a chain from the root's node; every rank but the chain's last forwards 1/L.
        let got = net_bytes(nodes.clone(), true, "broadcast", 24_000);
        let total: u64 = got.iter().sum();
        assert_eq!(total, (n as u64 - 1) * l as u64 * (size as u64 / l as u64 + print), "broadcast {n}x{l}: {got:?}");
        // Flat ring (ordered by node): n ranks send 2(k-1)/k of the buffer each, the others nothing.
        let flat = net_bytes(nodes, false, "all_reduce", 24_000);
        let per = (2.0 * (k - 1.0) / k * size as f64) as u64 + print;
        assert_eq!(flat.iter().filter(|&&b| b == per).count(), n, "flat {n}x{l}: {flat:?}");
        assert_eq!(flat.iter().filter(|&&b| b == 0).count(), n * (l - 1), "flat {n}x{l}: {flat:?}");
    }
}

/// The bytes rank `r` must send between nodes (`want`) within its share of fingerprints: at most
/// one per stage call, and a member makes fewer than `2k` of them.
fn within(got: &[u64], want: impl Fn(usize) -> u64, what: &str) {
    let slack = 2 * got.len() as u64 * PRINT_LEN as u64;
    for (r, &g) in got.iter().enumerate() {
        assert!(g >= want(r) && g <= want(r) + slack, "{what}: rank {r} sent {g}, want {} (+ prints): {got:?}", want(r));
    }
}

#[test]
fn bytes_between_nodes_meet_the_minimum_on_uneven_layouts() {
    // 33600 f32 divide by every node and world size here. L(a): members of node a; S: buffer bytes.
    let (count, print) = (33_600usize, PRINT_LEN as u64);
    let size = count as u64 * 4;
    for nodes in [vec![0, 0, 0, 1, 1], vec![0, 0, 0, 0, 1, 1, 2], vec![0, 1, 2, 2, 2], vec![0, 1, 1, 0]] {
        let (k, n) = (nodes.len() as u64, *nodes.iter().max().unwrap() as u64 + 1);
        let per = |a: usize| nodes.iter().filter(|&&x| x == a).count() as u64;
        // Each member's local block: S / L(a).
        let block = |r: usize| size / per(nodes[r]);
        let what = |coll: &str| format!("{coll} on {nodes:?}");
        // All-reduce: every node sends 2(n-1)/n S, each member that share of its local block.
        let got = net_bytes(nodes.clone(), true, "all_reduce", count);
        within(&got, |r| 2 * (n - 1) * block(r) / n, &what("all_reduce"));
        // Reduce onto rank 0: every other node sends S once, each member its local block.
        let got = net_bytes(nodes.clone(), true, "reduce", count);
        within(&got, |r| if nodes[r] == nodes[0] { 0 } else { block(r) }, &what("reduce"));
        // Reduce-scatter: node a sends the world blocks of the other nodes once, (k - L(a))/k S
        // (the minimum); no member more than its local block.
        let got = net_bytes(nodes.clone(), true, "reduce_scatter", count);
        for a in 0..n as usize {
            let on: Vec<usize> = (0..nodes.len()).filter(|&r| nodes[r] == a).collect();
            let sent: u64 = on.iter().map(|&r| got[r]).sum();
            let want = (k - per(a)) * size / k;
            let slack = 2 * k * k * print;
            assert!(sent >= want && sent <= want + slack, "{}: node {a} sent {sent}, want {want}: {got:?}", what("reduce_scatter"));
            assert!(on.iter().all(|&r| got[r] <= block(r) + slack), "{}: {got:?}", what("reduce_scatter"));
        }
        // All-gather and broadcast: every piece reaches each other node once, (n-1) S in all.
        for coll in ["all_gather", "broadcast"] {
            let got = net_bytes(nodes.clone(), true, coll, count);
            let total: u64 = got.iter().sum();
            let want = (n - 1) * size;
            assert!(total >= want && total <= want + 2 * k * k * print, "{}: {total} in all, want {want}: {got:?}", what(coll));
        }
    }
}

#[test]
fn bytes_between_nodes_meet_the_minimum_on_blocked_layouts() {
    // Node a holds ranks a L .. (a + 1) L; 24 000 f32 and 23 999 (blocks of unequal length): every
    // rank sends (n-1)/n of the buffer over L for reduce-scatter and all-gather, its local block
    // for a reduce off the root's node, within one fingerprint per stage call.
    for (n, l) in [(2usize, 2usize), (3, 2), (2, 4)] {
        let nodes: Vec<usize> = (0..n * l).map(|r| r / l).collect();
        for count in [24_000usize, 23_999] {
            let size = count as u64 * 4;
            let (n64, l64, k) = (n as u64, l as u64, (n * l) as u64);
            // The world blocks of one place on the other nodes: within a block's rounding.
            let share = (n64 - 1) * size / (n64 * l64);
            for coll in ["reduce_scatter", "all_gather"] {
                let got = net_bytes(nodes.clone(), true, coll, count);
                let what = format!("{coll} {n}x{l} blocked, {count} f32");
                within(&got, |_| share.saturating_sub((n64 - 1) * 4), &what);
                assert!(got.iter().all(|&g| g <= share + (n64 - 1) * 4 + 2 * k * PRINT_LEN as u64), "{what}: {got:?}");
            }
            let got = net_bytes(nodes.clone(), true, "reduce", count);
            let block = |r: usize| (crate::comm::block_range(count, l, r % l).len() * 4) as u64;
            within(&got, |r| if nodes[r] == 0 { 0 } else { block(r) }, &format!("reduce {n}x{l} blocked"));
        }
    }
}

#[test]
fn bytes_between_nodes_meet_the_minimum_on_shuffled_even_layouts() {
    // Spread layouts (pieces) and one that is not (packed): every rank sends (n-1)/n of the buffer
    // over L for reduce-scatter and all-gather, within a block's rounding and one fingerprint per
    // stage call, also with blocks of unequal length.
    let layouts: Vec<(Vec<usize>, usize, usize)> = vec![
        (vec![0, 1, 1, 0], 2, 2),
        (vec![1, 0, 0, 1, 1, 0], 2, 3),
        (vec![0, 1, 2, 2, 0, 1], 3, 2),
        (vec![0, 1, 1, 1, 0, 0], 2, 3),
    ];
    for (nodes, n, l) in layouts {
        for count in [24_000usize, 23_999] {
            let (n64, l64, k) = (n as u64, l as u64, (n * l) as u64);
            let share = (n64 - 1) * count as u64 * 4 / (n64 * l64);
            for coll in ["reduce_scatter", "all_gather"] {
                let got = net_bytes(nodes.clone(), true, coll, count);
                let what = format!("{coll} on {nodes:?}, {count} f32");
                within(&got, |_| share.saturating_sub(n64 * 4), &what);
                assert!(got.iter().all(|&g| g <= share + n64 * 4 + 2 * k * PRINT_LEN as u64), "{what}: {got:?}");
            }
        }
    }
}
