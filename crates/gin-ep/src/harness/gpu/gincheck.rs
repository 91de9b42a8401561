//! The GIN conformance check (`gin-ep check --mode gin`): one rank's driver of
//! kernels/gin/conformance.cu.
//!
//! Owns: the check's window layout, its device bookkeeping (expected signal and counter
//! values, the mismatch record), the same-node IPC mappings it asks for, one launch per
//! iteration with a bounded wait, the kill-a-rank fault (`--kill RANK:ITER`: the rank exits
//! abruptly), and turning a failure into an error that names the peer. Never: calls NCCL's
//! unbounded GIN waits (the kernel polls under deadlines), or frees memory a kernel may still
//! use after a failure (it is left to the process's end).
//!
//! What the kernel does each iteration is in kernels/gin/conformance.cu's header; the plan is
//! mirrored here ([`plan`]) so CPU tests pin it down.

use std::time::{Duration, Instant};

use crate::backend::cuda::abi::gin as abi;
use crate::backend::cuda::ipc::{map_node_windows, NodeWindows};
use crate::backend::cuda::runtime::{CudaRank, CudaRankOptions, DevCommRequest};
use crate::error::{Error, Result};
use crate::group::vnodes::RankTopology;
use crate::group::Group;
use abi::GinCheckArgs;

/// Kernel entry point.
pub const KERNEL: &str = "gin_ep_gin_conformance";
/// Threads of the check's one CTA (`kGinCheckThreads`, the kernel's launch bound).
const THREADS: u32 = abi::K_GIN_CHECK_THREADS as u32;
/// Ordering test: puts per round and bytes per put (kOrder* in kernels/abi/gin.h).
pub const ORDER_PUTS: usize = abi::K_ORDER_PUTS as usize;
pub const ORDER_BYTES: usize = abi::K_ORDER_BYTES as usize;
/// Bytes of the kernel's result record (`GinCheckResult`).
const RESULT_BYTES: usize = std::mem::size_of::<abi::GinCheckResult>();
/// Exit status of a rank killed by `--kill`.
pub const KILL_EXIT: i32 = 86;

/// `--kill RANK:ITER` on rank `me` before iteration `it`: ends the process at once with
/// [`KILL_EXIT`], as a crash would, so the peers must notice on their own.
pub fn exit_abruptly(me: usize, it: u64) -> ! {
    eprintln!("rank {me}: --kill {me}:{it}: exiting abruptly now");
    // SAFETY: _exit takes no pointers; no unwinding or atexit handler runs, so no teardown
    // reaches the peers.
    unsafe { libc::_exit(KILL_EXIT) }
}

/// What to check.
#[derive(Clone, Debug)]
pub struct GinCheckOptions {
    pub iters: u64,
    pub seed: u64,
    /// Largest random put, bytes.
    pub max_bytes: usize,
    /// Ordering test every this many iterations (0: never).
    pub order_every: u32,
    /// `(rank, iteration)`: that rank exits abruptly before that iteration.
    pub kill: Option<(usize, u64)>,
    pub timeout: Duration,
}

impl Default for GinCheckOptions {
    fn default() -> Self {
        GinCheckOptions {
            iters: 100,
            seed: 0,
            max_bytes: 4096,
            order_every: 10,
            kill: None,
            timeout: Duration::from_secs(60),
        }
    }
}

impl GinCheckOptions {
    /// Refuses what the check cannot do, naming the value.
    pub fn validate(&self, world: usize) -> Result<()> {
        if self.iters == 0 {
            return Err(Error::input("iters", "0: must be at least 1"));
        }
        if self.max_bytes == 0 || self.max_bytes > 1 << 20 {
            return Err(Error::input(
                "max-bytes",
                format!("{}: must be 1..=1048576", self.max_bytes),
            ));
        }
        if let Some((r, it)) = self.kill {
            if r >= world {
                return Err(Error::input(
                    "kill",
                    format!("rank {r} is out of range for {world} ranks"),
                ));
            }
            if world < 2 {
                return Err(Error::input(
                    "kill",
                    "needs at least 2 ranks (someone must notice)",
                ));
            }
            if it >= self.iters {
                return Err(Error::input(
                    "kill",
                    format!("iteration {it} is never reached (--iters {})", self.iters),
                ));
            }
        }
        Ok(())
    }
}

/// The check's window layout for `world` ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub slot: usize,
    pub send_offset: usize,
    pub recv_offset: usize,
    pub order_send_offset: usize,
    pub order_recv_offset: usize,
    pub node_recv_offset: usize,
    pub node_flag_offset: usize,
    pub bytes: usize,
    /// Signals per context: inc, add and barrier per source, one ordering signal.
    pub signals: usize,
}

/// Regions never overlap, each starts 256-byte aligned, and a slot leaves room for offsets.
pub fn layout(world: usize, max_bytes: usize) -> Layout {
    let up = |x: usize| x.div_ceil(256) * 256;
    let slot = up(max_bytes + 256);
    let send_offset = 0;
    let recv_offset = send_offset + world * 2 * slot;
    let order_send_offset = recv_offset + world * 2 * slot;
    let order_recv_offset = order_send_offset + up(ORDER_PUTS * ORDER_BYTES);
    let node_recv_offset = order_recv_offset + up(ORDER_PUTS * ORDER_BYTES);
    let node_flag_offset = node_recv_offset + world * slot;
    Layout {
        slot,
        send_offset,
        recv_offset,
        order_send_offset,
        order_recv_offset,
        node_recv_offset,
        node_flag_offset,
        bytes: up(node_flag_offset + world * 8),
        signals: 3 * world + 1,
    }
}

/// One operation of the plan (kernels/gin/conformance.cu `GcOp`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlannedOp {
    pub bytes: u64,
    pub src_off: u64,
    pub dst_off: u64,
    pub add: u64,
    pub ctx: u32,
}

fn mix(mut x: u64) -> u64 {
    x ^= x >> 30;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Host mirror of `gc_key`.
pub fn key(seed: u64, it: u64, src: u32, dst: u32, op: u32) -> u64 {
    mix(seed
        ^ mix(it.wrapping_mul(0x9E37_79B9_7F4A_7C15)
            ^ (u64::from(src) << 40)
            ^ (u64::from(dst) << 16)
            ^ u64::from(op)))
}

/// Host mirror of `gc_plan`: operation `op` of `src -> dst` in iteration `it`.
pub fn plan(seed: u64, it: u64, src: u32, dst: u32, op: u32, max_bytes: u64, slot: u64) -> PlannedOp {
    let k = key(seed, it, src, dst, op);
    let pick = mix(k.wrapping_add(1));
    let bytes = if op == 2 || op == 3 {
        0
    } else {
        match pick & 7 {
            0 => 0,
            1 => max_bytes,
            _ => (pick >> 8) % (max_bytes + 1),
        }
    };
    PlannedOp {
        bytes,
        src_off: mix(k.wrapping_add(2)) % (slot - bytes + 1),
        dst_off: mix(k.wrapping_add(3)) % (slot - bytes + 1),
        add: 1 + (mix(k.wrapping_add(4)) & 0xFFFF),
        ctx: (it
            .wrapping_add(3 * u64::from(src))
            .wrapping_add(u64::from(dst))
            .wrapping_add(u64::from(op))
            & 3) as u32,
    }
}

/// Host mirror of `gc_byte`: byte `i` of the data keyed `key`.
pub fn data_byte(key: u64, i: u64) -> u8 {
    (mix(key ^ (i >> 3).wrapping_mul(0xD6E8_FEB8_6659_FD93)) >> (8 * (i & 7))) as u8
}

/// The kernel's `GinCheckResult`, decoded.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Mismatch {
    pub count: u64,
    pub src: i32,
    pub op: u32,
    pub index: u64,
    pub expected: u32,
    pub got: u32,
}

fn decode_result(raw: &[u8; RESULT_BYTES]) -> Mismatch {
    use abi::GinCheckResult as R;
    use std::mem::offset_of;
    let u64_at = |o: usize| u64::from_le_bytes(raw[o..o + 8].try_into().unwrap_or([0; 8]));
    let u32_at = |o: usize| u32::from_le_bytes(raw[o..o + 4].try_into().unwrap_or([0; 4]));
    Mismatch {
        count: u64_at(offset_of!(R, mismatches)),
        src: u32_at(offset_of!(R, src)) as i32,
        op: u32_at(offset_of!(R, op)),
        index: u64_at(offset_of!(R, index)),
        expected: u32_at(offset_of!(R, expected)),
        got: u32_at(offset_of!(R, got)),
    }
}

fn op_name(op: u32) -> &'static str {
    match op {
        0 => "put + SignalInc",
        1 => "put + SignalAdd",
        4 => "same-node store (IPC)",
        5 => "ordering test (1000 puts, then one signal)",
        _ => "unknown operation",
    }
}

/// What one rank checked.
#[derive(Clone, Debug, serde::Serialize)]
pub struct GinCheckReport {
    pub rank: usize,
    pub world: usize,
    pub iters: u64,
    /// Puts + signals this rank issued.
    pub operations: u64,
    /// Bytes this rank verified.
    pub bytes_checked: u64,
    /// Ranks of this rank's gin-ep node it reached by stores.
    pub node_peers: usize,
    pub secs: f64,
    /// Processes shared a GPU: timings are time-sliced, correctness only.
    pub time_sliced: bool,
}

/// Runs the check as one rank of `group`; every rank calls it with the same options.
pub fn check_rank(group: &Group, opts: &GinCheckOptions) -> Result<GinCheckReport> {
    opts.validate(group.world())?;
    let topo = RankTopology::from_env()?;
    let rank = CudaRank::new(group, CudaRankOptions::with_timeout(opts.timeout))?;
    // Each rank's pid, so a survivor can say which peer is gone (one host: virtual nodes).
    group.store().set(
        &group.key(&format!("gincheck/pid/{}", group.rank())),
        std::process::id().to_string().as_bytes(),
    )?;
    match run(group, &rank, opts, &topo) {
        Ok(r) => Ok(r),
        Err(e) => {
            rank.comm().mark_failed();
            Err(explain(group, e))
        }
    }
}

/// Adds which peers' processes are gone to a failure (ranks on this host only).
fn explain(group: &Group, e: Error) -> Error {
    let mut gone = Vec::new();
    for r in (0..group.world()).filter(|&r| r != group.rank()) {
        let Ok(raw) = group.store().get(
            &group.key(&format!("gincheck/pid/{r}")),
            Duration::from_millis(200),
        ) else {
            continue;
        };
        let Some(pid) = String::from_utf8(raw).ok().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        // Field 3 is the state; a zombie has exited but is not reaped yet.
        let state = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next());
        if stat.is_empty() || state == Some("Z") {
            gone.push(format!("rank {r} (pid {pid})"));
        }
    }
    if gone.is_empty() {
        return e;
    }
    Error::PeerFailed {
        peer: gone[0]
            .split(' ')
            .nth(1)
            .and_then(|p| p.parse().ok())
            .unwrap_or(usize::MAX),
        phase: "GIN conformance check".into(),
        reason: format!("its process is gone ({}); this rank saw: {e}", gone.join(", ")),
    }
}

fn run(
    group: &Group,
    rank: &CudaRank,
    opts: &GinCheckOptions,
    topo: &RankTopology,
) -> Result<GinCheckReport> {
    let world = group.world();
    let me = group.rank();
    let lay = layout(world, opts.max_bytes);
    let window = rank.window(lay.bytes)?;
    let dev_comm = rank.dev_comm_with_counters(
        DevCommRequest {
            lsa_barriers: 0,
            gin_signals: lay.signals as u32,
        },
        1,
    )?;
    // Without --node-size the node is NCCL's LSA team, which this check reaches over GIN only.
    let (first, size) = match topo.node_size {
        Some(_) => topo.node_of(me, world, dev_comm.lsa().1),
        None => (me, 1),
    };
    let nodes: NodeWindows = map_node_windows(rank, &window, first, size)?;
    let expect_bytes = (4 * lay.signals + 4) * 8;
    let expect = rank.alloc(expect_bytes)?;
    rank.memset_u8(expect.region(), 0)?;
    let result = rank.alloc(RESULT_BYTES)?;
    rank.memset_u8(result.region(), 0)?;
    let peers = rank.alloc(world * 8)?;
    let raw_peers: Vec<u8> = nodes.bases().iter().flat_map(|b| b.to_le_bytes()).collect();
    rank.upload(peers.region(), &raw_peers)?;
    rank.wait("GIN check setup")?;
    group.barrier("gincheck/start")?;

    let t0 = Instant::now();
    let (mut operations, mut checked) = (0u64, 0u64);
    for it in 0..opts.iters {
        if opts.kill == Some((me, it)) {
            exit_abruptly(me, it);
        }
        let args = GinCheckArgs {
            comm: dev_comm.raw(),
            win: window.raw(),
            seed: opts.seed,
            iteration: it,
            timeout_ns: u64::try_from(rank.options().kernel_timeout.as_nanos()).unwrap_or(u64::MAX),
            err: rank.fabric_err_dev(),
            result: result.region().ptr,
            expect: expect.region().ptr,
            node_peers: peers.region().ptr,
            max_bytes: opts.max_bytes as u64,
            slot: lay.slot as u64,
            send_offset: lay.send_offset as u64,
            recv_offset: lay.recv_offset as u64,
            order_send_offset: lay.order_send_offset as u64,
            order_recv_offset: lay.order_recv_offset as u64,
            node_recv_offset: lay.node_recv_offset as u64,
            node_flag_offset: lay.node_flag_offset as u64,
            order_every: opts.order_every,
            n_signals: lay.signals as u32,
        };
        // SAFETY: GinCheckArgs is the kernel parameter (generated from abi/gin.h, layout
        // asserted by rustc and nvcc);
        // the window, device communicator, buffers and IPC mappings outlive the launch: the
        // wait below bounds it, and on failure they are leaked, never freed under it.
        let launched = unsafe { rank.own().launch(KERNEL, 1, THREADS, &args) };
        let waited = launched.and_then(|_| rank.wait(&format!("GIN conformance iteration {it}")));
        if let Err(e) = waited {
            std::mem::forget((window, dev_comm, nodes, expect, result, peers));
            return Err(e);
        }
        let mut raw = [0u8; RESULT_BYTES];
        rank.download(result.region(), &mut raw)?;
        let m = decode_result(&raw);
        if m.count != 0 {
            std::mem::forget((window, dev_comm, nodes, expect, result, peers));
            return Err(Error::Mismatch(format!(
                "GIN conformance, iteration {it}: rank {me} received wrong data from rank {} in its {} \
                 at byte {}: expected {:#04x}, got {:#04x}; {} bad bytes in all (seed {})",
                m.src,
                op_name(m.op),
                m.index,
                m.expected,
                m.got,
                m.count,
                opts.seed
            )));
        }
        for dst in 0..world as u32 {
            for op in 0..2 {
                let p = plan(
                    opts.seed,
                    it,
                    dst,
                    me as u32,
                    op,
                    opts.max_bytes as u64,
                    lay.slot as u64,
                );
                checked += p.bytes;
            }
            operations += 4;
        }
        if opts.order_every != 0 && it % u64::from(opts.order_every) == 0 {
            operations += ORDER_PUTS as u64 + 1;
            checked += (ORDER_PUTS * ORDER_BYTES) as u64;
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    // Nobody unmaps or frees a window a peer may still store into or put to.
    group.barrier("gincheck/done")?;
    let node_peers = nodes.peers();
    drop(nodes);
    Ok(GinCheckReport {
        rank: me,
        world,
        iters: opts.iters,
        operations,
        bytes_checked: checked,
        node_peers,
        secs,
        time_sliced: topo.vnodes > 1,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_layout_keeps_regions_apart_aligned_and_inside_the_window() {
        for (world, max) in [(1, 1), (2, 4096), (4, 4096), (8, 65536), (3, 1000)] {
            let l = layout(world, max);
            let regions = [
                (l.send_offset, world * 2 * l.slot),
                (l.recv_offset, world * 2 * l.slot),
                (l.order_send_offset, ORDER_PUTS * ORDER_BYTES),
                (l.order_recv_offset, ORDER_PUTS * ORDER_BYTES),
                (l.node_recv_offset, world * l.slot),
                (l.node_flag_offset, world * 8),
            ];
            for (i, (a, la)) in regions.iter().enumerate() {
                assert_eq!(a % 256, 0, "region {i} of ({world},{max})");
                assert!(a + la <= l.bytes);
                for (b, lb) in &regions[i + 1..] {
                    assert!(a + la <= *b || b + lb <= *a, "overlap in ({world},{max})");
                }
            }
            assert!(l.slot >= max);
            assert_eq!(l.signals, 3 * world + 1);
        }
    }

    #[test]
    fn the_plan_covers_empty_and_full_puts_every_context_and_stays_in_its_slot() {
        let (max, slot) = (4096u64, layout(4, 4096).slot as u64);
        let mut ctxs = [0usize; 4];
        let (mut empty, mut full) = (0, 0);
        for it in 0..200 {
            for src in 0..4 {
                for dst in 0..4 {
                    for op in 0..4 {
                        let p = plan(7, it, src, dst, op, max, slot);
                        ctxs[p.ctx as usize] += 1;
                        assert!(p.src_off + p.bytes <= slot && p.dst_off + p.bytes <= slot);
                        assert!(p.add >= 1 && p.add <= 0x10000);
                        if op >= 2 {
                            assert_eq!(p.bytes, 0, "ops 2 and 3 carry no data");
                        } else if p.bytes == 0 {
                            empty += 1;
                        } else if p.bytes == max {
                            full += 1;
                        }
                    }
                }
            }
        }
        assert!(ctxs.iter().all(|&c| c > 0), "every context is used: {ctxs:?}");
        assert!(empty > 0 && full > 0, "empty {empty}, full {full}");
        // The plan depends on every coordinate.
        let base = plan(1, 2, 0, 1, 0, max, slot);
        for other in [
            plan(2, 2, 0, 1, 0, max, slot),
            plan(1, 3, 0, 1, 0, max, slot),
            plan(1, 2, 1, 1, 0, max, slot),
            plan(1, 2, 0, 2, 0, max, slot),
        ] {
            assert_ne!(
                (base.bytes, base.src_off, base.dst_off, base.add),
                (other.bytes, other.src_off, other.dst_off, other.add)
            );
        }
    }

    #[test]
    fn data_differs_between_iterations_so_stale_bytes_are_caught() {
        let (a, b) = (key(5, 10, 0, 1, 5), key(5, 11, 0, 1, 5));
        let n = (ORDER_PUTS * ORDER_BYTES) as u64;
        let same = (0..n).filter(|&i| data_byte(a, i) == data_byte(b, i)).count() as u64;
        // Independent bytes agree 1 time in 256; a stale block can never pass as a whole.
        assert!(same < n / 128, "{same} of {n} bytes equal");
    }

    #[test]
    fn results_decode_from_the_kernels_layout() {
        // The record as the kernel writes it: its fields at the offsets of the generated struct
        // (which nvcc asserts are the kernel's).
        use abi::GinCheckResult as R;
        use std::mem::offset_of;
        let mut raw = [0u8; RESULT_BYTES];
        let mut put = |o: usize, b: &[u8]| raw[o..o + b.len()].copy_from_slice(b);
        put(offset_of!(R, mismatches), &3u64.to_le_bytes());
        put(offset_of!(R, claimed), &1u32.to_le_bytes());
        put(offset_of!(R, src), &2i32.to_le_bytes());
        put(offset_of!(R, op), &5u32.to_le_bytes());
        put(offset_of!(R, index), &777u64.to_le_bytes());
        put(offset_of!(R, expected), &0xAAu32.to_le_bytes());
        put(offset_of!(R, got), &0x55u32.to_le_bytes());
        let m = decode_result(&raw);
        assert_eq!(
            m,
            Mismatch {
                count: 3,
                src: 2,
                op: 5,
                index: 777,
                expected: 0xAA,
                got: 0x55
            }
        );
        assert!(op_name(m.op).contains("ordering"));
    }

    #[test]
    fn bad_options_are_refused_naming_the_value() {
        let o = GinCheckOptions::default();
        assert!(o.validate(2).is_ok());
        let bad = [
            (
                GinCheckOptions {
                    iters: 0,
                    ..o.clone()
                },
                2,
                "iters",
            ),
            (
                GinCheckOptions {
                    max_bytes: 0,
                    ..o.clone()
                },
                2,
                "max-bytes",
            ),
            (
                GinCheckOptions {
                    kill: Some((2, 0)),
                    ..o.clone()
                },
                2,
                "rank 2",
            ),
            (
                GinCheckOptions {
                    kill: Some((0, 0)),
                    ..o.clone()
                },
                1,
                "2 ranks",
            ),
            (
                GinCheckOptions {
                    kill: Some((1, 100)),
                    ..o.clone()
                },
                2,
                "100",
            ),
        ];
        for (opts, world, needle) in bad {
            let e = opts.validate(world).unwrap_err().to_string();
            assert!(e.contains(needle), "{e}");
        }
    }
}
