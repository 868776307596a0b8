// The CUDA objects that the backend (cuda_backend.cpp) shares with the graph it
// captures (cuda_graph.cpp): the retained primary context, the stream, and the
// graph's factory. Internal to the CUDA backend; nothing here is bound to Python.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <utility>

#include "backend.h"
#include "driver_api.h"

namespace offload::cuda_detail {

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

inline CUstream raw(Stream& s) {
  auto* c = dynamic_cast<CudaStream*>(&s);
  if (c == nullptr) throw std::invalid_argument("the CUDA backend was given a stream of another backend");
  return c->get();
}

// The graph captured as `g` in the context `ctx`; it owns `g` once made. When this
// throws, `g` is still the caller's to destroy.
std::shared_ptr<DeviceGraph> make_cuda_graph(ContextRef ctx, CUgraph g);

}  // namespace offload::cuda_detail
