//! The first half of loading a job configuration: the TOML text parsed into a table (syntax errors
//! give line and column), then `--set` overrides and `MESHTRAIN_<SECTION>_<KEY>` environment
//! overrides written into that table by dotted key, in that order. The caller deserializes and
//! validates the result; the map returned says where each overridden key came from, for its errors.

use std::collections::HashMap;
use std::path::Path;

use crate::error::{Error, Result};

/// Sections of the file; an environment variable `MESHTRAIN_<SECTION>_...` targets one of them.
const SECTIONS: &[&str] = &[
    "model",
    "data",
    "train",
    "optim",
    "parallel",
    "checkpoint",
    "metrics",
];
/// Keys outside any section.
const TOP_LEVEL_KEYS: &[&str] = &["device", "precision", "init_from"];
/// Prefix of environment overrides.
pub const ENV_PREFIX: &str = "MESHTRAIN_";

/// Parses `text` (named `origin` in errors) and applies `sets`, then the `MESHTRAIN_*` pairs of
/// `env` (other pairs are ignored). Returns the table and, per overridden dotted key, where its
/// value came from (`--set ...` or `environment VAR`).
pub fn parse_with_overrides(
    text: &str,
    origin: &Path,
    sets: &[String],
    env: &[(String, String)],
) -> Result<(toml::Table, HashMap<String, String>)> {
    let mut table: toml::Table = toml::from_str(text).map_err(|e| {
        let at = e.span().map(|s| s.start);
        let place = at.map_or(String::new(), |at| {
            let before = &text[..at.min(text.len())];
            let line = before.matches('\n').count() + 1;
            let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
            format!("line {line}, column {column}: ")
        });
        Error::file(origin, at.map(|a| a as u64), format!("{place}{}", e.message()))
    })?;
    // Dotted key -> where an override came from, to say so in errors about that key.
    let mut overridden: HashMap<String, String> = HashMap::new();
    for set in sets {
        let (key, value) = set.split_once('=').ok_or_else(|| {
            Error::config(
                set.clone(),
                "a --set override must look like section.key=value",
            )
        })?;
        let key = key.trim();
        insert_dotted(&mut table, key, parse_scalar(value))?;
        overridden.insert(key.to_string(), format!("--set {set}"));
    }
    for (var, value) in env {
        if let Some(key) = env_key(var) {
            insert_dotted(&mut table, &key, parse_scalar(value))?;
            overridden.insert(key, format!("environment {var}"));
        }
    }
    Ok((table, overridden))
}

/// The dotted key a `MESHTRAIN_*` variable overrides, or `None` if it is not a config override.
pub(crate) fn env_key(var: &str) -> Option<String> {
    let rest = var.strip_prefix(ENV_PREFIX)?.to_ascii_lowercase();
    if TOP_LEVEL_KEYS.contains(&rest.as_str()) {
        return Some(rest);
    }
    let (section, key) = rest.split_once('_')?;
    SECTIONS
        .contains(&section)
        .then(|| format!("{section}.{key}"))
}

/// `value` as a TOML scalar, or as a string if it does not parse as one.
fn parse_scalar(value: &str) -> toml::Value {
    let value = value.trim();
    toml::from_str::<toml::Table>(&format!("v = {value}"))
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(value.to_string()))
}

/// Sets `table[a][b]... = value` for the dotted key `a.b...`, creating sections as needed.
fn insert_dotted(table: &mut toml::Table, key: &str, value: toml::Value) -> Result<()> {
    let parts: Vec<&str> = key.split('.').collect();
    if parts.iter().any(|p| p.is_empty()) {
        return Err(Error::config(key, "not a valid dotted key"));
    }
    let (last, sections) = parts.split_last().expect("split always yields one part");
    let mut cur = table;
    for (i, part) in sections.iter().enumerate() {
        let entry = cur
            .entry(part.to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        cur = entry.as_table_mut().ok_or_else(|| {
            Error::config(
                parts[..=i].join("."),
                format!("is not a section, cannot set `{key}`"),
            )
        })?;
    }
    cur.insert(last.to_string(), value);
    Ok(())
}

