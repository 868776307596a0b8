// The budget owner: one authority over committed physical bytes per device.
//
// Every byte the device commits for this process is charged to one zone. A zone
// has an allowance (a cap) and a reserve (headroom that other zones may not take).
// Growth takes free budget first, then asks lower-priority zones to shrink through
// their reclaim callbacks. A shortage is a BudgetExceeded, never an OOM.
//
// Idle pooled handles are physical bytes too: they are tracked as `pooled`, and
// zones + pooled never exceed the budget at rest.
//
// Locking: one mutex guards the state. Reclaim callbacks are called with no lock
// held, so they may decommit through the arena (lock order: arena, then ledger).
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "bookkeeping.h"

namespace offload {

// {current, peak, total}: total is the cumulative bytes charged.
struct Counter {
  uint64_t current = 0, peak = 0, total = 0;
  void add(uint64_t n) {
    current += n;
    total += n;
    if (current > peak) peak = current;
  }
  void sub(uint64_t n) { current -= n; }
};

struct ZoneSnapshot {
  uint64_t allowance = 0, reserve = 0;
  int priority = 0;
  Counter committed;  // physical bytes
  Counter content;    // bytes of the tensors they hold
  uint64_t outside = 0;  // of committed: bytes measured outside the arena (ORT, cudaMalloc path)
  uint64_t lent = 0;     // bytes reclaimed from this zone for another
};

struct LedgerSnapshot {
  uint64_t budget = 0;
  uint64_t pooled = 0;
  uint64_t committed = 0;  // sum over zones
  uint64_t peak_committed = 0;  // zones + pooled, at its peak
  uint64_t peak_content = 0;
  uint64_t refusals = 0;
  uint64_t reclaims = 0;
  std::array<ZoneSnapshot, kZoneCount> zones;
};

class BudgetOwner {
 public:
  // Returns the bytes it freed.
  using Reclaimer = std::function<uint64_t(uint64_t bytes_needed)>;

  explicit BudgetOwner(uint64_t budget);

  uint64_t budget() const;
  // priority defaults to zone_priority(z).
  void set_zone(Zone z, uint64_t allowance, uint64_t reserve = 0, std::optional<int> priority = std::nullopt);

  // Admits `bytes` into zone z or throws BudgetExceeded; never calls out.
  // The arena charges before it backs the bytes (possibly with pooled handles), so it
  // passes note_peak=false and records the peak when it updates `pooled` at the end.
  void charge(Zone z, uint64_t bytes, bool outside = false, bool note_peak = true);
  void refund(Zone z, uint64_t bytes, bool outside = false);
  // Moves committed bytes between zones (an extent now held only by another zone).
  void transfer(Zone from, Zone to, uint64_t bytes);
  bool can_charge(Zone z, uint64_t bytes) const;
  // Bytes zone z could take now without reclaiming.
  uint64_t headroom(Zone z) const;

  // Frees budget for `bytes` in zone z by calling the reclaimers of lower-priority
  // zones, lowest priority first. Called with no lock held; returns can_charge.
  bool make_room(Zone z, uint64_t bytes);
  void set_reclaimer(Zone z, Reclaimer fn);
  void clear_reclaimer(Zone z);

  void add_content(Zone z, uint64_t bytes);
  void sub_content(Zone z, uint64_t bytes);
  void set_pooled(uint64_t bytes);

  LedgerSnapshot snapshot() const;
  uint64_t committed_total() const;
  uint64_t pooled() const;

 private:
  // Committed bytes plus the unmet reserves of the zones other than z.
  uint64_t held_locked(Zone z) const;
  bool can_charge_locked(Zone z, uint64_t bytes, std::string* why) const;
  [[noreturn]] void refuse_locked(Zone z, uint64_t bytes, const std::string& why);
  void note_peak_locked();

  mutable std::mutex mu_;
  uint64_t budget_;
  uint64_t pooled_ = 0;
  uint64_t peak_physical_ = 0;
  uint64_t peak_content_ = 0;
  uint64_t refusals_ = 0;
  uint64_t reclaims_ = 0;
  std::array<ZoneSnapshot, kZoneCount> zones_;
  // Held through shared pointers: a Reclaimer may wrap a Python callable, whose copy or
  // destruction takes the GIL, so under mu_ only the pointers are copied or swapped.
  std::array<std::shared_ptr<const Reclaimer>, kZoneCount> reclaimers_;
};

std::string describe(const LedgerSnapshot& s);

}  // namespace offload
