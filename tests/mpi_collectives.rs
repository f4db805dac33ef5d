//! Every collective, element type and operator across real rank processes (world sizes 1..8,
//! odd ones included), over shared memory and over TCP, with `meshtrain selftest` (bit-exact
//! comparison against the reference; counts 0, 1, primes, and ~3 MiB).

mod common;

use std::time::Duration;

fn selftest(np: usize, envs: &[(&str, &str)]) {
    let mut cmd = common::mpirun(np);
    cmd.arg("selftest");
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let out = common::run(cmd, Duration::from_secs(300));
    assert!(
        out.success() && out.stdout.contains("0 mismatches"),
        "selftest on {np} ranks {envs:?} failed ({:?} after {:?}):\n{}\n{}",
        out.status,
        out.elapsed,
        out.stdout,
        out.stderr
    );
}

#[test]
fn shared_memory_world_sizes_1_to_8() {
    for np in 1..=8 {
        selftest(np, &[]);
    }
}

#[test]
fn tcp_world_sizes() {
    for np in [2, 3, 5, 8] {
        selftest(np, &[("MESHTRAIN_TRANSPORT", "tcp")]);
    }
}

#[test]
fn forced_schedules_over_shared_memory() {
    for algo in ["ring", "direct"] {
        selftest(4, &[("MESHTRAIN_ALGO", algo)]);
    }
}
