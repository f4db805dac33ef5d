//! Sweep arithmetic (quantiles, summaries, efficiency), the CSV, point planning and the plots.

use super::run::{plan_points, point_command, SweepPlan};
use super::*;

fn meta(mode: Mode, ranks: usize, tokens_per_step: u64) -> PointMeta {
    PointMeta {
        mode,
        nodes: ranks.div_ceil(2),
        ranks,
        tp: 1,
        pp: 1,
        dp: ranks,
        micro_batch: 4,
        grad_accum: 1,
        seq_len: 32,
        tokens_per_step,
        flops_per_token: 1e6,
        job_id: Some("17".into()),
        nodelist: "n[1-2],x".into(),
        command: vec![],
        env: vec![],
    }
}

/// Metrics lines with the given step times; compute = step - exposed - bubble.
fn lines(step_s: &[f64], exposed: f64, bubble: f64, mfu: Option<f64>) -> String {
    step_s
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let mut v = serde_json::json!({
                "step": i + 1, "loss": 5.0, "step_s": s, "compute_s": s - exposed - bubble,
                "comm_exposed_s": exposed, "param_gather_wait_s": 0.0, "bubble_s": bubble,
                "model_tflops": 2.0, "mfu": mfu,
            });
            if bubble == 0.0 {
                v.as_object_mut().unwrap().remove("bubble_s");
            }
            format!("{v}\n")
        })
        .collect()
}

fn point(mode: Mode, ranks: usize, tokens_per_step: u64, step_s: &[f64]) -> PointSummary {
    summarize(meta(mode, ranks, tokens_per_step), &lines(step_s, 0.0, 0.0, None), Path::new("m.jsonl"), 0).unwrap()
}

#[test]
fn quantiles_interpolate_between_closest_ranks() {
    let v = [1.0, 2.0, 4.0, 8.0, 16.0];
    assert_eq!(quantile(&v, 0.5), 4.0);
    assert_eq!(quantile(&v, 0.0), 1.0);
    assert_eq!(quantile(&v, 1.0), 16.0);
    // Position 0.1 * 4 = 0.4 between 1 and 2; 0.9 * 4 = 3.6 between 8 and 16.
    assert_eq!(quantile(&v, 0.1), 1.0 + 0.4 * 1.0);
    assert_eq!(quantile(&v, 0.9), 8.0 + (16.0 - 8.0) * (3.6 - 3.0));
    assert_eq!(quantile(&[1.0, 3.0], 0.5), 2.0);
}

#[test]
fn summary_leaves_out_warmup_and_uses_the_median_step() {
    // Two slow warm-up steps, then 0.5, 0.25, 0.75, 0.5 (median 0.5).
    let text = lines(&[9.0, 7.0, 0.5, 0.25, 0.75, 0.5], 0.125, 0.0625, Some(0.25));
    let p = summarize(meta(Mode::Strong, 4, 1024), &text, Path::new("m.jsonl"), 2).unwrap();
    assert_eq!(p.steps, 4);
    assert_eq!(p.step_median_s, 0.5);
    assert_eq!(p.step_p10_s, 0.25 + (0.5 - 0.25) * (0.1 * 3.0));
    assert_eq!(p.step_p90_s, 0.5 + (0.75 - 0.5) * (0.9 * 3.0 - 2.0));
    assert_eq!(p.tokens_per_s, 2048.0);
    assert_eq!(p.tokens_per_s_per_rank, 512.0);
    // flops_per_token 1e6: 2048 tok/s -> 2.048e9 FLOP/s = 2.048e-3 TFLOP/s, over 4 ranks.
    assert_eq!(p.tflops_per_rank, 1e6 * 2048.0 / 1e12 / 4.0);
    // Peak = model_tflops / mfu = 8 TFLOP/s: MFU at the median = 2.048e-3 / 8.
    assert_eq!(p.mfu, Some(1e6 * 2048.0 / 1e12 / 8.0));
    assert_eq!(p.comm_exposed_s, 0.125);
    assert_eq!(p.bubble_s, 0.0625);
    assert_eq!(p.compute_s, (0.5 + 0.25 + 0.75 + 0.5) / 4.0 - 0.125 - 0.0625);
}

#[test]
fn summary_rejects_short_or_malformed_metrics_naming_file_and_line() {
    // (file, metrics text, warm-up steps, fragments the error must name).
    let short = lines(&[1.0, 1.0], 0.0, 0.0, None);
    let cases: [(&str, &str, usize, &[&str]); 3] = [
        ("a.jsonl", &short, 2, &["2 steps"]),
        ("b.jsonl", "{\"step\":1,\"step_s\":1.0,\"compute_s\":1.0}\n{\"step\":2,\"compute_s\":1.0}\n", 0, &["line 2", "step_s"]),
        ("c.jsonl", "{oops}\n", 0, &["line 1"]),
    ];
    for (file, text, warmup, fragments) in cases {
        let msg = summarize(meta(Mode::Weak, 1, 64), text, Path::new(file), warmup).unwrap_err().to_string();
        for want in [file].iter().chain(fragments) {
            assert!(msg.contains(want), "{file}: `{want}` not in: {msg}");
        }
    }
}

#[test]
fn strong_efficiency_is_t1_n1_over_tn_n_against_the_fewest_ranks() {
    // Listed out of order; the base is the 2-rank point (N_1 = 2, T_1 = 1.0).
    let mut pts = vec![point(Mode::Strong, 8, 512, &[0.3125]), point(Mode::Strong, 2, 512, &[1.0]), point(Mode::Strong, 4, 512, &[0.625])];
    fill_efficiency(&mut pts);
    assert_eq!(pts.iter().map(|p| p.meta.ranks).collect::<Vec<_>>(), [2, 4, 8]);
    assert_eq!(pts[0].efficiency, 1.0);
    assert_eq!(pts[1].efficiency, 2.0 / 2.5);
    assert_eq!(pts[2].efficiency, 2.0 / 2.5);
}

#[test]
fn weak_efficiency_is_the_per_rank_throughput_ratio_per_mode() {
    // Weak: per-rank tokens/s 1000 (1 rank), 800 (2 ranks), 500 (4 ranks); a strong point beside
    // them is measured against its own mode only.
    let mut pts = vec![
        point(Mode::Weak, 4, 2000, &[1.0]),
        point(Mode::Weak, 1, 1000, &[1.0]),
        point(Mode::Strong, 2, 1000, &[1.0]),
        point(Mode::Weak, 2, 1600, &[1.0]),
    ];
    fill_efficiency(&mut pts);
    let got: Vec<(Mode, usize, f64)> = pts.iter().map(|p| (p.meta.mode, p.meta.ranks, p.efficiency)).collect();
    assert_eq!(got, [(Mode::Strong, 2, 1.0), (Mode::Weak, 1, 1.0), (Mode::Weak, 2, 0.8), (Mode::Weak, 4, 0.5)]);
}

/// Splits a CSV line on commas outside double quotes.
fn csv_cells(line: &str) -> Vec<String> {
    let (mut cells, mut cur, mut quoted) = (Vec::new(), String::new(), false);
    for c in line.chars() {
        match c {
            '"' => quoted = !quoted,
            ',' if !quoted => cells.push(std::mem::take(&mut cur)),
            c => cur.push(c),
        }
    }
    cells.push(cur);
    cells
}

#[test]
fn csv_has_one_row_per_point_with_every_column() {
    let mut pts = vec![point(Mode::Strong, 1, 512, &[1.0]), point(Mode::Strong, 2, 512, &[0.625])];
    fill_efficiency(&mut pts);
    let csv = to_csv(&pts);
    let rows: Vec<Vec<String>> = csv.lines().map(csv_cells).collect();
    assert_eq!(rows.len(), 3);
    assert_eq!(rows[0], CSV_HEADER);
    let col = |name: &str| CSV_HEADER.iter().position(|h| *h == name).unwrap();
    for (row, p) in rows[1..].iter().zip(&pts) {
        assert_eq!(row.len(), CSV_HEADER.len());
        assert_eq!(row[col("mode")], "strong");
        assert_eq!(row[col("ranks")], p.meta.ranks.to_string());
        assert_eq!(row[col("layout")], format!("tp1-pp1-dp{}", p.meta.ranks));
        assert_eq!(row[col("mfu")], "", "no MFU without a peak");
        assert_eq!(row[col("nodelist")], "n[1-2],x");
        assert_eq!(row[col("step_median_s")].parse::<f64>().unwrap(), p.step_median_s);
        assert_eq!(row[col("efficiency")].parse::<f64>().unwrap(), p.efficiency);
    }
    assert_eq!(rows[2][col("tokens_per_s")], "819.2");
}

fn job_file(dir: &Path) -> PathBuf {
    let path = dir.join("job.toml");
    std::fs::write(
        &path,
        "device = \"cpu\"\n[model]\nsize = \"tiny\"\n[data]\nsource = \"synthetic\"\n[train]\nsteps = 5\nmicro_batch = 2\nseq_len = 16\n",
    )
    .unwrap();
    path
}

fn plan(dir: &Path, mode: Mode, ranks: &[usize]) -> SweepPlan {
    SweepPlan {
        job: job_file(dir),
        sets: vec!["train.steps=7".into()],
        mode,
        ranks: ranks.to_vec(),
        ranks_per_node: 2,
        tp: 1,
        pp: 1,
        global_batch: None,
        launch: "srun -N {nodes} -n {ranks}".split(' ').map(String::from).collect(),
        binary: PathBuf::from("/bin/meshtrain"),
        out: dir.to_path_buf(),
    }
}

#[test]
fn strong_points_split_one_global_batch_and_weak_points_keep_the_micro_batch() {
    let dir = tempfile::tempdir().unwrap();
    let strong = plan_points(&plan(dir.path(), Mode::Strong, &[1, 2, 4])).unwrap();
    // Default global batch: micro_batch 2 at the largest dp (4) = 8 sequences of 16 tokens.
    let got: Vec<(usize, usize, usize, u64)> = strong.iter().map(|(m, _)| (m.ranks, m.nodes, m.micro_batch, m.tokens_per_step)).collect();
    assert_eq!(got, [(1, 1, 8, 128), (2, 1, 4, 128), (4, 2, 2, 128)]);
    let weak = plan_points(&plan(dir.path(), Mode::Weak, &[1, 2, 4])).unwrap();
    let got: Vec<(usize, u64)> = weak.iter().map(|(m, _)| (m.micro_batch, m.tokens_per_step)).collect();
    assert_eq!(got, [(2, 32), (2, 64), (2, 128)]);
    // The point's command: launcher with placeholders filled, the user's sets before the sweep's.
    let (m, sets) = &strong[2];
    let cmd = point_command(&plan(dir.path(), Mode::Strong, &[4]), m, sets, Path::new("p.jsonl"));
    let text = cmd.join(" ");
    assert!(text.starts_with("srun -N 2 -n 4 /bin/meshtrain train "), "{text}");
    assert!(text.contains("--set train.steps=7 --set parallel.tp=1"), "{text}");
    assert!(text.ends_with("--set parallel.dp=4 --set train.micro_batch=2 --set train.eval_every=0 --set checkpoint.every=0 --metrics p.jsonl"), "{text}");
}

#[test]
fn bad_points_fail_before_anything_runs() {
    let dir = tempfile::tempdir().unwrap();
    let mut p = plan(dir.path(), Mode::Strong, &[1, 3]);
    p.global_batch = Some(4);
    let msg = plan_points(&p).unwrap_err().to_string();
    assert!(msg.contains("global batch 4") && msg.contains("3 ranks"), "{msg}");
    let mut p = plan(dir.path(), Mode::Weak, &[2, 3]);
    p.tp = 2;
    let msg = plan_points(&p).unwrap_err().to_string();
    assert!(msg.contains("3 ranks are not a multiple"), "{msg}");
    let mut p = plan(dir.path(), Mode::Weak, &[1]);
    p.sets.push("train.nonsense=1".into());
    assert!(plan_points(&p).is_err());
}

/// Opening and closing tags of an SVG balance and the root is `<svg>`.
fn assert_svg(path: &Path, must_contain: &str) {
    let text = std::fs::read_to_string(path).unwrap();
    assert!(text.trim_start().starts_with("<svg") || text.trim_start().starts_with("<?xml"), "{}", path.display());
    let mut stack: Vec<String> = Vec::new();
    for tag in text.split('<').skip(1).map(|t| t.split('>').next().unwrap()) {
        if tag.starts_with('?') || tag.starts_with('!') || tag.ends_with('/') {
            continue;
        }
        let name = tag.trim_start_matches('/').split_whitespace().next().unwrap().to_string();
        if tag.starts_with('/') {
            assert_eq!(stack.pop().as_deref(), Some(name.as_str()), "{}: unbalanced </{name}>", path.display());
        } else {
            stack.push(name);
        }
    }
    assert!(stack.is_empty(), "{}: unclosed {stack:?}", path.display());
    assert!(text.contains(must_contain), "{}: no `{must_contain}`", path.display());
}

/// Decodes a PNG; returns (width, height, pixels that are not white).
fn decode_png(path: &Path) -> (u32, u32, usize) {
    let decoder = png::Decoder::new(std::fs::File::open(path).unwrap());
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).unwrap();
    let channels = info.color_type.samples();
    let inked = buf[..info.buffer_size()].chunks(channels).filter(|px| px.iter().take(3).any(|&c| c != 255)).count();
    (info.width, info.height, inked)
}

#[test]
fn sweep_plots_decode_as_png_and_parse_as_svg() {
    let dir = tempfile::tempdir().unwrap();
    let mut pts = vec![
        point(Mode::Strong, 1, 512, &[1.0]),
        point(Mode::Strong, 2, 512, &[0.625]),
        point(Mode::Strong, 4, 512, &[0.5]),
        point(Mode::Weak, 1, 512, &[1.0]),
        point(Mode::Weak, 2, 1024, &[1.25]),
    ];
    fill_efficiency(&mut pts);
    let files = plot::sweep_plots(&pts, dir.path()).unwrap();
    assert_eq!(files.len(), 6);
    for f in &files {
        match f.extension().unwrap().to_str().unwrap() {
            "png" => {
                let (w, h, inked) = decode_png(f);
                assert_eq!((w, h), (900, 540));
                assert!(inked > 2000, "{}: only {inked} drawn pixels", f.display());
            }
            _ => assert_svg(f, "strong"),
        }
    }
    assert_svg(&dir.path().join("efficiency.svg"), "strong ideal");
    assert_svg(&dir.path().join("step_split.svg"), "exposed communication");
}

#[test]
fn bench_plots_draw_one_chart_per_collective() {
    let dir = tempfile::tempdir().unwrap();
    let header = "coll,bytes,count,dtype,time_us,algbw_gbs,busbw_gbs,wrong";
    let (a, b) = (dir.path().join("n1.csv"), dir.path().join("n2.csv"));
    std::fs::write(&a, format!("{header}\nall_reduce,4096,1024,f32,10.0,0.4,0.6,0\nall_reduce,16384,4096,f32,20.0,0.8,1.2,0\nbroadcast,4096,1024,f32,5.0,0.8,0.8,0\n")).unwrap();
    std::fs::write(&b, format!("{header}\nall_reduce,4096,1024,f32,30.0,0.1,0.2,0\nall_reduce,16384,4096,f32,40.0,0.4,0.7,0\n")).unwrap();
    let inputs = vec![("1 node".to_string(), a.clone()), ("2 nodes".to_string(), b)];
    let files = plot::bench_plots(&inputs, &dir.path().join("plots")).unwrap();
    let names: Vec<String> = files.iter().map(|f| f.file_name().unwrap().to_string_lossy().into_owned()).collect();
    assert_eq!(names, ["busbw_all_reduce.svg", "busbw_all_reduce.png", "busbw_broadcast.svg", "busbw_broadcast.png"]);
    assert_svg(&files[0], "2 nodes");
    assert_svg(&files[0], "16K");
    assert_eq!(decode_png(&files[1]).0, 900);
    std::fs::write(&a, "size,time\n1,2\n").unwrap();
    let msg = plot::bench_plots(&inputs, dir.path()).unwrap_err().to_string();
    assert!(msg.contains("n1.csv") && msg.contains("`coll`"), "{msg}");
}
