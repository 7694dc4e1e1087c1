// The op schemas, declared once; each device file registers implementations.
// Also a small Python module for introspection (CPU variants, what was built).
#include <ATen/Parallel.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/autocast_mode.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/Exceptions.h>
#include <torch/extension.h>
#include <torch/library.h>

#include "../kernels.h"

TORCH_LIBRARY(fp8linear, m) {
  // x: any shape, float32/bfloat16/float16. scale: None (dynamic) or float32,
  // shape () for per-tensor, x.shape[:-1] + (1,) for per_row. Returns (q, scale).
  m.def("quantize_fp8(Tensor x, Tensor? scale, ScalarType dtype, bool per_row) -> (Tensor, Tensor)");
  // a [M, K] fp8 (or float32/bfloat16/float16: weight-only), b [K, N] fp8, scale_a () or [M, 1], scale_b () or [1, N], bias [N].
  m.def("scaled_mm(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, Tensor? bias, ScalarType out_dtype) -> Tensor");
  // One scale per block of block_rows x block_cols of x seen as [rows, cols] over its last
  // dimension: block_rows = 1 is groups of block_cols along the last dimension (scale
  // x.shape[:-1] + (ceil(cols / block_cols),)); block_rows > 1 needs a 2-D x (scale
  // [ceil(rows / block_rows), ceil(cols / block_cols)]). power_of_two: dynamic scales rounded
  // up to powers of two (scale_fmt "ue8m0"). Returns (q, scale).
  m.def("quantize_fp8_blocks(Tensor x, Tensor? scale, ScalarType dtype, int block_rows, int block_cols, "
        "bool power_of_two=False) -> (Tensor, Tensor)");
  // FP8Linear's forward as one op (ops_linear.cpp: the activation quantization, then
  // scaled_mm, composed of the ops above for every device). x [..., K] float, weight
  // [N, K] fp8, weight_scale () / [N, 1] / [ceil(N/128), ceil(K/128)], bias [N];
  // activations 0 none / 1 static / 2 dynamic, granularity 0 tensor / 1 token / 2 group /
  // 3 group with power-of-two scales (scale_fmt "ue8m0").
  m.def("linear(Tensor x, Tensor weight, Tensor weight_scale, Tensor? bias, Tensor? activation_scale, int activations, int granularity) -> Tensor");
}

namespace fp8linear {
// Defined in ops_linear.cpp: fp8linear::linear through the dispatcher.
at::Tensor linear_from_python(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                              const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& activation_scale,
                              int64_t activations, int64_t granularity);
std::tuple<at::Tensor, at::Tensor, at::Tensor> dynamic_linear_from_python(
    const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale, const std::optional<at::Tensor>& bias,
    int64_t granularity, const std::optional<at::Tensor>& quantized, const std::optional<at::Tensor>& quantized_scale);
// Defined in ops_cpu.cpp: the CPU kernel scaled_mm picks, and whether its block scales fold.
std::tuple<std::string, bool> cpu_scaled_mm_plan(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                                                 const at::Tensor& scale_b);
}  // namespace fp8linear

#ifdef FP8LINEAR_WITH_CUDA
namespace fp8linear {
// Defined in ops_cuda.cpp: CUDA introspection and path forcing for tests.
void register_cuda_python(pybind11::module& module);
}  // namespace fp8linear
#endif

namespace {

std::vector<std::string> cpu_variants_supported() {
  std::vector<std::string> names;
  for (int v = FP8_CPU_SCALAR; v < FP8_CPU_VARIANT_COUNT; ++v) {
    if (fp8_cpu_variant_supported(static_cast<fp8_cpu_variant>(v))) {
      names.emplace_back(fp8_cpu_variant_name(static_cast<fp8_cpu_variant>(v)));
    }
  }
  return names;
}

void set_cpu_variant(const std::string& name) {
  for (int v = FP8_CPU_SCALAR; v < FP8_CPU_VARIANT_COUNT; ++v) {
    const auto variant = static_cast<fp8_cpu_variant>(v);
    if (name == fp8_cpu_variant_name(variant)) {
      TORCH_CHECK_VALUE(fp8_cpu_set_variant(variant), "CPU variant '", name,
                        "' is not supported by this CPU; supported: ", c10::Join(", ", cpu_variants_supported()));
      return;
    }
  }
  TORCH_CHECK_VALUE(false, "unknown CPU variant '", name, "'; supported: ", c10::Join(", ", cpu_variants_supported()));
}

// Reads a CPU tensor's bytes once on every thread's share (benchmarks' bandwidth probe).
uint64_t read_bandwidth_probe(const at::Tensor& tensor) {
  TORCH_CHECK_VALUE(tensor.device().is_cpu() && tensor.is_contiguous(), "tensor must be a contiguous CPU tensor");
  const int64_t bytes = tensor.numel() * tensor.element_size();
  const auto* data = static_cast<const uint8_t*>(tensor.data_ptr());
  constexpr int64_t chunk = 1 << 20;
  std::vector<uint64_t> checksums(static_cast<size_t>((bytes + chunk - 1) / chunk), 0);
  at::parallel_for(0, static_cast<int64_t>(checksums.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c)
      checksums[static_cast<size_t>(c)] = fp8_cpu_read_probe(data + c * chunk, std::min(chunk, bytes - c * chunk));
  });
  uint64_t checksum = 0;
  for (uint64_t value : checksums) checksum ^= value;
  return checksum;
}

// FP8Linear's fast path (forward): fp8linear::linear for an eager call without autograd,
// from Python without the boxed torch.ops call, or None where FP8Linear's full forward must run
// instead: it raises the errors, converts float64 and autocast inputs, records autograd,
// and lets tensor subclasses, torch function modes and dispatch modes see what they see
// there. The tests are here, not in Python, because in decode each layer's Python runs
// with cold caches (the weights streamed in between evict them), where each test in
// Python cost ~0.3 us.
// The tensor behind x_object if the fast path may take the call: see the comment above.
const at::Tensor* plain_input(pybind11::handle x_object, const at::Tensor& weight, const at::Tensor& weight_scale,
                              const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& activation_scale,
                              int64_t max_rows) {
  if (!THPVariable_CheckExact(x_object.ptr())) return nullptr;  // a subclass (its __torch_function__), or not a tensor
  const at::Tensor& x = THPVariable_Unpack(x_object.ptr());
  const int64_t in_features = weight.dim() == 2 ? weight.size(1) : 0;
  const at::ScalarType dtype = x.scalar_type();
  const c10::DeviceType device = x.device().type();
  // K = 0 takes the full path, as there
  if (in_features <= 0 || x.dim() == 0 || x.size(-1) != in_features || x.numel() / in_features > max_rows) {
    return nullptr;
  }
  if (dtype != at::kFloat && dtype != at::kBFloat16 && dtype != at::kHalf) return nullptr;
  if (device != c10::DeviceType::CPU && device != c10::DeviceType::CUDA) return nullptr;
  // Keys a thread includes beyond the defaults (BackendSelect, ADInplaceOrView): autocast,
  // dispatch modes (Python), functorch transforms; the full path's torch.ops call is what
  // those expect to see
  if (!(c10::impl::tls_local_dispatch_key_set().included_ - c10::default_included_set).empty() ||
      c10::impl::dispatch_mode_enabled() ||
      at::impl::torch_function_mode_enabled() || at::autocast::is_autocast_enabled(device)) {
    return nullptr;
  }
  const bool grad_mode = c10::GradMode::is_enabled();
  const auto plain = [grad_mode](const at::Tensor& t) {  // no __torch_dispatch__ subclass, no autograd to record
    return !t.defined() || (!t.key_set().has(c10::DispatchKey::Python) && !(grad_mode && t.requires_grad()));
  };
  if (weight.requires_grad() || !plain(x) || !plain(weight) || !plain(weight_scale) ||
      (bias.has_value() && !plain(*bias)) || (activation_scale.has_value() && !plain(*activation_scale))) {
    return nullptr;
  }
  return &x;
}

std::optional<at::Tensor> linear_if_plain(pybind11::handle x_object, const at::Tensor& weight,
                                          const at::Tensor& weight_scale, const std::optional<at::Tensor>& bias,
                                          const std::optional<at::Tensor>& activation_scale, int64_t activations,
                                          int64_t granularity, int64_t max_rows) {
  HANDLE_TH_ERRORS  // as on the torch.ops path: C++ errors and warnings become Python ones
  const at::Tensor* x = plain_input(x_object, weight, weight_scale, bias, activation_scale, max_rows);
  if (x == nullptr) return std::nullopt;
  pybind11::gil_scoped_release no_gil;
  // Nothing here needs autograd (tested above): below its dispatch keys the op's calls of
  // quantize_fp8 and scaled_mm reach their kernels unboxed (the autograd-not-implemented
  // fallback they get otherwise is boxed) and its views are plain ones. ~1.5 us a call.
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  return fp8linear::linear_from_python(*x, weight, weight_scale, bias, activation_scale, activations, granularity);
  END_HANDLE_TH_ERRORS_PYBIND
}

// The same for a layer with dynamic activations whose input sibling layers share (q, k
// and v): given the input's quantization (quantized, quantized_scale) by one of them, or
// quantizing it, returns (out, the quantization used), or None as linear_if_plain does.
std::optional<std::tuple<at::Tensor, at::Tensor, at::Tensor>> dynamic_linear_if_plain(
    pybind11::handle x_object, const at::Tensor& weight, const at::Tensor& weight_scale,
    const std::optional<at::Tensor>& bias, int64_t granularity, const std::optional<at::Tensor>& quantized,
    const std::optional<at::Tensor>& quantized_scale, int64_t max_rows) {
  HANDLE_TH_ERRORS
  const at::Tensor* x = plain_input(x_object, weight, weight_scale, bias, std::nullopt, max_rows);
  if (x == nullptr) return std::nullopt;
  pybind11::gil_scoped_release no_gil;
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  return fp8linear::dynamic_linear_from_python(*x, weight, weight_scale, bias, granularity, quantized, quantized_scale);
  END_HANDLE_TH_ERRORS_PYBIND
}

bool cuda_built() {
#ifdef FP8LINEAR_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.doc() = "fp8linear native kernels; use them through fp8linear.ops";
  module.def("cpu_variants_supported", &cpu_variants_supported,
             "Names of the CPU kernel variants this CPU can run (scalar first; amx_emulated, a test model of the AMX kernels, last).");
  module.def("cpu_variant", [] { return std::string(fp8_cpu_variant_name(fp8_cpu_active_variant())); },
             "The CPU kernel variant in use.");
  module.def("set_cpu_variant", &set_cpu_variant, "Force a CPU kernel variant (for tests and benchmarks).");
  module.def("cpu_amx_status", [] { return std::string(fp8_cpu_amx_status()); },
             "Why the AMX kernels are not used on this machine; empty if they are.");
  module.def("read_bandwidth_probe", &read_bandwidth_probe,
             "Read a contiguous CPU tensor once with all threads; returns a checksum (for benchmarks).");
  module.def("linear_if_plain", &linear_if_plain,
             "FP8Linear's fast path: torch.ops.fp8linear.linear without the boxed call, or None where the full "
             "forward must run (subclass, autograd, autocast, torch function mode, float64, shape).");
  module.def("dynamic_linear_if_plain", &dynamic_linear_if_plain,
             "FP8Linear's fast path for dynamic activations that sibling layers share: (out, q, scale) given "
             "the input's quantization (q, scale) or making it, or None where the full forward must run.");
  module.def("cpu_scaled_mm_plan", &fp8linear::cpu_scaled_mm_plan,
             "(kernel, folded): the CPU kernel scaled_mm runs for these operands with torch's thread count "
             "(scalar, float_dot, bf16_dot, bf16_skinny, bf16_tile, amx, avx2_panel) and whether their block "
             "scales fold into the operands (power-of-two steps along K: the AMX kernels then sum over all of K "
             "in their tiles).");
  module.def("cuda_built", &cuda_built, "Whether the CUDA kernels were compiled into this build.");
#ifdef FP8LINEAR_WITH_CUDA
  fp8linear::register_cuda_python(module);
#endif
}
