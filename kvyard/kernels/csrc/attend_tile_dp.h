// A prompt's attention on AVX512-BF16: a tile's rows against their shared context as two small matrix products on
// VDPBF16PS, where attend_tile repeats the decode kernel's fp32 chain row by row. (On the batch-invariant path a
// decode takes this kernel too, as a tile of one row, so that its attention stays a prompt token's.) Each instruction takes 32 bf16 products where an fp32 FMA takes 16, and no score needs a horizontal
// sum: the scores come out 16 positions to a register. The price is two roundings attend_tile does not make: the
// products pair up before they are added, and the softmax weights are rounded to bf16 before they weight V (as in
// flash attention's bf16 kernels). Softmax stays exact over each row's own length, in fp32.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "attend_tile.h"

namespace kvyard {

#if defined(__AVX512BF16__) && defined(KVYARD_HEAD_KERNEL)

// Sixteen rows of 16 dwords into their columns, in place: pairs of rows interleaved, then pairs of pairs, leave
// each 128-bit lane holding four rows of one column; the lane shuffles then gather a column's four lanes.
inline void transpose16(__m512i r[16]) {
  __m512i u[16];
  for (int g = 0; g < 16; g += 4) {
    const __m512i t0 = _mm512_unpacklo_epi32(r[g], r[g + 1]), t1 = _mm512_unpackhi_epi32(r[g], r[g + 1]);
    const __m512i t2 = _mm512_unpacklo_epi32(r[g + 2], r[g + 3]), t3 = _mm512_unpackhi_epi32(r[g + 2], r[g + 3]);
    u[g] = _mm512_unpacklo_epi64(t0, t2);  // lane L: rows g..g+3 of column 4L
    u[g + 1] = _mm512_unpackhi_epi64(t0, t2);  // ... of column 4L + 1
    u[g + 2] = _mm512_unpacklo_epi64(t1, t3);
    u[g + 3] = _mm512_unpackhi_epi64(t1, t3);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i a01 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), a23 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
    const __m512i b01 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
    const __m512i b23 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(a01, b01, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(a01, b01, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(a23, b23, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(a23, b23, 0xDD);
  }
}

// The context rearranged once per tile, so that both products read it 16 lanes at a time:
// kt[i * np + t] is K[t]'s i-th pair of values (dims 2i, 2i + 1), so a register holds one pair of 16 positions;
// vp[j * D + d] holds V[2j][d] and V[2j + 1][d], so a register holds one pair of positions for 16 dims.
// Positions from n up to np are zeros: a product over them adds nothing, and nothing there is NaN.
template <int D>
inline void rearrange_context(const uint16_t* k, const uint16_t* v, const int64_t* table, int64_t block_size,
                              int64_t kv_heads, int64_t head, int64_t n, int64_t np, uint32_t* kt, uint32_t* vp) {
  // Interleaves two V rows' 32 values: dword d of the result is (a[d], b[d]); lo takes dims 0-15, hi 16-31.
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37,
                                      5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16)), zero = _mm512_setzero_si512();
  // A decode's context is cold (a prompt's was just written): its blocks are asked for ahead, as the decode kernel
  // asks (attention_lanes.h); without it, waiting on K's rows took a fifth of a 32-row decode step's attention.
  constexpr int64_t row_bytes = D * sizeof(uint16_t);
  const SlotSpan k_span{reinterpret_cast<const char*>(k), kv_heads * row_bytes, head * row_bytes, row_bytes};
  const SlotSpan v_span{reinterpret_cast<const char*>(v), kv_heads * row_bytes, head * row_bytes, row_bytes};
  const int64_t blocks = (n + block_size - 1) / block_size;
  int64_t next_fetch = 0;  // the first block not asked for yet
  auto fetch_through = [&](int64_t b) {
    for (; next_fetch <= std::min(b, blocks - 1); ++next_fetch) {
      prefetch_block(table, next_fetch, block_size, k_span);
      prefetch_block(table, next_fetch, block_size, v_span);
    }
  };
  int64_t at[16];  // this group's rows in the cache (slot * kv_heads + head), -1 past n
  int64_t block = 0, in_block = 0;  // position t's place in the table, stepped rather than divided
  for (int64_t t = 0; t < np; t += 16) {
    fetch_through(block + kBlocksAhead);
    for (int u = 0; u < 16; ++u) {
      at[u] = t + u < n ? (table[block] * block_size + in_block) * kv_heads + head : -1;
      if (++in_block == block_size) in_block = 0, ++block;
    }
    for (int c = 0; c < D; c += 32) {  // 16 dword pairs of 16 positions at a time
      __m512i r[16];
      for (int u = 0; u < 16; ++u) r[u] = at[u] >= 0 ? _mm512_loadu_si512(k + at[u] * D + c) : zero;
      transpose16(r);
      for (int i = 0; i < 16; ++i) _mm512_storeu_si512(kt + (c / 2 + i) * np + t, r[i]);
    }
    for (int u = 0; u < 16; u += 2) {
      for (int c = 0; c < D; c += 32) {
        const __m512i a = at[u] >= 0 ? _mm512_loadu_si512(v + at[u] * D + c) : zero;
        const __m512i b = at[u + 1] >= 0 ? _mm512_loadu_si512(v + at[u + 1] * D + c) : zero;
        _mm512_storeu_si512(vp + ((t + u) / 2) * D + c, _mm512_permutex2var_epi16(a, lo, b));
        _mm512_storeu_si512(vp + ((t + u) / 2) * D + c + 16, _mm512_permutex2var_epi16(a, hi, b));
      }
    }
  }
}

// attend_tile's contract (TileRows, one KV head, a bf16 cache), computed as described above, QB row-heads (a row's
// query head) at a time. QB does not change any result: every score and every weighted sum is its own chain.
template <int D, int QB>
void attend_tile_dp_by(const TileRows& rows, int64_t group, const uint16_t* k, const uint16_t* v, const float*,
                    const float*, const int64_t* table, int64_t block_size, int64_t kv_heads, int64_t head,
                    float scale, std::vector<float>& buf) {
  constexpr int NV = D / kLanes, DP = D / 2;
  constexpr int PB = D == 64 ? QB : 2;  // row-heads whose weighted sums are computed together: up to 16 accumulators
  const int64_t pairs = rows.count * group;  // (row, query head)
  auto len_of = [&](int64_t h) { return rows.len[h / group]; };
  // The longest context among row-heads h0 .. h0 + B - 1 (those that exist): how far a block of them reads.
  auto longest = [&](int64_t h0, int B) {
    int64_t upto = 0;
    for (int64_t h = h0; h < std::min(pairs, h0 + B); ++h) upto = std::max(upto, len_of(h));
    return upto;
  };
  const int64_t n = *std::max_element(rows.len, rows.len + rows.count), np = (n + 31) / 32 * 32;
  buf.resize(2 * DP * np + pairs * np + 2 * pairs);
  uint32_t* kt = reinterpret_cast<uint32_t*>(buf.data());
  uint32_t* vp = kt + DP * np;
  float* scores = reinterpret_cast<float*>(vp + DP * np);  // one row of np per row-head; then its bf16 weights
  float *max = scores + pairs * np, *inv_sum = max + pairs;
  rearrange_context<D>(k, v, table, block_size, kv_heads, head, n, np, kt, vp);
  const __m512 scale_v = _mm512_set1_ps(scale);
  for (int64_t h0 = 0; h0 < pairs; h0 += QB) {
    const uint32_t* q[QB];
    for (int b = 0; b < QB; ++b) {
      const int64_t h = std::min(h0 + b, pairs - 1);  // past the last: repeats it, stored nowhere
      q[b] = reinterpret_cast<const uint32_t*>(rows.q[h / group] + (h % group) * D);
    }
    const int64_t upto = longest(h0, QB);
    for (int64_t t = 0; t < upto; t += 32) {
      __m512 acc[QB][2];
      for (int b = 0; b < QB; ++b) acc[b][0] = acc[b][1] = _mm512_setzero_ps();
      for (int i = 0; i < DP; ++i) {
        const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kt + i * np + t);
        const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kt + i * np + t + 16);
        for (int b = 0; b < QB; ++b) {
          const __m512bh qb = (__m512bh)_mm512_set1_epi32(static_cast<int>(q[b][i]));
          acc[b][0] = _mm512_dpbf16_ps(acc[b][0], qb, k0);
          acc[b][1] = _mm512_dpbf16_ps(acc[b][1], qb, k1);
        }
      }
      for (int b = 0; b < QB && h0 + b < pairs; ++b) {
        _mm512_storeu_ps(scores + (h0 + b) * np + t, _mm512_mul_ps(acc[b][0], scale_v));
        _mm512_storeu_ps(scores + (h0 + b) * np + t + 16, _mm512_mul_ps(acc[b][1], scale_v));
      }
    }
  }
  for (int64_t h = 0; h < pairs; ++h) {  // exact softmax over the row's own length, then its weights in bf16 pairs
    float* s = scores + h * np;
    inv_sum[h] = softmax_unnormalized(s, len_of(h), &max[h]);
    std::fill(s + len_of(h), s + np, 0.0f);
    uint16_t* weights = reinterpret_cast<uint16_t*>(s);  // written behind the floats it reads
    for (int64_t t = 0; t < np; t += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(weights + t), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s + t)));
  }
  for (int64_t h0 = 0; h0 < pairs; h0 += PB) {
    const uint32_t* w[PB];
    for (int b = 0; b < PB; ++b) w[b] = reinterpret_cast<const uint32_t*>(scores + std::min(h0 + b, pairs - 1) * np);
    const int64_t upto = longest(h0, PB);
    __m512 acc[PB][NV];
    for (int b = 0; b < PB; ++b)
      for (int i = 0; i < NV; ++i) acc[b][i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < (upto + 1) / 2; ++j) {
      __m512bh vv[NV];
      for (int i = 0; i < NV; ++i) vv[i] = (__m512bh)_mm512_loadu_si512(vp + j * D + i * kLanes);
      for (int b = 0; b < PB; ++b) {
        const __m512bh wb = (__m512bh)_mm512_set1_epi32(static_cast<int>(w[b][j]));
        for (int i = 0; i < NV; ++i) acc[b][i] = _mm512_dpbf16_ps(acc[b][i], wb, vv[i]);
      }
    }
    for (int b = 0; b < PB && h0 + b < pairs; ++b) {
      const int64_t h = h0 + b;
      finish_lanes<D>(acc[b], max[h], inv_sum[h], rows.out[h / group] + (h % group) * D,
                      offset(rows.partial[h / group], (h % group) * (D + 2)));
    }
  }
}

// Three row-heads at a time where they come in threes (a lone decode row of SmolLM2's three query heads per KV head
// wasted a quarter of four), else four (8 score and 16 sum accumulators).
template <int D>
void attend_tile_dp(const TileRows& rows, int64_t group, const uint16_t* k, const uint16_t* v, const float* ks,
                    const float* vs, const int64_t* table, int64_t block_size, int64_t kv_heads, int64_t head,
                    float scale, std::vector<float>& buf) {
  const int64_t pairs = rows.count * group;
  auto kernel = pairs % 4 != 0 && pairs % 3 == 0 ? &attend_tile_dp_by<D, 3> : &attend_tile_dp_by<D, 4>;
  kernel(rows, group, k, v, ks, vs, table, block_size, kv_heads, head, scale, buf);
}

#endif  // __AVX512BF16__ && KVYARD_HEAD_KERNEL

// The AVX512-BF16 tile kernel for bf16 queries over a bf16 cache at this head size; null where there is none.
inline TileKernel<uint16_t> dp_tile_kernel(int64_t d) {
#if defined(__AVX512BF16__) && defined(KVYARD_HEAD_KERNEL)
  if (d == 64) return &attend_tile_dp<64>;
  if (d == 128) return &attend_tile_dp<128>;
#endif
  (void)d;
  return nullptr;
}

}  // namespace kvyard
