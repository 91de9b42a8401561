// kernels/ll/entries.cuh: what each LL entry point runs (ll.cu defines the kernels, once
// per variant). Included twice by ll.cu, like the parts it calls: no include guard.

// ---------------------------------------------------------------------------------------
// Entry points. Split: send and receive halves (two launches per operation; the receive
// hooks). Fused: one launch per operation, send then receive in every CTA; needs every CTA
// of the grid resident at once on every rank (the host checks occupancy), since a CTA waits
// for all CTAs of every peer.
//
// Dynamic shared memory (ll/layout.rs sizes it): dispatch-send: mask and base, (E + R) rows of
// ceil(T / 32) u32 each; dispatch-recv: the L x R table; combine-send: L + 1 u32; fused:
// the larger of its halves.

// Every kernel that starts an operation pushes the set's deferred credits first (CTA 0),
// before any wait; the kernel that ends an operation stores this CTA's new op count last.
// Every entry point begins with kernel_enter (programmatic dependent launch).

__device__ __forceinline__ void dispatch_send_entry(const LlArgs& a) {
  kernel_enter(a, kStDispEntry);
  extern __shared__ uint32_t smem[];
  push_credits(a);
  dispatch_send_body(a, read_op(a, kOpDispatch), smem, kWarps, nullptr);
}

__device__ __forceinline__ void dispatch_recv_entry(const LlArgs& a) {
  kernel_enter(a);
  extern __shared__ uint32_t smem[];
  const uint32_t n = read_op(a, kOpDispatch);
  const WarpGroup group = WarpGroup::cta();
  if (dispatch_recv_table(a, n, smem, group)) dispatch_expand(a, n, smem, group.warp, group.warps);
  end_op(a, kOpDispatch, n);
  stamp(a, kStDispExpanded);
  stamp(a, kStDispEnd);
}

__device__ __forceinline__ void dispatch_fused_entry(const LlArgs& a) {
  kernel_enter(a, kStDispEntry);
  extern __shared__ uint32_t smem[];
  push_credits(a);
  const uint32_t n = read_op(a, kOpDispatch);
  // Warps [0, sw) send the records; the CTA's last warp publishes their ready words
  // (publish_rounds) and then, in the masked kernels, expands like a send warp (in the
  // polled ones, kDataPolled, the expand does not wait for its fences, so neither does its
  // share); the warps between build the receive table and expand what has landed meanwhile.
  const int sw = fused_send_warps(a.flags);
  const int wic = int(threadIdx.x / 32);
  // The receive half's table lies after the send half's masks (ll/layout.rs dispatch_fused_smem);
  // its state word and the publisher's progress words are cleared before the send half's
  // first barrier.
  uint32_t* table_smem = smem + size_t(2) * (a.experts + a.ranks) * ((a.max_tokens + 31) / 32);
  __shared__ uint32_t progress[kWarps];
  if (threadIdx.x == 0) *RecvTable::at(a, table_smem).word = kTableNotYet;
  if (threadIdx.x < kWarps) progress[threadIdx.x] = 0;
  const bool sent = dispatch_send_body(a, n, smem, sw, progress);
  // The receive half: the warps beside the senders and the publisher; those join the expand
  // once they have sent (published).
  const int recv_warps = kWarps - sw - 1;
  const int expanders = kDataPolled ? kWarps - 1 : kWarps;  // per CTA
  bool ok = sent;
  size_t first_item = 0;  // of this warp's expand items (dispatch_expand)
  if (ok && wic >= sw && wic < sw + recv_warps) {
    const WarpGroup group = WarpGroup::range(sw, recv_warps, kBarRecv);
    ok = dispatch_recv_table(a, n, table_smem, group);
    first_item = group.warp;
  } else if (ok && (wic < sw || !kDataPolled)) {
    ok = wait_recv_table(a, table_smem);
    first_item = wic >= sw ? size_t(gridDim.x) * recv_warps + blockIdx.x
                           : size_t(gridDim.x) * (expanders - sw) + WarpGroup::range(0, sw, kBarSend).warp;
  } else {
    ok = false;  // the polled kernels' publisher: no expand items
  }
  if (ok) dispatch_expand(a, n, table_smem, first_item, size_t(gridDim.x) * expanders);
  end_op(a, kOpDispatch, n);
  stamp(a, kStDispExpanded);  // every warp of both groups is done only here
  stamp(a, kStDispEnd);
}

__device__ __forceinline__ void combine_send_entry(const LlArgs& a) {
  kernel_enter(a, kStCombEntry);
  extern __shared__ uint32_t smem[];
  push_credits(a);
  combine_send_body(a, read_op(a, kOpCombine), smem);
}

__device__ __forceinline__ void combine_recv_entry(const LlArgs& a) {
  kernel_enter(a);
  const uint32_t n = read_op(a, kOpCombine);
  combine_recv_body(a, n);
  end_op(a, kOpCombine, n);
}

__device__ __forceinline__ void combine_fused_entry(const LlArgs& a) {
  kernel_enter(a, kStCombEntry);
  extern __shared__ uint32_t smem[];
  push_credits(a);
  const uint32_t n = read_op(a, kOpCombine);
  const bool sent = combine_send_body(a, n, smem);  // CTA-uniform
  // The polled rank-first reduce starts in each warp as soon as its own sends are issued
  // (signal_after_sends); warp 0 waits for the others' and adds the signal, a release that
  // holds it until the CTA's stores are acknowledged, so it takes no reduce item
  // (ReduceItems) and nothing here waits for it.
  if (!kRowsPolled || a.comb_order != kCombOrderRankFirst) __syncthreads();
  if (sent) combine_recv_body(a, n);
  end_op(a, kOpCombine, n);
}
