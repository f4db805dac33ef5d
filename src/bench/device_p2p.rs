//! `meshtrain bench device-sendrecv`: ping-pong of device buffers between members 0 and 1 (the
//! other members idle), for comparing the device-direct path with staging through host memory
//! (`MESHTRAIN_GPU_DIRECT=on|off`). Each size: `warmup` untimed round trips, then `iters` timed
//! ones; one-way time is half a round trip. Buffers hold a pattern that member 1 checks after the
//! last round (a wrong byte is an error, not a number).

use crate::comm::device::{GpuCommConfig, GpuCommState};
use crate::comm::{Communicator, DType};
use crate::device::Device;
use crate::error::{Error, Result};

/// One measured size: bytes per message and the mean one-way time in seconds.
pub struct P2pRow {
    pub bytes: usize,
    pub one_way_s: f64,
}

/// Times device send/recv of each size in `sizes` (bytes) between members 0 and 1; rows are
/// meaningful on member 0.
pub fn bench_device_sendrecv(comm: &Communicator, dev: &Device, sizes: &[usize], warmup: usize, iters: usize) -> Result<Vec<P2pRow>> {
    if comm.size() < 2 {
        return Err(Error::InvalidArgument("bench device-sendrecv: needs at least 2 ranks".into()));
    }
    let mut state = GpuCommState::new(GpuCommConfig::from_env()?);
    let mut rows = Vec::new();
    for &bytes in sizes {
        let pattern: Vec<u8> = (0..bytes).map(|i| (i % 251) as u8).collect();
        let mut buf = dev.upload(&pattern)?;
        if comm.rank() == 1 {
            dev.copy_to_device(&mut buf, &vec![0u8; bytes])?;
        }
        let mut coll = state.bind(comm, dev);
        let mut start = std::time::Instant::now();
        for i in 0..warmup + iters {
            if i == warmup {
                start = std::time::Instant::now();
            }
            match comm.rank() {
                0 => {
                    coll.send(&buf, bytes, DType::U8, 1)?;
                    coll.recv_into(&mut buf, bytes, DType::U8, 1)?;
                }
                1 => {
                    coll.recv_into(&mut buf, bytes, DType::U8, 0)?;
                    coll.send(&buf, bytes, DType::U8, 0)?;
                }
                _ => {}
            }
        }
        let one_way_s = start.elapsed().as_secs_f64() / (2 * iters.max(1)) as f64;
        if comm.rank() == 1 && bytes > 0 {
            let mut got = vec![0u8; bytes];
            dev.copy_to_host(&buf, &mut got)?;
            if got != pattern {
                return Err(Error::Check(format!("bench device-sendrecv: {bytes}-byte message arrived changed")));
            }
        }
        state.release_mappings(comm, dev)?;
        rows.push(P2pRow { bytes, one_way_s });
    }
    Ok(rows)
}
