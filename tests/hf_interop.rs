//! Hugging Face interop against a fixture written by transformers itself
//! (`tests/fixtures/gen_hf_gpt2_fixture.py`: a randomly initialised 2-layer GPT-2 with GPT-2's
//! vocabulary, saved with `save_pretrained`, and its logits on a fixed input).
//!
//! - meshtrain imports it and its forward pass gives transformers' logits within 1e-4;
//! - importing and writing it again (`export --format safetensors`'s writer) gives the same
//!   names, shapes, dtypes and bytes: HF -> meshtrain -> HF is byte-identical.

use std::path::Path;

use meshtrain::checkpoint::{read_hf, write_hf};
use meshtrain::model::{Gpt, ParamLayout};

const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/hf_gpt2_tiny");

#[test]
fn a_transformers_gpt2_gives_the_same_logits_in_meshtrain() {
    let (config, tensors) = read_hf(Path::new(FIXTURE)).unwrap();
    let layout = ParamLayout::new(&config);
    let mut params = vec![0f32; layout.total_len()];
    for e in layout.entries() {
        let t = tensors
            .iter()
            .find(|t| t.0 == format!("model/{}", e.name))
            .unwrap();
        params[e.range()].copy_from_slice(&t.2);
    }
    let want: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(format!("{FIXTURE}/logits.json")).unwrap())
            .unwrap();
    let tokens: Vec<u32> = want["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    let kept: Vec<usize> = want["vocab_kept"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as usize)
        .collect();
    let mut model = Gpt::<f32>::from_params(config, 1, tokens.len(), params).unwrap();
    model.forward(&tokens, &vec![0u32; tokens.len()]).unwrap();
    let vp = config.padded_vocab_size();
    let mut worst = 0f32;
    for (t, row) in want["logits"].as_array().unwrap().iter().enumerate() {
        for (&v, x) in kept.iter().zip(row.as_array().unwrap()) {
            let (got, x) = (model.logits()[t * vp + v], x.as_f64().unwrap() as f32);
            worst = worst.max((got - x).abs() / x.abs().max(1.0));
        }
    }
    assert!(worst <= 1e-4, "largest logit difference {worst:e}");
}

#[test]
fn hugging_face_to_meshtrain_to_hugging_face_is_byte_identical() {
    let (config, tensors) = read_hf(Path::new(FIXTURE)).unwrap();
    let dir = tempfile::tempdir().unwrap();
    write_hf(dir.path(), &config, &tensors).unwrap();
    let theirs = std::fs::read(format!("{FIXTURE}/model.safetensors")).unwrap();
    let ours = std::fs::read(dir.path().join("model.safetensors")).unwrap();
    // The header first (names, dtypes, shapes, offsets), for a readable failure; then every byte.
    let header = |b: &[u8]| {
        String::from_utf8_lossy(&b[8..8 + u64::from_le_bytes(b[..8].try_into().unwrap()) as usize])
            .into_owned()
    };
    assert_eq!(header(&ours), header(&theirs));
    assert!(ours == theirs, "same header, different tensor bytes");
    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("config.json")).unwrap()).unwrap();
    assert_eq!(
        (
            cfg["n_layer"].as_u64(),
            cfg["n_embd"].as_u64(),
            cfg["vocab_size"].as_u64()
        ),
        (Some(2), Some(16), Some(50257))
    );
}
