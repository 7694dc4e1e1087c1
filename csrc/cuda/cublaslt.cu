// scaled_mm through cuBLASLt's FP8 GEMM (cc >= 8.9): the fastest path for the shapes
// it accepts. Row-major out [M, N] is computed as the column-major out^T = W a^T,
// cuBLASLt's "TN" layout: A = the weight (b = w.t(), K contiguous per output feature,
// op T), B = the activations (K contiguous per token, op N), D = out^T with ld N.
//
// Scales: per-tensor ones go in as the A/B scale pointers (device memory, no sync).
// Per-row / per-column scales use the outer-vector scale mode (cuBLAS >= 12.9, sm_90
// only, both operands in that mode: a per-tensor side is broadcast to a vector in the
// workspace). Block-wise scales (activations per token and group of 128, the weight per
// 128 x 128 block) use the block scale modes (cuBLAS >= 12.9, sm_90 only): BLK128x128
// for cuBLASLt's A (our weight), VEC128 for its B (our activations), each in the layout
// cuBLASLt reads, which one small kernel writes into the workspace per call (scales
// only: M x K/128 + N/128 x K/128 floats): the activations' [M, K/128] transposed to
// M-major ([K/128][M]), the weight's [N/128, K/128] with the K-block count padded to a
// multiple of 4 ([N/128][round_up(K/128, 4)]; the layouts torch._scaled_mm checks for
// the same modes, and pytorch issue 166752 for the padding, without which cuBLASLt's
// results are silently wrong). A bias rides in the epilogue when it has the output's
// 16-bit dtype (not with block scales). Anything else is left to our GEMM (scaled_mm.cu
// decides).
//
// Cached per device: the handle; per problem: the heuristic's algorithm. The workspace
// comes with each call (the bindings allocate it from torch's caching allocator on the
// call's stream, so it follows the stream's ordering and CUDA-graph capture).
#include <cublasLt.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

#include "cuda_kernels.h"
#include "launch.cuh"

// cuBLAS 12.9 added both the outer-vector and the block scale modes.
#if CUBLAS_VER_MAJOR > 12 || (CUBLAS_VER_MAJOR == 12 && CUBLAS_VER_MINOR >= 9)
#define FP8LINEAR_HAS_SCALE_MODES 1
#else
#define FP8LINEAR_HAS_SCALE_MODES 0
#endif

namespace fp8cuda {
namespace {

constexpr size_t kWorkspaceBytes = FP8_CUDA_CUBLASLT_WORKSPACE_BYTES;  // what cuBLAS recommends on Hopper
constexpr int64_t kBroadcastFloats = FP8_CUDA_BROADCAST_FLOATS;  // a per-tensor scale as an M- or N-vector
constexpr int kMaxDevices = 64;

// The headers say what was compiled against; the library loaded at run time (torch's
// wheel may have loaded an older libcublasLt first) must have the scale modes too.
bool scale_modes_available() {
  static const bool available = FP8LINEAR_HAS_SCALE_MODES && cublasLtGetVersion() >= 120900;
  return available;
}

const char* status_message(const char* what, cublasStatus_t status) {
  return error_text("fp8linear CUDA: %s: %s (cuBLAS status %d)", what, cublasLtGetStatusString(status),
                    static_cast<int>(status));
}

struct ProblemKey {
  int device;
  int64_t m, n, k, lda, ldb, ldd;
  int a_format, b_format, out_dtype, bias_dtype, scale_mode;
  int alignment_a, alignment_b, alignment_d, alignment_bias;
  size_t workspace_bytes;
  auto tie() const {
    return std::tie(device, m, n, k, lda, ldb, ldd, a_format, b_format, out_dtype, bias_dtype, scale_mode,
                    alignment_a, alignment_b, alignment_d, alignment_bias, workspace_bytes);
  }
  bool operator<(const ProblemKey& other) const { return tie() < other.tie(); }
};

struct CachedAlgorithm {
  bool found;
  cublasLtMatmulAlgo_t algorithm;
};

std::mutex cache_mutex;
cublasLtHandle_t handles[kMaxDevices];
std::map<ProblemKey, CachedAlgorithm> algorithms;
// Set once cuBLASLt says outer-vector (block) scales are not supported on a device
// (NOT_SUPPORTED), so later calls skip the try; outer-vector scales apart with and
// without a bias epilogue ([device][bias]: whether the two combine is not documented, so
// a refusal of one is not taken for the other). An INVALID_VALUE is taken as this
// problem's alone: its cached algorithm is dropped and other shapes keep trying.
bool outer_vector_refused[kMaxDevices][2];
bool block_scales_refused[kMaxDevices];

// The largest power of two (up to 256) that divides the address: cuBLASLt assumes
// 256-byte alignment unless told, and a sliced tensor may have less.
int alignment_of(const void* pointer) {
  int alignment = 256;
  while (alignment > 1 && !is_aligned(pointer, alignment)) alignment /= 2;
  return alignment;
}

cudaDataType_t fp8_type(fp8_format format) { return format == FP8_E4M3FN ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2; }

cudaDataType_t float_type(fp8_float_dtype dtype) {
  return dtype == FP8_BFLOAT16 ? CUDA_R_16BF : dtype == FP8_FLOAT16 ? CUDA_R_16F : CUDA_R_32F;
}

// The operands' leading dimensions; a single row (column) may have any stride.
int64_t activation_ld(const fp8_scaled_mm_params* p) { return p->m == 1 ? p->k : p->a_row_stride; }
int64_t weight_ld(const fp8_scaled_mm_params* p) { return p->n == 1 ? p->k : p->b_col_stride; }

bool wants_outer_vector(const fp8_scaled_mm_params* p) { return p->scale_a_per_row || p->scale_b_per_col; }

// How cuBLASLt is asked to scale: one number per operand, outer vectors, or blocks.
enum ScaleMode { kScalar = 0, kOuterVector = 1, kBlocks = 2 };
ScaleMode scale_mode_of(const fp8_scaled_mm_params* p) {
  return fp8_k_blocked(p) ? kBlocks : wants_outer_vector(p) ? kOuterVector : kScalar;
}

// Block scales in cuBLASLt's layouts, after its workspace: the activations' transposed
// ([K/128][M]), then (from a 256-byte boundary) the weight's padded ([N/128][L4]).
struct BlockScaleLayout {
  int64_t k_blocks, k_blocks4, n_blocks;
  int64_t a_floats, b_offset, total_floats;
};
BlockScaleLayout block_scale_layout(const fp8_scaled_mm_params* p) {
  BlockScaleLayout l;
  l.k_blocks = ceil_div(p->k, static_cast<int64_t>(FP8_SCALE_BLOCK));
  l.k_blocks4 = ceil_div(l.k_blocks, static_cast<int64_t>(4)) * 4;
  l.n_blocks = ceil_div(p->n, static_cast<int64_t>(FP8_SCALE_BLOCK));
  l.a_floats = l.k_blocks * p->m;
  l.b_offset = ceil_div(l.a_floats, static_cast<int64_t>(64)) * 64;
  l.total_floats = l.b_offset + l.n_blocks * l.k_blocks4;
  return l;
}

// a_t[kb * M + m] = scale_a(m, kb); b_padded[nb * L4 + kb] = scale_b(kb, nb) (0 past K/128).
__global__ void block_scales_kernel(float* a_t, float* b_padded, const float* scale_a, int64_t scale_a_row_stride,
                                    const float* scale_b, int64_t scale_b_k_stride, int64_t scale_b_n_stride, int64_t m,
                                    int64_t k_blocks, int64_t k_blocks4, int64_t n_blocks) {
  const int64_t a_count = k_blocks * m, total = a_count + n_blocks * k_blocks4;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (i < a_count) {
      const int64_t kb = i / m, row = i % m;
      a_t[i] = scale_a[row * scale_a_row_stride + kb];
    } else {
      const int64_t j = i - a_count, nb = j / k_blocks4, kb = j % k_blocks4;
      b_padded[j] = kb < k_blocks ? scale_b[kb * scale_b_k_stride + nb * scale_b_n_stride] : 0.0f;
    }
  }
}

// Why cuBLASLt's block scaling does not take this K-blocked call, or NULL. Some rules
// are stricter than cuBLASLt's documentation requires, where it leaves the layout
// unclear and a wrong guess would be silently wrong (not yet run on a GPU).
const char* block_scale_refusal(const fp8_scaled_mm_params* p, int major) {
  if (!scale_modes_available()) return "block-wise scales in cuBLASLt need cuBLAS 12.9 or newer (built and loaded)";
  if (major != 9) return "block-wise scales in cuBLASLt exist only on sm_90";
  if (!p->scale_a_blocked || !p->scale_b_blocked) {
    return "cuBLASLt's block scaling takes activations scaled per token and group of 128 with a weight scaled per "
           "128 x 128 block, not mixed with per-tensor or per-row/column scales";
  }
  if (p->a_format != FP8_E4M3FN || p->b_format != FP8_E4M3FN) return "cuBLASLt's block scaling is used for e4m3 operands only";
  if (p->k % FP8_SCALE_BLOCK != 0 || p->n % FP8_SCALE_BLOCK != 0) {
    return "cuBLASLt's block scaling needs whole blocks: K and N multiples of 128";
  }
  if (p->m % 4 != 0) return "cuBLASLt's block scaling is used with M a multiple of 4 (M-long, 16-byte aligned scale columns)";
  if (p->bias != nullptr) return "cuBLASLt's block scaling is used without a bias epilogue";
  return nullptr;
}

__global__ void broadcast_kernel(float* out, const float* value, int64_t count) {
  const float v = *value;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = v;
  }
}

// RAII for the descriptors of one call.
struct Descriptors {
  cublasLtMatmulDesc_t matmul = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulPreference_t preference = nullptr;
  ~Descriptors() {
    if (preference) cublasLtMatmulPreferenceDestroy(preference);
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (matmul) cublasLtMatmulDescDestroy(matmul);
  }
};

}  // namespace
}  // namespace fp8cuda

using namespace fp8cuda;

const char* fp8_cuda_cublaslt_refusal(const fp8_scaled_mm_params* p, int major, int minor) {
  if (major * 10 + minor < 89) return "cuBLASLt FP8 needs compute capability 8.9 or newer";
  if (p->a_is_float) return "cuBLASLt FP8 needs fp8 activations (a is a float dtype: weight-only)";
  if (p->a_format == FP8_E5M2 && p->b_format == FP8_E5M2) return "cuBLASLt has no e5m2 x e5m2 GEMM";
  if (p->k == 0) return "K = 0 has no products";
  if (p->out_dtype == FP8_FLOAT32) {
    // Measured on Ada/Hopper (SageAttention, DeepSeek-V3): the fp8 tensor cores carry
    // partial sums with 13 mantissa bits between cuBLASLt's float32 promotions, about
    // 1e-4 relative error at K = 4096: fine for 16-bit outputs, not float32 sums
    // (scaled_mm.cu sends float32 outputs to our kernels, widened to float16).
    return "float32 output needs float32 sums; cuBLASLt's FP8 GEMM keeps 13-bit partial sums between promotions";
  }
  // cuBLASLt reads K contiguous bytes of every row of a and column of b, also when there
  // is only one (M = 1 or N = 1: the leading dimension does not matter then, the K stride does)
  if (p->a_col_stride != 1 || p->b_row_stride != 1) {
    return "cuBLASLt FP8 takes only the TN layout: a row-major [M, K] and b = w.t() of a row-major [N, K] weight";
  }
  if (p->k % 16 != 0 || p->n % 16 != 0) return "cuBLASLt FP8 needs K and N to be multiples of 16";
  if (activation_ld(p) % 16 != 0 || weight_ld(p) % 16 != 0 || p->out_row_stride % 16 != 0) {
    return "cuBLASLt FP8 needs row strides that are multiples of 16";
  }
  // Rows that overlap (an expanded activation, x.expand(M, K), has row stride 0) are a
  // layout cuBLASLt does not take: its leading dimension must be at least K.
  if ((p->m > 1 && p->a_row_stride < p->k) || (p->n > 1 && p->b_col_stride < p->k)) {
    return "cuBLASLt needs rows that do not overlap (a row stride of at least K)";
  }
  if (!is_aligned(p->a, 16) || !is_aligned(p->b, 16) || !is_aligned(p->out, 16)) {
    return "cuBLASLt FP8 needs 16-byte aligned operands";
  }
  if (fp8_k_blocked(p)) return block_scale_refusal(p, major);
  if (wants_outer_vector(p)) {
    if (!scale_modes_available()) return "per-row/column scales in cuBLASLt need cuBLAS 12.9 or newer (built and loaded)";
    if (major != 9) return "per-row/column scales in cuBLASLt (outer-vector mode) exist only on sm_90";
    // The vectors cuBLASLt reads in place (a per-row scale_a, a per-column scale_b);
    // one sliced from a larger vector may be only 4-byte aligned, and cuBLASLt's
    // documentation does not say what it needs: those calls take our kernels
    if ((p->scale_a_per_row && !is_aligned(p->scale_a, 16)) || (p->scale_b_per_col && !is_aligned(p->scale_b, 16))) {
      return "cuBLASLt is given per-row/column scale vectors only 16-byte aligned";
    }
    if ((!p->scale_a_per_row && p->m > kBroadcastFloats) || (!p->scale_b_per_col && p->n > kBroadcastFloats)) {
      return "too many rows to broadcast a per-tensor scale for cuBLASLt's outer-vector mode";
    }
  }
  if (p->bias != nullptr) {
    if (p->bias_dtype != p->out_dtype) return "cuBLASLt's FP8 bias epilogue needs a bias of the output dtype";
    if (!is_aligned(p->bias, 16)) return "cuBLASLt needs a 16-byte aligned bias";
  }
  return nullptr;
}

size_t fp8_cuda_workspace_bytes(const fp8_scaled_mm_params* p) {
  // one launch's rows: a larger call runs in parts that reuse the workspace in turn
  fp8_scaled_mm_params part = *p;
  part.m = std::min<int64_t>(p->m, FP8_CUDA_MAX_LAUNCH_ROWS);
  const int64_t scale_floats = fp8_k_blocked(p) ? std::max(block_scale_layout(&part).total_floats, kBroadcastFloats)
                                                : kBroadcastFloats;
  return kWorkspaceBytes + static_cast<size_t>(scale_floats) * sizeof(float);
}

const char* fp8_cuda_cublaslt_launch(const fp8_scaled_mm_params* p, int device, int major, int minor,
                                     cudaStream_t stream, fp8_cuda_workspace given, int* unsupported) {
  *unsupported = 0;
  if (const char* refusal = fp8_cuda_cublaslt_refusal(p, major, minor)) {
    *unsupported = 1;
    return refusal;
  }
  if (device < 0 || device >= kMaxDevices) return error_text("fp8linear CUDA: device index %d is out of range", device);
  const ScaleMode mode = scale_mode_of(p);
  const bool outer_vector = mode == kOuterVector, blocks = mode == kBlocks;

  cublasLtHandle_t handle;
  {
    std::lock_guard<std::mutex> lock(cache_mutex);
    if (outer_vector && outer_vector_refused[device][p->bias != nullptr]) {
      *unsupported = 1;
      return p->bias != nullptr ? "cuBLASLt refused outer-vector (per-row/column) scales with a bias on this device"
                                : "cuBLASLt refused outer-vector (per-row/column) scales on this device";
    }
    if (blocks && block_scales_refused[device]) {
      *unsupported = 1;
      return "cuBLASLt refused block scales on this device";
    }
    if (handles[device] == nullptr) {
      const cublasStatus_t status = cublasLtCreate(&handles[device]);
      if (status != CUBLAS_STATUS_SUCCESS) {
        handles[device] = nullptr;
        return status_message("cublasLtCreate", status);
      }
    }
    handle = handles[device];
  }
  // The caller's memory: cuBLASLt's workspace, then the broadcast or block scales.
  struct {
    void* memory;
    size_t bytes;
  } workspace = {nullptr, 0};
  if (given.memory != nullptr && given.bytes >= fp8_cuda_workspace_bytes(p)) workspace = {given.memory, kWorkspaceBytes};
  if (mode != kScalar && workspace.memory == nullptr) {
    *unsupported = 1;
    return outer_vector ? "no workspace for broadcasting a per-tensor scale" : "no workspace for the block scales' layouts";
  }

  // Scales: cuBLASLt's A is our weight (scale_b), its B our activations (scale_a).
  const float* weight_scale = p->scale_b;
  const float* activation_scale = p->scale_a;
  if (blocks) {
    float* scales = reinterpret_cast<float*>(static_cast<char*>(workspace.memory) + kWorkspaceBytes);
    const BlockScaleLayout layout = block_scale_layout(p);
    const int grid = static_cast<int>(std::min<int64_t>(ceil_div(layout.total_floats, 256), 1024));
    block_scales_kernel<<<grid, 256, 0, stream>>>(scales, scales + layout.b_offset, p->scale_a, p->scale_a_row_stride,
                                                     p->scale_b, p->scale_b_k_stride, p->scale_b_n_stride, p->m,
                                                     layout.k_blocks, layout.k_blocks4, layout.n_blocks);
    if (const char* error = check_launch("block_scales_kernel")) return error;
    activation_scale = scales;
    weight_scale = scales + layout.b_offset;
  }
  if (outer_vector) {
    float* broadcast = reinterpret_cast<float*>(static_cast<char*>(workspace.memory) + kWorkspaceBytes);
    const bool broadcast_weight = !p->scale_b_per_col;
    const int64_t count = broadcast_weight ? p->n : p->m;
    if (!p->scale_a_per_row || !p->scale_b_per_col) {
      const int blocks = static_cast<int>(std::min<int64_t>(ceil_div(count, 256), 1024));
      broadcast_kernel<<<blocks, 256, 0, stream>>>(broadcast, broadcast_weight ? p->scale_b : p->scale_a, count);
      if (const char* error = check_launch("broadcast_kernel")) return error;
      (broadcast_weight ? weight_scale : activation_scale) = broadcast;
    }
  }

  Descriptors descriptors;
  cublasStatus_t status = cublasLtMatmulDescCreate(&descriptors.matmul, CUBLAS_COMPUTE_32F, CUDA_R_32F);
  if (status != CUBLAS_STATUS_SUCCESS) return status_message("cublasLtMatmulDescCreate", status);
  auto set = [&](cublasLtMatmulDescAttributes_t attribute, const void* value, size_t size) {
    if (status == CUBLAS_STATUS_SUCCESS) status = cublasLtMatmulDescSetAttribute(descriptors.matmul, attribute, value, size);
  };
  const cublasOperation_t transpose = CUBLAS_OP_T, no_transpose = CUBLAS_OP_N;
  set(CUBLASLT_MATMUL_DESC_TRANSA, &transpose, sizeof transpose);
  set(CUBLASLT_MATMUL_DESC_TRANSB, &no_transpose, sizeof no_transpose);
  set(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &weight_scale, sizeof weight_scale);
  set(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &activation_scale, sizeof activation_scale);
#if FP8LINEAR_HAS_SCALE_MODES
  if (outer_vector) {
    const int32_t vector_mode = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
    set(CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &vector_mode, sizeof vector_mode);
    set(CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &vector_mode, sizeof vector_mode);
  }
  if (blocks) {
    const int32_t weight_mode = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
    const int32_t activation_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    set(CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &weight_mode, sizeof weight_mode);
    set(CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &activation_mode, sizeof activation_mode);
  }
#endif
  if (status != CUBLAS_STATUS_SUCCESS && mode != kScalar) {
    // a library that does not know the scale modes: our kernels take the call
    *unsupported = 1;
    return status_message("cublasLtMatmulDescSetAttribute refused the scale mode", status);
  }
  // Fast accumulation stays off: Hopper then promotes the fp8 partial sums to full
  // float32 periodically, which the float32-accumulation contract needs.
  if (p->bias != nullptr) {
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    const int32_t bias_type = float_type(p->bias_dtype);
    set(CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof epilogue);
    set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, &p->bias, sizeof p->bias);
    set(CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof bias_type);
  }
  if (status != CUBLAS_STATUS_SUCCESS) return status_message("cublasLtMatmulDescSetAttribute", status);

  const uint64_t m = static_cast<uint64_t>(p->m), n = static_cast<uint64_t>(p->n), k = static_cast<uint64_t>(p->k);
  status = cublasLtMatrixLayoutCreate(&descriptors.a, fp8_type(p->b_format), k, n, weight_ld(p));
  if (status == CUBLAS_STATUS_SUCCESS) {
    status = cublasLtMatrixLayoutCreate(&descriptors.b, fp8_type(p->a_format), k, m, activation_ld(p));
  }
  if (status == CUBLAS_STATUS_SUCCESS) {
    // C is not read (beta = 0) but must be described; it shares D's layout and type.
    status = cublasLtMatrixLayoutCreate(&descriptors.d, float_type(p->out_dtype), n, m, p->out_row_stride);
  }
  if (status != CUBLAS_STATUS_SUCCESS) return status_message("cublasLtMatrixLayoutCreate", status);

  const ProblemKey key{device, p->m, p->n, p->k, activation_ld(p), weight_ld(p), p->out_row_stride,
                       p->a_format, p->b_format, p->out_dtype, p->bias ? static_cast<int>(p->bias_dtype) : -1,
                       static_cast<int>(mode), alignment_of(p->b), alignment_of(p->a), alignment_of(p->out),
                       p->bias ? alignment_of(p->bias) : 256, workspace.bytes};
  CachedAlgorithm cached{};
  bool have_cached = false;
  {
    std::lock_guard<std::mutex> lock(cache_mutex);
    auto found = algorithms.find(key);
    if (found != algorithms.end()) {
      cached = found->second;
      have_cached = true;
    }
  }
  if (!have_cached) {
    status = cublasLtMatmulPreferenceCreate(&descriptors.preference);
    auto prefer = [&](cublasLtMatmulPreferenceAttributes_t attribute, uint32_t value) {
      if (status == CUBLAS_STATUS_SUCCESS) {
        status = cublasLtMatmulPreferenceSetAttribute(descriptors.preference, attribute, &value, sizeof value);
      }
    };
    const uint64_t workspace_bytes = workspace.bytes;
    if (status == CUBLAS_STATUS_SUCCESS) {
      status = cublasLtMatmulPreferenceSetAttribute(descriptors.preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                    &workspace_bytes, sizeof workspace_bytes);
    }
    prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, static_cast<uint32_t>(key.alignment_a));
    prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, static_cast<uint32_t>(key.alignment_b));
    prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, static_cast<uint32_t>(key.alignment_d));
    prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, static_cast<uint32_t>(key.alignment_d));
    if (status != CUBLAS_STATUS_SUCCESS) return status_message("cublasLtMatmulPreference", status);
    cublasLtMatmulHeuristicResult_t result{};
    int results = 0;
    status = cublasLtMatmulAlgoGetHeuristic(handle, descriptors.matmul, descriptors.a, descriptors.b, descriptors.d,
                                            descriptors.d, descriptors.preference, 1, &result, &results);
    if (status != CUBLAS_STATUS_SUCCESS && status != CUBLAS_STATUS_NOT_SUPPORTED &&
        status != CUBLAS_STATUS_INVALID_VALUE) {
      // (ALLOC_FAILED, INTERNAL_ERROR, ...: may pass; this call falls back, the next asks again)
      *unsupported = 1;
      return status_message("cublasLtMatmulAlgoGetHeuristic", status);
    }
    // an answer about this problem, kept: SUCCESS with or without an algorithm, or a refusal
    cached.found = status == CUBLAS_STATUS_SUCCESS && results > 0 && result.state == CUBLAS_STATUS_SUCCESS;
    cached.algorithm = result.algo;
    std::lock_guard<std::mutex> lock(cache_mutex);
    algorithms[key] = cached;
  }
  if (!cached.found) {
    *unsupported = 1;
    return "cuBLASLt has no algorithm for this problem";
  }

  const float alpha = 1.0f, beta = 0.0f;
  status = cublasLtMatmul(handle, descriptors.matmul, &alpha, p->b, descriptors.a, p->a, descriptors.b, &beta, p->out,
                          descriptors.d, p->out, descriptors.d, &cached.algorithm, workspace.memory, workspace.bytes,
                          stream);
  if (status == CUBLAS_STATUS_SUCCESS) return nullptr;
  if (status == CUBLAS_STATUS_NOT_SUPPORTED || status == CUBLAS_STATUS_INVALID_VALUE) {
    // NOT_SUPPORTED with vector or block scales: the documented way a device without
    // them says so, remembered for the device. Otherwise (INVALID_VALUE, or a per-tensor
    // call: cublasLt.h says an unsupported combination of types and scales is reported
    // by cublasLtMatmul, not by the heuristic) it may concern this problem only: only its
    // algorithm is forgotten (this shape falls back from now on; others still try).
    std::lock_guard<std::mutex> lock(cache_mutex);
    if (status == CUBLAS_STATUS_NOT_SUPPORTED && mode != kScalar) {
      (outer_vector ? outer_vector_refused[device][p->bias != nullptr] : block_scales_refused[device]) = true;
    }
    algorithms[key] = CachedAlgorithm{false, cached.algorithm};
    *unsupported = 1;
    return status_message(outer_vector ? "cublasLtMatmul refused outer-vector scales"
                          : blocks     ? "cublasLtMatmul refused block scales"
                                       : "cublasLtMatmul refused this problem",
                          status);
  }
  return status_message("cublasLtMatmul", status);
}
