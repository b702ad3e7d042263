// NVTX ranges in the `trainsan` domain, through one macro; compiled out without
// TRAINSAN_WITH_NVTX. Range names are constant strings such as "trainsan/tensor_stats".
#pragma once

#ifdef TRAINSAN_WITH_NVTX
#include <nvtx3/nvToolsExt.h>

namespace trainsan::kernels {

class NvtxRange {
 public:
  explicit NvtxRange(const char* name) {
    nvtxEventAttributes_t attr = {};
    attr.version = NVTX_VERSION;
    attr.size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
    attr.messageType = NVTX_MESSAGE_TYPE_ASCII;
    attr.message.ascii = name;
    nvtxDomainRangePushEx(domain(), &attr);
  }
  ~NvtxRange() { nvtxDomainRangePop(domain()); }
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;

 private:
  static nvtxDomainHandle_t domain() {
    static nvtxDomainHandle_t d = nvtxDomainCreateA("trainsan");
    return d;
  }
};

}  // namespace trainsan::kernels

#define TRAINSAN_NVTX_CONCAT_(a, b) a##b
#define TRAINSAN_NVTX_CONCAT(a, b) TRAINSAN_NVTX_CONCAT_(a, b)
#define TRAINSAN_NVTX_RANGE(name) \
  ::trainsan::kernels::NvtxRange TRAINSAN_NVTX_CONCAT(trainsan_nvtx_range_, __LINE__)(name)
#else
#define TRAINSAN_NVTX_RANGE(name) \
  do {                            \
  } while (0)
#endif
