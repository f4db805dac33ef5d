//! The libfabric transport across real rank processes on this machine: `meshtrain selftest` (every
//! collective, element type and operator, bit-exact) with `MESHTRAIN_TRANSPORT=ofi` over the
//! `tcp;ofi_rxm` and `shm` providers at 2, 3, 5 and 8 ranks, the choice logged, and a provider that
//! does not exist turned into a clear error. The multi-node runs (two network-namespace nodes,
//! partition, SIGKILL) are in tests/testbed/ci.sh.
#![cfg(feature = "ofi")]

mod common;

use std::time::Duration;

fn selftest_over(provider: &str, np: usize) -> common::Finished {
    let mut cmd = common::mpirun(np);
    cmd.args(["selftest", "--counts", "0,1,13,4099", "--large", "300001"])
        .env("MESHTRAIN_TRANSPORT", "ofi")
        .env("FI_PROVIDER", provider)
        .env("RUST_LOG", "info");
    common::run(cmd, Duration::from_secs(300))
}

fn check_provider(provider: &str) {
    for np in [2, 3, 5, 8] {
        let out = selftest_over(provider, np);
        assert!(
            out.success() && out.stdout.contains(&format!("selftest: {np} ranks: 0 mismatches")),
            "selftest over {provider} on {np} ranks failed ({:?} after {:?}):\n{}\n{}",
            out.status,
            out.elapsed,
            out.stdout,
            out.stderr
        );
        let logged = format!("provider {provider},");
        assert!(out.stderr.contains(&logged), "rank 0 did not log `{logged}`:\n{}", out.stderr);
    }
}

#[test]
fn selftest_over_tcp_rxm_provider() {
    check_provider("tcp;ofi_rxm");
}

#[test]
fn selftest_over_shm_provider() {
    check_provider("shm");
}

#[test]
fn missing_provider_is_an_error_naming_it() {
    let mut cmd = common::mpirun(2);
    cmd.args(["selftest", "--counts", "1", "--large", "0"])
        .env("MESHTRAIN_TRANSPORT", "ofi")
        .env("MESHTRAIN_OFI_PROVIDER", "no_such_provider");
    let out = common::run(cmd, Duration::from_secs(120));
    // (mpirun's own exit status is 0 here: the helper lets every rank report instead of aborting.)
    assert!(!out.stdout.contains("mismatches"), "selftest with a missing provider ran:\n{}", out.stdout);
    assert!(
        out.stderr.contains("meshtrain: error: rank 0:") && out.stderr.contains("fi_getinfo (provider no_such_provider)"),
        "error does not name the provider:\n{}",
        out.stderr
    );
}
