#include "ledger.h"

#include <algorithm>
#include <stdexcept>
#include <vector>

#include "errors.h"

namespace offload {

BudgetOwner::BudgetOwner(uint64_t budget) : budget_(budget) {
  for (int i = 0; i < kZoneCount; ++i) {
    zones_[i].allowance = budget;
    zones_[i].priority = zone_priority(Zone(i));
  }
}

uint64_t BudgetOwner::budget() const {
  std::lock_guard<std::mutex> g(mu_);
  return budget_;
}

void BudgetOwner::set_zone(Zone z, uint64_t allowance, uint64_t reserve, std::optional<int> priority) {
  std::lock_guard<std::mutex> g(mu_);
  if (reserve > allowance)
    throw std::invalid_argument(concat("zone ", zone_name(z), ": reserve ", reserve,
                                       " exceeds its allowance ", allowance));
  uint64_t reserves = reserve;
  for (int i = 0; i < kZoneCount; ++i)
    if (i != int(z)) reserves += zones_[i].reserve;
  if (reserves > budget_)
    throw std::invalid_argument(concat("zone reserves (", reserves, " bytes) exceed the budget of ",
                                       budget_, " bytes"));
  ZoneSnapshot& zs = zones_[int(z)];
  zs.allowance = allowance;
  zs.reserve = reserve;
  zs.priority = priority.value_or(zone_priority(z));
}

uint64_t BudgetOwner::held_locked(Zone z) const {
  uint64_t held = 0;
  for (int i = 0; i < kZoneCount; ++i) {
    held += zones_[i].committed.current;
    if (i != int(z) && zones_[i].reserve > zones_[i].committed.current)
      held += zones_[i].reserve - zones_[i].committed.current;
  }
  return held;
}

bool BudgetOwner::can_charge_locked(Zone z, uint64_t bytes, std::string* why) const {
  const ZoneSnapshot& zs = zones_[int(z)];
  if (bytes > zs.allowance || zs.committed.current > zs.allowance - bytes) {
    if (why) *why = concat("zone ", zone_name(z), " would exceed its allowance");
    return false;
  }
  uint64_t held = held_locked(z);
  if (held > budget_ || bytes > budget_ - held) {
    if (why) *why = "the device budget, less the reserves of other zones, is full";
    return false;
  }
  return true;
}

void BudgetOwner::refuse_locked(Zone z, uint64_t bytes, const std::string& why) {
  ++refusals_;
  LedgerSnapshot s;
  s.budget = budget_;
  s.pooled = pooled_;
  s.zones = zones_;
  for (auto& zs : zones_) s.committed += zs.committed.current;
  throw BudgetExceeded(zone_name(z), bytes,
                       concat("cannot commit ", bytes, " bytes in zone ", zone_name(z), ": ", why,
                              ". ", describe(s)));
}

void BudgetOwner::note_peak_locked() {
  uint64_t phys = pooled_, content = 0;
  for (auto& zs : zones_) {
    zs.committed.peak = std::max(zs.committed.peak, zs.committed.current);
    phys += zs.committed.current;
    content += zs.content.current;
  }
  peak_physical_ = std::max(peak_physical_, phys);
  peak_content_ = std::max(peak_content_, content);
}

void BudgetOwner::charge(Zone z, uint64_t bytes, bool outside, bool note_peak) {
  std::lock_guard<std::mutex> g(mu_);
  std::string why;
  if (!can_charge_locked(z, bytes, &why)) refuse_locked(z, bytes, why);
  ZoneSnapshot& zs = zones_[int(z)];
  zs.committed.current += bytes;
  zs.committed.total += bytes;
  if (outside) zs.outside += bytes;
  if (note_peak) note_peak_locked();
}

void BudgetOwner::refund(Zone z, uint64_t bytes, bool outside) {
  std::lock_guard<std::mutex> g(mu_);
  ZoneSnapshot& zs = zones_[int(z)];
  if (bytes > zs.committed.current || (outside && bytes > zs.outside))
    throw StateError(concat("refund of ", bytes, " bytes to zone ", zone_name(z), " which holds ",
                            outside ? zs.outside : zs.committed.current));
  zs.committed.sub(bytes);
  if (outside) zs.outside -= bytes;
}

void BudgetOwner::transfer(Zone from, Zone to, uint64_t bytes) {
  std::lock_guard<std::mutex> g(mu_);
  ZoneSnapshot& f = zones_[int(from)];
  if (bytes > f.committed.current - f.outside)
    throw StateError(concat("transfer of ", bytes, " bytes out of zone ", zone_name(from)));
  f.committed.sub(bytes);
  zones_[int(to)].committed.add(bytes);
  note_peak_locked();
}

bool BudgetOwner::can_charge(Zone z, uint64_t bytes) const {
  std::lock_guard<std::mutex> g(mu_);
  return can_charge_locked(z, bytes, nullptr);
}

uint64_t BudgetOwner::headroom(Zone z) const {
  std::lock_guard<std::mutex> g(mu_);
  const ZoneSnapshot& zs = zones_[int(z)];
  uint64_t by_allowance = zs.allowance > zs.committed.current ? zs.allowance - zs.committed.current : 0;
  uint64_t held = held_locked(z);
  uint64_t by_budget = budget_ > held ? budget_ - held : 0;
  return std::min(by_allowance, by_budget);
}

bool BudgetOwner::make_room(Zone z, uint64_t bytes) {
  std::vector<std::pair<int, Zone>> order;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (can_charge_locked(z, bytes, nullptr)) return true;
    const ZoneSnapshot& zs = zones_[int(z)];
    // A zone over its own allowance cannot be helped by others.
    if (bytes > zs.allowance || zs.committed.current > zs.allowance - bytes) return false;
    for (int i = 0; i < kZoneCount; ++i)
      if (i != int(z) && zones_[i].priority < zs.priority && reclaimers_[i]) order.push_back({zones_[i].priority, Zone(i)});
  }
  std::sort(order.begin(), order.end(), [](auto& a, auto& b) { return a.first < b.first; });
  for (auto& [prio, victim] : order) {
    std::shared_ptr<const Reclaimer> fn;
    uint64_t shortfall;
    {
      std::lock_guard<std::mutex> g(mu_);
      if (can_charge_locked(z, bytes, nullptr)) return true;
      uint64_t held = held_locked(z);
      shortfall = held + bytes > budget_ ? held + bytes - budget_ : 0;
      fn = reclaimers_[int(victim)];
    }
    uint64_t freed = fn ? (*fn)(shortfall) : 0;  // no lock held: the callback decommits
    std::lock_guard<std::mutex> g(mu_);
    if (freed > 0) {
      ++reclaims_;
      zones_[int(victim)].lent += freed;
    }
  }
  return can_charge(z, bytes);
}

void BudgetOwner::set_reclaimer(Zone z, Reclaimer fn) {
  auto made = std::make_shared<const Reclaimer>(std::move(fn));
  {
    std::lock_guard<std::mutex> g(mu_);
    reclaimers_[int(z)].swap(made);
  }
  // `made` now holds the old one, destroyed here, outside the lock (see reclaimers_).
}

void BudgetOwner::clear_reclaimer(Zone z) {
  std::shared_ptr<const Reclaimer> old;
  {
    std::lock_guard<std::mutex> g(mu_);
    old.swap(reclaimers_[int(z)]);
  }
  // `old` is destroyed here, outside the lock: it may own a Python callable.
}

void BudgetOwner::add_content(Zone z, uint64_t bytes) {
  std::lock_guard<std::mutex> g(mu_);
  zones_[int(z)].content.add(bytes);
  note_peak_locked();
}

void BudgetOwner::sub_content(Zone z, uint64_t bytes) {
  std::lock_guard<std::mutex> g(mu_);
  ZoneSnapshot& zs = zones_[int(z)];
  if (bytes > zs.content.current)
    throw StateError(concat("content of zone ", zone_name(z), " would go negative"));
  zs.content.sub(bytes);
}

void BudgetOwner::set_pooled(uint64_t bytes) {
  std::lock_guard<std::mutex> g(mu_);
  pooled_ = bytes;
  note_peak_locked();
}

LedgerSnapshot BudgetOwner::snapshot() const {
  std::lock_guard<std::mutex> g(mu_);
  LedgerSnapshot s;
  s.budget = budget_;
  s.pooled = pooled_;
  s.zones = zones_;
  for (auto& zs : zones_) s.committed += zs.committed.current;
  s.peak_committed = peak_physical_;
  s.peak_content = peak_content_;
  s.refusals = refusals_;
  s.reclaims = reclaims_;
  return s;
}

uint64_t BudgetOwner::committed_total() const {
  std::lock_guard<std::mutex> g(mu_);
  uint64_t n = 0;
  for (auto& zs : zones_) n += zs.committed.current;
  return n;
}

uint64_t BudgetOwner::pooled() const {
  std::lock_guard<std::mutex> g(mu_);
  return pooled_;
}

std::string describe(const LedgerSnapshot& s) {
  std::string out = concat("Budget ", s.budget, " bytes, committed ", s.committed, " + pooled ", s.pooled, "; zones:");
  for (int i = 0; i < kZoneCount; ++i) {
    const ZoneSnapshot& z = s.zones[i];
    out += concat(" ", zone_name(Zone(i)), " ", z.committed.current, "/", z.allowance,
                  z.reserve ? concat(" (reserve ", z.reserve, ")") : std::string(), i + 1 < kZoneCount ? "," : "");
  }
  return out;
}

}  // namespace offload
