//! The `[parallel]` section of a job: the tp x pp x dp sizes, ZeRO stage, pipeline schedule,
//! stage split and grid axis order, as the job names them. Validation against the model and the
//! world size is the job configuration's (`config`); this module only defines the values and
//! their defaults, so that the grid and the schedules need nothing above them.

use serde::{Deserialize, Serialize};

/// The pipeline schedule a job names (`parallel.schedule`); the schedule itself, with its
/// chunk count, is [`super::schedule::Schedule`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ScheduleName {
    /// All forwards, then all backwards.
    #[serde(rename = "gpipe")]
    GPipe,
    /// One forward, one backward in steady state.
    #[serde(rename = "1f1b")]
    OneFOneB,
    /// 1F1B over `virtual_stages` model chunks per rank.
    #[serde(rename = "interleaved")]
    Interleaved,
}

/// One axis of the 3D process grid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Axis {
    /// Tensor parallel.
    Tp,
    /// Pipeline parallel.
    Pp,
    /// Data parallel.
    Dp,
}

/// Order of the grid axes in the world rank, innermost (fastest-varying) first, e.g. `tp-pp-dp`:
/// tensor-parallel peers are adjacent ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct AxisOrder(pub [Axis; 3]);

impl TryFrom<String> for AxisOrder {
    type Error = String;

    fn try_from(s: String) -> std::result::Result<Self, String> {
        let axes: Vec<Axis> = s
            .split('-')
            .map(|a| match a {
                "tp" => Ok(Axis::Tp),
                "pp" => Ok(Axis::Pp),
                "dp" => Ok(Axis::Dp),
                other => Err(format!("`{other}` in `{s}` is not tp, pp or dp")),
            })
            .collect::<std::result::Result<_, _>>()?;
        match axes[..] {
            [a, b, c] if a != b && b != c && a != c => Ok(AxisOrder([a, b, c])),
            _ => Err(format!(
                "`{s}` must name each of tp, pp, dp once, e.g. `tp-pp-dp`"
            )),
        }
    }
}

impl From<AxisOrder> for String {
    fn from(o: AxisOrder) -> String {
        let name = |a: Axis| match a {
            Axis::Tp => "tp",
            Axis::Pp => "pp",
            Axis::Dp => "dp",
        };
        o.0.map(name).join("-")
    }
}

/// `[parallel]`: the 3D process grid and how each axis works.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ParallelConfig {
    /// Tensor-parallel degree; divides `model.n_head` (default 1).
    pub tp: usize,
    /// Pipeline-parallel degree, at most `model.n_layer` (default 1).
    pub pp: usize,
    /// Data-parallel degree (default 1).
    pub dp: usize,
    /// ZeRO stage 0-3 over the data-parallel group (default 0).
    pub zero: u8,
    /// Shard layernorm/dropout activations along the sequence over the TP group; needs tp > 1
    /// (default false).
    pub sequence_parallel: bool,
    /// Pipeline schedule: `gpipe`, `1f1b` (default) or `interleaved`.
    pub schedule: ScheduleName,
    /// Pipeline micro-batches per step (default 1).
    pub microbatches: usize,
    /// Model chunks per pipeline rank; above 1 only with `interleaved` (default 1).
    pub virtual_stages: usize,
    /// Blocks of each of the `pp * virtual_stages` pipeline stages, in pipeline order (chunk `c`
    /// of pipeline rank `r` is stage `c * pp + r`); empty (default): balanced by estimated compute,
    /// the last stage's head counted (see `parallel::stage_split`).
    pub stage_layers: Vec<usize>,
    /// Gradient bucket size in MiB, fractions allowed (default 25).
    pub bucket_mb: f64,
    /// Grid axis order, innermost first (default `tp-pp-dp`).
    pub order: AxisOrder,
    /// How the data-parallel ranks combine gradients: `allreduce` (default) or `ps` (parameter
    /// servers, configured in `[ps]`).
    pub dp_sync: DpSync,
}

/// How data-parallel gradients are combined (`parallel.dp_sync`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum DpSync {
    /// Collectives among the data-parallel ranks (ZeRO 0-3).
    #[serde(rename = "allreduce")]
    AllReduce,
    /// Workers push gradients to parameter servers and pull the updated parameters.
    #[serde(rename = "ps")]
    Ps,
}

impl Default for ParallelConfig {
    fn default() -> Self {
        ParallelConfig {
            tp: 1,
            pp: 1,
            dp: 1,
            zero: 0,
            sequence_parallel: false,
            schedule: ScheduleName::OneFOneB,
            microbatches: 1,
            virtual_stages: 1,
            stage_layers: Vec::new(),
            bucket_mb: 25.0,
            order: AxisOrder([Axis::Tp, Axis::Pp, Axis::Dp]),
            dp_sync: DpSync::AllReduce,
        }
    }
}
