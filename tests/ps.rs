//! Parameter-server data parallelism (`parallel.dp_sync = "ps"`) end to end with real rank
//! processes: the sync mode gives the all-reduce run's losses and parameters (bit for bit with
//! two workers, within 1e-6 with four), async with staleness 0 is sync bit for bit and with
//! staleness 1 and 4 trains with a bounded staleness histogram, checkpoints move between PS and
//! all-reduce in both directions, bad configurations name their key, and a killed server is
//! named by the survivors.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::tiny_job;

fn sets(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

fn losses(metrics: &Path) -> Vec<f64> {
    common::losses(metrics)
        .into_iter()
        .map(|(_, l)| l)
        .collect()
}

/// The last metrics line's staleness histogram.
fn staleness(metrics: &Path) -> Vec<u64> {
    let text = std::fs::read_to_string(metrics).unwrap();
    let last: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    last["ps_staleness"]
        .as_array()
        .expect("ps_staleness in the metrics")
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect()
}

/// Runs `job` on `np` ranks with a checkpoint at step 20, returns the losses and the exported
/// parameters and moments.
fn run(
    dir: &Path,
    name: &str,
    np: usize,
    job: &Path,
    extra: &[&str],
) -> (Vec<f64>, Vec<meshtrain::checkpoint::ExportedTensor>) {
    let metrics = dir.join(format!("{name}.jsonl"));
    let ckpt = dir.join(format!("{name}_ckpt"));
    let mut all = sets(&["checkpoint.every=10"]);
    all.push(format!("checkpoint.dir={:?}", ckpt.display().to_string()));
    all.extend(sets(extra));
    let out = common::train(np, job, &metrics, &all);
    let last = ckpt.join("step_00000020");
    assert!(
        last.join("checkpoint.h5").exists(),
        "{name}: {} is incomplete: {:?}\n{}\n{}",
        last.display(),
        std::fs::read_dir(&last).map(|d| d.flatten().map(|e| e.file_name()).collect::<Vec<_>>()),
        out.stdout,
        out.stderr
    );
    let params = common::export(&ckpt.join("step_00000020"), &dir.join(format!("{name}.h5")));
    (losses(&metrics), params)
}

fn bits(l: &[f64]) -> Vec<u64> {
    l.iter().map(|x| x.to_bits()).collect()
}

fn tensors_identical(
    a: &[meshtrain::checkpoint::ExportedTensor],
    b: &[meshtrain::checkpoint::ExportedTensor],
    what: &str,
) {
    assert_eq!(a.len(), b.len(), "{what}: tensor counts");
    for (x, y) in a.iter().zip(b) {
        assert_eq!((&x.0, &x.1), (&y.0, &y.1), "{what}");
        let same =
            x.2.iter()
                .zip(&y.2)
                .all(|(p, q)| p.to_bits() == q.to_bits());
        assert!(
            same && x.2.len() == y.2.len(),
            "{what}: tensor {} differs",
            x.0
        );
    }
}

#[test]
fn sync_servers_give_the_allreduce_run() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // Small buckets: the pieces are the buckets, several per server.
    let job = tiny_job(d, "job.toml", "[parallel]\ndp = 2\nbucket_mb = 0.05");
    let (ar, ar_params) = run(d, "ar2", 2, &job, &[]);
    let (ps, ps_params) = run(d, "ps2", 4, &job, &["parallel.dp_sync=ps", "ps.servers=2"]);
    assert_eq!(
        bits(&ps),
        bits(&ar),
        "two workers: the losses are the all-reduce run's bits\n{ps:?}\n{ar:?}"
    );
    tensors_identical(
        &ps_params,
        &ar_params,
        "two workers: parameters and moments at step 20",
    );
    // Two micro-batches per step: each worker scales by 1/2 before the push, as the buckets do.
    let accum = |name: &str, np: usize, extra: &[&str]| {
        let m = d.join(format!("{name}.jsonl"));
        let mut all = sets(&["train.grad_accum=2", "train.steps=6"]);
        all.extend(sets(extra));
        common::train(np, &job, &m, &all);
        bits(&losses(&m))
    };
    assert_eq!(
        accum("ar_accum", 2, &[]),
        accum("ps_accum", 3, &["parallel.dp_sync=ps"]),
        "grad_accum = 2"
    );
    // Four workers: the ring adds in another order; within 1e-6 relative at every step.
    let (ar4, ar4_params) = run(d, "ar4", 4, &job, &["parallel.dp=4"]);
    let (ps4, ps4_params) = run(d, "ps4", 5, &job, &["parallel.dp=4", "parallel.dp_sync=ps"]);
    for (i, (x, y)) in ps4.iter().zip(&ar4).enumerate() {
        assert!(
            (x - y).abs() <= 1e-6 * y.abs(),
            "four workers, step {}: {x} vs {y}",
            i + 1
        );
    }
    common::assert_params_close(&ps4_params, &ar4_params, 1e-5, "four workers");
}

#[test]
fn async_staleness_zero_is_sync_and_larger_staleness_trains_within_its_bound() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let job = tiny_job(
        d,
        "job.toml",
        "[parallel]\ndp = 2\ndp_sync = \"ps\"\nbucket_mb = 0.05\n[ps]\nservers = 1",
    );
    let sync = d.join("sync.jsonl");
    common::train(3, &job, &sync, &[]);
    let s0 = d.join("s0.jsonl");
    common::train(3, &job, &s0, &sets(&["ps.mode=async", "ps.staleness=0"]));
    assert_eq!(
        bits(&losses(&s0)),
        bits(&losses(&sync)),
        "staleness 0 is sync"
    );
    assert_eq!(staleness(&s0), vec![20]);
    for s in [1u64, 4] {
        let m = d.join(format!("s{s}.jsonl"));
        let out = common::train(
            3,
            &job,
            &m,
            &sets(&["ps.mode=async", &format!("ps.staleness={s}")]),
        );
        let l = losses(&m);
        assert!(l.iter().all(|x| x.is_finite()), "staleness {s}: {l:?}");
        assert!(l[19] < l[0] - 0.4, "staleness {s} does not train: {l:?}");
        let h = staleness(&m);
        assert_eq!(
            h.len(),
            s as usize + 1,
            "staleness {s}: one bin per lag 0..=s: {h:?}"
        );
        assert_eq!(
            h.iter().sum::<u64>(),
            20,
            "staleness {s}: every step counted: {h:?}"
        );
        assert!(out.stdout.contains("steps per staleness"), "{}", out.stdout);
    }
}

/// A PS run and an all-reduce run of `layout` (`np` workers, `ps.servers = 2`) each save a
/// checkpoint at step 10; each resumes under the other mode and steps 11-20 are the
/// uninterrupted run's bits.
fn checkpoints_move_both_ways(layout: &str, np: usize) {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let job = tiny_job(d, "job.toml", &format!("[parallel]\n{layout}\nbucket_mb = 0.05"));
    let ps_args = ["parallel.dp_sync=ps", "ps.servers=2"];
    let (ps, _) = run(d, "ps", np + 2, &job, &ps_args);
    let (ar, _) = run(d, "ar", np, &job, &[]);
    // Resume at step 10 under the other mode: steps 11-20 are the uninterrupted run's.
    let resume = |name: &str, np: usize, from: &str, extra: &[&str]| {
        let metrics = d.join(format!("{name}.jsonl"));
        let mut all = sets(extra);
        all.push(format!(
            "checkpoint.resume={:?}",
            d.join(from).join("step_00000010").display().to_string()
        ));
        common::train(np, &job, &metrics, &all);
        common::losses(&metrics)
    };
    let ar_from_ps = resume("ar_from_ps", np, "ps_ckpt", &[]);
    assert_eq!(ar_from_ps.first().map(|s| s.0), Some(11));
    assert_eq!(
        bits(&ar_from_ps.iter().map(|s| s.1).collect::<Vec<_>>()),
        bits(&ps[10..]),
        "{layout}: all-reduce resumed from a PS checkpoint"
    );
    let ps_from_ar = resume("ps_from_ar", np + 2, "ar_ckpt", &ps_args);
    assert_eq!(
        bits(&ps_from_ar.iter().map(|s| s.1).collect::<Vec<_>>()),
        bits(&ar[10..]),
        "{layout}: PS resumed from an all-reduce checkpoint"
    );
}

#[test]
fn checkpoints_move_between_servers_and_allreduce_both_ways() {
    checkpoints_move_both_ways("dp = 2", 2);
}

#[test]
fn tp2_checkpoints_move_between_servers_and_allreduce_both_ways() {
    checkpoints_move_both_ways("tp = 2\ndp = 2", 4);
}

/// (loss, grad_norm) bits of every step.
fn loss_and_norm_bits(metrics: &Path) -> Vec<(u64, u64)> {
    std::fs::read_to_string(metrics)
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            let f = |k: &str| v[k].as_f64().unwrap_or_else(|| panic!("{k} in {l}")).to_bits();
            (f("loss"), f("grad_norm"))
        })
        .collect()
}

/// Each (tp, pp) shard has its own pieces on the servers and the global norm is the whole
/// model's (each shard's counted spans, added over tp then pp as the all-reduce step adds its
/// partial norms): with two ranks per axis every sum is of two terms, so the losses and norms
/// are the all-reduce run's bits.
#[test]
fn tp_and_pp_shards_give_the_allreduce_run() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let job = tiny_job(d, "job.toml", "[parallel]\ndp = 2\nbucket_mb = 0.05");
    let layouts: &[(&str, usize, &[&str])] = &[
        ("tp2_dp2", 4, &["parallel.tp=2"]),
        ("pp2_dp2", 4, &["parallel.pp=2", "parallel.microbatches=2"]),
        (
            "tp2_pp2_dp2",
            8,
            &["parallel.tp=2", "parallel.pp=2", "parallel.microbatches=2"],
        ),
    ];
    for (name, np, layout) in layouts {
        let mut all = sets(layout);
        all.push("train.steps=8".into());
        let ar = d.join(format!("{name}_ar.jsonl"));
        common::train(*np, &job, &ar, &all);
        all.extend(sets(&["parallel.dp_sync=ps", "ps.servers=3"]));
        let ps = d.join(format!("{name}_ps.jsonl"));
        common::train(np + 3, &job, &ps, &all);
        let (a, p) = (loss_and_norm_bits(&ar), loss_and_norm_bits(&ps));
        assert_eq!(a.len(), 8, "{name}");
        assert_eq!(p, a, "{name}: (loss, norm) bits of the PS run vs the all-reduce run");
    }
}

/// The emulated GPU arm (`device = "emu"`, the path CUDA and HIP take: gradients copied device
/// -> host per piece as the backward finishes them, parameters host -> device after the pull)
/// gives the emu all-reduce run's losses and norms within 1e-6 relative, data-parallel and under
/// TP2. Not bit for bit: the all-reduce run's norm and AdamW run as device kernels (block sums of
/// squares, fused multiply-adds on a GPU), the servers' as the CPU arm's expressions.
#[test]
fn emu_device_servers_give_the_emu_allreduce_run() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let job = tiny_job(
        d,
        "job.toml",
        "[parallel]\ndp = 2\nbucket_mb = 0.05",
    );
    let emu = ["device=emu", "precision=fp32", "train.steps=4"];
    for (name, np, layout) in [("dp2", 2, &[][..]), ("tp2_dp2", 4, &["parallel.tp=2"][..])] {
        let mut all = sets(&emu);
        all.extend(sets(layout));
        let ar = d.join(format!("{name}_ar.jsonl"));
        common::train(np, &job, &ar, &all);
        all.extend(sets(&["parallel.dp_sync=ps", "ps.servers=2"]));
        let ps = d.join(format!("{name}_ps.jsonl"));
        common::train(np + 2, &job, &ps, &all);
        let (a, p) = (loss_and_norm_bits(&ar), loss_and_norm_bits(&ps));
        assert_eq!((a.len(), p.len()), (4, 4), "{name}");
        for (i, (x, y)) in p.iter().zip(&a).enumerate() {
            for (what, u, v) in [("loss", x.0, y.0), ("norm", x.1, y.1)] {
                let (u, v) = (f64::from_bits(u), f64::from_bits(v));
                assert!(
                    (u - v).abs() <= 1e-6 * v.abs(),
                    "emu {name}, step {}: {what} {u} (PS) vs {v} (all-reduce)",
                    i + 1
                );
            }
        }
    }
}

#[test]
fn bad_server_configurations_name_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let job = tiny_job(dir.path(), "job.toml", "[parallel]\ndp_sync = \"ps\"");
    let cases: &[(&[&str], &str, &str)] = &[
        (&["ps.servers=0"], "ps.servers", "at least 1"),
        (
            &["parallel.zero=1"],
            "parallel.zero",
            "servers hold the optimizer state",
        ),
        (&["ps.staleness=2"], "ps.staleness", "async"),
        (
            &["ps.colocate=true", "ps.servers=3"],
            "ps.servers",
            "every worker process runs one server",
        ),
        (&["precision=fp16"], "train.loss_scale", "cannot skip a step"),
        (&["train.loss_scale=1024"], "train.loss_scale", "cannot skip a step"),
        (&["ps.mode=later"], "ps.mode", "unknown variant"),
        (
            &["parallel.dp_sync=gossip"],
            "parallel.dp_sync",
            "unknown variant",
        ),
        // One process: 1 worker + 1 server needs 2 ranks.
        (
            &[],
            "ps.servers",
            "1 server(s) = 2 ranks, but the job has 1",
        ),
    ];
    for (set, key, says) in cases {
        let mut cmd = Command::new(common::meshtrain());
        cmd.arg("train").arg(&job);
        for s in *set {
            cmd.args(["--set", s]);
        }
        let out = cmd.output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{set:?}: {err}");
        assert!(err.contains(key) && err.contains(says), "{set:?}: {err}");
    }
}

/// SIGKILLs rank `victim` of a running `np`-rank job of `layout` (lines of `[parallel]` and
/// after); every survivor must exit naming it, within a minute.
fn kill_and_check_survivors(victim: usize, np: usize, layout: &str) {
    let dir = tempfile::tempdir().unwrap();
    let job = tiny_job(
        dir.path(),
        "job.toml",
        &format!("[parallel]\ndp_sync = \"ps\"\n{layout}"),
    );
    let text = std::fs::read_to_string(&job)
        .unwrap()
        .replace("\nsteps = 20", "\nsteps = 100000");
    std::fs::write(&job, text).unwrap();
    let metrics = dir.path().join("m.jsonl");
    let mut cmd = common::mpirun(np);
    cmd.arg("train").arg(&job).arg("--metrics").arg(&metrics);
    let mut launcher = 0;
    let child = common::spawn_then_signal(cmd, &metrics, 3, "KILL", |pid| {
        launcher = pid;
        common::rank_pid(pid, victim)
    });
    let (limit, killed) = (Duration::from_secs(60), Instant::now());
    while !common::rank_pids(launcher).is_empty() {
        assert!(
            killed.elapsed() < limit,
            "the survivors did not end after rank {victim} died"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // mpirun, told not to abort, may linger after its processes are gone: the test ends it.
    let out = common::wait(child, Duration::from_secs(5));
    for r in (0..np).filter(|&r| r != victim) {
        let said = out.rank_stderr(r).join("\n");
        assert!(
            said.contains("error") && said.contains(&format!("rank {victim}")),
            "rank {r} does not name rank {victim}:\n{said}"
        );
    }
}

#[test]
fn a_killed_server_is_named_by_every_worker_and_nothing_hangs() {
    kill_and_check_survivors(2, 3, "dp = 2");
}

#[test]
fn a_killed_worker_is_named_by_the_other_worker_and_the_server() {
    kill_and_check_survivors(0, 3, "dp = 2");
}

/// A colocated worker + server process dies: the other process (its worker and its server
/// thread) names it and ends.
#[test]
fn a_killed_colocated_worker_and_server_is_named_by_the_survivors() {
    kill_and_check_survivors(1, 3, "dp = 3\n[ps]\ncolocate = true");
}

/// `ps.colocate = true`: every worker process runs a server (no extra ranks), the pieces are
/// spread over all of them as over as many server ranks, and the sums have the same fixed
/// order: the losses and norms are the separate servers' run's bits (DP2, TP2 x DP2).
#[test]
fn colocated_servers_give_the_separate_servers_run() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let job = tiny_job(d, "job.toml", "[parallel]\ndp = 2\ndp_sync = \"ps\"\nbucket_mb = 0.05");
    for (name, np, layout) in [("dp2", 2, &[][..]), ("tp2_dp2", 4, &["parallel.tp=2"][..])] {
        let mut all = sets(layout);
        all.push("train.steps=8".into());
        let mut separate = all.clone();
        separate.push(format!("ps.servers={np}"));
        let sep = d.join(format!("{name}_separate.jsonl"));
        common::train(2 * np, &job, &sep, &separate);
        all.push("ps.colocate=true".into());
        let col = d.join(format!("{name}_colocated.jsonl"));
        let out = common::train(np, &job, &col, &all);
        assert!(out.stdout.contains("colocated"), "{}", out.stdout);
        let (a, b) = (loss_and_norm_bits(&sep), loss_and_norm_bits(&col));
        assert_eq!(a.len(), 8, "{name}");
        assert_eq!(b, a, "{name}: colocated vs separate servers");
    }
}

#[test]
fn stop_signals_checkpoint_through_the_servers_and_the_job_resumes() {
    // Slurm's `--signal=USR1@120` to one rank, and SIGTERM to every rank (servers included) as at
    // the time limit: the workers stop together, checkpoint through the servers, and all exit 0.
    for (signal, all) in [("USR1", false), ("TERM", true)] {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let ckpt = d.join("ckpt");
        let extra = format!(
            "[parallel]\ndp = 2\ndp_sync = \"ps\"\n[checkpoint]\ndir = {:?}",
            ckpt.display().to_string()
        );
        let job = tiny_job(d, "job.toml", &extra);
        let text = std::fs::read_to_string(&job)
            .unwrap()
            .replace("\nsteps = 20", "\nsteps = 100000");
        std::fs::write(&job, text).unwrap();
        let metrics = d.join("m.jsonl");
        let mut cmd = common::mpirun(3);
        cmd.arg("train").arg(&job).arg("--metrics").arg(&metrics);
        let child = common::spawn_then_signal(cmd, &metrics, 3, signal, |launcher| {
            if !all {
                return launcher;
            }
            let ranks = common::rank_pids(launcher);
            assert_eq!(ranks.len(), 3, "{ranks:?}");
            for &(_, pid) in ranks.iter().filter(|(r, _)| *r != 0) {
                let st = std::process::Command::new("kill").args(["-TERM", &pid.to_string()]).status().unwrap();
                assert!(st.success(), "kill -TERM {pid}");
            }
            common::rank_pid(launcher, 0)
        });
        let limit = Duration::from_secs(60);
        let out = common::wait(child, limit);
        assert!(out.success(), "SIG{signal}: {}\n{}", out.stdout, out.stderr);
        let said = format!("stopped by SIG{signal}");
        assert!(out.stdout.contains(&said) || out.stderr.contains(&said), "{}\n{}", out.stdout, out.stderr);
        let last = common::losses(&metrics).last().unwrap().0;
        let saved = ckpt.join(format!("step_{last:08}"));
        assert!(
            saved.join("checkpoint.h5").exists(),
            "SIG{signal}: no complete checkpoint at step {last}: {}",
            out.stdout
        );
        // The job resumes from it, through the servers again.
        let resumed = d.join("r.jsonl");
        let sets = vec![
            format!("train.steps={}", last + 3),
            "checkpoint.resume=latest".to_string(),
        ];
        common::train(3, &job, &resumed, &sets);
        let steps: Vec<u64> = common::losses(&resumed).iter().map(|s| s.0).collect();
        assert_eq!(steps, vec![last + 1, last + 2, last + 3], "SIG{signal}");
    }
}
