"""Python-call overhead of gin_ep.Buffer on GPUs: time per call of dispatch, combine,
low_latency_dispatch and low_latency_combine, by CUDA events (device time) and by the
host clock (call returned; rank 0's, and the slowest rank's), on every GPU of this host (or
--world). Compare the device figures with `gin-ep bench --mode ht|ll` at the same shape.
--handle-cost times what building DeepEP's handle entries costs those calls (world 1 too).

    python python/bench_overhead.py --world 2 --tokens 4096 --hidden 7168 --topk 8 --experts 256
    python python/bench_overhead.py --world 1 --handle-cost --samples 3
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Thread CPU µs per call of each `timed` row, in order (see `timed`).
CPU_US = []
# Median host µs of one call of each `timed` row, in order: a noisy stretch of the host (CPU
# clock, other tenants) moves the mean of a row, much less its median.
MEDIAN_US = []


def timed(fn, iters):
    """(device us per call by CUDA events, host us per call) over `iters` calls after warmup.
    Also keeps the calling thread's CPU time per call (`CPU_US`): a host time well above it
    means the thread waited (descheduled, blocked), not that its work got slower."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    marks = [0.0] * (iters + 1)
    t0, c0 = time.perf_counter(), time.thread_time()
    start.record()
    for i in range(iters):
        marks[i] = time.perf_counter()
        fn()
    end.record()
    marks[iters] = time.perf_counter()
    host = (marks[iters] - t0) / iters * 1e6
    CPU_US.append((time.thread_time() - c0) / iters * 1e6)
    MEDIAN_US.append(sorted(b - a for a, b in zip(marks, marks[1:]))[iters // 2] * 1e6)
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters, host


def synced(fn, iters):
    """Median host us per call with the stream synchronized after every call, as `gin-ep
    bench` times its `total` row: no back-to-back queueing, so no call's host work overlaps
    the previous call's kernels."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return float("nan"), ts[len(ts) // 2] * 1e6


def graphed(fn, iters):
    """(device us, host us) per call of `fn` captured once in a CUDA graph and replayed
    `iters` times: the device work of the Python path with no host time in it, and the host
    time of a replay (what a graph-captured model pays per step)."""
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            fn()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    for _ in range(iters):
        g.replay()
    host = (time.perf_counter() - t0) / iters * 1e6
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters, host


def profiled(fn, iters, rank):
    """Rank 0 prints where the host time of `iters` calls goes (cProfile, top 15)."""
    import cProfile
    import pstats
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    dist.barrier()
    prof.enable()
    for _ in range(iters):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    if rank == 0:
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)


class _Timed:
    """Forwards to gin-ep's native object, summing the host time of each method (--split)."""

    def __init__(self, inner, acc):
        self._inner, self._acc = inner, acc

    def __getattr__(self, name):
        f = getattr(self._inner, name)
        if not callable(f):
            return f

        def call(*args, **kw):
            t0 = time.perf_counter()
            try:
                return f(*args, **kw)
            finally:
                self._acc[name] = self._acc.get(name, 0.0) + time.perf_counter() - t0
        return call


def split(buf, fn, iters, rank, label):
    """Rank 0 prints host us per call spent in gin-ep's native calls vs the rest."""
    from gin_ep import _gpu
    acc = {}
    g = buf._gpu
    saved = {name: dict(getattr(g, name)) for name in ("hts", "lls", "ht_sms")}
    # Every native Ep of the Buffer, and the tables keyed by them, through a timing proxy.
    proxy = {id(ep): _Timed(ep, acc) for ep in (*g.hts.values(), *g.lls.values())}
    for name in ("hts", "lls"):
        setattr(g, name, {k: proxy[id(ep)] for k, ep in saved[name].items()})
    for name in ("ht_sms",):
        setattr(g, name, {proxy.get(id(ep), ep): v for ep, v in saved[name].items()})
    real_empty, real_stream = _gpu.empty, _gpu.stream

    def timed_of(name, f):
        def g(*args, **kw):
            t0 = time.perf_counter()
            try:
                return f(*args, **kw)
            finally:
                acc[name] = acc.get(name, 0.0) + time.perf_counter() - t0
        return g
    _gpu.empty, _gpu.stream = timed_of("torch.empty", real_empty), timed_of("current_stream", real_stream)
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    total = time.perf_counter() - t0
    torch.cuda.synchronize()
    for name, table in saved.items():
        setattr(g, name, table)
    _gpu.empty, _gpu.stream = real_empty, real_stream
    if rank == 0:
        parts = ", ".join(f"{k} {v / iters * 1e6:.1f}" for k, v in sorted(acc.items()))
        print(f"host split {label}: total {total / iters * 1e6:.1f} us/call; {parts}")


def _cpulist(text):
    cpus = []
    for part in text.strip().split(","):
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def pin(rank, world):
    """Pins this process to CPUs of its GPU's NUMA node (sysfs local_cpulist), its own share
    when several ranks' GPUs sit on one node. Returns the CPUs, or None where unknown."""
    p = torch.cuda.get_device_properties(rank)
    dev = f"{getattr(p, 'pci_domain_id', 0):04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
    try:
        with open(f"/sys/bus/pci/devices/{dev}/local_cpulist") as f:
            local = _cpulist(f.read())
    except (OSError, ValueError):
        local = None
    lists = [None] * world
    dist.all_gather_object(lists, local)
    if local is None:
        return None
    sharing = [r for r in range(world) if lists[r] == local]
    share = max(1, len(local) // len(sharing))
    mine = local[sharing.index(rank) * share:][:share] or local
    os.sched_setaffinity(0, mine)
    return mine


def _thread_ticks():
    """{(tid, name): utime + stime clock ticks} of this process's threads."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                text = f.read()
        except OSError:
            continue
        name = text[text.index("(") + 1:text.rindex(")")]
        fields = text[text.rindex(")") + 2:].split()
        out[(tid, name)] = int(fields[11]) + int(fields[12])
    return out


def _steal_ticks():
    """(all, steal) CPU ticks of the machine (/proc/stat's first line)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v), v[7] if len(v) > 7 else 0


def thread_report(before, after, wall_s, rank):
    """One line per rank: its threads that used over 5% of a CPU between two snapshots."""
    hz = os.sysconf("SC_CLK_TCK")
    (t0, s0), (t1, s1) = before[1], after[1]
    busy = sorted(((after[0][k] - v) / hz / wall_s * 100, k[1]) for k, v in before[0].items() if k in after[0])
    busy = [f"{name} {pct:.0f}%" for pct, name in reversed(busy) if pct > 5]
    steal = (s1 - s0) / max(1, t1 - t0) * 100
    return f"rank {rank}: {wall_s:.1f} s, machine steal {steal:.1f}%, threads over 5% of a CPU: " + ", ".join(busy)


def ht_rows(buf, x, idx, w, e, a, rows, out, rank):
    """The HT rows: dispatch, cached dispatch, combine (and the synced ones)."""
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, e)

    def disp():
        out["d"] = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
    rows.append(("ht dispatch",) + timed(disp, a.iters))
    # Only the newest dispatch's handle is valid (one HT handle per shape).
    recv_x, _, _, _, handle, _ = out["d"]
    rows.append(("ht dispatch (cached)",) + timed(lambda: buf.dispatch(x, handle=handle), a.iters))
    rows.append(("ht combine",) + timed(lambda: buf.combine(recv_x, handle), a.iters))
    if a.sync_each:
        # Drop the earlier outputs first: with two receive slabs, out["d"] and a still-held
        # recv_x would leave the next dispatch no free slab (it would copy its rows out).
        recv_x = handle = None
        rows.append(("ht dispatch (sync each, median)",) + synced(disp, a.iters))
        recv_x, _, _, _, handle, _ = out["d"]
        rows.append(("ht combine (sync each, median)",) + synced(lambda: buf.combine(recv_x, handle), a.iters))
        if a.profile:
            # Where an isolated call's host time goes (the sync is in the profile too).
            profiled(lambda: (disp(), torch.cuda.synchronize()), a.iters, rank)


class _NoHandleEntries:
    """Within it, GPU dispatches build their handles without DeepEP's entries: the HT
    `rank_prefix_matrix` and the LL `src_info` views are None (the rest of each handle as
    usual), so rows timed inside and outside it differ by what building them costs."""

    def __enter__(self):
        from gin_ep import _gpu
        self.cls = _gpu.Gpu
        self.saved = {n: getattr(self.cls, n) for n in ("ht_rank_prefix", "ll_set_tensors") if hasattr(self.cls, n)}
        if "ht_rank_prefix" in self.saved:
            self.cls.ht_rank_prefix = lambda *args, **kw: None
        if "ll_set_tensors" in self.saved:
            tensors = self.saved["ll_set_tensors"]
            self.cls.ll_set_tensors = lambda g, views: (None, tensors(g, views)[1])
        return self

    def __exit__(self, *exc):
        for n, f in self.saved.items():
            setattr(self.cls, n, f)

    def applies(self) -> bool:
        """Whether the gin_ep imported builds those entries (an older wheel may not)."""
        from gin_ep import _gpu
        return all(hasattr(_gpu.Gpu, n) for n in ("ht_rank_prefix", "ll_set_tensors"))


def built(fn, iters):
    """Host us per call of `fn`, a host-only step (no device work), over `iters` calls."""
    for _ in range(100):
        fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return float("nan"), (time.perf_counter() - t0) / iters * 1e6


def handle_cost_rows(buf, x, idx, w, e, a, rank, world):
    """The hot-path cost of the handles' DeepEP entries: LL dispatch + combine back to back,
    the same replayed as a CUDA graph, HT fresh and cached dispatch, each with the entries
    built and without (_NoHandleEntries), alternated `a.samples` times; and the host time of
    building one handle's entries alone. Rows: (name, variant, device us, host us)."""
    try:
        from gin_ep import _handles
    except ImportError:  # a wheel from before the handles held DeepEP's entries
        _handles = None
    rows = []
    ln = min(a.tokens, a.ll_tokens)
    xl, il, wl = x[:ln], idx[:ln], w[:ln]
    dev = x.device
    y = torch.randn(e // world, world * a.ll_tokens, a.hidden, device=dev).to(torch.bfloat16)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, e)
    out = {}

    def ll_pair():
        _, _, lh, _, _ = buf.low_latency_dispatch(xl, il, a.ll_tokens, e)
        out["c"] = buf.low_latency_combine(y, il, wl, lh)

    def ht_fresh():
        out["d"] = None  # the previous handle's slab back before the next dispatch
        out["d"] = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)

    off = _NoHandleEntries()
    variants = [("entries", None)] + ([("no entries", off)] if off.applies() else [])
    for _ in range(a.samples):
        for variant, ctx in variants:
            if ctx is not None:
                ctx.__enter__()
            try:
                rows.append(("ll dispatch+combine bf16", variant) + timed(ll_pair, a.iters))
                rows.append(("ll dispatch+combine (graph replay)", variant) + graphed(ll_pair, a.iters))
                rows.append(("ht dispatch", variant) + timed(ht_fresh, a.iters))
                handle = out["d"][4]
                rows.append(("ht dispatch (cached)", variant) +
                            timed(lambda: buf.dispatch(x, handle=handle), a.iters))
                handle = None
            finally:
                if ctx is not None:
                    ctx.__exit__(None, None, None)
    # Building one handle's entries alone, from the last dispatches' states (host only).
    g = buf._gpu
    if off.applies() and hasattr(_handles, "ht_handle"):
        d = out["d"]
        hs = d[4].state
        rows.append(("ht handle build", "entries") +
                    built(lambda: _handles.ht_handle(hs, g.ht_rank_prefix(hs.ep, hs.native), d[4][3], d[4][4]),
                          10 * a.iters))
        _, _, lh, _, _ = buf.low_latency_dispatch(xl, il, a.ll_tokens, e)
        ls = lh.state
        # The entries come with the buffer set's views, made on its first dispatch: what a
        # handle costs past that is the tuple.
        rows.append(("ll handle build", "entries") +
                    built(lambda: _handles.ll_handle(ls, lh[0], lh[1], a.ll_tokens, a.hidden, e), 10 * a.iters))
    torch.cuda.synchronize()
    return rows


def print_handle_cost(rows, world, a):
    """Rank 0: one line per (row, variant): the median over samples of device and host us,
    prefixed `handle-cost` (scripts/gpu-handle-cost joins these lines of several wheels)."""
    from gin_ep import __version__
    print(f"handle-cost shape: world {world}, HT {a.tokens} tokens, LL {min(a.tokens, a.ll_tokens)} tokens, "
          f"hidden {a.hidden}, top-{a.topk} of {a.experts} experts, {a.iters} calls x {a.samples} samples; "
          f"gin_ep {__version__}")
    keys = []
    for name, variant, _, _ in rows:
        if (name, variant) not in keys:
            keys.append((name, variant))
    for name, variant in keys:
        ds = sorted(d for n, v, d, _ in rows if (n, v) == (name, variant))
        hs = sorted(h for n, v, _, h in rows if (n, v) == (name, variant))
        d, h = ds[len(ds) // 2], hs[len(hs) // 2]
        print(f"handle-cost|{name}|{variant}|{'-' if d != d else f'{d:.1f}'}|{h:.2f}")


def worker(rank, world, init, a):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    if a.pin:
        cpus = pin(rank, world)
        print(f"rank {rank}: pinned to CPUs {cpus[0]}-{cpus[-1]} ({len(cpus)})" if cpus else
              f"rank {rank}: GPU's local CPUs unknown, not pinned")
    if a.no_gc:
        import gc
        gc.disable()
    from gin_ep import Buffer
    if a.num_sms is not None:
        Buffer.set_num_sms(a.num_sms)
    dev = torch.device("cuda", rank)
    g = torch.Generator(device=dev).manual_seed(rank)
    n, h, k, e = a.tokens, a.hidden, a.topk, a.experts
    x = torch.randn(n, h, device=dev, generator=g).to(torch.bfloat16)
    idx = torch.rand(n, e, device=dev, generator=g).topk(k, dim=1).indices.to(torch.int64)
    w = torch.rand(n, k, device=dev, generator=g)
    rows = []
    buf = Buffer(dist.group.WORLD, num_nvl_bytes=0, max_tokens_per_rank=n,
                 num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(a.ll_tokens, h, world, e),
                 low_latency_mode=True)
    out = {}
    if a.handle_cost:
        hc = handle_cost_rows(buf, x, idx, w, e, a, rank, world)
        if rank == 0:
            print_handle_cost(hc, world, a)
            sys.stdout.flush()
        dist.barrier()
        dist.destroy_process_group()
        return
    if not a.ll_only:
        ht_rows(buf, x, idx, w, e, a, rows, out, rank)
    ln = min(n, a.ll_tokens)
    # The LL inputs sliced once: the slices are the caller's work, not gin-ep's.
    xl, il, wl = x[:ln], idx[:ln], w[:ln]
    snap0, wall0 = (_thread_ticks(), _steal_ticks()), time.perf_counter()
    for fp8 in [False, True] * a.samples:
        def lld():
            out["l"] = buf.low_latency_dispatch(xl, il, a.ll_tokens, e, use_fp8=fp8)
        y = torch.randn(e // world, world * a.ll_tokens, h, device=dev).to(torch.bfloat16)
        name = f"ll dispatch {'fp8' if fp8 else 'bf16'}"
        rows.append((name,) + timed(lld, a.iters))
        if a.profile:
            profiled(lld, a.iters, rank)
        if a.split:
            split(buf, lld, a.iters, rank, name)
        # The newest dispatch's handle (LL alternates two buffer sets).
        _, _, lh, _, _ = out["l"]

        def llc():
            out["c"] = buf.low_latency_combine(y, il, wl, lh)
        rows.append(("ll combine",) + timed(llc, a.iters))
        if a.graphs:
            def both():
                lld()
                _, _, gh, _, _ = out["l"]
                out["c"] = buf.low_latency_combine(y, il, wl, gh)
            rows.append((f"{name} + combine (graph)",) + graphed(both, a.iters))
        if a.compiled:
            def step():
                _, _, ch, _, _ = buf.low_latency_dispatch(xl, il, a.ll_tokens, e, use_fp8=fp8)
                return buf.low_latency_combine(y, il, wl, ch)[0]
            # torch.compile's CUDA graphs: warm-up, record, then replays (timed's warm-up calls).
            # Static addresses: CUDA-graph replays would otherwise copy every input into the
            # graph's own buffers first (y alone is 470 MB at the default shape), which a model
            # computing y inside the compiled graph would not do.
            for t in (xl, il, wl, y):
                torch._dynamo.mark_static_address(t)
            rows.append((f"{name} + combine (compiled)",) +
                        timed(torch.compile(step, mode="reduce-overhead", fullgraph=True), a.iters))
    if a.threads:
        line = thread_report(snap0, (_thread_ticks(), _steal_ticks()), time.perf_counter() - wall0, rank)
        lines = [None] * world
        dist.all_gather_object(lines, line)
        if rank == 0:
            print("\n".join(lines))
    # Every rank's host time: a collective call runs at the pace of the slowest process, so
    # rank 0's host time alone does not explain a device time above it.
    hosts, cpus = [None] * world, [None] * world
    dist.all_gather_object(hosts, [hst for _, _, hst in rows])
    dist.all_gather_object(cpus, CPU_US)
    medians = [None] * world
    dist.all_gather_object(medians, MEDIAN_US)
    if rank == 0:
        print(f"world {world}, HT {n} tokens, LL {ln} tokens, hidden {h}, top-{k} of {e} experts, "
              f"{a.iters} calls each, HT on {Buffer.num_sms} CTAs (num_sms)")
        print(f"{'operation':<36}{'device us/call':>16}{'host us/call':>14}{'slowest host':>14}")
        for i, (name, d, hst) in enumerate(rows):
            dev = "-" if d != d else f"{d:.1f}"  # NaN: a host-timed row (sync each)
            slow = max(hs[i] for hs in hosts)
            print(f"{name:<36}{dev:>16}{hst:>14.1f}{slow:>14.1f}")
        # Per rank: host µs per call / the thread's CPU µs per call / median host µs of one
        # call (timed rows).
        print("per rank host / thread CPU / median host us per call:")
        timed_rows = [j for j, (_, d, hst) in enumerate(rows) if d == d and hst == hst]
        for i, j in enumerate(timed_rows):
            print(f"  {rows[j][0]:<34}" + "  ".join(f"r{r} {hosts[r][j]:.1f}/{cpus[r][i]:.1f}/{medians[r][i]:.1f}"
                                                    for r in range(world)))
        sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=torch.cuda.device_count())
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--ll-tokens", type=int, default=128)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--num-sms", type=int, default=None,
                   help="Buffer.set_num_sms: the CTAs of every HT dispatch and combine (default: Buffer's 20)")
    p.add_argument("--graphs", action="store_true", help="also replay LL dispatch + combine as a CUDA graph")
    p.add_argument("--compiled", action="store_true",
                   help="also time LL dispatch + combine under torch.compile(mode='reduce-overhead')")
    p.add_argument("--sync-each", action="store_true",
                   help="also time HT calls with a stream sync after each (as gin-ep bench's total row)")
    p.add_argument("--profile", action="store_true",
                   help="rank 0 prints a cProfile of the LL dispatch calls (and, with --sync-each, of "
                        "the synced HT dispatch calls)")
    p.add_argument("--split", action="store_true",
                   help="rank 0 prints the host time of the LL dispatch calls spent in native calls vs the rest")
    p.add_argument("--samples", type=int, default=1, help="LL rows: this many samples of each, in turn")
    p.add_argument("--threads", action="store_true",
                   help="each rank prints its threads' CPU use over the LL rows, and the machine's steal time")
    p.add_argument("--no-gc", action="store_true", help="Python's garbage collector off in every rank")
    p.add_argument("--ll-only", action="store_true", help="LL rows only (no HT dispatch and combine)")
    p.add_argument("--handle-cost", action="store_true",
                   help="only the handle rows: LL dispatch+combine (back to back and as a CUDA graph), HT "
                        "fresh and cached dispatch, with DeepEP's handle entries built and without, "
                        "--samples times alternated, and building one handle alone (scripts/gpu-handle-cost)")
    p.add_argument("--pin", action="store_true",
                   help="pin each rank to CPUs of its GPU's NUMA node (its own share of them)")
    a = p.parse_args()
    if not 1 <= a.world <= torch.cuda.device_count():
        sys.exit(f"--world {a.world}: this host has {torch.cuda.device_count()} GPUs")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    # A file rendezvous needs no free port (a probed port can be taken before use).
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        init = "file://" + os.path.join(d, "rendezvous")
        mp.spawn(worker, args=(a.world, init, a), nprocs=a.world, join=True)


if __name__ == "__main__":
    main()
