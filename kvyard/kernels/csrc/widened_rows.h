// Few-row matmuls over a weight stored in a narrow form (int8, int4 or bf16), shared by lowbit_linear.cpp and
// linear_bf16.cpp: each block of four output rows is widened once into an L1 buffer as exact fp32 weights,
// then the input rows take their dot products against it, three rows at a time, so the weight is read from memory
// once whatever the row count, and each dot is plain fp32 FMA work. Three rows at a time took a 32-row decode step
// of SmolLM2 from 161 to 143 ms in bf16 and 186 to 166 ms with --quantization gguf on a 2-core AMD EPYC (AVX2),
// one row at a time against three alternating in one process; a row's sums keep one order either way.
#pragma once

#include <ATen/Parallel.h>

#include <vector>

#include "vec.h"

namespace kvyard {

constexpr int64_t kBlockRows = 4;  // output rows widened together: one x load serves four FMAs

// out[j * 4 + r] = w[r] . x[j] for `rows` (<= 4) rows of `w` [rows, k] and R rows of `x` [R, k]. Each sum is taken
// in one order whatever R is, so a row's result does not depend on how many rows share the call. One x row keeps four FMA chains
// in flight, which their latency holds to about one FMA a cycle, and loads 5 vectors per 4 FMAs; R rows keep 4R
// chains and load 4 + R per 4R FMAs.
template <int R>
inline void dot_rows(const float* w, int64_t rows, const float* x, int64_t k, float* out) {
#if defined(__AVX2__) && defined(__FMA__)
  if (rows == kBlockRows && k % 8 == 0) {
    __m256 acc[R][kBlockRows];
    for (int j = 0; j < R; ++j)
      for (int r = 0; r < kBlockRows; ++r) acc[j][r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i += 8) {
      __m256 xv[R];
      for (int j = 0; j < R; ++j) xv[j] = _mm256_loadu_ps(x + j * k + i);
      for (int r = 0; r < kBlockRows; ++r) {
        const __m256 wv = _mm256_loadu_ps(w + r * k + i);
        for (int j = 0; j < R; ++j) acc[j][r] = _mm256_fmadd_ps(wv, xv[j], acc[j][r]);
      }
    }
    for (int j = 0; j < R; ++j) _mm_storeu_ps(out + j * kBlockRows, sum4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]));
    return;
  }
#endif
  for (int j = 0; j < R; ++j)
    for (int64_t r = 0; r < rows; ++r) out[j * kBlockRows + r] = dot(w + r * k, x + j * k, k);
}

constexpr int kXRows = 3;  // rows of x per pass: 12 accumulators, 3 x vectors and a weight vector fill AVX2's 16

// Rows of x per pass over a thread's weight blocks: a prefill-sized call (2,048 rows) would otherwise stream all of
// x (4.7 MB for SmolLM2's 576 inputs) through the caches once per block of four weight rows. A tile of 96 rows of
// 576 (216 KB) stays in L2 while the thread's blocks pass over it, each block widened again per tile. The tiles
// change only the order in which output elements are computed, never the order of any one element's sum.
constexpr int64_t kRowTile = 96;

// out[m, n] = xf[m, k] . W^T, where widen(row, dst) writes row `row` of W as k floats.
template <typename T, typename Widen>
void widened_matmul(const float* xf, int64_t m, int64_t n, int64_t k, Widen&& widen, T* out) {
  at::parallel_for(0, (n + kBlockRows - 1) / kBlockRows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> w(kBlockRows * k);
    float sums[kXRows * kBlockRows];
    for (int64_t m0 = 0; m0 < m; m0 += kRowTile) {
      const int64_t m1 = std::min(m, m0 + kRowTile);
      for (int64_t b = begin; b < end; ++b) {
        const int64_t n0 = b * kBlockRows, rows = std::min(kBlockRows, n - n0);
        for (int64_t r = 0; r < rows; ++r) widen(n0 + r, w.data() + r * k);
        for (int64_t i = m0; i < m1; i += kXRows) {
          const int64_t count = std::min<int64_t>(kXRows, m1 - i);
          const float* x = xf + i * k;
          if (count == kXRows) dot_rows<kXRows>(w.data(), rows, x, k, sums);
          else if (count == 2) dot_rows<2>(w.data(), rows, x, k, sums);
          else dot_rows<1>(w.data(), rows, x, k, sums);
          for (int64_t j = 0; j < count; ++j) store_row(sums + j * kBlockRows, 1.0f, out + (i + j) * n + n0, rows);
        }
      }
    }
  });
}

}  // namespace kvyard
