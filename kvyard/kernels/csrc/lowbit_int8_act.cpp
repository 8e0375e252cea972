// Low-bit linear layers with the activations rounded to int8 as they arrive ("dynamic quantization"), registered
// as torch.ops.kvyard.lowbit_linear_i8: several bf16 rows of x against the portable layout (lowbit_layout.h) in
// AVX2 integer dot products. A numerics change, so it is off unless asked for (--dynamic-quant); fp32 inputs and
// the batch-invariant path never take it.
//
// Why: widened_rows.h widens each block of four weight rows to fp32 and spends one FMA per weight per row of x,
// which bounds a 32-row step by FMA throughput. Here vpmaddubsw multiplies 32 code-activation pairs per
// instruction, exactly in integers, and the block's codes are unpacked once per call for every row.
//
// x: each run of 32 values gets its own step (largest magnitude / 127) and int8 codes, rounded to nearest even.
// Weight codes: int4 as u = q + 8 (unsigned, as vpmaddubsw takes its first operand); int8 through the sign trick,
// |q| against x's codes with q's sign. No int16 lane can saturate (int4: four products of 15 * 127 and their sums
// over four rows' halves, at most 30,480; int8: two of 128 * 127), and every int32 sum is below 2^24, exact in
// fp32. Each run's integer dot is scaled by its x step times its weight group's scale; the zero term, less int4's
// + 8 times the scale, multiplies the run's rounded sum. So y = x_rounded . W exactly as each term rounds in fp32
// (W the dequantized weight), and every output element is summed in one order whatever the row count: a row's
// result depends only on that row. On a 2-core AMD EPYC (Zen 3) SmolLM2's four layer shapes took half the time of
// the widened fp32 loop at 32 and at 256 rows (int4-g32 codes; int8 0.75-0.8 of it). Two per-lane divisions when a
// block was prepared and a per-group loop for the zero terms had cost 15-20 % of that.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "lowbit_layout.h"
#include "ops.h"
#include "vec.h"

namespace {

using namespace kvyard;

#if defined(__AVX2__) && defined(__FMA__)
constexpr bool kCompiled = true;
constexpr int64_t kLanes = 8;  // one chunk's sums: lane r (+ 4) is block row r's; int4: lanes 0-3 run A, 4-7 run B

// x's rows rounded to int8, laid out chunk by chunk as the weight's codes are read.
struct Int8Rows {
  int64_t chunks = 0, chunk_values = 0;
  std::vector<int8_t> q;     // [m][chunks][values]; int4: A's 0-15, B's 0-15, A's 16-31, B's 16-31
  std::vector<float> step;   // [m][chunks][8]: the x step of each lane's run
  std::vector<float> total;  // [m][chunks][8]: the sum of each lane's run as rounded (step * its code sum)
};

// One run of 32 values to int8 codes, values 0-15 to dst[0] and 16-31 to dst[1], returning its step and code sum.
float round_run(const float* v, int8_t* const dst[2], int32_t* code_sum) {
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
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst[half]), bytes);
  }
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
  *code_sum = _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1)));
  return amax / 127.0f;
}

template <int kBits>
Int8Rows round_rows(const float* x, int64_t m, int64_t k) {
  Int8Rows rows;
  rows.chunk_values = kChunkBytes * 8 / kBits;
  rows.chunks = k / rows.chunk_values;
  rows.q.resize(m * k);
  rows.step.resize(m * rows.chunks * kLanes);
  rows.total.resize(m * rows.chunks * kLanes);
  at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      for (int64_t c = 0; c < rows.chunks; ++c) {
        const float* v = x + i * k + c * rows.chunk_values;
        int8_t* q = rows.q.data() + i * k + c * rows.chunk_values;
        float* step = rows.step.data() + (i * rows.chunks + c) * kLanes;
        float* total = rows.total.data() + (i * rows.chunks + c) * kLanes;
        for (int run = 0; run < (kBits == 4 ? 2 : 1); ++run) {
          // int8: one run in order; int4: run A's halves at 0 and 32, B's at 16 and 48, as the nibbles unpack
          int8_t* const dst[2] = {kBits == 4 ? q + 16 * run : q, kBits == 4 ? q + 32 + 16 * run : q + 16};
          int32_t code_sum = 0;
          const float s = round_run(v + kInt4Run * run, dst, &code_sum);
          const int lanes = kBits == 4 ? 4 : 8;
          std::fill_n(step + lanes * run, lanes, s);
          std::fill_n(total + lanes * run, lanes, s * static_cast<float>(code_sum));
        }
      }
  });
  return rows;
}

// A block of four weight rows made ready for every row of x: codes unpacked to the bytes vpmaddubsw reads (int4:
// the low nibbles then the high ones; int8: |q| then q), and per chunk each lane's weight scale and shift (the
// zero term, less int4's + 8 times the scale), which multiplies the lane's run sum of x.
struct Block {
  std::vector<uint8_t> codes;  // [chunks][4][64]
  std::vector<float> scale;    // [chunks][8]
  std::vector<float> shift;    // [chunks][8], empty where there is none (int8 without zero terms)
};

template <int kBits>
void prepare_block(const uint8_t* q, const float* scale, const float* zero, int64_t groups, int64_t group,
                   int64_t chunks, Block& b) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int64_t c = 0; c < chunks; ++c)
    for (int r = 0; r < kBlockRows; ++r) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + (c * kBlockRows + r) * kChunkBytes));
      auto* dst = reinterpret_cast<__m256i*>(b.codes.data() + (c * kBlockRows + r) * 64);
      _mm256_storeu_si256(dst, kBits == 4 ? _mm256_and_si256(raw, low) : _mm256_abs_epi8(raw));
      _mm256_storeu_si256(dst + 1, kBits == 4 ? _mm256_and_si256(_mm256_srli_epi16(raw, 4), low) : raw);
    }
  // each lane's group, run by run (a group holds whole runs), without a division per lane
  const int64_t runs_per_group = group / kInt4Run, halves = kBits == 4 ? 2 : 1, lanes = kLanes / halves;
  for (int64_t c = 0, run = 0; c < chunks; ++c)
    for (int64_t half = 0; half < halves; ++half, ++run) {
      const int64_t g = run / runs_per_group;  // once per run, not per lane
      for (int64_t l = half * lanes; l < (half + 1) * lanes; ++l) {
        const int64_t r = l % kBlockRows;
        const float s = scale[r * groups + g];
        b.scale[c * kLanes + l] = s;
        if (!b.shift.empty()) b.shift[c * kLanes + l] = (zero != nullptr ? zero[r * groups + g] : 0.0f) - (kBits == 4 ? 8.0f * s : 0.0f);
      }
    }
}

// One chunk of one row of x against the block's four rows: the integer dots, lanes as kLanes says.
template <int kBits>
inline __m256i chunk_dots(const uint8_t* codes, const int8_t* xq) {
  const __m256i ones = _mm256_set1_epi16(1);
  auto load = [](const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); };
  __m256i p[kBlockRows];
  if constexpr (kBits == 4) {
    const __m256i lo = load(xq), hi = load(xq + 32);
    for (int r = 0; r < kBlockRows; ++r)
      p[r] = _mm256_add_epi16(_mm256_maddubs_epi16(load(codes + 64 * r), lo),
                              _mm256_maddubs_epi16(load(codes + 64 * r + 32), hi));
    const __m256i h = _mm256_hadd_epi16(_mm256_hadd_epi16(p[0], p[1]), _mm256_hadd_epi16(p[2], p[3]));
    return _mm256_madd_epi16(h, ones);
  } else {
    const __m256i xv = load(xq);
    for (int r = 0; r < kBlockRows; ++r)
      p[r] = _mm256_madd_epi16(_mm256_maddubs_epi16(load(codes + 64 * r), _mm256_sign_epi8(xv, load(codes + 64 * r + 32))), ones);
    return _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
  }
}

// kCount blocks (of four weight rows) against rows m0..m1 of x, their sums to `sums_out` [rows][kCount * 4]: each
// row's x codes, steps and run sums are read once for every block of the panel.
template <int kBits, int kCount>
void panel_rows(const Block* b, const Int8Rows& x, int64_t m0, int64_t m1, int64_t k, float* sums_out) {
  for (int64_t i = m0; i < m1; ++i) {
    __m256 acc[kCount];
    for (int j = 0; j < kCount; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t c = 0; c < x.chunks; ++c) {
      const int64_t at = i * x.chunks + c;
      const int8_t* xq = x.q.data() + i * k + c * x.chunk_values;
      const __m256 step = _mm256_loadu_ps(x.step.data() + at * kLanes);
      for (int j = 0; j < kCount; ++j) {
        const __m256i dots = chunk_dots<kBits>(b[j].codes.data() + c * kBlockRows * 64, xq);
        const __m256 scale = _mm256_mul_ps(_mm256_loadu_ps(b[j].scale.data() + c * kLanes), step);
        acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), scale, acc[j]);
        if (!b[j].shift.empty())
          acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(b[j].shift.data() + c * kLanes),
                                   _mm256_loadu_ps(x.total.data() + at * kLanes), acc[j]);
      }
    }
    for (int j = 0; j < kCount; ++j)
      _mm_storeu_ps(sums_out + ((i - m0) * kCount + j) * kBlockRows,
                    _mm_add_ps(_mm256_castps256_ps128(acc[j]), _mm256_extractf128_ps(acc[j], 1)));
  }
}

constexpr int kPanel = 2;  // blocks per pass over x's rows

template <int kBits>
void int8_act_matmul(const float* xf, int64_t m, const uint8_t* q, const float* scale, const float* zero,
                     int64_t group, const LowBitDims& d, int64_t n_out, at::BFloat16* out) {
  const Int8Rows x = round_rows<kBits>(xf, m, d.k);
  const int64_t blocks = (n_out + kBlockRows - 1) / kBlockRows;
  at::parallel_for(0, (blocks + kPanel - 1) / kPanel, 1, [&](int64_t begin, int64_t end) {
    std::vector<Block> panel(kPanel, Block{std::vector<uint8_t>(x.chunks * kBlockRows * 64),
                                           std::vector<float>(x.chunks * kLanes),
                                           std::vector<float>(kBits == 4 || zero != nullptr ? x.chunks * kLanes : 0)});
    std::vector<float> sums(kRowTile * kPanel * kBlockRows);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n0 = p * kPanel * kBlockRows, count = std::min<int64_t>(kPanel, blocks - p * kPanel);
      for (int64_t j = 0; j < count; ++j) {
        const int64_t r0 = n0 + j * kBlockRows;
        prepare_block<kBits>(q + r0 * d.row_bytes, scale + r0 * d.groups, zero != nullptr ? zero + r0 * d.groups : nullptr,
                             d.groups, group, x.chunks, panel[j]);
      }
      const int64_t rows = std::min(count * kBlockRows, n_out - n0);
      for (int64_t m0 = 0; m0 < m; m0 += kRowTile) {
        const int64_t m1 = std::min(m, m0 + kRowTile);
        if (count == kPanel) panel_rows<kBits, kPanel>(panel.data(), x, m0, m1, d.k, sums.data());
        else panel_rows<kBits, 1>(panel.data(), x, m0, m1, d.k, sums.data());
        for (int64_t i = m0; i < m1; ++i)
          store_row(sums.data() + (i - m0) * count * kBlockRows, 1.0f, out + i * n_out + n0, rows);
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
