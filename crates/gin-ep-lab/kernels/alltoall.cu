// kernels/alltoall.cu: all-to-all over the NCCL Device API, the fabric's first user and our
// yardstick against ncclAllToAll (shared/ANCHORS.md).
//
// Data layout (every rank the same): the send buffer holds n_ranks chunks of chunk_bytes,
// chunk p for rank p; the window holds the receive buffer at recv_offset, n_ranks chunks,
// slot s filled by rank s. Push kernels: rank r writes send[p] into peer p's window at
// recv_offset + r * chunk_bytes. Pull kernels: the send buffer is inside the window too (at
// send_offset), and rank r reads chunk r of peer p's send buffer into its own slot p.
// chunk_bytes must be a multiple of 16 and every offset 16-byte aligned (the host checks;
// kernels do not re-validate).
//
// lsa_simple, lsa_pull and lsa_opt_nccl_barrier run two barriers, epochs 2e+1 and 2e+2 for
// the host's launch counter e: the start barrier makes sure every peer has entered this
// launch, so the previous launch's readers of its receive buffer are done (stream order on
// that peer); the end barrier makes the data visible to the receiver before its kernel ends.
// ce_start and ce_end are these two barriers alone, around copies the host gives the copy
// engine (see "ce" below).
//
// lsa_opt, lsa_run, lsa_bulk (the `each` signal) and lsa_count (an arrival counter) run one
// signal round and no start barrier (see "Double-buffered protocol" below): the receive
// region is double-buffered, launch e writing buffer e & 1 at recv_offset +
// (e & 1) * recv_stride.
//
// Kernels are extern "C" so the host finds them by plain name with cuModuleGetFunction.

#include "common/fabric.cuh"
#include "common/nccl_compat.cuh"

// The argument structs, the block size ceiling, the variant bits and the stamp points the host
// shares (after the headers that define the types they name).
#include "abi/alltoall.h"

namespace gin_ep {

__device__ __forceinline__ void stamp(const AlltoallArgs& a, Stamp i) {
  if (a.stamps != nullptr && threadIdx.x == 0) a.stamps[blockIdx.x * kStampsPerCta + i] = globaltimer_ns();
}

static_assert(kVflagStorePlain == 0u, "the host's default (vflags 0) is the plain store");

__device__ __forceinline__ DeadlineBarrier make_barrier(const AlltoallArgs& a) {
  return DeadlineBarrier{lsa_fabric(a.comm, a.win, a.timeout_ns, a.err), a.signal_offset};
}

}  // namespace gin_ep

using namespace gin_ep;

// lsa_simple: the plainest correct version, the baseline for lsa_opt. Work items are
// (peer, slice) pairs, item i serving peer i % n_ranks, so neighbouring blocks feed different
// links; blocks stride over items, so a grid smaller than n_ranks still covers every peer
// (the first version mapped block b to peer b % n only, and a grid < n skipped peers).
// 4-byte loads and stores.
extern "C" __global__ void __launch_bounds__(kMaxThreads) gin_ep_alltoall_lsa_simple(const AlltoallArgs a) {
  const DeadlineBarrier bar = make_barrier(a);
  if (!bar.sync(2 * a.epoch + 1, kPhaseAlltoallStart)) return;

  const int n = a.comm.lsaSize;
  const int slices = max(1, int(gridDim.x) / n);
  const size_t words = a.chunk_bytes / 4;
  const size_t per_slice = (words + slices - 1) / slices;
  for (int item = blockIdx.x; item < n * slices; item += gridDim.x) {
    const int peer = item % n;
    const int slice = item / n;
    const size_t begin = min(words, size_t(slice) * per_slice);
    const size_t end = min(words, begin + per_slice);
    const uint32_t* src = reinterpret_cast<const uint32_t*>(a.send + size_t(peer) * a.chunk_bytes);
    uint32_t* dst =
        reinterpret_cast<uint32_t*>(lsa_ptr(a.win, a.recv_offset + size_t(a.comm.lsaRank) * a.chunk_bytes, peer));
    for (size_t i = begin + threadIdx.x; i < end; i += blockDim.x) dst[i] = src[i];
  }

  bar.sync(2 * a.epoch + 2, kPhaseAlltoallEnd);
}

// Push copy, what the hardware wants. Work is cut into 512-byte tiles (one warp, one 16-byte
// vector per lane); tile i goes to peer (rank + 1 + i) % n, so the UNROLL tiles a warp holds
// in flight go to UNROLL different peers and every NVLink is busy at once, instead of the
// whole grid queueing on one link at a time. All UNROLL loads are issued before the first
// store so their latencies overlap. Grid-stride over warps: any grid size is correct.
// `slot_offset`: where this rank's chunk lies in every peer's window. Indices are 32-bit
// (tiles <= 16 GiB / 512 = 2^25) and peer pointers are base + peer * stride, computed once:
// no 64-bit division and no window-struct load per tile.
template <int UNROLL>
__device__ __forceinline__ void alltoall_push_copy(const AlltoallArgs& a, size_t slot_offset) {
  const uint32_t n = uint32_t(a.comm.lsaSize);
  const uint32_t rank = uint32_t(a.comm.lsaRank);
  const uint32_t lane = threadIdx.x % 32;
  const uint32_t vecs = uint32_t(a.chunk_bytes / 16);
  const uint32_t tiles_per_chunk = (vecs + 31) / 32;
  const uint32_t tiles = tiles_per_chunk * n;
  const uint32_t warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const uint32_t warps = gridDim.x * blockDim.x / 32;
  char* const base = lsa_ptr(a.win, slot_offset, 0);
  const size_t stride = n > 1 ? size_t(lsa_ptr(a.win, slot_offset, 1) - base) : 0;
  const uint32_t first_peer = (rank + 1) % n;

  for (uint32_t tb = warp * UNROLL; tb < tiles; tb += warps * UNROLL) {
    uint4 v[UNROLL];
    uint4* dst[UNROLL];
    // tile -> (peer, tile within chunk); the first UNROLL tiles of a warp step are
    // consecutive, so only the first needs a division.
    uint32_t peer = (first_peer + tb % n) % n;
    uint32_t ct = tb / n;
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      // Tail lanes (and whole tiles past the end) get dst = nullptr and skip the store.
      dst[u] = nullptr;
      const uint32_t vec = ct * 32 + lane;
      if (tb + u < tiles && vec < vecs) {
        v[u] = ld_nc_v4(reinterpret_cast<const uint4*>(a.send + size_t(peer) * a.chunk_bytes) + vec);
        dst[u] = reinterpret_cast<uint4*>(base + size_t(peer) * stride) + vec;
      }
      if (++peer == n) peer = 0;
      if (peer == first_peer) ++ct;
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      if (dst[u] != nullptr) st_v4(dst[u], v[u]);
    }
  }
}

// Double-buffered protocol (lsa_opt, lsa_run, lsa_bulk, lsa_count): one signal round per
// launch and no start barrier.
//
// - Data: launch e pushes into receive buffer e & 1 of every peer.
// - Signal: after its stores, a rank tells every peer "launch e landed" and waits
//   (deadline) until every peer told it the same (acquire); the waiter's acquire, then the
//   kernel boundary, make the peers' data visible to whatever the stream runs next. Two
//   ways to signal, below: `each` (lsa_opt and the bandwidth variants) and the arrival
//   counter (lsa_count, the first design, kept for comparison).
// - Why no start barrier: the sender at launch e last wrote buffer e & 1 at launch e - 2 or
//   earlier. It finished launch e - 1, which waited for peer p's signal of e - 1, which p
//   wrote inside its launch e - 1; so p had entered launch e - 1, and stream order on p
//   means p's readers of buffer e & 1 enqueued before launch e - 1 were done. Hence the
//   contract: a rank reads the output of launch e before enqueueing launch e + 1, and never
//   writes its own receive buffers without a group-wide sync first (the benchmark poisons,
//   then meets its peers at a host barrier). A rank is at most one launch ahead of a peer.
// - The epoch e is the rank's launch counter shared with the two-barrier kernels.

// The `each` signal (lsa_opt, lsa_run, lsa_bulk). Every CTA, after its stores, adds 1
// (red.release.sys, thread p for peer p, in parallel) to counter [e & 1][rank] in every
// peer's flag area; CTA 0 alone then waits (deadline) until its own counters [e & 1][p]
// reach gridDim.x for every p (acquire), and resets them to 0. Why the reset is safe: peer
// p adds to slot e & 1 again only at launch e + 2, which it starts after its launch e + 1
// saw our signals of e + 1, which we send after this kernel (and its reset) ended. Every
// rank runs the same grid, so gridDim.x counts the adds of one launch from one peer. Cost
// per CTA: one __syncthreads and n fire-and-forget release adds; no serial fence + atomic +
// fence chain through a last CTA (lsa_count's: 4 us more at 1 MiB on 4x H200). Counters
// live after lsa_count's words: flag_offset + 8 * (n + 1 + (e & 1) * n + src).
__device__ __forceinline__ void signal_each_and_wait(const AlltoallArgs& a) {
  const int n = a.comm.lsaSize;
  const int rank = a.comm.lsaRank;
  const size_t slot = a.flag_offset + size_t(n + 1 + int(a.epoch & 1) * n) * 8;
  __syncthreads();  // every thread's stores happen-before the releases below (bar.sync)
  stamp(a, kStampCopied);
  for (int p = int(threadIdx.x); p < n; p += int(blockDim.x)) {
    red_release_sys_add(reinterpret_cast<uint64_t*>(lsa_ptr(a.win, slot + size_t(rank) * 8, p)), 1);
  }
  stamp(a, kStampSignal);
  if (blockIdx.x != 0) return;
  uint64_t* const mine = reinterpret_cast<uint64_t*>(lsa_ptr(a.win, slot, rank));
  bool ok = true;
  const uint64_t start = globaltimer_ns();
  for (int p = int(threadIdx.x); p < n && ok; p += int(blockDim.x)) {
    ok = wait_at_least(mine + p, gridDim.x, start, a.timeout_ns);
    if (!ok) {
      report_error(a.err, kPhaseAlltoallEnd, p, rank, globaltimer_ns() - start);
    } else {
      mine[p] = 0;  // see above: no adds to this slot until our next-but-one launch
    }
  }
  __syncthreads_and(ok);  // extends the waiters' acquire to the block (and the kernel end)
  stamp(a, kStampSeen);
}

// lsa_opt: the interleaved push copy with the `each` signal.
template <int UNROLL>
__device__ __forceinline__ void alltoall_lsa_opt(const AlltoallArgs& a) {
  stamp(a, kStampStart);
  const size_t buf = a.recv_offset + (a.epoch & 1) * a.recv_stride;
  alltoall_push_copy<UNROLL>(a, buf + size_t(a.comm.lsaRank) * a.chunk_bytes);
  signal_each_and_wait(a);
}

// UNROLL 4 is the default (four 16-byte loads in flight per thread cover NVLink latency at
// 512 threads per block); 1, 2 and 8 exist so one run can sweep it (`--unroll`).
#define GIN_EP_LSA_OPT(NAME, U) \
  extern "C" __global__ void __launch_bounds__(kMaxThreads) NAME(const AlltoallArgs a) { alltoall_lsa_opt<U>(a); }
GIN_EP_LSA_OPT(gin_ep_alltoall_lsa_opt, 4)
GIN_EP_LSA_OPT(gin_ep_alltoall_lsa_opt_u1, 1)
GIN_EP_LSA_OPT(gin_ep_alltoall_lsa_opt_u2, 2)
GIN_EP_LSA_OPT(gin_ep_alltoall_lsa_opt_u8, 8)
#undef GIN_EP_LSA_OPT

// lsa_count: the same copy (unroll 4) with the arrival-counter signal, one signal word per
// (source, destination) pair. Every block, after its stores, fences at system scope and
// bumps this rank's local arrival counter; the block that arrives last resets the counter
// (the next launch is stream-ordered after this one), fences again and stores e + 1
// (release, .sys) into word [rank] of every peer's flag area, then waits (deadline) until
// its own words [p] >= e + 1 for every peer p (acquire). The other blocks exit at once.
// One remote store per peer per launch, but a serial fence -> atomic -> fence -> store
// chain in the last block. Words only grow, so nothing is reset between launches, and
// waits are `>=`.
extern "C" __global__ void __launch_bounds__(kMaxThreads) gin_ep_alltoall_lsa_count(const AlltoallArgs a) {
  const int n = a.comm.lsaSize;
  const int rank = a.comm.lsaRank;
  const size_t buf = a.recv_offset + (a.epoch & 1) * a.recv_stride;
  stamp(a, kStampStart);
  alltoall_push_copy<4>(a, buf + size_t(rank) * a.chunk_bytes);

  __shared__ int last;
  uint64_t* const flags = reinterpret_cast<uint64_t*>(lsa_ptr(a.win, a.flag_offset, rank));
  unsigned long long* const arrived = reinterpret_cast<unsigned long long*>(flags + n);
  __syncthreads();  // every thread's stores happen-before thread 0's fence
  stamp(a, kStampCopied);
  if (threadIdx.x == 0) {
    __threadfence_system();
    last = atomicAdd(arrived, 1ull) == gridDim.x - 1ull;
  }
  __syncthreads();
  if (!last || threadIdx.x != 0) return;

  // The last block: every other block's fence + add is before our add.
  *arrived = 0ull;
  __threadfence_system();
  const uint64_t value = a.epoch + 1;
  for (int p = 0; p < n; ++p) {
    st_release_sys(reinterpret_cast<uint64_t*>(lsa_ptr(a.win, a.flag_offset + size_t(rank) * 8, p)), value);
  }
  stamp(a, kStampSignal);
  const uint64_t start = globaltimer_ns();
  for (int i = 1; i <= n; ++i) {
    const int p = (rank + i) % n;  // self last: it is already there
    if (!wait_at_least(flags + p, value, start, a.timeout_ns)) {
      report_error(a.err, kPhaseAlltoallEnd, p, rank, globaltimer_ns() - start);
      return;
    }
  }
  stamp(a, kStampSeen);
}

// Push copy in runs: a work item is RUN vectors per lane = RUN * 512 contiguous bytes of one
// chunk (4 KiB at RUN 8), item i going to peer (rank + 1 + i) % n; a warp loads its whole
// run (RUN independent 16-byte loads per lane) before the first store, then stores it in
// address order, so each link sees one long sequential burst per warp instead of 512-byte
// pieces interleaved with other links. Store instruction from a.vflags (uniform branch).
template <int RUN>
__device__ __forceinline__ void alltoall_push_run(const AlltoallArgs& a, size_t slot_offset) {
  const uint32_t n = uint32_t(a.comm.lsaSize);
  const uint32_t rank = uint32_t(a.comm.lsaRank);
  const uint32_t lane = threadIdx.x % 32;
  const uint32_t vecs = uint32_t(a.chunk_bytes / 16);
  const uint32_t runs_per_chunk = (vecs + 32 * RUN - 1) / (32 * RUN);
  const uint32_t items = runs_per_chunk * n;
  const uint32_t warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const uint32_t warps = gridDim.x * blockDim.x / 32;
  char* const base = lsa_ptr(a.win, slot_offset, 0);
  const size_t stride = n > 1 ? size_t(lsa_ptr(a.win, slot_offset, 1) - base) : 0;
  const uint32_t store = a.vflags & kVflagStoreMask;

  for (uint32_t item = warp; item < items; item += warps) {
    const uint32_t peer = (rank + 1 + item % n) % n;
    const uint32_t first = (item / n) * (32 * RUN) + lane;
    const uint4* src = reinterpret_cast<const uint4*>(a.send + size_t(peer) * a.chunk_bytes) + first;
    uint4* dst = reinterpret_cast<uint4*>(base + size_t(peer) * stride) + first;
    uint4 v[RUN];
#pragma unroll
    for (int u = 0; u < RUN; ++u) {
      if (first + u * 32 < vecs) v[u] = ld_nc_v4(src + u * 32);
    }
#pragma unroll
    for (int u = 0; u < RUN; ++u) {
      if (first + u * 32 < vecs) {
        if (store == kVflagStoreCs) {
          st_cs_v4(dst + u * 32, v[u]);
        } else if (store == kVflagStoreNa) {
          st_na_v4(dst + u * 32, v[u]);
        } else {
          st_v4(dst + u * 32, v[u]);
        }
      }
    }
  }
}

// lsa_run: 4 KiB runs per warp per peer, `each` signal.
extern "C" __global__ void __launch_bounds__(kMaxThreads) gin_ep_alltoall_lsa_run(const AlltoallArgs a) {
  stamp(a, kStampStart);
  const size_t buf = a.recv_offset + (a.epoch & 1) * a.recv_stride;
  alltoall_push_run<8>(a, buf + size_t(a.comm.lsaRank) * a.chunk_bytes);
  signal_each_and_wait(a);
}

// lsa_bulk: the copy engine's way from an SM. Thread 0 of each CTA drives a ring of
// kBulkStages shared-memory buffers of kBulkBytes: cp.async.bulk global -> shared (local
// send chunk, completion on an mbarrier), then cp.async.bulk shared -> global (the peer's
// receive slot, an NVLink address from the window), one bulk group per piece. Pieces: the
// chunk cut in kBulkBytes, piece i going to peer (rank + 1 + i) % n, CTAs striding over
// pieces. Loads run kBulkStages pieces ahead; a stage is refilled once the store that read
// it has finished reading (wait_group.read). The host launches it with 32 threads (one
// warp; only lane 0 works). Before signalling: wait_group 0 (the stores are complete), then
// fence.proxy.async.global so the generic-proxy release that follows orders them.
constexpr int kBulkStages = 4;
constexpr uint32_t kBulkBytes = 8192;  // 4 x 8 KiB = 32 KiB static shared memory per CTA

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void bulk_load(uint32_t dst_smem, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst_smem),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}

__device__ __forceinline__ void bulk_store(void* dst, uint32_t src_smem, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(src_smem), "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// Polls the mbarrier's phase `parity` (deadline: true when it completed in time).
__device__ __forceinline__ bool mbar_wait(uint32_t bar, uint32_t parity, uint64_t start, uint64_t timeout_ns) {
  for (uint32_t spin = 0;; ++spin) {
    uint32_t done;
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
                 : "=r"(done)
                 : "r"(bar), "r"(parity)
                 : "memory");
    if (done) return true;
    if ((spin & 63u) == 63u && globaltimer_ns() - start > timeout_ns) return false;
  }
}

extern "C" __global__ void __launch_bounds__(kMaxThreads) gin_ep_alltoall_lsa_bulk(const AlltoallArgs a) {
  __shared__ alignas(128) unsigned char ring[kBulkStages][kBulkBytes];
  __shared__ alignas(8) uint64_t bars[kBulkStages];
  stamp(a, kStampStart);
  const uint32_t n = uint32_t(a.comm.lsaSize);
  const uint32_t rank = uint32_t(a.comm.lsaRank);
  if (threadIdx.x == 0) {
    const size_t slot_offset = a.recv_offset + (a.epoch & 1) * a.recv_stride + size_t(rank) * a.chunk_bytes;
    char* const base = lsa_ptr(a.win, slot_offset, 0);
    const size_t stride = n > 1 ? size_t(lsa_ptr(a.win, slot_offset, 1) - base) : 0;
    const size_t pieces_per_chunk = (a.chunk_bytes + kBulkBytes - 1) / kBulkBytes;
    const size_t pieces = pieces_per_chunk * n;
    // The k-th piece of this CTA, as (peer, byte offset in the chunk, bytes).
    auto piece = [&](size_t k, uint32_t& peer, size_t& off, uint32_t& bytes) {
      const size_t i = blockIdx.x + k * gridDim.x;
      peer = uint32_t((rank + 1 + i % n) % n);
      off = (i / n) * kBulkBytes;
      bytes = uint32_t(min(size_t(kBulkBytes), a.chunk_bytes - off));
    };
    const size_t count = blockIdx.x < pieces ? (pieces - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
    for (int s = 0; s < kBulkStages; ++s) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&bars[s])) : "memory");
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    auto load = [&](size_t k) {
      uint32_t peer, bytes;
      size_t off;
      piece(k, peer, off, bytes);
      const int s = int(k % kBulkStages);
      bulk_load(smem_addr(ring[s]), a.send + size_t(peer) * a.chunk_bytes + off, bytes, smem_addr(&bars[s]));
    };
    for (size_t k = 0; k < count && k < size_t(kBulkStages); ++k) load(k);
    const uint64_t start = globaltimer_ns();
    for (size_t k = 0; k < count; ++k) {
      const int s = int(k % kBulkStages);
      if (!mbar_wait(smem_addr(&bars[s]), uint32_t(k / kBulkStages) & 1u, start, a.timeout_ns)) {
        report_error(a.err, kPhaseAlltoallEnd, -1, int(rank), globaltimer_ns() - start);
        break;
      }
      uint32_t peer, bytes;
      size_t off;
      piece(k, peer, off, bytes);
      bulk_store(base + size_t(peer) * stride + off, smem_addr(ring[s]), bytes);
      if (k >= 1 && k - 1 + kBulkStages < count) {
        // The store of piece k - 1 read stage (k - 1) % S; piece k's may still be reading.
        asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
        load(k - 1 + kBulkStages);
      }
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    asm volatile("fence.proxy.async.global;" ::: "memory");
  }
  signal_each_and_wait(a);
}

// Pull: tile i comes from peer (rank + 1 + i) % n, like the push kernel, but each thread
// loads 16 bytes of the peer's send chunk for this rank over NVLink and stores locally.
// Reads keep UNROLL loads in flight per thread across different links; whether NVLink reads
// beat writes on a given machine is what `lsa-pull` vs `lsa-opt` measures. Plain (coherent)
// loads, not ld.nc: the peer wrote its send buffer in an earlier kernel, which the start
// barrier's acquire orders, and the non-coherent path promises nothing about remote writes.
template <int UNROLL>
__device__ __forceinline__ void alltoall_lsa_pull_copy(const AlltoallArgs& a) {
  const int n = a.comm.lsaSize;
  const int rank = a.comm.lsaRank;
  const int lane = threadIdx.x % 32;
  const size_t vecs = a.chunk_bytes / 16;
  const size_t tiles_per_chunk = (vecs + 31) / 32;
  const size_t tiles = tiles_per_chunk * size_t(n);
  const size_t warp = (size_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const size_t warps = size_t(gridDim.x) * blockDim.x / 32;
  const size_t send_slot = a.send_offset + size_t(rank) * a.chunk_bytes;
  char* const recv = lsa_ptr(a.win, a.recv_offset, rank);

  for (size_t base = warp * UNROLL; base < tiles; base += warps * UNROLL) {
    uint4 v[UNROLL];
    uint4* dst[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const size_t tile = base + u;
      dst[u] = nullptr;
      if (tile < tiles) {
        const int peer = int((size_t(rank) + 1 + tile) % size_t(n));
        const size_t vec = (tile / size_t(n)) * 32 + lane;
        if (vec < vecs) {
          v[u] = ld_v4(reinterpret_cast<const uint4*>(lsa_ptr(a.win, send_slot, peer)) + vec);
          dst[u] = reinterpret_cast<uint4*>(recv + size_t(peer) * a.chunk_bytes) + vec;
        }
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      if (dst[u] != nullptr) st_v4(dst[u], v[u]);
    }
  }
}

// Barriers as in lsa_simple, with the roles swapped: the start barrier says "my send buffer is
// ready" (its release covers the producer's writes), the end barrier "I am done reading
// yours", so a peer may overwrite its send buffer after its kernel ends.
extern "C" __global__ void __launch_bounds__(kMaxThreads) gin_ep_alltoall_lsa_pull(const AlltoallArgs a) {
  const DeadlineBarrier bar = make_barrier(a);
  if (!bar.sync(2 * a.epoch + 1, kPhaseAlltoallStart)) return;
  alltoall_lsa_pull_copy<4>(a);
  bar.sync(2 * a.epoch + 2, kPhaseAlltoallEnd);
}

// The lsa_opt copy (UNROLL 4, single receive buffer) between two of NCCL's own
// ncclLsaBarrierSession barriers (no deadline), as the nccl-tests Device API
// benchmark does: the reference point that tells whether our barrier costs anything. Needs
// ncclDevCommRequirements.lsaBarrierCount >= gridDim.x. Use only where a hang is acceptable
// (benchmarks run under an outer timeout).
extern "C" __global__ void __launch_bounds__(kMaxThreads) gin_ep_alltoall_lsa_opt_nccl_barrier(const AlltoallArgs a) {
  {
    ncclLsaBarrierSession<ncclCoopCta> bar(ncclCoopCta(), a.comm, ncclTeamTagLsa(), blockIdx.x);
    bar.sync(ncclCoopCta(), cuda::memory_order_relaxed);
  }
  alltoall_push_copy<4>(a, a.recv_offset + size_t(a.comm.lsaRank) * a.chunk_bytes);
  {
    ncclLsaBarrierSession<ncclCoopCta> bar(ncclCoopCta(), a.comm, ncclTeamTagLsa(), blockIdx.x);
    bar.sync(ncclCoopCta(), cuda::memory_order_release);
  }
}

// ---------------------------------------------------------------------------------------
// ce: the copy engine does the all-to-all. The host queues, per launch: gin_ep_alltoall_ce_start,
// one cuMemcpyDtoDAsync per destination (send chunk p -> peer p's receive slot for this rank,
// through the peer's LSA address of the window; on the rank's stream, or on side streams
// forked from it and joined back), then gin_ep_alltoall_ce_end (gin-ep-lab's
// src/launch/alltoall.rs, ce_alltoall). The two kernels are lsa_simple's barriers without its copy, one
// CTA each (block 0's barrier words; the host gives each launch its own epoch e):
// - start (2e+1): every peer has entered this operation, so its readers of the receive
//   buffer from the previous one are done (stream order on the peer) before a copy writes.
// - end (2e+2): launched after this rank's copies completed (stream order, and the join
//   events), and a copy completes only once its writes are done at the destination, so the
//   release store that follows orders them for the peer that acquires it; the receiver's
//   kernel, and so the operation on its stream, ends only when every peer's copies into it
//   are done. The pattern check after the first run and after the timed loop tests exactly
//   this on the machine.
extern "C" __global__ void __launch_bounds__(kMaxThreads) gin_ep_alltoall_ce_start(const AlltoallArgs a) {
  make_barrier(a).sync(2 * a.epoch + 1, kPhaseAlltoallStart);
}

extern "C" __global__ void __launch_bounds__(kMaxThreads) gin_ep_alltoall_ce_end(const AlltoallArgs a) {
  make_barrier(a).sync(2 * a.epoch + 2, kPhaseAlltoallEnd);
}

#if GIN_EP_HAVE_GIN
// ---------------------------------------------------------------------------------------
// gin and hybrid: the all-to-all over NCCL's GPU-Initiated Networking, with the semantics of
// nccl-tests' `-D 3` (every peer, self included, by GIN puts) and `-D 4` (the ranks of this
// rank's gin-ep node by stores, the rest by GIN). Layout as the push kernels: the send region
// (inside the window: GIN puts read a registered source) at send_offset, chunk p for rank p;
// rank r's chunk lands in every peer's receive region at recv_offset + r * chunk_bytes.
//
// One launch (every rank launches the same sequence of these, with the same grid):
// 1. Start barrier (gin-ep's, signal based): CTA 0 sends SignalInc on barrier signal [me] of
//    context 0 to every rank; every CTA then polls (deadline) until barrier signal [src]
//    reached `barrier_target` (the host's count of GIN all-to-all launches on this device
//    communicator) for every src. A rank past it knows every peer has entered this launch, so
//    the peer's stream-ordered readers of the previous output are done.
// 2. Data. CTA 0, thread per destination outside the node: one put of the chunk with
//    SignalInc on data signal [data_base + me] of context (me + dst) & 3 (puts spread over
//    the four contexts; the receiver reads the signal through the sender's context) and
//    CounterInc on counter `counter` of the same context. Every CTA: 16-byte stores of the
//    chunks for the node's ranks straight into their windows (node_bases: this process's
//    address of each node rank's window; its own included), then, after a bar.sync, one
//    release add per node rank on its arrival word [me] at node_flag_offset.
// 3. CTA 0, thread per source: a node rank's arrival word [src] reaching node_target (the
//    sum of the grids of all hybrid launches so far), or data signal [data_base + src] of
//    context (src + me) & 3 reaching data_target (launches of this mode so far); deadlines
//    name the source. Threads 0..3 then poll counter `counter` of their context until this
//    rank's puts on it are consumed (data_target * puts per launch on that context): the send
//    region may be rewritten once the kernel ends. Never flush or waitSignal: no deadline.
// Signals and counters are monotonic, never reset; gin and hybrid use their own data signals
// and counters (data_base, counter), so their targets count only their own launches.
// GinAlltoallArgs: abi/alltoall.h.

__device__ __forceinline__ int gin_a2a_context(int src, int dst) { return (src + dst) & 3; }

// Stores this rank's chunks for node ranks [first, first + m) (all with a node base) into
// their windows: 512-byte tiles (one 16-byte vector per lane), four in flight per warp, tile
// i to node rank (first + (off + i) % m), warps striding over tiles.
__device__ __forceinline__ void gin_a2a_node_stores(const GinAlltoallArgs& a, const char* send, int me, int first,
                                                    int m) {
  const uint32_t vecs = uint32_t(a.chunk_bytes / 16);
  const uint32_t tiles_per_chunk = (vecs + 31) / 32;
  const uint32_t tiles = tiles_per_chunk * uint32_t(m);
  const uint32_t lane = threadIdx.x % 32;
  const uint32_t warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const uint32_t warps = gridDim.x * blockDim.x / 32;
  const uint32_t off = uint32_t(me - first + 1);
  constexpr int kUnroll = 4;
  for (uint32_t tb = warp * kUnroll; tb < tiles; tb += warps * kUnroll) {
    uint4 v[kUnroll];
    uint4* dst[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      dst[u] = nullptr;
      const uint32_t t = tb + u;
      if (t < tiles) {
        const int peer = first + int((off + t % uint32_t(m)) % uint32_t(m));
        const uint32_t vec = (t / uint32_t(m)) * 32 + lane;
        if (vec < vecs) {
          v[u] = ld_nc_v4(reinterpret_cast<const uint4*>(send + size_t(peer) * a.chunk_bytes) + vec);
          dst[u] = reinterpret_cast<uint4*>(reinterpret_cast<char*>(a.node_bases[peer]) + a.recv_offset +
                                            size_t(me) * a.chunk_bytes) +
                   vec;
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (dst[u] != nullptr) st_v4(dst[u], v[u]);
    }
  }
}

extern "C" __global__ void __launch_bounds__(kMaxThreads, 1) gin_ep_alltoall_gin(const GinAlltoallArgs a) {
  const ncclTeam world = ncclTeamWorld(a.comm);
  const int n = world.nRanks, me = world.rank;
  __shared__ int ok_all;
  __shared__ int node_first, node_size;
  if (threadIdx.x == 0) {
    ok_all = 1;
    // The node is the run of consecutive ranks around `me` that have a base (host-checked).
    int f = me, l = me;
    if (a.node_bases[me] != 0) {
      while (f > 0 && a.node_bases[f - 1] != 0) --f;
      while (l + 1 < n && a.node_bases[l + 1] != 0) ++l;
      node_first = f;
      node_size = l - f + 1;
    } else {
      node_first = me;
      node_size = 0;
    }
  }
  __syncthreads();
  const int first = node_first, m = node_size;
  const bool in_node_me = m > 0;
  auto in_node = [&](int r) { return in_node_me && r >= first && r < first + m; };

  // 1. Start barrier.
  if (blockIdx.x == 0) {
    ncclGin gin(a.comm, 0);
    for (int dst = threadIdx.x; dst < n; dst += blockDim.x) {
      gin_signal(gin, world, dst, ncclGin_SignalInc{a.barrier_base + uint32_t(me)});
    }
  }
  {
    ncclGin gin(a.comm, 0);
    bool ok = true;
    for (int src = threadIdx.x; src < n && ok; src += blockDim.x) {
      ok = gin_wait_signal(gin, a.barrier_base + uint32_t(src), a.barrier_target, a.err, a.timeout_ns, kPhaseGinBarrier,
                           src, me);
    }
    if (!__syncthreads_and(ok)) return;
  }

  // 2. Data: GIN puts from CTA 0, stores from every CTA.
  if (blockIdx.x == 0) {
    for (int dst = threadIdx.x; dst < n; dst += blockDim.x) {
      if (in_node(dst)) continue;
      ncclGin gin(a.comm, gin_a2a_context(me, dst));
      gin_put(gin, world, dst, a.win, a.recv_offset + size_t(me) * a.chunk_bytes, a.win,
              a.send_offset + size_t(dst) * a.chunk_bytes, a.chunk_bytes, ncclGin_SignalInc{a.data_base + uint32_t(me)},
              ncclGin_CounterInc{a.counter});
    }
  }
  if (in_node_me) {
    const char* send = static_cast<const char*>(ncclGetLocalPointer(a.win, a.send_offset));
    gin_a2a_node_stores(a, send, me, first, m);
    __syncthreads();  // every thread's stores happen-before the releases below (bar.sync)
    for (int p = threadIdx.x; p < m; p += blockDim.x) {
      red_release_sys_add(reinterpret_cast<uint64_t*>(reinterpret_cast<char*>(a.node_bases[first + p]) +
                                                      a.node_flag_offset + size_t(me) * 8),
                          1);
    }
  }
  if (blockIdx.x != 0) return;

  // 3. Arrivals, then local completion of this rank's puts.
  bool ok = true;
  for (int src = threadIdx.x; src < n && ok; src += blockDim.x) {
    if (in_node(src)) {
      const uint64_t* w = reinterpret_cast<const uint64_t*>(reinterpret_cast<const char*>(a.node_bases[me]) +
                                                            a.node_flag_offset + size_t(src) * 8);
      ok = wait_word(w, a.node_target, kPhaseNodeStore, src, me, a.timeout_ns, a.err);
    } else {
      ncclGin gin(a.comm, gin_a2a_context(src, me));
      ok = gin_wait_signal(gin, a.data_base + uint32_t(src), a.data_target, a.err, a.timeout_ns, kPhaseGinPeerSignal,
                           src, me);
    }
  }
  if (!__syncthreads_and(ok)) return;
  if (threadIdx.x < 4) {
    uint64_t puts = 0;
    for (int dst = 0; dst < n; ++dst) {
      if (!in_node(dst) && gin_a2a_context(me, dst) == int(threadIdx.x)) ++puts;
    }
    if (puts != 0) {
      ncclGin gin(a.comm, int(threadIdx.x));
      ok = gin_wait_counter(gin, a.counter, puts * a.data_target, a.err, a.timeout_ns, me);
    }
  }
  __syncthreads_and(ok);  // extends the waiters' acquires to the block (and the kernel end)
}
#endif
