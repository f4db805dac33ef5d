//! Every job-configuration key with its type, default and meaning: the source of the README's key
//! table ([`markdown_table`]) and of the "did you mean" of an unknown key ([`nearest`]).
//!
//! Invariants, checked by the tests below: the keys listed are exactly the keys the loader
//! accepts (every field of the effective config, plus `model.size`), and a default shown as
//! [`Default::Code`] is read from the built-in defaults at run time, so the table cannot drift
//! from the code; the README holds the table as [`markdown_table`] renders it.

use super::JobConfig;

/// Where a key's default comes from.
pub enum Default {
    /// The value the built-in defaults serialize to.
    Code,
    /// A key with no single value (absent, or derived from another key): said in words.
    Text(&'static str),
}

/// One documented key.
pub struct Key {
    /// Dotted name (`train.steps`; top-level keys have no section).
    pub key: &'static str,
    /// Value type as written in TOML.
    pub ty: &'static str,
    /// Default.
    pub default: Default,
    /// What it does.
    pub meaning: &'static str,
}

const fn key(key: &'static str, ty: &'static str, default: Default, meaning: &'static str) -> Key {
    Key {
        key,
        ty,
        default,
        meaning,
    }
}

use Default::{Code, Text};

/// Every key, in the order of the file's sections.
#[rustfmt::skip]
pub const KEYS: &[Key] = &[
    key("device", "string", Code, "`cpu`, `cuda`, `hip`, or `emu` (the GPU kernels emulated on the host)"),
    key("precision", "string", Text("`fp32` on the CPU, `bf16` on a GPU"), "matrix-product inputs: `fp32`, `bf16` or `fp16` (f32 accumulation and master weights)"),
    key("init_from", "path", Text("none"), "start from these weights: a `meshtrain export` file or a Hugging Face GPT-2 or Llama directory (safetensors)"),
    key("model.size", "string", Text("none"), "named shape: `tiny`, `d12`, `d24`, `d36`, `d48`, `22b`, `175b`, `1t`, `llama-tiny`, `llama-7b`, `llama-13b`, `llama-70b`"),
    key("model.n_layer", "integer", Text("from `size`"), "transformer blocks"),
    key("model.n_head", "integer", Text("from `size`"), "attention heads"),
    key("model.n_embd", "integer", Text("from `size`"), "width"),
    key("model.vocab_size", "integer", Text("from `size`"), "vocabulary (50257 for GPT-2 BPE text from `meshtrain tokenize`)"),
    key("model.max_seq_len", "integer", Text("from `size`"), "longest sequence (learned positions)"),
    key("model.arch", "string", Text("`gpt2` (`llama` for the `llama-*` sizes)"), "`gpt2` or `llama` (RMSNorm, SwiGLU, rotary embeddings, grouped-query attention, no biases)"),
    key("model.n_kv_head", "integer", Text("`n_head`"), "llama: key/value heads (grouped-query attention)"),
    key("model.ffn_dim", "integer", Text("from `size`"), "llama: SwiGLU hidden width"),
    key("model.rope_theta", "float", Text("10000"), "llama: rotary embedding base"),
    key("model.rope_scaling_factor", "float", Text("none"), "llama: Llama 3 rotary frequency scaling factor (absent: no scaling)"),
    key("model.rope_low_freq_factor", "float", Text("1"), "llama: Llama 3 scaling's low-frequency factor"),
    key("model.rope_high_freq_factor", "float", Text("4"), "llama: Llama 3 scaling's high-frequency factor"),
    key("model.rope_original_max_seq_len", "integer", Text("8192"), "llama: context length the rotary frequencies were trained for"),
    key("model.norm_eps", "float", Text("1e-5"), "llama: RMSNorm epsilon"),
    key("model.tie_embeddings", "bool", Text("false"), "llama: the output head reuses the token embedding"),
    key("data.source", "string", Code, "`synthetic` (built-in Markov-chain corpus) or a glob of token shards"),
    key("data.val_source", "string", Text("none"), "validation shards (same forms as `source`)"),
    key("data.shuffle", "bool", Code, "shuffle the order of windows each epoch"),
    key("data.seed", "integer", Code, "seed of the shuffle and of the synthetic corpus"),
    key("train.steps", "integer", Code, "optimizer steps"),
    key("train.micro_batch", "integer", Code, "sequences per rank per micro-step"),
    key("train.seq_len", "integer", Text("`model.max_seq_len`"), "tokens per sequence"),
    key("train.grad_accum", "integer", Code, "micro-steps accumulated per optimizer step"),
    key("train.seed", "integer", Code, "seed of the weight initialization"),
    key("train.eval_every", "integer", Code, "evaluate on `data.val_source` every N steps; 0 = never"),
    key("train.eval_batches", "integer", Code, "validation batches per evaluation"),
    key("train.log_every", "integer", Code, "print a progress line every N steps (when stderr is not a terminal)"),
    key("train.nonfinite", "string", Code, "a NaN/inf loss or gradient norm: `stop` the run or `skip` the step"),
    key("train.threads", "integer", Code, "CPU threads per rank (GEMMs and other layers); 0 = `OMP_NUM_THREADS`, else `OPENBLAS_NUM_THREADS`, else the node's cores / its ranks"),
    key("train.recompute", "string", Code, "activation recomputation: `none`, `selective` (the attention core) or `full` (every block from its input)"),
    key("train.inject_nan_at", "[step, rank]", Text("none"), "testing knob: that rank's loss is NaN at that step"),
    key("train.loss_scale", "string or float", Text("`\"dynamic\"` under fp16, else `\"none\"`"), "loss scaling: `dynamic`, `none` or a fixed scale; a step with non-finite gradients (finite loss) is skipped on every rank"),
    key("train.loss_scale_init", "float", Code, "first scale of dynamic loss scaling"),
    key("train.loss_scale_growth", "float", Code, "factor the dynamic scale grows by after `loss_scale_growth_interval` good steps"),
    key("train.loss_scale_backoff", "float", Code, "factor the dynamic scale is multiplied by after a skipped step"),
    key("train.loss_scale_growth_interval", "integer", Code, "consecutive steps with finite gradients before the scale grows"),
    key("train.loss_scale_min", "float", Code, "smallest dynamic scale: backing off below it stops the run with an error"),
    key("optim.lr", "float", Code, "peak learning rate (AdamW)"),
    key("optim.min_lr", "float", Code, "final learning rate of the cosine decay"),
    key("optim.warmup_steps", "integer", Code, "linear warm-up steps (cut to `train.steps` when longer)"),
    key("optim.weight_decay", "float", Code, "decoupled weight decay"),
    key("optim.beta1", "float", Code, "Adam beta1"),
    key("optim.beta2", "float", Code, "Adam beta2"),
    key("optim.eps", "float", Code, "Adam epsilon"),
    key("optim.grad_clip", "float", Code, "clip the global gradient norm; 0 = off"),
    key("parallel.tp", "integer", Code, "tensor-parallel degree (divides `n_head`)"),
    key("parallel.pp", "integer", Code, "pipeline-parallel degree (at most `n_layer`)"),
    key("parallel.dp", "integer", Code, "data-parallel degree; tp x pp x dp = ranks"),
    key("parallel.zero", "integer", Code, "ZeRO stage 0-3 over the data-parallel group"),
    key("parallel.sequence_parallel", "bool", Code, "shard LayerNorm/dropout activations over the TP group (tp > 1)"),
    key("parallel.schedule", "string", Code, "pipeline schedule: `gpipe`, `1f1b` or `interleaved`"),
    key("parallel.microbatches", "integer", Code, "pipeline micro-batches per step"),
    key("parallel.virtual_stages", "integer", Code, "model chunks per pipeline rank (`interleaved` only)"),
    key("parallel.stage_layers", "[integer]", Code, "blocks per pipeline stage; empty = balanced by estimated compute"),
    key("parallel.bucket_mb", "float", Code, "gradient bucket size in MiB"),
    key("parallel.order", "string", Code, "grid axis order, innermost first"),
    key("parallel.dp_sync", "string", Code, "data-parallel gradients: `allreduce` (collectives, ZeRO 0-3) or `ps` (parameter servers, `[ps]`)"),
    key("checkpoint.dir", "path", Text("none (no checkpoints)"), "checkpoint directory"),
    key("checkpoint.every", "integer", Code, "save every N steps and at the end; 0 = only at the end"),
    key("checkpoint.keep", "integer", Code, "checkpoints kept, oldest deleted first; 0 = all"),
    key("checkpoint.resume", "string", Text("none"), "`latest` (newest in `dir`) or a checkpoint path"),
    key("metrics.peak_tflops", "float", Text("none (CPU: measured sgemm rate)"), "peak TFLOP/s of one device, for MFU"),
    key("ps.servers", "integer", Code, "parameter-server ranks after the tp x pp x dp workers (`dp_sync = \"ps\"`; ignored with `ps.colocate`)"),
    key("ps.mode", "string", Code, "`sync` (one update per step from every worker) or `async` (stale synchronous parallel)"),
    key("ps.staleness", "integer", Code, "async: versions a worker's parameters may lag its step count; 0 = sync"),
    key("ps.colocate", "bool", Code, "a server thread in every worker process (one per worker, no extra ranks; leave `ps.servers` unset)"),
];

/// The built-in defaults as dotted key -> TOML text (a tiny model stands in for the required one).
pub fn code_defaults() -> Vec<(String, String)> {
    let cfg = JobConfig::from_str("[model]\nsize = \"tiny\"\n", &[])
        .expect("the built-in defaults are valid");
    let table: toml::Table = toml::from_str(&cfg.to_toml()).expect("the effective config is TOML");
    let mut out = Vec::new();
    for (k, v) in table {
        match v {
            toml::Value::Table(t) => out.extend(
                t.into_iter()
                    .map(|(k2, v2)| (format!("{k}.{k2}"), v2.to_string())),
            ),
            v => out.push((k, v.to_string())),
        }
    }
    out
}

/// The key table in Markdown: key, type, default, meaning.
pub fn markdown_table() -> String {
    let defaults = code_defaults();
    let mut s = String::from("| key | type | default | meaning |\n|---|---|---|---|\n");
    for k in KEYS {
        let default = match k.default {
            Text(t) => t.to_string(),
            Code => {
                let v = defaults
                    .iter()
                    .find(|(d, _)| d == k.key)
                    .map_or("?", |(_, v)| v.as_str());
                format!("`{v}`")
            }
        };
        s.push_str(&format!(
            "| `{}` | {} | {} | {} |\n",
            k.key, k.ty, default, k.meaning
        ));
    }
    s
}

/// The documented key nearest to `unknown` (a dotted key), if one is close enough to be a typo.
pub fn nearest(unknown: &str) -> Option<&'static str> {
    let (best, d) = KEYS
        .iter()
        .map(|k| (k.key, crate::env::edit_distance(k.key, unknown)))
        .min_by_key(|&(_, d)| d)?;
    (d <= 3 || d * 3 <= unknown.len()).then_some(best)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_key_with_a_code_default_is_documented_and_vice_versa() {
        let defaults = code_defaults();
        for (k, _) in &defaults {
            let doc = KEYS.iter().find(|d| d.key == k);
            let model_shape = k.starts_with("model.");
            assert!(
                doc.is_some(),
                "config key `{k}` is missing from config::keys::KEYS"
            );
            assert!(
                model_shape
                    || matches!(doc.unwrap().default, Code)
                    || k == "precision"
                    || k == "train.loss_scale"
                    || k == "train.seq_len",
                "`{k}` has a built-in default: mark it Code"
            );
        }
        for k in KEYS.iter().filter(|k| matches!(k.default, Code)) {
            assert!(
                defaults.iter().any(|(d, _)| d == k.key),
                "`{}` is marked Code but has no built-in default",
                k.key
            );
        }
    }

    #[test]
    fn every_documented_key_is_accepted_by_the_loader() {
        let base = "[model]\nsize = \"tiny\"\n";
        for k in KEYS {
            let err = JobConfig::from_str(base, &[format!("{}=@@", k.key)])
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(!err.contains("unknown key"), "`{}`: {err}", k.key);
        }
        let err = JobConfig::from_str(base, &["train.step=5".into()])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("unknown key") && err.contains("did you mean `train.steps`?"),
            "{err}"
        );
    }

    #[test]
    fn the_readme_holds_the_generated_key_table() {
        let readme =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
        let table = markdown_table();
        assert!(
            readme.contains(&table),
            "README.md's configuration key table differs from the code; replace it with:\n{table}"
        );
    }
}
