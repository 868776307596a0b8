#include "backend.h"

#include <stdexcept>

#include "errors.h"

namespace offload {

void PhysicalBackend::inject_failure(const std::string& op, uint64_t after, bool out_of_memory, uint64_t times) {
  const std::atomic<uint64_t>* target = nullptr;
  if (op == "create") target = &counters_->creates;
  else if (op == "release") target = &counters_->releases;
  else if (op == "map") target = &counters_->maps;
  else if (op == "set_access") target = &counters_->set_access;
  else if (op == "unmap") target = &counters_->unmaps;
  else if (op == "plain_alloc") target = &counters_->plain_allocs;
  else throw std::invalid_argument(concat("cannot inject a failure into '", op, "'"));
  fail_at_ = target->load() + after;
  fail_oom_ = out_of_memory;
  fail_times_ = times;
  fail_op_ = target;
}

DriverCounters PhysicalBackend::counters() const {
  DriverCounters c;
#define OFFLOAD_FIELD(name) c.name = counters_->name.load();
  OFFLOAD_DRIVER_COUNTER_FIELDS(OFFLOAD_FIELD)
#undef OFFLOAD_FIELD
  return c;
}

void PhysicalBackend::begin_graph_capture(Stream&) {
  throw StateError(concat("device graphs need the CUDA backend, not '", name(), "'"));
}

std::shared_ptr<DeviceGraph> PhysicalBackend::end_graph_capture(Stream&) {
  throw StateError(concat("device graphs need the CUDA backend, not '", name(), "'"));
}

void PhysicalBackend::maybe_fail(const std::atomic<uint64_t>& calls) {
  if (fail_op_.load() == &calls && calls.load() + 1 >= fail_at_.load()) {
    // A call that fails is not counted, so the next one meets the same condition.
    if (fail_times_.load() > 1)
      --fail_times_;
    else
      fail_op_ = nullptr;
    if (fail_oom_.load())
      throw CudaDriverError(2, "CUDA_ERROR_OUT_OF_MEMORY", "injected failure: CUDA_ERROR_OUT_OF_MEMORY (out of memory)");
    throw OffloadError("injected failure");
  }
}

}  // namespace offload
