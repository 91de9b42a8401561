//! The LL kernels' tuning values ([`LlTuning`]): the grid and the fused dispatch's send
//! warps, and the kernel's flags word they map to.
//!
//! Owns: their defaults, their valid ranges and their bits in `LlArgs::flags`. Never: reads
//! the environment (the product path always runs [`LlTuning::DEFAULT`]; the harness passes
//! typed values), or changes a result: every tuning computes the same bytes.

use super::abi;
use super::{MAX_GRID, WARPS};
use crate::error::{Error, Result};

/// Flags bit that limits the stamps to each operation's first and last (kFlagStampEdges).
pub(super) const STAMP_EDGES_FLAG: u32 = abi::K_FLAG_STAMP_EDGES;

/// First bit of the send-warp count in the kernel's flags word (kFlagSendWarpsShift).
const SEND_WARPS_SHIFT: u32 = abi::K_FLAG_SEND_WARPS_SHIFT as u32;
/// Most send warps: the CTA's last warp publishes their ready words and at least one warp
/// builds the receive table (kernels/ll/common.cuh fused_send_warps).
pub const MAX_SEND_WARPS: u32 = WARPS - 2;
// The count goes in the 5 bits the kernel reads.
const _: () = assert!(MAX_SEND_WARPS <= 31);

/// How the LL kernels spread their work over the GPU. Every tuning computes the same bytes
/// (the same arithmetic in the same order); they differ in latency only.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LlTuning {
    /// CTAs per kernel; `None`: the caller's grid (the bench's `--sms`, else every SM);
    /// `Some(0)`: every SM. The fused kernels need the whole grid resident at once.
    pub grid: Option<u32>,
    /// Warps of each fused-dispatch CTA that send the records (1 to [`MAX_SEND_WARPS`]);
    /// the CTA's last warp publishes their ready words and the others expand what has
    /// landed meanwhile, then the senders and the publisher join the expand.
    pub send_warps: u32,
}

impl Default for LlTuning {
    fn default() -> Self {
        LlTuning::DEFAULT
    }
}

impl LlTuning {
    /// What the product path runs: the caller's grid, 8 send warps (4×H200, 128 tokens,
    /// docs/performance.md "Design choices").
    pub const DEFAULT: LlTuning = LlTuning {
        grid: None,
        send_warps: 8,
    };

    /// Refuses values the kernels do not take, naming the field.
    pub fn validate(&self) -> Result<()> {
        if !(1..=MAX_SEND_WARPS).contains(&self.send_warps) {
            return Err(Error::config(
                "ll send warps",
                self.send_warps,
                format!(
                    "must be 1 to {MAX_SEND_WARPS} (of {WARPS} warps per CTA: one publishes, one at least receives)"
                ),
            ));
        }
        if let Some(g) = self.grid.filter(|&g| g > MAX_GRID) {
            return Err(Error::config("ll grid", g, format!("must be at most {MAX_GRID}")));
        }
        Ok(())
    }

    /// Flags word of `LlArgs` (kFlagSendWarpsShift in kernels/abi/ll.h).
    pub(super) fn kernel_flags(&self) -> u32 {
        self.send_warps << SEND_WARPS_SHIFT
    }

    /// `send8`, `send4@3`, `send8@all`: the send warps, then the grid when set.
    pub fn name(&self) -> String {
        match self.grid {
            None => format!("send{}", self.send_warps),
            Some(0) => format!("send{}@all", self.send_warps),
            Some(g) => format!("send{}@{g}", self.send_warps),
        }
    }

    /// The tunings the LL GPU check runs its small cases on besides the default: small
    /// grids, so each warp loops over several items, and the extremes of the send warps.
    pub fn check_list() -> Vec<LlTuning> {
        [(3, 4), (5, MAX_SEND_WARPS), (2, 1)]
            .into_iter()
            .map(|(g, s)| LlTuning {
                grid: Some(g),
                send_warps: s,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_carry_the_send_warps_apart_from_the_stamp_edges_bit() {
        let send_bits = 31u32 << SEND_WARPS_SHIFT;
        assert_eq!(send_bits & STAMP_EDGES_FLAG, 0);
        assert_eq!(LlTuning::DEFAULT.kernel_flags(), 8 << 8);
        for s in 1..=MAX_SEND_WARPS {
            let t = LlTuning {
                grid: None,
                send_warps: s,
            };
            assert_eq!(t.kernel_flags() & !send_bits, 0);
            assert_eq!(t.kernel_flags() >> SEND_WARPS_SHIFT, s);
        }
    }

    #[test]
    fn tunings_out_of_range_are_refused_naming_the_field() {
        LlTuning::DEFAULT.validate().unwrap();
        for t in LlTuning::check_list() {
            t.validate().unwrap();
        }
        for (grid, send_warps, field) in [
            (None, 0, "send warps"),
            (None, MAX_SEND_WARPS + 1, "send warps"),
            (Some(MAX_GRID + 1), 8, "grid"),
        ] {
            let e = LlTuning { grid, send_warps }.validate().unwrap_err();
            assert!(e.is_usage() && e.to_string().contains(field), "{e}");
        }
        assert_eq!(LlTuning::DEFAULT.name(), "send8");
        assert_eq!(
            LlTuning {
                grid: Some(0),
                send_warps: 4
            }
            .name(),
            "send4@all"
        );
    }
}
