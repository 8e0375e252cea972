// Paged decode attention on CPU, registered as torch.ops.kvyard.paged_decode_attention (see kvyard/kernels/cpu.py).
//
// Why hand-written: at decode time the work per layer is tiny (32 rows x ~200 cached tokens), so
// PyTorch's per-call costs dominate. One pass that reads K/V in place through the block table replaces
// a gather copy plus an SDPA call that loops over (row, head) pairs.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "vec.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using namespace kvyard;

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
};
#endif

#ifdef KVYARD_HEAD_KERNEL
using V = Lanes::V;
constexpr int kLanes = Lanes::kWidth;

// The hot path for bf16 queries over a bf16 or int8 cache: one KV head and its G query heads, head_dim D,
// with the queries and the G x D output accumulators held in registers for the whole walk over the
// context (the generic loop keeps them in memory and converts through a buffer). Same arithmetic as the
// generic path: fp32 dot products and accumulation, exact softmax.
template <int D, int G, typename C>
void attend_head(const uint16_t* q, const C* k, const C* v, const float* k_scale, const float* v_scale,
                 const int64_t* table, int64_t len, int64_t block_size, int64_t kv_heads, int64_t head,
                 float scale, uint16_t* out, float* scores, float* partial) {
  constexpr int NV = D / kLanes;
  constexpr int64_t row_bytes = D * sizeof(C);
  const SlotSpan k_span{reinterpret_cast<const char*>(k), kv_heads * row_bytes, head * row_bytes, row_bytes};
  const SlotSpan v_span{reinterpret_cast<const char*>(v), kv_heads * row_bytes, head * row_bytes, row_bytes};
  const V vscale = Lanes::set1(scale);
  V qv[G][NV];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < NV; ++i) qv[g][i] = Lanes::mul(Lanes::load(q + g * D + i * kLanes, 1.0f), vscale);
  // This head's row of a cache at `slot`, as NV vectors of fp32.
  auto load_slot = [&](const C* cache, const float* scales, int64_t slot, V* row) {
    const int64_t at = slot * kv_heads + head;
    const float s = scales ? scales[at] : 1.0f;
    for (int i = 0; i < NV; ++i) row[i] = Lanes::load(cache + at * D + i * kLanes, s);
  };
  // q . k of one token for query head g, as lanes still to be summed
  auto lanes_of = [&](int g, const V* kv) {
    V acc = Lanes::mul(qv[g][0], kv[0]);
    for (int i = 1; i < NV; ++i) acc = Lanes::fmadd(qv[g][i], kv[i], acc);
    return acc;
  };
  // Four tokens' lanes are summed together: one shuffle tree for four, where a horizontal sum each took most of
  // the score loop's instructions (attention at 32 rows of ~280 tokens: see BENCHMARKS.md, session 19).
  auto score4 = [&](int64_t t, int64_t slot) {
    V acc[G][4];
    for (int u = 0; u < 4; ++u) {
      V kv[NV];
      load_slot(k, k_scale, slot + u, kv);
      for (int g = 0; g < G; ++g) acc[g][u] = lanes_of(g, kv);
    }
    for (int g = 0; g < G; ++g) _mm_storeu_ps(scores + g * len + t, Lanes::sum4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]));
  };
  auto score = [&](int64_t t, int64_t slot) {
    V kv[NV];
    load_slot(k, k_scale, slot, kv);
    for (int g = 0; g < G; ++g) scores[g * len + t] = Lanes::sum(lanes_of(g, kv));
  };
  for_each_token(table, len, block_size, k_span, score, score4);
  float inv_sum[G], max[G];
  for (int g = 0; g < G; ++g) inv_sum[g] = softmax_unnormalized(scores + g * len, len, &max[g]);
  V acc[G][NV];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < NV; ++i) acc[g][i] = Lanes::set1(0.0f);
  for_each_token(table, len, block_size, v_span, [&](int64_t t, int64_t slot) {
    V vv[NV];
    load_slot(v, v_scale, slot, vv);
    for (int g = 0; g < G; ++g) {
      const V p = Lanes::set1(scores[g * len + t]);
      for (int i = 0; i < NV; ++i) acc[g][i] = Lanes::fmadd(p, vv[i], acc[g][i]);
    }
  });
  for (int g = 0; g < G; ++g) {
    alignas(64) float row[D];
    if (partial != nullptr) {  // a chunk: {max, sum, acc} kept in fp32 (finish_head)
      for (int i = 0; i < NV; ++i) Lanes::store(row + i * kLanes, acc[g][i]);
      finish_head(row, max[g], inv_sum[g], reinterpret_cast<at::BFloat16*>(out + g * D), partial + g * (D + 2), D);
      continue;
    }
    // the whole context: scaled by 1 / sum in registers, then rounded
    for (int i = 0; i < NV; ++i) Lanes::store(row + i * kLanes, Lanes::mul(acc[g][i], Lanes::set1(inv_sum[g])));
    store_row(row, 1.0f, reinterpret_cast<at::BFloat16*>(out + g * D), D);
  }
}

template <typename C>
using HeadKernel = void (*)(const uint16_t*, const C*, const C*, const float*, const float*, const int64_t*,
                            int64_t, int64_t, int64_t, int64_t, float, uint16_t*, float*, float*);

// The specialisation for (head_dim, group), or null where the generic loop serves.
template <int D, typename C>
HeadKernel<C> head_kernel_for_group(int64_t group) {
  switch (group) {
    case 1: return &attend_head<D, 1, C>;
    case 2: return &attend_head<D, 2, C>;
    case 3: return &attend_head<D, 3, C>;
    case 4: return &attend_head<D, 4, C>;
    case 5: return &attend_head<D, 5, C>;
    case 6: return &attend_head<D, 6, C>;
    case 7: return &attend_head<D, 7, C>;
    case 8: return &attend_head<D, 8, C>;
    default: return nullptr;
  }
}

template <typename C>
HeadKernel<C> head_kernel(int64_t d, int64_t group) {
  if (d == 64) return head_kernel_for_group<64, C>(group);
  if (d == 128) return head_kernel_for_group<128, C>(group);
  return nullptr;
}
#endif  // KVYARD_HEAD_KERNEL

// Attention of one row for KV heads [h0, h1) and the `group` query heads sharing each, over `len` cached
// tokens found through the row's block table. Every token's K (then V) rows of those heads are read
// together: one token's heads sit side by side in the cache, so the reads stream through memory. Scores
// are kept whole (len is at most the context), so softmax is exact rather than online.
template <typename Q, typename C>
void attend_row(const Q* q, const C* k, const C* v, const float* k_scale, const float* v_scale,
                const int64_t* table, int64_t len, int64_t block_size, int64_t kv_heads, int64_t h0, int64_t h1,
                int64_t group, int64_t d, float scale, Q* out, float* partial, std::vector<float>& buf) {
  const int64_t nh = h1 - h0, nq = nh * group;  // KV heads and query heads handled here
#ifdef KVYARD_HEAD_KERNEL
  if constexpr (std::is_same_v<Q, at::BFloat16> && !std::is_same_v<C, float>) {
    // The cache as the fast path reads it: bf16 as its raw bits, int8 as is.
    using Raw = std::conditional_t<std::is_same_v<C, at::BFloat16>, uint16_t, C>;
    if (HeadKernel<Raw> kernel = head_kernel<Raw>(d, group)) {
      buf.resize(group * len);
      for (int64_t h = 0; h < nh; ++h) {
        kernel(reinterpret_cast<const uint16_t*>(q + h * group * d), reinterpret_cast<const Raw*>(k),
               reinterpret_cast<const Raw*>(v), k_scale, v_scale, table, len, block_size, kv_heads, h0 + h,
               scale, reinterpret_cast<uint16_t*>(out + h * group * d), buf.data(),
               offset(partial, h * group * (d + 2)));
      }
      return;
    }
  }
#endif
  buf.resize(nq * d * 2 + nh * d + nq * len);
  float* qf = buf.data();
  float* acc = qf + nq * d;
  float* rows = acc + nq * d;
  float* scores = rows + nh * d;
  for (int64_t j = 0; j < nq; ++j) {
    load_row(q + j * d, 1.0f, qf + j * d, d);
    for (int64_t i = 0; i < d; ++i) qf[j * d + i] *= scale;
  }
  auto span_of = [&](const C* cache) {
    const int64_t row = d * static_cast<int64_t>(sizeof(C));
    return SlotSpan{reinterpret_cast<const char*>(cache), kv_heads * row, h0 * row, nh * row};
  };
  auto load_heads = [&](const C* cache, const float* cache_scale, int64_t slot) {
    for (int64_t h = 0; h < nh; ++h) {
      const int64_t at = slot * kv_heads + h0 + h;
      load_row(cache + at * d, cache_scale ? cache_scale[at] : 1.0f, rows + h * d, d);
    }
  };
  for_each_token(table, len, block_size, span_of(k), [&](int64_t t, int64_t slot) {
    load_heads(k, k_scale, slot);
    for (int64_t j = 0; j < nq; ++j) scores[j * len + t] = dot(qf + j * d, rows + (j / group) * d, d);
  });
  std::vector<float> inv_sum(nq), max(nq);
  for (int64_t j = 0; j < nq; ++j) inv_sum[j] = softmax_unnormalized(scores + j * len, len, &max[j]);
  std::fill(acc, acc + nq * d, 0.0f);
  for_each_token(table, len, block_size, span_of(v), [&](int64_t t, int64_t slot) {
    load_heads(v, v_scale, slot);
    for (int64_t j = 0; j < nq; ++j) {
      const float p = scores[j * len + t];
      const float* row = rows + (j / group) * d;
      float* aj = acc + j * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) aj[i] += p * row[i];
    }
  });
  for (int64_t j = 0; j < nq; ++j)
    finish_head(acc + j * d, max[j], inv_sum[j], out + j * d, offset(partial, j * (d + 2)), d);
}

// One query head's chunks {max, sum, acc} ([chunks, d + 2], `stride` floats apart) as one softmax: each chunk
// weighted by exp(its max - the overall max), then rounded into out.
template <typename Q>
void merge_chunks(const float* partial, int64_t chunks, int64_t stride, int64_t d, Q* out, std::vector<float>& acc) {
  float max = -std::numeric_limits<float>::infinity();
  for (int64_t c = 0; c < chunks; ++c) max = std::max(max, partial[c * stride]);
  acc.assign(d, 0.0f);
  float sum = 0.0f;
  for (int64_t c = 0; c < chunks; ++c) {
    const float* part = partial + c * stride;
    const float w = std::exp(part[0] - max);
    sum += w * part[1];
    for (int64_t i = 0; i < d; ++i) acc[i] += w * part[2 + i];
  }
  store_row(acc.data(), 1.0f / sum, out, d);
}

// Contexts longer than this are cut into chunks of about this many positions (whole blocks), each a work item of
// its own, merged by their softmax maxima and sums: at a few rows a long context otherwise kept one thread per KV
// head busy and the others idle. The cut depends on a row's length alone, never on the batch, so a row's result
// does not depend on what it is batched with (speculative decoding and batching must not change outputs).
constexpr int64_t kChunkTokens = 512;

template <typename Q, typename C>
void decode_attention_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const float* k_scale, const float* v_scale, const at::Tensor& table,
                           const at::Tensor& lens, int64_t block_size, double scale, at::Tensor& out) {
  const int64_t rows = q.size(0), heads = q.size(1), d = q.size(2), q_row = q.stride(0);
  const int64_t kv_heads = k.size(1), group = heads / kv_heads, width = table.size(1);
  const Q* qp = q.data_ptr<Q>();
  Q* op = out.data_ptr<Q>();
  const C* kp = k.data_ptr<C>();
  const C* vp = v.data_ptr<C>();
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  // A work item is a chunk of a row's context (the whole context unless it is long) for all its KV heads when
  // there are rows enough to keep every thread busy, else for one KV head.
  const int64_t split = rows >= 2 * at::get_num_threads() ? 1 : kv_heads;
  const int64_t per_item = kv_heads / split;
  const int64_t chunk_blocks = std::max<int64_t>(1, kChunkTokens / block_size), chunk_len = chunk_blocks * block_size;
  std::vector<int64_t> first_chunk(rows + 1, 0), chunk_row;  // chunk_row[c]: the row of chunk c
  std::vector<int64_t> first_partial(rows, -1);             // where a chunked row's {max, sum, acc} start
  int64_t partials = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t chunks = std::max<int64_t>(1, (lp[r] + chunk_len - 1) / chunk_len);
    first_chunk[r + 1] = first_chunk[r] + chunks;
    chunk_row.insert(chunk_row.end(), chunks, r);
    if (chunks > 1) {
      first_partial[r] = partials;
      partials += chunks * heads * (d + 2);
    }
  }
  std::vector<float> scratch(partials);
  at::parallel_for(0, first_chunk[rows] * split, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t chunk = item / split, r = chunk_row[chunk], c = chunk - first_chunk[r];
      const int64_t h0 = (item % split) * per_item, t0 = c * chunk_len;
      float* partial = first_partial[r] < 0 ? nullptr
                                             : scratch.data() + first_partial[r] + (c * heads + h0 * group) * (d + 2);
      attend_row<Q, C>(qp + r * q_row + h0 * group * d, kp, vp, k_scale, v_scale, tp + r * width + c * chunk_blocks,
                       std::min(chunk_len, lp[r] - t0), block_size, kv_heads, h0, h0 + per_item, group, d,
                       static_cast<float>(scale), op + (r * heads + h0 * group) * d, partial, buf);
    }
  });
  std::vector<float> acc;
  for (int64_t r = 0; r < rows; ++r) {
    if (first_partial[r] < 0) continue;
    for (int64_t j = 0; j < heads; ++j)
      merge_chunks(scratch.data() + first_partial[r] + j * (d + 2), first_chunk[r + 1] - first_chunk[r],
                   heads * (d + 2), d, op + (r * heads + j) * d, acc);
  }
}

// q [rows, heads, head_dim] (rows may be strided); k_cache / v_cache [slots, kv_heads, head_dim] in q's dtype, or int8 with
// k_scale / v_scale [slots, kv_heads]; block_table [rows, max_blocks] int64; seq_lens [rows] int64.
}  // namespace

namespace kvyard::ops {

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const std::optional<at::Tensor>& k_scale,
                                  const std::optional<at::Tensor>& v_scale, const at::Tensor& block_table,
                                  const at::Tensor& seq_lens, int64_t block_size, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "q and the caches must be 3-D");
  // q may be a row slice of the fused qkv projection: only its heads must be dense.
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "q's heads must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && block_table.is_contiguous() &&
                  seq_lens.is_contiguous(),
              "caches, block_table and seq_lens must be contiguous");
  TORCH_CHECK(block_table.size(0) == q.size(0) && seq_lens.size(0) == q.size(0), "one table row and length per q row");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "block_table and seq_lens must be int64");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(q.size(2) == k_cache.size(2), "head_dim of q and the cache differ");
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  const bool int8 = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(int8 == (k_scale.has_value() && v_scale.has_value()), "int8 caches need both scales");
  TORCH_CHECK(int8 || k_cache.scalar_type() == q.scalar_type(), "cache dtype must be q's or int8");
  const float* ks = int8 ? k_scale->data_ptr<float>() : nullptr;
  const float* vs = int8 ? v_scale->data_ptr<float>() : nullptr;
  if (q.scalar_type() == at::kFloat) {
    if (int8)
      decode_attention_impl<float, int8_t>(q, k_cache, v_cache, ks, vs, block_table, seq_lens, block_size, scale, out);
    else
      decode_attention_impl<float, float>(q, k_cache, v_cache, ks, vs, block_table, seq_lens, block_size, scale, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    if (int8)
      decode_attention_impl<at::BFloat16, int8_t>(q, k_cache, v_cache, ks, vs, block_table, seq_lens, block_size,
                                                  scale, out);
    else
      decode_attention_impl<at::BFloat16, at::BFloat16>(q, k_cache, v_cache, ks, vs, block_table, seq_lens,
                                                        block_size, scale, out);
  } else {
    TORCH_CHECK(false, "paged_decode_attention supports float32 and bfloat16, got ", q.scalar_type());
  }
  return out;
}

}  // namespace kvyard::ops

TORCH_LIBRARY_FRAGMENT(kvyard, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor? k_scale, Tensor? v_scale, "
        "Tensor block_table, Tensor seq_lens, int block_size, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvyard, CPU, m) { m.impl("paged_decode_attention", &kvyard::ops::paged_decode_attention); }
