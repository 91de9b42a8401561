//! BF16 and FP8 (e4m3) conversions, bit-compatible with CUDA's intrinsics.
//!
//! Owns the number formats: every backend that converts must produce exactly
//! these bits. FP8 follows `cvt.rn.satfinite.e4m3x2.f32` (round to nearest even,
//! finite overflow and infinities saturate to ±448, NaN becomes 0x7F); BF16
//! follows `__float2bfloat16_rn` (round to nearest even). Written for clarity.

use crate::config::{DispatchDtype, FP8_BLOCK};
use half::bf16;

/// Largest finite e4m3 value.
pub const E4M3_MAX: f32 = 448.0;
/// Floor under a block's amax so all-zero blocks get a finite scale (as DeepEP does).
pub const AMAX_FLOOR: f32 = 1e-4;

/// f32 → bf16, round to nearest even.
pub fn f32_to_bf16(x: f32) -> bf16 {
    bf16::from_f32(x)
}

/// f32 → e4m3 bits, round to nearest even, saturating to ±448.
///
/// Works on the f32 bit pattern: keep 3 mantissa bits (normals) or count units
/// of 2^-9 (subnormals), rounding the dropped bits to nearest even; a carry out
/// of the mantissa bumps the exponent, as it does in hardware.
pub fn f32_to_e4m3(x: f32) -> u8 {
    let bits = x.to_bits();
    let sign = ((bits >> 24) & 0x80) as u8;
    let abs = bits & 0x7FFF_FFFF;
    if abs > 0x7F80_0000 {
        return 0x7F; // NaN
    }
    if abs >= 0x43E0_0000 {
        return sign | 0x7E; // >= 448, infinities included: satfinite
    }
    let exp = (abs >> 23) as i32 - 127;
    let round = |q: u32, rem: u32, half: u32| q + u32::from(rem > half || (rem == half && q & 1 == 1));
    if exp < -6 {
        // Subnormal e4m3: value = q * 2^-9. The f32 value is mant24 * 2^(exp-23),
        // so q = mant24 >> (14 - exp) before rounding.
        if abs < 0x0080_0000 {
            return sign; // f32 zero or subnormal: far below 2^-10
        }
        let shift = (14 - exp) as u32;
        if shift >= 32 {
            return sign;
        }
        let mant24 = (abs & 0x7F_FFFF) | 0x80_0000;
        let q = round(mant24 >> shift, mant24 & ((1 << shift) - 1), 1 << (shift - 1));
        return sign | q as u8;
    }
    let mant = abs & 0x7F_FFFF;
    let q = round(
        (((exp + 7) as u32) << 3) | (mant >> 20),
        mant & 0xF_FFFF,
        0x8_0000,
    );
    sign | q.min(0x7E) as u8
}

/// e4m3 bits → f32 (exact).
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let exp = ((b >> 3) & 0x0F) as i32;
    let man = (b & 0x07) as f32;
    if exp == 0x0F && b & 0x07 == 0x07 {
        return f32::NAN;
    }
    if exp == 0 {
        sign * man * 2f32.powi(-9)
    } else {
        sign * (1.0 + man / 8.0) * 2f32.powi(exp - 7)
    }
}

/// Rounds a positive scale up to a power of two (UE8M0): the exponent is kept
/// and bumped if any mantissa bit is set, as `ceil(log2(s))` would.
pub fn round_scale_ue8m0(s: f32) -> f32 {
    let bits = s.to_bits();
    let exp = bits & 0x7F80_0000;
    if bits & 0x007F_FFFF == 0 {
        f32::from_bits(exp)
    } else {
        f32::from_bits(exp + 0x0080_0000)
    }
}

/// Scale of one 128-channel block: max(amax, 1e-4) / 448, optionally rounded to UE8M0.
pub fn block_scale(block: &[bf16], ue8m0: bool) -> f32 {
    let amax = block.iter().fold(0.0f32, |m, v| m.max(v.to_f32().abs()));
    let s = amax.max(AMAX_FLOOR) / E4M3_MAX;
    if ue8m0 {
        round_scale_ue8m0(s)
    } else {
        s
    }
}

/// `x / scale` as the CUDA kernels compute it (kernels/common/quant.cuh `e4m3_scaled`): one
/// reciprocal per block, `inv = RN(1 / scale)`, then per element `q = RN(x * inv)`, the exact
/// remainder `e = q * scale - x` and `RN(q - e * inv)` (Markstein's correction, with `-inv` as
/// a factor so that -0 stays -0), instead of an IEEE division per element. An infinite scale
/// (an infinity in the block) uses 0 in the remainder, which gives `x * 0` (= `x / inf`).
/// Not the oracle's arithmetic (that is `x / scale`, in [`quantize_row`]) but proved to give
/// the same e4m3 byte for every input a block can hold (the tests below: every BF16 `x` with
/// `|x| <= amax` or NaN, every scale of every BF16 amax, infinity included, both scale
/// formats); the quotients themselves differ only below 2^-10, where both bytes are ±0.
pub fn div_by_reciprocal(x: f32, scale: f32) -> f32 {
    let neg_inv = -(1.0 / scale);
    let rem_scale = if scale.is_infinite() { 0.0 } else { scale };
    let q = x * -neg_inv;
    q.mul_add(rem_scale, -x).mul_add(neg_inv, q)
}

/// Quantizes one token row: e4m3(x / scale) per element, one scale per 128 channels.
/// `out.len() == row.len()`, `scales.len() == row.len() / 128`.
pub fn quantize_row(row: &[bf16], ue8m0: bool, out: &mut [u8], scales: &mut [f32]) {
    for (b, block) in row.chunks(FP8_BLOCK).enumerate() {
        let s = block_scale(block, ue8m0);
        scales[b] = s;
        for (i, v) in block.iter().enumerate() {
            out[b * FP8_BLOCK + i] = f32_to_e4m3(v.to_f32() / s);
        }
    }
}

/// Dequantizes one row: f32(q) * scale, rounded to bf16.
pub fn dequantize_row(q: &[u8], scales: &[f32], out: &mut [bf16]) {
    for (i, (o, b)) in out.iter_mut().zip(q).enumerate() {
        *o = f32_to_bf16(e4m3_to_f32(*b) * scales[i / FP8_BLOCK]);
    }
}

/// A block of dispatched rows in the wire format: BF16, or FP8 e4m3 with scales.
#[derive(Clone, Debug)]
pub enum Rows {
    /// `[rows, hidden]` BF16.
    Bf16(Vec<bf16>),
    /// `[rows, hidden]` e4m3 bits and `[rows, hidden / 128]` f32 scales.
    Fp8 { data: Vec<u8>, scales: Vec<f32> },
}

impl Rows {
    /// `rows` rows of zeros (scales zero too) in the format of `dtype`.
    pub fn zeros(dtype: DispatchDtype, rows: usize, hidden: usize) -> Rows {
        if dtype.is_fp8() {
            Rows::Fp8 {
                data: bytemuck::zeroed_vec(rows * hidden),
                scales: bytemuck::zeroed_vec(rows * hidden / FP8_BLOCK),
            }
        } else {
            // zeroed_vec lets the allocator hand out lazily zeroed pages.
            Rows::Bf16(bytemuck::zeroed_vec(rows * hidden))
        }
    }

    /// Encodes BF16 rows `[rows, hidden]` as `dtype` (quantizing for FP8).
    pub fn encode(dtype: DispatchDtype, x: &[bf16], hidden: usize) -> Rows {
        match dtype {
            DispatchDtype::Bf16 => Rows::Bf16(x.to_vec()),
            DispatchDtype::Fp8 | DispatchDtype::Fp8Ue8m0 => {
                let ue8m0 = dtype == DispatchDtype::Fp8Ue8m0;
                let mut data = vec![0u8; x.len()];
                let mut scales = vec![0f32; x.len() / FP8_BLOCK];
                let spr = hidden / FP8_BLOCK;
                for (i, row) in x.chunks(hidden).enumerate() {
                    quantize_row(
                        row,
                        ue8m0,
                        &mut data[i * hidden..(i + 1) * hidden],
                        &mut scales[i * spr..(i + 1) * spr],
                    );
                }
                Rows::Fp8 { data, scales }
            }
        }
    }

    pub fn is_fp8(&self) -> bool {
        matches!(self, Rows::Fp8 { .. })
    }

    /// Number of rows, given the hidden size.
    pub fn num_rows(&self, hidden: usize) -> usize {
        match self {
            Rows::Bf16(v) => v.len() / hidden,
            Rows::Fp8 { data, .. } => data.len() / hidden,
        }
    }

    /// Copies row `src_row` of `src` into row `dst_row` of `self` (same format).
    pub fn copy_row_from(&mut self, dst_row: usize, src: &Rows, src_row: usize, hidden: usize) {
        let spr = hidden / FP8_BLOCK;
        match (self, src) {
            (Rows::Bf16(d), Rows::Bf16(s)) => d[dst_row * hidden..(dst_row + 1) * hidden]
                .copy_from_slice(&s[src_row * hidden..(src_row + 1) * hidden]),
            (Rows::Fp8 { data: dd, scales: ds }, Rows::Fp8 { data: sd, scales: ss }) => {
                dd[dst_row * hidden..(dst_row + 1) * hidden]
                    .copy_from_slice(&sd[src_row * hidden..(src_row + 1) * hidden]);
                ds[dst_row * spr..(dst_row + 1) * spr]
                    .copy_from_slice(&ss[src_row * spr..(src_row + 1) * spr]);
            }
            _ => unreachable!("rows of one operation share one format"),
        }
    }

    /// Row `i` decoded to f32 (dequantized for FP8; not rounded).
    pub fn row_f32(&self, i: usize, hidden: usize) -> Vec<f32> {
        match self {
            Rows::Bf16(v) => v[i * hidden..(i + 1) * hidden]
                .iter()
                .map(|x| x.to_f32())
                .collect(),
            Rows::Fp8 { data, scales } => {
                let spr = hidden / FP8_BLOCK;
                data[i * hidden..(i + 1) * hidden]
                    .iter()
                    .enumerate()
                    .map(|(j, b)| e4m3_to_f32(*b) * scales[i * spr + j / FP8_BLOCK])
                    .collect()
            }
        }
    }

    /// Bits of element `j` of row `i` (u16 for BF16, u8 for FP8) for exact comparison.
    pub fn elem_bits(&self, i: usize, j: usize, hidden: usize) -> u32 {
        match self {
            Rows::Bf16(v) => v[i * hidden + j].to_bits() as u32,
            Rows::Fp8 { data, .. } => data[i * hidden + j] as u32,
        }
    }

    /// Bits of scale `b` of row `i` (FP8 only; 0 for BF16).
    pub fn scale_bits(&self, i: usize, b: usize, hidden: usize) -> u32 {
        match self {
            Rows::Bf16(_) => 0,
            Rows::Fp8 { scales, .. } => scales[i * (hidden / FP8_BLOCK) + b].to_bits(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The definition, in exact f64 arithmetic: slow and obviously right.
    fn f32_to_e4m3_reference(x: f32) -> u8 {
        if x.is_nan() {
            return 0x7F;
        }
        let sign: u8 = if x.is_sign_negative() { 0x80 } else { 0 };
        let a = x.abs() as f64; // exact: every f32 is an f64
        if a >= E4M3_MAX as f64 {
            return sign | 0x7E;
        }
        // Subnormal range: multiples of 2^-9 below 2^-6.
        if a < 2f64.powi(-6) {
            let m = (a * 512.0).round_ties_even() as u8; // 0..=8; 8 is the smallest normal
            return sign | m;
        }
        let mut e = a.log2().floor() as i32;
        // log2 may round up at exact powers' neighbours; fix the exponent exactly.
        if 2f64.powi(e) > a {
            e -= 1;
        }
        if 2f64.powi(e + 1) <= a {
            e += 1;
        }
        let mut m = (a / 2f64.powi(e - 3)).round_ties_even() as u32; // 8..=16
        if m == 16 {
            m = 8;
            e += 1;
        }
        let bits = (((e + 7) as u32) << 3) | (m - 8);
        if bits > 0x7E {
            sign | 0x7E
        } else {
            sign | bits as u8
        }
    }

    #[test]
    fn fast_e4m3_matches_the_definition() {
        // Every f32 whose exponent can matter, stepping through mantissas.
        let mut b: u32 = 0;
        while b < 0x4400_0000 {
            for sign in [0u32, 0x8000_0000] {
                let x = f32::from_bits(b | sign);
                assert_eq!(
                    f32_to_e4m3(x),
                    f32_to_e4m3_reference(x),
                    "x = {x:e} bits {:#x}",
                    b | sign
                );
            }
            b += 0x3FF; // odd stride hits ties, near-ties and every exponent
        }
        // Exact ties and their neighbours around every e4m3 code.
        for code in 0u8..0x7E {
            let (a, c) = (e4m3_to_f32(code), e4m3_to_f32(code + 1));
            let mid = (a + c) / 2.0;
            for x in [
                mid,
                f32::from_bits(mid.to_bits() + 1),
                f32::from_bits(mid.to_bits() - 1),
            ] {
                assert_eq!(f32_to_e4m3(x), f32_to_e4m3_reference(x), "x = {x:e}");
                assert_eq!(f32_to_e4m3(-x), f32_to_e4m3_reference(-x), "x = -{x:e}");
            }
        }
    }

    #[test]
    fn e4m3_round_trips_every_finite_code() {
        for b in 0u8..=255 {
            if b & 0x7F == 0x7F {
                continue; // NaN codes
            }
            let v = e4m3_to_f32(b);
            let back = f32_to_e4m3(v);
            // -0 and +0 are distinct codes and must both survive.
            assert_eq!(back, b, "code {b:#04x} value {v}");
        }
    }

    /// The e4m3 bytes of `div_by_reciprocal` against the division's for the BF16 amax
    /// patterns `0, step, 2 * step, ...` up to infinity, both scale formats, and every BF16
    /// x a block with that amax can hold (|x| <= amax, NaN). Returns the pairs compared.
    fn check_div_by_reciprocal(step: usize) -> u64 {
        let mut pairs = 0u64;
        for am in (0u16..=0x7F80).step_by(step) {
            let amax = bf16::from_bits(am).to_f32();
            for ue8m0 in [false, true] {
                let s = amax.max(AMAX_FLOOR) / E4M3_MAX;
                let s = if ue8m0 { round_scale_ue8m0(s) } else { s };
                for xb in 0..=u16::MAX {
                    let x = bf16::from_bits(xb).to_f32();
                    if x.abs() > amax {
                        continue; // not in a block of this amax (NaN fails the test, so stays)
                    }
                    let (want, got) = (f32_to_e4m3(x / s), f32_to_e4m3(div_by_reciprocal(x, s)));
                    assert_eq!(got, want, "x={x:e} ({xb:#06x}) scale={s:e} ue8m0={ue8m0}");
                    pairs += 1;
                }
            }
        }
        pairs
    }

    #[test]
    fn div_by_reciprocal_matches_the_division() {
        // A prime stride walks every mantissa at scattered exponents; the exhaustive run
        // (step 1, 2.1e9 pairs) is the ignored test below. Infinity's own scale too.
        assert!(check_div_by_reciprocal(61) > 30_000_000);
        // amax 0 (±0 and 254 NaNs) and infinity (every x), two formats each.
        assert_eq!(check_div_by_reciprocal(0x7F80), 2 * (256 + 65_536));
        // The zeros keep their sign; an infinite scale gives x / inf.
        assert_eq!(div_by_reciprocal(-0.0, 0.5).to_bits(), (-0.0f32).to_bits());
        assert_eq!(
            div_by_reciprocal(-3.0, f32::INFINITY).to_bits(),
            (-0.0f32).to_bits()
        );
        assert!(div_by_reciprocal(f32::INFINITY, f32::INFINITY).is_nan());
        assert!(div_by_reciprocal(f32::NAN, 0.5).is_nan());
    }

    #[test]
    #[ignore = "exhaustive, ≈ 2.1e9 pairs: cargo test --release -p gin-ep -- --ignored div_by_reciprocal"]
    fn div_by_reciprocal_matches_the_division_everywhere() {
        assert_eq!(check_div_by_reciprocal(1), 2_147_516_672);
    }

    #[test]
    fn e4m3_saturates_and_handles_nan() {
        assert_eq!(f32_to_e4m3(1e9), 0x7E);
        assert_eq!(f32_to_e4m3(f32::INFINITY), 0x7E);
        assert_eq!(f32_to_e4m3(-1e9), 0xFE);
        assert_eq!(f32_to_e4m3(449.0), 0x7E);
        assert_eq!(f32_to_e4m3(f32::NAN), 0x7F);
        assert_eq!(e4m3_to_f32(0x7E), 448.0);
    }

    #[test]
    fn e4m3_ties_go_to_even() {
        // 1.0625 lies halfway between 1.0 (mantissa 000) and 1.125 (001): even is 1.0.
        assert_eq!(f32_to_e4m3(1.0625), 0x38);
        // 1.1875 lies between 1.125 (001) and 1.25 (010): even is 1.25.
        assert_eq!(f32_to_e4m3(1.1875), 0x3A);
        // Subnormal tie: 1.5 * 2^-9 goes to 2 * 2^-9.
        assert_eq!(f32_to_e4m3(1.5 * 2f32.powi(-9)), 0x02);
        // Half of the smallest subnormal rounds to zero (even).
        assert_eq!(f32_to_e4m3(0.5 * 2f32.powi(-9)), 0x00);
    }

    #[test]
    fn ue8m0_rounds_up_to_power_of_two() {
        assert_eq!(round_scale_ue8m0(1.0), 1.0);
        assert_eq!(round_scale_ue8m0(1.0001), 2.0);
        assert_eq!(round_scale_ue8m0(0.3), 0.5);
    }

    proptest! {
        #[test]
        fn e4m3_is_nearest(x in -500.0f32..500.0) {
            let q = e4m3_to_f32(f32_to_e4m3(x));
            let err = (q - x.clamp(-448.0, 448.0)).abs();
            // Distance to every other code must not be smaller.
            for b in 0u8..=255 {
                if b & 0x7F == 0x7F { continue; }
                let c = e4m3_to_f32(b);
                prop_assert!((c - x.clamp(-448.0, 448.0)).abs() >= err, "x={x} got {q} but {c} is closer");
            }
        }

        #[test]
        fn quantize_error_is_within_half_step(vals in proptest::collection::vec(-1000.0f32..1000.0, 256)) {
            let row: Vec<bf16> = vals.iter().map(|v| bf16::from_f32(*v)).collect();
            let mut q = vec![0u8; 256];
            let mut s = vec![0f32; 2];
            quantize_row(&row, false, &mut q, &mut s);
            for (i, v) in row.iter().enumerate() {
                let back = e4m3_to_f32(q[i]) * s[i / 128];
                // e4m3 has 3 mantissa bits: relative error <= 2^-4 for normals,
                // absolute error <= 2^-10 * scale in the subnormal range.
                let tol = v.to_f32().abs() / 16.0 + s[i / 128] * 2f32.powi(-10) + 1e-12;
                prop_assert!((back - v.to_f32()).abs() <= tol, "i={i} v={v} back={back}");
            }
        }
    }
}
