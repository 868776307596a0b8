// A weight's slot over the arena, and its state machine.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "arena.h"

namespace offload {

// A weight's slot: one stable address for its whole life, backed only while resident.
enum class SlotState { Evicted, PagingIn, Resident, Pinned };
const char* slot_state_name(SlotState s);

class WeightSlot {
 public:
  WeightSlot(std::shared_ptr<Arena> arena, std::string key, uint64_t length, uint64_t alignment = kDefaultAlignment,
             Zone region = Zone::Weights);
  ~WeightSlot();
  WeightSlot(const WeightSlot&) = delete;
  WeightSlot& operator=(const WeightSlot&) = delete;

  const std::string& key() const { return key_; }
  uint64_t va() const { return va_; }
  uint64_t length() const { return length_; }
  SlotState state();
  int pins() const { return pins_; }  // how many pin() calls no unpin() has answered
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

}  // namespace offload
