// kernels/ll/publisher.cuh: the publisher warp of the fused dispatch's send: send warps
// record their progress in shared memory and the CTA's last warp fences once per batch of
// rounds and stores their ready words.

// A send warp's progress word once it stopped on a failed wait of its own.
constexpr uint32_t kProgressFailed = 0xffffffffu;

// The publisher warp (the CTA's last) of a send. Send warp w of this CTA takes items i,
// i + warps, ... with i = blockIdx.x * per_cta + w: its round r is its item r. After each
// item's stores a send warp's lane 0 records its progress (st.release.cta, after a warp
// barrier); the chain store -> release.cta -> acquire.cta -> fence.sys -> ready word is a
// release pattern by causality order (the cross-warp form of what a warp barrier and one
// lane's fence do in the split send). The publisher waits until every send warp has stored
// at least one round more than it has published (progress words; a warp that has stored all
// of its items no longer holds anyone back), then fences once (.sys, every lane: each lane
// stores ready words after it) for all of those rounds and the lanes publish their (warp,
// j < per_item) pairs through publish_at(item, j). One fence per round instead fell behind
// (in a combine publisher: ≈ 3.3 rounds, each fence a drain of the SM's stores: +4.3 µs,
// bench/log/2026-11-22-02.md). The send warps never wait on the publisher, so the deadline
// here (1.5x, like wait_recv_table, not reading the host flag) only guards a send warp that
// never advances. False when it expired or a send warp reported kProgressFailed (the
// receivers then miss these ready words and report this rank).
struct PublishPlan {
  int per_cta;     // send warps per CTA (warps 0..per_cta - 1)
  size_t warps;    // send warps of the grid
  size_t items;    // send items of the grid
  int per_item;    // ready words per item (one per destination)
  int stamp_slot;  // stamped (max) after each fence
  int first_slot;  // stamped (max) after the first batch, or -1
  uint32_t phase;  // of the publisher's own deadline
};

template <typename PublishAt>
__device__ bool publish_rounds(const LlArgs& a, const uint32_t* progress, const PublishPlan& plan,
                               PublishAt publish_at) {
  const int lane = threadIdx.x & 31;
  const int per_cta = plan.per_cta, per_item = plan.per_item;
  const size_t warps = plan.warps, items = plan.items;
  // Grid-wide index of send warp w of this CTA.
  auto warp_at = [&](int w) { return size_t(blockIdx.x) * per_cta + size_t(w); };
  const size_t w0 = warp_at(lane);
  const uint32_t mine = lane < per_cta && w0 < items ? uint32_t((items - 1 - w0) / warps + 1) : 0u;
  const uint32_t rounds = __shfl_sync(0xffffffffu, mine, 0);  // warp 0 has the most
  constexpr uint32_t kAll = kProgressFailed - 1;              // no constraint
  for (uint32_t published = 0; published < rounds;) {
    PollDeadline deadline;
    uint32_t done = 0;
    for (uint32_t spin = 0;; ++spin) {
      const uint32_t v = mine == 0u ? kAll : ld_acquire_cta_shared(progress + lane);
      const bool failed = v == kProgressFailed;
      if (__any_sync(0xffffffffu, failed)) {
        if (failed) mark_failed(a);
        return false;
      }
      done = __reduce_min_sync(0xffffffffu, v >= mine ? kAll : v);
      if (done > published) break;
      bool expired = false;
      if (lane == 0 && (spin & 255u) == 255u) {
        expired = !deadline.ok(a.err, wait_timeout(a, a.rank), static_cast<FabricPhase>(plan.phase), a.rank, a.rank,
                               /*others=*/false);
        if (expired) mark_failed(a);
      }
      if (__shfl_sync(0xffffffffu, expired, 0)) return false;
    }
    done = min(done, rounds);
    __syncwarp();  // every lane's acquire before every lane's fence
    fence_acq_rel_sys();
    if (lane == 0) stamp_max(a, plan.stamp_slot);
    const int per_round = per_cta * per_item;
    for (int p = lane; p < int(done - published) * per_round; p += 32) {
      const int q = p % per_round;
      const size_t item = warp_at(q / per_item) + size_t(published + p / per_round) * warps;
      if (item < items) publish_at(item, q % per_item);
    }
    if (published == 0 && plan.first_slot >= 0 && lane == 0) stamp_max(a, plan.first_slot);
    published = done;
  }
  return true;
}
