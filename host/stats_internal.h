// Host-side pieces of the statistics pass shared by the CPU and CUDA paths.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "stats.h"
#include "trainsan/stats.h"

namespace trainsan::host {

// Descriptors of a list of tensors of one device, with the chunk table (Note [Chunking]).
struct Described {
  std::vector<kernels::TensorDesc> descs;
  std::vector<int64_t> chunk_begin;  // descs.size() + 1 entries
  std::vector<at::Tensor> keep_alive;  // contiguous copies made for views of > kMaxDims dims
};

// Checks every element (TypeError/ValueError naming it) and that all share one device.
void check_tensors(const std::vector<at::Tensor>& tensors, const char* fn);
Described describe(const std::vector<at::Tensor>& tensors);

PackedStats packed_cpu(const std::vector<at::Tensor>& tensors);
PackedStats packed_cuda(const std::vector<at::Tensor>& tensors);  // stats_cuda.cpp
PackedStats packed_meta(const std::vector<at::Tensor>& tensors);

}  // namespace trainsan::host
