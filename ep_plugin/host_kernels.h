// The per-ISA inner kernels of host_matmul (internal). Each works on at most kMaxRows
// rows of x at once (its accumulators live in registers); host_matmul.cpp loops over
// larger M in chunks of that many rows.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace offload::host {

constexpr int kMaxRows = 8;

// acc[m * lda + j] += sum_{k0 <= k < k1} xt[k * rows + m] * W[k * ldw + n0 + j]
// for m < rows, j < nb; W of type `wdtype` (HostDType). x comes transposed ([K, rows]):
// the rows' values of one k lie together, so the kernel broadcasts them from one pointer.
using DenseFn = void (*)(int rows, const float* xt, const void* w, int32_t wdtype, size_t ldw, size_t k0, size_t k1,
                         size_t n0, size_t nb, float* acc, size_t lda);

// y[m * ldy + j] = sum_k x[m * ldx + k] * (q[n0 + j][k] - zp) * scale[n0 + j][k / bs]
// for m < rows, j < nb, k < n_blocks * bs (x zero past K); scales of type sdtype.
// Where Kernels::nbits_pairs and bs >= 32, x comes de-interleaved in groups of 32: the 16
// even k of a group, then its 16 odd k (the low and the high nibbles of 16 bytes).
using NBitsFn = void (*)(int rows, const float* x, size_t ldx, const uint8_t* b, const void* scales,
                         int32_t sdtype, const uint8_t* zero_points, size_t n_blocks, size_t bs, size_t n0,
                         size_t nb, float* y, size_t ldy);

// dst[i] = src[i] converted to dtype (HOST_F32 or HOST_F16, round to nearest even).
using StoreFn = void (*)(const float* src, void* dst, int32_t dtype, size_t count);
// dst[i] = src[i] of dtype (HOST_F32 or HOST_F16) as fp32.
using LoadFn = void (*)(const void* src, int32_t dtype, float* dst, size_t count);

struct Kernels {
  DenseFn dense;
  NBitsFn nbits;
  StoreFn store;
  LoadFn load;
  bool nbits_pairs;
};

Kernels kernels_scalar();
#if defined(__x86_64__) || defined(__i386__)
Kernels kernels_avx2();
Kernels kernels_avx512();
#endif

// Portable conversions (the scalar path, and tails of the vector paths): the compiler's
// _Float16 where it has one (GCC 12+, Clang 15+ on x86-64; AArch64), else by bits.
#ifdef __FLT16_MAX__
inline float half_to_float(uint16_t h) {
  _Float16 v;
  std::memcpy(&v, &h, 2);
  return float(v);
}
inline uint16_t float_to_half(float f) {
  const _Float16 v = _Float16(f);
  uint16_t h;
  std::memcpy(&h, &v, 2);
  return h;
}
#else
inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13);  // inf, nan
  } else if (exp) {
    u = sign | ((exp + 112) << 23) | (man << 13);
  } else {  // zero and subnormals: man * 2^-24, exact in fp32
    float f = float(man) * 5.9604644775390625e-8f;
    std::memcpy(&u, &f, 4);
    u |= sign;
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t float_to_half(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000);
  const uint32_t a = u & 0x7fffffffu;
  if (a >= 0x7f800000u) return uint16_t(sign | 0x7c00 | (a > 0x7f800000u ? 0x200 : 0));  // inf, nan
  if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00);  // rounds past 65504: inf
  if (a < 0x38800000u) {  // below 2^-14: a multiple of 2^-24, rounded by the fp32 adder
    float v;
    std::memcpy(&v, &a, 4);
    v += 0.5f;  // 0.5 = 2^-1: the sum's ulp is 2^-24, so its low bits are the half's
    uint32_t r;
    std::memcpy(&r, &v, 4);
    return uint16_t(sign | (r - 0x3f000000u));
  }
  const uint32_t odd = (a >> 13) & 1;
  return uint16_t(sign | ((a + 0xc8000fffu + odd) >> 13));  // rebias (-112 << 23) and round
}
#endif
inline float bf16_to_float(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// Element i of a dense weight or scale array of HostDType `dt`.
inline float elem(const void* p, int32_t dt, size_t i) {
  if (dt == 0) return static_cast<const float*>(p)[i];
  const uint16_t v = static_cast<const uint16_t*>(p)[i];
  return dt == 1 ? half_to_float(v) : bf16_to_float(v);
}
// The 4-bit zero point of block `blk` of column n (8 when there are none).
inline int zero_point(const uint8_t* zp, size_t n, size_t n_blocks, size_t blk) {
  if (!zp) return 8;
  return (zp[n * ((n_blocks + 1) / 2) + blk / 2] >> ((blk & 1) * 4)) & 15;
}

// DenseFn's columns j0 <= j < nb, past a vector path's last full vector, one at a time.
inline void dense_tail(int rows, const float* xt, const void* w, int32_t wdtype, size_t ldw, size_t k0, size_t k1,
                       size_t n0, size_t j0, size_t nb, float* acc, size_t lda) {
  for (size_t j = j0; j < nb; ++j)
    for (int m = 0; m < rows; ++m) {
      float s = acc[size_t(m) * lda + j];
      for (size_t k = k0; k < k1; ++k) s += xt[k * size_t(rows) + size_t(m)] * elem(w, wdtype, k * ldw + n0 + j);
      acc[size_t(m) * lda + j] = s;
    }
}

}  // namespace offload::host
