// The scratch allocator: a caching sub-allocator over the arena for one zone.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "arena.h"

namespace offload {

// The fields of ScratchStats (the binding reads this list too).
#define OFFLOAD_SCRATCH_STATS_FIELDS(_) \
  _(live_bytes) _(cached_bytes) _(peak_live) _(allocs) _(frees) _(cache_hits) _(failures)

struct ScratchStats {
#define OFFLOAD_FIELD(name) uint64_t name = 0;
  OFFLOAD_SCRATCH_STATS_FIELDS(OFFLOAD_FIELD)
#undef OFFLOAD_FIELD
};

// A caching sub-allocator over the arena for one zone (ORT's scratch memory and
// segment boundary buffers). Freed blocks stay committed and are reused by size;
// empty_cache gives them back.
class ScratchAllocator {
 public:
  ScratchAllocator(std::shared_ptr<Arena> arena, Zone zone, uint64_t alignment = kDefaultAlignment);
  ~ScratchAllocator();
  uint64_t allocate(uint64_t bytes);  // throws BudgetExceeded
  void deallocate(uint64_t ptr);
  uint64_t empty_cache();  // returns committed bytes freed
  // Frees every live block too, then empties the cache: one call, so that a caller
  // interrupted half way through giving its blocks back cannot keep some.
  uint64_t release_all();
  // The same, reporting failure through the return value (for callers across a C ABI).
  uint64_t try_allocate(uint64_t bytes) noexcept;
  std::string last_error();

  ScratchStats stats();

 private:
  uint64_t empty_cache_locked();
  std::shared_ptr<Arena> arena_;
  Zone zone_;
  uint64_t align_;
  std::mutex mu_;
  std::unordered_map<uint64_t, uint64_t> live_;  // ptr -> rounded bytes
  std::multimap<uint64_t, uint64_t> cache_;      // rounded bytes -> ptr
  ScratchStats stats_;
  std::string last_error_;
};

}  // namespace offload
