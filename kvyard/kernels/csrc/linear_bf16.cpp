// A decode step's few bf16 rows against a dense bf16 weight, y = x . W^T, registered as
// torch.ops.kvyard.linear_bf16: the decode matmul on CPUs where oneDNN has no bf16 GEMM (no AVX-512 BF16,
// no AMX), so that the weight is a plain [N, K] matrix.
//
// Such a step streams every weight from memory once. There, torch.mv read SmolLM2's bf16 weights at about
// 13 GB/s on a 2-core AMD EPYC (AVX2) that streams 23 GB/s, and PyTorch's generic bf16 GEMM ran 32 rows at
// about a third of the speed of the same rows on int8 weights. One row: four weight rows are read at a time,
// each 8 bf16 values widened to fp32 by a shift (bf16 is the top half of a float) into an FMA against x in
// fp32, with the bytes asked for 8 KB ahead. More rows: widened_rows.h's loop, the weight widened once a
// block of four rows for every row of x. Sums are fp32, rounded to bf16 once.
#include <torch/library.h>

#include <vector>

#include "ops.h"
#include "vec.h"
#include "widened_rows.h"

namespace {

using namespace kvyard;

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

// One row of x, in whole blocks of four weight rows; returns false where it does not apply.
bool gemv(const float* x, const uint16_t* w, int64_t n, int64_t k, at::BFloat16* out) {
  if (n % kBlockRows != 0 || k % 8 != 0) return false;
  at::parallel_for(0, n / kBlockRows, 16, [&](int64_t begin, int64_t end) {
    float sums[kBlockRows];
    for (int64_t b = begin; b < end; ++b) {
      dot_block(w + b * kBlockRows * k, x, k, sums);
      store_row(sums, 1.0f, out + b * kBlockRows, kBlockRows);
    }
  });
  return true;
}
#endif

}  // namespace

namespace kvyard::ops {

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "x must be a contiguous bf16 [rows, in] matrix");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.is_contiguous(),
              "w must be a contiguous bf16 [out, in] matrix");
  TORCH_CHECK(x.size(1) == w.size(1), "x has ", x.size(1), " columns, the weight takes ", w.size(1));
  const int64_t m = x.size(0), n = w.size(0), k = w.size(1);
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return out;
  std::vector<float> xf(m * k);
  load_row(x.data_ptr<at::BFloat16>(), 1.0f, xf.data(), m * k);
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
#if defined(__AVX2__) && defined(__FMA__)
  if (m == 1 && gemv(xf.data(), wp, n, k, op)) return out;
#endif
  widened_matmul(xf.data(), m, n, k, [&](int64_t row, float* dst) {
    load_row(reinterpret_cast<const at::BFloat16*>(wp + row * k), 1.0f, dst, k);
  }, op);
  return out;
}

}  // namespace kvyard::ops

TORCH_LIBRARY_FRAGMENT(kvyard, m) { m.def("linear_bf16(Tensor x, Tensor w) -> Tensor"); }

TORCH_LIBRARY_IMPL(kvyard, CPU, m) { m.impl("linear_bf16", &kvyard::ops::linear_bf16); }
