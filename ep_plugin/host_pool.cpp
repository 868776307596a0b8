// The host kernels' worker pool (see host_pool.h).
#include "host_pool.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
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

// How long a worker spins (PAUSE, by the clock) after a job for the next one before it
// sleeps on its condition variable, and a caller for its workers before it sleeps on its
// own. The host MatMuls of a decode step come one after another with GPU work between
// them (tens to hundreds of microseconds); 1 ms covers those gaps, so a step pays the
// futex wake-up at most once, and an idle process goes quiet 1 ms after its last job.
// (libgomp spins 300,000 PAUSE rounds by default, about 0.1 - 3 ms across CPUs; Intel's
// OpenMP 200 ms; llama.cpp's pool spins a bounded count too.) Settable, 0 .. 1 s.
constexpr int64_t kSpinDefaultUs = 1000;
constexpr int64_t kSpinMaxUs = 1000000;
std::atomic<int64_t> g_spin_us{-1};  // -1: not read from the environment yet

int64_t spin_us() {
  int64_t v = g_spin_us.load(std::memory_order_relaxed);
  if (v >= 0) return v;
  v = kSpinDefaultUs;
  if (const char* e = std::getenv("ONNX_OFFLOAD_HOST_SPIN_US")) {
    char* end = nullptr;
    errno = 0;
    const long long parsed = std::strtoll(e, &end, 10);
    if (end == e || *end != '\0' || errno || parsed < 0 || parsed > kSpinMaxUs)
      throw std::invalid_argument("ONNX_OFFLOAD_HOST_SPIN_US must be an integer in [0, " +
                                  std::to_string(kSpinMaxUs) + "] (microseconds), got '" + e + "'");
    v = parsed;
  }
  int64_t expected = -1;
  g_spin_us.compare_exchange_strong(expected, v, std::memory_order_relaxed);
  return g_spin_us.load(std::memory_order_relaxed);
}

// Spins until done() or the spin bound has passed; true if done().
template <class Done>
bool spin_until(Done done) {
  if (done()) return true;
  const int64_t us = spin_us();
  if (us == 0) return false;
  const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(us);
  for (;;) {
    for (int i = 0; i < 64; ++i) {
      if (done()) return true;
      cpu_relax();
    }
    if (std::chrono::steady_clock::now() >= until) return done();
    // A thread of this pool, or another process, may wait for this CPU (the caller is not
    // pinned and can share a worker's CPU; a loaded host runs more threads than CPUs):
    // pure spinning would hold it for a whole time slice (milliseconds). Yielding every
    // 64 PAUSEs (a few microseconds) lets it run, and costs about a microsecond where no
    // one waits.
    sched_yield();
  }
}

// A job is announced by one atomic word, (generation << 16) | nthreads: a worker reads
// the thread count of the very job whose generation it saw, and one past that count never
// touches fn and ctx (which the next job may be overwriting). A worker within the count
// reads fn and ctx after its acquire of the word; its caller rewrites them only after it
// has finished (remaining == 0). Sleepers: a worker (or the caller) announces itself in
// `sleepers` (or `caller_sleeps`) before it checks its condition under `mu` and waits; the
// other side, after its own store, takes `mu` and notifies only where that count is not
// zero. Both sides are sequentially consistent, so a sleeper either sees the store or is
// notified, and a hand-off between spinning threads takes no lock and no system call.
constexpr int kThreadBits = 16;

struct Pool {
  std::mutex mu;  // held only to sleep and to wake a sleeper
  std::condition_variable work_cv, done_cv;
  std::atomic<uint64_t> job{0};
  std::atomic<int> remaining{0};
  std::atomic<int> sleepers{0};
  std::atomic<bool> caller_sleeps{false};
  std::atomic<bool> failed{false};  // a job's function threw (out of memory): its caller raises
  PoolFn fn = nullptr;
  void* ctx = nullptr;
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
  pthread_setname_np(pthread_self(), "offload-host");  // how tests and `top -H` tell them apart
#endif
  uint64_t seen = 0;
  for (;;) {
    const auto changed = [&] { return p->job.load(std::memory_order_seq_cst) != seen; };
    if (!spin_until(changed)) {
      p->sleepers.fetch_add(1, std::memory_order_seq_cst);
      {
        std::unique_lock<std::mutex> lk(p->mu);
        p->work_cv.wait(lk, changed);
      }
      p->sleepers.fetch_sub(1, std::memory_order_relaxed);
    }
    seen = p->job.load(std::memory_order_acquire);
    const int n = int(seen & ((1u << kThreadBits) - 1));
    if (tid >= n) continue;
    try {
      p->fn(p->ctx, tid, n);
    } catch (...) {
      p->failed.store(true, std::memory_order_relaxed);
    }
    if (p->remaining.fetch_sub(1, std::memory_order_seq_cst) == 1 && p->caller_sleeps.load(std::memory_order_seq_cst)) {
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
  spin_us();  // a malformed ONNX_OFFLOAD_HOST_SPIN_US raises here, before any thread waits
  std::lock_guard<std::mutex> call(g_call_mu);
  Pool& p = pool_with(nthreads);
  p.fn = fn;
  p.ctx = ctx;
  p.failed.store(false, std::memory_order_relaxed);
  p.remaining.store(nthreads - 1, std::memory_order_relaxed);
  const uint64_t gen = (p.job.load(std::memory_order_relaxed) >> kThreadBits) + 1;
  p.job.store((gen << kThreadBits) | uint64_t(nthreads), std::memory_order_seq_cst);
  if (p.sleepers.load(std::memory_order_seq_cst) > 0) {
    std::lock_guard<std::mutex> lk(p.mu);
    p.work_cv.notify_all();
  }
  try {  // the caller takes part 0 while the workers start
    fn(ctx, 0, nthreads);
  } catch (...) {
    p.failed.store(true, std::memory_order_relaxed);
  }
  const auto done = [&] { return p.remaining.load(std::memory_order_seq_cst) == 0; };
  if (!spin_until(done)) {
    p.caller_sleeps.store(true, std::memory_order_seq_cst);
    {
      std::unique_lock<std::mutex> lk(p.mu);
      p.done_cv.wait(lk, done);
    }
    p.caller_sleeps.store(false, std::memory_order_relaxed);
  }
  if (p.failed.load(std::memory_order_relaxed)) throw std::bad_alloc();
}

int64_t pool_spin_us() { return spin_us(); }

void pool_set_spin_us(int64_t us) {
  if (us < 0 || us > kSpinMaxUs)
    throw std::invalid_argument("host pool: spin_us must be in [0, " + std::to_string(kSpinMaxUs) + "], got " +
                                std::to_string(us));
  g_spin_us.store(us, std::memory_order_relaxed);
}

int pool_sleeping() {
  std::lock_guard<std::mutex> call(g_call_mu);
  return g_pool ? g_pool->sleepers.load(std::memory_order_seq_cst) : 0;
}

int pool_workers() {
  std::lock_guard<std::mutex> call(g_call_mu);
  return g_pool ? g_pool->workers : 0;
}

}  // namespace offload::host
