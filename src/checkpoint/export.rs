//! Export of a checkpoint to one self-contained HDF5 file (plain datasets at global shape, the
//! metadata as root attributes), and the reader `init_from` uses.
//!
//! The export is written to `<out>.tmp` and renamed, so a finished `<out>` is always whole.

use std::path::{Path, PathBuf};

use crate::checkpoint::h5;
use crate::checkpoint::index::open;
use crate::checkpoint::meta::{volume, CkptMeta};
use crate::checkpoint::save::{sync_dir, to_json};
use crate::error::{Error, Result};

/// Value of the `format` attribute of an exported file.
pub const EXPORT_FORMAT: &str = "meshtrain-export";

/// Writes the checkpoint at `ckpt` (directory or root with `latest`) to the single file `out`:
/// the model's weights, and with `optimizer` the optimizer state too; returns the number of
/// tensors written.
pub fn export(ckpt: &Path, out: &Path, optimizer: bool) -> Result<usize> {
    let index = open(ckpt)?;
    let tensors: Vec<_> = index.tensors().iter().filter(|t| optimizer || t.name.starts_with("model/")).collect();
    let tmp = PathBuf::from(format!("{}.tmp", out.display()));
    let _ = std::fs::remove_file(&tmp);
    let file = h5::create(&tmp)?;
    let write = || -> Result<()> {
        h5::write_str_attr(&file, "format", EXPORT_FORMAT, &tmp)?;
        h5::write_str_attr(&file, "meta", &to_json(index.meta()), &tmp)?;
        for t in &tensors {
            let zeros = vec![0; t.global_shape.len()];
            let mut buf = vec![0f32; t.len()]; // tiling-checked: the shard files hold these bytes
            index.load_slice(&t.name, &zeros, &t.global_shape, &mut buf)?;
            h5::write_dataset(&file, &tmp, &t.name, &t.global_shape, &buf)?;
        }
        Ok(())
    };
    let r = write().and_then(|()| h5::close_and_sync(file, &tmp).map(|_| ()));
    if let Err(e) = r {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::rename(&tmp, out).map_err(|e| h5::file_err(out, "rename export into place", e))?;
    let parent = out
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    sync_dir(parent)?;
    Ok(tensors.len())
}

/// A tensor of an exported file: name, global shape, row-major values.
pub type ExportedTensor = (String, Vec<usize>, Vec<f32>);

/// Reads an exported file: its metadata and every tensor (name, shape, row-major values), sorted by
/// name.
pub fn read_exported(path: &Path) -> Result<(CkptMeta, Vec<ExportedTensor>)> {
    let file = h5::open(path)?;
    let format = h5::read_str_attr(&file, "format", path)?;
    if format != EXPORT_FORMAT {
        return Err(Error::file(
            path,
            None,
            format!("format `{format}` is not `{EXPORT_FORMAT}`"),
        ));
    }
    let meta_text = h5::read_str_attr(&file, "meta", path)?;
    let meta: CkptMeta = serde_json::from_str(&meta_text)
        .map_err(|e| Error::file(path, None, format!("attribute `meta`: {e}")))?;
    let file_bytes = std::fs::metadata(path)
        .map_err(|e| h5::file_err(path, "stat", e))?
        .len();
    let mut out = Vec::new();
    let mut groups = vec![file.group("/").map_err(|e| h5::file_err(path, "root group", e))?];
    while let Some(g) = groups.pop() {
        groups.extend(
            g.groups()
                .map_err(|e| h5::file_err(path, format!("group {}", g.name()), e))?,
        );
        for ds in g
            .datasets()
            .map_err(|e| h5::file_err(path, format!("group {}", g.name()), e))?
        {
            let name = ds.name().trim_start_matches('/').to_string();
            let shape = ds.shape();
            // Check the size against the file before allocating it.
            let n = volume(&shape)
                .filter(|&n| (n as u64).saturating_mul(4) <= file_bytes)
                .ok_or_else(|| {
                    Error::file(
                        path,
                        None,
                        format!("dataset `{name}`: shape {shape:?} does not fit in the file"),
                    )
                })?;
            let ds = h5::open_dataset(&file, path, &name, &shape)?;
            let mut buf = vec![0f32; n];
            h5::read_all(&ds, path, &name, &mut buf)?;
            out.push((name, shape, buf));
        }
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok((meta, out))
}
