//! The device collectives on the CPU arm over in-process ranks (world sizes 1..8): tiny staging
//! chunks force the staged pipeline through many chunks and both slots; results are compared
//! bit for bit with the serial reference ([`crate::comm::selftest`]). Plus the error cases.

use crate::comm::device::{GpuCommConfig, GpuCommState, GpuIpc};
use crate::comm::selftest::{check_device_all, check_device_type};
use crate::comm::testing::{run_ranks, run_ranks_on_nodes};
use crate::comm::{CommConfig, DType, ReduceOp};
use crate::device::Device;
use crate::error::Error;

/// Counts: empty, one, primes, and sizes not divisible by any world size above 1.
const COUNTS: [usize; 6] = [0, 1, 2, 13, 97, 331];

fn state(stage_chunk: usize) -> GpuCommState {
    GpuCommState::new(GpuCommConfig { ipc: GpuIpc::Auto, stage_chunk, ..Default::default() })
}

#[test]
fn staged_every_collective_every_dtype_every_size() {
    for k in 1..=8 {
        run_ranks(k, CommConfig::default(), |c| {
            // 24-byte chunks: a 331-element f32 call runs in 56 chunks, a blocked one in a piece
            // of one element per block and chunk once 3 ranks or more share the chunk.
            let fails = check_device_all(&c, &Device::Cpu, &mut state(24), &COUNTS, &ReduceOp::ALL).unwrap();
            assert_eq!(fails, Vec::<String>::new());
        });
    }
}

#[test]
fn staged_chunk_sizes_from_one_element_to_whole_buffers() {
    for k in [2, 3, 5] {
        run_ranks(k, CommConfig::default(), |c| {
            for chunk in [1, 8, 100, 4 << 20] {
                let mut st = state(chunk);
                let fails = check_device_type::<f32>(&c, &Device::Cpu, &mut st, &[0, 7, 331], &ReduceOp::ALL).unwrap();
                assert_eq!(fails, Vec::<String>::new(), "chunk {chunk}");
                let fails = check_device_type::<i64>(&c, &Device::Cpu, &mut st, &[331], &[ReduceOp::Sum]).unwrap();
                assert_eq!(fails, Vec::<String>::new(), "chunk {chunk}");
            }
        });
    }
}

#[test]
fn the_cpu_arm_never_takes_the_ipc_path() {
    run_ranks(3, CommConfig::default(), |c| {
        let dev = Device::Cpu;
        let mut st = state(64);
        let mut buf = dev.upload(&[1.0f32; 50]).unwrap();
        st.bind(&c, &dev).all_reduce(&mut buf, 50, DType::F32, ReduceOp::Sum).unwrap();
        assert_eq!(st.path_counts(), (0, 1));
        let mut got = vec![0f32; 50];
        dev.copy_to_host(&buf, &mut got).unwrap();
        assert!(got.iter().all(|&x| x == 3.0));
    });
}

#[test]
fn wrong_sizes_are_errors_naming_the_operation_and_bytes() {
    run_ranks(2, CommConfig::default(), |c| {
        let dev = Device::Cpu;
        let mut st = state(64);
        let mut coll = st.bind(&c, &dev);
        let mut small = dev.alloc(12).unwrap();
        let msg = coll.all_reduce(&mut small, 4, DType::F32, ReduceOp::Sum).unwrap_err().to_string();
        assert!(msg.contains("all_reduce") && msg.contains("12 bytes") && msg.contains("need 16"), "{msg}");
        let send = dev.alloc(40).unwrap();
        let msg = coll.reduce_scatter_into(&send, &mut small, 10, DType::F64, ReduceOp::Sum).unwrap_err().to_string();
        assert!(msg.contains("reduce_scatter") && msg.contains("`send` holds 40 bytes"), "{msg}");
        let msg = coll.all_gather_into(&send, &mut small, 10, DType::F32).unwrap_err().to_string();
        assert!(msg.contains("all_gather") && msg.contains("`recv` holds 12 bytes"), "{msg}");
        let msg = coll.all_to_all_into(&send, &mut small, 10, DType::F32).unwrap_err().to_string();
        assert!(msg.contains("all_to_all") && msg.contains("`recv`"), "{msg}");
        assert!(coll.broadcast(&mut small, 1, DType::F32, 2).unwrap_err().to_string().contains("root 2 out of range"));
        assert!(coll.send(&send, 1, DType::F32, c.rank()).is_err());
        // Nothing moved: the communicator still works afterwards.
        let mut ok = dev.upload(&[2i32; 3]).unwrap();
        coll.all_reduce(&mut ok, 3, DType::I32, ReduceOp::Prod).unwrap();
        let mut got = [0i32; 3];
        dev.copy_to_host(&ok, &mut got).unwrap();
        assert_eq!(got, [4; 3]);
    });
}

#[test]
fn ipc_forced_on_with_the_cpu_device_is_a_config_error() {
    let errors = run_ranks(3, CommConfig::default(), |c| {
        let dev = Device::Cpu;
        let mut st = GpuCommState::new(GpuCommConfig { ipc: GpuIpc::On, stage_chunk: 64, ..Default::default() });
        let mut buf = dev.upload(&[1.0f32; 5]).unwrap();
        st.bind(&c, &dev).all_reduce(&mut buf, 5, DType::F32, ReduceOp::Sum).unwrap_err()
    });
    for e in errors {
        assert!(matches!(&e, Error::Config { key, .. } if key == "MESHTRAIN_GPU_IPC"), "{e}");
        assert!(e.to_string().contains("the CPU device has no IPC handles"), "{e}");
    }
}

#[test]
fn ipc_off_and_auto_agree_on_the_cpu_arm() {
    run_ranks(4, CommConfig::default(), |c| {
        let mut off = GpuCommState::new(GpuCommConfig { ipc: GpuIpc::Off, stage_chunk: 40, ..Default::default() });
        let fails = check_device_type::<bf16>(&c, &Device::Cpu, &mut off, &[0, 13, 97], &ReduceOp::ALL).unwrap();
        assert_eq!(fails, Vec::<String>::new());
    });
}

use half::bf16;

/// Every all-reduce on ranks spread evenly over several nodes runs in three stages (reduce-scatter
/// within the node, all-reduce of the block between nodes, all-gather within), exact for every
/// dtype and operator (`avg` divided once), with the scratch block growing from count to count;
/// an uneven spread stays flat. In-process ranks share one process, so the stages themselves are
/// staged here (IPC needs a process per rank; `tests/testbed/ci.sh` runs them over IPC and rings).
#[test]
fn all_reduce_across_nodes_runs_in_three_stages() {
    for (k, nodes, three_stage) in [(4, 2, true), (6, 2, true), (6, 3, true), (5, 2, false), (3, 3, false)] {
        let calls = run_ranks_on_nodes(k, nodes, CommConfig::default(), |c| {
            let dev = Device::open(crate::device::DeviceKind::Emu, 0).unwrap();
            let mut st = state(40);
            let fails = check_device_all(&c, &dev, &mut st, &[0, 1, 13, 97], &ReduceOp::ALL).unwrap();
            assert_eq!(fails, Vec::<String>::new());
            st.check(&c, &dev).unwrap();
            st.release_mappings(&c, &dev).unwrap();
            st.hierarchical_calls()
        });
        // 7 dtypes x 3 non-empty counts x 5 operators.
        let want = if three_stage { 7 * 3 * 5 } else { 0 };
        assert!(calls.iter().all(|&n| n == want), "{k} ranks on {nodes} nodes: {calls:?}");
    }
}
