// ORT's CUDA EP takes its device memory from three C functions given as provider
// options (gpu_external_alloc / gpu_external_free / gpu_external_empty_cache).
// They carry no user data, so each binding gets its own instantiation of the
// three functions, indexing a small table of scratch allocators. The table owns
// the allocators it holds; unbinding happens after the ORT session is gone.
#pragma once

#include <array>
#include <cstdint>
#include <memory>

#include "scratch_allocator.h"

namespace offload {

constexpr int kExternalAllocatorSlots = 32;

struct ExternalAllocatorBinding {
  int index = -1;
  uint64_t alloc_fn = 0, free_fn = 0, empty_cache_fn = 0;  // function addresses
};

ExternalAllocatorBinding bind_external_allocator(std::shared_ptr<ScratchAllocator> a);
void unbind_external_allocator(int index);

}  // namespace offload
