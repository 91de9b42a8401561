// kernels/fabric.cu: the node fabric's host helper kernel (the peer layout itself is in
// common/fabric.cuh; the host side in crates/gin-ep/src/backend/cuda/fabric.rs).
//
// Kernels are extern "C" so the host finds them by plain name with cuModuleGetFunction.

#include "common/fabric.cuh"
#include "common/nccl_compat.cuh"

using namespace gin_ep;

// The address of every LSA peer's copy of a window as this process maps it, for copies the
// host issues: ncclGetLsaPointer reads the window's device-side descriptor, which the host
// cannot. Offset 0: NCCL maps each peer's window contiguously (pointer = base + offset), so
// the host asks once per window and adds offsets itself. LsaPointerArgs: abi/fabric.h.
extern "C" __global__ void gin_ep_lsa_pointers(const LsaPointerArgs a) {
  for (uint32_t p = threadIdx.x; p < a.n; p += blockDim.x) {
    a.out[p] = reinterpret_cast<uint64_t>(lsa_ptr(a.win, 0, int(p)));
  }
}
