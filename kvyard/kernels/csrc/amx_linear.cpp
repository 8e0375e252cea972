// bf16 linear layers on Intel AMX tiles, registered as torch.ops.kvyard.amx_linear.
//
// A decode step's matmuls have few rows (1 to ~64) and stream every weight from memory once. oneDNN's
// GEMM spends ~20 us per call before any work and, at 32 rows, runs at a third of what the tiles can do
// even with the weight in cache. Here the weight is pre-arranged once (see kvyard/models/linear.py) and a
// call is a plain loop of tile loads and TDPBF16PS over it. Prefill chunks (hundreds of rows) take the
// same loop, blocked so that activations and weights stay in L2: one copy of the weight serves both.
//
// The weight layout is amx.h's VNNI blocks.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "amx.h"
#include "ops.h"
#include "vec.h"

namespace {

using namespace kvyard;
using namespace kvyard::amx;

constexpr int64_t kPanelBytes = 256 * 1024;  // activation rows per pass over the weights: about this many bytes

#ifdef KVYARD_HAS_AMX

// out[rows x 32] (bf16, row stride n) = c + bias, rounded once as oneDNN rounds its fp32 result.
void write_out(float* c, const uint16_t* bias, uint16_t* out, int64_t n, int64_t rows) {
  for (int64_t r = 0; r < rows; ++r) {
    float* cr = c + r * kBlockCols;
    if (bias != nullptr) {
#pragma omp simd
      for (int64_t j = 0; j < kBlockCols; ++j) cr[j] += bf16_to_float(bias[j]);
    }
    store_row(cr, 1.0f, reinterpret_cast<at::BFloat16*>(out + r * n), kBlockCols);
  }
}

// Each thread takes a share of the column blocks. Rows go in panels whose activations stay in L2 while the
// thread's weights stream past once per panel; each 32-column block (36-100 KB) stays in L1 while the
// panel's 32-row blocks pass. A decode step (one panel, one row block) thus reads each weight once.
void amx_matmul(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* out, int64_t m, int64_t n,
                int64_t k) {
  const int64_t k_blocks = k / kTileK, col_blocks = n / kBlockCols;
  const int64_t panel_rows = std::clamp<int64_t>(kPanelBytes / (k * 2) / 32 * 32, 32, 1024);
  at::parallel_for(0, col_blocks, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float c[2 * kTileRows * kBlockCols];
    int64_t configured_rows = -1;
    for (int64_t panel = 0; panel < m; panel += panel_rows) {
      const int64_t panel_end = std::min(m, panel + panel_rows);
      for (int64_t nb = begin; nb < end; ++nb) {
        const uint16_t* b = w + nb * k * kBlockCols;
        const int64_t n0 = nb * kBlockCols;
        for (int64_t m0 = panel; m0 < panel_end; m0 += 2 * kTileRows) {
          const int64_t rows = std::min<int64_t>(2 * kTileRows, panel_end - m0);
          configure_for(rows, configured_rows);
          const bool stream = m0 == panel;  // later row blocks find the block in cache
          if (rows > kTileRows) {
            tile_kernel<true>(x + m0 * k, k * 2, b, k_blocks, stream, c);
          } else {
            tile_kernel<false>(x + m0 * k, k * 2, b, k_blocks, stream, c);
          }
          write_out(c, bias != nullptr ? bias + n0 : nullptr, out + m0 * n + n0, n, rows);
        }
      }
    }
    _tile_release();
  });
}

#else  // compiled for a CPU without AMX: amx_available() says so and nobody calls amx_linear

bool amx_ready() { return false; }
void amx_matmul(const uint16_t*, const uint16_t*, const uint16_t*, uint16_t*, int64_t, int64_t, int64_t) {
  TORCH_CHECK(false, "kvyard was compiled for a CPU without AMX");
}

#endif

bool amx_available() { return amx_ready(); }

}  // namespace

namespace kvyard::ops {

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(amx_ready(), "AMX is not available on this CPU or was refused by the OS");
  return vnni::bf16_blocks_linear(x, packed, bias, amx_matmul);
}

}  // namespace kvyard::ops

TORCH_LIBRARY_FRAGMENT(kvyard, m) {
  m.def("amx_available() -> bool", &amx_available);
  m.def("amx_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvyard, CPU, m) { m.impl("amx_linear", &kvyard::ops::amx_linear); }
