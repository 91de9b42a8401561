// The header from C++: the frozen sizes, the _INIT macros, and a malformed call's code and
// message, compiled with -Wall -Werror.
#include <cstdio>
#include <cstring>
#include <type_traits>

#include "nccl_ep.h"

static_assert(sizeof(ncclEpTensor_t) == NCCL_EP_TENSOR_V1_SIZE, "tensor");
static_assert(sizeof(ncclEpGroupConfig_t) == NCCL_EP_GROUP_CONFIG_V2_SIZE, "group config");
static_assert(offsetof(ncclEpGroupConfig_t, timeout_ns) + sizeof(uint64_t) == NCCL_EP_GROUP_CONFIG_V1_SIZE,
              "group config V1");
static_assert(sizeof(ncclEpLayoutInfo_t) == NCCL_EP_LAYOUT_INFO_V2_SIZE, "layout info");
static_assert(sizeof(ncclEpDispatchInputs_t) == 32 && sizeof(ncclEpDispatchOutputs_t) == 40, "dispatch io");
static_assert(sizeof(ncclEpDispatchConfig_t) == 24 && sizeof(ncclEpCombineConfig_t) == 20, "configs");
static_assert(sizeof(ncclEpCombineInputs_t) == 32 && sizeof(ncclEpCombineOutputs_t) == 24, "combine io");
static_assert(sizeof(ncclEpHandleConfig_t) == 16, "handle config");
static_assert(std::is_standard_layout<ncclEpGroupConfig_t>::value, "C layout");

int main() {
    ncclEpGroupConfig_t cfg = NCCL_EP_GROUP_CONFIG_INIT;
    ncclEpDispatchConfig_t dcfg = NCCL_EP_DISPATCH_CONFIG_INIT;
    ncclEpTensor_t t = NCCL_EP_TENSOR_INIT;
    if (cfg.size != 112 || cfg.magic != NCCL_EP_MAGIC || cfg.version != NCCL_EP_API_VERSION || dcfg.size != 24 ||
        t.magic != NCCL_EP_TENSOR_MAGIC) {
        std::printf("FAIL _INIT macros\n");
        return 1;
    }
    cfg.magic = 0xBAD;
    ncclEpGroup_t g = nullptr;
    ncclResult_t r = ncclEpCreateGroup(&g, nullptr, &cfg);
    const char* last = ncclEpGetLastError();
    if (r != ncclInvalidArgument || std::strstr(last, "config->magic = 0xbad") == nullptr) {
        std::printf("FAIL CreateGroup(wrong magic): %d \"%s\"\n", (int)r, last);
        return 1;
    }
    int v = 0;
    if (ncclEpGetVersion(&v) != ncclSuccess || v != NCCL_EP_VERSION_CODE) {
        std::printf("FAIL GetVersion\n");
        return 1;
    }
    std::printf("all C++ ABI checks passed\n");
    return 0;
}
