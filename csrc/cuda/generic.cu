// scaled_mm for anything the tensor-core kernels do not take: arbitrary strides of a
// and b, float32 activations (weight-only; a 16-bit mma would round them), K = 0, and
// GPUs below sm_80 (and K-blocked, 128 x 128 block-wise scales, which the tensor-core
// kernels take too). Plain SIMT: a 64 x 64 tile per block, each thread 4 x 4 outputs,
// operands decoded to float32 on their way into shared memory, exact fp8 products
// and float32 sums (fmaf rounds once per step, as the reference's a * b + acc).
#include "cuda_kernels.h"
#include "fp8_device.cuh"
#include "launch.cuh"
#include "mma.cuh"

namespace fp8cuda {
namespace {

constexpr int kTile = 64;      // output rows and columns per block
constexpr int kDepth = 16;     // k per shared-memory stage
constexpr int kThreads = 256;  // 16 x 16 threads, 4 x 4 outputs each

__device__ __forceinline__ float load_a(const fp8_scaled_mm_params& p, int64_t m, int64_t k) {
  const int64_t offset = m * p.a_row_stride + k * p.a_col_stride;
  if (p.a_is_float) return load_float(p.a, p.a_float_dtype, offset);
  return decode_fp8(static_cast<const uint8_t*>(p.a)[offset], p.a_format);
}

__device__ __forceinline__ float load_b(const fp8_scaled_mm_params& p, int64_t k, int64_t n) {
  return decode_fp8(p.b[k * p.b_row_stride + n * p.b_col_stride], p.b_format);
}

__global__ void __launch_bounds__(kThreads) generic_kernel(fp8_scaled_mm_params p) {
  // k-major tiles: a thread's 4 rows (or columns) are 16 apart, so a warp's reads of
  // one k row hit 32 consecutive floats. The +1 keeps the k-fastest stores below on
  // distinct banks.
  __shared__ float a_tile[kDepth][kTile + 1];
  __shared__ float b_tile[kDepth][kTile + 1];
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int64_t m0 = blockIdx.y * static_cast<int64_t>(kTile), n0 = blockIdx.x * static_cast<int64_t>(kTile);
  // Consecutive threads load along the operand's unit stride when it has one (K for
  // a row-major activation or a Linear weight seen as w.t()), so loads coalesce.
  const bool a_k_fastest = p.a_col_stride == 1, b_k_fastest = p.b_row_stride == 1;
  float acc[4][4] = {}, total[4][4] = {};
  const bool blocked = fp8_k_blocked(&p);
  for (int64_t k0 = 0; k0 < p.k; k0 += kDepth) {
    // Each tile holds 64 x 16 values: 4 per thread.
#pragma unroll
    for (int i = 0; i < kTile * kDepth / kThreads; ++i) {
      const int index = threadIdx.x + i * kThreads;
      int along = a_k_fastest ? index / kDepth : index % kTile;
      int depth = a_k_fastest ? index % kDepth : index / kTile;
      a_tile[depth][along] = (m0 + along < p.m && k0 + depth < p.k) ? load_a(p, m0 + along, k0 + depth) : 0.0f;
      along = b_k_fastest ? index / kDepth : index % kTile;
      depth = b_k_fastest ? index % kDepth : index / kTile;
      b_tile[depth][along] = (n0 + along < p.n && k0 + depth < p.k) ? load_b(p, k0 + depth, n0 + along) : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int depth = 0; depth < kDepth; ++depth) {
      float a[4], b[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        a[i] = a_tile[depth][ty + 16 * i];
        b[i] = b_tile[depth][tx + 16 * i];
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
      }
    }
    __syncthreads();
    // K-blocked scales: at the end of each block of 128 k (a multiple of kDepth), its
    // float32 sums, scaled, join the totals
    if (blocked && ((k0 + kDepth) % FP8_SCALE_BLOCK == 0 || k0 + kDepth >= p.k)) {
      const int64_t kb = k0 / FP8_SCALE_BLOCK;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int64_t m = m0 + ty + 16 * i, n = n0 + tx + 16 * j;
          if (m < p.m && n < p.n) total[i][j] = fmaf(fp8_k_block_scale(&p, m, n, kb), acc[i][j], total[i][j]);
          acc[i][j] = 0.0f;
        }
      }
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) store_result(p, m0 + ty + 16 * i, n0 + tx + 16 * j, blocked ? total[i][j] : acc[i][j]);
  }
}

}  // namespace
}  // namespace fp8cuda

const char* fp8_cuda_generic_launch(const fp8_scaled_mm_params* p, cudaStream_t stream) {
  using namespace fp8cuda;
  const int64_t blocks_m = ceil_div(p->m, kTile), blocks_n = ceil_div(p->n, kTile);
  if (blocks_m > 65535 || blocks_n > 0x7FFFFFFF) {
    return error_text("fp8linear CUDA: generic grid too large for M = %lld, N = %lld", static_cast<long long>(p->m),
                      static_cast<long long>(p->n));
  }
  generic_kernel<<<dim3(static_cast<unsigned>(blocks_n), static_cast<unsigned>(blocks_m)), kThreads, 0, stream>>>(*p);
  return check_launch("generic_kernel");
}
