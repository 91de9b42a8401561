//! The HT variant sweep: the (SM budget, variant) entries `gin-ep bench --sweep` times
//! ([`sweep_rank`]) and `gin-ep check --variants` checks ([`sweep_entries`]).
//!
//! Owns: the built-in list, the entry text form and the timing of each entry. Never: checks
//! results (gin-ep's harness does, `gin_ep::gpu::check_rank_variants`).

use gin_ep::backend::cuda::ht::{HtGpuOptions, HtVariant, Sizing, STAMP_WORDS};
use gin_ep::backend::cuda::{CudaRank, CudaRankOptions};
use gin_ep::bench::{BenchMode, BenchOptions, Stats};
use gin_ep::error::{Error, Result};
use gin_ep::gpu::{gather, ht_stamps as ht_abi, max_per_iter, HtTimer, SweepEntry};
use gin_ep::group::Group;

/// Environment variable with a `;`-separated sweep list (entries as [`parse_sweep_entry`]).
pub const ENV_SWEEP: &str = "GIN_EP_HT_SWEEP";

/// The built-in sweep: the default at 24 SMs, then one knob at a time at 24 SMs, then SM
/// budgets above 24 (default and a combined variant). docs/history/perf-notes.md (HT) has
/// the prediction for each.
pub const BUILTIN_SWEEP: &[&str] = &[
    "sms=24",
    "sms=24,rot=0,cu=4,cc=0",
    "sms=24,dc=1,cc=1",
    "sms=24,rot=1",
    "sms=24,dt=256,ct=128",
    "sms=24,du=4,dt=768",
    "sms=24,du=4,dt=768,dc=2",
    "sms=24,du=16,dt=384",
    "sms=24,du=16,dt=384,dc=1,rot=1",
    "sms=24,cu=3,ct=384",
    "sms=24,cu=3,ct=512,cc=2",
    "sms=24,cu=2,ct=512",
    "sms=24,cu=2,ct=512,cc=2",
    "sms=32",
    "sms=32,du=4,dt=768,dc=2,cu=3,ct=512,cc=2",
    "sms=48",
    "sms=48,du=4,dt=768,dc=2,cu=3,ct=512,cc=2",
    "sms=64",
    "sms=96",
];

/// `sms=N,` followed by an [`HtVariant`] text (either part optional; `default_sms` when no
/// `sms=`).
pub fn parse_sweep_entry(text: &str, default_sms: u32) -> Result<SweepEntry> {
    let mut sms = default_sms;
    let mut rest = Vec::new();
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match part.strip_prefix("sms=") {
            Some(n) => {
                sms = n
                    .trim()
                    .parse()
                    .map_err(|_| Error::config("sweep", part, "sms is not a number"))?;
            }
            None => rest.push(part),
        }
    }
    let variant = HtVariant::parse(&rest.join(","))?;
    HtGpuOptions {
        num_sms: sms,
        sizing: Sizing::Static,
        variant,
        ..HtGpuOptions::default()
    }
    .validate()?;
    Ok(SweepEntry {
        sms,
        variant,
        name: text.trim().to_string(),
    })
}

/// The sweep list: `list` (`;`-separated) when given, else `GIN_EP_HT_SWEEP`, else the
/// built-in list, at 24 SMs unless an entry says otherwise.
pub fn sweep_entries(list: Option<&str>) -> Result<Vec<SweepEntry>> {
    let env = std::env::var(ENV_SWEEP).ok();
    let text: Vec<String> = match list.map(str::to_string).or(env) {
        Some(t) => t
            .split(';')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(str::to_string)
            .collect(),
        None => BUILTIN_SWEEP.iter().map(|s| s.to_string()).collect(),
    };
    if text.is_empty() {
        return Err(Error::config("sweep", "(empty)", "no entries"));
    }
    text.iter()
        .map(|t| parse_sweep_entry(t, gin_ep::backend::cuda::ht::DEFAULT_SMS))
        .collect()
}

/// Refuses entries that tune the combine's staging (`sb=`, `cp=`) when nothing stages:
/// with static sizing the bench keeps the combine input in the window, so those entries
/// would time the default kernel under another name (`--ht-sizing exact` stages the input
/// from caller memory, as `gin_ep.Buffer`).
pub fn check_staging(entries: &[SweepEntry], exact: bool) -> Result<()> {
    let d = HtVariant::default();
    match entries
        .iter()
        .find(|e| e.variant.stage_blocks != d.stage_blocks || e.variant.combine_push != d.combine_push)
    {
        Some(e) if !exact => Err(Error::config(
            "sweep",
            &e.name,
            "sb= and cp= tune the staged combine, and with static sizing nothing stages (the \
             combine input is already in the window): add --ht-sizing exact",
        )),
        _ => Ok(()),
    }
}

/// One line of a sweep: medians (µs) over iterations of the slowest rank per iteration.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct SweepRow {
    pub name: String,
    /// Host clock, API call to the end of the stream's work.
    pub dispatch_us: f64,
    /// CUDA events around both dispatch launches.
    pub dispatch_kernel_us: f64,
    /// CUDA events around the layout + count exchange kernel.
    pub layout_us: f64,
    /// Device clock inside the layout kernel: layout work before the count stores.
    pub layout_compute_us: f64,
    /// Device clock: count stores + signals until every peer's counts arrived (includes
    /// the peers' launch skew).
    pub count_wait_us: f64,
    /// Device clock: dispatch block 0 start until the last block's last row was stored.
    pub dispatch_payload_us: f64,
    pub combine_us: f64,
    pub combine_kernel_us: f64,
    /// Device clock: combine block 0 after the start barrier until the last block's pull end.
    pub combine_pull_us: f64,
    /// Device clock: combine block 0 after the start barrier until the last stage CTA's end
    /// (staged combine, `--ht-sizing exact`; 0 otherwise).
    pub combine_staged_us: f64,
}

/// Runs every entry of `entries` (all ranks the same list) with `opts` (iterations, shape,
/// routing; SMs from the entries) on one CudaHt; rank 0 gets one row per entry.
pub fn sweep_rank(
    group: &Group,
    opts: &BenchOptions,
    entries: &[SweepEntry],
) -> Result<Option<Vec<SweepRow>>> {
    let cfg = &opts.cfg;
    if opts.mode != BenchMode::Ht
        || entries.is_empty()
        || opts.tokens > cfg.max_tokens_per_rank
        || opts.iters == 0
    {
        return Err(Error::config(
            "sweep",
            entries.len(),
            "needs --mode ht, at least one entry, tokens <= max_tokens and iters >= 1",
        ));
    }
    let rank = CudaRank::new(group, CudaRankOptions::with_timeout(opts.timeout))?;
    let out = sweep_inner(group, &rank, opts, entries);
    if out.is_err() {
        rank.comm().mark_failed();
    }
    let rows = out?;
    group.barrier("gpu-sweep/done")?;
    Ok(if group.rank() == 0 { Some(rows) } else { None })
}

fn sweep_inner(
    group: &Group,
    rank: &CudaRank,
    opts: &BenchOptions,
    entries: &[SweepEntry],
) -> Result<Vec<SweepRow>> {
    let mut t = HtTimer::new(group, rank, opts, entries[0].sms, entries[0].variant)?;
    let mut rows = Vec::new();
    for (vi, e) in entries.iter().enumerate() {
        t.ht.set_tuning(e.sms, e.variant)?;
        group.barrier(&format!("gpu-sweep/{vi}"))?;
        // [metric][iter], seconds.
        let mut m: Vec<Vec<f64>> = vec![Vec::new(); 10];
        for i in 0..opts.warmup + opts.iters {
            let (td, tc) = t.round(rank)?;
            let st: [u64; STAMP_WORDS] = t.ht.stamps(rank.own())?;
            if i >= opts.warmup {
                // Stamp words (kStamp* in kernels/abi/ht.h), seconds between two.
                let d = |a: i32, b: i32| st[b as usize].saturating_sub(st[a as usize]) as f64 * 1e-9;
                let vals = [
                    td.as_secs_f64(),
                    t.event_secs(0, 2)?,
                    t.event_secs(0, 1)?,
                    d(ht_abi::K_STAMP_LAY_START, ht_abi::K_STAMP_LAY_DONE),
                    d(ht_abi::K_STAMP_LAY_DONE, ht_abi::K_STAMP_LAY_COUNTS),
                    d(ht_abi::K_STAMP_DISP_START, ht_abi::K_STAMP_DISP_PAYLOAD),
                    tc.as_secs_f64(),
                    t.event_secs(3, 4)?,
                    d(ht_abi::K_STAMP_COMB_START, ht_abi::K_STAMP_COMB_PULL),
                    d(ht_abi::K_STAMP_COMB_START, ht_abi::K_STAMP_COMB_STAGED),
                ];
                for (k, v) in vals.into_iter().enumerate() {
                    m[k].push(v);
                }
            }
        }
        let mut med = [0.0f64; 10];
        for (k, v) in m.iter().enumerate() {
            let all = gather(group, &format!("gpu-sweep/{vi}/{k}"), v)?;
            med[k] = Stats::of(&max_per_iter(&all)).median_us;
        }
        rows.push(SweepRow {
            name: e.name.clone(),
            dispatch_us: med[0],
            dispatch_kernel_us: med[1],
            layout_us: med[2],
            layout_compute_us: med[3],
            count_wait_us: med[4],
            dispatch_payload_us: med[5],
            combine_us: med[6],
            combine_kernel_us: med[7],
            combine_pull_us: med[8],
            combine_staged_us: med[9],
        });
    }
    rank.wait("end of sweep")?;
    group.barrier("gpu-sweep/loop-done")?;
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staging_entries_need_a_staged_combine() {
        let list = sweep_entries(Some("sms=24;sms=20,sb=4")).unwrap();
        let e = check_staging(&list, false).unwrap_err().to_string();
        assert!(
            e.contains("sms=20,sb=4") && e.contains("--ht-sizing exact"),
            "{e}"
        );
        assert!(check_staging(&list, true).is_ok());
        assert!(check_staging(&sweep_entries(Some("sms=24;sms=32,du=4")).unwrap(), false).is_ok());
        // The pull-from-a-copy combine (cp=0) is not the default either.
        let copy = sweep_entries(Some("cp=0")).unwrap();
        assert!(check_staging(&copy, false).is_err());
        // sb= counts CTAs of the entry's sms=, and must leave one to reduce.
        let e = sweep_entries(Some("sms=8,sb=8")).unwrap_err().to_string();
        assert!(e.contains("sb=8"), "{e}");
    }

    #[test]
    fn sweep_lists_parse() {
        let all = sweep_entries(None).unwrap();
        assert_eq!(all.len(), BUILTIN_SWEEP.len());
        assert_eq!(all[0].sms, 24);
        assert_eq!(all[0].variant, HtVariant::default());
        let e = sweep_entries(Some("sms=48,du=4,dt=768; rot=1")).unwrap();
        assert_eq!((e[0].sms, e[0].variant.dispatch_unroll), (48, 4));
        assert_eq!((e[1].sms, e[1].variant.rotate), (24, true));
        assert!(sweep_entries(Some("sms=0")).is_err());
        assert!(sweep_entries(Some("sms=200")).is_err());
        assert!(sweep_entries(Some(" ; ")).is_err());
        for e in all {
            e.variant.validate().unwrap();
        }
    }
}
