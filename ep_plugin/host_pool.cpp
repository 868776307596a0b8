// The host kernels' worker pool (see host_pool.h).
#include "host_pool.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <fstream>
#include <mutex>
#include <new>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace offload::host {
namespace {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#endif
}

int read_int(const std::string& path, int fallback) {
  std::ifstream f(path);
  int v = 0;
  if (f >> v) return v;
  return fallback;
}

CpuTopology read_topology() {
  std::vector<int> allowed;
#ifdef __linux__
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0)
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &set)) allowed.push_back(c);
#endif
  if (allowed.empty()) {
    const unsigned n = std::max(1u, std::thread::hardware_concurrency());
    for (unsigned c = 0; c < n; ++c) allowed.push_back(int(c));
  }
  // A physical core is a (package, core_id) pair; where sysfs does not say, each CPU
  // counts as a core of its own.
  std::set<std::pair<int, int>> seen;
  std::vector<int> first, rest;
  for (int c : allowed) {
    const std::string base = "/sys/devices/system/cpu/cpu" + std::to_string(c) + "/topology/";
    const int package = read_int(base + "physical_package_id", 0);
    const int core = read_int(base + "core_id", -1 - c);
    (seen.insert({package, core}).second ? first : rest).push_back(c);
  }
  CpuTopology t;
  t.physical_cores = int(first.size());
  t.logical_cpus = int(allowed.size());
  t.cpus = first;
  t.cpus.insert(t.cpus.end(), rest.begin(), rest.end());
  return t;
}

// How long a worker spins before it sleeps (and a caller before it sleeps on a job):
// back-to-back calls of a decode step then skip the futex wake-up, and an idle pool costs
// no CPU. By the clock, as PAUSE takes from a few to a hundred cycles across CPUs.
constexpr auto kSpin = std::chrono::microseconds(50);

// Spins until done() or kSpin has passed; true if done().
template <class Done>
bool spin_until(Done done) {
  const auto until = std::chrono::steady_clock::now() + kSpin;
  for (;;) {
    for (int i = 0; i < 64; ++i) {
      if (done()) return true;
      cpu_relax();
    }
    if (std::chrono::steady_clock::now() >= until) return done();
  }
}

struct Pool {
  std::mutex mu;  // guards the job description; the condition variables wait on it
  std::condition_variable work_cv, done_cv;
  std::atomic<uint64_t> generation{0};
  std::atomic<int> remaining{0};
  std::atomic<bool> failed{false};  // a job's function threw (out of memory): its caller raises
  PoolFn fn = nullptr;
  void* ctx = nullptr;
  int nthreads = 0;
  int workers = 0;  // touched only under g_call_mu
};

std::mutex g_call_mu;     // one job at a time; creation of the pool and of its workers
Pool* g_pool = nullptr;   // never freed: its workers run for the life of the process
bool g_atfork = false;

void worker_main(Pool* p, int tid, int cpu) {
#ifdef __linux__
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  pthread_setaffinity_np(pthread_self(), sizeof(set), &set);  // best effort: a refusal leaves it unpinned
#endif
  uint64_t seen = 0;
  for (;;) {
    spin_until([&] { return p->generation.load(std::memory_order_acquire) != seen; });
    PoolFn fn;
    void* ctx;
    int n;
    {
      std::unique_lock<std::mutex> lk(p->mu);
      p->work_cv.wait(lk, [&] { return p->generation.load(std::memory_order_relaxed) != seen; });
      seen = p->generation.load(std::memory_order_relaxed);
      fn = p->fn;
      ctx = p->ctx;
      n = p->nthreads;
    }
    if (tid >= n) continue;
    try {
      fn(ctx, tid, n);
    } catch (...) {
      p->failed.store(true, std::memory_order_relaxed);
    }
    if (p->remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      std::lock_guard<std::mutex> lk(p->mu);
      p->done_cv.notify_one();
    }
  }
}

// fork(): the prepare handler takes the call lock, so no job is half done in the
// parent's memory when the child is made; the child drops the parent's pool (its
// workers do not exist there) and builds a new one on first use.
void atfork_prepare() { g_call_mu.lock(); }
void atfork_parent() { g_call_mu.unlock(); }
void atfork_child() {
  g_pool = nullptr;  // leaked: its mutexes may be in any state
  g_call_mu.unlock();
}

Pool& pool_with(int nthreads) {
  if (!g_atfork) {
    if (pthread_atfork(atfork_prepare, atfork_parent, atfork_child) != 0)
      throw std::runtime_error("host pool: pthread_atfork failed");
    g_atfork = true;
  }
  if (!g_pool) g_pool = new Pool();
  const CpuTopology& topo = cpu_topology();
  while (g_pool->workers < nthreads - 1) {  // thread 0 of a job is its caller
    const int tid = g_pool->workers + 1;
    std::thread(worker_main, g_pool, tid, topo.cpus[size_t(tid)]).detach();
    ++g_pool->workers;
  }
  return *g_pool;
}

}  // namespace

const CpuTopology& cpu_topology() {
  static const CpuTopology t = read_topology();
  return t;
}

void pool_run(int nthreads, PoolFn fn, void* ctx) {
  if (nthreads < 1 || nthreads > cpu_topology().logical_cpus)
    throw std::invalid_argument("host pool: threads must be in [1, " + std::to_string(cpu_topology().logical_cpus) +
                                "], got " + std::to_string(nthreads));
  if (nthreads == 1) {  // on the caller's thread: no hand-off, nothing shared
    fn(ctx, 0, 1);
    return;
  }
  std::lock_guard<std::mutex> call(g_call_mu);
  Pool& p = pool_with(nthreads);
  {
    std::lock_guard<std::mutex> lk(p.mu);
    p.fn = fn;
    p.ctx = ctx;
    p.nthreads = nthreads;
    p.failed.store(false, std::memory_order_relaxed);
    p.remaining.store(nthreads - 1, std::memory_order_relaxed);
    p.generation.fetch_add(1, std::memory_order_release);
  }
  p.work_cv.notify_all();
  try {  // the caller takes part 0 while the workers wake
    fn(ctx, 0, nthreads);
  } catch (...) {
    p.failed.store(true, std::memory_order_relaxed);
  }
  spin_until([&] { return p.remaining.load(std::memory_order_acquire) == 0; });
  std::unique_lock<std::mutex> lk(p.mu);
  p.done_cv.wait(lk, [&] { return p.remaining.load(std::memory_order_acquire) == 0; });
  if (p.failed.load(std::memory_order_relaxed)) throw std::bad_alloc();
}

int pool_workers() {
  std::lock_guard<std::mutex> call(g_call_mu);
  return g_pool ? g_pool->workers : 0;
}

}  // namespace offload::host
