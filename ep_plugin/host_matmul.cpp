// host_matmul: the checks, the ISA dispatch, and the split of a product between the
// pool's threads (see host_matmul.h).
#include "host_matmul.h"

#include <algorithm>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include "host_kernels.h"
#include "host_pool.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace offload::host {
namespace {

bool cpu_can(int32_t isa) {
#if defined(__x86_64__) || defined(__i386__)
  // libgcc's checks include the OS's consent (XCR0) to the AVX and AVX-512 registers.
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (isa == HOST_ISA_AVX2) return avx2;
  if (isa == HOST_ISA_AVX512)
    return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
#endif
  return isa == HOST_ISA_SCALAR;
}

Kernels kernels_for(int32_t isa) {
#if defined(__x86_64__) || defined(__i386__)
  if (isa == HOST_ISA_AVX512) return kernels_avx512();
  if (isa == HOST_ISA_AVX2) return kernels_avx2();
#endif
  return kernels_scalar();
}

size_t dtype_size(int32_t dt) { return dt == HOST_F32 ? 4 : 2; }
const char* dtype_name(int32_t dt) { return dt == HOST_F32 ? "float32" : dt == HOST_F16 ? "float16" : "bfloat16"; }

size_t n_blocks(const HostWeight& w) { return size_t((w.k + w.block_size - 1) / w.block_size); }

// [begin, end) of part `t` of `units` split into `parts` near-equal runs.
std::pair<size_t, size_t> share(size_t units, int t, int parts) {
  return {units * size_t(t) / size_t(parts), units * size_t(t + 1) / size_t(parts)};
}

// Columns of one dense accumulator block: 16 KiB of fp32 accumulators for the rows of x,
// so the block stays in L1 while rows of W stream through it.
size_t block_cols(int rows) { return std::max<size_t>(32, (4096 / size_t(rows)) & ~size_t(31)); }

constexpr size_t kColUnit = 32;  // a thread's band of N: whole 64-byte lines of fp16
constexpr size_t kRowUnit = 8;   // a thread's band of K: whole 8-row tiles
constexpr size_t kSmall = 256 << 10;  // weight bytes below which one thread computes

struct Ctx {
  const HostMatmulJob* job;
  Kernels kr;
  const float* xs;  // x as fp32: int4 [M, kp] (zero past K); dense, per chunk of kMaxRows
  size_t kp;        // rows, [K, rows] at xs + m0 * K (the layout of DenseFn)
  float* partial;   // the row split's per-thread sums [threads, M, N]
};

char* y_row(const Ctx& c, size_t m) {
  return static_cast<char*>(c.job->y) + m * size_t(c.job->weight.n) * dtype_size(c.job->x_dtype);
}

void dense_columns(void* p, int tid, int nt) {
  const Ctx& c = *static_cast<const Ctx*>(p);
  const HostWeight& w = c.job->weight;
  const size_t M = size_t(c.job->m), K = size_t(w.k), N = size_t(w.n), ysz = dtype_size(c.job->x_dtype);
  const auto [u0, u1] = share((N + kColUnit - 1) / kColUnit, tid, nt);
  const size_t c0 = u0 * kColUnit, c1 = std::min(N, u1 * kColUnit);
  thread_local std::vector<float> acc;
  for (size_t m0 = 0; m0 < M; m0 += kMaxRows) {
    const int rows = int(std::min<size_t>(kMaxRows, M - m0));
    const size_t cb_max = block_cols(rows);
    for (size_t col = c0; col < c1; col += cb_max) {
      const size_t cb = std::min(cb_max, c1 - col);
      acc.assign(size_t(rows) * cb, 0.0f);
      c.kr.dense(rows, c.xs + m0 * K, w.data, w.dtype, N, 0, K, col, cb, acc.data(), cb);
      for (int m = 0; m < rows; ++m)
        c.kr.store(acc.data() + size_t(m) * cb, y_row(c, m0 + size_t(m)) + col * ysz, c.job->x_dtype, cb);
    }
  }
}

void dense_rows(void* p, int tid, int nt) {
  const Ctx& c = *static_cast<const Ctx*>(p);
  const HostWeight& w = c.job->weight;
  const size_t M = size_t(c.job->m), K = size_t(w.k), N = size_t(w.n);
  const auto [u0, u1] = share((K + kRowUnit - 1) / kRowUnit, tid, nt);
  const size_t k0 = u0 * kRowUnit, k1 = std::min(K, u1 * kRowUnit);
  float* mine = c.partial + size_t(tid) * M * N;
  std::fill(mine, mine + M * N, 0.0f);
  for (size_t m0 = 0; m0 < M; m0 += kMaxRows) {
    const int rows = int(std::min<size_t>(kMaxRows, M - m0));
    c.kr.dense(rows, c.xs + m0 * K, w.data, w.dtype, N, k0, k1, 0, N, mine + m0 * N, N);
  }
}

struct Reduce {
  const Ctx* c;
  int parts;  // threads of the row split
};

void reduce_rows(void* p, int tid, int nt) {
  const Reduce& r = *static_cast<const Reduce*>(p);
  const Ctx& c = *r.c;
  const size_t M = size_t(c.job->m), N = size_t(c.job->weight.n), ysz = dtype_size(c.job->x_dtype);
  const auto [u0, u1] = share((N + kColUnit - 1) / kColUnit, tid, nt);
  const size_t c0 = u0 * kColUnit, c1 = std::min(N, u1 * kColUnit);
  if (c0 >= c1) return;
  thread_local std::vector<float> sum;
  sum.resize(c1 - c0);
  for (size_t m = 0; m < M; ++m) {
    std::copy(c.partial + m * N + c0, c.partial + m * N + c1, sum.begin());
    for (int t = 1; t < r.parts; ++t) {
      const float* src = c.partial + (size_t(t) * M + m) * N;
      for (size_t j = c0; j < c1; ++j) sum[j - c0] += src[j];
    }
    c.kr.store(sum.data(), y_row(c, m) + c0 * ysz, c.job->x_dtype, c1 - c0);
  }
}

void nbits_columns(void* p, int tid, int nt) {
  const Ctx& c = *static_cast<const Ctx*>(p);
  const HostWeight& w = c.job->weight;
  const size_t M = size_t(c.job->m), N = size_t(w.n), ysz = dtype_size(c.job->x_dtype);
  const auto [n0, n1] = share(N, tid, nt);
  constexpr size_t kChunk = 256;
  thread_local std::vector<float> out;
  out.resize(kMaxRows * kChunk);
  for (size_t m0 = 0; m0 < M; m0 += kMaxRows) {
    const int rows = int(std::min<size_t>(kMaxRows, M - m0));
    for (size_t col = n0; col < n1; col += kChunk) {
      const size_t cb = std::min(kChunk, n1 - col);
      c.kr.nbits(rows, c.xs + m0 * c.kp, c.kp, static_cast<const uint8_t*>(w.data), w.scales, w.dtype,
                 w.zero_points, n_blocks(w), size_t(w.block_size), col, cb, out.data(), cb);
      for (int m = 0; m < rows; ++m)
        c.kr.store(out.data() + size_t(m) * cb, y_row(c, m0 + size_t(m)) + col * ysz, c.job->x_dtype, cb);
    }
  }
}

}  // namespace

std::vector<int32_t> isa_available() {
  std::vector<int32_t> out;
  for (int32_t isa : {HOST_ISA_SCALAR, HOST_ISA_AVX2, HOST_ISA_AVX512})
    if (cpu_can(isa)) out.push_back(isa);
  return out;
}

const char* isa_name(int32_t isa) {
  switch (isa) {
    case HOST_ISA_SCALAR: return "scalar";
    case HOST_ISA_AVX2: return "avx2";
    case HOST_ISA_AVX512: return "avx512";
    default: return "unknown";
  }
}

int32_t isa_best() {
  static const int32_t best = isa_available().back();
  return best;
}

int default_threads() { return cpu_topology().physical_cores; }

std::string check(const HostMatmulJob& j) {
  const HostWeight& w = j.weight;
  if (j.m < 1) return "x has " + std::to_string(j.m) + " rows; it needs at least 1";
  if (w.k < 1 || w.n < 1)
    return "the weight is [K, N] = [" + std::to_string(w.k) + ", " + std::to_string(w.n) + "]; both must be >= 1";
  if (j.x_dtype != HOST_F32 && j.x_dtype != HOST_F16) return "x must be float16 or float32";
  if (!j.x || !w.data) return "x and the weight must not be null";
  if (w.kind == HOST_DENSE) {
    if (w.dtype != HOST_F32 && w.dtype != HOST_F16 && w.dtype != HOST_BF16)
      return "a dense weight must be float16, bfloat16 or float32";
  } else if (w.kind == HOST_NBITS4) {
    if (w.block_size < 16 || (w.block_size & (w.block_size - 1)))
      return "block_size must be a power of two >= 16, got " + std::to_string(w.block_size);
    if (w.dtype != j.x_dtype)
      return std::string("the scales must have x's type (") + dtype_name(j.x_dtype) + "), got " + dtype_name(w.dtype);
    if (!w.scales) return "the scales must not be null";
  } else {
    return "unknown weight kind " + std::to_string(w.kind);
  }
  if (j.threads < 0 || j.threads > cpu_topology().logical_cpus)
    return "threads must be in [1, " + std::to_string(cpu_topology().logical_cpus) + "] (the CPUs this process may "
           "use), got " + std::to_string(j.threads);
  if (j.isa != HOST_ISA_AUTO) {
    if (j.isa != HOST_ISA_SCALAR && j.isa != HOST_ISA_AVX2 && j.isa != HOST_ISA_AVX512)
      return "unknown isa " + std::to_string(j.isa);
    if (!cpu_can(j.isa)) {
      std::string have;
      for (int32_t i : isa_available()) have += std::string(have.empty() ? "" : ", ") + isa_name(i);
      return std::string("isa '") + isa_name(j.isa) + "' is not available on this CPU (available: " + have + ")";
    }
  }
  if (j.split < HOST_SPLIT_AUTO || j.split > HOST_SPLIT_ROWS) return "unknown split " + std::to_string(j.split);
  return "";
}

void run(const HostMatmulJob& job) {
  const std::string why = check(job);
  if (!why.empty()) throw std::invalid_argument(why);
  if (!job.y) throw std::invalid_argument("y must not be null");
  const HostWeight& w = job.weight;
  const size_t M = size_t(job.m), K = size_t(w.k), N = size_t(w.n);
  Ctx c{&job, kernels_for(job.isa == HOST_ISA_AUTO ? isa_best() : job.isa), nullptr, 0, nullptr};
  c.kp = w.kind == HOST_DENSE ? K : n_blocks(w) * size_t(w.block_size);
  thread_local std::vector<float> xs, xt;  // kept between calls
  xs.assign(M * c.kp, 0.0f);
  for (size_t m = 0; m < M; ++m)
    c.kr.load(static_cast<const char*>(job.x) + m * K * dtype_size(job.x_dtype), job.x_dtype, xs.data() + m * c.kp,
              K);
  if (w.kind == HOST_NBITS4 && c.kr.nbits_pairs && w.block_size >= 32) {  // even k, then odd k, per 32
    xt.resize(M * c.kp);
    for (size_t m = 0; m < M; ++m)
      for (size_t g = 0; g < c.kp; g += 32)
        for (size_t i = 0; i < 16; ++i) {
          xt[m * c.kp + g + i] = xs[m * c.kp + g + 2 * i];
          xt[m * c.kp + g + 16 + i] = xs[m * c.kp + g + 2 * i + 1];
        }
    xs.swap(xt);
  }
  if (w.kind == HOST_DENSE) {  // each chunk of rows transposed to [K, rows]
    xt.resize(M * K);
    for (size_t m0 = 0; m0 < M; m0 += kMaxRows) {
      const size_t rows = std::min<size_t>(kMaxRows, M - m0);
      for (size_t m = 0; m < rows; ++m)
        for (size_t k = 0; k < K; ++k) xt[m0 * K + k * rows + m] = xs[(m0 + m) * K + k];
    }
    xs.swap(xt);
  }
  c.xs = xs.data();
  // A product too small to pay for waking the pool (a few microseconds a thread) runs on
  // the caller's thread.
  const size_t weight_bytes = w.kind == HOST_DENSE ? K * N * dtype_size(w.dtype) : N * c.kp / 2;
  const int threads = weight_bytes < kSmall ? 1 : job.threads ? job.threads : default_threads();
  if (w.kind == HOST_NBITS4) {
    pool_run(int(std::min<size_t>(size_t(threads), N)), nbits_columns, &c);
    return;
  }
  const size_t col_units = (N + kColUnit - 1) / kColUnit, row_units = (K + kRowUnit - 1) / kRowUnit;
  int32_t split = job.split;
  // Rows by default (one contiguous run of W a thread; measured faster, host_matmul.h),
  // columns where K is too short to give each thread two 8-row tiles.
  if (split == HOST_SPLIT_AUTO) split = row_units >= 2 * size_t(threads) ? HOST_SPLIT_ROWS : HOST_SPLIT_COLUMNS;
  if (split == HOST_SPLIT_COLUMNS) {
    pool_run(int(std::min<size_t>(size_t(threads), col_units)), dense_columns, &c);
    return;
  }
  const int parts = int(std::min<size_t>(size_t(threads), row_units));
  thread_local std::vector<float> partial;  // kept between calls: no page faults per call
  if (partial.size() < size_t(parts) * M * N) partial.resize(size_t(parts) * M * N);
  c.partial = partial.data();
  pool_run(parts, dense_rows, &c);
  Reduce r{&c, parts};
  pool_run(int(std::min<size_t>(size_t(threads), col_units)), reduce_rows, &r);
}

namespace {
struct ReadCtx {
  const uint64_t* p;
  size_t words;
  uint64_t sums[256];
};
uint64_t sum_words(const uint64_t* p, size_t n) {
  uint64_t s = 0;
  for (size_t i = 0; i < n; ++i) s += p[i];
  return s;
}
#if defined(__x86_64__) || defined(__i386__)
__attribute__((target("avx2"))) uint64_t sum_words_avx2(const uint64_t* p, size_t n) {
  __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    a0 = _mm256_add_epi64(a0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)));
    a1 = _mm256_add_epi64(a1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 4)));
  }
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_add_epi64(a0, a1));
  return lanes[0] + lanes[1] + lanes[2] + lanes[3] + sum_words(p + i, n - i);
}
#endif
void read_band(void* p, int tid, int nt) {
  ReadCtx& r = *static_cast<ReadCtx*>(p);
  const auto [w0, w1] = share(r.words, tid, nt);
#if defined(__x86_64__) || defined(__i386__)
  if (cpu_can(HOST_ISA_AVX2)) {
    r.sums[tid] = sum_words_avx2(r.p + w0, w1 - w0);
    return;
  }
#endif
  r.sums[tid] = sum_words(r.p + w0, w1 - w0);
}
}  // namespace

uint64_t read_bytes(const void* data, size_t bytes, int threads) {
  ReadCtx r{static_cast<const uint64_t*>(data), bytes / 8, {}};
  threads = std::min(std::max(threads ? threads : default_threads(), 1), 256);
  pool_run(threads, read_band, &r);
  uint64_t s = 0;
  for (int t = 0; t < threads; ++t) s += r.sums[t];
  return s;
}

}  // namespace offload::host

extern "C" void host_matmul_job_run(void* p) {
  auto* job = static_cast<HostMatmulJob*>(p);
  try {
    offload::host::run(*job);
    job->status = 0;
    job->error[0] = '\0';
  } catch (const std::exception& e) {
    job->status = 1;
    std::snprintf(job->error, sizeof(job->error), "%s", e.what());
  } catch (...) {
    job->status = 1;
    std::snprintf(job->error, sizeof(job->error), "host_matmul: unknown error");
  }
}
