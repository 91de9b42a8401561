// kernels/ht/ht.cu: HT (high-throughput) dispatch and combine over NVLink (NCCL LSA): the
// kernel parts in launch order (layout and count exchange, dispatch, combine), each with its
// entry points. The arguments, window layout and shared helpers are in ht/common.cuh.

#include "ht/common.cuh"
#include "ht/layout.cuh"
#include "ht/dispatch.cuh"
#include "ht/combine.cuh"
#include "ht/nodes.cuh"
