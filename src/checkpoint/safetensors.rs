//! GPT-2 weights (Llama: `safetensors_llama.rs`) in the Hugging Face layout: a directory with `model.safetensors` and
//! `config.json`, as `GPT2LMHeadModel.save_pretrained` writes them, so that
//! `GPT2LMHeadModel.from_pretrained(DIR)` loads what `meshtrain export --format safetensors`
//! writes, and `init_from = "DIR"` (or `generate DIR`) reads such a directory.
//!
//! The two layouts differ in names, in the orientation of the matrices and in the vocabulary:
//! transformers' GPT-2 keeps its linear weights as `Conv1D`, (in, out), meshtrain as (out, in), so
//! every block matrix is transposed on the way; meshtrain pads the vocabulary to a multiple of 128
//! (the padded rows never reach a loss or a sample), the Hugging Face model has exactly
//! `vocab_size` rows, so the padding is dropped on export and zero-filled on import. The head is
//! tied to `wte` in both and is not stored.
//!
//! The file: 8 bytes little-endian header length, the header (compact JSON: `__metadata__` first,
//! then every tensor by name with dtype, shape and data offsets), padded with spaces to a
//! multiple of 8, then the tensors' bytes. Export always writes F32 tensors in name order into
//! one `model.safetensors`. Import (`safetensors_read.rs`) also takes what the hub publishes:
//! F32, BF16 or F16 tensors (widened to f32 exactly), in one `model.safetensors` or in shards
//! named by `model.safetensors.index.json`, read one shard at a time; errors about the set of
//! tensors (missing, extra) then name the index. Reading checks every offset against the file's
//! length and every shape against the model's.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::checkpoint::export::ExportedTensor;
use crate::error::{Error, Result};
use crate::model::{GptConfig, ParamLayout};

#[cfg(test)]
pub(crate) use super::safetensors_read::parse;

/// The weights file inside a Hugging Face model directory.
pub const WEIGHTS_FILE: &str = "model.safetensors";
/// The model configuration beside it.
pub const CONFIG_FILE: &str = "config.json";

/// Tensors by name: shape and F32 values.
pub type NamedTensors = BTreeMap<String, (Vec<usize>, Vec<f32>)>;

/// meshtrain's block tensor suffix -> (transformers' suffix, transposed).
const BLOCK_NAMES: &[(&str, &str, bool)] = &[
    ("ln1.weight", "ln_1.weight", false),
    ("ln1.bias", "ln_1.bias", false),
    ("attn.qkv.weight", "attn.c_attn.weight", true),
    ("attn.qkv.bias", "attn.c_attn.bias", false),
    ("attn.proj.weight", "attn.c_proj.weight", true),
    ("attn.proj.bias", "attn.c_proj.bias", false),
    ("ln2.weight", "ln_2.weight", false),
    ("ln2.bias", "ln_2.bias", false),
    ("mlp.fc.weight", "mlp.c_fc.weight", true),
    ("mlp.fc.bias", "mlp.c_fc.bias", false),
    ("mlp.proj.weight", "mlp.c_proj.weight", true),
    ("mlp.proj.bias", "mlp.c_proj.bias", false),
];

/// The Hugging Face name of meshtrain tensor `name` (without `model/`) and whether it is stored
/// transposed.
fn hf_name(name: &str) -> Option<(String, bool)> {
    match name {
        "wte" => Some(("transformer.wte.weight".into(), false)),
        "wpe" => Some(("transformer.wpe.weight".into(), false)),
        "lnf.weight" => Some(("transformer.ln_f.weight".into(), false)),
        "lnf.bias" => Some(("transformer.ln_f.bias".into(), false)),
        _ => {
            let rest = name.strip_prefix("h.")?;
            let (layer, suffix) = rest.split_once('.')?;
            let (_, hf, t) = BLOCK_NAMES.iter().find(|b| b.0 == suffix)?;
            Some((format!("transformer.h.{layer}.{hf}"), *t))
        }
    }
}

/// `rows x cols` row-major -> `cols x rows` row-major.
fn transpose(data: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0f32; data.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = data[r * cols + c];
        }
    }
    out
}

/// transformers' `GPT2Config` for `m` (GELU "gelu_new" is GPT-2's tanh approximation).
fn hf_config(m: &GptConfig) -> serde_json::Value {
    serde_json::json!({
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "activation_function": "gelu_new",
        "vocab_size": m.vocab_size,
        "n_positions": m.max_seq_len,
        "n_ctx": m.max_seq_len,
        "n_embd": m.n_embd,
        "n_layer": m.n_layer,
        "n_head": m.n_head,
        "n_inner": null,
        "layer_norm_epsilon": 1e-5,
        "tie_word_embeddings": true,
        "bos_token_id": 50256,
        "eos_token_id": 50256,
        "torch_dtype": "float32"
    })
}

/// Writes the model tensors of `tensors` (names `model/<name>`, global shapes) as a Hugging Face
/// GPT-2 directory `dir`; returns the number of tensors written.
pub fn write_hf(dir: &Path, model: &GptConfig, tensors: &[ExportedTensor]) -> Result<usize> {
    if let Some(l) = &model.llama {
        let out = super::safetensors_llama::hf_tensors(dir, model, tensors)?;
        return write_dir(dir, &out, &super::safetensors_llama::hf_config(model, l));
    }
    let mut out = NamedTensors::new();
    for (name, shape, data) in tensors {
        let Some(short) = name.strip_prefix("model/") else { continue };
        let (hf, t) = hf_name(short).ok_or_else(|| Error::file(dir, None, format!("no Hugging Face name for `{name}`")))?;
        let entry = match (short, t, &shape[..]) {
            ("wte", _, &[_, c]) => (vec![model.vocab_size, c], data[..model.vocab_size * c].to_vec()),
            (_, true, &[r, c]) => (vec![c, r], transpose(data, r, c)),
            _ => (shape.clone(), data.clone()),
        };
        out.insert(hf, entry);
    }
    write_dir(dir, &out, &hf_config(model))
}

/// Writes `tensors` and `config` as the Hugging Face directory `dir`; returns the tensor count.
fn write_dir(dir: &Path, out: &NamedTensors, config: &serde_json::Value) -> Result<usize> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(format!("create {}", dir.display()), e))?;
    let bytes = serialize(out);
    write_atomic(&dir.join(WEIGHTS_FILE), &bytes)?;
    let config = serde_json::to_string_pretty(config).expect("a JSON value serializes");
    write_atomic(&dir.join(CONFIG_FILE), config.as_bytes())?;
    Ok(out.len())
}

fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = PathBuf::from(format!("{}.tmp", path.display()));
    std::fs::write(&tmp, bytes).map_err(|e| Error::io(format!("write {}", tmp.display()), e))?;
    std::fs::rename(&tmp, path).map_err(|e| Error::io(format!("rename {}", path.display()), e))
}

/// The safetensors bytes of `tensors` (all F32), in name order.
pub fn serialize(tensors: &NamedTensors) -> Vec<u8> {
    let mut header = String::from("{\"__metadata__\":{\"format\":\"pt\"}");
    let mut offset = 0usize;
    for (name, (shape, data)) in tensors {
        let end = offset + 4 * data.len();
        let shape: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
        let name = serde_json::to_string(name).expect("a string serializes");
        header.push_str(&format!(",{name}:{{\"dtype\":\"F32\",\"shape\":[{}],\"data_offsets\":[{offset},{end}]}}", shape.join(",")));
        offset = end;
    }
    header.push('}');
    while header.len() % 8 != 0 {
        header.push(' ');
    }
    let mut bytes = Vec::with_capacity(8 + header.len() + offset);
    bytes.extend_from_slice(&(header.len() as u64).to_le_bytes());
    bytes.extend_from_slice(header.as_bytes());
    for (_, data) in tensors.values() {
        for x in data {
            bytes.extend_from_slice(&x.to_le_bytes());
        }
    }
    bytes
}

/// Writes the weights of the checkpoint at `ckpt` as a Hugging Face GPT-2 directory `dir`;
/// returns the number of tensors written.
pub fn export_hf(ckpt: &Path, dir: &Path) -> Result<usize> {
    let index = crate::checkpoint::index::open(ckpt)?;
    let mut tensors = Vec::new();
    for t in index.tensors().iter().filter(|t| t.name.starts_with("model/")) {
        let zeros = vec![0; t.global_shape.len()];
        let mut buf = vec![0f32; t.len()]; // tiling-checked: the shard files hold these bytes
        index.load_slice(&t.name, &zeros, &t.global_shape, &mut buf)?;
        tensors.push((t.name.clone(), t.global_shape.clone(), buf));
    }
    write_hf(dir, &index.meta().model, &tensors)
}

/// Whether `path` is a Hugging Face model directory (single-file or sharded weights).
pub fn is_hf_dir(path: &Path) -> bool {
    super::safetensors_read::has_weights(path)
}

/// Reads a Hugging Face GPT-2 directory: its model configuration and the tensors in meshtrain's
/// names and layout (`model/<name>`, global shapes, the vocabulary padded with zero rows).
pub fn read_hf(dir: &Path) -> Result<(GptConfig, Vec<ExportedTensor>)> {
    let cpath = dir.join(CONFIG_FILE);
    let text = std::fs::read_to_string(&cpath).map_err(|e| Error::io(format!("read {}", cpath.display()), e))?;
    let c: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::file(&cpath, None, format!("not JSON: {e}")))?;
    if super::safetensors_llama::is_llama(&c) {
        let model = super::safetensors_llama::read_config(&cpath, &c)?;
        let (wpath, hf) = super::safetensors_read::read_tensors(dir)?;
        let tensors = super::safetensors_llama::from_hf(&wpath, &model, hf)?;
        return Ok((model, tensors));
    }
    let get = |k: &str| c[k].as_u64().map(|v| v as usize).ok_or_else(|| Error::file(&cpath, None, format!("missing integer `{k}`")));
    let model = GptConfig { n_layer: get("n_layer")?, n_head: get("n_head")?, n_embd: get("n_embd")?, vocab_size: get("vocab_size")?, max_seq_len: get("n_positions")?, llama: None };
    model.validate()?;
    let (wpath, mut hf) = super::safetensors_read::read_tensors(dir)?;
    let mut out = Vec::new();
    for e in ParamLayout::new(&model).entries() {
        let (name, t) = hf_name(&e.name).expect("every layout tensor has a Hugging Face name");
        let (shape, data) = hf.remove(&name).ok_or_else(|| Error::file(&wpath, None, format!("missing tensor `{name}`")))?;
        let want: Vec<usize> = match (e.name.as_str(), t, &e.shape[..]) {
            ("wte", _, &[_, c]) => vec![model.vocab_size, c],
            (_, true, &[r, c]) => vec![c, r],
            _ => e.shape.clone(),
        };
        if shape != want {
            return Err(Error::file(&wpath, None, format!("tensor `{name}` has shape {shape:?}, expected {want:?}")));
        }
        let data = match (e.name.as_str(), t) {
            ("wte", _) => {
                let mut padded = data;
                padded.resize(e.len, 0.0);
                padded
            }
            (_, true) => transpose(&data, want[0], want[1]),
            _ => data,
        };
        out.push((format!("model/{}", e.name), e.shape.clone(), data));
    }
    // Buffers transformers may store beside the weights (causal masks) carry no parameters.
    if let Some(extra) = hf.keys().find(|k| !k.ends_with(".attn.bias") && !k.ends_with(".attn.masked_bias") && *k != "lm_head.weight") {
        return Err(Error::file(&wpath, None, format!("unexpected tensor `{extra}` for a GPT-2 of this shape")));
    }
    Ok((model, out))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> GptConfig {
        GptConfig { n_layer: 2, n_head: 2, n_embd: 8, vocab_size: 50, max_seq_len: 6, llama: None }
    }

    /// Every model tensor of `m` with distinct values (padded vocabulary rows zero).
    fn tensors(m: &GptConfig) -> Vec<ExportedTensor> {
        let mut k = 0f32;
        ParamLayout::new(m)
            .entries()
            .iter()
            .map(|e| {
                let mut data: Vec<f32> = (0..e.len).map(|_| { k += 1.0; k }).collect();
                if e.name == "wte" {
                    data[m.vocab_size * m.n_embd..].fill(0.0);
                }
                (format!("model/{}", e.name), e.shape.clone(), data)
            })
            .collect()
    }

    #[test]
    fn export_and_import_round_trip_with_the_hugging_face_names_and_layouts() {
        let dir = tempfile::tempdir().unwrap();
        let m = tiny();
        let mine = tensors(&m);
        assert_eq!(write_hf(dir.path(), &m, &mine).unwrap(), 2 + 12 * 2 + 2);
        let bytes = std::fs::read(dir.path().join(WEIGHTS_FILE)).unwrap();
        let hf = parse(dir.path(), &bytes).unwrap();
        // transformers' Conv1D orientation: c_attn is (C, 3C); the vocabulary is not padded.
        assert_eq!(hf["transformer.h.1.attn.c_attn.weight"].0, [8, 24]);
        assert_eq!(hf["transformer.h.0.mlp.c_proj.weight"].0, [32, 8]);
        assert_eq!(hf["transformer.wte.weight"].0, [50, 8]);
        let qkv = &mine.iter().find(|t| t.0 == "model/h.1.attn.qkv.weight").unwrap().2;
        assert_eq!(hf["transformer.h.1.attn.c_attn.weight"].1[1], qkv[8], "element (0, 1) is meshtrain's (1, 0)");
        let (back_cfg, back) = read_hf(dir.path()).unwrap();
        assert_eq!(back_cfg, m);
        assert_eq!(back, mine);
        // Written again from what was read: the same bytes.
        let again = tempfile::tempdir().unwrap();
        write_hf(again.path(), &m, &back).unwrap();
        assert_eq!(std::fs::read(again.path().join(WEIGHTS_FILE)).unwrap(), bytes);
        assert_eq!(&bytes[8..40], b"{\"__metadata__\":{\"format\":\"pt\"},");
        assert_eq!((u64::from_le_bytes(bytes[..8].try_into().unwrap()) % 8), 0);
    }

    #[test]
    fn bad_files_are_errors_naming_the_file_and_tensor() {
        let dir = tempfile::tempdir().unwrap();
        let m = tiny();
        write_hf(dir.path(), &m, &tensors(&m)).unwrap();
        let path = dir.path().join(WEIGHTS_FILE);
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 4]).unwrap();
        let err = read_hf(dir.path()).unwrap_err().to_string();
        assert!(err.contains("model.safetensors") && err.contains("data_offsets"), "{err}");
        let err = parse(&path, b"\xff\xff\xff\xff\xff\xff\xff\xff{}").unwrap_err().to_string();
        assert!(err.contains("header length"), "{err}");
        // A config of another shape: the first tensor that differs is named.
        let cfg = std::fs::read_to_string(dir.path().join(CONFIG_FILE)).unwrap().replace("\"n_positions\": 6", "\"n_positions\": 7");
        std::fs::write(&path, &bytes).unwrap();
        std::fs::write(dir.path().join(CONFIG_FILE), cfg).unwrap();
        let err = read_hf(dir.path()).unwrap_err().to_string();
        assert!(err.contains("transformer.wpe.weight") && err.contains("[6, 8]"), "{err}");
    }
}
