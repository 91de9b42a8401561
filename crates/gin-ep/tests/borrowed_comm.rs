//! An `Ep` made from a communicator the caller created through NCCL's own API
//! (`ncclGetUniqueId` / `ncclCommInitRank`), which gin-ep borrows: one HT round (dispatch,
//! combine) and one LL round (dispatch, combine) on the GPU equal the oracle bit for bit, and
//! the communicator is still the caller's afterwards (usable, then destroyed by the caller).
//!
//! GPU-gated: without a CUDA driver, a GPU, embedded kernels or NCCL the test says why and
//! passes (as the rest of `cargo test` on a machine without GPUs). With GPUs it starts one
//! process per GPU (at most `GIN_EP_TEST_GPUS`, default 4) of this same test binary, each
//! running [`borrowed_comm_rank`] as one rank, and waits for them with a deadline.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cudarc::driver::{result, sys, CudaContext};
use gin_ep::ep::{
    Ep, EpOptions, GpuRank, GpuRankOptions, HtCombineIn, HtCombineOut, HtDispatchIn, HtOutput, LlCombineIn,
    LlDispatchIn, LlDispatchOut, LlHalf, Mem, RecvSlab, Stream,
};
use gin_ep::ht::{HtCombineInput, HtCombineOutput, HtDispatchOutput};
use gin_ep::ll::LlDispatchOutput;
use gin_ep::quant::Rows;
use gin_ep::workload::{Routing, Workload};
use gin_ep::{oracle, DispatchDtype, EpConfig, Error, Result};
use gin_ep_sys as ns;
use half::bf16;

/// `RANK,WORLD,HEX(unique id)` of a child rank.
const ENV_CHILD: &str = "GIN_EP_TEST_BORROWED_RANK";
const DEADLINE: Duration = Duration::from_secs(300);

/// Why this machine cannot run the test, or the number of GPUs it has.
fn gpus() -> std::result::Result<usize, String> {
    let drv = gin_ep::backend::cuda::driver::probe().map_err(|e| e.to_string())?;
    if drv.device_count < 1 {
        return Err("no GPU".into());
    }
    let (sets, _) = gin_ep::ep::kernels_info();
    if !sets.iter().any(|s| s.2) {
        let why: Vec<_> = sets.iter().filter_map(|s| s.3).collect();
        return Err(format!("no CUDA kernels embedded ({})", why.join("; ")));
    }
    ns::Nccl::load().map_err(|e| e.to_string())?;
    Ok(drv.device_count as usize)
}

#[test]
fn an_ep_on_a_borrowed_communicator_equals_the_oracle() {
    let gpus = match gpus() {
        Ok(n) => n,
        Err(why) => {
            eprintln!("skipped: {why}");
            return;
        }
    };
    let most = std::env::var("GIN_EP_TEST_GPUS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(4);
    let world = gpus.min(most).max(1);
    let nccl = ns::Nccl::load().expect("NCCL loaded above");
    let mut id = ns::ncclUniqueId::default();
    // SAFETY: writes one ncclUniqueId.
    assert_eq!(unsafe { (nccl.ncclGetUniqueId)(&mut id) }, ns::ncclSuccess);
    let hex: String = id.internal.iter().map(|&c| format!("{:02x}", c as u8)).collect();
    let exe = std::env::current_exe().expect("the test binary");
    let mut children: Vec<(usize, Child)> = (0..world)
        .map(|r| {
            let child = Command::new(&exe)
                .args([
                    "--exact",
                    "borrowed_comm_rank",
                    "--ignored",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env(ENV_CHILD, format!("{r},{world},{hex}"))
                .env("NCCL_NVLS_ENABLE", "0")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("start a rank");
            (r, child)
        })
        .collect();
    let start = Instant::now();
    let mut failed = Vec::new();
    while !children.is_empty() {
        let mut i = 0;
        while i < children.len() {
            match children[i].1.try_wait().expect("poll a rank") {
                Some(status) => {
                    let (r, child) = children.swap_remove(i);
                    let out = child.wait_with_output().expect("a rank's output");
                    let text = format!(
                        "{}{}",
                        String::from_utf8_lossy(&out.stdout),
                        String::from_utf8_lossy(&out.stderr)
                    );
                    // A child whose filter matched nothing prints "0 passed": never a pass.
                    if !status.success() || !text.contains("1 passed") {
                        failed.push(format!("rank {r} ({status}):\n{text}"));
                    }
                }
                None => i += 1,
            }
        }
        if start.elapsed() > DEADLINE {
            for (r, mut c) in children.drain(..) {
                let _ = c.kill();
                let _ = c.wait();
                failed.push(format!("rank {r}: not finished within {DEADLINE:?}"));
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

/// One rank of [`an_ep_on_a_borrowed_communicator_equals_the_oracle`] (started by it).
#[test]
#[ignore = "a rank of an_ep_on_a_borrowed_communicator_equals_the_oracle, which starts it"]
fn borrowed_comm_rank() {
    let Ok(spec) = std::env::var(ENV_CHILD) else {
        eprintln!("skipped: only as a rank started by the borrowed-communicator test");
        return;
    };
    let mut parts = spec.split(',');
    let mut num = || {
        parts
            .next()
            .and_then(|v| v.parse::<usize>().ok())
            .expect(ENV_CHILD)
    };
    let (me, world) = (num(), num());
    let hex = spec.rsplit(',').next().expect(ENV_CHILD);
    let mut id = ns::ncclUniqueId::default();
    for (i, d) in id.internal.iter_mut().enumerate() {
        *d = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).expect("hex") as std::ffi::c_char;
    }
    if let Err(e) = run_rank(me, world, id) {
        panic!("rank {me}: {e}");
    }
}

fn run_rank(me: usize, world: usize, id: ns::ncclUniqueId) -> Result<()> {
    // The caller's world: its context current, its NCCL, its communicator.
    let ctx = CudaContext::new(me).map_err(|e| Error::input("cuda context", format!("{e:?}")))?;
    let nccl = ns::Nccl::load().map_err(|e| Error::input("nccl", e))?;
    let mut comm: ns::ncclComm_t = std::ptr::null_mut();
    // SAFETY: the context of GPU `me` is current on this thread; comm receives the communicator.
    let r = unsafe { (nccl.ncclCommInitRank)(&mut comm, world as i32, id, me as i32) };
    if r != ns::ncclSuccess {
        return Err(Error::input("ncclCommInitRank", nccl.error_string(r)));
    }
    let out = (|| {
        let opts = GpuRankOptions {
            timeout: Duration::from_secs(60),
            nccl_version: Some({
                let mut v = 0;
                // SAFETY: writes one int.
                unsafe { (nccl.ncclGetVersion)(&mut v) };
                v
            }),
        };
        // SAFETY: comm is live and destroyed below, after the rank and the Ep have dropped.
        let rank = unsafe { GpuRank::from_comm(comm.cast(), opts)? };
        assert!(rank.borrows_comm());
        assert_eq!((rank.info().rank, rank.info().world), (me, world));
        let cfg = EpConfig::new(world, 4 * world, 256, 3, 32).with_dtype(DispatchDtype::Bf16);
        let ep = Ep::on_rank(
            &rank,
            &cfg,
            &EpOptions {
                timeout: Duration::from_secs(60),
                ..EpOptions::default()
            },
        )?;
        assert_eq!(ep.rank(), me);
        rounds(&ep, &cfg, me)
    })();
    // gin-ep is gone; the communicator must still be the caller's and work.
    let mut count = 0;
    // SAFETY: comm is live (gin-ep never destroys a borrowed communicator); writes one int.
    let r = unsafe { (nccl.ncclCommCount)(comm, &mut count) };
    let still = r == ns::ncclSuccess && count as usize == world;
    // SAFETY: comm is the caller's (this test's) and nothing else uses it now.
    unsafe {
        (nccl.ncclCommFinalize)(comm);
        (nccl.ncclCommDestroy)(comm);
    }
    drop(ctx);
    out?;
    if !still {
        return Err(Error::Mismatch(format!(
            "rank {me}: the communicator after gin-ep dropped: ncclCommCount {r}, count {count}"
        )));
    }
    Ok(())
}

/// Device memory of the test (the caller's tensors), freed on drop.
struct Dev {
    ptr: sys::CUdeviceptr,
    bytes: usize,
}

impl Dev {
    fn zeroed(bytes: usize) -> Dev {
        let bytes = bytes.max(16);
        // SAFETY: plain allocation in the current context, then a synchronous fill.
        unsafe {
            let ptr = result::malloc_sync(bytes).expect("cuMemAlloc");
            result::memset_d8_sync(ptr, 0xff, bytes).expect("cuMemsetD8");
            Dev { ptr, bytes }
        }
    }
    fn of<T: Copy>(v: &[T]) -> Dev {
        let d = Dev::zeroed(std::mem::size_of_val(v));
        // SAFETY: d holds at least size_of_val(v) bytes.
        unsafe { result::memcpy_htod_sync(d.ptr, v).expect("cuMemcpyHtoD") };
        d
    }
    fn read<T: Copy + Default>(&self, n: usize) -> Vec<T> {
        let mut v = vec![T::default(); n];
        assert!(std::mem::size_of_val(&v[..]) <= self.bytes);
        // SAFETY: v has room for n values, within self's bytes.
        unsafe { result::memcpy_dtoh_sync(&mut v, self.ptr).expect("cuMemcpyDtoH") };
        v
    }
    fn mem<T>(&self) -> Mem<'static, T> {
        Mem::Device {
            ptr: self.ptr,
            bytes: self.bytes,
        }
    }
    fn out(&self) -> gin_ep::ep::DeviceOut {
        gin_ep::ep::DeviceOut {
            ptr: self.ptr,
            bytes: self.bytes,
        }
    }
}

impl Drop for Dev {
    fn drop(&mut self) {
        // SAFETY: allocated by malloc_sync; every operation on it was waited for.
        unsafe {
            let _ = result::free_sync(self.ptr);
        }
    }
}

fn bf16_rows(r: &Rows) -> &[bf16] {
    match r {
        Rows::Bf16(v) => v,
        Rows::Fp8 { .. } => panic!("a BF16 config"),
    }
}

/// One HT and one LL round on `ep` against the oracle (every rank computes it for all).
fn rounds(ep: &Ep, cfg: &EpConfig, me: usize) -> Result<()> {
    let tokens: Vec<usize> = (0..cfg.ranks).map(|r| [7, 32, 0, 19][r % 4]).collect();
    let w = Workload {
        routing: Routing::Uniform,
        seed: 0xB0220,
        mask_prob: 0.1,
    };
    let ins: Vec<_> = (0..cfg.ranks).map(|r| w.rank_input(cfg, r, tokens[r])).collect();
    let mine = &ins[me];
    let (n, h, k) = (tokens[me], cfg.hidden, cfg.topk);
    let s = Stream(0);
    let (x, idx, wts) = (
        Dev::of(&mine.x),
        Dev::of(&mine.topk_idx),
        Dev::of(&mine.topk_weights),
    );

    // HT dispatch: rows, local expert ids, weights and counts in the oracle's receive order.
    let want = oracle::ht_dispatch(cfg, &ins)?;
    let (_, handle) = ep.ht_dispatch(
        HtDispatchIn {
            x: x.mem(),
            fp8_scales: None,
            num_tokens: n,
            topk_idx: idx.mem(),
            topk_weights: wts.mem(),
            recv: RecvSlab::Copy,
        },
        s,
    )?;
    ep.sync(s)?;
    let nr = handle
        .num_recv()
        .ok_or_else(|| Error::Mismatch("exact sizing left num_recv unknown".into()))?;
    if nr != want[me].handle.num_recv() {
        return Err(Error::Mismatch(format!(
            "rank {me}: num_recv {nr}, oracle {}",
            want[me].handle.num_recv()
        )));
    }
    let region = |which: HtOutput, n: usize, size: usize| -> Result<Dev> {
        let d = Dev::zeroed(n * size);
        if n > 0 {
            ep.ht_copy_out(
                which,
                gin_ep::ep::DeviceOut {
                    ptr: d.ptr,
                    bytes: n * size,
                },
                s,
            )?;
        }
        Ok(d)
    };
    let (rx, ri, rw) = (
        region(HtOutput::X, nr * h, 2)?,
        region(HtOutput::TopkIdx, nr * k, 8)?,
        region(HtOutput::TopkWeights, nr * k, 4)?,
    );
    let counts = ep.ht_recv_counts(&handle, s)?;
    ep.sync(s)?;
    // The routing record stays on the device; its size was compared above.
    let got = HtDispatchOutput {
        recv_x: Rows::Bf16(rx.read::<u16>(nr * h).into_iter().map(bf16::from_bits).collect()),
        recv_topk_idx: ri.read::<i64>(nr * k),
        recv_topk_weights: rw.read::<f32>(nr * k),
        num_recv_tokens_per_expert: counts,
        handle: want[me].handle.clone(),
    };
    gin_ep::check::ht_dispatch(cfg, me, &got, &want[me])?;

    // HT combine of the received rows themselves (no weights, no bias).
    let handles: Vec<_> = want.iter().map(|o| o.handle.clone()).collect();
    let comb_in: Vec<HtCombineInput> = want
        .iter()
        .map(|o| HtCombineInput {
            x: bf16_rows(&o.recv_x).to_vec(),
            topk_weights: None,
            bias: [None, None],
        })
        .collect();
    let want_comb = oracle::ht_combine(cfg, &handles, &comb_in)?;
    let cx = Dev::of(&comb_in[me].x);
    let combined = Dev::zeroed(n * h * 2);
    ep.ht_combine(
        HtCombineIn {
            x: cx.mem(),
            topk_weights: None,
            bias: [None, None],
        },
        &handle,
        HtCombineOut {
            x: Some(combined.out()),
            topk_weights: None,
        },
        s,
    )?;
    ep.sync(s)?;
    let got_comb = HtCombineOutput {
        x: combined
            .read::<u16>(n * h)
            .into_iter()
            .map(bf16::from_bits)
            .collect(),
        topk_weights: None,
    };
    gin_ep::check::ht_combine(me, &got_comb, &want_comb[me])?;
    drop(handle);

    // LL dispatch: counts, every valid row of every local expert, and layout_range.
    let want_ll = oracle::ll_dispatch(cfg, &ins)?;
    let (l, cap) = (cfg.local_experts(), cfg.ranks * cfg.max_tokens_per_rank);
    let (recv_x, recv_count, layout) = (
        Dev::zeroed(l * cap * h * 2),
        Dev::zeroed(l * 4),
        Dev::zeroed(l * cfg.ranks * 8),
    );
    let d = ep.ll_dispatch(
        LlDispatchIn {
            x: x.mem(),
            num_tokens: n,
            topk_idx: idx.mem(),
        },
        LlHalf::Both,
        LlDispatchOut {
            recv_x: Some(recv_x.out()),
            recv_scales: None,
            recv_count: Some(recv_count.out()),
            layout_range: Some(layout.out()),
            ..LlDispatchOut::default()
        },
        s,
    )?;
    ep.sync(s)?;
    let mut got_ll_handle = want_ll[me].handle.clone();
    got_ll_handle.layout_range = layout
        .read::<i64>(l * cfg.ranks)
        .into_iter()
        .map(|v| ((v as u64 >> 32) as u32, v as u32))
        .collect();
    let got_ll = LlDispatchOutput {
        recv_x: Rows::Bf16(
            recv_x
                .read::<u16>(l * cap * h)
                .into_iter()
                .map(bf16::from_bits)
                .collect(),
        ),
        recv_count: recv_count
            .read::<i32>(l)
            .into_iter()
            .map(|c| c.max(0) as usize)
            .collect(),
        handle: got_ll_handle,
    };
    gin_ep::check::ll_dispatch(cfg, me, &got_ll, &want_ll[me])?;

    // LL combine of expert outputs: the received rows themselves, weighted.
    let ys: Vec<Vec<bf16>> = want_ll.iter().map(|o| bf16_rows(&o.recv_x).to_vec()).collect();
    let ll_handles: Vec<_> = want_ll.iter().map(|o| o.handle.clone()).collect();
    let all_idx: Vec<_> = ins.iter().map(|i| i.topk_idx.clone()).collect();
    let all_w: Vec<_> = ins.iter().map(|i| i.topk_weights.clone()).collect();
    let want_llc = oracle::ll_combine(cfg, &ll_handles, &ys, &all_idx, &all_w)?;
    let y = Dev::of(&ys[me]);
    let out = Dev::zeroed(n * h * 2);
    ep.ll_combine(
        LlCombineIn {
            y: y.mem(),
            topk_idx: idx.mem(),
            topk_weights: wts.mem(),
        },
        &d.handle,
        LlHalf::Both,
        Some(out.out()),
        s,
    )?;
    ep.sync(s)?;
    let got_llc: Vec<bf16> = out.read::<u16>(n * h).into_iter().map(bf16::from_bits).collect();
    gin_ep::check::ll_combine(me, &got_llc, &want_llc[me])
}
