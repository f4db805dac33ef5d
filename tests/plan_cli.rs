//! `meshtrain plan` and `meshtrain tune` as a user runs them: bad input exits 2 naming the flag or
//! the profile field; `--write` gives a job file that loads for the planned rank count and an
//! sbatch script; `tune` runs its trials and writes the winner and the calibration error.

mod common;

use std::process::Command;

fn plan(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(common::meshtrain()).arg("plan").args(args).output().expect("meshtrain starts");
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.code().unwrap_or(-1), text(&out.stdout), text(&out.stderr))
}

#[test]
fn bad_input_exits_2_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let base = ["--gpus", "8", "--global-batch", "8"];
    let with = |extra: &[&str]| plan(&[extra, &base[..]].concat());
    for (args, expect) in [
        (vec!["--model", "17b", "--machine", "frontier"], "--model"),
        (vec!["--model", "d12", "--machine", "summit"], "--machine"),
        (vec!["--model", "1t", "--machine", "frontier"], "--gpus"),
    ] {
        let (code, _, err) = with(&args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.contains(expect), "{args:?}: {err}");
    }
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/jobs/machines/frontier.toml")).unwrap();
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, text.replace("bandwidth_gbs = 1600\n", "")).unwrap();
    let (code, _, err) = with(&["--model", "d12", "--machine", bad.to_str().unwrap()]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("memory.bandwidth_gbs"), "{err}");
}

#[test]
fn write_gives_a_loadable_job_and_an_sbatch() {
    let dir = tempfile::tempdir().unwrap();
    let job = dir.path().join("job.toml");
    let (code, out, err) = plan(&[
        "--model", "d24", "--machine", "dgx-a100", "--gpus", "16", "--global-batch", "64", "--write", job.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(out.lines().any(|l| l.trim_start().starts_with("1 ")), "{out}");
    let cfg = meshtrain::config::JobConfig::load(&job, &[]).unwrap();
    cfg.validate_world(16).unwrap();
    let sbatch = std::fs::read_to_string(dir.path().join("job.sbatch")).unwrap();
    assert!(sbatch.contains("#SBATCH -N 2") && sbatch.contains("train"), "{sbatch}");
}

#[test]
fn tune_runs_its_trials_and_records_the_error() {
    let dir = tempfile::tempdir().unwrap();
    let job = common::tiny_job(dir.path(), "tiny.toml", "");
    let out = dir.path().join("tune");
    let status = Command::new(common::meshtrain())
        .args(["tune", job.to_str().unwrap(), "--machine", "dgx-a100", "--top", "2", "--steps", "3", "--warmup", "1", "--launch", ""])
        .args(["--repeat", "2"])
        .args(["--out", out.to_str().unwrap()])
        .status()
        .unwrap();
    assert!(status.success());
    let tune: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("tune.json")).unwrap()).unwrap();
    let trials = tune["trials"].as_array().unwrap();
    assert_eq!(trials.len(), 2);
    assert!(trials.iter().all(|t| t["measured_s"].as_f64().unwrap() > 0.0));
    // Both ranks are recorded; the measured ranks are 1 and 2, in the printed (measured) order.
    let mut ranks: Vec<u64> = trials.iter().map(|t| t["measured_rank"].as_u64().unwrap()).collect();
    ranks.sort();
    assert_eq!(ranks, [1, 2]);
    assert!(trials.iter().all(|t| t["predicted_rank"].as_u64().is_some()));
    // Two runs of each layout.
    for f in ["trial0-run0", "trial0-run1", "trial1-run0", "trial1-run1"] {
        assert!(out.join("trials").join(format!("{f}.jsonl")).exists(), "{f}");
    }
    assert!(tune["mean_abs_error_pct"].as_f64().unwrap().is_finite());
    meshtrain::config::JobConfig::load(&out.join("best.toml"), &[]).unwrap().validate_world(1).unwrap();
}

/// A measured strong-scaling point of `ranks` ranks, all tensor parallel, whose steps take
/// `step_s`, as `sweep run` writes it.
fn sweep_point(dir: &std::path::Path, ranks: usize, step_s: f64) {
    use meshtrain::sweep::{Mode, PointMeta};
    let meta = PointMeta::new(Mode::Strong, 1, ranks, [ranks, 1, 1], [8, 1, 1024], 1e9);
    let points = dir.join("points");
    std::fs::create_dir_all(&points).unwrap();
    std::fs::write(points.join(format!("{}.json", meta.name())), serde_json::to_string(&meta).unwrap()).unwrap();
    let line = format!("{{\"step\":1,\"step_s\":{step_s},\"compute_s\":{step_s}}}\n");
    std::fs::write(points.join(format!("{}.jsonl", meta.name())), line.repeat(4)).unwrap();
}

#[test]
fn scaling_overlay_draws_prediction_and_sweep_on_one_chart() {
    let dir = tempfile::tempdir().unwrap();
    let sweep = dir.path().join("sweep");
    for (ranks, step) in [(1, 0.8), (2, 0.45), (4, 0.3)] {
        sweep_point(&sweep, ranks, step);
    }
    let out = dir.path().join("charts");
    let args = ["--model", "d12", "--machine", "dgx-a100", "--global-batch", "8", "--seq-len", "1024", "--scaling", "strong"];
    let (code, text, err) = plan(&[&args[..], &["--gpus", "1,2,4", "--overlay", sweep.to_str().unwrap(), "--out", out.to_str().unwrap()]].concat());
    assert_eq!(code, 0, "{err}");
    // Each count is predicted on the sweep's own grid (all TP here; the free choice is DP).
    for layout in ["tp1-pp1-dp1", "tp2-pp1-dp1", "tp4-pp1-dp1"] {
        assert!(text.contains(layout), "{layout}: {text}");
    }
    // One comparison row per rank count, with the measured step time of the sweep's point.
    for (ranks, measured) in [("1", "0.8000"), ("2", "0.4500"), ("4", "0.3000")] {
        assert!(text.lines().any(|l| l.split_whitespace().next() == Some(ranks) && l.contains(measured)), "{text}");
    }
    for stem in ["predicted_vs_measured_efficiency", "predicted_vs_measured_throughput_per_rank"] {
        let svg = std::fs::read_to_string(out.join(format!("{stem}.svg"))).unwrap();
        assert!(svg.contains("strong predicted") && svg.contains("strong measured"), "{stem}: both series in the legend");
        assert!(out.join(format!("{stem}.png")).exists());
    }
    // A sweep without points of the predicted mode is refused, naming the flag.
    let (code, _, err) = plan(&[&args[..9], &["weak", "--gpus", "1,2", "--overlay", sweep.to_str().unwrap()]].concat());
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--overlay"), "{err}");
}

/// `meshtrain bench --csv` rows of `coll` as a schedule with `latency_us` and `busbw_gbs` on 2
/// ranks would measure them.
fn bench_csv(coll: &str, latency_us: f64, busbw_gbs: f64) -> String {
    let mut s = "coll,bytes,count,dtype,time_us,algbw_gbs,busbw_gbs,wrong\n".to_string();
    let factor = if coll == "all_reduce" { 1.0 } else { 0.5 };
    for kib in [8u64, 32, 128, 512, 2048, 8192] {
        let bytes = kib * 1024;
        let t = latency_us + bytes as f64 * factor / (busbw_gbs * 1e3);
        s += &format!("{coll},{bytes},{},f32,{t:.3},0,0,0\n", bytes / 4);
    }
    s
}

#[test]
fn calibrate_fits_bench_csv_per_schedule_and_writes_a_loadable_profile() {
    let dir = tempfile::tempdir().unwrap();
    let (ring, direct) = (dir.path().join("ring.csv"), dir.path().join("direct.csv"));
    std::fs::write(&ring, bench_csv("all_reduce", 40.0, 4.0) + bench_csv("all_gather", 20.0, 3.0).split_once('\n').unwrap().1).unwrap();
    std::fs::write(&direct, bench_csv("all_reduce", 10.0, 1.0)).unwrap();
    let profile = dir.path().join("here.toml");
    let out = common::mpirun(2)
        .args(["plan", "calibrate", "--out", profile.to_str().unwrap(), "--bench-ranks", "2"])
        .args(["--bench-csv", &format!("ring={}", ring.display()), "--bench-csv", &format!("direct={}", direct.display())])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let p = meshtrain::plan::Profile::load(profile.to_str().unwrap()).unwrap();
    let fit = |coll: &str, algo: &str| p.collectives.iter().find(|f| f.coll == coll && f.algo == algo).unwrap().clone();
    for (coll, algo, lat, bw) in [("all_reduce", "ring", 40.0, 4.0), ("all_reduce", "direct", 10.0, 1.0), ("all_gather", "ring", 20.0, 3.0)] {
        let f = fit(coll, algo);
        assert!((f.latency_us - lat).abs() < 0.01 * lat && (f.busbw_gbs - bw).abs() < 0.01 * bw, "{f:?}");
    }
    assert_eq!(p.collectives.len(), 3);
    // The ring all-reduce is the intra link: latency per ring step (2 (g-1) = 2 steps), bus bandwidth.
    assert!((p.intra.latency_us - 20.0).abs() < 0.2 && (p.intra.bandwidth_gbs - 4.0).abs() < 0.04, "{:?}", p.intra);
    assert!(p.description.contains("copied"), "{}", p.description);
    assert!(p.overhead.source.contains("StepHarness") && p.overhead.block_ms.is_finite(), "{:?}", p.overhead);
    assert!(!p.compute.measured.is_empty());
    // The planner loads it.
    let (code, text, err) = plan(&["--model", "d12", "--machine", profile.to_str().unwrap(), "--gpus", "2", "--global-batch", "4", "--seq-len", "64"]);
    assert_eq!(code, 0, "{err}");
    assert!(text.lines().any(|l| l.trim_start().starts_with("1 ")), "{text}");
    // A bench file without the columns is refused on every rank, naming it; nothing is written.
    // (mpirun may exit 0 when every rank failed, see common::mpirun.)
    let bad = dir.path().join("bad.csv");
    std::fs::write(&bad, "coll,size\n").unwrap();
    let none = dir.path().join("none.toml");
    let out = common::mpirun(2)
        .args(["plan", "calibrate", "--out", none.to_str().unwrap(), "--bench-csv", &format!("ring={}", bad.display())])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.matches("bad.csv: not `meshtrain bench --csv` output: no `bytes` column").count(), 2, "{err}");
    assert!(!none.exists());
}

/// A Llama plan as the user runs it: the table, `--json` with one object per layout, `--write`
/// giving a job file of the same Llama shape; a job file as `--model`; impossible TP named.
#[test]
fn llama_7b_on_frontier_ranks_writes_and_names_impossible_tp() {
    let dir = tempfile::tempdir().unwrap();
    let base = ["--model", "llama-7b", "--machine", "frontier", "--gpus", "64", "--global-batch", "512", "--seq-len", "4096"];
    let job = dir.path().join("llama.toml");
    let (code, out, err) = plan(&[&base[..], &["--write", job.to_str().unwrap()]].concat());
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("# llama-7b on 64 GPUs of frontier") && out.lines().any(|l| l.trim_start().starts_with("1 ")), "{out}");
    assert!(out.contains("tp 64: parallel.tp = 64: n_head 32 is not divisible by tp 64"), "{out}");
    let cfg = meshtrain::config::JobConfig::load(&job, &[]).unwrap();
    cfg.validate_world(64).unwrap();
    assert_eq!(cfg.model, meshtrain::model::GptConfig::named("llama-7b").unwrap());
    let (code, json, err) = plan(&[&base[..], &["--json"]].concat());
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["job"]["model"]["arch"], "llama");
    let first = &v["layouts"][0];
    let (tp, pp, dp) = (first["tp"].as_u64().unwrap(), first["pp"].as_u64().unwrap(), first["dp"].as_u64().unwrap());
    assert_eq!(tp * pp * dp, 64);
    // Memory per GCD (with the profile's reserve) within the MI250X GCD's 64 GB.
    assert!(first["mem_per_gpu_gb"].as_f64().unwrap() <= 64.0, "{first}");
    // The written job file's [model] plans the same shape (`--model FILE`).
    let (code, again, err) = plan(&["--model", job.to_str().unwrap(), "--machine", "frontier", "--gpus", "64", "--global-batch", "512", "--json"]);
    assert_eq!(code, 0, "{err}");
    let w: serde_json::Value = serde_json::from_str(&again).unwrap();
    assert_eq!(w["layouts"][0]["step_s"], first["step_s"]);
    // 3 GPUs: TP 3 cannot split 32 heads; 70B on 3 GPUs fits no layout and names --gpus.
    let (code, _, err) = plan(&["--model", "llama-70b", "--machine", "frontier", "--gpus", "3", "--global-batch", "3"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--gpus"), "{err}");
    let (code, _, err) = plan(&["--model", "llama-70b", "--machine", "frontier", "--gpus", "8", "--global-batch", "8", "--seq-len", "8192"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--seq-len") && err.contains("4096"), "{err}");
}
