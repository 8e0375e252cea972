// Fused RMSNorm (optionally after the residual add) and SiLU(gate) * up, registered as torch.ops.kvyard.*.
//
// Each replaces four to seven PyTorch ops per call, 61 calls per step for SmolLM2; at decode sizes the
// per-op cost, not the arithmetic, is what these save. Every intermediate that PyTorch rounds to the model
// dtype (HF's order: normalise in fp32, cast, then scale) is rounded here too.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "ops.h"
#include "vec.h"

namespace {

using namespace kvyard;

// x = weight * T(x / rms(x)) over one row, in fp32 with the one rounding HF's LlamaRMSNorm makes.
template <typename T>
void normalize(float* __restrict x, const float* __restrict weight, int64_t h, float eps) {
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < h; ++i) ss += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(h) + eps);
#pragma omp simd
  for (int64_t i = 0; i < h; ++i) x[i] = weight[i] * round_as<T>(x[i] * inv);
}

template <typename T>
void norm_rows(T* x, const T* delta, const T* weight, T* out, int64_t rows, int64_t h, float eps) {
  at::parallel_for(0, rows, row_grain(h), [&](int64_t begin, int64_t end) {
    std::vector<float> xf(h), wf(h), df(delta != nullptr ? h : 0);
    load_row(weight, 1.0f, wf.data(), h);
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x + r * h;
      load_row(xr, 1.0f, xf.data(), h);
      if (delta != nullptr) {  // the residual add, rounded once and written back, as x.add_(delta)
        load_row(delta + r * h, 1.0f, df.data(), h);
        for (int64_t i = 0; i < h; ++i) xf[i] = round_as<T>(xf[i] + df[i]);
        store_row(xf.data(), 1.0f, xr, h);
      }
      normalize<T>(xf.data(), wf.data(), h, eps);
      store_row(xf.data(), 1.0f, out + r * h, h);
    }
  });
}

void check_norm(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [rows, hidden] matrix");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(), "weight must be [hidden]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight and x must share a dtype");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "float32 or bfloat16 only");
}

at::Tensor norm_impl(const at::Tensor& x, const std::optional<at::Tensor>& delta, const at::Tensor& weight,
                     double eps) {
  check_norm(x, weight);
  if (delta) TORCH_CHECK(delta->sizes() == x.sizes() && delta->is_contiguous() &&
                             delta->scalar_type() == x.scalar_type(), "delta must match x");
  at::Tensor out = at::empty_like(x);
  const int64_t rows = x.size(0), h = x.size(1);
  if (x.scalar_type() == at::kFloat) {
    norm_rows<float>(x.data_ptr<float>(), delta ? delta->data_ptr<float>() : nullptr, weight.data_ptr<float>(),
                     out.data_ptr<float>(), rows, h, static_cast<float>(eps));
  } else {
    norm_rows<at::BFloat16>(x.data_ptr<at::BFloat16>(), delta ? delta->data_ptr<at::BFloat16>() : nullptr,
                            weight.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), rows, h,
                            static_cast<float>(eps));
  }
  return out;
}

// g[i] = silu(g[i]) * u[i], silu rounded to T first as F.silu's output is. (A function of its own with
// __restrict pointers: inlined into the row loop, the compiler could not prove g and u apart.)
// The gated MLPs' activations, both x * sigmoid(z): silu's z is x; gelu-tanh's 0.5 x (1 + tanh(y)) is
// x * sigmoid(2y), with y = sqrt(2 / pi) (x + 0.044715 x^3).
enum class Gate { kSilu, kGeluTanh };

template <Gate A>
inline float sigmoid_arg(float x) {
  if constexpr (A == Gate::kSilu) return x;
  else return 1.5957691216057308f * (x + 0.044715f * x * x * x);
}

template <typename T, Gate A>
void gate_times(float* __restrict g, const float* __restrict u, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) g[i] = round_as<T>(g[i] / (1.0f + fast_exp(-sigmoid_arg<A>(g[i])))) * u[i];
}

template <typename T, Gate A>
void gate_mul_rows(const T* gate_up, T* out, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, row_grain(inter), [&](int64_t begin, int64_t end) {
    std::vector<float> g(inter), u(inter);
    for (int64_t r = begin; r < end; ++r) {
      load_row(gate_up + r * 2 * inter, 1.0f, g.data(), inter);
      load_row(gate_up + r * 2 * inter + inter, 1.0f, u.data(), inter);
      gate_times<T, A>(g.data(), u.data(), inter);
      store_row(g.data(), 1.0f, out + r * inter, inter);
    }
  });
}

}  // namespace

namespace kvyard::ops {

// weight * (x / rms(x)), as HF's LlamaRMSNorm.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return norm_impl(x, std::nullopt, weight, eps);
}

// x += delta in place, then rms_norm(x): the residual stream's add fused with the next layer norm.
at::Tensor add_rms_norm_(at::Tensor x, const at::Tensor& delta, const at::Tensor& weight, double eps) {
  return norm_impl(x, delta, weight, eps);
}

template <Gate A>
at::Tensor gate_mul(const at::Tensor& gate_up, const char* name) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "gate_up must be a contiguous [rows, 2 * intermediate] matrix");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, inter}, gate_up.options());
  if (gate_up.scalar_type() == at::kFloat) {
    gate_mul_rows<float, A>(gate_up.data_ptr<float>(), out.data_ptr<float>(), rows, inter);
  } else if (gate_up.scalar_type() == at::kBFloat16) {
    gate_mul_rows<at::BFloat16, A>(gate_up.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), rows, inter);
  } else {
    TORCH_CHECK(false, name, " supports float32 and bfloat16, got ", gate_up.scalar_type());
  }
  return out;
}

// silu(gate_up[:, :I]) * gate_up[:, I:] for the fused gate|up projection's output [rows, 2I].
at::Tensor silu_mul(const at::Tensor& gate_up) { return gate_mul<Gate::kSilu>(gate_up, "silu_mul"); }

// gelu-tanh(gate_up[:, :I]) * gate_up[:, I:] (Gemma's MLP), the activation rounded to the dtype before the product
// as PyTorch's two ops round it.
at::Tensor gelu_tanh_mul(const at::Tensor& gate_up) { return gate_mul<Gate::kGeluTanh>(gate_up, "gelu_tanh_mul"); }

}  // namespace kvyard::ops

TORCH_LIBRARY_FRAGMENT(kvyard, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) x, Tensor delta, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("gelu_tanh_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvyard, CPU, m) {
  m.impl("rms_norm", &kvyard::ops::rms_norm);
  m.impl("add_rms_norm_", &kvyard::ops::add_rms_norm_);
  m.impl("silu_mul", &kvyard::ops::silu_mul);
  m.impl("gelu_tanh_mul", &kvyard::ops::gelu_tanh_mul);
}
