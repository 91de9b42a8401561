//! Kernels another crate brings: a [`Module`] loaded from that crate's fatbins (one per NCCL
//! minor, as gin-ep's own) into a rank's context, and launches of its functions on the
//! rank's own stream. gin-ep-lab's all-to-all study is the user: its kernels are not
//! gin-ep's, so they are not in the rank's embedded module.
//!
//! Owns: choosing the set built for the loaded NCCL's minor, the module handle and its
//! function cache, and unloading it after the rank's stream is idle. Never: knows a kernel's
//! parameter; the caller builds it and vouches for it ([`Module::launch`] is unsafe for that
//! reason alone).

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{c_void, CString};

use cudarc::driver::{result, sys};
use gin_ep_sys as ns;

use super::result::{cu, unavailable};
use super::CudaRank;
use crate::backend::cuda::kernels::KernelSet;
use crate::backend::cuda::version_text;
use crate::error::{Error, Result};

/// A module loaded into one rank's context; unloaded on drop. Borrowing the rank keeps the
/// context alive for as long as the module is.
pub struct Module<'r> {
    rank: &'r CudaRank,
    /// Names the module in errors ("gin-ep-lab kernels").
    what: &'static str,
    raw: sys::CUmodule,
    functions: RefCell<HashMap<&'static str, sys::CUfunction>>,
}

impl std::fmt::Debug for Module<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Module")
            .field("what", &self.what)
            .field("rank", &self.rank.info().rank)
            .finish()
    }
}

/// The set of `sets` built for NCCL `loaded`'s minor, or why there is none.
fn set_for(what: &str, sets: &[KernelSet], loaded: i32) -> Result<&'static [u8]> {
    let abi = ns::DevAbi::for_library(loaded)
        .ok_or_else(|| unavailable(format!("{what}: NCCL {} is not supported", version_text(loaded))))?;
    let label = abi.to_string();
    let set = sets
        .iter()
        .find(|s| s.nccl == label)
        .ok_or_else(|| unavailable(format!("{what}: no kernel set for NCCL {label}")))?;
    set.fatbin.ok_or_else(|| {
        unavailable(format!(
            "{what}: kernels for NCCL {label} were not built ({}); rebuild after scripts/setup-cuda",
            set.absent_reason.unwrap_or("unknown")
        ))
    })
}

impl CudaRank {
    /// Loads the kernels of `sets` (a crate's generated `KERNEL_SETS`) built for the NCCL this
    /// rank runs with into the rank's context; `what` names them in errors.
    pub fn load_module(&self, what: &'static str, sets: &'static [KernelSet]) -> Result<Module<'_>> {
        let fatbin = set_for(what, sets, self.info.nccl_version)?;
        self.bind_to_thread()?;
        // SAFETY: the fatbin is a complete image embedded at build time, 64-byte aligned
        // (gin-ep-build's generated `Aligned`), and the rank's context is current.
        let raw = unsafe { result::module::load_data(fatbin.as_ptr() as *const c_void) }
            .map_err(|e| unavailable(format!("{what}: cuModuleLoadData failed: {e:?}")))?;
        Ok(Module {
            rank: self,
            what,
            raw,
            functions: RefCell::new(HashMap::new()),
        })
    }
}

impl<'r> Module<'r> {
    /// The rank the module is loaded into.
    pub fn rank(&self) -> &'r CudaRank {
        self.rank
    }

    /// The function `name`, looked up once.
    fn function(&self, name: &'static str) -> Result<sys::CUfunction> {
        if let Some(f) = self.functions.borrow().get(name) {
            return Ok(*f);
        }
        let cname = CString::new(name).map_err(|_| Error::input("kernel name", name))?;
        // SAFETY: the module is live for as long as self, and so is the function handle.
        let f = unsafe { result::module::get_function(self.raw, cname) }
            .map_err(|e| unavailable(format!("kernel `{name}` is not in the {} ({e:?})", self.what)))?;
        self.functions.borrow_mut().insert(name, f);
        Ok(f)
    }

    /// Whether the module has a kernel `name` (an error names the module and the kernel).
    pub fn check_function(&self, name: &'static str) -> Result<()> {
        self.function(name).map(|_| ())
    }

    /// Launches kernel `name` of the module on the rank's own stream with `grid` x `block`
    /// threads, passing `args` as its single by-value parameter. The own stream only: it is
    /// the stream the module's `Drop` waits for before unloading, so no kernel of the module
    /// can outlive it.
    ///
    /// # Safety
    /// `A` must match the kernel's parameter type exactly (layout asserted on both sides of
    /// the ABI), and every pointer and offset in it must be valid for what the kernel
    /// accesses, with the memory alive until the kernel has run.
    pub unsafe fn launch<A: Copy>(&self, name: &'static str, grid: u32, block: u32, args: &A) -> Result<()> {
        let f = self.function(name)?;
        // SAFETY: the caller's contract; f is live in the rank's context, which the own
        // queue's stream belongs to.
        unsafe {
            self.rank
                .own()
                .launch_function(f, name, grid, block, 0, false, args)
        }
    }
}

impl Drop for Module<'_> {
    fn drop(&mut self) {
        let _ = self.rank.bind_to_thread();
        // A kernel of the module may still be queued: unload only once the rank's stream is
        // idle, and leave a module whose work did not finish to the context's teardown
        // (unloading it could block behind a stuck kernel).
        if self.rank.wait("module unload").is_err() || self.rank.comm().failed() {
            return;
        }
        // SAFETY: the module is live, loaded in the rank's context, released once, and no
        // kernel of it is pending.
        let _ = cu("cuModuleUnload", unsafe { result::module::unload(self.raw) });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SETS: &[KernelSet] = &[
        KernelSet {
            nccl: "2.28",
            nccl_header_version: Some(22809),
            fatbin: Some(&[0x50, 0xed, 0x55, 0xba]),
            nvcc_command: None,
            absent_reason: None,
        },
        KernelSet {
            nccl: "2.29",
            nccl_header_version: None,
            fatbin: None,
            nvcc_command: None,
            absent_reason: Some("no NCCL 2.29 headers"),
        },
    ];

    #[test]
    fn a_module_takes_the_set_of_the_loaded_minor_or_says_why_not() {
        assert_eq!(set_for("lab", SETS, 22809).unwrap(), SETS[0].fatbin.unwrap());
        let absent = set_for("lab", SETS, 22907).unwrap_err().to_string();
        assert!(
            absent.contains("lab") && absent.contains("no NCCL 2.29 headers"),
            "{absent}"
        );
        let missing = set_for("lab", SETS, 23007).unwrap_err().to_string();
        assert!(missing.contains("no kernel set for NCCL 2.30"), "{missing}");
        let unsupported = set_for("lab", SETS, 22705).unwrap_err().to_string();
        assert!(unsupported.contains("2.27.5"), "{unsupported}");
    }
}
