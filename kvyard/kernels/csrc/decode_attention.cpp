// Paged decode attention on CPU, registered as torch.ops.kvyard.paged_decode_attention (see kvyard/kernels/cpu.py).
//
// Why hand-written: at decode time the work per layer is tiny (32 rows x ~200 cached tokens), so
// PyTorch's per-call costs dominate. One pass that reads K/V in place through the block table replaces
// a gather copy plus an SDPA call that loops over (row, head) pairs.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "attend_tile.h"
#include "attend_tile_dp.h"
#include "attention_lanes.h"
#include "ops.h"
#include "vec.h"

namespace {

using namespace kvyard;

#ifdef KVYARD_HEAD_KERNEL
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
  V qv[G][NV];
  for (int g = 0; g < G; ++g) scaled_query<NV>(q + g * D, scale, qv[g]);
  // This head's row of a cache at `slot`, as NV vectors of fp32.
  auto load_slot = [&](const C* cache, const float* scales, int64_t slot, V* row) {
    const int64_t at = slot * kv_heads + head;
    const float s = scales ? scales[at] : 1.0f;
    for (int i = 0; i < NV; ++i) row[i] = Lanes::load(cache + at * D + i * kLanes, s);
  };
  auto lanes_of = [&](int g, const V* kv) { return score_lanes<NV>(qv[g], kv); };
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
  for (int g = 0; g < G; ++g) finish_lanes<D>(acc[g], max[g], inv_sum[g], out + g * D, offset(partial, g * (D + 2)));
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
  // Gemma 3. Its 4 x 16 vectors of queries, then of sums, outgrow the 32 registers and spill, yet on AVX-512 (Zen 4)
  // 18 Gemma-3-270M layers at 32 rows of ~150 tokens took 0.61x the generic loop's time (372 against 607 us a
  // layer). Not measured on AVX2, where twice the vectors would spill: the generic loop stays there.
  if (d == 256 && Lanes::kWidth == 16) return head_kernel_for_group<256, C>(group);
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
    using Raw = RawCache<C>;
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

// A work item: a chunk of one row's context for KV heads [h0, h1), or of a tile's rows for one KV head.
struct WorkItem {
  int64_t tile, chunk, h0, h1;
};

template <typename Q, typename C>
void decode_attention_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const float* k_scale, const float* v_scale, const at::Tensor& table,
                           const at::Tensor& lens, int64_t block_size, double scale, at::Tensor& out,
                           TileKernel<RawCache<C>> tiles, bool lone_rows_in_tiles = false) {
  const int64_t rows = q.size(0), heads = q.size(1), d = q.size(2), q_row = q.stride(0);
  const int64_t kv_heads = k.size(1), group = heads / kv_heads, width = table.size(1);
  const Q* qp = q.data_ptr<Q>();
  Q* op = out.data_ptr<Q>();
  const C* kp = k.data_ptr<C>();
  const C* vp = v.data_ptr<C>();
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  // Rows sharing a block table (a prompt's tokens, each a row) go to `tiles`, up to kTileRows at a time.
  // A lone row's item covers all its KV heads when there are rows enough to keep every thread busy, else one.
  const int64_t split = rows >= 2 * at::get_num_threads() ? 1 : kv_heads;
  const int64_t per_item = kv_heads / split;
  const int64_t chunk_blocks = std::max<int64_t>(1, kChunkTokens / block_size), chunk_len = chunk_blocks * block_size;
  auto chunks_of = [&](int64_t r) { return std::max<int64_t>(1, (lp[r] + chunk_len - 1) / chunk_len); };
  std::vector<int64_t> tile_first{0}, first_partial(rows, -1);  // where a chunked row's {max, sum, acc} start
  int64_t partials = 0;
  for (int64_t r = 0; r < rows; ++r) {
    if (r > 0 && !(tiles != nullptr && r - tile_first.back() < kTileRows &&
                   std::equal(tp + r * width, tp + (r + 1) * width, tp + (r - 1) * width)))
      tile_first.push_back(r);
    if (chunks_of(r) > 1) {
      first_partial[r] = partials;
      partials += chunks_of(r) * heads * (d + 2);
    }
  }
  tile_first.push_back(rows);
  std::vector<WorkItem> items;
  for (int64_t t = 0; t + 1 < static_cast<int64_t>(tile_first.size()); ++t) {
    const int64_t first = tile_first[t], count = tile_first[t + 1] - first;
    const int64_t chunks = chunks_of(std::max_element(lp + first, lp + first + count) - lp);  // its longest row's
    for (int64_t c = 0; c < chunks; ++c)
      for (int64_t s = 0; s < (count == 1 ? split : kv_heads); ++s)
        items.push_back(count == 1 ? WorkItem{t, c, s * per_item, (s + 1) * per_item} : WorkItem{t, c, s, s + 1});
  }
  std::vector<float> scratch(partials);
  auto partial_of = [&](int64_t r, int64_t c, int64_t h) {
    return first_partial[r] < 0 ? nullptr : scratch.data() + first_partial[r] + (c * heads + h * group) * (d + 2);
  };
  auto run = [&](const WorkItem& item, std::vector<float>& buf) {
    const int64_t first = tile_first[item.tile], count = tile_first[item.tile + 1] - first;
    const int64_t t0 = item.chunk * chunk_len;
    const int64_t* chunk_table = tp + first * width + item.chunk * chunk_blocks;
    if (count == 1 && !lone_rows_in_tiles) {
      attend_row<Q, C>(qp + first * q_row + item.h0 * group * d, kp, vp, k_scale, v_scale, chunk_table,
                       std::min(chunk_len, lp[first] - t0), block_size, kv_heads, item.h0, item.h1, group, d,
                       static_cast<float>(scale), op + (first * heads + item.h0 * group) * d,
                       partial_of(first, item.chunk, item.h0), buf);
      return;
    }
    int64_t members[kTileRows], count_in = 0;  // the tile's rows whose context reaches this chunk
    for (int64_t r = first; r < first + count; ++r)
      if (lp[r] > t0) members[count_in++] = r;
    for (int64_t h = item.h0; h < item.h1; ++h) {  // a tile's item is one KV head; a lone row's may be several
      TileRows tile;
      for (int64_t j = 0; j < count_in; ++j) {
        const int64_t r = members[j];
        tile.q[j] = reinterpret_cast<const uint16_t*>(qp + r * q_row + h * group * d);
        tile.len[j] = std::min(chunk_len, lp[r] - t0);
        tile.out[j] = reinterpret_cast<uint16_t*>(op + (r * heads + h * group) * d);
        tile.partial[j] = partial_of(r, item.chunk, h);
      }
      tile.count = count_in;
      tiles(tile, group, reinterpret_cast<const RawCache<C>*>(kp), reinterpret_cast<const RawCache<C>*>(vp), k_scale,
            v_scale, chunk_table, block_size, kv_heads, h, static_cast<float>(scale), buf);
    }
  };
  if (tile_first.size() == static_cast<size_t>(rows) + 1) {  // no tiles: items in order, split evenly
    at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
      std::vector<float> buf;
      for (int64_t i = begin; i < end; ++i) run(items[i], buf);
    });
  } else {  // a prompt's tiles grow with their position: each thread takes the next item, the longest first
    std::atomic<int64_t> next{0};
    const int64_t count = static_cast<int64_t>(items.size());
    at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
      std::vector<float> buf;
      for (int64_t i = next++; i < count; i = next++) run(items[count - 1 - i], buf);
    });
  }
  std::vector<float> acc;
  for (int64_t r = 0; r < rows; ++r) {
    if (first_partial[r] < 0) continue;
    for (int64_t j = 0; j < heads; ++j)
      merge_chunks(scratch.data() + first_partial[r] + j * (d + 2), chunks_of(r), heads * (d + 2), d,
                   op + (r * heads + j) * d, acc);
  }
}

// q [rows, heads, head_dim] (rows may be strided); k_cache / v_cache [slots, kv_heads, head_dim] in q's dtype, or int8 with
// k_scale / v_scale [slots, kv_heads]; block_table [rows, max_blocks] int64; seq_lens [rows] int64.
}  // namespace

namespace kvyard::ops {

// The checks both entry points make; the output, shaped as q.
at::Tensor checked_output(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& block_table, const at::Tensor& seq_lens) {
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
  return at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const std::optional<at::Tensor>& k_scale,
                                  const std::optional<at::Tensor>& v_scale, const at::Tensor& block_table,
                                  const at::Tensor& seq_lens, int64_t block_size, double scale) {
  at::Tensor out = checked_output(q, k_cache, v_cache, block_table, seq_lens);
  const bool int8 = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(int8 == (k_scale.has_value() && v_scale.has_value()), "int8 caches need both scales");
  TORCH_CHECK(int8 || k_cache.scalar_type() == q.scalar_type(), "cache dtype must be q's or int8");
  const float* ks = int8 ? k_scale->data_ptr<float>() : nullptr;
  const float* vs = int8 ? v_scale->data_ptr<float>() : nullptr;
  const int64_t d = q.size(2), group = q.size(1) / k_cache.size(1);
  if (q.scalar_type() == at::kFloat) {
    if (int8)
      decode_attention_impl<float, int8_t>(q, k_cache, v_cache, ks, vs, block_table, seq_lens, block_size, scale, out,
                                           nullptr);
    else
      decode_attention_impl<float, float>(q, k_cache, v_cache, ks, vs, block_table, seq_lens, block_size, scale, out,
                                          nullptr);
  } else if (q.scalar_type() == at::kBFloat16) {
    if (int8)
      decode_attention_impl<at::BFloat16, int8_t>(q, k_cache, v_cache, ks, vs, block_table, seq_lens, block_size,
                                                  scale, out, tile_kernel<at::BFloat16, int8_t>(d, group));
    else
      decode_attention_impl<at::BFloat16, at::BFloat16>(q, k_cache, v_cache, ks, vs, block_table, seq_lens,
                                                        block_size, scale, out,
                                                        tile_kernel<at::BFloat16, at::BFloat16>(d, group));
  } else {
    TORCH_CHECK(false, "paged_decode_attention supports float32 and bfloat16, got ", q.scalar_type());
  }
  return out;
}

// paged_decode_attention on AVX512-BF16 products for bf16 over a bf16 cache: rows sharing a block table (a prompt's
// tokens) go to attend_tile_dp; lone rows (decodes) too where `lone_rows`, so that a token's attention is the same as
// a prompt token and as a decode (the batch-invariant path), else to the decode kernel's fp32 chain (faster alone).
at::Tensor paged_attention_dp(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const at::Tensor& block_table, const at::Tensor& seq_lens, int64_t block_size,
                              double scale, bool lone_rows) {
  at::Tensor out = checked_output(q, k_cache, v_cache, block_table, seq_lens);
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16,
              "paged_attention_dp takes bf16 queries over a bf16 cache");
  const TileKernel<uint16_t> tiles = dp_tile_kernel(q.size(2));
  TORCH_CHECK(tiles != nullptr, "paged_attention_dp needs AVX512-BF16 and a head_dim of 64 or 128");
  decode_attention_impl<at::BFloat16, at::BFloat16>(q, k_cache, v_cache, nullptr, nullptr, block_table, seq_lens,
                                                    block_size, scale, out, tiles, lone_rows);
  return out;
}

// Whether rows sharing a block table are attended in tiles (attend_tile.h) for this head size and group: bf16
// queries over a bf16 or int8 cache, on a CPU this build has the register kernels for.
bool paged_attention_tiles(int64_t head_dim, int64_t group) {
  return tile_kernel<at::BFloat16, at::BFloat16>(head_dim, group) != nullptr;
}

// Whether paged_attention_dp runs here for this head size.
bool paged_attention_dp_available(int64_t head_dim) { return dp_tile_kernel(head_dim) != nullptr; }

}  // namespace kvyard::ops

TORCH_LIBRARY_FRAGMENT(kvyard, m) {
  m.def("paged_attention_tiles(int head_dim, int group) -> bool", &kvyard::ops::paged_attention_tiles);
  m.def("paged_attention_dp_available(int head_dim) -> bool", &kvyard::ops::paged_attention_dp_available);
  m.def("paged_attention_dp(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor seq_lens, "
        "int block_size, float scale, bool lone_rows) -> Tensor");
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor? k_scale, Tensor? v_scale, "
        "Tensor block_table, Tensor seq_lens, int block_size, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvyard, CPU, m) {
  m.impl("paged_decode_attention", &kvyard::ops::paged_decode_attention);
  m.impl("paged_attention_dp", &kvyard::ops::paged_attention_dp);
}
