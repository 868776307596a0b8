// The host backend: the same semantics as CUDA VMM, on the CPU.
//
// A reservation is a PROT_NONE mapping. A physical handle is a memfd whose pages
// are allocated up front (fallocate), so that "committed" means committed. Mapping
// places the memfd over part of the reservation with MAP_FIXED|MAP_SHARED; access
// is granted separately (mprotect), as cuMemSetAccess does; unmapping puts a fresh
// PROT_NONE mapping back, so the address range stays reserved.
//
// Streams are worker threads that run their copies in order; events are fences.
// Reading an unmapped range faults, exactly like a kernel reading unmapped VMM memory.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/sysinfo.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include "backend.h"
#include "bookkeeping.h"
#include "errors.h"

namespace offload {
namespace {

[[noreturn]] void throw_errno(const char* what) {
  throw OffloadError(concat("host backend: ", what, " failed: ", std::strerror(errno)));
}

class Fence {
 public:
  void signal() {
    {
      std::lock_guard<std::mutex> g(mu_);
      done_ = true;
      at_ = std::chrono::steady_clock::now();
    }
    cv_.notify_all();
  }
  void wait() {
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait(l, [&] { return done_; });
  }
  bool done() {
    std::lock_guard<std::mutex> g(mu_);
    return done_;
  }
  std::chrono::steady_clock::time_point at() {
    wait();
    std::lock_guard<std::mutex> g(mu_);
    return at_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::chrono::steady_clock::time_point at_{};
};

using Task = std::function<void()>;

// Locking: close_mu_ serializes close() (it is held across the join), then mu_
// guards the queue; a task never takes either, so the join cannot wait on itself.
class HostStream : public Stream {
 public:
  HostStream(uint64_t id, SharedCounters counters)
      : id_(id), counters_(std::move(counters)), worker_([this] { run(); }) {}
  ~HostStream() override {
    try {
      close();
    } catch (const std::exception& e) {
      warn(concat("closing host stream ", id_, " failed: ", e.what()));
    }
  }
  uint64_t native() const override { return id_; }
  void enqueue(Task t) {
    {
      std::lock_guard<std::mutex> g(mu_);
      require_open_locked();
      if (capturing_) {
        captured_.push_back(std::move(t));
        return;
      }
      queue_.push_back(std::move(t));
    }
    cv_.notify_all();
  }
  void synchronize() override {
    auto f = std::make_shared<Fence>();
    enqueue([f] { f->signal(); });
    counted_wait(*counters_, [&] { f->wait(); });
  }
  bool is_capturing() override {
    std::lock_guard<std::mutex> g(mu_);
    return capturing_;
  }
  void begin_capture() {
    std::lock_guard<std::mutex> g(mu_);
    require_open_locked();
    if (capturing_) throw StateError("host stream is already capturing");
    capturing_ = true;
    captured_.clear();
  }
  std::vector<Task> end_capture() {
    std::lock_guard<std::mutex> g(mu_);
    require_open_locked();
    if (!capturing_) throw StateError("host stream is not capturing");
    capturing_ = false;
    return std::move(captured_);
  }
  // Runs what is queued, then joins the worker. An open capture is abandoned: its work
  // was never queued. In a process forked after the stream was made, the worker (and
  // whoever held the locks at the fork) does not exist: the stream is only let go.
  void close() override {
    if (getpid() != pid_) {
      if (worker_.joinable()) worker_.detach();
      return;
    }
    if (std::this_thread::get_id() == worker_.get_id())
      throw StateError(concat("host stream ", id_, " cannot be closed by its own work"));
    std::lock_guard<std::mutex> closing(close_mu_);
    {
      std::lock_guard<std::mutex> g(mu_);
      if (stop_) return;
      stop_ = true;
      capturing_ = false;
      captured_.clear();
    }
    cv_.notify_all();
    worker_.join();
  }
  bool closed() const override {
    std::lock_guard<std::mutex> g(mu_);
    return stop_;
  }

 private:
  void require_open_locked() const {
    if (stop_) throw StateError(concat("host stream ", id_, " is closed"));
  }
  void run() {
    for (;;) {
      Task t;
      {
        std::unique_lock<std::mutex> l(mu_);
        cv_.wait(l, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopped and drained
        t = std::move(queue_.front());
        queue_.pop_front();
      }
      t();
    }
  }
  uint64_t id_;
  SharedCounters counters_;
  pid_t pid_ = getpid();  // the process whose thread the worker is
  std::mutex close_mu_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> queue_;
  bool stop_ = false;
  bool capturing_ = false;
  std::vector<Task> captured_;
  std::thread worker_;  // last: starts after the members it uses
};

HostStream& as_host(Stream& s) {
  auto* h = dynamic_cast<HostStream*>(&s);
  if (h == nullptr) throw std::invalid_argument("the host backend was given a stream of another backend");
  return *h;
}

class HostEvent : public Event {
 public:
  explicit HostEvent(SharedCounters counters) : counters_(std::move(counters)) {
    fence_->signal();  // like a CUDA event never recorded: complete
  }
  void record(Stream& s) override {
    auto f = std::make_shared<Fence>();
    as_host(s).enqueue([f] { f->signal(); });  // first: a refused record leaves the event as it was
    std::lock_guard<std::mutex> g(mu_);
    fence_ = f;
  }
  bool query() override { return current()->done(); }
  void synchronize() override {
    auto f = current();
    counted_wait(*counters_, [&] { f->wait(); });
  }
  void wait_on(Stream& s) override {
    auto f = current();
    as_host(s).enqueue([f] { f->wait(); });
  }
  float elapsed_ms(Event& start) override {
    auto* other = dynamic_cast<HostEvent*>(&start);
    if (other == nullptr) throw std::invalid_argument("elapsed_ms across backends");
    auto dt = current()->at() - other->current()->at();
    return std::chrono::duration<float, std::milli>(dt).count();
  }

 private:
  std::shared_ptr<Fence> current() {
    std::lock_guard<std::mutex> g(mu_);
    return fence_;
  }
  SharedCounters counters_;
  std::mutex mu_;
  std::shared_ptr<Fence> fence_ = std::make_shared<Fence>();
};

class HostGraphImpl : public HostGraph {
 public:
  explicit HostGraphImpl(std::vector<Task> tasks) : tasks_(std::move(tasks)) {}
  void launch(Stream& s) override {
    HostStream& hs = as_host(s);
    for (const Task& t : tasks_) hs.enqueue(t);
  }
  std::size_t size() const override { return tasks_.size(); }

 private:
  std::vector<Task> tasks_;
};

// A line of /proc/meminfo in KiB ("MemAvailable:"), 0 when it is absent.
uint64_t meminfo_kib(const char* key) {
  std::FILE* f = std::fopen("/proc/meminfo", "r");
  if (f == nullptr) return 0;
  char line[256];
  uint64_t value = 0;
  const std::size_t n = std::strlen(key);
  while (std::fgets(line, sizeof line, f) != nullptr) {
    if (std::strncmp(line, key, n) == 0) {
      value = std::strtoull(line + n, nullptr, 10);
      break;
    }
  }
  std::fclose(f);
  return value;
}

class HostBackend : public PhysicalBackend {
 public:
  explicit HostBackend(uint64_t granularity) : gran_(granularity) {
    const uint64_t page = uint64_t(sysconf(_SC_PAGESIZE));
    if (!is_pow2(granularity) || granularity % page != 0)
      throw std::invalid_argument(concat("host granularity ", granularity,
                                         " must be a power of two and a multiple of the page size ", page));
  }
  std::string name() const override { return "host"; }
  int device() const override { return -1; }
  uint64_t granularity() const override { return gran_; }

  uint64_t reserve(uint64_t bytes) override {
    bytes = round_up(bytes, gran_);
    const uint64_t total = bytes + gran_;
    void* p = mmap(nullptr, total, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) throw_errno("reserving address space (mmap PROT_NONE)");
    const uint64_t start = uint64_t(p), aligned = round_up(start, gran_);
    if (aligned > start) munmap(p, aligned - start);
    const uint64_t tail = start + total - (aligned + bytes);
    if (tail > 0) munmap(reinterpret_cast<void*>(aligned + bytes), tail);
    return aligned;
  }
  void free_reservation(uint64_t va, uint64_t bytes) noexcept override {
    munmap(reinterpret_cast<void*>(va), round_up(bytes, gran_));
  }

  // A stream dropped in a forked child is never destroyed: its condition variable still
  // counts the parent's worker as a waiter, and destroying it would wait for that thread.
  std::shared_ptr<Stream> create_stream() override {
    const pid_t pid = getpid();
    return std::shared_ptr<HostStream>(new HostStream(++next_stream_, shared_counters()), [pid](HostStream* s) {
      if (getpid() == pid) delete s;
    });
  }
  std::shared_ptr<Stream> wrap_stream(uint64_t) override {
    throw std::invalid_argument("the host backend has no foreign streams to wrap");
  }
  std::shared_ptr<Event> create_event() override { return std::make_shared<HostEvent>(shared_counters()); }
  void copy_h2d(uint64_t dst, const void* src, uint64_t n, Stream& s) override {
    as_host(s).enqueue([=] { std::memcpy(reinterpret_cast<void*>(dst), src, n); });
  }
  void copy_d2h(void* dst, uint64_t src, uint64_t n, Stream& s) override {
    as_host(s).enqueue([=] { std::memcpy(dst, reinterpret_cast<const void*>(src), n); });
  }
  void copy_d2d(uint64_t dst, uint64_t src, uint64_t n, Stream& s) override {
    as_host(s).enqueue([=] { std::memmove(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), n); });
  }
  void copy_d2d_2d(uint64_t dst, uint64_t dst_pitch, uint64_t src, uint64_t src_pitch, uint64_t width,
                   uint64_t rows, Stream& s) override {
    as_host(s).enqueue([=] {
      for (uint64_t r = 0; r < rows; ++r)
        std::memmove(reinterpret_cast<void*>(dst + r * dst_pitch), reinterpret_cast<const void*>(src + r * src_pitch),
                     width);
    });
  }
  void fill(uint64_t dst, uint8_t value, uint64_t n, Stream& s) override {
    as_host(s).enqueue([=] { std::memset(reinterpret_cast<void*>(dst), value, n); });
  }
  void enqueue_delay(Stream& s, uint32_t ms) override {
    as_host(s).enqueue([ms] { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); });
  }
  void host_register(void*, uint64_t) override {}
  void host_unregister(void*) noexcept override {}
  uint64_t host_device_address(void* p) override { return uint64_t(reinterpret_cast<uintptr_t>(p)); }
  // Free memory as the kernel reports it available (MemAvailable: free pages plus the
  // page cache and slabs it can reclaim), as a GPU's free memory is what an allocation
  // can still get; "auto" and fractions then mean the same on both.
  std::pair<uint64_t, uint64_t> mem_info() override {
    struct sysinfo si {};
    if (sysinfo(&si) != 0) throw_errno("sysinfo");
    const uint64_t total = uint64_t(si.totalram) * si.mem_unit;
    uint64_t avail = meminfo_kib("MemAvailable:") * 1024;
    if (avail == 0) avail = uint64_t(si.freeram + si.bufferram) * si.mem_unit;  // kernels before 3.14
    return {std::min(avail, total), total};
  }

 protected:
  uint64_t do_create(uint64_t bytes) override {
    if (bytes == 0 || bytes % gran_ != 0)
      throw std::invalid_argument(concat("handle size ", bytes, " is not a multiple of the granularity ", gran_));
    int fd = memfd_create("onnx-offload", MFD_CLOEXEC);
    if (fd < 0) throw_errno("memfd_create");
    if (ftruncate(fd, off_t(bytes)) != 0 || fallocate(fd, 0, 0, off_t(bytes)) != 0) {
      int saved = errno;
      close(fd);
      errno = saved;
      throw_errno(concat("committing ", bytes, " bytes (memfd fallocate)").c_str());
    }
    return uint64_t(fd);
  }
  void do_release(uint64_t handle) override {
    if (close(int(handle)) != 0) throw_errno("close(memfd)");
  }
  void do_map(uint64_t va, uint64_t bytes, uint64_t handle) override {
    void* p = mmap(reinterpret_cast<void*>(va), bytes, PROT_NONE, MAP_SHARED | MAP_FIXED, int(handle), 0);
    if (p == MAP_FAILED) throw_errno("mmap(MAP_FIXED|MAP_SHARED)");
  }
  void do_set_access(uint64_t va, uint64_t bytes) override {
    if (mprotect(reinterpret_cast<void*>(va), bytes, PROT_READ | PROT_WRITE) != 0) throw_errno("mprotect");
  }
  void do_unmap(uint64_t va, uint64_t bytes) override {
    void* p = mmap(reinterpret_cast<void*>(va), bytes, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) throw_errno("mmap(PROT_NONE) over a mapping");
  }
  // The host is the device here: a host handle is a memfd like any other, which the
  // ledger does not count.
  uint64_t do_create_host(uint64_t bytes) override { return do_create(bytes); }
  void do_set_host_access(uint64_t va, uint64_t bytes) override { do_set_access(va, bytes); }
  uint64_t do_plain_alloc(uint64_t bytes) override {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (p == MAP_FAILED) throw_errno("mmap(plain allocation)");
    return uint64_t(p);
  }
  void do_plain_free(uint64_t ptr, uint64_t bytes) override {
    if (munmap(reinterpret_cast<void*>(ptr), bytes) != 0) throw_errno("munmap(plain allocation)");
  }

 private:
  uint64_t gran_;
  std::atomic<uint64_t> next_stream_{0};
};

}  // namespace

std::shared_ptr<PhysicalBackend> make_host_backend(uint64_t granularity) {
  return std::make_shared<HostBackend>(granularity);
}

void host_begin_capture(Stream& s) { as_host(s).begin_capture(); }

std::shared_ptr<HostGraph> host_end_capture(Stream& s) {
  return std::make_shared<HostGraphImpl>(as_host(s).end_capture());
}

}  // namespace offload
