// Which kernel family computes a scaled_mm call, and the launch. Host code only.
//
// AUTO, for fp8 activations on cc >= 8.9 with K-contiguous operands:
//   M <= 16                      -> gemv (the weight streamed once; cuBLASLt pads M)
//   cuBLASLt accepts the problem -> cublaslt
//   M <= 64                      -> gemv (skinny: 16-feature blocks keep the GPU busy)
//   otherwise                    -> gemm
// below cc 8.9, or 16-bit activations (weight-only) -> upconvert (widening gemv/gemm);
// float32 activations, other strides, K = 0, GPUs below sm_80 -> generic.
// K-blocked (block-wise 128 x 128) scales take the same rules: cuBLASLt's block scaling
// (sm_90) for the calls cublaslt.cu accepts, else gemv up to M = 64, gemm above.
//
// float32 outputs: our gemm/gemv widen fp8 to float16 for the tensor cores (exact
// products, float32 sums) instead of using the fp8 mma, and cuBLASLt is not used. The
// fp8 tensor cores of Ada/Hopper keep partial sums with 13 mantissa bits (reports
// disagree on whether products within one instruction are also truncated): within
// the 1e-2 of 16-bit outputs, not the 1e-5 of float32 sums.
#include <algorithm>
#include <cstring>
#include <string>

#include "cuda_kernels.h"
#include "launch.cuh"

namespace {

constexpr int64_t kGemvMaxTokens = 16;
constexpr int64_t kSkinnyMaxTokens = 64;

int capability(int major, int minor) { return major * 10 + minor; }

// Rows per launch. Every kernel puts its row tiles in gridDim.y (at most 65535); the
// smallest row tile of a call this large is 32 (forced gemv, block-wise), so 2^20 rows
// make at most 32768 of them. Larger calls are launched in parts of this many rows.
#if defined(FP8LINEAR_CUDA_EMULATION)
}  // namespace
// tests/cuda_emulator: the split, at a number of rows the emulator can run in seconds
int64_t fp8_emulated_max_launch_rows = FP8_CUDA_MAX_LAUNCH_ROWS;
namespace {
#define kMaxLaunchRows fp8_emulated_max_launch_rows
#else
constexpr int64_t kMaxLaunchRows = FP8_CUDA_MAX_LAUNCH_ROWS;
#endif

// Our tensor-core kernels read 16 consecutive k-elements of each row of a and of each
// column of b (a row of the [N, K] weight).
bool k_contiguous(const fp8_scaled_mm_params* p) {
  return p->k <= 1 || (p->a_col_stride == 1 && p->b_row_stride == 1);
}

const char* older_build(const fp8_cuda_device_info* info, int needed) {
  if (capability(info->major, info->minor) < needed || info->kernel_arch >= needed) return nullptr;
  if (info->kernel_arch == 0) {
    return "this build has no code for this device's architecture (add it to TORCH_CUDA_ARCH_LIST and rebuild)";
  }
  return fp8cuda::error_text(
      "this build's kernels run as compute capability %d.%d on this device (TORCH_CUDA_ARCH_LIST had no %d.%d or "
      "newer for it), and this path needs %d.%d: rebuild with it to use the device's tensor cores",
      info->kernel_arch / 10, info->kernel_arch % 10, needed / 10, needed % 10, needed / 10, needed % 10);
}

const char* fp8_tensor_core_refusal(const fp8_scaled_mm_params* p, const fp8_cuda_device_info* info) {
  if (const char* older = older_build(info, 89)) return older;
  if (fp8_cuda_kernel_capability(info) < 89) {
    return "fp8 tensor cores need compute capability 8.9 or newer (use 'upconvert')";
  }
  if (p->a_is_float) return "a is a float dtype (weight-only): fp8 tensor cores need fp8 activations (use 'upconvert')";
  if (!k_contiguous(p)) return "needs K-contiguous operands: a row-major [M, K] and b = w.t() of a row-major [N, K]";
  return nullptr;
}

const char* upconvert_refusal(const fp8_scaled_mm_params* p, const fp8_cuda_device_info* info) {
  if (const char* older = older_build(info, 80)) return older;
  if (fp8_cuda_kernel_capability(info) < 80) {
    return "16-bit tensor cores (mma.sync m16n8k16) need compute capability 8.0 or newer";
  }
  if (p->a_is_float && p->a_float_dtype == FP8_FLOAT32) {
    return "float32 activations would be rounded by a 16-bit multiply (the 'generic' path takes them)";
  }
  if (!k_contiguous(p)) return "needs K-contiguous operands: a row-major [M, K] and b = w.t() of a row-major [N, K]";
  return nullptr;
}

const char* run(fp8_cuda_path path, const fp8_scaled_mm_params* p, int device, const fp8_cuda_device_info* info,
                cudaStream_t stream, fp8_cuda_workspace workspace, int* unsupported) {
  *unsupported = 0;
  const bool skinny = p->m <= kSkinnyMaxTokens;
  const int widen_for_float32_sums = p->out_dtype == FP8_FLOAT32;
  switch (path) {
    case FP8_CUDA_PATH_CUBLASLT:
      return fp8_cuda_cublaslt_launch(p, device, info->major, info->minor, stream, workspace, unsupported);
    case FP8_CUDA_PATH_GEMM:
      return fp8_cuda_gemm_launch(p, widen_for_float32_sums, stream);
    case FP8_CUDA_PATH_GEMV:
      return fp8_cuda_gemv_launch(p, widen_for_float32_sums, stream);
    case FP8_CUDA_PATH_UPCONVERT:
      return skinny ? fp8_cuda_gemv_launch(p, 1, stream) : fp8_cuda_gemm_launch(p, 1, stream);
    default:
      return fp8_cuda_generic_launch(p, stream);
  }
}

fp8_cuda_path auto_path(const fp8_scaled_mm_params* p, const fp8_cuda_device_info* info) {
  if (fp8_tensor_core_refusal(p, info) == nullptr) {
    if (p->m <= kGemvMaxTokens) return FP8_CUDA_PATH_GEMV;
    if (fp8_cuda_cublaslt_refusal(p, info->major, info->minor) == nullptr) return FP8_CUDA_PATH_CUBLASLT;
    return p->m <= kSkinnyMaxTokens ? FP8_CUDA_PATH_GEMV : FP8_CUDA_PATH_GEMM;
  }
  if (upconvert_refusal(p, info) == nullptr) return FP8_CUDA_PATH_UPCONVERT;
  return FP8_CUDA_PATH_GENERIC;
}

}  // namespace

int fp8_cuda_kernel_capability(const fp8_cuda_device_info* info) {
  return std::min(capability(info->major, info->minor), info->kernel_arch);
}

const char* fp8_cuda_no_code_refusal(const fp8_cuda_device_info* info) {
  if (info->kernel_arch != 0) return nullptr;
  return fp8cuda::error_text(
      "fp8linear CUDA: this build has no code for this device's architecture (compute capability %d.%d; its "
      "TORCH_CUDA_ARCH_LIST had neither %d.%d nor PTX of an older one): add \"%d.%d\" to TORCH_CUDA_ARCH_LIST and "
      "rebuild (pip install --no-build-isolation .)",
      info->major, info->minor, info->major, info->minor, info->major, info->minor);
}

const char* fp8_cuda_path_name(fp8_cuda_path path) {
  switch (path) {
    case FP8_CUDA_PATH_AUTO: return "auto";
    case FP8_CUDA_PATH_CUBLASLT: return "cublaslt";
    case FP8_CUDA_PATH_GEMM: return "gemm";
    case FP8_CUDA_PATH_GEMV: return "gemv";
    case FP8_CUDA_PATH_UPCONVERT: return "upconvert";
    case FP8_CUDA_PATH_GENERIC: return "generic";
    case FP8_CUDA_PATH_NONE: return "none";
    default: return "unknown";
  }
}

fp8_cuda_path fp8_cuda_path_from_name(const char* name) {
  for (int path = FP8_CUDA_PATH_AUTO; path < FP8_CUDA_PATH_COUNT; ++path) {
    if (std::strcmp(name, fp8_cuda_path_name(static_cast<fp8_cuda_path>(path))) == 0) {
      return static_cast<fp8_cuda_path>(path);
    }
  }
  return FP8_CUDA_PATH_COUNT;
}

const char* fp8_cuda_path_refusal(fp8_cuda_path path, const fp8_scaled_mm_params* p,
                                  const fp8_cuda_device_info* info) {
  switch (path) {
    case FP8_CUDA_PATH_CUBLASLT: return fp8_cuda_cublaslt_refusal(p, info->major, info->minor);
    case FP8_CUDA_PATH_GEMM:
    case FP8_CUDA_PATH_GEMV: return fp8_tensor_core_refusal(p, info);
    case FP8_CUDA_PATH_UPCONVERT: return upconvert_refusal(p, info);
    default: return nullptr;
  }
}

int fp8_cuda_may_use_cublaslt(const fp8_scaled_mm_params* p, fp8_cuda_path path, int device) {
  if (path == FP8_CUDA_PATH_CUBLASLT) return 1;
  if (path != FP8_CUDA_PATH_AUTO || p->m <= kGemvMaxTokens) return 0;  // auto sends M <= 16 to the GEMV first
  // with this device's capability: on sm_80/sm_89 per-row/column and block scales never
  // reach cuBLASLt, and its 32 MiB workspace would be taken for nothing
  const char* error = nullptr;
  const fp8_cuda_device_info* info = fp8_cuda_device(device, &error);
  return info != nullptr && fp8_cuda_cublaslt_refusal(p, info->major, info->minor) == nullptr;
}

const char* fp8_cuda_scaled_mm_launch(const fp8_scaled_mm_params* p, fp8_cuda_path path, int device,
                                      cudaStream_t stream, fp8_cuda_workspace workspace, fp8_cuda_path* used) {
  *used = FP8_CUDA_PATH_NONE;
  if (p->m == 0 || p->n == 0) return nullptr;
  const char* error = nullptr;
  const fp8_cuda_device_info* info = fp8_cuda_device(device, &error);
  if (info == nullptr) return error;
  if (path != FP8_CUDA_PATH_AUTO && p->k != 0) {
    if (const char* refusal = fp8_cuda_path_refusal(path, p, info)) {
      const std::string reason = refusal;  // it may sit in the buffer error_text writes
      return fp8cuda::error_text("fp8linear CUDA: forced path '%s' cannot run this call on compute capability %d.%d: %s",
                                 fp8_cuda_path_name(path), info->major, info->minor, reason.c_str());
    }
  }
  // Every path but cuBLASLt launches our kernels (k = 0 too: the generic one writes the bias)
  if (path != FP8_CUDA_PATH_CUBLASLT) {
    if (const char* refusal = fp8_cuda_no_code_refusal(info)) return refusal;
  }
  // (after the forced path's check: the whole call is refused or run, never a part of it)
  if (p->m > kMaxLaunchRows) {
    for (int64_t m0 = 0; m0 < p->m; m0 += kMaxLaunchRows) {
      const fp8_scaled_mm_params part = fp8_scaled_mm_rows(p, m0, std::min(p->m, m0 + kMaxLaunchRows));
      if ((error = fp8_cuda_scaled_mm_launch(&part, path, device, stream, workspace, used))) return error;
    }
    return nullptr;
  }
  int unsupported = 0;
  if (p->k == 0) {
    // No products: every path's answer is the bias (or zeros); the generic kernel writes it.
    *used = FP8_CUDA_PATH_GENERIC;
    return fp8_cuda_generic_launch(p, stream);
  }
  if (path == FP8_CUDA_PATH_AUTO) {
    const fp8_cuda_path chosen = auto_path(p, info);
    *used = chosen;
    error = run(chosen, p, device, info, stream, workspace, &unsupported);
    if (!unsupported) return error;
    // cuBLASLt declined at run time (no algorithm, or no outer-vector scales here).
    *used = p->m <= kSkinnyMaxTokens ? FP8_CUDA_PATH_GEMV : FP8_CUDA_PATH_GEMM;
    return run(*used, p, device, info, stream, workspace, &unsupported);
  }
  *used = path;
  error = run(path, p, device, info, stream, workspace, &unsupported);
  if (unsupported) {
    const std::string reason = error;  // error_text reuses the buffer `error` points into
    return fp8cuda::error_text("fp8linear CUDA: forced path '%s' cannot run this call: %s", fp8_cuda_path_name(path),
                               reason.c_str());
  }
  return error;
}
