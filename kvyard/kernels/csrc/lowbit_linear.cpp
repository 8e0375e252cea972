// Weight-only int8 and int4 linear layers for CPUs without AMX, registered as torch.ops.kvyard.lowbit_linear.
//
// A decode step's few rows make each matmul a stream over its weight: the kernel reads the low-bit bytes
// once and spends as little work per byte as it can, so that memory, not arithmetic, sets its pace.
// (PyTorch's own int8/int4 CPU kernels ran at 4-5 GB/s of weights on a 2-core AVX2 machine whose bf16
// GEMV streams 9 GB/s, which left int8 only 1.2x faster than bf16 there.)
//
// Several rows (and fp32 rows) widen each block of four output rows once into exact fp32 weights,
// (q - zp) * scale per group, for widened_rows.h's loop; one bf16 row takes the integer path below.
//
// Layout (kvyard/quant/qlinear.py, PlainLowBitLinear): a row's codes are int8 q, or int4 u = q + 8 two per
// byte, where within each run of 32 values byte j holds value j in its low nibble and value j + 16 in its
// high one. Each row is cut into chunks of 32 bytes (int8: 32 values, int4: 64), and the four rows of each
// block of output rows are interleaved chunk by chunk, [N/4][chunks][4][32 bytes], so that the batch-1 loop,
// which reads a block's four rows together, reads one sequential stream: on a 2-core AMD EPYC (AVX2) that took
// Qwen2.5-0.5B's int8 layer matmuls from 18.7 to 23.5 GB/s (1.25x) against four strided row streams. N is
// padded to whole blocks and K to whole chunks with zero codes; scales and zero terms are [N, groups] fp32
// (int8: one group of the padded K), zero on padded groups.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <type_traits>
#include <vector>

#include "ops.h"
#include "vec.h"
#include "lowbit_layout.h"
#include "widened_rows.h"

namespace {

using namespace kvyard;


// One row of the weight as fp32, exactly (q - zp) * scale = q * scale + zero, into `w` [k]. Its chunks lie
// kBlockRows * kChunkBytes bytes apart from `first` (its first one), interleaved with its block's other rows.
void widen_row(const uint8_t* first, const float* scale, const float* zero, int64_t bits, int64_t group, int64_t k,
               float* __restrict w) {
  constexpr int64_t stride = kBlockRows * kChunkBytes;
  const int64_t chunk_values = kChunkBytes * 8 / bits;
  float s = scale[0], z = zero != nullptr ? zero[0] : 0.0f;
  for (int64_t run = 0, g = 0, group_end = group; run < k; run += kInt4Run) {  // groups hold whole runs
    if (run == group_end) {
      ++g, group_end += group;
      s = scale[g], z = zero != nullptr ? zero[g] : 0.0f;
    }
    const uint8_t* bytes = first + (run / chunk_values) * stride + (run % chunk_values) * bits / 8;
    if (bits == 8) {
      const int8_t* src = reinterpret_cast<const int8_t*>(bytes);
#pragma omp simd
      for (int64_t j = 0; j < kInt4Run; ++j) w[run + j] = static_cast<float>(src[j]) * s + z;
      continue;
    }
#pragma omp simd
    for (int64_t j = 0; j < kInt4Run / 2; ++j) {
      w[run + j] = static_cast<float>((bytes[j] & 0xF) - 8) * s + z;
      w[run + kInt4Run / 2 + j] = static_cast<float>((bytes[j] >> 4) - 8) * s + z;
    }
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// A batch-1 decode's path: one row of x against four weight rows at a time, in integer arithmetic.
//
// Widening every code to fp32 for an FMA left the loop bound by conversions (two per eight weights)
// rather than by memory. Here x is rounded once per call to int16, with one fp32 scale per run of 32
// values (step = the run's largest magnitude / 32767), and the codes are widened only to int16, so one
// vpmaddwd multiplies sixteen weights and adds them in pairs, exactly, into int32. Each run's int32 sum
// is scaled into fp32; the weights' group scales and zero terms are applied per group.
// The rounding of x moves each value by at most 1/65534 of its run's largest, which is below bf16's own
// rounding of x for every value within 128x of that largest; so only bf16 inputs take this path, and
// fp32 inputs keep the exact fp32 one below.
constexpr int64_t kActRun = 32;  // x values that share one int16 scale
// Each thread asks for its weight bytes 8 KB ahead of where it reads: the hardware prefetchers alone held the
// loop to ~10 GB/s on a 2-core AMD EPYC that streams 23 GB/s (tools/gemm_stream.py --lowbit: the 120 SmolLM2
// layer matmuls took 0.73x (int8) and 0.79x (int4) of the time with it, when rows were still read as four
// streams). A prefetch never faults, so the ones past the end of the weight need no guard.
constexpr int64_t kPrefetchBytes = 8192;
// Codes per step of the inner loop. int8: one run, widened in order. int4: two runs (32 bytes), whose nibbles
// are widened in-lane (vpunpck*bw), so each vector holds eight values of run A and eight of run B; x is laid
// out in the same order, and the int32 sums hold run A in lanes 0-3 and run B in lanes 4-7.
template <int kBits>
constexpr int64_t kChunk = kBits == 8 ? 32 : 64;

struct Int16Row {
  std::vector<int16_t> q;    // [k], in the chunk order of the weight's codes
  std::vector<float> scale;  // [k / 32], x ~= q * scale of its run
};

// The largest magnitude among a run's 32 values.
inline float run_amax(const float* v) {
  const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  auto mag = [&](int i) { return _mm256_and_ps(_mm256_loadu_ps(v + 8 * i), abs); };
  const __m256 m = _mm256_max_ps(_mm256_max_ps(mag(0), mag(1)), _mm256_max_ps(mag(2), mag(3)));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

// round(v * inv) for a run's 32 values into `out`, to nearest even as nearbyint; |v * inv| <= 32767 here.
inline void round_run(const float* v, float inv, int16_t* out) {
  const __m256 s = _mm256_set1_ps(inv);
  auto codes = [&](int i) { return _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 8 * i), s)); };
  // packs interleaves its two sources by 128-bit lane; the permute puts the 16 values back in order
  for (int half = 0; half < 2; ++half)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16 * half),
                        _mm256_permute4x64_epi64(_mm256_packs_epi32(codes(2 * half), codes(2 * half + 1)), 0xD8));
}

template <int kBits>
Int16Row round_to_int16(const float* x, int64_t k) {
  Int16Row row{std::vector<int16_t>(k), std::vector<float>(k / kActRun)};
  std::vector<int16_t> ordered(kBits == 8 ? 0 : k);  // int8 codes are already in order: rounded in place
  int16_t* rounded = kBits == 8 ? row.q.data() : ordered.data();
  for (int64_t r = 0; r < k / kActRun; ++r) {
    const float* v = x + r * kActRun;
    const float amax = run_amax(v);
    row.scale[r] = amax / 32767.0f;
    round_run(v, amax > 0.0f ? 32767.0f / amax : 0.0f, rounded + r * kActRun);
  }
  if constexpr (kBits == 4) {  // vector t of a chunk: values 8t..8t+7 of run A, then the same of run B
    for (int64_t c = 0; c < k; c += 64)
      for (int64_t t = 0; t < 4; ++t)
        for (int64_t h = 0; h < 2; ++h)
          std::copy_n(ordered.data() + c + h * 32 + 8 * t, 8, row.q.data() + c + 16 * t + 8 * h);
  }
  return row;
}

// One row's chunk (`bytes`: its 32 bytes) against x's int16 codes `xv`, as int32 sums (exact: see gemv_block).
template <int kBits>
inline __m256i chunk_dot(const uint8_t* bytes, const __m256i* xv) {
  if constexpr (kBits == 8) {
    const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
    const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 16)));
    return _mm256_add_epi32(_mm256_madd_epi16(w0, xv[0]), _mm256_madd_epi16(w1, xv[1]));
  } else {
    const __m256i low = _mm256_set1_epi8(0x0F), zero = _mm256_setzero_si256();
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes));
    const __m256i lo = _mm256_and_si256(b, low), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
    const __m256i p0 = _mm256_add_epi32(_mm256_madd_epi16(_mm256_unpacklo_epi8(lo, zero), xv[0]),
                                        _mm256_madd_epi16(_mm256_unpackhi_epi8(lo, zero), xv[1]));
    const __m256i p1 = _mm256_add_epi32(_mm256_madd_epi16(_mm256_unpacklo_epi8(hi, zero), xv[2]),
                                        _mm256_madd_epi16(_mm256_unpackhi_epi8(hi, zero), xv[3]));
    return _mm256_add_epi32(p0, p1);
  }
}

// The scale of each lane of a chunk's sums: one per run of x; for int4-g32, also one per weight group.
inline __m256 per_run(const float* scales, int64_t run, bool two_runs) {
  return two_runs ? _mm256_setr_m128(_mm_set1_ps(scales[run]), _mm_set1_ps(scales[run + 1]))
                  : _mm256_set1_ps(scales[run]);
}

// Sums of scale(x run) * (codes . x codes) are gathered in fp32 over a span of whole weight groups (int4-g32:
// one chunk, two groups) and then scaled by the group's weight scale; the zero term (int4: less the + 8
// offset) rides on each group's exact sum of x. No int32 sum can overflow or round: a chunk's lane adds at
// most 4 products of 127 * 32767 (int8) or 8 of 15 * 32767 (int4), under 2^24, exact in the fp32 it becomes.
template <int kBits>
void gemv_block(const Int16Row& x, const float* xsums, const uint8_t* q, const float* scale, const float* zero,
                int64_t group, int64_t groups, int64_t k, float* out) {
  constexpr int64_t chunk = kChunk<kBits>;
  constexpr int kVectors = chunk / 16;
  const int64_t span = std::max(group, chunk);
  const bool group_per_run = group < chunk;  // int4-g32
  __m256 total[kBlockRows];
  for (int r = 0; r < kBlockRows; ++r) total[r] = _mm256_setzero_ps();
  for (int64_t s0 = 0; s0 < k; s0 += span) {
    __m256 acc[kBlockRows];
    for (int r = 0; r < kBlockRows; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t i = s0; i < std::min(k, s0 + span); i += chunk) {
      __m256i xv[kVectors];
      for (int v = 0; v < kVectors; ++v) xv[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q.data() + i) + v);
      const __m256 xs = per_run(x.scale.data(), i / kActRun, kBits == 4);
      const uint8_t* rows = q + (i / chunk) * kBlockRows * kChunkBytes;  // this chunk of the block's 4 rows
      _mm_prefetch(reinterpret_cast<const char*>(rows + kPrefetchBytes), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(rows + kPrefetchBytes + 64), _MM_HINT_T0);
      for (int r = 0; r < kBlockRows; ++r)
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(chunk_dot<kBits>(rows + r * kChunkBytes, xv)), xs, acc[r]);
    }
    for (int r = 0; r < kBlockRows; ++r)
      total[r] = _mm256_fmadd_ps(acc[r], per_run(scale + r * groups, s0 / group, group_per_run), total[r]);
  }
  float offset_terms[kBlockRows] = {0.0f, 0.0f, 0.0f, 0.0f};
  if (kBits == 4 || zero != nullptr) {
    for (int r = 0; r < kBlockRows; ++r)
      for (int64_t g = 0; g < groups; ++g) {
        const float s = scale[r * groups + g], z = zero != nullptr ? zero[r * groups + g] : 0.0f;
        offset_terms[r] += (z - (kBits == 4 ? 8.0f * s : 0.0f)) * xsums[g];
      }
  }
  _mm_storeu_ps(out, _mm_add_ps(sum4(total[0], total[1], total[2], total[3]), _mm_loadu_ps(offset_terms)));
}

// y = x . W for one row of x: every block of four padded weight rows, the first `n_out` outputs stored.
template <int kBits>
void gemv_rows(const float* x, const uint8_t* q, const float* scale, const float* zero, int64_t group, int64_t n,
               int64_t n_out, int64_t k, at::BFloat16* out) {
  const int64_t groups = (k + group - 1) / group, row_bytes = k * kBits / 8;
  const Int16Row xq = round_to_int16<kBits>(x, k);
  std::vector<float> xsums(groups, 0.0f);  // for the zero terms (int4's + 8 offset among them)
  if (kBits == 4 || zero != nullptr) {
    for (int64_t g = 0; g < groups; ++g) {
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = g * group; i < std::min(k, (g + 1) * group); ++i) sum += x[i];
      xsums[g] = sum;
    }
  }
  at::parallel_for(0, n / kBlockRows, 16, [&](int64_t begin, int64_t end) {
    float sums[kBlockRows];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * kBlockRows;
      gemv_block<kBits>(xq, xsums.data(), q + n0 * row_bytes, scale + n0 * groups,
                        zero != nullptr ? zero + n0 * groups : nullptr, group, groups, k, sums);
      store_row(sums, 1.0f, out + n0, std::min(kBlockRows, n_out - n0));
    }
  });
}
#endif

// Row `row` of the weight widened to fp32 into `w` [k].
void widen_weight_row(const uint8_t* q, const float* scale, const float* zero, int64_t bits, int64_t group,
                      const LowBitDims& d, int64_t row, float* w) {
  const uint8_t* first = q + (row / kBlockRows) * kBlockRows * d.row_bytes + (row % kBlockRows) * kChunkBytes;
  widen_row(first, scale + row * d.groups, zero != nullptr ? zero + row * d.groups : nullptr, bits, group, d.k, w);
}

template <typename T>
void lowbit_rows(const T* x, const uint8_t* q, const float* scale, const float* zero, int64_t bits, int64_t group,
                 const LowBitDims& d, int64_t m, int64_t n_out, T* out) {
  std::vector<float> xf(m * d.k);
  for (int64_t r = 0; r < m; ++r) load_row(x + r * d.k, 1.0f, xf.data() + r * d.k, d.k);
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (m == 1) {
      if (bits == 8) gemv_rows<8>(xf.data(), q, scale, zero, group, d.n, n_out, d.k, out);
      else gemv_rows<4>(xf.data(), q, scale, zero, group, d.n, n_out, d.k, out);
      return;
    }
  }
#endif
  widened_matmul(xf.data(), m, n_out, d.k, [&](int64_t row, float* w) {
    widen_weight_row(q, scale, zero, bits, group, d, row, w);
  }, out);
}

}  // namespace

namespace kvyard::ops {

// y [rows, out_features] = x . W^T for x [rows, K] (K padded as the weight is).
at::Tensor lowbit_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                         const std::optional<at::Tensor>& zero, int64_t bits, int64_t group_size, int64_t out_features) {
  const LowBitDims d = check_layout(q, scale, zero, bits, group_size);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be a contiguous fp32 or bf16 [rows, in] matrix");
  TORCH_CHECK(x.size(1) == d.k, "x has ", x.size(1), " columns, the weight takes ", d.k);
  TORCH_CHECK(out_features > d.n - kBlockRows && out_features <= d.n, "out_features ", out_features,
              " does not fit ", d.n, " padded rows");
  const int64_t m = x.size(0);
  at::Tensor out = at::empty({m, out_features}, x.options());
  if (m == 0 || out_features == 0) return out;
  const auto* qp = reinterpret_cast<const uint8_t*>(q.data_ptr());
  const float* zp = zero ? zero->data_ptr<float>() : nullptr;
  if (x.scalar_type() == at::kFloat) {
    lowbit_rows<float>(x.data_ptr<float>(), qp, scale.data_ptr<float>(), zp, bits, group_size, d, m, out_features,
                       out.data_ptr<float>());
  } else {
    lowbit_rows<at::BFloat16>(x.data_ptr<at::BFloat16>(), qp, scale.data_ptr<float>(), zp, bits, group_size, d, m,
                              out_features, out.data_ptr<at::BFloat16>());
  }
  return out;
}

// The weight itself, [out, in] fp32, both padded: what a prefill-sized call multiplies by in the dense GEMM.
// The same products and sums as the kernels' widening, so the same values.
at::Tensor lowbit_dequantize(const at::Tensor& q, const at::Tensor& scale, const std::optional<at::Tensor>& zero,
                             int64_t bits, int64_t group_size) {
  const LowBitDims d = check_layout(q, scale, zero, bits, group_size);
  at::Tensor w = at::empty({d.n, d.k}, scale.options());
  const auto* qp = reinterpret_cast<const uint8_t*>(q.data_ptr());
  const float *sp = scale.data_ptr<float>(), *zp = zero ? zero->data_ptr<float>() : nullptr;
  float* wp = w.data_ptr<float>();
  at::parallel_for(0, d.n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) widen_weight_row(qp, sp, zp, bits, group_size, d, r, wp + r * d.k);
  });
  return w;
}

}  // namespace kvyard::ops

TORCH_LIBRARY_FRAGMENT(kvyard, m) {
  m.def("lowbit_linear(Tensor x, Tensor q, Tensor scale, Tensor? zero, int bits, int group_size, int out_features) -> Tensor");
  m.def("lowbit_dequantize(Tensor q, Tensor scale, Tensor? zero, int bits, int group_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvyard, CPU, m) {
  m.impl("lowbit_linear", &kvyard::ops::lowbit_linear);
  m.impl("lowbit_dequantize", &kvyard::ops::lowbit_dequantize);
}
