// The arena: one virtual-address reservation per device, carved at byte
// granularity, with physical handles mapped behind it on demand.
//
// The reservation is split into one region per zone, so that spans of different
// zones never share a granule. Commit and decommit are transactions over a list of
// ranges: commit charges the ledger, maps every uncovered granule run with pooled
// or new handles (large size classes for the bulk, the granule for tails), sets
// access once per run, and rolls all of it back on failure; decommit drops
// refcounts, waits for the last readers of what it frees, unmaps each contiguous
// run in one call, and returns the handles to the pool.
//
// Locking: one mutex per arena. Public methods do not call each other under it.
// The ledger's lock is taken inside the arena's (order: arena, then ledger); the
// arena never calls the ledger's reclaimers, which run with no lock held.
#pragma once

#include <array>
#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "backend.h"
#include "bookkeeping.h"
#include "ledger.h"

namespace offload {

// Bytes a plain (non-VMM) device allocation of `bytes` commits, as the arena charges it.
uint64_t plain_charge(uint64_t bytes, uint64_t gran);

struct ArenaConfig {
  uint64_t zone_va_bytes = 0;            // address space per zone region
  std::vector<uint64_t> handle_classes;  // ascending multiples of the granularity; empty: defaults
  uint64_t pool_limit = UINT64_MAX;      // idle bytes kept for reuse
};

// The scalar fields of ArenaStats, in order (the binding reads this list too).
#define OFFLOAD_ARENA_STATS_FIELDS(_)                                                        \
  _(granularity) _(va_base) _(va_bytes)                                                     \
  _(live_handle_bytes) _(live_handles) _(pool_bytes) _(pool_handles)                        \
  _(extents) _(mapped_bytes)                                                                \
  _(commits) _(decommits) _(rollbacks)                                                      \
  _(handles_created) _(handles_released) _(handles_reused)                                  \
  _(unmap_calls) _(set_access_calls) _(map_calls)                                           \
  _(reader_waits)                                                                           \
  _(capture_refusals)     /* map/unmap refused because a guarded stream was capturing */    \
  /* Invariants: all must read 0. */                                                        \
  _(refcount_underflows)                                                                    \
  _(unmaps_before_reader) /* extents unmapped while a recorded reader was still running */  \
  _(unaccounted_bytes)    /* ledger vs arena disagreement */                                \
  _(uncovered_referenced)

struct ArenaStats {
#define OFFLOAD_FIELD(name) uint64_t name = 0;
  OFFLOAD_ARENA_STATS_FIELDS(OFFLOAD_FIELD)
#undef OFFLOAD_FIELD
  std::array<uint64_t, kZoneCount> mapped_by_zone{}, plain_by_zone{}, content_by_zone{};
};

class Arena {
 public:
  Arena(std::shared_ptr<PhysicalBackend> backend, std::shared_ptr<BudgetOwner> ledger, ArenaConfig cfg);
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  PhysicalBackend& backend() { return *backend_; }
  std::shared_ptr<PhysicalBackend> backend_ptr() { return backend_; }
  std::shared_ptr<BudgetOwner> ledger() { return ledger_; }
  uint64_t granularity() const { return gran_; }
  const std::vector<uint64_t>& handle_classes() const { return classes_; }

  // Address space: a span in the region of `region`, at byte granularity.
  uint64_t carve(Zone region, uint64_t length, uint64_t alignment);
  void release(uint64_t va);

  // Bytes a commit of these ranges would newly commit.
  uint64_t incremental_commit_bytes(const std::vector<ByteRange>& ranges);
  // One transaction: all or nothing. `content` is the tensor bytes the ranges hold.
  void commit(Zone charge, const std::vector<ByteRange>& ranges, uint64_t content);
  // Undo of commit with the same arguments. Waits for the readers of what it unmaps.
  void decommit(Zone charge, const std::vector<ByteRange>& ranges, uint64_t content);
  // The work on some stream that reads these ranges ends at `e`: no unmap before it.
  void note_reader(const std::vector<ByteRange>& ranges, std::shared_ptr<Event> e);

  // Plain allocations (the baseline that allocates per page-in), in the same ledger.
  uint64_t plain_alloc(Zone charge, uint64_t bytes);
  void plain_free(uint64_t ptr);

  // Refuse map/unmap while this stream captures a graph.
  void guard_capture(std::shared_ptr<Stream> s);
  void unguard_capture(const Stream* s);

  // Releases idle pooled handles until `bytes` are freed (or the pool is empty).
  uint64_t trim_pool(uint64_t bytes);
  ArenaStats stats();
  // Unmaps and releases everything, frees the reservation. Idempotent.
  void close();
  bool closed() const { return closed_; }

  // Test hook: skip the wait for readers before unmapping, to show that
  // unmaps_before_reader detects it. Never set outside tests.
  void debug_skip_reader_wait(bool skip) { skip_reader_wait_ = skip; }

 private:
  struct Mapped {
    uint64_t va, bytes, handle;
  };
  void require_open_locked() const;
  void check_capture_locked(const char* what);
  std::vector<ByteRange> to_offsets_locked(const std::vector<ByteRange>& ranges) const;
  uint64_t acquire_handle_locked(uint64_t rem, uint64_t pending, bool* reused);
  void return_handle_locked(uint64_t size, uint64_t handle) noexcept;
  // Releases a handle the arena neither maps nor pools; it is forgotten even when the
  // release fails (nothing could retry it).
  void release_handle_locked(uint64_t handle);
  // Releases idle pooled handles while over(); keeps sizes <= keep_limit longest.
  template <typename Over>
  void trim_pool_while_locked(uint64_t keep_limit, Over over);
  void wait_readers_locked(const std::vector<Extent>& freed);
  // Counts a freed extent whose recorded readers have not all finished; called right
  // before it is unmapped.
  void check_readers_done_locked(const Extent& e);
  uint64_t unaccounted_locked();

  std::shared_ptr<PhysicalBackend> backend_;
  std::shared_ptr<BudgetOwner> ledger_;
  uint64_t gran_;
  std::vector<uint64_t> classes_;
  uint64_t pool_limit_;
  uint64_t zone_va_;
  uint64_t base_ = 0;
  bool closed_ = false;
  std::atomic<bool> skip_reader_wait_{false};

  std::mutex mu_;
  std::vector<SpanAllocator> regions_;
  GranuleMap gmap_;
  HandlePool pool_;
  std::unordered_map<uint64_t, uint64_t> handle_size_;  // every live handle
  std::unordered_map<uint64_t, std::vector<std::shared_ptr<Event>>> readers_;  // by extent's first granule
  std::unordered_map<uint64_t, std::pair<Zone, uint64_t>> plain_;  // ptr -> (zone, bytes)
  std::vector<std::weak_ptr<Stream>> guarded_;
  std::array<uint64_t, kZoneCount> mapped_by_zone_{}, plain_by_zone_{}, content_by_zone_{};
  ArenaStats counters_;
};

}  // namespace offload
