// bf16 linear layers in AVX512-BF16 registers over the VNNI blocks the AMX kernel reads, registered as
// torch.ops.kvyard.dpbf16_linear: the matmul of CPUs with AVX512-BF16 but no AMX (AMD Zen 4, Intel Cooper
// Lake).
//
// There oneDNN's bf16 GEMM streamed SmolLM2's decode weights at ~16 GB/s at one row on a 2-core AMD EPYC
// (Zen 4), and torch.mv ~8 GB/s; this loop reads them at about memory speed (a step's 121 matmuls in 9.7
// against oneDNN's 16.4 ms, python tools/gemm_stream.py) and still ties oneDNN's GEMM at 512 rows, so one copy
// of each weight serves decode and prefill.
//
// Each 32-column block [K/2][32][2] is one sequential stream: for each pair of k, the 32 columns' pairs fill two
// registers, and VDPBF16PS multiplies them with x's pair broadcast, adding both products to each column's fp32
// sum: no horizontal sums. A tile of up to kTileRows rows of x shares each weight load (2 x kTileRows
// accumulators). bf16 x bf16 products are exact in fp32, so each output is an fp32 sum rounded once to bf16.
//
// Every output is one chain over k's pairs in order, whatever the tile it lands in, so a row's result never
// depends on the rows beside it (the batch-invariant path relies on it). One row alone once split its sums over
// two chains to hide the adds' latency; a single chain streamed SmolLM2's 120 decode matmuls in the same time
// (7.8-8.6 against 7.6-8.5 ms on a Zen 4 EPYC): one row is bound by memory, not by the chain.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <array>
#include <type_traits>
#include <utility>

#include "ops.h"
#include "vec.h"
#include "vnni_blocks.h"

namespace {

using namespace kvyard;
using kvyard::vnni::kBlockCols;

constexpr int64_t kPanelBytes = 256 * 1024;  // activation rows per pass over the weights: about this many bytes

#ifdef __AVX512BF16__
constexpr int kTileRows = 12;  // 24 accumulators, two weight registers and a broadcast in the 32 zmm

// out[r, 0..31] (row stride n) = c[r] + bias, rounded once to bf16; an fp32 `Out` gets those bf16 values widened
// (a model's logits as a bf16 matmul gives them, without a separate pass to convert them for sampling).
template <typename Out>
inline void write_rows(const __m512 (*c)[2], int rows, const uint16_t* bias, Out* out, int64_t n) {
  alignas(64) float sums[kBlockCols];
  for (int r = 0; r < rows; ++r) {
    _mm512_store_ps(sums, c[r][0]);
    _mm512_store_ps(sums + 16, c[r][1]);
    if (bias != nullptr) {
#pragma omp simd
      for (int64_t j = 0; j < kBlockCols; ++j) sums[j] += bf16_to_float(bias[j]);
    }
    if constexpr (std::is_same_v<Out, float>) {
#pragma omp simd
      for (int64_t j = 0; j < kBlockCols; ++j) out[r * n + j] = bf16_to_float(float_to_bf16(sums[j]));
    } else {
      store_row(sums, 1.0f, reinterpret_cast<at::BFloat16*>(out + r * n), kBlockCols);
    }
  }
}

inline __m512bh pair_of(const uint32_t* x, int64_t p) { return (__m512bh)_mm512_set1_epi32(static_cast<int>(x[p])); }
inline __m512bh load_bh(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }

// `rows` (1..kTileRows) rows of x [rows, k] against one block b [k/2][32][2].
template <int kRows, typename Out>
void tile(const uint16_t* x, int64_t k, const uint16_t* b, const uint16_t* bias, Out* out, int64_t n) {
  __m512 c[kRows][2];
  for (int r = 0; r < kRows; ++r) c[r][0] = c[r][1] = _mm512_setzero_ps();
  const auto* xp = reinterpret_cast<const uint32_t*>(x);
  const int64_t pairs = k / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512bh w0 = load_bh(b + p * 2 * kBlockCols), w1 = load_bh(b + p * 2 * kBlockCols + kBlockCols);
    for (int r = 0; r < kRows; ++r) {
      const __m512bh xr = pair_of(xp + r * pairs, p);
      c[r][0] = _mm512_dpbf16_ps(c[r][0], w0, xr);
      c[r][1] = _mm512_dpbf16_ps(c[r][1], w1, xr);
    }
  }
  write_rows(c, kRows, bias, out, n);
}

template <typename Out>
using TileFn = void (*)(const uint16_t*, int64_t, const uint16_t*, const uint16_t*, Out*, int64_t);

template <typename Out, int... kRows>
constexpr std::array<TileFn<Out>, sizeof...(kRows)> tiles(std::integer_sequence<int, kRows...>) {
  return {&tile<kRows + 1, Out>...};
}
template <typename Out>  // kTiles<Out>[r - 1]: r rows
constexpr auto kTiles = tiles<Out>(std::make_integer_sequence<int, kTileRows>{});

// Each thread takes a share of the column blocks; rows go in panels whose activations stay in L2 while the
// thread's blocks stream past once per panel (a decode step is one panel: each weight is read once).
template <typename Out>
void matmul(const uint16_t* x, const uint16_t* w, const uint16_t* bias, Out* out, int64_t m, int64_t n, int64_t k) {
  const int64_t panel_rows = std::clamp<int64_t>(kPanelBytes / (k * 2) / kTileRows * kTileRows, kTileRows, 1020);
  at::parallel_for(0, n / kBlockCols, 1, [&](int64_t begin, int64_t end) {
    for (int64_t panel = 0; panel < m; panel += panel_rows) {
      const int64_t panel_end = std::min(m, panel + panel_rows);
      for (int64_t nb = begin; nb < end; ++nb) {
        const int64_t n0 = nb * kBlockCols;
        for (int64_t m0 = panel; m0 < panel_end; m0 += kTileRows) {
          const int64_t rows = std::min<int64_t>(kTileRows, panel_end - m0);
          kTiles<Out>[rows - 1](x + m0 * k, k, w + nb * k * kBlockCols, bias != nullptr ? bias + n0 : nullptr,
                           out + m0 * n + n0, n);
        }
      }
    }
  });
}
constexpr bool kCompiled = true;

#else  // compiled for a CPU without AVX512-BF16: dpbf16_available() says so and nobody calls dpbf16_linear

template <typename Out>
void matmul(const uint16_t*, const uint16_t*, const uint16_t*, Out*, int64_t, int64_t, int64_t) {
  TORCH_CHECK(false, "kvyard was compiled for a CPU without AVX512-BF16");
}
constexpr bool kCompiled = false;

#endif

bool dpbf16_available() { return kCompiled; }

}  // namespace

namespace kvyard::ops {

at::Tensor dpbf16_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  return vnni::bf16_blocks_linear(x, packed, bias, matmul<uint16_t>);
}

// The same product rounded to bf16, handed back as fp32: what linear(x, w).float() gives, in one pass.
at::Tensor dpbf16_linear_f32(const at::Tensor& x, const at::Tensor& packed) {
  const auto [m, n, k] = vnni::check_bf16_blocks(x, packed, std::nullopt);
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({m, n}, x.options().dtype(at::kFloat));
  if (m > 0 && n > 0) {
    matmul<float>(reinterpret_cast<const uint16_t*>(xc.data_ptr()),
                  reinterpret_cast<const uint16_t*>(packed.data_ptr()), nullptr, out.data_ptr<float>(), m, n, k);
  }
  return out;
}

}  // namespace kvyard::ops

TORCH_LIBRARY_FRAGMENT(kvyard, m) {
  m.def("dpbf16_available() -> bool", &dpbf16_available);
  m.def("dpbf16_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  m.def("dpbf16_linear_f32(Tensor x, Tensor packed) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvyard, CPU, m) {
  m.impl("dpbf16_linear", &kvyard::ops::dpbf16_linear);
  m.impl("dpbf16_linear_f32", &kvyard::ops::dpbf16_linear_f32);
}
