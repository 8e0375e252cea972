// Vector-friendly scalar helpers shared by kvyard's CPU kernels: bf16 <-> fp32, row loads, dot, exp.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace kvyard {


inline float bf16_to_float(uint16_t v) {
  return __builtin_bit_cast(float, static_cast<uint32_t>(v) << 16);
}

#ifdef __AVX512F__
// 16 bf16 values widened to fp32, exactly (bf16 is a float's top half).
inline __m512 load_bf16x16(const uint16_t* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// 16 floats rounded to bf16 (nearest even; NaN stays NaN) and stored: float_to_bf16 below, 16 at a time.
inline void store_bf16x16(uint16_t* p, __m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(rounded));
}
#endif

// One cached K or V row as fp32; `scale` is the int8 cache's per-(token, head) scale, else unused.
inline void load_row(const float* src, float, float* dst, int64_t d) {
  std::memcpy(dst, src, d * sizeof(float));
}
inline void load_row(const at::BFloat16* src, float, float* dst, int64_t d) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) dst[i] = bf16_to_float(s[i]);
}
inline void load_row(const int8_t* src, float scale, float* dst, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<float>(src[i]) * scale;
}

inline void store_row(const float* src, float mul, float* dst, int64_t d) {
  for (int64_t i = 0; i < d; ++i) dst[i] = src[i] * mul;
}
// fp32 -> bf16 bits, rounded to nearest even (NaN stays NaN), as c10::BFloat16 does, in a form that
// vectorises (c10's conversion does not).
inline uint16_t float_to_bf16(float f) {
  const uint32_t u = __builtin_bit_cast(uint32_t, f);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7fffffffu) > 0x7f800000u ? static_cast<uint16_t>(0x7fc0u) : static_cast<uint16_t>(rounded);
}

inline void store_row(const float* src, float mul, at::BFloat16* dst, int64_t d) {
  uint16_t* out = reinterpret_cast<uint16_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) out[i] = float_to_bf16(src[i] * mul);
}

// a . b over d floats. Compilers reduce a vectorised sum lane by lane (16 dependent scalar adds per
// score, the kernel's top cost), so with AVX-512 the lanes are summed by shuffles instead.
inline float dot(const float* a, const float* b, int64_t d) {
#ifdef __AVX512F__
  if (d % 16 == 0) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    return _mm512_reduce_add_ps(acc);
  }
#endif
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < d; ++i) s += a[i] * b[i];
  return s;
}

// exp(x) in a form the compiler vectorises (a scalar expf per softmax score was a third of the attention
// kernel's time): x = n ln2 + r with |r| <= ln2 / 2, exp(r) by Cephes' degree-5 polynomial, 2^n through
// the exponent bits; about 1 ulp from expf. Below -87, where expf turns subnormal, 0; above 88, exp(88).
inline float fast_exp(float x) {
  const bool tiny = x < -87.0f;
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  return tiny ? 0.0f : e * __builtin_bit_cast(float, bits);
}

// Softmax numerator in place: x[i] = exp(x[i] - max(x)); returns 1 / sum, the normaliser to apply later (and max(x)
// at max_out, for merging softmaxes taken over parts of a row).
inline float softmax_unnormalized(float* __restrict x, int64_t n, float* max_out = nullptr) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < n; ++i) m = x[i] > m ? x[i] : m;
  if (max_out != nullptr) *max_out = m;
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) {
    const float e = fast_exp(x[i] - m);
    x[i] = e;
    sum += e;
  }
  return 1.0f / sum;
}

// Rows per parallel task for row-wise kernels: about 32k values each, so a decode's few rows stay on one
// thread and a prefill's hundreds spread over all.
inline int64_t row_grain(int64_t row_width) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(row_width, 1)); }

// The value stored as T (bf16: rounded to nearest even), read back as fp32: where PyTorch's bf16 ops
// round an intermediate, the kernels round it the same way.
// (A template rather than a tag argument: a tag object inside a loop stops GCC from vectorising it.)
template <typename T>
inline float round_as(float x);
template <>
inline float round_as<float>(float x) { return x; }
template <>
inline float round_as<at::BFloat16>(float x) { return bf16_to_float(float_to_bf16(x)); }

#if defined(__AVX2__) && defined(__FMA__)
// The totals of four 8-lane sums, as one vector [sum(a0), sum(a1), sum(a2), sum(a3)].
inline __m128 sum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}
#endif

}  // namespace kvyard
