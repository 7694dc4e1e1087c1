// Skinny scaled_mm for small M (decode): the weight is streamed once, 16 bytes per
// load, and widened (or fed to the fp8 tensor cores) in registers.
//
// Why tensor cores for a GEMV: at M = 16 a SIMT kernel needs 16 FMAs per weight byte
// and becomes compute-bound below the bandwidth; mma.sync m16n8k32 does 16 x 8 x 32
// products per instruction, so the kernel stays bound by the weight stream up to
// M = 64. Roles are swapped (out^T = W a^T): the weight [N, K] is the mma's row
// operand (16 output features per tile, K contiguous: "row"), the activations the
// column operand (8 tokens per tile, K contiguous: "col").
//
// A block owns 16 output features and kTokenTiles * 8 tokens (8, 16 or 64; K-blocked
// calls 8, 16 or 32, so that M = 33-64 reads the weight twice there); its 8
// warps split K (warp w takes slices w, w + 8, ...) and add their partial sums in
// shared memory. 16-feature blocks give N / 16 blocks (256 for N = 4096: two per SM),
// enough to fill the GPU where a GEMM's 128-wide tiles would leave SMs idle.
// Bytes: N * K weight bytes once, plus M * K activation bytes per block (L2 hits);
// at M = 1 the time is weight bytes / bandwidth (4096 x 14336: 58.7 MB, ~15 us at
// 4 TB/s; the bf16 weight is twice that). Widened variants (kWiden) serve GPUs below
// sm_89, 16-bit activations (weight-only) and float32 outputs (scaled_mm.cu).
//
// K-blocked (block-wise 128 x 128) scales: warps take whole blocks of 128 k (two
// slices: warp w blocks w, w + 8, ...), and each block's float32 sums join the warp's
// totals scaled by scale_a(token, kb) * scale_b(kb, feature) before the warps add up.
// At most two slices are in flight per warp there (otherwise up to four; one at M > 16),
// and M > 16 takes blocks of 32 tokens (otherwise 64).
#include "cuda_kernels.h"
#include "launch.cuh"
#include "mma.cuh"

namespace fp8cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kFeatures = 16;  // output features per block: one m16 row tile

template <class WeightKind, class ActivationKind, int kTokenTiles, bool kWiden, bool kBlocked>
__global__ void __launch_bounds__(kThreads)
    gemv_kernel(fp8_scaled_mm_params p, bool weight_aligned, bool activation_aligned) {
  constexpr int kTokens = 8 * kTokenTiles;
  // Slices loaded ahead per warp, so each thread keeps ~128 bytes in flight at M = 1;
  // fewer when the activation registers of many tokens leave no room.
  constexpr int kActivationBytes = kTokenTiles * ActivationKind::kBytes;  // a thread's bytes per k-element
  // widened fp8 activations are held as 16-bit values (two token tiles, four slices
  // ahead: 128 registers and spills at sm_80)
  constexpr int kHeldBytes = kTokenTiles * (kWiden ? 2 : ActivationKind::kBytes);
  constexpr int kLoadsAhead = kHeldBytes <= 2 ? 4 : kActivationBytes <= 8 ? 2 : 1;  // (kHeldBytes >= kActivationBytes)

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = lane / 4, thread_in_group = lane % 4;
  const int64_t feature0 = blockIdx.x * static_cast<int64_t>(kFeatures);
  const int64_t token0 = blockIdx.y * static_cast<int64_t>(kTokens);

  // b = w.t() with b_row_stride 1: weight row n (output feature n) starts at b + n * b_col_stride.
  const uint8_t* weight = p.b;
  const int64_t feature_lo = feature0 + group, feature_hi = feature_lo + 8;
  const uint8_t* weight_lo = weight + feature_lo * p.b_col_stride;
  const uint8_t* weight_hi = weight + feature_hi * p.b_col_stride;
  const uint8_t* activation = static_cast<const uint8_t*>(p.a);
  const uint8_t* token_rows[kTokenTiles];
  bool has_token[kTokenTiles];
#pragma unroll
  for (int j = 0; j < kTokenTiles; ++j) {
    const int64_t token = token0 + 8 * j + group;
    has_token[j] = token < p.m;
    token_rows[j] = activation + token * p.a_row_stride * ActivationKind::kBytes;
  }

  float acc[1][kTokenTiles][4] = {};
  const int64_t slices = ceil_div(p.k, kSliceElements);
  // A thread's share of slice `slice` (zeros past K, N and M).
  auto load = [&](Slice<WeightKind>& lo, Slice<WeightKind>& hi, Slice<ActivationKind> (&tokens)[kTokenTiles],
                  int64_t slice) {
    const int64_t k0 = slice * kSliceElements + 16 * thread_in_group;
    const bool in_range = slice < slices;
    clear(lo);
    clear(hi);
    if (in_range && feature_lo < p.n) load_slice<WeightKind, true>(lo, weight_lo, k0, p.k, weight_aligned);
    if (in_range && feature_hi < p.n) load_slice<WeightKind, true>(hi, weight_hi, k0, p.k, weight_aligned);
#pragma unroll
    for (int j = 0; j < kTokenTiles; ++j) {
      clear(tokens[j]);
      if (in_range && has_token[j]) load_slice<ActivationKind, false>(tokens[j], token_rows[j], k0, p.k, activation_aligned);
    }
  };
  if constexpr (!kBlocked) {
    for (int64_t first = warp; first < slices; first += kWarps * kLoadsAhead) {
      Slice<WeightKind> lo[kLoadsAhead][1], hi[kLoadsAhead][1];
      Slice<ActivationKind> tokens[kLoadsAhead][kTokenTiles];
      // All loads of the batch are issued before any mma waits on them.
#pragma unroll
      for (int u = 0; u < kLoadsAhead; ++u) load(lo[u][0], hi[u][0], tokens[u], first + static_cast<int64_t>(u) * kWarps);
#pragma unroll
      for (int u = 0; u < kLoadsAhead; ++u) mma_slice<WeightKind, ActivationKind, kWiden>(acc, lo[u], hi[u], tokens[u]);
    }
  } else {
    constexpr int kSlicesPerBlock = FP8_SCALE_BLOCK / kSliceElements;
    // slices in flight: two, one with 4 token tiles (with two, 12 bytes spilled at sm_90a)
    constexpr int kBatch = kTokenTiles >= 4 ? 1 : kLoadsAhead < kSlicesPerBlock ? kLoadsAhead : kSlicesPerBlock;
    const int64_t k_blocks = ceil_div(p.k, FP8_SCALE_BLOCK);
    float block[1][kTokenTiles][4] = {};
    for (int64_t kb = warp; kb < k_blocks; kb += kWarps) {
#pragma unroll
      for (int first = 0; first < kSlicesPerBlock; first += kBatch) {
        Slice<WeightKind> lo[kBatch][1], hi[kBatch][1];
        Slice<ActivationKind> tokens[kBatch][kTokenTiles];
#pragma unroll
        for (int u = 0; u < kBatch; ++u) load(lo[u][0], hi[u][0], tokens[u], kb * kSlicesPerBlock + first + u);
#pragma unroll
        for (int u = 0; u < kBatch; ++u) mma_slice<WeightKind, ActivationKind, kWiden>(block, lo[u], hi[u], tokens[u]);
      }
      // mma rows are features (groupID, + 8), columns tokens (2t, 2t + 1 of each tile)
      add_scaled_block(acc, block, p, feature_lo, token0 + 2 * thread_in_group, false, kb);
    }
  }

  // Split-K: the 8 warps' partial sums meet in shared memory, laid out so that a
  // warp's 32 lanes write 32 consecutive floats.
  __shared__ float partial[kWarps][kTokenTiles * 4][32];
#pragma unroll
  for (int j = 0; j < kTokenTiles; ++j) {
#pragma unroll
    for (int r = 0; r < 4; ++r) partial[warp][4 * j + r][lane] = acc[0][j][r];
  }
  __syncthreads();
  for (int index = threadIdx.x; index < kTokenTiles * 4 * 32; index += kThreads) {
    const int value = index / 32, source_lane = index % 32;
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += partial[w][value][source_lane];
    // Accumulator r of a lane: feature groupID (+ 8 for r >= 2), token 2t (+ 1 for odd r).
    const int tile = value / 4, r = value % 4;
    const int64_t feature = feature0 + source_lane / 4 + (r >= 2 ? 8 : 0);
    const int64_t token = token0 + 8 * tile + 2 * (source_lane % 4) + (r & 1);
    store_result(p, token, feature, sum);
  }
}

template <class WeightKind, class ActivationKind, bool kWiden, bool kBlocked>
const char* launch_with_shape(const fp8_scaled_mm_params* p, cudaStream_t stream) {
  const bool weight_aligned = is_aligned(p->b, 16) && p->b_col_stride % 16 == 0 && p->k % 16 == 0;
  const int64_t activation_bytes = ActivationKind::kBytes;
  const bool activation_aligned = is_aligned(p->a, 16) && (p->a_row_stride * activation_bytes) % 16 == 0 &&
                                  (p->k * activation_bytes) % 16 == 0;
  // Token tiles per block: 1 (M <= 8), 2 (M <= 16), else 8 (K-blocked: 4, whose two
  // sets of sums fit the registers); larger M takes more blocks in y.
  constexpr int kMostTiles = kBlocked ? 4 : 8;
  const int token_tiles = p->m <= 8 ? 1 : p->m <= 16 ? 2 : kMostTiles;
  const int64_t feature_blocks = ceil_div(p->n, kFeatures);
  const int64_t token_blocks = ceil_div(p->m, 8 * token_tiles);
  if (feature_blocks > 0x7FFFFFFF || token_blocks > 65535) {
    return error_text("fp8linear CUDA: gemv grid too large for M = %lld, N = %lld", static_cast<long long>(p->m),
                      static_cast<long long>(p->n));
  }
  const dim3 grid(static_cast<unsigned>(feature_blocks), static_cast<unsigned>(token_blocks));
  const bool w = weight_aligned, a = activation_aligned;
  switch (token_tiles) {
    case 1: gemv_kernel<WeightKind, ActivationKind, 1, kWiden, kBlocked><<<grid, kThreads, 0, stream>>>(*p, w, a); break;
    case 2: gemv_kernel<WeightKind, ActivationKind, 2, kWiden, kBlocked><<<grid, kThreads, 0, stream>>>(*p, w, a); break;
    default:
      gemv_kernel<WeightKind, ActivationKind, kMostTiles, kWiden, kBlocked><<<grid, kThreads, 0, stream>>>(*p, w, a);
      break;
  }
  return check_launch(kWiden ? "gemv_kernel (widening)" : "gemv_kernel (fp8 tensor cores)");
}

template <class WeightKind, class ActivationKind, bool kWiden>
const char* launch_with_kinds(const fp8_scaled_mm_params* p, cudaStream_t stream) {
  return fp8_k_blocked(p) ? launch_with_shape<WeightKind, ActivationKind, kWiden, true>(p, stream)
                          : launch_with_shape<WeightKind, ActivationKind, kWiden, false>(p, stream);
}

template <class WeightKind>
const char* launch_with_weight_kind(const fp8_scaled_mm_params* p, bool widen, cudaStream_t stream) {
  if (p->a_is_float) {
    // Weight-only: 16-bit activations as they are, the weight widened to match.
    if (p->a_float_dtype == FP8_BFLOAT16) return launch_with_kinds<WeightKind, KindBF16, true>(p, stream);
    return launch_with_kinds<WeightKind, KindF16, true>(p, stream);
  }
  if (p->a_format == FP8_E4M3FN) {
    return widen ? launch_with_kinds<WeightKind, KindE4M3, true>(p, stream)
                 : launch_with_kinds<WeightKind, KindE4M3, false>(p, stream);
  }
  return widen ? launch_with_kinds<WeightKind, KindE5M2, true>(p, stream)
               : launch_with_kinds<WeightKind, KindE5M2, false>(p, stream);
}

}  // namespace
}  // namespace fp8cuda

const char* fp8_cuda_gemv_launch(const fp8_scaled_mm_params* p, int widen, cudaStream_t stream) {
  using namespace fp8cuda;
  // 16-bit tensor cores only: float32 activations would be rounded (the generic kernel
  // takes them)
  if (p->a_is_float && p->a_float_dtype == FP8_FLOAT32) {
    return "fp8linear CUDA: gemv: float32 activations are not supported (the generic path takes them)";
  }
  return p->b_format == FP8_E4M3FN ? launch_with_weight_kind<KindE4M3>(p, widen != 0, stream)
                                   : launch_with_weight_kind<KindE5M2>(p, widen != 0, stream);
}
