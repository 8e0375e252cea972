// AMX tile helpers shared by kvyard's bf16 and low-bit linear kernels (amx_linear.cpp, amx_lowbit.cpp).
//
// Weights sit in VNNI blocks of 32 output columns, [N/32, K/2, 32, 2]: row p of a block holds the pair
// W[n, 2p], W[n, 2p + 1] of each column n in turn, the order TDPBF16PS reads. A 16-column x 32-k B tile is
// 16 such rows, half of each (a 128-byte stride). Tiles 0-3 accumulate C (row block i, column half j at
// 2i + j), 4-5 hold A's two 16-row blocks, 6-7 the two B tiles.
#pragma once

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>

#include "vnni_blocks.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512FP16__)
#define KVYARD_HAS_AMX 1
#endif

namespace kvyard::amx {

constexpr int64_t kTileRows = 16;   // rows of A (and C) per tile
constexpr int64_t kTileK = vnni::kKStep;  // bf16 values of K per tile row: 64 bytes
constexpr int64_t kTileCols = 16;   // output columns per B tile
constexpr int64_t kBlockCols = vnni::kBlockCols;  // output columns per packed block: two B tiles

#ifdef KVYARD_HAS_AMX

// Linux grants a process AMX's 8 KB of tile state only when asked (arch_prctl), once per process.
inline bool request_amx() {
  constexpr int kArchReqXcompPerm = 0x1023;
  constexpr int kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

inline bool amx_ready() {
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
inline void configure_tiles(int rows0, int rows1) {
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

constexpr int64_t kBStride = kBlockCols * 2 * sizeof(uint16_t);  // bytes per VNNI row of a 32-column block
constexpr int64_t kBTileElems = kTileK / 2 * kBlockCols * 2;       // one k block (32 values) of that block

template <bool kTwoRowBlocks>
inline void zero_c() {
  _tile_zero(0);
  _tile_zero(1);
  if (kTwoRowBlocks) {
    _tile_zero(2);
    _tile_zero(3);
  }
}

// A weight streamed from memory is asked for this many bytes ahead of its use. The hardware prefetchers
// alone kept a decode step's weight stream well below memory speed: over SmolLM2's 121 decode matmuls,
// asking 4 KB ahead took the AMX loop to 0.76-0.80x of its time at 32 rows and 0.88-0.99x at one row
// (two alternating runs against the loop without it), and the one-row int8 loop to 0.63x of its time
// with the next line only. Further ahead (8 KB) gained nothing more.
constexpr int64_t kPrefetchAhead = 4096;

// Asks for the `bytes` (a multiple of 64) that follow `p` by kPrefetchAhead.
inline void prefetch_ahead(const void* p, int64_t bytes) {
  const char* ahead = static_cast<const char*>(p) + kPrefetchAhead;
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T0);
}

// C tiles += A[rows x 32 k_blocks] . B over one packed block of 32 columns (two B tiles per k block).
// `stream`: B comes from memory (the first row block of a pass), so it is prefetched ahead.
template <bool kTwoRowBlocks>
inline void accumulate(const uint16_t* a, int64_t a_stride_bytes, const uint16_t* b, int64_t k_blocks, bool stream) {
  const uint16_t* a1 = a + kTileRows * a_stride_bytes / 2;
  for (int64_t kb = 0; kb < k_blocks; ++kb) {
    const uint16_t* bk = b + kb * kBTileElems;
    if (stream) prefetch_ahead(bk, kBTileElems * sizeof(uint16_t));
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
}

// C tiles -> c[32 x 32] fp32 (row stride 32).
template <bool kTwoRowBlocks>
inline void store_c(float* c) {
  constexpr int64_t kStride = kBlockCols * sizeof(float);
  _tile_stored(0, c, kStride);
  _tile_stored(1, c + kTileCols, kStride);
  if (kTwoRowBlocks) {
    _tile_stored(2, c + kTileRows * kBlockCols, kStride);
    _tile_stored(3, c + kTileRows * kBlockCols + kTileCols, kStride);
  }
}

// c[32 x 32] = A[rows x K] . B for one or two 16-row blocks and one packed block of 32 columns.
template <bool kTwoRowBlocks>
inline void tile_kernel(const uint16_t* a, int64_t a_stride_bytes, const uint16_t* b, int64_t k_blocks, bool stream,
                        float* c) {
  zero_c<kTwoRowBlocks>();
  accumulate<kTwoRowBlocks>(a, a_stride_bytes, b, k_blocks, stream);
  store_c<kTwoRowBlocks>(c);
}

// Sets the tile shapes for a block of `rows` (1..32) rows, unless they are set already.
inline void configure_for(int64_t rows, int64_t& configured_rows) {
  if (rows == configured_rows) return;
  configure_tiles(static_cast<int>(std::min(rows, kTileRows)), static_cast<int>(std::max<int64_t>(rows - kTileRows, 0)));
  configured_rows = rows;
}

#endif  // KVYARD_HAS_AMX

}  // namespace kvyard::amx
