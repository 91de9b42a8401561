// kernels/common/bf16.cuh: BF16 arithmetic shared by the HT and LL kernels, bit for bit with
// the oracle (crates/gin-ep/src/oracle.rs): widening, rounding to nearest even, and the f32
// chains of a combine over 8 channels (one 16-byte vector).
//
// Owns: how a BF16 word is read and written and the element order of the 8-channel chains.
// Never: loads or stores (the callers do, each with its own lane layout), and never contracts
// an add into an FMA the oracle does not make (every step is an explicit __fadd_rn/__fmaf_rn).

#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

namespace gin_ep {

// The BF16 in the low / high half of a 32-bit word, widened (exact).
__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xFFFF0000u); }

// Two f32 rounded to BF16 (nearest even), lo in the low half.
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const uint32_t l = __bfloat16_as_ushort(__float2bfloat16_rn(lo));
  const uint32_t h = __bfloat16_as_ushort(__float2bfloat16_rn(hi));
  return l | (h << 16);
}

// 8 f32 values rounded to BF16 (nearest even), packed for one 16-byte store.
__device__ __forceinline__ uint4 pack_bf16x8(const float* x) {
  return make_uint4(pack_bf16x2(x[0], x[1]), pack_bf16x2(x[2], x[3]), pack_bf16x2(x[4], x[5]), pack_bf16x2(x[6], x[7]));
}

// acc[i] += channel i of the 8 BF16 values in v (one IEEE f32 add each), i = 0..8.
__device__ __forceinline__ void add_bf16x8(const uint4& v, float* acc) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    acc[2 * j] = __fadd_rn(acc[2 * j], bf16_lo(w[j]));
    acc[2 * j + 1] = __fadd_rn(acc[2 * j + 1], bf16_hi(w[j]));
  }
}

// acc[i] = fma(w, channel i of the 8 BF16 values in v, acc[i]), i = 0..8 (the combine chain).
__device__ __forceinline__ void fma_bf16x8(float w, const uint4& v, float* acc) {
  const uint32_t wv[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    acc[2 * j] = __fmaf_rn(w, bf16_lo(wv[j]), acc[2 * j]);
    acc[2 * j + 1] = __fmaf_rn(w, bf16_hi(wv[j]), acc[2 * j + 1]);
  }
}

}  // namespace gin_ep
