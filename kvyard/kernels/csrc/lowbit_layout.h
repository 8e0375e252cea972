// The portable low-bit layout (kvyard/quant/qlinear.py, PlainLowBitLinear), shared by lowbit_linear.cpp and
// lowbit_int8_act.cpp: codes int8 q, or int4 u = q + 8 two per byte (within each run of 32 values, byte j holds
// value j low and j + 16 high), each row cut into chunks of 32 bytes and the four rows of each block of output
// rows interleaved chunk by chunk, [N/4][chunks][4][32 bytes]; scales and zero terms [N, groups] fp32.
#pragma once

#include <torch/library.h>

#include <optional>

#include "widened_rows.h"

namespace kvyard {

constexpr int64_t kInt4Run = 32;     // values per nibble run in the int4 layout
constexpr int64_t kChunkBytes = 32;  // bytes of one row in each chunk of the interleaved layout

// A weight's dimensions, checked against the layout: n and k padded (rows to blocks of 4, k to chunks).
struct LowBitDims {
  int64_t n, k, groups, row_bytes;
};

inline LowBitDims check_layout(const at::Tensor& q, const at::Tensor& scale,
                               const std::optional<at::Tensor>& zero, int64_t bits, int64_t group_size) {
  TORCH_CHECK(bits == 8 || bits == 4, "bits must be 8 or 4, got ", bits);
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && q.scalar_type() == (bits == 8 ? at::kChar : at::kByte),
              "q must be int8 [out, in] (uint8 [out, in/2] for int4)");
  const int64_t n = q.size(0), row_bytes = q.size(1), k = row_bytes * 8 / bits;
  TORCH_CHECK(n % kBlockRows == 0 && row_bytes % kChunkBytes == 0, "q must be padded to blocks of ", kBlockRows,
              " rows and chunks of ", kChunkBytes, " bytes, got ", n, " x ", row_bytes);
  TORCH_CHECK(group_size > 0 && group_size % kInt4Run == 0, "groups must be whole runs of 32 values, got ", group_size);
  const int64_t groups = (k + group_size - 1) / group_size;
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.sizes() == at::IntArrayRef({n, groups}),
              "scale must be float32 [out, groups] = [", n, ", ", groups, "]");
  if (zero) TORCH_CHECK(zero->sizes() == scale.sizes() && zero->scalar_type() == at::kFloat && zero->is_contiguous(),
                        "zero must match scale");
  return {n, k, groups, row_bytes};
}

}  // namespace kvyard
