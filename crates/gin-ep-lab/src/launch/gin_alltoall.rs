//! The GIN all-to-all (`gin` and `hybrid` modes of `gin-ep alltoall`, nccl-tests' `-D 3` and
//! `-D 4`): typed launches of `gin_ep_alltoall_gin` (kernels/alltoall.cu) on a rank's
//! [`Module`] of the lab kernels, and the local copy-engine reference of runs whose ranks share
//! a GPU.
//!
//! Owns: the kernel's argument mirror, every bound the kernel relies on (checked before a
//! launch), the monotonic targets its waits poll for (barrier, per-mode data signals, node
//! arrival words; every rank counts the same launches, so every rank computes the same
//! targets), and the node table: this process's address of each window of this rank's gin-ep
//! node (NCCL's LSA team, or the IPC-mapped `--node-size` grouping). Never: waits (callers
//! use `CudaRank::wait`, which reports missed in-kernel deadlines), calls NCCL's unbounded
//! GIN waits, or resets a signal or counter.

use std::cell::Cell;

use gin_ep::backend::cuda::fabric::lsa_peer_bases;
use gin_ep::backend::cuda::ipc::{map_node_windows, NodeWindows};
use gin_ep::backend::cuda::{CudaRank, DevComm, DeviceBuffer, Module, Window};
use gin_ep::error::{Error, Result};
use gin_ep::group::vnodes::RankTopology;
use gin_ep::group::Group;

use super::alltoall::MAX_THREADS;
use crate::abi::alltoall::GinAlltoallArgs;
use crate::kernels::names::ALLTOALL_GIN as KERNEL;

/// GIN signals per rank, per context: `gin`'s data signals, `hybrid`'s, the barrier's.
pub const SIGNALS_PER_RANK: u32 = 3;
/// GIN counters per context: one per mode.
pub const COUNTERS: u32 = 2;
/// Most CTAs of a hybrid launch (its node stores stride over the grid).
pub const MAX_GRID: u32 = 1024;

/// Which of the two GIN all-to-alls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GinVariant {
    /// Every peer, self included, by GIN put + signal.
    Gin,
    /// The ranks of this rank's gin-ep node by stores, the rest by GIN.
    Hybrid,
}

impl GinVariant {
    /// (first data signal, counter id) of the variant: each counts only its own launches.
    fn signals(self, world: u32) -> (u32, u32) {
        match self {
            GinVariant::Gin => (0, 0),
            GinVariant::Hybrid => (world, 1),
        }
    }
}

/// The launch counts behind the kernel's targets, per device communicator (its signals and
/// counters only grow). Every rank makes the same launches, so every rank's counts agree.
#[derive(Debug, Default)]
pub struct GinCounts {
    launches: Cell<u64>,
    gin: Cell<u64>,
    hybrid: Cell<u64>,
    node_arrivals: Cell<u64>,
}

/// This rank's gin-ep node as the hybrid kernel sees it: `bases[r]` is rank r's window base
/// in this process for r in the node (this rank included), 0 elsewhere; and a table of
/// zeros for the pure GIN kernel.
pub struct GinNode {
    /// The node: (first rank, size); consecutive ranks.
    pub first: usize,
    pub size: usize,
    /// "NCCL LSA team" or "--node-size grouping (IPC-mapped windows)".
    pub source: &'static str,
    table: DeviceBuffer,
    zeros: DeviceBuffer,
    _ipc: Option<NodeWindows>,
}

/// Where each rank of `me`'s node lies, for a node `first..first + size` that contains `me`:
/// its base from `lookup(r)` (None: not reachable), this rank's own `own`.
pub fn node_table(
    world: usize,
    me: usize,
    first: usize,
    size: usize,
    own: u64,
    lookup: &dyn Fn(usize) -> Option<u64>,
) -> Result<Vec<u64>> {
    if size == 0 || first > me || me >= first + size || first + size > world {
        return Err(Error::input(
            "gin-ep node",
            format!("ranks {first}..{} do not hold rank {me} of {world}", first + size),
        ));
    }
    let mut t = vec![0u64; world];
    for (r, slot) in t.iter_mut().enumerate().skip(first).take(size) {
        let b = if r == me { own } else { lookup(r).unwrap_or(0) };
        if b == 0 || b % 16 != 0 {
            return Err(Error::Device {
                call: "gin-ep node window mapping".into(),
                reason: format!("rank {r}'s window base {b:#x} in this process is null or unaligned"),
            });
        }
        *slot = b;
    }
    Ok(t)
}

/// Maps this rank's gin-ep node: with `--node-size`, the IPC-mapped windows of that grouping
/// (collective over the node); otherwise NCCL's LSA team (through the window's LSA
/// addresses). Collective: every rank calls it with the same topology.
pub fn gin_node(rank: &CudaRank, group: &Group, window: &Window, dev_comm: &DevComm) -> Result<GinNode> {
    let topo = RankTopology::from_env()?;
    let (world, me) = (group.world(), group.rank());
    let (lsa_rank, lsa_size) = dev_comm.lsa();
    let own = window.region(0, window.len())?.device_ptr();
    let (first, size, source, table, ipc) = if topo.node_size.is_some() {
        let (first, size) = topo.node_of(me, world, lsa_size);
        let nodes = map_node_windows(rank, window, first, size)?;
        let table = node_table(world, me, first, size, own, &|r| nodes.bases().get(r).copied())?;
        (
            first,
            size,
            "--node-size grouping (IPC-mapped windows)",
            table,
            Some(nodes),
        )
    } else {
        let first = me - lsa_rank.min(me);
        let bases = if lsa_size > 1 {
            lsa_peer_bases(rank, window, dev_comm)?.to_vec()
        } else {
            vec![own]
        };
        let table = node_table(world, me, first, lsa_size, own, &|r| {
            bases.get(r - first).copied()
        })?;
        (first, lsa_size, "NCCL LSA team", table, None)
    };
    let raw: Vec<u8> = table.iter().flat_map(|b| b.to_le_bytes()).collect();
    let dev = rank.alloc(world * 8)?;
    rank.upload(dev.region(), &raw)?;
    let zeros = rank.alloc(world * 8)?;
    rank.memset_u8(zeros.region(), 0)?;
    rank.wait("GIN all-to-all node table")?;
    Ok(GinNode {
        first,
        size,
        source,
        table: dev,
        zeros,
        _ipc: ipc,
    })
}

/// One GIN all-to-all launch over a window laid out as: send region (`n * chunk_bytes` at
/// `send_offset`), receive region (`n * chunk_bytes` at `recv_offset`), the node arrival
/// words (`n` u64 at `node_flag_offset`, zero at window creation). The device communicator
/// must have [`SIGNALS_PER_RANK`] `* n` GIN signals and [`COUNTERS`] counters.
#[derive(Clone, Copy)]
pub struct GinAlltoall<'a> {
    pub variant: GinVariant,
    pub window: &'a Window,
    pub dev_comm: &'a DevComm,
    pub node: &'a GinNode,
    pub counts: &'a GinCounts,
    pub send_offset: usize,
    pub recv_offset: usize,
    pub node_flag_offset: usize,
    pub chunk_bytes: usize,
    /// CTAs: 1 for `gin` (only CTA 0 puts); `hybrid`'s node stores use all of them.
    pub grid: u32,
    pub block: u32,
}

fn bad(what: &str, reason: String) -> Error {
    Error::input(format!("GIN all-to-all launch: {what}"), reason)
}

impl GinAlltoall<'_> {
    /// Every bound the kernel assumes, for a group of `world` ranks.
    pub fn check(&self, world: usize) -> Result<()> {
        let need = SIGNALS_PER_RANK as usize * world;
        if (self.dev_comm.request().gin_signals as usize) < need {
            return Err(bad(
                "device communicator",
                format!(
                    "{} GIN signals, the kernel needs {need}",
                    self.dev_comm.request().gin_signals
                ),
            ));
        }
        if self.chunk_bytes == 0 || !self.chunk_bytes.is_multiple_of(16) {
            return Err(bad(
                "chunk_bytes",
                format!("{} is not a positive multiple of 16", self.chunk_bytes),
            ));
        }
        if self.grid == 0 || self.grid > MAX_GRID {
            return Err(bad("grid", format!("{}: must be in 1..={MAX_GRID}", self.grid)));
        }
        if self.block < 32 || !self.block.is_multiple_of(32) || self.block > MAX_THREADS {
            return Err(bad(
                "block",
                format!("{}: must be whole warps, 32..={MAX_THREADS}", self.block),
            ));
        }
        let data = self
            .chunk_bytes
            .checked_mul(world)
            .ok_or_else(|| bad("chunk_bytes", "overflows".into()))?;
        check_ranges(
            &[
                ("send region", self.send_offset, data),
                ("receive region", self.recv_offset, data),
                ("node arrival words", self.node_flag_offset, world * 8),
            ],
            self.window.len(),
        )
        .map_err(|(what, why)| bad(what, why))
    }
}

/// Each range 16-byte aligned, inside `len` bytes, and apart from the others.
pub fn check_ranges(
    ranges: &[(&'static str, usize, usize)],
    len: usize,
) -> std::result::Result<(), (&'static str, String)> {
    for &(name, off, bytes) in ranges {
        if !off.is_multiple_of(16) {
            return Err((name, format!("offset {off} is not 16-byte aligned")));
        }
        if off.checked_add(bytes).is_none_or(|end| end > len) {
            return Err((
                name,
                format!("[{off}, +{bytes}) exceeds the window of {len} bytes"),
            ));
        }
    }
    for (i, a) in ranges.iter().enumerate() {
        for b in &ranges[i + 1..] {
            if a.2 > 0 && b.2 > 0 && a.1 < b.1 + b.2 && b.1 < a.1 + a.2 {
                return Err((a.0, format!("overlaps the {}", b.0)));
            }
        }
    }
    Ok(())
}

/// Launches one GIN all-to-all on the rank's stream (checked first). Every rank must launch
/// the same sequence of them on this device communicator. Returns the window offset of the
/// receive region it fills (`recv_offset`): the kernel's start barrier means no contract on
/// when the caller reads it.
pub fn launch_gin_alltoall(kernels: &Module<'_>, l: &GinAlltoall<'_>) -> Result<usize> {
    let rank = kernels.rank();
    let world = rank.info().world;
    l.check(world)?;
    let (data_base, counter) = l.variant.signals(world as u32);
    let c = l.counts;
    let launches = c.launches.get() + 1;
    let (data_target, node_target, bases, grid) = match l.variant {
        GinVariant::Gin => (c.gin.get() + 1, c.node_arrivals.get(), l.node.zeros.region(), 1),
        GinVariant::Hybrid => (
            c.hybrid.get() + 1,
            c.node_arrivals.get() + u64::from(l.grid),
            l.node.table.region(),
            l.grid,
        ),
    };
    let args = GinAlltoallArgs {
        comm: l.dev_comm.raw(),
        win: l.window.raw(),
        send_offset: l.send_offset,
        recv_offset: l.recv_offset,
        chunk_bytes: l.chunk_bytes,
        node_flag_offset: l.node_flag_offset,
        node_bases: bases.device_ptr(),
        barrier_target: launches,
        data_target,
        node_target,
        timeout_ns: u64::try_from(rank.options().kernel_timeout.as_nanos()).unwrap_or(u64::MAX),
        err: rank.fabric_err_dev(),
        data_base,
        barrier_base: 2 * world as u32,
        counter,
        pad: 0,
    };
    // SAFETY: GinAlltoallArgs is the kernel parameter (generated from abi/alltoall.h, layout
    // asserted by rustc and nvcc); the window, device communicator, node table and IPC
    // mappings outlive the launch (callers wait before dropping them, and leak them after a
    // failure); check() proved every region the kernel touches lies inside the window, and the
    // device communicator has the signals.
    unsafe { kernels.launch(KERNEL, grid, l.block, &args)? };
    c.launches.set(launches);
    match l.variant {
        GinVariant::Gin => c.gin.set(data_target),
        GinVariant::Hybrid => {
            c.hybrid.set(data_target);
            c.node_arrivals.set(node_target);
        }
    }
    Ok(l.recv_offset)
}

/// The copy-engine reference where no peer is reachable by the copy engine (ranks sharing a
/// GPU as separate NCCL nodes: LSA team of 1): one device-to-device copy of the same `bytes`
/// from the send region to the receive region of this rank's own window, on the stream. It
/// is the ceiling a GIN path on the same GPU can reach, not an all-to-all.
pub fn ce_local_copy(
    rank: &CudaRank,
    window: &Window,
    send_offset: usize,
    recv_offset: usize,
    bytes: usize,
) -> Result<()> {
    check_ranges(
        &[
            ("send region", send_offset, bytes),
            ("receive region", recv_offset, bytes),
        ],
        window.len(),
    )
    .map_err(|(what, why)| bad(what, why))?;
    let src = window.region(send_offset, bytes)?;
    let dst = window.region(recv_offset, bytes)?;
    rank.copy_on(None, dst, src)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_tables_hold_the_node_only_and_refuse_holes() {
        let t = node_table(4, 2, 2, 2, 0x1000, &|r| Some(0x10_0000 * r as u64)).unwrap();
        assert_eq!(t, [0, 0, 0x1000, 0x30_0000]);
        // A node of one: only this rank's own window.
        assert_eq!(node_table(2, 1, 1, 1, 0x20, &|_| None).unwrap(), [0, 0x20]);
        // A node rank with no mapping, a misaligned one, a node not holding `me`.
        assert!(node_table(4, 0, 0, 2, 0x1000, &|_| None).is_err());
        assert!(node_table(4, 0, 0, 2, 0x1000, &|_| Some(0x1008)).is_err());
        assert!(node_table(4, 3, 0, 2, 0x1000, &|_| Some(0x2000)).is_err());
        assert!(node_table(4, 3, 2, 3, 0x1000, &|_| Some(0x2000)).is_err());
    }

    #[test]
    fn variants_use_their_own_signals_and_counters_apart_from_the_barrier() {
        let world = 4;
        let (g, gc) = GinVariant::Gin.signals(world);
        let (h, hc) = GinVariant::Hybrid.signals(world);
        let barrier = 2 * world;
        assert_ne!(gc, hc);
        assert!(gc < COUNTERS && hc < COUNTERS);
        // Three disjoint blocks of `world` signals, all below the requested count.
        let mut blocks = [g, h, barrier];
        blocks.sort_unstable();
        assert!(blocks.windows(2).all(|w| w[1] - w[0] >= world));
        assert!(blocks[2] + world <= SIGNALS_PER_RANK * world);
    }

    #[test]
    fn the_kernel_is_an_entry_point_with_the_mirrored_argument_size() {
        let src = include_str!("../../kernels/alltoall.cu");
        assert!(src.contains(&format!(" {KERNEL}(const GinAlltoallArgs a)")));
        // Never NCCL's unbounded waits in it (fabric.cuh's deadline polls only).
        let body = &src[src
            .find("GinAlltoallArgs: abi/alltoall.h")
            .expect("the GIN kernel's section")..];
        for banned in ["waitSignal(", "waitCounter(", "flush(", "ncclGinBarrierSession"] {
            assert!(!body.contains(banned), "{banned}");
        }
    }

    #[test]
    fn ranges_must_be_aligned_inside_and_apart() {
        assert!(check_ranges(&[("a", 0, 64), ("b", 64, 64)], 128).is_ok());
        assert_eq!(check_ranges(&[("a", 8, 16)], 128).unwrap_err().0, "a");
        assert!(check_ranges(&[("a", 0, 64), ("b", 112, 32)], 128)
            .unwrap_err()
            .1
            .contains("exceeds"));
        assert!(check_ranges(&[("a", 0, 64), ("b", 48, 32)], 128)
            .unwrap_err()
            .1
            .contains("overlaps"));
        assert!(check_ranges(&[("a", usize::MAX - 15, 32)], 128).is_err());
        // An empty range overlaps nothing.
        assert!(check_ranges(&[("a", 0, 64), ("b", 32, 0)], 128).is_ok());
    }
}
