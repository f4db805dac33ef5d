//! Checkpoint tests on in-process ranks: round trips, resharding, atomicity under injected
//! failures and a full disk, corruption detection, inspect/export, and the external readers
//! (h5dump, h5py) when installed.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use crate::checkpoint::save::{fault, Stage};
use crate::checkpoint::*;
use crate::comm::testing::run_ranks;
use crate::comm::{block_range, CommConfig};
use crate::error::{Error, Result};
use crate::model::{GptConfig, ParamLayout};
use crate::optim::AdamWConfig;

fn meta(step: u64) -> CkptMeta {
    let mut m = CkptMeta::new(
        step,
        1000 * step,
        GptConfig::named("tiny").unwrap(),
        OptimizerMeta {
            adamw: AdamWConfig::default(),
            steps_taken: step,
        },
    );
    m.parallel = serde_json::json!({"dp": 3, "zero": 1});
    m
}

/// Value of element (i, j) of the test matrix `model/w`.
fn w(i: usize, j: usize) -> f32 {
    (i * 100 + j) as f32
}

const ROWS: usize = 6;
const COLS: usize = 4;

/// (offset, shape, values) of a box a test rank owns.
type OwnedBox = (Vec<usize>, Vec<usize>, Vec<f32>);

/// Rank `r` of 3 owns rows block `r` of `model/w` (6, 4), cut into two column halves, and block `r`
/// of the vector `model/b` (7).
fn owned(r: usize) -> (Vec<OwnedBox>, (usize, Vec<f32>)) {
    let rows = block_range(ROWS, 3, r);
    let boxes = (0..2)
        .map(|h| {
            let cols = block_range(COLS, 2, h);
            let data = rows
                .clone()
                .flat_map(|i| cols.clone().map(move |j| w(i, j)))
                .collect();
            (vec![rows.start, cols.start], vec![rows.len(), cols.len()], data)
        })
        .collect();
    let b = block_range(7, 3, r);
    (boxes, (b.start, b.clone().map(|i| i as f32 * 0.5).collect()))
}

/// Saves step `step` of the 3-way test checkpoint under `root` from 3 in-process ranks.
fn save_3x2(root: &Path, step: u64) -> Vec<Result<PathBuf>> {
    let root = root.to_path_buf();
    run_ranks(3, CommConfig::default(), move |comm| {
        let (boxes, (b_off, b)) = owned(comm.rank());
        let mut slices: Vec<ShardSlice> = boxes
            .iter()
            .map(|(offset, shape, data)| ShardSlice {
                name: "model/w".into(),
                global_shape: vec![ROWS, COLS],
                offset: offset.clone(),
                shape: shape.clone(),
                data,
            })
            .collect();
        slices.push(ShardSlice {
            name: "model/b".into(),
            global_shape: vec![7],
            offset: vec![b_off],
            shape: vec![b.len()],
            data: &b,
        });
        save(&comm, &root, step, &slices, &meta(step), 2)
    })
}

fn ok_all(results: Vec<Result<PathBuf>>) -> PathBuf {
    let paths: Vec<PathBuf> = results.into_iter().map(|r| r.expect("save succeeds")).collect();
    assert!(
        paths.iter().all(|p| p == &paths[0]),
        "every rank returns the same path"
    );
    paths[0].clone()
}

/// Every rank failed with the same message; returns it.
fn same_err(results: Vec<Result<PathBuf>>) -> String {
    let msgs: Vec<String> = results
        .into_iter()
        .map(|r| r.expect_err("save fails").to_string())
        .collect();
    assert!(msgs.iter().all(|m| m == &msgs[0]), "ranks disagree: {msgs:#?}");
    msgs[0].clone()
}

#[test]
fn round_trip_and_hyperslab_across_shards() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = ok_all(save_3x2(tmp.path(), 10));
    assert_eq!(ckpt, tmp.path().join("step_00000010"));
    assert_eq!(
        std::fs::read_to_string(tmp.path().join("latest")).unwrap(),
        "step_00000010\n"
    );
    let index = open(tmp.path()).unwrap();
    assert_eq!(index.meta(), &meta(10));
    assert_eq!(index.tensor("model/w").unwrap().shards.len(), 6);
    let mut all = vec![0f32; ROWS * COLS];
    index
        .load_slice("model/w", &[0, 0], &[ROWS, COLS], &mut all)
        .unwrap();
    let expect: Vec<f32> = (0..ROWS).flat_map(|i| (0..COLS).map(move |j| w(i, j))).collect();
    assert_eq!(all, expect);
    // Rows 1..5 cross all three row blocks, columns 1..3 cross both column halves.
    let mut part = vec![0f32; 4 * 2];
    load_slice(&ckpt, "model/w", &[1, 1], &[4, 2], &mut part).unwrap();
    let expect: Vec<f32> = (1..5).flat_map(|i| (1..3).map(move |j| w(i, j))).collect();
    assert_eq!(part, expect);
    let mut b = vec![0f32; 3];
    index.load_slice("model/b", &[2], &[3], &mut b).unwrap();
    assert_eq!(b, vec![1.0, 1.5, 2.0]);
    let err = index
        .load_slice("model/w", &[5, 0], &[2, 4], &mut [0f32; 8])
        .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
}

#[test]
fn h5dump_and_h5py_read_the_global_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = ok_all(save_3x2(tmp.path(), 1));
    // Run from another directory: the virtual datasets must find their sources relative to the index.
    match Command::new("h5dump")
        .args(["-d", "/model/w"])
        .arg(ckpt.join(INDEX_FILE))
        .current_dir("/")
        .output()
    {
        Err(e) => println!("SKIP h5dump check: h5dump not runnable ({e}); install hdf5-tools"),
        Ok(out) => {
            let text = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success(),
                "h5dump failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(
                text.contains("DATASPACE  SIMPLE { ( 6, 4 ) / ( 6, 4 ) }"),
                "{text}"
            );
            assert!(text.contains("(5,0): 500, 501, 502, 503"), "{text}");
        }
    }
    // The first interpreter that has h5py: the one named by MESHTRAIN_H5PY_PYTHON, `python3` on
    // PATH, or Debian's (python3-h5py installs there even when another python3 comes first).
    let candidates: Vec<String> = std::env::var("MESHTRAIN_H5PY_PYTHON")
        .into_iter()
        .chain(["python3".to_string(), "/usr/bin/python3".to_string()])
        .collect();
    let python = candidates.into_iter().find(|p| {
        Command::new(p).args(["-c", "import h5py"]).output().is_ok_and(|o| o.status.success())
    });
    let Some(python) = python else {
        let fix = "set MESHTRAIN_H5PY_PYTHON or install python3-h5py";
        assert!(std::env::var("MESHTRAIN_REQUIRE_H5PY").is_err(), "h5py is required but missing ({fix})");
        println!("SKIP h5py check: no python3 with h5py ({fix})");
        return;
    };
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/checkpoint_h5py.py");
    let out = Command::new(&python)
        .arg(script)
        .arg(&ckpt)
        .arg("model/w=i[0]*100+i[1]")
        .arg("model/b=i[0]*0.5")
        .current_dir("/")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    print!("{}", String::from_utf8_lossy(&out.stdout));
}

#[test]
fn zero_shards_reload_at_another_data_parallel_size() {
    let tmp = tempfile::tempdir().unwrap();
    let layout = Arc::new(ParamLayout::new(&GptConfig::named("tiny").unwrap()));
    let n = layout.total_len();
    let params: Arc<Vec<f32>> = Arc::new((0..n).map(|i| (i % 977) as f32 - 400.0).collect());
    let (root, lay, p) = (tmp.path().to_path_buf(), layout.clone(), params.clone());
    let results = run_ranks(3, CommConfig::default(), move |comm| {
        let mine = block_range(n, 3, comm.rank());
        let m: Vec<f32> = p[mine.clone()].iter().map(|x| x * 2.0).collect();
        let mut slices = flat_range_slices("model", lay.entries(), &p, 0, mine.clone())?;
        slices.extend(flat_range_slices(
            "optim/m",
            lay.entries(),
            &m,
            mine.start,
            mine.clone(),
        )?);
        save(&comm, &root, 5, &slices, &meta(5), 0)
    });
    ok_all(results);
    let index = open(tmp.path()).unwrap();
    let expected: Vec<(String, Vec<usize>)> = ["model", "optim/m"]
        .iter()
        .flat_map(|p| {
            layout
                .entries()
                .iter()
                .map(move |e| (format!("{p}/{}", e.name), e.shape.clone()))
        })
        .collect();
    index.expect_tensors(&expected).unwrap();
    for r in 0..2 {
        let range = block_range(n, 2, r);
        let mut out = vec![0f32; range.len()];
        load_flat_range(&index, "model", layout.entries(), range.clone(), &mut out).unwrap();
        assert_eq!(out, params[range.clone()]);
        load_flat_range(&index, "optim/m", layout.entries(), range.clone(), &mut out).unwrap();
        assert!(out.iter().zip(&params[range]).all(|(a, b)| *a == b * 2.0));
    }
}

#[test]
fn failing_rank_is_named_and_previous_checkpoint_stays_latest() {
    let tmp = tempfile::tempdir().unwrap();
    ok_all(save_3x2(tmp.path(), 1));
    let root = tmp.path().to_path_buf();
    let results = run_ranks(3, CommConfig::default(), move |comm| {
        if comm.rank() == 1 {
            fault::set(|s| match s {
                Stage::ShardWritten => Err(Error::file("rank_00001.h5", None, "injected write failure")),
                _ => Ok(()),
            });
        }
        let (boxes, _) = owned(comm.rank());
        let (offset, shape, data) = &boxes[0];
        let s = ShardSlice {
            name: "model/w".into(),
            global_shape: vec![ROWS, COLS],
            offset: offset.clone(),
            shape: shape.clone(),
            data,
        };
        save(&comm, &root, 2, &[s], &meta(2), 2)
    });
    let msg = same_err(results);
    assert!(
        msg.contains("rank 1 failed") && msg.contains("rank_00001.h5") && msg.contains("injected"),
        "{msg}"
    );
    let names: Vec<String> = std::fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert!(
        !names.iter().any(|n| n.starts_with("step_00000002")),
        "no trace of the failed save: {names:?}"
    );
    let index = open(tmp.path()).unwrap();
    assert_eq!(index.meta().step, 1);
    index.verify().unwrap();
}

#[test]
fn bad_slices_fail_on_every_rank() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().to_path_buf();
    // Rank 1 passes 3 values for a 4-element slice.
    let results = run_ranks(2, CommConfig::default(), move |comm| {
        let data = vec![1f32; 4 - comm.rank()];
        let s = ShardSlice {
            name: "model/x".into(),
            global_shape: vec![8],
            offset: vec![4 * comm.rank()],
            shape: vec![4],
            data: &data,
        };
        save(&comm, &root, 1, &[s], &meta(1), 1)
    });
    let msg = same_err(results);
    assert!(
        msg.contains("rank 1 failed") && msg.contains("3 elements for shape [4]"),
        "{msg}"
    );
    // Both ranks write the same half: the shards overlap and leave a gap.
    let root = tmp.path().to_path_buf();
    let results = run_ranks(2, CommConfig::default(), move |comm| {
        let data = vec![comm.rank() as f32; 4];
        let s = ShardSlice {
            name: "model/x".into(),
            global_shape: vec![8],
            offset: vec![0],
            shape: vec![4],
            data: &data,
        };
        save(&comm, &root, 1, &[s], &meta(1), 1)
    });
    let msg = same_err(results);
    assert!(msg.contains("model/x") && msg.contains("overlap"), "{msg}");
    assert!(open(tmp.path()).is_err(), "nothing was saved");
}

/// Runs a 1-rank save of the 3x2 data with `hook` installed; a panic in the hook plays a crash.
fn crash_at(root: &Path, step: u64, at: Stage) {
    let root = root.to_path_buf();
    run_ranks(1, CommConfig::default(), move |comm| {
        fault::set(move |s| {
            assert!(s != at, "simulated crash at {s:?}");
            Ok(())
        });
        let data: Vec<f32> = (0..ROWS).flat_map(|i| (0..COLS).map(move |j| w(i, j))).collect();
        let s = ShardSlice {
            name: "model/w".into(),
            global_shape: vec![ROWS, COLS],
            offset: vec![0, 0],
            shape: vec![ROWS, COLS],
            data: &data,
        };
        let crashed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            save(&comm, &root, step, &[s], &meta(step), 3)
        }));
        assert!(crashed.is_err(), "the hook panicked");
    });
}

#[test]
fn crashes_leave_the_previous_checkpoint_loadable() {
    let tmp = tempfile::tempdir().unwrap();
    ok_all(save_3x2(tmp.path(), 1));
    crash_at(tmp.path(), 2, Stage::BeforeIndex);
    let tmps: Vec<PathBuf> = std::fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().contains("step_00000002.tmp-"))
        .collect();
    assert_eq!(tmps.len(), 1, "the crashed writer's directory is left behind");
    assert!(tmps[0].join("rank_00000.h5").is_file());
    let err = open(&tmps[0]).unwrap_err().to_string();
    assert!(err.contains("not a complete checkpoint"), "{err}");
    assert_eq!(open(tmp.path()).unwrap().meta().step, 1);

    // Crash after the rename, before `latest`: both checkpoints are complete, latest names step 1.
    crash_at(tmp.path(), 3, Stage::BeforeLatest);
    assert_eq!(open(tmp.path()).unwrap().meta().step, 1);
    open(&tmp.path().join("step_00000003")).unwrap().verify().unwrap();

    // The next save removes the stale temporary and keeps the newest two.
    ok_all(save_3x2(tmp.path(), 4));
    let mut names: Vec<String> = std::fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, vec!["latest", "meshtrain.lock", "step_00000003", "step_00000004"]);
}

/// A 1 MiB tmpfs mounted for the test, unmounted on drop.
struct SmallFs(PathBuf);

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

#[test]
fn disk_full_names_the_rank_and_file() {
    let tmp = tempfile::tempdir().unwrap();
    let mount = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=1M", "tmpfs"])
        .arg(tmp.path())
        .output();
    match mount {
        Ok(o) if o.status.success() => {}
        Ok(o) => {
            return println!(
                "SKIP disk-full test: mount tmpfs failed: {}",
                String::from_utf8_lossy(&o.stderr)
            )
        }
        Err(e) => return println!("SKIP disk-full test: cannot run mount: {e}"),
    }
    let _fs = SmallFs(tmp.path().to_path_buf());
    ok_all(save_3x2(tmp.path(), 1));
    let root = tmp.path().to_path_buf();
    // 2 ranks x 400 KiB + 1 rank x 400 KiB > 1 MiB.
    let results = run_ranks(3, CommConfig::default(), move |comm| {
        let data = vec![comm.rank() as f32; 100 << 10];
        let s = ShardSlice {
            name: "model/big".into(),
            global_shape: vec![3, 100 << 10],
            offset: vec![comm.rank(), 0],
            shape: vec![1, 100 << 10],
            data: &data,
        };
        save(&comm, &root, 2, &[s], &meta(2), 2)
    });
    let msg = same_err(results);
    println!("disk full: {msg}");
    assert!(msg.contains("failed") && msg.contains("rank_0000"), "{msg}");
    let index = open(tmp.path()).unwrap();
    assert_eq!(index.meta().step, 1);
    index.verify().unwrap();
    let leftovers = std::fs::read_dir(tmp.path())
        .unwrap()
        .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().contains("tmp"))
        .count();
    assert_eq!(leftovers, 0, "rank 0 removed the failed save's directory");
}

/// Offset in the file of the first data byte of `dataset` in rank file `file`.
fn data_offset(ckpt: &Path, file: &str, dataset: &str) -> u64 {
    let f = hdf5_metno::File::open(ckpt.join(file)).unwrap();
    f.dataset(dataset).unwrap().offset().expect("contiguous dataset")
}

#[test]
fn corruption_is_reported_with_file_and_dataset() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = ok_all(save_3x2(tmp.path(), 1));
    let index = open(&ckpt).unwrap();
    let tiny = GptConfig::named("tiny").unwrap();
    index.check_model(&tiny).unwrap();
    let other = GptConfig { n_layer: 3, ..tiny };
    let err = index.check_model(&other).unwrap_err().to_string();
    assert!(
        err.contains("checkpoint.h5") && err.contains("n_layer: 2"),
        "{err}"
    );

    let want = |extra: Option<(&str, Vec<usize>)>, w_shape: Vec<usize>| {
        let mut v = vec![("model/w".to_string(), w_shape), ("model/b".to_string(), vec![7])];
        v.extend(extra.map(|(n, s)| (n.to_string(), s)));
        v
    };
    index.expect_tensors(&want(None, vec![6, 4])).unwrap();
    let err = index
        .expect_tensors(&want(Some(("model/missing", vec![2])), vec![6, 4]))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("checkpoint.h5") && err.contains("missing tensor `model/missing`"),
        "{err}"
    );
    let err = index
        .expect_tensors(&want(None, vec![4, 6]))
        .unwrap_err()
        .to_string();
    assert!(err.contains("`model/w`: shape [6, 4], expected [4, 6]"), "{err}");
    let err = index
        .expect_tensors(&[("model/w".to_string(), vec![6, 4])])
        .unwrap_err()
        .to_string();
    assert!(err.contains("unexpected tensor `model/b`"), "{err}");

    // A flipped bit in the data of one shard: caught by its hash, naming file and dataset.
    let shard = index.tensor("model/w").unwrap().shards[3].clone();
    let path = ckpt.join(&shard.file);
    let at = data_offset(&ckpt, &shard.file, &shard.dataset) as usize + 5;
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[at] ^= 0x10;
    std::fs::write(&path, &bytes).unwrap();
    let mut out = vec![0f32; ROWS * COLS];
    let err = index
        .load_slice("model/w", &[0, 0], &[ROWS, COLS], &mut out)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&shard.file) && err.contains(&shard.dataset) && err.contains("sha256"),
        "{err}"
    );
    // The same flip through a read of one element of that shard (as a resharding load reads).
    let mut one = [0f32];
    let err = index.load_slice("model/w", &shard.offset, &[1, 1], &mut one).unwrap_err().to_string();
    assert!(err.contains(&shard.file) && err.contains(&shard.dataset) && err.contains("sha256"), "{err}");
    let err = inspect(&ckpt, true, None).unwrap_err().to_string();
    assert!(err.contains(&shard.dataset), "{err}");
    bytes[at] ^= 0x10;

    // Garbage over the superblock, size unchanged: HDF5 refuses it, we name the file.
    let mut garbled = bytes.clone();
    garbled[..64].fill(0xAB);
    std::fs::write(&path, &garbled).unwrap();
    let err = index
        .load_slice("model/w", &[0, 0], &[ROWS, COLS], &mut out)
        .unwrap_err();
    assert!(
        matches!(err, Error::File { .. }) && err.to_string().contains(&shard.file),
        "{err}"
    );

    // Truncated: caught by open from the recorded size.
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    let err = open(&ckpt).unwrap_err().to_string();
    assert!(err.contains(&shard.file) && err.contains("truncated"), "{err}");

    // Missing file.
    std::fs::remove_file(&path).unwrap();
    let err = open(&ckpt).unwrap_err().to_string();
    assert!(err.contains(&shard.file), "{err}");
}

#[test]
fn inspect_and_export_report_the_tensors() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = ok_all(save_3x2(tmp.path(), 7));
    let report = inspect(tmp.path(), true, None).unwrap();
    let norm_b = (0..7).map(|i| (i as f64 * 0.5).powi(2)).sum::<f64>().sqrt();
    let norm_w = (0..ROWS)
        .flat_map(|i| (0..COLS).map(move |j| f64::from(w(i, j)).powi(2)))
        .sum::<f64>()
        .sqrt();
    assert_eq!(report.tensors.len(), 2);
    assert_eq!(report.tensors[0].name, "model/b");
    // Sums of squares of small integers and halves are exact in f64.
    assert_eq!(report.tensors[0].l2_norm, norm_b);
    assert_eq!(report.tensors[1].l2_norm, norm_w);
    assert_eq!(report.tensors[1].shards, 3, "six shards in three rank files");
    let text = report.to_string();
    assert!(
        text.contains("step 7") && text.contains("model/w") && text.contains("rank_00002.h5"),
        "{text}"
    );
    assert_eq!(
        report.to_json()["tensors"][1]["global_shape"],
        serde_json::json!([6, 4])
    );
    // One tensor, by its short name: its row and statistics only.
    let one = inspect(tmp.path(), false, Some("b")).unwrap();
    assert_eq!(one.tensors.len(), 1);
    let d = one.detail.as_ref().unwrap();
    assert_eq!((d.name.as_str(), d.min, d.max, d.mean), ("model/b", 0.0, 3.0, 1.5));
    let text = one.to_string();
    assert!(text.contains("tensor model/b: shape [7] f32 in ") && !text.contains("model/w"), "{text}");
    let err = inspect(tmp.path(), false, Some("x")).unwrap_err().to_string();
    assert!(err.contains("no tensor `x` (did you mean"), "{err}");

    let out = tmp.path().join("export.h5");
    assert_eq!(export(&ckpt, &out, true).unwrap(), 2);
    let (m, tensors) = read_exported(&out).unwrap();
    assert_eq!(m, meta(7));
    assert_eq!(tensors[1].0, "model/w");
    assert_eq!(tensors[1].1, vec![ROWS, COLS]);
    assert_eq!(
        tensors[1].2,
        (0..ROWS)
            .flat_map(|i| (0..COLS).map(move |j| w(i, j)))
            .collect::<Vec<_>>()
    );
    assert_eq!(tensors[0].2, (0..7).map(|i| i as f32 * 0.5).collect::<Vec<_>>());
}

#[test]
fn bench_runs_and_accounts_reshard_bytes() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    let n = 1024 * 40 + 3;
    let reports = run_ranks(2, CommConfig::default(), move |comm| {
        bench_checkpoint(&comm, &dir, n)
    });
    for r in reports {
        let r = r.unwrap();
        assert_eq!(r.ranks, 2);
        assert!(r.save_gbps > 0.0 && r.load_gbps > 0.0 && r.seq_write_gbps > 0.0);
        // 40 rows, one tensor: the other rank's 20 rows, half the columns.
        assert_eq!(r.reshard_needed_bytes, 4 * 20 * 512);
    }
}

#[test]
fn a_non_finite_value_refuses_the_save_on_every_rank() {
    let tmp = tempfile::tempdir().unwrap();
    ok_all(save_3x2(tmp.path(), 1));
    let root = tmp.path().to_path_buf();
    let results = run_ranks(3, CommConfig::default(), move |comm| {
        let (boxes, _) = owned(comm.rank());
        let (offset, shape, data) = &boxes[0];
        let mut data = data.clone();
        if comm.rank() == 2 {
            data[1] = f32::NAN;
        }
        let s = ShardSlice { name: "model/w".into(), global_shape: vec![ROWS, COLS], offset: offset.clone(), shape: shape.clone(), data: &data };
        save(&comm, &root, 2, &[s], &meta(2), 2)
    });
    let msg = same_err(results);
    assert!(msg.contains("rank 2 failed") && msg.contains("non-finite value NaN") && msg.contains("model/w"), "{msg}");
    assert_eq!(open(tmp.path()).unwrap().meta().step, 1, "the previous checkpoint stays latest");
}

#[test]
fn a_flipped_bit_in_the_index_metadata_names_the_index() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = ok_all(save_3x2(tmp.path(), 1));
    let index = ckpt.join(INDEX_FILE);
    let mut bytes = std::fs::read(&index).unwrap();
    // A digit of the recorded tokens seen: still valid JSON, silently another data position
    // without the index checksum.
    let key = b"\"tokens_seen\":";
    let start = bytes.windows(key.len()).position(|w| w == key).expect("the meta attribute is stored as text") + key.len();
    let at = start + bytes[start..].iter().position(|b| !b.is_ascii_digit()).unwrap() - 1;
    bytes[at] ^= 0x01; // 1000 -> 1001
    std::fs::write(&index, &bytes).unwrap();
    let err = open(&ckpt).unwrap_err().to_string();
    assert!(err.contains("checkpoint.h5") && err.contains("index metadata corrupt"), "{err}");
}

#[test]
fn a_step_saved_again_replaces_the_old_checkpoint_atomically() {
    let tmp = tempfile::tempdir().unwrap();
    ok_all(save_3x2(tmp.path(), 1));
    let root = tmp.path().to_path_buf();
    let twice = run_ranks(1, CommConfig::default(), move |comm| {
        let data: Vec<f32> = (0..ROWS * COLS).map(|i| 2.0 * i as f32).collect();
        let s = ShardSlice { name: "model/w".into(), global_shape: vec![ROWS, COLS], offset: vec![0, 0], shape: vec![ROWS, COLS], data: &data };
        save(&comm, &root, 1, &[s], &meta(1), 2)
    });
    let ckpt = ok_all(twice);
    let mut out = vec![0f32; ROWS * COLS];
    open(&ckpt).unwrap().load_slice("model/w", &[0, 0], &[ROWS, COLS], &mut out).unwrap();
    assert!(out.iter().enumerate().all(|(i, &x)| x == 2.0 * i as f32), "the new values replaced the old");
    let names: Vec<String> = std::fs::read_dir(tmp.path()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    assert!(!names.iter().any(|n| n.contains("tmp-")), "the old checkpoint is gone: {names:?}");
}

/// Bytes this thread has read through system calls so far (`rchar` of `/proc/thread-self/io`);
/// HDF5 reads on the calling thread, so other tests' threads do not count.
fn thread_rchar() -> u64 {
    let text = std::fs::read_to_string("/proc/thread-self/io").unwrap();
    text.lines().find_map(|l| l.strip_prefix("rchar:")).unwrap().trim().parse().unwrap()
}

#[test]
fn a_partial_read_reads_only_the_tiles_it_touches() {
    use crate::checkpoint::tiles::{TILE_COLS, TILE_ROWS};
    // One 1024 x 1024 shard (4 MiB, 16 tiles); read a 10 x 10 box inside tile (1, 2).
    let n = 4 * TILE_ROWS;
    let data: Vec<f32> = (0..n * n).map(|i| i as f32).collect();
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().to_path_buf();
    let ckpt = ok_all(run_ranks(1, CommConfig::default(), move |comm| {
        let slice = ShardSlice { name: "model/w".into(), global_shape: vec![n, n], offset: vec![0, 0], shape: vec![n, n], data: &data };
        save(&comm, &root, 1, &[slice], &meta(1), 1)
    }));
    let index = open(&ckpt).unwrap();
    let (r0, c0) = (TILE_ROWS + 7, 2 * TILE_COLS + 3);
    let mut out = vec![0f32; 100];
    let before = thread_rchar();
    index.load_slice("model/w", &[r0, c0], &[10, 10], &mut out).unwrap();
    let read = thread_rchar() - before;
    let expected: Vec<f32> = (r0..r0 + 10).flat_map(|r| (c0..c0 + 10).map(move |c| (r * n + c) as f32)).collect();
    assert_eq!(out, expected);
    // One tile of data plus the HDF5 metadata of opening the file, far below the 4 MiB dataset.
    let tile_bytes = (4 * TILE_ROWS * TILE_COLS) as u64;
    assert!(read >= 400 && read <= tile_bytes + (64 << 10), "read {read} bytes for one {tile_bytes}-byte tile");

    // A flipped byte in that tile fails the read, naming file, dataset and tile; the same flip is
    // not read by a box in another tile.
    let shard = index.tensor("model/w").unwrap().shards[0].clone();
    let path = ckpt.join(&shard.file);
    let at = data_offset(&ckpt, &shard.file, &shard.dataset) as usize + 4 * (r0 * n + c0) + 2;
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[at] ^= 0x01;
    std::fs::write(&path, &bytes).unwrap();
    let err = index.load_slice("model/w", &[r0, c0], &[1, 1], &mut [0f32]).unwrap_err().to_string();
    assert!(err.contains(&shard.file) && err.contains(&shard.dataset) && err.contains("tile (1, 2)"), "{err}");
    let mut other = [0f32];
    index.load_slice("model/w", &[0, 0], &[1, 1], &mut other).unwrap();
    assert_eq!(other[0], 0.0);
}

#[test]
fn a_checkpoint_without_tile_digests_is_read_whole_at_format_2_and_refused_at_format_3() {
    use crate::checkpoint::h5;
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = ok_all(save_3x2(tmp.path(), 1));
    let ipath = ckpt.join(INDEX_FILE);
    // Rewrite the index as a writer before tile digests would have: no `tile_sha256`, and a
    // matching `index_sha256`; first still claiming format 3, then format 2.
    let rewrite = |version: u32| {
        let f = hdf5_metno::File::open_rw(&ipath).unwrap();
        let attr = |n: &str| h5::read_str_attr(&f, n, &ipath).unwrap();
        let mut tensors: serde_json::Value = serde_json::from_str(&attr("tensors")).unwrap();
        for t in tensors.as_array_mut().unwrap() {
            for s in t["shards"].as_array_mut().unwrap() {
                s.as_object_mut().unwrap().remove("tile_sha256");
            }
        }
        let tensors = tensors.to_string();
        let digest = h5::index_digest(&attr("meta"), &tensors, &attr("files"));
        for name in ["tensors", "index_sha256", "format_version"] {
            f.delete_attr(name).unwrap();
        }
        h5::write_str_attr(&f, "tensors", &tensors, &ipath).unwrap();
        h5::write_str_attr(&f, "index_sha256", &digest, &ipath).unwrap();
        f.new_attr::<u32>().create("format_version").unwrap().write_scalar(&version).unwrap();
    };
    rewrite(3);
    let err = open(&ckpt).unwrap_err().to_string();
    assert!(err.contains("checkpoint.h5") && err.contains("has 0 tile digests, expected 1"), "{err}");
    rewrite(2);
    let index = open(&ckpt).unwrap();
    let shard = index.tensor("model/w").unwrap().shards[3].clone();
    let mut one = [0f32];
    index.load_slice("model/w", &shard.offset, &[1, 1], &mut one).unwrap();
    assert_eq!(one[0], w(shard.offset[0], shard.offset[1]));
    // A flip in that shard, outside the element read, is still caught: the whole shard is checked.
    let path = ckpt.join(&shard.file);
    let at = data_offset(&ckpt, &shard.file, &shard.dataset) as usize + 4 * 3;
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[at] ^= 0x10;
    std::fs::write(&path, &bytes).unwrap();
    let err = index.load_slice("model/w", &shard.offset, &[1, 1], &mut one).unwrap_err().to_string();
    assert!(err.contains(&shard.file) && err.contains(&shard.dataset) && err.contains("sha256"), "{err}");
}
