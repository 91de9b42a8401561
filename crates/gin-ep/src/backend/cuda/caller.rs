//! What an embedding API (the C API, `crates/gin-ep-capi`) asks of a [`GpuRank`] besides its
//! engines: the caller's device allocator, device memory of its own, and int32 expert ids
//! widened to the int64 the kernels read.

use super::engine::GpuRank;
use super::runtime::{DeviceAllocator, DeviceBuffer};
use crate::error::Result;

impl GpuRank {
    /// Makes every later device buffer of the rank (the engines' and [`GpuRank::alloc`]'s)
    /// come from `a` and go back to it (None: cuMemAlloc). The windows are NCCL's
    /// (ncclMemAlloc) either way.
    pub fn set_device_allocator(&self, a: Option<DeviceAllocator>) -> Result<()> {
        self.run(0, |q| {
            q.rank().set_allocator(a);
            Ok(())
        })
    }

    /// `bytes` of device memory on the rank's GPU, freed when dropped.
    pub fn alloc(&self, bytes: usize) -> Result<DeviceBuffer> {
        self.run(0, |q| q.rank().alloc(bytes))
    }

    /// Queues on `stream` (0: the legacy default stream) the widening of the `n` int32 values at
    /// `src` into the `n` int64 values at `dst` (`(address, bytes)` of this GPU's memory).
    pub fn widen_i32_to_i64(
        &self,
        stream: u64,
        src: (u64, usize),
        dst: (u64, usize),
        n: usize,
    ) -> Result<()> {
        self.run(stream, |q| {
            let s = q.rank().external("int32 ids", src.0, src.1)?;
            let d = q.rank().external("int64 ids", dst.0, dst.1)?;
            q.widen_i32_to_i64(s, d, n)
        })
    }
}

impl GpuRank {
    /// Copies `src` into the start of `dst`, after the work queued on `stream` (0: the legacy
    /// default stream) and before any queued later (bounded waits, as [`Queue::upload`](super::runtime::Queue::upload)).
    pub fn upload_to(&self, stream: u64, dst: &DeviceBuffer, src: &[u8]) -> Result<()> {
        self.run(stream, |q| q.upload(dst.region().sub(0, src.len())?, src))
    }

    /// The first u64 of `src`, read after the work queued on `stream` (0: the legacy
    /// default stream), with the rank's deadline.
    pub fn read_u64(&self, stream: u64, src: &DeviceBuffer) -> Result<u64> {
        self.run(stream, |q| {
            q.wait("the work before a device read")?;
            Ok(q.read_u64_pair(src.region())?[0])
        })
    }

    /// Queues on `stream` a copy of caller memory `src` (`(address, bytes)` of this GPU) into
    /// the start of `dst`.
    pub fn copy_from_caller(&self, stream: u64, dst: &DeviceBuffer, src: (u64, usize)) -> Result<()> {
        self.run(stream, |q| {
            let s = q.rank().external("caller memory", src.0, src.1)?;
            q.copy_from_external(dst.region(), s)
        })
    }

    /// The first `dst.len()` bytes of `src`, read after the work queued on `stream` (bounded
    /// waits, as [`Queue::download`](super::runtime::Queue::download)).
    pub fn download_from(&self, stream: u64, src: &DeviceBuffer, dst: &mut [u8]) -> Result<()> {
        self.run(stream, |q| q.download(src.region().sub(0, dst.len())?, dst))
    }

    /// Queues on `stream` a copy of the first `dst.1` bytes of `src` to caller memory `dst`
    /// (`(address, bytes)` of this GPU).
    pub fn copy_to_caller(&self, stream: u64, src: &DeviceBuffer, dst: (u64, usize)) -> Result<()> {
        self.run(stream, |q| {
            let d = q.rank().external("caller memory", dst.0, dst.1)?;
            q.copy_to_external(src.region(), d)
        })
    }
}
