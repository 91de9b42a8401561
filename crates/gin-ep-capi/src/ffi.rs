//! The C entry points, and every `unsafe` of the crate: reading caller structs through raw
//! pointers, the opaque group and handle pointers, and the borrowed communicator.
//!
//! Each entry runs inside [`guard`]: a panic becomes ncclInternalError (never an unwind
//! across the C boundary, never an abort), and a failure's message is stored for
//! `ncclEpGetLastError`, prefixed with the function's name.
//!
//! Reading a versioned struct ([`read`]): NULL where required, a `size` below the struct's V1
//! size, or a wrong magic is ncclInvalidArgument; otherwise the first `min(size, ours)` bytes
//! are copied over a zeroed value, so an older caller's missing fields read as their zero
//! defaults and a newer caller's unknown tail is never touched.

// The entry points take raw pointers from C, whose validity is the header's contract: they
// cannot be `unsafe fn` (C calls them), so the lint that asks for it does not apply.
#![allow(clippy::not_unsafe_ptr_arg_deref)]

use std::ffi::{c_char, c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use gin_ep::backend::cuda::DeviceAllocator;
use gin_ep::ep::{EpOptions, GpuRank, GpuRankOptions, RankTopology, Stream};
use gin_ep::{Ep, EpConfig};

use crate::abi::*;
use crate::group::{Algo, Group, GroupSpec, Mask};
use crate::handle::{CombineArgs, DispatchArgs, Handle, LayoutDescs};
use crate::status::{self, CResult, CapiError};
use crate::tensor::Desc;

/// All-zero `T`: the default of every field.
pub fn zeroed<T: Versioned>() -> T {
    // SAFETY: `Versioned` is implemented only for the `repr(C)` structs of `abi`, whose
    // fields are integers, raw pointers, and structs or arrays of those: all-zero bytes are
    // a valid value of each.
    unsafe { std::mem::zeroed() }
}

/// Runs one entry: its result code, its message stored on failure, a panic caught.
fn guard(func: &str, f: impl FnOnce() -> CResult<()>) -> NcclResult {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => NCCL_SUCCESS,
        Ok(Err(e)) => {
            status::set_last(&format!("{func}: {}", e.msg));
            e.code
        }
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic with no message".into());
            status::set_last(&format!("{func}: internal error (gin-ep panicked: {what})"));
            NCCL_INTERNAL_ERROR
        }
    }
}

/// Reads the versioned struct at `p` (None when NULL); `name` is the argument's name.
fn read<T: Versioned>(p: *const T, name: &str) -> CResult<Option<T>> {
    if p.is_null() {
        return Ok(None);
    }
    // SAFETY: the caller passes a pointer to a live struct of this type, whose first 8 bytes
    // are `size` and `magic` in every version.
    let [size, magic] = unsafe { std::ptr::read_unaligned(p.cast::<[u32; 2]>()) };
    if size < T::V1_SIZE {
        return Err(CapiError::arg(format!(
            "{name}->size = {size}: below {}'s first released size {} (initialize it with its _INIT macro)",
            T::NAME,
            T::V1_SIZE
        )));
    }
    let ours_ok = magic == T::MAGIC || (T::MAGIC == TENSOR_MAGIC && magic == TENSOR_ALLOC_MAGIC);
    if !ours_ok {
        return Err(CapiError::arg(format!(
            "{name}->magic = {magic:#x}: expected {:#x} for {} (initialize it with its _INIT macro)",
            T::MAGIC,
            T::NAME
        )));
    }
    let mut v = zeroed::<T>();
    let n = (size as usize).min(std::mem::size_of::<T>());
    // SAFETY: the caller's struct is `size` bytes long (its own sizeof), so its first `n`
    // bytes are readable; `v` is a distinct local of at least `n` bytes, and any bytes are a
    // valid value of its integer and pointer fields.
    unsafe { std::ptr::copy_nonoverlapping(p.cast::<u8>(), (&mut v as *mut T).cast::<u8>(), n) };
    Ok(Some(v))
}

fn read_required<T: Versioned>(p: *const T, name: &str) -> CResult<T> {
    read(p, name)?.ok_or_else(|| CapiError::arg(format!("{name} is NULL (required)")))
}

/// The most dimensions a tensor gin-ep reads has (LL receive rows are 3-D).
const MAX_NDIM: u32 = 8;

/// Reads the tensor descriptor at `p` (None when NULL).
fn tensor(p: *const Tensor, name: &str) -> CResult<Option<Desc>> {
    let Some(t) = read(p, name)? else {
        return Ok(None);
    };
    if !t.win_hdl.is_null() {
        return Err(CapiError::usage(format!(
            "{name}->win_hdl is set: gin-ep takes tensors in device memory (data), not NCCL windows"
        )));
    }
    if t.win_offset != 0 {
        return Err(CapiError::arg(format!(
            "{name}->win_offset = {}: an offset into a window, and win_hdl is NULL",
            t.win_offset
        )));
    }
    if t.ndim == 0 || t.ndim > MAX_NDIM {
        return Err(CapiError::arg(format!(
            "{name}->ndim = {}: expected 1..={MAX_NDIM}",
            t.ndim
        )));
    }
    if t.sizes.is_null() {
        return Err(CapiError::arg(format!("{name}->sizes is NULL")));
    }
    // SAFETY: the descriptor's contract: `sizes` points to `ndim` extents that outlive the
    // call.
    let sizes = unsafe { std::slice::from_raw_parts(t.sizes, t.ndim as usize) }.to_vec();
    let d = Desc {
        name: name.to_string(),
        dtype: t.datatype,
        data: t.data as u64,
        sizes,
    };
    if d.data == 0 && d.elems() != 0 {
        return Err(CapiError::arg(format!("{name}->data is NULL")));
    }
    Ok(Some(d))
}

fn layout_info(p: *const LayoutInfo, name: &str) -> CResult<Option<LayoutDescs>> {
    let Some(l) = read(p, name)? else {
        return Ok(None);
    };
    if l.recv_topk_idx_kind > EXPERT_ID_GLOBAL {
        return Err(CapiError::arg(format!(
            "{name}->recv_topk_idx_kind = {}: not an ncclEpExpertIdKind_t value",
            l.recv_topk_idx_kind
        )));
    }
    Ok(Some(LayoutDescs {
        expert_counters: tensor(l.expert_counters, &format!("{name}->expert_counters"))?,
        src_rank_counters: tensor(l.src_rank_counters, &format!("{name}->src_rank_counters"))?,
        expert_offsets: tensor(l.expert_offsets, &format!("{name}->expert_offsets"))?,
        recv_total_counter: tensor(l.recv_total_counter, &format!("{name}->recv_total_counter"))?,
        recv_topk_idx_kind: l.recv_topk_idx_kind,
    }))
}

fn out_ptr<T>(p: *mut T, name: &str) -> CResult<*mut T> {
    if p.is_null() {
        return Err(CapiError::arg(format!("{name} is NULL (required)")));
    }
    Ok(p)
}

// ---------------------------------------------------------------- opaque objects

/// Marks a live group or handle: a pointer that is not one (garbage, or destroyed) is
/// refused instead of used, as far as its first word tells.
const GROUP_ALIVE: u64 = 0x6769_6e65_7067_7270; // "ginepgrp"
const HANDLE_ALIVE: u64 = 0x6769_6e65_7068_646c; // "ginephdl"

#[repr(C)]
pub struct GroupBox {
    alive: u64,
    group: Arc<Group>,
}

#[repr(C)]
pub struct HandleBox {
    alive: u64,
    handle: Handle,
}

fn group_ref<'a>(p: *mut GroupBox, name: &str) -> CResult<&'a GroupBox> {
    let p = out_ptr(p, name)?;
    // SAFETY: a non-NULL group pointer comes from ncclEpCreateGroup and lives until
    // ncclEpGroupDestroy (the caller's contract); the word check catches the common misuse.
    let g = unsafe { &*p };
    if g.alive != GROUP_ALIVE {
        return Err(CapiError::arg(format!("{name} is not a live ncclEpGroup_t")));
    }
    Ok(g)
}

fn handle_mut<'a>(p: *mut HandleBox, name: &str) -> CResult<&'a mut HandleBox> {
    let p = out_ptr(p, name)?;
    // SAFETY: as for groups: from ncclEpInitHandle/CreateHandle, live until
    // ncclEpHandleDestroy, used by one thread at a time (NCCL EP's contract).
    let h = unsafe { &mut *p };
    if h.alive != HANDLE_ALIVE {
        return Err(CapiError::arg(format!("{name} is not a live ncclEpHandle_t")));
    }
    Ok(h)
}

// ---------------------------------------------------------------- NCCL and the engine

/// This process's rank of the caller's communicator (collective over `comm`).
fn open_rank(comm: *mut c_void, timeout: std::time::Duration) -> CResult<GpuRank> {
    let opts = GpuRankOptions {
        timeout,
        ..GpuRankOptions::default()
    };
    // SAFETY: `comm` is a live communicator of the libnccl.so.2 this process loaded, and the
    // caller destroys it only after the group and its handles (ncclEpCreateGroup's contract,
    // docs/c-api.md); the group's engines hold the rank, so it lives as long as they do.
    Ok(unsafe { GpuRank::from_comm(comm, opts) }?)
}

/// The caller's allocator of `ncclEpGroupConfig_t::alloc` (both functions or neither:
/// [`GroupSpec::new`] checked).
fn allocator(a: &AllocConfig) -> Option<DeviceAllocator> {
    if a.alloc_fn.is_null() || a.free_fn.is_null() {
        return None;
    }
    // SAFETY: non-NULL `ncclEpAllocFn_t` / `ncclEpFreeFn_t` values of the caller's config:
    // C function pointers of exactly these signatures (cudaError_t is a C enum, an int).
    let (alloc, free) = unsafe {
        (
            std::mem::transmute::<*mut c_void, AllocFn>(a.alloc_fn),
            std::mem::transmute::<*mut c_void, FreeFn>(a.free_fn),
        )
    };
    Some(DeviceAllocator {
        alloc,
        free,
        context: a.context,
    })
}

type AllocFn = unsafe extern "C" fn(*mut *mut c_void, usize, *mut c_void) -> i32;
type FreeFn = unsafe extern "C" fn(*mut c_void, *mut c_void) -> i32;

/// gin-ep's engine for `cfg` on the group's rank (collective): the buffers of the group's
/// mode only (HT with exact sizing: counts known when the dispatch returns), its deadline and
/// CTAs, and the launch's node topology (`GIN_EP_VNODES`, `GIN_EP_NODE_SIZE`:
/// an NCCL EP program does not know gin-ep's topology, so the launcher's environment says it).
/// HT crosses the launch's gin-ep nodes when they are smaller than the group (node-first
/// combine), as the Python `Buffer` does.
fn open_engine(rank: &GpuRank, cfg: &EpConfig, spec: &GroupSpec) -> CResult<Ep> {
    let ht = spec.algo == Algo::Ht;
    let topology = RankTopology::from_env()?;
    let cfg = if ht { topology.ht_config(cfg) } else { cfg.clone() };
    let mut opts = EpOptions {
        ht,
        ll: !ht,
        timeout: spec.timeout,
        topology,
        ..EpOptions::default()
    };
    match (ht, spec.max_sms) {
        (true, Some(sms)) => opts.ht_sms = sms,
        (false, sms) => opts.ll_grid = sms,
        (true, None) => {}
    }
    Ok(Ep::on_rank(rank, &cfg, &opts)?)
}

// ---------------------------------------------------------------- the entry points

#[no_mangle]
pub extern "C" fn ncclEpGetVersion(version: *mut c_int) -> NcclResult {
    guard("ncclEpGetVersion", || {
        let p = out_ptr(version, "version")?;
        // SAFETY: non-NULL output pointer to an int, the caller's contract.
        unsafe { p.write(VERSION_CODE) };
        Ok(())
    })
}

/// A descriptor from `ncclEpTensorAlloc`: the public part first (its address is the
/// caller's), then the extents it points to.
#[repr(C)]
struct OwnedTensor {
    public: Tensor,
    sizes: Box<[usize]>,
}

#[no_mangle]
pub extern "C" fn ncclEpTensorAlloc(
    out: *mut *mut Tensor,
    ndim: u32,
    datatype: i32,
    sizes: *const usize,
    config: *const TensorAllocConfig,
) -> NcclResult {
    guard("ncclEpTensorAlloc", || {
        read(config, "config")?;
        let out = out_ptr(out, "tensor")?;
        if ndim == 0 || ndim > MAX_NDIM {
            return Err(CapiError::arg(format!("ndim = {ndim}: expected 1..={MAX_NDIM}")));
        }
        let sizes = out_ptr(sizes.cast_mut(), "sizes")?;
        // SAFETY: `sizes` holds `ndim` extents (the function's contract).
        let mut owned: Box<[usize]> = unsafe { std::slice::from_raw_parts(sizes, ndim as usize) }.into();
        let t = Box::new(OwnedTensor {
            public: Tensor {
                size: std::mem::size_of::<Tensor>() as u32,
                magic: TENSOR_ALLOC_MAGIC,
                ndim,
                datatype,
                data: std::ptr::null_mut(),
                win_hdl: std::ptr::null_mut(),
                win_offset: 0,
                sizes: owned.as_mut_ptr(),
            },
            sizes: owned,
        });
        // SAFETY: non-NULL output pointer (checked); `public` is the first field of a
        // `repr(C)` struct, so the box's address is the descriptor's.
        unsafe { out.write(Box::into_raw(t).cast::<Tensor>()) };
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn ncclEpTensorDestroy(tensor: *mut Tensor) -> NcclResult {
    guard("ncclEpTensorDestroy", || {
        if tensor.is_null() {
            return Ok(());
        }
        let Some(t) = read(tensor, "tensor")? else {
            return Ok(());
        };
        if t.magic != TENSOR_ALLOC_MAGIC {
            return Err(CapiError::arg(format!(
                "tensor->magic = {:#x}: not a descriptor of ncclEpTensorAlloc",
                t.magic
            )));
        }
        // SAFETY: the magic says ncclEpTensorAlloc made it: it is the address of a boxed
        // `OwnedTensor`, destroyed once (the caller's contract).
        let owned = unsafe { Box::from_raw(tensor.cast::<OwnedTensor>()) };
        if owned.public.sizes != owned.sizes.as_ptr().cast_mut() {
            // The caller repointed `sizes`; the box is still ours to free.
            drop(owned);
            return Err(CapiError::arg(
                "tensor->sizes was changed after ncclEpTensorAlloc (freed anyway)",
            ));
        }
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn ncclEpCreateGroup(
    group: *mut *mut GroupBox,
    comm: *mut c_void,
    config: *const GroupConfig,
) -> NcclResult {
    guard("ncclEpCreateGroup", || {
        let out = out_ptr(group, "ep_group")?;
        let cfg = read_required(config, "config")?;
        if comm.is_null() {
            return Err(CapiError::arg("comm is NULL"));
        }
        // What does not depend on the communicator is checked before the collective (every
        // rank passes the same config, so every rank fails alike); the rest after it.
        let early = GroupSpec::new(&cfg, 1, 0)?;
        let rank = open_rank(comm, early.timeout)?;
        // Every device buffer of the group (its engines' and its handles') comes from the
        // caller's allocator when it gave one; the windows are NCCL's, as NCCL EP's are.
        rank.set_device_allocator(allocator(&cfg.alloc))?;
        let info = rank.info();
        let spec = GroupSpec::new(&cfg, info.world, info.rank)?;
        let mask = if spec.mask {
            Some(Mask::new(&rank, spec.ranks)?)
        } else {
            None
        };
        let g = Group::new(spec, rank, open_engine, mask);
        let b = Box::new(GroupBox {
            alive: GROUP_ALIVE,
            group: Arc::new(g),
        });
        // SAFETY: non-NULL output pointer (checked).
        unsafe { out.write(Box::into_raw(b)) };
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn ncclEpGroupDestroy(group: *mut GroupBox) -> NcclResult {
    guard("ncclEpGroupDestroy", || {
        group_ref(group, "ep_group")?;
        // SAFETY: a live group (checked) from Box::into_raw; marked dead before it is freed.
        let mut b = unsafe { Box::from_raw(group) };
        b.alive = 0;
        // The group goes either way; a peer that never reached its destroy is reported.
        let quiet = b.group.quiesce();
        drop(b);
        quiet
    })
}

#[no_mangle]
pub extern "C" fn ncclEpHandleMemSize(
    group: *mut GroupBox,
    layout: u32,
    config: *const HandleConfig,
    size_out: *mut usize,
    num_topk: c_int,
) -> NcclResult {
    guard("ncclEpHandleMemSize", || {
        let g = group_ref(group, "ep_group")?;
        read(config, "config")?;
        let out = out_ptr(size_out, "size_out")?;
        let l = crate::handle::layout(g.group.spec.algo, layout)?;
        match (l, num_topk) {
            (crate::handle::Layout::LlExpertMajor, k) if k <= 0 => {
                return Err(CapiError::arg(format!(
                    "num_topk = {k}: LL handles need the top-k (> 0)"
                )))
            }
            (_, k) if k > 0 => g.group.spec.check_topk(k as usize)?,
            _ => {}
        }
        // gin-ep keeps a handle's routing state in its engine's windows: a handle needs no
        // memory of the caller's.
        // SAFETY: non-NULL output pointer (checked).
        unsafe { out.write(0) };
        Ok(())
    })
}

fn new_handle(
    g: &GroupBox,
    layout: u32,
    config: *const HandleConfig,
    num_topk: c_int,
    handle_mem: *const Tensor,
) -> CResult<Handle> {
    let alignment = read(config, "config")?.map_or(0, |c| c.dispatch_output_per_expert_alignment);
    // Accepted and unused: gin-ep needs none of the caller's memory for a handle (size 0).
    tensor(handle_mem, "handle_mem")?;
    Handle::init(g.group.clone(), layout, num_topk, alignment)
}

fn publish(out: *mut *mut HandleBox, handle: Handle) {
    let b = Box::new(HandleBox {
        alive: HANDLE_ALIVE,
        handle,
    });
    // SAFETY: callers checked `out` is non-NULL.
    unsafe { out.write(Box::into_raw(b)) };
}

#[no_mangle]
pub extern "C" fn ncclEpInitHandle(
    handle: *mut *mut HandleBox,
    group: *mut GroupBox,
    layout: u32,
    config: *const HandleConfig,
    num_topk: c_int,
    handle_mem: *const Tensor,
) -> NcclResult {
    guard("ncclEpInitHandle", || {
        let out = out_ptr(handle, "handle")?;
        let g = group_ref(group, "ep_group")?;
        let h = new_handle(g, layout, config, num_topk, handle_mem)?;
        publish(out, h);
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn ncclEpUpdateHandle(
    handle: *mut HandleBox,
    topk_idx: *const Tensor,
    layout: *const LayoutInfo,
    stream: *mut c_void,
) -> NcclResult {
    guard("ncclEpUpdateHandle", || {
        let h = handle_mut(handle, "handle")?;
        let idx = tensor(topk_idx, "topk_idx")?;
        let li = layout_info(layout, "layout_info")?;
        h.handle.update(idx, li, Stream(stream as u64))
    })
}

#[no_mangle]
pub extern "C" fn ncclEpCreateHandle(
    handle: *mut *mut HandleBox,
    group: *mut GroupBox,
    layout: u32,
    topk_idx: *const Tensor,
    layout_info_p: *const LayoutInfo,
    config: *const HandleConfig,
    stream: *mut c_void,
) -> NcclResult {
    guard("ncclEpCreateHandle", || {
        let out = out_ptr(handle, "handle")?;
        let g = group_ref(group, "ep_group")?;
        let idx = tensor(topk_idx, "topk_idx")?;
        let li = layout_info(layout_info_p, "layout_info")?;
        // The top-k is the routing's second extent.
        let k = match &idx {
            Some(d) if d.sizes.len() == 2 => d.sizes[1] as c_int,
            Some(d) => {
                return Err(CapiError::arg(format!(
                    "topk_idx->sizes = {:?}: expected [tokens, topk]",
                    d.sizes
                )))
            }
            None => return Err(CapiError::arg("topk_idx is NULL (required)")),
        };
        let mut h = new_handle(g, layout, config, k, std::ptr::null())?;
        h.update(idx, li, Stream(stream as u64))?;
        publish(out, h);
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn ncclEpHandleDestroy(handle: *mut HandleBox) -> NcclResult {
    guard("ncclEpHandleDestroy", || {
        handle_mut(handle, "handle")?;
        // SAFETY: a live handle (checked) from Box::into_raw; marked dead before it is freed.
        let mut b = unsafe { Box::from_raw(handle) };
        b.alive = 0;
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn ncclEpDispatch(
    handle: *mut HandleBox,
    inputs: *const DispatchInputs,
    outputs: *const DispatchOutputs,
    layout: *const LayoutInfo,
    config: *const DispatchConfig,
    stream: *mut c_void,
) -> NcclResult {
    guard("ncclEpDispatch", || {
        let h = handle_mut(handle, "handle")?;
        let i = read_required(inputs, "inputs")?;
        let o = read_required(outputs, "outputs")?;
        let config = read(config, "config")?.unwrap_or_else(zeroed);
        let args = DispatchArgs {
            tokens: tensor(i.tokens, "inputs->tokens")?,
            topk_weights: tensor(i.topk_weights, "inputs->topk_weights")?,
            scales: tensor(i.scales, "inputs->scales")?,
            out_tokens: tensor(o.tokens, "outputs->tokens")?,
            out_weights: tensor(o.topk_weights, "outputs->topk_weights")?,
            out_scales: tensor(o.scales, "outputs->scales")?,
            out_idx: tensor(o.topk_idx, "outputs->topk_idx")?,
            layout: layout_info(layout, "layout_info")?,
            config,
        };
        h.handle.dispatch(args, Stream(stream as u64))
    })
}

#[no_mangle]
pub extern "C" fn ncclEpCombine(
    handle: *mut HandleBox,
    inputs: *const CombineInputs,
    outputs: *const CombineOutputs,
    config: *const CombineConfig,
    stream: *mut c_void,
) -> NcclResult {
    guard("ncclEpCombine", || {
        let h = handle_mut(handle, "handle")?;
        let i = read_required(inputs, "inputs")?;
        let o = read_required(outputs, "outputs")?;
        let config = read(config, "config")?.unwrap_or_else(zeroed);
        let args = CombineArgs {
            tokens: tensor(i.tokens, "inputs->tokens")?,
            topk_weights: tensor(i.topk_weights, "inputs->topk_weights")?,
            scales: tensor(i.scales, "inputs->scales")?,
            out_tokens: tensor(o.tokens, "outputs->tokens")?,
            out_weights: tensor(o.topk_weights, "outputs->topk_weights")?,
            config,
        };
        h.handle.combine(args, Stream(stream as u64))
    })
}

#[no_mangle]
pub extern "C" fn ncclEpComplete(
    handle: *mut HandleBox,
    config: *const CompleteConfig,
    stream: *mut c_void,
) -> NcclResult {
    guard("ncclEpComplete", || {
        let h = handle_mut(handle, "handle")?;
        read(config, "config")?;
        h.handle.complete(Stream(stream as u64))
    })
}

#[no_mangle]
pub extern "C" fn ncclEpMaskQuery(group: *mut GroupBox, mask: *mut c_int, stream: *mut c_void) -> NcclResult {
    guard("ncclEpMaskQuery", || {
        let g = group_ref(group, "ep_group")?;
        let dst = out_ptr(mask, "mask_status")?;
        g.group.mask_query(stream as u64, dst as u64)
    })
}

#[no_mangle]
pub extern "C" fn ncclEpMaskUpdate(
    group: *mut GroupBox,
    mask: *const c_int,
    stream: *mut c_void,
) -> NcclResult {
    guard("ncclEpMaskUpdate", || {
        let g = group_ref(group, "ep_group")?;
        let p = out_ptr(mask.cast_mut(), "mask")?;
        // SAFETY: the function's contract: `mask` is host memory of int[ranks].
        let active = unsafe { std::slice::from_raw_parts(p, g.group.spec.ranks) };
        g.group.mask_update(stream as u64, active)
    })
}

#[no_mangle]
pub extern "C" fn ncclEpMaskClean(group: *mut GroupBox, stream: *mut c_void) -> NcclResult {
    guard("ncclEpMaskClean", || {
        let g = group_ref(group, "ep_group")?;
        g.group.mask_clean(stream as u64)
    })
}

#[no_mangle]
pub extern "C" fn ncclEpGetAsyncError(group: *mut GroupBox, error_out: *mut c_int) -> NcclResult {
    guard("ncclEpGetAsyncError", || {
        let g = group_ref(group, "ep_group")?;
        let out = out_ptr(error_out, "error_out")?;
        let (raised, text) = g.group.poll_async();
        if let Some(t) = text {
            // The call succeeds; the failure it found is this thread's last error text.
            status::set_last(&format!("ncclEpGetAsyncError: {t}"));
        }
        // SAFETY: non-NULL output pointer (checked).
        unsafe { out.write(c_int::from(raised)) };
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn ncclEpErrorClear(group: *mut GroupBox) -> NcclResult {
    guard("ncclEpErrorClear", || {
        let g = group_ref(group, "ep_group")?;
        g.group.async_error.store(false, Ordering::SeqCst);
        Ok(())
    })
}

/// gin-ep's extra: the calling thread's last error text.
#[no_mangle]
pub extern "C" fn ncclEpGetLastError() -> *const c_char {
    status::last_ptr()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::offset_of;

    #[test]
    fn a_panic_becomes_internal_error_with_its_message() {
        let r = guard("ncclEpTest", || panic!("boom {}", 7));
        assert_eq!(r, NCCL_INTERNAL_ERROR);
        let last = status::last_text();
        assert!(last.contains("ncclEpTest") && last.contains("boom 7"), "{last}");
    }

    /// A caller's group config as raw bytes: `len` bytes, the fields below set, the rest
    /// filled with `fill` (bytes that are not the config's).
    fn config_bytes(size: u32, len: usize, fill: u8) -> Vec<u64> {
        let mut b = vec![fill; len];
        let mut put = |off: usize, v: &[u8]| b[off..off + v.len()].copy_from_slice(v);
        put(offset_of!(GroupConfig, size), &size.to_ne_bytes());
        put(offset_of!(GroupConfig, magic), &MAGIC.to_ne_bytes());
        put(offset_of!(GroupConfig, num_experts), &8u32.to_ne_bytes());
        put(offset_of!(GroupConfig, timeout_ns), &5u64.to_ne_bytes());
        if len >= 112 {
            put(offset_of!(GroupConfig, num_topk), &3u32.to_ne_bytes());
        }
        // 8-byte aligned storage, as a C struct with u64 fields has.
        b.chunks(8)
            .map(|c| u64::from_ne_bytes(c.try_into().unwrap()))
            .collect()
    }

    #[test]
    fn a_v1_struct_reads_its_v2_fields_as_zero() {
        // A V1 caller's 96 bytes, followed by bytes of something else.
        let words = config_bytes(96, 112, 0xA5);
        let r = read(words.as_ptr().cast::<GroupConfig>(), "config")
            .unwrap()
            .unwrap();
        assert_eq!((r.num_experts, r.timeout_ns), (8, 5));
        assert_eq!((r.zero_copy, r.overflow_policy, r.num_topk), (0, 0, 0));
    }

    #[test]
    fn a_future_struct_is_read_up_to_our_size() {
        let words = config_bytes(256, 256, 0x5A);
        let r = read(words.as_ptr().cast::<GroupConfig>(), "config")
            .unwrap()
            .unwrap();
        assert_eq!((r.size, r.num_experts, r.num_topk), (256, 8, 3));
    }

    #[test]
    fn short_and_foreign_structs_are_refused() {
        let words = config_bytes(95, 112, 0);
        let e = read(words.as_ptr().cast::<GroupConfig>(), "config").unwrap_err();
        assert_eq!(e.code, NCCL_INVALID_ARGUMENT);
        assert!(e.msg.contains("config->size = 95"), "{}", e.msg);
        let mut words = config_bytes(112, 112, 0);
        words[0] = 112 | (0xDEAD_u64 << 32);
        let e = read(words.as_ptr().cast::<GroupConfig>(), "config").unwrap_err();
        assert!(e.msg.contains("config->magic = 0xdead"), "{}", e.msg);
    }
}
