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

struct ArenaStats {
  uint64_t granularity = 0, va_base = 0, va_bytes = 0;
  uint64_t live_handle_bytes = 0, live_handles = 0;
  uint64_t pool_bytes = 0, pool_handles = 0;
  uint64_t extents = 0, mapped_bytes = 0;
  std::array<uint64_t, kZoneCount> mapped_by_zone{}, plain_by_zone{}, content_by_zone{};
  uint64_t commits = 0, decommits = 0, rollbacks = 0;
  uint64_t handles_created = 0, handles_released = 0, handles_reused = 0;
  uint64_t unmap_calls = 0, set_access_calls = 0, map_calls = 0;
  uint64_t reader_waits = 0;
  uint64_t capture_refusals = 0;  // map/unmap attempts refused because a guarded stream was capturing
  // Invariants: all must read 0.
  uint64_t refcount_underflows = 0;
  uint64_t unmaps_before_reader = 0;  // unmaps whose reader had not finished
  uint64_t unaccounted_bytes = 0;     // ledger vs arena disagreement
  uint64_t uncovered_referenced = 0;
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

 private:
  struct Mapped {
    uint64_t va, bytes, handle;
  };
  void require_open_locked() const;
  void check_capture_locked(const char* what);
  std::vector<ByteRange> to_offsets_locked(const std::vector<ByteRange>& ranges) const;
  uint64_t acquire_handle_locked(uint64_t rem, uint64_t pending, bool* reused);
  void return_handle_locked(uint64_t size, uint64_t handle) noexcept;
  void wait_readers_locked(const std::vector<Extent>& freed);
  uint64_t unaccounted_locked();

  std::shared_ptr<PhysicalBackend> backend_;
  std::shared_ptr<BudgetOwner> ledger_;
  uint64_t gran_;
  std::vector<uint64_t> classes_;
  uint64_t pool_limit_;
  uint64_t zone_va_;
  uint64_t base_ = 0;
  bool closed_ = false;

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

// A weight's slot: one stable address for its whole life, backed only while resident.
enum class SlotState { Evicted, PagingIn, Resident, Pinned };
const char* slot_state_name(SlotState s);

class WeightSlot {
 public:
  WeightSlot(std::shared_ptr<Arena> arena, std::string key, uint64_t length, uint64_t alignment, Zone region);
  ~WeightSlot();
  WeightSlot(const WeightSlot&) = delete;
  WeightSlot& operator=(const WeightSlot&) = delete;

  const std::string& key() const { return key_; }
  uint64_t va() const { return va_; }
  uint64_t length() const { return length_; }
  SlotState state();
  Zone charged_zone() const { return charge_; }
  std::shared_ptr<Event> ready_event() const { return ready_; }
  std::shared_ptr<Arena> arena() const { return arena_; }

  // Where page-in copies from; the memory must outlive the slot.
  void set_source(const void* host, uint64_t bytes);
  const void* source() const { return src_; }

  void pin();
  void unpin();
  void mark_read(std::shared_ptr<Event> e);
  ByteRange range() const { return {va_, length_}; }

  // Group operations: one commit (or decommit) transaction for all slots.
  // page_in commits in `charge`, enqueues the copies on `stream` and returns the event
  // that marks them done; every slot must be Evicted and have a source.
  static std::shared_ptr<Event> page_in(const std::vector<std::shared_ptr<WeightSlot>>& slots, Zone charge, Stream& stream);
  // Every slot must be Resident or PagingIn (not Pinned) and charged to the same zone.
  static void evict(const std::vector<std::shared_ptr<WeightSlot>>& slots);

 private:
  struct Group {
    Arena* arena;
    std::vector<ByteRange> ranges;
    uint64_t content;
  };
  // The ranges and content bytes of a group, checked: one arena, each slot in a state
  // `allowed` accepts (else a StateError naming the slot, its address and `op`).
  static Group gather(const std::vector<std::shared_ptr<WeightSlot>>& slots, const char* op, bool (*allowed)(SlotState));
  [[noreturn]] void illegal(const char* op);
  std::shared_ptr<Arena> arena_;
  std::string key_;
  uint64_t va_, length_;
  const void* src_ = nullptr;
  uint64_t src_bytes_ = 0;
  SlotState state_ = SlotState::Evicted;
  int pins_ = 0;
  Zone charge_ = Zone::Weights;
  std::shared_ptr<Event> ready_;
};

// A caching sub-allocator over the arena for one zone (ORT's scratch memory and
// segment boundary buffers). Freed blocks stay committed and are reused by size;
// empty_cache gives them back.
class ScratchAllocator {
 public:
  ScratchAllocator(std::shared_ptr<Arena> arena, Zone zone, uint64_t alignment = 256);
  ~ScratchAllocator();
  uint64_t allocate(uint64_t bytes);  // throws BudgetExceeded
  void deallocate(uint64_t ptr);
  uint64_t empty_cache();  // returns committed bytes freed
  // The same, reporting failure through the return value (for callers across a C ABI).
  uint64_t try_allocate(uint64_t bytes) noexcept;
  std::string last_error();

  struct Stats {
    uint64_t live_bytes = 0, cached_bytes = 0, peak_live = 0, allocs = 0, frees = 0, cache_hits = 0, failures = 0;
  };
  Stats stats();

 private:
  uint64_t empty_cache_locked();
  std::shared_ptr<Arena> arena_;
  Zone zone_;
  uint64_t align_;
  std::mutex mu_;
  std::unordered_map<uint64_t, uint64_t> live_;  // ptr -> rounded bytes
  std::multimap<uint64_t, uint64_t> cache_;      // rounded bytes -> ptr
  Stats stats_;
  std::string last_error_;
};

}  // namespace offload
