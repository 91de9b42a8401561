"""vLLM's and SGLang's DeepEP call sequences, replayed through `import deep_ep` on the host
backend (2 gloo processes), every result bit for bit against gin-ep's oracle. The calls,
keywords and values are theirs (../shared/ECOSYSTEM.md §1.3-§1.5): vLLM's HT manager on its
gloo `cpu_group` with dual-batch overlap (two micro-batches dispatched before either
combines: two live handles), vLLM's LL manager (`enable_shrink`, receive hooks, `out=`, and
with fault tolerance the mask queries and `clean_buffers`), SGLang's `auto` mode (one Buffer
for normal and LL, `clean_low_latency_buffer` on the switch, two-batch overlap,
`expert_alignment=128`), on a gloo group and on an NCCL-group stand-in."""

import pytest
import torch
import torch.distributed as dist

import _dist
from _inputs import check_ll_recv, quantize, routing, same_bits
from gin_ep import _native
from gin_ep._convert import from_bytes, to_bytes

WORLD, HIDDEN, TOPK, EXPERTS, T = 2, 256, 2, 8, 16


def _ht_ref(inputs, alignment=1):
    cfg = _native.EpConfig(len(inputs), EXPERTS, HIDDEN, TOPK, max(max(i[0].shape[0] for i in inputs), 1), "bf16",
                           alignment)
    ref = _native.oracle_ht_dispatch(cfg, [to_bytes(i[0]) for i in inputs], [to_bytes(i[1]) for i in inputs],
                                     [to_bytes(i[2]) for i in inputs])
    return cfg, ref


def _cpu(t):
    return tuple(_cpu(i) for i in t) if isinstance(t, tuple) else t.cpu() if isinstance(t, torch.Tensor) else t


def _check_ht_dispatch(name, rank, inputs, ref, out, fp8_inputs=None, alignment=1):
    recv_x, recv_idx, recv_w, counts, handle, event = _cpu(out)
    rx, _, ridx, rw, rcounts, native = ref[rank]
    nr = native.num_recv
    if fp8_inputs is None:
        same_bits(f"{name} recv_x", recv_x, from_bytes(rx, torch.bfloat16, (nr, HIDDEN)))
    else:
        # FP8 rows travel as they are: the inputs' rows in the oracle's receive order.
        src_rank = from_bytes(native.recv_src_rank(), torch.int32, (nr,)).tolist()
        src_tok = from_bytes(native.recv_src_token(), torch.int32, (nr,)).tolist()
        for part, i in (("data", 0), ("scales", 1)):
            want = torch.stack([fp8_inputs[r][i][t] for r, t in zip(src_rank, src_tok)]) if nr else None
            if want is not None:
                same_bits(f"{name} recv_x {part}", recv_x[i], want)
    same_bits(f"{name} recv_topk_idx", recv_idx, from_bytes(ridx, torch.int64, (nr, TOPK)))
    same_bits(f"{name} recv_topk_weights", recv_w, from_bytes(rw, torch.float32, (nr, TOPK)))
    assert counts == [(c + alignment - 1) // alignment * alignment for c in rcounts], (counts, rcounts)
    return native


def _check_ht_combine(name, rank, cfg, natives, ys, combined):
    want = _native.oracle_ht_combine(cfg, natives, [to_bytes(y) for y in ys])[rank][0]
    same_bits(f"{name} combined_x", combined.cpu(), from_bytes(want, torch.bfloat16, (combined.shape[0], HIDDEN)))


def _expert_out(r, ub, nr):
    g = torch.Generator().manual_seed(7000 + 10 * r + ub)
    return torch.randn(nr, HIDDEN, generator=g).to(torch.bfloat16)


def _ht_micro_batches(buf, deep_ep, rank, seeds, keywords, fp8_batch=None, alignment=1, dev="cpu"):
    """Each micro-batch dispatches (keywords from the framework) before any combines, as vLLM's
    dual-batch overlap and SGLang's two-batch overlap do; then each combines. Inputs on `dev`."""
    world = buf.group_size
    handles, refs = [], []
    for ub, seed in enumerate(seeds):
        inputs = routing(world, [9 + ub, 6 + 3 * ub][:world], HIDDEN, TOPK, EXPERTS, seed=seed)
        x, ids, w = (t.to(dev) for t in inputs[rank])
        previous_event = buf.capture()
        per_rank, per_rdma, per_expert, in_rank, event = buf.get_dispatch_layout(
            topk_idx=ids, num_experts=EXPERTS, previous_event=previous_event, **keywords["layout"])
        if event.event is not None:
            event.current_stream_wait()
        fp8_inputs = [quantize(i[0]) for i in inputs] if ub == fp8_batch else None
        out = buf.dispatch(x=tuple(t.to(dev) for t in fp8_inputs[rank]) if fp8_inputs else x, handle=None, num_tokens_per_rank=per_rank,
                           num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
                           num_tokens_per_expert=per_expert, topk_idx=ids, topk_weights=w,
                           expert_alignment=alignment, config=deep_ep.Buffer.get_dispatch_config(world),
                           previous_event=previous_event, **keywords["dispatch"])
        out[5].current_stream_wait()
        cfg, ref = _ht_ref(inputs, alignment)
        _check_ht_dispatch(f"micro-batch {ub}", rank, inputs, ref, out, fp8_inputs, alignment)
        handles.append(out[4])
        refs.append((cfg, ref))
    for ub, (handle, (cfg, ref)) in enumerate(zip(handles, refs)):
        nr = ref[rank][5].num_recv
        combined, _, event = buf.combine(x=_expert_out(rank, ub, nr).to(dev), handle=handle, topk_weights=None,
                                         config=deep_ep.Buffer.get_combine_config(world),
                                         previous_event=buf.capture(), **keywords["combine"])
        event.current_stream_wait()
        _check_ht_combine(f"micro-batch {ub}", rank, cfg, [ref[r][5] for r in range(world)],
                          [_expert_out(r, ub, ref[r][5].num_recv) for r in range(world)], combined)


def _ll_round(buf, rank, seed, use_fp8, hook_mode, combine_keywords, dev="cpu"):
    world = buf.group_size
    inputs = routing(world, [5, 11][:world], HIDDEN, TOPK, EXPERTS, seed=seed)
    x, ids, w = (t.to(dev) for t in inputs[rank])
    local = EXPERTS // world
    dtype = "fp8" if use_fp8 else "bf16"
    cfg = _native.EpConfig(world, EXPERTS, HIDDEN, TOPK, T, dtype)
    ref = _native.oracle_ll_dispatch(cfg, [to_bytes(i[0]) for i in inputs], [to_bytes(i[1]) for i in inputs])
    expert_x, expert_num_tokens, handle, event, hook = buf.low_latency_dispatch(
        x, ids, T, EXPERTS, use_fp8=use_fp8, round_scale=False, use_ue8m0=False, async_finish=not hook_mode,
        return_recv_hook=hook_mode)
    if hook_mode:
        hook()
    else:
        event.current_stream_wait()
    check_ll_recv(f"LL {dtype}", ref[rank], expert_x, expert_num_tokens, handle[1], local, world, T, HIDDEN, use_fp8)

    def y_of(r):
        g = torch.Generator().manual_seed(seed * 10 + r)
        return torch.randn(local, world * T, HIDDEN, generator=g).to(torch.bfloat16)

    out = torch.empty(x.shape[0], HIDDEN, dtype=torch.bfloat16, device=dev)
    kw = dict(combine_keywords, out=out) if "out" in combine_keywords else combine_keywords
    combined, event, recv_hook = buf.low_latency_combine(y_of(rank).to(dev), ids, w, handle,
                                                         return_recv_hook=hook_mode, **kw)
    # As the frameworks do: the hook, or the event (async_finish runs the combine on the
    # communication stream; reading `combined` before waiting for it races the kernel).
    if hook_mode:
        recv_hook()
    else:
        event.current_stream_wait()
    want = _native.oracle_ll_combine(cfg, [ref[r][3] for r in range(world)], [to_bytes(y_of(r)) for r in range(world)],
                                     [to_bytes(i[1]) for i in inputs], [to_bytes(i[2]) for i in inputs])[rank]
    same_bits("LL combine", combined.cpu(), from_bytes(want, torch.bfloat16, (x.shape[0], HIDDEN)))
    if "out" in combine_keywords:
        assert combined is out


# ------------------------------------------------------------------ vLLM


def _vllm_worker(rank, world, fault_tolerance, dev="cpu"):
    import deep_ep
    cpu_group = dist.new_group(list(range(world)), backend="gloo")  # GroupCoordinator.cpu_group
    # DeepEPHTAll2AllManager._make_all2all_kwargs (VLLM_DEEPEP_BUFFER_SIZE_MB scaled down).
    ht = deep_ep.Buffer(**dict(group=cpu_group, num_nvl_bytes=16 * 1024 * 1024, num_rdma_bytes=0,
                               low_latency_mode=False, num_qps_per_rank=1, explicitly_destroy=True))
    deep_ep.Buffer.set_num_sms(min(20, deep_ep.Buffer.num_sms))  # set_num_sms (DBO's SM split)
    keywords = {"layout": dict(async_finish=False, allocate_on_comm_stream=False),
                "dispatch": dict(async_finish=False, allocate_on_comm_stream=False),
                "combine": dict(async_finish=False, allocate_on_comm_stream=False)}
    # Dual-batch overlap: ubatch 1 dispatches before ubatch 0 combines; ubatch 1 is FP8
    # block-quantized before dispatch, as for block-FP8 models.
    _ht_micro_batches(ht, deep_ep, rank, [101, 202], keywords, fp8_batch=1, dev=dev)
    ht.destroy()

    # DeepEPLLAll2AllManager._make_all2all_kwargs.
    ll = deep_ep.Buffer(**dict(
        group=cpu_group, num_nvl_bytes=16 * 1024 * 1024,
        num_rdma_bytes=deep_ep.Buffer.get_low_latency_rdma_size_hint(
            num_max_dispatch_tokens_per_rank=T, hidden=HIDDEN, num_ranks=world, num_experts=EXPERTS),
        low_latency_mode=True, num_qps_per_rank=EXPERTS // world, allow_nvlink_for_low_latency_mode=True,
        allow_mnnvl=False, explicitly_destroy=True, enable_shrink=fault_tolerance))
    # DeepEPLLPrepareAndFinalize: return_recv_hook=True always; combine with out=.
    for seed, use_fp8 in ((5, True), (6, False)):
        _ll_round(ll, rank, seed, use_fp8, True, dict(async_finish=False, zero_copy=False, out=True), dev)
    if fault_tolerance:
        # query_active_mask / clean_buffers / query_fault.
        mask = torch.zeros(world, dtype=torch.int32)
        ll.low_latency_query_mask_buffer(mask)
        assert mask.tolist() == [0] * world
        ll.get_local_buffer_tensor(dtype=torch.int8, use_rdma_buffer=True).zero_()
        ll.low_latency_clean_mask_buffer()
        _ll_round(ll, rank, 7, True, True, dict(async_finish=False, zero_copy=False, out=True), dev)
    ll.destroy()


@pytest.mark.parametrize("fault_tolerance", [False, True], ids=["default", "fault_tolerance"])
def test_vllm_sequences(fault_tolerance):
    _dist.run(WORLD, _vllm_worker, fault_tolerance)


# ------------------------------------------------------------------ SGLang


class _StartedGpu(Exception):
    pass


def _sglang_worker(rank, world, nccl_stand_in, dev="cpu"):
    import deep_ep
    group = dist.group.WORLD
    if nccl_stand_in:
        # SGLang passes its NCCL device group; on a machine without GPUs the stand-in reports
        # "nccl" and records that the Buffer starts its CUDA rank at construction, while the
        # CPU tensors below still run on the host backend.
        started = []
        dist.get_backend = lambda g=None: "nccl"
        torch.cuda.is_available = lambda: True
        deep_ep.Buffer._start_gpu = lambda self: started.append(self.rank)
    cfg = deep_ep.Config(**{"num_sms": 24, "num_max_nvl_chunked_send_tokens": 6,
                            "num_max_nvl_chunked_recv_tokens": 256, "num_max_rdma_chunked_send_tokens": 6,
                            "num_max_rdma_chunked_recv_tokens": 128})
    num_nvl_bytes = cfg.get_nvl_buffer_size_hint(HIDDEN * 2, world)
    num_rdma_bytes = max(cfg.get_rdma_buffer_size_hint(HIDDEN * 2, world),
                         deep_ep.Buffer.get_low_latency_rdma_size_hint(T, HIDDEN, world, EXPERTS))
    buf = deep_ep.Buffer(group, num_nvl_bytes, num_rdma_bytes, low_latency_mode=True,
                         num_qps_per_rank=EXPERTS // world, allow_mnnvl=True)
    if nccl_stand_in:
        assert started == [rank]
    assert deep_ep.Buffer.num_sms > 0 and buf.group_size == world and buf.low_latency_mode
    # `auto` mode, normal (prefill): two-batch overlap with DeepGEMM's alignment.
    keywords = {"layout": dict(async_finish=True, allocate_on_comm_stream=True),
                "dispatch": dict(async_finish=True, allocate_on_comm_stream=True),
                "combine": dict(async_finish=True, allocate_on_comm_stream=True)}
    _ht_micro_batches(buf, deep_ep, rank, [303, 404], keywords, alignment=128, dev=dev)
    # Switch to LL (decode).
    buf.clean_low_latency_buffer(T, HIDDEN, EXPERTS)
    for seed, hook_mode in ((8, True), (9, False)):
        _ll_round(buf, rank, seed, True, hook_mode, dict(async_finish=not hook_mode), dev)


@pytest.mark.parametrize("nccl_stand_in", [False, True], ids=["gloo", "nccl_stand_in"])
def test_sglang_sequences(nccl_stand_in):
    _dist.run(WORLD, _sglang_worker, nccl_stand_in)


# ------------------------------------------------------------------ the same on GPUs


def _gpu_entry(rank, world, port, backend, fn, args):
    dev = _dist.enter_gpu(rank)
    kw = {"device_id": dev} if backend == "nccl" else {}
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, **kw)
    try:
        fn(rank, world, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _gpu_run(world, backend, fn, *args):
    # With GIN_EP_VNODES=K, K ranks share each GPU (_dist.vnodes); the sequences run HT
    # against one-node references (flat combine order): every rank in one gin-ep node.
    _dist.skip_unless_gpus_for(world)
    if not _dist.ht_one_node(world):
        pytest.skip("the sequences check HT against one-node references: with virtual nodes, set "
                    "GIN_EP_NODE_SIZE to the world")
    import os
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ["GIN_EP_POISON_OUTPUTS"] = "1"
    _dist.spawn_on_free_port(_gpu_entry, (world, backend, fn, args), world)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("backend", ["gloo", "nccl"])
@pytest.mark.parametrize("fault_tolerance", [False, True], ids=["default", "fault_tolerance"])
def test_vllm_sequences_gpu(world, backend, fault_tolerance):
    """CUDA tensors: vLLM's calls on its gloo cpu_group (the GPU path by tensor device) and, for
    comparison, with an NCCL world group underneath."""
    _gpu_run(world, backend, _vllm_worker, fault_tolerance, "cuda")


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_sglang_sequences_gpu(world, backend):
    _gpu_run(world, backend, _sglang_worker, False, "cuda")
