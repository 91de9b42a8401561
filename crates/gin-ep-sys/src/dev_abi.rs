//! NCCL Device API types, mirrored once per supported minor release (2.28 to 2.32).
//!
//! Owns: the `#[repr(C)]` mirrors of `ncclDevComm`, `ncclDevCommRequirements` and
//! `ncclWindow_vidmem` for each [`DevAbi`], the fixed-size [`DevCommSlot`] that carries a
//! device communicator of any of them into kernel arguments, and the plain copy of gin-ep's
//! version-neutral [`DevCommRequirements`] into the loaded version's struct. Never: decides
//! which NCCL is supported for running kernels (gin-ep's backend does, from the kernels it
//! embeds) or calls NCCL.
//!
//! Why per version: these structs change between minors (2.29 adds size/magic/version to
//! the requirements, 2.30 puts magic/version in front of `ncclDevComm`, shifting every field,
//! 2.31 reshapes its GIN fields and appends CFT ones, 2.32 grows `ncclWindow_vidmem`) and patch
//! releases of 2.28/2.29 changed them too (2.28.3 had no GIN fields; 2.29.2/2.29.3
//! differ from 2.29.7). Layouts: build.rs compiles a probe against each header set it finds
//! and asserts every size and offset below; the fixed assertions at the end pin the measured
//! values where no headers are installed.

use std::ffi::{c_char, c_int, c_void};
use std::fmt;

/// `ncclTeam`: a strided subset of ranks (the same in every supported version).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ncclTeam {
    pub nRanks: c_int,
    pub rank: c_int,
    pub stride: c_int,
}

pub type ncclDevResourceHandle_t = u32;
pub type ncclGinSignal_t = u32;
pub type ncclGinCounter_t = u32;
pub type ncclGinWindow_t = *mut c_void;

/// `NCCL_GIN_MAX_CONTEXTS` (2.28) / `NCCL_GIN_MAX_CONNECTIONS` (2.29 to 2.32).
pub const NCCL_GIN_MAX_CONTEXTS: usize = 4;

/// `NCCL_NET_DEVICE_GIN_EFA_GDA` (`ncclNetDeviceType`, 2.31+): AWS EFA's GPU-direct GIN
/// backend, which gin-ep's kernels are compiled without (kernels/common/nccl_compat.cuh).
pub const NCCL_NET_DEVICE_GIN_EFA_GDA: u8 = 5;

/// `NCCL_API_MAGIC` (nccl.h 2.29+): the requirements struct must carry it.
pub const NCCL_API_MAGIC: u32 = 0xcafe_beef;

/// `struct ncclWindow_vidmem`, opaque: host code only passes `ncclWindow_t` pointers, and its
/// layout differs by version (see `v2_28::ncclWindow_vidmem` and the others).
#[repr(C)]
pub struct ncclWindow_vidmem {
    _opaque: [u8; 0],
}
pub type ncclWindow_t = *mut ncclWindow_vidmem;

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ncclMultimemHandle {
    pub mcBasePtr: *mut c_void,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ncclLsaBarrierHandle {
    pub bufHandle: ncclDevResourceHandle_t,
    pub nBarriers: c_int,
}

/// `struct ncclGinBarrierHandle`; the second word is `bufHandle` in 2.28 and `unused` from
/// 2.29 on.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ncclGinBarrierHandle {
    pub signal0: ncclGinSignal_t,
    pub bufHandle: ncclDevResourceHandle_t,
}

/// Opaque window table (`struct ncclDevCommWindowTable`, device memory).
#[repr(C)]
pub struct ncclDevCommWindowTable {
    _opaque: [u8; 0],
}

/// `struct ncclDevResourceRequirements` (the same in every supported version): a linked
/// list node asking for extra symmetric memory or GIN signals/counters.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ncclDevResourceRequirements {
    pub next: *mut ncclDevResourceRequirements,
    pub bufferSize: usize,
    pub bufferAlign: usize,
    pub outBufferHandle: *mut ncclDevResourceHandle_t,
    pub ginSignalCount: c_int,
    pub ginCounterCount: c_int,
    pub outGinSignalStart: *mut ncclGinSignal_t,
    pub outGinCounterStart: *mut ncclGinCounter_t,
}

/// `struct ncclTeamRequirements` (the same in every supported version).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ncclTeamRequirements {
    pub next: *mut ncclTeamRequirements,
    pub team: ncclTeam,
    pub multimem: bool,
    pub outMultimemHandle: *mut ncclMultimemHandle,
}

/// NCCL 2.28.7 - 2.28.x (measured with 2.28.9's headers; 2.28.7 declares the same).
pub mod v2_28 {
    use super::*;

    #[repr(C)]
    #[derive(Clone, Copy, Debug)]
    pub struct ncclWindow_vidmem {
        pub winHost: *mut c_void,
        pub lsaFlatBase: *mut c_char,
        pub lsaRank: c_int,
        pub worldRank: c_int,
        pub stride4G: u32,
        pub mcOffset4K: u32,
        pub ginOffset4K: u32,
        pub ginWins: [ncclGinWindow_t; NCCL_GIN_MAX_CONTEXTS],
    }

    #[repr(C)]
    #[derive(Clone, Copy, Debug)]
    pub struct ncclDevComm {
        pub rank: c_int,
        pub nRanks: c_int,
        pub nRanks_rcp32: u32,
        pub lsaRank: c_int,
        pub lsaSize: c_int,
        pub lsaSize_rcp32: u32,
        pub windowTable: *mut ncclDevCommWindowTable,
        pub resourceWindow: super::ncclWindow_t,
        pub resourceWindow_inlined: ncclWindow_vidmem,
        pub lsaMultimem: ncclMultimemHandle,
        pub lsaBarrier: ncclLsaBarrierHandle,
        pub railGinBarrier: ncclGinBarrierHandle,
        pub ginContextCount: u8,
        pub ginTypes: [u8; 4],
        pub ginHandles: [*mut c_void; 4],
        pub ginSignalBase: u32,
        pub ginSignalCount: c_int,
        pub ginCounterBase: u32,
        pub ginCounterCount: c_int,
        pub ginSignalShadows: *mut u64,
    }

    /// Zero means "none" for every field; there is no initializer macro in 2.28.
    #[repr(C)]
    #[derive(Clone, Copy, Debug)]
    pub struct ncclDevCommRequirements {
        pub resourceRequirementsList: *mut ncclDevResourceRequirements,
        pub teamRequirementsList: *mut ncclTeamRequirements,
        pub lsaMultimem: bool,
        pub barrierCount: c_int,
        pub lsaBarrierCount: c_int,
        pub railGinBarrierCount: c_int,
        pub lsaLLA2ABlockCount: c_int,
        pub lsaLLA2ASlotCount: c_int,
        pub ginForceEnable: bool,
        pub ginContextCount: c_int,
        pub ginSignalCount: c_int,
        pub ginCounterCount: c_int,
    }
}

/// NCCL 2.29.5 - 2.29.x (measured with 2.29.7's headers; NCCL's own compatibility table
/// gives 2.29.5-2.29.7 one layout, 2.29.2-2.29.3 another, which gin-ep does not mirror).
pub mod v2_29 {
    use super::*;

    pub use super::v2_28::ncclWindow_vidmem;

    /// `ncclGinConnectionType_t`.
    pub type ncclGinConnectionType_t = c_int;
    pub const NCCL_GIN_CONNECTION_NONE: ncclGinConnectionType_t = 0;
    pub const NCCL_GIN_CONNECTION_FULL: ncclGinConnectionType_t = 1;
    pub const NCCL_GIN_CONNECTION_RAIL: ncclGinConnectionType_t = 2;

    #[repr(C)]
    #[derive(Clone, Copy, Debug)]
    pub struct ncclDevComm {
        pub rank: c_int,
        pub nRanks: c_int,
        pub nRanks_rcp32: u32,
        pub lsaRank: c_int,
        pub lsaSize: c_int,
        pub lsaSize_rcp32: u32,
        pub windowTable: *mut ncclDevCommWindowTable,
        pub resourceWindow: super::ncclWindow_t,
        pub resourceWindow_inlined: ncclWindow_vidmem,
        pub lsaMultimem: ncclMultimemHandle,
        pub lsaBarrier: ncclLsaBarrierHandle,
        pub railGinBarrier: ncclGinBarrierHandle,
        pub ginConnectionCount: u8,
        pub ginNetDeviceTypes: [u8; NCCL_GIN_MAX_CONTEXTS],
        pub ginHandles: [*mut c_void; NCCL_GIN_MAX_CONTEXTS],
        pub ginSignalBase: u32,
        pub ginSignalCount: c_int,
        pub ginCounterBase: u32,
        pub ginCounterCount: c_int,
        pub ginSignalShadows: *mut u64,
        pub ginContextCount: u32,
        pub ginContextBase: u32,
        pub ginIsRailed: bool,
        pub abortFlag: *mut u32,
    }

    /// Must start as `NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER` makes it (size, magic, the
    /// header version, ginContextCount 4): [`DevCommRequirements::to_v2_29`].
    #[repr(C)]
    #[derive(Clone, Copy, Debug)]
    pub struct ncclDevCommRequirements {
        pub size: usize,
        pub magic: u32,
        pub version: u32,
        pub resourceRequirementsList: *mut ncclDevResourceRequirements,
        pub teamRequirementsList: *mut ncclTeamRequirements,
        pub lsaMultimem: bool,
        pub barrierCount: c_int,
        pub lsaBarrierCount: c_int,
        pub railGinBarrierCount: c_int,
        pub lsaLLA2ABlockCount: c_int,
        pub lsaLLA2ASlotCount: c_int,
        pub ginForceEnable: bool,
        pub ginContextCount: c_int,
        pub ginSignalCount: c_int,
        pub ginCounterCount: c_int,
        pub ginConnectionType: ncclGinConnectionType_t,
        pub ginExclusiveContexts: bool,
        pub ginQueueDepth: c_int,
    }
}

/// NCCL 2.30.7 - 2.30.x (measured with 2.30.7's headers; 2.30.3 declares another
/// `ncclDevComm`).
pub mod v2_30 {
    use super::*;

    pub use super::v2_29::{
        ncclGinConnectionType_t, NCCL_GIN_CONNECTION_FULL, NCCL_GIN_CONNECTION_NONE, NCCL_GIN_CONNECTION_RAIL,
    };

    /// `NCCL_CONFIG_UNDEF_INT` (INT_MIN): "not set" for ginTrafficClass.
    pub const NCCL_CONFIG_UNDEF_INT: c_int = c_int::MIN;

    #[repr(C)]
    #[derive(Clone, Copy, Debug)]
    pub struct ncclWindow_vidmem {
        pub winHost: *mut c_void,
        pub lsaFlatBase: *mut c_char,
        pub lsaRank: c_int,
        pub worldRank: c_int,
        pub stride4G: u32,
        pub mcOffset4K: u32,
        pub ginOffset4K: u32,
        pub ginWins: [ncclGinWindow_t; NCCL_GIN_MAX_CONTEXTS],
        pub ginMultiSegmentWins: *mut c_void,
        pub numSegments: c_int,
    }

    /// `ncclResourceWindow_vidmem_t`, the devcomm's inlined copy of its resource window.
    #[repr(C)]
    #[derive(Clone, Copy, Debug)]
    pub struct ncclResourceWindow_vidmem {
        pub reserved1: [c_char; 8],
        pub lsaFlatBase: *mut c_char,
        pub reserved2: [c_char; 8],
        pub stride4G: u32,
        pub mcOffset4K: u32,
        pub reserved3: [c_char; 32],
    }

    #[repr(C)]
    #[derive(Clone, Copy, Debug)]
    pub struct ncclDevComm {
        pub magic: u32,
        pub version: u32,
        pub rank: c_int,
        pub nRanks: c_int,
        pub nRanks_rcp32: u32,
        pub lsaRank: c_int,
        pub lsaSize: c_int,
        pub lsaSize_rcp32: u32,
        pub windowTable: *mut ncclDevCommWindowTable,
        pub resourceWindow: super::ncclWindow_t,
        pub resourceWindow_inlined: ncclResourceWindow_vidmem,
        pub hybridWorldGinBarrier: ncclGinBarrierHandle,
        pub lsaMultimem: ncclMultimemHandle,
        pub lsaBarrier: ncclLsaBarrierHandle,
        pub railGinBarrier: ncclGinBarrierHandle,
        pub ginConnectionCount: u8,
        pub ginNetDeviceTypes: [u8; NCCL_GIN_MAX_CONTEXTS],
        pub ginHandles: [*mut c_void; NCCL_GIN_MAX_CONTEXTS],
        pub ginSignalCount: c_int,
        pub ginCounterCount: c_int,
        pub ginSignalShadows: *mut u64,
        pub ginContextCount: u32,
        pub ginConnectionsRailed: bool,
        pub ginStrongLegacySignals: bool,
        pub ginContextsRailed: bool,
        pub abortFlag: *mut u32,
        pub hybridLsaBarrier: ncclLsaBarrierHandle,
        pub hybridRailGinBarrier: ncclGinBarrierHandle,
        pub worldGinBarrier: ncclGinBarrierHandle,
    }

    /// Must start as `NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER` makes it:
    /// [`DevCommRequirements::to_v2_30`].
    #[repr(C)]
    #[derive(Clone, Copy, Debug)]
    pub struct ncclDevCommRequirements {
        pub size: usize,
        pub magic: u32,
        pub version: u32,
        pub resourceRequirementsList: *mut ncclDevResourceRequirements,
        pub teamRequirementsList: *mut ncclTeamRequirements,
        pub lsaMultimem: bool,
        pub barrierCount: c_int,
        pub lsaBarrierCount: c_int,
        pub railGinBarrierCount: c_int,
        pub lsaLLA2ABlockCount: c_int,
        pub lsaLLA2ASlotCount: c_int,
        pub ginForceEnable: bool,
        pub ginContextCount: c_int,
        pub ginSignalCount: c_int,
        pub ginCounterCount: c_int,
        pub ginConnectionType: ncclGinConnectionType_t,
        pub ginExclusiveContexts: bool,
        pub ginQueueDepth: c_int,
        pub ginTrafficClass: c_int,
        pub worldGinBarrierCount: c_int,
        pub ginStrongSignalsRequired: bool,
        pub ginVaSignalsRequired: bool,
    }
}

/// NCCL 2.31.2 - 2.31.x (measured with 2.31.2, the first 2.31 release on PyPI): the resource
/// window shrinks to its three used fields, the GIN connection flags become strides, a backend
/// index and the CFT fields (`ncclCft`, nccl_device/cft.h) are appended.
pub mod v2_31 {
    use super::*;

    pub use super::v2_29::{
        ncclGinConnectionType_t, NCCL_GIN_CONNECTION_FULL, NCCL_GIN_CONNECTION_NONE, NCCL_GIN_CONNECTION_RAIL,
    };
    pub use super::v2_30::NCCL_CONFIG_UNDEF_INT;

    /// `ncclGinType_t`; `NCCL_GIN_TYPE_NONE` lets NCCL pick any backend.
    pub type ncclGinType_t = c_int;
    pub const NCCL_GIN_TYPE_NONE: ncclGinType_t = 0;
    /// `NCCL_CFT_NONE` (`ncclCftCap_t`): no CFT capabilities asked for.
    pub const NCCL_CFT_NONE: c_int = 0;

    /// `ncclCftLeId` (a logical endpoint id).
    pub type ncclCftLeId = u32;

    /// `struct ncclCftBarrierHandle`.
    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default)]
    pub struct ncclCftBarrierHandle {
        pub bufHandle: ncclDevResourceHandle_t,
        pub nBarriers: c_int,
    }

    #[repr(C)]
    #[derive(Clone, Copy, Debug)]
    pub struct ncclWindow_vidmem {
        pub winHost: *mut c_void,
        pub lsaFlatBase: *mut c_char,
        pub lsaRank: c_int,
        pub worldRank: c_int,
        pub stride4G: u32,
        pub mcOffset4K: u32,
        pub ginOffset4K: u32,
        pub ginWinsDefaultBackend: [ncclGinWindow_t; NCCL_GIN_MAX_CONTEXTS],
        pub ginMultiSegmentWins: *mut c_void,
        pub numSegments: c_int,
        pub cftFlatRank: c_int,
    }

    /// `ncclResourceWindow_vidmem_t`: from 2.31 only the fields resource addressing reads.
    #[repr(C)]
    #[derive(Clone, Copy, Debug)]
    pub struct ncclResourceWindow_vidmem {
        pub lsaFlatBase: *mut c_char,
        pub stride4G: u32,
        pub mcOffset4K: u32,
    }

    #[repr(C)]
    #[derive(Clone, Copy, Debug)]
    pub struct ncclDevComm {
        pub magic: u32,
        pub version: u32,
        pub rank: c_int,
        pub nRanks: c_int,
        pub nRanks_rcp32: u32,
        pub lsaRank: c_int,
        pub lsaSize: c_int,
        pub lsaSize_rcp32: u32,
        pub windowTable: *mut ncclDevCommWindowTable,
        pub resourceWindow: super::ncclWindow_t,
        pub resourceWindow_inlined: ncclResourceWindow_vidmem,
        pub hybridDenseGinBarrier: ncclGinBarrierHandle,
        pub lsaMultimem: ncclMultimemHandle,
        pub lsaBarrier: ncclLsaBarrierHandle,
        pub railGinBarrier: ncclGinBarrierHandle,
        pub ginConnectionCount: u8,
        pub backendIndex: u8,
        pub ginNetDeviceTypes: [u8; NCCL_GIN_MAX_CONTEXTS],
        pub ginHandles: [*mut c_void; NCCL_GIN_MAX_CONTEXTS],
        pub ginSignalCount: c_int,
        pub ginCounterCount: c_int,
        pub ginSignalShadows: *mut u64,
        pub ginContextCount: u32,
        pub ginConnectionStride: c_int,
        pub ginContextStride: c_int,
        pub ginStrongLegacySignals: bool,
        pub abortFlag: *mut u32,
        pub hybridLsaBarrier: ncclLsaBarrierHandle,
        pub hybridRailGinBarrier: ncclGinBarrierHandle,
        pub worldGinBarrier: ncclGinBarrierHandle,
        pub ginConnectionStride_rcp32: u32,
        pub cftRank: c_int,
        pub cftSize: c_int,
        pub cftMultimemRank: c_int,
        pub cftMultimemSize: c_int,
        pub cftMultimemSize_rcp32: u32,
        pub ucLeId: ncclCftLeId,
        pub mcLeId: ncclCftLeId,
        pub cftBarrier: ncclCftBarrierHandle,
        pub cftMultimemBarrier: ncclCftBarrierHandle,
    }

    /// Must start as `NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER` makes it:
    /// [`DevCommRequirements::to_v2_31`]. `useRuntimeVersion` stays false: it tells NCCL the
    /// device code was compiled against the library's own headers (JIT) and makes it write the
    /// library's `ncclDevComm`; gin-ep's kernels are compiled ahead of time per header set, so
    /// NCCL must write the layout of the set's `version` instead (docs/nccl.md).
    #[repr(C)]
    #[derive(Clone, Copy, Debug)]
    pub struct ncclDevCommRequirements {
        pub size: usize,
        pub magic: u32,
        pub version: u32,
        pub resourceRequirementsList: *mut ncclDevResourceRequirements,
        pub teamRequirementsList: *mut ncclTeamRequirements,
        pub lsaMultimem: bool,
        pub barrierCount: c_int,
        pub lsaBarrierCount: c_int,
        pub railGinBarrierCount: c_int,
        pub lsaLLA2ABlockCount: c_int,
        pub lsaLLA2ASlotCount: c_int,
        pub ginForceEnable: bool,
        pub ginContextCount: c_int,
        pub ginSignalCount: c_int,
        pub ginCounterCount: c_int,
        pub ginConnectionType: ncclGinConnectionType_t,
        pub ginExclusiveContexts: bool,
        pub ginQueueDepth: c_int,
        pub ginTrafficClass: c_int,
        pub worldGinBarrierCount: c_int,
        pub ginStrongSignalsRequired: bool,
        pub ginVaSignalsRequired: bool,
        pub ginCustomStride: c_int,
        pub ginType: ncclGinType_t,
        pub useRuntimeVersion: bool,
        pub cftCaps: c_int,
        pub cftBarrierCount: c_int,
    }
}

/// NCCL 2.32.3 - 2.32.x (measured with 2.32.3, the first 2.32 release on PyPI): `ncclDevComm`
/// and the requirements are 2.31's; `ncclWindow_vidmem` gains `winFlags` (in 2.31's padding)
/// and `ucLeIdBase`.
pub mod v2_32 {
    use super::*;

    pub use super::v2_31::{ncclDevComm, ncclDevCommRequirements, ncclResourceWindow_vidmem};

    #[repr(C)]
    #[derive(Clone, Copy, Debug)]
    pub struct ncclWindow_vidmem {
        pub winHost: *mut c_void,
        pub lsaFlatBase: *mut c_char,
        pub lsaRank: c_int,
        pub worldRank: c_int,
        pub stride4G: u32,
        pub mcOffset4K: u32,
        pub ginOffset4K: u32,
        pub winFlags: u32,
        pub ginWinsDefaultBackend: [ncclGinWindow_t; NCCL_GIN_MAX_CONTEXTS],
        pub ginMultiSegmentWins: *mut c_void,
        pub numSegments: c_int,
        pub cftFlatRank: c_int,
        pub ucLeIdBase: v2_31::ncclCftLeId,
    }
}

/// One supported device-API ABI: the minor release whose headers the kernels and these
/// mirrors were built against.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DevAbi {
    V2_28,
    V2_29,
    V2_30,
    V2_31,
    V2_32,
}

impl DevAbi {
    /// Every mirrored ABI, oldest first.
    pub const ALL: [DevAbi; 5] = [
        DevAbi::V2_28,
        DevAbi::V2_29,
        DevAbi::V2_30,
        DevAbi::V2_31,
        DevAbi::V2_32,
    ];

    /// The newest mirrored ABI: a library of a later minor is refused naming the range.
    pub const NEWEST: DevAbi = DevAbi::V2_32;

    /// NCCL_VERSION_CODE of the headers mirrored (and the kernels built against).
    pub const fn headers(self) -> i32 {
        match self {
            DevAbi::V2_28 => 22809,
            DevAbi::V2_29 => 22907,
            DevAbi::V2_30 => 23007,
            DevAbi::V2_31 => 23102,
            DevAbi::V2_32 => 23203,
        }
    }

    /// The oldest library this ABI serves. 2.28: 2.28.7 has 2.28.9's layout and 2.28.3 not.
    /// 2.29 to 2.32: the header version itself, because NCCL refuses requirements whose
    /// `version` is newer than the library ("NCCL library is too old"). 2.31.2 and 2.32.3 are
    /// also the first releases of their minors on PyPI.
    pub const fn min_library(self) -> i32 {
        match self {
            DevAbi::V2_28 => 22807,
            DevAbi::V2_29 => 22907,
            DevAbi::V2_30 => 23007,
            DevAbi::V2_31 => 23102,
            DevAbi::V2_32 => 23203,
        }
    }

    /// The ABI of a library reporting `version` (ncclGetVersion): the same major.minor and
    /// a patch from [`DevAbi::min_library`] on. `None`: not mirrored.
    pub fn for_library(version: i32) -> Option<DevAbi> {
        Self::ALL
            .into_iter()
            .find(|abi| version / 100 == abi.headers() / 100 && version >= abi.min_library())
    }

    /// sizeof(ncclDevComm) of this version.
    pub const fn dev_comm_bytes(self) -> usize {
        match self {
            DevAbi::V2_28 => std::mem::size_of::<v2_28::ncclDevComm>(),
            DevAbi::V2_29 => std::mem::size_of::<v2_29::ncclDevComm>(),
            DevAbi::V2_30 => std::mem::size_of::<v2_30::ncclDevComm>(),
            DevAbi::V2_31 => std::mem::size_of::<v2_31::ncclDevComm>(),
            DevAbi::V2_32 => std::mem::size_of::<v2_32::ncclDevComm>(),
        }
    }

    /// (lsaRank, lsaSize) of a devcomm `ncclDevCommCreate` of this version filled.
    pub fn lsa(self, slot: &DevCommSlot) -> (c_int, c_int) {
        // SAFETY: the slot is 8-aligned and larger than every mirrored ncclDevComm (checked
        // at compile time below); every field is an integer, array or pointer, valid for any
        // bytes, so reading it as the caller's version is sound whatever NCCL wrote.
        unsafe {
            match self {
                DevAbi::V2_28 => {
                    let c = &*(slot.bytes.as_ptr() as *const v2_28::ncclDevComm);
                    (c.lsaRank, c.lsaSize)
                }
                DevAbi::V2_29 => {
                    let c = &*(slot.bytes.as_ptr() as *const v2_29::ncclDevComm);
                    (c.lsaRank, c.lsaSize)
                }
                DevAbi::V2_30 => {
                    let c = &*(slot.bytes.as_ptr() as *const v2_30::ncclDevComm);
                    (c.lsaRank, c.lsaSize)
                }
                DevAbi::V2_31 | DevAbi::V2_32 => {
                    let c = &*(slot.bytes.as_ptr() as *const v2_31::ncclDevComm);
                    (c.lsaRank, c.lsaSize)
                }
            }
        }
    }

    /// The GIN backend (`ncclNetDeviceType`) of each GIN connection of a devcomm this
    /// version's `ncclDevCommCreate` filled; empty without GIN.
    pub fn gin_backends(self, slot: &DevCommSlot) -> Vec<u8> {
        // SAFETY: as in `lsa`: an 8-aligned slot larger than every mirror, plain-data fields.
        let (types, count) = unsafe {
            match self {
                DevAbi::V2_28 => {
                    let c = &*(slot.bytes.as_ptr() as *const v2_28::ncclDevComm);
                    (c.ginTypes, c.ginContextCount as usize)
                }
                DevAbi::V2_29 => {
                    let c = &*(slot.bytes.as_ptr() as *const v2_29::ncclDevComm);
                    (c.ginNetDeviceTypes, c.ginConnectionCount as usize)
                }
                DevAbi::V2_30 => {
                    let c = &*(slot.bytes.as_ptr() as *const v2_30::ncclDevComm);
                    (c.ginNetDeviceTypes, c.ginConnectionCount as usize)
                }
                DevAbi::V2_31 | DevAbi::V2_32 => {
                    let c = &*(slot.bytes.as_ptr() as *const v2_31::ncclDevComm);
                    (c.ginNetDeviceTypes, c.ginConnectionCount as usize)
                }
            }
        };
        types[..count.min(NCCL_GIN_MAX_CONTEXTS)].to_vec()
    }

    /// `requirements` as this version's `ncclDevCommRequirements`.
    pub fn requirements(self, r: &DevCommRequirements) -> DevCommRequirementsC {
        match self {
            DevAbi::V2_28 => DevCommRequirementsC::V2_28(r.to_v2_28()),
            DevAbi::V2_29 => DevCommRequirementsC::V2_29(r.to_v2_29()),
            DevAbi::V2_30 => DevCommRequirementsC::V2_30(r.to_v2_30()),
            DevAbi::V2_31 | DevAbi::V2_32 => DevCommRequirementsC::V2_31(r.to_v2_31(self)),
        }
    }
}

impl fmt::Display for DevAbi {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let v = self.headers();
        write!(f, "{}.{}", v / 10000, v / 100 % 100)
    }
}

/// Bytes reserved for `ncclDevComm` at the start of every kernel argument struct;
/// `kDevCommSlotBytes` in kernels/common/nccl_compat.cuh (change both together).
pub const DEV_COMM_SLOT_BYTES: usize = 384;

/// An `ncclDevComm` of any supported version, as kernels take it by value: a fixed size so
/// the argument structs after it have one layout whatever NCCL is loaded.
#[repr(C, align(8))]
#[derive(Clone, Copy)]
pub struct DevCommSlot {
    pub bytes: [u8; DEV_COMM_SLOT_BYTES],
}

impl DevCommSlot {
    /// All zero: the state NCCL expects to overwrite in `ncclDevCommCreate`.
    pub const fn zeroed() -> Self {
        DevCommSlot {
            bytes: [0; DEV_COMM_SLOT_BYTES],
        }
    }
}

impl fmt::Debug for DevCommSlot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("DevCommSlot { .. }")
    }
}

/// What gin-ep asks of `ncclDevCommCreate`, in the words every supported version shares
/// (field names as in NCCL). [`DevAbi::requirements`] copies it into the loaded version's
/// struct with that version's defaults for everything else.
#[derive(Clone, Copy, Debug)]
pub struct DevCommRequirements {
    pub resourceRequirementsList: *mut ncclDevResourceRequirements,
    pub teamRequirementsList: *mut ncclTeamRequirements,
    pub lsaMultimem: bool,
    pub barrierCount: c_int,
    pub lsaBarrierCount: c_int,
    pub railGinBarrierCount: c_int,
    pub lsaLLA2ABlockCount: c_int,
    pub lsaLLA2ASlotCount: c_int,
    /// GIN on. Asking for GIN where the network has none crashes NCCL 2.28.9
    /// (shared/ANCHORS.md): callers must check for a GIN-capable network first. From 2.29
    /// on it also selects `NCCL_GIN_CONNECTION_FULL`, which 2.30 defaults it to.
    pub ginForceEnable: bool,
    /// A hint: 2.28.9 ignores it; 2.29+ default to 4.
    pub ginContextCount: c_int,
    pub ginSignalCount: c_int,
    pub ginCounterCount: c_int,
}

impl DevCommRequirements {
    /// No requirements at all (null lists, zero counts, multimem and GIN off).
    pub fn zeroed() -> Self {
        DevCommRequirements {
            resourceRequirementsList: std::ptr::null_mut(),
            teamRequirementsList: std::ptr::null_mut(),
            lsaMultimem: false,
            barrierCount: 0,
            lsaBarrierCount: 0,
            railGinBarrierCount: 0,
            lsaLLA2ABlockCount: 0,
            lsaLLA2ASlotCount: 0,
            ginForceEnable: false,
            ginContextCount: 0,
            ginSignalCount: 0,
            ginCounterCount: 0,
        }
    }

    pub fn to_v2_28(&self) -> v2_28::ncclDevCommRequirements {
        v2_28::ncclDevCommRequirements {
            resourceRequirementsList: self.resourceRequirementsList,
            teamRequirementsList: self.teamRequirementsList,
            lsaMultimem: self.lsaMultimem,
            barrierCount: self.barrierCount,
            lsaBarrierCount: self.lsaBarrierCount,
            railGinBarrierCount: self.railGinBarrierCount,
            lsaLLA2ABlockCount: self.lsaLLA2ABlockCount,
            lsaLLA2ASlotCount: self.lsaLLA2ASlotCount,
            ginForceEnable: self.ginForceEnable,
            ginContextCount: self.ginContextCount,
            ginSignalCount: self.ginSignalCount,
            ginCounterCount: self.ginCounterCount,
        }
    }

    /// As `NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER` of 2.29.7, then gin-ep's fields.
    pub fn to_v2_29(&self) -> v2_29::ncclDevCommRequirements {
        v2_29::ncclDevCommRequirements {
            size: std::mem::size_of::<v2_29::ncclDevCommRequirements>(),
            magic: NCCL_API_MAGIC,
            version: DevAbi::V2_29.headers() as u32,
            resourceRequirementsList: self.resourceRequirementsList,
            teamRequirementsList: self.teamRequirementsList,
            lsaMultimem: self.lsaMultimem,
            barrierCount: self.barrierCount,
            lsaBarrierCount: self.lsaBarrierCount,
            railGinBarrierCount: self.railGinBarrierCount,
            lsaLLA2ABlockCount: self.lsaLLA2ABlockCount,
            lsaLLA2ASlotCount: self.lsaLLA2ASlotCount,
            ginForceEnable: self.ginForceEnable,
            ginContextCount: if self.ginContextCount > 0 {
                self.ginContextCount
            } else {
                4
            },
            ginSignalCount: self.ginSignalCount,
            ginCounterCount: self.ginCounterCount,
            ginConnectionType: if self.ginForceEnable {
                v2_29::NCCL_GIN_CONNECTION_FULL
            } else {
                v2_29::NCCL_GIN_CONNECTION_NONE
            },
            ginExclusiveContexts: false,
            ginQueueDepth: 0,
        }
    }

    /// As `NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER` of 2.30.7, then gin-ep's fields.
    pub fn to_v2_30(&self) -> v2_30::ncclDevCommRequirements {
        v2_30::ncclDevCommRequirements {
            size: std::mem::size_of::<v2_30::ncclDevCommRequirements>(),
            magic: NCCL_API_MAGIC,
            version: DevAbi::V2_30.headers() as u32,
            resourceRequirementsList: self.resourceRequirementsList,
            teamRequirementsList: self.teamRequirementsList,
            lsaMultimem: self.lsaMultimem,
            barrierCount: self.barrierCount,
            lsaBarrierCount: self.lsaBarrierCount,
            railGinBarrierCount: self.railGinBarrierCount,
            lsaLLA2ABlockCount: self.lsaLLA2ABlockCount,
            lsaLLA2ASlotCount: self.lsaLLA2ASlotCount,
            ginForceEnable: self.ginForceEnable,
            ginContextCount: if self.ginContextCount > 0 {
                self.ginContextCount
            } else {
                4
            },
            ginSignalCount: self.ginSignalCount,
            ginCounterCount: self.ginCounterCount,
            ginConnectionType: if self.ginForceEnable {
                v2_30::NCCL_GIN_CONNECTION_FULL
            } else {
                v2_30::NCCL_GIN_CONNECTION_NONE
            },
            ginExclusiveContexts: false,
            ginQueueDepth: 0,
            ginTrafficClass: v2_30::NCCL_CONFIG_UNDEF_INT,
            worldGinBarrierCount: 0,
            ginStrongSignalsRequired: true,
            ginVaSignalsRequired: true,
        }
    }

    /// As `NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER` of 2.31.2 (and of 2.32.3, the same struct),
    /// then gin-ep's fields; `version` is `abi`'s headers, V2_31 or V2_32.
    pub fn to_v2_31(&self, abi: DevAbi) -> v2_31::ncclDevCommRequirements {
        v2_31::ncclDevCommRequirements {
            size: std::mem::size_of::<v2_31::ncclDevCommRequirements>(),
            magic: NCCL_API_MAGIC,
            version: abi.headers() as u32,
            resourceRequirementsList: self.resourceRequirementsList,
            teamRequirementsList: self.teamRequirementsList,
            lsaMultimem: self.lsaMultimem,
            barrierCount: self.barrierCount,
            lsaBarrierCount: self.lsaBarrierCount,
            railGinBarrierCount: self.railGinBarrierCount,
            lsaLLA2ABlockCount: self.lsaLLA2ABlockCount,
            lsaLLA2ASlotCount: self.lsaLLA2ASlotCount,
            ginForceEnable: self.ginForceEnable,
            ginContextCount: if self.ginContextCount > 0 {
                self.ginContextCount
            } else {
                4
            },
            ginSignalCount: self.ginSignalCount,
            ginCounterCount: self.ginCounterCount,
            ginConnectionType: if self.ginForceEnable {
                v2_31::NCCL_GIN_CONNECTION_FULL
            } else {
                v2_31::NCCL_GIN_CONNECTION_NONE
            },
            ginExclusiveContexts: false,
            ginQueueDepth: 0,
            ginTrafficClass: v2_31::NCCL_CONFIG_UNDEF_INT,
            worldGinBarrierCount: 0,
            ginStrongSignalsRequired: true,
            ginVaSignalsRequired: true,
            ginCustomStride: 1,
            ginType: v2_31::NCCL_GIN_TYPE_NONE,
            useRuntimeVersion: false,
            cftCaps: v2_31::NCCL_CFT_NONE,
            cftBarrierCount: 0,
        }
    }
}

/// One version's `ncclDevCommRequirements`, ready to pass to `ncclDevCommCreate`.
#[derive(Clone, Copy, Debug)]
pub enum DevCommRequirementsC {
    V2_28(v2_28::ncclDevCommRequirements),
    V2_29(v2_29::ncclDevCommRequirements),
    V2_30(v2_30::ncclDevCommRequirements),
    /// 2.31's struct, also 2.32's.
    V2_31(v2_31::ncclDevCommRequirements),
}

impl DevCommRequirementsC {
    /// The `reqs` argument of [`crate::ncclDevCommCreate_t`]; valid while `self` is.
    pub fn as_ptr(&self) -> *const c_void {
        match self {
            DevCommRequirementsC::V2_28(r) => r as *const _ as *const c_void,
            DevCommRequirementsC::V2_29(r) => r as *const _ as *const c_void,
            DevCommRequirementsC::V2_30(r) => r as *const _ as *const c_void,
            DevCommRequirementsC::V2_31(r) => r as *const _ as *const c_void,
        }
    }
}

// ---------------------------------------------------------------------------------------
// Layout checks.

/// Generated by build.rs from every NCCL header set it found (no checks without headers).
mod generated_layout_checks {
    #[allow(unused_imports)]
    use super::*;
    include!(concat!(env!("OUT_DIR"), "/layout_checks.rs"));
}

/// NCCL_VERSION_CODE of each header set the struct layouts were checked against at build
/// time (empty when the build had no headers; then only the fixed checks below ran).
pub use generated_layout_checks::CHECKED_AGAINST as LAYOUT_CHECKED_AGAINST;

/// Measured with each version's headers on 64-bit targets; fails to compile when a field
/// above is added, removed or retyped, even where no headers are installed.
#[cfg(target_pointer_width = "64")]
const _: () = {
    use std::mem::{align_of, offset_of, size_of};
    assert!(size_of::<ncclTeam>() == 12);
    assert!(size_of::<ncclDevResourceRequirements>() == 56);
    assert!(size_of::<ncclTeamRequirements>() == 32);

    assert!(size_of::<v2_28::ncclWindow_vidmem>() == 72);
    assert!(size_of::<v2_28::ncclDevComm>() == 200 && align_of::<v2_28::ncclDevComm>() == 8);
    assert!(offset_of!(v2_28::ncclDevComm, resourceWindow_inlined) == 40);
    assert!(offset_of!(v2_28::ncclDevComm, ginContextCount) == 136);
    assert!(offset_of!(v2_28::ncclDevComm, ginSignalShadows) == 192);
    assert!(size_of::<v2_28::ncclDevCommRequirements>() == 56);
    assert!(offset_of!(v2_28::ncclDevCommRequirements, ginForceEnable) == 40);

    assert!(size_of::<v2_29::ncclDevComm>() == 224 && align_of::<v2_29::ncclDevComm>() == 8);
    assert!(offset_of!(v2_29::ncclDevComm, lsaRank) == 12);
    assert!(offset_of!(v2_29::ncclDevComm, abortFlag) == 216);
    assert!(size_of::<v2_29::ncclDevCommRequirements>() == 88);

    assert!(size_of::<v2_30::ncclWindow_vidmem>() == 88);
    assert!(size_of::<v2_30::ncclDevComm>() == 240 && align_of::<v2_30::ncclDevComm>() == 8);
    assert!(offset_of!(v2_30::ncclDevComm, lsaRank) == 20);
    assert!(offset_of!(v2_30::ncclDevComm, lsaSize) == 24);
    assert!(size_of::<v2_30::ncclDevCommRequirements>() == 96);

    assert!(size_of::<v2_31::ncclWindow_vidmem>() == 88);
    assert!(size_of::<v2_31::ncclResourceWindow_vidmem>() == 16);
    assert!(size_of::<v2_31::ncclDevComm>() == 248 && align_of::<v2_31::ncclDevComm>() == 8);
    assert!(offset_of!(v2_31::ncclDevComm, lsaRank) == 20);
    assert!(offset_of!(v2_31::ncclDevComm, lsaSize) == 24);
    assert!(offset_of!(v2_31::ncclDevComm, ginConnectionCount) == 96);
    assert!(offset_of!(v2_31::ncclDevComm, ginNetDeviceTypes) == 98);
    assert!(offset_of!(v2_31::ncclDevComm, ginHandles) == 104);
    assert!(offset_of!(v2_31::ncclDevComm, abortFlag) == 168);
    assert!(size_of::<v2_31::ncclDevCommRequirements>() == 120);
    assert!(offset_of!(v2_31::ncclDevCommRequirements, useRuntimeVersion) == 104);

    assert!(size_of::<v2_32::ncclWindow_vidmem>() == 96);
    assert!(offset_of!(v2_32::ncclWindow_vidmem, ginWinsDefaultBackend) == 40);

    // NCCL writes sizeof(its ncclDevComm) into the slot.
    assert!(size_of::<DevCommSlot>() == DEV_COMM_SLOT_BYTES && align_of::<DevCommSlot>() == 8);
    assert!(size_of::<v2_28::ncclDevComm>() <= DEV_COMM_SLOT_BYTES);
    assert!(size_of::<v2_29::ncclDevComm>() <= DEV_COMM_SLOT_BYTES);
    assert!(size_of::<v2_30::ncclDevComm>() <= DEV_COMM_SLOT_BYTES);
    assert!(size_of::<v2_31::ncclDevComm>() <= DEV_COMM_SLOT_BYTES);
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_library_version_maps_to_its_minor_from_the_first_mirrored_patch() {
        assert_eq!(DevAbi::for_library(22809), Some(DevAbi::V2_28));
        assert_eq!(DevAbi::for_library(22807), Some(DevAbi::V2_28));
        assert_eq!(DevAbi::for_library(22803), None, "2.28.3 lacks the GIN fields");
        assert_eq!(DevAbi::for_library(22907), Some(DevAbi::V2_29));
        assert_eq!(DevAbi::for_library(22903), None, "2.29.3 has another layout");
        assert_eq!(DevAbi::for_library(23007), Some(DevAbi::V2_30));
        assert_eq!(DevAbi::for_library(23012), Some(DevAbi::V2_30));
        assert_eq!(DevAbi::for_library(23004), None);
        assert_eq!(DevAbi::for_library(23102), Some(DevAbi::V2_31));
        assert_eq!(DevAbi::for_library(23109), Some(DevAbi::V2_31));
        assert_eq!(DevAbi::for_library(23100), None, "older than the 2.31.2 headers");
        assert_eq!(DevAbi::for_library(23203), Some(DevAbi::V2_32));
        assert_eq!(DevAbi::for_library(23202), None, "older than the 2.32.3 headers");
        assert_eq!(DevAbi::for_library(23300), None, "a minor newer than every set");
        assert_eq!(DevAbi::for_library(22705), None);
        assert_eq!(DevAbi::V2_30.to_string(), "2.30");
        assert_eq!(DevAbi::V2_32.to_string(), "2.32");
        assert_eq!(DevAbi::NEWEST, *DevAbi::ALL.last().unwrap());
    }

    #[test]
    fn requirements_of_2_29_and_2_30_start_as_nccls_initializer() {
        let mut r = DevCommRequirements::zeroed();
        r.lsaBarrierCount = 3;
        r.ginForceEnable = true;
        r.ginSignalCount = 5;
        let v29 = r.to_v2_29();
        assert_eq!((v29.size, v29.magic, v29.version), (88, 0xcafe_beef, 22907));
        assert_eq!(
            (v29.lsaBarrierCount, v29.ginSignalCount, v29.ginContextCount),
            (3, 5, 4)
        );
        assert_eq!(v29.ginConnectionType, v2_29::NCCL_GIN_CONNECTION_FULL);
        let v30 = r.to_v2_30();
        assert_eq!((v30.size, v30.magic, v30.version), (96, 0xcafe_beef, 23007));
        assert_eq!(v30.ginTrafficClass, i32::MIN);
        assert!(v30.ginStrongSignalsRequired && v30.ginVaSignalsRequired);
        for (abi, version) in [(DevAbi::V2_31, 23102), (DevAbi::V2_32, 23203)] {
            let v31 = r.to_v2_31(abi);
            assert_eq!((v31.size, v31.magic, v31.version), (120, 0xcafe_beef, version));
            assert_eq!((v31.lsaBarrierCount, v31.ginSignalCount), (3, 5));
            assert_eq!(v31.ginConnectionType, v2_31::NCCL_GIN_CONNECTION_FULL);
            assert_eq!((v31.ginCustomStride, v31.ginType, v31.cftCaps), (1, 0, 0));
            assert!(
                !v31.useRuntimeVersion,
                "the kernels are not built against the library's headers"
            );
        }
        let v28 = r.to_v2_28();
        assert_eq!(
            (v28.lsaBarrierCount, v28.ginSignalCount, v28.ginContextCount),
            (3, 5, 0)
        );
    }

    #[test]
    fn gin_backends_read_each_versions_own_fields() {
        // (ABI, offset of the connection count, offset of the type array).
        use std::mem::offset_of;
        for (abi, at_count, at_types) in [
            (
                DevAbi::V2_28,
                offset_of!(v2_28::ncclDevComm, ginContextCount),
                offset_of!(v2_28::ncclDevComm, ginTypes),
            ),
            (
                DevAbi::V2_29,
                offset_of!(v2_29::ncclDevComm, ginConnectionCount),
                offset_of!(v2_29::ncclDevComm, ginNetDeviceTypes),
            ),
            (
                DevAbi::V2_30,
                offset_of!(v2_30::ncclDevComm, ginConnectionCount),
                offset_of!(v2_30::ncclDevComm, ginNetDeviceTypes),
            ),
            (DevAbi::V2_31, 96, 98),
            (DevAbi::V2_32, 96, 98),
        ] {
            let mut slot = DevCommSlot::zeroed();
            assert!(abi.gin_backends(&slot).is_empty(), "{abi:?}");
            slot.bytes[at_count] = 2;
            slot.bytes[at_types..at_types + 3].copy_from_slice(&[2, NCCL_NET_DEVICE_GIN_EFA_GDA, 3]);
            assert_eq!(
                abi.gin_backends(&slot),
                vec![2, NCCL_NET_DEVICE_GIN_EFA_GDA],
                "{abi:?}"
            );
            slot.bytes[at_count] = 200;
            assert_eq!(abi.gin_backends(&slot).len(), 4, "{abi:?}: capped at the array");
        }
    }

    #[test]
    fn lsa_reads_each_versions_own_offsets() {
        for abi in DevAbi::ALL {
            let mut slot = DevCommSlot::zeroed();
            let (at_rank, at_size) = match abi {
                DevAbi::V2_28 | DevAbi::V2_29 => (12, 16),
                DevAbi::V2_30 | DevAbi::V2_31 | DevAbi::V2_32 => (20, 24),
            };
            slot.bytes[at_rank..at_rank + 4].copy_from_slice(&3i32.to_ne_bytes());
            slot.bytes[at_size..at_size + 4].copy_from_slice(&8i32.to_ne_bytes());
            assert_eq!(abi.lsa(&slot), (3, 8), "{abi:?}");
            assert!(abi.dev_comm_bytes() <= DEV_COMM_SLOT_BYTES);
        }
    }
}
