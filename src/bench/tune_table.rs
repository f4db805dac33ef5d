//! `meshtrain bench --tune`: measures every schedule candidate of every tuned collective per size
//! on the running communicator and writes the winners as a tuning table
//! ([`crate::comm::tuner`]) that jobs load with `MESHTRAIN_TUNING=FILE`.
//!
//! Why here and not at job start: a measurement takes minutes and is noisy on a shared machine;
//! it is made once per machine kind, read by a person, and shipped (the built-in table is one).
//!
//! Invariants:
//! - every candidate is timed under the benchmark's rule ([`collectives::time_calls`]: warm-up,
//!   barrier, timed calls, slowest rank), `rounds` times in alternation, its time the minimum;
//!   the times are the same on every rank, so every rank picks the same winners;
//! - a candidate is forced through a one-rule table ([`Communicator::set_tuning`]) that every rank
//!   installs between the same calls; the communicator's own table is restored afterwards;
//! - rules of the file for other world sizes or link kinds are kept, so runs at 2 and at 4 ranks
//!   build one table; the rules for this (world size, link kind) are replaced;
//! - reduce-scatter and all-gather are measured before all-reduce: the split all-reduce candidate
//!   runs under a table holding their rules measured in this run, so its halves are the winners
//!   this table will hold.

use std::path::Path;
use std::sync::Arc;

use crate::bench::collectives::{self, CollBench};
use crate::comm::probe::Reads;
use crate::comm::tuner::{Family, Rule, Tuning, TUNED};
use crate::comm::Communicator;
use crate::error::{Error, Result};

/// The order of measurement: the halves of the split all-reduce before it.
const ORDER: [&str; 6] = ["reduce_scatter", "all_gather", "all_reduce", "broadcast", "reduce", "all_to_all"];

/// Chunk sizes tried for the ring (each at most the communicator's chunk).
const RING_CHUNKS: [usize; 3] = [64 << 10, 256 << 10, 1 << 20];

/// One candidate's measurement at one size.
#[derive(Debug, Clone)]
pub struct Timed {
    /// Schedule family.
    pub family: Family,
    /// Chunk bytes.
    pub chunk_bytes: usize,
    /// Best of the rounds, microseconds per call (slowest rank).
    pub time_us: f64,
}

/// The candidates of one size of one collective, and the winner's index.
#[derive(Debug, Clone)]
pub struct SizeResult {
    /// Collective.
    pub coll: &'static str,
    /// Whole-buffer bytes.
    pub bytes: usize,
    /// Every candidate, in trial order.
    pub timed: Vec<Timed>,
    /// Index of the fastest candidate (the first among equals).
    pub best: usize,
}

/// The candidates for `coll` on a communicator whose chunk is `chunk` bytes (`hier`: it can run the
/// hierarchical schedules).
fn candidates(coll: &str, chunk: usize, reads: bool, hier: bool) -> Vec<(Family, usize)> {
    let mut out: Vec<(Family, usize)> = Vec::new();
    if Family::Ring.serves(coll) {
        out.extend(RING_CHUNKS.iter().filter(|&&c| c <= chunk).map(|&c| (Family::Ring, c)));
        if !RING_CHUNKS.contains(&chunk) {
            out.push((Family::Ring, chunk));
        }
    }
    out.push((Family::Direct, chunk));
    if reads && Family::Read.serves(coll) {
        out.push((Family::Read, chunk));
    }
    if hier && Family::Hier.serves(coll) {
        out.push((Family::Hier, chunk));
    }
    if Family::Split.serves(coll) {
        out.push((Family::Split, chunk));
    }
    out
}

/// Whether single-copy reads work on `c` (one forced read call probes, as a job would).
fn reads_work(c: &Communicator, b: &CollBench, chunk: usize) -> Result<bool> {
    force(c, "all_reduce", Family::Read, chunk, &[])?;
    collectives::time_calls::<f32>(c, &CollBench { warmup: 0, iters: 1, iter_bytes: 0, ..b.clone() }, "all_reduce", c.size())?;
    Ok(matches!(c.single_copy_reads(), Some(Reads::Pay | Reads::Slow(_))))
}

/// Installs a table that makes `coll` run `family`; a split all-reduce's halves get the rules
/// `measured` so far (the other collectives' winners of this run).
fn force(c: &Communicator, coll: &str, family: Family, chunk_bytes: usize, measured: &[SizeResult]) -> Result<()> {
    let mut rules = match family {
        Family::Split => rules_from(measured, c.size(), c.link_kind()),
        _ => Vec::new(),
    };
    rules.retain(|r| r.coll != coll);
    rules.push(Rule {
        coll: coll.to_string(),
        ranks: c.size(),
        link: c.link_kind(),
        max_bytes: None,
        algo: family,
        chunk_bytes,
    });
    c.set_tuning(Some(Arc::new(Tuning::from_rules(rules, "bench --tune candidate")?)));
    Ok(())
}

/// Times every candidate of every tuned collective at every size of `b` (f32, `rounds` rounds);
/// `emit` gets each size's result as it completes. Restores the communicator's table.
pub fn measure(
    c: &Communicator,
    b: &CollBench,
    chunk: usize,
    rounds: usize,
    mut emit: impl FnMut(&SizeResult),
) -> Result<Vec<SizeResult>> {
    if c.size() < 2 {
        return Err(Error::config("bench --tune", "needs at least 2 ranks (start it with mpirun -np N)"));
    }
    let own = c.tuning();
    let reads = reads_work(c, b, chunk)?;
    let mut out: Vec<SizeResult> = Vec::new();
    for coll in ORDER {
        let mut prev: Option<(Family, usize)> = None;
        for n in collectives::counts(b, c.size()) {
            let cands = candidates(coll, chunk, reads, c.hierarchical());
            let mut best_times = vec![f64::INFINITY; cands.len()];
            for _ in 0..rounds.max(1) {
                for (i, &(family, chunk_bytes)) in cands.iter().enumerate() {
                    force(c, coll, family, chunk_bytes, &out)?;
                    let t = collectives::time_calls::<f32>(c, b, coll, n)?;
                    best_times[i] = best_times[i].min(t);
                }
            }
            let timed: Vec<Timed> = cands
                .iter()
                .zip(&best_times)
                .map(|(&(family, chunk_bytes), &time_us)| Timed { family, chunk_bytes, time_us })
                .collect();
            let best = pick(&timed, prev);
            prev = Some((timed[best].family, timed[best].chunk_bytes));
            let r = SizeResult { coll, bytes: n * 4, timed, best };
            emit(&r);
            out.push(r);
        }
    }
    c.set_tuning(own);
    Ok(out)
}

/// Within this fraction of the fastest, the previous size's winner keeps the size: differences
/// smaller than the run-to-run noise should not cut a bucket.
const KEEP_WITHIN: f64 = 0.05;

/// The winner among `timed`: the fastest (the first among equals), unless `prev`, the previous
/// size's winner, is within [`KEEP_WITHIN`] of it.
fn pick(timed: &[Timed], prev: Option<(Family, usize)>) -> usize {
    let fastest = (0..timed.len()).fold(0, |b, i| if timed[i].time_us < timed[b].time_us { i } else { b });
    let kept = prev.and_then(|p| timed.iter().position(|t| (t.family, t.chunk_bytes) == p));
    match kept {
        Some(k) if timed[k].time_us <= timed[fastest].time_us * (1.0 + KEEP_WITHIN) => k,
        _ => fastest,
    }
}

/// The rules for `ranks` members over `link`: consecutive sizes with the same winner merge into
/// one bucket; a bucket ends at its largest measured size, the last one has no bound.
pub fn rules_from(results: &[SizeResult], ranks: usize, link: crate::comm::tuner::LinkKind) -> Vec<Rule> {
    let mut rules: Vec<Rule> = Vec::new();
    for coll in TUNED {
        let rows: Vec<&SizeResult> = results.iter().filter(|r| r.coll == coll).collect();
        for (i, r) in rows.iter().enumerate() {
            let w = &r.timed[r.best];
            let max_bytes = (i + 1 < rows.len()).then_some(r.bytes);
            match rules.last_mut() {
                Some(last) if last.coll == coll && last.algo == w.family && last.chunk_bytes == w.chunk_bytes => {
                    last.max_bytes = max_bytes;
                }
                _ => rules.push(Rule {
                    coll: coll.to_string(),
                    ranks,
                    link,
                    max_bytes,
                    algo: w.family,
                    chunk_bytes: w.chunk_bytes,
                }),
            }
        }
    }
    rules
}

/// Writes `rules` into the table at `path`, keeping its rules for other (world size, link kind)
/// pairs; a file that exists but does not parse is an error (it is not overwritten).
pub fn write_table(path: &Path, rules: Vec<Rule>, header: &[String]) -> Result<Tuning> {
    let Some(first) = rules.first().cloned() else {
        return Err(Error::Check("bench --tune: no rules measured".into()));
    };
    let mut all: Vec<Rule> = if path.exists() {
        Tuning::load(path)?.rules().iter().filter(|r| (r.ranks, r.link) != (first.ranks, first.link)).cloned().collect()
    } else {
        Vec::new()
    };
    all.extend(rules);
    all.sort_by(|a, b| (a.link.name(), a.ranks).cmp(&(b.link.name(), b.ranks)));
    let table = Tuning::from_rules(all, &path.display().to_string())?;
    let text = table.to_toml(header)?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir.display().to_string(), e))?;
    }
    std::fs::write(path, text).map_err(|e| Error::file(path, None, format!("writing the tuning table: {e}")))?;
    Ok(table)
}

/// One size's line: every candidate's time and the winner.
pub fn format_result(r: &SizeResult) -> String {
    let cells: Vec<String> =
        r.timed.iter().map(|t| format!("{}/{}K={:.1}", t.family.name(), t.chunk_bytes >> 10, t.time_us)).collect();
    let w = &r.timed[r.best];
    format!("{},{},{},best={}/{}K", r.coll, r.bytes, cells.join(" "), w.family.name(), w.chunk_bytes >> 10)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::testing::run_ranks;
    use crate::comm::tuner::LinkKind;
    use crate::comm::{CommConfig, DType, ReduceOp};

    fn sweep() -> CollBench {
        CollBench {
            colls: vec![],
            min_bytes: 256,
            max_bytes: 4096,
            factor: 4,
            dtype: DType::F32,
            op: ReduceOp::Sum,
            warmup: 1,
            iters: 2,
            iter_bytes: 0,
            inplace: false,
            vs_mpi: false,
            csv: true,
            exact_count: false,
        }
    }

    #[test]
    fn a_previous_winner_within_the_noise_keeps_the_size() {
        let t = |family, time_us| Timed { family, chunk_bytes: 1024, time_us };
        let timed = [t(Family::Ring, 10.0), t(Family::Direct, 10.4), t(Family::Read, 12.0)];
        assert_eq!(pick(&timed, None), 0);
        assert_eq!(pick(&timed, Some((Family::Direct, 1024))), 1);
        assert_eq!(pick(&timed, Some((Family::Read, 1024))), 0);
        assert_eq!(pick(&timed, Some((Family::Direct, 4096))), 0);
    }

    #[test]
    fn every_rank_measures_the_same_winners_and_the_rules_cover_every_size() {
        let cfg = CommConfig { chunk_bytes: 1024, ..CommConfig::default() };
        let results = run_ranks(3, cfg, |c| {
            let r = measure(&c, &sweep(), 1024, 1, |_| {}).unwrap();
            r.iter().map(|s| (s.coll, s.bytes, s.timed[s.best].family, s.timed[s.best].chunk_bytes)).collect::<Vec<_>>()
        });
        assert!(results.iter().all(|r| *r == results[0]), "{results:?}");
        assert_eq!(results[0].len(), TUNED.len() * 3);
        // Every all-reduce size timed the split candidate, after its halves were measured.
        let pos = |coll: &str| results[0].iter().position(|r| r.0 == coll).unwrap();
        assert!(pos("reduce_scatter") < pos("all_reduce") && pos("all_gather") < pos("all_reduce"));
        let fake: Vec<SizeResult> = results[0]
            .iter()
            .map(|&(coll, bytes, family, chunk_bytes)| SizeResult {
                coll,
                bytes,
                timed: vec![Timed { family, chunk_bytes, time_us: 1.0 }],
                best: 0,
            })
            .collect();
        let t = Tuning::from_rules(rules_from(&fake, 3, LinkKind::Shm), "test").unwrap();
        for &(coll, bytes, family, chunk_bytes) in &results[0] {
            let c = t.select(coll, 3, LinkKind::Shm, bytes).unwrap();
            assert_eq!((c.family, c.chunk_bytes), (family, chunk_bytes), "{coll} {bytes}");
        }
    }

    #[test]
    fn every_collective_is_measured_once_and_the_halves_before_all_reduce() {
        let mut order = ORDER.to_vec();
        order.sort_unstable();
        let mut tuned = TUNED.to_vec();
        tuned.sort_unstable();
        assert_eq!(order, tuned);
        assert!(candidates("all_reduce", 1 << 20, false, false).contains(&(Family::Split, 1 << 20)));
        assert!(!candidates("reduce_scatter", 1 << 20, true, true).iter().any(|c| c.0 == Family::Split));
    }

    #[test]
    fn the_split_candidate_runs_under_the_halves_measured_in_this_run() {
        let t = |family, chunk_bytes, time_us| Timed { family, chunk_bytes, time_us };
        let measured = vec![
            SizeResult { coll: "reduce_scatter", bytes: 1024, timed: vec![t(Family::Direct, 256, 1.0)], best: 0 },
            SizeResult { coll: "all_gather", bytes: 1024, timed: vec![t(Family::Ring, 512, 2.0), t(Family::Direct, 64, 1.0)], best: 1 },
        ];
        let picks = run_ranks(2, CommConfig { chunk_bytes: 1024, ..CommConfig::default() }, move |c| {
            force(&c, "all_reduce", Family::Split, 1024, &measured).unwrap();
            let mut v = vec![1.0f32; 300];
            c.all_reduce(&mut v, ReduceOp::Sum).unwrap();
            assert!(v.iter().all(|&x| x == 2.0));
            ["all_reduce", "reduce_scatter", "all_gather"].map(|coll| {
                let ch = c.planned_schedule(coll, 1 << 20);
                (ch.family, ch.chunk_bytes)
            })
        });
        assert_eq!(picks[0], [(Family::Split, 1024), (Family::Direct, 256), (Family::Direct, 64)]);
    }
}
