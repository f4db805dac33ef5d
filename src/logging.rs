//! Log output that launchers can merge line by line.
//!
//! `mpirun --tag-output`, `srun --label` and the like read each rank's stderr in pieces and tag
//! every piece; a piece that ends mid-line gets the next piece (possibly another rank's) glued on
//! without a newline. A write of at most [`PIPE_ATOMIC`] bytes to a pipe reaches the reader whole,
//! so [`LineWrites`] hands a long record (a flight record dump is several KiB) to stderr in writes
//! that each end at a line break and stay within that size. Invariant: every write it makes is a
//! whole number of lines, except when one line alone is longer than [`PIPE_ATOMIC`].

use std::io::{self, Write};

/// Bytes that one write to a pipe delivers whole (POSIX `PIPE_BUF` on Linux).
pub const PIPE_ATOMIC: usize = 4096;

/// A writer that forwards each write as pieces of whole lines of at most [`PIPE_ATOMIC`] bytes.
pub struct LineWrites<W: Write> {
    inner: W,
}

impl<W: Write> LineWrites<W> {
    /// Wraps `inner` (stderr in the binary, a buffer in tests).
    pub fn new(inner: W) -> Self {
        LineWrites { inner }
    }

    /// The wrapped writer.
    pub fn into_inner(self) -> W {
        self.inner
    }
}

/// Bytes of `buf` that the next write takes: all of it if it fits, else up to the last line break
/// within the limit (or the limit, for a longer line).
fn piece_len(buf: &[u8]) -> usize {
    if buf.len() <= PIPE_ATOMIC {
        return buf.len();
    }
    buf[..PIPE_ATOMIC].iter().rposition(|&b| b == b'\n').map_or(PIPE_ATOMIC, |i| i + 1)
}

impl<W: Write> Write for LineWrites<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = piece_len(buf);
        self.inner.write_all(&buf[..n])?;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records each write the wrapped writer gets.
    #[derive(Default)]
    struct Writes(Vec<Vec<u8>>);

    impl Write for Writes {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.0.push(buf.to_vec());
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_long_record_goes_out_in_whole_lines_within_the_atomic_size() {
        // 200 lines of 1..=99 bytes: about 10 KiB.
        let record: String = (0..200).map(|i| format!("{}\n", "x".repeat(1 + i * 7 % 99))).collect();
        let mut w = LineWrites::new(Writes::default());
        w.write_all(record.as_bytes()).unwrap();
        let writes = w.into_inner().0;
        assert!(writes.len() >= 3, "{} writes", writes.len());
        for piece in &writes {
            assert!(piece.len() <= PIPE_ATOMIC && piece.ends_with(b"\n"), "{} bytes", piece.len());
        }
        assert_eq!(writes.concat(), record.as_bytes());
    }

    #[test]
    fn a_short_record_is_one_write_and_an_overlong_line_is_cut_at_the_limit() {
        let mut w = LineWrites::new(Writes::default());
        w.write_all(b"one line\n").unwrap();
        let long = vec![b'y'; 2 * PIPE_ATOMIC + 10];
        w.write_all(&long).unwrap();
        let writes = w.into_inner().0;
        let sizes: Vec<usize> = writes.iter().map(Vec::len).collect();
        assert_eq!(sizes, [9, PIPE_ATOMIC, PIPE_ATOMIC, 10]);
    }
}
