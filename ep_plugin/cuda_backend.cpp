// The CUDA backend: VMM through the driver table. The primary context of the
// device is retained explicitly for the backend's life and made current on the
// calling thread before each driver call, since ORT and Python call in from
// threads of their own.
#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <utility>

#include "backend.h"
#include "bookkeeping.h"
#include "cuda_objects.h"
#include "driver_api.h"

namespace offload {
namespace {

using cuda_detail::ContextRef;
using cuda_detail::CudaStream;
using cuda_detail::PrimaryContext;
using cuda_detail::raw;

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
      return cuda_detail::make_cuda_graph(ctx_, g);
    } catch (...) {
      CU_WARN(DRV(cuGraphDestroy)(g));
      throw;
    }
  }
  void host_register(void* p, uint64_t n) override {
    current();
    CU_CHECK(DRV(cuMemHostRegister)(p, n, CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP));
  }
  uint64_t host_device_address(void* p) override {
    current();
    CUdeviceptr d = 0;
    CU_CHECK(DRV(cuMemHostGetDevicePointer)(&d, p, 0));
    return uint64_t(d);
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
  uint64_t do_create_host(uint64_t bytes) override {
    current();
    host_prop();
    CUmemGenericAllocationHandle h = 0;
    CU_CHECK(DRV(cuMemCreate)(&h, bytes, &host_prop_, 0));
    return uint64_t(h);
  }
  void do_set_host_access(uint64_t va, uint64_t bytes) override {
    current();
    host_prop();
    CUmemAccessDesc both[2] = {access_, access_};
    both[1].location = host_prop_.location;
    CU_CHECK(DRV(cuMemSetAccess)(CUdeviceptr(va), bytes, both, 2));
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
  // The properties of a host handle, checked once: the device must support VMM
  // allocations of location HOST (attribute 145, CUDA 12.2 on) at the device's granularity.
  void host_prop() {
    std::call_once(host_once_, [&] {
      int supported = 0;
      CU_CHECK(DRV(cuDeviceGetAttribute)(&supported, CUdevice_attribute(145), dev_));
      if (supported) {
        host_prop_.type = CU_MEM_ALLOCATION_TYPE_PINNED;
        host_prop_.location.type = CUmemLocationType(2);  // CU_MEM_LOCATION_TYPE_HOST; its id is ignored
        host_prop_.location.id = 0;
        size_t g = 0;
        CU_CHECK(DRV(cuMemGetAllocationGranularity)(&g, &host_prop_, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
        if (g && gran_ % g == 0) host_ok_ = true;
      }
    });
    if (!host_ok_)
      throw CudaUnavailable(concat("CUDA device ", device_, " cannot map host memory into a reserved range "
                                   "(VMM allocations of location HOST need CUDA 12.2 and a driver that supports them)"));
  }
  int device_;
  CUdevice dev_ = 0;
  ContextRef ctx_;
  uint64_t gran_ = 0;
  CUmemAllocationProp prop_{};
  CUmemAccessDesc access_{};
  std::once_flag host_once_;
  bool host_ok_ = false;
  CUmemAllocationProp host_prop_{};
};

}  // namespace

std::shared_ptr<PhysicalBackend> make_cuda_backend(int device) { return std::make_shared<CudaBackend>(device); }

}  // namespace offload