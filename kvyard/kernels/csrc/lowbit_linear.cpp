// Weight-only int8 and int4 linear layers for CPUs without AMX, registered as torch.ops.kvyard.lowbit_linear.
//
// A decode step's few rows make each matmul a stream over its weight: the kernel reads the low-bit bytes
// once and spends as little work per byte as it can, so that memory, not arithmetic, sets its pace.
// (PyTorch's own int8/int4 CPU kernels ran at 4-5 GB/s of weights on a 2-core AVX2 machine whose bf16
// GEMV streams 9 GB/s, which left int8 only 1.2x faster than bf16 there.)
//
// Each block of four output rows is widened once into an L1 buffer as exact fp32 weights, (q - zp) * scale
// per group, then every input row takes four dot products against it: the weight is read from memory once
// whatever the row count, and each dot is plain fp32 FMA work with four independent sums.
//
// Layouts (kvyard/quant/qlinear.py, PlainLowBitLinear): int8 q row-major [N, K]; int4 codes u = q + 8
// row-major [N, K/2] uint8, where within each run of 32 values byte j holds value j in its low nibble and
// value j + 16 in its high one. Scales and zero terms are [N, groups] fp32 (int8: one group of K).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "vec.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

using namespace kvyard;

constexpr int64_t kBlockRows = 4;  // output rows widened together: one x load serves four FMAs
constexpr int64_t kInt4Run = 32;   // values per nibble run in the int4 layout

#if defined(__AVX2__) && defined(__FMA__)
// The totals of four 8-lane sums, as one vector [sum(a0), sum(a1), sum(a2), sum(a3)].
inline __m128 sum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}
#endif

// Row `r` of the weight as fp32, exactly (q - zp) * scale = q * scale + zero, into `w` [k].
void widen_row(const uint8_t* q, const float* scale, const float* zero, int64_t bits, int64_t group, int64_t k,
               float* __restrict w) {
  for (int64_t g0 = 0, g = 0; g0 < k; g0 += group, ++g) {
    const int64_t end = std::min(k, g0 + group);
    const float s = scale[g], z = zero != nullptr ? zero[g] : 0.0f;
    if (bits == 8) {
      const int8_t* src = reinterpret_cast<const int8_t*>(q);
#pragma omp simd
      for (int64_t i = g0; i < end; ++i) w[i] = static_cast<float>(src[i]) * s + z;
      continue;
    }
    for (int64_t run = g0; run < end; run += kInt4Run) {  // groups (the last may be short) hold whole runs
      const uint8_t* bytes = q + run / 2;
#pragma omp simd
      for (int64_t j = 0; j < kInt4Run / 2; ++j) {
        w[run + j] = static_cast<float>((bytes[j] & 0xF) - 8) * s + z;
        w[run + kInt4Run / 2 + j] = static_cast<float>((bytes[j] >> 4) - 8) * s + z;
      }
    }
  }
}

// out[r] = w[r] . x for `rows` (<= 4) rows of `w` [rows, k].
void dot_rows(const float* w, int64_t rows, const float* x, int64_t k, float* out) {
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

#if defined(__AVX2__) && defined(__FMA__)
// One row of x against four weight rows, widened in registers (no buffer): a batch-1 decode's path, where
// the widening's store and reload were the kernel's bottleneck. Per group, each row's dot with the codes
// is scaled into its total, and the zero term (int4: less the + 8 offset) rides on the group's sum of x.
inline __m256 int8_to_ps(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 codes_to_ps(__m128i bytes8) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes8)); }

template <int kBits>
void gemv_block(const float* x, const float* xsums, const uint8_t* q, const float* scale, const float* zero,
                int64_t group, int64_t groups, int64_t k, float* out) {
  const int64_t row_bytes = k * kBits / 8;
  __m256 total[kBlockRows];
  float offset_terms[kBlockRows] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int r = 0; r < kBlockRows; ++r) total[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t g0 = g * group, g1 = std::min(k, g0 + group);
    __m256 acc[kBlockRows];
    for (int r = 0; r < kBlockRows; ++r) acc[r] = _mm256_setzero_ps();
    if constexpr (kBits == 8) {
      for (int64_t i = g0; i < g1; i += 8) {
        const __m256 xv = _mm256_loadu_ps(x + i);
        for (int r = 0; r < kBlockRows; ++r) acc[r] = _mm256_fmadd_ps(int8_to_ps(q + r * row_bytes + i), xv, acc[r]);
      }
    } else {
      const __m128i low = _mm_set1_epi8(0x0F);
      for (int64_t i = g0; i < g1; i += kInt4Run) {
        const __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + i + 8);
        const __m256 x2 = _mm256_loadu_ps(x + i + 16), x3 = _mm256_loadu_ps(x + i + 24);
        for (int r = 0; r < kBlockRows; ++r) {
          const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + r * row_bytes + i / 2));
          const __m128i lo = _mm_and_si128(b, low), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
          __m256 a = acc[r];
          a = _mm256_fmadd_ps(codes_to_ps(lo), x0, a);
          a = _mm256_fmadd_ps(codes_to_ps(_mm_srli_si128(lo, 8)), x1, a);
          a = _mm256_fmadd_ps(codes_to_ps(hi), x2, a);
          acc[r] = _mm256_fmadd_ps(codes_to_ps(_mm_srli_si128(hi, 8)), x3, a);
        }
      }
    }
    for (int r = 0; r < kBlockRows; ++r) {
      const float s = scale[r * groups + g], z = zero != nullptr ? zero[r * groups + g] : 0.0f;
      total[r] = _mm256_fmadd_ps(acc[r], _mm256_set1_ps(s), total[r]);
      offset_terms[r] += (z - (kBits == 4 ? 8.0f * s : 0.0f)) * xsums[g];
    }
  }
  _mm_storeu_ps(out, _mm_add_ps(sum4(total[0], total[1], total[2], total[3]), _mm_loadu_ps(offset_terms)));
}

// y = x . W for one row of x, in whole blocks of four weight rows; returns false where it does not apply.
template <typename T>
bool gemv_one_row(const float* x, const uint8_t* q, const float* scale, const float* zero, int64_t bits, int64_t group,
                  int64_t n, int64_t k, T* out) {
  if (n % kBlockRows != 0 || group % 8 != 0 || k % 8 != 0) return false;
  const int64_t groups = (k + group - 1) / group, row_bytes = k * bits / 8;
  std::vector<float> xsums(groups, 0.0f);
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t i = g * group; i < std::min(k, (g + 1) * group); ++i) xsums[g] += x[i];
  at::parallel_for(0, n / kBlockRows, 16, [&](int64_t begin, int64_t end) {
    float sums[kBlockRows];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * kBlockRows;
      const uint8_t* qb = q + n0 * row_bytes;
      const float* zb = zero != nullptr ? zero + n0 * groups : nullptr;
      if (bits == 8) gemv_block<8>(x, xsums.data(), qb, scale + n0 * groups, zb, group, groups, k, sums);
      else gemv_block<4>(x, xsums.data(), qb, scale + n0 * groups, zb, group, groups, k, sums);
      store_row(sums, 1.0f, out + n0, kBlockRows);
    }
  });
  return true;
}
#endif

template <typename T>
void lowbit_rows(const T* x, const uint8_t* q, const float* scale, const float* zero, int64_t bits, int64_t group,
                 int64_t m, int64_t n, int64_t k, T* out) {
  std::vector<float> xf(m * k);
  for (int64_t r = 0; r < m; ++r) load_row(x + r * k, 1.0f, xf.data() + r * k, k);
#if defined(__AVX2__) && defined(__FMA__)
  if (m == 1 && gemv_one_row(xf.data(), q, scale, zero, bits, group, n, k, out)) return;
#endif
  const int64_t groups = (k + group - 1) / group, row_bytes = k * bits / 8;
  at::parallel_for(0, (n + kBlockRows - 1) / kBlockRows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> w(kBlockRows * k);
    float sums[kBlockRows];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * kBlockRows, rows = std::min(kBlockRows, n - n0);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t row = n0 + r;
        widen_row(q + row * row_bytes, scale + row * groups, zero != nullptr ? zero + row * groups : nullptr, bits,
                  group, k, w.data() + r * k);
      }
      for (int64_t i = 0; i < m; ++i) {
        dot_rows(w.data(), rows, xf.data() + i * k, k, sums);
        store_row(sums, 1.0f, out + i * n + n0, rows);
      }
    }
  });
}

at::Tensor lowbit_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                         const std::optional<at::Tensor>& zero, int64_t bits, int64_t group_size) {
  TORCH_CHECK(bits == 8 || bits == 4, "bits must be 8 or 4, got ", bits);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be a contiguous fp32 or bf16 [rows, in] matrix");
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && q.scalar_type() == (bits == 8 ? at::kChar : at::kByte),
              "q must be int8 [out, in] (uint8 [out, in/2] for int4)");
  const int64_t m = x.size(0), n = q.size(0), k = q.size(1) * 8 / bits;
  TORCH_CHECK(x.size(1) == k, "x has ", x.size(1), " columns, the weight takes ", k);
  TORCH_CHECK(group_size > 0 && (bits == 8 || (group_size % kInt4Run == 0 && k % kInt4Run == 0)),
              "int4 needs groups and rows of whole runs of 32 values, got group ", group_size, " for ", k, " columns");
  const int64_t groups = (k + group_size - 1) / group_size;
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.dim() == 2 && scale.size(0) == n &&
                  scale.size(1) == groups, "scale must be float32 [out, groups]");
  if (zero) TORCH_CHECK(zero->sizes() == scale.sizes() && zero->scalar_type() == at::kFloat && zero->is_contiguous(),
                        "zero must match scale");
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return out;
  const auto* qp = reinterpret_cast<const uint8_t*>(q.data_ptr());
  const float* zp = zero ? zero->data_ptr<float>() : nullptr;
  if (x.scalar_type() == at::kFloat) {
    lowbit_rows<float>(x.data_ptr<float>(), qp, scale.data_ptr<float>(), zp, bits, group_size, m, n, k,
                       out.data_ptr<float>());
  } else {
    lowbit_rows<at::BFloat16>(x.data_ptr<at::BFloat16>(), qp, scale.data_ptr<float>(), zp, bits, group_size, m, n, k,
                              out.data_ptr<at::BFloat16>());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvyard, m) {
  m.def("lowbit_linear(Tensor x, Tensor q, Tensor scale, Tensor? zero, int bits, int group_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvyard, CPU, m) { m.impl("lowbit_linear", &lowbit_linear); }
