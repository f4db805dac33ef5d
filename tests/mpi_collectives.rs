//! Every collective, element type and operator across real rank processes (world sizes 1..8,
//! odd ones included), over shared memory and over TCP, with `meshtrain selftest` (bit-exact
//! comparison against the reference; counts 0, 1, primes, and ~3 MiB), with single-copy reads
//! (Cross Memory Attach) in their automatic mode, forced on at every size, and off.

mod common;

use std::time::Duration;

/// Runs `meshtrain selftest` on `np` ranks; returns what it said about single-copy reads.
fn selftest(np: usize, envs: &[(&str, &str)]) -> String {
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
    let reads = out.stdout.lines().find_map(|l| l.split("single-copy reads: ").nth(1));
    reads.expect("selftest reports single-copy reads").trim().to_string()
}

#[test]
fn shared_memory_world_sizes_1_to_8() {
    for np in 1..=8 {
        // The ~3 MiB count is above the small-message size: from 2 ranks on, it probes reads
        // (which work here; whether they pay depends on the machine's copy rates).
        let reads = selftest(np, &[]);
        if np == 1 {
            assert_eq!(reads, "not probed");
        } else if common::cross_process_reads_allowed() {
            assert!(reads.starts_with("work"), "{np} ranks: {reads}");
        } else {
            // The probe must find out and fall back (the selftest above passed on the FIFOs).
            assert!(!reads.starts_with("work"), "{np} ranks: {reads}");
        }
    }
}

#[test]
fn tcp_world_sizes() {
    for np in [2, 3, 5, 8] {
        let reads = selftest(np, &[("MESHTRAIN_TRANSPORT", "tcp")]);
        assert!(reads.starts_with("unavailable (rank 0: reading rank 1: the link offers no access"), "{reads}");
    }
}

#[test]
fn forced_schedules_over_shared_memory() {
    for algo in ["ring", "direct"] {
        assert_eq!(selftest(4, &[("MESHTRAIN_ALGO", algo)]), "not probed");
    }
}

#[test]
fn single_copy_reads_forced_on_and_off_odd_world_sizes() {
    let allowed = common::cross_process_reads_allowed();
    if !allowed {
        eprintln!("SKIP forced-on part: this machine forbids process_vm_readv between processes");
    }
    for np in [3, 5] {
        if allowed {
            // Forced on, reads that work are used at every size, paying or not.
            let reads = selftest(np, &[("MESHTRAIN_CMA", "on")]);
            assert!(reads.starts_with("work"), "{np} ranks, forced on: {reads}");
        }
        assert_eq!(selftest(np, &[("MESHTRAIN_CMA", "off")]), "not probed", "{np} ranks, off");
    }
}
