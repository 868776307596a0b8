// The CUDA driver, loaded at run time through one table.
//
// The extension never links libcuda: `driver()` opens libcuda.so.1 with dlopen on
// first use, finds cuGetProcAddress, and fills the table from the X-macro list
// below. On a machine without a driver the module still imports, and
// `driver_status()` says why the CUDA path is unavailable.
#pragma once

#include <cuda.h>

#include <string>

#include "errors.h"

namespace offload {

// name, and the ABI version of the entry that cuda.h declares under that name: each
// entry is loaded at its own version, so a `_v2` entry gets its `_v2` ABI.
#define OFFLOAD_DRIVER_FUNCS(_)            \
  _(cuInit, 2000)                          \
  _(cuDriverGetVersion, 2020)              \
  _(cuDeviceGet, 2000)                     \
  _(cuDeviceGetCount, 2000)                \
  _(cuDeviceGetName, 2000)                 \
  _(cuDeviceGetAttribute, 2000)            \
  _(cuDeviceTotalMem, 3020)                \
  _(cuDevicePrimaryCtxRetain, 7000)        \
  _(cuDevicePrimaryCtxRelease, 11000)      \
  _(cuCtxGetCurrent, 4000)                 \
  _(cuCtxSetCurrent, 4000)                 \
  _(cuCtxSynchronize, 2000)                \
  _(cuMemGetInfo, 3020)                    \
  _(cuMemAddressReserve, 10020)            \
  _(cuMemAddressFree, 10020)               \
  _(cuMemCreate, 10020)                    \
  _(cuMemRelease, 10020)                   \
  _(cuMemMap, 10020)                       \
  _(cuMemUnmap, 10020)                     \
  _(cuMemSetAccess, 10020)                 \
  _(cuMemGetAllocationGranularity, 10020)  \
  _(cuMemAlloc, 3020)                      \
  _(cuMemFree, 3020)                       \
  _(cuMemHostRegister, 6050)               \
  _(cuMemHostUnregister, 4000)             \
  _(cuMemcpyHtoDAsync, 3020)               \
  _(cuMemcpyDtoHAsync, 3020)               \
  _(cuMemcpyDtoDAsync, 3020)               \
  _(cuMemcpy2DAsync, 3020)                 \
  _(cuMemsetD8Async, 3020)                 \
  _(cuStreamCreate, 2000)                  \
  _(cuStreamDestroy, 4000)                 \
  _(cuStreamSynchronize, 2000)             \
  _(cuStreamWaitEvent, 3020)               \
  _(cuStreamIsCapturing, 10000)            \
  _(cuLaunchHostFunc, 10000)               \
  _(cuEventCreate, 2000)                   \
  _(cuEventDestroy, 4000)                  \
  _(cuEventRecord, 2000)                   \
  _(cuEventQuery, 2000)                    \
  _(cuEventSynchronize, 2000)              \
  _(cuEventElapsedTime, 12080)             \
  _(cuStreamBeginCapture, 10010)          \
  _(cuStreamEndCapture, 10000)             \
  _(cuGraphGetNodes, 10000)                \
  _(cuGraphGetEdges, 12030)                \
  _(cuGraphNodeGetType, 10000)             \
  _(cuGraphKernelNodeGetParams, 12000)     \
  _(cuGraphMemcpyNodeGetParams, 10000)     \
  _(cuGraphMemsetNodeGetParams, 10000)     \
  _(cuFuncGetParamInfo, 12040)             \
  _(cuKernelGetParamInfo, 12040)           \
  _(cuGraphAddMemcpyNode, 10000)           \
  _(cuGraphAddHostNode, 10000)             \
  _(cuGraphAddEventRecordNode, 11010)      \
  _(cuGraphAddDependencies, 12030)         \
  _(cuMemHostGetDevicePointer, 3020)       \
  _(cuGraphInstantiateWithFlags, 11040)    \
  _(cuGraphUpload, 11010)                  \
  _(cuGraphLaunch, 10000)                  \
  _(cuGraphExecDestroy, 10000)             \
  _(cuGraphDestroy, 10000)                 \
  _(cuGetErrorName, 6000)                  \
  _(cuGetErrorString, 6000)

// Entries used only to describe what went wrong: nullptr where the driver lacks them.
#define OFFLOAD_DRIVER_OPTIONAL_FUNCS(_) \
  _(cuFuncGetName, 12030)                \
  _(cuKernelGetName, 12030)

struct DriverApi {
#define OFFLOAD_DECLARE_MEMBER(name, version) decltype(&name) name##_ = nullptr;
  OFFLOAD_DRIVER_FUNCS(OFFLOAD_DECLARE_MEMBER)
  OFFLOAD_DRIVER_OPTIONAL_FUNCS(OFFLOAD_DECLARE_MEMBER)
#undef OFFLOAD_DECLARE_MEMBER
  int driver_version = 0;
};

// The loaded table; throws CudaUnavailable (with the reason) when there is no usable driver.
// Loading happens once, thread-safely (a function-local static).
const DriverApi& driver();

// "" when the driver loaded and cuInit succeeded and at least one device exists,
// else the reason the CUDA path is unavailable. Never throws.
std::string driver_status();

// "CUDA_ERROR_OUT_OF_MEMORY" for a code, without throwing.
std::string cu_error_name(CUresult r);

[[noreturn]] void throw_driver_error(CUresult r, const char* expr, const char* file, int line);
void warn_driver_error(CUresult r, const char* expr, const char* file, int line) noexcept;

}  // namespace offload

// Raising check: the expression, the CUresult name and file:line.
#define CU_CHECK(expr)                                                          \
  do {                                                                          \
    CUresult offload_cu_r_ = (expr);                                            \
    if (offload_cu_r_ != CUDA_SUCCESS)                                          \
      ::offload::throw_driver_error(offload_cu_r_, #expr, __FILE__, __LINE__);  \
  } while (0)

// Warning check, for destructors and rollback paths that must keep unwinding.
#define CU_WARN(expr)                                                           \
  do {                                                                          \
    CUresult offload_cu_r_ = (expr);                                            \
    if (offload_cu_r_ != CUDA_SUCCESS)                                          \
      ::offload::warn_driver_error(offload_cu_r_, #expr, __FILE__, __LINE__);   \
  } while (0)

#define DRV(name) ::offload::driver().name##_
