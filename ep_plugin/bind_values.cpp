// The read-only values that cross the binding: ledger snapshots, arena statistics,
// driver counters and scratch statistics. Each is a copy taken at one moment, with
// as_dict() (plain nested dicts and ints, for JSON) and a readable repr.
#include <pybind11/stl.h>

#include <string>

#include "arena.h"
#include "backend.h"
#include "bindings.h"
#include "errors.h"
#include "ledger.h"
#include "scratch_allocator.h"

namespace offload::bind {
namespace {

using Fields = std::vector<const char*>;

// A value as plain Python data: snapshot objects by their as_dict, dicts by value.
py::object plain(py::handle v) {
  if (py::hasattr(v, "as_dict")) return v.attr("as_dict")();
  if (py::isinstance<py::dict>(v)) {
    py::dict out;
    for (auto item : py::reinterpret_borrow<py::dict>(v)) out[item.first] = plain(item.second);
    return std::move(out);
  }
  return py::reinterpret_borrow<py::object>(v);
}

// Adds as_dict, __repr__ and copying, all driven by the attribute names.
template <typename T>
py::class_<T> value_class(py::module_& m, const char* name, const char* doc, Fields fields) {
  py::class_<T> c(m, name, doc);
  c.def("as_dict", [fields](py::handle self) {
     py::dict d;
     for (const char* f : fields) d[f] = plain(self.attr(f));
     return d;
   }, "The fields as plain nested dicts and ints (JSON-ready).");
  c.def("__repr__", [name = std::string(name), fields](py::handle self) {
    std::string out = name + "(";
    for (std::size_t i = 0; i < fields.size(); ++i)
      out += offload::concat(i ? ", " : "", fields[i], "=", std::string(py::repr(self.attr(fields[i]))));
    return out + ")";
  });
  c.def("__copy__", [](const T& v) { return T(v); });
  c.def("__deepcopy__", [](const T& v, py::handle) { return T(v); }, py::arg("memo"));
  return c;
}

py::dict by_zone(const std::array<uint64_t, kZoneCount>& a) {
  py::dict d;
  for (int i = 0; i < kZoneCount; ++i) d[zone_name(Zone(i))] = a[i];
  return d;
}

}  // namespace

void bind_values(py::module_& m) {
  value_class<Counter>(m, "Counter", "{current, peak, total}: total is the cumulative bytes charged.",
                       {"current", "peak", "total"})
      .def_readonly("current", &Counter::current)
      .def_readonly("peak", &Counter::peak)
      .def_readonly("total", &Counter::total);

  value_class<ZoneSnapshot>(m, "ZoneSnapshot", "One zone of a ledger snapshot.",
                            {"allowance", "reserve", "priority", "committed", "content", "outside", "lent"})
      .def_readonly("allowance", &ZoneSnapshot::allowance)
      .def_readonly("reserve", &ZoneSnapshot::reserve)
      .def_readonly("priority", &ZoneSnapshot::priority)
      .def_property_readonly("committed", [](const ZoneSnapshot& z) { return z.committed; }, "Physical bytes.")
      .def_property_readonly("content", [](const ZoneSnapshot& z) { return z.content; }, "Bytes of the tensors held.")
      .def_readonly("outside", &ZoneSnapshot::outside, "Of committed: bytes measured outside the arena.")
      .def_readonly("lent", &ZoneSnapshot::lent, "Bytes reclaimed from this zone for another.");

  value_class<LedgerSnapshot>(m, "LedgerSnapshot", "The budget owner's state at one moment.",
                              {"budget", "pooled", "committed", "peak_committed", "peak_content", "refusals",
                               "reclaims", "zones"})
      .def_readonly("budget", &LedgerSnapshot::budget)
      .def_readonly("pooled", &LedgerSnapshot::pooled)
      .def_readonly("committed", &LedgerSnapshot::committed, "Sum over the zones.")
      .def_readonly("peak_committed", &LedgerSnapshot::peak_committed, "Zones + pooled, at its peak.")
      .def_readonly("peak_content", &LedgerSnapshot::peak_content)
      .def_readonly("refusals", &LedgerSnapshot::refusals)
      .def_readonly("reclaims", &LedgerSnapshot::reclaims)
      .def_property_readonly("zones", [](const LedgerSnapshot& s) {
        py::dict d;
        for (int i = 0; i < kZoneCount; ++i) d[zone_name(Zone(i))] = s.zones[i];
        return d;
      }, "dict[str, ZoneSnapshot] by zone label, in zone order.")
      .def("zone", [](const LedgerSnapshot& s, py::handle z) { return s.zones[int(to_zone(z))]; }, py::arg("zone"),
           "The snapshot of one zone, given as its label or a Zone.");

  Fields arena_fields = {
#define OFFLOAD_NAME(name) #name,
      OFFLOAD_ARENA_STATS_FIELDS(OFFLOAD_NAME)
#undef OFFLOAD_NAME
      "mapped_by_zone", "plain_by_zone", "content_by_zone"};
  auto arena = value_class<ArenaStats>(m, "ArenaStats", "The arena's counters and invariants at one moment.",
                                       arena_fields);
#define OFFLOAD_DEF(name) arena.def_readonly(#name, &ArenaStats::name);
  OFFLOAD_ARENA_STATS_FIELDS(OFFLOAD_DEF)
#undef OFFLOAD_DEF
  arena.def_property_readonly("mapped_by_zone", [](const ArenaStats& s) { return by_zone(s.mapped_by_zone); })
      .def_property_readonly("plain_by_zone", [](const ArenaStats& s) { return by_zone(s.plain_by_zone); })
      .def_property_readonly("content_by_zone", [](const ArenaStats& s) { return by_zone(s.content_by_zone); });

  auto driver = value_class<DriverCounters>(m, "DriverCounters", "Driver calls and their time (ns), since the backend was made.",
                                            {
#define OFFLOAD_NAME(name) #name,
                                                OFFLOAD_DRIVER_COUNTER_FIELDS(OFFLOAD_NAME)
#undef OFFLOAD_NAME
                                            });
#define OFFLOAD_DEF(name) driver.def_readonly(#name, &DriverCounters::name);
  OFFLOAD_DRIVER_COUNTER_FIELDS(OFFLOAD_DEF)
#undef OFFLOAD_DEF

  auto scratch = value_class<ScratchStats>(m, "ScratchStats", "A scratch allocator's counters at one moment.",
                                           {
#define OFFLOAD_NAME(name) #name,
                                               OFFLOAD_SCRATCH_STATS_FIELDS(OFFLOAD_NAME)
#undef OFFLOAD_NAME
                                           });
#define OFFLOAD_DEF(name) scratch.def_readonly(#name, &ScratchStats::name);
  OFFLOAD_SCRATCH_STATS_FIELDS(OFFLOAD_DEF)
#undef OFFLOAD_DEF
}

}  // namespace offload::bind
