// The AVX2 + F16C + FMA kernels of host_matmul: the layout of host_kernels_avx512.cpp
// at 8 lanes. With 16 vector registers, int4 in blocks of 16 keeps two accumulator chains
// per row of x only up to 4 rows (8 rows would spill); blocks of 32 and more go through a
// table of the block's 16 weights (nbits_lut).
#include "host_kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#define OFFLOAD_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace offload::host {
namespace {

template <int WT>
OFFLOAD_AVX2 inline __m256 load8(const void* w, size_t i) {
  if constexpr (WT == 0) {
    return _mm256_loadu_ps(static_cast<const float*>(w) + i);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(w) + i));
    if constexpr (WT == 1) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

template <int M, int WT, int R>
OFFLOAD_AVX2 void dense_tile(const float* xt, const void* w, size_t ldw, size_t k, size_t n0, size_t nv,
                             float* acc, size_t lda) {
  const float* xk = xt + k * M;  // x[m, k + r] at xk[r * M + m]: constant offsets from one pointer
  for (size_t j = 0; j < nv; j += 8) {
    __m256 a[M];
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) a[m] = _mm256_loadu_ps(acc + size_t(m) * lda + j);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 wv = load8<WT>(w, (k + size_t(r)) * ldw + n0 + j);
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) a[m] = _mm256_fmadd_ps(_mm256_set1_ps(xk[r * M + m]), wv, a[m]);
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) _mm256_storeu_ps(acc + size_t(m) * lda + j, a[m]);
  }
}

template <int M, int WT>
OFFLOAD_AVX2 void dense_m(const float* xt, const void* w, size_t ldw, size_t k0, size_t k1, size_t n0, size_t nb,
                          float* acc, size_t lda) {
  const size_t nv = nb / 8 * 8;
  size_t k = k0;
  for (; k + 8 <= k1; k += 8) dense_tile<M, WT, 8>(xt, w, ldw, k, n0, nv, acc, lda);
  for (; k < k1; ++k) dense_tile<M, WT, 1>(xt, w, ldw, k, n0, nv, acc, lda);
  if (nv < nb) dense_tail(M, xt, w, WT, ldw, k0, k1, n0, nv, nb, acc, lda);
}

using DenseM = void (*)(const float*, const void*, size_t, size_t, size_t, size_t, size_t, float*, size_t);

template <int WT>
constexpr DenseM kDense[kMaxRows] = {dense_m<1, WT>, dense_m<2, WT>, dense_m<3, WT>, dense_m<4, WT>,
                                     dense_m<5, WT>, dense_m<6, WT>, dense_m<7, WT>, dense_m<8, WT>};

void dense(int rows, const float* xt, const void* w, int32_t wdtype, size_t ldw, size_t k0, size_t k1, size_t n0,
           size_t nb, float* acc, size_t lda) {
  const DenseM* table = wdtype == 0 ? kDense<0> : wdtype == 1 ? kDense<1> : kDense<2>;
  table[rows - 1](xt, w, ldw, k0, k1, n0, nb, acc, lda);
}

OFFLOAD_AVX2 inline __m256 dequant8(__m128i q, __m256i z, __m256 s) {
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(q), z)), s);
}

OFFLOAD_AVX2 inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int M, int ST, bool ZP>
OFFLOAD_AVX2 void nbits_m(const float* x, size_t ldx, const uint8_t* b, const void* scales, const uint8_t* zps,
                          size_t nblk, size_t bs, size_t n0, size_t nb, float* y, size_t ldy) {
  constexpr bool kTwo = M <= 4;  // a second accumulator chain per row where registers allow
  const __m128i low = _mm_set1_epi8(0x0f);
  const size_t blob = bs / 2;
  for (size_t j = 0; j < nb; ++j) {
    const size_t n = n0 + j;
    __m256 a0[M], a1[M];
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) a0[m] = a1[m] = _mm256_setzero_ps();
    for (size_t blk = 0; blk < nblk; ++blk) {
      const __m256 s = _mm256_set1_ps(elem(scales, ST, n * nblk + blk));
      const __m256i z = _mm256_set1_epi32(ZP ? zero_point(zps, n, nblk, blk) : 8);
      const uint8_t* p = b + (n * nblk + blk) * blob;
      const float* xb = x + blk * bs;
      for (size_t i = 0; i < bs; i += 16) {
        const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + i / 2));
        const __m128i lo = _mm_and_si128(bytes, low);
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);
        const __m128i q = _mm_unpacklo_epi8(lo, hi);  // values i .. i + 15
        const __m256 w0 = dequant8(q, z, s);
        const __m256 w1 = dequant8(_mm_srli_si128(q, 8), z, s);
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m) {
          a0[m] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + size_t(m) * ldx + i), w0, a0[m]);
          if constexpr (kTwo)
            a1[m] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + size_t(m) * ldx + i + 8), w1, a1[m]);
          else
            a0[m] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + size_t(m) * ldx + i + 8), w1, a0[m]);
        }
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) y[size_t(m) * ldy + j] = hsum(kTwo ? _mm256_add_ps(a0[m], a1[m]) : a0[m]);
  }
}

// Blocks of 32 and more: the block's 16 possible weights (q - z) * s, computed once, are a
// table in two registers (q < 8 and q >= 8); vpermps picks from each by the low 3 bits of
// the nibble and a blend on its bit 3 (moved to the sign bit) chooses between them. 8
// bytes widen to 8 int32: their low nibbles are 8 even k, shifted by 4 the high nibbles 8
// odd k, so x comes de-interleaved (even k, then odd k, per 32) as for AVX-512. A column
// at a time: with the table in two registers, two columns' tables and accumulators would
// not fit the 16 registers beside the chains.
OFFLOAD_AVX2 inline __m256 lookup(__m256 lo, __m256 hi, __m256i index, __m256i bit3_at_sign) {
  return _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, index), _mm256_permutevar8x32_ps(hi, index),
                          _mm256_castsi256_ps(bit3_at_sign));
}

// Scale i of a block's fp32 or fp16 scales (F16C: no call into the runtime's conversion).
template <int ST>
OFFLOAD_AVX2 inline float scale(const void* scales, size_t i) {
  if constexpr (ST == 0) return static_cast<const float*>(scales)[i];
  return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<const uint16_t*>(scales)[i])));
}

template <int M, int ST, bool ZP>
OFFLOAD_AVX2 void nbits_lut(const float* x, size_t ldx, const uint8_t* b, const void* scales, const uint8_t* zps,
                            size_t nblk, size_t bs, size_t n0, size_t nb, float* y, size_t ldy) {
  // Accumulator chains per row of x: a block of 32 gives each row 4 FMAs, which one chain
  // would serialize on the FMA latency; as many chains as the 16 registers leave room for.
  constexpr int kChains = M == 1 ? 4 : M == 2 ? 2 : 1;
  const __m256 iota = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 eight = _mm256_set1_ps(8);
  const size_t blob = bs / 2;
  for (size_t j = 0; j < nb; ++j) {
    const size_t n = n0 + j;
    __m256 a[M][kChains];
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 4
      for (int c = 0; c < kChains; ++c) a[m][c] = _mm256_setzero_ps();
    for (size_t blk = 0; blk < nblk; ++blk) {
      const __m256 s = _mm256_set1_ps(scale<ST>(scales, n * nblk + blk));
      const __m256 q0 = _mm256_sub_ps(iota, _mm256_set1_ps(float(ZP ? zero_point(zps, n, nblk, blk) : 8)));
      const __m256 lo = _mm256_mul_ps(q0, s);  // q - z is exact in fp32: one rounding, as fp32((q - z) * s)
      const __m256 hi = _mm256_mul_ps(_mm256_add_ps(q0, eight), s);
      const uint8_t* p = b + (n * nblk + blk) * blob;
      const float* xb = x + blk * bs;
      for (size_t i = 0; i < bs; i += 32) {
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {  // bytes 8h .. 8h + 7 of the 16: even k 8h.., odd k 8h.. of the group
          const __m256i d = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + i / 2 + 8 * h)));
          const __m256 we = lookup(lo, hi, d, _mm256_slli_epi32(d, 28));
          const __m256 wo = lookup(lo, hi, _mm256_srli_epi32(d, 4), _mm256_slli_epi32(d, 24));
#pragma GCC unroll 8
          for (int m = 0; m < M; ++m) {
            __m256& ce = a[m][(2 * h) % kChains];
            ce = _mm256_fmadd_ps(_mm256_loadu_ps(xb + size_t(m) * ldx + i + 8 * h), we, ce);
            __m256& co = a[m][(2 * h + 1) % kChains];
            co = _mm256_fmadd_ps(_mm256_loadu_ps(xb + size_t(m) * ldx + i + 16 + 8 * h), wo, co);
          }
        }
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      __m256 t = a[m][0];
#pragma GCC unroll 4
      for (int c = 1; c < kChains; ++c) t = _mm256_add_ps(t, a[m][c]);
      y[size_t(m) * ldy + j] = hsum(t);
    }
  }
}

template <int M, int ST, bool ZP>
OFFLOAD_AVX2 void nbits_pairs(const float* x, size_t ldx, const uint8_t* b, const void* scales, const uint8_t* zps,
                              size_t nblk, size_t bs, size_t n0, size_t nb, float* y, size_t ldy) {
  if (bs < 32) return nbits_m<M, ST, ZP>(x, ldx, b, scales, zps, nblk, bs, n0, nb, y, ldy);
  nbits_lut<M, ST, ZP>(x, ldx, b, scales, zps, nblk, bs, n0, nb, y, ldy);
}

using NBitsM = void (*)(const float*, size_t, const uint8_t*, const void*, const uint8_t*, size_t, size_t, size_t,
                        size_t, float*, size_t);

template <int ST, bool ZP>
constexpr NBitsM kNBits[kMaxRows] = {nbits_pairs<1, ST, ZP>, nbits_pairs<2, ST, ZP>, nbits_pairs<3, ST, ZP>,
                                     nbits_pairs<4, ST, ZP>, nbits_pairs<5, ST, ZP>, nbits_pairs<6, ST, ZP>,
                                     nbits_pairs<7, ST, ZP>, nbits_pairs<8, ST, ZP>};

void nbits(int rows, const float* x, size_t ldx, const uint8_t* b, const void* scales, int32_t sdtype,
           const uint8_t* zps, size_t nblk, size_t bs, size_t n0, size_t nb, float* y, size_t ldy) {
  const NBitsM* table = sdtype == 0 ? (zps ? kNBits<0, true> : kNBits<0, false>)
                                    : (zps ? kNBits<1, true> : kNBits<1, false>);
  table[rows - 1](x, ldx, b, scales, zps, nblk, bs, n0, nb, y, ldy);
}

OFFLOAD_AVX2 void store(const float* src, void* dst, int32_t dtype, size_t count) {
  size_t i = 0;
  if (dtype == 0) {
    float* d = static_cast<float*>(dst);
    for (; i + 8 <= count; i += 8) _mm256_storeu_ps(d + i, _mm256_loadu_ps(src + i));
    for (; i < count; ++i) d[i] = src[i];
    return;
  }
  uint16_t* d = static_cast<uint16_t*>(dst);
  for (; i + 8 <= count; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  for (; i < count; ++i) d[i] = float_to_half(src[i]);
}

OFFLOAD_AVX2 void load(const void* src, int32_t dtype, float* dst, size_t count) {
  size_t i = 0;
  if (dtype == 1) {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    for (; i + 8 <= count; i += 8)
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i))));
  }
  for (; i < count; ++i) dst[i] = elem(src, dtype, i);
}

}  // namespace

Kernels kernels_avx2() { return {dense, nbits, store, load, true}; }

}  // namespace offload::host
#endif
