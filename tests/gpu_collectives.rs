//! The device collectives on a real GPU, across real rank processes sharing it (ignored
//! elsewhere). Run on a machine with an NVIDIA GPU, driver, NVRTC and OpenMPI with:
//!
//! `cargo test --release --test gpu_collectives -- --ignored gpu_coll_ --test-threads=1 --nocapture`
//!
//! Each test starts `meshtrain selftest --device cuda` under mpirun (2, 3 and 4 ranks, all on
//! GPU 0 when only one is visible): every collective, element type and operator, bit for bit
//! against the serial reference, once over the IPC path (forced on, so a silent fallback fails)
//! and once staged through pinned host memory with small chunks (many chunks, both slots). A
//! machine without a CUDA driver says SKIP and passes.
//!
//! Three tests run everywhere: the same selftest on the CPU arm across real processes (the staged
//! pipeline with memcpy copies), on the emu arm (staged, and IPC through emu shared memory), and
//! `MESHTRAIN_GPU_IPC=on` with the CPU device, a clear error.

mod common;

use std::time::Duration;

/// Counts small enough for a quick run, with the same shapes as the CPU checks (0, 1, primes).
const COUNTS: &str = "0,1,2,13,97,4099";

fn cuda_or_skip(test: &str) -> bool {
    let ok = meshtrain::device::cuda_driver_available();
    if !ok {
        eprintln!("SKIP {test}: no CUDA driver (libcuda.so) on this machine");
    }
    ok
}

/// Runs the device selftest on `np` ranks of `device` with `envs`; returns rank 0's summary.
fn device_selftest(np: usize, device: &str, envs: &[(&str, &str)]) -> String {
    let mut cmd = common::mpirun(np);
    cmd.args(["selftest", "--device", device, "--counts", COUNTS, "--large", "1000003"]);
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let out = common::run(cmd, Duration::from_secs(600));
    assert!(
        out.success() && out.stdout.contains(" 0 mismatches"),
        "device selftest on {np} ranks {envs:?} failed ({:?} after {:?}):\n{}\n{}",
        out.status,
        out.elapsed,
        out.stdout,
        out.stderr
    );
    let line = out.stdout.lines().find(|l| l.contains("device path: "));
    line.expect("the selftest reports the device path").to_string()
}

/// "device path: I of C collective calls over IPC" -> (I, C).
fn path_counts(line: &str) -> (u64, u64) {
    let rest = line.split("device path: ").nth(1).expect("device path");
    let words: Vec<&str> = rest.split_whitespace().collect();
    (words[0].parse().expect("IPC calls"), words[2].parse().expect("calls"))
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_coll_ipc_path_2_3_4_ranks() {
    if !cuda_or_skip("gpu_coll_ipc_path_2_3_4_ranks") {
        return;
    }
    for np in [2, 3, 4] {
        let line = device_selftest(np, "cuda", &[("MESHTRAIN_GPU_IPC", "on")]);
        let (ipc, calls) = path_counts(&line);
        // Calls with a count of 0 stay staged (nothing to map); every other one went over IPC.
        assert!(ipc > 0 && ipc < calls, "{np} ranks: {line}");
        eprintln!("{np} ranks: {line}");
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_coll_staged_path_2_3_4_ranks() {
    if !cuda_or_skip("gpu_coll_staged_path_2_3_4_ranks") {
        return;
    }
    for np in [2, 3, 4] {
        let line = device_selftest(np, "cuda", &[("MESHTRAIN_GPU_IPC", "off"), ("MESHTRAIN_GPU_STAGE_CHUNK", "4K")]);
        assert_eq!(path_counts(&line).0, 0, "{np} ranks: {line}");
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_coll_auto_uses_ipc_on_one_node() {
    if !cuda_or_skip("gpu_coll_auto_uses_ipc_on_one_node") {
        return;
    }
    let line = device_selftest(3, "cuda", &[]);
    assert!(path_counts(&line).0 > 0, "{line}");
}

#[test]
fn device_selftest_on_the_cpu_arm_across_processes() {
    for np in [1, 3, 4] {
        let line = device_selftest(np, "cpu", &[("MESHTRAIN_GPU_STAGE_CHUNK", "1K")]);
        assert_eq!(path_counts(&line).0, 0, "{np} ranks: {line}");
    }
}

/// The same on the emu arm: the combine and divide kernels of every dtype and operator run
/// emulated (bounds-checked) inside the staged collectives of three processes, and inside the IPC
/// path, whose peers' buffers are emu shared memory mapped by the other processes (the
/// stream-ordered path off, so that every call with elements goes over IPC).
#[test]
fn device_selftest_on_the_emu_arm_across_processes() {
    let line = device_selftest(3, "emu", &[("MESHTRAIN_GPU_IPC", "off"), ("MESHTRAIN_GPU_STAGE_CHUNK", "1K")]);
    assert_eq!(path_counts(&line).0, 0, "{line}");
    for np in [2, 3, 4] {
        let line = device_selftest(np, "emu", &[("MESHTRAIN_GPU_IPC", "on"), ("MESHTRAIN_GPU_ONESHOT", "0")]);
        let (ipc, calls) = path_counts(&line);
        // Per dtype (7): 18 calls per count, those with 0 elements staged; the 18 large f32 over IPC.
        assert_eq!((ipc, calls), (7 * 5 * 18 + 18, 7 * 6 * 18 + 18), "{np} ranks: {line}");
    }
}

#[test]
fn ipc_forced_on_with_the_cpu_device_fails_clearly() {
    let mut cmd = common::mpirun(2);
    cmd.args(["selftest", "--device", "cpu", "--counts", "5", "--large", "0"]).env("MESHTRAIN_GPU_IPC", "on");
    let out = common::run(cmd, Duration::from_secs(120));
    // Rank 0 fails on its first call (other ranks may report that rank 0 left).
    let rank0 = out.rank_stderr(0).join("\n");
    assert!(
        rank0.contains("MESHTRAIN_GPU_IPC") && rank0.contains("the CPU device has no IPC handles"),
        "{}\n{}",
        out.stdout,
        out.stderr
    );
    assert!(!out.stdout.contains("mismatches"), "{}", out.stdout);
}
