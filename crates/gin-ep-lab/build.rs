//! Build script of gin-ep-lab: the lab's kernels (kernels/*.cu: the all-to-all study and its
//! test pattern) as one fatbin per supported NCCL minor, and their ABI (kernels/abi/*.h), both
//! through gin-ep-build, as gin-ep's are.
//!
//! The lab's units include gin-ep's device headers (kernels/common/, kernels/abi/ at the
//! workspace root): the include path is the lab's tree first, then gin-ep's. Its ABI headers
//! use gin-ep's abi/common.h and abi/fabric.h, which are read for their definitions and left
//! to gin-ep's generated module.
//!
//! Outputs for src/kernels.rs and src/abi.rs: `OUT_DIR/gin_ep_lab_2_XX.fatbin`,
//! `OUT_DIR/kernels_meta.rs`, `OUT_DIR/ptxas.txt`, `OUT_DIR/abi.rs`, `OUT_DIR/abi_checks.h`.

use std::env;
use std::path::{Path, PathBuf};

use gin_ep_build::{build_kernel_sets, collect_units, generate_abi, AbiHeader, KernelBuild};

/// gin-ep's headers the lab's ABI headers build on (read, not emitted), then the lab's own.
const GIN_EP_ABI: &[&str] = &["abi/common.h", "abi/fabric.h"];
const LAB_ABI: &[&str] = &["abi/alltoall.h", "abi/pattern.h"];

fn main() {
    let manifest = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets this"));
    let workspace = manifest
        .parent()
        .and_then(Path::parent)
        .expect("crates/gin-ep-lab sits two levels below the workspace root")
        .to_path_buf();
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets this"));
    let lab_kernels = manifest.join("kernels");
    let gin_ep_kernels = workspace.join("kernels");

    let headers: Vec<AbiHeader<'_>> = GIN_EP_ABI
        .iter()
        .map(|file| AbiHeader {
            tree: &gin_ep_kernels,
            file,
            emit: false,
        })
        .chain(LAB_ABI.iter().map(|file| AbiHeader {
            tree: &lab_kernels,
            file,
            emit: true,
        }))
        .collect();
    generate_abi(&workspace, &headers, &out_dir);

    build_kernel_sets(&KernelBuild {
        crate_name: "gin-ep-lab",
        workspace: &workspace,
        out_dir: &out_dir,
        prefix: "gin_ep_lab",
        include_dirs: vec![lab_kernels.clone(), gin_ep_kernels],
        units: collect_units(&lab_kernels),
        prelude: String::new(),
        abi_headers: LAB_ABI.iter().map(|h| h.to_string()).collect(),
        no_kernels_cfg: "gin_ep_lab_no_kernels",
    });
}
