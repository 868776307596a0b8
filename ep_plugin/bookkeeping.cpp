#include "bookkeeping.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "errors.h"

namespace offload {

const char* zone_name(Zone z) {
  switch (z) {
    case Zone::Weights: return "weights";
    case Zone::KV: return "kv";
    case Zone::Scratch: return "scratch";
    case Zone::Transient: return "transient";
  }
  return "?";
}

Zone zone_from_name(const std::string& name) {
  for (int i = 0; i < kZoneCount; ++i)
    if (name == zone_name(Zone(i))) return Zone(i);
  throw std::invalid_argument(concat("unknown zone '", name,
                                     "': expected weights, kv, scratch or transient"));
}

bool is_pow2(uint64_t v) { return v != 0 && (v & (v - 1)) == 0; }

uint64_t round_up(uint64_t value, uint64_t align) {
  if (align == 0) throw std::invalid_argument("alignment must be positive");
  uint64_t rem = value % align;
  if (rem == 0) return value;
  uint64_t add = align - rem;
  if (value > UINT64_MAX - add) throw std::overflow_error(concat("rounding ", value, " up to ", align, " overflows"));
  return value + add;
}

// ---------------------------------------------------------------- SpanAllocator

SpanAllocator::SpanAllocator(uint64_t capacity) : capacity_(capacity), free_bytes_(capacity) {
  if (capacity > 0) free_[0] = capacity;
}

std::optional<uint64_t> SpanAllocator::carve(uint64_t length, uint64_t alignment) {
  if (length == 0) throw std::invalid_argument("cannot carve a zero-size span");
  if (!is_pow2(alignment)) throw std::invalid_argument(concat("alignment ", alignment, " is not a power of two"));
  if (length > capacity_) return std::nullopt;
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    const uint64_t off = it->first, len = it->second;
    const uint64_t aligned = round_up(off, alignment);
    if (aligned < off || aligned - off > len || len - (aligned - off) < length) continue;
    const uint64_t head = aligned - off;
    const uint64_t tail = len - head - length;
    free_.erase(it);
    if (head > 0) free_[off] = head;
    if (tail > 0) free_[aligned + length] = tail;
    used_[aligned] = length;
    free_bytes_ -= length;
    return aligned;
  }
  return std::nullopt;
}

void SpanAllocator::release(uint64_t offset) {
  auto u = used_.find(offset);
  if (u == used_.end()) throw StateError(concat("release of offset ", offset, " that was not carved"));
  uint64_t off = offset, len = u->second;
  used_.erase(u);
  free_bytes_ += len;
  auto next = free_.lower_bound(off);
  if (next != free_.end() && next->first == off + len) {
    len += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == off) {
      prev->second += len;
      return;
    }
  }
  free_[off] = len;
}

uint64_t SpanAllocator::largest_free() const {
  uint64_t best = 0;
  for (auto& [o, l] : free_) best = std::max(best, l);
  return best;
}

uint64_t SpanAllocator::length_of(uint64_t offset) const {
  auto u = used_.find(offset);
  if (u == used_.end()) throw StateError(concat("offset ", offset, " was not carved"));
  return u->second;
}

// ---------------------------------------------------------------- GranuleMap

GranuleMap::GranuleMap(uint64_t granule) : granule_(granule) {
  if (granule == 0) throw std::invalid_argument("granule must be positive");
}

GranuleRun GranuleMap::granules_of(const ByteRange& r) const {
  if (r.length == 0) return {r.offset / granule_, 0};
  if (r.offset > UINT64_MAX - r.length) throw std::overflow_error("byte range wraps around");
  uint64_t first = r.offset / granule_;
  uint64_t last = (r.end() - 1) / granule_;
  return {first, last - first + 1};
}

const Extent* GranuleMap::covering(uint64_t g) const {
  auto it = extents_.upper_bound(g);
  if (it == extents_.begin()) return nullptr;
  --it;
  const Extent& e = it->second;
  return (g >= e.first && g < e.first + e.count) ? &e : nullptr;
}

std::vector<GranuleRun> GranuleMap::uncovered_runs(const std::vector<ByteRange>& ranges) const {
  std::vector<uint64_t> gs;
  for_each_granule(ranges, [&](uint64_t g) {
    if (covering(g) == nullptr) gs.push_back(g);
  });
  std::sort(gs.begin(), gs.end());
  gs.erase(std::unique(gs.begin(), gs.end()), gs.end());
  std::vector<GranuleRun> runs;
  for (uint64_t g : gs) {
    if (!runs.empty() && runs.back().first + runs.back().count == g)
      ++runs.back().count;
    else
      runs.push_back({g, 1});
  }
  return runs;
}

uint64_t GranuleMap::incremental_commit_bytes(const std::vector<ByteRange>& ranges) const {
  uint64_t n = 0;
  for (const GranuleRun& r : uncovered_runs(ranges)) n += r.count;
  return n * granule_;
}

void GranuleMap::add_extent(const Extent& e) {
  if (e.count == 0) throw std::invalid_argument("empty extent");
  for (uint64_t g = e.first; g < e.first + e.count; ++g)
    if (covering(g) != nullptr) throw StateError(concat("granule ", g, " is already backed"));
  extents_[e.first] = e;
  mapped_granules_ += e.count;
}

void GranuleMap::acquire(Zone zone, const std::vector<ByteRange>& ranges) {
  for_each_granule(ranges, [&](uint64_t g) {
    if (covering(g) == nullptr) throw StateError(concat("granule ", g, " is referenced but not backed"));
  });
  for_each_granule(ranges, [&](uint64_t g) { ++refs_[g][int(zone)]; });
}

GranuleMap::ReleaseResult GranuleMap::release(Zone zone, const std::vector<ByteRange>& ranges) {
  // Check first so that an underflow changes nothing.
  std::unordered_map<uint64_t, uint32_t> drop;
  for_each_granule(ranges, [&](uint64_t g) { ++drop[g]; });
  for (auto& [g, n] : drop) {
    auto it = refs_.find(g);
    uint32_t have = it == refs_.end() ? 0 : it->second[int(zone)];
    if (have < n) {
      ++underflows_;
      throw StateError(concat("refcount underflow at granule ", g, " (byte offset ", g * granule_,
                              ") in zone ", zone_name(zone), ": ", have, " references, ", n,
                              " released"));
    }
  }
  std::vector<uint64_t> touched_extents;
  for (auto& [g, n] : drop) {
    auto& counts = refs_[g];
    counts[int(zone)] -= n;
    if (const Extent* e = covering(g)) touched_extents.push_back(e->first);
    bool all_zero = true;
    for (uint32_t c : counts) all_zero = all_zero && c == 0;
    if (all_zero) refs_.erase(g);
  }
  std::sort(touched_extents.begin(), touched_extents.end());
  touched_extents.erase(std::unique(touched_extents.begin(), touched_extents.end()), touched_extents.end());
  ReleaseResult out;
  for (uint64_t first : touched_extents) {
    Extent e = extents_.at(first);
    std::array<uint64_t, kZoneCount> by_zone{};
    for (uint64_t g = e.first; g < e.first + e.count; ++g) {
      auto it = refs_.find(g);
      if (it == refs_.end()) continue;
      for (int z = 0; z < kZoneCount; ++z) by_zone[z] += it->second[z];
    }
    uint64_t total = 0;
    for (uint64_t c : by_zone) total += c;
    if (total == 0) {
      out.freed.push_back(e);
      extents_.erase(first);
      mapped_granules_ -= e.count;
    } else if (by_zone[int(e.zone)] == 0) {
      for (int z = 0; z < kZoneCount; ++z)
        if (by_zone[z] > 0) {
          out.recharged.push_back({e, Zone(z)});
          break;
        }
    }
  }
  return out;
}

void GranuleMap::restore(Zone zone, const std::vector<ByteRange>& ranges, const ReleaseResult& r) {
  for (const Extent& e : r.freed) {
    extents_[e.first] = e;
    mapped_granules_ += e.count;
  }
  for_each_granule(ranges, [&](uint64_t g) { ++refs_[g][int(zone)]; });
}

void GranuleMap::set_extent_zone(uint64_t first, Zone z) { extents_.at(first).zone = z; }

std::vector<uint64_t> GranuleMap::extents_touching(const std::vector<ByteRange>& ranges) const {
  std::vector<uint64_t> out;
  for_each_granule(ranges, [&](uint64_t g) {
    if (const Extent* e = covering(g)) {
      if (out.empty() || out.back() != e->first) out.push_back(e->first);
    }
  });
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

uint32_t GranuleMap::refs(uint64_t g) const {
  auto it = refs_.find(g);
  if (it == refs_.end()) return 0;
  uint32_t n = 0;
  for (uint32_t c : it->second) n += c;
  return n;
}

std::vector<Extent> GranuleMap::extents() const {
  std::vector<Extent> out;
  for (auto& [k, e] : extents_) out.push_back(e);
  return out;
}

uint64_t GranuleMap::uncovered_referenced() const {
  uint64_t n = 0;
  for (auto& [g, c] : refs_)
    if (covering(g) == nullptr) ++n;
  return n;
}

// ---------------------------------------------------------------- HandlePool

std::optional<uint64_t> HandlePool::take(uint64_t size) {
  auto it = idle_.find(size);
  if (it == idle_.end() || it->second.empty()) return std::nullopt;
  uint64_t h = it->second.back();
  it->second.pop_back();
  if (it->second.empty()) idle_.erase(it);
  bytes_ -= size;
  return h;
}

std::optional<uint64_t> HandlePool::largest_fitting(uint64_t limit) const {
  auto it = idle_.upper_bound(limit);
  if (it == idle_.begin()) return std::nullopt;
  return std::prev(it)->first;
}

std::optional<std::pair<uint64_t, uint64_t>> HandlePool::pop_for_trim(uint64_t keep_limit) {
  if (idle_.empty()) return std::nullopt;
  // Sizes above keep_limit cannot serve the current request: drop those first, largest first.
  auto it = std::prev(idle_.end());
  if (it->first <= keep_limit) it = idle_.begin();
  uint64_t size = it->first;
  uint64_t h = it->second.back();
  it->second.pop_back();
  if (it->second.empty()) idle_.erase(it);
  bytes_ -= size;
  return std::make_pair(size, h);
}

std::size_t HandlePool::count() const {
  std::size_t n = 0;
  for (auto& [s, v] : idle_) n += v.size();
  return n;
}

std::vector<std::pair<uint64_t, uint64_t>> HandlePool::drain() {
  std::vector<std::pair<uint64_t, uint64_t>> out;
  for (auto& [s, v] : idle_)
    for (uint64_t h : v) out.push_back({s, h});
  idle_.clear();
  bytes_ = 0;
  return out;
}

}  // namespace offload
