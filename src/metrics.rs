//! Training metrics: model FLOP counting and MFU, the per-step JSONL log, and rank 0's progress line.
//!
//! FLOP convention (what "model FLOPs" means everywhere in meshtrain). Per token, training costs
//! three forward passes' worth of matmul work (forward 1x, backward 2x), a multiply-add being 2 FLOPs:
//!
//! `train_flops_per_token = 6 * N + 12 * L * C * T`, with `N = 12 * L * C^2 + V * C`.
//!
//! - `N` counts the weights of every matmul: per block `C x 3C` (qkv), `C x C` (attention output),
//!   `C x 4C` and `4C x C` (MLP) = `12 C^2`, plus the `V x C` language-model head (tied with the token
//!   embedding, counted once, as a matmul). Not counted: biases, layernorms, the position embedding
//!   and the embedding lookups, which do no matmul work, and the padded vocabulary rows (`V` is the
//!   real vocabulary), which do no useful work.
//! - `12 L C T` is attention's score and value matmuls (`Q K^T` and `P V`, each `2 T C` FLOPs per token
//!   per layer forward, times 3 for training) over the full `T x T` score matrix, i.e. the causal mask
//!   is not discounted, as in the PaLM paper's MFU definition.
//!
//! Recomputation is never counted in model FLOPs, so MFU does not change with it. MFU is achieved
//! model FLOP/s divided by the peak of all devices of the job. Hardware FLOPs add what
//! `train.recompute` computes again per token: `selective` the attention core's forward
//! (`4 L C T`), `full` every block's forward (`24 L C^2 + 4 L C T`); the JSONL reports them as
//! `hardware_tflops`.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{IsTerminal, Write};
use std::path::Path;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use crate::error::{Error, Result};
use crate::model::{GptConfig, Recompute};

/// Matmul parameters `N = 12 L C^2 + V C` of the FLOP convention in the module doc (Llama:
/// each block's `2 C^2 + 2 NKV hd C + 3 F C` instead of `12 C^2`).
pub fn flop_params(model: &GptConfig) -> u64 {
    let (l, c, v) = (
        model.n_layer as u64,
        model.n_embd as u64,
        model.vocab_size as u64,
    );
    l * block_flop_params(model) + v * c
}

/// Matmul parameters of one block: `12 C^2` for GPT-2, `2 C^2 + 2 NKV hd C + 3 F C` for Llama.
pub fn block_flop_params(model: &GptConfig) -> u64 {
    let c = model.n_embd as u64;
    match &model.llama {
        None => 12 * c * c,
        Some(l) => 2 * c * c + 2 * (l.n_kv_head * model.head_dim()) as u64 * c + 3 * l.ffn_dim as u64 * c,
    }
}

/// Model FLOPs to train on one token at sequence length `seq_len`: `6 N + 12 L C T`.
pub fn train_flops_per_token(model: &GptConfig, seq_len: usize) -> f64 {
    let attention = 12.0 * model.n_layer as f64 * model.n_embd as f64 * seq_len as f64;
    6.0 * flop_params(model) as f64 + attention
}

/// FLOPs per token that `recompute` computes a second time (see the module doc).
pub fn recompute_flops_per_token(model: &GptConfig, seq_len: usize, recompute: Recompute) -> f64 {
    let (l, c, t) = (model.n_layer as f64, model.n_embd as f64, seq_len as f64);
    let core = 4.0 * l * c * t;
    match recompute {
        Recompute::None => 0.0,
        Recompute::Selective => core,
        Recompute::Full => 2.0 * l * block_flop_params(model) as f64 + core,
    }
}

/// Turns a token rate into model TFLOP/s and MFU for one job.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FlopCounter {
    flops_per_token: f64,
    /// FLOPs per token recomputed in the backward (hardware, not model, FLOPs).
    recompute_per_token: f64,
    /// Peak TFLOP/s of all devices together, when the per-device peak is known.
    peak_tflops_total: Option<f64>,
}

impl FlopCounter {
    /// Counter for `model` at `seq_len` on `devices` devices of `peak_tflops_per_device` each.
    pub fn new(
        model: &GptConfig,
        seq_len: usize,
        peak_tflops_per_device: Option<f64>,
        devices: usize,
    ) -> Self {
        FlopCounter {
            flops_per_token: train_flops_per_token(model, seq_len),
            recompute_per_token: 0.0,
            peak_tflops_total: peak_tflops_per_device.map(|p| p * devices as f64),
        }
    }

    /// The same counter for a job that recomputes `recompute` in the backward.
    pub fn with_recompute(self, model: &GptConfig, seq_len: usize, recompute: Recompute) -> Self {
        FlopCounter { recompute_per_token: recompute_flops_per_token(model, seq_len, recompute), ..self }
    }

    /// Achieved hardware TFLOP/s: the model's plus the recomputed FLOPs.
    pub fn hardware_tflops(&self, tokens_per_s: f64) -> f64 {
        (self.flops_per_token + self.recompute_per_token) * tokens_per_s / 1e12
    }

    /// Model FLOPs per trained token.
    pub fn flops_per_token(&self) -> f64 {
        self.flops_per_token
    }

    /// Achieved model TFLOP/s of the whole job at `tokens_per_s` (job-wide) tokens per second.
    pub fn model_tflops(&self, tokens_per_s: f64) -> f64 {
        self.flops_per_token * tokens_per_s / 1e12
    }

    /// Model FLOPs utilization in [0, 1] (of the job's total peak), if the peak is known.
    pub fn mfu(&self, tokens_per_s: f64) -> Option<f64> {
        self.peak_tflops_total
            .map(|peak| self.model_tflops(tokens_per_s) / peak)
    }
}

/// One line of the metrics log.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StepRecord {
    /// Optimizer step just completed (1-based).
    pub step: u64,
    /// Mean training loss of the step.
    pub loss: f64,
    /// Learning rate used for the step.
    pub lr: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Job-wide tokens per second over the step.
    pub tokens_per_s: f64,
    /// Job-wide model TFLOP/s (see the module doc).
    pub model_tflops: f64,
    /// Model FLOPs utilization, `null` when the peak is unknown.
    pub mfu: Option<f64>,
    /// Seconds since training started.
    pub elapsed_s: f64,
    /// Validation loss, on steps that evaluated.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_loss: Option<f64>,
    /// Further fields (e.g. `compute_s`, `comm_s`, `bubble_s`), written at the top level of the line.
    #[serde(flatten)]
    pub extra: BTreeMap<String, serde_json::Value>,
}

/// Appends one JSON object per step to a file, each line flushed as it is written.
#[derive(Debug)]
pub struct MetricsWriter {
    path: std::path::PathBuf,
    file: File,
}

impl MetricsWriter {
    /// Creates (truncates) `path`, making its directory if needed.
    pub fn create(path: &Path) -> Result<MetricsWriter> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)
                .map_err(|e| Error::io(format!("create {}", dir.display()), e))?;
        }
        let file =
            File::create(path).map_err(|e| Error::io(format!("create {}", path.display()), e))?;
        Ok(MetricsWriter {
            path: path.to_path_buf(),
            file,
        })
    }

    /// Writes `record` as one line and flushes it.
    pub fn write(&mut self, record: &StepRecord) -> Result<()> {
        let mut line = serde_json::to_string(record).map_err(|e| {
            Error::file(
                &self.path,
                None,
                format!("cannot encode step {}: {e}", record.step),
            )
        })?;
        line.push('\n');
        self.file
            .write_all(line.as_bytes())
            .and_then(|()| self.file.flush())
            .map_err(|e| Error::io(format!("write {}", self.path.display()), e))
    }
}

/// One step's figures as shown to the user: `loss .. | lr .. | norm .. | .. tok/s | .. TFLOP/s`, then
/// MFU and validation loss when known.
fn summary(r: &StepRecord) -> String {
    let mut text = format!(
        "loss {:.4} | lr {:.3e} | norm {:.3} | {:.0} tok/s | {:.2} TFLOP/s",
        r.loss, r.lr, r.grad_norm, r.tokens_per_s, r.model_tflops
    );
    if let Some(mfu) = r.mfu {
        text.push_str(&format!(" | mfu {:.1}%", 100.0 * mfu));
    }
    if let Some(v) = r.val_loss {
        text.push_str(&format!(" | val {v:.4}"));
    }
    text
}

/// Rank 0's view of training progress: a live bar on a terminal, a log line every `log_every` steps
/// otherwise; silent on other ranks.
#[derive(Debug)]
pub struct Progress {
    mode: ProgressMode,
    total_steps: u64,
    log_every: u64,
}

#[derive(Debug)]
enum ProgressMode {
    Silent,
    Bar(ProgressBar),
    Lines,
}

impl Progress {
    /// A reporter for `total_steps` steps; `enabled` is false on every rank but 0.
    pub fn new(total_steps: u64, log_every: u64, enabled: bool) -> Progress {
        let mode = if !enabled {
            ProgressMode::Silent
        } else if std::io::stderr().is_terminal() {
            let bar = ProgressBar::new(total_steps);
            let style =
                ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} {msg}")
                    .expect("the template is a valid indicatif template")
                    .progress_chars("=> ");
            bar.set_style(style);
            bar.enable_steady_tick(Duration::from_millis(250));
            ProgressMode::Bar(bar)
        } else {
            ProgressMode::Lines
        };
        Progress {
            mode,
            total_steps,
            log_every: log_every.max(1),
        }
    }

    /// Reports a completed step.
    pub fn update(&self, r: &StepRecord) {
        let text = summary(r);
        match &self.mode {
            ProgressMode::Silent => {}
            ProgressMode::Bar(bar) => {
                bar.set_position(r.step);
                bar.set_message(text.clone());
                if r.val_loss.is_some() {
                    bar.println(format!("step {}/{} {text}", r.step, self.total_steps));
                }
            }
            ProgressMode::Lines => {
                if r.step % self.log_every == 0
                    || r.step == self.total_steps
                    || r.val_loss.is_some()
                {
                    say(&format!("step {}/{} | {text}", r.step, self.total_steps));
                }
            }
        }
    }

    /// Prints a line without breaking the bar (or as a plain line on stdout).
    pub fn println(&self, msg: &str) {
        match &self.mode {
            ProgressMode::Silent => {}
            ProgressMode::Bar(bar) => bar.println(msg),
            ProgressMode::Lines => say(msg),
        }
    }

    /// Ends the bar, leaving its last state on screen.
    pub fn finish(&self) {
        if let ProgressMode::Bar(bar) = &self.mode {
            bar.finish();
        }
    }
}

/// One line on stdout, flushed at once: rank 0's progress and phase lines share that stream, so
/// they keep their order (logs go to stderr).
fn say(line: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flop_params_match_gpt2_small_minus_uncounted_weights() {
        // GPT-2 small has 124,439,808 parameters; not counted: the position embedding (1024 x 768)
        // and per layer 4 biases (2304 + 768 + 3072 + 768) and 2 layernorms (4 x 768) = 9984, times
        // 12 layers, plus the final layernorm (2 x 768).
        let d12 = GptConfig::named("d12").unwrap();
        assert_eq!(
            flop_params(&d12),
            124_439_808 - 1024 * 768 - (12 * 9984 + 2 * 768)
        );
        // 6 N + 12 L C T at T = 1024.
        let per_token = 6.0 * 123_532_032.0 + 12.0 * 12.0 * 768.0 * 1024.0;
        assert_eq!(train_flops_per_token(&d12, 1024), per_token);
    }

    #[test]
    fn mfu_divides_by_the_peak_of_all_devices() {
        let d12 = GptConfig::named("d12").unwrap();
        let c = FlopCounter::new(&d12, 1024, Some(100.0), 2);
        let tflops = c.flops_per_token() * 1e5 / 1e12;
        assert_eq!(c.model_tflops(1e5), tflops);
        assert_eq!(c.mfu(1e5), Some(tflops / 200.0));
        assert_eq!(FlopCounter::new(&d12, 1024, None, 2).mfu(1e5), None);
        // Recomputation adds hardware FLOPs only: MFU stays.
        let full = c.with_recompute(&d12, 1024, Recompute::Full);
        let sel = c.with_recompute(&d12, 1024, Recompute::Selective);
        assert_eq!((full.mfu(1e5), sel.model_tflops(1e5)), (c.mfu(1e5), c.model_tflops(1e5)));
        let (l, ch, t) = (12.0, 768.0, 1024.0);
        assert_eq!(sel.hardware_tflops(1e5), (c.flops_per_token() + 4.0 * l * ch * t) * 1e5 / 1e12);
        assert_eq!(full.hardware_tflops(1e5), (c.flops_per_token() + 24.0 * l * ch * ch + 4.0 * l * ch * t) * 1e5 / 1e12);
        assert_eq!(c.hardware_tflops(1e5), c.model_tflops(1e5));
    }

    fn record(step: u64) -> StepRecord {
        StepRecord {
            step,
            loss: 5.5,
            lr: 1e-4,
            grad_norm: 2.0,
            tokens_per_s: 1000.0,
            model_tflops: 0.5,
            mfu: None,
            elapsed_s: 0.25,
            val_loss: None,
            extra: BTreeMap::new(),
        }
    }

    #[test]
    fn summary_shows_mfu_and_val_loss_only_when_known() {
        let mut r = record(3);
        assert_eq!(
            summary(&r),
            "loss 5.5000 | lr 1.000e-4 | norm 2.000 | 1000 tok/s | 0.50 TFLOP/s"
        );
        r.mfu = Some(0.4567);
        r.val_loss = Some(4.25);
        assert!(
            summary(&r).ends_with("TFLOP/s | mfu 45.7% | val 4.2500"),
            "{}",
            summary(&r)
        );
    }

    #[test]
    fn jsonl_lines_hold_every_field_and_extras() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/m.jsonl");
        let mut w = MetricsWriter::create(&path).unwrap();
        let mut r = record(1);
        w.write(&r).unwrap();
        r.step = 2;
        r.val_loss = Some(4.0);
        r.mfu = Some(0.3);
        r.extra.insert("comm_s".into(), serde_json::json!(0.125));
        w.write(&r).unwrap();
        // Written lines are visible before the writer is dropped (flushed per line).
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0]["step"], 1);
        assert_eq!(lines[0]["loss"], 5.5);
        assert!(lines[0]["mfu"].is_null());
        assert!(lines[0].get("val_loss").is_none());
        for key in [
            "lr",
            "grad_norm",
            "tokens_per_s",
            "model_tflops",
            "elapsed_s",
        ] {
            assert!(lines[0][key].is_number(), "{key}");
        }
        assert_eq!(lines[1]["val_loss"], 4.0);
        assert_eq!(lines[1]["mfu"], 0.3);
        assert_eq!(lines[1]["comm_s"], 0.125);
    }
}
