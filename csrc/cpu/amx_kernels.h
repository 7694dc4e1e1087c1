/* What the AMX kernels share: gemm_amx.c (the full-K and panel kernels, and the entry
 * that configures the tiles) and gemm_amx_stream.c (the stream kernel, M <= 64). Only
 * those two include this. */
#ifndef FP8LINEAR_AMX_KERNELS_H
#define FP8LINEAR_AMX_KERNELS_H

#include "amx_tiles.h"

/* The address `offset` bytes from `base`, for prefetches, which may point past the
 * weights (the next panel or group of the last one): computed as an integer, since
 * forming such a pointer by pointer arithmetic is undefined in C. */
ALWAYS_INLINE const char* address_at(const void* base, int64_t offset) {
  return (const char*)((uintptr_t)base + (uintptr_t)offset);
}

enum {
  AMX_ROWS = 16,                    /* rows of every tile */
  AMX_K = 32,                       /* k per tile product: 16 pairs of bf16 (64 bytes) per A-tile row */
  AMX_TILE_BF16 = AMX_ROWS * AMX_K  /* bf16 per A tile: 1 KiB */
};

/* ---- block-wise scales ------------------------------------------------------- */

/* K-blocked calls (fp8_k_blocked) sum each block of 128 k in C tiles of its own; this
 * adds one such tile (`tile`: 16 weight rows from n0, a multiple of 16, x 16 activation
 * rows from m0, stored [weight row][activation row]) into the running sums `sums` (same
 * layout) with the block's scales: sums[j][i] (+)= scale_b(kb, n0 + j) * scale_a(m0 + i, kb)
 * * tile[j][i]. The 16 weight rows share one block of 128, so scale_b is one number;
 * scale_a varies along the tile's row (`scale_a`: fp8_block_scale_a16 of m0 and kb, which
 * the kernels build once per panel or call, not per tile). Rows past M get scale 0. */
BF16_TARGET ALWAYS_INLINE void add_scaled_block(const fp8_scaled_mm_params* p, const float* tile, float* sums,
                                                int64_t n0, __m512 scale_a, int64_t kb, int first) {
  const __m512 scale = _mm512_mul_ps(scale_a, _mm512_set1_ps(fp8_block_scale_b(p, n0, kb)));
  for (int j = 0; j < 16; ++j) {
    /* a per-column scale_b (scale_a blocked) differs per weight row */
    const __m512 row_scale =
        p->scale_b_per_col ? _mm512_mul_ps(scale_a, _mm512_set1_ps(fp8_block_scale_b(p, n0 + j, kb))) : scale;
    const __m512 value = _mm512_load_ps(tile + j * 16);
    _mm512_store_ps(sums + j * 16, first ? _mm512_mul_ps(value, row_scale)
                                         : _mm512_fmadd_ps(value, row_scale, _mm512_load_ps(sums + j * 16)));
  }
}

/* The stream kernel (gemm_amx_stream.c), on tiles gemm_amx.c has configured: the real
 * instructions, or the model's. Its scratch: what it uses, before the model. */
int64_t fp8_amx_stream_scratch_bytes(const fp8_cpu_mm_plan* plan);
void fp8_amx_stream_hardware(const fp8_scaled_mm_params* p, const fp8_cpu_mm_plan* plan, const uint32_t* packed,
                             uint8_t* scratch, int64_t m_begin, int64_t m_end, int64_t n_begin, int64_t n_end);
void fp8_amx_stream_emulated(const fp8_scaled_mm_params* p, const fp8_cpu_mm_plan* plan, const uint32_t* packed,
                             uint8_t* scratch, int64_t m_begin, int64_t m_end, int64_t n_begin, int64_t n_end,
                             amx_model* model);

#endif
