//! Token shards in llm.c's on-disk format, memory-mapped for reading and written atomically.
//!
//! Layout: a header of 256 little-endian `i32` (1024 bytes) with `header[0] = SHARD_MAGIC`,
//! `header[1] = SHARD_VERSION`, `header[2] = token count`, the rest zero; then `count` little-endian
//! `u16` token ids. Invariants established by [`Shard::open`] and relied on by every reader: the file
//! is exactly `1024 + 2 * count` bytes and every token id is below the model's vocabulary size, so a
//! window read from an open shard never needs checking again.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::error::{Error, Result};

/// `header[0]` of every shard.
pub const SHARD_MAGIC: i32 = 20240520;
/// `header[1]` of every shard this code reads or writes.
pub const SHARD_VERSION: i32 = 1;
/// Bytes in the header (256 x i32).
pub const HEADER_BYTES: usize = 256 * 4;

/// A validated, memory-mapped token shard.
#[derive(Debug)]
pub struct Shard {
    path: PathBuf,
    /// The whole file, header included; `len() == HEADER_BYTES + 2 * count`.
    map: Mmap,
    count: usize,
}

impl Shard {
    /// Maps `path` and checks header, size and that every token is `< vocab_size`.
    pub fn open(path: &Path, vocab_size: usize) -> Result<Shard> {
        let file =
            File::open(path).map_err(|e| Error::io(format!("open shard {}", path.display()), e))?;
        // SAFETY: the map is read-only and private to this process; shards are written to a temporary
        // name and renamed into place (see `write_shard`), so a file is never modified while mapped
        // by a reader of this crate. An outside writer truncating the file would be a user error.
        let map = unsafe { Mmap::map(&file) }
            .map_err(|e| Error::io(format!("mmap shard {}", path.display()), e))?;
        let header = read_header(path, &map)?;
        if header[0] != SHARD_MAGIC {
            return Err(Error::file(
                path,
                Some(0),
                format!("bad magic {} (expected {SHARD_MAGIC})", header[0]),
            ));
        }
        if header[1] != SHARD_VERSION {
            return Err(Error::file(
                path,
                Some(4),
                format!(
                    "unsupported version {} (expected {SHARD_VERSION})",
                    header[1]
                ),
            ));
        }
        if header[2] < 0 {
            return Err(Error::file(
                path,
                Some(8),
                format!("negative token count {}", header[2]),
            ));
        }
        let count = header[2] as usize;
        let expected = HEADER_BYTES as u64 + 2 * count as u64;
        if map.len() as u64 != expected {
            return Err(Error::file(
                path,
                Some(map.len() as u64),
                format!(
                    "file is {} bytes but the header's {count} tokens need {expected}",
                    map.len()
                ),
            ));
        }
        let shard = Shard {
            path: path.to_path_buf(),
            map,
            count,
        };
        let tokens = shard.map[HEADER_BYTES..].chunks_exact(2);
        if let Some(i) = tokens
            .map(|b| u16::from_le_bytes([b[0], b[1]]) as usize)
            .position(|t| t >= vocab_size)
        {
            return Err(Error::file(
                path,
                Some((HEADER_BYTES + 2 * i) as u64),
                format!(
                    "token {} at index {i} is not below vocab_size {vocab_size}",
                    shard.token(i)
                ),
            ));
        }
        Ok(shard)
    }

    /// The file this shard was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Number of tokens in the shard.
    pub fn len(&self) -> usize {
        self.count
    }

    /// True when the shard holds no tokens.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Token `i`; panics unless `i < len()`, like slice indexing.
    pub fn token(&self, i: usize) -> u16 {
        let at = HEADER_BYTES + 2 * i;
        u16::from_le_bytes([self.map[at], self.map[at + 1]])
    }

    /// Copies tokens `start .. start + out.len()` into `out`; panics if that range is past `len()`.
    pub fn read(&self, start: usize, out: &mut [u32]) {
        let bytes = &self.map[HEADER_BYTES + 2 * start..HEADER_BYTES + 2 * (start + out.len())];
        for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
            *o = u16::from_le_bytes([b[0], b[1]]) as u32;
        }
    }
}

fn read_header(path: &Path, map: &[u8]) -> Result<[i32; 3]> {
    if map.len() < HEADER_BYTES {
        return Err(Error::file(
            path,
            Some(map.len() as u64),
            format!(
                "file is {} bytes, shorter than the {HEADER_BYTES}-byte header",
                map.len()
            ),
        ));
    }
    let word =
        |i: usize| i32::from_le_bytes([map[4 * i], map[4 * i + 1], map[4 * i + 2], map[4 * i + 3]]);
    Ok([word(0), word(1), word(2)])
}

/// Writes `tokens` as a shard at `path`: to `path.tmp` first, fsynced, then renamed over `path`, so a
/// reader never sees a half-written shard.
pub fn write_shard(path: &Path, tokens: &[u16]) -> Result<()> {
    let count = i32::try_from(tokens.len()).map_err(|_| {
        Error::InvalidArgument(format!(
            "{} tokens do not fit one shard (max {})",
            tokens.len(),
            i32::MAX
        ))
    })?;
    let mut bytes = Vec::with_capacity(HEADER_BYTES + 2 * tokens.len());
    let mut header = [0i32; 256];
    header[0] = SHARD_MAGIC;
    header[1] = SHARD_VERSION;
    header[2] = count;
    for h in header {
        bytes.extend_from_slice(&h.to_le_bytes());
    }
    for t in tokens {
        bytes.extend_from_slice(&t.to_le_bytes());
    }
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let io = |what: &str, e| Error::io(format!("{what} {}", tmp.display()), e);
    let mut file = File::create(&tmp).map_err(|e| io("create", e))?;
    file.write_all(&bytes).map_err(|e| io("write", e))?;
    file.sync_all().map_err(|e| io("fsync", e))?;
    drop(file);
    std::fs::rename(&tmp, path)
        .map_err(|e| Error::io(format!("rename {} to {}", tmp.display(), path.display()), e))
}
