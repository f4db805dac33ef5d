//! Communicators and collectives, written over transport links.
//!
//! Layering: [`primitives`] turns links into NCCL's message primitives (copies through a link's
//! FIFO, and single-copy reads of a peer's buffer where the link allows them); [`algo`] holds the
//! schedules (ring, direct, read) as plain functions over those primitives; [`communicator`] owns
//! the links of one group of ranks, chooses a schedule per call ([`tuning`] holds the tunables)
//! and exposes the typed, `Result` returning API. No algorithm knows which transport or device
//! carries its bytes.
//!
//! Buffers that are split across ranks (reduce-scatter output, all-gather input, all-to-all
//! blocks) use [`block_range`]: `n` elements cut into `k` contiguous blocks whose lengths differ by
//! at most one, the longer ones first. Any `n`, including 0 and counts not divisible by `k`, works.
//!
//! # Collectives in detail
//!
//! ### Collectives
//!
//! `Communicator` (`src/comm/`) offers broadcast, reduce, all_reduce, reduce_scatter, all_gather,
//! send/recv and all_to_all on host buffers of f32, f64, bf16, f16, i32, i64 and u8 with sum, prod,
//! min, max and avg, in place (`all_reduce(buf)`) and out of place (`all_reduce_into(send, recv)`),
//! for any world size and any count: split buffers use `block_range(n, k, i)`, k contiguous blocks
//! whose lengths differ by at most one (a ZeRO shard is such a block). `split(color, key)` makes
//! sub-communicators, each with its own ring and links; several communicators can run concurrently
//! on different threads. Every call returns `Result`.
//!
//! - **Ring** (bandwidth): NCCL's schedule — send; recv-reduce-send x(k-2); recv-reduce-copy-send;
//!   recv-copy-send x(k-2); recv — over pieces of 1 MiB that flow around the ring concurrently
//!   (links hold several pieces in flight), so a broadcast of N bytes in S pieces costs
//!   (k-1+S-1)·N/(S·B) instead of (k-1)·N/B. The ring orders ranks by (node, rank), is checked to be a
//!   permutation and logged once (`ring 0: 0 1 2 3`).
//! - **Direct** (latency, all-to-all): each rank posts its piece to every peer before waiting for any,
//!   and reduces contributions in rank order. `auto` uses it up to 64 KiB; all-to-all where the table does not read.
//! - **Single copy** (Cross Memory Attach): a rank publishes (address, length) of its buffer over the
//!   link and its peers copy straight out of it with `process_vm_readv`, then answer; the owner
//!   returns only once every live reader answered, also after an error (a reader that fails answers
//!   "gave up"), so no peer reads a buffer that went back to its caller. All-gather reads every other
//!   block into the output; all-reduce runs the ring's reduce-scatter, then reads; broadcast reads the
//!   root; all-to-all reads this rank's block of every peer's input. A probe at the first large call
//!   checks that every member can read every other (a random
//!   token exposed and read back; `prctl(PR_SET_PTRACER_ANY)` for Yama) and times one kernel copy
//!   against two FIFO copies; the members agree on its answer. `MESHTRAIN_CMA=auto` (default) reads
//!   for all-gather and all-reduce above 64 KiB only where reads work *and* pay, `on` reads for all
//!   four at every size wherever they work (an error where they do not), `off` never; member 0 logs
//!   the probe's answer once. On this VM reads work but do not pay (see "where the time goes").
//! - **Hierarchical** (members on several nodes, some node holding >= 2; `MESHTRAIN_HIER=auto`,
//!   the default; `off` keeps the flat schedules): all-reduce, reduce-scatter, all-gather,
//!   broadcast and reduce run in stages over sub-communicators made from the node map (no
//!   messages): the members of a node (shared memory, CMA) and, per segment of the buffer, one
//!   member of every node carrying it (the network; on even layouts a segment is a place). All-reduce
//!   is a reduce-scatter within the node, an all-reduce of each member's local block between nodes,
//!   an all-gather within the node, so each node sends `2(n-1)/n` of the buffer between nodes (the
//!   minimum), spread over its ranks (the flat ring sends `2(k-1)/k` of the whole buffer from the
//!   one rank at each node's end); uneven layouts (3+2, 4+2+1) run in stages too, a smaller node's
//!   members carrying more. Each stage picks its own schedule; all-to-all stays flat, and so does
//!   one rank per node, logged once with the reason. Summation order: within the node in its ring
//!   order, then between nodes. `Communicator::net_bytes_sent` counts the bytes a rank posted to
//!   other nodes; `meshtrain bench` prints them per call next to the minimum.
//! - Reductions are deterministic: every rank ends with the same bits, and the same inputs give the
//!   same bits run to run.
//! - **Transports** (`src/transport/`): shared memory between ranks of one node (a segment per pair,
//!   a FIFO of slots per direction, spin-then-futex waits; the segment is unlinked as soon as both
//!   sides mapped it, so nothing is left in /dev/shm even after SIGKILL), TCP otherwise (a sender and
//!   a receiver thread per link, so rings never deadlock on socket buffers). A transport is a
//!   `SendLink`/`RecvLink` pair of traits; libfabric will be one more file.
//! - **Security**: every connection proves knowledge of the job's 128-bit secret (HMAC-SHA256 over
//!   nonces, both directions) and names its communicator, ranks and purpose; random bytes, HTTP
//!   requests, stalled half headers (5 s), wrong secrets, out-of-range and duplicate ranks are dropped
//!   and logged with their address, without using up a slot.
//! - **Faults**: every operation has a deadline; a closed socket or a dead shm peer (pid check) turns
//!   into an error naming the operation, its sequence number and the peer; the failing rank raises a
//!   job-wide abort that rank 0 forwards over the control channel, so every other rank exits non-zero
//!   within the deadline with an error naming the dead rank (tested with SIGKILL over shm and TCP,
//!   and during a single-copy all-gather).
//!
//! #### GPU collectives
//!
//! `comm::device` runs the same collectives on device buffers: `GpuCommState::new(GpuCommConfig::from_env()?)`
//! once per (communicator, device), then `state.bind(&comm, &dev).all_reduce(&mut buf, n, dtype, op)`
//! (also `broadcast`, `reduce`, `reduce_scatter_into`, `all_gather_into`, `all_to_all_into`, `send`,
//! `recv_into`); counts are elements, buffers may be larger, a buffer of another arm or too few bytes
//! is an error naming the operation and the bytes. Three paths, chosen identically on every rank:
//!
//! - **Stream-ordered** (small calls between GPUs of one node: the TP/SP all-reduces, all-gathers
//!   and reduce-scatters of every layer; `src/comm/device/oneshot.rs`, `kernels/oneshot.cu`): once
//!   per state every rank allocates a shareable workspace (two data slots, two flags, an error
//!   record) that its peers map. A call only queues work on the caller's stream and returns: copy the
//!   input into slot `call % 2`, `oneshot_signal` (a system-scope fenced store of the call's sequence
//!   number and fingerprint), `oneshot_wait` (one thread per peer spins on the peer's flag), then the
//!   ordinary reduce/copy kernels read the peers' slots in rank order, so every rank gets bitwise the
//!   same result. No host sync, no host message per call. A slot is reused two calls later, which is
//!   safe because every call waits for every peer's signal of the previous call; a signal never
//!   waits, so no block scheduling can deadlock. Errors keep the other paths' semantics, one check
//!   per step instead of per call: a wait that sees a peer in a different collective (the fingerprint
//!   packs operation, operator, dtype, root and count) or no signal within half of
//!   `MESHTRAIN_TIMEOUT` records it on the device; later waits return at once; the training step
//!   calls `GpuCommState::check` (a host all-gather of the error records) before it applies an update,
//!   and every rank fails naming the rank, the peer and both calls, e.g. `rank 0, call 2: rank 1 made
//!   a different call: all_reduce sum of 2000 f32`. Used when `MESHTRAIN_GPU_ONESHOT` (bytes a rank
//!   publishes, default `1M`, agreed as the minimum over the ranks) allows and the IPC path is
//!   eligible and not off.
//! - **IPC** (GPUs of one node): every rank exports its input's IPC handle (`cuIpcGetMemHandle` /
//!   `hipIpcGetMemHandle`), the records are all-gathered over the host communicator, and peers' inputs
//!   are mapped once and cached per (peer, allocation). All-reduce: rank r reduces block r from every
//!   peer's memory with the GPU reduce kernels, then copies every peer's finished block; each phase
//!   ends with a stream synchronize and an agreed error flag (a host all-reduce), so no rank
//!   overwrites what a peer may still read and an error anywhere is an error everywhere. Used when
//!   every rank is on this node, in its own process, and every buffer can be exported: on CUDA that
//!   means memory from `device::ipc::alloc_shareable` (`cuMemAlloc`; pool memory from
//!   `Device::alloc` cannot be exported, and such calls are staged). Call
//!   `GpuCommState::release_mappings` (collective) before freeing buffers used this way.
//! - **Hierarchical** (all-reduce over several nodes with the same number of ranks each):
//!   reduce-scatter within the node, all-reduce of each rank's block between nodes, all-gather
//!   within the node, each stage on its own path (see `crate::transport`, libfabric in detail).
//! - **FI_HMEM rings** (other nodes over libfabric, all-reduce, reduce-scatter, all-gather,
//!   broadcast): where every rank's links to its ring neighbours are libfabric links whose providers
//!   offer FI_HMEM (agreed once by all ranks; see `crate::transport`), the device buffers themselves are
//!   registered and each ring hop posts the send to the next rank and the receive from the previous
//!   one at once; received pieces land in a device slot that the reduce kernel folds into the
//!   buffer, so nothing passes through host memory.
//! - **Staged** (other nodes, CPU arm, send/recv, IPC off or impossible): chunks go through two slots
//!   of pinned host memory (`cuMemHostAlloc` / `hipHostMalloc`; aligned memory on the CPU arm) and the
//!   host collectives; the device copies of chunk i+1 are queued on the stream while the host
//!   collective of chunk i runs. The pipeline is one function for every arm (the CPU arm's copies are
//!   `memcpy`); a slot is handed to the host only after its copies' event completed.
//!
//! `MESHTRAIN_GPU_IPC=auto|on|off` (`on` where IPC is impossible is an error; `off` also turns the
//! stream-ordered path off), `MESHTRAIN_GPU_STAGE_CHUNK` (bytes per staged chunk, default `4M`) and
//! `MESHTRAIN_GPU_ONESHOT`. `meshtrain selftest --device cuda|hip|emu|cpu` checks every device
//! collective bit for bit on real ranks and reports the paths taken; `meshtrain bench device --device
//! cuda --min 4 --max 1M [--coll all_reduce|all_gather|broadcast]` times a device collective per
//! path (stream-ordered, IPC, FI_HMEM ring, staged), us per call for back-to-back calls between two
//! synchronizations, checked exact.
//!
//! Tested here (CI, no GPU): the staged pipeline on the CPU arm for every collective, the 7 element
//! types and 5 operators, world sizes 1..8, counts 0, 1, primes and sizes not divisible by the world
//! size, chunks from one element to the whole buffer (`src/comm/device/tests.rs`), and across real
//! processes (`tests/gpu_collectives.rs`). The IPC and stream-ordered paths run on the emu arm across
//! 2, 3 and 4 processes, bit for bit, every collective, dtype and operator: an emu buffer from
//! `alloc_shareable` is a memfd whose handle (pid, descriptor) a peer process maps through
//! `/proc/<pid>/fd/<fd>` between guard pages of its own, so the kernels of one process read (and the
//! flag kernels spin on) another's memory, bounds-checked (`tests/gpu_collectives.rs`,
//! `tests/device_oneshot.rs`: the path counts are asserted, a different call and a silent peer fail
//! every rank naming them); TP2 with sequence parallelism trains on emu over the stream-ordered path
//! and matches the CPU arm (`tests/gpu_layouts.rs`). The HIP arm type-checks (`--features hip`).
//! **Nothing GPU-side has run**: the CUDA/HIP copies, events, pinned memory, IPC handles and the
//! device-side flag waits are written against the cudarc 0.19 and HIP APIs but unverified;
//! `tests/gpu_collectives.rs` and `tests/device_oneshot.rs` hold the ignored `gpu_coll_*` tests
//! (mpirun of 2, 3, 4 ranks sharing one GPU: IPC forced on, staged, stream-ordered) for the first
//! machine with a GPU. `bench device` on emu measures the emulator (kernel launches are fibers on
//! the host; there the stream-ordered path, 135-210 us per call up to 16 KiB on 2 ranks, is slower
//! than the IPC path, 55-95 us, whose synchronizations cost nothing on emu), not a GPU.
//!

pub mod algo;
pub mod communicator;
pub mod device;
pub mod fingerprint;
pub mod flight;
pub mod nodes;
pub mod primitives;
pub mod probe;
pub mod selftest;
pub mod stats;
pub mod tuner;
pub mod tuning;
#[cfg(test)]
mod collective_tests;
#[cfg(test)]
mod hier_tests;
#[cfg(test)]
mod lifetime_tests;
#[cfg(test)]
pub(crate) mod testing;

use std::ops::Range;

pub use communicator::Communicator;
pub use tuning::{Algo, Cma, CommConfig};
// The element types moved to the crate-root leaf [`crate::dtype`]; re-exported here so that code
// written against `comm::{DType, ReduceOp, ...}` keeps compiling.
pub use crate::dtype::{self, DType, Element, ReduceOp};

/// Element range of block `i` when `n` elements are cut into `k` near-equal contiguous blocks.
pub fn block_range(n: usize, k: usize, i: usize) -> Range<usize> {
    let (base, rem) = (n / k, n % k);
    let start = i * base + i.min(rem);
    start..start + base + usize::from(i < rem)
}

#[cfg(test)]
mod tests {
    use super::block_range;

    #[test]
    fn blocks_tile_the_buffer() {
        for n in [0, 1, 2, 7, 8, 13, 1000] {
            for k in 1..=8 {
                let mut next = 0;
                for i in 0..k {
                    let r = block_range(n, k, i);
                    assert_eq!(r.start, next);
                    assert!(r.len() == n / k || r.len() == n / k + 1);
                    next = r.end;
                }
                assert_eq!(next, n);
            }
        }
    }
}
