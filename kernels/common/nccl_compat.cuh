// kernels/common/nccl_compat.cuh: what differs between the NCCL versions the kernels are
// built against (2.28.7+, 2.29.7+, 2.30.7+, 2.31.2+, 2.32.3+; crates/gin-ep/build.rs builds
// every kernel once per header set and the runtime picks the one matching ncclGetVersion).
// The one place kernels include NCCL's headers from (fabric.cuh and its parts include this).
//
// Owns: the fixed-size slot that carries an `ncclDevComm` in every kernel argument struct,
// the version macros, and the record of which Device API calls differ between versions.
// Never: decides protocol or buffer layout, and never spins (fabric.cuh owns waits).
//
// Kernels call NCCL's Device API directly only where it is the same in every supported
// version (ncclGetLsaPointer, ncclTeamWorld/Lsa/Rail, ncclLsaBarrierSession, ncclGin's
// constructor, readSignal, readCounter, flush; the window fields lsaFlatBase and stride4G
// that ll.cu's `wargs` variant reads sit at offsets 8 and 24 in every version). Where a
// version differs, the difference is handled here or in the one wrapper named below, and
// guarded with NCCL_VERSION_CODE if behaviour must differ.

#pragma once

// GIN backends compiled into every ncclGin operation. ncclGin dispatches at run time over all
// backends its headers enable; 2.31 adds AWS EFA's GPU-direct backend (EFA_GDA), whose
// inlined code pushes the LL kernels across nodes past their 128-register budget into spills
// (2.31.2: 9 kernels, 2.32.3: 17). gin-ep reaches other nodes through the proxy (its own
// plugin, or NCCL's over IB) or GDAKI, so EFA_GDA is compiled out, as NCCL's headers allow
// (`#ifndef NCCL_GIN_EFA_GDA_ENABLE`, nccl_device/gin/gin_device_common.h). A device
// communicator NCCL gives an EFA_GDA backend is refused on the host before any launch
// (backend/cuda/runtime/window.rs): ncclGin treats a backend outside its mask as unreachable.
#ifndef NCCL_GIN_EFA_GDA_ENABLE
#define NCCL_GIN_EFA_GDA_ENABLE 0
#endif

#include <nccl.h>
#include <nccl_device.h>
#include <stddef.h>
#include <stdint.h>

#include "abi/common.h"

// 2.28.3 had no GIN fields in ncclDevComm and ncclWindow_vidmem; 2.28.7 is the first layout
// the host mirrors (crates/gin-ep-sys) know.
#if !defined(NCCL_VERSION_CODE) || NCCL_VERSION_CODE < 22807
#error "gin-ep kernels need NCCL >= 2.28.7 headers"
#endif

// The minor release of the headers being compiled against, e.g. 30 for 2.30.7.
#define GIN_EP_NCCL_MINOR ((NCCL_VERSION_CODE / 100) % 100)

namespace gin_ep {

// kDevCommSlotBytes (abi/common.h): the bytes reserved for `ncclDevComm` at the start of
// every kernel argument struct.
static_assert(sizeof(ncclDevComm) <= kDevCommSlotBytes, "ncclDevComm outgrew the argument slot");
static_assert(alignof(ncclDevComm) <= 8, "ncclDevComm needs more than 8-byte alignment");

// The slot's storage. Argument structs embed it in an anonymous union with the devcomm
// itself, so kernels keep writing `a.comm`:
//   union { ncclDevComm comm; DevCommSlot comm_slot; };
struct alignas(8) DevCommSlot {
  unsigned char bytes[kDevCommSlotBytes];
};

}  // namespace gin_ep

// GIN's release scopes. ncclGin::put and ::signal end with two cuda::thread_scope arguments
// whose order differs: 2.28 declares (alreadyReleased, expected_scope) but implements them as
// (required, given); 2.29 and 2.30 take (givenRelease, requiredRelease). gin-ep's only GIN
// issuers, gin_put and gin_signal in fabric.cuh, fence first (fence.acq_rel.sys) and pass
// thread_scope_system for both, which makes the order irrelevant; with given == required ==
// system no backend (proxy, GDAKI, GPI from 2.30) adds a fence of its own. Kernels never call
// put/signal directly, and never putValue (fabric.cuh makes that a compile error).
