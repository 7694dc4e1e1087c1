// Tiled scaled_mm on tensor cores for what cuBLASLt cannot take: K or N not a
// multiple of 16 (rows at any byte alignment, no padded copies), e5m2 x e5m2, scales
// or bias cuBLASLt lacks, and every GPU from sm_80 (the up-conversion path).
//
// A block computes a kBlockM x 128 tile of out, 8 warps as 2 x 4 (warp tile
// kBlockM/2 x 32). K advances in 64-element slices through double-buffered shared
// memory: the next slice's loads are in flight while the tensor cores work on the
// current one, with one barrier per slice. When both operands are 16-byte aligned
// (rows, strides, K) the slices go global -> shared by cp.async, without registers;
// otherwise they are staged in registers, read by the loader of mma.cuh (4-byte loads
// and funnel shifts: unaligned K costs extra load instructions, no extra DRAM traffic).
// A warp then loads its column operand and one row tile's operands at a time.
//
// Registers (ptxas -v, sm_90a, fp8 x fp8, 128-row tiles): 152 with cp.async, 188 staged
// through registers (189 before either change, all row tiles' operands held together).
// Both still mean one 256-thread block per SM (two need <= 128, which spills the 64
// float32 sums and the mma products that are added to them): the occupancy, and whether
// Hopper's mma.sync fp8 (ptxas lowers it to a conversion and two f16 HMMA there; sm_89
// has a native fp8 mma.sync) is worth a wgmma kernel, are for a GPU run to measure.
//
// Per 64-slice and warp: 32 fp8 mma.sync (kBlockM = 128), 128 FADDs that keep the
// sums in float32 (mma.cuh), 12 shared-memory 16-byte loads; 16 KB of operands per
// block for 2 * 128 * 128 * 64 FLOPs (128 FLOP per byte of L2 traffic), so it is
// compute-bound from M ~ 128. mma.sync reaches a fraction of Hopper's wgmma peak:
// aligned shapes go to cuBLASLt; this kernel's job is to make unaligned ones work at
// tensor-core speed without padded copies.
//
// K-blocked (block-wise 128 x 128) scales, which cuBLASLt is not asked for: the sums of
// every two slices (128 k) join float32 totals, scaled by scale_a(m, kb) * scale_b(kb,
// n), as the generic kernel does. Both sets of sums take registers, so blocked calls
// use 64-row tiles (the accumulators of one 128-row tile).
#include "cuda_kernels.h"
#include "launch.cuh"
#include "mma.cuh"

namespace fp8cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kBlockN = 128;

template <class ActivationKind, bool kBlocked>
struct TileShape {
  // 16-bit activations (weight-only) take twice the bytes per row; 64 rows keep the
  // double-buffered tiles within the 48 KB of static shared memory. K-blocked calls
  // keep two sets of sums: 64 rows keep them within the registers of one.
  static constexpr int kBlockM = ActivationKind::kBytes == 2 || kBlocked ? 64 : 128;
  static constexpr int kWarpTilesM = kBlockM / 2 / 16;  // m16 tiles per warp
  static constexpr int kWarpTilesN = 4;                 // n8 tiles per warp (32 columns)
  // Row pitches in bytes. A 16-byte shared load by lanes (groupID g, t) reads row g at
  // byte 16t (fp8) or 32t (16-bit); eight lanes of a quarter-warp touch rows g, g + 1.
  // 64-byte fp8 rows put those in one contiguous 128 bytes; 128-byte rows need 16 bytes
  // of padding so that rows g and g + 1 fall into different banks.
  static constexpr int kActivationPitch = kSliceElements * ActivationKind::kBytes + (ActivationKind::kBytes == 2 ? 16 : 0);
  static constexpr int kWeightPitch = kSliceElements;
  static constexpr int kActivationPieces = kBlockM * kSliceElements * ActivationKind::kBytes / 16 / kThreads;
  static constexpr int kWeightPieces = kBlockN * kSliceElements / 16 / kThreads;
};

// 16 bytes global -> shared without registers (cp.async, sm_80+), cached in L2 only.
// !inside (a piece past the end of a row, or beyond the last row): a source size of 0,
// so the 16 bytes are zeroed and nothing is read (`global` need only be a valid address).
// Below sm_80 (an architecture added to TORCH_CUDA_ARCH_LIST, e.g. 7.5 for a T4) these
// kernels compile to a trap: the launcher takes `generic` there and never this kernel,
// as for mma.cuh's products.
__device__ __forceinline__ void copy_async16(void* shared, const void* global, bool inside) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const uint32_t address = static_cast<uint32_t>(__cvta_generic_to_shared(shared));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(address), "l"(global), "r"(inside ? 16 : 0)
               : "memory");
#elif defined(FP8LINEAR_CUDA_EMULATION)  // tests/cuda_emulator: copied at once
  fp8emu::copy_async16(shared, global, inside);
#else
  (void)shared, (void)global, (void)inside;
  __trap();
#endif
}

__device__ __forceinline__ void copies_commit_and_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
#elif defined(FP8LINEAR_CUDA_EMULATION)
  // the emulated copies completed when they were issued
#else
  __trap();
#endif
}

// kAsync: both operands 16-byte aligned (rows, strides and K), so that every 16-byte
// piece is wholly inside or wholly past its row: the slices go from global to shared
// memory with cp.async. Otherwise they are assembled in registers (load_row_bytes) and
// stored to shared memory after the current slice's products.
template <class ActivationKind, class WeightKind, bool kWiden, bool kBlocked, bool kAsync>
__global__ void __launch_bounds__(kThreads)
    gemm_kernel(fp8_scaled_mm_params p, bool activation_aligned, bool weight_aligned) {
  using Shape = TileShape<ActivationKind, kBlocked>;
  constexpr int kBlockM = Shape::kBlockM;
  constexpr int kPiecesPerActivationRow = kSliceElements * ActivationKind::kBytes / 16;
  constexpr int kPiecesPerWeightRow = kSliceElements / 16;
  __shared__ __align__(16) uint8_t activation_tile[2][kBlockM * Shape::kActivationPitch];
  __shared__ __align__(16) uint8_t weight_tile[2][kBlockN * Shape::kWeightPitch];

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = lane / 4, thread_in_group = lane % 4;
  const int warp_m = warp / 4, warp_n = warp % 4;
  const int64_t m0 = blockIdx.y * static_cast<int64_t>(kBlockM), n0 = blockIdx.x * static_cast<int64_t>(kBlockN);
  const uint8_t* activation = static_cast<const uint8_t*>(p.a);
  const int64_t activation_row_bytes = p.k * ActivationKind::kBytes;

  // Visits this thread's 16-byte pieces of slice `slice`: piece i of the activation tile
  // (tile row (threadIdx.x + i * 256) / pieces-per-row) as activation(i, its row m, its
  // byte offset in that row, its offset in the shared tile), then the weight tile's as
  // weight(i, n, offset, shared offset).
  auto for_each_piece = [&](int64_t slice, auto&& activation_fn, auto&& weight_fn) {
#pragma unroll
    for (int i = 0; i < Shape::kActivationPieces; ++i) {
      const int piece = threadIdx.x + i * kThreads;
      activation_fn(i, m0 + piece / kPiecesPerActivationRow,
                    slice * kSliceElements * ActivationKind::kBytes + (piece % kPiecesPerActivationRow) * 16,
                    (piece / kPiecesPerActivationRow) * Shape::kActivationPitch + (piece % kPiecesPerActivationRow) * 16);
    }
#pragma unroll
    for (int i = 0; i < Shape::kWeightPieces; ++i) {
      const int piece = threadIdx.x + i * kThreads;
      weight_fn(i, n0 + piece / kPiecesPerWeightRow, slice * kSliceElements + (piece % kPiecesPerWeightRow) * 16,
                (piece / kPiecesPerWeightRow) * Shape::kWeightPitch + (piece % kPiecesPerWeightRow) * 16);
    }
  };
  // kAsync: slice -> shared buffer `buffer`, in flight until copies_commit_and_wait
  auto copy_slice = [&](int64_t slice, int buffer) {
    for_each_piece(
        slice,
        [&](int, int64_t m, int64_t offset, int shared_offset) {
          const bool inside = m < p.m && offset < activation_row_bytes;
          copy_async16(&activation_tile[buffer][shared_offset],
                       inside ? activation + m * p.a_row_stride * ActivationKind::kBytes + offset : activation, inside);
        },
        [&](int, int64_t n, int64_t offset, int shared_offset) {
          const bool inside = n < p.n && offset < p.k;
          copy_async16(&weight_tile[buffer][shared_offset], inside ? p.b + n * p.b_col_stride + offset : p.b, inside);
        });
  };
  // !kAsync: global -> registers, then registers -> shared
  uint4 activation_stage[kAsync ? 1 : Shape::kActivationPieces], weight_stage[kAsync ? 1 : Shape::kWeightPieces];
  auto load_stage = [&](int64_t slice) {
    for_each_piece(
        slice,
        [&](int i, int64_t m, int64_t offset, int) {
          activation_stage[i] = m < p.m ? load_row_bytes<false>(activation + m * p.a_row_stride * ActivationKind::kBytes,
                                                                offset, activation_row_bytes, activation_aligned)
                                        : make_uint4(0, 0, 0, 0);
        },
        [&](int i, int64_t n, int64_t offset, int) {
          weight_stage[i] = n < p.n ? load_row_bytes<false>(p.b + n * p.b_col_stride, offset, p.k, weight_aligned)
                                    : make_uint4(0, 0, 0, 0);
        });
  };
  auto store_stage = [&](int64_t slice, int buffer) {
    for_each_piece(
        slice,
        [&](int i, int64_t, int64_t, int shared_offset) {
          *reinterpret_cast<uint4*>(&activation_tile[buffer][shared_offset]) = activation_stage[i];
        },
        [&](int i, int64_t, int64_t, int shared_offset) {
          *reinterpret_cast<uint4*>(&weight_tile[buffer][shared_offset]) = weight_stage[i];
        });
  };
  auto read_slice = [&](auto& slice, const uint8_t* tile_row) {
    constexpr int kBytes = sizeof(slice.word) / 16;
#pragma unroll
    for (int part = 0; part < kBytes; ++part) {
      const uint4 piece = *reinterpret_cast<const uint4*>(tile_row + (16 * thread_in_group * kBytes) + 16 * part);
      slice.word[4 * part + 0] = piece.x;
      slice.word[4 * part + 1] = piece.y;
      slice.word[4 * part + 2] = piece.z;
      slice.word[4 * part + 3] = piece.w;
    }
  };

  float acc[Shape::kWarpTilesM][Shape::kWarpTilesN][4] = {};
  // K-blocked: acc holds the current block of 128 k, total the scaled blocks before it
  float total[Shape::kWarpTilesM][Shape::kWarpTilesN][4] = {};
  // this thread's first row and column of the accumulators (mma.sync's C fragment)
  const int64_t row0 = m0 + warp_m * (kBlockM / 2) + group, col0 = n0 + warp_n * 32 + 2 * thread_in_group;
  constexpr int kSlicesPerBlock = FP8_SCALE_BLOCK / kSliceElements;
  const int64_t slices = ceil_div(p.k, kSliceElements);
  if (slices > 0) {
    if constexpr (kAsync) {
      copy_slice(0, 0);
      copies_commit_and_wait();
    } else {
      load_stage(0);
      store_stage(0, 0);
    }
  }
  __syncthreads();
  for (int64_t slice = 0; slice < slices; ++slice) {
    const int buffer = static_cast<int>(slice & 1);
    const bool has_next = slice + 1 < slices;
    // The other buffer was last read in the previous iteration, before its barrier.
    if (has_next) {
      if constexpr (kAsync) {
        copy_slice(slice + 1, buffer ^ 1);
      } else {
        load_stage(slice + 1);
      }
    }

    // The column operand for the whole slice, then one row tile at a time (a third of the
    // registers that all row tiles' operands take).
    Slice<WeightKind> column_slices[Shape::kWarpTilesN];
#pragma unroll
    for (int j = 0; j < Shape::kWarpTilesN; ++j) {
      read_slice(column_slices[j], &weight_tile[buffer][(warp_n * 32 + 8 * j + group) * Shape::kWeightPitch]);
    }
    const ColumnOperand<ActivationKind, WeightKind, kWiden, Shape::kWarpTilesN> columns(column_slices);
#pragma unroll
    for (int i = 0; i < Shape::kWarpTilesM; ++i) {
      const int row = warp_m * (kBlockM / 2) + 16 * i + group;
      Slice<ActivationKind> lo, hi;
      read_slice(lo, &activation_tile[buffer][row * Shape::kActivationPitch]);
      read_slice(hi, &activation_tile[buffer][(row + 8) * Shape::kActivationPitch]);
      mma_row_tile<ActivationKind, WeightKind, kWiden>(acc[i], lo, hi, columns);
    }
    if constexpr (kBlocked) {
      if (slice % kSlicesPerBlock == kSlicesPerBlock - 1 || !has_next) {
        add_scaled_block(total, acc, p, row0, col0, true, slice / kSlicesPerBlock);
      }
    }

    if (has_next) {
      if constexpr (kAsync) {
        copies_commit_and_wait();
      } else {
        store_stage(slice + 1, buffer ^ 1);
      }
    }
    __syncthreads();
  }

#pragma unroll
  for (int i = 0; i < Shape::kWarpTilesM; ++i) {
#pragma unroll
    for (int j = 0; j < Shape::kWarpTilesN; ++j) {
      const float(&sums)[4] = kBlocked ? total[i][j] : acc[i][j];
      const int64_t m = row0 + 16 * i, n = col0 + 8 * j;
      store_result(p, m, n, sums[0]);
      store_result(p, m, n + 1, sums[1]);
      store_result(p, m + 8, n, sums[2]);
      store_result(p, m + 8, n + 1, sums[3]);
    }
  }
}

template <class ActivationKind, class WeightKind, bool kWiden, bool kBlocked>
const char* launch_with_shape(const fp8_scaled_mm_params* p, cudaStream_t stream) {
  const int64_t activation_bytes = ActivationKind::kBytes;
  const bool activation_aligned = is_aligned(p->a, 16) && (p->a_row_stride * activation_bytes) % 16 == 0 &&
                                  (p->k * activation_bytes) % 16 == 0;
  const bool weight_aligned = is_aligned(p->b, 16) && p->b_col_stride % 16 == 0 && p->k % 16 == 0;
  const int64_t blocks_m = ceil_div(p->m, TileShape<ActivationKind, kBlocked>::kBlockM), blocks_n = ceil_div(p->n, kBlockN);
  if (blocks_m > 65535 || blocks_n > 0x7FFFFFFF) {
    return error_text("fp8linear CUDA: gemm grid too large for M = %lld, N = %lld", static_cast<long long>(p->m),
                      static_cast<long long>(p->n));
  }
  const dim3 grid(static_cast<unsigned>(blocks_n), static_cast<unsigned>(blocks_m));
  if (activation_aligned && weight_aligned) {
    gemm_kernel<ActivationKind, WeightKind, kWiden, kBlocked, true><<<grid, kThreads, 0, stream>>>(*p, true, true);
  } else {
    gemm_kernel<ActivationKind, WeightKind, kWiden, kBlocked, false><<<grid, kThreads, 0, stream>>>(*p, activation_aligned, weight_aligned);
  }
  return check_launch(kWiden ? "gemm_kernel (widening)" : "gemm_kernel (fp8 tensor cores)");
}

template <class ActivationKind, class WeightKind, bool kWiden>
const char* launch_with_kinds(const fp8_scaled_mm_params* p, cudaStream_t stream) {
  return fp8_k_blocked(p) ? launch_with_shape<ActivationKind, WeightKind, kWiden, true>(p, stream)
                          : launch_with_shape<ActivationKind, WeightKind, kWiden, false>(p, stream);
}

template <class WeightKind>
const char* launch_with_weight_kind(const fp8_scaled_mm_params* p, bool widen, cudaStream_t stream) {
  if (p->a_is_float) {
    if (p->a_float_dtype == FP8_BFLOAT16) return launch_with_kinds<KindBF16, WeightKind, true>(p, stream);
    return launch_with_kinds<KindF16, WeightKind, true>(p, stream);
  }
  if (p->a_format == FP8_E4M3FN) {
    return widen ? launch_with_kinds<KindE4M3, WeightKind, true>(p, stream)
                 : launch_with_kinds<KindE4M3, WeightKind, false>(p, stream);
  }
  return widen ? launch_with_kinds<KindE5M2, WeightKind, true>(p, stream)
               : launch_with_kinds<KindE5M2, WeightKind, false>(p, stream);
}

}  // namespace
}  // namespace fp8cuda

const char* fp8_cuda_gemm_launch(const fp8_scaled_mm_params* p, int widen, cudaStream_t stream) {
  using namespace fp8cuda;
  // 16-bit tensor cores only: float32 activations would be rounded (the generic kernel
  // takes them)
  if (p->a_is_float && p->a_float_dtype == FP8_FLOAT32) {
    return "fp8linear CUDA: gemm: float32 activations are not supported (the generic path takes them)";
  }
  return p->b_format == FP8_E4M3FN ? launch_with_weight_kind<KindE4M3>(p, widen != 0, stream)
                                   : launch_with_weight_kind<KindE5M2>(p, widen != 0, stream);
}
