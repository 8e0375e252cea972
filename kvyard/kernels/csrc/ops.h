// kvyard's CPU kernels as C++ functions: what each .cpp registers as torch.ops.kvyard.*, callable directly by
// the kernels that string several together (decode_stack.cpp) without a trip through Python or the dispatcher.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace kvyard::ops {

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias);
at::Tensor dpbf16_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias);
at::Tensor dpbf16_linear_f32(const at::Tensor& x, const at::Tensor& packed);
at::Tensor amx_linear_lowbit(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                             const std::optional<at::Tensor>& zero, int64_t bits, int64_t group_size,
                             const std::optional<at::Tensor>& outlier_cols, const std::optional<at::Tensor>& outliers);
at::Tensor vnni_lowbit_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                              const std::optional<at::Tensor>& zero, int64_t bits, int64_t group_size,
                              const std::optional<at::Tensor>& outlier_cols, const std::optional<at::Tensor>& outliers);
// The same, with `int16_row`: one row through the int16 loop with its streams asked for ahead into L2 (what
// amx_linear_lowbit's int4 rows take); without it every row count takes the bf16 tiles, whose rows are invariant.
at::Tensor vnni_lowbit_linear_ex(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                                 const std::optional<at::Tensor>& zero, int64_t bits, int64_t group_size,
                                 const std::optional<at::Tensor>& outlier_cols, const std::optional<at::Tensor>& outliers,
                                 bool int16_row);
at::Tensor lowbit_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                         const std::optional<at::Tensor>& zero, int64_t bits, int64_t group_size, int64_t out_features);
at::Tensor lowbit_linear_i8(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                            const std::optional<at::Tensor>& zero, int64_t bits, int64_t group_size, int64_t out_features);
at::Tensor lowbit_dequantize(const at::Tensor& q, const at::Tensor& scale, const std::optional<at::Tensor>& zero,
                             int64_t bits, int64_t group_size);
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor add_rms_norm_(at::Tensor x, const at::Tensor& delta, const at::Tensor& weight, double eps);
at::Tensor silu_mul(const at::Tensor& gate_up);
at::Tensor gelu_tanh_mul(const at::Tensor& gate_up);
void lora_bgmv_(at::Tensor out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                const at::Tensor& slots, int64_t rank, const at::Tensor& used, at::IntArrayRef part_offsets);
void rope_write_kv_(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t kv_heads,
                    at::Tensor k_cache, at::Tensor v_cache, const std::optional<at::Tensor>& k_scale,
                    const std::optional<at::Tensor>& v_scale, const at::Tensor& slots);
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                                  const at::Tensor& block_table, const at::Tensor& seq_lens, int64_t block_size,
                                  double scale);
at::Tensor paged_attention_dp(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const at::Tensor& block_table, const at::Tensor& seq_lens, int64_t block_size,
                              double scale, bool lone_rows);

}  // namespace kvyard::ops
