//! The LL kernels' device-clock stamps, read on the host: where the benchmark takes them
//! ([`StampMode`]), the stamp slots of abi/ll.h, and the phase breakdown ([`PHASES`]) and
//! eager-loop split computed from one rank's rows.
//!
//! Owns: the meaning of each stamp slot (kSt* in kernels/abi/ll.h). Never: allocates,
//! launches or times anything (the harness's LL benchmark does); pure arithmetic on
//! downloaded rows.

use super::abi;
use super::STAMP_SLOTS;
use crate::error::{Error, Result};

/// Stamp slots of each operation's first and last stamp (kStDispStart, kStDispEnd,
/// kStCombStart, kStCombEnd in abi/ll.h): the span of its kernels.
const ST_DISP_START: usize = slot(abi::K_ST_DISP_START);
const ST_DISP_END: usize = slot(abi::K_ST_DISP_END);
const ST_COMB_START: usize = slot(abi::K_ST_COMB_START);
const ST_COMB_END: usize = slot(abi::K_ST_COMB_END);
/// Stamp slots of the first instruction of the kernel that starts each operation
/// (kStDispEntry, kStCombEntry): the gap before an operation is launch, then entry.
const ST_DISP_ENTRY: usize = slot(abi::K_ST_DISP_ENTRY);
const ST_COMB_ENTRY: usize = slot(abi::K_ST_COMB_ENTRY);
/// The combine reduce's latest warp: first item stored, last item stored (kStCombFirstItem,
/// kStCombLastItem).
const ST_COMB_FIRST_ITEM: usize = slot(abi::K_ST_COMB_FIRST_ITEM);
const ST_COMB_LAST_ITEM: usize = slot(abi::K_ST_COMB_LAST_ITEM);
/// `pub`: the latest CTA's first batch of ready words published (kStDispFirstPub).
const ST_DISP_FIRST_PUB: usize = slot(abi::K_ST_DISP_FIRST_PUB);

/// A stamp slot as an index into a CTA's row.
const fn slot(s: i32) -> usize {
    s as usize
}

/// Environment variable: the device-clock phase breakdown ([`PHASES`]) of `gin-ep bench
/// --mode ll`, see [`StampMode`].
pub const ENV_STAMPS: &str = "GIN_EP_LL_STAMPS";

/// Where `gin-ep bench --mode ll` takes device-clock stamps ([`ENV_STAMPS`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StampMode {
    /// Unset, empty or `0`: none.
    Off,
    /// `1` or `loop`: an extra eager loop after the timed ones, not timed by events (the
    /// kernels' stamp writes stay out of the timed figures).
    Loop,
    /// `eager`: inside the event-timed eager loop itself, and each rank prints how its
    /// event-to-event time splits into the gap before the kernel and the kernel's span (to
    /// tell a slow kernel from a late one); the eager figures then include the stamp writes.
    Eager,
    /// `edges`: as `eager`, but the kernels write only each operation's first and last
    /// stamp (start and end of the span), so the loop runs nearly as unstamped.
    Edges,
}

impl StampMode {
    pub fn parse(v: &str) -> Result<StampMode> {
        match v.trim() {
            "" | "0" => Ok(StampMode::Off),
            "1" | "loop" => Ok(StampMode::Loop),
            "eager" => Ok(StampMode::Eager),
            "edges" => Ok(StampMode::Edges),
            other => Err(Error::config(
                ENV_STAMPS,
                other,
                "expected 0, 1 (or loop), eager or edges",
            )),
        }
    }

    pub fn from_env() -> Result<StampMode> {
        std::env::var(ENV_STAMPS).map_or(Ok(StampMode::Off), |v| StampMode::parse(&v))
    }
}

/// One column of the device-clock breakdown: name, stamp slot (kSt* in abi/ll.h), and whether
/// it is the first CTA to reach the slot (else the last). Times are µs from the first CTA's
/// start of the operation (kStDispStart, kStCombStart) on the rank's clock; medians over
/// iterations of the slowest rank. Absent slots (no kernel passes them) are left
/// out of the report.
pub const PHASES: [(&str, usize, bool); 29] = [
    ("d.lay", slot(abi::K_ST_DISP_LAYOUT), false),
    ("d.cred", slot(abi::K_ST_DISP_CREDIT), false),
    ("d.loop0", slot(abi::K_ST_DISP_LOOP), true),
    ("d.loop", slot(abi::K_ST_DISP_LOOP), false),
    ("d.enc0", slot(abi::K_ST_DISP_ENCODED), true),
    ("d.enc", slot(abi::K_ST_DISP_ENCODED), false),
    ("d.stored0", slot(abi::K_ST_DISP_STORED), true),
    ("d.stored", slot(abi::K_ST_DISP_STORED), false),
    ("d.pub1", ST_DISP_FIRST_PUB, false),
    ("d.fenced", slot(abi::K_ST_DISP_FENCED), false),
    ("d.sent0", slot(abi::K_ST_DISP_SENT), true),
    ("d.sent", slot(abi::K_ST_DISP_SENT), false),
    ("d.rstart", slot(abi::K_ST_DISP_RECV), false),
    ("d.cnts", slot(abi::K_ST_DISP_COUNTS), false),
    ("d.exp", slot(abi::K_ST_DISP_EXPANDED), false),
    ("d.end", slot(abi::K_ST_DISP_END), false),
    ("c.cred0", slot(abi::K_ST_COMB_CREDIT), true),
    ("c.cred", slot(abi::K_ST_COMB_CREDIT), false),
    ("c.wts", slot(abi::K_ST_COMB_WEIGHTS), false),
    ("c.sent0", slot(abi::K_ST_COMB_SENT), true),
    ("c.sent", slot(abi::K_ST_COMB_SENT), false),
    ("c.sig", slot(abi::K_ST_COMB_SIGNALED), false),
    ("c.rstart", slot(abi::K_ST_COMB_RECV), false),
    ("c.seen0", slot(abi::K_ST_COMB_SEEN), true),
    ("c.seen", slot(abi::K_ST_COMB_SEEN), false),
    ("c.item1", ST_COMB_FIRST_ITEM, false),
    ("c.items", ST_COMB_LAST_ITEM, false),
    ("c.red", slot(abi::K_ST_COMB_REDUCED), false),
    ("c.end", slot(abi::K_ST_COMB_END), false),
];
/// Dispatch columns of [`PHASES`] (the rest are combine).
pub(crate) const DISPATCH_PHASES: usize = 16;

/// Whether stamp slot `slot` belongs to the dispatch (kStDisp* in abi/ll.h, the slots before
/// kStCombEntry), else the combine.
fn dispatch_slot(slot: usize) -> bool {
    slot < ST_COMB_ENTRY
}

/// [`PHASES`] of one operation pair from its `[grid][STAMP_SLOTS]` stamps, µs; -1 where a
/// slot was never written.
pub(crate) fn phase_values(st: &[u64], grid: usize) -> [f64; PHASES.len()] {
    let mut out = [-1.0; PHASES.len()];
    for (i, &(_, slot, first)) in PHASES.iter().enumerate() {
        let origin = if dispatch_slot(slot) {
            ST_DISP_START
        } else {
            ST_COMB_START
        };
        let t0 = slot_time(st, grid, origin, true);
        if let Some(us) = us_between(t0, slot_time(st, grid, slot, first)) {
            out[i] = us;
        }
    }
    out
}

/// The first (`first`) or last CTA's stamp in slot `slot` of one `[grid][STAMP_SLOTS]` row
/// (ns); None when no CTA wrote the slot.
fn slot_time(row: &[u64], grid: usize, slot: usize, first: bool) -> Option<u64> {
    let written = (0..grid).map(|c| row[c * STAMP_SLOTS + slot]).filter(|&v| v != 0);
    if first {
        written.min()
    } else {
        written.max()
    }
}

/// µs from stamp `a` to stamp `b` (ns), when both were written.
fn us_between(a: Option<u64>, b: Option<u64>) -> Option<f64> {
    Some(b?.saturating_sub(a?) as f64 * 1e-3)
}
/// One rank's eager loop split by its stamps ([`StampMode::Eager`]): per operation, the
/// event-to-event time, the gap on this GPU's clock from the previous operation's last CTA
/// end to this one's first CTA start (launch, event, waiting for the stream), and the span
/// from first CTA start to last CTA end; median and max over iterations, µs. An event time
/// far above gap + span would point at the events themselves.
pub(crate) fn eager_split(host: &[u64], grid: usize, ev_d: &[f64], ev_c: &[f64]) -> String {
    let per = grid * STAMP_SLOTS;
    let iters = host.len() / per.max(1);
    let edge =
        |i: usize, slot: usize, first: bool| slot_time(&host[i * per..(i + 1) * per], grid, slot, first);
    let (mut gap_d, mut span_d, mut gap_c, mut span_c) = (vec![], vec![], vec![], vec![]);
    // The gaps' parts: launch (previous end to the first CTA's first instruction) and entry
    // (that instruction to the first CTA's start stamp).
    let (mut launch_d, mut entry_d, mut launch_c, mut entry_c) = (vec![], vec![], vec![], vec![]);
    for i in 0..iters {
        let (ds, de) = (edge(i, ST_DISP_START, true), edge(i, ST_DISP_END, false));
        let (cs, ce) = (edge(i, ST_COMB_START, true), edge(i, ST_COMB_END, false));
        let (dn, cn) = (edge(i, ST_DISP_ENTRY, true), edge(i, ST_COMB_ENTRY, true));
        if i > 0 {
            let prev = edge(i - 1, ST_COMB_END, false);
            gap_d.extend(us_between(prev, ds));
            launch_d.extend(us_between(prev, dn));
        }
        entry_d.extend(us_between(dn, ds));
        span_d.extend(us_between(ds, de));
        gap_c.extend(us_between(de, cs));
        launch_c.extend(us_between(de, cn));
        entry_c.extend(us_between(cn, cs));
        span_c.extend(us_between(cs, ce));
    }
    let mm = |v: &[f64]| {
        let mut s = v.to_vec();
        s.sort_by(f64::total_cmp);
        match s.last() {
            Some(max) => format!("{:.1}/{:.1}", s[s.len() / 2], max),
            None => "-".to_string(),
        }
    };
    format!(
        "eager loop stamped, median/max µs: dispatch event {} = gap {} (launch {} + entry {}) + span \
         {}; combine event {} = gap {} (launch {} + entry {}) + span {}",
        mm(ev_d),
        mm(&gap_d),
        mm(&launch_d),
        mm(&entry_d),
        mm(&span_d),
        mm(ev_c),
        mm(&gap_c),
        mm(&launch_c),
        mm(&entry_c),
        mm(&span_c)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stamp_mode_parses_and_names_a_bad_value() {
        assert_eq!(StampMode::parse("").unwrap(), StampMode::Off);
        assert_eq!(StampMode::parse(" 0 ").unwrap(), StampMode::Off);
        assert_eq!(StampMode::parse("1").unwrap(), StampMode::Loop);
        assert_eq!(StampMode::parse("loop").unwrap(), StampMode::Loop);
        assert_eq!(StampMode::parse("eager").unwrap(), StampMode::Eager);
        assert_eq!(StampMode::parse("edges").unwrap(), StampMode::Edges);
        let e = StampMode::parse("yes").unwrap_err();
        assert!(e.is_usage() && e.to_string().contains("yes"), "{e}");
    }

    #[test]
    fn eager_split_separates_the_gap_before_a_kernel_from_its_span() {
        // Two iterations, two CTAs: the start and end slots of dispatch and combine.
        let per = 2 * STAMP_SLOTS;
        let mut st = vec![0u64; 2 * per];
        let mut set =
            |i: usize, cta: usize, slot: usize, ns: u64| st[i * per + cta * STAMP_SLOTS + slot] = ns;
        set(0, 0, ST_DISP_START, 1_000);
        set(0, 1, ST_DISP_START, 2_000);
        set(0, 0, ST_DISP_END, 11_000);
        set(0, 1, ST_DISP_END, 12_000); // dispatch 0: span 11 µs
        set(0, 0, ST_COMB_START, 15_000);
        set(0, 1, ST_COMB_END, 25_000); // combine 0: gap 3, span 10
        set(0, 0, ST_COMB_ENTRY, 14_000); // combine 0: launch 2, entry 1
        set(1, 0, ST_DISP_ENTRY, 1_224_500); // a later CTA's entry: not the one timed
        set(1, 1, ST_DISP_ENTRY, 1_224_000); // dispatch 1: launch 1199, entry 1
        set(1, 1, ST_DISP_START, 1_225_000); // dispatch 1 starts 1.2 ms after combine 0 ended
        set(1, 0, ST_DISP_END, 1_236_000);
        set(1, 0, ST_COMB_START, 1_240_000);
        set(1, 0, ST_COMB_END, 1_250_000);
        let line = eager_split(&st, 2, &[20.0, 1215.0], &[14.0, 14.0]);
        assert!(
            line.contains(
                "dispatch event 1215.0/1215.0 = gap 1200.0/1200.0 (launch 1199.0/1199.0 + entry \
                 1.0/1.0) + span 11.0/11.0"
            ),
            "{line}"
        );
        assert!(
            line.contains(
                "combine event 14.0/14.0 = gap 4.0/4.0 (launch 2.0/2.0 + entry 1.0/1.0) + span 10.0/10.0"
            ),
            "{line}"
        );
    }

    #[test]
    fn phases_are_last_cta_times_from_the_first_start() {
        let mut st = vec![0u64; 2 * STAMP_SLOTS];
        let sent = slot(abi::K_ST_DISP_SENT);
        let reduced = slot(abi::K_ST_COMB_REDUCED);
        st[ST_DISP_START] = 1_000; // CTA 0 starts at 1 µs, CTA 1 at 2 µs
        st[STAMP_SLOTS + ST_DISP_START] = 2_000;
        st[sent] = 5_000; // sent: CTA 0 at 5 µs, CTA 1 at 9 µs
        st[STAMP_SLOTS + sent] = 9_000;
        st[ST_COMB_START] = 20_000;
        st[STAMP_SLOTS + reduced] = 30_000;
        let v = phase_values(&st, 2);
        let at = |n: &str| v[PHASES.iter().position(|p| p.0 == n).unwrap()];
        assert_eq!(at("d.sent0"), 4.0);
        assert_eq!(at("d.sent"), 8.0);
        assert_eq!(at("c.red"), 10.0);
        assert_eq!(at("d.fenced"), -1.0);
        assert_eq!(
            PHASES.iter().filter(|p| dispatch_slot(p.1)).count(),
            DISPATCH_PHASES
        );
        assert!(PHASES[..DISPATCH_PHASES].iter().all(|p| dispatch_slot(p.1)));
    }
}
