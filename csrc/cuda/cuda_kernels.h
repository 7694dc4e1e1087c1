// The CUDA launchers: the only entry points csrc/bindings/ops_cuda.cpp calls.
// Torch-free (parameter structs of ../kernels.h, raw device pointers, a stream),
// so every .cu file compiles and reads without torch.
//
// Every launcher enqueues its work on `stream` and returns NULL on success or a
// message naming what failed (kept in a thread-local buffer until the next call
// on the same thread). Launch errors are checked after each kernel launch.
#pragma once

#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#include "../kernels.h"

// ---- devices ----------------------------------------------------------------

typedef struct {
  int major, minor;        // compute capability
  int multiprocessors;
  // The architecture our kernels run as on this device (their PTX target, as in
  // __CUDA_ARCH__ / 10: 80, 89, 90), which a build's TORCH_CUDA_ARCH_LIST decides: an
  // sm_80-only build runs as 80 on an sm_89 GPU, where its fp8 mma compiles to a trap.
  // 0 where the build has no code for the device. Paths of our kernels go by
  // min(compute capability, kernel_arch); cuBLASLt by the compute capability.
  int kernel_arch;
} fp8_cuda_device_info;

// Properties of `device`, queried once per device and cached.
const fp8_cuda_device_info* fp8_cuda_device(int device, const char** error);

// What our kernels can use there, as major * 10 + minor: the device's capability, unless
// the build's code for it targets an older one (kernel_arch).
int fp8_cuda_kernel_capability(const fp8_cuda_device_info* info);

// NULL, or (kernel_arch 0: e.g. a T4, compute capability 7.5, under the default
// TORCH_CUDA_ARCH_LIST) the message that none of our kernels can run there and how to
// build ones that can. The ops check it before launching anything of ours, where the
// launch would only say "no kernel image is available".
const char* fp8_cuda_no_code_refusal(const fp8_cuda_device_info* info);

// NULL, or a message for a CUDA error already pending on this thread before an op
// launched anything (an earlier operation's, or a sticky fault of an earlier kernel),
// which it clears where CUDA allows. The ops call it first, so that check_launch's
// cudaGetLastError after a launch reports only what the launch itself raised.
const char* fp8_cuda_pending_error(const char* op);

// ---- quantize_fp8 ---------------------------------------------------------
// p->q is contiguous [rows, cols]; scales are float32 on the device.

// One scale for the whole tensor, from its amax: no host synchronization.
// `amax_scratch` is one device word the launcher zeroes; the scale lands in *scale_out.
const char* fp8_cuda_quantize_tensor_dynamic_launch(const fp8_quantize_params* p, unsigned int* amax_scratch,
                                                    float* scale_out, int multiprocessors, cudaStream_t stream);

// A given scale: scale[0] for all rows (per_row = 0) or scale[row] (per_row = 1).
const char* fp8_cuda_quantize_static_launch(const fp8_quantize_params* p, const float* scale, int per_row,
                                            int multiprocessors, cudaStream_t stream);

// One dynamic scale per row, written to row_scales[row]; power_of_two: each rounded up to a
// power of two (scale_fmt "ue8m0", groups viewed as rows).
const char* fp8_cuda_quantize_rows_dynamic_launch(const fp8_quantize_params* p, float* row_scales, int power_of_two,
                                                  cudaStream_t stream);

// quantize_fp8 as the op runs it, on p of x's quantize view (rows, or one long row for a
// per-tensor scale): with static_scale, that scale (scale[0], or scale[row] if per_row)
// and scale_out untouched; with static_scale NULL, dynamic scales written to scale_out
// (scale_out[0], or scale_out[row] if per_row) and amax_scratch (one device word) used
// for the per-tensor amax. The op's bindings and the CUDA emulator's both call this.
const char* fp8_cuda_quantize_launch(const fp8_quantize_params* p, const float* static_scale, int per_row,
                                     float* scale_out, unsigned int* amax_scratch, int multiprocessors,
                                     cudaStream_t stream);

// ---- scaled_mm ----------------------------------------------------------------

// The kernel families; tests force each one. AUTO picks per call (see scaled_mm.cu).
typedef enum {
  FP8_CUDA_PATH_AUTO = 0,
  FP8_CUDA_PATH_CUBLASLT = 1,   // cuBLASLt FP8 (cc >= 8.9, aligned TN shapes)
  FP8_CUDA_PATH_GEMM = 2,       // our tiled fp8 tensor-core GEMM (cc >= 8.9)
  FP8_CUDA_PATH_GEMV = 3,       // our skinny fp8 tensor-core kernel for small M (cc >= 8.9)
  FP8_CUDA_PATH_UPCONVERT = 4,  // fp8 widened to f16/bf16 in registers (cc >= 8.0; also weight-only)
  FP8_CUDA_PATH_GENERIC = 5,    // SIMT fallback: any strides, any dtype, any GPU
  FP8_CUDA_PATH_COUNT = 6,
  FP8_CUDA_PATH_NONE = 7        // nothing to compute (M = 0 or N = 0)
} fp8_cuda_path;

const char* fp8_cuda_path_name(fp8_cuda_path path);
// The path of that name among AUTO..COUNT - 1 (what set_cuda_path accepts), or
// FP8_CUDA_PATH_COUNT if there is none.
fp8_cuda_path fp8_cuda_path_from_name(const char* name);

// Why `path` cannot run this call on the device `info` describes, or NULL if it can.
const char* fp8_cuda_path_refusal(fp8_cuda_path path, const fp8_scaled_mm_params* p,
                                  const fp8_cuda_device_info* info);

// Device memory the caller provides for one call (the bindings take it from torch's
// caching allocator on the call's stream, which is also what CUDA-graph capture needs):
// cuBLASLt's workspace followed by room for its scales: a per-tensor scale broadcast to
// a vector, or the block-wise scales in cuBLASLt's layouts.
typedef struct {
  void* memory;  // NULL: cuBLASLt runs without a workspace, and without vector or block scales
  size_t bytes;
} fp8_cuda_workspace;

// The workspace a call may use (cuBLASLt's recommended 32 MiB on Hopper + 1 MiB of
// broadcast scales, or more for the block scales of a large M: fp8_cuda_workspace_bytes),
// and whether this call could reach cuBLASLt at all on `path` and `device` (otherwise the
// caller need not allocate it).
// The workspace is sized for one launch: calls of more than FP8_CUDA_MAX_LAUNCH_ROWS rows
// run in parts of that many (fp8_cuda_scaled_mm_launch), one after another on the stream.
enum { FP8_CUDA_CUBLASLT_WORKSPACE_BYTES = (32 << 20), FP8_CUDA_BROADCAST_FLOATS = (1 << 18) };
enum { FP8_CUDA_MAX_LAUNCH_ROWS = (1 << 20) };
int fp8_cuda_may_use_cublaslt(const fp8_scaled_mm_params* p, fp8_cuda_path path, int device);
size_t fp8_cuda_workspace_bytes(const fp8_scaled_mm_params* p);

// out = (a * scale_a) @ (b * scale_b) + bias on `path` (AUTO: the best one that can
// run it). *used receives the path that ran. A forced path that cannot run the call
// is an error, never a silent fallback.
const char* fp8_cuda_scaled_mm_launch(const fp8_scaled_mm_params* p, fp8_cuda_path path, int device,
                                      cudaStream_t stream, fp8_cuda_workspace workspace, fp8_cuda_path* used);

// The kernel families, called by fp8_cuda_scaled_mm_launch once it has chosen.
// Preconditions: M, N > 0; the family's refusal above is NULL.
const char* fp8_cuda_gemv_launch(const fp8_scaled_mm_params* p, int widen, cudaStream_t stream);
const char* fp8_cuda_gemm_launch(const fp8_scaled_mm_params* p, int widen, cudaStream_t stream);
const char* fp8_cuda_generic_launch(const fp8_scaled_mm_params* p, cudaStream_t stream);

// cuBLASLt: *unsupported is set (and NULL returned) when cuBLASLt declines this
// problem at run time (no algorithm, or a scale mode this device lacks), so that
// AUTO can fall back to our GEMM.
const char* fp8_cuda_cublaslt_launch(const fp8_scaled_mm_params* p, int device, int major, int minor,
                                     cudaStream_t stream, fp8_cuda_workspace workspace, int* unsupported);
// Whether cuBLASLt can take this problem's shapes, strides, dtypes and scales, or why not.
const char* fp8_cuda_cublaslt_refusal(const fp8_scaled_mm_params* p, int major, int minor);
