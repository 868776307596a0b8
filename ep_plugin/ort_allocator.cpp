#include "ort_allocator.h"

#include <atomic>
#include <mutex>
#include <utility>

#include "errors.h"

namespace offload {
namespace {

struct Table {
  std::mutex mu;
  std::array<std::shared_ptr<ScratchAllocator>, kExternalAllocatorSlots> owners;
  std::array<std::atomic<ScratchAllocator*>, kExternalAllocatorSlots> live{};
};

Table& table() {
  static Table t;
  return t;
}

// No exception may cross into ORT: failures return nullptr and leave the reason
// in the allocator (last_error), which the session reports.
template <int I>
void* ext_alloc(size_t n) {
  ScratchAllocator* a = table().live[I].load(std::memory_order_acquire);
  return a ? reinterpret_cast<void*>(a->try_allocate(n)) : nullptr;
}

template <int I>
void ext_free(void* p) {
  ScratchAllocator* a = table().live[I].load(std::memory_order_acquire);
  if (a == nullptr || p == nullptr) return;
  try {
    a->deallocate(reinterpret_cast<uint64_t>(p));
  } catch (const std::exception& e) {
    warn(concat("ORT's external allocator: ", e.what()));
  }
}

template <int I>
void ext_empty_cache() {
  ScratchAllocator* a = table().live[I].load(std::memory_order_acquire);
  if (a == nullptr) return;
  try {
    a->empty_cache();
  } catch (const std::exception& e) {
    warn(concat("ORT's external allocator: ", e.what()));
  }
}

template <std::size_t... I>
constexpr std::array<std::array<uint64_t, 3>, sizeof...(I)> make_fns(std::index_sequence<I...>) {
  return {{{reinterpret_cast<uint64_t>(&ext_alloc<int(I)>), reinterpret_cast<uint64_t>(&ext_free<int(I)>),
            reinterpret_cast<uint64_t>(&ext_empty_cache<int(I)>)}...}};
}

const std::array<std::array<uint64_t, 3>, kExternalAllocatorSlots>& fns() {
  static const auto f = make_fns(std::make_index_sequence<kExternalAllocatorSlots>{});
  return f;
}

}  // namespace

ExternalAllocatorBinding bind_external_allocator(std::shared_ptr<ScratchAllocator> a) {
  Table& t = table();
  std::lock_guard<std::mutex> g(t.mu);
  for (int i = 0; i < kExternalAllocatorSlots; ++i) {
    if (t.owners[i]) continue;
    t.owners[i] = a;
    t.live[i].store(a.get(), std::memory_order_release);
    const auto& f = fns()[i];
    return {i, f[0], f[1], f[2]};
  }
  throw OffloadError(concat("all ", kExternalAllocatorSlots, " external allocator bindings are in use: close a session first"));
}

void unbind_external_allocator(int index) {
  Table& t = table();
  std::shared_ptr<ScratchAllocator> old;
  {
    std::lock_guard<std::mutex> g(t.mu);
    if (index < 0 || index >= kExternalAllocatorSlots) return;
    t.live[index].store(nullptr, std::memory_order_release);
    old.swap(t.owners[index]);
  }
}

}  // namespace offload
