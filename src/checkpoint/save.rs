//! Writing a checkpoint: the collective [`save`].
//!
//! Protocol (every rank of `comm` calls `save` with its own slices):
//! 1. rank 0 creates `DIR/step_XXXXXXXX.tmp-<nonce>/` and broadcasts its name (or its error);
//! 2. every rank that owns slices writes `rank_RRRRR.h5` there (hashing while HDF5 writes),
//!    closes and fsyncs it; all reports (file size, shard records, or the error) are gathered on
//!    every rank, so a failure anywhere makes every rank return the same error naming the rank
//!    and file; rank 0 then removes the temporary directory;
//! 3. rank 0 checks that the shards tile every tensor, fsyncs the directory, writes and fsyncs the
//!    index `checkpoint.h5`, renames the directory to `step_XXXXXXXX` (a checkpoint of that step
//!    saved before, by a run resumed from an earlier step, is swapped out atomically with
//!    `renameat2(RENAME_EXCHANGE)` and then removed), fsyncs the root, replaces
//!    `latest` (temp file + fsync + rename + fsync), deletes checkpoints beyond `keep` (index first,
//!    so a half-deleted one never looks complete) and stale temporaries, and broadcasts the outcome.
//!
//! A slice holding a NaN or infinity fails the save the same way (nothing non-finite is written).
//!
//! Rank 0 holds the directory's lock ([`super::lock`]) during the save (a training run holds it
//! for the whole job), so a directory used by another job refuses the save, and the temporaries
//! it prunes are provably left by processes that are gone.
//!
//! A crash before the rename leaves only a `*.tmp-*` directory, which no reader accepts; a crash
//! after it leaves a complete checkpoint that `latest` may not name yet. Either way the previous
//! checkpoint stays loadable.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::checkpoint::agree::{broadcast_from, gather_all};
use crate::checkpoint::boxes::ShardSlice;
use crate::checkpoint::tiles;
use crate::checkpoint::h5::{self, file_err};
use crate::checkpoint::lock::{held_here, DirLock};
use crate::checkpoint::meta::{
    check_name, check_tiling, inside, volume, CkptMeta, FileRecord, ShardRecord, TensorRecord,
};
use crate::checkpoint::{
    parse_step_dir, rank_file_name, step_dir_name, FORMAT, FORMAT_VERSION, INDEX_FILE, LATEST_FILE,
};
use crate::comm::Communicator;
use crate::error::{Error, Result};

/// Points of the protocol where tests inject failures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stage {
    /// A rank closed and fsynced its shard file.
    ShardWritten,
    /// Rank 0 is about to write the index.
    BeforeIndex,
    /// Rank 0 is about to update `latest` (the directory has its final name).
    BeforeLatest,
}

/// Test-only failure injection: a per-thread hook (in-process ranks are threads).
#[cfg(test)]
pub(crate) mod fault {
    use std::cell::RefCell;

    use super::Stage;
    use crate::error::Result;

    type Hook = Box<dyn Fn(Stage) -> Result<()>>;
    thread_local! {
        static HOOK: RefCell<Option<Hook>> = RefCell::new(None);
    }

    /// Installs `hook` for saves on this thread.
    pub fn set(hook: impl Fn(Stage) -> Result<()> + 'static) {
        HOOK.with(|h| *h.borrow_mut() = Some(Box::new(hook)));
    }

    pub(super) fn check(stage: Stage) -> Result<()> {
        HOOK.with(|h| h.borrow().as_ref().map_or(Ok(()), |f| f(stage)))
    }
}

#[cfg(not(test))]
mod fault {
    use super::Stage;
    use crate::error::Result;

    #[inline]
    pub(super) fn check(_stage: Stage) -> Result<()> {
        Ok(())
    }
}

/// What one rank reports after writing its shard file.
#[derive(Debug, Serialize, Deserialize)]
struct RankReport {
    /// (file, message) of the failure, if any.
    error: Option<(String, String)>,
    file: Option<FileRecord>,
    /// (tensor name, global shape, shard).
    shards: Vec<(String, Vec<usize>, ShardRecord)>,
}

/// A decision of rank 0: `Ok(path)` or `Err((file, message))`.
type Outcome = std::result::Result<String, (String, String)>;

fn outcome_of(r: Result<String>) -> Outcome {
    r.map_err(|e| match e {
        Error::File { file, msg, .. } => (file.display().to_string(), msg),
        other => (String::new(), other.to_string()),
    })
}

fn outcome_error(file: String, msg: String) -> Error {
    Error::File {
        file: PathBuf::from(file),
        offset: None,
        msg,
    }
}

/// Saves checkpoint `step` under `dir`: every rank of `comm` passes the slices it owns (the caller
/// decides ownership; each hyperslab on exactly one rank). Keeps the newest `keep` checkpoints
/// (0 keeps all). Returns the checkpoint directory; every rank returns the same `Ok` or `Err`.
pub fn save(
    comm: &Communicator,
    dir: &Path,
    step: u64,
    slices: &[ShardSlice],
    meta: &CkptMeta,
    keep: usize,
) -> Result<PathBuf> {
    let root = comm.rank() == 0;
    // Rank 0 holds the directory's lock for the whole save (re-entrant: a training run already
    // holds it); a directory held by another job refuses the save on every rank.
    let mut _lock = None;
    let prep = if root {
        Some(outcome_of(DirLock::acquire(dir).and_then(|l| {
            _lock = Some(l);
            prepare(dir, step)
        })))
    } else {
        None
    };
    let tmp = broadcast_from(comm, 0, prep.as_ref())?.map_err(|(f, m)| outcome_error(f, m))?;
    let tmp = dir.join(tmp);

    let mut report = write_rank_file(comm.rank(), &tmp, slices);
    if root && meta.step != step && report.error.is_none() {
        let msg = format!("meta.step {} differs from the saved step {step}", meta.step);
        report.error = Some((tmp.display().to_string(), msg));
    }
    let reports = gather_all(comm, &report)?;
    let failed: Vec<usize> = (0..reports.len())
        .filter(|&r| reports[r].error.is_some())
        .collect();
    if let Some(&first) = failed.first() {
        if root {
            remove_dir_logged(&tmp);
        }
        let (file, msg) = reports[first]
            .error
            .clone()
            .expect("a failed rank reports its error");
        let others = if failed.len() > 1 {
            format!(" (and {} more ranks)", failed.len() - 1)
        } else {
            String::new()
        };
        return Err(outcome_error(
            file,
            format!("checkpoint step {step}: rank {first} failed{others}: {msg}"),
        ));
    }

    let done = if root {
        let r = commit(dir, &tmp, step, meta, &reports, keep);
        if r.is_err() && tmp.exists() {
            remove_dir_logged(&tmp);
        }
        Some(outcome_of(r))
    } else {
        None
    };
    let path = broadcast_from(comm, 0, done.as_ref())?.map_err(|(f, m)| outcome_error(f, m))?;
    Ok(PathBuf::from(path))
}

fn io_err(path: &Path, what: &str, e: std::io::Error) -> Error {
    file_err(path, what, e)
}

/// Rank 0: creates the root and a fresh temporary directory; returns the latter's name.
fn prepare(dir: &Path, step: u64) -> Result<String> {
    std::fs::create_dir_all(dir).map_err(|e| io_err(dir, "create checkpoint root", e))?;
    let name = step_dir_name(step);
    let mut nonce = [0u8; 8];
    getrandom::getrandom(&mut nonce).map_err(|e| Error::file(dir, None, format!("nonce: {e}")))?;
    let hex: String = nonce.iter().map(|b| format!("{b:02x}")).collect();
    let tmp = format!("{name}.tmp-{hex}");
    std::fs::create_dir(dir.join(&tmp)).map_err(|e| io_err(&dir.join(&tmp), "create directory", e))?;
    Ok(tmp)
}

fn check_slice(s: &ShardSlice) -> Result<()> {
    check_name(&s.name)?;
    let bad = |m: String| Err(Error::InvalidArgument(format!("slice `{}`: {m}", s.name)));
    if s.global_shape.is_empty() || !inside(&s.offset, &s.shape, &s.global_shape) {
        return bad(format!(
            "offset {:?} + shape {:?} not inside global shape {:?}",
            s.offset, s.shape, s.global_shape
        ));
    }
    match volume(&s.shape) {
        Some(0) => bad("empty hyperslab".into()),
        Some(n) if n == s.data.len() => Ok(()),
        _ => bad(format!("{} elements for shape {:?}", s.data.len(), s.shape)),
    }
}

/// Writes this rank's slices (if any) into `tmp/rank_RRRRR.h5`; never fails, reports instead.
fn write_rank_file(rank: usize, tmp: &Path, slices: &[ShardSlice]) -> RankReport {
    let path = tmp.join(rank_file_name(rank));
    match write_shards(rank, &path, slices) {
        Ok(report) => report,
        Err(e) => {
            let file = match &e {
                Error::File { file, .. } => file.display().to_string(),
                _ => path.display().to_string(),
            };
            let msg = match e {
                Error::File { msg, .. } => msg,
                other => other.to_string(),
            };
            RankReport {
                error: Some((file, msg)),
                file: None,
                shards: Vec::new(),
            }
        }
    }
}

fn write_shards(rank: usize, path: &Path, slices: &[ShardSlice]) -> Result<RankReport> {
    if slices.is_empty() {
        return Ok(RankReport {
            error: None,
            file: None,
            shards: Vec::new(),
        });
    }
    for s in slices {
        check_slice(s)?;
        // A NaN or infinity never reaches a checkpoint (it would rotate good ones out).
        if let Some(i) = s.data.iter().position(|x| !x.is_finite()) {
            let msg = format!("refusing to save: `{}` holds the non-finite value {} (element {i} of this rank's slice)", s.name, s.data[i]);
            return Err(Error::file(path, None, msg));
        }
    }
    let fname = rank_file_name(rank);
    let file = h5::create(path)?;
    h5::write_str_attr(&file, "format", FORMAT, path)?;
    let mut shards = Vec::with_capacity(slices.len());
    for s in slices {
        let offs: Vec<String> = s.offset.iter().map(|o| o.to_string()).collect();
        let dataset = format!("{}@{}", s.name, offs.join(","));
        // Hash on a second core while HDF5 writes the same bytes.
        let ((sha, tile_sha256), ds) = std::thread::scope(|sc| {
            let hasher = sc.spawn(|| (h5::sha256_hex(s.data), tiles::tile_digests(&s.shape, s.data)));
            let ds = h5::write_dataset(&file, path, &dataset, &s.shape, s.data);
            (hasher.join().expect("hash thread"), ds)
        });
        let ds = ds?;
        h5::write_u64s_attr(&ds, "global_offset", &s.offset, path)?;
        h5::write_u64s_attr(&ds, "global_shape", &s.global_shape, path)?;
        h5::write_str_attr(&ds, "sha256", &sha, path)?;
        let rec = ShardRecord {
            file: fname.clone(),
            dataset,
            offset: s.offset.clone(),
            shape: s.shape.clone(),
            sha256: sha,
            tile_sha256,
        };
        shards.push((s.name.clone(), s.global_shape.clone(), rec));
    }
    let bytes = h5::close_and_sync(file, path)?;
    fault::check(Stage::ShardWritten)?;
    Ok(RankReport {
        error: None,
        file: Some(FileRecord {
            name: fname,
            rank,
            bytes,
        }),
        shards,
    })
}

/// The tensor table from all ranks' shards, sorted by name; checks global shapes agree and shards tile.
fn tensor_table(reports: &[RankReport], index: &Path) -> Result<Vec<TensorRecord>> {
    let mut tensors: BTreeMap<&str, TensorRecord> = BTreeMap::new();
    for (name, global, shard) in reports.iter().flat_map(|r| &r.shards) {
        let t = tensors.entry(name).or_insert_with(|| TensorRecord {
            name: name.clone(),
            global_shape: global.clone(),
            dtype: "f32".into(),
            shards: Vec::new(),
        });
        if &t.global_shape != global {
            return Err(Error::file(
                index,
                None,
                format!(
                    "tensor `{name}`: global shape {global:?} in {} but {:?} elsewhere",
                    shard.file, t.global_shape
                ),
            ));
        }
        t.shards.push(shard.clone());
    }
    let table: Vec<TensorRecord> = tensors.into_values().collect();
    for t in &table {
        check_tiling(t, index)?;
    }
    Ok(table)
}

/// fsyncs a directory (its entries).
pub(crate) fn sync_dir(dir: &Path) -> Result<()> {
    std::fs::File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(|e| io_err(dir, "fsync directory", e))
}

fn write_index(path: &Path, meta: &CkptMeta, tensors: &[TensorRecord], files: &[FileRecord]) -> Result<()> {
    let file = h5::create(path)?;
    h5::write_str_attr(&file, "format", FORMAT, path)?;
    file.new_attr::<u32>()
        .create("format_version")
        .and_then(|a| a.write_scalar(&FORMAT_VERSION))
        .map_err(|e| file_err(path, "attribute `format_version`", e))?;
    let (meta, tensor_table, file_table) = (to_json(meta), to_json(&tensors), to_json(&files));
    h5::write_str_attr(&file, "meta", &meta, path)?;
    h5::write_str_attr(&file, "tensors", &tensor_table, path)?;
    h5::write_str_attr(&file, "files", &file_table, path)?;
    h5::write_str_attr(&file, "index_sha256", &h5::index_digest(&meta, &tensor_table, &file_table), path)?;
    for t in tensors {
        let (group, leaf) = h5::split_path(&t.name);
        let g = h5::ensure_group(&file, group, path)?;
        let mut b = g.new_dataset::<f32>().shape(t.global_shape.as_slice());
        for s in &t.shards {
            let vds_sel = h5::box_selection(&s.offset, &s.shape);
            b = b.virtual_map(
                &s.file,
                &s.dataset,
                s.shape.as_slice(),
                ..,
                t.global_shape.as_slice(),
                vds_sel,
            );
        }
        b.create(leaf)
            .map_err(|e| file_err(path, format!("virtual dataset `{}`", t.name), e))?;
    }
    h5::close_and_sync(file, path).map(|_| ())
}

/// JSON text of a record stored as an index attribute.
pub(crate) fn to_json<T: Serialize>(v: &T) -> String {
    serde_json::to_string(v).expect("checkpoint records serialize (plain structs of strings and numbers)")
}

/// Rank 0, after every rank succeeded: index, rename, `latest`, pruning.
fn commit(
    dir: &Path,
    tmp: &Path,
    step: u64,
    meta: &CkptMeta,
    reports: &[RankReport],
    keep: usize,
) -> Result<String> {
    let index = tmp.join(INDEX_FILE);
    let tensors = tensor_table(reports, &index)?;
    let files: Vec<FileRecord> = reports.iter().filter_map(|r| r.file.clone()).collect();
    sync_dir(tmp)?;
    fault::check(Stage::BeforeIndex)?;
    write_index(&index, meta, &tensors, &files)?;
    sync_dir(tmp)?;
    let name = step_dir_name(step);
    let fin = dir.join(&name);
    if fin.exists() {
        // A rerun (resumed from an earlier step) reached a step saved before: the new checkpoint
        // replaces it in one atomic swap, then the old one (now under the temporary name) goes.
        exchange_dirs(tmp, &fin)?;
        log::info!("checkpoint {} replaces the one saved there before", fin.display());
        remove_dir_logged(tmp);
    } else {
        std::fs::rename(tmp, &fin).map_err(|e| io_err(&fin, "rename the finished checkpoint into place", e))?;
    }
    sync_dir(dir)?;
    fault::check(Stage::BeforeLatest)?;
    write_latest(dir, &name)?;
    prune(dir, &name, keep);
    log::debug!(
        "checkpoint {} saved ({} tensors, {} files)",
        fin.display(),
        tensors.len(),
        files.len()
    );
    Ok(fin.display().to_string())
}

/// Swaps the directories `a` and `b` atomically (Linux `renameat2(RENAME_EXCHANGE)`).
fn exchange_dirs(a: &Path, b: &Path) -> Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &Path| std::ffi::CString::new(p.as_os_str().as_bytes()).map_err(|e| Error::file(p, None, e.to_string()));
    let (ca, cb) = (c(a)?, c(b)?);
    // SAFETY: both paths are valid NUL-terminated strings that outlive the call; AT_FDCWD makes
    // relative paths relative to the working directory, as std's rename does.
    let rc = unsafe { libc::renameat2(libc::AT_FDCWD, ca.as_ptr(), libc::AT_FDCWD, cb.as_ptr(), libc::RENAME_EXCHANGE) };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        return Err(io_err(b, "replace the existing checkpoint of this step (atomic directory swap)", e));
    }
    Ok(())
}

/// Points `DIR/latest` at `name` atomically.
fn write_latest(dir: &Path, name: &str) -> Result<()> {
    let tmp = dir.join(format!("{LATEST_FILE}.tmp-{name}"));
    let latest = dir.join(LATEST_FILE);
    let write = || -> std::io::Result<()> {
        use std::io::Write;
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(format!("{name}\n").as_bytes())?;
        f.sync_all()
    };
    write().map_err(|e| io_err(&tmp, "write", e))?;
    std::fs::rename(&tmp, &latest).map_err(|e| io_err(&latest, "replace", e))?;
    sync_dir(dir)
}

fn remove_dir_logged(path: &Path) {
    if let Err(e) = std::fs::remove_dir_all(path) {
        log::warn!("could not remove {}: {e}", path.display());
    }
}

/// Deletes complete checkpoints beyond the newest `keep` (never `current`) and stale temporaries.
/// Temporaries are touched only while this process holds the directory's lock: every writer holds
/// it while it writes, so they are left by processes that are gone. Failures are logged: the new
/// checkpoint is already safe.
fn prune(dir: &Path, current: &str, keep: usize) {
    let dead_leftovers = held_here(dir);
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) => return log::warn!("prune {}: {e}", dir.display()),
    };
    let mut complete = Vec::new();
    for name in entries
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().into_string().ok())
    {
        let path = dir.join(&name);
        let temporary = name.contains(".tmp-");
        if temporary && !dead_leftovers {
            continue;
        }
        if name.starts_with("step_") && temporary {
            log::warn!("removing {}: left by a save that did not finish", path.display());
            remove_dir_logged(&path);
        } else if name.starts_with(&format!("{LATEST_FILE}.tmp-")) {
            let _ = std::fs::remove_file(&path);
        } else if let Some(step) = parse_step_dir(&name) {
            if name != current && path.join(INDEX_FILE).is_file() {
                complete.push((step, path));
            }
        }
    }
    if keep == 0 {
        return;
    }
    complete.sort_by_key(|c| std::cmp::Reverse(c.0));
    for (_, path) in complete.into_iter().skip(keep - 1) {
        // Index first: a deletion cut short leaves a directory that is not a checkpoint.
        if let Err(e) = std::fs::remove_file(path.join(INDEX_FILE))
            .map_err(|e| io_err(&path, "remove index", e))
            .and_then(|_| sync_dir(dir))
        {
            log::warn!("prune: {e}");
            continue;
        }
        remove_dir_logged(&path);
    }
}
