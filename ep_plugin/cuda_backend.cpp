// The CUDA backend: VMM through the driver table. The primary context of the
// device is retained explicitly for the backend's life and made current on the
// calling thread before each driver call, since ORT and Python call in from
// threads of their own.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <mutex>
#include <queue>
#include <stdexcept>
#include <thread>
#include <tuple>
#include <unordered_map>

#include "backend.h"
#include "bookkeeping.h"
#include "driver_api.h"

namespace offload {
namespace {

// The device's primary context, retained for as long as anything made in it lives:
// the backend, and every stream and event, each hold a reference.
class PrimaryContext {
 public:
  explicit PrimaryContext(CUdevice dev) : dev_(dev) { CU_CHECK(DRV(cuDevicePrimaryCtxRetain)(&ctx_, dev_)); }
  ~PrimaryContext() { CU_WARN(DRV(cuDevicePrimaryCtxRelease)(dev_)); }
  PrimaryContext(const PrimaryContext&) = delete;
  PrimaryContext& operator=(const PrimaryContext&) = delete;
  CUcontext get() const { return ctx_; }
  void make_current() const { CU_CHECK(DRV(cuCtxSetCurrent)(ctx_)); }

 private:
  CUdevice dev_;
  CUcontext ctx_ = nullptr;
};
using ContextRef = std::shared_ptr<const PrimaryContext>;

// close() synchronizes, then destroys an owned CUstream; a wrapped one is only
// forgotten. ORT sessions given the stream as user_compute_stream must be gone by then.
class CudaStream : public Stream {
 public:
  CudaStream(ContextRef ctx, CUstream s, bool owned, SharedCounters counters)
      : ctx_(std::move(ctx)), s_(s), owned_(owned), counters_(std::move(counters)) {}
  ~CudaStream() override {
    if (owned_ && s_ != nullptr) {
      CU_WARN(DRV(cuCtxSetCurrent)(ctx_->get()));
      CU_WARN(DRV(cuStreamDestroy)(s_));
    }
  }
  uint64_t native() const override { return uint64_t(reinterpret_cast<uintptr_t>(s_)); }
  CUstream get() const {
    if (closed_) throw StateError(concat("CUDA stream ", hex(native()), " is closed"));
    return s_;
  }
  void synchronize() override {
    CUstream s = get();
    ctx_->make_current();
    counted_wait(*counters_, [&] { CU_CHECK(DRV(cuStreamSynchronize)(s)); });
  }
  bool is_capturing() override {
    if (closed_) return false;
    ctx_->make_current();
    CUstreamCaptureStatus st = CU_STREAM_CAPTURE_STATUS_NONE;
    CU_CHECK(DRV(cuStreamIsCapturing)(s_, &st));
    return st != CU_STREAM_CAPTURE_STATUS_NONE;
  }
  void close() override {
    std::lock_guard<std::mutex> g(close_mu_);
    if (closed_) return;
    ctx_->make_current();
    CU_CHECK(DRV(cuStreamSynchronize)(s_));
    closed_ = true;
    if (owned_) {
      CU_WARN(DRV(cuStreamDestroy)(s_));
      owned_ = false;
    }
  }
  bool closed() const override { return closed_; }

 private:
  ContextRef ctx_;
  CUstream s_;
  bool owned_;
  SharedCounters counters_;
  std::mutex close_mu_;
  std::atomic<bool> closed_{false};
};

CUstream raw(Stream& s) {
  auto* c = dynamic_cast<CudaStream*>(&s);
  if (c == nullptr) throw std::invalid_argument("the CUDA backend was given a stream of another backend");
  return c->get();
}

class CudaEvent : public Event {
 public:
  CudaEvent(ContextRef ctx, SharedCounters counters) : ctx_(std::move(ctx)), counters_(std::move(counters)) {
    ctx_->make_current();
    CU_CHECK(DRV(cuEventCreate)(&e_, CU_EVENT_DEFAULT));
  }
  ~CudaEvent() override {
    CU_WARN(DRV(cuCtxSetCurrent)(ctx_->get()));
    CU_WARN(DRV(cuEventDestroy)(e_));
  }
  void record(Stream& s) override {
    ctx_->make_current();
    CU_CHECK(DRV(cuEventRecord)(e_, raw(s)));
  }
  bool query() override {
    ctx_->make_current();
    CUresult r = DRV(cuEventQuery)(e_);
    if (r == CUDA_ERROR_NOT_READY) return false;
    CU_CHECK(r);
    return true;
  }
  void synchronize() override {
    ctx_->make_current();
    counted_wait(*counters_, [&] { CU_CHECK(DRV(cuEventSynchronize)(e_)); });
  }
  void wait_on(Stream& s) override {
    ctx_->make_current();
    CU_CHECK(DRV(cuStreamWaitEvent)(raw(s), e_, 0));
  }
  float elapsed_ms(Event& start) override {
    auto* other = dynamic_cast<CudaEvent*>(&start);
    if (other == nullptr) throw std::invalid_argument("elapsed_ms across backends");
    float ms = 0;
    ctx_->make_current();
    CU_CHECK(DRV(cuEventElapsedTime)(&ms, other->e_, e_));
    return ms;
  }

 private:
  ContextRef ctx_;
  SharedCounters counters_;
  CUevent e_ = nullptr;
};

// A captured CUgraph, edited and replayed by the package.
class CudaGraph : public DeviceGraph {
 public:
  CudaGraph(ContextRef ctx, CUgraph g) : ctx_(std::move(ctx)), g_(g) {
    ctx_->make_current();
    size_t n = 0;
    CU_CHECK(DRV(cuGraphGetNodes)(g_, nullptr, &n));
    std::vector<CUgraphNode> nodes(n);
    if (n) CU_CHECK(DRV(cuGraphGetNodes)(g_, nodes.data(), &n));
    size_t e = 0;
    CU_CHECK(DRV(cuGraphGetEdges)(g_, nullptr, nullptr, nullptr, &e));
    std::vector<CUgraphNode> from(e), to(e);
    std::vector<CUgraphEdgeData> data(e);  // edges may carry data (programmatic launches): asked for, or the query fails
    if (e) CU_CHECK(DRV(cuGraphGetEdges)(g_, from.data(), to.data(), data.data(), &e));
    // Kahn's algorithm, ties broken by the driver's node order (creation order).
    std::unordered_map<CUgraphNode, size_t> index;
    for (size_t i = 0; i < n; ++i) index[nodes[i]] = i;
    std::vector<std::vector<size_t>> out(n);
    std::vector<size_t> indegree(n, 0);
    for (size_t i = 0; i < e; ++i) {
      out[index.at(from[i])].push_back(index.at(to[i]));
      ++indegree[index.at(to[i])];
    }
    std::priority_queue<size_t, std::vector<size_t>, std::greater<size_t>> ready;  // the earliest node first
    for (size_t i = 0; i < n; ++i)
      if (indegree[i] == 0) ready.push(i);
    while (!ready.empty()) {
      size_t i = ready.top();
      ready.pop();
      order_.push_back(nodes[i]);
      for (size_t j : out[i])
        if (--indegree[j] == 0) ready.push(j);
    }
    if (order_.size() != n) throw StateError("the captured graph has a cycle");
    for (CUgraphNode node : order_) {
      CUgraphNodeType t;
      CU_CHECK(DRV(cuGraphNodeGetType)(node, &t));
      types_.push_back(t);
      if (t == CU_GRAPH_NODE_TYPE_KERNEL) ++kernels_;
    }
  }
  ~CudaGraph() override {
    CU_WARN(DRV(cuCtxSetCurrent)(ctx_->get()));
    if (exec_ != nullptr) CU_WARN(DRV(cuGraphExecDestroy)(exec_));
    CU_WARN(DRV(cuGraphDestroy)(g_));
  }

  std::size_t nodes() const override { return order_.size(); }
  std::size_t kernels() const override { return kernels_; }
  std::size_t opaque() const override { return opaque_; }
  uint64_t launches() const override { return launches_; }

  std::vector<std::vector<int>> readers(const std::vector<std::pair<uint64_t, uint64_t>>& ranges) override {
    ctx_->make_current();
    std::vector<std::tuple<uint64_t, uint64_t, int>> sorted;
    for (size_t i = 0; i < ranges.size(); ++i) sorted.emplace_back(ranges[i].first, ranges[i].second, int(i));
    std::sort(sorted.begin(), sorted.end());
    std::vector<std::vector<int>> found(ranges.size());
    opaque_ = 0;
    for (size_t k = 0; k < order_.size(); ++k) {
      std::vector<int> hit;
      bool readable = words(order_[k], types_[k], [&](int, size_t, size_t, uint64_t w) {
        auto it = std::upper_bound(sorted.begin(), sorted.end(), std::make_tuple(w, UINT64_MAX, INT32_MAX));
        if (it == sorted.begin()) return;
        --it;
        if (w >= std::get<0>(*it) && w < std::get<1>(*it)) hit.push_back(std::get<2>(*it));
      });
      if (!readable) ++opaque_;
      std::sort(hit.begin(), hit.end());
      hit.erase(std::unique(hit.begin(), hit.end()), hit.end());
      for (int r : hit) found[size_t(r)].push_back(int(k));
    }
    return found;
  }

  std::string kernel_name(int node) override {
    ctx_->make_current();
    CUgraphNode n = node_at(node);
    const CUgraphNodeType t = types_[size_t(node)];
    if (t != CU_GRAPH_NODE_TYPE_KERNEL) return concat("(node type ", int(t), ")");
    CUDA_KERNEL_NODE_PARAMS p{};
    CU_CHECK(DRV(cuGraphKernelNodeGetParams)(n, &p));
    const char* name = nullptr;
    const DriverApi& d = driver();
    if (p.func != nullptr && d.cuFuncGetName_ != nullptr) d.cuFuncGetName_(&name, p.func);
    if (p.func == nullptr && p.kern != nullptr && d.cuKernelGetName_ != nullptr) d.cuKernelGetName_(&name, p.kern);
    return name != nullptr ? std::string(name) : std::string("(kernel name unknown)");
  }

  std::vector<std::tuple<int, uint64_t, uint64_t>> address_in_params(int node, uint64_t lo, uint64_t hi) override {
    ctx_->make_current();
    std::vector<std::tuple<int, uint64_t, uint64_t>> found;
    CUgraphNode n = node_at(node);
    words(n, types_[size_t(node)], [&](int param, size_t size, size_t offset, uint64_t w) {
      if (param >= -1 && w >= lo && w < hi) found.emplace_back(param, uint64_t(size), uint64_t(offset));
    });
    return found;
  }

  std::vector<std::string> param_bytes(int node) override {
    ctx_->make_current();
    std::vector<std::string> out;
    CUgraphNode n = node_at(node);
    if (types_[size_t(node)] != CU_GRAPH_NODE_TYPE_KERNEL) return out;
    kernel_params(n, [&](int, const void* data, size_t size) {
      out.emplace_back(static_cast<const char*>(data), size);
    });
    return out;
  }

  void add_copies(const std::vector<GraphCopy>& copies) override {
    if (exec_ != nullptr) throw StateError("the graph is instantiated: no more edits");
    ctx_->make_current();
    CUgraphNode prev = nullptr;
    for (const GraphCopy& c : copies) {
      std::vector<CUgraphNode> deps;
      if (prev != nullptr) deps.push_back(prev);
      for (int i : c.after) deps.push_back(node_at(i));
      CUDA_MEMCPY3D p{};
      p.srcMemoryType = CU_MEMORYTYPE_HOST;
      p.srcHost = reinterpret_cast<const void*>(uintptr_t(c.src));
      p.srcPitch = c.bytes;
      p.srcHeight = 1;
      p.dstMemoryType = CU_MEMORYTYPE_DEVICE;
      p.dstDevice = CUdeviceptr(c.dst);
      p.dstPitch = c.bytes;
      p.dstHeight = 1;
      p.WidthInBytes = c.bytes;
      p.Height = 1;
      p.Depth = 1;
      CUgraphNode node = nullptr;
      CU_CHECK(DRV(cuGraphAddMemcpyNode)(&node, g_, deps.data(), deps.size(), &p, ctx_->get()));
      for (int i : c.before) {
        CUgraphNode to = node_at(i);
        CU_CHECK(DRV(cuGraphAddDependencies)(g_, &node, &to, nullptr, 1));
      }
      prev = node;
    }
  }

  void instantiate(Stream& s) override {
    if (exec_ != nullptr) return;
    ctx_->make_current();
    CU_CHECK(DRV(cuGraphInstantiateWithFlags)(&exec_, g_, 0));
    CU_CHECK(DRV(cuGraphUpload)(exec_, raw(s)));
  }

  void launch(Stream& s) override {
    if (exec_ == nullptr) throw StateError("the graph is not instantiated");
    ctx_->make_current();
    CU_CHECK(DRV(cuGraphLaunch)(exec_, raw(s)));
    ++launches_;
  }

 private:
  CUgraphNode node_at(int i) const {
    if (i < 0 || size_t(i) >= order_.size()) throw std::out_of_range(concat("graph node ", i, " of ", order_.size()));
    return order_[size_t(i)];
  }

  // Calls f(index, data, size) for each parameter blob of a kernel node: every
  // parameter where the driver gives the layout, else the one packed buffer the launch
  // passed (index -1 then). False when neither is readable.
  template <class F>
  static bool kernel_params(CUgraphNode node, F&& f) {
    CUDA_KERNEL_NODE_PARAMS p{};
    CU_CHECK(DRV(cuGraphKernelNodeGetParams)(node, &p));
    if (p.kernelParams != nullptr && (p.func != nullptr || p.kern != nullptr)) {
      for (size_t i = 0;; ++i) {
        size_t offset = 0, size = 0;
        CUresult r = p.func != nullptr ? DRV(cuFuncGetParamInfo)(p.func, i, &offset, &size)
                                       : DRV(cuKernelGetParamInfo)(p.kern, i, &offset, &size);
        if (r == CUDA_ERROR_INVALID_VALUE) break;  // past the last parameter
        CU_CHECK(r);
        if (p.kernelParams[i] != nullptr) f(int(i), p.kernelParams[i], size);
      }
      return true;
    }
    if (p.extra != nullptr) {
      const void* buffer = nullptr;
      size_t size = 0;
      for (void** e = p.extra; *e != CU_LAUNCH_PARAM_END; e += 2) {
        if (*e == CU_LAUNCH_PARAM_BUFFER_POINTER) buffer = e[1];
        if (*e == CU_LAUNCH_PARAM_BUFFER_SIZE) size = *static_cast<size_t*>(e[1]);
      }
      if (buffer != nullptr) {
        f(-1, buffer, size);
        return true;
      }
    }
    return false;
  }

  // Calls f(param, size, offset, word) for every word of a node's parameters that may
  // be an address: each 8-byte-aligned word of a kernel's parameters (a device
  // address is 8-aligned in the parameter layout, as ld.param.u64 needs; a window at
  // 4 would join two 32-bit fields into a false address), and the device addresses of
  // a copy or a set (param -2). False when the node may read memory its parameters
  // do not show.
  template <class F>
  static bool words(CUgraphNode node, CUgraphNodeType t, F&& f) {
    switch (t) {
      case CU_GRAPH_NODE_TYPE_KERNEL:
        return kernel_params(node, [&](int param, const void* data, size_t size) {
          const auto* bytes = static_cast<const unsigned char*>(data);
          for (size_t o = 0; o + 8 <= size; o += 8) {
            uint64_t w;
            std::memcpy(&w, bytes + o, 8);
            f(param, size, o, w);
          }
        });
      case CU_GRAPH_NODE_TYPE_MEMCPY: {
        CUDA_MEMCPY3D p{};
        CU_CHECK(DRV(cuGraphMemcpyNodeGetParams)(node, &p));
        f(-2, 0, 0, uint64_t(p.srcDevice));
        f(-2, 0, 0, uint64_t(p.dstDevice));
        f(-2, 0, 0, uint64_t(reinterpret_cast<uintptr_t>(p.srcHost)));
        return true;
      }
      case CU_GRAPH_NODE_TYPE_MEMSET: {
        CUDA_MEMSET_NODE_PARAMS p{};
        CU_CHECK(DRV(cuGraphMemsetNodeGetParams)(node, &p));
        f(-2, 0, 0, uint64_t(p.dst));
        return true;
      }
      case CU_GRAPH_NODE_TYPE_GRAPH:
      case CU_GRAPH_NODE_TYPE_HOST:
        return false;
      default:  // events, waits, empty nodes: no memory
        return true;
    }
  }

  ContextRef ctx_;
  CUgraph g_;
  CUgraphExec exec_ = nullptr;
  std::vector<CUgraphNode> order_;
  std::vector<CUgraphNodeType> types_;
  std::size_t kernels_ = 0, opaque_ = 0;
  std::atomic<uint64_t> launches_{0};
};

void CUDA_CB sleep_ms(void* ms) { std::this_thread::sleep_for(std::chrono::milliseconds(uintptr_t(ms))); }

// Where the next address reservation is asked for (see CudaBackend::reserve).
std::atomic<uint64_t> next_reservation_hint{0x6b5a00000000ull};

class CudaBackend : public PhysicalBackend {
 public:
  explicit CudaBackend(int device) : device_(device) {
    const DriverApi& d = driver();  // throws CudaUnavailable with the reason
    int count = 0;
    CU_CHECK(d.cuDeviceGetCount_(&count));
    if (device < 0 || device >= count)
      throw CudaUnavailable(concat("CUDA device ", device, " does not exist (", count, " visible)"));
    CU_CHECK(d.cuDeviceGet_(&dev_, device));
    ctx_ = std::make_shared<const PrimaryContext>(dev_);
    current();
    prop_.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop_.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop_.location.id = device;
    size_t g = 0;
    CU_CHECK(d.cuMemGetAllocationGranularity_(&g, &prop_, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
    gran_ = g;
    access_.location = prop_.location;
    access_.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  }

  std::string name() const override { return "cuda"; }
  int device() const override { return device_; }
  uint64_t granularity() const override { return gran_; }

  uint64_t reserve(uint64_t bytes) override {
    current();
    CUdeviceptr p = 0;
    const uint64_t size = round_up(bytes, gran_);
    // Asked for high in the address space, where an address's upper 32 bits are a
    // number no parameter struct is likely to hold: the graph engine reads captured
    // kernels' parameters for addresses, and a small-valued range (0x3'xxxx'xxxx) is
    // matched by any pair of 32-bit fields whose second is 3. The driver may place the
    // range elsewhere; any place is correct.
    const uint64_t hint = next_reservation_hint.fetch_add(round_up(size, uint64_t(1) << 30));
    if (DRV(cuMemAddressReserve)(&p, size, gran_, CUdeviceptr(hint), 0) != CUDA_SUCCESS || p == 0)
      CU_CHECK(DRV(cuMemAddressReserve)(&p, size, gran_, 0, 0));
    return uint64_t(p);
  }
  void free_reservation(uint64_t va, uint64_t bytes) noexcept override {
    CU_WARN(DRV(cuCtxSetCurrent)(ctx_->get()));
    CU_WARN(DRV(cuMemAddressFree)(CUdeviceptr(va), round_up(bytes, gran_)));
  }

  std::shared_ptr<Stream> create_stream() override {
    current();
    CUstream s = nullptr;
    CU_CHECK(DRV(cuStreamCreate)(&s, CU_STREAM_NON_BLOCKING));
    return std::make_shared<CudaStream>(ctx_, s, true, shared_counters());
  }
  std::shared_ptr<Stream> wrap_stream(uint64_t native) override {
    return std::make_shared<CudaStream>(ctx_, reinterpret_cast<CUstream>(uintptr_t(native)), false, shared_counters());
  }
  std::shared_ptr<Event> create_event() override { return std::make_shared<CudaEvent>(ctx_, shared_counters()); }
  void copy_h2d(uint64_t dst, const void* src, uint64_t n, Stream& s) override {
    current();
    CU_CHECK(DRV(cuMemcpyHtoDAsync)(CUdeviceptr(dst), src, n, raw(s)));
  }
  void copy_d2h(void* dst, uint64_t src, uint64_t n, Stream& s) override {
    current();
    CU_CHECK(DRV(cuMemcpyDtoHAsync)(dst, CUdeviceptr(src), n, raw(s)));
  }
  void copy_d2d(uint64_t dst, uint64_t src, uint64_t n, Stream& s) override {
    current();
    CU_CHECK(DRV(cuMemcpyDtoDAsync)(CUdeviceptr(dst), CUdeviceptr(src), n, raw(s)));
  }
  void copy_d2d_2d(uint64_t dst, uint64_t dst_pitch, uint64_t src, uint64_t src_pitch, uint64_t width,
                   uint64_t rows, Stream& s) override {
    if (width == 0 || rows == 0) return;
    current();
    CUDA_MEMCPY2D c{};
    c.srcMemoryType = CU_MEMORYTYPE_DEVICE;
    c.srcDevice = CUdeviceptr(src);
    c.srcPitch = src_pitch;
    c.dstMemoryType = CU_MEMORYTYPE_DEVICE;
    c.dstDevice = CUdeviceptr(dst);
    c.dstPitch = dst_pitch;
    c.WidthInBytes = width;
    c.Height = rows;
    CU_CHECK(DRV(cuMemcpy2DAsync)(&c, raw(s)));
  }
  void fill(uint64_t dst, uint8_t value, uint64_t n, Stream& s) override {
    current();
    CU_CHECK(DRV(cuMemsetD8Async)(CUdeviceptr(dst), value, n, raw(s)));
  }
  void enqueue_delay(Stream& s, uint32_t ms) override {
    current();
    // A host function on the stream: the work queued after it waits until it returns.
    CU_CHECK(DRV(cuLaunchHostFunc)(raw(s), &sleep_ms, reinterpret_cast<void*>(uintptr_t(ms))));
  }
  void begin_graph_capture(Stream& s) override {
    current();
    CU_CHECK(DRV(cuStreamBeginCapture)(raw(s), CU_STREAM_CAPTURE_MODE_RELAXED));
  }
  std::shared_ptr<DeviceGraph> end_graph_capture(Stream& s) override {
    current();
    CUgraph g = nullptr;
    CU_CHECK(DRV(cuStreamEndCapture)(raw(s), &g));
    try {
      return std::make_shared<CudaGraph>(ctx_, g);
    } catch (...) {
      CU_WARN(DRV(cuGraphDestroy)(g));
      throw;
    }
  }
  void host_register(void* p, uint64_t n) override {
    current();
    CU_CHECK(DRV(cuMemHostRegister)(p, n, CU_MEMHOSTREGISTER_PORTABLE));
  }
  void host_unregister(void* p) noexcept override {
    CU_WARN(DRV(cuCtxSetCurrent)(ctx_->get()));
    CU_WARN(DRV(cuMemHostUnregister)(p));
  }
  std::pair<uint64_t, uint64_t> mem_info() override {
    current();
    size_t free = 0, total = 0;
    CU_CHECK(DRV(cuMemGetInfo)(&free, &total));
    return {free, total};
  }

 protected:
  uint64_t do_create(uint64_t bytes) override {
    current();
    CUmemGenericAllocationHandle h = 0;
    CU_CHECK(DRV(cuMemCreate)(&h, bytes, &prop_, 0));
    return uint64_t(h);
  }
  void do_release(uint64_t handle) override {
    current();
    CU_CHECK(DRV(cuMemRelease)(CUmemGenericAllocationHandle(handle)));
  }
  void do_map(uint64_t va, uint64_t bytes, uint64_t handle) override {
    current();
    CU_CHECK(DRV(cuMemMap)(CUdeviceptr(va), bytes, 0, CUmemGenericAllocationHandle(handle), 0));
  }
  void do_set_access(uint64_t va, uint64_t bytes) override {
    current();
    CU_CHECK(DRV(cuMemSetAccess)(CUdeviceptr(va), bytes, &access_, 1));
  }
  void do_unmap(uint64_t va, uint64_t bytes) override {
    current();
    CU_CHECK(DRV(cuMemUnmap)(CUdeviceptr(va), bytes));
  }
  uint64_t do_plain_alloc(uint64_t bytes) override {
    current();
    CUdeviceptr p = 0;
    CU_CHECK(DRV(cuMemAlloc)(&p, bytes));
    return uint64_t(p);
  }
  void do_plain_free(uint64_t ptr, uint64_t) override {
    current();
    CU_CHECK(DRV(cuMemFree)(CUdeviceptr(ptr)));
  }

 private:
  void current() { ctx_->make_current(); }
  int device_;
  CUdevice dev_ = 0;
  ContextRef ctx_;
  uint64_t gran_ = 0;
  CUmemAllocationProp prop_{};
  CUmemAccessDesc access_{};
};

}  // namespace

std::shared_ptr<PhysicalBackend> make_cuda_backend(int device) { return std::make_shared<CudaBackend>(device); }

}  // namespace offload
