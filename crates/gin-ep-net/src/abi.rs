//! The NCCL plugin ABI, mirrored by hand: the v11 tables of NCCL 2.28.9 (`plugin/nccl_net.h`,
//! `plugin/net/net_v11.h`, `plugin/gin/gin_v11.h`, `nccl_common.h`, `nccl_device/net_device.h`)
//! and the v13 GIN table of NCCL 2.30 (`plugin/gin/gin_v13.h`, with `plugin/net/net_v12.h`
//! for its properties), which 2.30 also loads as its RMA table (`plugin/rma/rma_v13.h`).
//! NCCL 2.31 and 2.32 load the same tables (docs/nccl.md, "The project's plugin").
//!
//! Owns: `#[repr(C)]` layouts, constants and function-pointer types, with size and offset
//! assertions written from the headers for x86_64/aarch64 Linux (LP64). Never: logic. The
//! wheel NCCL ships lacks the net headers, so there is nothing to generate these from; the
//! assertions at the end pin every offset NCCL reads.

#![allow(non_camel_case_types, non_snake_case, non_upper_case_globals)]

use std::ffi::{c_char, c_int, c_ulong, c_void};
use std::mem::{offset_of, size_of};

/// `ncclResult_t`.
pub type ncclResult_t = c_int;
pub const ncclSuccess: ncclResult_t = 0;
pub const ncclSystemError: ncclResult_t = 2;
pub const ncclInternalError: ncclResult_t = 3;
pub const ncclInvalidArgument: ncclResult_t = 4;
pub const ncclInvalidUsage: ncclResult_t = 5;
pub const ncclRemoteError: ncclResult_t = 6;

/// `NCCL_NET_HANDLE_MAXSIZE`: bytes of a listen handle NCCL exchanges between ranks.
pub const NCCL_NET_HANDLE_MAXSIZE: usize = 128;
pub const NCCL_PTR_HOST: c_int = 0x1;
pub const NCCL_PTR_CUDA: c_int = 0x2;
pub const NCCL_PTR_DMABUF: c_int = 0x4;
pub const NCCL_NET_MR_FLAG_FORCE_SO: u64 = 1 << 0;
pub const NCCL_NET_SIGNAL_OP_INC: u32 = 0x1;
pub const NCCL_NET_SIGNAL_OP_ADD: u32 = 0x2;
pub const NCCL_NET_MAX_DEVS_PER_NIC: usize = 4;
/// `MAX_NET_SIZE`: the largest single transfer NCCL is told about.
pub const MAX_NET_SIZE: usize = 1024 * 1024 * 1024;

/// `ncclNetDeviceType` (an enum, int-sized).
pub type ncclNetDeviceType = c_int;
pub const NCCL_NET_DEVICE_HOST: ncclNetDeviceType = 0;
pub const NCCL_NET_DEVICE_GIN_PROXY: ncclNetDeviceType = 2;

/// `ncclDebugLogLevel`.
pub const NCCL_LOG_WARN: c_int = 2;
pub const NCCL_LOG_INFO: c_int = 3;
pub const NCCL_LOG_TRACE: c_int = 5;
/// `ncclDebugLogSubSys` bits used here.
pub const NCCL_INIT: c_ulong = 0x1;
pub const NCCL_NET: c_ulong = 0x10;

/// `ncclDebugLogger_t`: printf-style, variadic.
pub type ncclDebugLogger_t = Option<
    unsafe extern "C" fn(
        level: c_int,
        flags: c_ulong,
        file: *const c_char,
        line: c_int,
        fmt: *const c_char,
        ...
    ),
>;
/// `ncclProfilerCallback_t`; never called by this plugin.
pub type ncclProfilerCallback_t = *mut c_void;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ncclNetVDeviceProps_v11_t {
    pub ndevs: c_int,
    pub devs: [c_int; NCCL_NET_MAX_DEVS_PER_NIC],
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ncclNetCommConfig_v11_t {
    pub trafficClass: c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ncclNetProperties_v11_t {
    pub name: *mut c_char,
    pub pciPath: *mut c_char,
    pub guid: u64,
    pub ptrSupport: c_int,
    pub regIsGlobal: c_int,
    pub forceFlush: c_int,
    pub speed: c_int,
    pub port: c_int,
    pub latency: f32,
    pub maxComms: c_int,
    pub maxRecvs: c_int,
    pub netDeviceType: ncclNetDeviceType,
    pub netDeviceVersion: c_int,
    pub vProps: ncclNetVDeviceProps_v11_t,
    pub maxP2pBytes: usize,
    pub maxCollBytes: usize,
    pub maxMultiRequestSize: c_int,
}

/// `ncclNetDeviceHandle_v11_t` (= v7); only its pointer type appears in the tables.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ncclNetDeviceHandle_v11_t {
    pub netDeviceType: ncclNetDeviceType,
    pub netDeviceVersion: c_int,
    pub handle: *mut c_void,
    pub size: usize,
    pub needsProxyProgress: c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ncclNetCommAttr_v11_t {
    pub maxConcurrentPeers: i32,
    pub minConcurrentPeers: i32,
    pub maxFlowsPerPeer: i32,
    pub minFlowsPerPeer: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ncclNetAttr_v11_t {
    pub sendCommAttr: ncclNetCommAttr_v11_t,
    pub recvCommAttr: ncclNetCommAttr_v11_t,
    pub op: u32,
    pub algo: u32,
    pub proto: u32,
}

type R = ncclResult_t;
type DevHandlePtr = *mut *mut ncclNetDeviceHandle_v11_t;

/// `ncclNet_v11_t`: the point-to-point network table (`ncclNetPlugin_v11`).
#[repr(C)]
pub struct ncclNet_v11_t {
    pub name: *const c_char,
    pub init: unsafe extern "C" fn(
        ctx: *mut *mut c_void,
        commId: u64,
        config: *mut ncclNetCommConfig_v11_t,
        logFunction: ncclDebugLogger_t,
        profFunction: ncclProfilerCallback_t,
    ) -> R,
    pub devices: unsafe extern "C" fn(ndev: *mut c_int) -> R,
    pub getProperties: unsafe extern "C" fn(dev: c_int, props: *mut ncclNetProperties_v11_t) -> R,
    pub listen: unsafe extern "C" fn(
        ctx: *mut c_void,
        dev: c_int,
        handle: *mut c_void,
        listenComm: *mut *mut c_void,
    ) -> R,
    pub connect: unsafe extern "C" fn(
        ctx: *mut c_void,
        dev: c_int,
        handle: *mut c_void,
        sendComm: *mut *mut c_void,
        sendDevComm: DevHandlePtr,
    ) -> R,
    pub accept: unsafe extern "C" fn(
        listenComm: *mut c_void,
        recvComm: *mut *mut c_void,
        recvDevComm: DevHandlePtr,
    ) -> R,
    pub regMr: unsafe extern "C" fn(
        comm: *mut c_void,
        data: *mut c_void,
        size: usize,
        type_: c_int,
        mhandle: *mut *mut c_void,
    ) -> R,
    pub regMrDmaBuf: Option<
        unsafe extern "C" fn(
            comm: *mut c_void,
            data: *mut c_void,
            size: usize,
            type_: c_int,
            offset: u64,
            fd: c_int,
            mhandle: *mut *mut c_void,
        ) -> R,
    >,
    pub deregMr: unsafe extern "C" fn(comm: *mut c_void, mhandle: *mut c_void) -> R,
    pub isend: unsafe extern "C" fn(
        sendComm: *mut c_void,
        data: *mut c_void,
        size: usize,
        tag: c_int,
        mhandle: *mut c_void,
        phandle: *mut c_void,
        request: *mut *mut c_void,
    ) -> R,
    pub irecv: unsafe extern "C" fn(
        recvComm: *mut c_void,
        n: c_int,
        data: *mut *mut c_void,
        sizes: *mut usize,
        tags: *mut c_int,
        mhandles: *mut *mut c_void,
        phandles: *mut *mut c_void,
        request: *mut *mut c_void,
    ) -> R,
    pub iflush: unsafe extern "C" fn(
        recvComm: *mut c_void,
        n: c_int,
        data: *mut *mut c_void,
        sizes: *mut c_int,
        mhandles: *mut *mut c_void,
        request: *mut *mut c_void,
    ) -> R,
    pub test: unsafe extern "C" fn(request: *mut c_void, done: *mut c_int, sizes: *mut c_int) -> R,
    pub closeSend: unsafe extern "C" fn(sendComm: *mut c_void) -> R,
    pub closeRecv: unsafe extern "C" fn(recvComm: *mut c_void) -> R,
    pub closeListen: unsafe extern "C" fn(listenComm: *mut c_void) -> R,
    pub getDeviceMr:
        Option<unsafe extern "C" fn(comm: *mut c_void, mhandle: *mut c_void, dptr: *mut *mut c_void) -> R>,
    pub irecvConsumed:
        Option<unsafe extern "C" fn(recvComm: *mut c_void, n: c_int, request: *mut c_void) -> R>,
    pub makeVDevice: Option<unsafe extern "C" fn(d: *mut c_int, props: *mut ncclNetVDeviceProps_v11_t) -> R>,
    pub finalize: unsafe extern "C" fn(ctx: *mut c_void) -> R,
    pub setNetAttr: Option<unsafe extern "C" fn(ctx: *mut c_void, netAttr: *mut ncclNetAttr_v11_t) -> R>,
}

/// `ncclGin_v11_t`: the GIN table (`ncclGinPlugin_v11`), proxy type here.
#[repr(C)]
pub struct ncclGin_v11_t {
    pub name: *const c_char,
    pub init: unsafe extern "C" fn(ctx: *mut *mut c_void, commId: u64, logFunction: ncclDebugLogger_t) -> R,
    pub devices: unsafe extern "C" fn(ndev: *mut c_int) -> R,
    pub getProperties: unsafe extern "C" fn(dev: c_int, props: *mut ncclNetProperties_v11_t) -> R,
    pub listen: unsafe extern "C" fn(
        ctx: *mut c_void,
        dev: c_int,
        handle: *mut c_void,
        listenComm: *mut *mut c_void,
    ) -> R,
    pub connect: unsafe extern "C" fn(
        ctx: *mut c_void,
        handles: *mut *mut c_void,
        nranks: c_int,
        rank: c_int,
        listenComm: *mut c_void,
        collComm: *mut *mut c_void,
    ) -> R,
    pub createContext: Option<
        unsafe extern "C" fn(
            collComm: *mut c_void,
            nSignals: c_int,
            nCounters: c_int,
            ginCtx: *mut *mut c_void,
            devHandle: DevHandlePtr,
        ) -> R,
    >,
    pub regMrSym: unsafe extern "C" fn(
        collComm: *mut c_void,
        data: *mut c_void,
        size: usize,
        type_: c_int,
        mrFlags: u64,
        mhandle: *mut *mut c_void,
        ginHandle: *mut *mut c_void,
    ) -> R,
    pub regMrSymDmaBuf: Option<
        unsafe extern "C" fn(
            collComm: *mut c_void,
            data: *mut c_void,
            size: usize,
            type_: c_int,
            offset: u64,
            fd: c_int,
            mrFlags: u64,
            mhandle: *mut *mut c_void,
            ginHandle: *mut *mut c_void,
        ) -> R,
    >,
    pub deregMrSym: unsafe extern "C" fn(collComm: *mut c_void, mhandle: *mut c_void) -> R,
    pub destroyContext: Option<unsafe extern "C" fn(ginCtx: *mut c_void) -> R>,
    pub closeColl: unsafe extern "C" fn(collComm: *mut c_void) -> R,
    pub closeListen: unsafe extern "C" fn(listenComm: *mut c_void) -> R,
    pub iput: unsafe extern "C" fn(
        collComm: *mut c_void,
        srcOff: u64,
        srcMhandle: *mut c_void,
        size: usize,
        dstOff: u64,
        dstMhandle: *mut c_void,
        rank: u32,
        request: *mut *mut c_void,
    ) -> R,
    pub iputSignal: unsafe extern "C" fn(
        collComm: *mut c_void,
        srcOff: u64,
        srcMhandle: *mut c_void,
        size: usize,
        dstOff: u64,
        dstMhandle: *mut c_void,
        rank: u32,
        signalOff: u64,
        signalMhandle: *mut c_void,
        signalValue: u64,
        signalOp: u32,
        request: *mut *mut c_void,
    ) -> R,
    pub test: unsafe extern "C" fn(collComm: *mut c_void, request: *mut c_void, done: *mut c_int) -> R,
    pub ginProgress: Option<unsafe extern "C" fn(collComm: *mut c_void) -> R>,
    pub queryLastError: Option<unsafe extern "C" fn(ginCtx: *mut c_void, hasError: *mut bool) -> R>,
    pub finalize: unsafe extern "C" fn(ctx: *mut c_void) -> R,
}

/// `NCCL_NET_MAX_DEVS_PER_NIC_V12`.
pub const NCCL_NET_MAX_DEVS_PER_NIC_V12: usize = 8;
/// `NCCL_NET_ID_UNDEF`: rail and plane ids the plugin does not know.
pub const NCCL_NET_ID_UNDEF: i16 = -1;
/// `NCCL_NET_TRAFFIC_CLASS_UNDEF`.
pub const NCCL_NET_TRAFFIC_CLASS_UNDEF: c_int = -1;
/// `NCCL_CONFIG_UNDEF_INT` (`INT_MIN`): what NCCL 2.30 passes as the traffic class when the
/// communicator's config leaves it unset.
pub const NCCL_CONFIG_UNDEF_INT: c_int = c_int::MIN;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ncclNetVDeviceProps_v12_t {
    pub ndevs: c_int,
    pub devs: [c_int; NCCL_NET_MAX_DEVS_PER_NIC_V12],
}

/// `ncclNetProperties_v12_t`: v11 with 8 virtual devices and rail/plane ids at the end.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ncclNetProperties_v12_t {
    pub name: *mut c_char,
    pub pciPath: *mut c_char,
    pub guid: u64,
    pub ptrSupport: c_int,
    pub regIsGlobal: c_int,
    pub forceFlush: c_int,
    pub speed: c_int,
    pub port: c_int,
    pub latency: f32,
    pub maxComms: c_int,
    pub maxRecvs: c_int,
    pub netDeviceType: ncclNetDeviceType,
    pub netDeviceVersion: c_int,
    pub vProps: ncclNetVDeviceProps_v12_t,
    pub maxP2pBytes: usize,
    pub maxCollBytes: usize,
    pub maxMultiRequestSize: c_int,
    pub railId: i16,
    pub planeId: i16,
}

/// `ncclGinConfig_v13_t`: what `createContext` is asked for.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ncclGinConfig_v13_t {
    pub nSignals: c_int,
    pub nCounters: c_int,
    pub nContexts: c_int,
    pub queueDepth: c_int,
    pub trafficClass: c_int,
}

/// `ncclGin_v13_t` (= `ncclRma_v13_t`): puts, gets and flushes name a `ginCtx` from
/// `createContext` plus a context index inside it; `test` still takes the `collComm`.
#[repr(C)]
pub struct ncclGin_v13_t {
    pub name: *const c_char,
    pub init: unsafe extern "C" fn(ctx: *mut *mut c_void, commId: u64, logFunction: ncclDebugLogger_t) -> R,
    pub devices: unsafe extern "C" fn(ndev: *mut c_int) -> R,
    pub getProperties: unsafe extern "C" fn(dev: c_int, props: *mut ncclNetProperties_v12_t) -> R,
    pub listen: unsafe extern "C" fn(
        ctx: *mut c_void,
        dev: c_int,
        handle: *mut c_void,
        listenComm: *mut *mut c_void,
    ) -> R,
    pub connect: unsafe extern "C" fn(
        ctx: *mut c_void,
        handles: *mut *mut c_void,
        nranks: c_int,
        rank: c_int,
        listenComm: *mut c_void,
        collComm: *mut *mut c_void,
    ) -> R,
    pub createContext: unsafe extern "C" fn(
        collComm: *mut c_void,
        config: *mut ncclGinConfig_v13_t,
        ginCtx: *mut *mut c_void,
        devHandle: DevHandlePtr,
    ) -> R,
    pub regMrSym: unsafe extern "C" fn(
        collComm: *mut c_void,
        data: *mut c_void,
        size: usize,
        type_: c_int,
        mrFlags: u64,
        mhandle: *mut *mut c_void,
        ginHandle: *mut *mut c_void,
    ) -> R,
    pub regMrSymDmaBuf: Option<
        unsafe extern "C" fn(
            collComm: *mut c_void,
            data: *mut c_void,
            size: usize,
            type_: c_int,
            offset: u64,
            fd: c_int,
            mrFlags: u64,
            mhandle: *mut *mut c_void,
            ginHandle: *mut *mut c_void,
        ) -> R,
    >,
    pub deregMrSym: unsafe extern "C" fn(collComm: *mut c_void, mhandle: *mut c_void) -> R,
    pub destroyContext: unsafe extern "C" fn(ginCtx: *mut c_void) -> R,
    pub closeColl: unsafe extern "C" fn(collComm: *mut c_void) -> R,
    pub closeListen: unsafe extern "C" fn(listenComm: *mut c_void) -> R,
    pub iput: unsafe extern "C" fn(
        ginCtx: *mut c_void,
        context: c_int,
        srcOff: u64,
        srcMhandle: *mut c_void,
        size: usize,
        dstOff: u64,
        dstMhandle: *mut c_void,
        rank: u32,
        request: *mut *mut c_void,
    ) -> R,
    pub iputSignal: unsafe extern "C" fn(
        ginCtx: *mut c_void,
        context: c_int,
        srcOff: u64,
        srcMhandle: *mut c_void,
        size: usize,
        dstOff: u64,
        dstMhandle: *mut c_void,
        rank: u32,
        signalOff: u64,
        signalMhandle: *mut c_void,
        signalValue: u64,
        signalOp: u32,
        request: *mut *mut c_void,
    ) -> R,
    pub iget: unsafe extern "C" fn(
        ginCtx: *mut c_void,
        context: c_int,
        remoteOff: u64,
        remoteMhandle: *mut c_void,
        size: usize,
        localOff: u64,
        localMhandle: *mut c_void,
        rank: u32,
        request: *mut *mut c_void,
    ) -> R,
    pub iflush: unsafe extern "C" fn(
        ginCtx: *mut c_void,
        context: c_int,
        mhandle: *mut c_void,
        rank: u32,
        request: *mut *mut c_void,
    ) -> R,
    pub test: unsafe extern "C" fn(collComm: *mut c_void, request: *mut c_void, done: *mut c_int) -> R,
    pub ginProgress: Option<unsafe extern "C" fn(ginCtx: *mut c_void) -> R>,
    pub queryLastError: Option<unsafe extern "C" fn(ginCtx: *mut c_void, hasError: *mut bool) -> R>,
    pub finalize: unsafe extern "C" fn(ctx: *mut c_void) -> R,
}

/// The exported tables hold raw pointers (the name), which are not `Sync`; these wrappers
/// are `repr(transparent)`, so the symbol NCCL dlsyms has exactly the table's layout.
#[repr(transparent)]
pub struct ExportedNet(pub ncclNet_v11_t);
// SAFETY: the table is immutable and its `name` points at a `'static` C string.
unsafe impl Sync for ExportedNet {}

#[repr(transparent)]
pub struct ExportedGin(pub ncclGin_v11_t);
// SAFETY: as for `ExportedNet`.
unsafe impl Sync for ExportedGin {}

#[repr(transparent)]
pub struct ExportedGinV13(pub ncclGin_v13_t);
// SAFETY: as for `ExportedNet`.
unsafe impl Sync for ExportedGinV13 {}

// Layout assertions, written from the headers (LP64: pointers and size_t are 8 bytes).
const _: () = {
    assert!(size_of::<ncclNetVDeviceProps_v11_t>() == 20);
    assert!(size_of::<ncclNetCommConfig_v11_t>() == 4);
    assert!(offset_of!(ncclNetProperties_v11_t, guid) == 16);
    assert!(offset_of!(ncclNetProperties_v11_t, ptrSupport) == 24);
    assert!(offset_of!(ncclNetProperties_v11_t, latency) == 44);
    assert!(offset_of!(ncclNetProperties_v11_t, maxRecvs) == 52);
    assert!(offset_of!(ncclNetProperties_v11_t, netDeviceType) == 56);
    assert!(offset_of!(ncclNetProperties_v11_t, vProps) == 64);
    assert!(offset_of!(ncclNetProperties_v11_t, maxP2pBytes) == 88);
    assert!(offset_of!(ncclNetProperties_v11_t, maxCollBytes) == 96);
    assert!(offset_of!(ncclNetProperties_v11_t, maxMultiRequestSize) == 104);
    assert!(size_of::<ncclNetProperties_v11_t>() == 112);
    assert!(size_of::<ncclNetDeviceHandle_v11_t>() == 32);
    assert!(size_of::<ncclNetAttr_v11_t>() == 44);
    // ncclNet_v11_t: name + 21 function pointers.
    assert!(size_of::<ncclNet_v11_t>() == 22 * 8);
    assert!(offset_of!(ncclNet_v11_t, isend) == 10 * 8);
    assert!(offset_of!(ncclNet_v11_t, test) == 13 * 8);
    assert!(offset_of!(ncclNet_v11_t, finalize) == 20 * 8);
    // ncclGin_v11_t: name + 18 function pointers.
    assert!(size_of::<ncclGin_v11_t>() == 19 * 8);
    assert!(offset_of!(ncclGin_v11_t, regMrSym) == 7 * 8);
    assert!(offset_of!(ncclGin_v11_t, iput) == 13 * 8);
    assert!(offset_of!(ncclGin_v11_t, test) == 15 * 8);
    assert!(offset_of!(ncclGin_v11_t, finalize) == 18 * 8);
    assert!(size_of::<ExportedNet>() == size_of::<ncclNet_v11_t>());
    assert!(size_of::<ExportedGin>() == size_of::<ncclGin_v11_t>());
    // net_v12.h: the virtual device list grows to 8 entries (4 + 8 * 4 bytes), which moves
    // every later field; railId and planeId fill the tail padding of v11.
    assert!(size_of::<ncclNetVDeviceProps_v12_t>() == 36);
    assert!(offset_of!(ncclNetProperties_v12_t, guid) == 16);
    assert!(offset_of!(ncclNetProperties_v12_t, ptrSupport) == 24);
    assert!(offset_of!(ncclNetProperties_v12_t, latency) == 44);
    assert!(offset_of!(ncclNetProperties_v12_t, maxRecvs) == 52);
    assert!(offset_of!(ncclNetProperties_v12_t, netDeviceType) == 56);
    assert!(offset_of!(ncclNetProperties_v12_t, netDeviceVersion) == 60);
    assert!(offset_of!(ncclNetProperties_v12_t, vProps) == 64);
    assert!(offset_of!(ncclNetProperties_v12_t, maxP2pBytes) == 104);
    assert!(offset_of!(ncclNetProperties_v12_t, maxCollBytes) == 112);
    assert!(offset_of!(ncclNetProperties_v12_t, maxMultiRequestSize) == 120);
    assert!(offset_of!(ncclNetProperties_v12_t, railId) == 124);
    assert!(offset_of!(ncclNetProperties_v12_t, planeId) == 126);
    assert!(size_of::<ncclNetProperties_v12_t>() == 128);
    // gin_v13.h: five ints.
    assert!(size_of::<ncclGinConfig_v13_t>() == 20);
    assert!(offset_of!(ncclGinConfig_v13_t, nContexts) == 8);
    assert!(offset_of!(ncclGinConfig_v13_t, queueDepth) == 12);
    assert!(offset_of!(ncclGinConfig_v13_t, trafficClass) == 16);
    // ncclGin_v13_t: name + 20 function pointers (v11 plus iget and iflush).
    assert!(size_of::<ncclGin_v13_t>() == 21 * 8);
    assert!(offset_of!(ncclGin_v13_t, getProperties) == 3 * 8);
    assert!(offset_of!(ncclGin_v13_t, connect) == 5 * 8);
    assert!(offset_of!(ncclGin_v13_t, createContext) == 6 * 8);
    assert!(offset_of!(ncclGin_v13_t, regMrSym) == 7 * 8);
    assert!(offset_of!(ncclGin_v13_t, destroyContext) == 10 * 8);
    assert!(offset_of!(ncclGin_v13_t, closeColl) == 11 * 8);
    assert!(offset_of!(ncclGin_v13_t, iput) == 13 * 8);
    assert!(offset_of!(ncclGin_v13_t, iputSignal) == 14 * 8);
    assert!(offset_of!(ncclGin_v13_t, iget) == 15 * 8);
    assert!(offset_of!(ncclGin_v13_t, iflush) == 16 * 8);
    assert!(offset_of!(ncclGin_v13_t, test) == 17 * 8);
    assert!(offset_of!(ncclGin_v13_t, ginProgress) == 18 * 8);
    assert!(offset_of!(ncclGin_v13_t, queryLastError) == 19 * 8);
    assert!(offset_of!(ncclGin_v13_t, finalize) == 20 * 8);
    assert!(size_of::<ExportedGinV13>() == size_of::<ncclGin_v13_t>());
};
