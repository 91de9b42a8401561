// kernels/pattern.cu: test patterns for validating data movement on the device.
//
// Owns: the all-to-all pattern rule and the kernels that write and check it, so a benchmark
// validates every byte without copying gigabytes back to the host. Never: moves data between
// ranks (the kernels under test do).
//
// The rule (mirrored in gin-ep-lab's src/alltoall/run.rs, `pattern_word`): 32-bit word j of the
// chunk that rank `src` sends to rank `dst` is mix(seed, src, dst, j). A fresh seed per run
// means stale data from an earlier run never passes, and a receive buffer poisoned with a
// constant before the run catches a chunk that was never written.

#include <stdint.h>

// PatternArgs, the kernels' parameter, shared with the host.
#include "abi/pattern.h"

namespace gin_ep {

// __host__ too, so the Rust mirror's test values can be printed from this very definition.
// splitmix64's finalizer over the packed coordinates: every bit of src, dst, j and seed
// reaches every output bit, so swapped chunks, shifted offsets and stale runs all differ.
__host__ __device__ __forceinline__ uint32_t pattern_word(uint32_t seed, uint32_t src, uint32_t dst, uint64_t j) {
  uint64_t x = j * 0x9E3779B97F4A7C15ull ^ (uint64_t(src) << 48 | uint64_t(dst) << 32 | seed);
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 31;
  return uint32_t(x);
}

}  // namespace gin_ep

// Sender side: chunk p of rank `rank`'s buffer gets pattern(seed, rank, p, j).
extern "C" __global__ void gin_ep_pattern_fill(const gin_ep::PatternArgs a) {
  const uint64_t total = a.chunk_words * a.n_ranks;
  for (uint64_t i = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += uint64_t(gridDim.x) * blockDim.x) {
    const uint32_t peer = uint32_t(i / a.chunk_words);
    a.buf[i] = gin_ep::pattern_word(a.seed, a.rank, peer, i % a.chunk_words);
  }
}

// Receiver side: slot s of rank `rank`'s receive buffer must hold pattern(seed, s, rank, j).
// Counts mismatches and keeps the lowest bad index (device memory; the host copies it back).
extern "C" __global__ void gin_ep_pattern_check(const gin_ep::PatternArgs a) {
  const uint64_t total = a.chunk_words * a.n_ranks;
  uint64_t bad = 0;
  uint64_t first = ~0ull;
  for (uint64_t i = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += uint64_t(gridDim.x) * blockDim.x) {
    const uint32_t src = uint32_t(i / a.chunk_words);
    if (a.buf[i] != gin_ep::pattern_word(a.seed, src, a.rank, i % a.chunk_words)) {
      ++bad;
      first = min(first, i);
    }
  }
  if (bad != 0) {
    atomicAdd(reinterpret_cast<unsigned long long*>(&a.out[0]), (unsigned long long)bad);
    atomicMin(reinterpret_cast<unsigned long long*>(&a.out[1]), (unsigned long long)first);
  }
}
