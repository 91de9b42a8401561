//! Harness-only hooks of [`Ep`] (the `harness` feature): the GPU check drives `Ep` exactly
//! as Python does and reads what it cannot see through the product operations through
//! these. Each one names the operation it supports; none is on the product path.

use super::{Engine, Ep, HtHandle, HtInner};
use crate::backend::cuda::engine::EngineFault;
use crate::backend::cuda::ht::{HtVariant, Sizing};
use crate::error::{Error, Result};
use crate::ht::{HtCombineOutput, HtDispatchOutput};
use crate::quant::Rows;

fn gpu_only(what: &str) -> Error {
    Error::input(
        what,
        "a harness hook of the CUDA backend, called on a host-backend Ep",
    )
}

impl Ep {
    fn with_cuda_engine<T>(
        &self,
        what: &str,
        f: impl FnOnce(&mut crate::backend::cuda::engine::CudaEngine) -> Result<T>,
    ) -> Result<T> {
        match &mut self.state().engine {
            Engine::Cuda(c) => f(c),
            Engine::Host(_) => Err(gpu_only(what)),
        }
    }

    fn device_handle<'h>(&self, h: &'h HtHandle) -> Result<&'h crate::backend::cuda::ht::HtGpuHandle> {
        self.own_ht(h)?;
        match &h.inner {
            HtInner::Device(d) => Ok(d),
            HtInner::Host(_) => Err(gpu_only("HT handle")),
        }
    }

    /// Injects (or clears) a bug in the engine layer that the check must catch.
    pub fn set_engine_fault(&self, fault: Option<EngineFault>) -> Result<()> {
        self.with_cuda_engine("engine fault", |c| {
            c.set_fault(fault);
            Ok(())
        })
    }

    /// HT: poisons the window's combine input and outputs, and receive slab `slab` when given.
    pub fn ht_poison(&self, slab: Option<usize>) -> Result<()> {
        self.with_cuda_engine("HT poison", |c| c.ht_poison(slab))
    }

    /// HT: exact or static sizing for the next dispatches.
    pub fn ht_set_sizing(&self, sizing: Sizing) -> Result<()> {
        self.with_cuda_engine("HT sizing", |c| c.ht_set_sizing(sizing))
    }

    /// HT: the CTA count and kernel variant of the next operations (every rank the same).
    pub fn ht_set_tuning(&self, num_sms: u32, variant: HtVariant) -> Result<()> {
        self.with_cuda_engine("HT tuning", |c| c.ht_set_tuning(num_sms, variant))
    }

    /// HT: the CTA count and kernel variant of the next operations.
    pub fn ht_tuning(&self) -> Result<(u32, HtVariant)> {
        self.with_cuda_engine("HT tuning", |c| c.ht_tuning())
    }

    /// HT: what the last fresh dispatch (along `handle`) produced, in the oracle's types.
    pub fn ht_download_dispatch(&self, handle: &HtHandle) -> Result<HtDispatchOutput> {
        let h = self.device_handle(handle)?;
        self.with_cuda_engine("HT download", |c| c.ht_download_dispatch(h))
    }

    /// HT: the rows `handle`'s last dispatch left in receive slab `slab`.
    pub fn ht_download_slab_x(&self, handle: &HtHandle, slab: usize) -> Result<Rows> {
        let h = self.device_handle(handle)?;
        self.with_cuda_engine("HT download", |c| c.ht_download_slab_x(h, slab))
    }

    /// LL: the following launches take the masked kernels with no rank masked (an all-zero
    /// rank mask word the engine owns), as the harness runs them under `GIN_EP_LL_MASKED`.
    pub fn ll_use_own_mask_word(&self) -> Result<()> {
        self.with_cuda_engine("LL mask word", |c| c.ll_use_own_mask_word())
    }

    /// LL: the routing of `handle`'s dispatch as its buffer set holds it (after waiting).
    pub fn ll_download_routing(&self, handle: &super::LlHandle) -> Result<crate::ll::LlRouting> {
        if handle.ep != self.inner.id {
            return Err(Error::StaleHandle {
                what: "LL handle".into(),
                reason: "it comes from another Ep".into(),
            });
        }
        self.with_cuda_engine("LL download", |c| c.ll_download_routing(handle.set))
    }

    /// HT: the window's combine output along `handle`.
    pub fn ht_download_combine(&self, handle: &HtHandle, weights: bool) -> Result<HtCombineOutput> {
        let h = self.device_handle(handle)?;
        self.with_cuda_engine("HT download", |c| c.ht_download_combine(h, weights))
    }
}

impl Ep {
    /// The launch of this `Ep`'s GPU objects (fabric, node, grid), for the benchmark's report.
    pub fn launch_info(&self) -> Result<crate::backend::cuda::engine::LaunchInfo> {
        self.with_cuda_engine("launch info", |c| Ok(c.launch_info()))
    }
}
