#include "driver_api.h"

#include <dlfcn.h>

#include <memory>

namespace offload {
namespace {

using GetProcAddressFn = CUresult (*)(const char*, void**, int, cuuint64_t,
                                      CUdriverProcAddressQueryResult*);

struct Loaded {
  DriverApi api;
  std::string error;  // empty when the table is usable
};

std::string name_of(const DriverApi& api, CUresult r) {
  const char* name = nullptr;
  if (api.cuGetErrorName_ != nullptr && api.cuGetErrorName_(r, &name) == CUDA_SUCCESS && name)
    return name;
  return concat("CUresult(", int(r), ")");
}

std::unique_ptr<Loaded> load() {
  auto out = std::make_unique<Loaded>();
  // The handle stays open for the life of the process: the table points into it.
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* why = dlerror();
    out->error = concat("libcuda.so.1 could not be loaded (", why ? why : "unknown",
                        "): no NVIDIA driver on this machine");
    return out;
  }
  auto get_proc = reinterpret_cast<GetProcAddressFn>(dlsym(lib, "cuGetProcAddress_v2"));
  if (get_proc == nullptr) {
    out->error = "the NVIDIA driver is too old: cuGetProcAddress_v2 is missing (CUDA 12 or newer needed)";
    return out;
  }
  DriverApi& api = out->api;
#define OFFLOAD_LOAD_MEMBER(name, version)                                                 \
  {                                                                                        \
    void* fn = nullptr;                                                                    \
    CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;          \
    CUresult r = get_proc(#name, &fn, version, CU_GET_PROC_ADDRESS_DEFAULT, &status);      \
    if (r != CUDA_SUCCESS || fn == nullptr || status != CU_GET_PROC_ADDRESS_SUCCESS) {     \
      out->error = concat("the NVIDIA driver has no usable " #name " (CUresult ", int(r),   \
                          ", status ", int(status), ")");                                 \
      return out;                                                                          \
    }                                                                                      \
    api.name##_ = reinterpret_cast<decltype(api.name##_)>(fn);                             \
  }
  OFFLOAD_DRIVER_FUNCS(OFFLOAD_LOAD_MEMBER)
#undef OFFLOAD_LOAD_MEMBER
#define OFFLOAD_LOAD_OPTIONAL(name, version)                                               \
  {                                                                                        \
    void* fn = nullptr;                                                                    \
    CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;          \
    if (get_proc(#name, &fn, version, CU_GET_PROC_ADDRESS_DEFAULT, &status) == CUDA_SUCCESS && \
        status == CU_GET_PROC_ADDRESS_SUCCESS)                                             \
      api.name##_ = reinterpret_cast<decltype(api.name##_)>(fn);                           \
  }
  OFFLOAD_DRIVER_OPTIONAL_FUNCS(OFFLOAD_LOAD_OPTIONAL)
#undef OFFLOAD_LOAD_OPTIONAL
  CUresult r = api.cuInit_(0);
  if (r != CUDA_SUCCESS) {
    out->error = concat("cuInit failed with ", name_of(api, r));
    return out;
  }
  api.cuDriverGetVersion_(&api.driver_version);
  return out;
}

const Loaded& loaded() {
  static const std::unique_ptr<Loaded> instance = load();
  return *instance;
}

}  // namespace

const DriverApi& driver() {
  const Loaded& l = loaded();
  if (!l.error.empty()) throw CudaUnavailable(l.error);
  return l.api;
}

std::string driver_status() {
  const Loaded& l = loaded();
  if (!l.error.empty()) return l.error;
  int count = 0;
  CUresult r = l.api.cuDeviceGetCount_(&count);
  if (r != CUDA_SUCCESS) return concat("cuDeviceGetCount failed with ", cu_error_name(r));
  if (count == 0) return "the NVIDIA driver reports no CUDA device";
  return "";
}

std::string cu_error_name(CUresult r) {
  const Loaded& l = loaded();
  return l.error.empty() ? name_of(l.api, r) : concat("CUresult(", int(r), ")");
}

void throw_driver_error(CUresult r, const char* expr, const char* file, int line) {
  std::string name = cu_error_name(r);
  const char* desc = nullptr;
  const Loaded& l = loaded();
  if (l.error.empty()) l.api.cuGetErrorString_(r, &desc);
  throw CudaDriverError(int(r), name,
                        concat(expr, " failed: ", name, desc ? concat(" (", desc, ")") : "",
                               " at ", file, ":", line));
}

void warn_driver_error(CUresult r, const char* expr, const char* file, int line) noexcept {
  try {
    warn(concat(expr, " failed: ", cu_error_name(r), " at ", file, ":", line));
  } catch (...) {
  }
}

}  // namespace offload
