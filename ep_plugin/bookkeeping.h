// Pure bookkeeping of the arena: byte-granular carving, per-granule refcounts and
// the extents that back them, and the pool of idle physical handles.
// Nothing here includes cuda.h; it is unit-tested on the CPU.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace offload {

constexpr int kZoneCount = 4;
enum class Zone : int { Weights = 0, KV = 1, Scratch = 2, Transient = 3 };
const char* zone_name(Zone z);
Zone zone_from_name(const std::string& name);

// Reclaim order: a zone may take bytes from zones of lower priority. Weights give
// way first, then scratch caches, then KV; transient headroom never lends.
constexpr int zone_priority(Zone z) {
  constexpr int table[kZoneCount] = {/*weights*/ 0, /*kv*/ 2, /*scratch*/ 1, /*transient*/ 3};
  return table[int(z)];
}

// Alignment of slot and scratch carvings unless the caller asks for another.
constexpr uint64_t kDefaultAlignment = 256;

// A byte range [offset, offset + length).
struct ByteRange {
  uint64_t offset = 0;
  uint64_t length = 0;
  uint64_t end() const { return offset + length; }
};

// Rounds up to a multiple of `align`; throws std::overflow_error when the result
// does not fit in 64 bits and std::invalid_argument when align is 0.
uint64_t round_up(uint64_t value, uint64_t align);
bool is_pow2(uint64_t v);

// First-fit, byte-granular carving of [0, capacity) with alignment and coalescing.
class SpanAllocator {
 public:
  explicit SpanAllocator(uint64_t capacity);

  // Offset of a new span, or nullopt when no free block fits.
  // Zero length or a non power-of-two alignment is std::invalid_argument.
  std::optional<uint64_t> carve(uint64_t length, uint64_t alignment);
  // Returns a carved span; a range that was not carved is a StateError.
  void release(uint64_t offset);

  uint64_t capacity() const { return capacity_; }
  uint64_t free_bytes() const { return free_bytes_; }
  uint64_t largest_free() const;
  std::size_t free_blocks() const { return free_.size(); }
  std::size_t live_spans() const { return used_.size(); }
  uint64_t length_of(uint64_t offset) const;

 private:
  uint64_t capacity_;
  uint64_t free_bytes_;
  std::map<uint64_t, uint64_t> free_;  // offset -> length, never adjacent (coalesced)
  std::map<uint64_t, uint64_t> used_;  // offset -> length
};

// One physical handle mapped over consecutive granules.
struct Extent {
  uint64_t first = 0;  // granule index
  uint64_t count = 0;  // granules
  uint64_t handle = 0;
  Zone zone = Zone::Weights;  // the zone its bytes are charged to
};

// A run of consecutive granules.
struct GranuleRun {
  uint64_t first = 0;
  uint64_t count = 0;
};

// Per-granule refcounts (per zone) and the extents that back referenced granules.
// Map on 0 -> 1, unmap on 1 -> 0: a granule that two spans touch costs once and is
// given back only after both are gone. Extents are the unit of unmapping: one is
// freed when none of its granules is referenced.
class GranuleMap {
 public:
  explicit GranuleMap(uint64_t granule);

  uint64_t granule() const { return granule_; }
  GranuleRun granules_of(const ByteRange& r) const;

  // Runs of granules that the ranges touch and no extent covers, merged and sorted.
  std::vector<GranuleRun> uncovered_runs(const std::vector<ByteRange>& ranges) const;
  uint64_t incremental_commit_bytes(const std::vector<ByteRange>& ranges) const;

  void add_extent(const Extent& e);
  // Adds one reference per range to every granule it touches. Every touched
  // granule must already be covered by an extent.
  void acquire(Zone zone, const std::vector<ByteRange>& ranges);

  struct ReleaseResult {
    std::vector<Extent> freed;                       // no granule referenced any more
    std::vector<std::pair<Extent, Zone>> recharged;  // still referenced, but only by another zone
  };
  // Drops the references of `acquire`; an unreferenced granule is a StateError
  // (counted as an underflow) and nothing changes. Freed extents are removed.
  ReleaseResult release(Zone zone, const std::vector<ByteRange>& ranges);
  // Undo of `release` for a failed unmap: puts back references and extents.
  void restore(Zone zone, const std::vector<ByteRange>& ranges, const ReleaseResult& r);
  // Sets the charged zone of the extent starting at `first`.
  void set_extent_zone(uint64_t first, Zone z);

  // First granules of the extents that back any granule of the ranges.
  std::vector<uint64_t> extents_touching(const std::vector<ByteRange>& ranges) const;
  uint32_t refs(uint64_t granule_index) const;
  std::size_t extent_count() const { return extents_.size(); }
  uint64_t mapped_granules() const { return mapped_granules_; }
  uint64_t underflows() const { return underflows_; }
  std::vector<Extent> extents() const;
  // Granules that are referenced but not covered by an extent (must be 0).
  uint64_t uncovered_referenced() const;

 private:
  const Extent* covering(uint64_t g) const;
  // Calls fn(g) for every granule of every range, in range order (repeats included).
  template <typename F>
  void for_each_granule(const std::vector<ByteRange>& ranges, F&& fn) const {
    for (const ByteRange& r : ranges) {
      const GranuleRun run = granules_of(r);
      for (uint64_t g = run.first; g < run.first + run.count; ++g) fn(g);
    }
  }
  uint64_t granule_;
  std::unordered_map<uint64_t, std::array<uint32_t, kZoneCount>> refs_;
  std::map<uint64_t, Extent> extents_;  // keyed by first granule
  uint64_t mapped_granules_ = 0;
  uint64_t underflows_ = 0;
};

// Idle physical handles by size class. Pure: ids are opaque.
class HandlePool {
 public:
  void put(uint64_t size, uint64_t handle) { idle_[size].push_back(handle); bytes_ += size; }
  std::optional<uint64_t> take(uint64_t size);
  // The largest idle size <= limit, if any.
  std::optional<uint64_t> largest_fitting(uint64_t limit) const;
  // Removes one idle handle, preferring sizes that do not fit `keep_limit`; returns (size, id).
  std::optional<std::pair<uint64_t, uint64_t>> pop_for_trim(uint64_t keep_limit);
  uint64_t bytes() const { return bytes_; }
  std::size_t count() const;
  std::vector<std::pair<uint64_t, uint64_t>> drain();

 private:
  std::map<uint64_t, std::vector<uint64_t>> idle_;
  uint64_t bytes_ = 0;
};

}  // namespace offload
