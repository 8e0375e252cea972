// bf16 linear layers on Intel AMX tiles, registered as torch.ops.kvyard.amx_linear.
//
// A decode step's matmuls have few rows (1 to ~64) and stream every weight from memory once. oneDNN's
// GEMM spends ~20 us per call before any work and, at 32 rows, runs at a third of what the tiles can do
// even with the weight in cache. Here the weight is pre-arranged once (see kvyard/models/linear.py) and a
// call is a plain loop of tile loads and TDPBF16PS over it. Prefill chunks (hundreds of rows) take the
// same loop, blocked so that activations and weights stay in L2: one copy of the weight serves both.
//
// Layout, [N/32, K/2, 32, 2] bf16: for each block of 32 output columns, row p holds the pair W[n, 2p],
// W[n, 2p + 1] of each column n in turn -- the VNNI order TDPBF16PS reads. A 16-column x
// 32-k B tile is 16 such rows, half of each (a 128-byte stride).
#include <ATen/Parallel.h>
#include <sys/syscall.h>
#include <torch/library.h>
#include <unistd.h>

#include <vector>

#include "vec.h"

namespace {

using namespace kvyard;

constexpr int64_t kTileRows = 16;   // rows of A (and C) per tile
constexpr int64_t kTileK = 32;      // bf16 values of K per tile row: 64 bytes
constexpr int64_t kTileCols = 16;   // output columns per B tile
constexpr int64_t kBlockCols = 32;  // output columns per packed block: two B tiles
constexpr int64_t kPanelBytes = 256 * 1024;  // activation rows per pass over the weights: about this many bytes

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)

// Linux grants a process AMX's 8 KB of tile state only when asked (arch_prctl), once per process.
bool request_amx() {
  constexpr int kArchReqXcompPerm = 0x1023;
  constexpr int kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

bool amx_ready() {
  static const bool ok = request_amx();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3 accumulate C (row block i, column block j at 2i + j), 4-5 hold A's two row blocks, 6-7 B's two
// column blocks. rows1 is 0 when the call has at most 16 rows left.
void configure_tiles(int rows0, int rows1) {
  TileConfig cfg;
  auto set = [&cfg](int tile, int rows, int colsb) {
    cfg.rows[tile] = static_cast<uint8_t>(rows);
    cfg.colsb[tile] = static_cast<uint16_t>(rows > 0 ? colsb : 0);
  };
  set(0, rows0, 64);
  set(1, rows0, 64);
  set(2, rows1, 64);
  set(3, rows1, 64);
  set(4, rows0, 64);
  set(5, rows1, 64);
  set(6, 16, 64);
  set(7, 16, 64);
  _tile_loadconfig(&cfg);
}

// C[32 x 32] (fp32, row stride 32) = A[rows x K] . B for one or two 16-row blocks and one packed block of
// 32 columns (two B tiles, 128 bytes apart within each row).
template <bool kTwoRowBlocks>
void tile_kernel(const uint16_t* a, int64_t a_stride_bytes, const uint16_t* b, int64_t k_blocks, float* c) {
  constexpr int64_t kBStride = kBlockCols * 2 * sizeof(uint16_t);
  constexpr int64_t kBTileElems = kTileK / 2 * kBlockCols * 2;  // one k block of the 32-column block
  _tile_zero(0);
  _tile_zero(1);
  if (kTwoRowBlocks) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const uint16_t* a1 = a + kTileRows * a_stride_bytes / 2;
  for (int64_t kb = 0; kb < k_blocks; ++kb) {
    const uint16_t* bk = b + kb * kBTileElems;
    _tile_loadd(4, a + kb * kTileK, a_stride_bytes);
    _tile_loadd(6, bk, kBStride);
    _tile_loadd(7, bk + 2 * kTileCols, kBStride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (kTwoRowBlocks) {
      _tile_loadd(5, a1 + kb * kTileK, a_stride_bytes);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  constexpr int64_t kStride = kBlockCols * sizeof(float);
  _tile_stored(0, c, kStride);
  _tile_stored(1, c + kTileCols, kStride);
  if (kTwoRowBlocks) {
    _tile_stored(2, c + kTileRows * kBlockCols, kStride);
    _tile_stored(3, c + kTileRows * kBlockCols + kTileCols, kStride);
  }
}

// out[rows x 32] (bf16, row stride n) = c + bias, rounded once as oneDNN rounds its fp32 result.
void write_out(const float* c, const uint16_t* bias, uint16_t* out, int64_t n, int64_t rows) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* cr = c + r * kBlockCols;
    uint16_t* o = out + r * n;
    if (bias != nullptr) {
#pragma omp simd
      for (int64_t j = 0; j < kBlockCols; ++j) o[j] = float_to_bf16(cr[j] + bf16_to_float(bias[j]));
    } else {
#pragma omp simd
      for (int64_t j = 0; j < kBlockCols; ++j) o[j] = float_to_bf16(cr[j]);
    }
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
          if (rows != configured_rows) {
            configure_tiles(static_cast<int>(std::min(rows, kTileRows)),
                            static_cast<int>(std::max<int64_t>(rows - kTileRows, 0)));
            configured_rows = rows;
          }
          if (rows > kTileRows) {
            tile_kernel<true>(x + m0 * k, k * 2, b, k_blocks, c);
          } else {
            tile_kernel<false>(x + m0 * k, k * 2, b, k_blocks, c);
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

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be a bf16 [rows, in] matrix");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.size(1) % (kTileK / 2) == 0 && packed.size(2) == kBlockCols && packed.size(3) == 2,
              "packed must be a contiguous bf16 [out/32, in/2, 32, 2] VNNI layout (in a multiple of 32)");
  const int64_t m = x.size(0), n = packed.size(0) * kBlockCols, k = packed.size(1) * 2;
  TORCH_CHECK(x.size(1) == k, "x has ", x.size(1), " columns, the weight takes ", k);
  if (bias) TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == at::kBFloat16 &&
                            bias->is_contiguous(), "bias must be a contiguous bf16 [out] vector");
  TORCH_CHECK(amx_ready(), "AMX is not available on this CPU or was refused by the OS");
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({m, n}, x.options());
  if (m > 0) {
    amx_matmul(reinterpret_cast<const uint16_t*>(xc.data_ptr()), reinterpret_cast<const uint16_t*>(packed.data_ptr()),
               bias ? reinterpret_cast<const uint16_t*>(bias->data_ptr()) : nullptr,
               reinterpret_cast<uint16_t*>(out.data_ptr()), m, n, k);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvyard, m) {
  m.def("amx_available() -> bool", &amx_available);
  m.def("amx_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvyard, CPU, m) { m.impl("amx_linear", &amx_linear); }
