// Many LoRA adapters in one batch (kvyard/lora/stack.py): out[i] += x[i] @ A_s.T @ B_s for each row i with
// an adapter s, reading only that adapter's A and B (Punica's BGMV), registered as torch.ops.kvyard.lora_bgmv_.
//
// The stacks hold every loaded adapter a slot of W = parts x rank rows: A is [slots * W, in], B is
// [slots * W, out], and part p of a fused projection (q|k|v, gate|up) writes only its columns
// [offsets[p], offsets[p + 1]) of the fused output. `used[slot][p]` is how many of a part's rank rows its
// adapter fills (0 where it does not adapt that part); the padded rows are never read.
// Each row's delta is summed in fp32 and added to the row once, rounded to the model's dtype.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace {

using namespace kvyard;

#ifdef __AVX512F__
// One adapter's rows (bf16, widths multiples of 16): A and B read as bf16 and widened in registers; each
// 16 output columns summed over the rank in one register and added to the row once.
void bf16_group(at::BFloat16* out, const at::BFloat16* x, const at::BFloat16* a, const at::BFloat16* b,
                const std::vector<int64_t>& members, int64_t slot, int64_t in, int64_t width, int64_t rank,
                const int64_t* used, const std::vector<int64_t>& offsets, std::vector<float>& xf,
                std::vector<float>& t) {
  const int64_t m = static_cast<int64_t>(members.size()), out_width = offsets.back();
  const int64_t parts = static_cast<int64_t>(offsets.size()) - 1;
  const auto* a16 = reinterpret_cast<const uint16_t*>(a) + slot * width * in;
  const auto* b16 = reinterpret_cast<const uint16_t*>(b) + slot * width * out_width;
  xf.resize(m * in);
  t.resize(m * width);
  for (int64_t j = 0; j < m; ++j) load_row(x + members[j] * in, 1.0f, xf.data() + j * in, in);
  constexpr int64_t kRows = 8;
  for (int64_t r = 0; r < width; ++r) {  // shrink: t[j][r] = x_j . A_r, up to 8 rows' sums side by side
    if (r % rank >= used[r / rank]) continue;  // a padded row: its t is never read
    const uint16_t* ar = a16 + r * in;
    for (int64_t j0 = 0; j0 < m; j0 += kRows) {
      const int64_t n = std::min(kRows, m - j0);
      __m512 acc[kRows];
      for (int64_t jj = 0; jj < n; ++jj) acc[jj] = _mm512_setzero_ps();
      for (int64_t k = 0; k < in; k += 16) {  // independent chains: no row waits on another's last FMA
        const __m512 av = load_bf16x16(ar + k);
        for (int64_t jj = 0; jj < n; ++jj)
          acc[jj] = _mm512_fmadd_ps(_mm512_loadu_ps(xf.data() + (j0 + jj) * in + k), av, acc[jj]);
      }
      for (int64_t jj = 0; jj < n; ++jj) t[(j0 + jj) * width + r] = _mm512_reduce_add_ps(acc[jj]);
    }
  }
  // expand: out_j[c] += sum_r t[j][r] B_r[c], a part's columns from its rows. Each 16 columns of B are read
  // once for up to 8 rows at a time (row by row, the adapter's B went through the caches once per row).
  for (int64_t p = 0; p < parts; ++p) {
    const uint16_t* bp = b16 + p * rank * out_width;
    for (int64_t c = offsets[p]; c < offsets[p + 1]; c += 16) {
      for (int64_t j0 = 0; j0 < m; j0 += kRows) {
        const int64_t n = std::min(kRows, m - j0);
        __m512 acc[kRows];
        for (int64_t jj = 0; jj < n; ++jj) acc[jj] = _mm512_setzero_ps();
        for (int64_t r = 0; r < used[p]; ++r) {
          const __m512 br = load_bf16x16(bp + r * out_width + c);
          for (int64_t jj = 0; jj < n; ++jj)
            acc[jj] = _mm512_fmadd_ps(_mm512_set1_ps(t[(j0 + jj) * width + p * rank + r]), br, acc[jj]);
        }
        for (int64_t jj = 0; jj < n; ++jj) {
          auto* dst = reinterpret_cast<uint16_t*>(out + members[j0 + jj] * out_width) + c;
          store_bf16x16(dst, _mm512_add_ps(acc[jj], load_bf16x16(dst)));
        }
      }
    }
  }
}
#endif

template <typename T>
void bgmv_rows(T* out, const T* x, const T* a, const T* b, const int64_t* slots, int64_t rows, int64_t in,
               int64_t width, int64_t rank, const int64_t* used, const std::vector<int64_t>& offsets) {
  const int64_t out_width = offsets.back(), parts = static_cast<int64_t>(offsets.size()) - 1;
  // The rows by adapter: each adapter's rows together, so that its A and B rows are widened to fp32 once
  // for all of them (at 32 rows over 8 adapters, a quarter of the conversions a row at a time made).
  std::vector<std::vector<int64_t>> groups;
  std::vector<int64_t> group_of;
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t slot = slots[i];
    if (slot < 0) continue;  // a base-model row
    if (slot >= static_cast<int64_t>(group_of.size())) group_of.resize(slot + 1, -1);
    if (group_of[slot] < 0) {
      group_of[slot] = static_cast<int64_t>(groups.size());
      groups.emplace_back();
    }
    groups[group_of[slot]].push_back(i);
  }
  bool vectorized = false;
#ifdef __AVX512F__
  vectorized = std::is_same_v<T, at::BFloat16> && in % 16 == 0 &&
               std::all_of(offsets.begin(), offsets.end(), [](int64_t o) { return o % 16 == 0; });
#endif
  at::parallel_for(0, static_cast<int64_t>(groups.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> af(in), bf(out_width), row_out(out_width), xs, ts;
    for (int64_t g = begin; g < end; ++g) {
      const std::vector<int64_t>& members = groups[g];
      const int64_t m = static_cast<int64_t>(members.size()), slot = slots[members[0]];
#ifdef __AVX512F__
      if constexpr (std::is_same_v<T, at::BFloat16>) {
        if (vectorized) {
          bf16_group(out, x, a, b, members, slot, in, width, rank, used + slot * parts, offsets, xs, ts);
          continue;
        }
      }
#endif
      std::vector<float> xf(m * in), t(m), acc(m * out_width, 0.0f);
      for (int64_t j = 0; j < m; ++j) load_row(x + members[j] * in, 1.0f, xf.data() + j * in, in);
      for (int64_t p = 0; p < parts; ++p) {
        const int64_t first = offsets[p], cols = offsets[p + 1] - offsets[p];
        for (int64_t r = 0; r < used[slot * parts + p]; ++r) {
          const int64_t row = slot * width + p * rank + r;
          load_row(a + row * in, 1.0f, af.data(), in);
          bool any = false;
          for (int64_t j = 0; j < m; ++j) {
            t[j] = dot(xf.data() + j * in, af.data(), in);
            any = any || t[j] != 0.0f;
          }
          if (!any) continue;  // a padded rank row (or nothing to add)
          load_row(b + row * out_width + first, 1.0f, bf.data(), cols);
          for (int64_t j = 0; j < m; ++j) {
            float* __restrict dst = acc.data() + j * out_width + first;
            const float* __restrict src = bf.data();
            const float tj = t[j];
#pragma omp simd
            for (int64_t c = 0; c < cols; ++c) dst[c] += tj * src[c];
          }
        }
      }
      for (int64_t j = 0; j < m; ++j) {  // each row's delta added once, rounded to the model's dtype
        T* dst = out + members[j] * out_width;
        load_row(dst, 1.0f, row_out.data(), out_width);
        const float* delta = acc.data() + j * out_width;
        for (int64_t c = 0; c < out_width; ++c) row_out[c] += delta[c];
        store_row(row_out.data(), 1.0f, dst, out_width);
      }
    }
  });
}

}  // namespace

namespace kvyard::ops {

void lora_bgmv_(at::Tensor out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                const at::Tensor& slots, int64_t rank, const at::Tensor& used, at::IntArrayRef part_offsets) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && a.dim() == 2 && b.dim() == 2, "x, out, a and b must be matrices");
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && a.is_contiguous() && b.is_contiguous(), "contiguous only");
  TORCH_CHECK(x.scalar_type() == out.scalar_type() && a.scalar_type() == x.scalar_type() &&
                  b.scalar_type() == x.scalar_type(), "x, out, a and b must share a dtype");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "float32 or bfloat16 only");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == x.size(0) && slots.scalar_type() == at::kLong &&
                  slots.is_contiguous(), "slots must be [rows] int64");
  std::vector<int64_t> offsets(part_offsets.begin(), part_offsets.end());
  const int64_t parts = static_cast<int64_t>(offsets.size()) - 1, width = parts * rank;
  TORCH_CHECK(parts >= 1 && rank >= 1 && offsets.front() == 0 && offsets.back() == out.size(1) &&
                  out.size(0) == x.size(0) && a.size(1) == x.size(1) && b.size(1) == out.size(1) &&
                  a.size(0) == b.size(0) && a.size(0) % width == 0, "shapes do not agree");
  TORCH_CHECK(used.dim() == 2 && used.size(0) == a.size(0) / width && used.size(1) == parts &&
                  used.scalar_type() == at::kLong && used.is_contiguous(), "used must be [slots, parts] int64");
  const int64_t rows = x.size(0), in = x.size(1);
  if (x.scalar_type() == at::kFloat) {
    bgmv_rows<float>(out.data_ptr<float>(), x.data_ptr<float>(), a.data_ptr<float>(), b.data_ptr<float>(),
                     slots.data_ptr<int64_t>(), rows, in, width, rank, used.data_ptr<int64_t>(), offsets);
  } else {
    bgmv_rows<at::BFloat16>(out.data_ptr<at::BFloat16>(), x.data_ptr<at::BFloat16>(), a.data_ptr<at::BFloat16>(),
                            b.data_ptr<at::BFloat16>(), slots.data_ptr<int64_t>(), rows, in, width, rank,
                            used.data_ptr<int64_t>(), offsets);
  }
}

}  // namespace kvyard::ops

TORCH_LIBRARY_FRAGMENT(kvyard, m) {
  m.def("lora_bgmv_(Tensor(a!) out, Tensor x, Tensor a, Tensor b, Tensor slots, int rank, Tensor used, "
        "int[] part_offsets) -> ()");
}

TORCH_LIBRARY_IMPL(kvyard, CPU, m) { m.impl("lora_bgmv_", &kvyard::ops::lora_bgmv_); }
