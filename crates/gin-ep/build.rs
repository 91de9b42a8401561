//! Build script of gin-ep: its kernel ABI and its kernels, through gin-ep-build.
//!
//! Owns: which units and ABI headers are gin-ep's. `kernels/**/*.cu` are compiled into one
//! fatbin per supported NCCL minor (gin-ep-build's `kernels` says how and why); the harness's
//! units ([`HARNESS_UNITS`]) and the device timestamps go into harness builds only (the CLI,
//! gin-ep's tests), never into the library a product (the Python wheel) links. The lab's
//! kernels are gin-ep-lab's (crates/gin-ep-lab/kernels), built by its own script.
//!
//! Outputs for `src/backend/cuda/kernels.rs` and `src/backend/cuda/abi.rs`:
//! `OUT_DIR/gin_ep_2_XX.fatbin`, `OUT_DIR/kernels_meta.rs`, `OUT_DIR/ptxas.txt`, and always
//! `OUT_DIR/abi.rs` (the Rust form of kernels/abi/*.h) with `OUT_DIR/abi_checks.h` (the same
//! layouts as static_asserts that every kernel build includes). A header outside the
//! generator's subset fails the build with or without nvcc.

use std::env;
use std::path::{Path, PathBuf};

use gin_ep_build::{build_kernel_sets, collect_units, generate_abi, AbiHeader, KernelBuild};

/// The headers of kernels/abi/, in the order they are read (a header may use what an
/// earlier one defines). A new header is added here and in backend/cuda/abi.rs's docs;
/// gin-ep-lab reads common.h and fabric.h before its own.
const ABI_HEADERS: &[&str] = &[
    "abi/common.h",
    "abi/fabric.h",
    "abi/ll.h",
    "abi/ht.h",
    "abi/gin.h",
];

/// Kernel units of the harness (`gin-ep check --mode gin`), relative to kernels/.
const HARNESS_UNITS: &[&str] = &["gin/conformance.cu"];

fn main() {
    let manifest = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets this"));
    let workspace = manifest
        .parent()
        .and_then(Path::parent)
        .expect("crates/gin-ep sits two levels below the workspace root")
        .to_path_buf();
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets this"));
    let kernels_dir = workspace.join("kernels");

    let headers: Vec<AbiHeader<'_>> = ABI_HEADERS
        .iter()
        .map(|file| AbiHeader {
            tree: &kernels_dir,
            file,
            emit: true,
        })
        .collect();
    generate_abi(&workspace, &headers, &out_dir);

    let harness = env::var_os("CARGO_FEATURE_HARNESS").is_some();
    let mut units = collect_units(&kernels_dir);
    if !harness {
        units.retain(|u| !HARNESS_UNITS.iter().any(|h| *u == kernels_dir.join(h)));
    }
    build_kernel_sets(&KernelBuild {
        crate_name: "gin-ep",
        workspace: &workspace,
        out_dir: &out_dir,
        prefix: "gin_ep",
        include_dirs: vec![kernels_dir.clone()],
        units,
        prelude: format!("#define GIN_EP_STAMPS {}\n", u8::from(harness)),
        abi_headers: ABI_HEADERS.iter().map(|h| h.to_string()).collect(),
        no_kernels_cfg: "gin_ep_no_kernels",
    });
}
