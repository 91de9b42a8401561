//! Caller tensors of the GPU checks: device memory of the rank's GPU that the checks hand to
//! [`crate::Ep`] as the Python package hands it torch tensors.

use crate::backend::cuda::ht::POISON;
use crate::backend::cuda::DeviceBuffer;
use crate::ep::{DeviceOut, GpuRank, Mem};
use crate::error::Result;

/// A caller's tensor in device memory of this rank's GPU (what a torch tensor is to the
/// Python package): `bytes` of `buf`, which stays allocated while work may use it.
pub(super) struct Tensor {
    buf: DeviceBuffer,
    bytes: usize,
}

impl Tensor {
    pub(super) fn of<T: bytemuck::Pod>(gpu: &GpuRank, values: &[T]) -> Result<Tensor> {
        let bytes = std::mem::size_of_val(values);
        gpu.with_cuda(|q| {
            let buf = q.rank().alloc(bytes.max(16))?;
            q.upload(buf.region().sub(0, bytes)?, bytemuck::cast_slice(values))?;
            Ok(Tensor { buf, bytes })
        })
    }

    /// An output of `bytes`, filled with [`POISON`].
    pub(super) fn poisoned(gpu: &GpuRank, bytes: usize) -> Result<Tensor> {
        Tensor::filled(gpu, bytes, POISON)
    }

    /// `bytes` of device memory, every byte `value`.
    pub(super) fn filled(gpu: &GpuRank, bytes: usize, value: u8) -> Result<Tensor> {
        gpu.with_cuda(|q| {
            let buf = q.rank().alloc(bytes.max(16))?;
            q.memset_u8(buf.region(), value)?;
            Ok(Tensor { buf, bytes })
        })
    }

    pub(super) fn mem<T>(&self) -> Mem<'static, T> {
        Mem::Device {
            ptr: self.buf.region().device_ptr(),
            bytes: self.bytes,
        }
    }

    pub(super) fn out(&self) -> DeviceOut {
        DeviceOut {
            ptr: self.buf.region().device_ptr(),
            bytes: self.bytes,
        }
    }

    /// The values, after the work queued on the legacy default stream.
    pub(super) fn read<T: bytemuck::Pod>(&self, gpu: &GpuRank) -> Result<Vec<T>> {
        let mut v = vec![T::zeroed(); self.bytes / std::mem::size_of::<T>()];
        gpu.with_cuda(|q| {
            q.wait("check download")?;
            q.download(
                self.buf.region().sub(0, self.bytes)?,
                bytemuck::cast_slice_mut(&mut v),
            )
        })?;
        Ok(v)
    }
}
