// The CUDA backend: VMM through the driver table. The primary context of the
// device is retained explicitly for the backend's life and made current on the
// calling thread before each driver call, since ORT and Python call in from
// threads of their own.
#include <chrono>
#include <mutex>
#include <stdexcept>
#include <thread>

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
  CudaStream(ContextRef ctx, CUstream s, bool owned) : ctx_(std::move(ctx)), s_(s), owned_(owned) {}
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
    CU_CHECK(DRV(cuStreamSynchronize)(s));
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
  explicit CudaEvent(ContextRef ctx) : ctx_(std::move(ctx)) {
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
    CU_CHECK(DRV(cuEventSynchronize)(e_));
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
  CUevent e_ = nullptr;
};

void CUDA_CB sleep_ms(void* ms) { std::this_thread::sleep_for(std::chrono::milliseconds(uintptr_t(ms))); }

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
    CU_CHECK(DRV(cuMemAddressReserve)(&p, round_up(bytes, gran_), gran_, 0, 0));
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
    return std::make_shared<CudaStream>(ctx_, s, true);
  }
  std::shared_ptr<Stream> wrap_stream(uint64_t native) override {
    return std::make_shared<CudaStream>(ctx_, reinterpret_cast<CUstream>(uintptr_t(native)), false);
  }
  std::shared_ptr<Event> create_event() override { return std::make_shared<CudaEvent>(ctx_); }
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
