// kernels/abi/common.h: what every kernel argument struct shares (the devcomm slot), and the
// format of every header in kernels/abi/.
//
// The headers of kernels/abi/ are the one definition of what the host and the kernels must
// agree on: argument structs, flags, status codes, phases, signal kinds, stamp slots, limits.
// The kernels include them; crates/gin-ep/build.rs (abi_gen.rs) turns them into Rust
// (OUT_DIR/abi.rs, the module backend::cuda::abi) and into layout checks the kernel build
// includes (OUT_DIR/abi_checks.h). Change a value here and both sides change.
//
// Format: only these forms; the generator fails the build naming the line of anything else.
// - `//` comments (own-line comments above a declaration are copied into the Rust), blanks;
// - `#pragma once`, `#include <stdint.h>`, `#include <stddef.h>`, and `#include "abi/X.h"`
//   of a header read before (build.rs reads common, then the others in a fixed order);
// - `namespace NAME {` ... `}  // namespace NAME`; every constant and enum sits inside one
//   (the kernels are one translation unit); a struct may be global, with qualified type
//   names (`gin_ep::FabricError*`, `gin_ep::DevCommSlot` in the union), where the kernels
//   always had it there (its name is in kernel symbols);
// - `static const T kName = EXPR;`, several `kName = EXPR` separated by commas allowed. T is
//   int, int32_t, uint32_t, int64_t, uint64_t or size_t; EXPR is made of integer literals
//   (decimal or 0x hex, optional u suffix), constants defined above (in any header read),
//   `+ - * / << |` and parentheses. The generator evaluates it and checks it fits T; Rust
//   gets the value: `kStateWords` becomes `K_STATE_WORDS: i32`;
// - `enum Name : T { kA = EXPR, ... };`, every enumerator valued; Rust gets constants;
// - `struct Name { ... };` of fields `T name;` (T as above, or unsigned long long: u64),
//   `T* name;` or `const T* name;` (any T: an address, u64 in Rust), `ncclWindow_t name;`,
//   and, as the first field only,
//   `union { ncclDevComm comm; DevCommSlot comm_slot; };` (kDevCommSlotBytes bytes). Every
//   field must sit at a multiple of its size and the struct must end at a multiple of its
//   largest field: padding is explicit (`uint32_t pad0_;`), so the layout follows from the
//   fields alone. The generator asserts it on both sides (rustc: offset_of!, nvcc:
//   offsetof). Rust field names are the C names in lower case without a trailing `_`.
// Types a struct names (ncclDevComm, DevCommSlot, ncclWindow_t, pointees) come from the
// kernel headers that include these (common/nccl_compat.cuh, common/fabric.cuh).
#pragma once

#include <stddef.h>

namespace gin_ep {

// Bytes reserved for `ncclDevComm` at the start of every kernel argument struct: 200 in
// 2.28, 224 in 2.29, 240 in 2.30, 248 in 2.31/2.32. A fixed slot keeps every later field at
// the same offset in every build, so the host has one layout whatever NCCL is loaded
// (gin-ep-sys's DEV_COMM_SLOT_BYTES, asserted equal in backend/cuda/abi.rs). The room above
// 2.30's size leaves later minors a place without moving any field.
static const size_t kDevCommSlotBytes = 384;

}  // namespace gin_ep
