//! Llama fidelity against Hugging Face transformers: the fixtures under tests/fixtures/llama/
//! (`LlamaForCausalLM` with random weights; logits, loss and every parameter's gradient computed
//! by torch in float64) imported with `read_hf` and run through the one executor in fp32, on the
//! CPU and on emu.
//!
//! Metric, per tensor: ‖got − want‖₂ / ‖want‖₂ ≤ 1e-5 (norm-relative: robust to the many
//! near-zero entries an elementwise relative error would blow up on); the loss: |got − want| /
//! |want| ≤ 1e-5.

use std::path::{Path, PathBuf};

use crate::checkpoint::{parse_safetensors, read_hf};
use crate::device::{Device, DeviceKind};
use crate::model::{DeviceGpt, ParamLayout, Precision};

const TOL: f64 = 1e-5;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama").join(name)
}

/// ‖got − want‖₂ / ‖want‖₂.
fn norm_rel(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    let d: f64 = got.iter().zip(want).map(|(&g, &w)| (f64::from(g) - f64::from(w)).powi(2)).sum();
    let n: f64 = want.iter().map(|&w| f64::from(w).powi(2)).sum();
    (d / n).sqrt()
}

/// Runs fixture `name` on `kind`; returns the worst norm-relative error over logits, loss and
/// gradients, checking each.
fn check_fixture(name: &str, kind: DeviceKind) -> f64 {
    let dir = fixture(name);
    let (cfg, tensors) = read_hf(&dir).unwrap();
    let layout = ParamLayout::new(&cfg);
    let mut params = vec![0f32; layout.total_len()];
    for e in layout.entries() {
        let (_, _, data) = tensors.iter().find(|t| t.0 == format!("model/{}", e.name)).unwrap();
        params[e.range()].copy_from_slice(data);
    }
    let exp: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let rows = |k: &str| -> Vec<Vec<u32>> {
        exp[k].as_array().unwrap().iter().map(|r| r.as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect()).collect()
    };
    let (ids, targets) = (rows("input_ids"), rows("targets"));
    let (b, t) = (ids.len(), ids[0].len());
    let flat = |x: Vec<Vec<u32>>| x.into_iter().flatten().collect::<Vec<u32>>();
    let dev = Device::open(kind, 0).unwrap();
    let mut m = DeviceGpt::new(dev, cfg, b, t, params, Precision::Fp32).unwrap();
    let loss = m.forward(&flat(ids), &flat(targets)).unwrap();
    let want_loss = exp["loss"].as_f64().unwrap();
    let mut worst = ((loss - want_loss) / want_loss).abs();
    assert!(worst <= TOL, "{name}: loss {loss} vs transformers {want_loss}");

    let epath = dir.join("expected.safetensors");
    let expected = parse_safetensors(&epath, &std::fs::read(&epath).unwrap()).unwrap();
    let (vp, v) = (cfg.padded_vocab_size(), cfg.vocab_size);
    let logits: Vec<f32> = m.last_logits().unwrap().chunks(vp).flat_map(|r| r[..v].to_vec()).collect();
    let e = norm_rel(&logits, &expected["logits"].1);
    assert!(e <= TOL, "{name}: logits differ by {e:e} (norm-relative)");
    worst = worst.max(e);

    let mut grads = vec![0f32; layout.total_len()];
    m.backward(true, &mut |r, g| grads[r.clone()].copy_from_slice(&g[r])).unwrap();
    // The expected gradients in meshtrain's layout: written as a transformers directory under
    // their parameter names and imported like the weights.
    let gdir = std::env::temp_dir().join(format!("meshtrain-llama-grads-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&gdir).unwrap();
    let mut hf = expected.clone();
    hf.retain(|k, _| k.starts_with("grad."));
    let hf: std::collections::BTreeMap<String, (Vec<usize>, Vec<f32>)> = hf.into_iter().map(|(k, v)| (k["grad.".len()..].to_string(), v)).collect();
    std::fs::write(gdir.join("model.safetensors"), crate::checkpoint::serialize_safetensors(&hf)).unwrap();
    std::fs::copy(dir.join("config.json"), gdir.join("config.json")).unwrap();
    let (_, want_grads) = read_hf(&gdir).unwrap();
    std::fs::remove_dir_all(&gdir).unwrap();
    for e in layout.entries() {
        let (_, _, want) = want_grads.iter().find(|t| t.0 == format!("model/{}", e.name)).unwrap();
        let err = norm_rel(&grads[e.range()], want);
        assert!(err <= TOL, "{name} on {kind:?}: gradient of `{}` differs by {err:e} (norm-relative)", e.name);
        worst = worst.max(err);
    }
    worst
}

#[test]
fn llama_matches_transformers_on_the_cpu() {
    for name in ["gqa", "llama3"] {
        let worst = check_fixture(name, DeviceKind::Cpu);
        eprintln!("{name} (cpu): worst norm-relative error {worst:e}");
    }
}

#[test]
fn llama_matches_transformers_on_emu() {
    for name in ["gqa", "llama3"] {
        let worst = check_fixture(name, DeviceKind::Emu);
        eprintln!("{name} (emu): worst norm-relative error {worst:e}");
    }
}
