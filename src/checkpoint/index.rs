//! Reading a checkpoint: [`open`] finds and validates the index, [`CheckpointIndex::load_slice`]
//! reads any hyperslab of any tensor from the shard files that hold it.
//!
//! Validation happens before any tensor is used: format and version, the tensor table (shards tile
//! each tensor), every rank file present with its recorded size (a truncated file is caught without
//! opening it); [`CheckpointIndex::expect_tensors`] and [`CheckpointIndex::check_model`] compare
//! against what the caller needs. The index's JSON attributes are checked against its
//! `index_sha256`; a shard read whole is checked against its SHA-256, a shard read in part
//! against the digests of the tiles the part touches (format 3; before it, the whole shard is read
//! and checked); [`CheckpointIndex::verify`] checks every whole shard. Sizes are checked against the index before any
//! buffer is allocated, and every error names the file and dataset.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::checkpoint::boxes::{contiguous_start, copy_box, intersect};
use crate::checkpoint::h5;
use crate::checkpoint::tiles;
use crate::checkpoint::meta::{
    check_tiling, inside, volume, CkptMeta, FileRecord, ShardRecord, TensorRecord,
};
use crate::checkpoint::{parse_step_dir, FORMAT, FORMAT_VERSION, INDEX_FILE, LATEST_FILE};
use crate::error::{Error, Result};
use crate::model::GptConfig;

/// A validated checkpoint: metadata and tensor table.
#[derive(Debug, Clone)]
pub struct CheckpointIndex {
    dir: PathBuf,
    meta: CkptMeta,
    tensors: Vec<TensorRecord>,
    files: Vec<FileRecord>,
    by_name: HashMap<String, usize>,
}

/// Resolves `path`: a checkpoint directory (holding the index), its index file, or a checkpoint
/// root (holding `latest`).
fn resolve(path: &Path) -> Result<PathBuf> {
    if path.file_name().is_some_and(|n| n == INDEX_FILE) && path.is_file() {
        return Ok(path.parent().map_or_else(|| PathBuf::from("."), Path::to_path_buf));
    }
    if path.join(INDEX_FILE).is_file() {
        return Ok(path.to_path_buf());
    }
    // `DIR/latest` itself names the checkpoint `DIR` points at.
    if path.file_name().is_some_and(|n| n == LATEST_FILE) && path.is_file() {
        return resolve(path.parent().unwrap_or(Path::new(".")));
    }
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    if name.contains(".tmp-") || parse_step_dir(name).is_some() {
        return Err(Error::file(
            path,
            None,
            format!("not a complete checkpoint: no {INDEX_FILE} (its writer did not finish)"),
        ));
    }
    let latest = path.join(LATEST_FILE);
    let text = std::fs::read_to_string(&latest).map_err(|e| {
        Error::file(
            path,
            None,
            format!("no checkpoint here: no {INDEX_FILE} and no readable {LATEST_FILE} ({e})"),
        )
    })?;
    let target = text.trim();
    if parse_step_dir(target).is_none() {
        return Err(Error::file(
            latest,
            None,
            format!("`{target}` is not a checkpoint directory name"),
        ));
    }
    let dir = path.join(target);
    if !dir.join(INDEX_FILE).is_file() {
        return Err(Error::file(
            &dir,
            None,
            format!("named by {LATEST_FILE} but has no {INDEX_FILE}"),
        ));
    }
    Ok(dir)
}

/// Opens the checkpoint at `path` (a `step_XXXXXXXX` directory, or a root whose `latest` names one)
/// and validates its index.
pub fn open(path: &Path) -> Result<CheckpointIndex> {
    let dir = resolve(path)?;
    let ipath = dir.join(INDEX_FILE);
    let file = h5::open(&ipath)?;
    let format = h5::read_str_attr(&file, "format", &ipath)?;
    if format != FORMAT {
        return Err(Error::file(
            &ipath,
            None,
            format!("format `{format}` is not `{FORMAT}`"),
        ));
    }
    let version = file
        .attr("format_version")
        .and_then(|a| a.read_scalar::<u32>())
        .map_err(|e| h5::file_err(&ipath, "attribute `format_version`", e))?;
    if !(1..=FORMAT_VERSION).contains(&version) {
        return Err(Error::file(
            &ipath,
            None,
            format!("format version {version}, this build reads 1 to {FORMAT_VERSION}"),
        ));
    }
    let texts: Vec<String> =
        ["meta", "tensors", "files"].iter().map(|a| h5::read_str_attr(&file, a, &ipath)).collect::<Result<_>>()?;
    if version >= 2 {
        let recorded = h5::read_str_attr(&file, "index_sha256", &ipath)?;
        let found = h5::index_digest(&texts[0], &texts[1], &texts[2]);
        if found != recorded {
            return Err(Error::file(
                &ipath,
                None,
                format!("index metadata corrupt: sha256 {found} differs from the recorded index_sha256 {recorded}"),
            ));
        }
    }
    let parse = |attr: &str| -> Result<serde_json::Value> {
        let text = &texts[["meta", "tensors", "files"].iter().position(|a| *a == attr).expect("a read attribute")];
        serde_json::from_str(text).map_err(|e| Error::file(&ipath, None, format!("attribute `{attr}`: {e}")))
    };
    let typed =
        |attr: &str, v: serde_json::Value| Error::file(&ipath, None, format!("attribute `{attr}`: {v}"));
    let meta: CkptMeta =
        serde_json::from_value(parse("meta")?).map_err(|e| typed("meta", e.to_string().into()))?;
    let tensors: Vec<TensorRecord> =
        serde_json::from_value(parse("tensors")?).map_err(|e| typed("tensors", e.to_string().into()))?;
    let files: Vec<FileRecord> =
        serde_json::from_value(parse("files")?).map_err(|e| typed("files", e.to_string().into()))?;
    drop(file);
    check_tile_digests(&tensors, version, &ipath)?;
    CheckpointIndex::new(dir, meta, tensors, files)
}

/// Reads hyperslab (`offset`, `shape`) of tensor `name` of the checkpoint at `ckpt` into `out`.
/// Opens and validates the index on every call: keep a [`CheckpointIndex`] for many reads.
pub fn load_slice(ckpt: &Path, name: &str, offset: &[usize], shape: &[usize], out: &mut [f32]) -> Result<()> {
    open(ckpt)?.load_slice(name, offset, shape, out)
}

impl CheckpointIndex {
    fn new(dir: PathBuf, meta: CkptMeta, tensors: Vec<TensorRecord>, files: Vec<FileRecord>) -> Result<Self> {
        let ipath = dir.join(INDEX_FILE);
        let mut by_name = HashMap::new();
        for (i, t) in tensors.iter().enumerate() {
            check_tiling(t, &ipath)?;
            if by_name.insert(t.name.clone(), i).is_some() {
                return Err(Error::file(
                    &ipath,
                    None,
                    format!("tensor `{}` appears twice", t.name),
                ));
            }
            for s in &t.shards {
                // A shard's bytes fit in its file: readers may then allocate its size.
                let fits = files
                    .iter()
                    .find(|f| f.name == s.file)
                    .is_some_and(|f| (s.len() as u64).saturating_mul(4) <= f.bytes);
                if !fits {
                    return Err(Error::file(
                        &ipath,
                        None,
                        format!(
                            "tensor `{}`: shard {}:{} is not in a listed file large enough",
                            t.name, s.file, s.dataset
                        ),
                    ));
                }
            }
        }
        for f in &files {
            if f.name.contains('/') || f.name.starts_with('.') {
                return Err(Error::file(
                    &ipath,
                    None,
                    format!("file name `{}` leaves the checkpoint directory", f.name),
                ));
            }
            let path = dir.join(&f.name);
            let len = std::fs::metadata(&path)
                .map_err(|e| h5::file_err(&path, "rank file", e))?
                .len();
            if len != f.bytes {
                return Err(Error::file(
                    &path,
                    None,
                    format!("size {len} bytes, the index recorded {} (truncated?)", f.bytes),
                ));
            }
        }
        Ok(CheckpointIndex {
            dir,
            meta,
            tensors,
            files,
            by_name,
        })
    }

    /// The checkpoint directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The run metadata.
    pub fn meta(&self) -> &CkptMeta {
        &self.meta
    }

    /// Every tensor, sorted by name.
    pub fn tensors(&self) -> &[TensorRecord] {
        &self.tensors
    }

    /// The rank files and their sizes.
    pub fn files(&self) -> &[FileRecord] {
        &self.files
    }

    /// Tensor `name`, or an error naming the index.
    pub fn tensor(&self, name: &str) -> Result<&TensorRecord> {
        self.by_name
            .get(name)
            .map(|&i| &self.tensors[i])
            .ok_or_else(|| Error::file(self.dir.join(INDEX_FILE), None, format!("no tensor `{name}`")))
    }

    /// Checks that the checkpoint holds exactly the tensors `expected` (name, global shape).
    pub fn expect_tensors(&self, expected: &[(String, Vec<usize>)]) -> Result<()> {
        let ipath = self.dir.join(INDEX_FILE);
        for (name, shape) in expected {
            let t = self
                .tensor(name)
                .map_err(|_| Error::file(&ipath, None, format!("missing tensor `{name}`")))?;
            if &t.global_shape != shape {
                return Err(Error::file(
                    &ipath,
                    None,
                    format!("tensor `{name}`: shape {:?}, expected {shape:?}", t.global_shape),
                ));
            }
        }
        if let Some(t) = self
            .tensors
            .iter()
            .find(|t| !expected.iter().any(|(n, _)| n == &t.name))
        {
            return Err(Error::file(
                &ipath,
                None,
                format!("unexpected tensor `{}`", t.name),
            ));
        }
        Ok(())
    }

    /// Checks that the checkpoint's model is `config`.
    pub fn check_model(&self, config: &GptConfig) -> Result<()> {
        if &self.meta.model == config {
            return Ok(());
        }
        Err(Error::file(self.dir.join(INDEX_FILE), None, self.meta.model.mismatch(config)))
    }

    /// Reads hyperslab (`offset`, `shape`) of tensor `name` into `out` (row-major, exactly its
    /// size), touching only the shards that intersect it. A shard wholly inside is read and
    /// hash-checked whole; of a shard partly inside, only the tiles the box touches are read and
    /// checked (the whole shard in checkpoints without tile digests). On error the contents of
    /// `out` are unspecified.
    pub fn load_slice(&self, name: &str, offset: &[usize], shape: &[usize], out: &mut [f32]) -> Result<()> {
        let t = self.tensor(name)?;
        if !inside(offset, shape, &t.global_shape) || volume(shape) != Some(out.len()) {
            return Err(Error::InvalidArgument(format!(
                "load `{name}`: offset {offset:?} + shape {shape:?} into {} elements; tensor shape {:?}",
                out.len(),
                t.global_shape
            )));
        }
        for s in &t.shards {
            let Some((at, part)) = intersect(offset, shape, &s.offset, &s.shape) else {
                continue;
            };
            let path = self.dir.join(&s.file);
            let file = h5::open(&path)?;
            let ds = h5::open_dataset(&file, &path, &s.dataset, &s.shape)?;
            if part == s.shape {
                // A whole shard: read it straight into `out` when it lies contiguously there.
                let direct = contiguous_start(&at, &part, offset, shape);
                let mut staged = Vec::new();
                let buf = match direct {
                    Some(start) => &mut out[start..start + s.len()],
                    None => {
                        staged = vec![0f32; s.len()]; // bounded by `out`, whose size the caller owns
                        &mut staged[..]
                    }
                };
                h5::read_all(&ds, &path, &s.dataset, buf)?;
                check_hash(s, buf, &path)?;
                if direct.is_none() {
                    copy_box((&staged, &s.offset, &s.shape), (out, offset, shape), &at, &part);
                }
            } else {
                // Part of a shard (a resharding load): read and check the tiles it touches.
                let local: Vec<usize> = at.iter().zip(&s.offset).map(|(a, o)| a - o).collect();
                if let Some(b) = tiles::read_box_checked(&ds, &path, s, &local, &part)? {
                    let global: Vec<usize> = b.offset.iter().zip(&s.offset).map(|(l, o)| l + o).collect();
                    copy_box((&b.data, &global, &b.shape), (out, offset, shape), &at, &part);
                } else {
                    // No tile digests (format < 3): the hash covers the whole shard, so read and
                    // check all of it (its size fits its file, checked on open), then copy the part.
                    let mut whole = vec![0f32; s.len()];
                    h5::read_all(&ds, &path, &s.dataset, &mut whole)?;
                    check_hash(s, &whole, &path)?;
                    copy_box((&whole, &s.offset, &s.shape), (out, offset, shape), &at, &part);
                }
            }
        }
        Ok(())
    }

    /// Recomputes every shard's hash; returns the bytes read.
    pub fn verify(&self) -> Result<u64> {
        let mut bytes = 0u64;
        for t in &self.tensors {
            for s in &t.shards {
                bytes += self.verify_shard(s)?;
            }
        }
        Ok(bytes)
    }

    /// Reads shard `s` in full and checks its hash; returns its size in bytes.
    pub fn verify_shard(&self, s: &ShardRecord) -> Result<u64> {
        let path = self.dir.join(&s.file);
        let file = h5::open(&path)?;
        let ds = h5::open_dataset(&file, &path, &s.dataset, &s.shape)?;
        let mut buf = vec![0f32; s.len()]; // the index's shape, already checked against the dataset
        h5::read_all(&ds, &path, &s.dataset, &mut buf)?;
        check_hash(s, &buf, &path)?;
        Ok(4 * buf.len() as u64)
    }
}

fn check_hash(s: &ShardRecord, data: &[f32], path: &Path) -> Result<()> {
    let found = h5::sha256_hex(data);
    if found == s.sha256 {
        return Ok(());
    }
    Err(Error::file(
        path,
        None,
        format!(
            "dataset `{}`: sha256 {found} differs from the recorded {}",
            s.dataset, s.sha256
        ),
    ))
}

/// Format 3 records a digest per tile of every shard that has tiles; earlier formats record none.
fn check_tile_digests(tensors: &[TensorRecord], version: u32, ipath: &Path) -> Result<()> {
    for t in tensors {
        for s in &t.shards {
            let expected = if version >= 3 { tiles::tile_count(&s.shape) } else { 0 };
            if s.tile_sha256.len() != expected {
                return Err(Error::file(
                    ipath,
                    None,
                    format!(
                        "tensor `{}`: shard {}:{} has {} tile digests, expected {expected}",
                        t.name,
                        s.file,
                        s.dataset,
                        s.tile_sha256.len()
                    ),
                ));
            }
        }
    }
    Ok(())
}
