// Physical backends behind one interface: the CUDA driver (VMM) and the host
// (memfd pages mapped into a PROT_NONE reservation). The arena sees only this.
//
// Public methods are non-virtual: they count calls and time once, here, and
// delegate to the backend's do_* implementation.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace offload {

class Stream {
 public:
  virtual ~Stream() = default;
  virtual uint64_t native() const = 0;  // CUstream, or the host stream's id
  virtual void synchronize() = 0;
  virtual bool is_capturing() = 0;  // false once closed
  // Finishes the queued work and ends the stream (the host worker thread, the CUstream);
  // idempotent. Later work on it is a StateError; events recorded on it stay valid.
  virtual void close() = 0;
  virtual bool closed() const = 0;
};

class Event {
 public:
  virtual ~Event() = default;
  virtual void record(Stream& s) = 0;
  virtual bool query() = 0;        // true once the work before the record has finished
  virtual void synchronize() = 0;  // host waits
  virtual void wait_on(Stream& s) = 0;  // s waits for this event, without the host waiting
  virtual float elapsed_ms(Event& start) = 0;
};

// One H2D copy added to a captured graph: `bytes` from pinned host memory at `src` to
// device memory at `dst`. It runs after the previous copy added in the same call and
// after the captured nodes `after`; the captured nodes `before` run after it.
struct GraphCopy {
  uint64_t dst = 0;
  uint64_t src = 0;
  uint64_t bytes = 0;
  std::vector<int> after, before;
};

// One host-computed MatMul added to a captured graph (host_matmul.h): a D2H copy of
// `x_bytes` at the device address `x_src` into pinned host memory at `x_host`, after the
// captured nodes `after` (those that write X); a host node running
// host_matmul_job_run(job), whose job reads x_host and writes y_host; and an H2D copy of
// `y_bytes` from y_host to the device address `y_dst`, which the captured nodes `before`
// (those that read Y) wait for. Jobs with the same (x_src, x_host, x_bytes) share one D2H
// copy. `owner` keeps the job, x_host and y_host valid: the graph holds it until it is
// destroyed.
struct GraphHostMatMul {
  uint64_t x_src = 0;
  uint64_t x_host = 0;
  uint64_t x_bytes = 0;
  uint64_t job = 0;  // HostMatmulJob*
  uint64_t y_host = 0;
  uint64_t y_dst = 0;
  uint64_t y_bytes = 0;
  std::vector<int> after, before;
  std::shared_ptr<const void> owner;
};

// A stream capture of device work (on CUDA, a CUgraph), which the package edits and
// replays as its own: it finds which captured nodes read given address ranges, adds
// copies with their dependency edges, and launches the result.
class DeviceGraph {
 public:
  virtual ~DeviceGraph() = default;
  virtual std::size_t nodes() const = 0;    // captured nodes, in a topological order
  virtual std::size_t kernels() const = 0;  // of which kernel launches
  // Nodes whose reads cannot be told (a kernel without readable parameters, a child
  // graph): a caller that needs every reader must not rely on readers() then.
  virtual std::size_t opaque() const = 0;
  // For each [lo, hi) range, the topological index of every captured node whose
  // parameters hold an address inside it.
  virtual std::vector<std::vector<int>> readers(const std::vector<std::pair<uint64_t, uint64_t>>& ranges) = 0;
  // What a node is, for a message: a kernel's name where the driver tells it, and for
  // each place in its parameters that holds an address in [lo, hi), the parameter's
  // index (-1: the launch's one packed buffer), its size and the byte offset inside it.
  virtual std::string kernel_name(int node) = 0;
  virtual std::vector<std::tuple<int, uint64_t, uint64_t>> address_in_params(int node, uint64_t lo, uint64_t hi) = 0;
  // A kernel node's parameter bytes as the graph holds them, one blob per parameter
  // (or the one packed buffer); empty for other nodes.
  virtual std::vector<std::string> param_bytes(int node) = 0;
  // Each copy after the one `in_flight` places before it: 1 makes a chain, one copy at a
  // time; 2 lets the next start while one ends, so no dependency hop idles the link.
  virtual void add_copies(const std::vector<GraphCopy>& copies, int in_flight) = 0;
  // Adds the host-computed MatMuls (GraphHostMatMul). Their host nodes run one after
  // another in the order given, which must be the graph's: every job's last `after` node
  // comes before its own and every later job's first `before` node (std::invalid_argument
  // otherwise, before anything is added). A driver failure part way leaves the graph
  // unusable: instantiate then raises StateError.
  virtual void add_host_matmuls(const std::vector<GraphHostMatMul>& jobs) = 0;
  virtual void instantiate(Stream& s) = 0;  // no edits after this; uploads on `s`
  virtual void launch(Stream& s) = 0;
  virtual uint64_t launches() const = 0;
};

// Driver-call counters: how many calls and how long they took (the binding reads this list too).
// host_waits counts the calls in which the host waits for device work: a stream's or an
// event's synchronize.
#define OFFLOAD_DRIVER_COUNTER_FIELDS(_)                                                   \
  _(creates) _(releases) _(maps) _(unmaps) _(set_access)                                  \
  _(create_ns) _(release_ns) _(map_ns) _(unmap_ns) _(set_access_ns)                       \
  _(plain_allocs) _(plain_frees) _(plain_alloc_ns) _(plain_free_ns)                       \
  _(host_waits) _(host_wait_ns)

// A copy of the counters at one moment.
struct DriverCounters {
#define OFFLOAD_FIELD(name) uint64_t name = 0;
  OFFLOAD_DRIVER_COUNTER_FIELDS(OFFLOAD_FIELD)
#undef OFFLOAD_FIELD
};

// The counters as they are kept: shared by a backend and the streams and events it makes,
// which may outlive it and count their own host waits here.
struct AtomicDriverCounters {
#define OFFLOAD_FIELD(name) std::atomic<uint64_t> name{0};
  OFFLOAD_DRIVER_COUNTER_FIELDS(OFFLOAD_FIELD)
#undef OFFLOAD_FIELD
};
using SharedCounters = std::shared_ptr<AtomicDriverCounters>;

// Runs `f` and, once it has returned, adds one to `calls` and its duration to `ns`.
template <typename F>
auto counted(std::atomic<uint64_t>& calls, std::atomic<uint64_t>& ns, F&& f) {
  auto t0 = std::chrono::steady_clock::now();
  auto result = f();
  ns += uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count());
  ++calls;
  return result;
}

// Runs `wait`, a host wait, and counts it in `c` once it has returned.
template <typename F>
void counted_wait(AtomicDriverCounters& c, F&& wait) {
  counted(c.host_waits, c.host_wait_ns, [&] { wait(); return 0; });
}

class PhysicalBackend {
 private:
  template <typename F>
  auto timed(std::atomic<uint64_t>& calls, std::atomic<uint64_t>& ns, F&& f) {
    maybe_fail(calls);
    return counted(calls, ns, std::forward<F>(f));
  }

 public:
  virtual ~PhysicalBackend() = default;
  virtual std::string name() const = 0;
  virtual int device() const = 0;
  virtual uint64_t granularity() const = 0;

  // Address space.
  virtual uint64_t reserve(uint64_t bytes) = 0;
  virtual void free_reservation(uint64_t va, uint64_t bytes) noexcept = 0;

  // Physical handles and mappings, counted and timed.
  uint64_t create(uint64_t bytes) { return timed(counters_->creates, counters_->create_ns, [&] { return do_create(bytes); }); }
  void release(uint64_t handle) { timed(counters_->releases, counters_->release_ns, [&] { do_release(handle); return 0; }); }
  void map(uint64_t va, uint64_t bytes, uint64_t handle) {
    timed(counters_->maps, counters_->map_ns, [&] { do_map(va, bytes, handle); return 0; });
  }
  void set_access(uint64_t va, uint64_t bytes) {
    timed(counters_->set_access, counters_->set_access_ns, [&] { do_set_access(va, bytes); return 0; });
  }
  void unmap(uint64_t va, uint64_t bytes) { timed(counters_->unmaps, counters_->unmap_ns, [&] { do_unmap(va, bytes); return 0; }); }
  // A physical handle in host memory (on CUDA, a VMM allocation of location HOST), which
  // maps like a device handle: a range of one reservation may hold device pages beside
  // host pages, which the device's kernels read over the link. Not the ledger's: it
  // commits no device memory. CudaUnavailable where the driver cannot make one.
  uint64_t create_host(uint64_t bytes) {
    return timed(counters_->creates, counters_->create_ns, [&] { return do_create_host(bytes); });
  }
  // Read and write access for the host and the device to a mapping of host handles (a
  // view the host fills and copies from).
  void set_host_access(uint64_t va, uint64_t bytes) {
    timed(counters_->set_access, counters_->set_access_ns, [&] { do_set_host_access(va, bytes); return 0; });
  }
  // Plain allocations (the cudaMalloc-per-page-in baseline), counted the same way.
  uint64_t plain_alloc(uint64_t bytes) {
    return timed(counters_->plain_allocs, counters_->plain_alloc_ns, [&] { return do_plain_alloc(bytes); });
  }
  void plain_free(uint64_t ptr, uint64_t bytes) {
    timed(counters_->plain_frees, counters_->plain_free_ns, [&] { do_plain_free(ptr, bytes); return 0; });
  }

  // Streams, events and copies.
  virtual std::shared_ptr<Stream> create_stream() = 0;
  virtual std::shared_ptr<Stream> wrap_stream(uint64_t native) = 0;  // not owned
  virtual std::shared_ptr<Event> create_event() = 0;
  virtual void copy_h2d(uint64_t dst, const void* src, uint64_t n, Stream& s) = 0;
  virtual void copy_d2h(void* dst, uint64_t src, uint64_t n, Stream& s) = 0;
  virtual void copy_d2d(uint64_t dst, uint64_t src, uint64_t n, Stream& s) = 0;
  virtual void fill(uint64_t dst, uint8_t value, uint64_t n, Stream& s) = 0;
  // `rows` rows of `width` bytes from src (rows `src_pitch` apart) to dst (rows
  // `dst_pitch` apart), device to device: one call for a strided block, such as one
  // position of every head of a KV cache.
  virtual void copy_d2d_2d(uint64_t dst, uint64_t dst_pitch, uint64_t src, uint64_t src_pitch, uint64_t width,
                           uint64_t rows, Stream& s) = 0;

  // Device graphs: a relaxed-mode capture of everything queued on `s` until the end.
  // Maps and unmaps stay out of the captured region (the arena's capture guard).
  virtual void begin_graph_capture(Stream& s);
  virtual std::shared_ptr<DeviceGraph> end_graph_capture(Stream& s);

  // Page-locks host memory for fast, asynchronous copies, and maps it for the device's
  // kernels to read in place (no-op on the host).
  virtual void host_register(void* p, uint64_t n) = 0;
  virtual void host_unregister(void* p) noexcept = 0;
  // The address at which the device's kernels read registered host memory `p` (on the
  // host backend, `p` itself).
  virtual uint64_t host_device_address(void* p) = 0;

  // (free, total) bytes of the device.
  virtual std::pair<uint64_t, uint64_t> mem_info() = 0;

  DriverCounters counters() const;

  // Fault injection for rollback tests: the `after`-th next call of `op` ("create",
  // "map", "set_access", "unmap", "release", "plain_alloc") throws instead of running;
  // with `out_of_memory`, the error the CUDA driver gives a full device; `times` calls
  // in a row fail.
  void inject_failure(const std::string& op, uint64_t after, bool out_of_memory = false, uint64_t times = 1);
  // Test hook: the stream sleeps `ms` before its next work, so that events recorded
  // after it stay pending for that long (a reader that is genuinely still running).
  virtual void enqueue_delay(Stream& s, uint32_t ms) = 0;

 protected:
  // For the streams and events a backend makes: they count their host waits here.
  const SharedCounters& shared_counters() const { return counters_; }
  virtual uint64_t do_create(uint64_t bytes) = 0;
  virtual void do_release(uint64_t handle) = 0;
  virtual void do_map(uint64_t va, uint64_t bytes, uint64_t handle) = 0;
  virtual void do_set_access(uint64_t va, uint64_t bytes) = 0;
  virtual void do_unmap(uint64_t va, uint64_t bytes) = 0;
  virtual uint64_t do_create_host(uint64_t bytes) = 0;
  virtual void do_set_host_access(uint64_t va, uint64_t bytes) = 0;
  virtual uint64_t do_plain_alloc(uint64_t bytes) = 0;
  virtual void do_plain_free(uint64_t ptr, uint64_t bytes) = 0;

 private:
  void maybe_fail(const std::atomic<uint64_t>& calls);
  SharedCounters counters_ = std::make_shared<AtomicDriverCounters>();
  std::atomic<const std::atomic<uint64_t>*> fail_op_{nullptr};
  std::atomic<bool> fail_oom_{false};
  std::atomic<uint64_t> fail_times_{0};
  std::atomic<uint64_t> fail_at_{0};
};

std::shared_ptr<PhysicalBackend> make_host_backend(uint64_t granularity);
std::shared_ptr<PhysicalBackend> make_cuda_backend(int device);

// Host-only: capture a host stream's work into a replayable graph.
class HostGraph {
 public:
  virtual ~HostGraph() = default;
  virtual void launch(Stream& s) = 0;
  virtual std::size_t size() const = 0;
};
void host_begin_capture(Stream& s);
std::shared_ptr<HostGraph> host_end_capture(Stream& s);

}  // namespace offload
