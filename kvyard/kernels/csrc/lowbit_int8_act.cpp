// Low-bit linear layers with the activations rounded to int8 as they arrive ("dynamic quantization"), registered
// as torch.ops.kvyard.lowbit_linear_i8: several bf16 rows of x against the portable layout (lowbit_layout.h) in
// AVX2 integer dot products (AVX-512 VNNI ones where the CPU has them, 16 columns a panel). A numerics change,
// so it is off unless asked for (--dynamic-quant); fp32 inputs and the batch-invariant path never take it.
//
// Why: widened_rows.h widens each block of four weight rows to fp32 and spends one FMA per weight per row of x,
// which bounds a 32-row step by FMA throughput. Here vpmaddubsw multiplies 32 code-activation pairs per
// instruction, exactly in integers.
//
// x: each run of 32 values gets its own step (largest magnitude / 127) and int8 codes, rounded to nearest even.
// Weight: each call lays the codes out again, eight output columns at a time, one column per 32-bit lane holding
// four consecutive k values (int4 as u = q + 8, unsigned, as vpmaddubsw takes its first operand; int8 as |q|
// beside q, whose sign goes onto x's codes). Four rows of x share each loaded vector, each broadcasting its own
// four codes, so no lane ever needs a horizontal sum. No int16 lane can saturate (int4: 16 products of 15 * 127 over
// a run, at most 30,480; int8: two of 128 * 127 before each widening to int32), and every int32 sum is below 2^24,
// exact in fp32. Each run's integer dot is scaled by its x step times its weight group's scale; the zero term,
// less int4's + 8 times the scale, multiplies the run's rounded sum. So y = x_rounded . W exactly as each term
// rounds in fp32 (W the dequantized weight), and each output element is summed run by run in k order whatever the
// row count: a row's result depends only on that row. On a 2-core AMD EPYC (Zen 3), SmolLM2's four layer shapes in
// int4-g32 (tools/gemm_stream.py --dynamic-quant): 145 GFLOP/s at 32 rows, 201 at 256, 250 at 2,048, against 94,
// 181 and 184 for this kernel's first version (a block's four weight rows in the lanes of each vector, gathered by
// vphaddw per chunk) and 43, 102 and 140 for MKL's fp32 GEMM on the dequantized weight.
// On a 2-core AMD EPYC Zen 4 the AVX-512 VNNI build took SmolLM2 gguf --dynamic-quant at 32 rows from 0.64-0.81x
// to 0.95-1.05x of the bf16-tile kernel's throughput (kvyard bench offline --compare-dynamic-quant, 2026-12-07).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "lowbit_layout.h"
#include "ops.h"
#include "vec.h"

namespace {

using namespace kvyard;

#if defined(__AVX2__) && defined(__FMA__)
constexpr bool kCompiled = true;
// AVX-512 VNNI (Zen 4, Xeons): 16 columns a panel, one per 32-bit lane of a 512-bit vector, and VPDPBUSD adds four
// code-activation products into each int32 lane at once, where AVX2 takes vpmaddubsw, vpmaddwd and an add. The
// integer dots are exact either way, and each lane's fp32 sum runs the same steps, so both builds give the same bits.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define KVYARD_I8_WIDE 1
#else
#define KVYARD_I8_WIDE 0
#endif
constexpr bool kWide = KVYARD_I8_WIDE;
constexpr int64_t kSubCols = 8;                        // columns of one 8 x 8 transpose of quads (transpose_quads)
constexpr int64_t kPanelCols = kWide ? 16 : 8;         // output columns of one panel: one per fp32 lane
constexpr int64_t kLaneBytes = kPanelCols * 4;         // one panel vector: a quad of k for each column
constexpr int64_t kQuad = 4;       // consecutive k values of one column in each 32-bit lane of a panel vector
constexpr int64_t kTileRows = 4;   // rows of x that share each panel vector as it is loaded
constexpr int64_t kGroupPanels = 16;  // panels prepared together, then swept over every row tile of x

// x's rows rounded to int8, runs of 32 in k order, with each run's step and its sum as rounded.
struct Int8Rows {
  int64_t runs = 0;
  std::vector<int8_t> q;     // [m][k]
  std::vector<float> step;   // [m][runs]
  std::vector<float> total;  // [m][runs]: step * the run's code sum
};

// One run of 32 values to int8 codes in dst[0..31], returning its step and code sum.
float round_run(const float* v, int8_t* dst, int32_t* code_sum) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 vals[4], mag = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    vals[i] = _mm256_loadu_ps(v + 8 * i);
    mag = _mm256_max_ps(mag, _mm256_and_ps(vals[i], abs_mask));
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(mag), _mm256_extractf128_ps(mag, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
  const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  __m256i codes[4], total = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {  // rounded to nearest even (the default rounding mode), |code| <= 127
    codes[i] = _mm256_cvtps_epi32(_mm256_mul_ps(vals[i], inv));
    total = _mm256_add_epi32(total, codes[i]);
  }
  for (int half = 0; half < 2; ++half) {  // packs interleaves by 128-bit lane; the permute restores the order
    const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(codes[2 * half], codes[2 * half + 1]), 0xD8);
    const __m128i bytes = _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16 * half), bytes);
  }
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
  *code_sum = _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1)));
  return amax / 127.0f;
}

Int8Rows round_rows(const float* x, int64_t m, int64_t k) {
  Int8Rows rows;
  rows.runs = k / kInt4Run;
  rows.q.resize(m * k);
  rows.step.resize(m * rows.runs);
  rows.total.resize(m * rows.runs);
  at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      for (int64_t run = 0; run < rows.runs; ++run) {
        const int64_t at = i * rows.runs + run;
        int32_t code_sum = 0;
        rows.step[at] = round_run(x + i * k + run * kInt4Run, rows.q.data() + i * k + run * kInt4Run, &code_sum);
        rows.total[at] = rows.step[at] * static_cast<float>(code_sum);
      }
  });
  return rows;
}

// The 8 x 8 transpose of 32-bit lanes: v[c] holds column c's 32 codes of a run in k order; afterwards v[j] holds
// k values 4j..4j+3 of columns 0..7, one column per lane, as the dot products read them.
inline void transpose_quads(__m256i v[8]) {
  __m256i t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(v[i], v[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(v[i], v[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    v[j] = _mm256_permute2x128_si256(u[j], u[j + 4], 0x20);
    v[j + 4] = _mm256_permute2x128_si256(u[j], u[j + 4], 0x31);
  }
}

// kPanelCols output columns made ready for every row of x: per run, 8 vectors of codes (int4: u = q + 8; int8: |q|,
// each followed by q for its sign), then each column's weight scale and shift (the zero term, less int4's 8 times
// the scale), which multiplies the run's sum of x.
struct Panel {
  std::vector<uint8_t> codes;  // [runs][8 or 16][kLaneBytes]
  std::vector<float> scale;    // [runs][kPanelCols]
  std::vector<float> shift;    // [runs][kPanelCols], empty where there is none (int8 without zero terms)
};

template <int kBits>
constexpr int64_t kRunVectors = kBits == 4 ? 8 : 16;

// Columns n0..n0+7 into the panel's lanes from `lane` on (the last panel may hold a block of four or none, the rest
// zero codes), from the portable layout.
template <int kBits>
void prepare_columns(const uint8_t* q, const float* scale, const float* zero, const LowBitDims& d, int64_t group,
                     int64_t n0, int64_t lane, int64_t runs, Panel& p) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const int64_t blocks = std::clamp<int64_t>((d.n - n0) / kBlockRows, 0, 2), per_chunk = kBits == 4 ? 2 : 1;
  for (int64_t run = 0; run < runs; ++run) {
    const int64_t chunk = run / per_chunk, offset = (run % per_chunk) * 16;  // int4: runs A and B share a chunk
    __m256i v[kSubCols];
    for (int c = 0; c < kSubCols; ++c) {
      const int64_t b = c / kBlockRows;
      if (b >= blocks) { v[c] = _mm256_setzero_si256(); continue; }
      const uint8_t* src = q + (n0 + b * kBlockRows) * d.row_bytes + (chunk * kBlockRows + c % kBlockRows) * kChunkBytes;
      if constexpr (kBits == 4) {
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + offset));
        v[c] = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low);  // values 0-15, then 16-31
      } else {
        v[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
      }
    }
    transpose_quads(v);
    uint8_t* dst = p.codes.data() + run * kRunVectors<kBits> * kLaneBytes + lane * 4;
    auto put = [&](int at, __m256i value) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + at * kLaneBytes), value);
    };
    for (int j = 0; j < 8; ++j) {
      if constexpr (kBits == 4) {
        put(j, v[j]);
      } else {
        put(2 * j, _mm256_abs_epi8(v[j]));
        put(2 * j + 1, v[j]);
      }
    }
    const int64_t g = run * kInt4Run / group;
    for (int c = 0; c < kSubCols; ++c) {
      const bool real = c / kBlockRows < blocks;
      const float s = real ? scale[(n0 + c) * d.groups + g] : 0.0f;
      p.scale[run * kPanelCols + lane + c] = s;
      if (!p.shift.empty())
        p.shift[run * kPanelCols + lane + c] =
            real ? (zero != nullptr ? zero[(n0 + c) * d.groups + g] : 0.0f) - (kBits == 4 ? 8.0f * s : 0.0f) : 0.0f;
    }
  }
}

// Columns n0..n0 + kPanelCols - 1, eight at a time.
template <int kBits>
void prepare_panel(const uint8_t* q, const float* scale, const float* zero, const LowBitDims& d, int64_t group,
                   int64_t n0, int64_t runs, Panel& p) {
  for (int64_t lane = 0; lane < kPanelCols; lane += kSubCols)
    prepare_columns<kBits>(q, scale, zero, d, group, n0 + lane, lane, runs, p);
}

// kRows rows of x (from row i) against one panel: each row's kPanelCols sums in its own fp32 lanes, added run by
// run in k order, so a row's result never depends on the rows beside it.
#if KVYARD_I8_WIDE
template <int kBits, int kRows>
void panel_tile(const Panel& p, const Int8Rows& x, int64_t i, int64_t k, float* sums) {
  __m512 acc[kRows];
  for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t run = 0; run < x.runs; ++run) {
    const uint8_t* w = p.codes.data() + run * kRunVectors<kBits> * kLaneBytes;
    const int8_t* xq = x.q.data() + i * k + run * kInt4Run;
    __m512i dots[kRows];
    for (int r = 0; r < kRows; ++r) dots[r] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
      if constexpr (kBits == 4) {  // u <= 15 and |x| <= 127: 32 products a run, far inside int32
        const __m512i wv = _mm512_loadu_si512(w + j * kLaneBytes);
        for (int r = 0; r < kRows; ++r) {
          const __m512i xv = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xq + r * k + kQuad * j));
          dots[r] = _mm512_dpbusd_epi32(dots[r], wv, xv);
        }
      } else {  // |q| as the unsigned operand, q's sign onto x's codes (never -128: |code| <= 127)
        const __m512i mag = _mm512_loadu_si512(w + 2 * j * kLaneBytes);
        const __mmask64 negative = _mm512_movepi8_mask(_mm512_loadu_si512(w + (2 * j + 1) * kLaneBytes));
        for (int r = 0; r < kRows; ++r) {
          const __m512i xv = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xq + r * k + kQuad * j));
          const __m512i signed_x = _mm512_mask_sub_epi8(xv, negative, _mm512_setzero_si512(), xv);
          dots[r] = _mm512_dpbusd_epi32(dots[r], mag, signed_x);
        }
      }
    }
    const __m512 scale = _mm512_loadu_ps(p.scale.data() + run * kPanelCols);
    const bool shifted = !p.shift.empty();
    const __m512 shift = shifted ? _mm512_loadu_ps(p.shift.data() + run * kPanelCols) : _mm512_setzero_ps();
    for (int r = 0; r < kRows; ++r) {
      const int64_t at = (i + r) * x.runs + run;
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[r]), _mm512_mul_ps(scale, _mm512_set1_ps(x.step[at])), acc[r]);
      if (shifted) acc[r] = _mm512_fmadd_ps(shift, _mm512_set1_ps(x.total[at]), acc[r]);
    }
  }
  for (int r = 0; r < kRows; ++r) _mm512_storeu_ps(sums + r * kPanelCols, acc[r]);
}
#else
template <int kBits, int kRows>
void panel_tile(const Panel& p, const Int8Rows& x, int64_t i, int64_t k, float* sums) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[kRows];
  for (int r = 0; r < kRows; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t run = 0; run < x.runs; ++run) {
    const auto* w = reinterpret_cast<const __m256i*>(p.codes.data() + run * kRunVectors<kBits> * kLaneBytes);
    const int8_t* xq = x.q.data() + i * k + run * kInt4Run;
    __m256i dots[kRows];
    for (int r = 0; r < kRows; ++r) dots[r] = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
      if constexpr (kBits == 4) {
        // u <= 15 and |x| <= 127: each int16 lane sums 16 products over the run, at most 30,480
        const __m256i wv = _mm256_loadu_si256(w + j);
        for (int r = 0; r < kRows; ++r) {
          const __m256i xv = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(xq + r * k + kQuad * j));
          dots[r] = _mm256_add_epi16(dots[r], _mm256_maddubs_epi16(wv, xv));
        }
      } else {
        const __m256i mag = _mm256_loadu_si256(w + 2 * j), sign = _mm256_loadu_si256(w + 2 * j + 1);
        for (int r = 0; r < kRows; ++r) {
          const __m256i xv = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(xq + r * k + kQuad * j));
          dots[r] = _mm256_add_epi32(dots[r], _mm256_madd_epi16(_mm256_maddubs_epi16(mag, _mm256_sign_epi8(xv, sign)), ones));
        }
      }
    }
    const __m256 scale = _mm256_loadu_ps(p.scale.data() + run * kPanelCols);
    const bool shifted = !p.shift.empty();
    const __m256 shift = shifted ? _mm256_loadu_ps(p.shift.data() + run * kPanelCols) : _mm256_setzero_ps();
    for (int r = 0; r < kRows; ++r) {
      const int64_t at = (i + r) * x.runs + run;
      const __m256i d = kBits == 4 ? _mm256_madd_epi16(dots[r], ones) : dots[r];
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(scale, _mm256_set1_ps(x.step[at])), acc[r]);
      if (shifted) acc[r] = _mm256_fmadd_ps(shift, _mm256_set1_ps(x.total[at]), acc[r]);
    }
  }
  for (int r = 0; r < kRows; ++r) _mm256_storeu_ps(sums + r * kPanelCols, acc[r]);
}
#endif

template <int kBits>
void tile_rows(const Panel& p, const Int8Rows& x, int64_t i, int64_t rows, int64_t k, float* sums) {
  switch (rows) {
    case 4: return panel_tile<kBits, 4>(p, x, i, k, sums);
    case 3: return panel_tile<kBits, 3>(p, x, i, k, sums);
    case 2: return panel_tile<kBits, 2>(p, x, i, k, sums);
    default: return panel_tile<kBits, 1>(p, x, i, k, sums);
  }
}

template <int kBits>
void int8_act_matmul(const float* xf, int64_t m, const uint8_t* q, const float* scale, const float* zero,
                     int64_t group, const LowBitDims& d, int64_t n_out, at::BFloat16* out) {
  const Int8Rows x = round_rows(xf, m, d.k);
  const int64_t panels = (n_out + kPanelCols - 1) / kPanelCols;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    const bool shifted = kBits == 4 || zero != nullptr;
    std::vector<Panel> group_panels(std::min(kGroupPanels, end - begin),
                                    Panel{std::vector<uint8_t>(x.runs * kRunVectors<kBits> * kLaneBytes),
                                          std::vector<float>(x.runs * kPanelCols),
                                          std::vector<float>(shifted ? x.runs * kPanelCols : 0)});
    float sums[kTileRows * kPanelCols];
    for (int64_t g0 = begin; g0 < end; g0 += kGroupPanels) {
      const int64_t g1 = std::min(end, g0 + kGroupPanels);
      for (int64_t p = g0; p < g1; ++p)
        prepare_panel<kBits>(q, scale, zero, d, group, p * kPanelCols, x.runs, group_panels[p - g0]);
      for (int64_t i = 0; i < m; i += kTileRows) {  // a tile of x stays in L1 while the group's panels pass
        const int64_t rows = std::min(kTileRows, m - i);
        for (int64_t p = g0; p < g1; ++p) {
          tile_rows<kBits>(group_panels[p - g0], x, i, rows, d.k, sums);
          const int64_t n0 = p * kPanelCols, cols = std::min(kPanelCols, n_out - n0);
          for (int64_t r = 0; r < rows; ++r) store_row(sums + r * kPanelCols, 1.0f, out + (i + r) * n_out + n0, cols);
        }
      }
    }
  });
}
#else
constexpr bool kCompiled = false;
#endif

}  // namespace

namespace kvyard::ops {

bool lowbit_int8_act_available() { return kCompiled; }

// y [rows, out_features] = x . W^T for x [rows, K] (K padded as the weight is), x rounded to int8 per run where it is
// bf16 with two rows or more; one row (a batch-1 decode, memory-bound) and fp32 (exact) take lowbit_linear.
at::Tensor lowbit_linear_i8(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                            const std::optional<at::Tensor>& zero, int64_t bits, int64_t group_size, int64_t out_features) {
  if (x.scalar_type() != at::kBFloat16 || x.size(0) <= 1)
    return lowbit_linear(x, q, scale, zero, bits, group_size, out_features);
  TORCH_CHECK(kCompiled, "lowbit_linear_i8 needs AVX2 and FMA");
  const LowBitDims d = check_layout(q, scale, zero, bits, group_size);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [rows, in] matrix");
  TORCH_CHECK(x.size(1) == d.k, "x has ", x.size(1), " columns, the weight takes ", d.k);
  TORCH_CHECK(out_features > d.n - kBlockRows && out_features <= d.n, "out_features ", out_features, " does not fit ",
              d.n, " padded rows");
  const int64_t m = x.size(0);
  at::Tensor out = at::empty({m, out_features}, x.options());
#if defined(__AVX2__) && defined(__FMA__)
  if (m == 0 || out_features == 0) return out;
  std::vector<float> xf(m * d.k);
  for (int64_t r = 0; r < m; ++r) load_row(x.data_ptr<at::BFloat16>() + r * d.k, 1.0f, xf.data() + r * d.k, d.k);
  const auto* qp = reinterpret_cast<const uint8_t*>(q.data_ptr());
  const float* zp = zero ? zero->data_ptr<float>() : nullptr;
  if (bits == 8) int8_act_matmul<8>(xf.data(), m, qp, scale.data_ptr<float>(), zp, group_size, d, out_features, out.data_ptr<at::BFloat16>());
  else int8_act_matmul<4>(xf.data(), m, qp, scale.data_ptr<float>(), zp, group_size, d, out_features, out.data_ptr<at::BFloat16>());
#endif
  return out;
}

}  // namespace kvyard::ops

TORCH_LIBRARY_FRAGMENT(kvyard, m) {
  m.def("lowbit_int8_act_available() -> bool", &kvyard::ops::lowbit_int8_act_available);
  m.def("lowbit_linear_i8(Tensor x, Tensor q, Tensor scale, Tensor? zero, int bits, int group_size, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvyard, CPU, m) { m.impl("lowbit_linear_i8", &kvyard::ops::lowbit_linear_i8); }
