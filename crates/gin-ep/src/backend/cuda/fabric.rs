//! How the kernels reach the ranks of this rank's gin-ep node: rank `i`'s copy of a window
//! offset lies at `base + i * stride4g * 4 GiB` (kernels/common/fabric/handle.cuh
//! `Fabric::ptr`), with this rank's index and the node's size beside it. The kernels take all four from their
//! arguments and never from NCCL's team, so the same kernels run over either source:
//! - **LSA**: NCCL's LSA team (the GPUs of one NVLink domain). The host reads every peer's
//!   address of the window once (`ncclGetLsaPointer`, [`lsa_peer_bases`]) and accepts only
//!   NCCL's layout of one base plus a whole number of 4 GiB per peer.
//! - **IPC**: gin-ep's node grouping (`--vnodes`/`--node-size` launches, several NCCL nodes
//!   that share a GPU or an NVLink domain): the node's windows are mapped into this process
//!   with CUDA IPC in that same layout (ipc::map_node_windows_strided).
//!
//! Ranks outside the node are reached over GIN (LL, and HT across nodes); the node is always
//! a run of consecutive world ranks, `[first, first + size)`.
//!
//! Owns: choosing the source from the launch topology and producing (base, stride, rank,
//! size, first). Never: launches kernels or decides the window's layout.

use super::ipc::{map_node_windows_strided, StridedNodeWindows};
use super::kernels::{names, LsaPointerArgs};
#[cfg(feature = "harness")]
use super::runtime::memory::region;
#[cfg(feature = "harness")]
use super::runtime::DeviceRegion;
use super::runtime::{CudaRank, DevComm, Window};
use crate::error::{Error, Result};
use crate::group::vnodes::RankTopology;

/// Where the peers of this rank's node are, for the kernels' arguments.
pub struct NodeFabric {
    /// Node rank 0's window in this process.
    pub base: u64,
    /// Distance between two node ranks' windows, in 4 GiB units.
    pub stride4g: u32,
    /// This rank's index in its node.
    pub rank: u32,
    /// Ranks in the node.
    pub size: u32,
    /// World rank of node rank 0.
    pub first: u32,
    /// Which source gave them.
    pub source: FabricSource,
    /// The IPC mappings, kept alive for as long as the kernels may use them.
    _ipc: Option<StridedNodeWindows>,
}

/// How the node's windows are reached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FabricSource {
    /// NCCL's LSA team.
    Lsa,
    /// gin-ep's node grouping, windows mapped with CUDA IPC.
    Ipc,
}

impl FabricSource {
    pub fn name(self) -> &'static str {
        match self {
            FabricSource::Lsa => "NVLink (NCCL LSA)",
            FabricSource::Ipc => "gin-ep node (CUDA IPC)",
        }
    }
}

/// Which ranks form this rank's node, decided before any window exists (alike on every rank,
/// from the launch topology and NCCL's LSA team `(lsa_rank, lsa_size)`): its source, first
/// world rank and size.
pub fn node_span(
    topo: &RankTopology,
    me: usize,
    world: usize,
    lsa: (usize, usize),
) -> (FabricSource, usize, usize) {
    let (lsa_rank, lsa_size) = lsa;
    if topo.vnodes <= 1 && topo.node_size.is_none() {
        // NCCL's LSA team is a run of consecutive ranks (shared/GIN.md 1.5).
        (FabricSource::Lsa, me - lsa_rank.min(me), lsa_size)
    } else {
        let (first, size) = topo.node_of(me, world, lsa_size);
        (FabricSource::Ipc, first, size)
    }
}

impl NodeFabric {
    /// The node of this rank as the launch described it (`topo`): NCCL's LSA team for a
    /// one-process-per-GPU launch, else the gin-ep node `topo` names. Collective over the
    /// node (the IPC source exchanges window handles). `whole`: refused unless the node holds
    /// every rank (the one-node HT kernels reach their peers by load/store only); `what` names
    /// the operation for errors.
    pub fn new(
        rank: &CudaRank,
        window: &Window,
        dev_comm: &DevComm,
        topo: &RankTopology,
        what: &str,
        whole: bool,
    ) -> Result<NodeFabric> {
        let (me, world) = (rank.info().rank, rank.info().world);
        let (lsa_rank, lsa_size) = dev_comm.lsa();
        let (source, first, size) = node_span(topo, me, world, (lsa_rank, lsa_size));
        // Every rank decides this alike from the same topology, so all refuse before any
        // collective exchange.
        if whole && size != world {
            return Err(Error::Unavailable {
                backend: "cuda",
                reason: format!(
                    "{what} reaches its peers by load/store only: this rank's node ({}) has \
                     {size} of {world} ranks; use a node of every rank (one process per GPU on \
                     one NVLink host, or --node-size {world})",
                    source.name()
                ),
            });
        }
        if source == FabricSource::Lsa {
            let (base, stride4g) = lsa_base_stride(lsa_peer_bases(rank, window, dev_comm)?)?;
            return Ok(NodeFabric {
                base,
                stride4g,
                rank: lsa_rank as u32,
                size: lsa_size as u32,
                first: first as u32,
                source,
                _ipc: None,
            });
        }
        let ipc = map_node_windows_strided(rank, window, first, size)?;
        let (base, stride4g) = ipc.base_stride4g();
        Ok(NodeFabric {
            base,
            stride4g,
            rank: (me - first) as u32,
            size: size as u32,
            first: first as u32,
            source: FabricSource::Ipc,
            _ipc: Some(ipc),
        })
    }
}

/// The window's base and stride in 4 GiB units from every peer's address of it (index:
/// node rank), as the kernels compute a peer's copy (`add4G(base, peer * stride4G)`):
/// refused unless every peer lies at exactly that address.
pub fn lsa_base_stride(bases: &[u64]) -> Result<(u64, u32)> {
    let base = *bases.first().ok_or_else(|| Error::Device {
        call: "ncclGetLsaPointer".into(),
        reason: "no LSA peer address".into(),
    })?;
    let step = bases.get(1).map_or(0, |b| b.wrapping_sub(base));
    let stride4g = u32::try_from(step >> 32).ok().filter(|_| step & 0xffff_ffff == 0);
    let fits = |s: u32| u64::from(s) * bases.len() as u64 <= i32::MAX as u64;
    match stride4g.filter(|&s| fits(s)) {
        Some(s)
            if bases
                .iter()
                .enumerate()
                .all(|(p, &b)| b == base.wrapping_add((p as u64 * u64::from(s)) << 32)) =>
        {
            Ok((base, s))
        }
        _ => Err(Error::Device {
            call: "ncclGetLsaPointer".into(),
            reason: format!(
                "LSA peer addresses {bases:#x?} are not one base plus a whole number of 4 GiB per peer \
                 (the layout the kernels address peers by)"
            ),
        }),
    }
}

/// Bytes `[offset, offset + bytes)` of LSA peer `peer`'s copy of `window`, as mapped in this
/// process ([`lsa_peer_bases`]), for a copy the host queues into a peer. Windows are
/// symmetric (the same size on every rank), so the range is checked against this rank's
/// window; the region borrows the window, whose registration keeps the mapping.
#[cfg(feature = "harness")]
pub fn lsa_peer_region<'w>(
    rank: &CudaRank,
    window: &'w Window,
    dev_comm: &DevComm,
    peer: usize,
    offset: usize,
    bytes: usize,
) -> Result<DeviceRegion<'w>> {
    let bases = lsa_peer_bases(rank, window, dev_comm)?;
    let base = *bases
        .get(peer)
        .ok_or_else(|| Error::input("LSA peer", format!("{peer} of an LSA team of {}", bases.len())))?;
    region(base, window.len(), offset, bytes)
}

/// Every LSA peer's address of `window` in this process (index: LSA rank), for copies the
/// host queues: asked from the device once per window (a kernel reads ncclGetLsaPointer at
/// offset 0; NCCL maps each peer's window contiguously, so offset o of peer p is
/// `bases[p] + o`), then cached in the window. The first call waits (bounded).
pub fn lsa_peer_bases<'w>(rank: &CudaRank, window: &'w Window, dev_comm: &DevComm) -> Result<&'w [u64]> {
    window.lsa_bases(|| {
        let (_, n) = dev_comm.lsa();
        let out = rank.alloc(n.max(1) * 8)?;
        let args = LsaPointerArgs {
            win: window.raw(),
            out: out.region().ptr,
            n: u32::try_from(n).map_err(|_| Error::input("LSA team", format!("{n} ranks")))?,
            pad: 0,
        };
        // SAFETY: LsaPointerArgs is the kernel parameter (generated, layout asserted);
        // the window is live and `out` holds n u64 until the download below has waited.
        unsafe { rank.own().launch(names::LSA_POINTERS, 1, 32, &args)? };
        let mut raw = vec![0u8; n * 8];
        rank.download(out.region().sub(0, n * 8)?, &mut raw)?;
        let bases: Vec<u64> = raw
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
            .collect();
        // A null or repeated address would send copies astray: refuse instead.
        for (p, &b) in bases.iter().enumerate() {
            if b == 0 || bases[..p].contains(&b) {
                return Err(Error::Device {
                    call: "ncclGetLsaPointer".into(),
                    reason: format!("LSA peer {p}'s window address {b:#x} is null or repeated"),
                });
            }
        }
        Ok(bases)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lsa_base_stride_accepts_only_evenly_spaced_peers() {
        let g = 1u64 << 32;
        let base = 0x7f00_0000_0000u64;
        assert_eq!(
            lsa_base_stride(&[base, base + 2 * g, base + 4 * g]).unwrap(),
            (base, 2)
        );
        assert_eq!(lsa_base_stride(&[base]).unwrap(), (base, 0));
        for bad in [
            vec![],
            vec![base, base + 2 * g, base + 5 * g], // uneven
            vec![base, base + g + 4096],            // not whole 4 GiB
            vec![base, base - g],                   // below the base
            vec![base, base + (1u64 << 31) * g],    // peer * stride4G overflows an int
        ] {
            let e = lsa_base_stride(&bad).unwrap_err().to_string();
            assert!(e.contains("LSA peer"), "{bad:x?}: {e}");
        }
    }
}
