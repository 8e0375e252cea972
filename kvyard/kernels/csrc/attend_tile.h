// Attention of a prompt's tokens as rows that share one block table, tile by tile: the batch-invariant path gives
// each prompt token to the paged decode kernel as a row over its own prefix (decode_attention.cpp), and attend_tile
// takes up to kTileRows such rows at once with each row's result the decode step's to the bit.
#pragma once

#include <algorithm>
#include <type_traits>
#include <vector>

#include "attention_lanes.h"

namespace kvyard {

// Rows attended together where they share a block table (attend_tile).
constexpr int64_t kTileRows = 16;

// The rows of a tile: consecutive rows of the call that share one block table (a prompt's tokens on the
// batch-invariant path, each attending to its own prefix), within one chunk of their context.
struct TileRows {
  int64_t count = 0;
  const uint16_t* q[kTileRows];  // each row's G query heads of this KV head
  int64_t len[kTileRows];        // positions of this chunk each row attends
  uint16_t* out[kTileRows];
  float* partial[kTileRows];     // null unless the row's context is cut into chunks
};

template <typename C>
using TileKernel = void (*)(const TileRows&, int64_t, const C*, const C*, const float*, const float*, const int64_t*,
                            int64_t, int64_t, int64_t, float, std::vector<float>&);

#ifdef KVYARD_HEAD_KERNEL
// Positions of context widened at a time: 64 K (or V) rows of 64 fp32 values are 16 KB, which stay in L1 while
// every row and query head of the tile takes them. (Widening a whole 512-position chunk at once left each
// (row, head) streaming 256 KB from L2 per pass: 28-64 cycles per row, head and position on a Zen 3 EPYC.)
constexpr int64_t kSpanBytes = 16384;

// The same result for every row as attend_head<D, G, C>, operation for operation, for a tile of rows sharing one
// block table. The context is taken a span of positions at a time: its K (then V) rows of this head are widened
// to fp32 once for the whole tile (exactly: bf16 is a float's top half; int8 times its scale as Lanes::load
// multiplies), and every (row, query head) of the tile takes the span. Each row's scores are cut into fours and
// lone positions by cache block as for_each_token cuts them for its own length; its softmax is over its own
// length; its accumulators add positions in order, resting in memory between spans (a float stored and loaded is
// the same float). So a prompt token's attention is the decode step's, whichever rows share its call.
template <int D, typename C>
void attend_tile(const TileRows& rows, int64_t group, const C* k, const C* v, const float* k_scale,
                 const float* v_scale, const int64_t* table, int64_t block_size, int64_t kv_heads, int64_t head,
                 float scale, std::vector<float>& buf) {
  constexpr int NV = D / kLanes;
  constexpr int64_t row_bytes = D * sizeof(C);
  const int64_t n = *std::max_element(rows.len, rows.len + rows.count), pairs = rows.count * group;  // (row, query head)
  const int64_t span = std::max<int64_t>(1, kSpanBytes / (D * 4) / block_size) * block_size;
  buf.resize(span * D + pairs * (n + 2 * D + 2));
  float *widened = buf.data(), *scores = widened + span * D, *qs = scores + pairs * n, *accs = qs + pairs * D;
  float *max = accs + pairs * D, *inv_sum = max + pairs;
  auto widen = [&](const C* cache, const float* scales, int64_t s0, int64_t s1) {
    for (int64_t t = s0; t < s1; ++t) {
      const int64_t at = (table[t / block_size] * block_size + t % block_size) * kv_heads + head;
      const float s = scales ? scales[at] : 1.0f;
      for (int i = 0; i < NV; ++i)
        Lanes::storeu(widened + (t - s0) * D + i * kLanes, Lanes::load(cache + at * D + i * kLanes, s));
    }
  };
  for (int64_t h = 0; h < pairs; ++h) {
    V qv[NV];
    scaled_query<NV>(rows.q[h / group] + (h % group) * D, scale, qv);
    for (int i = 0; i < NV; ++i) Lanes::storeu(qs + h * D + i * kLanes, qv[i]);
  }
  for (int64_t s0 = 0; s0 < n; s0 += span) {
    const int64_t s1 = std::min(n, s0 + span);
    widen(k, k_scale, s0, s1);
    for (int64_t h = 0; h < pairs; ++h) {
      const int64_t len = rows.len[h / group];
      V qv[NV], a[8];
      for (int i = 0; i < NV; ++i) qv[i] = Lanes::loadf(qs + h * D + i * kLanes);
      float* row_scores = scores + h * n;
      for (int64_t t0 = s0; t0 < std::min(len, s1); t0 += block_size) {  // for_each_token's cut, block by block
        const int64_t end = std::min(len, t0 + block_size);
        int64_t t = t0;
        for (; t + 8 <= end; t += 8) {  // two fours at once: eight FMA chains in flight rather than four
          interleaved_scores<NV, 8>(qv, widened + (t - s0) * D, a);
          _mm_storeu_ps(row_scores + t, Lanes::sum4(a[0], a[1], a[2], a[3]));
          _mm_storeu_ps(row_scores + t + 4, Lanes::sum4(a[4], a[5], a[6], a[7]));
        }
        for (; t + 4 <= end; t += 4) {
          interleaved_scores<NV, 4>(qv, widened + (t - s0) * D, a);
          _mm_storeu_ps(row_scores + t, Lanes::sum4(a[0], a[1], a[2], a[3]));
        }
        for (; t < end; ++t) {
          interleaved_scores<NV, 1>(qv, widened + (t - s0) * D, a);
          row_scores[t] = Lanes::sum(a[0]);
        }
      }
    }
  }
  for (int64_t h = 0; h < pairs; ++h) inv_sum[h] = softmax_unnormalized(scores + h * n, rows.len[h / group], &max[h]);
  std::fill(accs, accs + pairs * D, 0.0f);
  for (int64_t s0 = 0; s0 < n; s0 += span) {
    const int64_t s1 = std::min(n, s0 + span);
    widen(v, v_scale, s0, s1);
    for (int64_t h = 0; h < pairs; ++h) {
      const float* p = scores + h * n;
      V acc[NV];
      for (int i = 0; i < NV; ++i) acc[i] = Lanes::loadf(accs + h * D + i * kLanes);
      for (int64_t t = s0; t < std::min(rows.len[h / group], s1); ++t) {
        const V pt = Lanes::set1(p[t]);
        for (int i = 0; i < NV; ++i) acc[i] = Lanes::fmadd(pt, Lanes::loadf(widened + (t - s0) * D + i * kLanes), acc[i]);
      }
      for (int i = 0; i < NV; ++i) Lanes::storeu(accs + h * D + i * kLanes, acc[i]);
    }
  }
  for (int64_t h = 0; h < pairs; ++h) {
    V acc[NV];
    for (int i = 0; i < NV; ++i) acc[i] = Lanes::loadf(accs + h * D + i * kLanes);
    finish_lanes<D>(acc, max[h], inv_sum[h], rows.out[h / group] + (h % group) * D,
                    offset(rows.partial[h / group], (h % group) * (D + 2)));
  }
}

#endif  // KVYARD_HEAD_KERNEL

// The cache as attend_tile (and attend_head) read it: bf16 as its raw bits, int8 as is.
template <typename C>
using RawCache = std::conditional_t<std::is_same_v<C, at::BFloat16>, uint16_t, C>;

// The tile kernel for bf16 queries (Q) over cache C at this head size and group, where attend_head would take the
// rows one by one; null where there is none (fp32, other sizes, a build without the register kernels).
template <typename Q, typename C>
TileKernel<RawCache<C>> tile_kernel(int64_t d, int64_t group) {
#ifdef KVYARD_HEAD_KERNEL
  if constexpr (std::is_same_v<Q, at::BFloat16> && !std::is_same_v<C, float>) {
    if (group < 1 || group > 8) return nullptr;
    if (d == 64) return &attend_tile<64, RawCache<C>>;
    if (d == 128) return &attend_tile<128, RawCache<C>>;
  }
#endif
  return nullptr;
}

}  // namespace kvyard
