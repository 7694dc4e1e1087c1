// The emulated CUDA ops on CPU tensors: what csrc/bindings/ops_cuda.cpp does with a GPU's
// tensors and stream, done with the launchers of csrc/cuda compiled for the emulator
// (emulator.h). The same argument checks and kernel parameters (checks.cpp, params.cpp)
// as the real ops; `device` picks an emulated GPU (emulator.cpp's table).
#include <torch/extension.h>

#include <string>
#include <tuple>

#include "bindings/checks.h"
#include "bindings/params.h"
#include "cuda/cuda_kernels.h"

// cuBLASLt cannot run here. By default it refuses every call, so that 'auto' takes our
// kernels; set_cublaslt_accepts(true) makes it accept every call at first and then
// decline at run time (as a cuBLASLt without an algorithm or a scale mode does), so that
// the launcher's fallback and its message for a forced 'cublaslt' run.
namespace {
bool cublaslt_accepts = false;
}

// Rows per launch (csrc/cuda/scaled_mm.cu; 2^20 on a GPU): tests lower it to run the split.
extern int64_t fp8_emulated_max_launch_rows;

const char* fp8_cuda_cublaslt_refusal(const fp8_scaled_mm_params*, int, int) {
  return cublaslt_accepts ? nullptr : "cuBLASLt is not part of the CUDA emulation";
}

const char* fp8_cuda_cublaslt_launch(const fp8_scaled_mm_params*, int, int, int, cudaStream_t, fp8_cuda_workspace,
                                     int* unsupported) {
  *unsupported = 1;
  return cublaslt_accepts ? "the emulated cuBLASLt has no algorithm for this problem"
                          : "cuBLASLt is not part of the CUDA emulation";
}

namespace {

using namespace fp8linear;

void check_launch(const char* error) {
  if (error == nullptr) return;
  const std::string failure = fp8emu::last_failure();
  TORCH_CHECK(false, error, failure.empty() ? "" : " [emulator: " + failure + "]");
}

fp8_cuda_path path_of(const std::string& name) {
  const fp8_cuda_path path = fp8_cuda_path_from_name(name.c_str());
  TORCH_CHECK_VALUE(path != FP8_CUDA_PATH_COUNT, "unknown CUDA path '", name, "'");
  return path;
}

// The device the launches run on (what the real ops' CUDAGuard sets).
void use_device(int64_t device) { TORCH_CHECK(cudaSetDevice(static_cast<int>(device)) == cudaSuccess, "no emulated device ", device); }

const fp8_cuda_device_info& device_info(int64_t device) {
  use_device(device);
  const char* error = nullptr;
  const fp8_cuda_device_info* info = fp8_cuda_device(static_cast<int>(device), &error);
  TORCH_CHECK(info != nullptr, error);
  return *info;
}

std::tuple<at::Tensor, std::string> scaled_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                                              const at::Tensor& scale_b, const std::optional<at::Tensor>& bias,
                                              at::ScalarType out_dtype, const std::string& path, int64_t device) {
  check_scaled_mm_args(a, b, scale_a, scale_b, bias, out_dtype);
  TORCH_CHECK(a.device().is_cpu(), "the emulation takes CPU tensors");
  device_info(device);  // queried (and cached) as the real ops do, before the launch
  check_launch(fp8_cuda_pending_error("scaled_mm"));
  const int64_t m = a.size(0), n = b.size(1);
  at::Tensor out = at::empty({m, n}, a.options().dtype(out_dtype));
  if (m == 0 || n == 0) return {out, "none"};
  const at::Tensor scale_a_c = scale_a.contiguous(), scale_b_c = scale_b_for_kernels(scale_b, a.size(1), n);
  const at::Tensor bias_c = bias.has_value() ? bias->contiguous() : at::Tensor();
  const fp8_scaled_mm_params p = scaled_mm_params_of(a, b, scale_a_c, scale_b_c, bias_c, out);
  out.fill_(NAN);  // an element no kernel writes stays NaN
  fp8_cuda_path used = FP8_CUDA_PATH_NONE;
  check_launch(fp8_cuda_scaled_mm_launch(&p, path_of(path), static_cast<int>(device), nullptr, {nullptr, 0}, &used));
  return {out, fp8_cuda_path_name(used)};
}

// quantize_fp8 as ops_cuda.cpp's quantize_fp8_cuda runs it, for a non-empty x.
std::tuple<at::Tensor, at::Tensor> quantize_fp8(const at::Tensor& x, const std::optional<at::Tensor>& scale,
                                                at::ScalarType dtype, bool per_row, int64_t device) {
  const std::vector<int64_t> scale_shape = check_quantize_args(x, scale, dtype, per_row);
  TORCH_CHECK(x.numel() > 0, "the emulation quantizes non-empty tensors");
  const fp8_format format = fp8_format_of(dtype, "dtype");
  check_launch(fp8_cuda_pending_error("quantize_fp8"));
  at::Tensor q = at::full(x.sizes(), 0x7F, x.options().dtype(at::kByte)).view(dtype);  // unwritten codes: NaN
  const RowView view = quantize_view(x, per_row);
  const fp8_quantize_params p = quantize_params_of(view, q, format);
  const int multiprocessors = device_info(device).multiprocessors;
  const at::TensorOptions float_options = x.options().dtype(at::kFloat);
  if (scale.has_value()) {
    const at::Tensor given = scale->contiguous();
    check_launch(fp8_cuda_quantize_launch(&p, given.data_ptr<float>(), per_row, nullptr, nullptr, multiprocessors,
                                          nullptr));
    return {q, scale->clone()};
  }
  // outputs and scratch start as garbage (NaN scales, a nonzero amax) that the launch must overwrite
  at::Tensor scales = at::full(scale_shape, NAN, float_options);
  at::Tensor amax = at::full({1}, 0x7F7F7F7F, x.options().dtype(at::kInt));
  check_launch(fp8_cuda_quantize_launch(&p, nullptr, per_row, scales.data_ptr<float>(),
                                        per_row ? nullptr : static_cast<unsigned int*>(amax.data_ptr()),
                                        multiprocessors, nullptr));
  return {q, scales};
}

// One dynamic scale per row of a 2-D x, rounded up to a power of two (the ue8m0 groups).
std::tuple<at::Tensor, at::Tensor> quantize_rows_power_of_two(const at::Tensor& x2d, at::ScalarType dtype) {
  use_device(0);
  TORCH_CHECK(x2d.dim() == 2 && x2d.numel() > 0, "a non-empty 2-D x");
  const fp8_format format = fp8_format_of(dtype, "dtype");
  at::Tensor q = at::full(x2d.sizes(), 0x7F, x2d.options().dtype(at::kByte)).view(dtype);  // unwritten codes: NaN
  at::Tensor row_scales = at::full({x2d.size(0), 1}, NAN, x2d.options().dtype(at::kFloat));
  const fp8_quantize_params p = quantize_params_of(row_view(x2d), q, format);
  check_launch(fp8_cuda_quantize_rows_dynamic_launch(&p, row_scales.data_ptr<float>(), 1, nullptr));
  return {q, row_scales};
}

// ---- kernels that check the emulator itself (tests/test_cuda_emulated.py) --------

__global__ void shuffle_kernel(float* out) {
  out[threadIdx.x] = __shfl_xor_sync(0xFFFFFFFFu, static_cast<float>(threadIdx.x), 5);
}

__global__ void shuffle_width_kernel(float* out) {
  out[threadIdx.x] = __shfl_xor_sync(0xFFFFFFFFu, static_cast<float>(threadIdx.x), 17, 16);
}

__global__ void shared_reverse_kernel(float* out) {
  __shared__ float values[64];
  fp8emu::shared_declared(values, sizeof values);  // what tests/cuda_emulation.py adds to each declaration
  values[threadIdx.x] = static_cast<float>(threadIdx.x);
  __syncthreads();
  out[threadIdx.x] = values[63 - threadIdx.x] + 1000.0f * blockIdx.x;
}

__global__ void shared_unwritten_kernel(float* out) {
  __shared__ float values[64];
  fp8emu::shared_declared(values, sizeof values);  // what tests/cuda_emulation.py adds to each declaration
  if (threadIdx.x < 32) values[threadIdx.x] = 1.0f;
  __syncthreads();
  out[threadIdx.x] = values[63 - threadIdx.x];  // threads 0-31 read what nobody wrote
}

__global__ void missing_barrier_kernel(float* out) {
  __shared__ float values[64];
  fp8emu::shared_declared(values, sizeof values);  // what tests/cuda_emulation.py adds to each declaration
  values[threadIdx.x] = 1.0f;
  out[threadIdx.x] = values[threadIdx.x ^ 1];  // no __syncthreads between the write and the read
}

__global__ void shuffle_after_exit_kernel(float* out) {
  if (threadIdx.x == 31) return;
  out[threadIdx.x] = __shfl_xor_sync(0xFFFFFFFFu, static_cast<float>(threadIdx.x), 1);
}

__global__ void deadlock_kernel(float* out) {
  if (threadIdx.x == 0) {
    __syncwarp(0x3u);  // waits for lane 1, which waits at __syncthreads for lane 0
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = 1.0f;
}

__global__ void divergent_barrier_kernel(float* out) {
  if (threadIdx.x < 32) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = 1.0f;
}

// Runs probe `name` on 64 threads per block (grid `blocks`); the first block's output.
at::Tensor probe(const std::string& name, int64_t blocks) {
  use_device(0);
  at::Tensor out = at::full({blocks, 64}, NAN, at::kFloat);
  float* data = out.data_ptr<float>();
  const dim3 grid(static_cast<unsigned>(blocks));
  if (name == "shuffle") {
    fp8emu::launch(grid, 64, 0, nullptr, [&] { shuffle_kernel(data + 64 * blockIdx.x); });
  } else if (name == "shuffle_width") {
    fp8emu::launch(grid, 64, [&] { shuffle_width_kernel(data + 64 * blockIdx.x); });
  } else if (name == "shared") {
    fp8emu::launch(grid, 64, 0, nullptr, [&] { shared_reverse_kernel(data + 64 * blockIdx.x); });
  } else if (name == "shared_unwritten") {
    fp8emu::launch(grid, 64, [&] { shared_unwritten_kernel(data + 64 * blockIdx.x); });
  } else if (name == "missing_barrier") {
    fp8emu::launch(grid, 64, [&] { missing_barrier_kernel(data + 64 * blockIdx.x); });
  } else if (name == "shuffle_after_exit") {
    fp8emu::launch(grid, 64, 0, nullptr, [&] { shuffle_after_exit_kernel(data + 64 * blockIdx.x); });
  } else if (name == "deadlock") {
    fp8emu::launch(grid, 64, 0, nullptr, [&] { deadlock_kernel(data + 64 * blockIdx.x); });
  } else if (name == "too_many_threads") {
    fp8emu::launch(grid, 2048, [&] { shuffle_kernel(data); });
  } else if (name == "divergent_barrier") {
    fp8emu::launch(grid, 64, [&] { divergent_barrier_kernel(data); });
  } else if (name == "leave_pending") {  // a failed launch nobody checks: the next op reports it
    fp8emu::launch(grid, 2048, [&] { shuffle_kernel(data); });
    return out;
  } else {
    TORCH_CHECK_VALUE(false, "unknown probe ", name);
  }
  const cudaError_t error = cudaGetLastError();
  TORCH_CHECK(error == cudaSuccess, cudaGetErrorName(error), ": ", fp8emu::last_failure());
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.doc() = "fp8linear's CUDA launchers and kernels run on the CPU by tests/cuda_emulator.";
  module.def("scaled_mm", &scaled_mm, "scaled_mm on an emulated device; returns (out, path that ran)",
             pybind11::arg("a"), pybind11::arg("b"), pybind11::arg("scale_a"), pybind11::arg("scale_b"),
             pybind11::arg("bias"), pybind11::arg("out_dtype"), pybind11::arg("path"), pybind11::arg("device"));
  module.def("quantize_fp8", &quantize_fp8, "quantize_fp8 on an emulated device", pybind11::arg("x"),
             pybind11::arg("scale"), pybind11::arg("dtype"), pybind11::arg("per_row"), pybind11::arg("device"));
  module.def("quantize_rows_power_of_two", &quantize_rows_power_of_two, pybind11::arg("x"), pybind11::arg("dtype"));
  module.def("device", [](int64_t device) {
    const fp8_cuda_device_info& info = device_info(device);
    return std::make_tuple(info.major, info.minor, info.multiprocessors, info.kernel_arch);
  }, "(major, minor, multiprocessors, kernel_arch) of an emulated device");
  module.def("set_max_launch_rows", [](int64_t rows) {
    const int64_t previous = fp8_emulated_max_launch_rows;
    fp8_emulated_max_launch_rows = rows;
    return previous;
  }, "rows per launch of scaled_mm (2^20 by default); returns the previous value");
  module.def("set_cublaslt_accepts", [](bool accepts) { cublaslt_accepts = accepts; },
             "whether the emulated cuBLASLt accepts calls (then declines each at run time)");
  module.def("probe", &probe, "runs one of the emulator's own check kernels", pybind11::arg("name"),
             pybind11::arg("blocks") = 1);
}
