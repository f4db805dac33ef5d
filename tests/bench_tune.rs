//! `meshtrain bench --tune` writes a table that jobs load (`MESHTRAIN_TUNING`), keeping the rules
//! of other world sizes; a job with the table runs exact collectives; a bad table stops every rank
//! with an error naming the file and field. The standalone MPI baseline (benches/mpi_coll.c)
//! builds with mpicc and prints the same sizes as `meshtrain bench`. No timing is asserted.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use meshtrain::comm::tuner::{LinkKind, Tuning, TUNED};

const SWEEP: [&str; 10] = ["--min", "4K", "--max", "64K", "--factor", "4", "--iters", "2", "--warmup", "1"];

fn tune(np: usize, out: &Path) {
    let mut cmd = common::mpirun(np);
    cmd.args(["bench", "all", "--tune", "--tune-rounds", "1", "--tune-out"]).arg(out).args(SWEEP);
    let run = common::run(cmd, Duration::from_secs(120));
    assert!(run.success(), "bench --tune on {np} ranks:\n{}\n{}", run.stdout, run.stderr);
    assert!(run.stdout.contains("best="), "{}", run.stdout);
}

#[test]
fn tuned_table_is_written_merged_loaded_and_checked() {
    let dir = tempfile_dir("tune");
    let table = dir.join("tuning.toml");
    tune(2, &table);
    tune(3, &table);
    let t = Tuning::load(&table).unwrap();
    for coll in TUNED {
        for ranks in [2, 3] {
            // Every size of the sweep has a rule measured on exactly this world size.
            assert!(t.rules().iter().any(|r| r.coll == coll && r.ranks == ranks), "{coll} on {ranks}: {t:?}");
            assert!(t.select(coll, ranks, LinkKind::Shm, 4096).is_some());
        }
    }
    // A job with the table: every collective exact through the schedules it picks.
    let mut cmd = common::mpirun(3);
    cmd.args(["selftest", "--counts", "0,1,13,4099,20000", "--large", "0"]).env("MESHTRAIN_TUNING", &table);
    let run = common::run(cmd, Duration::from_secs(120));
    assert!(run.success() && run.stdout.contains("0 mismatches"), "{}\n{}", run.stdout, run.stderr);

    // A table with a bad field, and a missing file: a clear error and a non-zero exit.
    let bad = dir.join("bad.toml");
    std::fs::write(
        &bad,
        "[[rule]]\ncoll = \"all_reduce\"\nranks = 2\nlink = \"shm\"\nalgo = \"tree\"\nchunk_bytes = 1024\n",
    )
    .unwrap();
    for (file, want) in [(bad.clone(), "rule[0].algo"), (dir.join("missing.toml"), "missing.toml")] {
        let mut cmd = common::mpirun(2);
        cmd.args(["selftest", "--counts", "1", "--large", "0"]).env("MESHTRAIN_TUNING", &file);
        let run = common::run(cmd, Duration::from_secs(60));
        assert!(!run.success(), "{}", run.stdout);
        assert!(run.stderr.contains("MESHTRAIN_TUNING") && run.stderr.contains(want), "{want}: {}", run.stderr);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn standalone_mpi_baseline_builds_and_sweeps_the_same_sizes() {
    let dir = tempfile_dir("mpi-coll");
    let exe = dir.join("mpi_coll");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/mpi_coll.c");
    let cc = Command::new("mpicc").args(["-O2", "-Wall", "-Werror", "-o"]).arg(&exe).arg(&src).output().unwrap();
    assert!(cc.status.success(), "mpicc: {}", String::from_utf8_lossy(&cc.stderr));
    let sizes = |out: &str, col: usize| -> Vec<String> {
        let lines = out.lines().map(|l| l.split_once(':').map_or(l, |(_, rest)| rest));
        lines.filter(|l| l.starts_with("all_gather,")).map(|l| l.split(',').nth(col).unwrap().to_string()).collect()
    };
    let mut mpi = common::mpirun(3);
    // Replace the program common::mpirun put last with the baseline.
    let args: Vec<_> = mpi.get_args().map(|a| a.to_owned()).collect();
    let mut cmd = Command::new(mpi.get_program());
    cmd.args(&args[..args.len() - 1]).arg(&exe).arg("all_gather").args(SWEEP);
    cmd.envs(mpi.get_envs().filter_map(|(k, v)| v.map(|v| (k.to_owned(), v.to_owned()))));
    let base = common::run(cmd, Duration::from_secs(60));
    assert!(base.success(), "{}\n{}", base.stdout, base.stderr);
    mpi.args(["bench", "all_gather", "--csv"]).args(SWEEP);
    let ours = common::run(mpi, Duration::from_secs(60));
    assert!(ours.success(), "{}\n{}", ours.stdout, ours.stderr);
    let (b, o) = (sizes(&base.stdout, 2), sizes(&ours.stdout, 2));
    assert_eq!(b.len(), 3, "{}", base.stdout);
    assert_eq!(b, o, "element counts of the baseline and of meshtrain bench");
    // A bad option: usage and exit status 2, no hang.
    let bad = Command::new(&exe)
        .arg("--iters")
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2), "{}", String::from_utf8_lossy(&bad.stderr));
    let _ = std::fs::remove_dir_all(&dir);
}

fn tempfile_dir(what: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("meshtrain-{what}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}
