// The memory of a captured graph's host-computed MatMuls (DeviceGraph::add_host_matmuls):
// their HostMatmulJob structs, which the host nodes are given, and one page-locked region
// for the X rows copied down from the device and the Y rows copied back up. The graph
// holds this object (GraphHostMatMul::owner) for as long as its host nodes may run.
#pragma once

#include <sys/types.h>
#include <unistd.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "backend.h"
#include "host_matmul.h"

namespace offload {

class HostJobs {
 public:
  // `count` jobs, each with status -1 ("not run"), and `pinned_bytes` of zeroed host
  // memory, page-aligned, registered with `backend` (page-locked on CUDA).
  HostJobs(std::shared_ptr<PhysicalBackend> backend, std::size_t count, uint64_t pinned_bytes);
  ~HostJobs();
  HostJobs(const HostJobs&) = delete;
  HostJobs& operator=(const HostJobs&) = delete;

  std::size_t size() const { return jobs_.size(); }
  HostMatmulJob& at(std::size_t i);  // std::out_of_range past the last
  uint64_t pinned() const { return uint64_t(reinterpret_cast<uintptr_t>(pinned_)); }
  uint64_t pinned_bytes() const { return bytes_; }
  // Whether [p, p + n) lies inside the pinned region (n >= 1).
  bool holds(uint64_t p, uint64_t n) const {
    return n >= 1 && p >= pinned() && p - pinned() <= bytes_ && n <= bytes_ - (p - pinned());
  }

 private:
  std::shared_ptr<PhysicalBackend> backend_;
  std::vector<HostMatmulJob> jobs_;  // never resized: the host nodes hold their addresses
  void* pinned_ = nullptr;
  uint64_t bytes_ = 0, mapped_ = 0;
  bool registered_ = false;
  pid_t pid_ = getpid();  // the process that mapped the region
};

}  // namespace offload
