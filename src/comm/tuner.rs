//! The collective tuner: one table that says, for each collective, world size, link kind and size
//! bucket, which schedule family (ring, direct, read) and chunk size carries a call.
//!
//! Why: the best schedule depends on the size (direct all-pairs exchanges win on latency, the
//! pipelined ring and the single-copy reads on bandwidth, and where the cross-overs lie depends on
//! the machine and on the world size); one threshold and one probe per communicator cannot choose
//! for every size. The table is measured by `meshtrain bench --tune`, which times every candidate
//! per size and writes the winners to a TOML file; a job loads one with `MESHTRAIN_TUNING=FILE`
//! (`off`: the fixed size threshold of [`crate::comm::CommConfig`]), and without one uses the
//! table built into the binary (measured on the development machine, `tuning_default.toml`).
//!
//! Invariants:
//! - [`Tuning::select`] is a pure function of (table, collective, world size, link kind, bytes):
//!   every member of a communicator holds the same table (the job-wide environment names it) and
//!   therefore picks the same schedule;
//! - a table that parses is valid: every rule names a known collective, a schedule that exists for
//!   it, a world size >= 2 and a chunk size that is a positive multiple of 64 bytes; anything else
//!   is an error naming the file, the rule and the field;
//! - world sizes the table does not list use the rules of the nearest listed size below (or the
//!   smallest listed one); a size above every bucket uses the last bucket.

use std::fmt;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::comm::tuning::{Algo, Cma, CommConfig};
use crate::error::{Error, Result};

/// The table compiled into the binary (`meshtrain bench --tune` on the development machine).
const BUILTIN: &str = include_str!("tuning_default.toml");

/// The collectives the tuner chooses for.
pub const TUNED: [&str; 6] = ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "all_to_all"];

/// Schedule families a rule may name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    /// Pipelined ring (every collective but all-to-all).
    Ring,
    /// All pairs through the FIFOs.
    Direct,
    /// Single copy: peers read each other's buffers (all-reduce, all-gather, broadcast,
    /// all-to-all).
    Read,
    /// Hierarchical (communicators spanning nodes, all-reduce, reduce-scatter, all-gather,
    /// broadcast, reduce): a stage within each node, one between nodes per segment, a stage within
    /// each node again; each stage picks its own schedule from this table. The chunk is unused.
    Hier,
    /// All-reduce only: a reduce-scatter, then an all-gather, each half with the (flat) schedule
    /// and chunk this table picks for that collective at the same byte size
    /// ([`crate::comm::algo::split`]). The chunk is unused.
    Split,
}

impl Family {
    /// Lower-case name, as in the table.
    pub fn name(self) -> &'static str {
        match self {
            Family::Ring => "ring",
            Family::Direct => "direct",
            Family::Read => "read",
            Family::Hier => "hier",
            Family::Split => "split",
        }
    }

    /// Whether `coll` has a schedule of this family.
    pub fn serves(self, coll: &str) -> bool {
        match self {
            Family::Ring => coll != "all_to_all",
            Family::Direct => true,
            Family::Read => matches!(coll, "all_reduce" | "all_gather" | "broadcast" | "all_to_all"),
            Family::Hier => matches!(coll, "all_reduce" | "reduce_scatter" | "all_gather" | "broadcast" | "reduce"),
            Family::Split => coll == "all_reduce",
        }
    }
}

/// Links between the members of a communicator, as the tuner tells them apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LinkKind {
    /// Every member on one node (shared memory).
    Shm,
    /// Members on several nodes (network links on the ring).
    Net,
}

impl LinkKind {
    /// Lower-case name, as in the table.
    pub fn name(self) -> &'static str {
        match self {
            LinkKind::Shm => "shm",
            LinkKind::Net => "net",
        }
    }
}

/// The schedule chosen for one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Choice {
    /// Schedule family.
    pub family: Family,
    /// Largest piece a schedule puts on a link, bytes (capped by the communicator's chunk size).
    pub chunk_bytes: usize,
}

impl fmt::Display for Choice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (chunk {})", self.family.name(), self.chunk_bytes)
    }
}

/// One row of the table: calls of `coll` on `ranks` members over `link` links with at most
/// `max_bytes` bytes (no bound when absent) use `algo` in pieces of `chunk_bytes`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rule {
    /// Collective (one of [`TUNED`]).
    pub coll: String,
    /// World size the rule was measured on (>= 2).
    pub ranks: usize,
    /// Link kind.
    pub link: LinkKind,
    /// Largest whole-buffer size the rule covers, bytes; absent: every larger size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_bytes: Option<usize>,
    /// Schedule family.
    pub algo: Family,
    /// Chunk size, bytes (a positive multiple of 64).
    pub chunk_bytes: usize,
}

#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    rule: Vec<Rule>,
}

/// A validated tuning table and where it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tuning {
    /// The file it was read from, or `built-in`.
    pub source: String,
    rules: Vec<Rule>,
    /// The rules grouped for [`Tuning::select`], which runs on every call: no allocation, no
    /// string comparison per rule.
    groups: Vec<Group>,
}

/// The rules of one collective (index into [`TUNED`]) over one link kind measured on one world
/// size, as (bound, choice) by bound (`usize::MAX`: no bound).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Group {
    coll: usize,
    link: LinkKind,
    ranks: usize,
    buckets: Vec<(usize, Choice)>,
}

fn group_rules(rules: &[Rule]) -> Vec<Group> {
    let mut groups: Vec<Group> = Vec::new();
    for r in rules {
        let coll = TUNED.iter().position(|t| *t == r.coll).expect("validated: a tuned collective");
        let bucket = (r.max_bytes.unwrap_or(usize::MAX), Choice { family: r.algo, chunk_bytes: r.chunk_bytes });
        match groups.iter_mut().find(|g| (g.coll, g.link, g.ranks) == (coll, r.link, r.ranks)) {
            Some(g) => g.buckets.push(bucket),
            None => groups.push(Group { coll, link: r.link, ranks: r.ranks, buckets: vec![bucket] }),
        }
    }
    // Stable: rules with the same bound keep table order, as the per-call filter and sort did.
    groups.iter_mut().for_each(|g| g.buckets.sort_by_key(|b| b.0));
    groups
}

impl Tuning {
    /// The table compiled into the binary.
    pub fn builtin() -> Result<Tuning> {
        Tuning::parse(BUILTIN, "built-in tuning table")
    }

    /// Reads and validates a table file.
    pub fn load(path: &Path) -> Result<Tuning> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| bad(&path.display().to_string(), "cannot read the tuning table", e))?;
        Tuning::parse(&text, &path.display().to_string())
    }

    /// A table of `rules` (validated as a file would be).
    pub fn from_rules(rules: Vec<Rule>, source: &str) -> Result<Tuning> {
        for (i, r) in rules.iter().enumerate() {
            validate(r).map_err(|(field, msg)| bad(source, &format!("rule[{i}].{field}"), msg))?;
        }
        Ok(Tuning { source: source.to_string(), groups: group_rules(&rules), rules })
    }

    /// Parses and validates the text of a table; errors name `source`, the rule and the field.
    pub fn parse(text: &str, source: &str) -> Result<Tuning> {
        let de = toml::Deserializer::new(text);
        let file: File = serde_path_to_error::deserialize(de).map_err(|e| {
            let path = e.path().to_string();
            bad(source, if path == "." { "(top level)" } else { &path }, e.into_inner().message().trim().to_string())
        })?;
        Tuning::from_rules(file.rule, source)
    }

    /// The rules, in table order.
    pub fn rules(&self) -> &[Rule] {
        &self.rules
    }

    /// The table as TOML (what `bench --tune` writes), after `header` comment lines.
    pub fn to_toml(&self, header: &[String]) -> Result<String> {
        let body = toml::to_string(&File { rule: self.rules.clone() })
            .map_err(|e| Error::Check(format!("tuning table to TOML: {e}")))?;
        let mut out: String = header.iter().map(|h| format!("# {h}\n")).collect();
        out.push('\n');
        out.push_str(&body);
        Ok(out)
    }

    /// The rules that serve `coll` on `ranks` members over `link`: those measured on the nearest
    /// world size at or below `ranks`, else on the smallest (see the module invariants).
    fn group_for(&self, coll: &str, ranks: usize, link: LinkKind) -> Option<&Group> {
        let c = TUNED.iter().position(|t| *t == coll)?;
        let (mut below, mut smallest): (Option<&Group>, Option<&Group>) = (None, None);
        for g in self.groups.iter().filter(|g| g.coll == c && g.link == link) {
            if g.ranks <= ranks && below.is_none_or(|b| g.ranks > b.ranks) {
                below = Some(g);
            }
            if smallest.is_none_or(|s| g.ranks < s.ranks) {
                smallest = Some(g);
            }
        }
        below.or(smallest)
    }

    /// The schedule for a call of `coll` on `ranks` members over `link` with `bytes` bytes;
    /// `None` when the table has no rule for the collective and link kind.
    pub fn select(&self, coll: &str, ranks: usize, link: LinkKind, bytes: usize) -> Option<Choice> {
        let g = self.group_for(coll, ranks, link)?;
        g.buckets.iter().find(|(max, _)| bytes <= *max).or(g.buckets.last()).map(|(_, choice)| *choice)
    }

    /// One line per tuned collective: the buckets that serve `ranks` members over `link` (what a
    /// communicator logs once).
    /// A `split` bucket names the schedules of its halves over the bucket's sizes.
    pub fn describe(&self, ranks: usize, link: LinkKind) -> Vec<String> {
        TUNED
            .iter()
            .filter_map(|&coll| {
                let g = self.group_for(coll, ranks, link)?;
                let mut lo = 0;
                let buckets: Vec<String> = g
                    .buckets
                    .iter()
                    .map(|&(max, choice)| {
                        let hi = (max != usize::MAX).then_some(max);
                        let family = match choice.family {
                            Family::Split => format!("split [{}]", self.split_halves(ranks, link, lo, hi)),
                            f => f.name().to_string(),
                        };
                        lo = max;
                        match hi {
                            Some(m) => format!("<={m} {family} ({})", choice.chunk_bytes),
                            None => format!("rest {family} ({})", choice.chunk_bytes),
                        }
                    })
                    .collect();
                Some(format!("{coll} [as measured on {} ranks]: {}", g.ranks, buckets.join(", ")))
            })
            .collect()
    }

    /// The schedules of a split all-reduce's halves on `ranks` members over `link` for sizes above
    /// `lo` up to `hi` bytes (`None`: no bound), as the log names them.
    pub fn split_halves(&self, ranks: usize, link: LinkKind, lo: usize, hi: Option<usize>) -> String {
        let span = Span { ranks, link, hier: false };
        format!(
            "reduce_scatter {} + all_gather {}",
            self.halves_in(span, "reduce_scatter", lo, hi),
            self.halves_in(span, "all_gather", lo, hi)
        )
    }

    /// The schedules (family/chunk) the table gives `coll` for sizes above `lo` up to `hi` bytes
    /// (`None`: no bound), in size order: what a split all-reduce's half runs there.
    fn halves_in(&self, span: Span, coll: &str, lo: usize, hi: Option<usize>) -> String {
        let Some(g) = self.group_for(coll, span.ranks, span.link) else {
            return "(fixed rule)".to_string();
        };
        let hi = hi.unwrap_or(usize::MAX);
        let name = |c: Choice| {
            // A half runs flat: the communicator runs a `hier` half as the ring.
            let family = if c.family == Family::Hier { Family::Ring } else { c.family };
            format!("{}/{}", family.name(), c.chunk_bytes)
        };
        let mut prev = 0;
        let mut seen: Vec<String> = Vec::new();
        for &(max, choice) in &g.buckets {
            if max > lo && prev < hi && seen.last() != Some(&name(choice)) {
                seen.push(name(choice));
            }
            prev = max;
        }
        match (seen.is_empty(), g.buckets.last()) {
            // Every bucket ends at or below `lo`: the last one serves the larger sizes.
            (true, Some(&(_, last))) => name(last),
            _ => seen.join(" then "),
        }
    }
}

/// The schedule for one call of `coll` with `bytes` bytes on `span.ranks` members over
/// `span.link`: a forced setting first (`MESHTRAIN_CMA=on` for the collectives with a read
/// schedule, then `MESHTRAIN_ALGO=ring|direct`, or `split` for all-reduce; all flat), then the
/// table, then the fixed rule
/// (hierarchical where `span.hier` says the communicator can run it, else direct up to
/// `small_bytes`, reads above it for all-reduce and all-gather within a node, the ring otherwise).
/// `span.hier`: the members span several nodes, some node holds >= 2 of them and
/// `MESHTRAIN_HIER` is not off; a table's `hier` without it is the ring. `MESHTRAIN_CMA=off` turns
/// a read the table chose into the ring. The chunk never exceeds the communicator's, for which its
/// links were sized.
pub fn choose(cfg: &CommConfig, table: Option<&Tuning>, coll: &str, span: Span, bytes: usize) -> Choice {
    let full = |family| Choice { family, chunk_bytes: cfg.chunk_bytes };
    match (cfg.cma, cfg.algo) {
        (Cma::On, _) if Family::Read.serves(coll) => return full(Family::Read),
        (_, Algo::Ring) => return full(Family::Ring),
        (_, Algo::Direct) => return full(Family::Direct),
        (_, Algo::Split) if Family::Split.serves(coll) => return full(Family::Split),
        _ => {}
    }
    if let Some(c) = table.and_then(|t| t.select(coll, span.ranks, span.link, bytes)) {
        let family = match c.family {
            Family::Read if cfg.cma == Cma::Off => Family::Ring,
            Family::Hier if !span.hier => Family::Ring,
            f => f,
        };
        return Choice { family, chunk_bytes: c.chunk_bytes.min(cfg.chunk_bytes) };
    }
    match cfg.cma {
        _ if span.hier && Family::Hier.serves(coll) => full(Family::Hier),
        _ if bytes <= cfg.small_bytes => full(Family::Direct),
        // Reads need the peer's memory on this node.
        Cma::Auto if span.link == LinkKind::Shm && matches!(coll, "all_reduce" | "all_gather") => full(Family::Read),
        _ => full(Family::Ring),
    }
}

/// What the tuner knows of a communicator: its size, its link kind and whether it can run the
/// hierarchical schedules (see [`choose`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    /// Members.
    pub ranks: usize,
    /// Link kind.
    pub link: LinkKind,
    /// Whether the hierarchical schedules may be used.
    pub hier: bool,
}

fn bad(source: &str, field: &str, msg: impl fmt::Display) -> Error {
    Error::config("MESHTRAIN_TUNING", format!("{source}: {field}: {msg}"))
}

/// What is wrong with one rule: (field, message).
fn validate(r: &Rule) -> std::result::Result<(), (&'static str, String)> {
    if !TUNED.contains(&r.coll.as_str()) {
        return Err(("coll", format!("`{}` is not one of {}", r.coll, TUNED.join(", "))));
    }
    if r.ranks < 2 {
        return Err(("ranks", format!("{} (a rule is for a world of at least 2 ranks)", r.ranks)));
    }
    if r.max_bytes == Some(0) {
        return Err(("max_bytes", "0 (leave it out for no bound)".to_string()));
    }
    if !r.algo.serves(&r.coll) {
        return Err(("algo", format!("`{}` has no {} schedule", r.coll, r.algo.name())));
    }
    if r.algo == Family::Hier && r.link != LinkKind::Net {
        return Err(("algo", "`hier` needs link = \"net\" (members on several nodes)".to_string()));
    }
    if r.chunk_bytes < 64 || r.chunk_bytes % 64 != 0 {
        return Err(("chunk_bytes", format!("{} is not a positive multiple of 64", r.chunk_bytes)));
    }
    Ok(())
}

#[cfg(test)]
#[path = "tuner_tests.rs"]
mod tests;
