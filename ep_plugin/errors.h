// The exception family of the core. Python maps each type onto the classes of
// onnx_offload.errors, so a caller can catch BudgetExceeded as a MemoryError.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace offload {

// Base of every error the core raises on purpose.
class OffloadError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The CUDA driver is missing, too old, or has no device.
class CudaUnavailable : public OffloadError {
 public:
  using OffloadError::OffloadError;
};

// A driver call returned an error: carries the call, the CUresult name and file:line.
class CudaDriverError : public OffloadError {
 public:
  CudaDriverError(int code, const std::string& name, const std::string& what)
      : OffloadError(what), code_(code), name_(name) {}
  int code() const { return code_; }
  const std::string& error_name() const { return name_; }

 private:
  int code_;
  std::string name_;
};

// A zone or the device budget cannot take the requested committed bytes.
// The message lists the request and every zone's committed bytes and allowance.
// `device_full`: the budget had room, the device did not (memory outside the ledger
// took it: another process, or what ORT and the CUDA libraries hold).
class BudgetExceeded : public OffloadError {
 public:
  BudgetExceeded(const std::string& zone, std::size_t requested, const std::string& what, bool device_full = false)
      : OffloadError(what), zone_(zone), requested_(requested), device_full_(device_full) {}
  const std::string& zone() const { return zone_; }
  std::size_t requested() const { return requested_; }
  bool device_full() const { return device_full_; }

 private:
  std::string zone_;
  std::size_t requested_;
  bool device_full_;
};

// An operation that is illegal in the slot's current state, or a bookkeeping
// request that names memory the arena does not own.
class StateError : public OffloadError {
 public:
  using OffloadError::OffloadError;
};

// Messages are built with std::to_string rather than iostreams: no locale machinery
// runs on error paths.
inline void append_to(std::string& out, const std::string& s) { out += s; }
inline void append_to(std::string& out, const char* s) { out += s; }
inline void append_to(std::string& out, char c) { out += c; }
template <typename T, typename = std::enable_if_t<std::is_arithmetic_v<T>>>
void append_to(std::string& out, T v) {
  out += std::to_string(v);
}

template <typename... Args>
std::string concat(const Args&... args) {
  std::string out;
  (append_to(out, args), ...);
  return out;
}

// The one warning path of the core, for cleanup failures that must not throw
// (destructors, rollback, close). The message is queued, never printed and never
// handed to Python here: callers may hold the arena lock, and the lock order is the
// GIL first. The binding emits the queue as onnx_offload.errors.OffloadWarning
// whenever it holds the GIL after a bound call. Thread-safe; never throws.
void warn(const std::string& message) noexcept;
// Takes every queued message, oldest first.
std::vector<std::string> take_warnings();
// Puts messages back at the front of the queue (ones that could not be emitted yet).
void requeue_warnings(std::vector<std::string> messages) noexcept;

inline std::string hex(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof(buf), "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

}  // namespace offload

#define OFFLOAD_REQUIRE(cond, ...)                                          \
  do {                                                                      \
    if (!(cond)) throw ::offload::OffloadError(::offload::concat(__VA_ARGS__)); \
  } while (0)
