//! The HT kernel variants ([`HtVariant`]): which compiled instantiation, block sizes, work
//! items and destination order the HT kernels run with, and their text form.
//!
//! Owns: parsing, printing and validating a variant, and the kernel each unroll selects.
//! Never: launches anything or changes a result (every variant moves the same bytes to the
//! same places and adds in the same order).

use super::MAX_GRID;
use crate::backend::cuda::kernels::names;
use crate::error::{Error, Result};

/// Environment variable naming the [`HtVariant`] the GPU check and bench use (harness builds
/// only: the product path always takes `HtVariant::default()` or an explicit tuning value).
#[cfg(feature = "harness")]
pub const ENV_VARIANT: &str = "GIN_EP_HT_VARIANT";

/// A performance variant of the HT kernels: which compiled instantiation (unroll), block
/// sizes, work-item size (row steps per item, 0 = one item per token), destination order.
/// Never changes a result: every variant moves the same bytes to the same places and adds in
/// the same order. Every rank must use the same variant (blocks pair across ranks).
///
/// Text form (CLI, `GIN_EP_HT_VARIANT`, sweep lists): comma-separated `key=value`, keys
/// `du` dispatch unroll (4, 8, 16), `dt` dispatch threads, `dc` dispatch chunk, `rot`
/// rotated destinations (0/1), `cu` combine unroll (2, 3, 4), `ct` combine threads, `cc`
/// combine chunk, `sb` stage CTAs of a combine from caller memory, out of the SM budget
/// (0: [`HtVariant::stage_blocks_for`]'s share), `cp` (0/1) how those CTAs move the rows:
/// 0 copy them into this rank's window for the sources to pull, 1 push them into the
/// sources' windows. Unnamed keys keep their
/// defaults, except that `du` / `cu` without `dt` / `ct` take that unroll's block-size
/// ceiling (du 4/8/16: 768/512/384, cu 2/3/4: 512/512/256). `default` is the default:
/// `du=8,dt=512,dc=0,rot=1,cu=3,ct=512,cc=2,sb=0,cp=1`
/// (bench/log/2026-11-21-02.md, HT sweep at commit 9103f98: rot=1 and cu=2,ct=512,cc=2 were the best at
/// 24 SMs; bench/log/2026-11-27-04.md: the push, its share of the budget, and cu=3 at 512
/// threads: 587–588 against 607–610 µs at 20 CTAs, within ±8 at 24 and 32).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HtVariant {
    pub dispatch_unroll: u32,
    pub dispatch_threads: u32,
    pub dispatch_chunk: u32,
    pub rotate: bool,
    pub combine_unroll: u32,
    pub combine_threads: u32,
    pub combine_chunk: u32,
    /// CTAs of the SM budget that move the caller's rows during a combine from
    /// caller-owned memory ([`super::HtIo::comb_x`]); 0: [`HtVariant::stage_blocks_for`].
    pub stage_blocks: u32,
    /// The stage CTAs push the rows into the sources' windows (the sources then reduce from
    /// local memory) instead of copying them into this rank's window for the sources to pull.
    pub combine_push: bool,
}

impl Default for HtVariant {
    fn default() -> Self {
        HtVariant {
            dispatch_unroll: 8,
            dispatch_threads: 512,
            dispatch_chunk: 0,
            rotate: true,
            combine_unroll: 3,
            combine_threads: 512,
            combine_chunk: 2,
            stage_blocks: 0,
            combine_push: true,
        }
    }
}

impl std::fmt::Display for HtVariant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "du={},dt={},dc={},rot={},cu={},ct={},cc={},sb={},cp={}",
            self.dispatch_unroll,
            self.dispatch_threads,
            self.dispatch_chunk,
            u8::from(self.rotate),
            self.combine_unroll,
            self.combine_threads,
            self.combine_chunk,
            self.stage_blocks,
            u8::from(self.combine_push)
        )
    }
}

impl HtVariant {
    /// Parses the text form (see the type); validates.
    pub fn parse(text: &str) -> Result<HtVariant> {
        let mut v = HtVariant::default();
        let text = text.trim();
        // Which of du, dt, cu, ct the text names.
        let mut named = [false; 4];
        if !(text.is_empty() || text == "default") {
            for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
                let (k, val) = part
                    .split_once('=')
                    .ok_or_else(|| Error::config("variant", part, "expected key=value"))?;
                let n: u32 = val
                    .trim()
                    .parse()
                    .map_err(|_| Error::config("variant", part, "value is not a number"))?;
                match k.trim() {
                    "du" => {
                        v.dispatch_unroll = n;
                        named[0] = true;
                    }
                    "dt" => {
                        v.dispatch_threads = n;
                        named[1] = true;
                    }
                    "dc" => v.dispatch_chunk = n,
                    "rot" => v.rotate = n != 0,
                    "cu" => {
                        v.combine_unroll = n;
                        named[2] = true;
                    }
                    "ct" => {
                        v.combine_threads = n;
                        named[3] = true;
                    }
                    "cc" => v.combine_chunk = n,
                    "sb" => v.stage_blocks = n,
                    "cp" => v.combine_push = n != 0,
                    other => {
                        return Err(Error::config(
                            "variant",
                            other,
                            "unknown key (du, dt, dc, rot, cu, ct, cc, sb, cp)",
                        ))
                    }
                }
            }
            if named[0] && !named[1] {
                if let Some((_, max)) = v.dispatch_kernel() {
                    v.dispatch_threads = max;
                }
            }
            if named[2] && !named[3] {
                if let Some((_, max)) = v.combine_kernel() {
                    v.combine_threads = max;
                }
            }
        }
        v.validate()?;
        Ok(v)
    }

    /// `GIN_EP_HT_VARIANT` when set, else the default.
    #[cfg(feature = "harness")]
    pub fn from_env() -> Result<HtVariant> {
        match std::env::var(ENV_VARIANT) {
            Ok(t) => HtVariant::parse(&t),
            Err(_) => Ok(HtVariant::default()),
        }
    }

    /// The CTAs of a staged combine's budget of `num_sms` that move the caller's rows (the
    /// others reduce); 0 when the budget leaves none (the rows are copied in first). `sb=`
    /// when given, else `min(num_sms / 4 + 4, num_sms / 2)`: the push runs at the links' rate
    /// from about 10 CTAs (≈ 32 GB/s each) and the reduce keeps up with it from about 14
    /// (4× H200, 4096 tokens, hidden 7168, combine µs at 20 CTAs: 8 pushing 635–643, 9
    /// 594–602, 7 723; at 24: 10 551, 12 589; at 32: 12 530–583, 16 562, 8 643; at 48: 16
    /// 529, 18 517; bench/log/2026-11-27-04.md).
    pub fn stage_blocks_for(&self, num_sms: u32) -> u32 {
        if num_sms < 2 {
            return 0;
        }
        match self.stage_blocks {
            0 => (num_sms / 4 + 4).min(num_sms / 2),
            n => n.min(num_sms - 1),
        }
    }

    /// The copy kernel for the dispatch unroll, and its block-size ceiling.
    pub(super) fn dispatch_kernel(&self) -> Option<(&'static str, u32)> {
        Some(match self.dispatch_unroll {
            4 => (names::HT_DISPATCH_U4_T768, 768),
            8 => (names::HT_DISPATCH, 512),
            16 => (names::HT_DISPATCH_U16_T384, 384),
            _ => return None,
        })
    }

    /// The combine kernel for the combine unroll, and its block-size ceiling.
    pub(super) fn combine_kernel(&self) -> Option<(&'static str, u32)> {
        Some(match self.combine_unroll {
            2 => (names::HT_COMBINE_U2_T512, 512),
            3 => (names::HT_COMBINE_U3_T512, 512),
            4 => (names::HT_COMBINE, 256),
            _ => return None,
        })
    }

    pub fn validate(&self) -> Result<()> {
        let threads = |what: &str, n: u32, max: u32| -> Result<()> {
            if n < 32 || n > max || !n.is_multiple_of(32) {
                return Err(Error::config(
                    "variant",
                    format!("{what}={n}"),
                    format!("must be a multiple of 32 in 32..={max} for this unroll"),
                ));
            }
            Ok(())
        };
        let (_, dmax) = self.dispatch_kernel().ok_or_else(|| {
            Error::config(
                "variant",
                format!("du={}", self.dispatch_unroll),
                "must be 4, 8 or 16",
            )
        })?;
        threads("dt", self.dispatch_threads, dmax)?;
        if self.stage_blocks >= MAX_GRID {
            return Err(Error::config(
                "variant",
                format!("sb={}", self.stage_blocks),
                format!("must be in 0..{MAX_GRID} (0: the default share)"),
            ));
        }
        let (_, cmax) = self.combine_kernel().ok_or_else(|| {
            Error::config(
                "variant",
                format!("cu={}", self.combine_unroll),
                "must be 2, 3 or 4",
            )
        })?;
        threads("ct", self.combine_threads, cmax)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variants_parse_validate_and_round_trip() {
        assert_eq!(HtVariant::parse("default").unwrap(), HtVariant::default());
        assert_eq!(HtVariant::parse("").unwrap(), HtVariant::default());
        let v = HtVariant::parse("du=4,dt=768,dc=2,rot=1,cu=2,ct=512,cc=3").unwrap();
        assert_eq!(v.dispatch_unroll, 4);
        assert_eq!(v.dispatch_threads, 768);
        assert!(v.rotate);
        assert_eq!(HtVariant::parse(&v.to_string()).unwrap(), v);
        let d = HtVariant::default();
        assert!(d.rotate);
        assert_eq!(
            (d.combine_unroll, d.combine_threads, d.combine_chunk),
            (3, 512, 2)
        );
        assert_eq!(HtVariant::parse("cu=4").unwrap().combine_threads, 256);
        assert_eq!(HtVariant::parse("cu=3").unwrap().combine_threads, 512);
        assert_eq!(HtVariant::parse("cu=2").unwrap().combine_threads, 512);
        assert_eq!(HtVariant::parse("du=16").unwrap().dispatch_threads, 384);
        assert_eq!(HtVariant::parse("du=4,dt=256").unwrap().dispatch_threads, 256);
        let s = HtVariant::parse("sb=48,cp=0").unwrap();
        assert_eq!(s.stage_blocks, 48);
        assert!(!s.combine_push);
        assert_eq!(HtVariant::parse(&s.to_string()).unwrap(), s);
        let p = HtVariant::parse("sb=16").unwrap();
        assert!(p.combine_push && d.combine_push && d.stage_blocks == 0);
        assert_eq!(HtVariant::parse(&p.to_string()).unwrap(), p);
        for bad in [
            "sb=128",
            "du=5",
            "du=16,dt=512",
            "dt=100",
            "cu=4,ct=512",
            "cu=8",
            "x=1",
            "du",
            "du=a",
        ] {
            let e = HtVariant::parse(bad).unwrap_err();
            assert!(e.is_usage(), "{bad}: {e}");
        }
    }

    #[test]
    fn a_staged_combine_splits_the_budget_and_never_exceeds_it() {
        let d = HtVariant::default();
        // The measured shares (stage_blocks_for's figures).
        for (sms, stage) in [(20, 9), (24, 10), (32, 12), (48, 16)] {
            assert_eq!(d.stage_blocks_for(sms), stage, "num_sms {sms}");
        }
        for sms in 1..=MAX_GRID {
            let stage = d.stage_blocks_for(sms);
            // Every CTA is counted in num_sms, and at least one reduces.
            assert!(stage < sms, "num_sms {sms}: {stage} stage CTAs");
            assert_eq!(stage == 0, sms < 2, "num_sms {sms}");
        }
        let named = HtVariant::parse("sb=30").unwrap();
        assert_eq!(named.stage_blocks_for(64), 30);
        assert_eq!(named.stage_blocks_for(1), 0);
    }
}
