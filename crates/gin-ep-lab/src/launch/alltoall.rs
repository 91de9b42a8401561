//! Typed launches of the LSA and copy-engine all-to-all kernels (kernels/alltoall.cu) on a
//! rank's [`Module`] of the lab kernels.
//!
//! Owns: building each kernel's parameter block from gin-ep's safe owners ([`Window`],
//! [`DevComm`], [`DeviceRegion`]) and checking, before the launch, every bound the kernels rely
//! on and do not re-check (offsets inside the window, 16-byte alignment, grid and block limits,
//! the LSA team spanning the whole group); the same for the copies of the copy-engine
//! all-to-all, which go to peers' window addresses. Never: allocates (except the one-time
//! peer address fetch, `fabric::lsa_peer_bases`), or waits (callers wait with
//! `CudaRank::wait`, which also reports missed in-kernel deadlines).

use gin_ep::backend::cuda::fabric::{lsa_peer_bases, lsa_peer_region};
use gin_ep::backend::cuda::{DevComm, DeviceRegion, Module, SideStreams, Window};
use gin_ep::error::{Error, Result};

use crate::abi::alltoall::{self as abi, AlltoallArgs};
use crate::kernels::names;

/// Most threads per block of the all-to-all kernels (`kMaxThreads` in kernels/abi/alltoall.h).
pub const MAX_THREADS: u32 = abi::K_MAX_THREADS as u32;

/// Which LSA all-to-all kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AlltoallKernel {
    /// Baseline: 4-byte stores, (peer, slice) items per block.
    LsaSimple,
    /// Push with 16-byte stores, peers interleaved per warp, `unroll` (1, 2, 4 or 8) tiles
    /// in flight per warp; double-buffered receive region, `each` signal: every CTA adds to
    /// a counter in every peer, CTA 0 waits.
    LsaOpt { unroll: u32 },
    /// `LsaOpt`'s copy (unroll 4) with the arrival-counter signal: every CTA bumps a local
    /// counter, the last one signals every peer and waits (the first design, slower by a
    /// serial fence/atomic chain; kept for comparison).
    LsaCount,
    /// 4 KiB contiguous runs per warp per peer (all loads before the stores), store
    /// instruction picked by `vflags`, `each` signal.
    LsaRun,
    /// cp.async.bulk global -> shared -> peer from one thread per CTA (launch 32 threads),
    /// `each` signal.
    LsaBulk,
    /// Pull with 16-byte NVLink loads (send buffer inside the window).
    LsaPull,
    /// `LsaOpt`'s copy (unroll 4, one receive buffer) between two of NCCL's
    /// ncclLsaBarrierSession barriers (no deadline) instead of ours; needs a device
    /// communicator with `lsa_barriers >= grid`.
    LsaOptNcclBarrier,
    /// The copy-engine all-to-all's start (`end: false`) or end barrier alone, one CTA of
    /// one warp; the data moves in copies queued between the two ([`ce_alltoall`]).
    CeBarrier { end: bool },
}

/// The `unroll` values `AlltoallKernel::LsaOpt` has kernels for.
pub const LSA_OPT_UNROLLS: [u32; 4] = [1, 2, 4, 8];

impl AlltoallKernel {
    fn name(self) -> &'static str {
        match self {
            AlltoallKernel::LsaSimple => names::ALLTOALL_LSA_SIMPLE,
            AlltoallKernel::LsaOpt { unroll: 1 } => names::ALLTOALL_LSA_OPT_U1,
            AlltoallKernel::LsaOpt { unroll: 2 } => names::ALLTOALL_LSA_OPT_U2,
            AlltoallKernel::LsaOpt { unroll: 8 } => names::ALLTOALL_LSA_OPT_U8,
            // check() refuses every other unroll before a launch.
            AlltoallKernel::LsaOpt { .. } => names::ALLTOALL_LSA_OPT,
            AlltoallKernel::LsaCount => names::ALLTOALL_LSA_COUNT,
            AlltoallKernel::LsaRun => names::ALLTOALL_LSA_RUN,
            AlltoallKernel::LsaBulk => names::ALLTOALL_LSA_BULK,
            AlltoallKernel::LsaPull => names::ALLTOALL_LSA_PULL,
            AlltoallKernel::LsaOptNcclBarrier => names::ALLTOALL_LSA_OPT_NCCL_BARRIER,
            AlltoallKernel::CeBarrier { end: false } => names::ALLTOALL_CE_START,
            AlltoallKernel::CeBarrier { end: true } => names::ALLTOALL_CE_END,
        }
    }

    /// Whether the kernel double-buffers its receive region (and so needs `recv_stride` and
    /// the flag words) instead of running a start and an end barrier.
    pub fn double_buffered(self) -> bool {
        matches!(
            self,
            AlltoallKernel::LsaOpt { .. }
                | AlltoallKernel::LsaCount
                | AlltoallKernel::LsaRun
                | AlltoallKernel::LsaBulk
        )
    }

    /// Threads per CTA this kernel is launched with, given the requested `block`: the bulk
    /// kernel and the copy-engine barriers use one warp (only lane 0 issues copies; n
    /// threads signal), the others `block`.
    pub fn block(self, block: u32) -> u32 {
        match self {
            AlltoallKernel::LsaBulk | AlltoallKernel::CeBarrier { .. } => 32,
            _ => block,
        }
    }

    /// The grid to use when none is given: for `LsaOpt`, just enough blocks for one
    /// round of `unroll` 512-byte tiles per warp (small sizes are latency-bound and every
    /// block costs a signal to every peer), at least one block per rank and at most
    /// `sm_count`; `LsaCount` as `LsaOpt` at unroll 4, `LsaRun` as unroll 8; the SM count for
    /// the others.
    pub fn default_grid(self, chunk_bytes: usize, world: usize, block: u32, sm_count: u32) -> u32 {
        let sms = sm_count.max(1);
        match self {
            AlltoallKernel::LsaOpt { unroll } => {
                let tiles = chunk_bytes.div_ceil(512).saturating_mul(world);
                let per_block = (block as usize / 32).max(1) * unroll.max(1) as usize;
                let want = tiles.div_ceil(per_block).max(world);
                u32::try_from(want).unwrap_or(u32::MAX).clamp(1, sms)
            }
            AlltoallKernel::LsaCount => {
                AlltoallKernel::LsaOpt { unroll: 4 }.default_grid(chunk_bytes, world, block, sm_count)
            }
            // One 4 KiB run per warp is the same bytes per warp as 8 tiles.
            AlltoallKernel::LsaRun => {
                AlltoallKernel::LsaOpt { unroll: 8 }.default_grid(chunk_bytes, world, block, sm_count)
            }
            AlltoallKernel::CeBarrier { .. } => 1,
            _ => sms,
        }
    }
}

/// One all-to-all launch over a window laid out as: send region (`n * chunk_bytes` at
/// `send_offset`), receive region (`n * chunk_bytes` at `recv_offset`; for double-buffered
/// kernels a second one at `recv_offset + recv_stride`), the deadline barrier's signal words
/// (`grid * n` u64 at `signal_offset`) and the double-buffered kernels' flags ([`flag_words`]
/// u64 at `flag_offset`), all zero at window creation and used by every later launch with
/// growing epochs.
#[derive(Clone, Copy, Debug)]
pub struct AlltoallLaunch<'a> {
    pub kernel: AlltoallKernel,
    pub window: &'a Window,
    pub dev_comm: &'a DevComm,
    pub send_offset: usize,
    pub recv_offset: usize,
    pub signal_offset: usize,
    /// Double-buffered kernels: receive buffer 1 is at `recv_offset + recv_stride`.
    pub recv_stride: usize,
    pub flag_offset: usize,
    pub chunk_bytes: usize,
    pub grid: u32,
    pub block: u32,
    /// `--breakdown`: `STAMP_WORDS_PER_CTA * grid` u64 of device memory the kernel stamps.
    pub stamps: Option<DeviceRegion<'a>>,
    /// Performance-only variant bits (see `AlltoallArgs::vflags`).
    pub vflags: u32,
}

/// u64 globaltimer words per CTA a stamped launch writes (`kStampsPerCta` in
/// kernels/abi/alltoall.h): start, stores issued, signal issued, every peer seen (kStamp*).
pub const STAMP_WORDS_PER_CTA: usize = abi::K_STAMPS_PER_CTA as usize;

fn bad(what: &str, reason: String) -> Error {
    Error::input(format!("all-to-all launch: {what}"), reason)
}

impl AlltoallLaunch<'_> {
    /// Every bound the kernel assumes, for a group of `world` ranks.
    pub fn check(&self, world: usize) -> Result<()> {
        let (_, lsa_size) = self.dev_comm.lsa();
        if lsa_size != world {
            return Err(Error::Unavailable {
                backend: "cuda",
                reason: format!(
                    "LSA kernels need every rank reachable by NVLink load/store; the LSA team \
                     has {lsa_size} of {world} ranks"
                ),
            });
        }
        if self.chunk_bytes == 0 || !self.chunk_bytes.is_multiple_of(16) {
            return Err(bad(
                "chunk_bytes",
                format!("{} is not a positive multiple of 16", self.chunk_bytes),
            ));
        }
        for (name, off) in [
            ("send_offset", self.send_offset),
            ("recv_offset", self.recv_offset),
            ("signal_offset", self.signal_offset),
            ("flag_offset", self.flag_offset),
        ] {
            if !off.is_multiple_of(16) {
                return Err(bad(name, format!("{off} is not 16-byte aligned")));
            }
        }
        if self.grid == 0 || self.block == 0 || !self.block.is_multiple_of(32) || self.block > MAX_THREADS {
            return Err(bad(
                "grid/block",
                format!(
                    "grid {} block {}: need grid >= 1 and a block of 32..={MAX_THREADS} threads in whole warps",
                    self.grid, self.block
                ),
            ));
        }
        if self.kernel == AlltoallKernel::LsaOptNcclBarrier
            && self.dev_comm.request().lsa_barriers < self.grid
        {
            return Err(bad(
                "grid",
                format!(
                    "{} blocks but the device communicator has {} NCCL LSA barriers",
                    self.grid,
                    self.dev_comm.request().lsa_barriers
                ),
            ));
        }
        if let AlltoallKernel::LsaOpt { unroll } = self.kernel {
            if !LSA_OPT_UNROLLS.contains(&unroll) {
                return Err(bad(
                    "unroll",
                    format!("{unroll}: lsa_opt has kernels for {LSA_OPT_UNROLLS:?}"),
                ));
            }
        }
        let data = self
            .chunk_bytes
            .checked_mul(world)
            .ok_or_else(|| bad("chunk_bytes", "overflows".into()))?;
        let signals = self.grid as usize * world * 8;
        let double = self.kernel.double_buffered();
        if double && self.recv_stride < data {
            return Err(bad(
                "recv_stride",
                format!(
                    "{} is smaller than one receive buffer ({data} bytes)",
                    self.recv_stride
                ),
            ));
        }
        let recv_len = if double {
            self.recv_stride
                .checked_add(data)
                .ok_or_else(|| bad("recv_stride", "overflows".into()))?
        } else {
            data
        };
        let flags = if double { flag_words(world) * 8 } else { 0 };
        if let Some(st) = self.stamps {
            let need = self.grid as usize * STAMP_WORDS_PER_CTA * 8;
            if st.len() < need {
                return Err(bad(
                    "stamps",
                    format!("{} bytes, the grid of {} needs {need}", st.len(), self.grid),
                ));
            }
        }
        let ranges = [
            ("send region", self.send_offset, data),
            ("receive region", self.recv_offset, recv_len),
            ("signal words", self.signal_offset, signals),
            ("flag words", self.flag_offset, flags),
        ];
        for (name, off, len) in ranges {
            if off.checked_add(len).is_none_or(|end| end > self.window.len()) {
                return Err(bad(
                    name,
                    format!(
                        "[{off}, +{len}) exceeds the window of {} bytes",
                        self.window.len()
                    ),
                ));
            }
        }
        for (i, a) in ranges.iter().enumerate() {
            for b in &ranges[i + 1..] {
                if a.2 > 0 && b.2 > 0 && a.1 < b.1 + b.2 && b.1 < a.1 + a.2 {
                    return Err(bad(a.0, format!("overlaps the {}", b.0)));
                }
            }
        }
        Ok(())
    }
}

/// u64 flag words at `flag_offset` the double-buffered kernels use: `lsa_count`'s n signal
/// words and arrival counter, then the `each` kernels' two slots of n counters.
pub fn flag_words(world: usize) -> usize {
    world + 1 + 2 * world
}

/// Launches one all-to-all on the rank's stream (checked first; takes the next barrier
/// epoch, so every rank must launch the same sequence of barrier kernels). Returns the
/// window offset of the receive buffer this launch fills (`recv_offset`, or for
/// double-buffered kernels `recv_offset + (epoch & 1) * recv_stride`).
///
/// Double-buffered kernels have no start barrier: the caller must read a launch's output
/// before enqueueing the next launch on this window, and may write its own receive buffers
/// (e.g. poison them) only while no peer can launch: finish the write, then meet every peer
/// (a host barrier) before anyone launches again. See kernels/alltoall.cu.
pub fn launch_alltoall(kernels: &Module<'_>, l: &AlltoallLaunch<'_>) -> Result<usize> {
    let rank = kernels.rank();
    l.check(rank.info().world)?;
    let send = l
        .window
        .region(l.send_offset, l.chunk_bytes * rank.info().world)?;
    let epoch = rank.next_epoch();
    let filled = if l.kernel.double_buffered() {
        l.recv_offset + (epoch & 1) as usize * l.recv_stride
    } else {
        l.recv_offset
    };
    let args = AlltoallArgs {
        comm: l.dev_comm.raw(),
        win: l.window.raw(),
        send: send.device_ptr(),
        send_offset: l.send_offset,
        recv_offset: l.recv_offset,
        signal_offset: l.signal_offset,
        chunk_bytes: l.chunk_bytes,
        epoch,
        timeout_ns: u64::try_from(rank.options().kernel_timeout.as_nanos()).unwrap_or(u64::MAX),
        err: rank.fabric_err_dev(),
        recv_stride: l.recv_stride,
        flag_offset: l.flag_offset,
        stamps: l.stamps.map_or(0, |r| r.device_ptr()),
        vflags: l.vflags,
        pad: 0,
    };
    // SAFETY: AlltoallArgs is the kernel parameter (generated from abi/alltoall.h; rustc and
    // nvcc assert its layout); the window, device communicator and error record outlive the
    // launch (callers wait before dropping them: CudaRank's Drop waits, and windows hold the
    // communicator); check() proved every region the kernel touches lies inside the window.
    unsafe { kernels.launch(l.kernel.name(), l.grid, l.kernel.block(l.block), &args)? };
    Ok(filled)
}

/// One copy-engine all-to-all (`ce` modes) over a window laid out as the LSA kernels' (send
/// region at `send_offset`, one receive buffer at `recv_offset`, the deadline barrier's
/// words at `signal_offset`): a start barrier kernel, one device-to-device copy per
/// destination p from send chunk p to peer p's receive slot for this rank (through the
/// peer's LSA address of the window, `fabric::lsa_peer_bases`), then an end barrier kernel. See
/// "ce" in kernels/alltoall.cu for why the data is at the receivers when the operation ends.
#[derive(Clone, Copy, Debug)]
pub struct CeAlltoall<'a> {
    pub window: &'a Window,
    pub dev_comm: &'a DevComm,
    pub send_offset: usize,
    pub recv_offset: usize,
    pub signal_offset: usize,
    pub chunk_bytes: usize,
    /// `Some`: each remote copy on its own side stream (n - 1 of them at least), forked
    /// after the start barrier and joined before the end barrier, so several copy engines
    /// run at once and the local copy overlaps them; `None`: every copy back to back on the
    /// rank's stream.
    pub side: Option<&'a SideStreams>,
}

impl<'a> CeAlltoall<'a> {
    /// A barrier kernel's launch over the same layout (single-buffered: no flag words).
    fn barrier(&self, end: bool) -> AlltoallLaunch<'a> {
        AlltoallLaunch {
            kernel: AlltoallKernel::CeBarrier { end },
            window: self.window,
            dev_comm: self.dev_comm,
            send_offset: self.send_offset,
            recv_offset: self.recv_offset,
            signal_offset: self.signal_offset,
            recv_stride: 0,
            flag_offset: 0,
            chunk_bytes: self.chunk_bytes,
            grid: 1,
            block: 32,
            stamps: None,
            vflags: 0,
        }
    }
}

/// The copies of one `ce` operation on LSA rank `me` of `n`, in queue order: (destination,
/// side stream index, or `None` for the rank's stream). Destination (me + 1 + k) % n at step
/// k: in the serial order every rank writes to a different peer at each step (no receiver
/// takes two writers while another idles), and the local chunk comes last; `forked`, remote
/// copy k goes to side stream k and the local one stays on the rank's stream, beside them.
fn ce_copy_order(me: usize, n: usize, forked: bool) -> impl Iterator<Item = (usize, Option<usize>)> {
    (0..n).map(move |k| {
        let p = (me + 1 + k) % n;
        (p, (forked && p != me).then_some(k))
    })
}

/// Queues one copy-engine all-to-all on the rank's stream (checked first, with the bounds
/// of [`AlltoallLaunch::check`]; its two barrier kernels take an epoch each, so every rank
/// must queue the same sequence of barrier kernels). Returns the window offset of the
/// receive buffer it fills, `recv_offset`: single-buffered, with start and end barriers as
/// `lsa_simple`, so there is no contract on when the caller reads it. The first call on a
/// window waits to fetch the peers' addresses.
pub fn ce_alltoall(kernels: &Module<'_>, c: &CeAlltoall<'_>) -> Result<usize> {
    let rank = kernels.rank();
    let start = c.barrier(false);
    start.check(rank.info().world)?;
    // check() proved the LSA team is the whole group.
    let (me, n) = c.dev_comm.lsa();
    if let Some(side) = c.side {
        if side.len() + 1 < n {
            return Err(bad(
                "side streams",
                format!("{} streams for {} remote peers", side.len(), n - 1),
            ));
        }
    }
    let bases = lsa_peer_bases(rank, c.window, c.dev_comm)?;
    if bases.len() != n {
        return Err(bad(
            "peer addresses",
            format!("{} for an LSA team of {n}", bases.len()),
        ));
    }
    let send = c.window.region(c.send_offset, c.chunk_bytes * n)?;
    // This rank's slot in every peer's receive region.
    let slot = c.recv_offset + me * c.chunk_bytes;
    let dsts = (0..n)
        .map(|p| lsa_peer_region(rank, c.window, c.dev_comm, p, slot, c.chunk_bytes))
        .collect::<Result<Vec<_>>>()?;
    launch_alltoall(kernels, &start)?;
    if let Some(side) = c.side {
        rank.fork(side)?;
    }
    for (p, side_index) in ce_copy_order(me, n, c.side.is_some()) {
        let src = send.sub(p * c.chunk_bytes, c.chunk_bytes)?;
        // The side streams are joined into the rank's stream before the end barrier, so
        // callers' waits on the rank cover these copies too.
        rank.copy_on(c.side.zip(side_index), dsts[p], src)?;
    }
    if let Some(side) = c.side {
        rank.join(side)?;
    }
    launch_alltoall(kernels, &c.barrier(true))?;
    Ok(c.recv_offset)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The source every all-to-all entry point is defined in.
    const ALLTOALL_CU: &str = include_str!("../../kernels/alltoall.cu");

    #[test]
    fn every_alltoall_kernel_maps_to_its_own_entry_point_in_the_source() {
        let kernels = [
            AlltoallKernel::LsaSimple,
            AlltoallKernel::LsaOpt { unroll: 1 },
            AlltoallKernel::LsaOpt { unroll: 2 },
            AlltoallKernel::LsaOpt { unroll: 4 },
            AlltoallKernel::LsaOpt { unroll: 8 },
            AlltoallKernel::LsaCount,
            AlltoallKernel::LsaRun,
            AlltoallKernel::LsaBulk,
            AlltoallKernel::LsaPull,
            AlltoallKernel::LsaOptNcclBarrier,
            AlltoallKernel::CeBarrier { end: false },
            AlltoallKernel::CeBarrier { end: true },
        ];
        let names: Vec<&str> = kernels.iter().map(|k| k.name()).collect();
        for (i, n) in names.iter().enumerate() {
            assert!(!names[..i].contains(n), "{n} used twice");
            // Defined directly or through the GIN_EP_LSA_OPT(NAME, U) macro.
            assert!(
                ALLTOALL_CU.contains(&format!(" {n}(const AlltoallArgs a)"))
                    || ALLTOALL_CU.contains(&format!("GIN_EP_LSA_OPT({n},")),
                "{n} is not an entry point of kernels/alltoall.cu"
            );
        }
    }

    #[test]
    fn ce_barriers_are_one_single_buffered_warp() {
        for end in [false, true] {
            let k = AlltoallKernel::CeBarrier { end };
            assert_eq!((k.block(512), k.default_grid(1 << 30, 4, 512, 132)), (32, 1));
            assert!(!k.double_buffered());
        }
    }

    #[test]
    fn ce_copies_reach_every_peer_once_local_last_and_spread_receivers_per_step() {
        for n in 1..=8 {
            let orders: Vec<Vec<(usize, Option<usize>)>> =
                (0..n).map(|me| ce_copy_order(me, n, true).collect()).collect();
            for (me, order) in orders.iter().enumerate() {
                let mut peers: Vec<usize> = order.iter().map(|c| c.0).collect();
                assert_eq!(peers.last(), Some(&me), "local chunk last");
                peers.sort_unstable();
                assert_eq!(peers, (0..n).collect::<Vec<_>>(), "every destination once");
                // Remote copy k on side stream k (n - 1 streams), the local one on the rank's.
                for (k, &(p, side)) in order.iter().enumerate() {
                    assert_eq!(side, (p != me).then_some(k));
                }
                let serial: Vec<Option<usize>> = ce_copy_order(me, n, false).map(|c| c.1).collect();
                assert!(serial.iter().all(Option::is_none));
            }
            for k in 0..n {
                let mut at_step: Vec<usize> = orders.iter().map(|o| o[k].0).collect();
                at_step.sort_unstable();
                assert_eq!(
                    at_step,
                    (0..n).collect::<Vec<_>>(),
                    "step {k} of {n}: one writer each"
                );
            }
        }
    }

    #[test]
    fn lsa_count_is_double_buffered_and_sized_like_lsa_opt_at_unroll_4() {
        let opt4 = AlltoallKernel::LsaOpt { unroll: 4 };
        assert!(AlltoallKernel::LsaCount.double_buffered() && opt4.double_buffered());
        assert!(!AlltoallKernel::LsaSimple.double_buffered());
        for chunk in [16, 256 << 10, 64 << 20] {
            assert_eq!(
                AlltoallKernel::LsaCount.default_grid(chunk, 4, 512, 132),
                opt4.default_grid(chunk, 4, 512, 132)
            );
        }
        // Fewer tiles in flight per warp: more CTAs for the same point.
        assert!(
            AlltoallKernel::LsaOpt { unroll: 1 }.default_grid(256 << 10, 4, 512, 132)
                > opt4.default_grid(256 << 10, 4, 512, 132)
        );
    }
}
