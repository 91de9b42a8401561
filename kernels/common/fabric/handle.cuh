// kernels/common/fabric/handle.cuh: Fabric, the one object through which a kernel reaches its
// peers, whatever the transport: stores into an LSA peer's window (NCCL's LSA team, or
// gin-ep's IPC-mapped node windows in the same layout) and NCCL's GIN for the others. Part of
// common/fabric.cuh (its head has the ordering contracts).
//
// Owns: the rank-index convention (every `peer` below is a rank of the kernel's group, the
// index of the routing and of the signals, never an LSA index), the LSA and rail teams, peer
// addressing, the signal and wait forms a phase calls, and the GIN ids of a kernel's signals.
// Never: decides what is sent (the phases do) or where a buffer lies (the host passes every
// offset), and never waits without a deadline.
//
// Built from the kernel arguments by one function per argument struct (ht/common.cuh,
// ll/common.cuh, the lab kernels) and used by value: every field comes from the constant
// bank, so a Fabric costs no register until a field is used.

#pragma once

#include <stddef.h>
#include <stdint.h>

#include "common/nccl_compat.cuh"
#include "common/fabric/deadline.cuh"
#include "common/fabric/gin.cuh"
#include "common/fabric/lsa.cuh"
#include "common/fabric/order.cuh"

namespace gin_ep {

// Ranks first + i * stride of the group, i in [0, size): a team as the fabric numbers it.
struct FabricTeam {
  int first;
  int size;
  int stride;

  __device__ __forceinline__ int rank(int i) const { return first + i * stride; }
  __device__ __forceinline__ int index(int peer) const { return (peer - first) / stride; }
};

#if GIN_EP_HAVE_GIN
// One thread: a GIN put of `bytes` from this rank's window at `src_off` to `peer`'s window at
// `dst_off`, whose arrival adds `add` to signal `sig` at peer (bytes = 0: the signal alone,
// as a 0-byte put: NCCL 2.28.9's putValue and signal-only paths are avoided, gin.cuh). The
// signal is visible only after the payload has landed (and every earlier put on the context
// to that peer): the one ordering GIN promises. No local completion is asked for (the callers
// rewrite a source only after its receiver has credited it).
// Out of line: an inlined ncclGin operation carries every backend (proxy and GDAKI), which
// would raise the register count of the store paths that never use it.
__device__ __noinline__ void fabric_gin_put(const ncclDevComm& comm, ncclWindow_t win, int peer, size_t dst_off,
                                            size_t src_off, size_t bytes, ncclGinSignal_t sig, uint64_t add) {
  ncclGin gin(comm, peer);
  gin_put(gin, ncclTeamWorld(comm), peer, win, dst_off, win, src_off, bytes, ncclGin_SignalAdd{sig, add},
          ncclGin_None{});
}
#endif

// Waits until the u64 word *w, which `peer` writes, is >= least (the words only grow), with
// the deadline; false: recorded in `err` (null: nothing recorded) naming phase, peer and
// `rank`, the waiter. `relaxed`: poll with relaxed loads and acquire once at the end (an
// acquire load invalidates the SM's L1 at every try); else every poll is an acquire. The
// form of Fabric::wait for a waiter without a Fabric (the lab kernels' node flags).
__device__ __forceinline__ bool wait_word(const uint64_t* w, uint64_t least, FabricPhase phase, int peer, int rank,
                                          uint64_t timeout_ns, FabricError* err, bool relaxed = false) {
  // The clock is read at the first slow poll and then every 256 polls: cheap enough to keep
  // the poll loop tight, frequent enough for ms-scale deadlines.
  PollDeadline deadline;
  for (uint32_t spin = 0; (relaxed ? ld_relaxed_sys(w) : ld_acquire_sys(w)) < least; ++spin) {
    if ((spin & 255u) == 0u && !deadline.ok(err, timeout_ns, phase, peer, rank)) return false;
  }
  // The word only grows: the acquire load sees at least what the relaxed one saw.
  if (relaxed) (void)ld_acquire_sys(w);
  return true;
}

struct Fabric {
  // LSA: the window of LSA index i lies at lsa_base + i * lsa_stride4G * 4 GiB in this
  // process; group ranks [lsa_first, lsa_first + lsa_size) are LSA indices 0, 1, ...
  char* lsa_base;
  uint32_t lsa_stride4G;
  int lsa_first;
  int lsa_size;
  int rank;   // this rank, in the group
  int ranks;  // the group
  // GIN: the device communicator (its world team is the group), this rank's window (source
  // and destination of every put), and the id of signal (kind 0, source 0) of this user's
  // signals, [kind][src] from there.
  const ncclDevComm* comm;
  ncclWindow_t win;
  uint32_t sig_base;
  // Every wait's deadline and where a missed one is recorded.
  uint64_t timeout_ns;
  FabricError* err;

  // ---- teams (group ranks) --------------------------------------------------------------

  // The ranks this one reaches by stores (its gin-ep node).
  __device__ __forceinline__ FabricTeam lsa() const { return FabricTeam{lsa_first, lsa_size, 1}; }
  // The ranks with this rank's local index on every node (nodes of lsa_size ranks each).
  __device__ __forceinline__ FabricTeam rail() const {
    return FabricTeam{rank - lsa_first, ranks / lsa_size, lsa_size};
  }
  // Whether `peer` is reached by stores (ptr); every other rank by GIN (put).
  __device__ __forceinline__ bool by_store(int peer) const { return unsigned(peer - lsa_first) < unsigned(lsa_size); }

  // ---- LSA: addresses, signals, waits ---------------------------------------------------

  // Address of `offset` in `peer`'s window (by_store(peer) only). From the fields (the
  // constant bank) rather than the window struct: ncclGetLsaPointer loads both at every call,
  // and the compiler reloads them after every asm "memory" clobber (each store and fence),
  // through an L1 that acquire loads and fences invalidate: a dependent L2 round trip before
  // many remote stores.
  __device__ __forceinline__ char* ptr(size_t offset, int peer) const {
    return nccl::utility::add4G(lsa_base, (peer - lsa_first) * int(lsa_stride4G)) + offset;
  }
  __device__ __forceinline__ uint64_t* word(size_t offset, int peer) const {
    return reinterpret_cast<uint64_t*>(ptr(offset, peer));
  }

  // Signals the u64 word at `offset` of `peer` (by_store): a release store of `value`, or a
  // release add, by a thread that follows the CTA barrier after the data stores (cumulative
  // at system scope over them; no fence needed).
  __device__ __forceinline__ void signal_store(size_t offset, int peer, uint64_t value) const {
    st_release_sys(word(offset, peer), value);
  }
  __device__ __forceinline__ void signal_add(size_t offset, int peer, uint64_t add) const {
    red_release_sys_add(word(offset, peer), add);
  }

  // wait_word with this rank as the waiter: the given deadline and error record (null: a miss
  // records nothing), or the fabric's.
  __device__ __forceinline__ bool wait(const uint64_t* w, uint64_t least, FabricPhase phase, int peer, uint64_t timeout,
                                       FabricError* error, bool relaxed = false) const {
    return wait_word(w, least, phase, peer, rank, timeout, error, relaxed);
  }
  __device__ __forceinline__ bool wait(const uint64_t* w, uint64_t least, FabricPhase phase, int peer,
                                       bool relaxed = false) const {
    return wait(w, least, phase, peer, timeout_ns, err, relaxed);
  }

  // ---- GIN: puts, signals, waits --------------------------------------------------------

#if GIN_EP_HAVE_GIN
  // GIN signal [kind][src] of this user's signals.
  __device__ __forceinline__ ncclGinSignal_t gin_signal(int kind, int src) const {
    return sig_base + uint32_t(kind * ranks + src);
  }

  // One thread: a put to `peer` (not by_store) whose arrival adds `add` to signal
  // [kind][rank] at peer (fabric_gin_put). Every signal addressed to a rank travels on the
  // context of that rank (ncclGin's constructor picks it from the peer), and that rank reads
  // all of its signals through the same context: GIN orders and stores signals per context.
  __device__ __forceinline__ void put(int peer, size_t dst_off, size_t src_off, size_t bytes, int kind,
                                      uint64_t add) const {
    fabric_gin_put(*comm, win, peer, dst_off, src_off, bytes, gin_signal(kind, rank), add);
  }
  // One thread: adds `add` to signal [kind][rank] at `peer`, ordered after every earlier put
  // of this rank to peer (a 0-byte put at `offset`).
  __device__ __forceinline__ void signal(int peer, size_t offset, int kind, uint64_t add) const {
    put(peer, offset, offset, 0, kind, add);
  }

  // One thread: waits until this rank's signal [kind][src] has reached `least` (plain >=:
  // the signals start at 0, only grow, and u64 does not wrap), with the deadline `timeout`;
  // false: recorded in `error` (null: nothing) naming phase and src.
  // Inline (unlike the puts): reading a signal is one load on either backend, and a call
  // would keep the send kernels' prefetched rows live across it (register spills).
  __device__ __forceinline__ bool wait_signal(int kind, int src, uint64_t least, FabricPhase phase, uint64_t timeout,
                                              FabricError* error) const {
    ncclGin gin(*comm, rank);
    return gin_wait_signal(gin, gin_signal(kind, src), least, error, timeout, phase, src, rank);
  }

  // This rank's signal [kind][src] now (acquire): what a wait_signal that succeeded saw, or
  // more (the value, beyond the target, says how the sender ended, e.g. HT's kHtGinFail).
  __device__ __forceinline__ uint64_t read_signal(int kind, int src) const {
    ncclGin gin(*comm, rank);
    return gin.readSignal(gin_signal(kind, src));
  }

  // Every thread of one CTA: zeroes this rank's GIN signals [0, kinds)[R]. Only when every
  // operation of every rank has completed (no add races with it, as resetSignal requires).
  __device__ __forceinline__ void reset_signals(int kinds) const {
    ncclGin gin(*comm, rank);
    for (int i = int(threadIdx.x); i < kinds * ranks; i += int(blockDim.x)) gin.resetSignal(gin_signal(0, 0) + i);
  }
#else
  __device__ __forceinline__ void put(int, size_t, size_t, size_t, int, uint64_t) const { __trap(); }
  __device__ __forceinline__ void signal(int, size_t, int, uint64_t) const { __trap(); }
  __device__ __forceinline__ bool wait_signal(int, int, uint64_t, FabricPhase, uint64_t, FabricError*) const {
    __trap();
    return false;
  }
  __device__ __forceinline__ uint64_t read_signal(int, int) const {
    __trap();
    return 0;
  }
  __device__ __forceinline__ void reset_signals(int) const { __trap(); }
#endif
};

// A Fabric over NCCL's LSA team alone (the lab kernels): the window's own LSA base and stride
// (what ncclGetLsaPointer reads), the team as the group, no GIN signals of its own.
__device__ __forceinline__ Fabric lsa_fabric(const ncclDevComm& comm, ncclWindow_t win, uint64_t timeout_ns,
                                             FabricError* err) {
  return Fabric{nccl::utility::loadConst(&win->lsaFlatBase),
                nccl::utility::loadConst(&win->stride4G),
                0,
                comm.lsaSize,
                comm.lsaRank,
                comm.lsaSize,
                &comm,
                win,
                0u,
                timeout_ns,
                err};
}

// ---------------------------------------------------------------------------------------
// DeadlineBarrier: NCCL's ncclLsaBarrierSession over the fabric's LSA team, but every wait
// ends by a deadline.
//
// Per block: block b of rank r arrives by writing `epoch` into word [b][r] of every LSA peer's
// window (release: all stores this block made before the barrier are visible to a peer that
// observes the word), then waits until its own words [b][p] reach `epoch` for every LSA peer p
// (acquire: after the wait the block sees everything those peers' block b wrote before
// arriving). Block-to-block pairing is enough for an all-to-all: the kernel's end (all
// blocks done) is the global completion, as in the NCCL Device API benchmarks.
struct DeadlineBarrier {
  Fabric fabric;
  size_t signal_offset;  // start of the gridDim.x * lsa_size u64 words

  // Word [blockIdx.x][src] in owner's window (both group ranks of the LSA team).
  __device__ __forceinline__ uint64_t* word(int owner, int src) const {
    const size_t idx = size_t(blockIdx.x) * size_t(fabric.lsa_size) + size_t(src - fabric.lsa_first);
    return fabric.word(signal_offset + idx * sizeof(uint64_t), owner);
  }

  // All threads of the block call this. Returns false (in every thread) when a peer missed
  // the deadline; the error record names it.
  __device__ bool sync(uint64_t epoch, FabricPhase phase) const {
    __syncthreads();  // the block's earlier stores happen-before thread 0..n-1's release
    const FabricTeam team = fabric.lsa();
    for (int i = threadIdx.x; i < team.size; i += blockDim.x) {
      st_release_sys(word(team.rank(i), fabric.rank), epoch);
    }
    bool ok = true;
    for (int i = threadIdx.x; i < team.size && ok; i += blockDim.x) {
      ok = fabric.wait(word(fabric.rank, team.rank(i)), epoch, phase, team.rank(i));
    }
    // bar.sync extends each waiter's acquire to the whole block.
    return __syncthreads_and(ok) != 0;
  }
};

}  // namespace gin_ep
