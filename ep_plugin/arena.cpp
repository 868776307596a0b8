#include "arena.h"

#include <algorithm>
#include <stdexcept>

#include "errors.h"

namespace offload {

uint64_t plain_charge(uint64_t bytes, uint64_t gran) {
  // What a plain device allocation really takes: whole pages once it is large.
  return bytes >= gran ? round_up(bytes, gran) : round_up(bytes, 512);
}

namespace {
constexpr uint64_t kMaxReservation = uint64_t(1) << 47;
}  // namespace

Arena::Arena(std::shared_ptr<PhysicalBackend> backend, std::shared_ptr<BudgetOwner> ledger, ArenaConfig cfg)
    : backend_(std::move(backend)),
      ledger_(std::move(ledger)),
      gran_(backend_->granularity()),
      classes_(cfg.handle_classes),
      pool_limit_(cfg.pool_limit),
      zone_va_(round_up(cfg.zone_va_bytes ? cfg.zone_va_bytes : (uint64_t(64) << 30), gran_)),
      gmap_(gran_) {
  // With 2 MiB granules: 2, 32, 128 and 512 MiB. Set-access and unmap cost about the
  // same per handle whatever its size, so large ranges want few, large handles.
  if (classes_.empty()) classes_ = {gran_, 16 * gran_, 64 * gran_, 256 * gran_};
  std::sort(classes_.begin(), classes_.end());
  classes_.erase(std::unique(classes_.begin(), classes_.end()), classes_.end());
  if (classes_.front() != gran_)
    throw std::invalid_argument(concat("the smallest handle class must be the granularity (", gran_, " bytes)"));
  for (uint64_t c : classes_)
    if (c % gran_ != 0) throw std::invalid_argument(concat("handle class ", c, " is not a multiple of the granularity ", gran_));
  // A 64-bit process has at most 2^47 bytes of user address space: a larger request
  // (or one whose product with the zone count wraps) can never be reserved.
  if (zone_va_ == 0 || zone_va_ > kMaxReservation / kZoneCount)
    throw std::invalid_argument(concat("zone_va_bytes=", cfg.zone_va_bytes, " cannot be reserved: ", kZoneCount,
                                       " zones of it exceed the ", kMaxReservation, " bytes of a process's address space"));
  for (int z = 0; z < kZoneCount; ++z) regions_.emplace_back(zone_va_);
  base_ = backend_->reserve(zone_va_ * kZoneCount);
  counters_.granularity = gran_;
  counters_.va_base = base_;
  counters_.va_bytes = zone_va_ * kZoneCount;
}

Arena::~Arena() {
  try {
    close();
  } catch (const std::exception& e) {
    warn(concat("closing the arena failed: ", e.what()));
  }
}

void Arena::require_open_locked() const {
  if (closed_) throw StateError("the arena is closed");
}

void Arena::check_capture_locked(const char* what) {
  for (auto it = guarded_.begin(); it != guarded_.end();) {
    auto s = it->lock();
    if (!s) {
      it = guarded_.erase(it);
      continue;
    }
    if (s->is_capturing()) {
      ++counters_.capture_refusals;
      throw StateError(concat("refused to ", what, " while stream ", s->native(),
                              " is capturing a graph: residency may change only between replays"));
    }
    ++it;
  }
}

std::vector<ByteRange> Arena::to_offsets_locked(const std::vector<ByteRange>& ranges) const {
  std::vector<ByteRange> out;
  out.reserve(ranges.size());
  const uint64_t total = zone_va_ * kZoneCount;
  for (const ByteRange& r : ranges) {
    if (r.offset < base_ || r.length > total || r.offset - base_ > total - r.length)
      throw StateError(concat("range [", r.offset, ", +", r.length, ") is outside the arena"));
    out.push_back({r.offset - base_, r.length});
  }
  return out;
}

uint64_t Arena::carve(Zone region, uint64_t length, uint64_t alignment) {
  std::lock_guard<std::mutex> g(mu_);
  require_open_locked();
  auto off = regions_[int(region)].carve(length, alignment);
  if (!off)
    throw OffloadError(concat("the ", zone_name(region), " region of the arena has no free span of ", length,
                              " bytes (", regions_[int(region)].free_bytes(), " bytes free of ", zone_va_,
                              "); raise zone_va_bytes"));
  return base_ + uint64_t(int(region)) * zone_va_ + *off;
}

void Arena::release(uint64_t va) {
  std::lock_guard<std::mutex> g(mu_);
  if (closed_) return;
  if (va < base_ || va - base_ >= zone_va_ * kZoneCount) throw StateError(concat("address ", va, " is outside the arena"));
  const uint64_t off = va - base_;
  regions_[off / zone_va_].release(off % zone_va_);
}

uint64_t Arena::incremental_commit_bytes(const std::vector<ByteRange>& ranges) {
  std::lock_guard<std::mutex> g(mu_);
  require_open_locked();
  return gmap_.incremental_commit_bytes(to_offsets_locked(ranges));
}

void Arena::release_handle_locked(uint64_t handle) {
  handle_size_.erase(handle);
  backend_->release(handle);
  ++counters_.handles_released;
}

template <typename Over>
void Arena::trim_pool_while_locked(uint64_t keep_limit, Over over) {
  while (over()) {
    auto victim = pool_.pop_for_trim(keep_limit);
    if (!victim) break;
    release_handle_locked(victim->second);
  }
}

uint64_t Arena::acquire_handle_locked(uint64_t rem, uint64_t pending, bool* reused) {
  uint64_t ideal = classes_.front();
  for (uint64_t c : classes_)
    if (c <= rem) ideal = c;
  *reused = true;
  if (auto h = pool_.take(ideal)) return *h;
  const uint64_t budget = ledger_->budget();
  // Physical bytes now: the zones (which already include this transaction's
  // pending, unbacked bytes) less those pending bytes, plus idle pooled handles.
  auto physical = [&] { return ledger_->committed_total() - pending + pool_.bytes(); };
  if (physical() + ideal > budget) {
    if (auto smaller = pool_.largest_fitting(rem)) {
      auto h = pool_.take(*smaller);
      return *h;
    }
    trim_pool_while_locked(rem, [&] { return physical() + ideal > budget; });
  }
  *reused = false;
  uint64_t h = backend_->create(ideal);
  handle_size_[h] = ideal;
  ++counters_.handles_created;
  return h;
}

void Arena::return_handle_locked(uint64_t size, uint64_t handle) noexcept {
  if (pool_.bytes() + size <= pool_limit_) {
    pool_.put(size, handle);
    return;
  }
  try {
    release_handle_locked(handle);
  } catch (const std::exception& e) {
    warn(concat("releasing a physical handle failed: ", e.what()));
  }
}

void Arena::commit(Zone charge, const std::vector<ByteRange>& ranges, uint64_t content) {
  std::lock_guard<std::mutex> g(mu_);
  require_open_locked();
  const std::vector<ByteRange> offs = to_offsets_locked(ranges);
  const std::vector<GranuleRun> runs = gmap_.uncovered_runs(offs);
  uint64_t n = 0;
  for (const GranuleRun& r : runs) n += r.count * gran_;
  if (n > 0) check_capture_locked("map");
  ledger_->charge(charge, n, false, false);  // reserve first; throws BudgetExceeded and nothing changed
  std::vector<Mapped> done;
  try {
    uint64_t pending = n;
    for (const GranuleRun& run : runs) {
      const uint64_t va = base_ + run.first * gran_, bytes = run.count * gran_;
      for (uint64_t pos = 0; pos < bytes;) {
        bool reused = false;
        const uint64_t h = acquire_handle_locked(bytes - pos, pending, &reused);
        const uint64_t size = handle_size_.at(h);
        if (reused) ++counters_.handles_reused;
        try {
          backend_->map(va + pos, size, h);
        } catch (...) {
          return_handle_locked(size, h);
          throw;
        }
        done.push_back({va + pos, size, h});
        pending -= size;
        pos += size;
      }
      backend_->set_access(va, bytes);  // one call over the whole run
    }
  } catch (...) {
    // Rolled back below; a device that is full although the budget had room is a
    // shortage of the budget's kind, which callers plan around, not a driver fault.
    std::exception_ptr error = std::current_exception();
    ++counters_.rollbacks;
    uint64_t stuck = 0;
    for (auto it = done.rbegin(); it != done.rend(); ++it) {
      try {
        backend_->unmap(it->va, it->bytes);
        return_handle_locked(it->bytes, it->handle);
      } catch (const std::exception& e) {
        // Still mapped: keep it as an unreferenced extent, charged, so close() retries.
        warn(concat("rollback could not unmap ", it->bytes, " bytes: ", e.what()));
        gmap_.add_extent({(it->va - base_) / gran_, it->bytes / gran_, it->handle, charge});
        mapped_by_zone_[int(charge)] += it->bytes;
        stuck += it->bytes;
      }
    }
    ledger_->refund(charge, n - stuck);
    ledger_->set_pooled(pool_.bytes());
    try {
      std::rethrow_exception(error);
    } catch (const CudaDriverError& e) {
      if (e.error_name() != "CUDA_ERROR_OUT_OF_MEMORY") throw;
      throw BudgetExceeded(zone_name(charge), n,
                           concat("the device has no free memory for ", n, " bytes in zone ", zone_name(charge),
                                  " although the budget has room: memory outside the budget (another process, "
                                  "or what ORT and the CUDA libraries hold) took it (", e.what(), ")"),
                           true);
    }
  }
  for (const Mapped& m : done) gmap_.add_extent({(m.va - base_) / gran_, m.bytes / gran_, m.handle, charge});
  gmap_.acquire(charge, offs);
  mapped_by_zone_[int(charge)] += n;
  content_by_zone_[int(charge)] += content;
  ledger_->set_pooled(pool_.bytes());  // first: the peak is noted against the current pool
  ledger_->add_content(charge, content);
  ++counters_.commits;
}

void Arena::wait_readers_locked(const std::vector<Extent>& freed) {
  if (skip_reader_wait_) return;
  for (const Extent& e : freed) {
    auto it = readers_.find(e.first);
    if (it == readers_.end()) continue;
    for (auto& ev : it->second) {
      if (!ev->query()) {
        ++counters_.reader_waits;
        ev->synchronize();
      }
    }
  }
}

void Arena::check_readers_done_locked(const Extent& e) {
  auto it = readers_.find(e.first);
  if (it == readers_.end()) return;
  for (auto& ev : it->second) {
    if (!ev->query()) {
      ++counters_.unmaps_before_reader;
      return;
    }
  }
}

void Arena::decommit(Zone charge, const std::vector<ByteRange>& ranges, uint64_t content) {
  std::lock_guard<std::mutex> g(mu_);
  require_open_locked();
  const std::vector<ByteRange> offs = to_offsets_locked(ranges);
  if (content > content_by_zone_[int(charge)])
    throw StateError(concat("decommit of ", content, " content bytes from zone ", zone_name(charge), " which holds ",
                            content_by_zone_[int(charge)]));
  GranuleMap::ReleaseResult rel;
  try {
    rel = gmap_.release(charge, offs);  // an underflow throws and changes nothing
  } catch (const StateError&) {
    counters_.refcount_underflows = gmap_.underflows();
    throw;
  }
  if (!rel.freed.empty()) {
    try {
      check_capture_locked("unmap");
      wait_readers_locked(rel.freed);
    } catch (...) {
      gmap_.restore(charge, offs, rel);
      throw;
    }
  }
  std::vector<Extent> freed = rel.freed;
  std::sort(freed.begin(), freed.end(), [](const Extent& a, const Extent& b) { return a.first < b.first; });
  std::vector<Extent> unmapped;
  std::string first_error;
  for (std::size_t i = 0; i < freed.size();) {
    std::size_t j = i + 1;
    while (j < freed.size() && freed[j - 1].first + freed[j - 1].count == freed[j].first) ++j;
    const uint64_t va = base_ + freed[i].first * gran_;
    const uint64_t bytes = (freed[j - 1].first + freed[j - 1].count - freed[i].first) * gran_;
    for (std::size_t k = i; k < j; ++k) check_readers_done_locked(freed[k]);
    try {
      backend_->unmap(va, bytes);  // one call over the contiguous run
      unmapped.insert(unmapped.end(), freed.begin() + long(i), freed.begin() + long(j));
    } catch (const std::exception& e) {
      // Keep them, charged and unreferenced; close() retries.
      if (first_error.empty()) first_error = e.what();
      for (std::size_t k = i; k < j; ++k) gmap_.add_extent(freed[k]);
    }
    i = j;
  }
  for (const Extent& e : unmapped) {
    const uint64_t bytes = e.count * gran_;
    ledger_->refund(e.zone, bytes);
    mapped_by_zone_[int(e.zone)] -= bytes;
    readers_.erase(e.first);
    return_handle_locked(bytes, e.handle);
  }
  for (auto& [e, to] : rel.recharged) {
    const uint64_t bytes = e.count * gran_;
    ledger_->transfer(e.zone, to, bytes);
    mapped_by_zone_[int(e.zone)] -= bytes;
    mapped_by_zone_[int(to)] += bytes;
    gmap_.set_extent_zone(e.first, to);
  }
  content_by_zone_[int(charge)] -= content;
  ledger_->sub_content(charge, content);
  ledger_->set_pooled(pool_.bytes());
  ++counters_.decommits;
  if (!first_error.empty()) throw OffloadError(concat("decommit could not unmap: ", first_error));
}

void Arena::note_reader(const std::vector<ByteRange>& ranges, std::shared_ptr<Event> e) {
  std::lock_guard<std::mutex> g(mu_);
  require_open_locked();
  for (uint64_t first : gmap_.extents_touching(to_offsets_locked(ranges))) {
    auto& list = readers_[first];
    list.erase(std::remove_if(list.begin(), list.end(), [&](const std::shared_ptr<Event>& x) { return x == e || x->query(); }),
               list.end());
    list.push_back(e);
  }
}

uint64_t Arena::plain_alloc(Zone charge, uint64_t bytes) {
  std::lock_guard<std::mutex> g(mu_);
  require_open_locked();
  if (bytes == 0) throw std::invalid_argument("plain allocation of zero bytes");
  const uint64_t charged = plain_charge(bytes, gran_);
  ledger_->charge(charge, charged, false, false);
  uint64_t ptr = 0;
  try {
    const uint64_t budget = ledger_->budget();
    trim_pool_while_locked(0, [&] { return ledger_->committed_total() + pool_.bytes() > budget; });
    ptr = backend_->plain_alloc(charged);  // freed with the same length
  } catch (...) {
    ledger_->refund(charge, charged);
    ledger_->set_pooled(pool_.bytes());
    throw;
  }
  plain_[ptr] = {charge, charged};
  plain_by_zone_[int(charge)] += charged;
  ledger_->set_pooled(pool_.bytes());
  return ptr;
}

void Arena::plain_free(uint64_t ptr) {
  std::lock_guard<std::mutex> g(mu_);
  require_open_locked();
  auto it = plain_.find(ptr);
  if (it == plain_.end()) throw StateError(concat("plain_free of ", ptr, " which the arena did not allocate"));
  auto [zone, charged] = it->second;
  backend_->plain_free(ptr, charged);
  plain_.erase(it);
  plain_by_zone_[int(zone)] -= charged;
  ledger_->refund(zone, charged);
}

void Arena::guard_capture(std::shared_ptr<Stream> s) {
  std::lock_guard<std::mutex> g(mu_);
  guarded_.push_back(s);
}

void Arena::unguard_capture(const Stream* s) {
  std::lock_guard<std::mutex> g(mu_);
  guarded_.erase(std::remove_if(guarded_.begin(), guarded_.end(),
                                [&](const std::weak_ptr<Stream>& w) {
                                  auto p = w.lock();
                                  return !p || p.get() == s;
                                }),
                 guarded_.end());
}

uint64_t Arena::trim_pool(uint64_t bytes) {
  std::lock_guard<std::mutex> g(mu_);
  if (closed_) return 0;
  const uint64_t before = pool_.bytes();
  trim_pool_while_locked(0, [&] { return before - pool_.bytes() < bytes; });
  const uint64_t freed = before - pool_.bytes();
  ledger_->set_pooled(pool_.bytes());
  return freed;
}

uint64_t Arena::unaccounted_locked() {
  auto diff = [](uint64_t a, uint64_t b) { return a > b ? a - b : b - a; };
  LedgerSnapshot s = ledger_->snapshot();
  uint64_t bad = diff(s.pooled, pool_.bytes());
  for (int z = 0; z < kZoneCount; ++z)
    bad += diff(s.zones[z].committed.current - s.zones[z].outside, mapped_by_zone_[z] + plain_by_zone_[z]);
  uint64_t live = 0, mapped = 0;
  for (auto& [h, size] : handle_size_) live += size;
  for (uint64_t m : mapped_by_zone_) mapped += m;
  bad += diff(live, mapped + pool_.bytes());
  bad += diff(mapped, gmap_.mapped_granules() * gran_);
  return bad;
}

ArenaStats Arena::stats() {
  std::lock_guard<std::mutex> g(mu_);
  ArenaStats s = counters_;
  for (auto& [h, size] : handle_size_) s.live_handle_bytes += size;
  s.live_handles = handle_size_.size();
  s.pool_bytes = pool_.bytes();
  s.pool_handles = pool_.count();
  s.extents = gmap_.extent_count();
  s.mapped_bytes = gmap_.mapped_granules() * gran_;
  s.mapped_by_zone = mapped_by_zone_;
  s.plain_by_zone = plain_by_zone_;
  s.content_by_zone = content_by_zone_;
  const DriverCounters c = backend_->counters();
  s.unmap_calls = c.unmaps;
  s.set_access_calls = c.set_access;
  s.map_calls = c.maps;
  s.refcount_underflows = gmap_.underflows();
  s.uncovered_referenced = gmap_.uncovered_referenced();
  s.unaccounted_bytes = closed_ ? 0 : unaccounted_locked();
  return s;
}

void Arena::close() {
  std::lock_guard<std::mutex> g(mu_);
  if (closed_) return;
  std::vector<Extent> all = gmap_.extents();
  wait_readers_locked(all);
  for (const Extent& e : all) {
    const uint64_t bytes = e.count * gran_;
    check_readers_done_locked(e);
    try {
      backend_->unmap(base_ + e.first * gran_, bytes);
    } catch (const std::exception& ex) {
      warn(concat("close could not unmap or release ", bytes, " bytes at ", hex(base_ + e.first * gran_),
                  " (unmap): ", ex.what()));
    }
    // Released even when still mapped, so the handle (a memfd on the host) is not leaked:
    // the driver frees a mapped handle's memory at its last unmap, and the reservation's
    // munmap below ends a host mapping.
    try {
      release_handle_locked(e.handle);
    } catch (const std::exception& ex) {
      warn(concat("close could not unmap or release ", bytes, " bytes at ", hex(base_ + e.first * gran_),
                  " (release): ", ex.what()));
    }
    ledger_->refund(e.zone, bytes);
  }
  for (auto& [size, h] : pool_.drain()) {
    try {
      release_handle_locked(h);
    } catch (const std::exception& ex) {
      warn(concat("close could not release a pooled handle: ", ex.what()));
    }
  }
  for (auto& [ptr, zc] : plain_) {
    try {
      backend_->plain_free(ptr, zc.second);
    } catch (const std::exception& ex) {
      warn(concat("close could not free a plain allocation: ", ex.what()));
    }
    ledger_->refund(zc.first, zc.second);
  }
  plain_.clear();
  for (int z = 0; z < kZoneCount; ++z) {
    if (content_by_zone_[z]) ledger_->sub_content(Zone(z), content_by_zone_[z]);
    content_by_zone_[z] = mapped_by_zone_[z] = plain_by_zone_[z] = 0;
  }
  ledger_->set_pooled(0);
  readers_.clear();
  gmap_ = GranuleMap(gran_);
  backend_->free_reservation(base_, zone_va_ * kZoneCount);
  closed_ = true;
}

}  // namespace offload
