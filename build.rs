//! Build script: with the `ofi` feature, compiles the libfabric shim (out-of-line forwards of the
//! static inline `fi_*` calls) and generates Rust bindings for it with bindgen, against the headers
//! and library that pkg-config finds for `libfabric`. Without the feature it does nothing.

use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var_os("CARGO_FEATURE_OFI").is_none() {
        return;
    }
    let shim = "src/transport/ofi_shim";
    println!("cargo:rerun-if-changed={shim}/shim.h");
    println!("cargo:rerun-if-changed={shim}/shim.c");
    let lib = pkg_config::Config::new()
        .atleast_version("1.10")
        .probe("libfabric")
        .unwrap_or_else(|e| {
            panic!("feature `ofi`: libfabric not found by pkg-config ({e}); install libfabric-dev or build with --no-default-features")
        });
    let mut cc = cc::Build::new();
    cc.file(format!("{shim}/shim.c")).warnings(true);
    for dir in &lib.include_paths {
        cc.include(dir);
    }
    cc.compile("meshtrain_ofi_shim");
    let mut bindings = bindgen::Builder::default()
        .header(format!("{shim}/shim.h"))
        .allowlist_function("mt_fi_.*|fi_getinfo|fi_freeinfo|fi_dupinfo|fi_fabric|fi_version|fi_strerror|fi_tostr")
        .allowlist_type("fi_.*|fid_.*")
        .allowlist_var("FI_.*")
        .derive_default(true)
        .layout_tests(false)
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()));
    for dir in &lib.include_paths {
        bindings = bindings.clang_arg(format!("-I{}", dir.display()));
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    bindings
        .generate()
        .expect("bindgen: generating libfabric bindings")
        .write_to_file(out.join("ofi_bindings.rs"))
        .expect("writing libfabric bindings");
}
