// Few-row matmuls over a weight stored in a narrow form (int8, int4 or bf16), shared by lowbit_linear.cpp and
// linear_bf16.cpp: each block of four output rows is widened once into an L1 buffer as exact fp32 weights,
// then every input row takes four dot products against it, so the weight is read from memory once whatever
// the row count, and each dot is plain fp32 FMA work with four independent sums.
#pragma once

#include <ATen/Parallel.h>

#include <vector>

#include "vec.h"

namespace kvyard {

constexpr int64_t kBlockRows = 4;  // output rows widened together: one x load serves four FMAs

// out[r] = w[r] . x for `rows` (<= 4) rows of `w` [rows, k].
inline void dot_rows(const float* w, int64_t rows, const float* x, int64_t k, float* out) {
#if defined(__AVX2__) && defined(__FMA__)
  if (rows == kBlockRows && k % 8 == 0) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t i = 0; i < k; i += 8) {
      const __m256 xv = _mm256_loadu_ps(x + i);
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), xv, a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + i), xv, a1);
      a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + 2 * k + i), xv, a2);
      a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + 3 * k + i), xv, a3);
    }
    _mm_storeu_ps(out, sum4(a0, a1, a2, a3));
    return;
  }
#endif
  for (int64_t r = 0; r < rows; ++r) out[r] = dot(w + r * k, x, k);
}

// out[m, n] = xf[m, k] . W^T, where widen(row, dst) writes row `row` of W as k floats.
template <typename T, typename Widen>
void widened_matmul(const float* xf, int64_t m, int64_t n, int64_t k, Widen&& widen, T* out) {
  at::parallel_for(0, (n + kBlockRows - 1) / kBlockRows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> w(kBlockRows * k);
    float sums[kBlockRows];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * kBlockRows, rows = std::min(kBlockRows, n - n0);
      for (int64_t r = 0; r < rows; ++r) widen(n0 + r, w.data() + r * k);
      for (int64_t i = 0; i < m; ++i) {
        dot_rows(w.data(), rows, xf + i * k, k, sums);
        store_row(sums, 1.0f, out + i * n + n0, rows);
      }
    }
  });
}

}  // namespace kvyard
