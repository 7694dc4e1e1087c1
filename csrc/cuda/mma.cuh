// Tensor-core building blocks shared by gemv.cu and gemm.cu: operand kinds, the
// 16-byte row loader (any alignment, zero past the end of a row), mma.sync wrappers,
// and the warp-level product of one 64-element slice of k.
//
// The k-permutation used throughout: in each 64-element slice of k, the thread with
// threadID_in_group t (lane % 4) holds the 16 consecutive elements [16t, 16t + 16)
// of its rows and columns, one 16-byte load each. An mma's k index need not be the
// memory's k index: a dot product is the same in any order, provided both operands
// use the same mapping. Both take their fragment registers from those 16 elements in
// the same order, so each thread loads whole 16-byte pieces and never shuffles bytes.
#pragma once

#include <stdint.h>

#include <type_traits>

#include "fp8_device.cuh"

namespace fp8cuda {

// What one k-element of an operand is in memory.
struct KindE4M3 {
  static constexpr int kBytes = 1;
  static constexpr fp8_format kFormat = FP8_E4M3FN;
};
struct KindE5M2 {
  static constexpr int kBytes = 1;
  static constexpr fp8_format kFormat = FP8_E5M2;
};
struct KindBF16 {
  static constexpr int kBytes = 2;
};
struct KindF16 {
  static constexpr int kBytes = 2;
};

constexpr int kSliceElements = 64;  // k-elements per slice: 16 per thread of a quad

// A thread's 16 consecutive k-elements of one row: 16 bytes (fp8) or 32 (16-bit).
template <class Kind>
struct Slice {
  uint32_t word[4 * Kind::kBytes];
};

template <class Kind>
__device__ __forceinline__ void clear(Slice<Kind>& slice) {
#pragma unroll
  for (int i = 0; i < 4 * Kind::kBytes; ++i) slice.word[i] = 0;
}

// 16 bytes at row + offset. `aligned`: the row and offset are 16-byte aligned and
// row_bytes is a multiple of 16, so a piece is wholly inside or wholly past the row.
// Otherwise the piece is assembled from the aligned 4-byte words that hold at least
// one byte of the row with funnel shifts, and the bytes at or past row_bytes read as
// zero: the other operand's padding is zero too, but a garbage NaN code times zero
// would still be NaN. The word the last row of a tensor ends in is read whole: up to 3
// bytes past the tensor, which for a tensor of an odd byte count lie past its requested
// size; likewise the word a misaligned first row starts in, up to 3 bytes before it (a
// tensor that starts misaligned is a view into a larger allocation, whose bytes those
// are). The hardware cannot fault on them (an aligned word lies in one page with the
// row's first or last byte, and no other allocation starts inside it), but
// compute-sanitizer's memcheck with PYTORCH_NO_CUDA_MEMORY_CACHING=1 may report them.
// Gathering that word byte by byte (checked on the host against every misalignment)
// made ptxas spill 20-148 bytes in the 8-token GEMV kernels
// (tests/test_cuda_compile.py), so it is left as it is.
template <bool kStream>
__device__ __forceinline__ uint4 load_row_bytes(const uint8_t* row, int64_t offset, int64_t row_bytes, bool aligned) {
  const int64_t valid = row_bytes - offset;
  if (valid <= 0) return make_uint4(0, 0, 0, 0);
  const uint8_t* start = row + offset;
  if (aligned) {
    const uint4* piece = reinterpret_cast<const uint4*>(start);
    return kStream ? __ldcs(piece) : __ldg(piece);
  }
  const int misalignment = static_cast<int>(reinterpret_cast<uintptr_t>(start) & 3u);
  const uint32_t* words = reinterpret_cast<const uint32_t*>(start - misalignment);
  uint32_t w[5];
#pragma unroll
  for (int i = 0; i < 5; ++i) {
    const bool needed = i < 4 || misalignment != 0;
    w[i] = needed && 4 * i - misalignment < valid ? __ldg(words + i) : 0u;
  }
  uint32_t out[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    out[q] = __funnelshift_r(w[q], w[q + 1], 8 * misalignment);
    const int64_t bytes_left = valid - 4 * q;
    if (bytes_left < 4) out[q] &= bytes_left <= 0 ? 0u : (1u << (8 * bytes_left)) - 1u;
  }
  return make_uint4(out[0], out[1], out[2], out[3]);
}

// Elements [element_offset, element_offset + 16) of a row of `row_elements` elements.
template <class Kind, bool kStream>
__device__ __forceinline__ void load_slice(Slice<Kind>& slice, const uint8_t* row, int64_t element_offset,
                                           int64_t row_elements, bool aligned) {
#pragma unroll
  for (int part = 0; part < Kind::kBytes; ++part) {
    const uint4 piece = load_row_bytes<kStream>(row, (element_offset + 8 * part) * Kind::kBytes,
                                                row_elements * Kind::kBytes, aligned);
    slice.word[4 * part + 0] = piece.x;
    slice.word[4 * part + 1] = piece.y;
    slice.word[4 * part + 2] = piece.z;
    slice.word[4 * part + 3] = piece.w;
  }
}

// ---- mma.sync wrappers -------------------------------------------------------
// Fragments (PTX ISA, "Matrix Fragments for mma.m16n8k32 / m16n8k16"): A regs 0 and 2
// hold row groupID, regs 1 and 3 row groupID + 8; B regs hold column groupID; A reg 0
// and B reg 0 cover the same k set, as do A reg 2 and B reg 1. C: c0,c1 row groupID,
// columns 2t, 2t+1; c2,c3 row groupID + 8.
//
// Each wrapper returns a fresh product (C = 0) that the caller adds to float32
// registers. Why not accumulate in the tensor core: the fp8 mma of Ada and Hopper
// carries its C input with 13 mantissa bits (measured by SageAttention and DeepSeek;
// cuBLASLt and DeepGEMM "promote" to float32 every few instructions for the same
// reason), which over K = 4096 costs ~3e-3 relative error; promoting every
// instruction leaves only the instruction's own rounding (float32 outputs still take
// the 16-bit path, see scaled_mm.cu). The extra FADDs are free in the memory-bound
// GEMV. The 16-bit mma accumulates with truncation; it gets the same treatment.

#define FP8LINEAR_MMA_FP8(A_TYPE, B_TYPE)                                                                      \
  asm volatile("mma.sync.aligned.m16n8k32.row.col.f32." A_TYPE "." B_TYPE                                      \
               ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%10,%10,%10};\n"                             \
               : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])                                                \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(0.0f))

// d = a x b for an m16n8k32 tile of fp8 operands.
template <fp8_format kA, fp8_format kB>
__device__ __forceinline__ void mma_fp8(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#if FP8LINEAR_HARDWARE_FP8
  if constexpr (kA == FP8_E4M3FN && kB == FP8_E4M3FN) {
    FP8LINEAR_MMA_FP8("e4m3", "e4m3");
  } else if constexpr (kA == FP8_E4M3FN && kB == FP8_E5M2) {
    FP8LINEAR_MMA_FP8("e4m3", "e5m2");
  } else if constexpr (kA == FP8_E5M2 && kB == FP8_E4M3FN) {
    FP8LINEAR_MMA_FP8("e5m2", "e4m3");
  } else {
    FP8LINEAR_MMA_FP8("e5m2", "e5m2");
  }
#elif defined(FP8LINEAR_CUDA_EMULATION)  // tests/cuda_emulator: the same fragments, on the CPU
  fp8emu::mma(d, a, b, kA == FP8_E4M3FN ? fp8emu::kMmaE4M3 : fp8emu::kMmaE5M2,
              kB == FP8_E4M3FN ? fp8emu::kMmaE4M3 : fp8emu::kMmaE5M2);
#else
  // fp8 tensor cores start at sm_89; the launchers never choose this kernel below it.
  d[0] = d[1] = d[2] = d[3] = 0.0f;
  __trap();
#endif
}

#undef FP8LINEAR_MMA_FP8

// d = a x b for an m16n8k16 tile of float16 or bfloat16 operands.
template <class Compute>
__device__ __forceinline__ void mma_16bit(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same<Compute, KindBF16>::value) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%10,%10,%10};\n"
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(0.0f));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%10,%10,%10};\n"
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(0.0f));
  }
#elif defined(FP8LINEAR_CUDA_EMULATION)
  const fp8emu::MmaType type = std::is_same<Compute, KindBF16>::value ? fp8emu::kMmaBF16 : fp8emu::kMmaF16;
  fp8emu::mma(d, a, b, type, type);
#else
  // bf16/f16 mma.sync m16n8k16 starts at sm_80; the launchers route older GPUs elsewhere.
  d[0] = d[1] = d[2] = d[3] = 0.0f;
  __trap();
#endif
}

__device__ __forceinline__ void add_product(float (&acc)[4], const float (&product)[4]) {
#pragma unroll
  for (int r = 0; r < 4; ++r) acc[r] += product[r];
}

// The 16-bit type fp8 operands are widened to: bfloat16 when the other operand is
// bfloat16 (weight-only with bfloat16 activations), float16 otherwise. Both hold every
// fp8 value exactly, so the products stay exact and the sums float32.
template <class RowKind, class ColumnKind>
using WidenedKind = typename std::conditional<std::is_same<RowKind, KindBF16>::value ||
                                                  std::is_same<ColumnKind, KindBF16>::value,
                                              KindBF16, KindF16>::type;

// Elements 2p and 2p + 1 of a slice as a packed pair of Compute values.
template <class Compute, class Kind>
__device__ __forceinline__ uint32_t pair_as(const Slice<Kind>& slice, int p) {
  if constexpr (Kind::kBytes == 2) {
    static_assert(std::is_same<Kind, Compute>::value, "16-bit operands are used as they are");
    return slice.word[p];
  } else {
    const uint32_t codes = slice.word[p / 2] >> (16 * (p % 2));
    if constexpr (std::is_same<Compute, KindBF16>::value) {
      return widen_fp8x2_to_bf16x2<Kind::kFormat>(codes);
    } else {
      return widen_fp8x2_to_f16x2<Kind::kFormat>(codes);
    }
  }
}

// One k step of a 64-element slice for one row tile: acc[j] += rows x columns(8j..).
// `lo` / `hi` are this thread's elements of the tile's rows groupID and groupID + 8.
// The fp8 mma (sm_89+, !kWiden) takes two k32 steps, step s bytes [8s, 8s + 8) of each
// thread's 16, from the column slices as loaded; the 16-bit mma (kWiden: both operands
// widened, sm_80+) four k16 steps, step s elements [4s, 4s + 4) as pairs 2s and 2s + 1,
// from the columns' pairs widened for that step (widen_columns).
template <class RowKind, class ColumnKind, int kColumnTiles>
__device__ __forceinline__ void mma_fp8_step(float (&acc)[kColumnTiles][4], const Slice<RowKind>& lo,
                                             const Slice<RowKind>& hi, const Slice<ColumnKind> (&column)[kColumnTiles],
                                             int s) {
  static_assert(RowKind::kBytes == 1 && ColumnKind::kBytes == 1, "the fp8 mma takes fp8 operands");
  const uint32_t a[4] = {lo.word[2 * s], hi.word[2 * s], lo.word[2 * s + 1], hi.word[2 * s + 1]};
#pragma unroll
  for (int j = 0; j < kColumnTiles; ++j) {
    const uint32_t b[2] = {column[j].word[2 * s], column[j].word[2 * s + 1]};
    float product[4];
    mma_fp8<RowKind::kFormat, ColumnKind::kFormat>(product, a, b);
    add_product(acc[j], product);
  }
}

template <class RowKind, class ColumnKind, int kColumnTiles>
__device__ __forceinline__ void widen_columns(uint32_t (&b)[kColumnTiles][2], const Slice<ColumnKind> (&column)[kColumnTiles],
                                              int s) {
  using Compute = WidenedKind<RowKind, ColumnKind>;
#pragma unroll
  for (int j = 0; j < kColumnTiles; ++j) {
    b[j][0] = pair_as<Compute>(column[j], 2 * s);
    b[j][1] = pair_as<Compute>(column[j], 2 * s + 1);
  }
}

template <class RowKind, class ColumnKind, int kColumnTiles>
__device__ __forceinline__ void mma_16bit_step(float (&acc)[kColumnTiles][4], const Slice<RowKind>& lo,
                                               const Slice<RowKind>& hi, const uint32_t (&b)[kColumnTiles][2], int s) {
  using Compute = WidenedKind<RowKind, ColumnKind>;
  const uint32_t a[4] = {pair_as<Compute>(lo, 2 * s), pair_as<Compute>(hi, 2 * s), pair_as<Compute>(lo, 2 * s + 1),
                         pair_as<Compute>(hi, 2 * s + 1)};
#pragma unroll
  for (int j = 0; j < kColumnTiles; ++j) {
    float product[4];
    mma_16bit<Compute>(product, a, b[j]);
    add_product(acc[j], product);
  }
}

// acc[i][j] += rows(16i.., k slice) x columns(8j.., k slice) for one 64-element slice of
// k: `lo[i]` / `hi[i]` are this thread's elements of row-tile i's rows groupID and
// groupID + 8, `column[j]` of column-tile j's column groupID. kWiden: both operands
// through 16-bit mma (sm_80+); otherwise both are fp8 and use the fp8 mma (sm_89+).
// Step by step over all row tiles: each column is widened once per step, not once per
// row tile it meets.
template <class RowKind, class ColumnKind, bool kWiden, int kRowTiles, int kColumnTiles>
__device__ __forceinline__ void mma_slice(float (&acc)[kRowTiles][kColumnTiles][4], const Slice<RowKind> (&lo)[kRowTiles],
                                          const Slice<RowKind> (&hi)[kRowTiles],
                                          const Slice<ColumnKind> (&column)[kColumnTiles]) {
#pragma unroll
  for (int s = 0; s < (kWiden ? 4 : 2); ++s) {
    if constexpr (kWiden) {
      uint32_t b[kColumnTiles][2];
      widen_columns<RowKind>(b, column, s);
#pragma unroll
      for (int i = 0; i < kRowTiles; ++i) mma_16bit_step<RowKind, ColumnKind>(acc[i], lo[i], hi[i], b, s);
    } else {
#pragma unroll
      for (int i = 0; i < kRowTiles; ++i) mma_fp8_step(acc[i], lo[i], hi[i], column, s);
    }
  }
}

// The column operand of one slice for row tiles taken one at a time (mma_row_tile): a
// GEMM's warp then holds one row tile's operands at once, not all of them (4 row tiles
// x 2 rows x 4 registers: a third of its registers besides the sums). The fp8 mma takes
// the slices as loaded; kWiden keeps every step's widened pairs, widened once here.
template <class RowKind, class ColumnKind, bool kWiden, int kColumnTiles>
struct ColumnOperand {
  const Slice<ColumnKind> (&slice)[kColumnTiles];
  __device__ __forceinline__ explicit ColumnOperand(const Slice<ColumnKind> (&column)[kColumnTiles]) : slice(column) {}
};

template <class RowKind, class ColumnKind, int kColumnTiles>
struct ColumnOperand<RowKind, ColumnKind, true, kColumnTiles> {
  uint32_t pair[4][kColumnTiles][2];  // [k16 step][column tile][mma B register]
  __device__ __forceinline__ explicit ColumnOperand(const Slice<ColumnKind> (&column)[kColumnTiles]) {
#pragma unroll
    for (int s = 0; s < 4; ++s) widen_columns<RowKind>(pair[s], column, s);
  }
};

// mma_slice's products for one row tile, added to each acc[j] in the same order (k
// step by k step), so that taking the row tiles one at a time changes no bit.
template <class RowKind, class ColumnKind, bool kWiden, int kColumnTiles>
__device__ __forceinline__ void mma_row_tile(float (&acc)[kColumnTiles][4], const Slice<RowKind>& lo,
                                             const Slice<RowKind>& hi,
                                             const ColumnOperand<RowKind, ColumnKind, kWiden, kColumnTiles>& columns) {
#pragma unroll
  for (int s = 0; s < (kWiden ? 4 : 2); ++s) {
    if constexpr (kWiden) {
      mma_16bit_step<RowKind, ColumnKind>(acc, lo, hi, columns.pair[s], s);
    } else {
      mma_fp8_step(acc, lo, hi, columns.slice, s);
    }
  }
}

// A K-blocked tile product's end of a block of 128 k (the tensor-core kernels): the
// float32 sums of that block, `block`, join `total` scaled by scale_a(m, kb) *
// scale_b(kb, n), and `block` is cleared. One m16 x n8 accumulator of mma.sync per
// [i][j], as this thread holds it: elements 0, 1 at row row0 + 16 i, columns col0 + 8 j
// and + 1; elements 2, 3 at row + 8. Rows and columns past their ends get scale 0 (their
// results are not stored). rows_are_a: rows index a (M) and columns b (N), as in the
// GEMM; otherwise swapped (the GEMV's out^T = W a^T).
template <int kRowTiles, int kColumnTiles>
__device__ __forceinline__ void add_scaled_block(float (&total)[kRowTiles][kColumnTiles][4],
                                                 float (&block)[kRowTiles][kColumnTiles][4], const fp8_scaled_mm_params& p,
                                                 int64_t row0, int64_t col0, bool rows_are_a, int64_t kb) {
  float row_scale[kRowTiles][2], col_scale[kColumnTiles][2];
#pragma unroll
  for (int i = 0; i < kRowTiles; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t r = row0 + 16 * i + 8 * h;
      row_scale[i][h] = rows_are_a ? (r < p.m ? fp8_k_block_scale_a(&p, r, kb) : 0.0f)
                                   : (r < p.n ? fp8_k_block_scale_b(&p, r, kb) : 0.0f);
    }
  }
#pragma unroll
  for (int j = 0; j < kColumnTiles; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t c = col0 + 8 * j + h;
      col_scale[j][h] = rows_are_a ? (c < p.n ? fp8_k_block_scale_b(&p, c, kb) : 0.0f)
                                   : (c < p.m ? fp8_k_block_scale_a(&p, c, kb) : 0.0f);
    }
  }
#pragma unroll
  for (int i = 0; i < kRowTiles; ++i) {
#pragma unroll
    for (int j = 0; j < kColumnTiles; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float a_scale = rows_are_a ? row_scale[i][e / 2] : col_scale[j][e % 2];
        const float b_scale = rows_are_a ? col_scale[j][e % 2] : row_scale[i][e / 2];
        total[i][j][e] = fmaf(a_scale * b_scale, block[i][j][e], total[i][j][e]);  // as fp8_k_block_scale(...) * sum
        block[i][j][e] = 0.0f;
      }
    }
  }
}

// out[m, n] = acc * scale_a[m] * scale_b[n] + bias[n], rounded once to the output dtype.
__device__ __forceinline__ void store_result(const fp8_scaled_mm_params& p, int64_t m, int64_t n, float acc) {
  if (m >= p.m || n >= p.n) return;
  // K-blocked calls come with the scales applied per block of 128 k
  const bool blocked = fp8_k_blocked(&p);
  const float scale = blocked ? 1.0f : fp8_scale_a(&p, m) * fp8_scale_b(&p, n);
  // K = 0 (the generic kernel takes it): an empty sum, so exactly the bias, whatever the
  // scales (0 * inf is NaN)
  float value = p.k == 0 ? 0.0f : acc * scale;
  if (p.bias != nullptr) value += load_float(p.bias, p.bias_dtype, n);
  store_float(p.out, p.out_dtype, m * p.out_row_stride + n, value);
}

}  // namespace fp8cuda
