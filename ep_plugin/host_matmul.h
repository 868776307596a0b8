// Host compute of MatMul weights that lie in host memory: y[m, n] = sum_k x[m, k] W[k, n]
// for a few rows of x (a decode step: M = 1..8; any M works, small M is what is fast),
// accumulated in fp32, on the pinned worker pool (host_pool.h).
//
// Weights, as the ONNX graph stores them:
//   - dense: MatMul's B, row-major [K, N], fp16, bf16 or fp32;
//   - int4: com.microsoft::MatMulNBits with bits=4: B uint8 [N, n_blocks, block_size/2]
//     (two values a byte, the first in the low nibble), scales [N * n_blocks] of x's type,
//     optional zero points uint8 [N, ceil(n_blocks/2)] packed the same way (default 8);
//     W[k, n] = (q - zero_point) * scale, K padded to n_blocks * block_size in B.
// x and y are fp16 or fp32, of one type.
//
// Why these kernels are written here and not taken from a library: at M <= 8 the product
// is a GEMV, bound by the rate the cores read the weights; what it needs is to read each
// weight byte once, in long contiguous runs, on every physical core, converting fp16/bf16/
// int4 to fp32 in registers. oneDNN or MLAS would add a large dependency, a weight
// prepacking step (their fast paths reorder B, which would double the host memory of
// weights that exist to save memory, or cost a pass per call), and their own thread pools
// beside ORT's; ORT's MLAS is not exported by onnxruntime's wheel. The kernels are about
// 300 lines per ISA, with a scalar path that serves as the reference.
//
// ISA dispatch at run time (one wheel for any x86-64): AVX-512 (F, BW, VL), AVX2 + F16C +
// FMA, and portable scalar; other architectures build the scalar path only.
//
// The split of a dense product between threads: by rows of K (each thread reads one
// contiguous run of W, whole rows, and the threads' [M, N] partial sums are added at the
// end) rather than by bands of N (each thread reads a band of every row: runs of 1-8 KiB
// that the hardware prefetcher restarts at each row). Measured on one core of an AMD EPYC
// (Zen 4, AVX-512), fp16 weights of 256 MiB, GB/s of weights, rows vs columns:
//   K=4096 N=32768: M=1 21.0 vs 19.5, M=4 15.6 vs 9.7, M=8 8.1 vs 6.0;
//   K=16384 N=8192: M=1 18.4 vs 19.0, M=4 12.6 vs 9.2, M=8 7.1 vs 4.3.
// Columns serve where K is too short to give each thread two 8-row tiles.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

extern "C" {

enum HostDType : int32_t { HOST_F32 = 0, HOST_F16 = 1, HOST_BF16 = 2 };
enum HostWeightKind : int32_t { HOST_DENSE = 0, HOST_NBITS4 = 1 };
enum HostIsa : int32_t { HOST_ISA_AUTO = -1, HOST_ISA_SCALAR = 0, HOST_ISA_AVX2 = 1, HOST_ISA_AVX512 = 2 };
// How a dense product is split between threads: AUTO picks; COLUMNS gives each thread
// a band of N (each reads contiguous column blocks of every row); ROWS gives each thread
// a band of K (contiguous memory) and sums the partial products at the end.
enum HostSplit : int32_t { HOST_SPLIT_AUTO = 0, HOST_SPLIT_COLUMNS = 1, HOST_SPLIT_ROWS = 2 };

struct HostWeight {
  int32_t kind;         // HostWeightKind
  int32_t dtype;        // dense: W's HostDType; int4: the scales' (= x's) HostDType
  int64_t k, n;
  const void* data;     // dense: W [K, N]; int4: B [N, n_blocks, block_size / 2]
  const void* scales;   // int4 only: [N * n_blocks]
  const uint8_t* zero_points;  // int4 only, may be null: [N, ceil(n_blocks / 2)]
  int64_t block_size;   // int4 only: a power of two >= 16
};

// One product for a CUDA host node (cudaLaunchHostFunc): x and y in host memory, all
// pointers valid until the function returns.
struct HostMatmulJob {
  HostWeight weight;
  int32_t x_dtype;  // HOST_F32 or HOST_F16; y has the same type
  int32_t threads;  // 0: every physical core of the process's affinity
  int32_t isa;      // HostIsa; HOST_ISA_AUTO: the best this CPU has
  int32_t split;    // HostSplit
  int64_t m;
  const void* x;    // [M, K]
  void* y;          // [M, N]
  int32_t status;   // out: 0 done; else the product was refused and `error` says why
  char error[256];
};

// Runs the job on the pool and returns when y is written. Matches CUhostFn
// (void (*)(void*)); never throws: a refusal sets status and error.
void host_matmul_job_run(void* job);

}  // extern "C"

namespace offload::host {

// The ISAs this CPU and OS can run, best last ("scalar" first); their names.
std::vector<int32_t> isa_available();
const char* isa_name(int32_t isa);
int32_t isa_best();
int default_threads();  // every physical core of the affinity

// Checks the job and runs it; throws std::invalid_argument naming what is wrong
// (shape, type, ISA, thread count) before touching x, W or y.
void run(const HostMatmulJob& job);

// Reads `bytes` (a multiple of 8) on `threads` workers (0: the default) of the same pool,
// each a contiguous band, and returns their sum: the bound a GEMV's read rate is held to.
uint64_t read_bytes(const void* data, size_t bytes, int threads);

// "" when the job can run, else why not (y aside: the binding checks before it allocates y).
std::string check(const HostMatmulJob& job);

}  // namespace offload::host
