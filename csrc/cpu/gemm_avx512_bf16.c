/* scaled_mm with AVX512-BF16 dot products (+ AVX512-VBMI byte permutes).
 *
 * Every e4m3/e5m2 value is exact in bf16 and vdpbf16ps multiplies bf16 pairs
 * exactly into float32 sums, so widening fp8 -> bf16 in registers gives the
 * same products an FP8 tensor core would, at half the weight bytes of bf16.
 *
 * Widening (bf16_widen.h): two byte-table lookups per 64 fp8 codes, in an
 * "interleave order" that activations share.
 *
 * Weights are read in their canonical layout (b = w.t(): each output column is a
 * contiguous row of K bytes), so no persistent prepacked copy is needed:
 * - dot kernel (M <= 4, GEMV; in gemm_avx512_bf16_dot.c): stream weight rows once,
 *   dot them against every activation row held widened in a workspace, reduce each
 *   sum at the end;
 * - tile kernel (large M, GEMM): widen a panel of weight rows into an L1/L2-sized
 *   buffer and reuse it for a chunk of up to 192 rows (widened again per chunk,
 *   1/192 of the work or less); activations are packed so that one
 *   vector holds 16 rows' (k, k+1) pair and weight pairs are broadcast; also M = 57-64
 *   (64 padded rows) where its 64-column tiles share out evenly among the threads
 *   (plan.skinny; M = 49-56 runs as 48 rows and the last ones apart);
 * - skinny kernel (9 <= M <= 64; in gemm_avx512_bf16_skinny.c): the tile kernel's data
 *   layout for one group of 16 rows at a time (3-4 groups: all of them per step of K,
 *   against one widening), with the widening of the next small panel interleaved with
 *   the dot products of the current one;
 * - eight-row kernel (5 <= M <= 8; gemm_avx512_bf16_skinny.c too): the skinny kernel's
 *   loop over 8 rows packed two k-pairs to a lane pair, so that (at M = 8) no lane works
 *   on a padding row.
 * On this Zen 5 the widening shuffles and the dot products compete for the same
 * vector pipes (widen64 alone: ~2.7 cycles; in a phase of its own beside the dot
 * products it adds as much), so the kernels are shaped to widen each weight as few
 * times as possible and never in long runs of their own.
 */
#include "cpu_internal.h" /* FP8_X86_KERNELS */
#if FP8_X86_KERNELS /* the whole file: x86-64 only */

#include <stdlib.h>
#include <string.h>

#include "bf16_widen.h"

/* [format][0 = high byte, 1 = low byte][magnitude]: the bf16 bits of each code. */
uint8_t fp8_bf16_widen_tables[2][2][128] __attribute__((aligned(64)));
static int widen_tables_ready = 0;

void fp8_bf16_build_widen_tables(void) {
  if (__atomic_load_n(&widen_tables_ready, __ATOMIC_ACQUIRE)) return;
  for (int format = 0; format < 2; ++format) {
    for (int magnitude = 0; magnitude < 128; ++magnitude) {
      const uint16_t bits = fp8_float_to_bf16(fp8_to_float((uint8_t)magnitude, (fp8_format)format));
      fp8_bf16_widen_tables[format][0][magnitude] = (uint8_t)(bits >> 8);
      fp8_bf16_widen_tables[format][1][magnitude] = (uint8_t)(bits & 0xFF);
    }
  }
  __atomic_store_n(&widen_tables_ready, 1, __ATOMIC_RELEASE);
}

/* ---- activations: widened rows ------------------------------------------- */

/* Row m of a, widened into `out` (k_padded bf16, zero beyond K, interleave order). */
BF16_TARGET static void widen_activation_row(const fp8_scaled_mm_params* p, const widen_tables_t* t, int64_t m,
                                             int64_t k_padded, uint16_t* out) {
  const int64_t k = p->k;
  for (int64_t k0 = 0; k0 < k_padded; k0 += 64) {
    const int64_t count = k - k0 < 0 ? 0 : k - k0;
    __m512i out0, out1;
    if (p->a_is_float && p->a_col_stride == 1) { /* bf16 activations (weight-only): exact, only reordered */
      /* (element by element, this loop took 40% more time than the whole fp8 layer: 576 x 576,
       * M = 2048, AMX, one core) */
      const uint16_t* row = (const uint16_t*)p->a + m * p->a_row_stride + k0;
      const __m512i low = _mm512_maskz_loadu_epi16(count >= 32 ? ~(__mmask32)0 : (__mmask32)((1u << count) - 1u), row);
      const __m512i high = count <= 32 ? _mm512_setzero_si512()
                           : _mm512_maskz_loadu_epi16(count >= 64 ? ~(__mmask32)0 : (__mmask32)((1u << (count - 32)) - 1u),
                                                      row + 32);
      permute64_bf16(low, high, &out0, &out1);
    } else if (p->a_is_float) {
      const uint16_t* row = (const uint16_t*)p->a + m * p->a_row_stride;
      uint16_t chunk[64] __attribute__((aligned(64)));
      for (int i = 0; i < 64; ++i) chunk[i] = i < count ? row[(k0 + i) * p->a_col_stride] : 0;
      permute64_bf16(_mm512_load_si512(chunk), _mm512_load_si512(chunk + 32), &out0, &out1);
    } else {
      if (p->a_col_stride == 1) {
        const uint8_t* row = (const uint8_t*)p->a + m * p->a_row_stride + k0;
        widen64(t, _mm512_maskz_loadu_epi8(tail_mask64(count), row), &out0, &out1);
      } else {
        const uint8_t* row = (const uint8_t*)p->a + m * p->a_row_stride;
        uint8_t chunk[64] __attribute__((aligned(64)));
        for (int i = 0; i < 64; ++i) chunk[i] = i < count ? row[(k0 + i) * p->a_col_stride] : 0;
        widen64(t, _mm512_load_si512(chunk), &out0, &out1);
      }
      /* power-of-two block scales folded into the values (k0: a multiple of 64, so all 64 in one block) */
      if (p->fold_a) fold64(p->fold_a[m * p->fold_k_blocks + k0 / FP8_SCALE_BLOCK], &out0, &out1);
    }
    _mm512_storeu_si512(out + k0, out0);
    _mm512_storeu_si512(out + k0 + 32, out1);
  }
}

BF16_TARGET void fp8_bf16_widen_activation_rows(const fp8_scaled_mm_params* p, int64_t m_begin, int64_t m_end,
                                                int64_t k_padded, uint16_t* out) {
  fp8_bf16_build_widen_tables();
  const widen_tables_t t = load_widen_tables(p->a_format);
  for (int64_t m = m_begin; m < m_end; ++m) widen_activation_row(p, &t, m, k_padded, out + (m - m_begin) * k_padded);
}

/* ---- tile kernel (large M) ------------------------------------------------- */

enum {
  TILE_VECTORS = 4,       /* activation vectors per register tile, at most: 64 rows (usually 3: 48 rows) */
  TILE_PANEL_COLS = 64,   /* weight rows widened together (a multiple of 16) */
  TILE_WHOLE_K_MAX = 2048, /* up to this K (padded) a panel holds all of K: 64 x 2048 bf16 = 256 KiB */
  TILE_K_BLOCK = 256,     /* K per pass beyond it: the widened panel is 64 x 256 bf16 = 32 KiB */
  TILE_FEW_ROWS = 64,     /* calls of up to this many rows take ... */
  TILE_K_BLOCK_FEW_ROWS = 128, /* ... panels of 128 k beyond TILE_WHOLE_K_MAX (16 KiB) */
  TILE_ROW_CHUNK = 192,   /* at most this many activation rows per sweep over the weights */
};

/* K per panel of the tile kernel: all of K up to TILE_WHOLE_K_MAX, in one pass whose
 * register tiles store their sums once for all of K instead of once per 256 k; 256
 * beyond. scaled_mm on quantized inputs, AMD EPYC Zen 4, 2 threads, 256-k panels ->
 * whole K, medians of 4-6 rounds alternated in one process (bit-identical results):
 * 576 x 576 M = 256 1.03x faster, M = 512 1.05x; 1536 x 576 and 576 x 1536 M = 256 1.03x;
 * 1024 x 1024 1.05x; 2048 x 2048 M = 256 1.03x, M = 1024 1.04x, M = 2048 1.08x; M = 80 and
 * 128 1.03-1.06x; one thread 1.03x; block-wise float and ue8m0 1.01-1.04x. For K of 2560-
 * 4096 whole-K panels (up to 512 KiB) gained 0.7-1.7%, and 2048-k panels at K = 4096 or
 * 14336 nothing, so larger K keep 256 (32 KiB of L1).
 *
 * With at most 64 rows (M = 57-64, and 64-row shares of a call) those take 128 k: a
 * 256-k panel (32 KiB) and the 64 rows' activations for it (32 KiB) overflowed the 48 KiB
 * L1 of an AMD Zen 5 every panel, and the panel's widening then waited on its loads for
 * ~17% of the call (perf: most of its samples just after the load of the codes, however
 * far ahead the panel had been prefetched into L2 or L1); at 128 k the two take 32 KiB.
 * The sums are loaded and stored twice as often (24 of each per 64 k-pairs, ~3% more
 * operations). FP8Linear, 2 threads, AMD EPYC Zen 5, M = 64, 7 alternated rounds: weights
 * in cache, 4096 x 4096 1.06x faster, 14336 x 4096 1.08x, 4096 x 14336 1.02-1.10x;
 * weights cycled from memory 1.11x, 1.07x and 1.11x. At M = 80-112 it measured 0.96-1.06x
 * and at 128-2048 rows 0.94-1.03x, so those keep 256; whole-K panels stay whole (K <=
 * 2048 in 128-k or 256-k panels at M = 64: 0.90-0.99x on SmolLM2's shapes and 2048 x 2048). */
static int64_t tile_panel_k(int64_t k_padded, int64_t rows) {
  return k_padded <= TILE_WHOLE_K_MAX ? k_padded : rows <= TILE_FEW_ROWS ? TILE_K_BLOCK_FEW_ROWS : TILE_K_BLOCK;
}

/* A panel buffer: large enough for any number of rows. */
static int64_t tile_panel_bytes(int64_t k_padded) {
  return TILE_PANEL_COLS * tile_panel_k(k_padded, TILE_FEW_ROWS + 1) * (int64_t)sizeof(uint16_t);
}

/* Workspace layout of the tile kernels: activations packed by groups of 16 rows,
 * [m_padded / 16][k_padded / 2][16 rows][2 values]: one vector = 16 rows' pair.
 * The 16 rows are widened into `rows` (16 x k_padded bf16), then turned into that
 * layout 16 x 16 pairs at a time by a transpose in registers (one scalar store per
 * pair took 8% of a 576 x 1536 layer's time at M = 2048). */
BF16_TARGET static void pack_activation_group(const fp8_scaled_mm_params* p, const widen_tables_t* t, int64_t group,
                                              int64_t k_padded, uint32_t* packed, uint16_t* rows) {
  uint32_t* dest = packed + group * (k_padded / 2) * TILE_LANES;
  /* rows past M are zero lanes of the transpose, not zeroed memory (M = 1 with AMX: one
   * row of a group of 16) */
  const int64_t lanes = p->m - group * TILE_LANES < TILE_LANES ? p->m - group * TILE_LANES : TILE_LANES;
  for (int lane = 0; lane < lanes; ++lane)
    widen_activation_row(p, t, group * TILE_LANES + lane, k_padded, rows + lane * k_padded);
  for (int64_t pair0 = 0; pair0 < k_padded / 2; pair0 += TILE_LANES) { /* k_padded: a multiple of 64 */
    __m512 block[TILE_LANES];
    for (int lane = 0; lane < TILE_LANES; ++lane)
      block[lane] = lane < lanes ? _mm512_castsi512_ps(_mm512_load_si512(rows + lane * k_padded + 2 * pair0))
                                 : _mm512_setzero_ps();
    transpose16(block);
    for (int j = 0; j < TILE_LANES; ++j) _mm512_store_ps((float*)(dest + (pair0 + j) * TILE_LANES), block[j]);
  }
}

/* Up to 8 activation rows (M = 5-8, the eight-row kernel) packed as
 * [k_padded / 4][8 rows][2 pairs]: one vector holds each row's k-pairs 2q and 2q + 1,
 * so that a broadcast 64-bit weight pair of pairs fills all 16 lanes. The rows are
 * widened into `rows` (8 x k_padded bf16) and turned into that layout 8 x 8 64-bit
 * pieces at a time by a transpose in registers. */
BF16_TARGET static void pack_activation_rows8(const fp8_scaled_mm_params* p, const widen_tables_t* t,
                                              int64_t k_padded, uint32_t* packed, uint16_t* rows) {
  const int64_t lanes = p->m < 8 ? p->m : 8;
  for (int lane = 0; lane < lanes; ++lane) widen_activation_row(p, t, lane, k_padded, rows + lane * k_padded);
  for (int64_t k0 = 0; k0 < k_padded; k0 += 32) { /* 32 bf16 of each row: 8 pieces of two pairs */
    __m512i r[8], lo[4], hi[4];
    for (int lane = 0; lane < 8; ++lane)
      r[lane] = lane < lanes ? _mm512_load_si512(rows + lane * k_padded + k0) : _mm512_setzero_si512();
    for (int i = 0; i < 4; ++i) { /* 128-bit lane L: rows 2i, 2i + 1 at piece 2L (lo), 2L + 1 (hi) */
      lo[i] = _mm512_unpacklo_epi64(r[2 * i], r[2 * i + 1]);
      hi[i] = _mm512_unpackhi_epi64(r[2 * i], r[2 * i + 1]);
    }
    __m512i* const halves[2] = {lo, hi};
    uint32_t* dest = packed + (k0 / 4) * 16;
    for (int h = 0; h < 2; ++h) { /* h = 0: pieces 0, 2, 4, 6; 1: 1, 3, 5, 7 */
      const __m512i* v = halves[h];
      const __m512i even01 = _mm512_shuffle_i64x2(v[0], v[1], 0x88), odd01 = _mm512_shuffle_i64x2(v[0], v[1], 0xDD);
      const __m512i even23 = _mm512_shuffle_i64x2(v[2], v[3], 0x88), odd23 = _mm512_shuffle_i64x2(v[2], v[3], 0xDD);
      _mm512_store_si512(dest + (h + 0) * 16, _mm512_shuffle_i64x2(even01, even23, 0x88));
      _mm512_store_si512(dest + (h + 4) * 16, _mm512_shuffle_i64x2(even01, even23, 0xDD));
      _mm512_store_si512(dest + (h + 2) * 16, _mm512_shuffle_i64x2(odd01, odd23, 0x88));
      _mm512_store_si512(dest + (h + 6) * 16, _mm512_shuffle_i64x2(odd01, odd23, 0xDD));
    }
  }
}

/* One register tile: VECTORS x 16 activation rows by TILE_COLS weight rows over
 * `pairs` k-pairs. Per pair: VECTORS vector loads, TILE_COLS broadcasts,
 * VECTORS * TILE_COLS dot products (24 with 3 vectors: 11 loads per 24). */
BF16_TARGET ALWAYS_INLINE void tile_block(const uint32_t* activations, int64_t group_stride, const uint32_t* panel,
                                          int64_t panel_stride, int64_t pairs, float* sums, int64_t sums_stride,
                                          int first, const fp8_scaled_mm_params* p, const __m512* scale_rows,
                                          int64_t n_first, int64_t kb, const int VECTORS, const int COLS,
                                          const int BLOCKED) {
  /* K-blocked calls: the pairs are one block of 128 k (or its end), summed from zero and
   * added into the sums with its scales (scale_rows[v]: scale_a of vector v's 16 rows in
   * block kb) */
  __m512 acc[TILE_VECTORS][16];
  for (int v = 0; v < VECTORS; ++v)
    for (int j = 0; j < COLS; ++j)
      acc[v][j] = first || BLOCKED ? _mm512_setzero_ps() : _mm512_loadu_ps(sums + j * sums_stride + v * TILE_LANES);
  for (int64_t pair = 0; pair < pairs; ++pair) {
    __m512bh a[TILE_VECTORS];
    for (int v = 0; v < VECTORS; ++v)
      a[v] = (__m512bh)_mm512_loadu_si512(activations + v * group_stride + pair * TILE_LANES);
    for (int j = 0; j < COLS; ++j) {
      const __m512bh b = (__m512bh)_mm512_set1_epi32((int)panel[j * panel_stride + pair]);
      for (int v = 0; v < VECTORS; ++v) acc[v][j] = _mm512_dpbf16_ps(acc[v][j], a[v], b);
    }
  }
  if (BLOCKED) {
    /* every scale read before the first store (the build's -fno-strict-aliasing lets a
     * store through `sums` alias them), and `first` decided once: per element, the
     * select and the scale reloads made the compiler spill all 24 accumulators to the
     * stack and read them back */
    float scale_b[16];
    for (int j = 0; j < COLS; ++j) scale_b[j] = fp8_block_scale_b(p, n_first + j, kb);
    __m512 scale_a[TILE_VECTORS];
    for (int v = 0; v < VECTORS; ++v) scale_a[v] = scale_rows[v];
    if (first) {
      for (int j = 0; j < COLS; ++j)
        for (int v = 0; v < VECTORS; ++v)
          _mm512_storeu_ps(sums + j * sums_stride + v * TILE_LANES,
                           _mm512_mul_ps(acc[v][j], _mm512_mul_ps(scale_a[v], _mm512_set1_ps(scale_b[j]))));
    } else {
      for (int j = 0; j < COLS; ++j)
        for (int v = 0; v < VECTORS; ++v) {
          float* at = sums + j * sums_stride + v * TILE_LANES;
          _mm512_storeu_ps(at, _mm512_fmadd_ps(acc[v][j], _mm512_mul_ps(scale_a[v], _mm512_set1_ps(scale_b[j])),
                                               _mm512_loadu_ps(at)));
        }
    }
    return;
  }
  for (int v = 0; v < VECTORS; ++v)
    for (int j = 0; j < COLS; ++j) _mm512_storeu_ps(sums + j * sums_stride + v * TILE_LANES, acc[v][j]);
}

/* 16 weight rows (panel rows b, `panel_pairs` apart) against VECTORS groups of 16
 * activation rows: as 2 x 8 columns for 2 or 3 vectors (up to 24 accumulators), as 6 + 6
 * + 4 columns for 4 (24, 24 and 16), at once for 1. */
BF16_TARGET ALWAYS_INLINE void tile_columns16(const uint32_t* a, int64_t group_stride, const uint32_t* b,
                                              int64_t panel_pairs, int pairs, float* sums, int64_t rows, int first,
                                              const fp8_scaled_mm_params* p, const __m512* scales, int64_t n_first,
                                              int64_t kb, const int VECTORS, const int BLOCKED) {
  if (VECTORS == 1) {
    tile_block(a, group_stride, b, panel_pairs, pairs, sums, rows, first, p, scales, n_first, kb, 1, 16, BLOCKED);
    return;
  }
  if (VECTORS == 4) {
    tile_block(a, group_stride, b, panel_pairs, pairs, sums, rows, first, p, scales, n_first, kb, 4, 6, BLOCKED);
    tile_block(a, group_stride, b + 6 * panel_pairs, panel_pairs, pairs, sums + 6 * rows, rows, first, p, scales,
               n_first + 6, kb, 4, 6, BLOCKED);
    tile_block(a, group_stride, b + 12 * panel_pairs, panel_pairs, pairs, sums + 12 * rows, rows, first, p, scales,
               n_first + 12, kb, 4, 4, BLOCKED);
    return;
  }
  tile_block(a, group_stride, b, panel_pairs, pairs, sums, rows, first, p, scales, n_first, kb, VECTORS, 8, BLOCKED);
  tile_block(a, group_stride, b + 8 * panel_pairs, panel_pairs, pairs, sums + 8 * rows, rows, first, p, scales,
             n_first + 8, kb, VECTORS, 8, BLOCKED);
}

/* The register tiles of `vectors` groups of 16 rows (packed activations at `activations`)
 * against the panel's `cols` weight rows, over its k_block / 2 k-pairs, 16 columns at a
 * time (tile_columns16). Compiled once per
 * BLOCKED, as the skinny kernel's step loop (a K-blocked branch inside it can cost the
 * accumulators their registers). */
BF16_TARGET ALWAYS_INLINE void tile_row_tiles(const uint32_t* activations, int64_t group_stride, const uint16_t* panel,
                                              int64_t k_block, int64_t cols, float* sums, int64_t rows, int first,
                                              const fp8_scaled_mm_params* p, const __m512* scale_rows, int64_t n0,
                                              int64_t kb, int vectors, const int BLOCKED) {
  const int64_t panel_pairs = k_block / 2;
  /* K-blocked: each block of 128 k of the panel summed on its own (scale_rows: TILE_VECTORS
   * per block) */
  const int64_t step_pairs = BLOCKED ? FP8_SCALE_BLOCK / 2 : panel_pairs;
  for (int64_t c0 = 0; c0 < cols; c0 += 16) {
    const uint32_t* panel_cols = (const uint32_t*)(panel + c0 * k_block);
    float* tile_sums = sums + c0 * rows;
    const int64_t n_first = n0 + c0;
    for (int64_t pair0 = 0; pair0 < panel_pairs; pair0 += step_pairs) {
      const int pairs = (int)(panel_pairs - pair0 < step_pairs ? panel_pairs - pair0 : step_pairs);
      const uint32_t* a = activations + pair0 * TILE_LANES;
      const uint32_t* b = panel_cols + pair0;
      const int first_step = first && pair0 == 0;
      const int64_t step_kb = kb + pair0 / (FP8_SCALE_BLOCK / 2);
      const __m512* scales = BLOCKED ? scale_rows + (pair0 / (FP8_SCALE_BLOCK / 2)) * TILE_VECTORS : NULL;
      switch (vectors) {
        case 4:
          tile_columns16(a, group_stride, b, panel_pairs, pairs, tile_sums, rows, first_step, p, scales, n_first,
                         step_kb, 4, BLOCKED);
          break;
        case 3:
          tile_columns16(a, group_stride, b, panel_pairs, pairs, tile_sums, rows, first_step, p, scales, n_first,
                         step_kb, 3, BLOCKED);
          break;
        case 2:
          tile_columns16(a, group_stride, b, panel_pairs, pairs, tile_sums, rows, first_step, p, scales, n_first,
                         step_kb, 2, BLOCKED);
          break;
        default:
          tile_columns16(a, group_stride, b, panel_pairs, pairs, tile_sums, rows, first_step, p, scales, n_first,
                         step_kb, 1, BLOCKED);
          break;
      }
    }
  }
}

/* Panels prefetched ahead: a thread widens its panels in the order (n0, k0), and while it
 * widens one it asks for the same lines of the panel TILE_PREFETCH_PANELS after it (the next
 * columns' panels once its rows' K runs out) into L2. Before, each row's next 256-k block
 * was fetched into L1 as the block before it was widened, and the panel's loads still
 * waited on memory in 2-5% of the tile kernel's samples at M = 2048 (perf, 4096 x 14336,
 * 14336 x 4096 and 4096 x 4096, 2 threads, AMD EPYC Zen 4; 7% with no software prefetch).
 * One panel ahead into L2 left as much; two panels ahead 0.5-2%. FP8Linear, old and new
 * alternated in one process, medians of 6-10 rounds: the Llama-3-8B shapes at M = 128-2048
 * 1.01-1.06x faster, SmolLM2's (whole-K panels, ~0.6% of samples waiting) 0.99-1.01x. */
enum { TILE_PREFETCH_PANELS = 2 };

/* Nothing fetched a thread's first panel (nor its second) ahead: with weights from memory
 * (a layer of a model, whose weights leave the cache between its calls) the first
 * panel's widening waited on them, up to ~15% of a small layer's call at M = 64-128. So
 * while the first panel of a call is widened, each row's lines are fetched this many rows
 * ahead into L1, and the second panel's matching lines into L2. FP8Linear, weights cycled
 * from memory (>= 512 MB of copies), 2 threads, AMD EPYC Zen 5, medians of 5-7 alternated
 * rounds, two runs: M = 64 576 x 1536 1.07-1.08x faster, 1536 x 576 1.08-1.13x, 576 x 576
 * 1.06-1.09x, 4096 x 4096 1.01-1.14x, M = 96-128 1.01-1.08x; from M = 256, and the Llama
 * shapes' larger layers at M = 64, 0.99-1.03x; weights in cache 0.96-1.03x. */
enum { TILE_FIRST_PANEL_ROWS_AHEAD = 4 };

typedef struct {
  const uint8_t* row0; /* the panel's first weight row at its k0 */
  int64_t cols;        /* its rows in this thread's columns (0: none) */
  int64_t k_left;      /* K from its k0 on */
} panel_ahead_t;

static panel_ahead_t panel_ahead(const fp8_scaled_mm_params* p, int64_t n0, int64_t n_end, int64_t k0,
                                 int64_t panel_k, int64_t distance) {
  const int64_t blocks = (p->k + panel_k - 1) / panel_k; /* panels per TILE_PANEL_COLS weight rows */
  const int64_t index = k0 / panel_k + distance;
  const int64_t ahead_n0 = n0 + index / blocks * TILE_PANEL_COLS, ahead_k0 = index % blocks * panel_k;
  const int64_t cols = n_end - ahead_n0 < TILE_PANEL_COLS ? n_end - ahead_n0 : TILE_PANEL_COLS;
  const panel_ahead_t none = {NULL, 0, 0};
  if (cols <= 0) return none; /* past this thread's columns */
  const panel_ahead_t ahead = {(const uint8_t*)p->b + ahead_n0 * p->b_col_stride + ahead_k0, cols, p->k - ahead_k0};
  return ahead;
}

/* Lines [kk0, kk1) (from its k0, up to its K) of row c of the panel ahead, into L2. Always
 * inlined: GCC once split a condition's body, the prefetch alone, into a function of its
 * own, found that function free of side effects and removed its calls, prefetch and all. */
BF16_TARGET ALWAYS_INLINE void prefetch_panel_ahead(const fp8_scaled_mm_params* p, const panel_ahead_t* ahead,
                                                    int64_t c, int64_t kk0, int64_t kk1) {
  if (c >= ahead->cols) return;
  const uint8_t* row = ahead->row0 + c * p->b_col_stride;
  const int64_t end = kk1 < ahead->k_left ? kk1 : ahead->k_left;
  for (int64_t kk = kk0; kk < end; kk += 64) _mm_prefetch((const char*)(row + kk), _MM_HINT_T1);
}

/* The call's first panel (next: the panel after it): row c + TILE_FIRST_PANEL_ROWS_AHEAD
 * of it into L1 and row c of the next one into L2, over the panel's k_block, before row c
 * is widened. */
BF16_TARGET ALWAYS_INLINE void prefetch_first_panel_row(const fp8_scaled_mm_params* p, const panel_ahead_t* next,
                                                        int64_t n0, int64_t cols, int64_t k0, int64_t k_block,
                                                        int64_t c) {
  const int64_t ahead = c + TILE_FIRST_PANEL_ROWS_AHEAD;
  if (ahead < cols)
    for (int64_t kk = 0; kk < k_block && k0 + kk < p->k; kk += 64)
      _mm_prefetch((const char*)p->b + (n0 + ahead) * p->b_col_stride + k0 + kk, _MM_HINT_T0);
  prefetch_panel_ahead(p, next, c, 0, k_block);
}

/* Codes [kk0, kk1) of a weight row (from the panel's k0) widened into dest[kk0, kk1): plain
 * 64-byte loads below `whole` (the panel's codes inside K, rounded down to 64), masked
 * ones from there (K's end: zeros past it). A loop of its own per row, with the row's
 * prefetches hoisted out of it: with a prefetch, its checks and the tail mask worked out
 * for every 64 codes, the loop took 36 instructions per 64 codes (GCC kept some of its
 * scalars in vector registers and on the stack), 13 now; FP8Linear, 2 threads, M = 64
 * (the tile kernel), AMD EPYC Zen 5, 7 alternated rounds: 4096 x 4096 1.06x faster,
 * 14336 x 4096 1.05x, 4096 x 14336 1.03x, 1536 x 576 1.04x; M = 256 0.99-1.00x. */
BF16_TARGET ALWAYS_INLINE void widen_row_codes(const widen_tables_t* t, const uint8_t* row, int64_t kk0, int64_t kk1,
                                               int64_t whole, int64_t in_k, uint16_t* dest) {
  int64_t kk = kk0;
  for (const int64_t plain_end = whole < kk1 ? whole : kk1; kk < plain_end; kk += 64) {
    __m512i out0, out1;
    widen64(t, _mm512_loadu_si512(row + kk), &out0, &out1);
    _mm512_store_si512(dest + kk, out0);
    _mm512_store_si512(dest + kk + 32, out1);
  }
  for (; kk < kk1; kk += 64) widen64_store(t, row + kk, in_k - kk, dest + kk);
}

/* Weight rows [n0, n0 + cols) at K [k0, k0 + k_block), widened into `panel`
 * (TILE_PANEL_COLS rows of k_block bf16; rows past `cols` are zero); the panel `ahead`
 * prefetched, and where `next` is given (the call's first panel) the panel after it and
 * this one's rows ahead of their widening. Folded
 * block scales (p->fold_b): the panel's rows lie in one block of 128 weight rows (n0 is a
 * multiple of 64), so one set of shifted tables serves each 128 k of them. */
BF16_TARGET static void widen_weight_panel(const fp8_scaled_mm_params* p, const widen_tables_t* t, int64_t n0,
                                           int64_t cols, int64_t k0, int64_t k_block, const panel_ahead_t* ahead,
                                           const panel_ahead_t* next, uint16_t* panel) {
  for (int64_t c = cols; c < TILE_PANEL_COLS; ++c) memset(panel + c * k_block, 0, sizeof(uint16_t) * (size_t)k_block);
  const int64_t stride = p->b_col_stride;
  const uint8_t* rows = (const uint8_t*)p->b + n0 * stride + k0;
  /* the panel's codes inside K, per row */
  const int64_t in_k = p->k - k0 < k_block ? (p->k > k0 ? p->k - k0 : 0) : k_block;
  const int64_t whole = in_k & ~(int64_t)63;
  if (p->fold_b) {
    const int8_t* shifts = p->fold_b + (n0 / FP8_SCALE_BLOCK) * p->fold_k_blocks;
    for (int64_t kb0 = 0; kb0 < k_block; kb0 += FP8_SCALE_BLOCK) { /* k0: 0 or a multiple of 128 */
      const widen_tables_t shifted = shifted_tables(t, p->b_format, shifts[(k0 + kb0) / FP8_SCALE_BLOCK]);
      const int64_t kb1 = k_block - kb0 < FP8_SCALE_BLOCK ? k_block : kb0 + FP8_SCALE_BLOCK;
      for (int64_t c = 0; c < cols; ++c) {
        if (next != NULL && kb0 == 0) prefetch_first_panel_row(p, next, n0, cols, k0, k_block, c);
        prefetch_panel_ahead(p, ahead, c, kb0, kb1);
        widen_row_codes(&shifted, rows + c * stride, kb0, kb1, whole, in_k, panel + c * k_block);
      }
    }
    return;
  }
  for (int64_t c = 0; c < cols; ++c) {
    if (next != NULL) prefetch_first_panel_row(p, next, n0, cols, k0, k_block, c);
    /* 64 rows x 4 lines at a time are more streams than the hardware prefetchers follow
     * (M = 64, 4096 x 4096, one thread: 7.2 ms per call without a software prefetch,
     * 5.1 ms with one) */
    prefetch_panel_ahead(p, ahead, c, 0, k_block);
    widen_row_codes(t, rows + c * stride, 0, k_block, whole, in_k, panel + c * k_block);
  }
}

BF16_TARGET static void tile_kernel_rows(const fp8_scaled_mm_params* p, const fp8_cpu_mm_plan* plan,
                                         const uint32_t* packed, uint8_t* scratch, int64_t m_begin, int64_t m_end,
                                         int64_t n_begin, int64_t n_end, int first_chunk) {
  const widen_tables_t t = load_widen_tables(p->b_format);
  const int64_t kp = plan->k_padded;
  const int64_t group_stride = (kp / 2) * TILE_LANES;                     /* uint32 between row groups */
  const int64_t rows = ((m_end - m_begin + TILE_LANES - 1) / TILE_LANES) * TILE_LANES;
  uint16_t* panel = (uint16_t*)scratch;
  float* sums = (float*)(scratch + tile_panel_bytes(kp));
  const int blocked = fp8_k_blocked(p);
  const int64_t panel_k = tile_panel_k(kp, rows);
  for (int64_t n0 = n_begin; n0 < n_end; n0 += TILE_PANEL_COLS) {
    const int64_t cols = n_end - n0 < TILE_PANEL_COLS ? n_end - n0 : TILE_PANEL_COLS;
    for (int64_t k0 = 0; k0 < kp; k0 += panel_k) {
      const int64_t k_block = kp - k0 < panel_k ? kp - k0 : panel_k;
      const panel_ahead_t ahead = panel_ahead(p, n0, n_end, k0, panel_k, TILE_PREFETCH_PANELS);
      if (first_chunk && n0 == n_begin && k0 == 0) { /* the call's first panel: TILE_FIRST_PANEL_ROWS_AHEAD */
        const panel_ahead_t next = panel_ahead(p, n0, n_end, k0, panel_k, 1);
        widen_weight_panel(p, &t, n0, cols, k0, k_block, &ahead, &next, panel);
      } else {
        widen_weight_panel(p, &t, n0, cols, k0, k_block, &ahead, NULL, panel);
      }
      for (int64_t r0 = 0; r0 < rows;) {
        const uint32_t* activations = packed + ((m_begin + r0) / TILE_LANES) * group_stride + k0 / 2 * TILE_LANES;
        /* 3 vectors (48 rows) per register tile; a remainder of 4 vectors runs as one
         * tile of 4 x 6 columns (M = 64: bf16_skinny in gemm.c; M = 112 1.05x faster
         * than as 2 + 2, 4096 x 4096, AMD EPYC Zen 5), never 3 + 1, since a 1-vector tile
         * is bound by its broadcasts. */
        const int64_t groups_left = (rows - r0) / TILE_LANES;
        const int vectors = groups_left == 1 ? 1 : groups_left == 2 ? 2 : groups_left == 4 ? 4 : 3;
        const int first = k0 == 0;
        const int64_t kb = k0 / FP8_SCALE_BLOCK;
        if (blocked) {
          /* the rows' scales for this block, gathered once for all the panel's columns */
          __m512 scale_rows[TILE_WHOLE_K_MAX / FP8_SCALE_BLOCK * TILE_VECTORS];
          for (int64_t step = 0; step * FP8_SCALE_BLOCK < k_block; ++step)
            for (int v = 0; v < vectors; ++v)
              scale_rows[step * TILE_VECTORS + v] = fp8_block_scale_a16(p, m_begin + r0 + v * TILE_LANES, kb + step);
          tile_row_tiles(activations, group_stride, panel, k_block, cols, sums + r0, rows, first, p, scale_rows, n0, kb,
                         vectors, 1);
        } else {
          tile_row_tiles(activations, group_stride, panel, k_block, cols, sums + r0, rows, first, p, NULL, n0, kb,
                         vectors, 0);
        }
        r0 += vectors * TILE_LANES;
      }
    }
    fp8_bf16_tile_epilogue(p, sums, fp8_sums_by_column(rows), m_begin, m_end, n0, cols);
  }
}

/* Rows in equal chunks of whole groups, at most TILE_ROW_CHUNK rows each, each chunk
 * over all of this thread's weight rows: a chunk's activations for one K block and its
 * sums stay in cache between panels (192 x K bf16 with whole-K panels: 768 KiB at K =
 * 2048), where all M rows at once (1 MiB per 256-k block at M = 2048) streamed from L3
 * (M = 2048, 4096 x 4096, 2 threads: 87 ms per call before, 77 ms after). Each chunk
 * widens the weight panels again: 1/192 of its dot products or less. Chunks of up to
 * 192 rows instead of 384 (scaled_mm on quantized inputs, AMD EPYC Zen 4, 2 threads,
 * medians of 4-6 rounds alternated in one process, bit-identical): M = 2048 1.02-1.03x
 * faster on 4096 x 4096, 576 x 576 and 1536 x 576 in the host's calm periods,
 * 1.13-1.19x in its slow ones (where 384-row chunks fell to 0.32-0.35 TFLOP/s); M = 512
 * (two chunks of 128 rows per thread instead of one of 256) 0.98-1.02x; one thread at
 * M = 2048 0.98-0.99x. */
BF16_TARGET static void tile_kernel(const fp8_scaled_mm_params* p, const fp8_cpu_mm_plan* plan, const uint32_t* packed,
                                    uint8_t* scratch, int64_t m_begin, int64_t m_end, int64_t n_begin, int64_t n_end) {
  const int64_t groups = (m_end - m_begin + TILE_LANES - 1) / TILE_LANES;
  const int64_t chunks = (groups * TILE_LANES + TILE_ROW_CHUNK - 1) / TILE_ROW_CHUNK;
  const int64_t chunk_rows = (groups + chunks - 1) / chunks * TILE_LANES;
  for (int64_t m0 = m_begin; m0 < m_end; m0 += chunk_rows)
    tile_kernel_rows(p, plan, packed, scratch, m0, m_end - m0 < chunk_rows ? m_end : m0 + chunk_rows, n_begin, n_end,
                     m0 == m_begin);
}

/* ---- entry points ---------------------------------------------------------- */

/* Per thread: the tile kernel's panel and sums (one row chunk) or the skinny kernel's
 * scale_a table, or the 16 rows that prepare widens before packing them. */
int64_t fp8_bf16_scratch_bytes(const fp8_cpu_mm_plan* plan) {
  if (plan->method == FP8_MM_BF16_DOT) return 0;
  const int64_t chunk_rows = plan->m_padded < TILE_ROW_CHUNK ? plan->m_padded : TILE_ROW_CHUNK;
  /* the skinny kernel's scale_a per group of 16 rows and block of 128 k (K-blocked calls) */
  const int64_t groups = (plan->m_padded + TILE_LANES - 1) / TILE_LANES;
  const int64_t k_blocks = (plan->k_padded + FP8_SCALE_BLOCK - 1) / FP8_SCALE_BLOCK;
  const int64_t compute = plan->skinny
                              ? groups * k_blocks * (int64_t)sizeof(__m512)
                              : tile_panel_bytes(plan->k_padded) +
                                    TILE_PANEL_COLS * chunk_rows * (int64_t)sizeof(float);
  const int64_t prepare = TILE_LANES * plan->k_padded * (int64_t)sizeof(uint16_t);
  return compute > prepare ? compute : prepare;
}

BF16_TARGET void fp8_bf16_prepare(const fp8_scaled_mm_params* p, const fp8_cpu_mm_plan* plan, void* workspace,
                                  void* scratch, int64_t m_begin, int64_t m_end) {
  fp8_bf16_build_widen_tables();
  const widen_tables_t t = load_widen_tables(p->a_format);
  const int64_t kp = plan->k_padded;
  if (plan->method == FP8_MM_BF16_DOT) {
    for (int64_t m = m_begin; m < m_end; ++m) widen_activation_row(p, &t, m, kp, (uint16_t*)workspace + m * kp);
    return;
  }
  if (plan->m_padded == FP8_BF16_ROWS8) {
    pack_activation_rows8(p, &t, kp, (uint32_t*)workspace, (uint16_t*)scratch); /* (m_begin = 0: one block of rows) */
    return;
  }
  for (int64_t group = m_begin / TILE_LANES; group * TILE_LANES < m_end; ++group)
    pack_activation_group(p, &t, group, kp, (uint32_t*)workspace, (uint16_t*)scratch);
}

BF16_TARGET void fp8_bf16_compute(const fp8_scaled_mm_params* p, const fp8_cpu_mm_plan* plan, const void* workspace,
                                  void* scratch, int64_t m_begin, int64_t m_end, int64_t n_begin, int64_t n_end) {
  fp8_bf16_build_widen_tables();
  if (plan->method == FP8_MM_BF16_DOT) {
    fp8_bf16_dot_compute(p, plan, (const uint16_t*)workspace, m_begin, m_end, n_begin, n_end);
  } else if (plan->skinny) {
    fp8_bf16_skinny_compute(p, plan, (const uint32_t*)workspace, scratch, m_begin, m_end, n_begin, n_end);
  } else {
    tile_kernel(p, plan, (const uint32_t*)workspace, (uint8_t*)scratch, m_begin, m_end, n_begin, n_end);
  }
}

#endif /* FP8_X86_KERNELS */
