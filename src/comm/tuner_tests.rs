//! The tuner's table: parsing, errors that name the file and field, selection, and every schedule
//! the tuner can choose exact over world sizes 1..8 (through [`crate::comm::selftest`]).

use std::sync::Arc;

use super::*;
use crate::comm::selftest::check_all;
use crate::comm::testing::run_ranks;
use crate::comm::{CommConfig, ReduceOp};

const TABLE: &str = r#"
[[rule]]
coll = "all_reduce"
ranks = 2
link = "shm"
max_bytes = 65536
algo = "direct"
chunk_bytes = 65536

[[rule]]
coll = "all_reduce"
ranks = 2
link = "shm"
algo = "read"
chunk_bytes = 1048576

[[rule]]
coll = "all_reduce"
ranks = 4
link = "shm"
max_bytes = 4096
algo = "direct"
chunk_bytes = 1048576

[[rule]]
coll = "all_reduce"
ranks = 4
link = "shm"
algo = "ring"
chunk_bytes = 262144
"#;

fn err_of(text: &str) -> String {
    Tuning::parse(text, "/jobs/tune.toml").unwrap_err().to_string()
}

#[test]
fn selection_by_size_bucket_and_nearest_measured_world_size() {
    let t = Tuning::parse(TABLE, "t.toml").unwrap();
    let sel = |ranks, bytes| t.select("all_reduce", ranks, LinkKind::Shm, bytes).map(|c| (c.family, c.chunk_bytes));
    assert_eq!(sel(2, 4096), Some((Family::Direct, 65536)));
    assert_eq!(sel(2, 65536), Some((Family::Direct, 65536)));
    assert_eq!(sel(2, 65537), Some((Family::Read, 1 << 20)));
    assert_eq!(sel(4, 4096), Some((Family::Direct, 1 << 20)));
    assert_eq!(sel(4, 1 << 30), Some((Family::Ring, 262144)));
    // 3 ranks: the nearest measured size below (2); 8: 4; 1 has none below: the smallest (2).
    assert_eq!(sel(3, 1 << 20), Some((Family::Read, 1 << 20)));
    assert_eq!(sel(8, 1 << 20), Some((Family::Ring, 262144)));
    assert_eq!(sel(1, 100), Some((Family::Direct, 65536)));
    // No rule for the collective or the link kind: no choice (the fixed rule decides).
    assert_eq!(t.select("broadcast", 2, LinkKind::Shm, 100), None);
    assert_eq!(t.select("all_reduce", 2, LinkKind::Net, 100), None);
}

#[test]
fn the_builtin_table_parses_and_covers_one_node() {
    let t = Tuning::builtin().unwrap();
    assert!(t.select("all_reduce", 2, LinkKind::Shm, 1 << 20).is_some());
    assert!(t.select("all_reduce", 4, LinkKind::Shm, 4096).is_some());
}

#[test]
fn written_tables_read_back_the_same() {
    let t = Tuning::parse(TABLE, "t.toml").unwrap();
    let text = t.to_toml(&["a header".into()]).unwrap();
    assert!(text.starts_with("# a header\n"));
    assert_eq!(Tuning::parse(&text, "t.toml").unwrap().rules(), t.rules());
}

#[test]
fn bad_tables_name_the_file_the_rule_and_the_field() {
    let rule = |field: &str| {
        let base = "[[rule]]\ncoll = \"all_reduce\"\nranks = 2\nlink = \"shm\"\nalgo = \"ring\"\nchunk_bytes = 1024\n";
        let keys: Vec<&str> = field.lines().map(|l| l.split(" = ").next().unwrap()).collect();
        let kept: String =
            base.lines().filter(|l| !keys.iter().any(|k| l.starts_with(k))).map(|l| format!("{l}\n")).collect();
        format!("{kept}{field}\n")
    };
    let cases = [
        (rule("algo = \"tree\""), "rule[0].algo"),
        (rule("coll = \"alltoall\""), "rule[0].coll"),
        // All-to-all has no ring.
        (rule("coll = \"all_to_all\""), "rule[0].algo"),
        (rule("algo = \"read\"\ncoll = \"reduce\""), "rule[0].algo"),
        // Split composes an all-reduce; no other collective has it.
        (rule("algo = \"split\"\ncoll = \"reduce_scatter\""), "rule[0].algo"),
        (rule("chunk_bytes = 100"), "rule[0].chunk_bytes"),
        (rule("ranks = 1"), "rule[0].ranks"),
        (rule("max_bytes = 0"), "rule[0].max_bytes"),
        (rule("link = \"ib\""), "rule[0].link"),
        (rule("chunk = 1024"), "rule[0]"),
        (rule("max_bytes = \"64K\""), "rule[0].max_bytes"),
        ("[[rule]]\ncoll = \"all_reduce\"\n".to_string(), "rule[0]"),
        ("rules = []\n".to_string(), "unknown field `rules`"),
    ];
    for (text, field) in cases {
        let e = err_of(&text);
        assert!(e.contains("/jobs/tune.toml") && e.contains(field) && e.contains("MESHTRAIN_TUNING"), "{field}: {e}");
    }
    let missing = Tuning::load(std::path::Path::new("/nonexistent/tune.toml")).unwrap_err().to_string();
    assert!(missing.contains("/nonexistent/tune.toml"), "{missing}");
}

#[test]
fn forced_settings_win_over_the_table_and_off_turns_reads_into_the_ring() {
    let t = Tuning::parse(TABLE, "t.toml").unwrap();
    let base = CommConfig { chunk_bytes: 1 << 20, ..CommConfig::default() };
    let pick = |cfg: &CommConfig, bytes| choose(cfg, Some(&t), "all_reduce", shm(2), bytes).family;
    assert_eq!(pick(&base, 1 << 20), Family::Read);
    assert_eq!(pick(&CommConfig { cma: Cma::Off, ..base.clone() }, 1 << 20), Family::Ring);
    assert_eq!(pick(&CommConfig { algo: Algo::Direct, ..base.clone() }, 1 << 20), Family::Direct);
    assert_eq!(pick(&CommConfig { cma: Cma::On, ..base.clone() }, 16), Family::Read);
    // The chunk is capped by the communicator's (its links were sized for it).
    let small = CommConfig { chunk_bytes: 4096, ..base.clone() };
    assert_eq!(choose(&small, Some(&t), "all_reduce", shm(2), 1 << 20).chunk_bytes, 4096);
    // No table: the fixed rule.
    assert_eq!(choose(&base, None, "all_reduce", shm(2), 16).family, Family::Direct);
    assert_eq!(choose(&base, None, "reduce", shm(2), 1 << 20).family, Family::Ring);
}

fn shm(ranks: usize) -> Span {
    Span { ranks, link: LinkKind::Shm, hier: false }
}

#[test]
fn hierarchical_where_the_members_span_nodes_unless_forced_flat_or_measured_slower() {
    let base = CommConfig::default();
    let net = |hier| Span { ranks: 4, link: LinkKind::Net, hier };
    for coll in ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce"] {
        assert_eq!(choose(&base, None, coll, net(true), 16).family, Family::Hier, "{coll}");
        assert_ne!(choose(&base, None, coll, net(false), 16).family, Family::Hier, "{coll}");
        let ring = CommConfig { algo: Algo::Ring, ..base.clone() };
        assert_eq!(choose(&ring, None, coll, net(true), 1 << 20).family, Family::Ring, "{coll}");
    }
    // All-to-all has no hierarchical schedule; reads never cross nodes.
    assert_eq!(choose(&base, None, "all_to_all", net(true), 1 << 20).family, Family::Ring);
    assert_eq!(choose(&base, None, "all_reduce", net(false), 1 << 20).family, Family::Ring);
    // A measured table decides per size; its `hier` is the ring where the layout does not allow it.
    let t = Tuning::parse(
        "[[rule]]\ncoll = \"all_reduce\"\nranks = 4\nlink = \"net\"\nmax_bytes = 4096\nalgo = \"direct\"\nchunk_bytes = 4096\n\n\
         [[rule]]\ncoll = \"all_reduce\"\nranks = 4\nlink = \"net\"\nalgo = \"hier\"\nchunk_bytes = 4096\n",
        "net.toml",
    )
    .unwrap();
    assert_eq!(choose(&base, Some(&t), "all_reduce", net(true), 64).family, Family::Direct);
    assert_eq!(choose(&base, Some(&t), "all_reduce", net(true), 1 << 20).family, Family::Hier);
    assert_eq!(choose(&base, Some(&t), "all_reduce", net(false), 1 << 20).family, Family::Ring);
    // `hier` is for network links; every tuned collective has it.
    let bad_text = |coll: &str, link: &str| {
        format!("[[rule]]\ncoll = \"{coll}\"\nranks = 4\nlink = \"{link}\"\nalgo = \"hier\"\nchunk_bytes = 64\n")
    };
    let bad = |coll: &str, link: &str| Tuning::parse(&bad_text(coll, link), "h.toml").unwrap_err().to_string();
    assert!(bad("all_reduce", "shm").contains("rule[0].algo"), "{}", bad("all_reduce", "shm"));
    assert!(Tuning::parse(&bad_text("reduce", "net"), "h.toml").is_ok());
}

/// Whether this process may read its own memory with `process_vm_readv` (the read schedules).
fn reads_allowed() -> bool {
    crate::transport::cma::PeerMemory::new(std::process::id()).is_some_and(|m| {
        let src = [7u8; 8];
        let mut dst = [0u8; 8];
        m.read(src.as_ptr() as u64, &mut dst).is_ok() && dst == src
    })
}

/// A one-rule-per-collective table forcing `family` with `chunk` bytes on every world size.
fn forcing(family: Family, chunk: usize) -> Arc<Tuning> {
    let rules = TUNED
        .iter()
        .filter(|c| family.serves(c))
        .map(|c| Rule {
            coll: c.to_string(),
            ranks: 2,
            link: LinkKind::Shm,
            max_bytes: None,
            algo: family,
            chunk_bytes: chunk,
        })
        .collect();
    Arc::new(Tuning::from_rules(rules, "forced").unwrap())
}

#[test]
fn every_schedule_the_tuner_can_choose_is_exact_on_1_to_8_ranks() {
    let reads = reads_allowed();
    let mut choices = vec![(Family::Ring, 64), (Family::Ring, 192), (Family::Direct, 64), (Family::Direct, 256)];
    if reads {
        choices.extend([(Family::Read, 64), (Family::Read, 256)]);
    } else {
        eprintln!("SKIP: process_vm_readv is forbidden here; the read schedules are not exercised");
    }
    for (family, chunk) in choices {
        for k in 1..=8 {
            // Counts not divisible by k (and smaller than k); chunks smaller than a block.
            let cfg = CommConfig { chunk_bytes: 256, tuning: Some(forcing(family, chunk)), ..CommConfig::default() };
            run_ranks(k, cfg, move |c| {
                let got = check_all(&c, &[0, 1, 7, 13, 97, 1001], &ReduceOp::ALL).unwrap();
                assert_eq!(got, Vec::<String>::new(), "{family:?} chunk {chunk} on {k} ranks");
            });
        }
    }
}

#[test]
fn every_rank_selects_the_same_schedule_from_a_loaded_table() {
    let path = std::env::temp_dir().join(format!("meshtrain-tuner-test-{}.toml", std::process::id()));
    std::fs::write(&path, TABLE).unwrap();
    let table = Arc::new(Tuning::load(&path).unwrap());
    let _ = std::fs::remove_file(&path);
    for k in [2, 3, 4] {
        let cfg = CommConfig { tuning: Some(table.clone()), ..CommConfig::default() };
        let picks = run_ranks(k, cfg, |c| {
            // Each rank encodes its choices and gathers everybody's: all rows must be equal.
            let sizes = [1usize, 4096, 65536, 65537, 1 << 20, 64 << 20];
            let mine: Vec<i64> = sizes
                .iter()
                .flat_map(|&b| {
                    let ch = c.planned_schedule("all_reduce", b);
                    [ch.family as i64, ch.chunk_bytes as i64]
                })
                .collect();
            let mut all = vec![0i64; mine.len() * c.size()];
            c.all_gather_into(&mine, &mut all).unwrap();
            // The schedules run, too: a small exact all-reduce through the table's choice.
            let mut x = vec![1.0f32; 20_000];
            c.all_reduce(&mut x, ReduceOp::Sum).unwrap();
            assert!(x.iter().all(|&v| v == c.size() as f32));
            all
        });
        for all in &picks {
            let row = all.len() / k;
            assert!(all.chunks(row).all(|r| r == &all[..row]), "k={k}: {all:?}");
        }
    }
}

/// A table: all-reduce split at every size, its reduce-scatter `rs` and its all-gather `ag`
/// (family, chunk) on every world size.
fn split_table(rs: (Family, usize), ag: (Family, usize)) -> Arc<Tuning> {
    let rule = |coll: &str, (algo, chunk_bytes): (Family, usize)| Rule {
        coll: coll.to_string(),
        ranks: 2,
        link: LinkKind::Shm,
        max_bytes: None,
        algo,
        chunk_bytes,
    };
    let rules = vec![rule("all_reduce", (Family::Split, 64)), rule("reduce_scatter", rs), rule("all_gather", ag)];
    Arc::new(Tuning::from_rules(rules, "split").unwrap())
}

#[test]
fn split_is_forced_for_all_reduce_only_and_reads_forced_on_win() {
    let t = Tuning::parse(TABLE, "t.toml").unwrap();
    let split = CommConfig { algo: Algo::Split, ..CommConfig::default() };
    assert_eq!(choose(&split, Some(&t), "all_reduce", shm(2), 16).family, Family::Split);
    assert_eq!(choose(&split, None, "all_reduce", shm(4), 1 << 30).family, Family::Split);
    // The other collectives (the halves among them) as under auto: the table, or the fixed rule.
    assert_eq!(choose(&split, None, "reduce_scatter", shm(4), 16).family, Family::Direct);
    assert_eq!(choose(&split, None, "reduce_scatter", shm(4), 1 << 20).family, Family::Ring);
    assert_eq!(choose(&split, None, "all_gather", shm(4), 1 << 20).family, Family::Read);
    assert_eq!(choose(&split, None, "all_to_all", shm(4), 16).family, Family::Direct);
    let on = CommConfig { cma: Cma::On, ..split.clone() };
    assert_eq!(choose(&on, None, "all_reduce", shm(2), 16).family, Family::Read);
    // A table's split stays split whatever the link kind (its halves run flat).
    let t = split_table((Family::Ring, 1024), (Family::Direct, 64));
    assert_eq!(choose(&CommConfig::default(), Some(&t), "all_reduce", shm(3), 1 << 20).family, Family::Split);
}

#[test]
fn the_log_line_of_a_split_bucket_names_its_halves() {
    let text = "[[rule]]\ncoll = \"all_reduce\"\nranks = 4\nlink = \"shm\"\nmax_bytes = 4096\nalgo = \"direct\"\nchunk_bytes = 64\n\n\
                [[rule]]\ncoll = \"all_reduce\"\nranks = 4\nlink = \"shm\"\nmax_bytes = 1048576\nalgo = \"split\"\nchunk_bytes = 64\n\n\
                [[rule]]\ncoll = \"all_reduce\"\nranks = 4\nlink = \"shm\"\nalgo = \"ring\"\nchunk_bytes = 1024\n\n\
                [[rule]]\ncoll = \"reduce_scatter\"\nranks = 4\nlink = \"shm\"\nmax_bytes = 65536\nalgo = \"direct\"\nchunk_bytes = 128\n\n\
                [[rule]]\ncoll = \"reduce_scatter\"\nranks = 4\nlink = \"shm\"\nalgo = \"ring\"\nchunk_bytes = 256\n\n\
                [[rule]]\ncoll = \"all_gather\"\nranks = 4\nlink = \"shm\"\nmax_bytes = 2048\nalgo = \"direct\"\nchunk_bytes = 64\n\n\
                [[rule]]\ncoll = \"all_gather\"\nranks = 4\nlink = \"shm\"\nalgo = \"read\"\nchunk_bytes = 512\n";
    let t = Tuning::parse(text, "t.toml").unwrap();
    let lines = t.describe(4, LinkKind::Shm);
    assert_eq!(
        lines[0],
        "all_reduce [as measured on 4 ranks]: <=4096 direct (64), <=1048576 split [reduce_scatter direct/128 \
         then ring/256 + all_gather read/512] (64), rest ring (1024)"
    );
    // Without rules for the halves: the fixed rule.
    let only = Tuning::parse("[[rule]]\ncoll = \"all_reduce\"\nranks = 2\nlink = \"shm\"\nalgo = \"split\"\nchunk_bytes = 64\n", "s")
        .unwrap();
    assert!(only.describe(2, LinkKind::Shm)[0].contains("split [reduce_scatter (fixed rule) + all_gather (fixed rule)]"));
}

#[test]
fn split_all_reduce_is_exact_with_every_pair_of_halves_on_1_to_8_ranks() {
    let reads = reads_allowed();
    let ag_read = if reads { (Family::Read, 256) } else { (Family::Ring, 128) };
    if !reads {
        eprintln!("SKIP: process_vm_readv is forbidden here; the read all-gather half is not exercised");
    }
    // Every world size with the two families at opposite ends; the mixed pairs on a few sizes.
    let pairs = [
        ((Family::Ring, 64), ag_read, 1..=8),
        ((Family::Direct, 256), (Family::Direct, 64), 1..=8),
        ((Family::Direct, 64), (Family::Ring, 192), 3..=5),
        ((Family::Ring, 192), (Family::Direct, 128), 3..=5),
    ];
    for (rs, ag, ks) in pairs {
        for k in ks {
            // Counts 0, 1, fewer than k, not divisible by k; chunks smaller than a block.
            let cfg = CommConfig { chunk_bytes: 256, tuning: Some(split_table(rs, ag)), ..CommConfig::default() };
            run_ranks(k, cfg, move |c| {
                assert_eq!(c.planned_schedule("all_reduce", 4).family, Family::Split);
                let got = crate::comm::selftest::check_all(&c, &[0, 1, 3, 7, 13, 97, 1001], &ReduceOp::ALL).unwrap();
                assert_eq!(got, Vec::<String>::new(), "split {rs:?} + {ag:?} on {k} ranks");
            });
        }
    }
}
