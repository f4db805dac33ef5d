//! Every `MESHTRAIN_*` variable meshtrain reads at run time, read and parsed here, and the one size
//! parser ([`parse_size`]) of the crate.
//!
//! Why one module: the variables used to be read in a dozen files, each with its own rules (is an
//! empty value unset? which size suffixes? which message?), and the pre-MPI check of every
//! variable ([`crate::bootstrap`]) must accept exactly what the runtime later accepts. Now each
//! variable has one typed getter here; the modules that use a value call it (their `from_env`
//! constructors add only defaults and the rules that need their own knowledge), and the pre-MPI
//! check calls those same constructors, so nothing accepted before `MPI_Init` is rejected after.
//!
//! Invariants:
//! - a leaf: nothing from the crate but [`crate::error`] is imported, so every layer may use it;
//!   the small mode enums of the variables ([`Transport`], [`Algo`], [`Cma`], [`GpuIpc`],
//!   [`GpuDirect`], [`SimdLevel`]) are defined here for that reason and re-exported where they
//!   are used;
//! - a runtime variable that is set but empty counts as unset; the tool variables (emu compiler,
//!   font, git sha, ...) keep the rule they always had, noted at each getter;
//! - a bad value is an [`Error::Config`] whose key is the variable and whose message says what it
//!   accepts (the README's Environment table lists the same);
//! - getters only read the environment, so every rank with the same environment gets the same
//!   answer; checks that need more (can an address be bound here, does an interface exist, is
//!   there a fabric NIC, a transport's maxima, `MESHTRAIN_GPU_DIRECT=on` against the transport)
//!   stay with the code that knows them.
//!
//! Not here: the job-configuration overrides `MESHTRAIN_<SECTION>_<KEY>`
//! ([`crate::config::overrides`]). They are another mechanism: each sets one key of the TOML job
//! configuration, is typed by that configuration's schema, and its errors come from the
//! configuration loader next to the file's own. This module knows only the fixed names of the
//! runtime ([`RUNTIME_VARS`]) and tool ([`TOOL_VARS`]) variables; with the override names they
//! make up what the misspelling check ([`check_names`]) accepts. Variables of other programs
//! (`SLURM_*`, `FI_*`, `*_VISIBLE_DEVICES`, MPI's rank variables) are read where they are used.

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::error::{Error, Result};

/// Runtime variables and what they accept (the README's Environment table lists the same).
pub const RUNTIME_VARS: &[(&str, &str)] = &[
    ("MESHTRAIN_TRANSPORT", "auto, shm, tcp, ofi or shm+ofi (any case)"),
    ("MESHTRAIN_BIND_ADDR", "an IP address of this host, or 0.0.0.0"),
    ("MESHTRAIN_SOCKET_IFNAME", "the name of an interface with an IPv4 address"),
    ("MESHTRAIN_TIMEOUT", "seconds > 0, at most 1e9"),
    ("MESHTRAIN_BOOTSTRAP_TIMEOUT", "seconds > 0, at most 1e9"),
    ("MESHTRAIN_ALGO", "auto, ring, direct or split"),
    ("MESHTRAIN_CMA", "auto, on (1) or off (0)"),
    ("MESHTRAIN_HIER", "auto or off"),
    ("MESHTRAIN_HUGEPAGES", "on or off"),
    ("MESHTRAIN_CPU_SIMD", "auto, avx512, avx2 or baseline"),
    ("MESHTRAIN_SMALL_BYTES", "bytes > 0"),
    ("MESHTRAIN_CHUNK_BYTES", "a multiple of 64 bytes"),
    ("MESHTRAIN_TUNING", "the path of a tuning table (meshtrain bench --tune), or off"),
    ("MESHTRAIN_SHM_CHUNK", "a size 1..=shm maximum (K/M/G suffix)"),
    ("MESHTRAIN_SHM_DEPTH", "slots 1..=shm maximum"),
    ("MESHTRAIN_TCP_CHUNK", "a size 1..=tcp maximum (K/M/G suffix)"),
    ("MESHTRAIN_TCP_DEPTH", "buffers 1..=tcp maximum"),
    ("MESHTRAIN_GPU_IPC", "auto, on or off"),
    ("MESHTRAIN_GPU_STAGE_CHUNK", "a size > 0 (K/M/G suffix)"),
    ("MESHTRAIN_GPU_ONESHOT", "a size 0..=1G (K/M/G suffix; 0 = off)"),
    ("MESHTRAIN_GPU_OVERLAP", "on or off"),
    ("MESHTRAIN_GPU_DIRECT", "auto, on or off (on needs libfabric links: MESHTRAIN_TRANSPORT=ofi, or auto with a fabric NIC)"),
    ("MESHTRAIN_OFI_PROVIDER", "a libfabric provider name, e.g. cxi, verbs, tcp or shm (else FI_PROVIDER)"),
    ("MESHTRAIN_OFI_PROFILE", "frontier"),
    ("MESHTRAIN_FAULT", "test only: stall-bootstrap@RANK, slow-step@RANK:MS or nan-grad@RANK:STEP"),
];

/// Variables read outside the runtime: by the emu and HIP devices, the plots, build and test
/// tooling.
pub const TOOL_VARS: &[&str] = &[
    "MESHTRAIN_EMU_CXX",
    "MESHTRAIN_EMU_CACHE",
    "MESHTRAIN_EMU_THREADS",
    "MESHTRAIN_HIP_ARCH",
    "MESHTRAIN_FONT",
    "MESHTRAIN_GIT_SHA",
    "MESHTRAIN_GPU_SEED",
    "MESHTRAIN_H5PY_PYTHON",
    "MESHTRAIN_REQUIRE_H5PY",
    "MESHTRAIN_REQUIRE_HIPCC",
    "MESHTRAIN_REQUIRE_NVRTC",
    "MESHTRAIN_TEST_CHILD",
    "MESHTRAIN_SLURM_DIR",
];

/// Default bound on the start-up exchange with rank 0 (`MESHTRAIN_BOOTSTRAP_TIMEOUT`).
pub const DEFAULT_BOOTSTRAP_TIMEOUT: Duration = Duration::from_secs(120);

/// The value of `key`; unset and empty are both `None`.
fn var(key: &str) -> Option<String> {
    std::env::var(key).ok().filter(|v| !v.is_empty())
}

/// What runtime variable `key` accepts, from [`RUNTIME_VARS`] (empty for other names).
pub fn accepted(key: &str) -> &'static str {
    RUNTIME_VARS.iter().find(|(k, _)| *k == key).map_or("", |(_, a)| a)
}

/// `123`, `64K`, `4m`, `1G` (powers of 1024, either case, surrounding blanks ignored) into bytes;
/// the error says what a size looks like. The command line's size arguments use it as well.
pub fn parse_size(s: &str) -> std::result::Result<usize, String> {
    let t = s.trim();
    let (digits, unit) = match t.char_indices().last() {
        Some((i, 'k' | 'K')) => (&t[..i], 1usize << 10),
        Some((i, 'm' | 'M')) => (&t[..i], 1 << 20),
        Some((i, 'g' | 'G')) => (&t[..i], 1 << 30),
        _ => (t, 1),
    };
    digits
        .parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(unit))
        .ok_or_else(|| format!("`{s}` is not a size like 4K, 64M or 1G"))
}

/// The entry of `table` whose name equals `v` in any case.
fn choice<T: Copy>(v: &str, table: &[(&str, T)]) -> Option<T> {
    let v = v.to_ascii_lowercase();
    table.iter().find(|(name, _)| *name == v).map(|&(_, t)| t)
}

/// `key` parsed by `parse`, whose error is `key`'s message; `None` when unset.
fn parsed<T>(key: &str, parse: impl FnOnce(&str) -> std::result::Result<T, String>) -> Result<Option<T>> {
    var(key).map(|v| parse(&v).map_err(|msg| Error::config(key, msg))).transpose()
}

/// A positive number (the communicator's numeric variables).
fn positive(v: &str) -> std::result::Result<f64, String> {
    v.parse::<f64>().ok().filter(|x| *x > 0.0).ok_or_else(|| format!("`{v}` is not a positive number"))
}

/// Which transports carry links (`MESHTRAIN_TRANSPORT`; [`crate::transport::select`] turns it
/// into link choices).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// Shared memory within a node; between nodes libfabric where a fabric NIC is present, else TCP.
    Auto,
    /// Shared memory within a node, TCP between nodes.
    Shm,
    /// TCP for every pair.
    Tcp,
    /// libfabric for every pair.
    Ofi,
    /// Shared memory within a node, libfabric between nodes.
    ShmOfi,
}

impl Transport {
    /// The lower-case name, as accepted.
    pub fn name(self) -> &'static str {
        match self {
            Transport::Auto => "auto",
            Transport::Shm => "shm",
            Transport::Tcp => "tcp",
            Transport::Ofi => "ofi",
            Transport::ShmOfi => "shm+ofi",
        }
    }
}

/// `MESHTRAIN_TRANSPORT` (`auto` when unset).
pub fn transport() -> Result<Transport> {
    use Transport::*;
    let v = var("MESHTRAIN_TRANSPORT").unwrap_or_else(|| "auto".into()).to_ascii_lowercase();
    choice(&v, &[("auto", Auto), ("shm", Shm), ("tcp", Tcp), ("ofi", Ofi), ("shm+ofi", ShmOfi)]).ok_or_else(|| {
        Error::config("MESHTRAIN_TRANSPORT", format!("{v:?}: expected auto, shm, tcp, ofi or shm+ofi (any case)"))
    })
}

/// Whether device send/recv over libfabric links post the device buffer itself (FI_HMEM
/// registration) instead of staging it through pinned host memory (`MESHTRAIN_GPU_DIRECT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GpuDirect {
    /// Direct where both ends' endpoints offer FI_HMEM; staged otherwise (the choice is logged).
    #[default]
    Auto,
    /// Always direct; an error where impossible.
    On,
    /// Always staged.
    Off,
}

impl GpuDirect {
    /// A value of `MESHTRAIN_GPU_DIRECT` (any case; `None`: unset).
    fn parse(value: Option<&str>) -> Result<GpuDirect> {
        match value.map(|v| v.to_ascii_lowercase()).as_deref() {
            None | Some("auto") => Ok(GpuDirect::Auto),
            Some("on") => Ok(GpuDirect::On),
            Some("off") => Ok(GpuDirect::Off),
            Some(other) => Err(Error::config("MESHTRAIN_GPU_DIRECT", format!("`{other}` is not auto, on or off"))),
        }
    }
}

/// `MESHTRAIN_GPU_DIRECT` (`auto` when unset); [`crate::transport::select::gpu_direct_from_env`]
/// adds the check against the transport.
pub fn gpu_direct() -> Result<GpuDirect> {
    GpuDirect::parse(var("MESHTRAIN_GPU_DIRECT").as_deref())
}

/// Which schedule a host collective uses (`MESHTRAIN_ALGO`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algo {
    /// Direct below the communicator's `small_bytes`, ring above (all-to-all is always direct).
    Auto,
    /// Always the ring (all-to-all stays direct).
    Ring,
    /// Always the direct all-pairs schedule.
    Direct,
    /// All-reduce as a reduce-scatter then an all-gather, each half as the tuning table (or the
    /// fixed rule) picks for that collective; the other collectives as under `Auto`.
    Split,
}

/// Whether all-gather, all-reduce and broadcast may read peers' buffers directly (Cross Memory
/// Attach) instead of copying through the shared-memory FIFOs (`MESHTRAIN_CMA`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cma {
    /// All-gather and all-reduce above the communicator's `small_bytes` under `Algo::Auto`, when
    /// the probe shows reads work (broadcast keeps the ring, measured faster).
    Auto,
    /// All three at every size, whatever [`Algo`] says; a failed probe is an error.
    On,
    /// Never.
    Off,
}

/// Whether device collectives may map peers' buffers (`MESHTRAIN_GPU_IPC`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuIpc {
    /// Where every rank is on this node and the buffers can be exported; staged otherwise.
    Auto,
    /// Always; an error where impossible.
    On,
    /// Never: always staged.
    Off,
}

/// The largest deadline accepted, in seconds (about 31 years): every deadline is added to an
/// `Instant`, which must not overflow.
const MAX_DEADLINE_S: f64 = 1e9;

/// A deadline in seconds: finite, > 0 and at most [`MAX_DEADLINE_S`] (`inf` or `1e400` are refused
/// with that message, never a panic).
fn seconds(v: &str) -> std::result::Result<Duration, String> {
    let s = v.trim().parse::<f64>().map_err(|_| format!("`{v}` is not a number of seconds (expected seconds > 0, at most 1e9)"))?;
    if !(s > 0.0 && s <= MAX_DEADLINE_S) {
        return Err(format!("`{v}` is out of range (expected seconds > 0, at most 1e9)"));
    }
    Duration::try_from_secs_f64(s).map_err(|e| format!("`{v}`: {e}"))
}

/// `MESHTRAIN_TIMEOUT`: the deadline of one collective, seconds > 0.
pub fn timeout() -> Result<Option<Duration>> {
    parsed("MESHTRAIN_TIMEOUT", seconds)
}

/// `MESHTRAIN_ALGO`.
pub fn algo() -> Result<Option<Algo>> {
    parsed("MESHTRAIN_ALGO", |v| {
        choice(v, &[("auto", Algo::Auto), ("ring", Algo::Ring), ("direct", Algo::Direct), ("split", Algo::Split)])
            .ok_or_else(|| format!("`{v}` is not one of auto, ring, direct, split"))
    })
}

/// `MESHTRAIN_CMA`.
pub fn cma() -> Result<Option<Cma>> {
    parsed("MESHTRAIN_CMA", |v| {
        choice(v, &[("auto", Cma::Auto), ("on", Cma::On), ("1", Cma::On), ("off", Cma::Off), ("0", Cma::Off)])
            .ok_or_else(|| format!("`{v}` is not one of auto, on (1), off (0)"))
    })
}

/// `MESHTRAIN_HIER`: whether host collectives of communicators spanning nodes may run in stages
/// (within the nodes, between them, within again): `auto` (true) or `off` (false, flat schedules).
pub fn hier() -> Result<Option<bool>> {
    parsed("MESHTRAIN_HIER", |v| {
        choice(v, &[("auto", true), ("off", false)]).ok_or_else(|| format!("`{v}` is not one of auto, off"))
    })
}

/// `MESHTRAIN_HUGEPAGES`: whether large host buffers are advised onto transparent huge pages
/// (`on`, the default, or `off`; see [`crate::mem`]).
pub fn hugepages() -> Result<Option<bool>> {
    parsed("MESHTRAIN_HUGEPAGES", |v| {
        choice(v, &[("on", true), ("off", false)]).ok_or_else(|| format!("`{v}` is not one of on, off"))
    })
}

/// The vector instruction sets the CPU layers can be compiled for (`crate::device::cpu::simd`),
/// narrowest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum SimdLevel {
    /// The build's own target (SSE2 on x86-64).
    Baseline,
    /// AVX2 (256-bit vectors).
    Avx2,
    /// AVX-512 F/BW/DQ/VL (512-bit vectors).
    Avx512,
}

impl SimdLevel {
    /// The name `MESHTRAIN_CPU_SIMD` takes and the logs print.
    pub fn name(self) -> &'static str {
        match self {
            SimdLevel::Baseline => "baseline",
            SimdLevel::Avx2 => "avx2",
            SimdLevel::Avx512 => "avx512",
        }
    }
}

/// `MESHTRAIN_CPU_SIMD`: the widest vector unit the CPU layers may use, `None` for `auto` or
/// unset (the widest the CPU has); a level the CPU lacks is never used whatever is asked.
pub fn cpu_simd() -> Result<Option<SimdLevel>> {
    let level = parsed("MESHTRAIN_CPU_SIMD", |v| {
        choice(v, &[("auto", None), ("baseline", Some(SimdLevel::Baseline)), ("avx2", Some(SimdLevel::Avx2)), ("avx512", Some(SimdLevel::Avx512))])
            .ok_or_else(|| format!("`{v}` is not one of auto, avx512, avx2, baseline"))
    })?;
    Ok(level.flatten())
}

/// `MESHTRAIN_SMALL_BYTES`: the largest message the direct schedule takes under `Algo::Auto`.
pub fn small_bytes() -> Result<Option<usize>> {
    parsed("MESHTRAIN_SMALL_BYTES", |v| positive(v).map(|b| b as usize))
}

/// `MESHTRAIN_TUNING`: a tuning table's path or `off` (read and checked by
/// [`crate::comm::tuner::Tuning`]); `None` when unset.
pub fn tuning() -> Option<String> {
    var("MESHTRAIN_TUNING")
}

/// `MESHTRAIN_CHUNK_BYTES`: the largest message a schedule puts on a link, a multiple of 64.
pub fn chunk_bytes() -> Result<Option<usize>> {
    parsed("MESHTRAIN_CHUNK_BYTES", |v| {
        let b = positive(v)? as usize;
        if b < 64 || b % 64 != 0 {
            return Err("must be a multiple of 64 bytes".into());
        }
        Ok(b)
    })
}

/// A link size variable (`MESHTRAIN_{SHM,TCP}_{CHUNK,DEPTH}`, K/M/G suffixes allowed); the range
/// is checked by the transport, which knows its maxima.
fn link_size(key: &str) -> Result<Option<usize>> {
    parsed(key, |v| parse_size(v).map_err(|_| format!("{v:?} is not a number (K/M/G suffixes allowed)")))
}

/// `MESHTRAIN_SHM_CHUNK`: slot bytes of shared-memory links.
pub fn shm_chunk() -> Result<Option<usize>> {
    link_size("MESHTRAIN_SHM_CHUNK")
}

/// `MESHTRAIN_SHM_DEPTH`: slots per direction of shared-memory links.
pub fn shm_depth() -> Result<Option<usize>> {
    link_size("MESHTRAIN_SHM_DEPTH")
}

/// `MESHTRAIN_TCP_CHUNK`: chunk bytes of TCP (and libfabric) links.
pub fn tcp_chunk() -> Result<Option<usize>> {
    link_size("MESHTRAIN_TCP_CHUNK")
}

/// `MESHTRAIN_TCP_DEPTH`: buffers per direction of TCP (and libfabric) links.
pub fn tcp_depth() -> Result<Option<usize>> {
    link_size("MESHTRAIN_TCP_DEPTH")
}

/// `MESHTRAIN_GPU_IPC`.
pub fn gpu_ipc() -> Result<Option<GpuIpc>> {
    parsed("MESHTRAIN_GPU_IPC", |v| {
        choice(v, &[("auto", GpuIpc::Auto), ("on", GpuIpc::On), ("off", GpuIpc::Off)])
            .ok_or_else(|| format!("`{v}` is not auto, on or off"))
    })
}

/// `MESHTRAIN_GPU_OVERLAP`: whether device-memory gradient buckets are reduced on a
/// communication thread during the backward (on) or after it on the compute thread (off).
pub fn gpu_overlap() -> Result<Option<bool>> {
    parsed("MESHTRAIN_GPU_OVERLAP", |v| choice(v, &[("on", true), ("off", false)]).ok_or_else(|| format!("`{v}` is not on or off")))
}

/// `MESHTRAIN_GPU_STAGE_CHUNK`: bytes per staged chunk of a device collective, > 0.
pub fn gpu_stage_chunk() -> Result<Option<usize>> {
    parsed("MESHTRAIN_GPU_STAGE_CHUNK", |v| {
        parse_size(v).ok().filter(|&n| n > 0).ok_or_else(|| format!("`{v}` is not a positive size like 4M"))
    })
}

/// `MESHTRAIN_GPU_ONESHOT`: the most bytes a rank publishes in a stream-ordered call, 0..=1G.
pub fn gpu_oneshot() -> Result<Option<usize>> {
    parsed("MESHTRAIN_GPU_ONESHOT", |v| {
        parse_size(v).ok().filter(|&n| n <= 1 << 30).ok_or_else(|| format!("`{v}` is not a size from 0 to 1G like 1M"))
    })
}

/// The libfabric provider asked for: `MESHTRAIN_OFI_PROVIDER`, else `FI_PROVIDER` (None:
/// libfabric chooses).
pub fn ofi_provider() -> Option<String> {
    var("MESHTRAIN_OFI_PROVIDER").or_else(|| var("FI_PROVIDER"))
}

/// Site settings for libfabric (`MESHTRAIN_OFI_PROFILE`; [`crate::transport::ofi`] applies them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OfiProfile {
    /// HPE Slingshot 11 (cxi) on Frontier.
    Frontier,
}

/// `MESHTRAIN_OFI_PROFILE`.
pub fn ofi_profile() -> Result<Option<OfiProfile>> {
    parsed("MESHTRAIN_OFI_PROFILE", |v| match v {
        "frontier" => Ok(OfiProfile::Frontier),
        _ => Err(format!("`{v}`: the only profile is `frontier`")),
    })
}

/// `MESHTRAIN_BIND_ADDR`: the address every rank's listener binds.
pub fn bind_addr() -> Result<Option<IpAddr>> {
    parsed("MESHTRAIN_BIND_ADDR", |v| {
        v.parse().map_err(|_| format!("`{v}` is not an IP address (expected {})", accepted("MESHTRAIN_BIND_ADDR")))
    })
}

/// `MESHTRAIN_SOCKET_IFNAME`: the interface whose IPv4 address the listener binds (the bootstrap
/// looks it up).
pub fn socket_ifname() -> Option<String> {
    var("MESHTRAIN_SOCKET_IFNAME")
}

/// How long the start-up exchange with rank 0 may take (`MESHTRAIN_BOOTSTRAP_TIMEOUT` seconds,
/// default 120).
pub fn bootstrap_timeout() -> Result<Duration> {
    let secs = parsed("MESHTRAIN_BOOTSTRAP_TIMEOUT", seconds)?;
    Ok(secs.unwrap_or(DEFAULT_BOOTSTRAP_TIMEOUT))
}

/// A test-only fault (`MESHTRAIN_FAULT`), so that failure handling can be tested with real
/// processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// `stall-bootstrap@RANK`: world rank RANK stops before its hello to rank 0 (as a stopped or
    /// wedged process would).
    StallBootstrap(usize),
    /// `slow-step@RANK:MS`: world rank RANK works MS milliseconds longer in every training step
    /// (a straggler).
    SlowStep(usize, u64),
    /// `nan-grad@RANK:STEP`: world rank RANK's loss gradient is NaN at step STEP (its gradients
    /// NaN, every loss finite).
    NanGrad(usize, u64),
}

fn parse_fault(v: &str) -> std::result::Result<Fault, String> {
    let bad = || format!("`{v}` is not {}", accepted("MESHTRAIN_FAULT"));
    if let Some(r) = v.strip_prefix("stall-bootstrap@") {
        return r.parse().map(Fault::StallBootstrap).map_err(|_| bad());
    }
    if let Some((r, step)) = v.strip_prefix("nan-grad@").and_then(|x| x.split_once(':')) {
        return Ok(Fault::NanGrad(r.parse().map_err(|_| bad())?, step.parse().map_err(|_| bad())?));
    }
    let (r, ms) = v.strip_prefix("slow-step@").and_then(|x| x.split_once(':')).ok_or_else(bad)?;
    Ok(Fault::SlowStep(r.parse().map_err(|_| bad())?, ms.parse().map_err(|_| bad())?))
}

/// `MESHTRAIN_FAULT`.
pub fn fault() -> Result<Option<Fault>> {
    parsed("MESHTRAIN_FAULT", parse_fault)
}

/// The rank `MESHTRAIN_FAULT=stall-bootstrap@RANK` stalls, if any.
pub fn stalled_bootstrap_rank() -> Result<Option<usize>> {
    Ok(match fault()? {
        Some(Fault::StallBootstrap(r)) => Some(r),
        _ => None,
    })
}

/// The extra milliseconds `MESHTRAIN_FAULT=slow-step@RANK:MS` gives each step of `rank`, if any.
pub fn slow_step_ms(rank: usize) -> Result<Option<u64>> {
    Ok(match fault()? {
        Some(Fault::SlowStep(r, ms)) if r == rank => Some(ms),
        _ => None,
    })
}

/// The step at which `MESHTRAIN_FAULT=nan-grad@RANK:STEP` poisons `rank`'s gradients, if any.
pub fn nan_grad_step(rank: usize) -> Result<Option<u64>> {
    Ok(match fault()? {
        Some(Fault::NanGrad(r, step)) if r == rank => Some(step),
        _ => None,
    })
}

/// `MESHTRAIN_EMU_CXX`: the C++ compiler of the emu device's kernels (default `g++`; an empty
/// value is used as is).
pub fn emu_cxx() -> String {
    std::env::var("MESHTRAIN_EMU_CXX").unwrap_or_else(|_| "g++".into())
}

/// `MESHTRAIN_EMU_CACHE`: where the emu device keeps its compiled kernels (default
/// `$TMPDIR/meshtrain-emu`; an empty value is used as is).
pub fn emu_cache() -> PathBuf {
    std::env::var_os("MESHTRAIN_EMU_CACHE").map(PathBuf::from).unwrap_or_else(|| std::env::temp_dir().join("meshtrain-emu"))
}

/// `MESHTRAIN_HIP_ARCH`: the offload architecture the HIP kernels are compiled for (default
/// `gfx90a`).
pub fn hip_arch() -> String {
    std::env::var("MESHTRAIN_HIP_ARCH").unwrap_or_else(|_| "gfx90a".into())
}

/// `MESHTRAIN_FONT`: the TrueType font of the sweep plots (an empty value is used as is).
pub fn font() -> Option<PathBuf> {
    std::env::var_os("MESHTRAIN_FONT").map(PathBuf::from)
}

/// `MESHTRAIN_GIT_SHA`: the commit the binary was built from, for sweep reports (an empty value
/// is used as is).
pub fn git_sha() -> Option<String> {
    std::env::var("MESHTRAIN_GIT_SHA").ok()
}

/// Whether `name` is a runtime or tool variable.
pub fn is_known(name: &str) -> bool {
    known_names().any(|k| k == name)
}

fn known_names() -> impl Iterator<Item = &'static str> {
    RUNTIME_VARS.iter().map(|(k, _)| *k).chain(TOOL_VARS.iter().copied())
}

/// A `MESHTRAIN_*` name among `names` that is neither a runtime variable, a tool variable nor a
/// job-config override (`is_override`, the configuration loader's rule) is a typo that would
/// otherwise be ignored silently: an error naming it and the nearest known name.
pub fn check_names<'a>(names: impl Iterator<Item = &'a str>, is_override: impl Fn(&str) -> bool) -> Result<()> {
    for name in names.filter(|n| n.starts_with("MESHTRAIN_")) {
        if is_known(name) || is_override(name) {
            continue;
        }
        let nearest = known_names().min_by_key(|k| edit_distance(k, name)).unwrap_or_default();
        return Err(Error::config(
            name,
            format!("unknown meshtrain variable (did you mean {nearest}? job-config overrides are MESHTRAIN_<SECTION>_<KEY>; README, Environment, lists the rest)"),
        ));
    }
    Ok(())
}

/// Levenshtein distance over bytes (names are ASCII).
pub(crate) fn edit_distance(a: &str, b: &str) -> usize {
    let b = b.as_bytes();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.bytes().enumerate() {
        let mut diag = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let next = (diag + usize::from(ca != cb)).min(row[j] + 1).min(row[j + 1] + 1);
            diag = row[j + 1];
            row[j + 1] = next;
        }
    }
    row[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_suffixes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("512K"), Ok(512 << 10));
        assert_eq!(parse_size("4K"), Ok(4096));
        assert_eq!(parse_size("2m"), Ok(2 << 20));
        assert_eq!(parse_size("64m"), Ok(64 << 20));
        assert_eq!(parse_size("1G"), Ok(1 << 30));
        assert_eq!(parse_size(" 100 "), Ok(100));
        assert_eq!(parse_size("x"), Err("`x` is not a size like 4K, 64M or 1G".into()));
        assert!(parse_size("").is_err());
        assert!(parse_size("4X").is_err());
        assert!(parse_size(&format!("{}G", usize::MAX)).is_err(), "overflow is an error, not a wrap");
    }

    #[test]
    fn gpu_direct_values_parse_in_any_case_and_others_name_the_variable() {
        assert_eq!(GpuDirect::parse(None).unwrap(), GpuDirect::Auto);
        assert_eq!(GpuDirect::parse(Some("AUTO")).unwrap(), GpuDirect::Auto);
        assert_eq!(GpuDirect::parse(Some("On")).unwrap(), GpuDirect::On);
        assert_eq!(GpuDirect::parse(Some("off")).unwrap(), GpuDirect::Off);
        let err = GpuDirect::parse(Some("yes")).unwrap_err().to_string();
        assert!(err.contains("MESHTRAIN_GPU_DIRECT") && err.contains("`yes` is not auto, on or off"), "{err}");
    }

    #[test]
    fn deadlines_are_finite_positive_seconds_and_never_panic() {
        assert_eq!(seconds("2.5"), Ok(Duration::from_millis(2500)));
        assert_eq!(seconds("1e9"), Ok(Duration::from_secs(1_000_000_000)));
        for bad in ["inf", "1e400", "-1", "0", "nan", "1e20", "soon", ""] {
            let err = seconds(bad).unwrap_err();
            assert!(err.contains(&format!("`{bad}`")) && err.contains("expected seconds > 0, at most 1e9"), "{bad}: {err}");
        }
    }

    #[test]
    fn faults_parse_and_others_are_refused() {
        assert_eq!(parse_fault("stall-bootstrap@2"), Ok(Fault::StallBootstrap(2)));
        assert_eq!(parse_fault("slow-step@1:40"), Ok(Fault::SlowStep(1, 40)));
        for bad in ["slow-step@1", "slow-step@x:4", "stall@1", ""] {
            assert!(parse_fault(bad).unwrap_err().contains("slow-step@RANK:MS"), "{bad}");
        }
    }

    #[test]
    fn choices_ignore_case() {
        assert_eq!(choice("RING", &[("auto", Algo::Auto), ("ring", Algo::Ring)]), Some(Algo::Ring));
        assert_eq!(choice("rings", &[("ring", Algo::Ring)]), None);
    }

    #[test]
    fn misspelled_names_get_the_nearest_known_name() {
        let err = check_names(["PATH", "MESHTRAIN_TRANSPRT"].into_iter(), |_| false).unwrap_err().to_string();
        assert!(err.contains("MESHTRAIN_TRANSPRT") && err.contains("did you mean MESHTRAIN_TRANSPORT?"), "{err}");
        check_names(["MESHTRAIN_EMU_CXX", "MESHTRAIN_X"].into_iter(), |n| n == "MESHTRAIN_X").unwrap();
    }

    #[test]
    fn edit_distance_counts_single_edits() {
        assert_eq!(edit_distance("MESHTRAIN_ALGO", "MESHTRAIN_ALGO"), 0);
        assert_eq!(edit_distance("MESHTRAIN_TRANSPORT", "MESHTRAIN_TRANSPRT"), 1);
        assert_eq!(edit_distance("abc", "acb"), 2);
        assert_eq!(edit_distance("", "abc"), 3);
    }
}
