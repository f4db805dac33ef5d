//! One job per checkpoint directory: the lock file `DIR/meshtrain.lock`.
//!
//! Why: two jobs given one `checkpoint.dir` used to corrupt each other's saves (one job's prune
//! removed the other's `step_*.tmp-*` directory as a leftover while it was being written). Now the
//! directory belongs to the process holding an exclusive `flock` on its lock file, and the file
//! names that holder (job id, host, pid, since when), so the second job is refused with a message
//! saying who has the directory.
//!
//! Invariants:
//! - the kernel releases a `flock` when its holder dies, so a killed job never leaves the
//!   directory locked; on a file system without `flock` (some network mounts) the holder line is
//!   used instead: a holder on this host whose process is gone is provably dead and is replaced,
//!   any other holder refuses (the message says to delete the file if that job is gone);
//! - the lock is re-entrant within a process (a training run holds it for the whole job and each
//!   save takes it again): one open file per directory, counted; the last guard releases it;
//! - a leftover temporary may be removed only by the holder ([`held_here`]): every writer holds the
//!   lock while it writes, so a temporary found by the holder belongs to a process that is gone.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{Read as _, Seek as _, Write as _};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use crate::checkpoint::agree::broadcast_from;
use crate::comm::Communicator;
use crate::error::{Error, Result};

/// File name of the lock inside a checkpoint root.
pub const LOCK_FILE: &str = "meshtrain.lock";

/// Open lock files of this process: canonical directory -> (file, guards alive).
static HELD: Mutex<Option<HashMap<PathBuf, (File, usize)>>> = Mutex::new(None);

fn held() -> MutexGuard<'static, Option<HashMap<PathBuf, (File, usize)>>> {
    HELD.lock().unwrap_or_else(|p| p.into_inner())
}

/// The directory `dir` is held by this process while a guard lives.
#[derive(Debug)]
pub struct DirLock {
    dir: PathBuf,
}

/// Who holds a directory: one line in the lock file.
pub fn holder_line() -> String {
    let job = std::env::var("SLURM_JOB_ID")
        .ok()
        .filter(|j| !j.is_empty())
        .unwrap_or_else(|| "-".into());
    let since = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    format!(
        "job={job} host={} pid={} since={since}\n",
        hostname(),
        std::process::id()
    )
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_default()
}

fn lock_err(path: &Path, msg: String) -> Error {
    Error::File {
        file: path.to_path_buf(),
        offset: None,
        msg,
    }
}

impl DirLock {
    /// Takes `dir` (created if missing) for this process, or refuses naming the holder.
    pub fn acquire(dir: &Path) -> Result<DirLock> {
        std::fs::create_dir_all(dir)
            .map_err(|e| lock_err(dir, format!("create checkpoint root: {e}")))?;
        let canon = dir
            .canonicalize()
            .map_err(|e| lock_err(dir, format!("resolve checkpoint root: {e}")))?;
        let mut map = held();
        let map = map.get_or_insert_with(HashMap::new);
        if let Some((_, n)) = map.get_mut(&canon) {
            *n += 1;
            return Ok(DirLock { dir: canon });
        }
        let path = canon.join(LOCK_FILE);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| lock_err(&path, format!("open the checkpoint directory's lock: {e}")))?;
        take(&file, &path)?;
        write_holder(&file, &path)?;
        map.insert(canon.clone(), (file, 1));
        Ok(DirLock { dir: canon })
    }
}

impl Drop for DirLock {
    fn drop(&mut self) {
        let mut map = held();
        let Some(map) = map.as_mut() else { return };
        let last = map.get_mut(&self.dir).is_some_and(|(_, n)| {
            *n -= 1;
            *n == 0
        });
        if last {
            if let Some((file, _)) = map.remove(&self.dir) {
                // An empty file says "free" where flock is not available; the flock itself goes
                // with the descriptor.
                let _ = file.set_len(0);
            }
        }
    }
}

/// Collective over `comm`: rank 0 takes `dir` for the job (kept while the returned guard lives);
/// every rank returns the same `Ok`, or the same error naming the holder.
pub fn lock_for_job(comm: &Communicator, dir: &Path) -> Result<Option<DirLock>> {
    let root = comm.rank() == 0;
    let mine = root.then(|| DirLock::acquire(dir));
    let outcome: std::result::Result<(), String> = match &mine {
        Some(Err(e)) => Err(e.to_string()),
        _ => Ok(()),
    };
    let agreed = broadcast_from(comm, 0, root.then_some(&outcome))?;
    match (mine, agreed) {
        (Some(Err(e)), _) => Err(e),
        (_, Err(msg)) => Err(Error::Check(format!("rank 0: {msg}"))),
        (mine, Ok(())) => Ok(mine.transpose()?),
    }
}

/// Whether this process holds `dir` (so leftovers found there are from processes that are gone).
pub fn held_here(dir: &Path) -> bool {
    let Ok(canon) = dir.canonicalize() else {
        return false;
    };
    held().as_ref().is_some_and(|m| m.contains_key(&canon))
}

/// The holder line of an open lock file (empty: none recorded).
fn read_holder(mut file: &File) -> String {
    let mut s = String::new();
    let _ = file.rewind().and_then(|_| file.read_to_string(&mut s));
    s.trim().to_string()
}

fn write_holder(mut file: &File, path: &Path) -> Result<()> {
    let line = holder_line();
    file.set_len(0)
        .and_then(|_| file.rewind())
        .and_then(|_| file.write_all(line.as_bytes()))
        .and_then(|_| file.sync_all())
        .map_err(|e| lock_err(path, format!("record the lock holder: {e}")))
}

fn refusal(path: &Path, holder: &str, how: &str) -> Error {
    let holder = if holder.is_empty() {
        "a process that recorded no holder"
    } else {
        holder
    };
    lock_err(path, format!("checkpoint directory is in use by another job ({holder}){how}; a checkpoint directory belongs to one job at a time: give this job its own checkpoint.dir"))
}

/// Takes the exclusive `flock` of `file`, or decides from the holder line where the file system
/// has no `flock`.
fn take(file: &File, path: &Path) -> Result<()> {
    // SAFETY: flock on a descriptor this function borrows; no memory is passed.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        return Ok(());
    }
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EWOULDBLOCK) => Err(refusal(path, &read_holder(file), "")),
        Some(libc::ENOLCK | libc::EOPNOTSUPP | libc::ENOSYS) => {
            let holder = read_holder(file);
            if holder.is_empty() || dead_here(&holder) {
                log::warn!(
                    "{}: no flock on this file system; the holder line decides ({})",
                    path.display(),
                    if holder.is_empty() {
                        "free"
                    } else {
                        "holder is gone"
                    }
                );
                return Ok(());
            }
            Err(refusal(
                path,
                &holder,
                " [no flock on this file system: delete the file if that job is gone]",
            ))
        }
        _ => Err(lock_err(
            path,
            format!("lock the checkpoint directory: {e}"),
        )),
    }
}

/// Whether `holder` names a process on this host that no longer exists.
fn dead_here(holder: &str) -> bool {
    let field = |k: &str| {
        holder
            .split_whitespace()
            .find_map(|w| w.strip_prefix(k))
            .map(str::to_string)
    };
    match (
        field("host="),
        field("pid=").and_then(|p| p.parse::<u32>().ok()),
    ) {
        (Some(h), Some(pid)) if h == hostname() => {
            pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists()
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lock_is_reentrant_and_names_its_holder() {
        let dir = std::env::temp_dir().join(format!("meshtrain-lock-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let a = DirLock::acquire(&dir).unwrap();
        let b = DirLock::acquire(&dir).unwrap();
        assert!(held_here(&dir));
        let line = std::fs::read_to_string(dir.join(LOCK_FILE)).unwrap();
        assert!(
            line.contains(&format!("pid={}", std::process::id())) && line.contains("host="),
            "{line}"
        );
        // Another open file description conflicts, as another process's would.
        let other = File::open(dir.join(LOCK_FILE)).unwrap();
        let err = take(&other, &dir.join(LOCK_FILE)).unwrap_err().to_string();
        assert!(
            err.contains("in use by another job")
                && err.contains(&format!("pid={}", std::process::id())),
            "{err}"
        );
        drop(a);
        assert!(held_here(&dir));
        drop(b);
        assert!(!held_here(&dir));
        take(&other, &dir.join(LOCK_FILE)).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn only_a_holder_on_this_host_with_no_process_is_dead() {
        let h = hostname();
        assert!(dead_here(&format!("job=- host={h} pid=4000000000 since=0")));
        assert!(!dead_here(&format!(
            "job=- host={h} pid={} since=0",
            std::process::id()
        )));
        assert!(!dead_here("job=- host=elsewhere pid=4000000000 since=0"));
        assert!(!dead_here("garbage"));
    }
}
