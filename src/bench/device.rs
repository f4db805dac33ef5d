//! `meshtrain bench device --device cuda|hip|emu|cpu`: latency of the device all-reduce per path,
//! the number that decides the small tensor-parallel calls of every layer.
//!
//! For each size the same in-place f32 sum all-reduce is timed over the paths that apply on this
//! job: stream-ordered (`oneshot`, workspaces mapped once, flags on the device), IPC (peer
//! buffers mapped per call, host agreement rounds), FI_HMEM rings (device memory posted to
//! libfabric, with `MESHTRAIN_TRANSPORT=ofi` over a provider that offers FI_HMEM) and staged
//! (pinned host memory and the host collectives). A path that does not apply shows the one taken. A row is `iters` back-to-back calls between two device synchronizations (how a
//! training step issues them: the stream-ordered path queues work and returns, so consecutive
//! calls overlap their launch latency), divided by `iters`, the slowest rank's time. The result
//! of the last call is checked against the exact sum on every rank (inputs are small integers).

use std::time::Instant;

use crate::comm::device::{GpuCommConfig, GpuCommState, GpuIpc};
use crate::comm::{Communicator, DType, ReduceOp};
use crate::device::ipc::alloc_shareable;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::transport::select::GpuDirect;

/// One path's setting.
struct Path {
    name: &'static str,
    cfg: GpuCommConfig,
}

fn paths(max_bytes: usize) -> [Path; 4] {
    let base = GpuCommConfig::default();
    [
        Path { name: "stream-ordered", cfg: GpuCommConfig { oneshot_bytes: max_bytes, ..base.clone() } },
        Path { name: "ipc", cfg: GpuCommConfig { oneshot_bytes: 0, ipc: GpuIpc::Auto, ..base.clone() } },
        Path { name: "fabric-ring", cfg: GpuCommConfig { ipc: GpuIpc::Off, gpu_direct: GpuDirect::Auto, ..base.clone() } },
        Path { name: "staged", cfg: GpuCommConfig { ipc: GpuIpc::Off, gpu_direct: GpuDirect::Off, ..base } },
    ]
}

/// Runs the sweep from `min` to `max` bytes (times `factor`); rank 0 prints one line per size.
pub fn run(c: &Communicator, dev: &Device, min: usize, max: usize, factor: usize, warmup: usize, iters: usize) -> Result<()> {
    if min == 0 || min > max || factor < 2 || iters == 0 {
        return Err(Error::InvalidArgument("bench device: need 0 < --min <= --max, --factor >= 2, --iters >= 1".into()));
    }
    let (k, me) = (c.size(), c.rank());
    let mut buf = alloc_shareable(dev, max.next_multiple_of(4))?;
    if me == 0 {
        println!("# device all-reduce (f32 sum, in place) on {} over {k} ranks: us per call (slowest rank), path taken", dev.arm());
        println!("{:>10} {:>16} {:>16} {:>16} {:>16}", "bytes", "stream-ordered", "ipc", "fabric-ring", "staged");
    }
    let mut bytes = min.next_multiple_of(4);
    while bytes <= max {
        let n = bytes / 4;
        let mut cells = Vec::new();
        for path in paths(max) {
            let mut state = GpuCommState::new(path.cfg);
            let input: Vec<f32> = (0..n).map(|i| ((i + me) % 7) as f32).collect();
            dev.copy_to_device(&mut buf, &input)?;
            let mut coll = state.bind(c, dev);
            for _ in 0..warmup {
                coll.all_reduce(&mut buf, n, DType::F32, ReduceOp::Max)?;
            }
            dev.copy_to_device(&mut buf, &input)?;
            dev.synchronize()?;
            c.barrier()?;
            let t = Instant::now();
            for i in 0..iters {
                // One sum, then maxima, which keep the sum: the result stays exact.
                let op = if i == 0 { ReduceOp::Sum } else { ReduceOp::Max };
                coll.all_reduce(&mut buf, n, DType::F32, op)?;
            }
            dev.synchronize()?;
            let mut us = [t.elapsed().as_secs_f64() * 1e6 / iters as f64];
            state.check(c, dev)?;
            let mut got = vec![0f32; n];
            dev.copy_to_host(&buf, &mut got)?;
            let wrong = (0..n).filter(|&i| got[i] != (0..k).map(|r| ((i + r) % 7) as f32).sum::<f32>()).count();
            if wrong > 0 {
                return Err(Error::Check(format!("bench device: {} path: {wrong} wrong elements at {bytes} bytes on rank {me}", path.name)));
            }
            c.all_reduce(&mut us, ReduceOp::Max)?;
            let (ipc, calls) = state.path_counts();
            let took = if state.stream_ordered_calls() > 0 {
                "stream-ordered"
            } else if state.ring_calls() > 0 {
                "fabric-ring"
            } else if ipc == calls {
                "ipc"
            } else {
                "staged"
            };
            cells.push(if took == path.name { format!("{:.1}", us[0]) } else { format!("({took})") });
            state.release_mappings(c, dev)?;
        }
        if me == 0 {
            println!("{bytes:>10} {:>16} {:>16} {:>16} {:>16}", cells[0], cells[1], cells[2], cells[3]);
        }
        bytes = bytes.saturating_mul(factor);
    }
    Ok(())
}
