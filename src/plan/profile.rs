//! Machine profiles: what the planner needs to know about a machine, as TOML.
//!
//! Shipped profiles live in `jobs/machines/*.toml` and are compiled into the binary (so `--machine
//! frontier` works from any directory); any other profile is a path (`--machine my.toml`), e.g.
//! one `meshtrain plan calibrate` wrote. A profile describes one device (dense peak per precision,
//! a GEMM efficiency model, memory and its bandwidth), the links between the devices of one node
//! and the NICs between nodes, each link as an alpha-beta pair (latency, bandwidth) plus the share
//! of its bandwidth a ring collective reaches.
//!
//! Invariants: a loaded profile has every field present (unknown keys are refused too, so a typo
//! cannot silently fall back to a default) and every number finite and positive, fractions in
//! (0, 1]; errors name the file and the field (`memory.bandwidth_gbs`).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The profiles shipped in `jobs/machines/`, by name.
const SHIPPED: &[(&str, &str)] = &[
    (
        "frontier",
        include_str!("../../jobs/machines/frontier.toml"),
    ),
    (
        "dgx-a100",
        include_str!("../../jobs/machines/dgx-a100.toml"),
    ),
    ("h100-ib", include_str!("../../jobs/machines/h100-ib.toml")),
];

/// One machine.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    /// Short name (`frontier`).
    pub name: String,
    /// One line for humans.
    #[serde(default)]
    pub description: String,
    /// The meshtrain device arm a written job uses (`cpu`, `cuda`, `hip`).
    pub device: String,
    /// Devices (ranks) per node.
    pub devices_per_node: usize,
    /// Ranks of one node that can compute at full speed at once, where fewer than
    /// `devices_per_node` (CPU ranks sharing a node's cores; measured by `plan calibrate`). With
    /// `r` ranks on a node and `r > cores_per_node`, every rank's compute (GEMMs, memory-bound
    /// kernels, measured overheads) takes `r / cores_per_node` times its unshared time. Absent: a
    /// device per rank, nothing shared.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cores_per_node: Option<f64>,
    /// One device's arithmetic.
    pub compute: Compute,
    /// One device's memory.
    pub memory: Memory,
    /// Links between the devices of one node.
    pub intra: Intra,
    /// Links between nodes.
    pub inter: Inter,
    /// Measured collectives (`plan calibrate`): one alpha-beta fit per collective, algorithm and
    /// tier; where a collective has fits they replace the ring model of its tier's link.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub collectives: Vec<CollFit>,
    /// Measured fixed costs of a training step (`plan calibrate`); zero in datasheet profiles.
    #[serde(default, skip_serializing_if = "Overhead::is_zero")]
    pub overhead: Overhead,
}

/// One collective's alpha-beta fit (see `plan::collfit`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CollFit {
    /// `all_reduce`, `all_gather` or `reduce_scatter`.
    pub coll: String,
    /// The schedule measured (`ring`, `direct`, `auto`, ...).
    pub algo: String,
    /// `intra` (one node) or `inter`.
    pub tier: String,
    /// Ranks measured.
    pub ranks: usize,
    /// Time of an empty collective on `ranks` ranks, microseconds.
    pub latency_us: f64,
    /// Bus bandwidth of large buffers, GB/s.
    pub busbw_gbs: f64,
    /// Sizes fitted.
    pub points: usize,
    /// Largest relative error of the fit over those sizes, percent.
    pub max_error_pct: f64,
}

/// Per-step costs that neither the GEMMs nor the bandwidth terms describe: kernel launches,
/// thread hand-offs, synchronisation, the step's bookkeeping.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Overhead {
    /// Per block and micro-batch (forward and backward) on the rank holding the block, ms.
    pub block_ms: f64,
    /// Per optimizer step and rank (head, embedding, optimizer, bookkeeping), ms.
    pub step_ms: f64,
    /// How it was obtained.
    #[serde(default)]
    pub source: String,
}

impl Overhead {
    /// No measured overhead (a datasheet profile).
    pub fn is_zero(&self) -> bool {
        *self == Overhead::default()
    }
}

/// Dense arithmetic of one device.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Compute {
    /// Dense peak TFLOP/s by precision name (`bf16`, `fp16`, `fp32`, `tf32`).
    pub peak_tflops: BTreeMap<String, f64>,
    /// The efficiency curve used where no measurement is near.
    pub gemm: GemmCurve,
    /// Measured GEMMs (from `plan calibrate`); the nearest one by shape sets the efficiency.
    #[serde(default)]
    pub measured: Vec<GemmPoint>,
}

/// GEMM efficiency of an (m, n, k) product: `max_efficiency * Π d / (d + half_dim)` over its three
/// dimensions, a saturating curve: small dimensions starve the device, large ones reach the max.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GemmCurve {
    /// Share of the peak the largest GEMMs reach.
    pub max_efficiency: f64,
    /// Dimension at which one factor of the curve is one half.
    pub half_dim: f64,
}

/// One measured GEMM.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GemmPoint {
    /// Rows of the output.
    pub m: usize,
    /// Columns of the output.
    pub n: usize,
    /// Inner dimension.
    pub k: usize,
    /// Measured TFLOP/s.
    pub tflops: f64,
}

/// One device's memory.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Memory {
    /// Capacity, GB (1e9 bytes).
    pub per_device_gb: f64,
    /// Bandwidth, GB/s.
    pub bandwidth_gbs: f64,
    /// Held by the runtime, libraries and communication buffers, GB.
    pub reserved_gb: f64,
}

/// Links inside a node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Intra {
    /// `nvswitch`, `xgmi`, `shm` (informational; `pair_bandwidth_gbs` carries the xGMI pairs).
    pub topology: String,
    /// Per device and direction, GB/s.
    pub bandwidth_gbs: f64,
    /// Between the two devices of one package (MI250X GCD pairs), GB/s; absent: `bandwidth_gbs`.
    #[serde(default)]
    pub pair_bandwidth_gbs: Option<f64>,
    /// Per message, microseconds.
    pub latency_us: f64,
    /// Share of the bandwidth a ring collective reaches.
    pub achievable: f64,
}

/// Links between nodes.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Inter {
    /// NICs per node.
    pub nics_per_node: usize,
    /// Per NIC and direction, GB/s.
    pub nic_bandwidth_gbs: f64,
    /// Per message, microseconds.
    pub latency_us: f64,
    /// Share of the bandwidth a ring collective reaches.
    pub achievable: f64,
}

/// One tier of links as the alpha-beta model sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Link {
    /// Seconds per message.
    pub alpha: f64,
    /// Bytes per second one rank moves in one direction.
    pub bandwidth: f64,
}

impl Profile {
    /// Names of the shipped profiles.
    pub fn shipped() -> Vec<&'static str> {
        SHIPPED.iter().map(|s| s.0).collect()
    }

    /// A shipped profile by name, or a profile file (a path: contains `/` or ends in `.toml`).
    pub fn load(name_or_path: &str) -> Result<Profile> {
        if name_or_path.contains('/') || name_or_path.ends_with(".toml") {
            let text = std::fs::read_to_string(name_or_path).map_err(|e| {
                Error::file(
                    name_or_path,
                    None,
                    format!("cannot read the machine profile: {e}"),
                )
            })?;
            return Profile::parse(&text, name_or_path);
        }
        match SHIPPED
            .iter()
            .find(|s| s.0 == name_or_path.to_ascii_lowercase())
        {
            Some((name, text)) => Profile::parse(text, &format!("jobs/machines/{name}.toml")),
            None => Err(Error::config(
                "--machine",
                format!(
                    "unknown machine `{name_or_path}` (known: {}; or a path to a profile TOML)",
                    Profile::shipped().join(", ")
                ),
            )),
        }
    }

    /// Parses and validates `text`; `file` names it in errors.
    pub fn parse(text: &str, file: &str) -> Result<Profile> {
        let de = toml::Deserializer::new(text);
        let profile: Profile = serde_path_to_error::deserialize(de).map_err(|e| {
            let path = e.path().to_string();
            let msg = e.inner().message().trim().to_string();
            let key = match (path.as_str(), missing_field(&msg)) {
                (".", Some(f)) => f.to_string(),
                (p, Some(f)) => format!("{p}.{f}"),
                (p, None) => p.to_string(),
            };
            Error::config(format!("{file}: {key}"), msg)
        })?;
        profile.validate().map_err(|e| match e {
            Error::Config { key, msg } => Error::config(format!("{file}: {key}"), msg),
            other => other,
        })?;
        Ok(profile)
    }

    /// The profile as TOML (what `plan calibrate` writes).
    pub fn to_toml(&self) -> Result<String> {
        toml::to_string(self)
            .map_err(|e| Error::InvalidArgument(format!("profile {}: {e}", self.name)))
    }

    fn validate(&self) -> Result<()> {
        self.validate_node()?;
        self.validate_compute()?;
        self.validate_memory()?;
        self.validate_links()?;
        self.validate_collectives()?;
        self.validate_overhead()
    }

    /// The node: device arm, devices and cores per node.
    fn validate_node(&self) -> Result<()> {
        if self.devices_per_node == 0 {
            return Err(Error::config("devices_per_node", "must be at least 1"));
        }
        if !["cpu", "cuda", "hip", "emu"].contains(&self.device.as_str()) {
            return Err(Error::config(
                "device",
                format!("`{}` is not cpu, cuda, hip or emu", self.device),
            ));
        }
        if let Some(c) = self.cores_per_node {
            positive("cores_per_node", c)?;
        }
        Ok(())
    }

    /// Peaks and the GEMM efficiency model.
    fn validate_compute(&self) -> Result<()> {
        if self.compute.peak_tflops.is_empty() {
            return Err(Error::config(
                "compute.peak_tflops",
                "names no precision (e.g. bf16 = 312.0)",
            ));
        }
        for (p, v) in &self.compute.peak_tflops {
            positive(&format!("compute.peak_tflops.{p}"), *v)?;
        }
        fraction(
            "compute.gemm.max_efficiency",
            self.compute.gemm.max_efficiency,
        )?;
        positive("compute.gemm.half_dim", self.compute.gemm.half_dim)?;
        for (i, g) in self.compute.measured.iter().enumerate() {
            positive(&format!("compute.measured[{i}].tflops"), g.tflops)?;
            if g.m == 0 || g.n == 0 || g.k == 0 {
                return Err(Error::config(
                    format!("compute.measured[{i}]"),
                    "m, n and k must be at least 1",
                ));
            }
        }
        Ok(())
    }

    /// Capacity, bandwidth and the reserved share of one device's memory.
    fn validate_memory(&self) -> Result<()> {
        positive("memory.per_device_gb", self.memory.per_device_gb)?;
        positive("memory.bandwidth_gbs", self.memory.bandwidth_gbs)?;
        non_negative("memory.reserved_gb", self.memory.reserved_gb)
    }

    /// The intra- and inter-node links.
    fn validate_links(&self) -> Result<()> {
        positive("intra.bandwidth_gbs", self.intra.bandwidth_gbs)?;
        if let Some(p) = self.intra.pair_bandwidth_gbs {
            positive("intra.pair_bandwidth_gbs", p)?;
        }
        positive("intra.latency_us", self.intra.latency_us)?;
        fraction("intra.achievable", self.intra.achievable)?;
        if self.inter.nics_per_node == 0 {
            return Err(Error::config("inter.nics_per_node", "must be at least 1"));
        }
        positive("inter.nic_bandwidth_gbs", self.inter.nic_bandwidth_gbs)?;
        positive("inter.latency_us", self.inter.latency_us)?;
        fraction("inter.achievable", self.inter.achievable)
    }

    /// The measured collective fits.
    fn validate_collectives(&self) -> Result<()> {
        for (i, f) in self.collectives.iter().enumerate() {
            let key = |k: &str| format!("collectives[{i}].{k}");
            if !super::collfit::COLLECTIVES.contains(&f.coll.as_str()) {
                return Err(Error::config(
                    key("coll"),
                    format!(
                        "`{}` is not one of {:?}",
                        f.coll,
                        super::collfit::COLLECTIVES
                    ),
                ));
            }
            if !["intra", "inter"].contains(&f.tier.as_str()) {
                return Err(Error::config(
                    key("tier"),
                    format!("`{}` is not intra or inter", f.tier),
                ));
            }
            if f.ranks < 2 {
                return Err(Error::config(key("ranks"), "must be at least 2"));
            }
            positive(&key("latency_us"), f.latency_us)?;
            positive(&key("busbw_gbs"), f.busbw_gbs)?;
        }
        Ok(())
    }

    /// The measured fixed costs.
    fn validate_overhead(&self) -> Result<()> {
        non_negative("overhead.block_ms", self.overhead.block_ms)?;
        non_negative("overhead.step_ms", self.overhead.step_ms)
    }

    /// Dense peak FLOP/s of one device at `precision`; an error names the missing key.
    pub fn peak_flops(&self, precision: &str) -> Result<f64> {
        self.compute
            .peak_tflops
            .get(precision)
            .map(|t| t * 1e12)
            .ok_or_else(|| {
                let known: Vec<&str> = self
                    .compute
                    .peak_tflops
                    .keys()
                    .map(|k| k.as_str())
                    .collect();
                Error::config(
                    format!("compute.peak_tflops.{precision}"),
                    format!(
                        "machine `{}` has no peak for {precision} (it has: {})",
                        self.name,
                        known.join(", ")
                    ),
                )
            })
    }

    /// Efficiency (share of `peak`) of an (m, n, k) GEMM: the nearest measured shape (log
    /// distance) when the profile has measurements, else the curve.
    pub fn gemm_efficiency(&self, m: usize, n: usize, k: usize, peak: f64) -> f64 {
        let ln = |x: usize| (x.max(1) as f64).ln();
        let nearest = self.compute.measured.iter().min_by(|a, b| {
            let d = |g: &GemmPoint| {
                (ln(g.m) - ln(m)).powi(2) + (ln(g.n) - ln(n)).powi(2) + (ln(g.k) - ln(k)).powi(2)
            };
            d(a).total_cmp(&d(b))
        });
        if let Some(g) = nearest {
            return (g.tflops * 1e12 / peak).min(1.0);
        }
        let c = self.compute.gemm;
        let f = |d: usize| d as f64 / (d as f64 + c.half_dim);
        c.max_efficiency * f(m) * f(n) * f(k)
    }

    /// Links between devices of one node; `pair` for a group of the two GCDs of one package.
    pub fn intra_link(&self, pair: bool) -> Link {
        let bw = match (pair, self.intra.pair_bandwidth_gbs) {
            (true, Some(p)) => p,
            _ => self.intra.bandwidth_gbs,
        };
        Link {
            alpha: self.intra.latency_us * 1e-6,
            bandwidth: bw * 1e9 * self.intra.achievable,
        }
    }

    /// Links between nodes as one rank sees them when `sharing` ranks of its node use the NICs at
    /// once (each gets `nics * bandwidth / sharing`, at most one NIC's worth... or more when a
    /// rank has several NICs to itself).
    pub fn inter_link(&self, sharing: usize) -> Link {
        let node = self.inter.nics_per_node as f64
            * self.inter.nic_bandwidth_gbs
            * 1e9
            * self.inter.achievable;
        Link {
            alpha: self.inter.latency_us * 1e-6,
            bandwidth: node / sharing.max(1) as f64,
        }
    }

    /// Memory a job may use on one device, bytes.
    pub fn usable_bytes(&self) -> f64 {
        (self.memory.per_device_gb - self.memory.reserved_gb).max(0.0) * 1e9
    }
}

/// `v` must be finite and positive; the error names `key`.
fn positive(key: &str, v: f64) -> Result<()> {
    if v.is_finite() && v > 0.0 {
        Ok(())
    } else {
        Err(Error::config(
            key,
            format!("{v} must be a finite positive number"),
        ))
    }
}

/// `v` must be a fraction in (0, 1]; the error names `key`.
fn fraction(key: &str, v: f64) -> Result<()> {
    if v.is_finite() && v > 0.0 && v <= 1.0 {
        Ok(())
    } else {
        Err(Error::config(
            key,
            format!("{v} must be a fraction in (0, 1]"),
        ))
    }
}

/// `v` must be finite and not negative; the error names `key`.
fn non_negative(key: &str, v: f64) -> Result<()> {
    if v.is_finite() && v >= 0.0 {
        Ok(())
    } else {
        Err(Error::config(
            key,
            format!("{v} must be a finite number >= 0"),
        ))
    }
}

/// `x` of serde's "missing field `x`".
fn missing_field(msg: &str) -> Option<&str> {
    msg.strip_prefix("missing field `")?.split('`').next()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shipped_profiles_load() {
        for name in Profile::shipped() {
            let p = Profile::load(name).unwrap();
            assert_eq!(p.name, name);
            assert_eq!(p.devices_per_node, 8);
        }
        let f = Profile::load("frontier").unwrap();
        assert_eq!(f.peak_flops("bf16").unwrap(), 191.5e12);
        assert_eq!(f.memory.per_device_gb, 64.0);
        assert_eq!(
            (f.inter.nics_per_node, f.inter.nic_bandwidth_gbs),
            (4, 25.0)
        );
        let a = Profile::load("dgx-a100").unwrap();
        assert_eq!(
            (
                a.peak_flops("bf16").unwrap(),
                a.memory.per_device_gb,
                a.intra.bandwidth_gbs
            ),
            (312e12, 80.0, 300.0)
        );
    }

    #[test]
    fn errors_name_the_field() {
        let text = Profile::load("frontier").unwrap().to_toml().unwrap();
        let err = |t: &str| Profile::parse(t, "m.toml").unwrap_err().to_string();
        let missing = text.replace("bandwidth_gbs = 1600.0\n", "");
        assert!(
            err(&missing).contains("m.toml: memory.bandwidth_gbs"),
            "{}",
            err(&missing)
        );
        let zero = text.replace("bandwidth_gbs = 1600.0", "bandwidth_gbs = 0.0");
        assert!(
            err(&zero).contains("memory.bandwidth_gbs"),
            "{}",
            err(&zero)
        );
        let typo = text.replace("latency_us = 4.0", "latency = 4.0");
        assert!(err(&typo).contains("inter"), "{}", err(&typo));
        let unknown = Profile::load("summit").unwrap_err().to_string();
        assert!(
            unknown.contains("--machine") && unknown.contains("frontier"),
            "{unknown}"
        );
        let fp8 = Profile::load("frontier")
            .unwrap()
            .peak_flops("fp8")
            .unwrap_err()
            .to_string();
        assert!(fp8.contains("compute.peak_tflops.fp8"), "{fp8}");
        let fit = "\n[[collectives]]\ncoll = \"all_reduce\"\nalgo = \"ring\"\ntier = \"intra\"\nranks = 4\n\
                   latency_us = 20.0\nbusbw_gbs = 5.0\npoints = 6\nmax_error_pct = 3.0\n";
        let with_fit = format!("{text}{fit}");
        assert_eq!(
            Profile::parse(&with_fit, "m.toml")
                .unwrap()
                .collectives
                .len(),
            1
        );
        let bcast = with_fit.replace("coll = \"all_reduce\"", "coll = \"bcast\"");
        assert!(
            err(&bcast).contains("m.toml: collectives[0].coll"),
            "{}",
            err(&bcast)
        );
        let one = with_fit.replace("ranks = 4", "ranks = 1");
        assert!(err(&one).contains("collectives[0].ranks"), "{}", err(&one));
        let cores = text.replace(
            "devices_per_node = 8\n",
            "devices_per_node = 8\ncores_per_node = 0.0\n",
        );
        assert!(
            err(&cores).contains("m.toml: cores_per_node"),
            "{}",
            err(&cores)
        );
        let two = text.replace(
            "devices_per_node = 8\n",
            "devices_per_node = 8\ncores_per_node = 2.0\n",
        );
        assert_eq!(
            Profile::parse(&two, "m.toml").unwrap().cores_per_node,
            Some(2.0)
        );
        let neg = format!("{text}\n[overhead]\nblock_ms = -1.0\nstep_ms = 0.0\n");
        assert!(err(&neg).contains("overhead.block_ms"), "{}", err(&neg));
    }

    #[test]
    fn gemm_efficiency_grows_with_size_and_uses_measurements() {
        let mut p = Profile::load("dgx-a100").unwrap();
        let peak = p.peak_flops("bf16").unwrap();
        let (small, big) = (
            p.gemm_efficiency(64, 64, 64, peak),
            p.gemm_efficiency(8192, 8192, 8192, peak),
        );
        assert!(small < 0.1 && big <= 0.8 && big > 0.7, "{small} {big}");
        p.compute.measured = vec![
            GemmPoint {
                m: 64,
                n: 64,
                k: 64,
                tflops: 3.12,
            },
            GemmPoint {
                m: 4096,
                n: 4096,
                k: 4096,
                tflops: 156.0,
            },
        ];
        assert!((p.gemm_efficiency(100, 50, 70, peak) - 0.01).abs() < 1e-12);
        assert!((p.gemm_efficiency(8192, 8192, 2048, peak) - 0.5).abs() < 1e-12);
    }
}
