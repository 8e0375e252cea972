// What the paged attention kernels share (decode_attention.cpp, attend_tile.h): the walk over a row's block table
// with its prefetching, and the register width their hot paths are written against.
#pragma once

#include <algorithm>
#include <type_traits>

#include "vec.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace kvyard {

// The part of every slot that a walk reads: `bytes` from `offset` within slots `stride` bytes apart.
struct SlotSpan {
  const char* base;
  int64_t stride, offset, bytes;
};

// Asks for the span of every slot of block `b` of a row's table, into L2 (_MM_HINT_T2): a request into L1 holds a
// fill buffer until its line arrives, and a block's 32 lines at once left the walk stalled on them; at 32 rows of
// ~280 tokens, 30 SmolLM2 layers' attention took 0.92x the time (random pool, 483-496 against 530-538 us a layer).
inline void prefetch_block(const int64_t* table, int64_t b, int64_t block_size, const SlotSpan& span) {
  const char* first = span.base + table[b] * block_size * span.stride + span.offset;
  for (int64_t j = 0; j < block_size; ++j)
    for (int64_t off = 0; off < span.bytes; off += 64) __builtin_prefetch(first + j * span.stride + off, 0, 1);
}

// Blocks sit anywhere in the pool, so the hardware prefetcher loses the stream at every block edge: the
// walk asks for its first kBlocksAhead blocks at once, then for the block that far ahead of the one it
// computes. Against one block ahead and none at the start: 0.93x of the time over SmolLM2's 30 layers at
// 32 rows of ~175 tokens (alternating microbenchmark); two ahead without the start: 1.03x.
constexpr int64_t kBlocksAhead = 4;

// Calls f(position, slot) for positions 0 .. len-1 of a row, walking its block table block by block; given f4,
// f4(position, slot) takes four positions at once (slots slot .. slot + 3: a block's slots are consecutive) and f
// the rest of each block. (A plain function does the prefetching: a lambda here kept GCC from inlining f, at 1.8x
// the time.)
template <typename F, typename F4 = std::nullptr_t>
inline void for_each_token(const int64_t* table, int64_t len, int64_t block_size, const SlotSpan& span, F&& f,
                           F4&& f4 = nullptr) {
  const int64_t blocks = (len + block_size - 1) / block_size;
  for (int64_t b = 0; b < std::min(kBlocksAhead, blocks); ++b) prefetch_block(table, b, block_size, span);
  for (int64_t b = 0, t0 = 0; t0 < len; ++b, t0 += block_size) {
    if (b + kBlocksAhead < blocks) prefetch_block(table, b + kBlocksAhead, block_size, span);
    const int64_t base = table[b] * block_size, n = std::min(block_size, len - t0);
    int64_t j = 0;
    if constexpr (!std::is_same_v<std::decay_t<F4>, std::nullptr_t>)
      for (; j + 4 <= n; j += 4) f4(t0 + j, base + j);
    for (; j < n; ++j) f(t0 + j, base + j);
  }
}

// The register width the hot path below is written against: AVX-512's 16 lanes or AVX2's 8, whichever this
// machine compiles for (one definition of the kernel serves both).
#if defined(__AVX512F__)
#define KVYARD_HEAD_KERNEL 1
struct Lanes {
  using V = __m512;
  static constexpr int kWidth = 16;
  // kWidth cached values -> floats: bf16 is the top half of a float; int8 is scaled by its (token, head) scale.
  static V load(const uint16_t* p, float) { return load_bf16x16(p); }
  static V load(const int8_t* p, float scale) {
    const V x = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    return _mm512_mul_ps(x, _mm512_set1_ps(scale));
  }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static float sum(V a) { return _mm512_reduce_add_ps(a); }
  // [sum(a0), sum(a1), sum(a2), sum(a3)]: each folded to 8 lanes, then vec.h's shuffle tree for four
  static __m128 sum4(V a0, V a1, V a2, V a3) {
    auto fold = [](V a) {
      return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
    };
    return kvyard::sum4(fold(a0), fold(a1), fold(a2), fold(a3));
  }
  static void store(float* p, V a) { _mm512_store_ps(p, a); }
  static V loadf(const float* p) { return _mm512_loadu_ps(p); }
  static void storeu(float* p, V a) { _mm512_storeu_ps(p, a); }
};
#elif defined(__AVX2__) && defined(__FMA__)
#define KVYARD_HEAD_KERNEL 1
struct Lanes {
  using V = __m256;
  static constexpr int kWidth = 8;
  static V load(const uint16_t* p, float) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(
        reinterpret_cast<const __m128i*>(p))), 16));
  }
  static V load(const int8_t* p, float scale) {
    const V x = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    return _mm256_mul_ps(x, _mm256_set1_ps(scale));
  }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static float sum(V a) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
  }
  static __m128 sum4(V a0, V a1, V a2, V a3) { return kvyard::sum4(a0, a1, a2, a3); }
  static void store(float* p, V a) { _mm256_store_ps(p, a); }
  static V loadf(const float* p) { return _mm256_loadu_ps(p); }
  static void storeu(float* p, V a) { _mm256_storeu_ps(p, a); }
};
#endif

// p + n, or null where p is (a row's chunk scratch, absent unless its context is cut into chunks).
inline float* offset(float* p, int64_t n) { return p == nullptr ? nullptr : p + n; }

// Where one query head's result goes: `acc` (the sum of exp(score - max) * v) scaled by inv_sum and rounded into
// out, or, for one chunk of a long context (partial not null), kept in fp32 as {max, sum, acc} for merge_chunks.
template <typename Q>
inline void finish_head(const float* acc, float max, float inv_sum, Q* out, float* partial, int64_t d) {
  if (partial == nullptr) {
    store_row(acc, inv_sum, out, d);
    return;
  }
  partial[0] = max;
  partial[1] = 1.0f / inv_sum;
  std::copy(acc, acc + d, partial + 2);
}

#ifdef KVYARD_HEAD_KERNEL
using V = Lanes::V;
constexpr int kLanes = Lanes::kWidth;

// What the register kernels (decode_attention.cpp's attend_head, attend_tile.h) share, so that a row's arithmetic
// is the same operations in the same order whichever of them takes it.
// A query head's D values as NV vectors of fp32, times the softmax scale.
template <int NV>
inline void scaled_query(const uint16_t* q, float scale, V* qv) {
  for (int i = 0; i < NV; ++i) qv[i] = Lanes::mul(Lanes::load(q + i * kLanes, 1.0f), Lanes::set1(scale));
}

// q . k of one token, as lanes still to be summed.
template <int NV>
inline V score_lanes(const V* qv, const V* kv) {
  V acc = Lanes::mul(qv[0], kv[0]);
  for (int i = 1; i < NV; ++i) acc = Lanes::fmadd(qv[i], kv[i], acc);
  return acc;
}

// score_lanes for U consecutive widened K rows (k: U rows of NV vectors), the U chains interleaved: each chain is
// the same operations in the same order, and U of them keep the FMA units busy where one waits on the last.
template <int NV, int U>
inline void interleaved_scores(const V* qv, const float* k, V* acc) {
  for (int u = 0; u < U; ++u) acc[u] = Lanes::mul(qv[0], Lanes::loadf(k + u * NV * kLanes));
  for (int i = 1; i < NV; ++i)
    for (int u = 0; u < U; ++u) acc[u] = Lanes::fmadd(qv[i], Lanes::loadf(k + (u * NV + i) * kLanes), acc[u]);
}

// A query head's accumulators into out (bf16, scaled by 1 / sum in registers, then rounded), or, for one chunk
// of a long context (partial not null), into {max, sum, acc} in fp32 (finish_head).
template <int D>
inline void finish_lanes(const V* acc, float max, float inv_sum, uint16_t* out, float* partial) {
  constexpr int NV = D / kLanes;
  alignas(64) float row[D];
  if (partial != nullptr) {
    for (int i = 0; i < NV; ++i) Lanes::store(row + i * kLanes, acc[i]);
    finish_head(row, max, inv_sum, reinterpret_cast<at::BFloat16*>(out), partial, D);
    return;
  }
  for (int i = 0; i < NV; ++i) Lanes::store(row + i * kLanes, Lanes::mul(acc[i], Lanes::set1(inv_sum)));
  store_row(row, 1.0f, reinterpret_cast<at::BFloat16*>(out), D);
}
#endif  // KVYARD_HEAD_KERNEL

}  // namespace kvyard
