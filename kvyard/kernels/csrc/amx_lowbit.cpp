// Weight-only int8 and int4 linear layers on AMX tiles, registered as torch.ops.kvyard.amx_linear_lowbit.
//
// Low-bit weights pay off where a step streams every weight once, as a batch-1 decode does: int8 halves
// the bytes read and int4 quarters them. Each k chunk of a 32-column block is widened to bf16 in a small
// buffer (exactly: these integers are bf16 values) and multiplied on the tiles; the scales (one per column
// and group) and zero points are applied to each group's fp32 sum. The result is the fp32 sum of
// x * (q - zp) * scale with no rounded weight in between, which is what PyTorch's own int8/int4 CPU
// kernels compute. int8 steps of 1-4 rows skip the tiles for AVX-512 dot products on the same bytes (gemv8,
// below); one int4 row takes the AVX-512 kernel's int16 loop (vnni_lowbit.cpp) instead. Outlier columns
// (vnni_blocks.h's Outliers) are added to each block's fp32 sums before they are rounded, on the tiles too.
// Every row count takes this kernel, prefill chunks included (see kWidenWholeRows).
//
// Layouts (built by kvyard/quant/qlinear.py): int8 q in amx.h's VNNI blocks, [N/32, K/2, 32, 2] int8;
// int4 q + 8 in the same order, two per byte, [N/32, K/2, 32] uint8: byte i of a 64-value VNNI row holds
// value i in its low nibble and value i + 32 in its high one. Scales and zero terms are [groups, N] fp32.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "amx.h"
#include "ops.h"
#include "vec.h"

namespace {

using namespace kvyard;
using namespace kvyard::amx;

constexpr int64_t kWidenBlocks = 8;  // k blocks widened per pass: 16 KB of bf16, which stays in L1

using vnni::num_groups;
using vnni::Outliers;

#ifdef KVYARD_HAS_AMX

// `k_blocks` k blocks of one 32-column block, low-bit in `src`, as bf16 VNNI rows in `dst`. Widening is
// this kernel's critical path (a float conversion per value took 3x the tile work), so it stays in
// 16-bit integer ops.
template <int kBits>
void widen(const uint8_t* src, uint16_t* dst, int64_t k_blocks);

// int8: q to fp16 (exact), then fp16's bits to bf16's: the exponent rebiased (+112) and the mantissa's
// three low bits, zero for these integers, dropped. Zero maps to zero through the mask.
template <>
void widen<8>(const uint8_t* src, uint16_t* dst, int64_t k_blocks) {
  const __m512i magnitude = _mm512_set1_epi16(0x7FFF), sign = _mm512_set1_epi16(static_cast<int16_t>(0x8000));
  const __m512i rebias = _mm512_set1_epi16((127 - 15) << 7);
  for (int64_t i = 0; i < k_blocks * kBTileElems; i += 32) {
    const __m512i q = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
    const __m512i h = _mm512_castph_si512(_mm512_cvtepi16_ph(q));
    const __m512i mag = _mm512_add_epi16(_mm512_srli_epi16(_mm512_and_si512(h, magnitude), 3), rebias);
    const __m512i bf = _mm512_or_si512(_mm512_and_si512(h, sign), mag);
    _mm512_storeu_si512(dst + i, _mm512_maskz_mov_epi16(_mm512_test_epi16_mask(q, q), bf));
  }
}

// int4: the stored code u = q + 8 OR-ed into the bits of bf16 128.0 is the bf16 value 128 + u, exactly (the
// binade [128, 256) steps by 1). The tiles then sum x * (q + kInt4Offset); the epilogue takes that back.
constexpr float kInt4Offset = 136.0f;

// One int4 VNNI row (32 bytes) as two vectors of bf16 pairs: columns 0-15 from the low nibbles, 16-31
// from the high ones, each code u OR-ed into 128.0.
inline void int4_row_to_bf16(const uint8_t* row, __m512i& lo, __m512i& hi) {
  const __m512i nibble = _mm512_set1_epi16(0x000F), bf16_128 = _mm512_set1_epi16(0x4300);
  const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row)));
  lo = _mm512_ternarylogic_epi32(bytes, nibble, bf16_128, 0xEA);  // (bytes & 0xF) | 128.0
  hi = _mm512_ternarylogic_epi32(_mm512_srli_epi16(bytes, 4), nibble, bf16_128, 0xEA);
}

template <>
void widen<4>(const uint8_t* src, uint16_t* dst, int64_t k_blocks) {
  for (int64_t r = 0; r < k_blocks * kTileK / 2; ++r) {
    __m512i lo, hi;
    int4_row_to_bf16(src + r * kBlockCols, lo, hi);
    _mm512_storeu_si512(dst + r * 2 * kBlockCols, lo);
    _mm512_storeu_si512(dst + r * 2 * kBlockCols + kBlockCols, hi);
  }
}

// sums[r, g] = the sum of x's row r over group g: the zero-point term and the int4 offset need it.
std::vector<float> group_sums(const uint16_t* x, int64_t m, int64_t k, int64_t group) {
  const int64_t groups = num_groups(k, group);
  std::vector<float> sums(m * groups, 0.0f);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.0f;
      const uint16_t* xr = x + r * k + g * group;
      const int64_t len = std::min(group, k - g * group);
#pragma omp simd reduction(+ : s)
      for (int64_t i = 0; i < len; ++i) s += bf16_to_float(xr[i]);
      sums[r * groups + g] = s;
    }
  }
  return sums;
}

struct LowBitWeight {
  const uint8_t* q;
  const float* scale;  // [groups, N]
  const float* zero;   // [groups, N], or nullptr
  int64_t group;
};

// 16 fp32 lanes -> 16 bf16 outputs, rounded as store_row rounds (every path's epilogue).
inline void store16(__m512 v, uint16_t* out) {
  alignas(64) float tmp[16];
  _mm512_store_ps(tmp, v);
  store_row(tmp, 1.0f, reinterpret_cast<at::BFloat16*>(out), 16);
}

template <int kBits>
constexpr int64_t kPackedKBlock = kBTileElems * kBits / 8;  // one k block of a 32-column block, packed
constexpr int64_t kTilePairs = kTileK / 2;                   // pairs of k per tile row

// What every block of one call shares.
struct TileCall {
  const uint16_t* x;
  LowBitWeight w;
  Outliers o;
  std::vector<float> sums;    // [m, groups]: each row's sum over each group, where the epilogue needs it
  int64_t kept_pairs;         // o.pairs rounded up to whole tile k blocks
  std::vector<uint32_t> xo;   // x's kept values as bf16 pairs, [m, kept_pairs], zero-padded
  int64_t n, k;
  uint16_t* out;
};

// One thread's buffers.
struct TileScratch {
  uint16_t* wide;  // kWidenBlocks k blocks of bf16, or a whole column block when `widened`
  bool widened;
  alignas(64) float c[2 * kTileRows * kBlockCols];
  alignas(64) float acc[2 * kTileRows * kBlockCols];
  alignas(64) uint16_t kept_tail[kBTileElems] = {};  // the last, partial k block of kept pairs, zero-padded
};

// Widens k blocks [kb, kb + count) of column block nb into wide, asking for the codes ahead of use.
template <int kBits>
void widen_blocks(const LowBitWeight& w, int64_t nb, int64_t k_blocks, int64_t kb, int64_t count, uint16_t* wide) {
  const uint8_t* b = w.q + (nb * k_blocks + kb) * kPackedKBlock<kBits>;
  prefetch_ahead(b, count * kPackedKBlock<kBits>);
  widen<kBits>(b, wide, count);
}

// Column block nb's kept weights: the pairs are laid out as B tiles' rows already, so whole k blocks are read in
// place; the last partial one is copied zero-padded into s.kept_tail, once per block for all of its row blocks.
inline const uint16_t* kept_weights(const Outliers& o, int64_t nb, TileScratch& s) {
  const uint16_t* b = o.weights + nb * o.pairs * kBlockCols * 2;
  const int64_t whole = o.pairs / kTilePairs, tail = o.pairs % kTilePairs;
  std::copy(b + whole * kBTileElems, b + whole * kBTileElems + tail * kBlockCols * 2, s.kept_tail);
  return b;
}

// c = x's kept values . the block's kept weights `b` (kept_weights), on the tiles. (A VDPBF16PS per pair and row
// took 5 % kept columns to ~1.5x the layers' time at 512 rows.)
template <bool kTwoRowBlocks>
void kept_columns(const TileCall& call, const uint16_t* b, int64_t m0, TileScratch& s) {
  const auto* a = reinterpret_cast<const uint16_t*>(call.xo.data() + m0 * call.kept_pairs);
  const int64_t a_stride = call.kept_pairs * 4, whole = call.o.pairs / kTilePairs;
  zero_c<kTwoRowBlocks>();
  accumulate<kTwoRowBlocks>(a, a_stride, b, whole, false);
  if (call.o.pairs % kTilePairs > 0) accumulate<kTwoRowBlocks>(a + whole * kTileK, a_stride, s.kept_tail, 1, false);
  store_c<kTwoRowBlocks>(s.c);
}

// One or two 16-row blocks of x against column block nb, rounded into out. `s.widened`: `s.wide` holds the whole
// block in bf16 already (see kWidenWholeRows); otherwise each group's k blocks are widened here, kWidenBlocks at a
// time, into a buffer that stays in L1.
template <int kBits, bool kTwoRowBlocks>
void block_rows(const TileCall& call, int64_t nb, const uint16_t* kept, int64_t m0, int64_t rows, TileScratch& s) {
  const LowBitWeight& w = call.w;
  const int64_t n = call.n, k = call.k;
  const int64_t groups = num_groups(k, w.group), group_blocks = w.group / kTileK, k_blocks = k / kTileK;
  const int64_t n0 = nb * kBlockCols;
  std::fill(s.acc, s.acc + rows * kBlockCols, 0.0f);
  for (int64_t g = 0; g < groups; ++g) {
    zero_c<kTwoRowBlocks>();
    const int64_t group_end = std::min((g + 1) * group_blocks, k_blocks);
    for (int64_t kb = g * group_blocks; kb < group_end; kb += kWidenBlocks) {
      const int64_t count = std::min(kWidenBlocks, group_end - kb);
      if (!s.widened) widen_blocks<kBits>(w, nb, k_blocks, kb, count, s.wide);
      accumulate<kTwoRowBlocks>(call.x + m0 * k + kb * kTileK, k * 2, s.widened ? s.wide + kb * kBTileElems : s.wide,
                                count, false);
    }
    store_c<kTwoRowBlocks>(s.c);
    // y += scale * (c - offset * sum) + zero * sum, with the offset the int4 widening added
    const float* scale = w.scale + g * n + n0;
    const float* zero = w.zero != nullptr ? w.zero + g * n + n0 : nullptr;
    constexpr float kOffset = kBits == 4 ? kInt4Offset : 0.0f;
    alignas(64) float sum_coef[kBlockCols];
    for (int64_t j = 0; j < kBlockCols; ++j) sum_coef[j] = (zero != nullptr ? zero[j] : 0.0f) - kOffset * scale[j];
    for (int64_t r = 0; r < rows; ++r) {
      float* ar = s.acc + r * kBlockCols;
      const float* cr = s.c + r * kBlockCols;
      const float sum = call.sums.empty() ? 0.0f : call.sums[(m0 + r) * groups + g];
#pragma omp simd
      for (int64_t j = 0; j < kBlockCols; ++j) ar[j] += cr[j] * scale[j] + sum_coef[j] * sum;
    }
  }
  if (kept != nullptr) {
    kept_columns<kTwoRowBlocks>(call, kept, m0, s);
    for (int64_t i = 0; i < rows * kBlockCols; ++i) s.acc[i] += s.c[i];
  }
  for (int64_t r = 0; r < rows; ++r)
    store_row(s.acc + r * kBlockCols, 1.0f, reinterpret_cast<at::BFloat16*>(call.out + (m0 + r) * n + n0), kBlockCols);
}

// Past this many rows a call widens each column block whole (64 KB of bf16 per 1,024 of k, in L2) once for all
// of its row blocks; up to it, every 32-row block widens k chunk by k chunk in step with its tiles (in L1). SmolLM2's
// four layer shapes (tools/gemm_stream.py --prefill, int8 / int4-g128): at 512 rows 3.28 / 3.25 ms whole against
// 3.79 / 3.62 chunked, at 128 rows 1.35 / 1.21 against 1.32 / 1.05, at 48 rows 0.91 / 0.56 against 0.76 / 0.50.
constexpr int64_t kWidenWholeRows = 128;

// Each thread takes a share of the 32-column blocks.
template <int kBits>
void lowbit_rows(const uint16_t* x, const LowBitWeight& w, const Outliers& o, uint16_t* out, int64_t m, int64_t n,
                 int64_t k) {
  const int64_t kept_pairs = (o.pairs + kTilePairs - 1) / kTilePairs * kTilePairs;
  const TileCall call{x, w, o,
                      w.zero != nullptr || kBits == 4 ? group_sums(x, m, k, w.group) : std::vector<float>(),
                      kept_pairs, o.gather(x, m, k, kept_pairs), n, k, out};
  const int64_t k_blocks = k / kTileK;
  const bool widen_whole = m > kWidenWholeRows;
  at::parallel_for(0, n / kBlockCols, 1, [&](int64_t begin, int64_t end) {
    std::vector<__m512i> wide((widen_whole ? k_blocks : kWidenBlocks) * kBTileElems / 32);  // 64-byte aligned
    TileScratch s{reinterpret_cast<uint16_t*>(wide.data()), widen_whole};
    int64_t configured_rows = -1;
    for (int64_t nb = begin; nb < end; ++nb) {
      if (widen_whole)
        for (int64_t kb = 0; kb < k_blocks; kb += kWidenBlocks)
          widen_blocks<kBits>(w, nb, k_blocks, kb, std::min(kWidenBlocks, k_blocks - kb), s.wide + kb * kBTileElems);
      const uint16_t* kept = o.count > 0 ? kept_weights(o, nb, s) : nullptr;
      for (int64_t m0 = 0; m0 < m; m0 += 2 * kTileRows) {
        const int64_t rows = std::min<int64_t>(2 * kTileRows, m - m0);
        configure_for(rows, configured_rows);
        if (rows > kTileRows) {
          block_rows<kBits, true>(call, nb, kept, m0, rows, s);
        } else {
          block_rows<kBits, false>(call, nb, kept, m0, rows, s);
        }
      }
    }
    _tile_release();
  });
}

// Rows are taken this many at a time, so that a chunk of x stays in L2 while every column block passes over it
// (each block widened once per chunk). All 2,048 rows of a prefill step at once streamed x from L3 for every
// block: SmolLM2 int4-g128 layers took 5.2 ms a call on average, against 3.5 ms per 4 calls at 512 rows.
constexpr int64_t kRowChunk = 256;

template <int kBits>
void lowbit_matmul(const uint16_t* x, const LowBitWeight& w, const Outliers& o, uint16_t* out, int64_t m, int64_t n,
                   int64_t k) {
  for (int64_t m0 = 0; m0 < m; m0 += kRowChunk)
    lowbit_rows<kBits>(x + m0 * k, w, o, out + m0 * n, std::min(kRowChunk, m - m0), n, k);
}

// ---- int8, a few rows (a batch-1 decode): AVX-512 dot products on the packed bytes, no tiles ----
//
// With one row the tiles do 1/16 of useful work, and the widening buffer costs a store and a reload per
// weight; these loops widen in registers and stream the weight at memory speed. Same layout, same result
// (fp32 sums of exact products; scales and zero terms per group). They beat the tiles up to this many rows
// (SmolLM2's 120 layer matmuls, alternating: int8 6.1 / 6.6 / 7.5 ms at 1 / 2 / 4 rows against ~10 ms on
// the tiles). Their codes and each next block's scales and kept columns are asked for ahead into L2
// (vnni_blocks.h's stream_ahead and prefetch_block_extras).
constexpr int64_t kGemv8MaxRows = 4;

using vnni::prefetch_block_extras;
using vnni::stream_ahead;

// int8, M rows: each 16 bytes of a VNNI row (8 columns x a pair of k) to fp32, and one FMA per row of x
// against its pair (x[2p], x[2p + 1]) broadcast; lanes 2c and 2c + 1 are added at the end.
template <int M>
void gemv8_block(const float* xf, const LowBitWeight& w, const float* sums, const Outliers& o, const uint32_t* xo,
                 int64_t nb, int64_t n, int64_t k, uint16_t* out) {
  const int64_t groups = num_groups(k, w.group), pairs = k / 2, n0 = nb * kBlockCols;
  const int8_t* b = reinterpret_cast<const int8_t*>(w.q) + nb * pairs * 2 * kBlockCols;
  prefetch_block_extras(w.scale, w.zero, o, nb + 1, n, groups);
  const __m512i evens = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odds = _mm512_add_epi32(evens, _mm512_set1_epi32(1));
  __m512 y[M][2];
  for (int r = 0; r < M; ++r) y[r][0] = y[r][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 a[M][4];
    for (int r = 0; r < M; ++r) a[r][0] = a[r][1] = a[r][2] = a[r][3] = _mm512_setzero_ps();
    const int64_t p_end = std::min(pairs, (g + 1) * w.group / 2);
    for (int64_t p = g * w.group / 2; p < p_end; ++p) {
      const int8_t* row = b + p * 2 * kBlockCols;
      stream_ahead(row);
      __m512 wq[4];
      for (int i = 0; i < 4; ++i)
        wq[i] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * i))));
      for (int r = 0; r < M; ++r) {
        double pair;
        std::memcpy(&pair, xf + r * k + 2 * p, 8);
        const __m512 xp = _mm512_castpd_ps(_mm512_set1_pd(pair));
        for (int i = 0; i < 4; ++i) a[r][i] = _mm512_fmadd_ps(wq[i], xp, a[r][i]);
      }
    }
    for (int h = 0; h < 2; ++h) {  // y += scale * dot + zero * sum
      const __m512 scale = _mm512_loadu_ps(w.scale + g * n + n0 + 16 * h);
      const __m512 zero = w.zero != nullptr ? _mm512_loadu_ps(w.zero + g * n + n0 + 16 * h) : _mm512_setzero_ps();
      for (int r = 0; r < M; ++r) {
        const __m512 dot = _mm512_add_ps(_mm512_permutex2var_ps(a[r][2 * h], evens, a[r][2 * h + 1]),
                                         _mm512_permutex2var_ps(a[r][2 * h], odds, a[r][2 * h + 1]));
        const __m512 s = _mm512_set1_ps(sums == nullptr ? 0.0f : sums[r * groups + g]);
        y[r][h] = _mm512_fmadd_ps(dot, scale, _mm512_fmadd_ps(zero, s, y[r][h]));
      }
    }
  }
  for (int r = 0; r < M; ++r) {
    add_outlier_pairs(o, y[r], xo + r * o.pairs, nb, 0, o.pairs);
    for (int h = 0; h < 2; ++h) store16(y[r][h], out + r * n + n0 + 16 * h);
  }
}

template <int M>
void gemv8(const float* xf, const LowBitWeight& w, const float* sums, const Outliers& o, const uint32_t* xo, int64_t n,
           int64_t k, uint16_t* out) {
  at::parallel_for(0, n / kBlockCols, 1, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb) gemv8_block<M>(xf, w, sums, o, xo, nb, n, k, out);
  });
}

// 1-4 rows of int8; each thread takes a share of the 32-column blocks, as on the tiles.
void lowbit_gemv8(const uint16_t* x, const LowBitWeight& w, const Outliers& o, uint16_t* out, int64_t m, int64_t n,
                  int64_t k) {
  const std::vector<float> sums = w.zero != nullptr ? group_sums(x, m, k, w.group) : std::vector<float>();
  const float* s = sums.empty() ? nullptr : sums.data();
  const std::vector<uint32_t> xo = o.gather(x, m, k);
  std::vector<float> xf(m * k);  // fp32 pairs broadcast straight from memory
  for (int64_t i = 0; i < m * k; ++i) xf[i] = bf16_to_float(x[i]);
  switch (m) {
    case 1: gemv8<1>(xf.data(), w, s, o, xo.data(), n, k, out); break;
    case 2: gemv8<2>(xf.data(), w, s, o, xo.data(), n, k, out); break;
    case 3: gemv8<3>(xf.data(), w, s, o, xo.data(), n, k, out); break;
    default: gemv8<4>(xf.data(), w, s, o, xo.data(), n, k, out); break;
  }
}

#endif

}  // namespace

namespace kvyard::ops {

at::Tensor amx_linear_lowbit(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                             const std::optional<at::Tensor>& zero, int64_t bits, int64_t group_size,
                             const std::optional<at::Tensor>& outlier_cols, const std::optional<at::Tensor>& outliers) {
  // One int4 row: the AVX-512 kernel's loop (x rounded to int16 per run, VPDPWSSD) with the streams prefetched into
  // L2 takes fewer instructions per weight than widening each code to bf16 for VDPBF16PS, which left this loop
  // partly compute-bound: SmolLM2 int4-g128 h8o5 decode 1.87-1.88x -> 1.99x bf16, Qwen2.5-Coder-0.5B 2.12x -> 2.25x
  // (tools/quant_decode_rates.py, two processes each way, two models stepped in turn).
  if (bits == 4 && x.dim() == 2 && x.size(0) == 1)
    return vnni_lowbit_linear_ex(x, q, scale, zero, bits, group_size, outlier_cols, outliers, /*int16_row=*/true);
  const Outliers o = vnni::outliers_of(q, outlier_cols, outliers);
  return vnni::lowbit_blocks_linear(x, q, scale, zero, bits, group_size,
                                    [&o](const uint16_t* xp, const vnni::LowBitBlocks& b, uint16_t* op, int64_t m) {
#ifdef KVYARD_HAS_AMX
    TORCH_CHECK(amx_ready(), "AMX is not available on this CPU or was refused by the OS");
    const LowBitWeight w{b.q, b.scale, b.zero, b.group};
    if (b.bits == 8 && m <= kGemv8MaxRows) {
      lowbit_gemv8(xp, w, o, op, m, b.n, b.k);
    } else {
      b.bits == 8 ? lowbit_matmul<8>(xp, w, o, op, m, b.n, b.k) : lowbit_matmul<4>(xp, w, o, op, m, b.n, b.k);
    }
#else
    TORCH_CHECK(false, "kvyard was compiled for a CPU without AMX");
#endif
  });
}

}  // namespace kvyard::ops

TORCH_LIBRARY_FRAGMENT(kvyard, m) {
  m.def("amx_linear_lowbit(Tensor x, Tensor q, Tensor scale, Tensor? zero, int bits, int group_size, "
        "Tensor? outlier_cols=None, Tensor? outliers=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvyard, CPU, m) { m.impl("amx_linear_lowbit", &kvyard::ops::amx_linear_lowbit); }
