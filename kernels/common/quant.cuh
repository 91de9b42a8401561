// kernels/common/quant.cuh: FP8 (e4m3) block quantization, bit for bit with
// crates/gin-ep/src/quant.rs (the oracle's number formats).
//
// Owns: a 128-channel block's scale from its amax (max(amax, 1e-4) / 448, optionally
// rounded up to a power of two, UE8M0), the e4m3 byte of x / scale, and the warp's
// quantization of 16 channels per lane (the lane layout HT and LL dispatch share). Never:
// loads or stores (the callers do).

#pragma once

#include <cuda_fp8.h>
#include <stdint.h>

#include "common/bf16.cuh"

namespace gin_ep {

// quant.rs round_scale_ue8m0: keep the exponent, bump it when any mantissa bit is set.
__device__ __forceinline__ float round_ue8m0(float s) {
  const uint32_t b = __float_as_uint(s);
  const uint32_t e = b & 0x7F800000u;
  return __uint_as_float((b & 0x007FFFFFu) != 0u ? e + 0x00800000u : e);
}

// quant.rs block_scale, given the block's amax (max of |x|, NaN ignored): an IEEE division.
__device__ __forceinline__ float block_scale(float amax, bool ue8m0) {
  const float s = __fdiv_rn(fmaxf(amax, 1e-4f), 448.0f);
  return ue8m0 ? round_ue8m0(s) : s;
}

// Divides by one block's scale without a division per element. quant.rs computes
// e4m3(x / scale) with an IEEE division; that division per element was ≈ 6% of the LL FP8
// dispatch at 384 tokens on 2 GPUs (bench/log/2026-11-22-03.md). Instead, once per block,
// inv = RN(1 / scale), and per element q = RN(x * inv), e = q * scale - x (exact, by FMA),
// result RN(q - e * inv) (Markstein's correction, written with -inv so that x = -0 keeps its
// sign: -0 - (+0 * inv) is +0, +0 * -inv + -0 is -0). An infinite scale (an infinity in the
// block) uses 0 in the remainder, which gives x * 0 (= x / inf) for every x. quant.rs
// div_by_reciprocal mirrors it; its tests check that the e4m3 bytes equal the division's for
// every BF16 x a block can hold (|x| <= amax, or NaN) and every scale of every BF16 amax,
// infinity included, both scale formats. Branch-free: three instructions per element.
struct ScaleDivisor {
  float scale;      // the block's scale (what is stored beside the bytes)
  float neg_inv;    // -RN(1 / scale)
  float rem_scale;  // scale, or 0 for an infinite scale
};

__device__ __forceinline__ ScaleDivisor scale_divisor(float scale) {
  const bool finite = scale < __int_as_float(0x7F800000);
  return ScaleDivisor{scale, -__frcp_rn(scale), finite ? scale : 0.0f};
}

// The e4m3 byte of x / d.scale (round to nearest even, saturating finite: quant.rs f32_to_e4m3).
__device__ __forceinline__ uint32_t e4m3_scaled(float x, const ScaleDivisor& d) {
  const float q = __fmul_rn(x, -d.neg_inv);
  const float e = __fmaf_rn(q, d.rem_scale, -x);
  return uint32_t(__nv_cvt_float_to_fp8(__fmaf_rn(e, d.neg_inv, q), __NV_SATFINITE, __NV_E4M3));
}

// Quantizes 16 BF16 channels per lane (lo: channels 0-7, hi: 8-15), 8 lanes per 128-channel
// block (lanes 8k..8k+7 of the warp; every lane of the warp calls it), bit-exact with
// quant.rs: the block's amax (of the lanes whose channels are in_range), its scale
// (block_scale), q = e4m3_satfinite_rn(x / scale) by one reciprocal per block (e4m3_scaled).
// Returns the 16 e4m3 bytes, channel order; the block's scale in *scale_out.
__device__ __forceinline__ uint4 quantize16(const uint4 lo, const uint4 hi, bool in_range, bool ue8m0,
                                            float* scale_out) {
  float v[16];
  const uint32_t w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    v[2 * i] = bf16_lo(w[i]);
    v[2 * i + 1] = bf16_hi(w[i]);
  }
  if (in_range) {
#pragma unroll
    for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(v[i]));
  }
  // Max is exact and order-free, so the butterfly gives quant.rs's fold bit for bit.
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 4));
  const ScaleDivisor d = scale_divisor(block_scale(amax, ue8m0));
  *scale_out = d.scale;
  uint32_t q[4] = {0, 0, 0, 0};
#pragma unroll
  for (int i = 0; i < 16; ++i) q[i / 4] |= e4m3_scaled(v[i], d) << (8 * (i % 4));
  return make_uint4(q[0], q[1], q[2], q[3]);
}

}  // namespace gin_ep
