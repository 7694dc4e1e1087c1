// fp8linear::linear: FP8Linear's forward as one op: the activation quantization and the
// product, composed here in C++ of the two ops (through the dispatcher, so every device
// and torch.compile take their own implementations of them). From Python the composition
// costs two op calls and the code around them: on SmolLM2's layers at M = 1 (AMD EPYC Zen
// 3) FP8Linear took ~40 us a call on a 64 x 64 layer, of which ~16 us were the two calls
// themselves; bf16 nn.Linear took ~11 us. And dynamic_linear_from_python, the same for
// FP8Linear's fast path on inputs whose quantization sibling layers reuse (ops.cpp).
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/accumulate.h>
#include <torch/library.h>

#include "../kernels.h"

namespace fp8linear {
namespace {

// How FP8Linear quantizes its input; the values of fp8linear.linear's ACTIVATION_* codes.
enum ActivationMode : int64_t { kActivationsNone = 0, kActivationsStatic = 1, kActivationsDynamic = 2 };
// kPerGroupPowerOfTwo: per group, scales rounded up to powers of two (scale_fmt "ue8m0")
enum ActivationGranularity : int64_t { kPerTensor = 0, kPerToken = 1, kPerGroup = 2, kPerGroupPowerOfTwo = 3 };

using QuantizeSignature = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const std::optional<at::Tensor>&,
                                                            at::ScalarType, bool);
using QuantizeBlocksSignature = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const std::optional<at::Tensor>&,
                                                                  at::ScalarType, int64_t, int64_t, bool);
using ScaledMmSignature = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                     const std::optional<at::Tensor>&, at::ScalarType);
using LinearSignature = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, int64_t, int64_t);

// The ops' handles, looked up once (after the library has registered them).
const c10::TypedOperatorHandle<QuantizeSignature>& quantize_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("fp8linear::quantize_fp8", "").typed<QuantizeSignature>();
  return op;
}
const c10::TypedOperatorHandle<QuantizeBlocksSignature>& quantize_blocks_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("fp8linear::quantize_fp8_blocks", "")
                             .typed<QuantizeBlocksSignature>();
  return op;
}
const c10::TypedOperatorHandle<ScaledMmSignature>& scaled_mm_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("fp8linear::scaled_mm", "").typed<ScaledMmSignature>();
  return op;
}

// The activations as the layer quantizes them: x2d [rows, K] float; weight's dtype is the
// activations' fp8 dtype; activation_scale: the static input scale, or the unit scale of
// weight-only layers. Returns (a, scale_a): what quantize_fp8 (or quantize_fp8_blocks for
// groups) gives, or x2d itself for weight-only layers.
std::tuple<at::Tensor, at::Tensor> quantize_activations(const at::Tensor& x2d, const at::Tensor& weight,
                                                        const std::optional<at::Tensor>& activation_scale,
                                                        int64_t activations, int64_t granularity) {
  if (activations == kActivationsNone) return {x2d, *activation_scale};
  if (activations == kActivationsStatic) {
    return quantize_op().call(x2d, activation_scale, weight.scalar_type(), false);
  }
  if (granularity == kPerGroup || granularity == kPerGroupPowerOfTwo) {
    return quantize_blocks_op().call(x2d, std::nullopt, weight.scalar_type(), 1, FP8_SCALE_BLOCK,
                                     granularity == kPerGroupPowerOfTwo);
  }
  return quantize_op().call(x2d, std::nullopt, weight.scalar_type(), granularity == kPerToken);
}

// scaled_mm of the quantized activations (a [rows, K], scale_a) with the weight, viewed as
// x's leading dimensions + [N], in x's dtype.
at::Tensor product(const at::Tensor& x, const at::Tensor& a, const at::Tensor& scale_a, const at::Tensor& weight,
                   const at::Tensor& weight_scale, const std::optional<at::Tensor>& bias) {
  // per-channel [N, 1] and block [N/128, K/128] weight scales are those of w.t() transposed
  const at::Tensor scale_b = weight_scale.dim() > 0 ? weight_scale.t() : weight_scale;
  const at::Tensor out = scaled_mm_op().call(a, weight.t(), scale_a, scale_b, bias, x.scalar_type());
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  shape.push_back(weight.size(0));
  return out.view(shape);
}

void check_linear_args(const at::Tensor& x, const at::Tensor& weight, int64_t activations, int64_t granularity) {
  TORCH_CHECK_VALUE(x.dim() >= 1 && weight.dim() == 2 && x.size(-1) == weight.size(1),
                    "linear: x's last dimension must be weight's in_features=", weight.dim() == 2 ? weight.size(1) : -1,
                    ", got x of shape ", x.sizes(), " and weight of shape ", weight.sizes());
  TORCH_CHECK_VALUE(activations >= kActivationsNone && activations <= kActivationsDynamic,
                    "linear: activations must be 0 (none), 1 (static) or 2 (dynamic), got ", activations);
  TORCH_CHECK_VALUE(granularity >= kPerTensor && granularity <= kPerGroupPowerOfTwo,
                    "linear: granularity must be 0 (tensor), 1 (token), 2 (group) or 3 (group, power-of-two "
                    "scales), got ", granularity);
}

// The rows of x [..., K]: the product of its leading dimensions.
int64_t row_count(const at::Tensor& x) { return c10::multiply_integers(x.sizes().begin(), x.sizes().end() - 1); }

// x [..., K] viewed as [rows, K]; rows counted, not inferred: reshape cannot infer -1 when K = 0
at::Tensor rows_of(const at::Tensor& x) { return x.reshape({row_count(x), x.size(-1)}); }

// x [..., K] float; weight [N, K] fp8 (its dtype is also the activations' fp8 dtype);
// weight_scale () / [N, 1] / [ceil(N/128), ceil(K/128)]; bias [N] or None;
// activation_scale: the static input scale, or the unit scale of weight-only layers.
// Returns [..., N] in x's dtype: exactly what quantize_fp8 (or quantize_fp8_blocks for
// groups) followed by scaled_mm give.
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                  const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& activation_scale,
                  int64_t activations, int64_t granularity) {
  check_linear_args(x, weight, activations, granularity);
  TORCH_CHECK_VALUE(activations == kActivationsDynamic || activation_scale.has_value(),
                    "linear: activation_scale is needed unless activations are dynamic");
  const auto [a, scale_a] = quantize_activations(rows_of(x), weight, activation_scale, activations, granularity);
  return product(x, a, scale_a, weight, weight_scale, bias);
}

}  // namespace

at::Tensor linear_from_python(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                              const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& activation_scale,
                              int64_t activations, int64_t granularity) {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("fp8linear::linear", "").typed<LinearSignature>();
  return op.call(x, weight, weight_scale, bias, activation_scale, activations, granularity);
}

// A layer with dynamic activations on x, given x's quantization (quantized, its scale) by
// an earlier layer fed the same x, or quantizing it here: returns (out, a, scale_a), the
// output and the quantization it used, for the next layer to reuse. The caller (the fast
// path in ops.cpp) vouches that a given quantization is x's with this granularity and
// the weight's fp8 dtype.
std::tuple<at::Tensor, at::Tensor, at::Tensor> dynamic_linear_from_python(
    const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale, const std::optional<at::Tensor>& bias,
    int64_t granularity, const std::optional<at::Tensor>& quantized, const std::optional<at::Tensor>& quantized_scale) {
  check_linear_args(x, weight, kActivationsDynamic, granularity);
  TORCH_CHECK(quantized.has_value() == quantized_scale.has_value(),
              "dynamic_linear: give both the kept quantization and its scale, or neither");
  at::Tensor a, scale_a;
  if (quantized.has_value()) {
    a = *quantized;
    scale_a = *quantized_scale;
    // what the caller vouches for, checked where it costs nothing: a quantization of
    // another dtype or shape would be a wrong result, not an error, further down
    TORCH_CHECK(a.scalar_type() == weight.scalar_type() && a.dim() == 2 && a.size(1) == x.size(-1) &&
                    a.size(0) == row_count(x),
                "dynamic_linear: the kept quantization ", a.scalar_type(), " ", a.sizes(),
                " is not one of x (", x.sizes(), ") for a ", weight.scalar_type(), " weight");
  } else {
    std::tie(a, scale_a) = quantize_activations(rows_of(x), weight, std::nullopt, kActivationsDynamic, granularity);
  }
  return {product(x, a, scale_a, weight, weight_scale, bias), a, scale_a};
}

TORCH_LIBRARY_IMPL(fp8linear, CompositeImplicitAutograd, m) { m.impl("linear", &linear); }

}  // namespace fp8linear
