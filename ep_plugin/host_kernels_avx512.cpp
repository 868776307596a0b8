// The AVX-512 (F, BW, VL) kernels of host_matmul. Compiled with per-function target
// attributes, so the translation unit builds for any x86-64 and runs only where
// host_matmul.cpp found the CPU able to.
//
// Dense: a register tile of 16 columns by up to 8 rows of x, over 8 rows of W at a time,
// adds into an fp32 accumulator block that the caller keeps in L1/L2; each of the 8 rows
// of W is read as one contiguous run across the block.
// int4: columns of W (each contiguous along K in MatMulNBits's layout), 32 values a step,
// through a table of the block's 16 weights (nbits_lut); blocks of 16 widen the nibbles to
// int32 instead (nbits_m). Either way the zero point is subtracted exactly and the scale
// multiplies once, so the dequantized weight is fp32((q - z) * s) on every path.
#include "host_kernels.h"

#if defined(__x86_64__) || defined(__i386__)
// GCC 12's AVX-512 headers self-initialize their undefined vectors (`__m512 __Y = __Y;`),
// which -Wmaybe-uninitialized reports at every inlined use.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#define OFFLOAD_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

namespace offload::host {
namespace {

template <int WT>
OFFLOAD_AVX512 inline __m512 load16(const void* w, size_t i) {
  if constexpr (WT == 0) {
    return _mm512_loadu_ps(static_cast<const float*>(w) + i);
  } else {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(w) + i));
    if constexpr (WT == 1) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

template <int M, int WT, int R>
OFFLOAD_AVX512 void dense_tile(const float* xt, const void* w, size_t ldw, size_t k, size_t n0, size_t nv,
                               float* acc, size_t lda) {
  const float* xk = xt + k * M;  // x[m, k + r] at xk[r * M + m]: constant offsets from one pointer
  for (size_t j = 0; j < nv; j += 16) {
    __m512 a[M];
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) a[m] = _mm512_loadu_ps(acc + size_t(m) * lda + j);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 wv = load16<WT>(w, (k + size_t(r)) * ldw + n0 + j);
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) a[m] = _mm512_fmadd_ps(_mm512_set1_ps(xk[r * M + m]), wv, a[m]);
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) _mm512_storeu_ps(acc + size_t(m) * lda + j, a[m]);
  }
}

template <int M, int WT>
OFFLOAD_AVX512 void dense_m(const float* xt, const void* w, size_t ldw, size_t k0, size_t k1, size_t n0, size_t nb,
                            float* acc, size_t lda) {
  const size_t nv = nb / 16 * 16;
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

// 16 4-bit values (bytes holding 0..15) as fp32 (q - z) * s.
OFFLOAD_AVX512 inline __m512 dequant16(__m128i q, __m512i z, __m512 s) {
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(q), z)), s);
}

template <int M, int ST, bool ZP>
OFFLOAD_AVX512 void nbits_m(const float* x, size_t ldx, const uint8_t* b, const void* scales, const uint8_t* zps,
                            size_t nblk, size_t bs, size_t n0, size_t nb, float* y, size_t ldy) {
  const __m128i low = _mm_set1_epi8(0x0f);
  const size_t blob = bs / 2;
  for (size_t j = 0; j < nb; ++j) {
    const size_t n = n0 + j;
    __m512 a0[M], a1[M];  // two chains per row of x: the FMA latency does not bound M = 1
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) a0[m] = a1[m] = _mm512_setzero_ps();
    for (size_t blk = 0; blk < nblk; ++blk) {
      const __m512 s = _mm512_set1_ps(elem(scales, ST, n * nblk + blk));
      const __m512i z = _mm512_set1_epi32(ZP ? zero_point(zps, n, nblk, blk) : 8);
      const uint8_t* p = b + (n * nblk + blk) * blob;
      const float* xb = x + blk * bs;
      size_t i = 0;
      for (; i + 32 <= bs; i += 32) {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i / 2));
        const __m128i lo = _mm_and_si128(bytes, low);
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);
        const __m512 w0 = dequant16(_mm_unpacklo_epi8(lo, hi), z, s);
        const __m512 w1 = dequant16(_mm_unpackhi_epi8(lo, hi), z, s);
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m) {
          a0[m] = _mm512_fmadd_ps(_mm512_loadu_ps(xb + size_t(m) * ldx + i), w0, a0[m]);
          a1[m] = _mm512_fmadd_ps(_mm512_loadu_ps(xb + size_t(m) * ldx + i + 16), w1, a1[m]);
        }
      }
      if (i < bs) {  // block_size 16
        const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + i / 2));
        const __m128i lo = _mm_and_si128(bytes, low);
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);
        const __m512 w0 = dequant16(_mm_unpacklo_epi8(lo, hi), z, s);
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m) a0[m] = _mm512_fmadd_ps(_mm512_loadu_ps(xb + size_t(m) * ldx + i), w0, a0[m]);
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) y[size_t(m) * ldy + j] = _mm512_reduce_add_ps(_mm512_add_ps(a0[m], a1[m]));
  }
}

// Blocks of 32 and more: the block's 16 possible weights (q - z) * s, computed once, are a
// table that vpermps indexes with the nibbles themselves: 16 bytes widen to 16 int32
// (vpermps reads the low 4 bits: the low nibbles), shifted by 4 they give the high
// nibbles. x comes de-interleaved to match (even k, then odd k, per 32). NC columns at a
// time share each load of x.
// The scales of column blocks at .. at + count (16 at most; zero past count) as fp32.
template <int ST>
OFFLOAD_AVX512 inline __m512 scales16(const void* scales, size_t at, size_t count) {
  const __mmask16 k = count >= 16 ? __mmask16(0xffff) : __mmask16((1u << count) - 1);
  if constexpr (ST == 0) return _mm512_maskz_loadu_ps(k, static_cast<const float*>(scales) + at);
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, static_cast<const uint16_t*>(scales) + at));
}

template <int M, int NC, int ST, bool ZP>
OFFLOAD_AVX512 void nbits_lut(const float* x, size_t ldx, const uint8_t* b, const void* scales, const uint8_t* zps,
                              size_t nblk, size_t bs, size_t n0, size_t nb, float* y, size_t ldy) {
  // A second chain per accumulator for one row of x (the FMA latency would bound it); the
  // same for every NC, so that a column sums in one order whichever pass computes it.
  constexpr bool kTwo = M == 1;
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const size_t blob = bs / 2;
  for (size_t j = 0; j + NC <= nb; j += NC) {
    __m512 a0[NC][M], a1[NC][M];
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c)
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) a0[c][m] = a1[c][m] = _mm512_setzero_ps();
    __m512 sv[NC];  // the scales of 16 blocks a column, read and widened at once
    __m512i lane = _mm512_setzero_si512();  // the block's lane in sv
    for (size_t blk = 0; blk < nblk; ++blk) {
      if ((blk & 15) == 0) {
#pragma GCC unroll 8
        for (int c = 0; c < NC; ++c) sv[c] = scales16<ST>(scales, (n0 + j + size_t(c)) * nblk + blk, nblk - blk);
        lane = _mm512_setzero_si512();
      }
      __m512 lut[NC];
      const uint8_t* p[NC];
#pragma GCC unroll 8
      for (int c = 0; c < NC; ++c) {
        const size_t n = n0 + j + size_t(c);
        const float z = float(ZP ? zero_point(zps, n, nblk, blk) : 8);
        lut[c] = _mm512_mul_ps(_mm512_sub_ps(iota, _mm512_set1_ps(z)), _mm512_permutexvar_ps(lane, sv[c]));
        p[c] = b + (n * nblk + blk) * blob;
      }
      lane = _mm512_add_epi32(lane, _mm512_set1_epi32(1));
      const float* xb = x + blk * bs;
      for (size_t i = 0; i < bs; i += 32) {
        __m512 we[NC], wo[NC];
#pragma GCC unroll 8
        for (int c = 0; c < NC; ++c) {
          const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p[c] + i / 2)));
          we[c] = _mm512_permutexvar_ps(d, lut[c]);
          wo[c] = _mm512_permutexvar_ps(_mm512_srli_epi32(d, 4), lut[c]);
        }
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m) {
          const __m512 xe = _mm512_loadu_ps(xb + size_t(m) * ldx + i);
          const __m512 xo = _mm512_loadu_ps(xb + size_t(m) * ldx + i + 16);
#pragma GCC unroll 8
          for (int c = 0; c < NC; ++c) {
            a0[c][m] = _mm512_fmadd_ps(xe, we[c], a0[c][m]);
            if constexpr (kTwo)
              a1[c][m] = _mm512_fmadd_ps(xo, wo[c], a1[c][m]);
            else
              a0[c][m] = _mm512_fmadd_ps(xo, wo[c], a0[c][m]);
          }
        }
      }
    }
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c)
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m)
        y[size_t(m) * ldy + j + size_t(c)] = _mm512_reduce_add_ps(kTwo ? _mm512_add_ps(a0[c][m], a1[c][m]) : a0[c][m]);
  }
}

template <int M, int ST, bool ZP>
OFFLOAD_AVX512 void nbits_pairs(const float* x, size_t ldx, const uint8_t* b, const void* scales, const uint8_t* zps,
                                size_t nblk, size_t bs, size_t n0, size_t nb, float* y, size_t ldy) {
  if (bs < 32) return nbits_m<M, ST, ZP>(x, ldx, b, scales, zps, nblk, bs, n0, nb, y, ldy);
  constexpr int NC = M <= 4 ? 4 : 2;  // columns a pass: as many as the 32 registers hold
  const size_t full = nb / NC * NC;
  nbits_lut<M, NC, ST, ZP>(x, ldx, b, scales, zps, nblk, bs, n0, full, y, ldy);
  if (full < nb) nbits_lut<M, 1, ST, ZP>(x, ldx, b, scales, zps, nblk, bs, n0 + full, nb - full, y + full, ldy);
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

OFFLOAD_AVX512 void store(const float* src, void* dst, int32_t dtype, size_t count) {
  size_t i = 0;
  if (dtype == 0) {
    float* d = static_cast<float*>(dst);
    for (; i + 16 <= count; i += 16) _mm512_storeu_ps(d + i, _mm512_loadu_ps(src + i));
    for (; i < count; ++i) d[i] = src[i];
    return;
  }
  uint16_t* d = static_cast<uint16_t*>(dst);
  for (; i + 16 <= count; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i),
                        _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  for (; i < count; ++i) d[i] = float_to_half(src[i]);
}

OFFLOAD_AVX512 void load(const void* src, int32_t dtype, float* dst, size_t count) {
  size_t i = 0;
  if (dtype == 1) {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    for (; i + 16 <= count; i += 16)
      _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i))));
  }
  for (; i < count; ++i) dst[i] = elem(src, dtype, i);
}

}  // namespace

Kernels kernels_avx512() { return {dense, nbits, store, load, true}; }

}  // namespace offload::host
#endif
