// kernels/abi/pattern.h: the parameter of the pattern fill and check kernels
// (kernels/pattern.cu), shared with the host.
//
// Format: the subset at the head of gin-ep's abi/common.h (the host reads this file through
// crates/gin-ep-lab/build.rs: gin_ep_lab's abi::pattern).
#pragma once

#include <stdint.h>

namespace gin_ep {

// The one parameter of gin_ep_pattern_fill and gin_ep_pattern_check.
struct PatternArgs {
  uint32_t* buf;  // n_ranks chunks of chunk_words words
  uint64_t chunk_words;
  uint32_t n_ranks;
  uint32_t rank;  // fill: the sender (src); check: the receiver (dst)
  uint32_t seed;
  uint32_t pad;
  uint64_t* out;  // check only: [0] mismatches, [1] first bad word index (~0 = none)
};

}  // namespace gin_ep
