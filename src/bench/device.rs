//! `meshtrain bench device --device cuda|hip|emu|cpu [--coll all_reduce|all_gather|broadcast]`:
//! time per call of a device collective per path; the all-reduce's latency decides the small
//! tensor-parallel calls of every layer, the copy-only collectives show what a path's transport
//! costs without reduce kernels.
//!
//! For each size the same f32 collective is timed over the paths that apply on this
//! job: stream-ordered (`oneshot`, workspaces mapped once, flags on the device), IPC (peer
//! buffers mapped per call, host agreement rounds), FI_HMEM rings (device memory posted to
//! libfabric, with `MESHTRAIN_TRANSPORT=ofi` over a provider that offers FI_HMEM) and staged
//! (pinned host memory and the host collectives). A path that does not apply shows the one taken.
//! A row is `iters` back-to-back calls between two device synchronizations (how a
//! training step issues them: the stream-ordered path queues work and returns, so consecutive
//! calls overlap their launch latency), divided by `iters`, the slowest rank's time. The result
//! of the last call is checked exactly on every rank (inputs are small integers).

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

/// The collective a sweep times.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Timed {
    /// In place, one sum then maxima (which keep the sum).
    AllReduce,
    /// Every rank's block into every rank's buffer.
    AllGather,
    /// From rank 0.
    Broadcast,
}

impl Timed {
    /// `all_reduce`, `all_gather` or `broadcast`.
    pub fn parse(s: &str) -> Result<Timed> {
        Ok(match s {
            "all_reduce" => Timed::AllReduce,
            "all_gather" => Timed::AllGather,
            "broadcast" => Timed::Broadcast,
            other => return Err(Error::InvalidArgument(format!("bench device: --coll `{other}` is not all_reduce, all_gather or broadcast"))),
        })
    }
}

/// Runs the sweep of `what` from `min` to `max` bytes (times `factor`); rank 0 prints one line
/// per size.
#[allow(clippy::too_many_arguments)]
pub fn run(c: &Communicator, dev: &Device, what: Timed, min: usize, max: usize, factor: usize, warmup: usize, iters: usize) -> Result<()> {
    if min == 0 || min > max || factor < 2 || iters == 0 {
        return Err(Error::InvalidArgument("bench device: need 0 < --min <= --max, --factor >= 2, --iters >= 1".into()));
    }
    let (k, me) = (c.size(), c.rank());
    let mut buf = alloc_shareable(dev, max.next_multiple_of(4))?;
    let mut block = alloc_shareable(dev, c.block(max.div_ceil(4)).len().max(1) * 4)?;
    if me == 0 {
        println!("# device {what:?} (f32) on {} over {k} ranks: us per call (slowest rank), path taken", dev.arm());
        println!("{:>10} {:>16} {:>16} {:>16} {:>16}", "bytes", "stream-ordered", "ipc", "fabric-ring", "staged");
    }
    let mut bytes = min.next_multiple_of(4);
    while bytes <= max {
        let n = bytes / 4;
        let mut cells = Vec::new();
        for path in paths(max) {
            let mut state = GpuCommState::new(path.cfg);
            let call = |state: &mut GpuCommState, buf: &mut _, block: &mut _, i: usize| -> Result<()> {
                let mut coll = state.bind(c, dev);
                match what {
                    Timed::AllReduce => coll.all_reduce(buf, n, DType::F32, if i == 0 { ReduceOp::Sum } else { ReduceOp::Max }),
                    Timed::AllGather => coll.all_gather_into(block, buf, n, DType::F32),
                    Timed::Broadcast => coll.broadcast(buf, n, DType::F32, 0),
                }
            };
            let input = |i: usize| ((i + me) % 7) as f32;
            let fill = |buf: &mut _, block: &mut _| -> Result<()> {
                let blk = c.block(n);
                dev.copy_to_device(block, &blk.clone().map(|i| (i % 7) as f32).collect::<Vec<_>>())?;
                let mine: Vec<f32> = match what {
                    Timed::AllReduce => (0..n).map(input).collect(),
                    Timed::Broadcast if me != 0 => vec![0.0; n],
                    _ => (0..n).map(|i| (i % 7) as f32).collect(),
                };
                dev.copy_to_device(buf, &mine)
            };
            fill(&mut buf, &mut block)?;
            for i in 0..warmup {
                call(&mut state, &mut buf, &mut block, i + 1)?;
            }
            fill(&mut buf, &mut block)?;
            dev.synchronize()?;
            c.barrier()?;
            let t = Instant::now();
            for i in 0..iters {
                call(&mut state, &mut buf, &mut block, i)?;
            }
            dev.synchronize()?;
            let mut us = [t.elapsed().as_secs_f64() * 1e6 / iters as f64];
            state.check(c, dev)?;
            let mut got = vec![0f32; n];
            dev.copy_to_host(&buf, &mut got)?;
            let want = |i: usize| match what {
                Timed::AllReduce => (0..k).map(|r| ((i + r) % 7) as f32).sum::<f32>(),
                _ => (i % 7) as f32,
            };
            let wrong = (0..n).filter(|&i| got[i] != want(i)).count();
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
