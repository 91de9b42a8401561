//! The C ABI's types as Rust declares them: every struct of `include/nccl_ep.h`, `repr(C)`, with
//! its frozen sizes asserted at compile time. Enums are plain integers here: a caller may pass
//! any value, and the library names a bad one instead of assuming it is valid.
//!
//! Every struct holds only integers and raw pointers, so all-zero bytes are a valid value (the
//! default of every field) and so is any prefix of a caller's struct followed by zeros: this is
//! what lets [`crate::ffi`] read a struct of an older, shorter version.

use std::ffi::c_void;
use std::mem::{offset_of, size_of};

pub type NcclResult = i32;
pub const NCCL_SUCCESS: NcclResult = 0;
pub const NCCL_INTERNAL_ERROR: NcclResult = 3;
pub const NCCL_INVALID_ARGUMENT: NcclResult = 4;
pub const NCCL_INVALID_USAGE: NcclResult = 5;
pub const NCCL_REMOTE_ERROR: NcclResult = 6;

/// `ncclDataType_t` values.
pub const NCCL_UINT8: i32 = 1;
pub const NCCL_INT32: i32 = 2;
pub const NCCL_INT64: i32 = 4;
pub const NCCL_FLOAT32: i32 = 7;
pub const NCCL_BFLOAT16: i32 = 9;
pub const NCCL_FLOAT8E4M3: i32 = 10;

pub const VERSION_CODE: i32 = 100; // 0.1.0
pub const API_VERSION: u32 = 2;
pub const MAGIC: u32 = 0xC00F_FFEE;
pub const TENSOR_MAGIC: u32 = 0xCAFE_CAFE;
/// The magic of descriptors this library allocated (`ncclEpTensorAlloc`); callers never
/// spell it.
pub const TENSOR_ALLOC_MAGIC: u32 = 0x61E9_A110;

pub const ALGO_LOW_LATENCY: u32 = 0;
pub const ALGO_HIGH_THROUGHPUT: u32 = 1;

pub const LAYOUT_UNSET: u32 = 0;
pub const LAYOUT_EXPERT_MAJOR: u32 = 1;
pub const LAYOUT_RANK_MAJOR: u32 = 2;
pub const LAYOUT_FLAT: u32 = 3;

pub const OVERFLOW_AUTO: u32 = 0;
pub const OVERFLOW_TRAP: u32 = 1;
pub const ZERO_COPY_ON: u32 = 2;
pub const EXPERT_ID_GLOBAL: u32 = 2;
pub const FWD_PASS: u32 = 0;
pub const BWD_PASS: u32 = 1;
pub const DISP_QUANT_NONE: u32 = 0;
pub const DISP_QUANT_FWD: u32 = 1;
pub const DISP_QUANT_DS_FP8E3M4: u32 = 2;
pub const COMB_QUANT_NONE: u32 = 0;

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Tensor {
    pub size: u32,
    pub magic: u32,
    pub ndim: u32,
    pub datatype: i32,
    pub data: *mut c_void,
    pub win_hdl: *mut c_void,
    pub win_offset: u64,
    pub sizes: *mut usize,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct TensorAllocConfig {
    pub size: u32,
    pub magic: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct AllocConfig {
    pub alloc_fn: *mut c_void,
    pub free_fn: *mut c_void,
    pub context: *mut c_void,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct GroupConfig {
    pub size: u32,
    pub magic: u32,
    pub version: u32,
    pub algorithm: u32,
    pub num_experts: u32,
    pub max_dispatch_tokens_per_rank: u32,
    pub max_recv_tokens_per_rank: u32,
    pub max_token_bytes: u32,
    pub rdma_buffer_size: u64,
    pub num_qp_per_rank: u32,
    pub num_channels: u32,
    pub max_num_sms: u32,
    pub alloc: AllocConfig,
    pub enable_mask: u32,
    pub timeout_ns: u64,
    // V2
    pub zero_copy: u32,
    pub overflow_policy: u32,
    pub num_topk: u32,
    pub padding_v2: [u8; 4],
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct LayoutInfo {
    pub size: u32,
    pub magic: u32,
    pub expert_counters: *mut Tensor,
    pub src_rank_counters: *mut Tensor,
    pub expert_offsets: *mut Tensor,
    pub recv_total_counter: *mut Tensor,
    // V2
    pub recv_topk_idx_kind: u32,
    pub padding_v2: [u8; 4],
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DispatchInputs {
    pub size: u32,
    pub magic: u32,
    pub tokens: *mut Tensor,
    pub topk_weights: *mut Tensor,
    pub scales: *mut Tensor,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DispatchOutputs {
    pub size: u32,
    pub magic: u32,
    pub tokens: *mut Tensor,
    pub topk_weights: *mut Tensor,
    pub scales: *mut Tensor,
    pub topk_idx: *mut Tensor,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CombineInputs {
    pub size: u32,
    pub magic: u32,
    pub tokens: *mut Tensor,
    pub topk_weights: *mut Tensor,
    // V2
    pub scales: *mut Tensor,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CombineOutputs {
    pub size: u32,
    pub magic: u32,
    pub tokens: *mut Tensor,
    pub topk_weights: *mut Tensor,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct HandleConfig {
    pub size: u32,
    pub magic: u32,
    pub dispatch_output_per_expert_alignment: usize,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DispatchConfig {
    pub size: u32,
    pub magic: u32,
    pub send_only: u32,
    pub round_scales: u32,
    pub pass_direction: u32,
    // V2
    pub quant_recipe: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CombineConfig {
    pub size: u32,
    pub magic: u32,
    pub send_only: u32,
    pub pass_direction: u32,
    // V2
    pub quant_recipe: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CompleteConfig {
    pub size: u32,
    pub magic: u32,
}

/// One versioned struct: its C name and the size of its first release.
pub trait Versioned: Copy {
    const NAME: &'static str;
    const V1_SIZE: u32;
    const MAGIC: u32 = MAGIC;
}

macro_rules! versioned {
    ($t:ty, $name:literal, $v1:expr, $current:expr) => {
        impl Versioned for $t {
            const NAME: &'static str = $name;
            const V1_SIZE: u32 = $v1;
        }
        const _: () = assert!(size_of::<$t>() == $current);
    };
}

versioned!(TensorAllocConfig, "ncclEpTensorAllocConfig_t", 8, 8);
versioned!(GroupConfig, "ncclEpGroupConfig_t", 96, 112);
versioned!(LayoutInfo, "ncclEpLayoutInfo_t", 40, 48);
versioned!(DispatchInputs, "ncclEpDispatchInputs_t", 32, 32);
versioned!(DispatchOutputs, "ncclEpDispatchOutputs_t", 40, 40);
versioned!(CombineInputs, "ncclEpCombineInputs_t", 24, 32);
versioned!(CombineOutputs, "ncclEpCombineOutputs_t", 24, 24);
versioned!(HandleConfig, "ncclEpHandleConfig_t", 16, 16);
versioned!(DispatchConfig, "ncclEpDispatchConfig_t", 20, 24);
versioned!(CombineConfig, "ncclEpCombineConfig_t", 16, 20);
versioned!(CompleteConfig, "ncclEpCompleteConfig_t", 8, 8);

impl Versioned for Tensor {
    const NAME: &'static str = "ncclEpTensor_t";
    const V1_SIZE: u32 = 48;
    const MAGIC: u32 = TENSOR_MAGIC;
}
const _: () = assert!(size_of::<Tensor>() == 48);

// The V1 boundaries fall where the header says (the end of each V1 struct's last field).
const _: () = assert!(offset_of!(GroupConfig, timeout_ns) + 8 == 96);
const _: () = assert!(offset_of!(GroupConfig, alloc) == 56);
const _: () = assert!(offset_of!(GroupConfig, zero_copy) == 96);
const _: () = assert!(offset_of!(LayoutInfo, recv_total_counter) + 8 == 40);
const _: () = assert!(offset_of!(CombineInputs, topk_weights) + 8 == 24);
const _: () = assert!(offset_of!(DispatchConfig, pass_direction) + 4 == 20);
const _: () = assert!(offset_of!(CombineConfig, pass_direction) + 4 == 16);
const _: () = assert!(offset_of!(Tensor, sizes) == 40);
