#include "host_jobs.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <new>
#include <stdexcept>

#include "errors.h"

namespace offload {

HostJobs::HostJobs(std::shared_ptr<PhysicalBackend> backend, std::size_t count, uint64_t pinned_bytes)
    : backend_(std::move(backend)), bytes_(pinned_bytes) {
  if (!backend_) throw std::invalid_argument("HostJobs needs a backend, got none");
  const uint64_t page = uint64_t(sysconf(_SC_PAGESIZE));
  // A size that rounds past 2^64 would map nothing while holds() took every address as
  // inside the region.
  if (pinned_bytes > UINT64_MAX - page)
    throw std::invalid_argument(concat("pinned_bytes ", pinned_bytes, " is more than a process can map"));
  jobs_.resize(count);
  for (HostMatmulJob& j : jobs_) {
    std::memset(&j, 0, sizeof(j));
    j.status = -1;
    std::snprintf(j.error, sizeof(j.error), "the job has not run");
  }
  mapped_ = (pinned_bytes + page - 1) / page * page;
  if (mapped_ == 0) return;
  // Anonymous pages: zeroed and page-aligned. A fork child gets no copy of them
  // (MADV_DONTFORK): copy-on-write would give the parent's next write a new page while the
  // device's copies still use the registered one.
  void* p = mmap(nullptr, mapped_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  if (madvise(p, mapped_, MADV_DONTFORK) != 0) {
    munmap(p, mapped_);
    throw std::runtime_error("HostJobs: madvise(MADV_DONTFORK) failed on the pinned rows");
  }
  pinned_ = p;
  try {
    backend_->host_register(pinned_, mapped_);
  } catch (...) {
    munmap(pinned_, mapped_);
    throw;
  }
  registered_ = true;
}

HostJobs::~HostJobs() {
  // A fork child has no copy of the region (MADV_DONTFORK), and what it maps later may lie
  // at the same address: it lets the parent's region be.
  if (pinned_ == nullptr || getpid() != pid_) return;
  if (registered_) backend_->host_unregister(pinned_);
  munmap(pinned_, mapped_);
}

HostMatmulJob& HostJobs::at(std::size_t i) {
  if (i >= jobs_.size()) throw std::out_of_range(concat("host job ", i, " of ", jobs_.size()));
  return jobs_[i];
}

}  // namespace offload
