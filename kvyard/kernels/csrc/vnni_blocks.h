// The VNNI-block weight layout (kvyard/kernels/vnni.py) as the four kernels over it see it: AMX and AVX512-BF16
// for bf16 weights (amx_linear.cpp, dpbf16_linear.cpp), AMX and AVX-512 registers for low-bit ones
// (amx_lowbit.cpp, vnni_lowbit.cpp). One place for the shapes they accept and for the call around each loop.
//
// bf16: [N/32, K/2, 32, 2], row p of a block holding W[n, 2p], W[n, 2p + 1] for each of its 32 columns n.
// Low-bit: int8 q in the same order; int4 q + 8 two per byte, [N/32, K/2, 32] uint8, byte i of a row holding
// value i in its low nibble and value i + 32 in its high one; scales and zero terms [groups, N] fp32.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace kvyard::vnni {

constexpr int64_t kBlockCols = 32;  // output columns per block
constexpr int64_t kKStep = 32;      // K is a multiple of this

inline int64_t num_groups(int64_t k, int64_t group) { return (k + group - 1) / group; }  // the last may be short

// out [rows, N] bf16 = x @ W^T (+ bias) for W in bf16 blocks, the loop being
// matmul(x, w, bias or nullptr, out, m, n, k) over raw bf16 bits.
// The product's (m, n, k) once x, the blocks and the bias are checked.
inline std::array<int64_t, 3> check_bf16_blocks(const at::Tensor& x, const at::Tensor& packed,
                                                const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be a bf16 [rows, in] matrix");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.size(1) % (kKStep / 2) == 0 && packed.size(2) == kBlockCols && packed.size(3) == 2,
              "packed must be a contiguous bf16 [out/32, in/2, 32, 2] VNNI layout (in a multiple of 32)");
  const int64_t m = x.size(0), n = packed.size(0) * kBlockCols, k = packed.size(1) * 2;
  TORCH_CHECK(x.size(1) == k, "x has ", x.size(1), " columns, the weight takes ", k);
  if (bias) TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == at::kBFloat16 &&
                            bias->is_contiguous(), "bias must be a contiguous bf16 [out] vector");
  return {m, n, k};
}

template <typename Matmul>
at::Tensor bf16_blocks_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                              Matmul&& matmul) {
  const auto [m, n, k] = check_bf16_blocks(x, packed, bias);
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({m, n}, x.options());
  if (m > 0 && n > 0) {
    matmul(reinterpret_cast<const uint16_t*>(xc.data_ptr()), reinterpret_cast<const uint16_t*>(packed.data_ptr()),
           bias ? reinterpret_cast<const uint16_t*>(bias->data_ptr()) : nullptr,
           reinterpret_cast<uint16_t*>(out.data_ptr()), m, n, k);
  }
  return out;
}

// A low-bit weight in blocks, as the loops read it.
struct LowBitBlocks {
  const uint8_t* q;
  const float* scale;  // [groups, N]
  const float* zero;   // [groups, N], or nullptr
  int64_t n, k, group, bits;
};

// out [rows, N] bf16 = x @ dequantized(W)^T for W in low-bit blocks, the loop being
// matmul(x (contiguous), LowBitBlocks, out bf16 bits, m).
template <typename Matmul>
at::Tensor lowbit_blocks_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                                const std::optional<at::Tensor>& zero, int64_t bits, int64_t group_size,
                                Matmul&& matmul) {
  TORCH_CHECK(bits == 8 || bits == 4, "bits must be 8 or 4, got ", bits);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be a bf16 [rows, in] matrix");
  TORCH_CHECK(q.scalar_type() == (bits == 8 ? at::kChar : at::kByte) && q.is_contiguous() &&
                  q.dim() == (bits == 8 ? 4 : 3) && q.size(2) == kBlockCols && (bits == 4 || q.size(3) == 2) &&
                  q.size(1) % (kKStep / 2) == 0,
              "q must be int8 [out/32, in/2, 32, 2] VNNI blocks (uint8 [out/32, in/2, 32] for int4)");
  const int64_t m = x.size(0), n = q.size(0) * kBlockCols, k = q.size(1) * 2;
  TORCH_CHECK(x.size(1) == k, "x has ", x.size(1), " columns, the weight takes ", k);
  TORCH_CHECK(group_size > 0 && group_size % kKStep == 0, "group_size must be a multiple of 32, got ", group_size);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.dim() == 2 &&
                  scale.size(0) == num_groups(k, group_size) && scale.size(1) == n,
              "scale must be float32 [groups, out]");
  if (zero) TORCH_CHECK(zero->sizes() == scale.sizes() && zero->scalar_type() == at::kFloat && zero->is_contiguous(),
                        "zero must match scale");
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({m, n}, x.options());
  if (m > 0 && n > 0) {
    const LowBitBlocks w{reinterpret_cast<const uint8_t*>(q.data_ptr()), scale.data_ptr<float>(),
                         zero ? zero->data_ptr<float>() : nullptr, n, k, group_size, bits};
    matmul(reinterpret_cast<const uint16_t*>(xc.data_ptr()), w, reinterpret_cast<uint16_t*>(out.data_ptr()), m);
  }
  return out;
}

// Input columns kept in full precision beside the low-bit codes (zero there): y += x[:, cols] . outliers.
struct Outliers {
  const int64_t* cols = nullptr;
  // bf16 [N/32, P, 32, 2], P = ceil(C / 2): the kept columns in pairs, as the dense VNNI blocks hold a weight (the
  // last pair padded with zero), block by block, read in step with the block's codes
  const uint16_t* weights = nullptr;
  int64_t count = 0, pairs = 0;

  // x's values at the kept columns as bf16 pairs, [rows, row_pairs] (row_pairs >= P; the rest zero): the broadcast
  // operand of VDPBF16PS, or (rows padded to whole tile k blocks) the A tiles of the AMX kernel.
  std::vector<uint32_t> gather(const uint16_t* x, int64_t m, int64_t k, int64_t row_pairs = -1) const {
    if (row_pairs < 0) row_pairs = pairs;
    std::vector<uint32_t> xo(m * row_pairs, 0);
    auto* halves = reinterpret_cast<uint16_t*>(xo.data());
    for (int64_t r = 0; r < m; ++r)
      for (int64_t j = 0; j < count; ++j) halves[r * 2 * row_pairs + j] = x[r * k + cols[j]];
    return xo;
  }
};

// The kept columns of a low-bit weight with codes q ([N/32, K/2, ...]), checked; none where both are absent.
inline Outliers outliers_of(const at::Tensor& q, const std::optional<at::Tensor>& outlier_cols,
                            const std::optional<at::Tensor>& outliers) {
  TORCH_CHECK(outlier_cols.has_value() == outliers.has_value(), "outlier_cols and outliers come together");
  if (!outlier_cols) return Outliers{};
  const int64_t n = q.size(0) * kBlockCols, k = q.size(1) * 2, c = outlier_cols->numel();
  TORCH_CHECK(outlier_cols->scalar_type() == at::kLong && outlier_cols->dim() == 1 && outlier_cols->is_contiguous(),
              "outlier_cols must be a contiguous int64 [C] vector");
  TORCH_CHECK(outliers->scalar_type() == at::kBFloat16 && outliers->is_contiguous() &&
                  outliers->sizes() == at::IntArrayRef({n / kBlockCols, (c + 1) / 2, kBlockCols, 2}),
              "outliers must be contiguous bf16 [out/32, ceil(C/2), 32, 2]");
  const int64_t* cols = outlier_cols->data_ptr<int64_t>();
  TORCH_CHECK(std::all_of(cols, cols + c, [k](int64_t j) { return j >= 0 && j < k; }), "outlier column out of range");
  return Outliers{cols, reinterpret_cast<const uint16_t*>(outliers->data_ptr()), c, (c + 1) / 2};
}

#if defined(__AVX512BF16__)
// One-row loops on AMX Xeons ask for their codes 8 KB ahead into L2, and at each block's start for the next block's
// scales, zero terms and kept columns (streams of their own that the code prefetch does not cover). Against 4 KB
// ahead into L1, over 120 SmolLM2 layer matmuls with 5 % kept columns, caches flushed before each pass, alternated
// in one process (21 rounds): int8 6.94 -> 6.46 ms, int4-g128 4.92 -> 4.62 ms; Qwen's shapes 6.29 -> 5.95 and
// 4.74 -> 4.26 ms. A one-row loop computes little per line, and requests into L1 hold a fill buffer each until the
// line arrives, so fewer lines were in flight than the stream needs.
constexpr int64_t kStreamAhead = 8192;

inline void stream_ahead(const void* p) { _mm_prefetch(static_cast<const char*>(p) + kStreamAhead, _MM_HINT_T2); }

inline void prefetch_lines(const void* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(static_cast<const char*>(p) + off, _MM_HINT_T2);
}

// Block nb's scales and zero terms (32 floats per group; zero may be null) and its kept columns, into L2.
inline void prefetch_block_extras(const float* scale, const float* zero, const Outliers& o, int64_t nb, int64_t n,
                                  int64_t groups) {
  for (int64_t g = 0; g < groups; ++g) {
    prefetch_lines(scale + g * n + nb * kBlockCols, kBlockCols * sizeof(float));
    if (zero != nullptr) prefetch_lines(zero + g * n + nb * kBlockCols, kBlockCols * sizeof(float));
  }
  prefetch_lines(o.weights + nb * o.pairs * kBlockCols * 2, o.pairs * kBlockCols * 2 * sizeof(uint16_t));
}

// Block nb's kept pairs [j0, j1) added into one row's sums of its two halves (y[0]: columns 0-15, y[1]: 16-31), in fp32:
// a pair of kept columns a VDPBF16PS per half (bf16 products are exact; one instruction for 32 weights, where widening
// each bf16 weight for an FMA took four for 16 and made 5 % of the columns cost int4-g128 layers ~15 %).
inline void add_outlier_pairs(const Outliers& o, __m512* y, const uint32_t* xo, int64_t nb, int64_t j0, int64_t j1) {
  const uint16_t* w = o.weights + nb * o.pairs * kBlockCols * 2;
  for (int64_t j = j0; j < j1; ++j) {
    const __m512bh xj = (__m512bh)_mm512_set1_epi32(static_cast<int>(xo[j]));
    y[0] = _mm512_dpbf16_ps(y[0], (__m512bh)_mm512_loadu_si512(w + j * 2 * kBlockCols), xj);
    y[1] = _mm512_dpbf16_ps(y[1], (__m512bh)_mm512_loadu_si512(w + j * 2 * kBlockCols + kBlockCols), xj);
  }
}
#endif

}  // namespace kvyard::vnni
