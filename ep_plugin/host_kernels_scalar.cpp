// The portable scalar kernels of host_matmul: every architecture, and the reference the
// vector paths are tested against. Each row of W is read in order (rows of x outer to
// rows of W inner would read W once per row of x).
#include "host_kernels.h"

namespace offload::host {
namespace {

void dense_scalar(int rows, const float* xt, const void* w, int32_t wdtype, size_t ldw, size_t k0, size_t k1,
                  size_t n0, size_t nb, float* acc, size_t lda) {
  for (size_t k = k0; k < k1; ++k) {
    const float* xk = xt + k * size_t(rows);
    const size_t base = k * ldw + n0;
    for (size_t j = 0; j < nb; ++j) {
      const float wv = elem(w, wdtype, base + j);
      for (int m = 0; m < rows; ++m) acc[size_t(m) * lda + j] += xk[m] * wv;
    }
  }
}

void nbits_scalar(int rows, const float* x, size_t ldx, const uint8_t* b, const void* scales, int32_t sdtype,
                  const uint8_t* zero_points, size_t n_blocks, size_t bs, size_t n0, size_t nb, float* y,
                  size_t ldy) {
  for (size_t j = 0; j < nb; ++j) {
    const size_t n = n0 + j;
    float sum[kMaxRows] = {};
    for (size_t blk = 0; blk < n_blocks; ++blk) {
      const float s = elem(scales, sdtype, n * n_blocks + blk);
      const int z = zero_point(zero_points, n, n_blocks, blk);
      const uint8_t* p = b + (n * n_blocks + blk) * (bs / 2);
      for (size_t i = 0; i < bs; ++i) {
        const int q = (p[i / 2] >> ((i & 1) * 4)) & 15;
        const float wv = float(q - z) * s;
        for (int m = 0; m < rows; ++m) sum[m] += x[size_t(m) * ldx + blk * bs + i] * wv;
      }
    }
    for (int m = 0; m < rows; ++m) y[size_t(m) * ldy + j] = sum[m];
  }
}

void store_scalar(const float* src, void* dst, int32_t dtype, size_t count) {
  if (dtype == 0) {
    for (size_t i = 0; i < count; ++i) static_cast<float*>(dst)[i] = src[i];
  } else {
    for (size_t i = 0; i < count; ++i) static_cast<uint16_t*>(dst)[i] = float_to_half(src[i]);
  }
}

void load_scalar(const void* src, int32_t dtype, float* dst, size_t count) {
  for (size_t i = 0; i < count; ++i) dst[i] = elem(src, dtype, i);
}

}  // namespace

Kernels kernels_scalar() { return {dense_scalar, nbits_scalar, store_scalar, load_scalar, false}; }

}  // namespace offload::host
