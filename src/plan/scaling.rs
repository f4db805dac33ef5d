//! `meshtrain plan --scaling weak|strong --gpus 128,256,...`: the predicted scaling curve of a job,
//! as `meshtrain sweep report` draws a measured one.
//!
//! Each GPU count gets its best layout from [`search`]; its prediction becomes a
//! [`PointSummary`] (median = p10 = p90 = the predicted step time; compute, exposed
//! communication and bubble from the estimate), so efficiency is computed by the sweep's own
//! [`fill_efficiency`] (strong: `T_1 N_1 / (T_N N)`; weak: tokens/s per rank over the first
//! point's) and the CSV and charts are the sweep's (`sweep.csv`, `efficiency.svg`, ...). Strong
//! scaling keeps the global batch; weak scaling grows it with the GPU count from the first one's.
//! Drawn over a measured sweep (`--overlay`), each count predicts the sweep's own (tp, pp) grid,
//! its best micro-batch and ZeRO stage, so both series describe the same layouts.

use std::collections::BTreeMap;
use std::path::Path;

use super::cost::Machine;
use super::search::{search, Options};
use super::Job;
use crate::error::{Error, Result};
use crate::sweep::{fill_efficiency, plot, to_csv, Mode, PointMeta, PointSummary};

/// The (tp, pp) grid each GPU count must use (a measured sweep's), where given; the best layout
/// of any grid elsewhere.
pub type Grids = BTreeMap<usize, (usize, usize)>;

/// The predicted point of `job` at its GPU count: its best layout, of the grid `grids` gives.
fn point(
    job: &Job,
    mach: &Machine,
    opts: &Options,
    mode: Mode,
    grids: &Grids,
) -> Result<PointSummary> {
    let plan = search(job, mach, opts)?;
    let want = grids.get(&job.gpus);
    let best = plan
        .ranked
        .iter()
        .find(|r| want.is_none_or(|&(tp, pp)| r.layout.tp == tp && r.layout.pp == pp))
        .ok_or_else(|| {
            let (tp, pp) = want.copied().unwrap_or_default();
            Error::config(
                "--overlay",
                format!(
                    "no layout with the sweep's tp {tp} pp {pp} fits {} GPUs",
                    job.gpus
                ),
            )
        })?;
    let (l, e) = (best.layout, &best.estimate);
    let ranks = job.gpus;
    let tokens = (job.global_batch * job.seq_len) as u64;
    let flops_per_token = crate::metrics::train_flops_per_token(&job.model, job.seq_len);
    let tokens_per_s = tokens as f64 / e.step_s;
    Ok(PointSummary {
        meta: PointMeta {
            nodelist: format!("predicted: {}", mach.profile.name),
            command: vec!["meshtrain".into(), "plan".into(), l.describe()],
            ..PointMeta::new(
                mode,
                ranks.div_ceil(mach.profile.devices_per_node),
                ranks,
                [l.tp, l.pp, l.dp],
                [l.micro_batch, l.grad_accum, job.seq_len],
                flops_per_token,
            )
        },
        steps: 0,
        step_median_s: e.step_s,
        step_p10_s: e.step_s,
        step_p90_s: e.step_s,
        tokens_per_s,
        tokens_per_s_per_rank: tokens_per_s / ranks as f64,
        tflops_per_rank: tokens_per_s * flops_per_token / ranks as f64 / 1e12,
        mfu: Some(tokens_per_s * flops_per_token / ranks as f64 / mach.peak),
        compute_s: e.compute_s,
        comm_exposed_s: e.exposed_comm_s(),
        bubble_s: e.bubble_s,
        efficiency: 0.0,
    })
}

/// Predicts `base` (its GPU count and global batch are the first point's) at every count of
/// `gpus`, on the grid `grids` names for a count (else the best one); with `out`, writes the
/// sweep's CSV and charts there.
pub fn curve(
    base: &Job,
    (gpus, grids): (&[usize], &Grids),
    mode: Mode,
    mach: &Machine,
    opts: &Options,
    out: Option<&Path>,
) -> Result<Vec<PointSummary>> {
    let first = *gpus
        .first()
        .ok_or_else(|| Error::config("--gpus", "needs at least one GPU count"))?;
    let mut points = Vec::new();
    for &n in gpus {
        let batch = match mode {
            Mode::Strong => base.global_batch,
            Mode::Weak => {
                if (base.global_batch * n) % first != 0 {
                    return Err(Error::config(
                        "--global-batch",
                        format!(
                            "{} x {n} / {first} GPUs is not whole (weak scaling)",
                            base.global_batch
                        ),
                    ));
                }
                base.global_batch * n / first
            }
        };
        let job = Job {
            gpus: n,
            global_batch: batch,
            ..base.clone()
        };
        points.push(point(&job, mach, opts, mode, grids)?);
    }
    fill_efficiency(&mut points);
    if let Some(dir) = out {
        std::fs::create_dir_all(dir)
            .map_err(|e| Error::io(format!("create {}", dir.display()), e))?;
        let csv = dir.join("sweep.csv");
        std::fs::write(&csv, to_csv(&points))
            .map_err(|e| Error::io(format!("write {}", csv.display()), e))?;
        plot::sweep_plots(&points, dir)?;
    }
    Ok(points)
}

/// The curve as a table.
pub fn table(points: &[PointSummary]) -> String {
    let mut s = format!(
        "{:>6} {:>16} {:>5} {:>9} {:>12} {:>9} {:>7}\n",
        "gpus", "layout", "mb", "step_s", "tokens/s/gpu", "TFLOP/s", "eff%"
    );
    for p in points {
        s += &format!(
            "{:>6} {:>16} {:>5} {:>9.3} {:>12.1} {:>9.1} {:>7.1}\n",
            p.meta.ranks,
            p.meta.layout(),
            p.meta.micro_batch,
            p.step_median_s,
            p.tokens_per_s_per_rank,
            p.tflops_per_rank,
            100.0 * p.efficiency
        );
    }
    s
}

/// The (tp, pp) grid of each rank count of `mode` in the sweep at `sweep_dir`, so the prediction
/// drawn over it is of the layouts it ran.
pub fn sweep_grids(sweep_dir: &Path, warmup: usize, mode: Mode) -> Result<Grids> {
    Ok(crate::sweep::load_points(sweep_dir, warmup)?
        .iter()
        .filter(|p| p.meta.mode == mode)
        .map(|p| (p.meta.ranks, (p.meta.tp, p.meta.pp)))
        .collect())
}

/// Draws `predicted` over the measured sweep in `sweep_dir` (its points summarized as `sweep
/// report` does, leaving out `warmup` steps each) into `out`, and returns the comparison table:
/// per rank count of the predicted mode, predicted and measured step time, the error of the
/// prediction and both efficiencies. Errors name `--overlay` when the sweep has no point of the
/// predicted mode.
pub fn overlay(
    predicted: &[PointSummary],
    sweep_dir: &Path,
    warmup: usize,
    out: &Path,
) -> Result<String> {
    let measured = crate::sweep::load_points(sweep_dir, warmup)?;
    let mode = predicted
        .first()
        .ok_or_else(|| Error::config("--gpus", "needs at least one GPU count"))?
        .meta
        .mode;
    let same: Vec<&PointSummary> = measured.iter().filter(|p| p.meta.mode == mode).collect();
    if same.is_empty() {
        return Err(Error::config(
            "--overlay",
            format!(
                "{} has no {} scaling points to draw the prediction over",
                sweep_dir.display(),
                mode.name()
            ),
        ));
    }
    let files = plot::overlay_plots(predicted, &measured, out)?;
    let mut s = format!(
        "{:>6} {:>12} {:>11} {:>7} {:>9} {:>9}\n",
        "ranks", "predicted_s", "measured_s", "error%", "pred_eff%", "meas_eff%"
    );
    for p in predicted {
        let m = same.iter().find(|m| m.meta.ranks == p.meta.ranks);
        let cell = |f: &dyn Fn(&PointSummary) -> f64, prec: usize| {
            m.map_or("-".to_string(), |m| format!("{:.*}", prec, f(m)))
        };
        s += &format!(
            "{:>6} {:>12.4} {:>11} {:>7} {:>9.1} {:>9}\n",
            p.meta.ranks,
            p.step_median_s,
            cell(&|m| m.step_median_s, 4),
            cell(
                &|m| 100.0 * (p.step_median_s - m.step_median_s) / m.step_median_s,
                1
            ),
            100.0 * p.efficiency,
            cell(&|m| 100.0 * m.efficiency, 1),
        );
    }
    s += &format!(
        "# wrote {} chart files under {}\n",
        files.len(),
        out.display()
    );
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{Profile, Stack};

    #[test]
    fn strong_scaling_keeps_the_batch_and_loses_efficiency() {
        let p = Profile::load("dgx-a100").unwrap();
        let mach = Machine::new(&p, Stack::Meshtrain, "bf16").unwrap();
        let job = Job::named("d24", 8, 64, 1024).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let pts = curve(
            &job,
            (&[8, 16, 32, 64], &Grids::new()),
            Mode::Strong,
            &mach,
            &Options::default(),
            Some(dir.path()),
        )
        .unwrap();
        assert_eq!(pts[0].efficiency, 1.0);
        assert!(pts.iter().all(|p| p.meta.tokens_per_step == 64 * 1024));
        assert!(pts[3].efficiency < 1.0 && pts[3].step_median_s < pts[0].step_median_s);
        assert!(
            dir.path().join("sweep.csv").exists() && dir.path().join("efficiency.svg").exists()
        );
        let weak = curve(
            &job,
            (&[8, 16], &Grids::new()),
            Mode::Weak,
            &mach,
            &Options::default(),
            None,
        )
        .unwrap();
        assert_eq!(weak[1].meta.tokens_per_step, 2 * 64 * 1024);
    }
}
