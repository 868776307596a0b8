// pybind11 module onnx_offload._core: the arena, the ledger, the backends, slots,
// the scratch allocator and its ORT binding, and DLPack views of slot memory.
//
// The GIL is released around every call that may map, unmap, copy or wait.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "arena.h"
#include "backend.h"
#include "driver_api.h"
#include "errors.h"
#include "ort_allocator.h"

namespace py = pybind11;
using namespace offload;

namespace {

// ------------------------------------------------------------------ DLPack
struct DLDevice {
  int32_t device_type;
  int32_t device_id;
};
struct DLDataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;
  uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor*);
};

struct DLPackHolder {
  DLManagedTensor managed{};
  std::vector<int64_t> shape;
};

void delete_holder(DLManagedTensor* t) { delete static_cast<DLPackHolder*>(t->manager_ctx); }

DLDataType parse_dtype(const std::string& s) {
  static const std::map<std::string, DLDataType> known = {
      {"float32", {2, 32, 1}}, {"float16", {2, 16, 1}}, {"float64", {2, 64, 1}}, {"bfloat16", {4, 16, 1}},
      {"int8", {0, 8, 1}},     {"int16", {0, 16, 1}},   {"int32", {0, 32, 1}},   {"int64", {0, 64, 1}},
      {"uint8", {1, 8, 1}},    {"uint16", {1, 16, 1}},  {"uint32", {1, 32, 1}},  {"uint64", {1, 64, 1}},
      {"bool", {6, 8, 1}}};
  auto it = known.find(s);
  if (it == known.end()) throw std::invalid_argument("dtype '" + s + "' has no DLPack form here");
  return it->second;
}

// A non-owning DLPack capsule over memory the arena owns.
py::capsule make_dlpack(uint64_t ptr, std::vector<int64_t> shape, const std::string& dtype, int device_type, int device_id) {
  auto* h = new DLPackHolder();
  h->shape = std::move(shape);
  DLTensor& t = h->managed.dl_tensor;
  t.data = reinterpret_cast<void*>(ptr);
  t.device = {device_type, device_id};
  t.ndim = int32_t(h->shape.size());
  t.dtype = parse_dtype(dtype);
  t.shape = h->shape.data();
  t.strides = nullptr;
  t.byte_offset = 0;
  h->managed.manager_ctx = h;
  h->managed.deleter = delete_holder;
  return py::capsule(&h->managed, "dltensor", [](PyObject* cap) {
    // Unconsumed capsules still carry the name "dltensor" and own the tensor.
    if (PyCapsule_IsValid(cap, "dltensor")) {
      auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(cap, "dltensor"));
      if (m && m->deleter) m->deleter(m);
    }
  });
}

// ------------------------------------------------------------------ helpers
std::vector<ByteRange> ranges_of(const std::vector<std::pair<uint64_t, uint64_t>>& v) {
  std::vector<ByteRange> out;
  out.reserve(v.size());
  for (auto& [o, l] : v) out.push_back({o, l});
  return out;
}

py::dict counter_dict(const Counter& c) {
  py::dict d;
  d["current"] = c.current;
  d["peak"] = c.peak;
  d["total"] = c.total;
  return d;
}

py::dict ledger_dict(const LedgerSnapshot& s) {
  py::dict d, zones;
  d["budget"] = s.budget;
  d["pooled"] = s.pooled;
  d["committed"] = s.committed;
  d["peak_committed"] = s.peak_committed;
  d["peak_content"] = s.peak_content;
  d["refusals"] = s.refusals;
  d["reclaims"] = s.reclaims;
  for (int i = 0; i < kZoneCount; ++i) {
    const ZoneSnapshot& z = s.zones[i];
    py::dict zd;
    zd["allowance"] = z.allowance;
    zd["reserve"] = z.reserve;
    zd["priority"] = z.priority;
    zd["committed"] = counter_dict(z.committed);
    zd["content"] = counter_dict(z.content);
    zd["outside"] = z.outside;
    zd["lent"] = z.lent;
    zones[zone_name(Zone(i))] = zd;
  }
  d["zones"] = zones;
  return d;
}

py::dict driver_counters_dict(const DriverCounters& c) {
  py::dict d;
  d["creates"] = c.creates.load();
  d["releases"] = c.releases.load();
  d["maps"] = c.maps.load();
  d["unmaps"] = c.unmaps.load();
  d["set_access"] = c.accesses.load();
  d["create_ns"] = c.create_ns.load();
  d["release_ns"] = c.release_ns.load();
  d["map_ns"] = c.map_ns.load();
  d["unmap_ns"] = c.unmap_ns.load();
  d["set_access_ns"] = c.access_ns.load();
  d["plain_allocs"] = c.plain_allocs.load();
  d["plain_frees"] = c.plain_frees.load();
  d["plain_alloc_ns"] = c.plain_alloc_ns.load();
  d["plain_free_ns"] = c.plain_free_ns.load();
  return d;
}

py::dict arena_dict(const ArenaStats& s) {
  py::dict d;
#define F(name) d[#name] = s.name;
  F(granularity) F(va_base) F(va_bytes) F(live_handle_bytes) F(live_handles) F(pool_bytes) F(pool_handles)
  F(extents) F(mapped_bytes) F(commits) F(decommits) F(rollbacks) F(handles_created) F(handles_released)
  F(handles_reused) F(unmap_calls) F(set_access_calls) F(map_calls) F(reader_waits) F(refcount_underflows)
  F(capture_refusals) F(unmaps_before_reader) F(unaccounted_bytes) F(uncovered_referenced)
#undef F
  py::dict mz, pz, cz;
  for (int i = 0; i < kZoneCount; ++i) {
    mz[zone_name(Zone(i))] = s.mapped_by_zone[i];
    pz[zone_name(Zone(i))] = s.plain_by_zone[i];
    cz[zone_name(Zone(i))] = s.content_by_zone[i];
  }
  d["mapped_by_zone"] = mz;
  d["plain_by_zone"] = pz;
  d["content_by_zone"] = cz;
  return d;
}

Zone to_zone(const py::object& o) {
  if (py::isinstance<py::str>(o)) return zone_from_name(o.cast<std::string>());
  return o.cast<Zone>();
}

using SlotList = std::vector<std::shared_ptr<WeightSlot>>;
using Release = py::call_guard<py::gil_scoped_release>;

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "onnx-offload core: VMM arena, committed-byte budget owner, backends and slots";

  // Map the C++ errors onto onnx_offload.errors (BudgetExceeded is a MemoryError there).
  py::register_exception_translator([](std::exception_ptr p) {
    if (!p) return;
    auto raise = [](const char* cls, const std::exception& e, py::dict attrs) {
      py::object errors = py::module_::import("onnx_offload.errors");
      py::object exc = errors.attr(cls)(e.what());
      for (auto item : attrs) exc.attr(item.first) = item.second;
      PyErr_SetObject(py::type::handle_of(exc).ptr(), exc.ptr());
    };
    try {
      std::rethrow_exception(p);
    } catch (const BudgetExceeded& e) {
      py::dict a;
      a["zone"] = e.zone();
      a["requested"] = e.requested();
      raise("BudgetExceeded", e, a);
    } catch (const CudaDriverError& e) {
      py::dict a;
      a["code"] = e.code();
      a["error_name"] = e.error_name();
      raise("CudaDriverError", e, a);
    } catch (const CudaUnavailable& e) {
      raise("CudaUnavailable", e, py::dict());
    } catch (const StateError& e) {
      raise("StateError", e, py::dict());
    } catch (const OffloadError& e) {
      raise("OffloadError", e, py::dict());
    }
  });

  m.def("driver_status", &driver_status, "'' when the CUDA driver is usable, else why not");
  m.def("driver_version", []() { return driver().driver_version; });

  py::enum_<Zone>(m, "Zone")
      .value("WEIGHTS", Zone::Weights)
      .value("KV", Zone::KV)
      .value("SCRATCH", Zone::Scratch)
      .value("TRANSIENT", Zone::Transient)
      .def_property_readonly("label", [](Zone z) { return std::string(zone_name(z)); });

  // Pure bookkeeping.
  m.def("round_up", &round_up);
  m.def("plain_charge", &plain_charge, py::arg("bytes"), py::arg("granularity"));
  py::class_<SpanAllocator>(m, "SpanAllocator")
      .def(py::init<uint64_t>())
      .def("carve", &SpanAllocator::carve, py::arg("length"), py::arg("alignment") = 1)
      .def("release", &SpanAllocator::release)
      .def_property_readonly("capacity", &SpanAllocator::capacity)
      .def_property_readonly("free_bytes", &SpanAllocator::free_bytes)
      .def_property_readonly("largest_free", &SpanAllocator::largest_free)
      .def_property_readonly("free_blocks", &SpanAllocator::free_blocks)
      .def_property_readonly("live_spans", &SpanAllocator::live_spans);

  py::class_<GranuleMap>(m, "GranuleMap")
      .def(py::init<uint64_t>())
      .def("incremental_commit_bytes", [](GranuleMap& g, const std::vector<std::pair<uint64_t, uint64_t>>& r) {
        return g.incremental_commit_bytes(ranges_of(r));
      })
      .def("uncovered_runs", [](GranuleMap& g, const std::vector<std::pair<uint64_t, uint64_t>>& r) {
        std::vector<std::pair<uint64_t, uint64_t>> out;
        for (auto& run : g.uncovered_runs(ranges_of(r))) out.push_back({run.first, run.count});
        return out;
      })
      .def("add_extent", [](GranuleMap& g, uint64_t first, uint64_t count, uint64_t handle, Zone z) {
        g.add_extent({first, count, handle, z});
      })
      .def("acquire", [](GranuleMap& g, Zone z, const std::vector<std::pair<uint64_t, uint64_t>>& r) { g.acquire(z, ranges_of(r)); })
      .def("release", [](GranuleMap& g, Zone z, const std::vector<std::pair<uint64_t, uint64_t>>& r) {
        auto res = g.release(z, ranges_of(r));
        std::vector<std::pair<uint64_t, uint64_t>> freed;
        for (auto& e : res.freed) freed.push_back({e.first, e.count});
        return freed;
      })
      .def("refs", &GranuleMap::refs)
      .def_property_readonly("mapped_granules", &GranuleMap::mapped_granules)
      .def_property_readonly("underflows", &GranuleMap::underflows)
      .def_property_readonly("extent_count", &GranuleMap::extent_count);

  py::class_<BudgetOwner, std::shared_ptr<BudgetOwner>>(m, "BudgetOwner")
      .def(py::init<uint64_t>(), py::arg("budget"))
      .def_property_readonly("budget", &BudgetOwner::budget)
      .def("set_zone", [](BudgetOwner& b, py::object z, uint64_t allowance, uint64_t reserve, int priority) {
        b.set_zone(to_zone(z), allowance, reserve, priority);
      }, py::arg("zone"), py::arg("allowance"), py::arg("reserve") = 0, py::arg("priority"))
      .def("charge", [](BudgetOwner& b, py::object z, uint64_t n, bool outside) { b.charge(to_zone(z), n, outside); },
           py::arg("zone"), py::arg("bytes"), py::arg("outside") = false)
      .def("refund", [](BudgetOwner& b, py::object z, uint64_t n, bool outside) { b.refund(to_zone(z), n, outside); },
           py::arg("zone"), py::arg("bytes"), py::arg("outside") = false)
      .def("can_charge", [](BudgetOwner& b, py::object z, uint64_t n) { return b.can_charge(to_zone(z), n); })
      .def("headroom", [](BudgetOwner& b, py::object z) { return b.headroom(to_zone(z)); })
      .def("make_room", [](BudgetOwner& b, py::object z, uint64_t n) {
        Zone zone = to_zone(z);
        py::gil_scoped_release nogil;
        return b.make_room(zone, n);
      })
      .def("set_reclaimer", [](BudgetOwner& b, py::object z, BudgetOwner::Reclaimer fn) { b.set_reclaimer(to_zone(z), std::move(fn)); })
      .def("clear_reclaimer", [](BudgetOwner& b, py::object z) {
        Zone zone = to_zone(z);
        b.clear_reclaimer(zone);
      })
      .def("snapshot", [](BudgetOwner& b) { return ledger_dict(b.snapshot()); })
      .def("describe", [](BudgetOwner& b) { return describe(b.snapshot()); })
      .def_property_readonly("committed", &BudgetOwner::committed_total)
      .def_property_readonly("pooled", &BudgetOwner::pooled);

  py::class_<Stream, std::shared_ptr<Stream>>(m, "Stream")
      .def_property_readonly("native", &Stream::native)
      .def("synchronize", &Stream::synchronize, Release())
      .def("is_capturing", &Stream::is_capturing);
  py::class_<Event, std::shared_ptr<Event>>(m, "Event")
      .def("record", &Event::record, Release())
      .def("query", &Event::query, Release())
      .def("synchronize", &Event::synchronize, Release())
      .def("wait_on", &Event::wait_on, Release())
      .def("elapsed_ms", &Event::elapsed_ms, Release());
  py::class_<HostGraph, std::shared_ptr<HostGraph>>(m, "HostGraph")
      .def("launch", &HostGraph::launch, Release())
      .def_property_readonly("size", &HostGraph::size);
  m.def("host_begin_capture", &host_begin_capture);
  m.def("host_end_capture", &host_end_capture);

  py::class_<PhysicalBackend, std::shared_ptr<PhysicalBackend>>(m, "Backend")
      .def_property_readonly("name", &PhysicalBackend::name)
      .def_property_readonly("device", &PhysicalBackend::device)
      .def_property_readonly("granularity", &PhysicalBackend::granularity)
      .def("create_stream", &PhysicalBackend::create_stream)
      .def("wrap_stream", &PhysicalBackend::wrap_stream)
      .def("create_event", &PhysicalBackend::create_event)
      .def("copy_h2d", [](PhysicalBackend& b, uint64_t dst, uint64_t src, uint64_t n, Stream& s) {
        b.copy_h2d(dst, reinterpret_cast<const void*>(src), n, s);
      }, Release())
      .def("copy_d2h", [](PhysicalBackend& b, uint64_t dst, uint64_t src, uint64_t n, Stream& s) {
        b.copy_d2h(reinterpret_cast<void*>(dst), src, n, s);
      }, Release())
      .def("copy_d2d", &PhysicalBackend::copy_d2d, Release())
      .def("fill", &PhysicalBackend::fill, Release())
      .def("host_register", [](PhysicalBackend& b, uint64_t p, uint64_t n) { b.host_register(reinterpret_cast<void*>(p), n); }, Release())
      .def("host_unregister", [](PhysicalBackend& b, uint64_t p) { b.host_unregister(reinterpret_cast<void*>(p)); }, Release())
      .def("mem_info", &PhysicalBackend::mem_info)
      .def("counters", [](PhysicalBackend& b) { return driver_counters_dict(b.counters()); })
      .def("inject_failure", &PhysicalBackend::inject_failure, py::arg("op"), py::arg("after") = 1)
      // Raw handle calls, for benchmarks and tests of the driver costs themselves.
      .def("create", &PhysicalBackend::create, Release())
      .def("release", &PhysicalBackend::release, Release())
      .def("map", &PhysicalBackend::map, Release())
      .def("set_access", &PhysicalBackend::set_access, Release())
      .def("unmap", &PhysicalBackend::unmap, Release())
      .def("reserve", &PhysicalBackend::reserve, Release())
      .def("free_reservation", &PhysicalBackend::free_reservation, Release())
      .def("plain_alloc", &PhysicalBackend::plain_alloc, Release())
      .def("plain_free", &PhysicalBackend::plain_free, Release());
  m.def("make_host_backend", &make_host_backend, py::arg("granularity") = uint64_t(2) << 20);
  m.def("make_cuda_backend", &make_cuda_backend, py::arg("device") = 0);

  py::class_<Arena, std::shared_ptr<Arena>>(m, "Arena")
      .def(py::init([](std::shared_ptr<PhysicalBackend> b, std::shared_ptr<BudgetOwner> l, uint64_t zone_va_bytes,
                       std::vector<uint64_t> classes, uint64_t pool_limit) {
             ArenaConfig c;
             c.zone_va_bytes = zone_va_bytes;
             c.handle_classes = std::move(classes);
             c.pool_limit = pool_limit;
             return std::make_shared<Arena>(std::move(b), std::move(l), c);
           }),
           py::arg("backend"), py::arg("ledger"), py::arg("zone_va_bytes") = 0,
           py::arg("handle_classes") = std::vector<uint64_t>{}, py::arg("pool_limit") = UINT64_MAX)
      .def_property_readonly("backend", &Arena::backend_ptr)
      .def_property_readonly("ledger", &Arena::ledger)
      .def_property_readonly("granularity", &Arena::granularity)
      .def_property_readonly("handle_classes", &Arena::handle_classes)
      .def_property_readonly("closed", &Arena::closed)
      .def("carve", [](Arena& a, py::object z, uint64_t len, uint64_t align) { return a.carve(to_zone(z), len, align); },
           py::arg("zone"), py::arg("length"), py::arg("alignment") = 256)
      .def("release", &Arena::release)
      .def("incremental_commit_bytes", [](Arena& a, const std::vector<std::pair<uint64_t, uint64_t>>& r) {
        return a.incremental_commit_bytes(ranges_of(r));
      })
      .def("commit", [](Arena& a, py::object z, const std::vector<std::pair<uint64_t, uint64_t>>& r, uint64_t content) {
        Zone zone = to_zone(z);
        py::gil_scoped_release nogil;
        a.commit(zone, ranges_of(r), content);
      }, py::arg("zone"), py::arg("ranges"), py::arg("content"))
      .def("decommit", [](Arena& a, py::object z, const std::vector<std::pair<uint64_t, uint64_t>>& r, uint64_t content) {
        Zone zone = to_zone(z);
        py::gil_scoped_release nogil;
        a.decommit(zone, ranges_of(r), content);
      }, py::arg("zone"), py::arg("ranges"), py::arg("content"))
      .def("note_reader", [](Arena& a, const std::vector<std::pair<uint64_t, uint64_t>>& r, std::shared_ptr<Event> e) {
        a.note_reader(ranges_of(r), std::move(e));
      })
      .def("plain_alloc", [](Arena& a, py::object z, uint64_t n) {
        Zone zone = to_zone(z);
        py::gil_scoped_release nogil;
        return a.plain_alloc(zone, n);
      })
      .def("plain_free", &Arena::plain_free, Release())
      .def("guard_capture", &Arena::guard_capture)
      .def("unguard_capture", [](Arena& a, Stream& s) { a.unguard_capture(&s); })
      .def("trim_pool", &Arena::trim_pool, Release())
      .def("stats", [](Arena& a) { return arena_dict(a.stats()); })
      .def("close", &Arena::close, Release());

  py::class_<WeightSlot, std::shared_ptr<WeightSlot>>(m, "WeightSlot")
      .def(py::init([](std::shared_ptr<Arena> a, std::string key, uint64_t length, uint64_t alignment, py::object region) {
             return std::make_shared<WeightSlot>(std::move(a), std::move(key), length, alignment, to_zone(region));
           }),
           py::arg("arena"), py::arg("key"), py::arg("length"), py::arg("alignment") = 256, py::arg("region") = Zone::Weights)
      .def_property_readonly("key", &WeightSlot::key)
      .def_property_readonly("va", &WeightSlot::va)
      .def_property_readonly("length", &WeightSlot::length)
      .def_property_readonly("state", [](WeightSlot& s) { return std::string(slot_state_name(s.state())); })
      .def_property_readonly("charged_zone", [](WeightSlot& s) { return std::string(zone_name(s.charged_zone())); })
      .def_property_readonly("ready_event", &WeightSlot::ready_event)
      .def("set_source", [](WeightSlot& s, uint64_t ptr, uint64_t n) { s.set_source(reinterpret_cast<const void*>(ptr), n); })
      .def("pin", &WeightSlot::pin)
      .def("unpin", &WeightSlot::unpin)
      .def("mark_read", &WeightSlot::mark_read)
      .def_static("page_in", [](const SlotList& slots, py::object z, Stream& s) {
        Zone zone = to_zone(z);
        py::gil_scoped_release nogil;
        return WeightSlot::page_in(slots, zone, s);
      })
      .def_static("evict", &WeightSlot::evict, Release());

  py::class_<ScratchAllocator, std::shared_ptr<ScratchAllocator>>(m, "ScratchAllocator")
      .def(py::init([](std::shared_ptr<Arena> a, py::object z, uint64_t align) {
             return std::make_shared<ScratchAllocator>(std::move(a), to_zone(z), align);
           }),
           py::arg("arena"), py::arg("zone") = Zone::Scratch, py::arg("alignment") = 256)
      .def("allocate", &ScratchAllocator::allocate, Release())
      .def("deallocate", &ScratchAllocator::deallocate, Release())
      .def("empty_cache", &ScratchAllocator::empty_cache, Release())
      .def("last_error", &ScratchAllocator::last_error)
      .def("stats", [](ScratchAllocator& a) {
        auto s = a.stats();
        py::dict d;
        d["live_bytes"] = s.live_bytes;
        d["cached_bytes"] = s.cached_bytes;
        d["peak_live"] = s.peak_live;
        d["allocs"] = s.allocs;
        d["frees"] = s.frees;
        d["cache_hits"] = s.cache_hits;
        d["failures"] = s.failures;
        return d;
      });

  m.def("bind_external_allocator", [](std::shared_ptr<ScratchAllocator> a) {
    ExternalAllocatorBinding b = bind_external_allocator(std::move(a));
    return py::make_tuple(b.index, b.alloc_fn, b.free_fn, b.empty_cache_fn);
  });
  m.def("unbind_external_allocator", &unbind_external_allocator);
  m.def("make_dlpack", &make_dlpack, py::arg("ptr"), py::arg("shape"), py::arg("dtype"), py::arg("device_type"),
        py::arg("device_id") = 0);
}
