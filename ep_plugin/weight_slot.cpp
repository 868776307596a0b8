#include "weight_slot.h"

#include <stdexcept>

#include "errors.h"

namespace offload {

const char* slot_state_name(SlotState s) {
  switch (s) {
    case SlotState::Evicted: return "evicted";
    case SlotState::PagingIn: return "paging_in";
    case SlotState::Resident: return "resident";
    case SlotState::Pinned: return "pinned";
  }
  return "?";
}

WeightSlot::WeightSlot(std::shared_ptr<Arena> arena, std::string key, uint64_t length, uint64_t alignment, Zone region)
    : arena_(std::move(arena)), key_(std::move(key)), length_(length) {
  if (length == 0) throw std::invalid_argument(concat("weight '", key_, "' has zero bytes"));
  va_ = arena_->carve(region, length, alignment);
}

WeightSlot::~WeightSlot() {
  if (arena_->closed()) return;
  try {
    if (state_ != SlotState::Evicted) {
      pins_ = 0;
      state_ = SlotState::Resident;
      arena_->decommit(charge_, {range()}, length_);
    }
    arena_->release(va_);
  } catch (const std::exception& e) {
    warn(concat("dropping slot '", key_, "' failed: ", e.what()));
  }
}

void WeightSlot::illegal(const char* op) {
  throw StateError(concat("slot '", key_, "' at ", hex(va_), " cannot ", op, " while ", slot_state_name(state_)));
}

SlotState WeightSlot::state() {
  if (state_ == SlotState::PagingIn && ready_ && ready_->query()) state_ = SlotState::Resident;
  return state_;
}

void WeightSlot::set_source(const void* host, uint64_t bytes) {
  if (bytes < length_) throw std::invalid_argument(concat("source of '", key_, "' has ", bytes, " bytes, the slot ", length_));
  src_ = host;
  src_bytes_ = bytes;
}

void WeightSlot::pin() {
  SlotState s = state();
  if (s != SlotState::Resident && s != SlotState::PagingIn && s != SlotState::Pinned) illegal("be pinned");
  state_ = SlotState::Pinned;
  ++pins_;
}

void WeightSlot::unpin() {
  if (state_ != SlotState::Pinned) illegal("be unpinned");
  if (--pins_ == 0) state_ = SlotState::Resident;
}

void WeightSlot::mark_read(std::shared_ptr<Event> e) {
  if (state_ == SlotState::Evicted) illegal("be read");
  arena_->note_reader({range()}, std::move(e));
}

WeightSlot::Group WeightSlot::gather(const std::vector<std::shared_ptr<WeightSlot>>& slots, const char* op,
                                     bool (*allowed)(SlotState)) {
  Group g{slots.front()->arena_.get(), {}, 0};
  for (auto& s : slots) {
    if (s->arena_.get() != g.arena) throw std::invalid_argument(concat("slots of one ", op, " must share an arena"));
    if (!allowed(s->state())) s->illegal(concat("be ", op).c_str());
    g.ranges.push_back(s->range());
    g.content += s->length_;
  }
  return g;
}

std::shared_ptr<Event> WeightSlot::page_in(const std::vector<std::shared_ptr<WeightSlot>>& slots, Zone charge, Stream& stream) {
  if (slots.empty()) return nullptr;
  Group group = gather(slots, "paged in", [](SlotState st) { return st == SlotState::Evicted; });
  for (auto& s : slots)
    if (s->src_ == nullptr) throw StateError(concat("slot '", s->key_, "' has no host source to page in from"));
  Arena& arena = *group.arena;
  const std::vector<ByteRange>& ranges = group.ranges;
  const uint64_t content = group.content;
  arena.commit(charge, ranges, content);
  std::shared_ptr<Event> ev;
  try {
    for (auto& s : slots) arena.backend().copy_h2d(s->va_, s->src_, s->length_, stream);
    ev = arena.backend().create_event();
    ev->record(stream);
    arena.note_reader(ranges, ev);  // the copy writes: no unmap before it ends
  } catch (...) {
    stream.synchronize();
    arena.decommit(charge, ranges, content);
    throw;
  }
  for (auto& s : slots) {
    s->state_ = SlotState::PagingIn;
    s->ready_ = ev;
    s->charge_ = charge;
  }
  return ev;
}

void WeightSlot::evict(const std::vector<std::shared_ptr<WeightSlot>>& slots) {
  if (slots.empty()) return;
  Group group = gather(slots, "evicted",
                       [](SlotState st) { return st == SlotState::Resident || st == SlotState::PagingIn; });
  const Zone charge = slots.front()->charge_;
  for (auto& s : slots)
    if (s->charge_ != charge) throw std::invalid_argument("slots of one eviction must be charged to one zone");
  group.arena->decommit(charge, group.ranges, group.content);
  for (auto& s : slots) {
    s->state_ = SlotState::Evicted;
    s->ready_.reset();
  }
}

}  // namespace offload
