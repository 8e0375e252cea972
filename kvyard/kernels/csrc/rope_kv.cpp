// RoPE on q and k plus the KV-cache write, fused, registered as torch.ops.kvyard.rope_write_kv_.
//
// A layer's q/k rotation (roll, two products, a sum) and the two index_copy_ writes of K and V are six
// PyTorch ops per layer; at decode sizes their per-call cost is most of their time. Rounding follows HF's
// q * cos + rotate_half(q) * sin in the model dtype: each product rounded, then the sum.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace {

using namespace kvyard;

// x [d] rotated in place: x * cos + roll(x, d/2) * signed_sin (signed_sin carries rotate_half's sign).
template <typename T>
void rotate(T* x, const float* __restrict cos, const float* __restrict sin, float* __restrict buf, int64_t d) {
  const int64_t half = d / 2;
  load_row(x, 1.0f, buf, d);
  float* rolled = buf + d;
  for (int64_t i = 0; i < d; ++i) rolled[i] = buf[i < half ? i + half : i - half];
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) buf[i] = round_as<T>(round_as<T>(buf[i] * cos[i]) + round_as<T>(rolled[i] * sin[i]));
  store_row(buf, 1.0f, x, d);
}

// kv_heads rows of d values written to a cache slot: copied in the model dtype, or, for an int8 cache,
// each row scaled by its own absolute maximum (as LayerKV's quantize_rows: scale = amax / 127, 1 for an
// all-zero row, values rounded half to even).
template <typename T>
void store_rows(const T* src, int64_t kv_heads, int64_t d, void* cache, float* scales, int64_t slot,
                std::vector<float>& buf) {
  if (scales == nullptr) {
    std::memcpy(static_cast<T*>(cache) + slot * kv_heads * d, src, kv_heads * d * sizeof(T));
    return;
  }
  int8_t* out = static_cast<int8_t*>(cache) + slot * kv_heads * d;
  for (int64_t h = 0; h < kv_heads; ++h) {
    load_row(src + h * d, 1.0f, buf.data(), d);
    float amax = 0.0f;
    for (int64_t i = 0; i < d; ++i) amax = std::max(amax, std::fabs(buf[i]));
    float scale = amax / 127.0f;
    scale = scale == 0.0f ? 1.0f : scale;
    for (int64_t i = 0; i < d; ++i)
      out[h * d + i] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, std::nearbyint(buf[i] / scale))));
    scales[slot * kv_heads + h] = scale;
  }
}

template <typename T>
void rope_write_kv_impl(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                        int64_t kv_heads, at::Tensor& k_cache, at::Tensor& v_cache, float* k_scale, float* v_scale,
                        const at::Tensor& slots) {
  const int64_t n = qkv.size(0), d = qkv.size(2), width = qkv.size(1);
  T* x = qkv.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  void* kc = k_cache.data_ptr();
  void* vc = v_cache.data_ptr();
  const int64_t* slot = slots.data_ptr<int64_t>();
  at::parallel_for(0, n, row_grain(width * d), [&](int64_t begin, int64_t end) {
    std::vector<float> cf(d), sf(d), buf(2 * d);
    for (int64_t t = begin; t < end; ++t) {
      load_row(cp + t * d, 1.0f, cf.data(), d);
      load_row(sp + t * d, 1.0f, sf.data(), d);
      T* row = x + t * width * d;
      for (int64_t h = 0; h < heads + kv_heads; ++h) rotate(row + h * d, cf.data(), sf.data(), buf.data(), d);
      store_rows(row + heads * d, kv_heads, d, kc, k_scale, slot[t], buf);
      store_rows(row + (heads + kv_heads) * d, kv_heads, d, vc, v_scale, slot[t], buf);
    }
  });
}

}  // namespace

namespace kvyard::ops {

// qkv [tokens, heads + 2 * kv_heads, head_dim], rotated in place on its q and k heads; cos / sin
// [tokens, head_dim] (sin with rotate_half's sign); the rotated k and the v rows are copied to
// k_cache / v_cache [slots, kv_heads, head_dim] at `slots` [tokens]: in qkv's dtype, or int8 with
// k_scale / v_scale [slots, kv_heads] float32.
void rope_write_kv_(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t kv_heads,
                    at::Tensor k_cache, at::Tensor v_cache, const std::optional<at::Tensor>& k_scale,
                    const std::optional<at::Tensor>& v_scale, const at::Tensor& slots) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.is_contiguous(), "qkv must be a contiguous [tokens, heads, head_dim] tensor");
  TORCH_CHECK(qkv.size(1) == heads + 2 * kv_heads && qkv.size(2) % 2 == 0, "qkv must hold q, k and v heads");
  const int64_t n = qkv.size(0), d = qkv.size(2);
  TORCH_CHECK(cos.numel() == n * d && sin.numel() == n * d && cos.is_contiguous() && sin.is_contiguous(),
              "cos and sin must be contiguous [tokens, head_dim]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 3 &&
                  k_cache.size(1) == kv_heads && k_cache.size(2) == d && v_cache.sizes() == k_cache.sizes(),
              "caches must be contiguous [slots, kv_heads, head_dim]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == n && slots.is_contiguous(), "one int64 slot per token");
  for (const auto& t : {cos, sin})
    TORCH_CHECK(t.scalar_type() == qkv.scalar_type(), "qkv, cos and sin must share a dtype");
  const bool int8 = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(int8 == (k_scale.has_value() && v_scale.has_value()), "int8 caches need both scales");
  TORCH_CHECK(int8 || (k_cache.scalar_type() == qkv.scalar_type() && v_cache.scalar_type() == qkv.scalar_type()),
              "the caches must be in qkv's dtype, or int8");
  if (int8) {
    TORCH_CHECK(v_cache.scalar_type() == at::kChar, "both caches must be int8");
    for (const auto* sc : {&*k_scale, &*v_scale})
      TORCH_CHECK(sc->scalar_type() == at::kFloat && sc->is_contiguous() && sc->numel() == k_cache.size(0) * kv_heads,
                  "scales must be contiguous float32 [slots, kv_heads]");
  }
  float* ks = int8 ? k_scale->data_ptr<float>() : nullptr;
  float* vs = int8 ? v_scale->data_ptr<float>() : nullptr;
  if (n > 0) {
    const int64_t* sp = slots.data_ptr<int64_t>();
    const int64_t lo = *std::min_element(sp, sp + n), hi = *std::max_element(sp, sp + n);
    TORCH_CHECK(lo >= 0 && hi < k_cache.size(0), "slot out of range");
  }
  if (qkv.scalar_type() == at::kFloat) {
    rope_write_kv_impl<float>(qkv, cos, sin, heads, kv_heads, k_cache, v_cache, ks, vs, slots);
  } else if (qkv.scalar_type() == at::kBFloat16) {
    rope_write_kv_impl<at::BFloat16>(qkv, cos, sin, heads, kv_heads, k_cache, v_cache, ks, vs, slots);
  } else {
    TORCH_CHECK(false, "rope_write_kv_ supports float32 and bfloat16, got ", qkv.scalar_type());
  }
}

}  // namespace kvyard::ops

TORCH_LIBRARY_FRAGMENT(kvyard, m) {
  m.def("rope_write_kv_(Tensor(a!) qkv, Tensor cos, Tensor sin, int heads, int kv_heads, Tensor(b!) k_cache, "
        "Tensor(c!) v_cache, Tensor(d!)? k_scale, Tensor(e!)? v_scale, Tensor slots) -> ()");
}

TORCH_LIBRARY_IMPL(kvyard, CPU, m) { m.impl("rope_write_kv_", &kvyard::ops::rope_write_kv_); }
