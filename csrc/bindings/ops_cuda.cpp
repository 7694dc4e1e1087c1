// CUDA implementations of the ops: the shared checks, then the torch-free launchers
// of csrc/cuda on the current stream of the operands' device. Nothing here waits for
// the GPU: dynamic scales stay on the device, static ones are read there.
// Only the stream and guard headers: ATen/cuda/CUDAContext.h would pull in the cuBLAS,
// cuSPARSE and cuSOLVER headers, which the build does not otherwise need.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <atomic>
#include <string>
#include <vector>

#include "../cuda/cuda_kernels.h"
#include "checks.h"
#include "params.h"

namespace fp8linear {
namespace {

// The kernel family scaled_mm must use (tests and benchmarks force each in turn).
std::atomic<int> forced_path{FP8_CUDA_PATH_AUTO};
// What the last scaled_mm on this thread ran, so tests can see that a path was taken.
thread_local fp8_cuda_path last_path = FP8_CUDA_PATH_NONE;

void check_launch(const char* error) { TORCH_CHECK(error == nullptr, error); }

const fp8_cuda_device_info& device_info(int device) {
  const char* error = nullptr;
  const fp8_cuda_device_info* info = fp8_cuda_device(device, &error);
  TORCH_CHECK(info != nullptr, error);
  return *info;
}

// Refuses, saying how to fix it, a device the build has no code for (our kernels would
// fail to launch with "no kernel image is available").
void check_kernels_run_on(const at::Tensor& t) {
  const char* refusal = fp8_cuda_no_code_refusal(&device_info(t.get_device()));
  TORCH_CHECK(refusal == nullptr, refusal);
}

void check_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got a tensor on ", t.device());
}

std::tuple<at::Tensor, at::Tensor> quantize_fp8_cuda(const at::Tensor& x, const std::optional<at::Tensor>& scale,
                                                     at::ScalarType dtype, bool per_row) {
  const std::vector<int64_t> scale_shape = check_quantize_args(x, scale, dtype, per_row);
  check_cuda(x, "x");
  const fp8_format format = fp8_format_of(dtype, "dtype");
  const c10::cuda::CUDAGuard guard(x.device());
  check_launch(fp8_cuda_pending_error("quantize_fp8"));
  check_kernels_run_on(x);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::TensorOptions float_options = x.options().dtype(at::kFloat);
  at::Tensor q = at::empty(x.sizes(), x.options().dtype(dtype));
  // Static scales come back as copies: an op's outputs must not alias its inputs.
  if (x.numel() == 0) {
    if (scale.has_value()) return {q, scale->clone()};
    const float floor = scale_from_amax(0.0f, format);  // amax of nothing is 0: the floor
    return {q, at::full(scale_shape, floor, float_options)};
  }
  const RowView view = quantize_view(x, per_row);  // holds the copy of x that row_view may make
  const fp8_quantize_params p = quantize_params_of(view, q, format);
  const int multiprocessors = device_info(x.get_device()).multiprocessors;
  if (scale.has_value()) {
    const at::Tensor given = scale->contiguous();
    check_launch(fp8_cuda_quantize_launch(&p, given.data_ptr<float>(), per_row, nullptr, nullptr, multiprocessors,
                                          stream));
    return {q, scale->clone()};
  }
  at::Tensor scales = at::empty(scale_shape, float_options);  // () per tensor, x.shape[:-1] + (1,) per row
  at::Tensor amax = per_row ? at::Tensor() : at::empty({1}, x.options().dtype(at::kInt));
  check_launch(fp8_cuda_quantize_launch(&p, nullptr, per_row, scales.data_ptr<float>(),
                                        per_row ? nullptr : static_cast<unsigned int*>(amax.data_ptr()),
                                        multiprocessors, stream));
  return {q, scales};
}

// Dynamic scales per row of a contiguous, non-empty 2-D x rounded up to powers of two
// (scale_fmt "ue8m0": groups of a contiguous x viewed as rows): the per-row kernel.
std::tuple<at::Tensor, at::Tensor> quantize_rows_power_of_two_cuda(const at::Tensor& x2d, at::ScalarType dtype) {
  check_kernels_run_on(x2d);
  const fp8_format format = fp8_format_of(dtype, "dtype");
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor q = at::empty(x2d.sizes(), x2d.options().dtype(dtype));
  at::Tensor row_scales = at::empty({x2d.size(0), 1}, x2d.options().dtype(at::kFloat));
  const fp8_quantize_params p = quantize_params_of(row_view(x2d), q, format);
  check_launch(fp8_cuda_quantize_rows_dynamic_launch(&p, row_scales.data_ptr<float>(), 1, stream));
  return {q, row_scales};
}

// Block and group scales on CUDA: groups of a contiguous x with whole groups per row run
// the per-row kernels; everything else (weight blocks, partial groups, strided x) runs
// as ATen operations that are the reference's arithmetic (amax of the finite |x| per
// block, the scale rule in double, a true division, clamp, one rounding): exact, though
// not a fused kernel. power_of_two: dynamic scales rounded up to powers of two (the
// per-row kernel rounds them for whole groups; the ATen path for the others).
std::tuple<at::Tensor, at::Tensor> quantize_fp8_blocks_cuda(const at::Tensor& x, const std::optional<at::Tensor>& scale,
                                                            at::ScalarType dtype, int64_t block_rows,
                                                            int64_t block_cols, bool power_of_two) {
  const std::vector<int64_t> scale_shape = check_quantize_blocks_args(x, scale, dtype, block_rows, block_cols);
  check_cuda(x, "x");
  const fp8_format format = fp8_format_of(dtype, "dtype");
  const c10::cuda::CUDAGuard guard(x.device());
  // Groups of a contiguous x whose rows are whole groups are the rows of x viewed as
  // [numel / group, group]: the per-row kernels, one launch, the same rule per group.
  const bool rounded = power_of_two && !scale.has_value();
  if (block_rows == 1 && x.numel() > 0 && x.is_contiguous() && x.size(-1) % block_cols == 0 && rounded) {
    check_launch(fp8_cuda_pending_error("quantize_fp8"));
    auto [q, scales] = quantize_rows_power_of_two_cuda(x.view({-1, block_cols}), dtype);
    return {q.view(x.sizes()), scales.view(scale_shape)};
  }
  if (block_rows == 1 && x.numel() > 0 && x.is_contiguous() && x.size(-1) % block_cols == 0) {
    const std::optional<at::Tensor> row_scale =
        scale.has_value() ? std::optional<at::Tensor>(scale->reshape({-1, 1})) : std::nullopt;
    auto [q, scales] = quantize_fp8_cuda(x.view({-1, block_cols}), row_scale, dtype, true);
    return {q.view(x.sizes()), scales.view(scale_shape)};
  }
  const double fmax = fp8_format_max(format);
  at::Tensor q = at::empty(x.sizes(), x.options().dtype(dtype));
  if (x.numel() == 0) {
    if (scale.has_value()) return {q, scale->clone()};
    const float floor = rounded ? power_of_two_scale_from_amax(0.0f, format) : scale_from_amax(0.0f, format);
    return {q, at::full(scale_shape, floor, x.options().dtype(at::kFloat))};
  }
  const int64_t cols = x.size(-1), rows = x.numel() / cols;
  const int64_t row_blocks = (rows + block_rows - 1) / block_rows, col_blocks = (cols + block_cols - 1) / block_cols;
  const at::Tensor x2 = x.reshape({rows, cols}).to(at::kFloat);
  at::Tensor scales;
  if (scale.has_value()) {
    scales = scale->reshape({row_blocks, col_blocks});
  } else {
    at::Tensor magnitude = x2.abs();
    magnitude = at::where(at::isfinite(magnitude), magnitude, at::zeros({}, magnitude.options()));
    magnitude = at::constant_pad_nd(magnitude, {0, col_blocks * block_cols - cols, 0, row_blocks * block_rows - rows});
    const at::Tensor amax = magnitude.reshape({row_blocks, block_rows, col_blocks, block_cols}).amax({1, 3});
    scales = (amax.to(at::kDouble) / fmax).clamp_min(1.0 / (fmax * 512.0)).to(at::kFloat);
    if (rounded) {  // fp8_power_of_two_ceil on the float32 bits: a set significand moves the exponent up one
      const at::Tensor bits = scales.view(at::kInt);
      const at::Tensor rounded_bits = at::where(bits.bitwise_and(0x7FFFFF).ne(0),
                                                bits.bitwise_and(0x7F800000).add(0x800000), bits);
      scales = rounded_bits.view(at::kFloat);
    }
  }
  const at::Tensor expanded = scales.repeat_interleave(block_rows, 0)
                                  .repeat_interleave(block_cols, 1)
                                  .slice(0, 0, rows)
                                  .slice(1, 0, cols);
  q.copy_((x2 / expanded).clamp(-fmax, fmax).to(dtype).reshape(x.sizes()));
  return {q, scale.has_value() ? scale->clone() : scales.reshape(scale_shape)};
}

at::Tensor scaled_mm_cuda(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                          const at::Tensor& scale_b, const std::optional<at::Tensor>& bias,
                          at::ScalarType out_dtype) {
  check_scaled_mm_args(a, b, scale_a, scale_b, bias, out_dtype);
  check_cuda(a, "a");
  const c10::cuda::CUDAGuard guard(a.device());
  check_launch(fp8_cuda_pending_error("scaled_mm"));
  const int64_t m = a.size(0), n = b.size(1);
  at::Tensor out = at::empty({m, n}, a.options().dtype(out_dtype));
  if (m == 0 || n == 0) {
    last_path = FP8_CUDA_PATH_NONE;
    return out;
  }
  // Scales and bias are tiny; contiguous() copies only if a caller passed them strided.
  const at::Tensor scale_a_c = scale_a.contiguous(), scale_b_c = scale_b_for_kernels(scale_b, a.size(1), b.size(1));
  const at::Tensor bias_c = bias.has_value() ? bias->contiguous() : at::Tensor();
  const fp8_scaled_mm_params p = scaled_mm_params_of(a, b, scale_a_c, scale_b_c, bias_c, out);
  fp8_cuda_path used = FP8_CUDA_PATH_NONE;
  const fp8_cuda_path path = static_cast<fp8_cuda_path>(forced_path.load());
  // cuBLASLt's workspace from torch's caching allocator, on this stream: reused between
  // calls, freed with the cache, and legal inside CUDA-graph capture (the graph's pool)
  at::Tensor workspace;
  fp8_cuda_workspace memory = {nullptr, 0};
  if (fp8_cuda_may_use_cublaslt(&p, path, a.get_device())) {
    const int64_t bytes = static_cast<int64_t>(fp8_cuda_workspace_bytes(&p));
    workspace = at::empty({bytes}, a.options().dtype(at::kByte));
    memory = {workspace.data_ptr(), static_cast<size_t>(bytes)};
  }
  const char* error = fp8_cuda_scaled_mm_launch(&p, path, a.get_device(), c10::cuda::getCurrentCUDAStream(), memory,
                                                &used);
  last_path = used;
  check_launch(error);
  return out;
}

std::vector<std::string> cuda_paths() {
  std::vector<std::string> names;
  for (int path = FP8_CUDA_PATH_AUTO; path < FP8_CUDA_PATH_COUNT; ++path) {
    names.emplace_back(fp8_cuda_path_name(static_cast<fp8_cuda_path>(path)));
  }
  return names;
}

void set_cuda_path(const std::string& name) {
  const fp8_cuda_path path = fp8_cuda_path_from_name(name.c_str());
  TORCH_CHECK_VALUE(path != FP8_CUDA_PATH_COUNT, "unknown CUDA path '", name, "'; expected one of: ",
                    c10::Join(", ", cuda_paths()));
  forced_path.store(path);
}

// What a device gets without forcing: FP8 tensor cores, up-conversion, or the SIMT kernel.
// (a guard on the device asked about, so that querying it never touches another GPU)
const fp8_cuda_device_info& guarded_device_info(int64_t device) {
  TORCH_CHECK_VALUE(device >= 0 && device < c10::cuda::device_count(), "CUDA device index ", device,
                    " is out of range: this process sees ", static_cast<int>(c10::cuda::device_count()), " GPU(s)");
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  return device_info(static_cast<int>(device));
}

std::string cuda_device_path(int64_t device) {
  // our kernels' view: a build without code for the device's architecture runs older code,
  // or none at all
  const fp8_cuda_device_info& info = guarded_device_info(device);
  if (info.kernel_arch == 0) return "none";
  const int capability = fp8_cuda_kernel_capability(&info);
  return capability >= 89 ? "fp8" : capability >= 80 ? "upconvert" : "generic";
}

}  // namespace

void register_cuda_python(pybind11::module& module) {
  module.def("cuda_paths", &cuda_paths, "Names of the scaled_mm CUDA paths that set_cuda_path accepts.");
  module.def("set_cuda_path", &set_cuda_path,
             "Force scaled_mm's CUDA path ('auto', 'cublaslt', 'gemm', 'gemv', 'upconvert', 'generic'); a forced "
             "path that cannot run a call raises instead of falling back (for tests and benchmarks).");
  module.def("cuda_path", [] { return std::string(fp8_cuda_path_name(static_cast<fp8_cuda_path>(forced_path.load()))); },
             "The CUDA path scaled_mm is forced to ('auto' when not forced).");
  module.def("cuda_last_path", [] { return std::string(fp8_cuda_path_name(last_path)); },
             "The path the last CUDA scaled_mm on this thread ran ('none' for an empty result).");
  module.def("cuda_kernel_arch",
             [](int64_t device) { return guarded_device_info(device).kernel_arch; }, pybind11::arg("device"),
             "The architecture this build's kernels run as on the device (their PTX target x 10 / 100: 80, 89, 90; "
             "0 if the build has no code for it): below the compute capability when TORCH_CUDA_ARCH_LIST lacked it.");
  module.def("cuda_device_path", &cuda_device_path, pybind11::arg("device"),
             "What the device runs by default: 'fp8' (tensor cores, cc >= 8.9), 'upconvert' (cc >= 8.0), 'generic', "
             "or 'none' (the build has no code for the device: TORCH_CUDA_ARCH_LIST).");
}

TORCH_LIBRARY_IMPL(fp8linear, CUDA, m) {
  m.impl("quantize_fp8", &quantize_fp8_cuda);
  m.impl("scaled_mm", &scaled_mm_cuda);
  m.impl("quantize_fp8_blocks", &quantize_fp8_blocks_cuda);
}

}  // namespace fp8linear
