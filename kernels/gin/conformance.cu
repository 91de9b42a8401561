// kernels/gin/conformance.cu: the GIN conformance check (`gin-ep check --mode gin`).
//
// Owns: one iteration of the check per launch, on one CTA: fill the sources, issue the
// iteration's puts and signals to every rank (self included) over all four GIN contexts,
// store into same-node peers' IPC-mapped windows, wait for everything addressed to this rank
// under deadlines, verify every byte, then a gin-ep signal barrier and the counter wait that
// makes the sources reusable. Never: putValue (broken in NCCL 2.28.9's proxy path), flush,
// waitSignal, waitCounter or NCCL's GIN barrier (no deadline; a dead peer would hang them).
//
// The plan of an iteration is a pure function of (seed, iteration, src, dst, op) (gc_plan
// below, mirrored by `gin_check::plan` in crates/gin-ep/src/backend/cuda/gincheck.rs), so the
// receiver knows what each sender did without being told. Per (src -> dst) and iteration:
//   op 0: put of 0..max bytes at random offsets + SignalInc{inc(src)} + CounterInc{0}
//   op 1: put of 0..max bytes at random offsets + SignalAdd{add(src), v} + CounterInc{0}
//   op 2: 0-byte put + SignalAdd{add(src), v} + CounterInc{0}
//   op 3: signal() SignalInc{inc(src)}
// each on context (iteration + 3 src + dst + op) mod 4. Signals live per context, so the
// receiver reads each through the sender's context. SignalInc and SignalAdd never share a
// signal (NCCL forbids mixing them between resets).
// Ordering test (every `order_every` iterations): rank r issues kOrderPuts puts of
// kOrderBytes to rank r+1 on one context, no signal, then one signal() on the same context;
// the receiver verifies all of it as soon as it sees that signal. NCCL's one ordering promise
// (a signal is visible only after the payloads of the earlier puts on that context to that
// peer) is exactly what this tests; a plugin that signals at submission fails it.
// Barrier: after verifying, every rank signals bar(src = me) to every rank on context 0; a
// rank starts the next iteration's puts only after every rank's barrier signal arrived, i.e.
// after every receiver has finished reading what the previous iteration put there.

#include "common/fabric.cuh"
#include "common/nccl_compat.cuh"

// GinCheckArgs, GinCheckResult and the constants the host shares (after the headers that
// define the types they name).
#include "abi/gin.h"

namespace gin_ep {

struct GcOp {
  uint64_t bytes, src_off, dst_off, add;
  int ctx;
};

__host__ __device__ __forceinline__ uint64_t gc_mix(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 31;
  return x;
}

__host__ __device__ __forceinline__ uint64_t gc_key(uint64_t seed, uint64_t it, uint32_t src, uint32_t dst,
                                                    uint32_t op) {
  return gc_mix(seed ^ gc_mix(it * 0x9E3779B97F4A7C15ull ^ (uint64_t(src) << 40) ^ (uint64_t(dst) << 16) ^ op));
}

// Operation `op` of src -> dst in iteration `it`.
__host__ __device__ __forceinline__ GcOp gc_plan(uint64_t seed, uint64_t it, uint32_t src, uint32_t dst, uint32_t op,
                                                 uint64_t max_bytes, uint64_t slot) {
  const uint64_t k = gc_key(seed, it, src, dst, op);
  GcOp o;
  o.ctx = int((it + 3ull * src + dst + op) & 3ull);
  // One put in eight is empty, one in eight as large as allowed; the rest anywhere between.
  const uint64_t pick = gc_mix(k + 1);
  o.bytes = (op == 2 || op == 3) ? 0
                                 : ((pick & 7) == 0   ? 0
                                    : (pick & 7) == 1 ? max_bytes
                                                      : (pick >> 8) % (max_bytes + 1));
  o.src_off = gc_mix(k + 2) % (slot - o.bytes + 1);
  o.dst_off = gc_mix(k + 3) % (slot - o.bytes + 1);
  o.add = 1 + (gc_mix(k + 4) & 0xFFFF);
  return o;
}

// Byte i of the data of (it, src, dst, op).
__host__ __device__ __forceinline__ uint32_t gc_byte(uint64_t key, uint64_t i) {
  return uint32_t(gc_mix(key ^ (i >> 3) * 0xD6E8FEB86659FD93ull) >> (8 * (i & 7))) & 0xFFu;
}

__device__ __forceinline__ void gc_mismatch(GinCheckResult* r, int src, uint32_t op, uint64_t index, uint32_t expected,
                                            uint32_t got) {
  atomicAdd(&r->mismatches, 1ull);
  if (atomicCAS(&r->claimed, 0u, 1u) == 0u) {
    r->src = src;
    r->op = op;
    r->index = index;
    r->expected = expected;
    r->got = got;
  }
}

__device__ __forceinline__ uint32_t gc_inc(int src) { return uint32_t(src); }
__device__ __forceinline__ uint32_t gc_add(int n, int src) { return uint32_t(n + src); }
__device__ __forceinline__ uint32_t gc_bar(int n, int src) { return uint32_t(2 * n + src); }
__device__ __forceinline__ uint32_t gc_order(int n) { return uint32_t(3 * n); }

}  // namespace gin_ep

using namespace gin_ep;

#if GIN_EP_HAVE_GIN
// Issues operation `op` of this rank to `dst` (kept out of line: four inlined put variants
// over both GIN backends would not fit the kernel's registers).
__device__ __forceinline__ void gc_issue(const GinCheckArgs& a, ncclTeam world, int me, int dst, uint32_t op) {
  const int n = world.nRanks;
  const GcOp o = gc_plan(a.seed, a.iteration, me, dst, op, a.max_bytes, a.slot);
  ncclGin gin(a.comm, o.ctx);
  const size_t src_off = a.send_offset + (size_t(dst) * 2 + (op & 1)) * a.slot + o.src_off;
  const size_t dst_off = a.recv_offset + (size_t(me) * 2 + (op & 1)) * a.slot + o.dst_off;
  switch (op) {
    case 0:
      gin_put(gin, world, dst, a.win, dst_off, a.win, src_off, o.bytes, ncclGin_SignalInc{gc_inc(me)},
              ncclGin_CounterInc{0});
      break;
    case 1:
      gin_put(gin, world, dst, a.win, dst_off, a.win, src_off, o.bytes, ncclGin_SignalAdd{gc_add(n, me), o.add},
              ncclGin_CounterInc{0});
      break;
    case 2:
      gin_put(gin, world, dst, a.win, a.recv_offset, a.win, a.send_offset, 0, ncclGin_SignalAdd{gc_add(n, me), o.add},
              ncclGin_CounterInc{0});
      break;
    default:
      gin_signal(gin, world, dst, ncclGin_SignalInc{gc_inc(me)});
      break;
  }
}

// Waits until every signal `src` sends this rank in this iteration has arrived, on every
// context (expectations are cumulative over iterations, kept in a.expect).
__device__ __forceinline__ bool gc_wait_source(const GinCheckArgs& a, int n, int me, int src) {
  uint64_t* expect_sig = a.expect;
  for (uint32_t op = 0; op < kGcOps; ++op) {
    const GcOp o = gc_plan(a.seed, a.iteration, src, me, op, a.max_bytes, a.slot);
    const uint32_t sig = (op == 1 || op == 2) ? gc_add(n, src) : gc_inc(src);
    expect_sig[size_t(o.ctx) * a.n_signals + sig] += (op == 1 || op == 2) ? o.add : 1;
  }
  for (int ctx = 0; ctx < 4; ++ctx) {
    ncclGin gin(a.comm, ctx);
    for (int k = 0; k < 2; ++k) {
      const uint32_t sig = k == 0 ? gc_inc(src) : gc_add(n, src);
      const uint64_t want = expect_sig[size_t(ctx) * a.n_signals + sig];
      if (want != 0 && !gin_wait_signal(gin, sig, want, a.err, a.timeout_ns, kPhaseGinPeerSignal, src, me))
        return false;
    }
  }
  return true;
}

extern "C" __global__ void __launch_bounds__(kGinCheckThreads, 1) gin_ep_gin_conformance(const GinCheckArgs a) {
  const ncclTeam world = ncclTeamWorld(a.comm);
  const int n = world.nRanks, me = world.rank;
  const uint64_t it = a.iteration;
  char* base = static_cast<char*>(ncclGetLocalPointer(a.win, 0));
  const bool order_round = a.order_every != 0 && it % a.order_every == 0;
  const int order_to = (me + 1) % n, order_from = (me + n - 1) % n;
  const int order_ctx = int((it / (a.order_every ? a.order_every : 1)) & 3);
  uint64_t* expect_sig = a.expect;
  uint64_t* expect_ctr = a.expect + 4 * size_t(a.n_signals);

  // 1. Sources: this iteration's data for every destination (ops 0, 1), the ordering block,
  // and the same-node stores straight into each same-node peer's window.
  for (int dst = 0; dst < n; ++dst) {
    for (uint32_t op = 0; op < 2; ++op) {
      const GcOp o = gc_plan(a.seed, it, me, dst, op, a.max_bytes, a.slot);
      const uint64_t key = gc_key(a.seed, it, me, dst, op);
      char* s = base + a.send_offset + (size_t(dst) * 2 + op) * a.slot + o.src_off;
      for (uint64_t i = threadIdx.x; i < o.bytes; i += blockDim.x) s[i] = char(gc_byte(key, i));
    }
    if (a.node_peers[dst] != 0) {
      const GcOp o = gc_plan(a.seed, it, me, dst, 4, a.max_bytes, a.slot);
      const uint64_t key = gc_key(a.seed, it, me, dst, 4);
      char* d = reinterpret_cast<char*>(a.node_peers[dst]) + a.node_recv_offset + size_t(me) * a.slot + o.dst_off;
      for (uint64_t i = threadIdx.x; i < o.bytes; i += blockDim.x) d[i] = char(gc_byte(key, i));
    }
  }
  if (order_round) {
    const uint64_t key = gc_key(a.seed, it, me, order_to, 5);
    char* s = base + a.order_send_offset;
    for (uint64_t i = threadIdx.x; i < uint64_t(kOrderPuts) * kOrderBytes; i += blockDim.x)
      s[i] = char(gc_byte(key, i));
  }
  __syncthreads();  // every thread's source stores precede the puts' fences (gin_put fences)

  // 2. Issue. Thread t serves destination t. Same-node stores are published first: a release
  // store of the iteration number into the peer's flag word, after the CTA's stores (bar.sync
  // above orders them before this thread's release).
  for (int dst = threadIdx.x; dst < n; dst += blockDim.x) {
    if (a.node_peers[dst] != 0) {
      uint64_t* flag =
          reinterpret_cast<uint64_t*>(reinterpret_cast<char*>(a.node_peers[dst]) + a.node_flag_offset + size_t(me) * 8);
      st_release_sys(flag, it + 1);
    }
    for (uint32_t op = 0; op < kGcOps; ++op) gc_issue(a, world, me, dst, op);
    if (order_round && dst == order_to) {
      ncclGin gin(a.comm, order_ctx);
      for (uint32_t j = 0; j < kOrderPuts; ++j) {
        gin_put(gin, world, dst, a.win, a.order_recv_offset + size_t(j) * kOrderBytes, a.win,
                a.order_send_offset + size_t(j) * kOrderBytes, kOrderBytes, ncclGin_None{}, ncclGin_CounterInc{0});
      }
      gin_signal(gin, world, dst, ncclGin_SignalInc{gc_order(n)});
    }
  }
  // Own bookkeeping: what this rank's counters reach once its sources are consumed.
  if (threadIdx.x == 0) {
    for (int dst = 0; dst < n; ++dst) {
      for (uint32_t op = 0; op < 3; ++op) expect_ctr[gc_plan(a.seed, it, me, dst, op, a.max_bytes, a.slot).ctx] += 1;
    }
    if (order_round) expect_ctr[order_ctx] += kOrderPuts;
  }

  // 3. The ordering test first: verify the whole block the moment its signal is seen.
  __shared__ int ok_all;
  if (threadIdx.x == 0) ok_all = 1;
  __syncthreads();
  if (order_round) {
    if (threadIdx.x == 0) {
      uint64_t* e = expect_sig + size_t(order_ctx) * a.n_signals + gc_order(n);
      *e += 1;
      ncclGin gin(a.comm, order_ctx);
      if (!gin_wait_signal(gin, gc_order(n), *e, a.err, a.timeout_ns, kPhaseGinOrdering, order_from, me)) ok_all = 0;
    }
    __syncthreads();
    if (ok_all) {
      const uint64_t key = gc_key(a.seed, it, order_from, me, 5);
      const volatile unsigned char* d = reinterpret_cast<const volatile unsigned char*>(base + a.order_recv_offset);
      for (uint64_t i = threadIdx.x; i < uint64_t(kOrderPuts) * kOrderBytes; i += blockDim.x) {
        const uint32_t want = gc_byte(key, i), got = d[i];
        if (want != got) gc_mismatch(a.result, order_from, 5, i, want, got);
      }
    }
  }

  // 4. Wait for every source's signals of this iteration, on every context, naming it.
  for (int src = threadIdx.x; src < n && ok_all; src += blockDim.x) {
    bool ok = gc_wait_source(a, n, me, src);
    if (ok && a.node_peers[src] != 0) {
      const uint64_t* flag = reinterpret_cast<const uint64_t*>(base + a.node_flag_offset + size_t(src) * 8);
      ok = wait_word(flag, it + 1, kPhaseNodeStore, src, me, a.timeout_ns, a.err);
    }
    if (!ok) ok_all = 0;
  }
  __syncthreads();

  // 5. Verify every byte of this iteration's puts and same-node stores.
  if (ok_all) {
    for (int src = 0; src < n; ++src) {
      for (uint32_t op = 0; op < 2; ++op) {
        const GcOp o = gc_plan(a.seed, it, src, me, op, a.max_bytes, a.slot);
        const uint64_t key = gc_key(a.seed, it, src, me, op);
        const volatile unsigned char* d = reinterpret_cast<const volatile unsigned char*>(
            base + a.recv_offset + (size_t(src) * 2 + op) * a.slot + o.dst_off);
        for (uint64_t i = threadIdx.x; i < o.bytes; i += blockDim.x) {
          const uint32_t want = gc_byte(key, i), got = d[i];
          if (want != got) gc_mismatch(a.result, src, op, i, want, got);
        }
      }
      if (a.node_peers[src] != 0) {
        const GcOp o = gc_plan(a.seed, it, src, me, 4, a.max_bytes, a.slot);
        const uint64_t key = gc_key(a.seed, it, src, me, 4);
        const volatile unsigned char* d = reinterpret_cast<const volatile unsigned char*>(
            base + a.node_recv_offset + size_t(src) * a.slot + o.dst_off);
        for (uint64_t i = threadIdx.x; i < o.bytes; i += blockDim.x) {
          const uint32_t want = gc_byte(key, i), got = d[i];
          if (want != got) gc_mismatch(a.result, src, 4, i, want, got);
        }
      }
    }
  }
  __syncthreads();

  // 6. gin-ep's signal barrier (context 0, one signal per source so a late rank is named),
  // then this rank's counters: its sources of this iteration are consumed. Skipped once a
  // wait failed: the error record already names the peer, and the host stops.
  if (!ok_all) return;
  for (int dst = threadIdx.x; dst < n; dst += blockDim.x) {
    ncclGin gin(a.comm, 0);
    gin_signal(gin, world, dst, ncclGin_SignalInc{gc_bar(n, me)});
  }
  for (int src = threadIdx.x; src < n; src += blockDim.x) {
    ncclGin gin(a.comm, 0);
    uint64_t* e = expect_sig + gc_bar(n, src);
    *e += 1;
    if (!gin_wait_signal(gin, gc_bar(n, src), *e, a.err, a.timeout_ns, kPhaseGinBarrier, src, me)) ok_all = 0;
  }
  __syncthreads();
  if (ok_all && threadIdx.x < 4) {
    ncclGin gin(a.comm, int(threadIdx.x));
    (void)gin_wait_counter(gin, 0, expect_ctr[threadIdx.x], a.err, a.timeout_ns, me);
  }
}
#endif
