// A decode step's decoder layers in one call from Python, registered as torch.classes.kvyard.DecodeStack.
//
// At batch 1 a layer's kernels take ~50 us on SmolLM2 (2-core AMD EPYC), while calling them one by one from
// Python (wrappers, views, dispatch) cost ~80 us more: 2.5 ms of a ~11 ms step over 30 layers. Here the same
// kernels run in the same order, on the same tensors, called directly from C++, so the outputs are
// bit-identical to kvyard/models/decoder.py's run_layer, whose steps this file mirrors one for one.
//
// Weights come in the forms kvyard's kernels read for a few rows (kvyard/models/decode_stack.py says which):
// VNNI blocks (AVX512-BF16 or AMX), low-bit codes (portable, AVX-512 or AMX kernel), plain bf16 (linear_bf16) and dense
// fp32 (at::linear).
#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "ops.h"

namespace {

using OptTensor = std::optional<at::Tensor>;
namespace ops = kvyard::ops;

// How one weight is multiplied (the numbering is kvyard/models/decode_stack.py's KINDS).
enum Kind : int64_t { kDpbf16 = 0, kAmx = 1, kLowBit = 2, kAmxLowBit = 3, kLinearBf16 = 4, kDense = 5, kVnniLowBit = 6,
            kLowBitI8 = 7 };

struct Linear {
  Kind kind;
  at::Tensor w;  // VNNI blocks, low-bit codes, or the dense matrix
  OptTensor scale, zero, bias, outlier_cols, outliers;  // outliers: the low-bit kernels over VNNI blocks only
  int64_t bits = 0, group = 0, out_features = 0, k_pad = 0;

  // linear(x, weight, bias) of kvyard/models/linear.py for a few rows: the weight's own kernel, and the bias
  // added after it where the kernel takes none (y + b, rounded as PyTorch rounds it).
  at::Tensor operator()(const at::Tensor& x) const {
    at::Tensor y;
    switch (kind) {
      case kDpbf16: return ops::dpbf16_linear(x, w, bias);
      case kAmx: return ops::amx_linear(x, w, bias);
      case kDense: return at::linear(x, w, bias);
      case kLowBit:
      case kLowBitI8: {  // PlainLowBitLinear.kernel: kLowBitI8 is --dynamic-quant's int8 activations
        const at::Tensor padded = (x.size(1) == k_pad ? x : at::constant_pad_nd(x, {0, k_pad - x.size(1)})).contiguous();
        y = kind == kLowBitI8 ? ops::lowbit_linear_i8(padded, w, *scale, zero, bits, group, out_features)
                              : ops::lowbit_linear(padded, w, *scale, zero, bits, group, out_features);
        break;
      }
      case kAmxLowBit: y = ops::amx_linear_lowbit(x, w, *scale, zero, bits, group, outlier_cols, outliers); break;
      case kVnniLowBit: y = ops::vnni_lowbit_linear(x, w, *scale, zero, bits, group, outlier_cols, outliers); break;
      case kLinearBf16: y = ops::linear_bf16(x.contiguous(), w); break;
      default: TORCH_CHECK(false, "unknown linear kind ", static_cast<int64_t>(kind));
    }
    return bias ? y + *bias : y;
  }
};

// The loaded LoRA adapters' stacked pairs for one projection (kvyard/lora/stack.py's StackedLora); rank 0: none
// adapts it. Each decode row adds its own adapter's delta after the projection (its slot; -1: the base model),
// with the same kernel, on the same tensors, as DecoderModel._project.
struct Lora {
  at::Tensor a, b, used;
  int64_t rank = 0;
  std::vector<int64_t> offsets;

  void add_(at::Tensor& out, const at::Tensor& x, const OptTensor& slots) const {
    if (rank > 0 && slots) ops::lora_bgmv_(out, x.contiguous(), a, b, *slots, rank, used, offsets);
  }
};

struct Layer {
  at::Tensor input_norm, post_norm;
  OptTensor qk_norm, qk_scale;
  Linear qkv, o, gate_up, down;
  Lora lora[4];  // qkv, o, gate_up, down
};

class DecodeStack : public torch::CustomClassHolder {
 public:
  DecodeStack(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps) {}

  // One layer, its four weights as kinds[i] with tensors[6i .. 6i + 5] = (weight, scale, zero, bias,
  // outlier_cols, outliers) and ints[4i .. 4i + 3] = (bits, group, out_features, k_pad), in the order qkv, o,
  // gate_up, down.
  void add_layer(at::Tensor input_norm, at::Tensor post_norm, OptTensor qk_norm, OptTensor qk_scale,
                 std::vector<int64_t> kinds, c10::List<OptTensor> tensors, std::vector<int64_t> ints) {
    TORCH_CHECK(kinds.size() == 4 && tensors.size() == 24 && ints.size() == 16, "a layer has four weights");
    Linear lin[4];
    for (size_t i = 0; i < 4; ++i) {
      const OptTensor w = tensors.get(6 * i);
      TORCH_CHECK(w.has_value() && kinds[i] >= kDpbf16 && kinds[i] <= kLowBitI8, "weight ", i, " has no kernel");
      lin[i] = Linear{static_cast<Kind>(kinds[i]), *w, tensors.get(6 * i + 1), tensors.get(6 * i + 2),
                      tensors.get(6 * i + 3), tensors.get(6 * i + 4), tensors.get(6 * i + 5),
                      ints[4 * i], ints[4 * i + 1], ints[4 * i + 2], ints[4 * i + 3]};
    }
    layers_.push_back(Layer{std::move(input_norm), std::move(post_norm), std::move(qk_norm), std::move(qk_scale),
                            lin[0], lin[1], lin[2], lin[3]});
  }

  // Layer `layer`'s adapters for `projection` (0 qkv, 1 o, 2 gate_up, 3 down).
  void set_lora(int64_t layer, int64_t projection, at::Tensor a, at::Tensor b, at::Tensor used, int64_t rank,
                std::vector<int64_t> offsets) {
    TORCH_CHECK(layer >= 0 && layer < num_layers() && projection >= 0 && projection < 4, "no such projection");
    layers_[layer].lora[projection] = Lora{std::move(a), std::move(b), std::move(used), rank, std::move(offsets)};
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // Every layer on the residual stream x [rows, hidden], updated in place: run_layer in a loop, for a step of
  // decodes only (one query per row, attending through the block tables). With dp_attention a bf16 cache's decodes
  // take paged_attention_dp's arithmetic, a prompt token's on this CPU (the batch-invariant path), rather than the
  // decode kernel's fp32 chain.
  void forward(at::Tensor x, at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> k_caches,
               std::vector<at::Tensor> v_caches, c10::List<OptTensor> k_scales, c10::List<OptTensor> v_scales,
               at::Tensor slots, at::Tensor block_table, at::Tensor seq_lens, int64_t block_size,
               OptTensor lora_slots, bool dp_attention) {
    const size_t n_layers = layers_.size();
    TORCH_CHECK(k_caches.size() == n_layers && v_caches.size() == n_layers && k_scales.size() == n_layers &&
                    v_scales.size() == n_layers, "one cache per layer");
    const int64_t rows = x.size(0);
    const double scale = std::pow(static_cast<double>(head_dim_), -0.5);  // as Python's head_dim**-0.5
    // A layer's MLP output waits for the next layer's input norm, which adds it to x in the same pass
    // (add_rms_norm_ rounds the sum once and writes it back, as x.add_ does): one small call per layer fewer,
    // ~2 us each at batch 1. The last layer's is added at the end.
    at::Tensor mlp_out;
    for (size_t i = 0; i < n_layers; ++i) {
      const Layer& layer = layers_[i];
      // attention
      const at::Tensor h_in = mlp_out.defined() ? ops::add_rms_norm_(x, mlp_out, layer.input_norm, eps_)
                                                : ops::rms_norm(x, layer.input_norm, eps_);
      at::Tensor qkv_out = layer.qkv(h_in);
      layer.lora[0].add_(qkv_out, h_in, lora_slots);
      at::Tensor qkv = qkv_out.view({rows, heads_ + 2 * kv_heads_, head_dim_});
      at::Tensor qk = qkv.narrow(1, 0, heads_ + kv_heads_);
      if (layer.qk_norm) {
        const at::Tensor normed = at::rms_norm(qk.to(at::kFloat), {head_dim_}, std::nullopt, eps_);
        qk.copy_(*layer.qk_norm * normed.to(qk.scalar_type()));
      }
      if (layer.qk_scale) qk.mul_(*layer.qk_scale);
      const OptTensor k_scale = k_scales.get(i), v_scale = v_scales.get(i);
      ops::rope_write_kv_(qkv, cos, sin, heads_, kv_heads_, k_caches[i], v_caches[i], k_scale, v_scale, slots);
      const at::Tensor q = qkv.narrow(1, 0, heads_);
      const at::Tensor attn =
          dp_attention && !k_scale.has_value() && q.scalar_type() == at::kBFloat16
              ? ops::paged_attention_dp(q, k_caches[i], v_caches[i], block_table, seq_lens, block_size, scale, true)
              : ops::paged_decode_attention(q, k_caches[i], v_caches[i], k_scale, v_scale, block_table, seq_lens,
                                            block_size, scale);
      const at::Tensor o_in = attn.reshape({rows, heads_ * head_dim_});
      at::Tensor h = layer.o(o_in);
      layer.lora[1].add_(h, o_in, lora_slots);
      // MLP
      const at::Tensor normed = ops::add_rms_norm_(x, h, layer.post_norm, eps_);
      at::Tensor gate_up = layer.gate_up(normed);
      layer.lora[2].add_(gate_up, normed, lora_slots);
      const at::Tensor down_in = ops::silu_mul(gate_up);
      mlp_out = layer.down(down_in);
      layer.lora[3].add_(mlp_out, down_in, lora_slots);
    }
    if (mlp_out.defined()) x.add_(mlp_out);
  }

 private:
  int64_t heads_, kv_heads_, head_dim_;
  double eps_;
  std::vector<Layer> layers_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvyard, m) {
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<int64_t, int64_t, int64_t, double>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("set_lora", &DecodeStack::set_lora)
      .def("num_layers", &DecodeStack::num_layers)
      .def("forward", &DecodeStack::forward);
}
