//! The few HDF5 operations the checkpoint needs, each turning library errors into
//! [`Error::File`] that names the file (and dataset); plus the shard hash.
//!
//! HDF5's own error-stack printing is silenced by the `hdf5-metno` crate on first use; the stack's
//! message ends up in our error instead. Files are created with the 1.10 format (checksummed
//! metadata) and opened without the data-sieve buffer, so that a hyperslab read fetches only the
//! selected bytes.

use std::path::Path;

use hdf5::types::VarLenUnicode;
use hdf5::{Dataset, File, Group, Hyperslab, Location, Selection, SliceOrIndex};
use hdf5_metno as hdf5;
use sha2::{Digest, Sha256};

use crate::error::{Error, Result};

#[cfg(target_endian = "big")]
compile_error!("checkpoint hashes are defined over little-endian f32 bytes");

/// An [`Error::File`] for `file` saying what failed and why.
pub fn file_err(file: &Path, what: impl std::fmt::Display, e: impl std::fmt::Display) -> Error {
    Error::file(file, None, format!("{what}: {e}"))
}

/// Creates `path` (must not exist) for writing.
pub fn create(path: &Path) -> Result<File> {
    File::with_options()
        .with_fapl(|p| p.libver_v110())
        .create_excl(path)
        .map_err(|e| file_err(path, "create HDF5 file", e))
}

/// Opens `path` read-only; a missing, truncated or garbled file is an [`Error::File`].
pub fn open(path: &Path) -> Result<File> {
    if !path.is_file() {
        return Err(Error::file(path, None, "file is missing"));
    }
    File::with_options()
        .with_fapl(|p| p.sieve_buf_size(0))
        .open(path)
        .map_err(|e| file_err(path, "open HDF5 file", e))
}

/// Closes `file` (flushing HDF5's buffers), then fsyncs it.
pub fn close_and_sync(file: File, path: &Path) -> Result<u64> {
    file.close().map_err(|e| file_err(path, "close HDF5 file", e))?;
    let f = std::fs::File::open(path).map_err(|e| file_err(path, "reopen to fsync", e))?;
    f.sync_all().map_err(|e| file_err(path, "fsync", e))?;
    let len = f.metadata().map_err(|e| file_err(path, "stat", e))?.len();
    Ok(len)
}

/// Opens group `path` of `file`, creating it and its parents as needed.
pub fn ensure_group(file: &File, path: &str, fname: &Path) -> Result<Group> {
    let mut g: Group = file.group("/").map_err(|e| file_err(fname, "root group", e))?;
    for part in path.split('/').filter(|p| !p.is_empty()) {
        g = if g.link_exists(part) {
            g.group(part)
        } else {
            g.create_group(part)
        }
        .map_err(|e| file_err(fname, format!("group `{path}`"), e))?;
    }
    Ok(g)
}

/// Splits `a/b/c` into (`a/b`, `c`).
pub fn split_path(path: &str) -> (&str, &str) {
    path.rsplit_once('/').unwrap_or(("", path))
}

/// Writes a UTF-8 string attribute.
pub fn write_str_attr(loc: &Location, name: &str, value: &str, file: &Path) -> Result<()> {
    let err = |e: hdf5::Error| file_err(file, format!("attribute `{name}`"), e);
    let v: VarLenUnicode = value
        .parse()
        .map_err(|e| file_err(file, format!("attribute `{name}`"), e))?;
    loc.new_attr::<VarLenUnicode>()
        .create(name)
        .map_err(err)?
        .write_scalar(&v)
        .map_err(err)
}

/// Reads a UTF-8 string attribute.
pub fn read_str_attr(loc: &Location, name: &str, file: &Path) -> Result<String> {
    let err = |e: hdf5::Error| file_err(file, format!("attribute `{name}`"), e);
    Ok(loc
        .attr(name)
        .map_err(err)?
        .read_scalar::<VarLenUnicode>()
        .map_err(err)?
        .as_str()
        .to_string())
}

/// Writes a 1-D u64 attribute.
pub fn write_u64s_attr(loc: &Location, name: &str, values: &[usize], file: &Path) -> Result<()> {
    let v: Vec<u64> = values.iter().map(|&x| x as u64).collect();
    loc.new_attr_builder()
        .with_data(&v)
        .create(name)
        .map(|_| ())
        .map_err(|e| file_err(file, format!("attribute `{name}`"), e))
}

/// Writes `data` (row-major, `shape`) as a new contiguous f32 dataset `path` of `file`.
pub fn write_dataset(
    file: &File,
    fname: &Path,
    path: &str,
    shape: &[usize],
    data: &[f32],
) -> Result<Dataset> {
    let (group, leaf) = split_path(path);
    let g = ensure_group(file, group, fname)?;
    let view = ndarray::ArrayView::from_shape(ndarray::IxDyn(shape), data)
        .map_err(|e| Error::InvalidArgument(format!("dataset `{path}`: {e}")))?;
    g.new_dataset_builder()
        .with_data(&view)
        .create(leaf)
        .map_err(|e| file_err(fname, format!("write dataset `{path}`"), e))
}

/// The HDF5 selection of box (`offset`, `shape`).
pub fn box_selection(offset: &[usize], shape: &[usize]) -> Selection {
    let dims: Vec<SliceOrIndex> = offset
        .iter()
        .zip(shape)
        .map(|(&o, &s)| SliceOrIndex::from(o..o + s))
        .collect();
    Selection::new(Hyperslab::from(dims))
}

/// Opens dataset `path` and checks that it is f32 with shape `shape`.
pub fn open_dataset(file: &File, fname: &Path, path: &str, shape: &[usize]) -> Result<Dataset> {
    let err = |what: String| Error::file(fname, None, format!("dataset `{path}`: {what}"));
    let ds = file.dataset(path).map_err(|e| err(e.to_string()))?;
    let dtype = ds.dtype().map_err(|e| err(e.to_string()))?;
    if !dtype.is::<f32>() {
        return Err(err(format!(
            "dtype is {:?}, expected f32",
            dtype.to_descriptor().ok()
        )));
    }
    let found = ds.shape();
    if found != shape {
        return Err(err(format!("shape {found:?}, expected {shape:?}")));
    }
    Ok(ds)
}

/// Reads the whole of `ds` into `out` (exactly its size).
pub fn read_all(ds: &Dataset, fname: &Path, path: &str, out: &mut [f32]) -> Result<()> {
    let n = ds
        .as_reader()
        .read_into_raw(out)
        .map_err(|e| file_err(fname, format!("read dataset `{path}`"), e))?;
    if n != out.len() {
        return Err(Error::file(
            fname,
            None,
            format!("dataset `{path}`: read {n} of {} elements", out.len()),
        ));
    }
    Ok(())
}

/// Reads box (`offset`, `shape`) of `ds` (local coordinates), row-major.
pub fn read_box(ds: &Dataset, fname: &Path, path: &str, offset: &[usize], shape: &[usize]) -> Result<Vec<f32>> {
    let arr = ds
        .as_reader()
        .read_slice::<f32, _, ndarray::IxDyn>(box_selection(offset, shape))
        .map_err(|e| file_err(fname, format!("read dataset `{path}` at {offset:?}+{shape:?}"), e))?;
    Ok(arr.into_raw_vec_and_offset().0)
}

/// SHA-256 (lowercase hex) of `data`'s little-endian bytes.
pub fn sha256_hex(data: &[f32]) -> String {
    sha256_hex_bytes(bytemuck::cast_slice::<f32, u8>(data))
}

/// Hex SHA-256 of `bytes`.
pub fn sha256_hex_bytes(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// The index's `index_sha256`: a hash of its three JSON attributes as stored, so that a flipped
/// bit in the metadata (a shard's offset, the data position) is an error, not a silent change.
pub fn index_digest(meta: &str, tensors: &str, files: &str) -> String {
    sha256_hex_bytes([meta, tensors, files].join("\n").as_bytes())
}
