//! What an all-to-all run is asked to do: the modes ([`AlltoallMode`]), the store hint, the
//! options with their validation ([`AlltoallOptions`]), and the sizes and grids they expand to.
//!
//! Owns: every refusal of a bad option, naming the field. Never: touches a GPU.

use std::time::Duration;

use crate::launch::alltoall::{self as ops, AlltoallKernel};
use crate::launch::gin_alltoall::GinVariant;
use gin_ep::error::{Error, Result};

/// Most CTAs an LSA all-to-all may use: the window reserves `MAX_BLOCKS * world` barrier
/// words.
pub const MAX_BLOCKS: u32 = 1024;
/// Largest per-rank size accepted (the window holds two of them).
pub const MAX_BYTES_LIMIT: usize = 16 << 30;

/// One way to run the all-to-all.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum AlltoallMode {
    /// NCCL's host API: `ncclAlltoAll`, or grouped `ncclSend`/`ncclRecv` where absent.
    Nccl,
    /// The copy engine does the same all-to-all over the same window: one device-to-device
    /// copy per destination into the peer's LSA address, each remote copy on its own
    /// stream (forked after a start barrier kernel, joined before an end barrier kernel).
    /// The bandwidth reference for the LSA kernels.
    Ce,
    /// `ce` with every copy back to back on the rank's one stream.
    CeSerial,
    /// Baseline LSA kernel (4-byte stores).
    LsaSimple,
    /// LSA push, 16-byte stores to peers, links interleaved (`--unroll` tiles in flight per
    /// warp), a double-buffered receive region (no start barrier) and the `each` signal:
    /// every CTA signals every peer (release add), CTA 0 waits.
    LsaOpt,
    /// `lsa-opt`'s copy (unroll 4) with the arrival-counter signal of the first design:
    /// every CTA bumps a local counter, the last one signals the peers and waits.
    LsaCount,
    /// 4 KiB contiguous runs per warp per peer (`--store-hint` picks the store), `each`
    /// signal.
    LsaRun,
    /// cp.async.bulk (TMA) global -> shared -> peer, one issuing thread per CTA, `each`
    /// signal.
    LsaBulk,
    /// LSA pull, 16-byte loads from peers.
    LsaPull,
    /// `lsa-opt`'s copy (unroll 4, one receive buffer) between two of NCCL's LSA barriers
    /// (no deadline): what our deadline barriers cost.
    LsaOptNcclbar,
    /// nccl-tests' `-D 3`: one GIN put + signal per peer, self included, spread over the
    /// four GIN contexts (needs a GIN-capable network, or the project's plugin).
    Gin,
    /// nccl-tests' `-D 4`: the ranks of this rank's gin-ep node (NCCL's LSA team, or the
    /// `--node-size` grouping) by stores, the rest by GIN.
    Hybrid,
}

impl AlltoallMode {
    /// Every mode, in report order.
    pub const ALL: [AlltoallMode; 12] = [
        AlltoallMode::Nccl,
        AlltoallMode::Ce,
        AlltoallMode::CeSerial,
        AlltoallMode::LsaSimple,
        AlltoallMode::LsaOpt,
        AlltoallMode::LsaCount,
        AlltoallMode::LsaRun,
        AlltoallMode::LsaBulk,
        AlltoallMode::LsaPull,
        AlltoallMode::LsaOptNcclbar,
        AlltoallMode::Gin,
        AlltoallMode::Hybrid,
    ];

    /// The default set: all but `lsa-opt-ncclbar` (no deadline on its barrier). Both copy
    /// orders of the copy engine are in: which one is faster depends on the machine (on
    /// 4x H200, one stream in rotation order; see bench/RESULTS.md), and the reference is
    /// the faster.
    pub fn defaults() -> Vec<AlltoallMode> {
        Self::ALL
            .into_iter()
            .filter(|m| !matches!(m, AlltoallMode::LsaOptNcclbar))
            .collect()
    }

    /// The name used on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            AlltoallMode::Nccl => "nccl",
            AlltoallMode::Ce => "ce",
            AlltoallMode::CeSerial => "ce-serial",
            AlltoallMode::LsaSimple => "lsa-simple",
            AlltoallMode::LsaOpt => "lsa-opt",
            AlltoallMode::LsaCount => "lsa-count",
            AlltoallMode::LsaRun => "lsa-run",
            AlltoallMode::LsaBulk => "lsa-bulk",
            AlltoallMode::LsaPull => "lsa-pull",
            AlltoallMode::LsaOptNcclbar => "lsa-opt-ncclbar",
            AlltoallMode::Gin => "gin",
            AlltoallMode::Hybrid => "hybrid",
        }
    }

    pub(super) fn kernel(self, unroll: u32) -> Option<AlltoallKernel> {
        match self {
            AlltoallMode::LsaSimple => Some(AlltoallKernel::LsaSimple),
            AlltoallMode::LsaOpt => Some(AlltoallKernel::LsaOpt { unroll }),
            AlltoallMode::LsaCount => Some(AlltoallKernel::LsaCount),
            AlltoallMode::LsaRun => Some(AlltoallKernel::LsaRun),
            AlltoallMode::LsaBulk => Some(AlltoallKernel::LsaBulk),
            AlltoallMode::LsaPull => Some(AlltoallKernel::LsaPull),
            AlltoallMode::LsaOptNcclbar => Some(AlltoallKernel::LsaOptNcclBarrier),
            _ => None,
        }
    }

    /// Whether the mode runs on the symmetric window (the LSA kernels and the copy engine).
    pub(super) fn uses_window(self, unroll: u32) -> bool {
        self.kernel(unroll).is_some() || matches!(self, AlltoallMode::Ce | AlltoallMode::CeSerial)
    }

    /// The GIN kernel's variant of a GIN mode.
    pub(super) fn gin_variant(self) -> Option<GinVariant> {
        match self {
            AlltoallMode::Gin => Some(GinVariant::Gin),
            AlltoallMode::Hybrid => Some(GinVariant::Hybrid),
            _ => None,
        }
    }

    /// Parses a comma-separated list (`all` = every mode); duplicates are refused.
    pub fn parse_list(text: &str) -> Result<Vec<AlltoallMode>> {
        let mut out = Vec::new();
        for word in text.split(',').map(str::trim).filter(|w| !w.is_empty()) {
            let found: Vec<AlltoallMode> = if word == "all" {
                Self::ALL.to_vec()
            } else {
                match Self::ALL.into_iter().find(|m| m.name() == word) {
                    Some(m) => vec![m],
                    None => {
                        if let Some((_, now)) = RENAMED.iter().find(|(old, _)| *old == word) {
                            return Err(Error::config("modes", word, format!("renamed: {now}")));
                        }
                        let known: Vec<&str> = Self::ALL.iter().map(|m| m.name()).collect();
                        return Err(Error::config(
                            "modes",
                            word,
                            format!("unknown mode; known: {}, all", known.join(", ")),
                        ));
                    }
                }
            };
            for m in found {
                if out.contains(&m) {
                    return Err(Error::config(
                        "modes",
                        text,
                        format!("`{}` given twice", m.name()),
                    ));
                }
                out.push(m);
            }
        }
        if out.is_empty() {
            return Err(Error::config("modes", text, "no mode given"));
        }
        Ok(out)
    }
}

/// Mode names of earlier versions, refused with what to ask for now (one name per design,
/// so a retired name is not an alias).
const RENAMED: [(&str, &str); 1] = [(
    "lsa-each",
    "its design (every CTA signals) is lsa-opt now; the arrival-counter lsa-opt is lsa-count",
)];

/// The store instruction of `lsa-run` (performance only).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum StoreHint {
    /// `st.global.v4`.
    #[default]
    Plain,
    /// `st.global.cs.v4` (streaming).
    Cs,
    /// `st.global.L1::no_allocate.v4`.
    Na,
}

impl StoreHint {
    /// The kernel's `vflags` bits (kVflagStore* in kernels/abi/alltoall.h).
    pub fn vflags(self) -> u32 {
        use crate::abi::alltoall as abi;
        match self {
            StoreHint::Plain => abi::K_VFLAG_STORE_PLAIN,
            StoreHint::Cs => abi::K_VFLAG_STORE_CS,
            StoreHint::Na => abi::K_VFLAG_STORE_NA,
        }
    }

    /// Parses `plain`, `cs` or `na`.
    pub fn parse(text: &str) -> Result<StoreHint> {
        match text.trim() {
            "plain" => Ok(StoreHint::Plain),
            "cs" => Ok(StoreHint::Cs),
            "na" => Ok(StoreHint::Na),
            other => Err(Error::config("store_hint", other, "must be plain, cs or na")),
        }
    }
}

/// What to run.
#[derive(Clone, Debug)]
pub struct AlltoallOptions {
    /// Smallest per-rank total send size, bytes (`-b`).
    pub min_bytes: usize,
    /// Largest (`-e`).
    pub max_bytes: usize,
    /// Size multiplier per step (`-f`), >= 2 unless `min_bytes == max_bytes`.
    pub factor: usize,
    pub modes: Vec<AlltoallMode>,
    pub warmup: usize,
    pub iters: usize,
    /// Check every result against the pattern (before and after the timed loop).
    pub validate: bool,
    /// CTAs of the LSA kernels; `None` = each kernel's default for the point
    /// ([`AlltoallKernel::default_grid`]).
    pub blocks: Option<u32>,
    /// Threads per CTA of the LSA kernels.
    pub threads: u32,
    /// `lsa-opt` tiles in flight per warp (one of [`ops::LSA_OPT_UNROLLS`]); the other LSA
    /// kernels have a fixed copy.
    pub unroll: u32,
    /// Try several grids per LSA point and keep the fastest (each one validated).
    pub grid_sweep: bool,
    /// The grids the sweep tries; empty = [`default_sweep_grids`]; 0 = the default grid.
    pub sweep_grids: Vec<u32>,
    /// Base seed of the validation pattern.
    pub seed: u32,
    /// `lsa-run`'s store instruction.
    pub store_hint: StoreHint,
    /// Stamp one extra loop per double-buffered LSA point (see [`super::Breakdown`]).
    pub breakdown: bool,
    /// Copy-engine peer copy GPU0 -> GPU1 size; 0 skips it.
    pub peer_copy_bytes: usize,
    pub peer_copy_iters: usize,
    /// Deadline of every host wait; in-kernel waits get half of it.
    pub timeout: Duration,
}

impl Default for AlltoallOptions {
    fn default() -> Self {
        AlltoallOptions {
            min_bytes: 1 << 20,
            max_bytes: 1 << 30,
            factor: 2,
            modes: AlltoallMode::defaults(),
            warmup: 5,
            iters: 20,
            validate: true,
            blocks: None,
            threads: 512,
            unroll: 4,
            grid_sweep: false,
            sweep_grids: Vec::new(),
            seed: 0x6769_6e65,
            store_hint: StoreHint::Plain,
            breakdown: false,
            peer_copy_bytes: 1 << 30,
            peer_copy_iters: 10,
            timeout: Duration::from_secs(60),
        }
    }
}

/// One size of the sweep.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SizePoint {
    /// Per-rank total send size actually moved: `chunk_bytes * world`.
    pub bytes: usize,
    /// Bytes to each destination, a multiple of 16 (the kernels' vector width).
    pub chunk_bytes: usize,
}

impl AlltoallOptions {
    /// Refuses options no run could honour, naming the field.
    pub fn validate(&self, world: usize) -> Result<()> {
        if world == 0 {
            return Err(Error::config("world", world, "needs at least one rank"));
        }
        if self.min_bytes == 0 {
            return Err(Error::config("min_bytes", self.min_bytes, "must be > 0"));
        }
        if self.min_bytes > self.max_bytes {
            return Err(Error::config(
                "min_bytes",
                self.min_bytes,
                format!("larger than max_bytes {}", self.max_bytes),
            ));
        }
        if self.max_bytes > MAX_BYTES_LIMIT {
            return Err(Error::config(
                "max_bytes",
                self.max_bytes,
                format!("above the {MAX_BYTES_LIMIT}-byte limit"),
            ));
        }
        if self.factor < 2 && self.min_bytes != self.max_bytes {
            return Err(Error::config(
                "factor",
                self.factor,
                "must be >= 2 (or min_bytes == max_bytes)",
            ));
        }
        if self.iters == 0 {
            return Err(Error::config("iters", self.iters, "must be >= 1"));
        }
        if self.threads == 0 || !self.threads.is_multiple_of(32) || self.threads > ops::MAX_THREADS {
            return Err(Error::config(
                "threads",
                self.threads,
                format!("must be a multiple of 32 in 32..={}", ops::MAX_THREADS),
            ));
        }
        if let Some(b) = self.blocks {
            if b == 0 || b > MAX_BLOCKS {
                return Err(Error::config("blocks", b, format!("must be in 1..={MAX_BLOCKS}")));
            }
        }
        if !ops::LSA_OPT_UNROLLS.contains(&self.unroll) {
            return Err(Error::config(
                "unroll",
                self.unroll,
                format!("must be one of {:?}", ops::LSA_OPT_UNROLLS),
            ));
        }
        if let Some(&g) = self.sweep_grids.iter().find(|&&g| g > MAX_BLOCKS) {
            return Err(Error::config("grids", g, format!("must be in 0..={MAX_BLOCKS}")));
        }
        if self.modes.is_empty() {
            return Err(Error::config("modes", "", "no mode given"));
        }
        for (i, m) in self.modes.iter().enumerate() {
            if self.modes[..i].contains(m) {
                return Err(Error::config("modes", m.name(), "given twice"));
            }
        }
        if self.peer_copy_bytes > 0 && self.peer_copy_iters == 0 {
            return Err(Error::config(
                "peer_copy_iters",
                0,
                "must be >= 1 when peer_copy_bytes > 0",
            ));
        }
        if self.timeout < Duration::from_millis(100) {
            return Err(Error::config(
                "timeout",
                format!("{:?}", self.timeout),
                "must be >= 100 ms",
            ));
        }
        if self.sizes(world).is_empty() {
            return Err(Error::config(
                "max_bytes",
                self.max_bytes,
                format!("no size in the sweep has >= 16 bytes per destination for {world} ranks"),
            ));
        }
        Ok(())
    }

    /// The sweep: `min_bytes, min_bytes * factor, ...` up to `max_bytes`, each rounded down
    /// to `world` chunks of a multiple of 16 bytes; sizes that round to 0 are dropped and
    /// duplicates after rounding merged.
    pub fn sizes(&self, world: usize) -> Vec<SizePoint> {
        let mut out: Vec<SizePoint> = Vec::new();
        if world == 0 || self.min_bytes == 0 {
            return out;
        }
        let mut b = self.min_bytes;
        while b <= self.max_bytes {
            let chunk_bytes = b / world / 16 * 16;
            if chunk_bytes > 0 {
                let p = SizePoint {
                    bytes: chunk_bytes * world,
                    chunk_bytes,
                };
                if out.last() != Some(&p) {
                    out.push(p);
                }
            }
            if self.factor < 2 {
                break;
            }
            match b.checked_mul(self.factor) {
                Some(next) => b = next,
                None => break,
            }
        }
        out
    }
}

/// The grids `--grid-sweep` tries without `--grids`: the size-based default (0), a few
/// small grids for latency-bound sizes, the SM count and twice it.
pub fn default_sweep_grids(sm_count: u32) -> Vec<u32> {
    let sms = sm_count.max(1);
    vec![0, 8, 16, 32, 64, sms, 2 * sms]
}

/// Resolves a sweep list (0 = the kernel's default grid for the point), clamped to
/// `1..=MAX_BLOCKS`, duplicates dropped, order kept.
pub(super) fn resolve_grids(list: &[u32], default: u32) -> Vec<u32> {
    let mut out: Vec<u32> = Vec::new();
    for &g in list {
        let g = if g == 0 { default } else { g }.clamp(1, MAX_BLOCKS);
        if !out.contains(&g) {
            out.push(g);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_follow_nccl_tests_and_round_to_whole_vectors_per_peer() {
        let o = AlltoallOptions {
            min_bytes: 1000,
            max_bytes: 64_000,
            factor: 4,
            ..Default::default()
        };
        let s = o.sizes(3);
        // 1000/3 = 333 -> 320 per peer; 4000/3 = 1333 -> 1328; 16000/3 -> 5328; 64000/3 -> 21328.
        let chunks: Vec<usize> = s.iter().map(|p| p.chunk_bytes).collect();
        assert_eq!(chunks, [320, 1328, 5328, 21328]);
        assert!(s
            .iter()
            .all(|p| p.bytes == p.chunk_bytes * 3 && p.chunk_bytes.is_multiple_of(16)));
        let d = AlltoallOptions::default().sizes(4);
        assert_eq!(d.first().map(|p| p.bytes), Some(1 << 20));
        assert_eq!(d.last().map(|p| p.bytes), Some(1 << 30));
        assert_eq!(d.len(), 11);
    }

    #[test]
    fn invalid_options_are_refused_naming_the_field() {
        let ok = AlltoallOptions::default();
        assert!(ok.validate(4).is_ok());
        let cases: Vec<(AlltoallOptions, &str)> = vec![
            (
                AlltoallOptions {
                    min_bytes: 0,
                    ..ok.clone()
                },
                "min_bytes",
            ),
            (
                AlltoallOptions {
                    min_bytes: 2 << 30,
                    ..ok.clone()
                },
                "min_bytes",
            ),
            (
                AlltoallOptions {
                    factor: 1,
                    ..ok.clone()
                },
                "factor",
            ),
            (
                AlltoallOptions {
                    iters: 0,
                    ..ok.clone()
                },
                "iters",
            ),
            (
                AlltoallOptions {
                    threads: 100,
                    ..ok.clone()
                },
                "threads",
            ),
            (
                AlltoallOptions {
                    threads: 1024,
                    ..ok.clone()
                },
                "threads",
            ),
            (
                AlltoallOptions {
                    blocks: Some(0),
                    ..ok.clone()
                },
                "blocks",
            ),
            (
                AlltoallOptions {
                    blocks: Some(MAX_BLOCKS + 1),
                    ..ok.clone()
                },
                "blocks",
            ),
            (
                AlltoallOptions {
                    unroll: 3,
                    ..ok.clone()
                },
                "unroll",
            ),
            (
                AlltoallOptions {
                    sweep_grids: vec![16, MAX_BLOCKS + 1],
                    ..ok.clone()
                },
                "grids",
            ),
            (
                AlltoallOptions {
                    modes: vec![],
                    ..ok.clone()
                },
                "modes",
            ),
            (
                AlltoallOptions {
                    modes: vec![AlltoallMode::Nccl, AlltoallMode::Nccl],
                    ..ok.clone()
                },
                "modes",
            ),
            (
                AlltoallOptions {
                    max_bytes: 32 << 30,
                    ..ok.clone()
                },
                "max_bytes",
            ),
            (
                AlltoallOptions {
                    min_bytes: 16,
                    max_bytes: 16,
                    ..ok.clone()
                },
                "max_bytes",
            ),
        ];
        for (o, field) in cases {
            let e = o.validate(4).unwrap_err();
            assert!(e.is_usage() && e.to_string().contains(field), "{field}: {e}");
        }
        // One size, factor irrelevant.
        let single = AlltoallOptions {
            min_bytes: 1 << 20,
            max_bytes: 1 << 20,
            factor: 1,
            ..ok
        };
        assert_eq!(single.validate(2).map(|_| single.sizes(2).len()).unwrap(), 1);
    }

    #[test]
    fn mode_lists_parse_and_bad_names_list_the_known_ones() {
        assert_eq!(
            AlltoallMode::parse_list("nccl, lsa-opt").unwrap(),
            [AlltoallMode::Nccl, AlltoallMode::LsaOpt]
        );
        assert_eq!(
            AlltoallMode::parse_list("all").unwrap().len(),
            AlltoallMode::ALL.len()
        );
        let e = AlltoallMode::parse_list("nccl,lsa-fast").unwrap_err().to_string();
        assert!(e.contains("lsa-fast") && e.contains("lsa-pull"), "{e}");
        assert_eq!(
            AlltoallMode::parse_list("lsa-count,lsa-opt").unwrap(),
            [AlltoallMode::LsaCount, AlltoallMode::LsaOpt]
        );
        let e = AlltoallMode::parse_list("lsa-each").unwrap_err();
        assert!(
            e.is_usage() && e.to_string().contains("lsa-opt") && e.to_string().contains("lsa-count"),
            "{e}"
        );
        for m in AlltoallMode::ALL {
            assert_eq!(AlltoallMode::parse_list(m.name()).unwrap(), [m]);
            assert!(RENAMED.iter().all(|(old, _)| *old != m.name()));
        }
        assert!(AlltoallMode::parse_list("gin,gin").is_err());
        assert!(AlltoallMode::parse_list(" , ").is_err());
        assert!(!AlltoallMode::defaults().contains(&AlltoallMode::LsaOptNcclbar));
        assert_eq!(
            AlltoallMode::parse_list("ce,ce-serial,nccl").unwrap(),
            [AlltoallMode::Ce, AlltoallMode::CeSerial, AlltoallMode::Nccl]
        );
        // Both copy orders of the copy-engine reference are measured in every default run.
        let d = AlltoallMode::defaults();
        assert!(d.contains(&AlltoallMode::Ce) && d.contains(&AlltoallMode::CeSerial));
        assert!(d.contains(&AlltoallMode::LsaOpt) && d.contains(&AlltoallMode::LsaCount));
    }

    #[test]
    fn lsa_opt_grid_is_one_round_of_tiles_and_sweeps_resolve_the_default() {
        let k = AlltoallKernel::LsaOpt { unroll: 4 };
        // 1 MiB over 4 ranks: 256 KiB chunks = 512 tiles each, 2048 tiles; 16 warps x 4.
        assert_eq!(k.default_grid(256 << 10, 4, 512, 132), 32);
        assert_eq!(k.default_grid(16 << 20, 4, 512, 132), 132);
        assert_eq!(k.default_grid(16, 4, 512, 132), 4);
        assert_eq!(AlltoallKernel::LsaSimple.default_grid(16, 4, 512, 132), 132);
        assert_eq!(resolve_grids(&[0, 32, 16, 32, 5000], 32), [32, 16, MAX_BLOCKS]);
        assert_eq!(default_sweep_grids(132), [0, 8, 16, 32, 64, 132, 264]);
    }

    #[test]
    fn store_hints_parse() {
        assert_eq!(StoreHint::parse("cs").unwrap().vflags(), 1);
        assert_eq!(StoreHint::parse("na").unwrap().vflags(), 2);
        assert_eq!(StoreHint::default().vflags(), 0);
        assert!(StoreHint::parse("wb")
            .unwrap_err()
            .to_string()
            .contains("store_hint"));
    }
}
