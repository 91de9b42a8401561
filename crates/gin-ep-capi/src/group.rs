//! `ncclEpGroup_t`: a group config read and checked against what gin-ep does ([`GroupSpec`]),
//! and the group object: the caller's communicator and one [`gin_ep::Ep`] per top-k and wire
//! format in use.
//!
//! NCCL EP fixes the top-k per handle and the wire format per call, where gin-ep fixes both
//! per `Ep`; so the group makes an `Ep` for a (top-k, format) pair the first time a handle or
//! a dispatch needs it. That creation is collective: every rank reaches it in the same call,
//! as NCCL EP's contract already requires of handle creation with an automatic buffer size
//! (make handles before capturing a CUDA graph, and run one FP8 dispatch before capturing
//! FP8 dispatches).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use gin_ep::backend::cuda::runtime::GIN_CONTEXTS;
use gin_ep::backend::cuda::DeviceBuffer;
use gin_ep::ep::GpuRank;
use gin_ep::{DispatchDtype, Ep, EpConfig};

use crate::abi::{self, GroupConfig};
use crate::status::{CResult, CapiError};

/// Which of gin-ep's two modes a group runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Algo {
    Ll,
    Ht,
}

/// A group config as gin-ep runs it.
#[derive(Clone, Debug, PartialEq)]
pub struct GroupSpec {
    pub algo: Algo,
    pub ranks: usize,
    pub rank: usize,
    pub experts: usize,
    pub max_tokens: usize,
    /// Channels per token: `max_token_bytes / 2` (BF16 rows, as callers size it).
    pub hidden: usize,
    /// HT: rows a rank's receive outputs hold (static sizing); None: query-then-allocate
    /// (NCCL EP's eager mode, `max_recv_tokens_per_rank` = AUTO), where the caller sizes them
    /// to the count `ncclEpUpdateHandle` writes. gin-ep's receive window holds the worst case
    /// either way.
    pub max_recv: Option<usize>,
    /// Deadline of every wait on a peer.
    pub timeout: Duration,
    /// Set in the V2 config: the only top-k handles may use.
    pub num_topk: Option<usize>,
    /// `max_num_sms`: CTAs of each LL kernel (None: gin-ep's default, every SM).
    pub max_sms: Option<u32>,
    /// `enable_mask`: LL rank masks; a peer that misses its deadline is masked.
    pub mask: bool,
}

/// The most ranks an LL rank mask covers (one bit each of a u64).
pub const MAX_MASK_RANKS: usize = 64;

/// The default deadline when `timeout_ns` is 0.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(100);

impl GroupSpec {
    /// Reads `c` (already size- and magic-checked) for a communicator of `ranks` ranks.
    /// ncclInvalidArgument: a value outside its type; ncclInvalidUsage: a request gin-ep
    /// does not implement, named with its value.
    pub fn new(c: &GroupConfig, ranks: usize, rank: usize) -> CResult<GroupSpec> {
        if c.version == 0 {
            return Err(CapiError::arg(
                "config->version = 0: set it to NCCL_EP_API_VERSION (NCCL_EP_GROUP_CONFIG_INIT does)",
            ));
        }
        let algo = match c.algorithm {
            abi::ALGO_LOW_LATENCY => Algo::Ll,
            abi::ALGO_HIGH_THROUGHPUT => Algo::Ht,
            a => {
                return Err(CapiError::arg(format!(
                    "config->algorithm = {a}: expected NCCL_EP_ALGO_LOW_LATENCY (0) or NCCL_EP_ALGO_HIGH_THROUGHPUT (1)"
                )))
            }
        };
        if c.num_experts == 0 {
            return Err(CapiError::arg("config->num_experts = 0: required"));
        }
        if c.max_dispatch_tokens_per_rank == 0 {
            return Err(CapiError::arg(
                "config->max_dispatch_tokens_per_rank = 0: required",
            ));
        }
        if c.max_token_bytes == 0 || !c.max_token_bytes.is_multiple_of(16) {
            return Err(CapiError::usage(format!(
                "config->max_token_bytes = {}: gin-ep needs the BF16 row bytes (2 x hidden), a positive multiple of 16",
                c.max_token_bytes
            )));
        }
        let max_recv = match (algo, c.max_recv_tokens_per_rank) {
            (Algo::Ll, 0) => None,
            (Algo::Ll, n) => {
                return Err(CapiError::usage(format!(
                    "config->max_recv_tokens_per_rank = {n} with LL: it bounds HT receives only (LL \
                     receives ranks x max_dispatch_tokens_per_rank rows per local expert); pass NCCL_EP_AUTO"
                )))
            }
            (Algo::Ht, 0) => None,
            (Algo::Ht, n) if n < c.max_dispatch_tokens_per_rank => {
                return Err(CapiError::arg(format!(
                    "config->max_recv_tokens_per_rank = {n}: below max_dispatch_tokens_per_rank = {}",
                    c.max_dispatch_tokens_per_rank
                )))
            }
            (Algo::Ht, n) => Some(n as usize),
        };
        let mask = c.enable_mask != 0;
        if mask && algo == Algo::Ht {
            return Err(CapiError::usage(format!(
                "config->enable_mask = {} with HT: rank masks are LL only (as NCCL EP's)",
                c.enable_mask
            )));
        }
        if mask && ranks > MAX_MASK_RANKS {
            return Err(CapiError::usage(format!(
                "config->enable_mask = {} on {ranks} ranks: gin-ep's LL rank mask is one 64-bit word \
                 (at most {MAX_MASK_RANKS} ranks)",
                c.enable_mask
            )));
        }
        let a = &c.alloc;
        if a.alloc_fn.is_null() != a.free_fn.is_null() {
            return Err(CapiError::usage(format!(
                "config->alloc: alloc_fn = {:?}, free_fn = {:?}: give both or neither",
                a.alloc_fn, a.free_fn
            )));
        }
        if a.alloc_fn.is_null() && !a.context.is_null() {
            return Err(CapiError::usage(format!(
                "config->alloc.context = {:?} without alloc_fn and free_fn: nothing would receive it",
                a.context
            )));
        }
        // A budget of queue pairs: gin-ep's device communicator opens GIN_CONTEXTS GIN
        // contexts (one queue pair each per peer), whatever the group's size.
        if c.num_qp_per_rank != 0 && c.num_qp_per_rank < GIN_CONTEXTS {
            return Err(CapiError::usage(format!(
                "config->num_qp_per_rank = {}: gin-ep's transport uses {GIN_CONTEXTS} GIN contexts \
                 (one queue pair each per peer); give at least {GIN_CONTEXTS} or NCCL_EP_AUTO",
                c.num_qp_per_rank
            )));
        }
        if c.num_channels != 0 {
            return Err(CapiError::usage(format!(
                "config->num_channels = {}: gin-ep has no channel count to set (its HT kernels take \
                 max_num_sms CTAs); pass NCCL_EP_AUTO",
                c.num_channels
            )));
        }
        if c.rdma_buffer_size != 0 {
            return Err(CapiError::usage(format!(
                "config->rdma_buffer_size = {}: gin-ep sizes its buffers itself; pass NCCL_EP_AUTO",
                c.rdma_buffer_size
            )));
        }
        // V2 fields (zero when the caller's struct ends at V1).
        if c.zero_copy == abi::ZERO_COPY_ON {
            return Err(CapiError::usage(
                "config->zero_copy = NCCL_EP_ZERO_COPY_ON: gin-ep takes no window-backed tensors",
            ));
        }
        if c.overflow_policy != abi::OVERFLOW_AUTO && c.overflow_policy != abi::OVERFLOW_TRAP {
            return Err(CapiError::usage(format!(
                "config->overflow_policy = {}: gin-ep refuses an overflowing receive (AUTO or TRAP)",
                c.overflow_policy
            )));
        }
        let timeout = if c.timeout_ns == 0 {
            DEFAULT_TIMEOUT
        } else {
            Duration::from_nanos(c.timeout_ns)
        };
        let spec = GroupSpec {
            algo,
            ranks,
            rank,
            experts: c.num_experts as usize,
            max_tokens: c.max_dispatch_tokens_per_rank as usize,
            hidden: c.max_token_bytes as usize / 2,
            max_recv,
            timeout,
            num_topk: (c.num_topk != 0).then_some(c.num_topk as usize),
            max_sms: (c.max_num_sms != 0).then_some(c.max_num_sms),
            mask,
        };
        // The shape checks gin-ep makes of every config, at a stand-in top-k of 1.
        spec.ep_config(spec.num_topk.unwrap_or(1), DispatchDtype::Bf16)?;
        Ok(spec)
    }

    /// gin-ep's config for handles of top-k `topk` and dispatches in `dtype`.
    pub fn ep_config(&self, topk: usize, dtype: DispatchDtype) -> CResult<EpConfig> {
        let cfg =
            EpConfig::new(self.ranks, self.experts, self.hidden, topk, self.max_tokens).with_dtype(dtype);
        cfg.validate()?;
        Ok(cfg)
    }

    pub fn local_experts(&self) -> usize {
        self.experts / self.ranks
    }

    /// Checks a handle's top-k against the group's (when set) and gin-ep's limits.
    pub fn check_topk(&self, topk: usize) -> CResult<()> {
        if let Some(k) = self.num_topk {
            if topk > k {
                return Err(CapiError::arg(format!(
                    "num_topk = {topk}: above the group's config->num_topk = {k}"
                )));
            }
        }
        self.ep_config(topk, DispatchDtype::Bf16).map(|_| ())
    }
}

/// How the group makes an engine on its rank (collective): [`crate::ffi`] gives gin-ep's.
pub type OpenEngine = fn(rank: &GpuRank, cfg: &EpConfig, spec: &GroupSpec) -> CResult<Ep>;

/// An `ncclEpGroup_t`.
pub struct Group {
    pub spec: GroupSpec,
    /// This process's rank of the caller's communicator (borrowed; it outlives the group).
    rank: GpuRank,
    open: OpenEngine,
    engines: Mutex<Vec<((usize, DispatchDtype), Ep)>>,
    /// Set by an operation that failed on a peer or a kernel; read by ncclEpGetAsyncError.
    pub async_error: AtomicBool,
    /// `enable_mask`: the rank mask every LL engine of the group reads (declared after the
    /// engines, so it outlives them).
    mask: Option<Mask>,
}

/// A group's LL rank mask: the device word the kernels read and write (bit p set: rank p
/// is masked), an `int[ranks]` staging area for `ncclEpMaskQuery`, and the word as the caller
/// last set it, so a bit a kernel set (a peer past its deadline) is told apart.
pub struct Mask {
    word: DeviceBuffer,
    ints: DeviceBuffer,
    set_by_caller: AtomicU64,
}

impl Mask {
    /// A mask of `ranks` ranks, every rank active.
    pub fn new(rank: &GpuRank, ranks: usize) -> CResult<Mask> {
        let word = rank.alloc(16)?;
        rank.upload_to(0, &word, &[0u8; 16])?;
        Ok(Mask {
            word,
            ints: rank.alloc((ranks * 4).max(16))?,
            set_by_caller: AtomicU64::new(0),
        })
    }
}

/// `ncclEpMaskUpdate`'s `int[ranks]` (1 active, 0 masked) as the mask word.
pub fn mask_word(active: &[i32]) -> CResult<u64> {
    let mut w = 0u64;
    for (p, &v) in active.iter().enumerate() {
        match v {
            1 => {}
            0 => w |= 1 << p,
            v => {
                return Err(CapiError::arg(format!(
                    "mask[{p}] = {v}: 1 (active) or 0 (masked)"
                )))
            }
        }
    }
    Ok(w)
}

/// The mask word as `ncclEpMaskQuery`'s `int[ranks]` (1 active, 0 masked), native-endian bytes.
pub fn mask_ints(word: u64, ranks: usize) -> Vec<u8> {
    (0..ranks)
        .flat_map(|p| i32::from(word >> p & 1 == 0).to_ne_bytes())
        .collect()
}

impl Group {
    pub fn new(spec: GroupSpec, rank: GpuRank, open: OpenEngine, mask: Option<Mask>) -> Group {
        Group {
            spec,
            rank,
            open,
            engines: Mutex::new(Vec::new()),
            async_error: AtomicBool::new(false),
            mask,
        }
    }

    fn mask(&self, what: &str) -> CResult<&Mask> {
        self.mask.as_ref().ok_or_else(|| {
            CapiError::usage(format!(
                "{what}: the group was made with enable_mask = 0 (rank masks need enable_mask = 1)"
            ))
        })
    }

    /// `ncclEpGroupDestroy`'s collective part (every rank destroys its group): each engine,
    /// in the order the group made them (the same on every rank for the same program),
    /// waits across gin-ep nodes until every rank got here ([`Ep::quiesce`]), so no rank's
    /// teardown strands a peer's rows still in its GIN proxy's queue.
    pub fn quiesce(&self) -> CResult<()> {
        for ep in self.engines() {
            self.note(ep.quiesce().map_err(CapiError::from))?;
        }
        Ok(())
    }

    fn engines(&self) -> Vec<Ep> {
        let e = self
            .engines
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        e.iter().map(|(_, ep)| ep.clone()).collect()
    }

    /// `ncclEpMaskQuery`: after the work queued on `stream`, `int[ranks]` at `dst` (device).
    pub fn mask_query(&self, stream: u64, dst: u64) -> CResult<()> {
        let m = self.mask("ncclEpMaskQuery")?;
        let word = self.note(self.rank.read_u64(stream, &m.word).map_err(CapiError::from))?;
        let ints = mask_ints(word, self.spec.ranks);
        self.rank.upload_to(stream, &m.ints, &ints)?;
        self.rank.copy_to_caller(stream, &m.ints, (dst, ints.len()))?;
        Ok(())
    }

    /// `ncclEpMaskUpdate`: the mask from `active` (`int[ranks]`), in stream order.
    pub fn mask_update(&self, stream: u64, active: &[i32]) -> CResult<()> {
        let m = self.mask("ncclEpMaskUpdate")?;
        let w = mask_word(active)?;
        self.rank.upload_to(stream, &m.word, &w.to_le_bytes())?;
        m.set_by_caller.store(w, Ordering::SeqCst);
        Ok(())
    }

    /// `ncclEpMaskClean` (collective): every engine's LL state reset (handles of earlier
    /// dispatches become stale), then every rank active. The async error flag stays.
    pub fn mask_clean(&self, stream: u64) -> CResult<()> {
        let m = self.mask("ncclEpMaskClean")?;
        for ep in self.engines() {
            self.note(ep.ll_reset(gin_ep::ep::Stream(stream)).map_err(CapiError::from))?;
        }
        self.rank.upload_to(stream, &m.word, &[0u8; 8])?;
        m.set_by_caller.store(0, Ordering::SeqCst);
        Ok(())
    }

    /// This process's rank of the caller's communicator.
    pub fn rank(&self) -> &GpuRank {
        &self.rank
    }

    /// The engine of (`topk`, `dtype`), made on first use (collective).
    pub fn engine(&self, topk: usize, dtype: DispatchDtype) -> CResult<Ep> {
        let mut engines = self
            .engines
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((_, ep)) = engines.iter().find(|(k, _)| *k == (topk, dtype)) {
            return Ok(ep.clone());
        }
        let cfg = self.spec.ep_config(topk, dtype)?;
        let ep = self.note((self.open)(&self.rank, &cfg, &self.spec))?;
        if let Some(m) = &self.mask {
            // shrink: a peer past its deadline is masked, and the operation goes on.
            let word = (m.word.region().device_ptr(), m.word.len());
            ep.set_ll_rank_mask_word(Some(word), true)?;
        }
        engines.push(((topk, dtype), ep.clone()));
        Ok(ep)
    }

    /// `ncclEpGetAsyncError`: whether a peer or a kernel failed since the flag was cleared.
    /// Besides the failures calls returned, asks each engine for a failure a kernel recorded
    /// (a missed in-kernel deadline): `sync` of the rank's own stream, which the caller's
    /// work does not use, so it returns at once with what the kernels recorded. Returns the
    /// failure's text when this poll found one.
    pub fn poll_async(&self) -> (bool, Option<String>) {
        if self.async_error.load(Ordering::SeqCst) {
            return (true, None);
        }
        if let Some(m) = &self.mask {
            // On the rank's own stream: reads the word as the kernels left it so far.
            match self.rank.read_u64(0, &m.word) {
                Ok(w) => {
                    let by_kernel = w & !m.set_by_caller.load(Ordering::SeqCst);
                    if by_kernel != 0 {
                        self.async_error.store(true, Ordering::SeqCst);
                        let peers: Vec<usize> = (0..64).filter(|p| by_kernel >> p & 1 == 1).collect();
                        return (
                            true,
                            Some(format!("peers {peers:?} missed their deadline and were masked")),
                        );
                    }
                }
                Err(e) => {
                    let e = CapiError::from(e);
                    let _ = self.note::<()>(Err(e.clone()));
                    return (self.async_error.load(Ordering::SeqCst), Some(e.msg));
                }
            }
        }
        for ep in self.engines() {
            if let Err(e) = self.note(ep.sync(gin_ep::ep::Stream(0)).map_err(CapiError::from)) {
                return (self.async_error.load(Ordering::SeqCst), Some(e.msg));
            }
        }
        (false, None)
    }

    /// Passes `r` on, raising the async error flag when a peer or a kernel caused it.
    pub fn note<T>(&self, r: CResult<T>) -> CResult<T> {
        if let Err(e) = &r {
            if e.is_async() {
                self.async_error.store(true, Ordering::SeqCst);
            }
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub fn ll_config() -> GroupConfig {
        let mut c: GroupConfig = crate::ffi::zeroed();
        c.size = 112;
        c.magic = abi::MAGIC;
        c.version = 2;
        c.num_experts = 16;
        c.max_dispatch_tokens_per_rank = 128;
        c.max_token_bytes = 2 * 1024;
        c
    }

    #[test]
    fn ll_config_maps_to_gin_ep() {
        let s = GroupSpec::new(&ll_config(), 4, 1).unwrap();
        assert_eq!(
            (s.algo, s.hidden, s.experts, s.max_tokens),
            (Algo::Ll, 1024, 16, 128)
        );
        assert_eq!(s.timeout, DEFAULT_TIMEOUT);
        assert_eq!(s.local_experts(), 4);
    }

    #[test]
    fn masks_are_ll_only_and_fit_one_word() {
        let mut c = ll_config();
        c.enable_mask = 1;
        c.num_experts = 128;
        assert!(GroupSpec::new(&c, 64, 0).unwrap().mask);
        let e = GroupSpec::new(&c, 128, 0).unwrap_err();
        assert_eq!(e.code, abi::NCCL_INVALID_USAGE);
        assert!(e.msg.contains("enable_mask = 1 on 128 ranks"), "{}", e.msg);
        c.algorithm = abi::ALGO_HIGH_THROUGHPUT;
        c.max_recv_tokens_per_rank = 512;
        let e = GroupSpec::new(&c, 4, 0).unwrap_err();
        assert!(e.msg.contains("enable_mask = 1 with HT"), "{}", e.msg);
    }

    #[test]
    fn mask_word_and_ints_round_trip() {
        assert_eq!(mask_word(&[1, 0, 1, 0]).unwrap(), 0b1010);
        let ints = mask_ints(0b1010, 4);
        let back: Vec<i32> = ints
            .chunks(4)
            .map(|b| i32::from_ne_bytes(b.try_into().unwrap()))
            .collect();
        assert_eq!(back, vec![1, 0, 1, 0]);
        let mut all = vec![1; 64];
        all[63] = 0;
        assert_eq!(mask_word(&all).unwrap(), 1 << 63);
        let e = mask_word(&[1, 2]).unwrap_err();
        assert_eq!(e.code, abi::NCCL_INVALID_ARGUMENT);
        assert!(e.msg.contains("mask[1] = 2"), "{}", e.msg);
    }

    #[test]
    fn unsupported_requests_name_field_and_value() {
        let mut c = ll_config();
        c.overflow_policy = 2;
        let e = GroupSpec::new(&c, 4, 0).unwrap_err();
        assert!(e.msg.contains("overflow_policy = 2"), "{}", e.msg);

        let mut c = ll_config();
        c.num_experts = 15;
        let e = GroupSpec::new(&c, 4, 0).unwrap_err();
        assert_eq!(e.code, abi::NCCL_INVALID_USAGE);
        assert!(e.msg.contains("experts = 15"), "{}", e.msg);
    }

    #[test]
    fn transport_and_allocator_fields_are_honoured_or_refused() {
        let mut c = ll_config();
        c.num_qp_per_rank = GIN_CONTEXTS;
        GroupSpec::new(&c, 4, 0).unwrap();
        c.num_qp_per_rank = GIN_CONTEXTS - 1;
        let e = GroupSpec::new(&c, 4, 0).unwrap_err();
        assert_eq!(e.code, abi::NCCL_INVALID_USAGE);
        assert!(
            e.msg.contains(&format!("num_qp_per_rank = {}", GIN_CONTEXTS - 1)),
            "{}",
            e.msg
        );

        let mut c = ll_config();
        c.num_channels = 10;
        let e = GroupSpec::new(&c, 4, 0).unwrap_err();
        assert_eq!(e.code, abi::NCCL_INVALID_USAGE);
        assert!(e.msg.contains("num_channels = 10"), "{}", e.msg);

        let mut c = ll_config();
        c.max_recv_tokens_per_rank = 512;
        let e = GroupSpec::new(&c, 4, 0).unwrap_err();
        assert!(
            e.msg.contains("max_recv_tokens_per_rank = 512 with LL"),
            "{}",
            e.msg
        );

        let f = 0x1000 as *mut std::ffi::c_void;
        let mut c = ll_config();
        c.alloc.alloc_fn = f;
        let e = GroupSpec::new(&c, 4, 0).unwrap_err();
        assert_eq!(e.code, abi::NCCL_INVALID_USAGE);
        assert!(e.msg.contains("give both or neither"), "{}", e.msg);
        c.alloc.free_fn = f;
        GroupSpec::new(&c, 4, 0).unwrap();
        let mut c = ll_config();
        c.alloc.context = f;
        let e = GroupSpec::new(&c, 4, 0).unwrap_err();
        assert!(e.msg.contains("config->alloc.context"), "{}", e.msg);
    }

    #[test]
    fn bad_values_are_invalid_arguments() {
        let mut c = ll_config();
        c.algorithm = 7;
        let e = GroupSpec::new(&c, 4, 0).unwrap_err();
        assert_eq!(e.code, abi::NCCL_INVALID_ARGUMENT);
        assert!(e.msg.contains("algorithm = 7"), "{}", e.msg);

        let mut c = ll_config();
        c.algorithm = abi::ALGO_HIGH_THROUGHPUT;
        // NCCL_EP_AUTO: query-then-allocate (outputs sized to ncclEpUpdateHandle's count).
        assert_eq!(GroupSpec::new(&c, 4, 0).unwrap().max_recv, None);
        c.max_recv_tokens_per_rank = 4 * 128;
        assert_eq!(GroupSpec::new(&c, 4, 0).unwrap().max_recv, Some(512));
        c.max_recv_tokens_per_rank = 64;
        let e = GroupSpec::new(&c, 4, 0).unwrap_err();
        assert!(e.msg.contains("max_recv_tokens_per_rank = 64"), "{}", e.msg);
    }

    #[test]
    fn timeout_and_topk_bound_are_read() {
        let mut c = ll_config();
        c.timeout_ns = 2_000_000_000;
        c.num_topk = 4;
        let s = GroupSpec::new(&c, 4, 0).unwrap();
        assert_eq!(s.timeout, Duration::from_secs(2));
        s.check_topk(4).unwrap();
        let e = s.check_topk(5).unwrap_err();
        assert!(e.msg.contains("num_topk = 5"), "{}", e.msg);
    }
}
