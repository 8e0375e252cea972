// One bf16 row against a dense bf16 weight, y = x . W^T, registered as torch.ops.kvyard.gemv_bf16: the
// batch-1 decode matmul on CPUs without AMX, where the weight is a plain [N, K] matrix.
//
// Such a step streams every weight from memory once. torch.mv read SmolLM2's bf16 weights at about 13 GB/s
// on a 2-core AMD EPYC (AVX2, no bf16 hardware) that streams 23 GB/s; here four weight rows are read at a
// time, each 8 bf16 values widened to fp32 by a shift (bf16 is the top half of a float) into an FMA against
// x in fp32, with the bytes asked for 8 KB ahead. Sums are fp32 and the result is rounded to bf16 once.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "vec.h"

namespace {

using namespace kvyard;

constexpr int64_t kBlockRows = 4;
constexpr int64_t kPrefetchBytes = 8192;

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 bf16x8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(
      reinterpret_cast<const __m128i*>(p))), 16));
}

// out[0..3] = rows w[0..3] . x, for k a multiple of 8.
inline void dot_block(const uint16_t* w, const float* x, int64_t k, float* out) {
  __m256 acc[kBlockRows];
  for (int r = 0; r < kBlockRows; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; i += 8) {
    const __m256 xv = _mm256_loadu_ps(x + i);
    for (int r = 0; r < kBlockRows; ++r) {
      const uint16_t* row = w + r * k + i;
      if (i % 32 == 0) _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetchBytes, _MM_HINT_T0);
      acc[r] = _mm256_fmadd_ps(bf16x8(row), xv, acc[r]);
    }
  }
  _mm_storeu_ps(out, sum4(acc[0], acc[1], acc[2], acc[3]));
}
#endif

at::Tensor gemv_bf16(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "x must be one contiguous bf16 row [1, in]");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.is_contiguous(),
              "w must be a contiguous bf16 [out, in] matrix");
  TORCH_CHECK(x.size(1) == w.size(1), "x has ", x.size(1), " columns, the weight takes ", w.size(1));
  const int64_t n = w.size(0), k = w.size(1);
  at::Tensor out = at::empty({1, n}, x.options());
  std::vector<float> xf(k);
  load_row(x.data_ptr<at::BFloat16>(), 1.0f, xf.data(), k);
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, (n + kBlockRows - 1) / kBlockRows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(k);
    float sums[kBlockRows];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * kBlockRows, rows = std::min(kBlockRows, n - n0);
#if defined(__AVX2__) && defined(__FMA__)
      if (rows == kBlockRows && k % 8 == 0) {
        dot_block(wp + n0 * k, xf.data(), k, sums);
        store_row(sums, 1.0f, op + n0, kBlockRows);
        continue;
      }
#endif
      for (int64_t r = 0; r < rows; ++r) {
        load_row(reinterpret_cast<const at::BFloat16*>(wp + (n0 + r) * k), 1.0f, row.data(), k);
        sums[r] = dot(row.data(), xf.data(), k);
      }
      store_row(sums, 1.0f, op + n0, rows);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvyard, m) { m.def("gemv_bf16(Tensor x, Tensor w) -> Tensor"); }

TORCH_LIBRARY_IMPL(kvyard, CPU, m) { m.impl("gemv_bf16", &gemv_bf16); }
