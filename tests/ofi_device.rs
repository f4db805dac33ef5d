//! Device send/recv over libfabric across real rank processes: the emu arm's buffers (host memory
//! playing the device, registered as FI_HMEM_SYSTEM) posted directly where the provider offers
//! FI_HMEM (`shm` here), staged through host memory where it does not (`tcp;ofi_rxm`) or where
//! `MESHTRAIN_GPU_DIRECT=off`; `on` where impossible is a configuration error naming the variable.
//!
//! `meshtrain selftest --device emu` checks every device collective bit for bit, send/recv among
//! them in a ring (counts 0, 1, odd, and a large one of several MiB that spans many direct
//! messages), and reports on rank 0 how many send/recv calls went direct and how many collectives
//! ran as FI_HMEM rings: the observables that the direct paths ran. Rings are tested with
//! `MESHTRAIN_GPU_IPC=off`, since on one machine the IPC paths would otherwise take every
//! collective.
#![cfg(feature = "ofi")]

mod common;

use std::io::{BufRead, BufReader};
use std::time::{Duration, Instant};

/// The device selftest on `np` ranks over libfabric `provider` with extra `envs`.
fn device_selftest(np: usize, provider: &str, large: usize, envs: &[(&str, &str)]) -> common::Finished {
    let mut cmd = common::mpirun(np);
    cmd.args(["selftest", "--device", "emu", "--counts", "0,1,13,4099", "--large", &large.to_string()])
        .env("MESHTRAIN_TRANSPORT", "ofi")
        .env("FI_PROVIDER", provider)
        .env("RUST_LOG", "info");
    for (k, v) in envs {
        cmd.env(k, v);
    }
    common::run(cmd, Duration::from_secs(600))
}

/// Rank 0's "send/recv: D of T FI_HMEM direct" -> (D, T), after checking the run passed.
fn direct_counts(out: &common::Finished, what: &str) -> (u64, u64) {
    assert!(
        out.success() && out.stdout.contains(" 0 mismatches"),
        "{what} failed ({:?} after {:?}):\n{}\n{}",
        out.status,
        out.elapsed,
        out.stdout,
        out.stderr
    );
    let line = out.stdout.lines().find(|l| l.contains("send/recv: ")).expect("the selftest reports the send/recv path");
    let words: Vec<&str> = line.split("send/recv: ").nth(1).expect("counts").split_whitespace().collect();
    (words[0].parse().expect("direct calls"), words[2].parse().expect("calls"))
}

/// Rank 0's "..., R over FI_HMEM rings; ..." -> R.
fn ring_calls(out: &common::Finished) -> u64 {
    let line = out.stdout.lines().find(|l| l.contains(" over FI_HMEM rings")).expect("the selftest reports the rings");
    let before = line.split(" over FI_HMEM rings").next().expect("count");
    before.rsplit(' ').next().expect("count").parse().expect("ring calls")
}

const NO_IPC: (&str, &str) = ("MESHTRAIN_GPU_IPC", "off");

/// Every all-reduce, reduce-scatter, all-gather and broadcast of every type and operator runs as
/// a ring of direct transfers, bit-exact, on 2, 3 and 5 ranks; 4 KiB slots cut the blocks into
/// many pieces (1.2 MB f32 calls: about 100 per block at 3 ranks).
#[test]
fn emu_collectives_run_as_fi_hmem_rings_bit_exact() {
    for np in [2, 3, 5] {
        let out = device_selftest(np, "shm", 300_017, &[NO_IPC, ("MESHTRAIN_GPU_STAGE_CHUNK", "4K")]);
        let (direct, calls) = direct_counts(&out, &format!("ring selftest on {np} ranks"));
        assert!(direct > 0 && direct == calls, "{np} ranks: {direct} of {calls} send/recv calls direct");
        // 7 types x 3 non-empty counts x (5 all-reduce + 5 reduce-scatter + all-gather +
        // broadcast), and those 12 on the large f32 count; reduce, all-to-all and empty calls
        // stay staged.
        assert_eq!(ring_calls(&out), 7 * 3 * 12 + 12, "{np} ranks:\n{}", out.stdout);
        let line = format!("device collectives: FI_HMEM rings over {np} members");
        assert!(out.stderr.contains(&line), "{np} ranks: no `{line}` in the log:\n{}", out.stderr);
    }
}

/// Member 1 all-reduces 2000 elements, or takes the maximum, where the others sum 1000: the
/// fingerprint hop makes every rank exit with an error naming both calls, before any data moves.
#[test]
fn a_member_in_another_ring_call_is_an_error_on_every_rank() {
    for (case, theirs) in [("count", "all_reduce #3 of 2000 f32 (sum)"), ("op", "all_reduce #3 of 1000 f32 (max)")] {
        let mut cmd = common::mpirun(3);
        cmd.args(["selftest", "--device", "emu", "--mismatch", case])
            .env("MESHTRAIN_TRANSPORT", "ofi")
            .env("FI_PROVIDER", "shm")
            .env("MESHTRAIN_TIMEOUT", "20")
            .env(NO_IPC.0, NO_IPC.1);
        let out = common::run(cmd, Duration::from_secs(300));
        // (mpirun's own status says nothing here: the tests let every rank report and exit.)
        assert!(!out.stderr.contains("was not detected"), "{case}: {}", out.stderr);
        for r in 0..3 {
            let named = out.rank_stderr(r).into_iter().any(|l| l.contains("meshtrain: error") && l.contains("op mismatch") && l.contains(theirs));
            assert!(named, "{case}: rank {r} did not name `{theirs}`:\n{}", out.stderr);
        }
    }
}

/// Losses of 3 steps of a 2-layer tiny job in bf16 on the emu arm over libfabric `shm` with IPC
/// off, `parallel` on `np` ranks, and what the ranks logged.
fn train_emu(dir: &std::path::Path, name: &str, np: usize, parallel: &str, gpu_direct: &str) -> (Vec<f64>, String) {
    let job = common::tiny_job(dir, &format!("{name}.toml"), &format!("[parallel]\n{parallel}"));
    let metrics = dir.join(format!("{name}.jsonl"));
    let mut cmd = common::mpirun(np);
    cmd.arg("train").arg(&job).arg("--metrics").arg(&metrics);
    for s in ["device=emu", "precision=bf16", "train.steps=3", "optim.warmup_steps=1", "model.n_layer=2"] {
        cmd.args(["--set", s]);
    }
    cmd.env("MESHTRAIN_TRANSPORT", "ofi").env("FI_PROVIDER", "shm").env(NO_IPC.0, NO_IPC.1).env("MESHTRAIN_GPU_DIRECT", gpu_direct).env("RUST_LOG", "info");
    let out = common::run(cmd, Duration::from_secs(600));
    assert!(out.success() && !out.stderr.contains("meshtrain: error"), "{name} failed:\n{}\n{}", out.stdout, out.stderr);
    (common::losses(&metrics).into_iter().map(|(_, l)| l).collect(), out.stderr)
}

/// Data-parallel training on the emu arm whose gradient reductions and parameter gathers (ZeRO-0
/// all-reduce; ZeRO-3 reduce-scatter and all-gather) run as FI_HMEM rings gives the losses of the
/// same run staged through host memory, bit for bit (two ranks: every sum has two terms, whose
/// order does not matter).
#[test]
fn emu_training_over_rings_matches_staged_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    for (name, parallel) in [("dp2z0", "dp = 2"), ("dp2z3", "dp = 2\nzero = 3")] {
        let (ring, log) = train_emu(dir.path(), &format!("{name}_ring"), 2, parallel, "on");
        let (staged, _) = train_emu(dir.path(), &format!("{name}_staged"), 2, parallel, "off");
        assert!(log.contains("device collectives: FI_HMEM rings over 2 members"), "{name}: no rings:\n{log}");
        assert_eq!(ring.len(), 3, "{name}: {ring:?}");
        assert_eq!(ring, staged, "{name}: ring losses differ from staged");
        eprintln!("{name}: losses {ring:?} over rings and staged");
    }
}

#[test]
fn emu_send_recv_goes_direct_over_the_shm_provider_bit_exact() {
    // 3_000_017 f32 = 12 MB: more direct messages than the window holds, and an odd tail.
    for (np, large) in [(2, 3_000_017), (3, 0)] {
        let out = device_selftest(np, "shm", large, &[]);
        let (direct, calls) = direct_counts(&out, &format!("direct selftest on {np} ranks"));
        assert!(direct > 0 && direct == calls, "{np} ranks: {direct} of {calls} send/recv calls direct");
        for line in ["device send to rank 1: FI_HMEM direct (provider shm, iface FI_HMEM_SYSTEM)", "device buffers: FI_HMEM registration"] {
            assert!(out.stderr.contains(line), "{np} ranks: no `{line}` in the log:\n{}", out.stderr);
        }
    }
}

#[test]
fn emu_send_recv_stages_where_the_provider_has_no_fi_hmem() {
    let out = device_selftest(3, "tcp;ofi_rxm", 0, &[NO_IPC]);
    let (direct, calls) = direct_counts(&out, "selftest over tcp;ofi_rxm");
    assert!(direct == 0 && calls > 0, "{direct} of {calls} send/recv calls direct over tcp;ofi_rxm");
    assert_eq!(ring_calls(&out), 0, "collectives ran as rings over tcp;ofi_rxm");
    for why in [
        "device send to rank 1: staged (provider tcp;ofi_rxm does not offer FI_HMEM on this rank or rank 1)",
        "device collectives: this rank's ring links cannot go FI_HMEM direct (link to rank 1: provider tcp;ofi_rxm does not offer FI_HMEM",
        "device collectives: staged through host memory (the ring links of member 0 are not FI_HMEM direct)",
    ] {
        assert!(out.stderr.contains(why), "no `{why}` in the log:\n{}", out.stderr);
    }
}

#[test]
fn gpu_direct_off_stages_even_where_fi_hmem_is_offered() {
    let out = device_selftest(2, "shm", 0, &[("MESHTRAIN_GPU_DIRECT", "off"), NO_IPC]);
    let (direct, calls) = direct_counts(&out, "selftest with MESHTRAIN_GPU_DIRECT=off");
    assert!(direct == 0 && calls > 0, "{direct} of {calls} send/recv calls direct with MESHTRAIN_GPU_DIRECT=off");
    assert_eq!(ring_calls(&out), 0, "collectives ran as rings with MESHTRAIN_GPU_DIRECT=off");
    assert!(out.stderr.contains("device send to rank 1: staged (MESHTRAIN_GPU_DIRECT=off)"), "{}", out.stderr);
}

/// `MESHTRAIN_GPU_DIRECT=on` where no device transfer can go direct: every rank fails with a
/// configuration error naming the variable and `why`, and no selftest runs.
fn on_is_an_error(transport: &str, provider: &str, why: &str) {
    let mut cmd = common::mpirun(2);
    cmd.args(["selftest", "--device", "emu", "--counts", "1", "--large", "0"])
        .env("MESHTRAIN_TRANSPORT", transport)
        .env("FI_PROVIDER", provider)
        .env("MESHTRAIN_GPU_DIRECT", "on");
    let out = common::run(cmd, Duration::from_secs(300));
    assert!(!out.stdout.contains("mismatches"), "selftest ran with MESHTRAIN_GPU_DIRECT=on over {transport}:\n{}", out.stdout);
    for r in 0..2 {
        let errors: Vec<String> = out.rank_stderr(r).into_iter().filter(|l| l.contains("meshtrain: error")).collect();
        assert!(
            errors.iter().any(|l| l.contains("`MESHTRAIN_GPU_DIRECT`: on, but") && l.contains(why)),
            "rank {r} did not name MESHTRAIN_GPU_DIRECT and `{why}`:\n{}",
            out.stderr
        );
    }
}

#[test]
fn gpu_direct_on_over_tcp_transport_is_a_config_error() {
    on_is_an_error("tcp", "shm", "MESHTRAIN_TRANSPORT=tcp puts no link on libfabric");
}

#[test]
fn gpu_direct_on_over_a_provider_without_fi_hmem_is_a_config_error() {
    on_is_an_error("ofi", "tcp;ofi_rxm", "provider tcp;ofi_rxm does not offer FI_HMEM");
}

/// Rank 1 SIGKILLed in the middle of a loop of direct device transfers: rank 0 exits by itself,
/// within the deadline, with an error blaming rank 1 (never a hang in a posted receive).
///
/// Ignored by default: with libfabric 1.17's `shm` provider (the only one here offering FI_HMEM),
/// a peer killed while it holds the shared region's spin lock leaves the survivor spinning inside
/// `fi_cq_read` for good (2 of 8 runs here; gdb: `pthread_spin_lock` under `fi_cq_read`), where
/// no deadline or abort check of ours can run. The other runs pass within seconds.
#[test]
#[ignore = "libfabric shm provider: a peer killed holding its spin lock hangs the survivor in fi_cq_read (~1 in 4 runs)"]
fn killed_peer_during_direct_transfers_is_named() {
    const DEADLINE_S: u64 = 20;
    let mut cmd = common::mpirun(2);
    cmd.args(["bench", "device-sendrecv", "--device", "emu", "--min", "4M", "--max", "4M", "--warmup", "0", "--iters", "1000000"])
        .env("MESHTRAIN_TRANSPORT", "ofi")
        .env("FI_PROVIDER", "shm")
        .env("MESHTRAIN_GPU_DIRECT", "on")
        .env("MESHTRAIN_TIMEOUT", DEADLINE_S.to_string())
        .env("RUST_LOG", "info");
    let mut child = common::spawn(cmd);
    let mpirun_pid = child.id();
    let stderr = child.stderr.take().expect("piped stderr");
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let reader = std::thread::spawn(move || {
        let mut all = String::new();
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line.clone());
            all.push_str(&line);
            all.push('\n');
        }
        all
    });
    // Kill only once the direct transfers run (start-up, emu kernels included, may take a while).
    let started = "device send to rank 1: FI_HMEM direct";
    while !rx.recv_timeout(Duration::from_secs(120)).expect("rank 0 starts direct transfers").contains(started) {}
    std::thread::sleep(Duration::from_secs(2));
    let pids = common::rank_pids(mpirun_pid);
    let victim = pids.iter().find(|p| p.0 == 1).expect("rank 1 runs").1;
    assert!(std::process::Command::new("kill").args(["-KILL", &victim.to_string()]).status().unwrap().success());
    let killed_at = Instant::now();
    while common::rank_pids(mpirun_pid).iter().any(|p| p.1 != victim) && killed_at.elapsed() < Duration::from_secs(DEADLINE_S + 60) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let took = killed_at.elapsed();
    // mpirun may linger once a rank died by a signal: `wait` stops it.
    let out = common::wait(child, Duration::from_secs(5));
    let stderr = reader.join().expect("stderr reader");
    assert!(took < Duration::from_secs(DEADLINE_S + 15), "rank 0 took {took:?} after the kill:\n{stderr}");
    assert!(!out.success(), "the job reported success after rank 1 was killed");
    assert!(
        stderr.lines().any(|l| l.contains(",0]<stderr>:meshtrain: error") && l.contains("blame: rank 1:")),
        "rank 0 did not blame rank 1:\n{stderr}"
    );
}
