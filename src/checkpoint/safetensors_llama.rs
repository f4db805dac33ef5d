//! Llama weights in the Hugging Face layout (`LlamaForCausalLM.save_pretrained`): the
//! `model.safetensors` + `config.json` directory that `init_from = "DIR"` (and `generate DIR`)
//! reads and `meshtrain export --format safetensors` writes for a `model.arch = "llama"`
//! checkpoint. Import takes what the hub publishes: F32, BF16 or F16 tensors, in one file or
//! sharded through `model.safetensors.index.json` (`safetensors_read.rs` reads the files and
//! widens to f32 exactly; errors about the set of tensors then name the index). Export writes
//! F32, one `model.safetensors`.
//!
//! Names map one to one (see the Llama table in `model::layout`), except that meshtrain keeps
//! `gate_proj` and `up_proj` as one (2F, C) tensor, gate rows first; matrices have the same
//! (out, in) orientation in both. The vocabulary is padded to a multiple of 128 in meshtrain and
//! exact in transformers, for `embed_tokens` and `lm_head` alike (padding dropped on export,
//! zero-filled on import). A tied head (`tie_word_embeddings`) stores no `lm_head.weight`.
//!
//! `config.json` is read in both transformers layouts of the rotary parameters: `rope_theta` and
//! `rope_scaling` (4.x) or `rope_parameters` (5.x); it is written with both, so either version
//! loads it. A rope type other than `default` and `llama3`, biases, or a `head_dim` other than
//! `hidden_size / num_attention_heads` are refused with the field named.

use std::path::Path;

use serde_json::{json, Value};

use super::export::ExportedTensor;
use super::safetensors::NamedTensors;
use crate::error::{Error, Result};
use crate::model::{GptConfig, LlamaConfig, ParamLayout};

/// meshtrain's block tensor suffix -> transformers' suffix after `model.layers.{l}.`
/// (`mlp.gate_up.weight` is two tensors, handled apart).
const BLOCK_NAMES: &[(&str, &str)] = &[
    ("attn_norm.weight", "input_layernorm.weight"),
    ("attn.q.weight", "self_attn.q_proj.weight"),
    ("attn.k.weight", "self_attn.k_proj.weight"),
    ("attn.v.weight", "self_attn.v_proj.weight"),
    ("attn.proj.weight", "self_attn.o_proj.weight"),
    ("mlp_norm.weight", "post_attention_layernorm.weight"),
    ("mlp.proj.weight", "mlp.down_proj.weight"),
];

/// The transformers names of meshtrain tensor `name`: one, or two stacked by rows (gate, up).
fn hf_names(name: &str) -> Option<Vec<String>> {
    match name {
        "wte" => Some(vec!["model.embed_tokens.weight".into()]),
        "norm.weight" => Some(vec!["model.norm.weight".into()]),
        "lm_head.weight" => Some(vec!["lm_head.weight".into()]),
        _ => {
            let (layer, suffix) = name.strip_prefix("h.")?.split_once('.')?;
            let p = format!("model.layers.{layer}.");
            if suffix == "mlp.gate_up.weight" {
                return Some(vec![format!("{p}mlp.gate_proj.weight"), format!("{p}mlp.up_proj.weight")]);
            }
            let (_, hf) = BLOCK_NAMES.iter().find(|b| b.0 == suffix)?;
            Some(vec![format!("{p}{hf}")])
        }
    }
}

/// Whether meshtrain tensor `name` has vocabulary rows (padded in meshtrain).
fn vocab_rows(name: &str) -> bool {
    name == "wte" || name == "lm_head.weight"
}

/// transformers' `LlamaConfig` for `m` (a Llama shape).
pub(super) fn hf_config(m: &GptConfig, l: &LlamaConfig) -> Value {
    let mut rope = json!({ "rope_theta": l.rope_theta, "rope_type": "default" });
    let scaling = l.rope_scaling().map(|s| {
        json!({
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position as u64,
        })
    });
    if let Some(s) = &scaling {
        let mut r = s.clone();
        r["rope_theta"] = json!(l.rope_theta);
        rope = r;
    }
    json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "vocab_size": m.vocab_size,
        "hidden_size": m.n_embd,
        "intermediate_size": l.ffn_dim,
        "num_hidden_layers": m.n_layer,
        "num_attention_heads": m.n_head,
        "num_key_value_heads": l.n_kv_head,
        "head_dim": m.head_dim(),
        "max_position_embeddings": m.max_seq_len,
        "rms_norm_eps": l.norm_eps,
        "rope_theta": l.rope_theta,
        "rope_scaling": scaling,
        "rope_parameters": rope,
        "attention_bias": false,
        "mlp_bias": false,
        "tie_word_embeddings": l.tie_embeddings,
        "torch_dtype": "float32"
    })
}

/// The transformers tensors of the model tensors of `tensors` (names `model/<name>`, global
/// shapes): vocabulary padding dropped, gate/up split.
pub(super) fn hf_tensors(dir: &Path, model: &GptConfig, tensors: &[ExportedTensor]) -> Result<NamedTensors> {
    let mut out = NamedTensors::new();
    for (name, shape, data) in tensors {
        let Some(short) = name.strip_prefix("model/") else { continue };
        let names = hf_names(short).ok_or_else(|| Error::file(dir, None, format!("no Hugging Face name for `{name}`")))?;
        let (rows, cols) = match shape[..] {
            [r, c] => (r, c),
            [r] => (r, 1),
            _ => return Err(Error::file(dir, None, format!("`{name}` has shape {shape:?}"))),
        };
        let rows = if vocab_rows(short) { model.vocab_size } else { rows };
        let per = rows / names.len();
        for (i, hf) in names.into_iter().enumerate() {
            let part = data[i * per * cols..(i + 1) * per * cols].to_vec();
            let s = if shape.len() == 1 { vec![per] } else { vec![per, cols] };
            out.insert(hf, (s, part));
        }
    }
    Ok(out)
}

/// The Llama shape of a transformers `config.json` (`c`, read from `cpath`).
pub(super) fn read_config(cpath: &Path, c: &Value) -> Result<GptConfig> {
    let bad = |msg: String| Error::file(cpath, None, msg);
    let int = |k: &str| c[k].as_u64().map(|v| v as usize).ok_or_else(|| bad(format!("missing integer `{k}`")));
    let (n_head, n_embd) = (int("num_attention_heads")?, int("hidden_size")?);
    if let Some(hd) = c["head_dim"].as_u64() {
        if n_head == 0 || hd as usize * n_head != n_embd {
            return Err(bad(format!("`head_dim` {hd} is not hidden_size / num_attention_heads ({n_embd} / {n_head}); meshtrain needs it to be")));
        }
    }
    for k in ["attention_bias", "mlp_bias"] {
        if c[k].as_bool() == Some(true) {
            return Err(bad(format!("`{k}` is true; meshtrain's Llama has no biases")));
        }
    }
    if let Some(act) = c["hidden_act"].as_str().filter(|a| *a != "silu") {
        return Err(bad(format!("`hidden_act` is `{act}`; meshtrain's Llama uses silu")));
    }
    // transformers 5 nests the rotary parameters; 4.x keeps rope_theta and rope_scaling apart.
    let rope = if c["rope_parameters"].is_object() { &c["rope_parameters"] } else { &c["rope_scaling"] };
    let theta = rope["rope_theta"].as_f64().or(c["rope_theta"].as_f64()).unwrap_or(10000.0);
    let mut l = LlamaConfig::new(n_head, int("intermediate_size")?);
    l.n_kv_head = c["num_key_value_heads"].as_u64().map_or(n_head, |v| v as usize);
    l.rope_theta = theta;
    l.norm_eps = c["rms_norm_eps"].as_f64().unwrap_or(1e-6);
    l.tie_embeddings = c["tie_word_embeddings"].as_bool().unwrap_or(false);
    match rope["rope_type"].as_str().or(rope["type"].as_str()) {
        None | Some("default") => {}
        Some("llama3") => {
            let f = |k: &str| rope[k].as_f64().ok_or_else(|| bad(format!("rope scaling: missing number `{k}`")));
            l.rope_scaling_factor = Some(f("factor")?);
            l.rope_low_freq_factor = Some(f("low_freq_factor")?);
            l.rope_high_freq_factor = Some(f("high_freq_factor")?);
            l.rope_original_max_seq_len = Some(f("original_max_position_embeddings")? as usize);
        }
        Some(other) => return Err(bad(format!("rope type `{other}` is not supported (default and llama3 are)"))),
    }
    let model = GptConfig {
        n_layer: int("num_hidden_layers")?,
        n_head,
        n_embd,
        vocab_size: int("vocab_size")?,
        max_seq_len: int("max_position_embeddings")?,
        llama: Some(l),
    };
    model.validate().map_err(|e| bad(format!("describes no usable Llama: {e}")))?;
    Ok(model)
}

/// meshtrain's tensors (`model/<name>`, global shapes, vocabulary padded with zero rows) from the
/// transformers tensors `hf` of `wpath`; every tensor must be there with its shape, and nothing
/// else may be.
pub(super) fn from_hf(wpath: &Path, model: &GptConfig, mut hf: NamedTensors) -> Result<Vec<ExportedTensor>> {
    let mut out = Vec::new();
    for e in ParamLayout::new(model).entries() {
        let names = hf_names(&e.name).expect("every Llama layout tensor has a Hugging Face name");
        let rows = if vocab_rows(&e.name) { model.vocab_size } else { e.shape[0] };
        let per = rows / names.len();
        let mut data = Vec::with_capacity(e.len);
        for name in &names {
            let (shape, part) = hf.remove(name).ok_or_else(|| Error::file(wpath, None, format!("missing tensor `{name}`")))?;
            let want: Vec<usize> = if e.shape.len() == 1 { vec![per] } else { vec![per, e.shape[1]] };
            if shape != want {
                return Err(Error::file(wpath, None, format!("tensor `{name}` has shape {shape:?}, expected {want:?}")));
            }
            data.extend(part);
        }
        data.resize(e.len, 0.0);
        out.push((format!("model/{}", e.name), e.shape.clone(), data));
    }
    let tied = model.llama.is_some_and(|l| l.tie_embeddings);
    // Rotary caches some versions store carry no parameters; a tied head may be saved anyway.
    let extra = hf.keys().find(|k| !(k.ends_with("rotary_emb.inv_freq") || (tied && *k == "lm_head.weight")));
    if let Some(extra) = extra {
        return Err(Error::file(wpath, None, format!("unexpected tensor `{extra}` for a Llama of this shape")));
    }
    Ok(out)
}

/// Whether a parsed `config.json` describes a Llama model.
pub(super) fn is_llama(c: &Value) -> bool {
    c["model_type"].as_str() == Some("llama")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::safetensors::{parse, read_hf, serialize, write_hf};
    use std::path::PathBuf;

    fn fixture(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama").join(name)
    }

    fn tensors_of(dir: &Path) -> NamedTensors {
        let p = dir.join("model.safetensors");
        parse(&p, &std::fs::read(&p).unwrap()).unwrap()
    }

    /// Import then export gives back transformers' tensors exactly (names, shapes, values), and
    /// importing the export gives the same model; for both fixtures (GQA, Llama 3 scaling).
    #[test]
    fn import_export_round_trip() {
        for name in ["gqa", "llama3"] {
            let src = fixture(name);
            let (model, tensors) = read_hf(&src).unwrap();
            let out = tempfile::tempdir().unwrap();
            write_hf(out.path(), &model, &tensors).unwrap();
            assert!(tensors_of(out.path()) == tensors_of(&src), "{name}: exported tensors differ from the fixture's");
            let (again, back) = read_hf(out.path()).unwrap();
            assert_eq!(again, model, "{name}");
            assert!(back == tensors, "{name}: re-imported tensors differ");
        }
        let (m, _) = read_hf(&fixture("llama3")).unwrap();
        let s = m.llama.unwrap().rope_scaling().unwrap();
        assert_eq!((s.factor, s.original_max_position, m.llama.unwrap().rope_theta), (8.0, 256.0, 500000.0));
    }

    /// A copy of fixture `name` with its tensors edited by `edit` and its config by `cfg`.
    fn broken(name: &str, edit: impl FnOnce(&mut NamedTensors), cfg: impl FnOnce(&mut Value)) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let mut t = tensors_of(&fixture(name));
        edit(&mut t);
        std::fs::write(dir.path().join("model.safetensors"), serialize(&t)).unwrap();
        let mut c: Value = serde_json::from_str(&std::fs::read_to_string(fixture(name).join("config.json")).unwrap()).unwrap();
        cfg(&mut c);
        std::fs::write(dir.path().join("config.json"), c.to_string()).unwrap();
        dir
    }

    /// Bad directories are refused naming the file and the tensor or field.
    #[test]
    fn bad_input_names_the_tensor_and_file() {
        let q = "model.layers.1.self_attn.q_proj.weight";
        let cases: Vec<(tempfile::TempDir, &str)> = vec![
            (broken("gqa", |t| drop(t.remove(q)), |_| ()), "missing tensor `model.layers.1.self_attn.q_proj.weight`"),
            (broken("gqa", |t| t.get_mut(q).unwrap().0 = vec![16, 64], |_| ()), "has shape [16, 64], expected [32, 32]"),
            (broken("gqa", |t| drop(t.insert("model.extra.weight".into(), (vec![1], vec![0.0]))), |_| ()), "unexpected tensor `model.extra.weight`"),
            (broken("gqa", |_| (), |c| c["num_key_value_heads"] = 3.into()), "model.n_kv_head"),
            (broken("gqa", |_| (), |c| c["mlp_bias"] = true.into()), "`mlp_bias`"),
            (broken("gqa", |_| (), |c| c["rope_parameters"]["rope_type"] = "yarn".into()), "rope type `yarn`"),
            (broken("gqa", |_| (), |c| c["model_type"] = "gpt2".into()), "missing integer `n_layer`"),
        ];
        for (dir, want) in cases {
            let e = read_hf(dir.path()).unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
            assert!(e.contains("model.safetensors") || e.contains("config.json"), "no file named: {e}");
        }
    }

    /// A llama-tiny written as F32, then as BF16, F16 and two shards, imports the same bit for bit.
    #[test]
    fn bf16_f16_and_sharded_import_like_f32() {
        use crate::checkpoint::safetensors_read::{tests::bits, tests::exact_tensors, writer::variants};
        let mut m = GptConfig::named("llama-tiny").unwrap();
        for tied in [false, true] {
            m.llama.as_mut().unwrap().tie_embeddings = tied;
            let t = exact_tensors(&m);
            let dir = tempfile::tempdir().unwrap();
            write_hf(dir.path(), &m, &t).unwrap();
            let (m32, t32) = read_hf(dir.path()).unwrap();
            assert_eq!((&m32, bits(&t32)), (&m, bits(&t)), "tied {tied}");
            for (label, v) in variants(dir.path()) {
                let (mv, tv) = read_hf(v.path()).unwrap();
                assert_eq!(mv, m, "{label}");
                assert!(bits(&tv) == bits(&t32), "{label}, tied {tied}: differs from the F32 import");
            }
        }
    }

    #[test]
    fn names_map_one_to_one_with_gate_and_up_split() {
        let m = GptConfig::named("llama-tiny").unwrap();
        let mut all: Vec<String> = Vec::new();
        for e in ParamLayout::new(&m).entries() {
            all.extend(hf_names(&e.name).unwrap());
        }
        let n = all.len();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), n, "two tensors share a Hugging Face name");
        assert!(all.contains(&"model.layers.1.mlp.up_proj.weight".to_string()));
        assert_eq!(n, 2 + 2 * 9 + 1);
    }
}
