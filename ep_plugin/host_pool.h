// The host kernels' worker pool: one thread per physical core of the process's CPU
// affinity, each pinned to its core, kept alive between calls (a decode step makes
// hundreds of small calls; starting threads per call would cost more than a GEMV). The
// caller of a job computes its part 0 itself, so a job of t threads wakes t - 1 workers
// (pinned to the 2nd .. t-th core; the caller stays where the OS runs it).
//
// Callers serialize: one job runs at a time, on the first `nthreads` workers, and the
// caller waits for it. Workers spin for a bounded time after each job (pool_spin_us), so
// a job that follows within it starts without waking anyone; past it they sleep. After fork() the child starts with no workers (the parent's
// threads do not exist there) and builds its own pool on first use.
#pragma once

#include <cstdint>
#include <vector>

namespace offload::host {

struct CpuTopology {
  // The CPUs of sched_getaffinity, one per physical core first (in core order), then
  // the remaining SMT siblings: a pool of t threads pins thread i to cpus[i].
  std::vector<int> cpus;
  int physical_cores = 0;
  int logical_cpus = 0;
};

// Read from sysfs (topology/core_id, physical_package_id) within sched_getaffinity, once
// per process (a forked child keeps the parent's answer, as its affinity is inherited).
const CpuTopology& cpu_topology();

// Runs fn(ctx, tid, nthreads) for tid in [0, nthreads) on pinned workers and returns
// when all have finished; tid 0 runs on the caller's own thread. 1 <= nthreads <= cpu_topology().logical_cpus. Where `fn`
// throws on a worker (its only allocations are scratch buffers), the call throws
// std::bad_alloc once every thread is done. Thread-safe: concurrent callers run one after
// another.
using PoolFn = void (*)(void* ctx, int tid, int nthreads);
void pool_run(int nthreads, PoolFn fn, void* ctx);

// Worker threads alive in this process, the callers aside (0 before the first job of 2
// threads or more, and in a fresh fork child).
int pool_workers();

// Worker threads asleep on the pool's condition variable now (past their spin bound):
// what tells spinning workers from sleeping ones, whatever share of a CPU they get.
int pool_sleeping();

// The bound, in microseconds, for which a worker spins (PAUSE) after a job for the next
// one before it sleeps, and a caller for its workers before it sleeps: back-to-back jobs
// within it take no system call. From ONNX_OFFLOAD_HOST_SPIN_US (0 .. 1000000) where set,
// else 1000; a malformed value makes pool_spin_us and every job of 2 threads or more throw
// std::invalid_argument that names it. pool_set_spin_us throws std::invalid_argument
// outside that range; it applies from the next wait.
int64_t pool_spin_us();
void pool_set_spin_us(int64_t us);

}  // namespace offload::host
