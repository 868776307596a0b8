// pybind11 module onnx_offload._core: the arena, the ledger, the backends, slots,
// the scratch allocator and its ORT binding, and DLPack views of slot memory.
// This file holds the module itself, the error and warning mapping, the pure
// bookkeeping and DLPack; bind_values.cpp and bind_arena.cpp bind the rest.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "arena.h"
#include "bindings.h"
#include "driver_api.h"
#include "errors.h"

namespace py = pybind11;
using namespace offload;

namespace offload::bind {

Zone to_zone(py::handle o) {
  if (py::isinstance<py::str>(o)) return zone_from_name(o.cast<std::string>());
  return o.cast<Zone>();
}

std::vector<ByteRange> ranges_of(const std::vector<std::pair<uint64_t, uint64_t>>& v) {
  std::vector<ByteRange> out;
  out.reserve(v.size());
  for (auto& [o, l] : v) out.push_back({o, l});
  return out;
}

void emit_warnings(bool may_raise) {
  std::vector<std::string> msgs = take_warnings();
  for (std::size_t i = 0; i < msgs.size(); ++i) {
    try {
      py::object cls = py::module_::import("onnx_offload.errors").attr("OffloadWarning");
      if (PyErr_WarnEx(cls.ptr(), msgs[i].c_str(), 1) == 0) continue;
      throw py::error_already_set();
    } catch (py::error_already_set&) {
      // The filters made it an error (or the warning class is missing).
      const std::size_t keep_from = may_raise ? i + 1 : i;
      requeue_warnings(std::vector<std::string>(msgs.begin() + long(keep_from), msgs.end()));
      if (may_raise) throw;
      return;  // the call is already failing: its error wins, the warning waits
    }
  }
}

}  // namespace offload::bind

namespace {

using offload::bind::Drain;


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
      a["device_full"] = e.device_full();
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

  m.def("drain_warnings", [] { offload::bind::emit_warnings(true); },
        "Emits the queued cleanup warnings as OffloadWarning (bound calls do this when they return).");
  m.def("driver_status", &driver_status, "'' when the CUDA driver is usable, else why not");
  m.def("driver_version", []() { return driver().driver_version; }, Drain());

  py::enum_<Zone>(m, "Zone")
      .value("WEIGHTS", Zone::Weights)
      .value("KV", Zone::KV)
      .value("SCRATCH", Zone::Scratch)
      .value("TRANSIENT", Zone::Transient)
      .def_property_readonly("label", [](Zone z) { return std::string(zone_name(z)); });

  py::dict priorities;
  for (int i = 0; i < kZoneCount; ++i) priorities[zone_name(Zone(i))] = zone_priority(Zone(i));
  m.attr("ZONE_PRIORITY") = priorities;
  m.attr("DEFAULT_ALIGNMENT") = kDefaultAlignment;

  offload::bind::bind_values(m);

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
        return g.incremental_commit_bytes(offload::bind::ranges_of(r));
      })
      .def("uncovered_runs", [](GranuleMap& g, const std::vector<std::pair<uint64_t, uint64_t>>& r) {
        std::vector<std::pair<uint64_t, uint64_t>> out;
        for (auto& run : g.uncovered_runs(offload::bind::ranges_of(r))) out.push_back({run.first, run.count});
        return out;
      })
      .def("add_extent", [](GranuleMap& g, uint64_t first, uint64_t count, uint64_t handle, Zone z) {
        g.add_extent({first, count, handle, z});
      })
      .def("acquire", [](GranuleMap& g, Zone z, const std::vector<std::pair<uint64_t, uint64_t>>& r) { g.acquire(z, offload::bind::ranges_of(r)); })
      .def("release", [](GranuleMap& g, Zone z, const std::vector<std::pair<uint64_t, uint64_t>>& r) {
        auto res = g.release(z, offload::bind::ranges_of(r));
        std::vector<std::pair<uint64_t, uint64_t>> freed;
        for (auto& e : res.freed) freed.push_back({e.first, e.count});
        return freed;
      })
      .def("refs", &GranuleMap::refs)
      .def_property_readonly("mapped_granules", &GranuleMap::mapped_granules)
      .def_property_readonly("underflows", &GranuleMap::underflows)
      .def_property_readonly("extent_count", &GranuleMap::extent_count);

  offload::bind::bind_arena(m);
  offload::bind::bind_host(m);

  m.def("make_dlpack", &make_dlpack, py::arg("ptr"), py::arg("shape"), py::arg("dtype"), py::arg("device_type"),
        py::arg("device_id") = 0);
}
