/* The AVX512-BF16 dot kernel (small M, GEMV): weight rows streamed once, each dotted
 * against every activation row, held widened in the workspace (fp8_bf16_prepare), with
 * 16 partial sums per output reduced at the end. gemm_avx512_bf16.c says how the
 * AVX512-BF16 kernels widen fp8 and when each runs. */
#include "cpu_internal.h" /* FP8_X86_KERNELS */
#if FP8_X86_KERNELS /* the whole file: x86-64 only */

#include <string.h>

#include "bf16_widen.h"

/* ---- dot kernel (small M) -------------------------------------------------- */

/* Lane j: the sum of the 16 floats of vectors[j] (16 x 16, 64-byte aligned): a tree of
 * shuffles across and within 128-bit lanes, 45 instructions for the 16 sums, where
 * _mm512_reduce_add_ps takes 8 per sum. With one weight row per call of dot_block (M = 1),
 * that reduction and a scalar store per output took ~40% of the dot kernel at K = 128-576
 * (perf, Intel Xeon with AMX). The operands are loaded in the order (i % 4) * 4 + i / 4,
 * which the last two stages, working within 128-bit lanes, turn back into lane order. */
BF16_TARGET ALWAYS_INLINE __m512 sum16_vectors(const float* vectors) {
  __m512 v[16], u[8], w[4], z[2];
  for (int i = 0; i < 16; ++i) v[i] = _mm512_load_ps(vectors + ((i % 4) * 4 + i / 4) * 16);
  for (int i = 0; i < 8; ++i) /* 128-bit lanes 0, 1: vector 2i's halves added; 2, 3: 2i + 1's */
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 4; ++i) /* 128-bit lane q: four partial sums of vector 4i + q (of v's order) */
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; ++i) z[i] = _mm512_add_ps(_mm512_unpacklo_ps(w[2 * i], w[2 * i + 1]), _mm512_unpackhi_ps(w[2 * i], w[2 * i + 1]));
  return _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_ps(z[0], z[1], _MM_SHUFFLE(3, 2, 3, 2)));
}

/* Outputs (m, n .. n + count) from their sums (count <= 16): scaled (unless a K-blocked
 * call applied the scales per block), biased and rounded once, with one masked store. */
BF16_TARGET ALWAYS_INLINE void store_row16(const fp8_scaled_mm_params* p, int64_t m, int64_t n, int64_t count,
                                           __m512 sums) {
  const __mmask16 mask = count >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << count) - 1u);
  __m512 scale = _mm512_set1_ps(1.0f);
  if (!fp8_k_blocked(p)) {
    scale = _mm512_mul_ps(_mm512_set1_ps(fp8_scale_a(p, m)), load_scale_b16(p, n, mask));
  }
  const __m512 value = _mm512_fmadd_ps(sums, scale, load_bias16(p, n, mask));
  const int64_t at = m * p->out_row_stride + n;
  switch (p->out_dtype) {
    case FP8_BFLOAT16: _mm256_mask_storeu_epi16((uint16_t*)p->out + at, mask, (__m256i)_mm512_cvtneps_pbh(value)); break;
    case FP8_FLOAT16:
      _mm256_mask_storeu_epi16((uint16_t*)p->out + at, mask, _mm512_cvtps_ph(value, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      break;
    default: _mm512_mask_storeu_ps((float*)p->out + at, mask, value); break;
  }
}

/* Every loop over the ROWS x COLS accumulators below is unrolled by this pragma: with
 * some of them left as loops until after GCC's scalar replacement, it kept the acc
 * arrays in memory as well as in registers and stored half the accumulators to the stack
 * in every 64-k step of the dot-product loops (M = 2-4: 6-16 zmm stores per 6-32 dot
 * products), though never read back there (tests/test_codegen.py looks for such stores).
 * scaled_mm, 2 threads, AMD EPYC Zen 5, stores -> none, alternated in one process, 9-11
 * rounds: 4096 x 4096 at M = 4 from cache (four rows by four columns) 1.26-1.27x faster;
 * from memory, M = 2-4 on the Llama-3-8B shapes 0.93-1.08x, and SmolLM2's from cache at
 * M = 1-4 0.89-1.07x (noise both ways): where the weights' bytes or the widening bound
 * the loop, the stores were hidden. */
#define UNROLL4 _Pragma("GCC unroll 4")

/* ROWS activation rows x COLS weight rows, over all of K: ROWS * COLS float32
 * accumulators of 16 partial sums each. At the end each is reduced and stored, or, with
 * `partials` (COLS = 1), left unreduced at partials + r * 256 for the caller to reduce
 * 16 columns at a time (sum16_vectors). */
BF16_TARGET ALWAYS_INLINE void dot_block(const fp8_scaled_mm_params* p, const widen_tables_t* t,
                                         const uint16_t* activations, int64_t k_padded, int64_t m0, int64_t n0,
                                         float* partials, const int ROWS, const int COLS,
                                         const int BLOCKED) {
  /* With few (row, column) pairs, one accumulator each would chain every dot product
   * on the previous one's latency; the two halves of each 64-k step then get their
   * own accumulators (decode, M = 1: one chain of two dot products per 64 bytes
   * capped a thread near 24 GB/s). */
  const int split = !BLOCKED && ROWS * COLS <= 4; /* K-blocked: each block's chain starts from zero */
  __m512 acc[4][4], acc_high[4][4], total[4][4];
  UNROLL4 for (int r = 0; r < ROWS; ++r)
    UNROLL4 for (int c = 0; c < COLS; ++c) acc[r][c] = acc_high[r][c] = total[r][c] = _mm512_setzero_ps();
  const uint8_t* weight_rows[4];
  UNROLL4 for (int c = 0; c < COLS; ++c) weight_rows[c] = (const uint8_t*)p->b + (n0 + c) * p->b_col_stride;
  /* K-blocked scales: scale_a(m0 + r, kb) = *scale_rows[r], scale_b(kb, n0 + c) = *scale_cols[c],
   * the pointers moved on by row_step and col_step per block; each is broadcast from memory
   * at the end of a block and multiplied as a vector (the product of two scalars broadcast
   * from a register takes a shuffle-port uop, the port the widening is bound on). */
  const float* scale_rows[4];
  const float* scale_cols[4];
  const int64_t row_step = fp8_k_block_scale_a_step(p), col_step = fp8_k_block_scale_b_step(p);
  if (BLOCKED) {
    UNROLL4 for (int r = 0; r < ROWS; ++r) scale_rows[r] = fp8_k_block_scale_a_at(p, m0 + r);
    UNROLL4 for (int c = 0; c < COLS; ++c) scale_cols[c] = fp8_k_block_scale_b_at(p, n0 + c);
  }
  const int64_t k = p->k;
  int64_t block_end = k_padded < FP8_SCALE_BLOCK ? k_padded : FP8_SCALE_BLOCK; /* (k_padded: a multiple of 64) */
  for (int64_t k0 = 0; k0 < k_padded; k0 += 64) {
    const __mmask64 mask = tail_mask64(k - k0);
    __m512i w0[4], w1[4];
    UNROLL4 for (int c = 0; c < COLS; ++c) {
      /* Software prefetch, since rows are often exactly one page long and the hardware
       * prefetchers stop at page boundaries (four rows at a time, 14336 x 4096, M = 1:
       * 47% of the read probe without, 81% with). One row at a time reads a single
       * stream: 8 KiB ahead in it; several rows: the same bytes two blocks ahead. A
       * distance of two rows of K = 14336 (28 KiB) ran at half the bandwidth of 8 KiB.
       * One row of one activation row (M = 1, or a last row's leftover columns): 6 KiB
       * ahead with prefetcht2 (into L2; prefetcht1 measured about the same) instead,
       * presumably because a prefetch into L1 holds one of L1's few miss buffers per line
       * all the way from memory.
       * FP8Linear, 2 threads, M = 1, % of the read probe, Intel Xeon with AMX: 4096 x 4096
       * 71 -> 82, 14336 x 4096 84 -> 90, 1536 x 576 90 -> 99; 4096 x 14336 unchanged; at
       * M = 2 it was 5% slower. scaled_mm, AMD EPYC Zen 4, 2 threads, two alternated
       * rounds: 4096 x 14336 69-73 -> 95-100, 14336 x 4096 91-96 -> 106-107, 4096 x 4096
       * 88-93 -> 92-103. (Not measured on a Zen 5, which ran 87-95% with the L1 prefetch.) */
      if (ROWS == 1 && COLS == 1) {
        _mm_prefetch((const char*)(weight_rows[c] + k0 + 6144), _MM_HINT_T2);
      } else {
        const int64_t ahead = COLS == 1 ? k0 + 8192 : 2 * COLS * p->b_col_stride + k0;
        _mm_prefetch((const char*)(weight_rows[c] + ahead), _MM_HINT_T0);
      }
      widen64(t, _mm512_maskz_loadu_epi8(mask, weight_rows[c] + k0), &w0[c], &w1[c]);
    }
    UNROLL4 for (int r = 0; r < ROWS; ++r) {
      const uint16_t* a = activations + (m0 + r) * k_padded + k0;
      const __m512bh a0 = (__m512bh)_mm512_loadu_si512(a), a1 = (__m512bh)_mm512_loadu_si512(a + 32);
      UNROLL4 for (int c = 0; c < COLS; ++c) {
        acc[r][c] = _mm512_dpbf16_ps(acc[r][c], a0, (__m512bh)w0[c]);
        if (split) {
          acc_high[r][c] = _mm512_dpbf16_ps(acc_high[r][c], a1, (__m512bh)w1[c]);
        } else {
          acc[r][c] = _mm512_dpbf16_ps(acc[r][c], a1, (__m512bh)w1[c]);
        }
      }
    }
    /* K-blocked scales: at the end of each block of 128 k (k_padded is a multiple of 64),
     * its sums, scaled, join the totals, lane by lane */
    if (BLOCKED && k0 + 64 == block_end) {
      UNROLL4 for (int r = 0; r < ROWS; ++r) {
        UNROLL4 for (int c = 0; c < COLS; ++c) {
          const __m512 scale = _mm512_mul_ps(broadcast_from_memory(scale_rows[r]), broadcast_from_memory(scale_cols[c]));
          total[r][c] = _mm512_fmadd_ps(acc[r][c], scale, total[r][c]);
          acc[r][c] = _mm512_setzero_ps();
        }
      }
      UNROLL4 for (int r = 0; r < ROWS; ++r) scale_rows[r] += row_step;
      UNROLL4 for (int c = 0; c < COLS; ++c) scale_cols[c] += col_step;
      block_end = k_padded - block_end < FP8_SCALE_BLOCK ? k_padded : block_end + FP8_SCALE_BLOCK;
    }
  }
  UNROLL4 for (int r = 0; r < ROWS; ++r) {
    UNROLL4 for (int c = 0; c < COLS; ++c) {
      const __m512 sums = BLOCKED ? total[r][c] : split ? _mm512_add_ps(acc[r][c], acc_high[r][c]) : acc[r][c];
      if (partials) {
        _mm512_store_ps(partials + r * 256, sums);
      } else {
        fp8_store_dot_sum(p, m0 + r, n0 + c, _mm512_reduce_add_ps(sums));
      }
    }
  }
}

/* Weight rows are the outer loop: each block of them is read from memory once and
 * reused from L1 by every block of up to 4 activation rows, four weight rows at a
 * time. One activation row, or up to 4 whose widened values fit in half of L1
 * (decode), read one weight row at a time instead: one sequential stream per thread
 * runs closer to the memory's bandwidth than four streams a row apart (14336 x 4096,
 * 2 threads, M = 1: 47 vs 34 GB/s; M = 4: 41 vs 36). */
#define DOT_CASE(ROWS, COLS, PARTIALS)                                                          \
  case ROWS:                                                                                    \
    if (blocked) dot_block(p, &t, activations, kp, m0, n, PARTIALS, ROWS, COLS, 1);         \
    else dot_block(p, &t, activations, kp, m0, n, PARTIALS, ROWS, COLS, 0);                 \
    break;
#define DOT_ROW_BLOCKS(COLS, PARTIALS)                                                                       \
  for (int64_t m0 = m_begin; m0 < m_end; m0 += 4) {                                                          \
    switch (m_end - m0 >= 4 ? 4 : (int)(m_end - m0)) {                                                       \
      DOT_CASE(1, COLS, PARTIALS) DOT_CASE(2, COLS, PARTIALS) DOT_CASE(3, COLS, PARTIALS) DOT_CASE(4, COLS, PARTIALS) \
      default: break;                                                                                        \
    }                                                                                                        \
  }

enum { DOT_L1_ACTIVATION_BYTES = 24 * 1024 };

BF16_TARGET void fp8_bf16_dot_compute(const fp8_scaled_mm_params* p, const fp8_cpu_mm_plan* plan,
                                      const uint16_t* activations, int64_t m_begin, int64_t m_end, int64_t n_begin,
                                      int64_t n_end) {
  const widen_tables_t t = load_widen_tables(p->b_format);
  const int64_t kp = plan->k_padded;
  const int blocked = fp8_k_blocked(p);
  int64_t n = n_begin;
  /* 2-4 rows of a long K: their widened activations (2 bytes per k and row) no longer
   * fit in half of L1 and would stream from L2 once per weight row; four weight rows at
   * a time read them a quarter as often (4096 x 14336, M = 2..4, 2 threads: 2.2-2.3 ms
   * -> 1.5-1.6 ms per call). */
  const int64_t rows = m_end - m_begin;
  if (rows > 4 || (rows > 1 && rows * kp * (int64_t)sizeof(uint16_t) > DOT_L1_ACTIVATION_BYTES)) {
    for (; n + 4 <= n_end; n += 4) DOT_ROW_BLOCKS(4, NULL)
  }
  if (rows <= 4) {
    /* one weight row at a time, the sums of 16 of them reduced together (sum16_vectors);
     * partials[r][j]: row m_begin + r, column n + j (past the last column: zeros or an
     * earlier column's, never stored) */
    float partials[4 * 16 * 16] __attribute__((aligned(64)));
    memset(partials, 0, sizeof(partials));
    for (; n < n_end; n += 16) {
      const int64_t count = n_end - n < 16 ? n_end - n : 16;
      const int64_t n_first = n;
      for (int64_t j = 0; j < count; ++j, ++n) DOT_ROW_BLOCKS(1, partials + j * 16)
      n = n_first;
      for (int64_t r = 0; r < rows; ++r) store_row16(p, m_begin + r, n, count, sum16_vectors(partials + r * 256));
    }
  }
  for (; n < n_end; ++n) DOT_ROW_BLOCKS(1, NULL) /* (more than 4 rows: the columns left by 4) */
}

#endif /* FP8_X86_KERNELS */
