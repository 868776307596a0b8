#include "scratch_allocator.h"

#include <algorithm>
#include <stdexcept>

#include "errors.h"

namespace offload {

ScratchAllocator::ScratchAllocator(std::shared_ptr<Arena> arena, Zone zone, uint64_t alignment)
    : arena_(std::move(arena)), zone_(zone), align_(alignment) {
  if (!is_pow2(alignment)) throw std::invalid_argument("scratch alignment must be a power of two");
}

ScratchAllocator::~ScratchAllocator() {
  try {
    std::lock_guard<std::mutex> g(mu_);
    for (auto& [ptr, size] : live_) cache_.insert({size, ptr});
    live_.clear();
    empty_cache_locked();
  } catch (const std::exception& e) {
    warn(concat("releasing scratch memory failed: ", e.what()));
  }
}

uint64_t ScratchAllocator::allocate(uint64_t bytes) {
  const uint64_t r = round_up(std::max<uint64_t>(bytes, 1), align_);
  {
    std::lock_guard<std::mutex> g(mu_);
    auto it = cache_.lower_bound(r);
    if (it != cache_.end() && it->first <= r + r / 2) {
      const uint64_t ptr = it->second, size = it->first;
      cache_.erase(it);
      live_[ptr] = size;
      stats_.cached_bytes -= size;
      stats_.live_bytes += size;
      stats_.peak_live = std::max(stats_.peak_live, stats_.live_bytes);
      ++stats_.allocs;
      ++stats_.cache_hits;
      return ptr;
    }
  }
  const uint64_t va = arena_->carve(zone_, r, align_);
  try {
    try {
      arena_->commit(zone_, {{va, r}}, r);
    } catch (const BudgetExceeded&) {
      // Free our own cache, then ask lower-priority zones to lend, then retry once.
      {
        std::lock_guard<std::mutex> g(mu_);
        empty_cache_locked();
      }
      arena_->ledger()->make_room(zone_, arena_->incremental_commit_bytes({{va, r}}));
      arena_->commit(zone_, {{va, r}}, r);
    }
  } catch (...) {
    arena_->release(va);
    std::lock_guard<std::mutex> g(mu_);
    ++stats_.failures;
    throw;
  }
  std::lock_guard<std::mutex> g(mu_);
  live_[va] = r;
  stats_.live_bytes += r;
  stats_.peak_live = std::max(stats_.peak_live, stats_.live_bytes);
  ++stats_.allocs;
  return va;
}

uint64_t ScratchAllocator::try_allocate(uint64_t bytes) noexcept {
  try {
    return allocate(bytes);
  } catch (const std::exception& e) {
    std::lock_guard<std::mutex> g(mu_);
    last_error_ = e.what();
    return 0;
  }
}

std::string ScratchAllocator::last_error() {
  std::lock_guard<std::mutex> g(mu_);
  return last_error_;
}

void ScratchAllocator::deallocate(uint64_t ptr) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = live_.find(ptr);
  if (it == live_.end()) throw StateError(concat("scratch free of ", ptr, " which is not a live block"));
  cache_.insert({it->second, ptr});
  stats_.live_bytes -= it->second;
  stats_.cached_bytes += it->second;
  ++stats_.frees;
  live_.erase(it);
}

uint64_t ScratchAllocator::release_all() {
  std::lock_guard<std::mutex> g(mu_);
  for (auto& [ptr, size] : live_) {
    cache_.insert({size, ptr});
    stats_.cached_bytes += size;
    ++stats_.frees;
  }
  stats_.live_bytes = 0;
  live_.clear();
  return empty_cache_locked();
}

uint64_t ScratchAllocator::empty_cache() {
  std::lock_guard<std::mutex> g(mu_);
  return empty_cache_locked();
}

uint64_t ScratchAllocator::empty_cache_locked() {
  if (cache_.empty() || arena_->closed()) return 0;
  std::vector<ByteRange> ranges;
  uint64_t content = 0;
  for (auto& [size, ptr] : cache_) {
    ranges.push_back({ptr, size});
    content += size;
  }
  const uint64_t before = arena_->ledger()->snapshot().zones[int(zone_)].committed.current;
  arena_->decommit(zone_, ranges, content);
  for (auto& r : ranges) arena_->release(r.offset);
  cache_.clear();
  stats_.cached_bytes = 0;
  const uint64_t after = arena_->ledger()->snapshot().zones[int(zone_)].committed.current;
  return before - after;
}

ScratchStats ScratchAllocator::stats() {
  std::lock_guard<std::mutex> g(mu_);
  return stats_;
}

}  // namespace offload
