//! Job configuration: strict keys, validation naming the key, override precedence, round trip.

use meshtrain::config::{Axis, DeviceKind, JobConfig, ScheduleName};
use meshtrain::Error;

const BASE: &str = "[model]\nsize = \"tiny\"\n";

fn config_err(text: &str, sets: &[&str]) -> (String, String) {
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    match JobConfig::from_str(text, &sets) {
        Err(e @ Error::Config { .. }) => {
            assert_eq!(e.exit_code(), 2);
            match e {
                Error::Config { key, msg } => (key, msg),
                _ => unreachable!(),
            }
        }
        Err(other) => panic!("expected a Config error, got {other}"),
        Ok(_) => panic!("config was accepted:\n{text}\n{sets:?}"),
    }
}

fn key_of(text: &str) -> String {
    config_err(text, &[]).0
}

#[test]
fn defaults_and_named_size() {
    let c = JobConfig::from_str(BASE, &[]).unwrap();
    assert_eq!(c.device, DeviceKind::Cpu);
    assert_eq!(
        (
            c.model.n_layer,
            c.model.n_head,
            c.model.n_embd,
            c.model.vocab_size
        ),
        (2, 4, 64, 256)
    );
    assert_eq!(c.train.seq_len, 64, "seq_len defaults to model.max_seq_len");
    assert_eq!(c.data.source, "synthetic");
    assert_eq!(c.parallel.schedule, ScheduleName::OneFOneB);
    assert_eq!(c.parallel.order.0, [Axis::Tp, Axis::Pp, Axis::Dp]);
}

#[test]
fn explicit_model_keys_override_the_named_size() {
    let c = JobConfig::from_str("[model]\nsize = \"tiny\"\nn_layer = 6\n", &[]).unwrap();
    assert_eq!((c.model.n_layer, c.model.n_embd), (6, 64));
    let c = JobConfig::from_str(
        "[model]\nn_layer = 3\nn_head = 2\nn_embd = 32\nvocab_size = 100\nmax_seq_len = 16\n",
        &[],
    )
    .unwrap();
    assert_eq!(
        (c.model.n_layer, c.model.vocab_size, c.train.seq_len),
        (3, 100, 16)
    );
    assert_eq!(key_of("[model]\nn_layer = 3\n"), "model.n_head");
    assert_eq!(key_of(""), "model.n_layer");
    assert_eq!(key_of("[model]\nsize = \"d13\"\n"), "model.size");
}

#[test]
fn unknown_keys_are_named_at_every_level() {
    assert_eq!(key_of(&format!("devise = \"cpu\"\n{BASE}")), "devise");
    assert_eq!(key_of(&format!("{BASE}layers = 3\n")), "model.layers");
    for section in [
        "data",
        "train",
        "optim",
        "parallel",
        "checkpoint",
        "metrics",
    ] {
        assert_eq!(
            key_of(&format!("{BASE}[{section}]\nbogus = 1\n")),
            format!("{section}.bogus")
        );
    }
    assert_eq!(key_of(&format!("{BASE}[extra]\nx = 1\n")), "extra");
    let (key, msg) = config_err(BASE, &["train.stpes=10"]);
    assert_eq!(key, "train.stpes");
    assert!(msg.contains("--set train.stpes=10"), "{msg}");
}

#[test]
fn bad_values_name_their_key() {
    let cases = [
        ("[train]\nsteps = 0\n", "train.steps"),
        ("[train]\nseq_len = 65\n", "train.seq_len"),
        ("[train]\nmicro_batch = -1\n", "train.micro_batch"),
        ("[train]\nsteps = \"ten\"\n", "train.steps"),
        ("[parallel]\ntp = 3\n", "parallel.tp"),
        ("[parallel]\npp = 3\n", "parallel.pp"),
        ("[parallel]\nschedule = \"zigzag\"\n", "parallel.schedule"),
        ("[parallel]\nzero = 4\n", "parallel.zero"),
        ("[parallel]\nsequence_parallel = true\n", "parallel.sequence_parallel"),
        ("[parallel]\nmicrobatches = 0\n", "parallel.microbatches"),
        ("[parallel]\norder = \"tp-dp-tp\"\n", "parallel.order"),
        ("[parallel]\nvirtual_stages = 2\n", "parallel.virtual_stages"),
        ("[parallel]\nschedule = \"interleaved\"\npp = 2\nvirtual_stages = 2\nmicrobatches = 4\n", "parallel.virtual_stages"),
        ("[parallel]\nschedule = \"interleaved\"\npp = 2\nmicrobatches = 3\n", "parallel.microbatches"),
        ("[parallel]\npp = 2\nstage_layers = [2]\n", "parallel.stage_layers"),
        ("[parallel]\npp = 2\nstage_layers = [2, 0]\n", "parallel.stage_layers"),
        ("[parallel]\npp = 2\nstage_layers = [2, 1]\n", "parallel.stage_layers"),
        ("[optim]\nlr = 0\n", "optim.lr"),
        ("[optim]\nmin_lr = 1.0\n", "optim.min_lr"),
        ("[optim]\nbeta2 = 1.0\n", "optim.beta2"),
        ("[optim]\ngrad_clip = -1\n", "optim.grad_clip"),
        ("[data]\nsource = \"\"\n", "data.source"),
        ("[data]\nsource = \"a/[x.bin\"\n", "data.source"),
        ("[metrics]\npeak_tflops = 0\n", "metrics.peak_tflops"),
        ("[checkpoint]\nresume = \"\"\n", "checkpoint.resume"),
        ("device = \"tpu\"\n", "device"),
        ("init_from = \"/nonexistent/ckpt.h5\"\n", "init_from"),
    ];
    for (extra, key) in cases {
        let text = if extra.starts_with('[') {
            format!("{BASE}{extra}")
        } else {
            format!("{extra}{BASE}")
        };
        assert_eq!(key_of(&text), key, "for\n{text}");
    }
}

#[test]
fn valid_parallel_layouts_pass_and_world_size_is_checked() {
    let c = JobConfig::from_str(
        "[model]\nsize = \"tiny\"\nn_layer = 4\n[parallel]\ntp = 2\npp = 2\ndp = 3\nsequence_parallel = true\n\
         schedule = \"interleaved\"\nvirtual_stages = 2\nmicrobatches = 4\norder = \"dp-tp-pp\"\n\
         stage_layers = [1, 1, 1, 1]\n",
        &[],
    )
    .unwrap();
    assert_eq!(c.parallel.order.0, [Axis::Dp, Axis::Tp, Axis::Pp]);
    assert_eq!(c.parallel.stage_layers, [1, 1, 1, 1]);
    let set = ["parallel.stage_layers=[3,1]".to_string()];
    let s = JobConfig::from_str("[model]\nsize = \"tiny\"\nn_layer = 4\n[parallel]\npp = 2\n", &set).unwrap();
    assert_eq!(s.parallel.stage_layers, [3, 1]);
    c.validate_world(12).unwrap();
    let e = c.validate_world(8).unwrap_err();
    assert_eq!(e.exit_code(), 2);
    assert!(
        e.to_string().contains("= 12 ranks, but the job has 8; for 8 ranks use `--set parallel.dp=2`"),
        "{e}"
    );
    // Only layouts that pass validation are offered: pp must stay 2 (stage_layers has 4 stages),
    // so 6 ranks fit only with tp 1, which also turns sequence parallelism off.
    let e = c.validate_world(6).unwrap_err().to_string();
    assert!(e.ends_with("for 6 ranks use `--set parallel.tp=1 --set parallel.sequence_parallel=false`"), "{e}");
}

#[test]
fn overrides_apply_in_order_file_set_env() {
    let text = format!("{BASE}[train]\nsteps = 5\nmicro_batch = 2\n");
    let sets = vec![
        "train.steps=7".to_string(),
        "train.micro_batch=3".to_string(),
        "data.source=data/ts_train_*.bin".to_string(),
        "optim.lr=1e-3".to_string(),
        "device=cuda".to_string(),
    ];
    let env = vec![
        ("MESHTRAIN_TRAIN_MICRO_BATCH".to_string(), "8".to_string()),
        (
            "MESHTRAIN_PARALLEL_SEQUENCE_PARALLEL".to_string(),
            "false".to_string(),
        ),
        ("MESHTRAIN_TRANSPORT".to_string(), "tcp".to_string()),
        ("OTHER_TRAIN_STEPS".to_string(), "99".to_string()),
    ];
    let c = JobConfig::from_sources(&text, "job.toml".as_ref(), &sets, &env).unwrap();
    assert_eq!(c.train.steps, 7, "--set beats the file");
    assert_eq!(c.train.micro_batch, 8, "the environment beats --set");
    assert_eq!(
        c.data.source, "data/ts_train_*.bin",
        "unquoted values are strings"
    );
    assert_eq!(c.optim.lr, 1e-3);
    assert_eq!(c.device, DeviceKind::Cuda);

    let env = vec![("MESHTRAIN_TRAIN_STPES".to_string(), "1".to_string())];
    match JobConfig::from_sources(BASE, "job.toml".as_ref(), &[], &env).unwrap_err() {
        Error::Config { key, msg } => {
            assert_eq!(key, "train.stpes");
            assert!(msg.contains("MESHTRAIN_TRAIN_STPES"), "{msg}");
        }
        other => panic!("{other}"),
    }
    assert_eq!(config_err(BASE, &["train.steps"]).0, "train.steps");
    assert_eq!(config_err(BASE, &["train.steps.x=1"]).0, "train.steps");
}

#[test]
fn toml_syntax_errors_give_the_offset() {
    match JobConfig::from_str("[model]\nsize = tiny\n", &[]).unwrap_err() {
        Error::File { offset, msg, .. } => {
            assert_eq!(offset, Some(15));
            assert!(msg.starts_with("line 2, column 8: "), "{msg}");
        }
        other => panic!("{other}"),
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.toml");
    std::fs::write(&path, "[train]\nsteps = 3\nseed = = 1\n").unwrap();
    let err = JobConfig::load(&path, &[]).unwrap_err().to_string();
    assert!(err.contains("bad.toml") && err.contains("line 3, column 8"), "{err}");
}

#[test]
fn effective_config_round_trips_through_toml() {
    let c = JobConfig::from_str(
        &format!("{BASE}[data]\nval_source = \"synthetic\"\n[metrics]\npeak_tflops = 989.0\n[checkpoint]\ndir = \"ck\"\nresume = \"latest\"\n"),
        &["parallel.schedule=\"gpipe\"".to_string()],
    )
    .unwrap();
    let text = c.to_string();
    assert!(text.contains("schedule = \"gpipe\""), "{text}");
    assert_eq!(JobConfig::from_str(&text, &[]).unwrap(), c);
    // Without a checkpoint directory no checkpoints are written and `latest` means nothing.
    let err = JobConfig::from_str(&format!("{BASE}[checkpoint]\nresume = \"latest\"\n"), &[]).unwrap_err();
    assert!(err.to_string().contains("`checkpoint.resume`: `latest` needs checkpoint.dir"), "{err}");
}
