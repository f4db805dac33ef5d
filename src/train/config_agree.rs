//! Start-up check that every rank trains the same job: a rank whose effective config (file, `--set`
//! and `MESHTRAIN_*` overrides all applied) or binary version differs would silently train a
//! diverged replica (another seed, learning rate or micro-batch).
//!
//! Every rank hashes its flattened config (`key = value` lines, sorted, plus `meshtrain.version`);
//! the hashes are gathered on every rank (each rank fills its slot, one max-reduction). If they
//! differ, the lines of rank 0 and of the first rank that differs from it are broadcast, and every
//! rank returns the same error naming that rank and the keys that differ, so the whole job exits
//! non-zero before any training.

use sha2::{Digest, Sha256};

use crate::comm::{Communicator, ReduceOp};
use crate::config::JobConfig;
use crate::error::{Error, Result};

/// Keys whose differences are listed in the error (the rest are counted).
const SHOWN: usize = 8;

/// `cfg` as sorted `dotted.key = value` lines, with the binary's version.
fn flatten(cfg: &JobConfig) -> Vec<String> {
    fn walk(prefix: &str, table: &toml::Table, out: &mut Vec<String>) {
        for (k, v) in table {
            let key = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
            match v {
                toml::Value::Table(t) => walk(&key, t, out),
                other => out.push(format!("{key} = {other}")),
            }
        }
    }
    let table: toml::Table = toml::from_str(&cfg.to_toml()).expect("the effective config parses back");
    let mut lines = vec![format!("meshtrain.version = \"{}\"", env!("CARGO_PKG_VERSION"))];
    walk("", &table, &mut lines);
    lines.sort();
    lines
}

fn hash(lines: &[String]) -> i64 {
    let digest = Sha256::digest(lines.join("\n").as_bytes());
    i64::from_le_bytes(digest[..8].try_into().expect("a SHA-256 has 8 bytes"))
}

/// `root`'s `lines` on every rank of `world`.
fn broadcast_lines(world: &Communicator, root: usize, lines: &[String]) -> Result<Vec<String>> {
    let mut bytes = lines.join("\n").into_bytes();
    let mut len = [bytes.len() as i64];
    world.broadcast(&mut len, root)?;
    bytes.resize(len[0] as usize, 0);
    world.broadcast(&mut bytes, root)?;
    Ok(String::from_utf8_lossy(&bytes).lines().map(str::to_string).collect())
}

/// The keys on which `a` (rank 0's lines) and `b` differ, as `key: value vs value`.
fn differences(a: &[String], b: &[String]) -> Vec<String> {
    let split = |l: &String| l.split_once(" = ").map(|(k, v)| (k.to_string(), v.to_string())).unwrap_or((l.clone(), String::new()));
    let (a, b): (Vec<_>, Vec<_>) = (a.iter().map(split).collect(), b.iter().map(split).collect());
    let mut keys: Vec<&String> = a.iter().chain(&b).map(|(k, _)| k).collect();
    keys.sort();
    keys.dedup();
    let value = |side: &[(String, String)], k: &String| side.iter().find(|(x, _)| x == k).map_or("(unset)".to_string(), |(_, v)| v.clone());
    keys.into_iter()
        .filter_map(|k| {
            let (x, y) = (value(&a, k), value(&b, k));
            (x != y).then(|| format!("{k}: {y} (rank 0: {x})"))
        })
        .collect()
}

/// Collective over `world`: an error naming the differing keys unless every rank has `cfg`.
pub fn check(world: &Communicator, cfg: &JobConfig) -> Result<()> {
    let lines = flatten(cfg);
    let mut hashes = vec![i64::MIN; world.size()];
    hashes[world.rank()] = hash(&lines);
    world.all_reduce(&mut hashes, ReduceOp::Max)?;
    let Some(other) = (1..hashes.len()).find(|&r| hashes[r] != hashes[0]) else {
        return Ok(());
    };
    let disagree: Vec<String> = (1..hashes.len()).filter(|&r| hashes[r] != hashes[0]).map(|r| r.to_string()).collect();
    let first = broadcast_lines(world, 0, &lines)?;
    let theirs = broadcast_lines(world, other, &lines)?;
    let diff = differences(&first, &theirs);
    let more = diff.len().saturating_sub(SHOWN);
    let shown = diff.into_iter().take(SHOWN).collect::<Vec<_>>().join("; ");
    Err(Error::config(
        "(effective config)",
        format!(
            "ranks differ from rank 0: {}; rank {other}: {shown}{}",
            disagree.join(", "),
            if more > 0 { format!(" (and {more} more keys)") } else { String::new() }
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::testing::run_ranks;
    use crate::comm::CommConfig;

    const JOB: &str = "[model]\nsize = \"tiny\"\n[train]\nseed = 7\nmicro_batch = 4\n";

    #[test]
    fn ranks_with_another_config_are_refused_naming_the_keys() {
        let results = run_ranks(3, CommConfig::default(), |c| {
            let sets: Vec<String> = match c.rank() {
                2 => vec!["train.seed=8".into(), "optim.lr=1e-3".into()],
                _ => vec![],
            };
            let same = check(&c, &JobConfig::from_str(JOB, &[]).unwrap()).is_ok();
            (same, check(&c, &JobConfig::from_str(JOB, &sets).unwrap()).unwrap_err().to_string())
        });
        for (same, err) in results {
            assert!(same);
            assert!(err.contains("ranks differ from rank 0: 2; rank 2: optim.lr: 0.001 (rank 0: 0.0003); train.seed: 8 (rank 0: 7)"), "{err}");
        }
    }
}
