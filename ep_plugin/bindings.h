// Shared pieces of the pybind11 module onnx_offload._core, bound across
// module.cpp (module, errors, bookkeeping, DLPack), bind_values.cpp (the read-only
// snapshot classes) and bind_arena.cpp (ledger, backends, arena, slots, scratch).
#pragma once

#include <pybind11/pybind11.h>

#include <exception>
#include <utility>
#include <vector>

#include "bookkeeping.h"

namespace offload::bind {

namespace py = pybind11;

// A zone given as its label ("weights") or as a Zone.
Zone to_zone(py::handle o);
std::vector<ByteRange> ranges_of(const std::vector<std::pair<uint64_t, uint64_t>>& v);

// Emits the messages queued by offload::warn as onnx_offload.errors.OffloadWarning.
// Needs the GIL. With may_raise, a warning that the filters turn into an error is
// thrown (error_already_set); without, it stays queued for the next drain.
void emit_warnings(bool may_raise);

// Call guard: drains the warning queue when a bound call returns. Listed first in a
// call_guard, it is destroyed last, after gil_scoped_release has taken the GIL back.
// While the call itself is throwing, a warning that would raise stays queued.
struct DrainWarnings {
  DrainWarnings() : uncaught_(std::uncaught_exceptions()) {}
  ~DrainWarnings() noexcept(false) { emit_warnings(std::uncaught_exceptions() == uncaught_); }
  DrainWarnings(const DrainWarnings&) = delete;
  DrainWarnings& operator=(const DrainWarnings&) = delete;

 private:
  int uncaught_;
};

using Drain = py::call_guard<DrainWarnings>;
using Release = py::call_guard<DrainWarnings, py::gil_scoped_release>;

void bind_values(py::module_& m);
void bind_arena(py::module_& m);
void bind_host(py::module_& m);  // bind_host.cpp: the host kernels

}  // namespace offload::bind
