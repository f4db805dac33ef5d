//! The one error type of meshtrain.
//!
//! Every fallible call in the crate returns [`Result`]. Variants carry the context a user needs to
//! find the fault without a debugger: the operation and its sequence number, the peer rank, the byte
//! count, the file and offset, the config key. Panics are reserved for broken internal invariants.

use std::path::PathBuf;

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in meshtrain.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A collective or point-to-point operation failed while talking to `peer`.
    #[error("rank {rank}: {op} #{seq} ({bytes} bytes): peer rank {peer}: {cause}")]
    Comm {
        /// This process's world rank.
        rank: usize,
        /// Operation name, e.g. `all_reduce`.
        op: &'static str,
        /// Per-communicator sequence number of the operation.
        seq: u64,
        /// World rank of the peer involved.
        peer: usize,
        /// Size of the operation's buffer in bytes.
        bytes: usize,
        /// What happened (peer closed, peer process died, protocol violation, ...).
        cause: String,
    },
    /// An operation did not finish before its deadline.
    #[error("rank {rank}: {op} #{seq} ({bytes} bytes): timed out after {waited_s:.1} s waiting for peer rank {peer}")]
    Timeout {
        /// This process's world rank.
        rank: usize,
        /// Operation name.
        op: &'static str,
        /// Per-communicator sequence number.
        seq: u64,
        /// World rank of the peer that did not answer.
        peer: usize,
        /// Size of the operation's buffer in bytes.
        bytes: usize,
        /// Seconds waited.
        waited_s: f64,
    },
    /// The job is being torn down because another rank reported a failure.
    #[error("rank {rank}: {op} #{seq}: job aborted: {reason}")]
    Aborted {
        /// This process's world rank.
        rank: usize,
        /// Operation that was interrupted.
        op: &'static str,
        /// Its sequence number.
        seq: u64,
        /// The reason as reported by the rank that detected the failure (names the failed rank).
        reason: String,
    },
    /// Rank discovery, unique-id exchange or connection setup failed.
    #[error("bootstrap (rank {rank}): {msg}")]
    Bootstrap {
        /// This process's world rank (0 if not yet known).
        rank: usize,
        /// What went wrong.
        msg: String,
    },
    /// A configuration value is missing, unknown or inconsistent.
    #[error("config: `{key}`: {msg}")]
    Config {
        /// The dotted key, e.g. `train.micro_batch`.
        key: String,
        /// Why the value is rejected.
        msg: String,
    },
    /// A data, checkpoint or fixture file is malformed.
    #[error("{}{}: {msg}", file.display(), offset.map(|o| format!(" (offset {o})")).unwrap_or_default())]
    File {
        /// The offending file.
        file: PathBuf,
        /// Byte offset of the problem, if known.
        offset: Option<u64>,
        /// What is wrong.
        msg: String,
    },
    /// An operating-system call failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done, e.g. `bind 127.0.0.1:0`.
        what: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A feature (CUDA, HIP, ...) was not compiled into this binary.
    #[error("{0} support is not compiled into this meshtrain binary")]
    NotCompiled(&'static str),
    /// A libfabric call failed (the message names the call and the provider's reason).
    #[error("libfabric: {0}")]
    Fabric(String),
    /// A device (GPU) could not be used.
    #[error("device: {0}")]
    Device(String),
    /// A self-check or benchmark found results that differ from the exact expectation.
    #[error("check failed: {0}")]
    Check(String),
    /// A caller passed arguments that violate an API contract (sizes, ranks, dtypes).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

impl Error {
    /// Wraps an `io::Error` with a description of what was being done.
    pub fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io { what: what.into(), source }
    }

    /// A `Config` error for `key`.
    pub fn config(key: impl Into<String>, msg: impl Into<String>) -> Self {
        Error::Config { key: key.into(), msg: msg.into() }
    }

    /// A `File` error for `file` at an optional byte offset.
    pub fn file(file: impl Into<PathBuf>, offset: Option<u64>, msg: impl Into<String>) -> Self {
        Error::File { file: file.into(), offset, msg: msg.into() }
    }

    /// Process exit code for this error: 2 for bad user input (config), 1 otherwise.
    pub fn exit_code(&self) -> i32 {
        match self {
            Error::Config { .. } | Error::InvalidArgument(_) => 2,
            _ => 1,
        }
    }
}
