// The VNNI-block weight layout (kvyard/kernels/vnni.py) as the four kernels over it see it: AMX and AVX512-BF16
// for bf16 weights (amx_linear.cpp, dpbf16_linear.cpp), AMX and AVX-512 registers for low-bit ones
// (amx_lowbit.cpp, vnni_lowbit.cpp). One place for the shapes they accept and for the call around each loop.
//
// bf16: [N/32, K/2, 32, 2], row p of a block holding W[n, 2p], W[n, 2p + 1] for each of its 32 columns n.
// Low-bit: int8 q in the same order; int4 q + 8 two per byte, [N/32, K/2, 32] uint8, byte i of a row holding
// value i in its low nibble and value i + 32 in its high one; scales and zero terms [groups, N] fp32.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

namespace kvyard::vnni {

constexpr int64_t kBlockCols = 32;  // output columns per block
constexpr int64_t kKStep = 32;      // K is a multiple of this

inline int64_t num_groups(int64_t k, int64_t group) { return (k + group - 1) / group; }  // the last may be short

// out [rows, N] bf16 = x @ W^T (+ bias) for W in bf16 blocks, the loop being
// matmul(x, w, bias or nullptr, out, m, n, k) over raw bf16 bits.
template <typename Matmul>
at::Tensor bf16_blocks_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                              Matmul&& matmul) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be a bf16 [rows, in] matrix");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.size(1) % (kKStep / 2) == 0 && packed.size(2) == kBlockCols && packed.size(3) == 2,
              "packed must be a contiguous bf16 [out/32, in/2, 32, 2] VNNI layout (in a multiple of 32)");
  const int64_t m = x.size(0), n = packed.size(0) * kBlockCols, k = packed.size(1) * 2;
  TORCH_CHECK(x.size(1) == k, "x has ", x.size(1), " columns, the weight takes ", k);
  if (bias) TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == at::kBFloat16 &&
                            bias->is_contiguous(), "bias must be a contiguous bf16 [out] vector");
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({m, n}, x.options());
  if (m > 0 && n > 0) {
    matmul(reinterpret_cast<const uint16_t*>(xc.data_ptr()), reinterpret_cast<const uint16_t*>(packed.data_ptr()),
           bias ? reinterpret_cast<const uint16_t*>(bias->data_ptr()) : nullptr,
           reinterpret_cast<uint16_t*>(out.data_ptr()), m, n, k);
  }
  return out;
}

// A low-bit weight in blocks, as the loops read it.
struct LowBitBlocks {
  const uint8_t* q;
  const float* scale;  // [groups, N]
  const float* zero;   // [groups, N], or nullptr
  int64_t n, k, group, bits;
};

// out [rows, N] bf16 = x @ dequantized(W)^T for W in low-bit blocks, the loop being
// matmul(x (contiguous), LowBitBlocks, out bf16 bits, m).
template <typename Matmul>
at::Tensor lowbit_blocks_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                                const std::optional<at::Tensor>& zero, int64_t bits, int64_t group_size,
                                Matmul&& matmul) {
  TORCH_CHECK(bits == 8 || bits == 4, "bits must be 8 or 4, got ", bits);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be a bf16 [rows, in] matrix");
  TORCH_CHECK(q.scalar_type() == (bits == 8 ? at::kChar : at::kByte) && q.is_contiguous() &&
                  q.dim() == (bits == 8 ? 4 : 3) && q.size(2) == kBlockCols && (bits == 4 || q.size(3) == 2) &&
                  q.size(1) % (kKStep / 2) == 0,
              "q must be int8 [out/32, in/2, 32, 2] VNNI blocks (uint8 [out/32, in/2, 32] for int4)");
  const int64_t m = x.size(0), n = q.size(0) * kBlockCols, k = q.size(1) * 2;
  TORCH_CHECK(x.size(1) == k, "x has ", x.size(1), " columns, the weight takes ", k);
  TORCH_CHECK(group_size > 0 && group_size % kKStep == 0, "group_size must be a multiple of 32, got ", group_size);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.dim() == 2 &&
                  scale.size(0) == num_groups(k, group_size) && scale.size(1) == n,
              "scale must be float32 [groups, out]");
  if (zero) TORCH_CHECK(zero->sizes() == scale.sizes() && zero->scalar_type() == at::kFloat && zero->is_contiguous(),
                        "zero must match scale");
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({m, n}, x.options());
  if (m > 0 && n > 0) {
    const LowBitBlocks w{reinterpret_cast<const uint8_t*>(q.data_ptr()), scale.data_ptr<float>(),
                         zero ? zero->data_ptr<float>() : nullptr, n, k, group_size, bits};
    matmul(reinterpret_cast<const uint16_t*>(xc.data_ptr()), w, reinterpret_cast<uint16_t*>(out.data_ptr()), m);
  }
  return out;
}

}  // namespace kvyard::vnni
