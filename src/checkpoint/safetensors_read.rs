//! Reading safetensors weights as the Hugging Face hub publishes them, for the GPT-2 and Llama
//! importers (`safetensors.rs`, `safetensors_llama.rs`): F32, BF16 or F16 tensors, in one
//! `model.safetensors` or sharded through `model.safetensors.index.json`.
//!
//! Why: published checkpoints are mostly 16-bit and, past a few GB, split into
//! `model-0000K-of-0000N.safetensors` shards with an index `{"metadata": {...}, "weight_map":
//! {tensor: shard file}}`. meshtrain trains from f32 master weights, so every value is widened
//! to f32 on the way in, exactly: a bf16 is the top half of an f32 (shifted into place), an f16
//! is widened by `half` (subnormals, infinities and NaNs included). Other dtypes (I8, F64, F8...)
//! are refused naming the tensor, the dtype and the file: no silent rounding or truncation.
//!
//! Invariants of a sharded read: every shard the index names is a plain file name inside the
//! directory and is read once, one at a time (its bytes are dropped once its tensors are
//! widened, so at most one shard's raw bytes are held beside the f32 tensors); every tensor of
//! the weight map is in the shard it is mapped to; a tensor in a shard other than its mapped one
//! (in two shards, or in none of the index) is an error naming the tensor and both files. A
//! single `model.safetensors` is preferred when both forms are present, as transformers does.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use super::safetensors::{NamedTensors, WEIGHTS_FILE};
use crate::error::{Error, Result};

/// The index of a sharded Hugging Face weights directory.
pub const SHARD_INDEX_FILE: &str = "model.safetensors.index.json";

/// Whether `dir` holds Hugging Face weights, single-file or sharded.
pub fn has_weights(dir: &Path) -> bool {
    dir.join(WEIGHTS_FILE).is_file() || dir.join(SHARD_INDEX_FILE).is_file()
}

/// The tensors of the Hugging Face directory `dir` (f32), and the file to name in errors about
/// the set of tensors (`model.safetensors`, or the index when sharded).
pub fn read_tensors(dir: &Path) -> Result<(PathBuf, NamedTensors)> {
    let single = dir.join(WEIGHTS_FILE);
    if single.is_file() || !dir.join(SHARD_INDEX_FILE).is_file() {
        let bytes = std::fs::read(&single).map_err(|e| Error::io(format!("read {}", single.display()), e))?;
        let tensors = parse(&single, &bytes)?;
        return Ok((single, tensors));
    }
    let index = dir.join(SHARD_INDEX_FILE);
    let tensors = read_sharded(dir, &index)?;
    Ok((index, tensors))
}

/// The weight map of the index at `path`: tensor name -> shard file name.
fn weight_map(path: &Path) -> Result<BTreeMap<String, String>> {
    let bad = |msg: String| Error::file(path, None, msg);
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(format!("read {}", path.display()), e))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
    let map = v["weight_map"].as_object().ok_or_else(|| bad("no `weight_map` object".into()))?;
    let mut out = BTreeMap::new();
    for (name, shard) in map {
        let shard = shard.as_str().ok_or_else(|| bad(format!("`weight_map` entry of tensor `{name}` is not a file name")))?;
        let plain = Path::new(shard).file_name().is_some_and(|f| f == shard) && shard != "." && shard != "..";
        if !plain {
            return Err(bad(format!("tensor `{name}` is mapped to `{shard}`, which is not a file name inside the directory")));
        }
        out.insert(name.clone(), shard.to_string());
    }
    if out.is_empty() {
        return Err(bad("`weight_map` names no tensor".into()));
    }
    Ok(out)
}

/// Reads every shard the index at `index` names, one at a time, checking each tensor against
/// the weight map.
fn read_sharded(dir: &Path, index: &Path) -> Result<NamedTensors> {
    let map = weight_map(index)?;
    let shards: BTreeSet<&String> = map.values().collect();
    let mut out = NamedTensors::new();
    for shard in shards {
        let path = dir.join(shard);
        let first = map.iter().find(|(_, s)| *s == shard).map(|(t, _)| t.as_str()).unwrap_or("?");
        if !path.is_file() {
            return Err(Error::file(index, None, format!("shard `{shard}` (holding tensor `{first}`) is missing: no file {}", path.display())));
        }
        let bytes = std::fs::read(&path).map_err(|e| Error::io(format!("read {}", path.display()), e))?;
        let tensors = parse(&path, &bytes)?;
        drop(bytes);
        for (name, t) in tensors {
            match map.get(&name) {
                Some(s) if s == shard => {}
                Some(s) => {
                    return Err(Error::file(&path, None, format!("tensor `{name}` is also here, but {} maps it to shard `{s}` (a tensor in two shards)", index.display())));
                }
                None => return Err(Error::file(&path, None, format!("tensor `{name}` is not in the weight map of {}", index.display()))),
            }
            out.insert(name, t);
        }
        if let Some((name, _)) = map.iter().find(|(t, s)| *s == shard && !out.contains_key(*t)) {
            return Err(Error::file(&path, None, format!("tensor `{name}` is missing: {} maps it to this shard", index.display())));
        }
    }
    Ok(out)
}

/// Bytes per element of the dtypes meshtrain reads.
fn dtype_size(dtype: &str) -> Option<usize> {
    match dtype {
        "F32" => Some(4),
        "BF16" | "F16" => Some(2),
        _ => None,
    }
}

/// `raw` (little-endian elements of `dtype`, a dtype `dtype_size` knows) widened to f32 exactly.
fn widen(dtype: &str, raw: &[u8]) -> Vec<f32> {
    match dtype {
        "F32" => raw.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
        "BF16" => raw.chunks_exact(2).map(|b| f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16)).collect(),
        _ => raw.chunks_exact(2).map(|b| half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()).collect(),
    }
}

/// Parses safetensors `bytes` (from `path`, for errors): name -> (shape, values widened to f32).
pub fn parse(path: &Path, bytes: &[u8]) -> Result<NamedTensors> {
    let bad = |msg: String| Error::file(path, None, msg);
    let n = bytes.get(..8).map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")) as usize);
    let n = n.filter(|&n| n <= bytes.len() - 8).ok_or_else(|| bad("not a safetensors file (header length)".into()))?;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + n]).map_err(|e| bad(format!("header is not JSON: {e}")))?;
    let data = &bytes[8 + n..];
    let mut out = BTreeMap::new();
    for (name, v) in header.iter().filter(|(k, _)| *k != "__metadata__") {
        let dtype = v["dtype"].as_str().unwrap_or("?");
        let size = dtype_size(dtype).ok_or_else(|| bad(format!("tensor `{name}` has dtype {dtype}; meshtrain reads F32, BF16 and F16")))?;
        let shape: Option<Vec<usize>> = v["shape"].as_array().and_then(|a| a.iter().map(|d| d.as_u64().map(|d| d as usize)).collect());
        let offs: Option<Vec<usize>> = v["data_offsets"].as_array().and_then(|a| a.iter().map(|d| d.as_u64().map(|d| d as usize)).collect());
        let (shape, [start, end]) = match (shape, offs.as_deref()) {
            (Some(s), Some(&[a, b])) => (s, [a, b]),
            _ => return Err(bad(format!("tensor `{name}`: bad shape or data_offsets"))),
        };
        let len = shape.iter().try_fold(size, |a, &d| a.checked_mul(d));
        if start > end || end > data.len() || Some(end - start) != len {
            return Err(bad(format!("tensor `{name}`: data_offsets [{start}, {end}] do not fit {dtype} shape {shape:?} in {} data bytes", data.len())));
        }
        out.insert(name.clone(), (shape, widen(dtype, &data[start..end])));
    }
    Ok(out)
}

/// Test writers: safetensors bytes in a 16-bit dtype and sharded directories, from f32 values
/// that the dtype represents exactly (checked, so a test cannot compare rounded values).
#[cfg(test)]
pub(crate) mod writer {
    use super::*;

    /// `x` in `dtype`'s little-endian bytes; panics when `x` is not exactly representable.
    fn narrow(dtype: &str, x: f32) -> Vec<u8> {
        let bytes = match dtype {
            "F32" => x.to_le_bytes().to_vec(),
            "BF16" => ((x.to_bits() >> 16) as u16).to_le_bytes().to_vec(),
            "F16" => half::f16::from_f32(x).to_bits().to_le_bytes().to_vec(),
            // Any other dtype: raw bytes of the right size, for the refusal tests.
            _ => vec![0; 1],
        };
        if dtype_size(dtype).is_some() {
            assert_eq!(widen(dtype, &bytes)[0].to_bits(), x.to_bits(), "{x} is not exact in {dtype}");
        }
        bytes
    }

    /// The safetensors bytes of `tensors`, every tensor in `dtype` (`dtype_of` overrides by name).
    pub(crate) fn serialize_as(tensors: &NamedTensors, dtype: &str, dtype_of: &dyn Fn(&str) -> Option<&'static str>) -> Vec<u8> {
        let mut header = String::from("{\"__metadata__\":{\"format\":\"pt\"}");
        let mut data = Vec::new();
        for (name, (shape, values)) in tensors {
            let dt = dtype_of(name).unwrap_or(dtype);
            let start = data.len();
            values.iter().for_each(|&x| data.extend(narrow(dt, x)));
            let shape: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
            let name = serde_json::to_string(name).unwrap();
            header.push_str(&format!(",{name}:{{\"dtype\":\"{dt}\",\"shape\":[{}],\"data_offsets\":[{start},{}]}}", shape.join(","), data.len()));
        }
        header.push('}');
        while header.len() % 8 != 0 {
            header.push(' ');
        }
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        bytes.extend(data);
        bytes
    }

    /// Writes `tensors` into `dir` as two shards (alternate tensors, the first BF16 and the
    /// second F16) and their index; returns the shard paths.
    pub(crate) fn write_sharded(dir: &Path, tensors: &NamedTensors) -> [PathBuf; 2] {
        let names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"];
        let mut parts = [NamedTensors::new(), NamedTensors::new()];
        let mut map = serde_json::Map::new();
        for (i, (name, t)) in tensors.iter().enumerate() {
            parts[i % 2].insert(name.clone(), t.clone());
            map.insert(name.clone(), names[i % 2].into());
        }
        for (k, dt) in [(0, "BF16"), (1, "F16")] {
            std::fs::write(dir.join(names[k]), serialize_as(&parts[k], dt, &|_| None)).unwrap();
        }
        let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": map});
        std::fs::write(dir.join(SHARD_INDEX_FILE), index.to_string()).unwrap();
        names.map(|n| dir.join(n))
    }

    /// Directories holding the weights of the F32 Hugging Face directory `src` (and its config)
    /// as BF16, as F16, and as two shards: (label, directory).
    pub(crate) fn variants(src: &Path) -> Vec<(&'static str, tempfile::TempDir)> {
        let w = src.join(WEIGHTS_FILE);
        let tensors = parse(&w, &std::fs::read(&w).unwrap()).unwrap();
        let config = std::fs::read(src.join(super::super::safetensors::CONFIG_FILE)).unwrap();
        let mut out = Vec::new();
        for label in ["BF16", "F16", "sharded"] {
            let dir = tempfile::tempdir().unwrap();
            std::fs::write(dir.path().join(super::super::safetensors::CONFIG_FILE), &config).unwrap();
            if label == "sharded" {
                write_sharded(dir.path(), &tensors);
            } else {
                std::fs::write(dir.path().join(WEIGHTS_FILE), serialize_as(&tensors, label, &|_| None)).unwrap();
            }
            out.push((label, dir));
        }
        out
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::writer::{serialize_as, variants, write_sharded};
    use super::*;
    use crate::checkpoint::export::ExportedTensor;
    use crate::checkpoint::safetensors::{read_hf, write_hf, CONFIG_FILE};
    use crate::model::{GptConfig, ParamLayout};

    /// Every model tensor of `m` with values exact in BF16 and F16 (an f16 subnormal, -0 and
    /// infinity among them; padded vocabulary rows zero).
    pub(crate) fn exact_tensors(m: &GptConfig) -> Vec<ExportedTensor> {
        let mut k = 0i32;
        let specials = [2f32.powi(-20), -0.0, f32::INFINITY, 32768.0];
        ParamLayout::new(m)
            .entries()
            .iter()
            .map(|e| {
                let mut data: Vec<f32> = (0..e.len).map(|_| { k += 1; (k % 200 - 100) as f32 / 8.0 }).collect();
                let n = specials.len().min(data.len());
                data[..n].copy_from_slice(&specials[..n]);
                if e.name == "wte" {
                    data[m.vocab_size * m.n_embd..].fill(0.0);
                }
                (format!("model/{}", e.name), e.shape.clone(), data)
            })
            .collect()
    }

    /// `t` with its values as bit patterns, so that -0 and 0 differ.
    pub(crate) fn bits(t: &[ExportedTensor]) -> Vec<(String, Vec<usize>, Vec<u32>)> {
        t.iter().map(|(n, s, d)| (n.clone(), s.clone(), d.iter().map(|x| x.to_bits()).collect())).collect()
    }

    fn gpt2_dir() -> (GptConfig, Vec<ExportedTensor>, tempfile::TempDir) {
        let m = GptConfig { n_layer: 2, n_head: 2, n_embd: 8, vocab_size: 50, max_seq_len: 6, llama: None };
        let t = exact_tensors(&m);
        let dir = tempfile::tempdir().unwrap();
        write_hf(dir.path(), &m, &t).unwrap();
        (m, t, dir)
    }

    #[test]
    fn sixteen_bit_values_widen_exactly() {
        let f16 = |b: u16| widen("F16", &b.to_le_bytes())[0];
        assert_eq!(f16(0x0001), 2f32.powi(-24), "smallest subnormal");
        assert_eq!(f16(0x03ff), 1023.0 * 2f32.powi(-24), "largest subnormal");
        assert_eq!(f16(0x3c00), 1.0);
        assert_eq!(f16(0xc000), -2.0);
        assert_eq!(f16(0x7bff), 65504.0);
        assert_eq!(f16(0x7c00), f32::INFINITY);
        assert_eq!(f16(0xfc00), f32::NEG_INFINITY);
        assert!(f16(0x7e00).is_nan() && f16(0xfe01).is_nan());
        assert_eq!(f16(0x8000).to_bits(), (-0f32).to_bits());
        let bf16 = |b: u16| widen("BF16", &b.to_le_bytes())[0];
        assert_eq!(bf16(0x3f80), 1.0);
        assert_eq!(bf16(0xc0a0), -5.0);
        assert_eq!(bf16(0x0001).to_bits(), 0x0001_0000, "subnormal");
        assert_eq!(bf16(0x7f80), f32::INFINITY);
        assert!(bf16(0x7fc1).is_nan());
        assert_eq!(bf16(0x8000).to_bits(), (-0f32).to_bits());
    }

    /// BF16, F16 and a 2-shard directory import to the F32 import bit for bit.
    #[test]
    fn gpt2_bf16_f16_and_sharded_import_like_f32() {
        let (m, t, dir) = gpt2_dir();
        let (m32, t32) = read_hf(dir.path()).unwrap();
        assert_eq!((&m32, bits(&t32)), (&m, bits(&t)));
        for (label, v) in variants(dir.path()) {
            assert!(crate::checkpoint::is_hf_dir(v.path()), "{label}");
            let (mv, tv) = read_hf(v.path()).unwrap();
            assert_eq!(mv, m, "{label}");
            assert!(bits(&tv) == bits(&t32), "{label}: differs from the F32 import");
        }
    }

    /// A copy of the GPT-2 directory as two shards: (directory, shard paths, the tensors).
    fn sharded() -> (tempfile::TempDir, [PathBuf; 2], NamedTensors) {
        let (_, _, src) = gpt2_dir();
        let w = src.path().join(WEIGHTS_FILE);
        let tensors = parse(&w, &std::fs::read(&w).unwrap()).unwrap();
        let dir = tempfile::tempdir().unwrap();
        std::fs::copy(src.path().join(CONFIG_FILE), dir.path().join(CONFIG_FILE)).unwrap();
        let shards = write_sharded(dir.path(), &tensors);
        (dir, shards, tensors)
    }

    fn err(dir: &Path) -> String {
        read_hf(dir).unwrap_err().to_string()
    }

    /// Rewrites the index of `dir` through `edit` of its weight map.
    fn edit_index(dir: &Path, edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) {
        let p = dir.join(SHARD_INDEX_FILE);
        let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        edit(v["weight_map"].as_object_mut().unwrap());
        std::fs::write(&p, v.to_string()).unwrap();
    }

    #[test]
    fn bad_shards_are_errors_naming_the_file_and_tensor() {
        let shard1 = "model-00001-of-00002.safetensors";
        let shard2 = "model-00002-of-00002.safetensors";
        // A shard file missing.
        let (dir, shards, _) = sharded();
        std::fs::remove_file(&shards[1]).unwrap();
        let e = err(dir.path());
        assert!(e.contains(SHARD_INDEX_FILE) && e.contains(shard2) && e.contains("missing") && e.contains("tensor `"), "{e}");
        // A tensor missing from its shard.
        let (dir, shards, tensors) = sharded();
        let mut part = parse(&shards[0], &std::fs::read(&shards[0]).unwrap()).unwrap();
        let gone = part.keys().next().unwrap().clone();
        part.remove(&gone);
        std::fs::write(&shards[0], serialize_as(&part, "BF16", &|_| None)).unwrap();
        let e = err(dir.path());
        assert!(e.contains(shard1) && e.contains(&format!("tensor `{gone}` is missing")), "{e}");
        // A tensor in two shards.
        let (dir, shards, _) = sharded();
        let mut part = parse(&shards[1], &std::fs::read(&shards[1]).unwrap()).unwrap();
        part.insert(gone.clone(), tensors[&gone].clone());
        std::fs::write(&shards[1], serialize_as(&part, "F16", &|_| None)).unwrap();
        let e = err(dir.path());
        assert!(e.contains(shard2) && e.contains(&format!("`{gone}` is also here")) && e.contains(&format!("shard `{shard1}`")), "{e}");
        // A tensor in a shard but not in the index.
        let (dir, _, _) = sharded();
        edit_index(dir.path(), |m| drop(m.remove(&gone)));
        let e = err(dir.path());
        assert!(e.contains(shard1) && e.contains(&format!("`{gone}` is not in the weight map")), "{e}");
        // The index (and its shard) name a tensor the model lacks.
        let (dir, shards, _) = sharded();
        let mut part = parse(&shards[1], &std::fs::read(&shards[1]).unwrap()).unwrap();
        part.insert("transformer.extra.weight".into(), (vec![2], vec![1.0, 2.0]));
        std::fs::write(&shards[1], serialize_as(&part, "F16", &|_| None)).unwrap();
        edit_index(dir.path(), |m| drop(m.insert("transformer.extra.weight".into(), shard2.into())));
        let e = err(dir.path());
        assert!(e.contains(SHARD_INDEX_FILE) && e.contains("unexpected tensor `transformer.extra.weight`"), "{e}");
        // The index names a tensor whose shard lacks it, and a shard outside the directory.
        let (dir, _, _) = sharded();
        edit_index(dir.path(), |m| drop(m.insert("transformer.extra.weight".into(), shard2.into())));
        let e = err(dir.path());
        assert!(e.contains(shard2) && e.contains("tensor `transformer.extra.weight` is missing"), "{e}");
        edit_index(dir.path(), |m| drop(m.insert("transformer.extra.weight".into(), "../x.safetensors".into())));
        let e = err(dir.path());
        assert!(e.contains(SHARD_INDEX_FILE) && e.contains("`../x.safetensors`") && e.contains("not a file name"), "{e}");
        // The model needs a tensor the index does not list at all.
        let (dir, _, tensors) = sharded();
        let last = tensors.keys().last().unwrap().clone();
        edit_index(dir.path(), |m| drop(m.remove(&last)));
        let e = err(dir.path());
        assert!(e.contains(&format!("`{last}`")), "{e}");
        std::fs::write(dir.path().join(SHARD_INDEX_FILE), "{\"metadata\": {}}").unwrap();
        let e = err(dir.path());
        assert!(e.contains(SHARD_INDEX_FILE) && e.contains("weight_map"), "{e}");
    }

    #[test]
    fn other_dtypes_are_refused_naming_the_tensor_and_dtype() {
        let (_, _, dir) = gpt2_dir();
        let w = dir.path().join(WEIGHTS_FILE);
        let tensors = parse(&w, &std::fs::read(&w).unwrap()).unwrap();
        for dt in ["I8", "F64", "F8_E4M3", "U16"] {
            let name = "transformer.h.1.mlp.c_fc.bias";
            std::fs::write(&w, serialize_as(&tensors, "BF16", &|n| (n == name).then_some(dt))).unwrap();
            let e = err(dir.path());
            assert!(e.contains(WEIGHTS_FILE) && e.contains(&format!("tensor `{name}` has dtype {dt}")), "{e}");
        }
        // A 16-bit tensor whose offsets hold F32-sized data is caught by the size check.
        let mut bytes = serialize_as(&tensors, "F32", &|_| None);
        let at = bytes.windows(5).position(|w| w == b"\"F32\"").unwrap();
        bytes[at..at + 5].copy_from_slice(b"\"F16\"");
        std::fs::write(&w, bytes).unwrap();
        let e = err(dir.path());
        assert!(e.contains("data_offsets") && e.contains("F16 shape"), "{e}");
    }
}
