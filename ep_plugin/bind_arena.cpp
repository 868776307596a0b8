// The stateful objects of the binding: the budget owner, backends with their
// streams and events, the arena, weight slots and the scratch allocator.
//
// The GIL is released around every call that may map, unmap, copy or wait. Every
// method drains the warning queue when it returns (DrainWarnings).
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include "arena.h"
#include "backend.h"
#include "host_jobs.h"
#include "bindings.h"
#include "ledger.h"
#include "ort_allocator.h"
#include "scratch_allocator.h"
#include "weight_slot.h"

namespace offload::bind {
namespace {

using RangeList = std::vector<std::pair<uint64_t, uint64_t>>;
using SlotList = std::vector<std::shared_ptr<WeightSlot>>;

void bind_ledger(py::module_& m) {
  py::class_<BudgetOwner, std::shared_ptr<BudgetOwner>>(m, "BudgetOwner")
      .def(py::init<uint64_t>(), py::arg("budget"))
      .def_property_readonly("budget", &BudgetOwner::budget)
      .def("set_zone", [](BudgetOwner& b, py::handle z, uint64_t allowance, uint64_t reserve, std::optional<int> priority) {
        b.set_zone(to_zone(z), allowance, reserve, priority);
      }, py::arg("zone"), py::arg("allowance"), py::arg("reserve") = 0, py::arg("priority") = py::none(), Drain(),
         "priority=None takes the zone's entry of ZONE_PRIORITY.")
      .def("charge", [](BudgetOwner& b, py::handle z, uint64_t n, bool outside) { b.charge(to_zone(z), n, outside); },
           py::arg("zone"), py::arg("bytes"), py::arg("outside") = false, Drain())
      .def("refund", [](BudgetOwner& b, py::handle z, uint64_t n, bool outside) { b.refund(to_zone(z), n, outside); },
           py::arg("zone"), py::arg("bytes"), py::arg("outside") = false, Drain())
      .def("can_charge", [](BudgetOwner& b, py::handle z, uint64_t n) { return b.can_charge(to_zone(z), n); },
           py::arg("zone"), py::arg("bytes"), Drain())
      .def("headroom", [](BudgetOwner& b, py::handle z) { return b.headroom(to_zone(z)); }, py::arg("zone"), Drain())
      .def("make_room", [](BudgetOwner& b, py::handle z, uint64_t n) {
        Zone zone = to_zone(z);
        py::gil_scoped_release nogil;
        return b.make_room(zone, n);
      }, py::arg("zone"), py::arg("bytes"), Drain())
      .def("set_reclaimer", [](BudgetOwner& b, py::handle z, BudgetOwner::Reclaimer fn) {
        b.set_reclaimer(to_zone(z), std::move(fn));
      }, py::arg("zone"), py::arg("fn"), Drain())
      .def("clear_reclaimer", [](BudgetOwner& b, py::handle z) { b.clear_reclaimer(to_zone(z)); }, py::arg("zone"), Drain())
      .def("snapshot", &BudgetOwner::snapshot, Drain())
      .def("describe", [](BudgetOwner& b) { return describe(b.snapshot()); }, Drain())
      .def_property_readonly("committed", &BudgetOwner::committed_total)
      .def_property_readonly("pooled", &BudgetOwner::pooled);
}

void bind_backend(py::module_& m) {
  py::class_<Stream, std::shared_ptr<Stream>>(m, "Stream")
      .def_property_readonly("native", &Stream::native)
      .def("synchronize", &Stream::synchronize, Release())
      .def("is_capturing", &Stream::is_capturing, Drain())
      .def("close", &Stream::close, Release(),
           "Finishes the queued work and ends the stream; idempotent. Later work on it is a StateError.")
      .def_property_readonly("closed", &Stream::closed);
  py::class_<Event, std::shared_ptr<Event>>(m, "Event")
      .def("record", &Event::record, py::arg("stream"), Release())
      .def("query", &Event::query, Release())
      .def("synchronize", &Event::synchronize, Release())
      .def("wait_on", &Event::wait_on, py::arg("stream"), Release())
      .def("elapsed_ms", &Event::elapsed_ms, py::arg("start"), Release());
  py::class_<HostGraph, std::shared_ptr<HostGraph>>(m, "HostGraph")
      .def("launch", &HostGraph::launch, py::arg("stream"), Release())
      .def_property_readonly("size", &HostGraph::size);
  py::class_<DeviceGraph, std::shared_ptr<DeviceGraph>>(m, "DeviceGraph")
      .def_property_readonly("nodes", &DeviceGraph::nodes)
      .def_property_readonly("kernels", &DeviceGraph::kernels)
      .def_property_readonly("opaque", &DeviceGraph::opaque)
      .def_property_readonly("launches", &DeviceGraph::launches)
      .def("readers", &DeviceGraph::readers, py::arg("ranges"), Release())
      .def("kernel_name", &DeviceGraph::kernel_name, py::arg("node"), Release())
      .def("address_in_params", &DeviceGraph::address_in_params, py::arg("node"), py::arg("lo"), py::arg("hi"),
           Release())
      .def("param_bytes", [](DeviceGraph& g, int node) {
        std::vector<std::string> blobs;
        {
          py::gil_scoped_release nogil;
          blobs = g.param_bytes(node);
        }
        py::list out;
        for (const std::string& b : blobs) out.append(py::bytes(b));
        return out;
      }, py::arg("node"))
      .def("add_copies", [](DeviceGraph& g, const std::vector<std::tuple<uint64_t, uint64_t, uint64_t, std::vector<int>,
                                                                         std::vector<int>>>& copies, int in_flight) {
        std::vector<GraphCopy> list;
        for (auto& [dst, src, n, after, before] : copies) list.push_back(GraphCopy{dst, src, n, after, before});
        py::gil_scoped_release nogil;
        g.add_copies(list, in_flight);
      }, py::arg("copies"), py::arg("in_flight") = 1, Drain())
      .def("add_host_matmuls", [](DeviceGraph& g, const std::shared_ptr<HostJobs>& jobs,
                                  const std::vector<std::tuple<size_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t,
                                                               uint64_t, std::vector<int>, std::vector<int>>>& items) {
        std::vector<GraphHostMatMul> list;
        for (auto& [i, x_src, x_host, x_bytes, y_host, y_dst, y_bytes, after, before] : items) {
          if (!jobs->holds(x_host, x_bytes) || !jobs->holds(y_host, y_bytes))
            throw py::value_error("host MatMul " + std::to_string(list.size()) + ": its X or Y host rows are not "
                                  "inside the jobs' pinned region");
          const uint64_t job = uint64_t(reinterpret_cast<uintptr_t>(&jobs->at(i)));
          list.push_back(GraphHostMatMul{x_src, x_host, x_bytes, job, y_host, y_dst, y_bytes, after, before, jobs});
        }
        py::gil_scoped_release nogil;
        g.add_host_matmuls(list);
      }, py::arg("jobs").none(false), py::arg("matmuls"), Drain(),
         "Adds per item (job index, X's device address, its pinned host rows, bytes, Y's pinned host rows, Y's "
         "device address, bytes, nodes after, nodes before): a D2H copy of X, a host node running the job, an H2D "
         "copy of Y. The graph holds `jobs` while it lives.")
      .def("instantiate", &DeviceGraph::instantiate, py::arg("stream"), Release())
      .def("launch", &DeviceGraph::launch, py::arg("stream"), Release());
  m.def("host_begin_capture", &host_begin_capture, py::arg("stream"), Drain());
  m.def("host_end_capture", &host_end_capture, py::arg("stream"), Drain());

  py::class_<PhysicalBackend, std::shared_ptr<PhysicalBackend>>(m, "Backend")
      .def_property_readonly("name", &PhysicalBackend::name)
      .def_property_readonly("device", &PhysicalBackend::device)
      .def_property_readonly("granularity", &PhysicalBackend::granularity)
      .def("create_stream", &PhysicalBackend::create_stream, Drain())
      .def("wrap_stream", &PhysicalBackend::wrap_stream, py::arg("native"), Drain())
      .def("create_event", &PhysicalBackend::create_event, Drain())
      .def("begin_graph_capture", &PhysicalBackend::begin_graph_capture, py::arg("stream"), Release())
      .def("end_graph_capture", &PhysicalBackend::end_graph_capture, py::arg("stream"), Release())
      .def("copy_h2d", [](PhysicalBackend& b, uint64_t dst, uint64_t src, uint64_t n, Stream& s) {
        b.copy_h2d(dst, reinterpret_cast<const void*>(src), n, s);
      }, py::arg("dst"), py::arg("src"), py::arg("bytes"), py::arg("stream"), Release())
      .def("copy_d2h", [](PhysicalBackend& b, uint64_t dst, uint64_t src, uint64_t n, Stream& s) {
        b.copy_d2h(reinterpret_cast<void*>(dst), src, n, s);
      }, py::arg("dst"), py::arg("src"), py::arg("bytes"), py::arg("stream"), Release())
      .def("copy_d2d", &PhysicalBackend::copy_d2d, py::arg("dst"), py::arg("src"), py::arg("bytes"), py::arg("stream"),
           Release())
      .def("copy_d2d_2d", &PhysicalBackend::copy_d2d_2d, py::arg("dst"), py::arg("dst_pitch"), py::arg("src"),
           py::arg("src_pitch"), py::arg("width"), py::arg("rows"), py::arg("stream"), Release())
      .def("fill", &PhysicalBackend::fill, py::arg("dst"), py::arg("value"), py::arg("bytes"), py::arg("stream"), Release())
      .def("host_register", [](PhysicalBackend& b, uint64_t p, uint64_t n) { b.host_register(reinterpret_cast<void*>(p), n); },
           py::arg("ptr"), py::arg("bytes"), Release())
      .def("host_unregister", [](PhysicalBackend& b, uint64_t p) { b.host_unregister(reinterpret_cast<void*>(p)); },
           py::arg("ptr"), Release())
      .def("host_device_address", [](PhysicalBackend& b, uint64_t p) {
        return b.host_device_address(reinterpret_cast<void*>(p));
      }, py::arg("ptr"), Release())
      .def("mem_info", &PhysicalBackend::mem_info, Drain())
      .def("counters", &PhysicalBackend::counters, Drain())
      .def("inject_failure", &PhysicalBackend::inject_failure, py::arg("op"), py::arg("after") = 1,
           py::arg("out_of_memory") = false, py::arg("times") = 1, Drain())
      .def("enqueue_delay", &PhysicalBackend::enqueue_delay, py::arg("stream"), py::arg("ms"), Release(),
           "Test hook: the stream sleeps `ms` before its next work.")
      // Raw handle calls, for benchmarks and tests of the driver costs themselves.
      .def("create", &PhysicalBackend::create, py::arg("bytes"), Release())
      .def("create_host", &PhysicalBackend::create_host, py::arg("bytes"), Release(),
           "A physical handle in host memory, which maps into a reservation like a device one.")
      .def("set_host_access", &PhysicalBackend::set_host_access, py::arg("va"), py::arg("bytes"), Release())
      .def("release", &PhysicalBackend::release, py::arg("handle"), Release())
      .def("map", &PhysicalBackend::map, py::arg("va"), py::arg("bytes"), py::arg("handle"), Release())
      .def("set_access", &PhysicalBackend::set_access, py::arg("va"), py::arg("bytes"), Release())
      .def("unmap", &PhysicalBackend::unmap, py::arg("va"), py::arg("bytes"), Release())
      .def("reserve", &PhysicalBackend::reserve, py::arg("bytes"), Release())
      .def("free_reservation", &PhysicalBackend::free_reservation, py::arg("va"), py::arg("bytes"), Release())
      .def("plain_alloc", &PhysicalBackend::plain_alloc, py::arg("bytes"), Release())
      .def("plain_free", &PhysicalBackend::plain_free, py::arg("ptr"), py::arg("bytes"), Release());
  m.def("make_host_backend", &make_host_backend, py::arg("granularity") = uint64_t(2) << 20, Drain());
  m.def("make_cuda_backend", &make_cuda_backend, py::arg("device") = 0, Drain());
}

void bind_arena_class(py::module_& m) {
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
           py::arg("handle_classes") = std::vector<uint64_t>{}, py::arg("pool_limit") = UINT64_MAX, Drain())
      .def_property_readonly("backend", &Arena::backend_ptr)
      .def_property_readonly("ledger", &Arena::ledger)
      .def_property_readonly("granularity", &Arena::granularity)
      .def_property_readonly("handle_classes", &Arena::handle_classes)
      .def_property_readonly("closed", &Arena::closed)
      .def("carve", [](Arena& a, py::handle z, uint64_t len, uint64_t align) { return a.carve(to_zone(z), len, align); },
           py::arg("zone"), py::arg("length"), py::arg("alignment") = kDefaultAlignment, Drain())
      .def("release", &Arena::release, py::arg("va"), Drain())
      .def("incremental_commit_bytes", [](Arena& a, const RangeList& r) { return a.incremental_commit_bytes(ranges_of(r)); },
           py::arg("ranges"), Drain())
      .def("commit", [](Arena& a, py::handle z, const RangeList& r, uint64_t content) {
        Zone zone = to_zone(z);
        py::gil_scoped_release nogil;
        a.commit(zone, ranges_of(r), content);
      }, py::arg("zone"), py::arg("ranges"), py::arg("content"), Drain())
      .def("decommit", [](Arena& a, py::handle z, const RangeList& r, uint64_t content) {
        Zone zone = to_zone(z);
        py::gil_scoped_release nogil;
        a.decommit(zone, ranges_of(r), content);
      }, py::arg("zone"), py::arg("ranges"), py::arg("content"), Drain())
      .def("note_reader", [](Arena& a, const RangeList& r, std::shared_ptr<Event> e) { a.note_reader(ranges_of(r), std::move(e)); },
           py::arg("ranges"), py::arg("event"), Drain())
      .def("plain_alloc", [](Arena& a, py::handle z, uint64_t n) {
        Zone zone = to_zone(z);
        py::gil_scoped_release nogil;
        return a.plain_alloc(zone, n);
      }, py::arg("zone"), py::arg("bytes"), Drain())
      .def("plain_free", &Arena::plain_free, py::arg("ptr"), Release())
      .def("guard_capture", &Arena::guard_capture, py::arg("stream"), Drain())
      .def("unguard_capture", [](Arena& a, Stream& s) { a.unguard_capture(&s); }, py::arg("stream"), Drain())
      .def("trim_pool", &Arena::trim_pool, py::arg("bytes"), Release())
      .def("stats", &Arena::stats, Drain())
      .def("close", &Arena::close, Release())
      .def("debug_skip_reader_wait", &Arena::debug_skip_reader_wait, py::arg("skip"), Drain(),
           "Test hook: decommit and close stop waiting for recorded readers.");
}

void bind_slots(py::module_& m) {
  py::class_<WeightSlot, std::shared_ptr<WeightSlot>>(m, "WeightSlot")
      .def(py::init([](std::shared_ptr<Arena> a, std::string key, uint64_t length, uint64_t alignment, py::handle region) {
             return std::make_shared<WeightSlot>(std::move(a), std::move(key), length, alignment, to_zone(region));
           }),
           py::arg("arena"), py::arg("key"), py::arg("length"), py::arg("alignment") = kDefaultAlignment,
           py::arg("region") = Zone::Weights, Drain())
      .def_property_readonly("key", &WeightSlot::key)
      .def_property_readonly("va", &WeightSlot::va)
      .def_property_readonly("length", &WeightSlot::length)
      .def_property_readonly("state", [](WeightSlot& s) { return std::string(slot_state_name(s.state())); })
      .def_property_readonly("pins", &WeightSlot::pins)
      .def_property_readonly("charged_zone", [](WeightSlot& s) { return std::string(zone_name(s.charged_zone())); })
      .def_property_readonly("ready_event", &WeightSlot::ready_event)
      .def("set_source", [](WeightSlot& s, uint64_t ptr, uint64_t n) { s.set_source(reinterpret_cast<const void*>(ptr), n); },
           py::arg("ptr"), py::arg("bytes"), Drain())
      .def("pin", &WeightSlot::pin, Drain())
      .def("unpin", &WeightSlot::unpin, Drain())
      .def("mark_read", &WeightSlot::mark_read, py::arg("event"), Drain())
      .def_static("page_in", [](const SlotList& slots, py::handle z, Stream& s) {
        Zone zone = to_zone(z);
        py::gil_scoped_release nogil;
        return WeightSlot::page_in(slots, zone, s);
      }, py::arg("slots"), py::arg("zone"), py::arg("stream"), Drain())
      .def_static("evict", &WeightSlot::evict, py::arg("slots"), Release());

  py::class_<ScratchAllocator, std::shared_ptr<ScratchAllocator>>(m, "ScratchAllocator")
      .def(py::init([](std::shared_ptr<Arena> a, py::handle z, uint64_t align) {
             return std::make_shared<ScratchAllocator>(std::move(a), to_zone(z), align);
           }),
           py::arg("arena"), py::arg("zone") = Zone::Scratch, py::arg("alignment") = kDefaultAlignment, Drain())
      .def("allocate", &ScratchAllocator::allocate, py::arg("bytes"), Release())
      .def("deallocate", &ScratchAllocator::deallocate, py::arg("ptr"), Release())
      .def("empty_cache", &ScratchAllocator::empty_cache, Release())
      .def("release_all", &ScratchAllocator::release_all, Release())
      .def("last_error", &ScratchAllocator::last_error, Drain())
      .def("stats", &ScratchAllocator::stats, Drain());

  m.def("bind_external_allocator", [](std::shared_ptr<ScratchAllocator> a) {
    ExternalAllocatorBinding b = bind_external_allocator(std::move(a));
    return py::make_tuple(b.index, b.alloc_fn, b.free_fn, b.empty_cache_fn);
  }, py::arg("allocator"), Drain());
  m.def("unbind_external_allocator", &unbind_external_allocator, py::arg("index"), Drain());
}

}  // namespace

void bind_arena(py::module_& m) {
  bind_ledger(m);
  bind_backend(m);
  bind_arena_class(m);
  bind_slots(m);
}

}  // namespace offload::bind
