// Weight-only int8 and int4 linear layers in AVX-512 registers over VNNI blocks, registered as
// torch.ops.kvyard.vnni_lowbit_linear: the low-bit matmul of CPUs with AVX-512 (BW, VNNI, BF16) but no AMX,
// such as AMD Zen 4: decode steps and prefill chunks alike.
//
// The codes sit in the low-bit VNNI blocks of vnni_blocks.h (as amx_lowbit.cpp reads them): 32-column blocks, each
// a sequential stream of rows holding a pair of k for each of its 32 columns. Each row's
// pairs widen into the columns' lanes directly, so every output column is one lane's sum: no horizontal sums,
// which on a 2-core AMD EPYC (Zen 4) left the row-interleaved kernel (lowbit_linear.cpp) at ~20 G weights a
// second even with the weights in cache, bound by each block's epilogue at SmolLM2's 576-wide rows.
//
// One row of x from amx_linear_lowbit (an AMX CPU's batch-1 int4 decode, int16_row): x rounded to int16 with one
// scale per run of up to 128 values (within a weight group), codes widened to int16, and VPDPWSSD adds each column's pair products into int32, exactly;
// a run's sums are scaled into fp32 once. The rounding of x moves each value by at most 1/65534 of its run's
// largest (below bf16's own rounding for values within 128x of it); int32 sums never overflow (at most 128
// products of 127 * 32767 < 2^31) and round by at most 2^-24 in fp32.
// Every row count of this op's own calls (the AVX-512 CPUs without AMX it is for): codes widened to bf16 (exact for
// these integers; int4 as 128 + u, OR-ed into 128.0's bits) and VDPBF16PS against x's bf16 pairs, exactly as the
// dense kernels sum (fp32, products exact). Each (row, column) is one chain per group whatever the tile, so a row's
// result does not depend on the rows beside it (the batch-invariant path keeps this kernel). A lone row took the
// int16 loop here until 2026-12-07: 120 SmolLM2 Q4_1 decode matmuls ran in 3.1-4.0 ms that way against 3.1-3.5 ms
// through a one-row tile (2-core Zen 4, best of 100, three processes each way alternating).
// Scales and zero terms apply per group to each column's fp32 sum: y = sum_g scale_g * (x . q_g) + zero_g * sum_g(x),
// and outlier columns kept in the model's bf16 (their codes zero) add x[:, cols] . outliers in fp32 (VDPBF16PS
// over the kept columns in pairs).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <array>
#include <utility>
#include <vector>

#include "ops.h"
#include "vec.h"
#include "vnni_blocks.h"

namespace {

using namespace kvyard;
using vnni::kBlockCols;
using vnni::num_groups;
using vnni::Outliers;
using Weight = vnni::LowBitBlocks;

int64_t row_bytes(const Weight& w) { return kBlockCols * 2 * w.bits / 8; }  // one VNNI row: a pair of k, 32 columns
const uint8_t* block(const Weight& w, int64_t nb) { return w.q + nb * (w.k / 2) * row_bytes(w); }

#if defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512BF16__)
constexpr bool kCompiled = true;
constexpr int64_t kMaxRun = 128;  // x values per int16 scale
constexpr int kTileRows = 6;      // rows of x per pass of the several-row loop: 4 x 6 + a few registers

// sums[r][g] = the sum of x's row r over group g, for the zero terms and int4's offset (groups are multiples of 32
// values: whole vectors).
std::vector<float> group_sums(const uint16_t* x, int64_t m, int64_t k, int64_t group) {
  const int64_t groups = num_groups(k, group);
  std::vector<float> sums(m * groups, 0.0f);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      __m512 s = _mm512_setzero_ps();
      const int64_t end = std::min(k, (g + 1) * group);
      for (int64_t i = g * group; i < end; i += 16) s = _mm512_add_ps(s, load_bf16x16(x + r * k + i));
      sums[r * groups + g] = _mm512_reduce_add_ps(s);
    }
  return sums;
}

// The per-column term a group adds beside scale * (x . codes): zero * sum(x), less the offset the widening put
// into the codes (int4: one row 8, several rows 136) times scale * sum(x).
inline __m512 offset_coef(const Weight& w, int64_t g, int64_t col, float offset) {
  __m512 coef = _mm512_mul_ps(_mm512_loadu_ps(w.scale + g * w.n + col), _mm512_set1_ps(-offset));
  return w.zero != nullptr ? _mm512_add_ps(coef, _mm512_loadu_ps(w.zero + g * w.n + col)) : coef;
}

inline void store16(__m512 v, at::BFloat16* out) {
  alignas(64) float tmp[16];
  _mm512_store_ps(tmp, v);
  store_row(tmp, 1.0f, out, 16);
}

// ---- one row: int16 x ------------------------------------------------------------------------------------------

struct Int16X {
  std::vector<int32_t> pairs;  // [k / 2]: x[2p], x[2p + 1] as int16, the broadcast operand of VPDPWSSD
  std::vector<float> scale;    // one per run
  int64_t run;
};

// x's one row as int16 codes: runs are multiples of 16 values (k and groups are multiples of 32), so whole vectors;
// the conversion rounds to nearest even, as nearbyint does in the default rounding mode
Int16X round_x(const uint16_t* x, int64_t k, int64_t group) {
  int64_t run = kMaxRun;
  while (group % run != 0) run /= 2;  // groups hold whole runs (group is a multiple of 32)
  Int16X out{std::vector<int32_t>(k / 2), std::vector<float>(num_groups(k, run)), run};
  auto* codes = reinterpret_cast<int16_t*>(out.pairs.data());
  for (int64_t r = 0; r * run < k; ++r) {
    const int64_t begin = r * run, end = std::min(k, begin + run);
    __m512 amax = _mm512_setzero_ps();
    for (int64_t i = begin; i < end; i += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(load_bf16x16(x + i)));
    const float largest = _mm512_reduce_max_ps(amax);
    out.scale[r] = largest / 32767.0f;
    const __m512 inv = _mm512_set1_ps(largest > 0.0f ? 32767.0f / largest : 0.0f);
    for (int64_t i = begin; i < end; i += 16) {
      const __m512i rounded = _mm512_cvtps_epi32(_mm512_mul_ps(load_bf16x16(x + i), inv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + i), _mm512_cvtsepi32_epi16(rounded));
    }
  }
  return out;
}

// One VNNI row's codes as int16 pairs: columns 0-15 in lo, 16-31 in hi.
template <int kBits>
inline void widen_int16(const uint8_t* row, __m512i& lo, __m512i& hi) {
  if constexpr (kBits == 8) {
    lo = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row)));
    hi = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32)));
  } else {
    const __m512i codes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row)));
    lo = _mm512_and_si512(codes, _mm512_set1_epi16(0x0F));
    hi = _mm512_srli_epi16(codes, 4);
  }
}

// The streams are asked for ahead into L2 (vnni_blocks.h), as the AMX kernel's callers measured it to pay on Intel
// Xeons (on AMD Zen 4 software prefetch in this loop measured slower, session 16; Zen 4 does not come here).
template <int kBits>
void gemv_block(const Weight& w, const Int16X& x, const float* sums, const Outliers& o, const uint32_t* xo, int64_t nb,
                at::BFloat16* out) {
  const uint8_t* b = block(w, nb);
  const int64_t col = nb * kBlockCols, groups = num_groups(w.k, w.group), rb = row_bytes(w);
  vnni::prefetch_block_extras(w.scale, w.zero, o, nb + 1, w.n, groups);
  __m512 y[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  const int64_t runs = num_groups(w.k, x.run);
  for (int64_t g = 0; g < groups; ++g) {
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    const int64_t g_end = std::min(w.k, (g + 1) * w.group);
    for (int64_t r0 = g * w.group; r0 < g_end; r0 += x.run) {
      // the kept pairs a slice per run, read in step with the codes: all at the block's end, their lines came as a
      // burst the prefetchers had not fetched ahead (5 % kept cost int4-g128 layers ~45 % rather than their ~20 % of
      // the bytes; spread, ~30 %)
      const int64_t r = r0 / x.run;
      add_outlier_pairs(o, y, xo, nb, r * o.pairs / runs, (r + 1) * o.pairs / runs);
      // even and odd pairs into separate sums, so that two VPDPWSSD chains hide each other's latency
      __m512i s[2][2] = {{_mm512_setzero_si512(), _mm512_setzero_si512()}, {_mm512_setzero_si512(), _mm512_setzero_si512()}};
      const int64_t p_end = std::min(g_end, r0 + x.run) / 2;
      for (int64_t p = r0 / 2; p < p_end; p += 2) {  // runs hold an even number of pairs
        for (int64_t off = 0; off < 2 * rb; off += 64) vnni::stream_ahead(b + p * rb + off);
        for (int u = 0; u < 2; ++u) {
          __m512i lo, hi;
          widen_int16<kBits>(b + (p + u) * rb, lo, hi);
          const __m512i xp = _mm512_set1_epi32(x.pairs[p + u]);
          s[u][0] = _mm512_dpwssd_epi32(s[u][0], lo, xp);
          s[u][1] = _mm512_dpwssd_epi32(s[u][1], hi, xp);
        }
      }
      const __m512 xs = _mm512_set1_ps(x.scale[r0 / x.run]);
      for (int h = 0; h < 2; ++h)
        acc[h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s[0][h], s[1][h])), xs, acc[h]);
    }
    for (int h = 0; h < 2; ++h) {
      if (sums != nullptr)
        y[h] = _mm512_fmadd_ps(offset_coef(w, g, col + 16 * h, kBits == 4 ? 8.0f : 0.0f), _mm512_set1_ps(sums[g]), y[h]);
      y[h] = _mm512_fmadd_ps(acc[h], _mm512_loadu_ps(w.scale + g * w.n + col + 16 * h), y[h]);
    }
  }
  for (int h = 0; h < 2; ++h) store16(y[h], out + col + 16 * h);
}

// ---- several rows: bf16 x --------------------------------------------------------------------------------------

// One VNNI row as bf16 pairs (columns 0-15 in lo, 16-31 in hi), exactly: int8 through fp32, int4 as 128 + u.
template <int kBits>
inline void widen_bf16(const uint8_t* row, __m512bh& lo, __m512bh& hi) {
  if constexpr (kBits == 8) {
    auto f = [&](int i) {
      return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * i))));
    };
    lo = _mm512_cvtne2ps_pbh(f(1), f(0));
    hi = _mm512_cvtne2ps_pbh(f(3), f(2));
  } else {
    const __m512i nibble = _mm512_set1_epi16(0x000F), bf16_128 = _mm512_set1_epi16(0x4300);
    const __m512i codes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row)));
    lo = (__m512bh)_mm512_ternarylogic_epi32(codes, nibble, bf16_128, 0xEA);  // (codes & 0xF) | 128.0
    hi = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(codes, 4), bf16_128);
  }
}

template <int kBits, int kRows>
void tile(const Weight& w, const uint16_t* x, const float* sums, const Outliers& o, const uint32_t* xo, int64_t nb,
          int64_t m0, at::BFloat16* out) {
  const uint8_t* b = block(w, nb);
  const int64_t col = nb * kBlockCols, groups = num_groups(w.k, w.group), rb = row_bytes(w), pairs = w.k / 2;
  const auto* xp = reinterpret_cast<const uint32_t*>(x + m0 * w.k);
  __m512 y[kRows][2];
  for (int r = 0; r < kRows; ++r) y[r][0] = y[r][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 acc[kRows][2];
    for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const int64_t p_end = std::min(w.k, (g + 1) * w.group) / 2;
    for (int64_t p = g * w.group / 2; p < p_end; ++p) {
      __m512bh lo, hi;
      widen_bf16<kBits>(b + p * rb, lo, hi);
      for (int r = 0; r < kRows; ++r) {
        const __m512bh xr = (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[r * pairs + p]));
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], lo, xr);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], hi, xr);
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m512 scale = _mm512_loadu_ps(w.scale + g * w.n + col + 16 * h);
      const __m512 coef = sums != nullptr ? offset_coef(w, g, col + 16 * h, kBits == 4 ? 136.0f : 0.0f) : scale;
      for (int r = 0; r < kRows; ++r) {
        if (sums != nullptr) y[r][h] = _mm512_fmadd_ps(coef, _mm512_set1_ps(sums[(m0 + r) * groups + g]), y[r][h]);
        y[r][h] = _mm512_fmadd_ps(acc[r][h], scale, y[r][h]);
      }
    }
  }
  for (int r = 0; r < kRows; ++r) {
    add_outlier_pairs(o, y[r], xo + (m0 + r) * o.pairs, nb, 0, o.pairs);
    for (int h = 0; h < 2; ++h) store16(y[r][h], out + (m0 + r) * w.n + col + 16 * h);
  }
}

template <int kBits>
using TileFn = void (*)(const Weight&, const uint16_t*, const float*, const Outliers&, const uint32_t*, int64_t, int64_t,
                        at::BFloat16*);

template <int kBits, int... kRows>
constexpr std::array<TileFn<kBits>, sizeof...(kRows)> tiles(std::integer_sequence<int, kRows...>) {
  return {&tile<kBits, kRows + 1>...};
}

template <int kBits>
void matmul(const uint16_t* x, const Weight& w, const Outliers& o, at::BFloat16* out, int64_t m, bool int16_row) {
  const bool need_sums = kBits == 4 || w.zero != nullptr;
  const std::vector<float> sums = need_sums ? group_sums(x, m, w.k, w.group) : std::vector<float>();
  const float* s = need_sums ? sums.data() : nullptr;
  const std::vector<uint32_t> xo = o.gather(x, m, w.k);
  if (m == 1 && int16_row) {
    const Int16X xq = round_x(x, w.k, w.group);
    at::parallel_for(0, w.n / kBlockCols, 1, [&](int64_t begin, int64_t end) {
      for (int64_t nb = begin; nb < end; ++nb) gemv_block<kBits>(w, xq, s, o, xo.data(), nb, out);
    });
    return;
  }
  static constexpr auto kTiles = tiles<kBits>(std::make_integer_sequence<int, kTileRows>{});  // [r - 1]: r rows
  at::parallel_for(0, w.n / kBlockCols, 1, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb)
      for (int64_t m0 = 0; m0 < m; m0 += kTileRows)
        kTiles[std::min<int64_t>(kTileRows, m - m0) - 1](w, x, s, o, xo.data(), nb, m0, out);
  });
}

#else  // compiled for a CPU without AVX-512 BW, VNNI and BF16: vnni_lowbit_available() says so

constexpr bool kCompiled = false;
template <int kBits>
void matmul(const uint16_t*, const Weight&, const Outliers&, at::BFloat16*, int64_t, bool) {
  TORCH_CHECK(false, "kvyard was compiled for a CPU without AVX-512 VNNI and BF16");
}

#endif

bool vnni_lowbit_available() { return kCompiled; }

}  // namespace

namespace kvyard::ops {

at::Tensor vnni_lowbit_linear_ex(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                                 const std::optional<at::Tensor>& zero, int64_t bits, int64_t group_size,
                                 const std::optional<at::Tensor>& outlier_cols, const std::optional<at::Tensor>& outliers,
                                 bool int16_row) {
  const Outliers o = vnni::outliers_of(q, outlier_cols, outliers);
  return vnni::lowbit_blocks_linear(x, q, scale, zero, bits, group_size,
                                    [&o, int16_row](const uint16_t* xp, const Weight& w, uint16_t* op, int64_t m) {
    auto* out = reinterpret_cast<at::BFloat16*>(op);
    w.bits == 8 ? matmul<8>(xp, w, o, out, m, int16_row) : matmul<4>(xp, w, o, out, m, int16_row);
  });
}

at::Tensor vnni_lowbit_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                              const std::optional<at::Tensor>& zero, int64_t bits, int64_t group_size,
                              const std::optional<at::Tensor>& outlier_cols, const std::optional<at::Tensor>& outliers) {
  return vnni_lowbit_linear_ex(x, q, scale, zero, bits, group_size, outlier_cols, outliers, false);
}

}  // namespace kvyard::ops

TORCH_LIBRARY_FRAGMENT(kvyard, m) {
  m.def("vnni_lowbit_available() -> bool", &vnni_lowbit_available);
  m.def("vnni_lowbit_linear(Tensor x, Tensor q, Tensor scale, Tensor? zero, int bits, int group_size, "
        "Tensor? outlier_cols=None, Tensor? outliers=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvyard, CPU, m) { m.impl("vnni_lowbit_linear", &kvyard::ops::vnni_lowbit_linear); }
