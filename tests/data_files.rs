//! Shards on disk: format validation, glob datasets, and text tokenization into shards.

use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use meshtrain::data::{
    tokenize_files, write_shard, Gpt2Tokenizer, Shard, ShardDataset, TokenWindows, EOT_TOKEN,
    GPT2_VOCAB_SIZE, HEADER_BYTES,
};
use meshtrain::Error;

fn patch(path: &Path, offset: u64, bytes: &[u8]) {
    let mut f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.seek(SeekFrom::Start(offset)).unwrap();
    f.write_all(bytes).unwrap();
}

fn file_error(e: Error) -> (PathBuf, Option<u64>, String) {
    match e {
        Error::File { file, offset, msg } => (file, offset, msg),
        other => panic!("expected a File error, got {other}"),
    }
}

#[test]
fn shard_round_trips_and_leaves_no_temp_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("a.bin");
    let tokens: Vec<u16> = (0..1000u32).map(|i| (i * 7 % 256) as u16).collect();
    write_shard(&path, &tokens).unwrap();
    assert_eq!(
        std::fs::metadata(&path).unwrap().len(),
        (HEADER_BYTES + 2 * 1000) as u64
    );
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        1,
        "temp file left behind"
    );
    let shard = Shard::open(&path, 256).unwrap();
    assert_eq!(shard.len(), 1000);
    let read: Vec<u16> = (0..1000).map(|i| shard.token(i).unwrap()).collect();
    assert_eq!(read, tokens);
    let mut window = vec![0u32; 5];
    shard.read(10, &mut window).unwrap();
    assert_eq!(
        window,
        tokens[10..15].iter().map(|&t| t as u32).collect::<Vec<_>>()
    );
    // Truncated under the open shard (a mapped file would raise SIGBUS here): an error naming it,
    // even for tokens the shorter file still holds.
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len((HEADER_BYTES + 200) as u64).unwrap();
    for start in [10, 500] {
        let err = shard.read(start, &mut window).unwrap_err().to_string();
        assert!(err.contains(&path.display().to_string()) && err.contains(&format!("changed from {} to {} bytes", HEADER_BYTES + 2000, HEADER_BYTES + 200)), "{err}");
    }
}

#[test]
fn a_shard_rewritten_or_replaced_under_an_open_dataset_is_refused_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("a.bin");
    let tokens: Vec<u16> = (0..1000u32).map(|i| (i % 256) as u16).collect();
    let mut window = vec![0u32; 5];
    // Rewritten in place, larger (the same inode).
    write_shard(&path, &tokens).unwrap();
    let shard = Shard::open(&path, 256).unwrap();
    let bigger = std::fs::read(&path).unwrap().repeat(3);
    std::fs::write(&path, &bigger).unwrap();
    let err = shard.read(0, &mut window).unwrap_err().to_string();
    assert!(err.contains(&path.display().to_string()) && err.contains("bytes since the job opened it"), "{err}");
    // Rewritten in place at the same size: the modification time tells.
    write_shard(&path, &tokens).unwrap();
    let shard = Shard::open(&path, 256).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20));
    patch(&path, HEADER_BYTES as u64, &[9, 0]);
    let err = shard.read(0, &mut window).unwrap_err().to_string();
    assert!(err.contains("was modified since the job opened it"), "{err}");
    // Replaced by a rename (write_shard's way): the open file is intact, but the path names another.
    write_shard(&path, &tokens).unwrap();
    let shard = Shard::open(&path, 256).unwrap();
    write_shard(&path, &tokens).unwrap();
    let err = shard.read(0, &mut window).unwrap_err().to_string();
    assert!(err.contains("was replaced by another file"), "{err}");
}

#[test]
fn shard_rejects_bad_magic_version_and_size() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.bin");
    write_shard(&path, &[1, 2, 3]).unwrap();
    patch(&path, 0, &7i32.to_le_bytes());
    let (file, offset, msg) = file_error(Shard::open(&path, 256).unwrap_err());
    assert_eq!((file, offset), (path.clone(), Some(0)));
    assert!(msg.contains("magic"), "{msg}");

    write_shard(&path, &[1, 2, 3]).unwrap();
    patch(&path, 4, &2i32.to_le_bytes());
    let (_, offset, msg) = file_error(Shard::open(&path, 256).unwrap_err());
    assert_eq!(offset, Some(4));
    assert!(msg.contains("version"), "{msg}");

    write_shard(&path, &[1, 2, 3]).unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len((HEADER_BYTES + 5) as u64).unwrap();
    let (_, offset, msg) = file_error(Shard::open(&path, 256).unwrap_err());
    assert_eq!(offset, Some((HEADER_BYTES + 5) as u64));
    assert!(msg.contains("3 tokens"), "{msg}");

    f.set_len(100).unwrap();
    let (_, _, msg) = file_error(Shard::open(&path, 256).unwrap_err());
    assert!(msg.contains("header"), "{msg}");
}

#[test]
fn shard_reports_first_out_of_vocab_token_offset() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("v.bin");
    write_shard(&path, &[1, 255, 300, 4, 500]).unwrap();
    let e = Shard::open(&path, 256).unwrap_err();
    assert!(e.to_string().contains("v.bin"), "{e}");
    let (_, offset, msg) = file_error(e);
    assert_eq!(offset, Some((HEADER_BYTES + 2 * 2) as u64));
    assert!(msg.contains("300"), "{msg}");
    assert!(Shard::open(&path, 501).is_ok());
}

#[test]
fn dataset_orders_shards_by_path_and_keeps_windows_inside_shards() {
    let dir = tempfile::tempdir().unwrap();
    // Written out of order; shard k holds tokens 100k, 100k+1, ...; sizes 10, 7, 4.
    for (k, n) in [(2u16, 4u16), (0, 10), (1, 7)] {
        let tokens: Vec<u16> = (0..n).map(|i| 100 * k + i).collect();
        write_shard(&dir.path().join(format!("d_train_{k:06}.bin")), &tokens).unwrap();
    }
    let pattern = format!("{}/d_train_*.bin", dir.path().display());
    let ds = ShardDataset::open(&pattern, 1000, "data.source").unwrap();
    assert_eq!(ds.num_tokens(), 21);
    // T = 3: shard 0 (10 tokens) has (10-1)/3 = 3 windows, shard 1 (7) has 2, shard 2 (4) has 1.
    assert_eq!(ds.num_windows(3), 6);
    let mut w = vec![0u32; 4];
    let expect = [
        [0, 1, 2, 3],
        [3, 4, 5, 6],
        [6, 7, 8, 9],
        [100, 101, 102, 103],
        [103, 104, 105, 106],
    ];
    for (i, e) in expect.iter().enumerate() {
        ds.read_window(i as u64, 3, &mut w).unwrap();
        assert_eq!(&w, e, "window {i}");
    }
    ds.read_window(5, 3, &mut w).unwrap();
    assert_eq!(w, [200, 201, 202, 203]);
    assert!(ds.read_window(6, 3, &mut w).is_err());
}

#[test]
fn dataset_glob_matching_nothing_names_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let pattern = format!("{}/none_*.bin", dir.path().display());
    match ShardDataset::open(&pattern, 256, "data.val_source").unwrap_err() {
        Error::Config { key, msg } => {
            assert_eq!(key, "data.val_source");
            assert!(msg.contains("matches no files"), "{msg}");
        }
        other => panic!("{other}"),
    }
}

#[test]
fn gpt2_tokenizer_uses_the_gpt2_vocabulary() {
    let tok = Gpt2Tokenizer::new().unwrap();
    // GPT-2's ids for "Hello" and " world" (from the published r50k_base vocabulary).
    assert_eq!(tok.encode("Hello world"), vec![15496, 995]);
    let text = "First Citizen:\nBefore we proceed any further, hear me speak. é🙂";
    assert_eq!(tok.decode(&tok.encode(text)).unwrap(), text);
    assert_eq!(tok.decode(&[EOT_TOKEN]).unwrap(), "<|endoftext|>");
    assert!(tok.decode(&[GPT2_VOCAB_SIZE as u32]).is_err());
}

#[test]
fn tokenize_writes_val_then_train_shards_with_eot_separators() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.txt");
    let b = dir.path().join("b.txt");
    let text_a = "To be, or not to be, that is the question. ".repeat(20);
    let text_b = "Whether 'tis nobler in the mind to suffer.\n".repeat(15);
    std::fs::write(&a, &text_a).unwrap();
    std::fs::write(&b, &text_b).unwrap();
    let prefix = dir.path().join("out/ts");
    let report = tokenize_files(&[a, b], &prefix, 0.1, 64).unwrap();

    let tok = Gpt2Tokenizer::new().unwrap();
    let mut expected = vec![EOT_TOKEN];
    expected.extend(tok.encode(&text_a));
    expected.push(EOT_TOKEN);
    expected.extend(tok.encode(&text_b));
    let n = expected.len() as u64;
    let val_len = (n as f64 * 0.1).ceil() as u64;
    assert_eq!(
        (report.documents, report.val_tokens, report.train_tokens),
        (2, val_len, n - val_len)
    );
    assert_eq!(
        report.val_shards[0],
        dir.path().join("out/ts_val_000000.bin")
    );
    assert_eq!(
        report.train_shards[0],
        dir.path().join("out/ts_train_000000.bin")
    );
    assert_eq!(report.train_shards.len() as u64, (n - val_len).div_ceil(64));

    let mut got = Vec::new();
    for path in report.val_shards.iter().chain(&report.train_shards) {
        let shard = Shard::open(path, GPT2_VOCAB_SIZE).unwrap();
        assert!(shard.len() <= 64);
        got.extend((0..shard.len()).map(|i| shard.token(i).unwrap() as u32));
    }
    assert_eq!(got, expected);
}

#[test]
fn tokenize_rejects_invalid_utf8_with_offset() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.txt");
    std::fs::write(&bad, b"abc\xffdef").unwrap();
    let (file, offset, _) = file_error(
        tokenize_files(std::slice::from_ref(&bad), &dir.path().join("x"), 0.0, 100).unwrap_err(),
    );
    assert_eq!((file, offset), (bad, Some(3)));
}

#[test]
fn tokenize_keeps_input_order_across_parallel_workers() {
    let dir = tempfile::tempdir().unwrap();
    let inputs: Vec<PathBuf> = (0..7)
        .map(|i| {
            let p = dir.path().join(format!("doc{i}.txt"));
            std::fs::write(&p, format!("document number {i} says {}", "hi ".repeat(i))).unwrap();
            p
        })
        .collect();
    let report = tokenize_files(&inputs, &dir.path().join("o"), 0.0, 1000).unwrap();
    assert!(report.val_shards.is_empty());
    let tok = Gpt2Tokenizer::new().unwrap();
    let mut expected = Vec::new();
    for p in &inputs {
        expected.push(EOT_TOKEN);
        expected.extend(tok.encode(&std::fs::read_to_string(p).unwrap()));
    }
    let shard = Shard::open(&report.train_shards[0], GPT2_VOCAB_SIZE).unwrap();
    let got: Vec<u32> = (0..shard.len()).map(|i| shard.token(i).unwrap() as u32).collect();
    assert_eq!(got, expected);
}
