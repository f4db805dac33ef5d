//! Start-up and call-matching faults with real rank processes under mpirun (issue 14, items 1
//! and 3). Each job must end on its own, quickly and non-zero, with a message on every rank that
//! names what was wrong: a bad `MESHTRAIN_*` variable (the variable and the allowed values), a
//! variable bad on one rank only (`MPI_Abort` ends the others), a rank that stalls before its
//! hello (rank 0 names it within the bootstrap deadline), and mismatched collective calls (both
//! calls and the peer rank named on every rank, over shared memory and TCP, on 2 and 3 ranks).
//!
//! Every job runs under a watchdog ([`WATCHDOG`]) far above the few seconds each takes, so that a
//! hang fails the test instead of blocking CI.

mod common;

use std::time::Duration;

/// Kills a job that did not end by itself; the jobs here take 1 to 5 s.
const WATCHDOG: Duration = Duration::from_secs(90);

/// Runs `meshtrain selftest` (small) on `np` ranks with `envs` on every rank.
fn selftest(np: usize, envs: &[(&str, &str)], extra: &[&str]) -> common::Finished {
    let mut cmd = common::mpirun(np);
    cmd.args(["selftest", "--counts", "1", "--large", "0"]).args(extra);
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let out = common::run(cmd, WATCHDOG);
    assert!(out.status.is_some(), "job hung (killed after {WATCHDOG:?}):\n{}", out.stderr);
    out
}

/// Asserts that every rank printed an error line containing each of `needles`.
fn every_rank_says(out: &common::Finished, np: usize, needles: &[&str]) {
    for r in 0..np {
        let lines = out.rank_stderr(r);
        assert!(
            lines.iter().any(|l| l.contains("meshtrain: error") && needles.iter().all(|n| l.contains(n))),
            "rank {r} printed no error with {needles:?}; its output:\n{}\n--- all stderr:\n{}",
            lines.join("\n"),
            out.stderr
        );
    }
}

#[test]
fn bad_runtime_variables_fail_every_rank_with_the_variable_and_allowed_values() {
    let cases: [(&str, &str, &str); 7] = [
        ("MESHTRAIN_TRANSPORT", "infiniband", "auto, shm, tcp, ofi or shm+ofi"),
        ("MESHTRAIN_TRANSPRT", "tcp", "did you mean MESHTRAIN_TRANSPORT?"),
        ("MESHTRAIN_BIND_ADDR", "10.255.255.1", "cannot be bound"),
        ("MESHTRAIN_SOCKET_IFNAME", "nosuch0", "does not exist"),
        ("MESHTRAIN_SHM_DEPTH", "0", "allowed 1..="),
        ("MESHTRAIN_TCP_DEPTH", "0", "allowed 1..="),
        ("MESHTRAIN_ALGO", "tree", "auto, ring, direct"),
    ];
    for (key, value, allowed) in cases {
        let out = selftest(3, &[(key, value)], &[]);
        every_rank_says(&out, 3, &[key, allowed]);
    }
}

#[test]
fn a_variable_bad_on_one_rank_aborts_the_whole_job() {
    // mpirun's MPMD form: rank 1 alone gets the bad value; the others would wait in MPI forever
    // if rank 1 just exited.
    let mut cmd = common::mpirun(1);
    let me = common::meshtrain();
    let me = me.to_str().expect("utf-8 path");
    cmd.args(["selftest", "--counts", "1", "--large", "0"])
        .args([":", "-np", "1", "env", "MESHTRAIN_TCP_DEPTH=0", me, "selftest", "--counts", "1", "--large", "0"])
        .args([":", "-np", "1", me, "selftest", "--counts", "1", "--large", "0"]);
    let out = common::run(cmd, WATCHDOG);
    assert!(out.status.is_some(), "job hung (killed after {WATCHDOG:?}):\n{}", out.stderr);
    assert!(!out.success(), "job succeeded with a bad variable on rank 1");
    assert!(
        out.rank_stderr(1).iter().any(|l| l.contains("meshtrain: error: rank 1:") && l.contains("MESHTRAIN_TCP_DEPTH")),
        "rank 1 did not name the variable:\n{}",
        out.stderr
    );
}

#[test]
fn a_rank_stalled_before_its_hello_is_named_within_the_bootstrap_deadline() {
    let envs = [("MESHTRAIN_FAULT", "stall-bootstrap@2"), ("MESHTRAIN_BOOTSTRAP_TIMEOUT", "3")];
    let out = selftest(3, &envs, &[]);
    assert!(!out.success(), "job succeeded with a stalled rank");
    assert!(
        out.rank_stderr(0)
            .iter()
            .any(|l| l.contains("meshtrain: error: rank 0:") && l.contains("blame: rank 2:") && l.contains("hello")),
        "rank 0 did not name the stalled rank 2:\n{}",
        out.stderr
    );
}

/// `selftest --mismatch CASE` on `np` ranks: member 1 deviates; every rank must fail naming both
/// calls (`mine`, `theirs`: the fingerprint texts) and the peer.
fn mismatch(case: &str, np: usize, transport: &str, mine: &str, theirs: &str) {
    let out = selftest(np, &[("MESHTRAIN_TRANSPORT", transport)], &["--mismatch", case]);
    every_rank_says(&out, np, &["op mismatch", "peer rank", mine, theirs]);
    assert!(!out.stderr.contains("were not detected"), "{}", out.stderr);
}

#[test]
fn mismatched_op_fails_every_rank_naming_both_calls() {
    mismatch("op", 2, "auto", "all_reduce #2 of 1000 f32 (sum)", "all_gather #2 of 1000 f32");
    mismatch("op", 3, "tcp", "all_reduce #2 of 1000 f32 (sum)", "all_gather #2 of 1000 f32");
}

#[test]
fn mismatched_count_dtype_root_fail_every_rank_naming_both_calls() {
    mismatch("count", 3, "auto", "all_reduce #2 of 1000 f32 (sum)", "all_reduce #2 of 2000 f32 (sum)");
    mismatch("dtype", 2, "tcp", "all_reduce #2 of 1000 f32 (sum)", "all_reduce #2 of 1000 f64 (sum)");
    // Two roots move data one way only: depending on the schedule the tuner picks for this size,
    // a rank finds the other root's print at the broadcast itself or at its next call (the
    // barrier's all-reduce); either way every rank names the broadcast and the peer.
    mismatch("root", 3, "tcp", "broadcast #2 of 1000 f32 root ", "peer rank ");
}
