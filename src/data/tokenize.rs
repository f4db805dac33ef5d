//! `meshtrain tokenize`: UTF-8 text files to GPT-2 BPE token shards, and the decoder `generate` uses.
//!
//! The GPT-2 (r50k_base) vocabulary is compiled into the tiktoken-rs crate, so this works offline.
//! Each input file is one document; as in llm.c's data preparation, every document is preceded by the
//! end-of-text token [`EOT_TOKEN`]. The first `val_fraction` of the resulting token stream (rounded
//! up) becomes the validation split, the rest the training split; each split is cut into shards of
//! at most `shard_tokens` tokens named `<prefix>_val_000000.bin`, `<prefix>_train_000000.bin`, ...
//! Files are encoded in parallel over the available cores (one file per task); the whole token
//! stream is held in memory (2 bytes per token) before writing.

use std::path::{Path, PathBuf};

use tiktoken_rs::CoreBPE;

use crate::data::shard::write_shard;
use crate::error::{Error, Result};

/// GPT-2's `<|endoftext|>` token, which separates documents.
pub const EOT_TOKEN: u32 = 50256;
/// Size of the GPT-2 vocabulary (real, unpadded).
pub const GPT2_VOCAB_SIZE: usize = 50257;

/// The GPT-2 byte-pair encoder/decoder.
pub struct Gpt2Tokenizer {
    bpe: CoreBPE,
}

impl Gpt2Tokenizer {
    /// Builds the tokenizer from the vocabulary embedded in tiktoken-rs.
    pub fn new() -> Result<Gpt2Tokenizer> {
        let bpe = tiktoken_rs::r50k_base()
            .map_err(|e| Error::file("<tiktoken-rs embedded r50k_base>", None, e.to_string()))?;
        Ok(Gpt2Tokenizer { bpe })
    }

    /// Encodes `text` as ordinary text: `<|endoftext|>` written in the text is not special.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        self.bpe.encode_ordinary(text)
    }

    /// Decodes `tokens` to text; byte sequences that are not valid UTF-8 (a multi-byte character
    /// split across a cut) become U+FFFD. Errors on ids outside the vocabulary.
    pub fn decode(&self, tokens: &[u32]) -> Result<String> {
        let bytes = self.bpe.decode_bytes(tokens).map_err(|e| {
            Error::InvalidArgument(format!("token {} is not in the GPT-2 vocabulary", e.token))
        })?;
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }
}

/// What [`tokenize_files`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenizeReport {
    /// Input files read (one document each).
    pub documents: usize,
    /// Tokens in the training split.
    pub train_tokens: u64,
    /// Tokens in the validation split.
    pub val_tokens: u64,
    /// Training shards, in order.
    pub train_shards: Vec<PathBuf>,
    /// Validation shards, in order (empty when `val_fraction` is 0).
    pub val_shards: Vec<PathBuf>,
}

/// Tokenizes `inputs` and writes train/val shards named after `out_prefix` (see the module doc).
pub fn tokenize_files(
    inputs: &[PathBuf],
    out_prefix: &Path,
    val_fraction: f64,
    shard_tokens: usize,
) -> Result<TokenizeReport> {
    if inputs.is_empty() {
        return Err(Error::InvalidArgument("tokenize: no input files".into()));
    }
    if !(0.0..1.0).contains(&val_fraction) {
        return Err(Error::InvalidArgument(format!(
            "tokenize: val_fraction {val_fraction} is not in [0, 1)"
        )));
    }
    if shard_tokens == 0 || shard_tokens > i32::MAX as usize {
        return Err(Error::InvalidArgument(format!(
            "tokenize: shard_tokens {shard_tokens} out of range"
        )));
    }
    let tokenizer = Gpt2Tokenizer::new()?;
    let mut stream: Vec<u16> = Vec::new();
    for doc in encode_documents(&tokenizer, inputs)? {
        stream.push(EOT_TOKEN as u16);
        stream.extend(doc);
    }
    let val_len = (stream.len() as f64 * val_fraction).ceil() as usize;
    let (val, train) = stream.split_at(val_len.min(stream.len()));
    if train.is_empty() {
        return Err(Error::InvalidArgument(format!(
            "tokenize: {} tokens leave nothing for training at val_fraction {val_fraction}",
            stream.len()
        )));
    }
    if let Some(dir) = out_prefix.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .map_err(|e| Error::io(format!("create {}", dir.display()), e))?;
    }
    let val_shards = write_split(out_prefix, "val", val, shard_tokens)?;
    let train_shards = write_split(out_prefix, "train", train, shard_tokens)?;
    let report = TokenizeReport {
        documents: inputs.len(),
        train_tokens: train.len() as u64,
        val_tokens: val.len() as u64,
        train_shards,
        val_shards,
    };
    log::debug!(
        "tokenize: {} documents -> {} train tokens in {} shards, {} val tokens in {} shards",
        report.documents,
        report.train_tokens,
        report.train_shards.len(),
        report.val_tokens,
        report.val_shards.len()
    );
    Ok(report)
}

/// Encodes each file as one document, files spread over the available cores; results in input order.
fn encode_documents(tokenizer: &Gpt2Tokenizer, inputs: &[PathBuf]) -> Result<Vec<Vec<u16>>> {
    let workers = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(inputs.len());
    let encode = |path: &PathBuf| -> Result<Vec<u16>> {
        let bytes =
            std::fs::read(path).map_err(|e| Error::io(format!("read {}", path.display()), e))?;
        let text = std::str::from_utf8(&bytes)
            .map_err(|e| Error::file(path, Some(e.valid_up_to() as u64), "not valid UTF-8"))?;
        // GPT-2 ids are below 50257 < 2^16, so the narrowing is exact.
        Ok(tokenizer
            .encode(text)
            .into_iter()
            .map(|t| t as u16)
            .collect())
    };
    let mut docs: Vec<Option<Result<Vec<u16>>>> = (0..inputs.len()).map(|_| None).collect();
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..workers)
            .map(|w| {
                scope.spawn(move || {
                    (w..inputs.len())
                        .step_by(workers)
                        .map(|i| (i, encode(&inputs[i])))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        for handle in handles {
            for (i, doc) in handle.join().expect("a tokenizer worker panicked") {
                docs[i] = Some(doc);
            }
        }
    });
    docs.into_iter()
        .map(|d| d.expect("every input is assigned to one worker"))
        .collect()
}

fn write_split(
    prefix: &Path,
    split: &str,
    tokens: &[u16],
    shard_tokens: usize,
) -> Result<Vec<PathBuf>> {
    let mut paths = Vec::new();
    for (i, chunk) in tokens.chunks(shard_tokens).enumerate() {
        let mut name = prefix.as_os_str().to_owned();
        name.push(format!("_{split}_{i:06}.bin"));
        let path = PathBuf::from(name);
        write_shard(&path, chunk)?;
        paths.push(path);
    }
    Ok(paths)
}
