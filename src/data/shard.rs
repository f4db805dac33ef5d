//! Token shards in llm.c's on-disk format, read with positioned reads and written atomically.
//!
//! Layout: a header of 256 little-endian `i32` (1024 bytes) with `header[0] = SHARD_MAGIC`,
//! `header[1] = SHARD_VERSION`, `header[2] = token count`, the rest zero; then `count` little-endian
//! `u16` token ids. Invariants established by [`Shard::open`] and relied on by every reader: the file
//! is exactly `1024 + 2 * count` bytes and every token id is below the model's vocabulary size, so a
//! window read from an open shard needs no checking again, except that the file may have changed
//! since: every read first checks that the open file still has its size and modification time and
//! that the path still names it (not a file renamed over it), and fails naming the file otherwise
//! (a shard rewritten in place under a running job used to be read silently).

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// `header[0]` of every shard.
pub const SHARD_MAGIC: i32 = 20240520;
/// `header[1]` of every shard this code reads or writes.
pub const SHARD_VERSION: i32 = 1;
/// Bytes in the header (256 x i32).
pub const HEADER_BYTES: usize = 256 * 4;
/// Bytes read at a time while validating a shard.
const SCAN_BYTES: usize = 1 << 20;

/// A validated token shard, read with positioned reads (`pread`).
///
/// Not memory-mapped: a mapped file truncated under a running job (a shard rewritten in place,
/// a filesystem quota) kills the process with SIGBUS at the first access past the new end, with
/// no word of which file. A positioned read of a truncated file returns short instead, which
/// becomes an error naming the file and offset. One read per window costs one system call per
/// sequence, nothing next to a training step.
#[derive(Debug)]
pub struct Shard {
    path: PathBuf,
    file: File,
    /// Tokens; the file was `HEADER_BYTES + 2 * count` bytes when opened.
    count: usize,
    /// What the file was when opened.
    ident: Ident,
}

/// What identifies a file's contents cheaply: size, modification time, device and inode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Ident {
    len: u64,
    mtime: (i64, i64),
    dev: u64,
    ino: u64,
}

impl Ident {
    fn of(m: &std::fs::Metadata) -> Ident {
        Ident { len: m.len(), mtime: (m.mtime(), m.mtime_nsec()), dev: m.dev(), ino: m.ino() }
    }
}

impl Shard {
    /// Opens `path` and checks header, size and that every token is `< vocab_size`.
    pub fn open(path: &Path, vocab_size: usize) -> Result<Shard> {
        let file =
            File::open(path).map_err(|e| Error::io(format!("open shard {}", path.display()), e))?;
        let ident = Ident::of(
            &file.metadata().map_err(|e| Error::io(format!("stat shard {}", path.display()), e))?,
        );
        let len = ident.len;
        let header = read_header(path, &file, len)?;
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
        if len != expected {
            return Err(Error::file(
                path,
                Some(len),
                format!("file is {len} bytes but the header's {count} tokens need {expected}"),
            ));
        }
        let shard = Shard { path: path.to_path_buf(), file, count, ident };
        let mut chunk = vec![0u32; SCAN_BYTES / 2];
        for start in (0..count).step_by(chunk.len()) {
            let n = chunk.len().min(count - start);
            shard.read(start, &mut chunk[..n])?;
            if let Some(i) = chunk[..n].iter().position(|&t| t as usize >= vocab_size) {
                let at = start + i;
                return Err(Error::file(
                    path,
                    Some((HEADER_BYTES + 2 * at) as u64),
                    format!("token {} at index {at} is not below vocab_size {vocab_size}", chunk[i]),
                ));
            }
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

    /// Token `i` (`i < len()`).
    pub fn token(&self, i: usize) -> Result<u16> {
        let mut one = [0u32];
        self.read(i, &mut one)?;
        Ok(one[0] as u16)
    }

    /// Copies tokens `start .. start + out.len()` (within `len()`) into `out`; an error naming the
    /// file if it no longer holds them (truncated since it was opened).
    pub fn read(&self, start: usize, out: &mut [u32]) -> Result<()> {
        if start + out.len() > self.count {
            return Err(Error::InvalidArgument(format!(
                "{}: tokens {start}..{} are past its {} tokens",
                self.path.display(),
                start + out.len(),
                self.count
            )));
        }
        self.check_unchanged()?;
        let at = (HEADER_BYTES + 2 * start) as u64;
        let mut bytes = vec![0u8; 2 * out.len()];
        self.file.read_exact_at(&mut bytes, at).map_err(|e| {
            let now = self.file.metadata().map_or("unknown".to_string(), |m| m.len().to_string());
            Error::file(
                &self.path,
                Some(at),
                format!(
                    "cannot read tokens {start}..{} ({e}): the file is now {now} bytes, {} when opened (truncated or replaced under the running job?)",
                    start + out.len(),
                    HEADER_BYTES + 2 * self.count
                ),
            )
        })?;
        for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
            *o = u16::from_le_bytes([b[0], b[1]]) as u32;
        }
        Ok(())
    }
}

impl Shard {
    /// An error naming the file if it changed since it was opened: written to (size or
    /// modification time), or replaced (the path names another file, or none).
    fn check_unchanged(&self) -> Result<()> {
        let changed = |what: String| {
            Err(Error::file(
                &self.path,
                None,
                format!("{what} since the job opened it: a shard must not change under a running job (its windows and their order were fixed at start); restore it or restart the job"),
            ))
        };
        let now = match self.file.metadata() {
            Ok(m) => Ident::of(&m),
            Err(e) => return Err(Error::io(format!("stat shard {}", self.path.display()), e)),
        };
        if now.len != self.ident.len {
            return changed(format!("changed from {} to {} bytes", self.ident.len, now.len));
        }
        if now.mtime != self.ident.mtime {
            return changed("was modified".into());
        }
        match std::fs::metadata(&self.path) {
            Ok(m) if (m.dev(), m.ino()) == (self.ident.dev, self.ident.ino) => Ok(()),
            Ok(_) => changed("was replaced by another file".into()),
            Err(e) => changed(format!("is gone ({e})")),
        }
    }
}

fn read_header(path: &Path, file: &File, len: u64) -> Result<[i32; 3]> {
    if len < HEADER_BYTES as u64 {
        return Err(Error::file(
            path,
            Some(len),
            format!("file is {len} bytes, shorter than the {HEADER_BYTES}-byte header"),
        ));
    }
    let mut head = [0u8; 12];
    file.read_exact_at(&mut head, 0)
        .map_err(|e| Error::io(format!("read shard header {}", path.display()), e))?;
    let word = |i: usize| i32::from_le_bytes([head[4 * i], head[4 * i + 1], head[4 * i + 2], head[4 * i + 3]]);
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
