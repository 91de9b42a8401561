//! Build-script helpers shared by gin-ep-sys, gin-ep and gin-ep-lab (a build-dependency of
//! each): where NCCL's header sets are ([`nccl_headers`]), the kernel ABI generator
//! ([`abi_gen`], driven by [`generate_abi`]), and the nvcc driver that turns one crate's kernel
//! units into one fatbin per supported NCCL minor ([`kernels`]).
//!
//! Why a crate and not a `#[path]` module: the kernel build is several hundred lines with its
//! own tests (the ABI generator's, the spill parser's), and two crates build kernels with it;
//! a build-dependency is the one way build scripts share code that cargo builds and tests once.
//!
//! Never: downloads anything (scripts/setup-cuda does), or fails a build without nvcc unless
//! `GIN_EP_REQUIRE_KERNELS=1` asks it to (the host backend must build on any laptop).

pub mod abi_gen;
pub mod kernels;
pub mod nccl_headers;

use std::fs;
use std::path::Path;

pub use kernels::{build_kernel_sets, collect_units, KernelBuild, SUPPORTED_NCCL};

/// One ABI header for [`generate_abi`].
#[derive(Clone, Copy, Debug)]
pub struct AbiHeader<'a> {
    /// The kernel tree it lies in (the directory its `abi/` folder is in).
    pub tree: &'a Path,
    /// Its path in that tree, `abi/ll.h`.
    pub file: &'a str,
    /// Whether this crate's outputs carry it; `false` for a header another crate generates,
    /// read only for what the later headers use from it.
    pub emit: bool,
}

/// Reads `headers` in order (a header may use what an earlier one defines) and writes
/// `OUT_DIR/abi.rs` and `OUT_DIR/abi_checks.h`; a header outside the generator's subset ends
/// the build, with or without nvcc. `workspace` shortens the paths in the outputs.
pub fn generate_abi(workspace: &Path, headers: &[AbiHeader<'_>], out_dir: &Path) {
    let mut abi = abi_gen::Abi::new();
    for h in headers {
        let path = h.tree.join(h.file);
        let src =
            fs::read_to_string(&path).unwrap_or_else(|e| fail(&format!("reading {}: {e}", path.display())));
        let root = h
            .tree
            .strip_prefix(workspace)
            .unwrap_or(h.tree)
            .display()
            .to_string();
        if let Err(e) = abi.read_in(&root, h.file, &src, h.emit) {
            fail(&format!("{root}/{e}"));
        }
    }
    for (name, text) in [("abi.rs", abi.rust()), ("abi_checks.h", abi.c_checks())] {
        fs::write(out_dir.join(name), text).expect("OUT_DIR is writable");
    }
}

/// Ends the build with a message; cargo shows a build script's stderr on failure.
pub fn fail(message: &str) -> ! {
    eprintln!("kernel build: {message}");
    std::process::exit(1);
}
