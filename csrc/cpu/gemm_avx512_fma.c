/* scaled_mm with float32 FMAs on AVX-512: the avx512_fma variant's kernel for M >= 10
 * (FP8_MM_FMA_TILE). The variant runs on CPUs with AVX512-BF16 whose vdpbf16ps is slow
 * next to their float32 FMAs: the Intel Xeons, when AMX is not usable (a VM that hides
 * it). On an Emerald Rapids (2 vCPUs, KVM, AMX hidden) one core sustained 1.45
 * vdpbf16ps (zmm, 64 flops each) per ns against 6.0 vfmadd231ps (32 flops): 90 against
 * 193 GFLOP/s, where an AMD Zen 5 core runs vdpbf16ps at 7.3 per ns. There bf16
 * nn.Linear (oneDNN's vdpbf16ps kernels) ran at half the speed of float32 nn.Linear, and
 * so did every kernel of the avx512_bf16 variant once compute-bound.
 *
 * Products stay exact: every fp8 value, and every bf16 activation, is exact in float32,
 * and an FMA rounds only its sum (a product of two fp8 values has at most 8 significant
 * bits, of an fp8 and a bf16 value 12). The sums are float32, in k order within each
 * output (one rounding per FMA: more exact than vdpbf16ps, which flushes subnormal inputs
 * and outputs). The operands are widened as the AVX512-BF16 kernels widen them (the byte
 * tables of bf16_widen.h, in their interleave order, and block scales folded the same
 * way), then each bf16 vector is split into two float32 vectors by a 16-bit unpack with
 * zeros, an exact conversion; weights and activations go through the same steps, so both
 * see K in the same order.
 *
 * The register tiles are the AVX512-BF16 tile kernel's, one k at a time instead of one
 * k-pair: activations packed by groups of 16 rows ([group][k_padded][16 rows] float32,
 * one vector per k), weights widened by panels of 64 rows x FMA_PANEL_K k into [row][k]
 * float32 and broadcast from there; 3 x 16 rows by 8 weight rows per register tile (24
 * accumulators, 3 loads and 8 broadcasts per 24 FMAs). */
#include "cpu_internal.h" /* FP8_X86_KERNELS */
#if FP8_X86_KERNELS /* the whole file: x86-64 only */

#include <string.h>

#include "bf16_widen.h"

#define FMA_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vbmi,fma,f16c")))

enum {
  FMA_VECTORS = 4,     /* activation vectors per register tile, at most (usually 3: 48 rows) */
  FMA_PANEL_COLS = 64, /* weight rows widened together */
  /* K per panel: 64 rows x 128 k float32 = 32 KiB, and one block of a K-blocked call. The
   * register tile's own share (48 rows x 128 k of activations, 24 KiB, and 8 weight rows)
   * stays in L1 while it runs over the panel's 64 rows. */
  FMA_PANEL_K = 128,
  FMA_ROW_CHUNK = 192, /* at most this many activation rows per sweep over the weights */
  FMA_PREFETCH_PANELS = 2, /* panels ahead whose codes are fetched into L2 while one is widened */
};

/* 32 bf16 bits -> two vectors of 16 float32 (the low and high four of each 128-bit lane),
 * exact: the bf16 bits become the high half of each float32. */
FMA_TARGET ALWAYS_INLINE __m512 bf16_low_to_f32(__m512i v) {
  return _mm512_castsi512_ps(_mm512_unpacklo_epi16(_mm512_setzero_si512(), v));
}
FMA_TARGET ALWAYS_INLINE __m512 bf16_high_to_f32(__m512i v) {
  return _mm512_castsi512_ps(_mm512_unpackhi_epi16(_mm512_setzero_si512(), v));
}

/* widen64's two vectors (64 values) -> dest[0, 64) float32, in the kernel's k order. */
FMA_TARGET ALWAYS_INLINE void store_f32x64(__m512i out0, __m512i out1, float* dest) {
  _mm512_store_ps(dest, bf16_low_to_f32(out0));
  _mm512_store_ps(dest + 16, bf16_high_to_f32(out0));
  _mm512_store_ps(dest + 32, bf16_low_to_f32(out1));
  _mm512_store_ps(dest + 48, bf16_high_to_f32(out1));
}

/* ---- activations ------------------------------------------------------------ */

int64_t fp8_fma_workspace_bytes(const fp8_cpu_mm_plan* plan) {
  return plan->m_padded * plan->k_padded * (int64_t)sizeof(float);
}

/* Group `group` of 16 rows: widened to bf16 rows (`rows`, 16 x k_padded, by the
 * AVX512-BF16 kernels' code), then to float32 and transposed 16 x 16 at a time into
 * [k_padded][16 rows]. Rows past M are zero lanes. */
FMA_TARGET static void pack_group(const fp8_scaled_mm_params* p, int64_t group, int64_t k_padded, float* packed,
                                  uint16_t* rows) {
  float* dest = packed + group * k_padded * TILE_LANES;
  const int64_t m0 = group * TILE_LANES;
  const int64_t lanes = p->m - m0 < TILE_LANES ? p->m - m0 : TILE_LANES;
  fp8_bf16_widen_activation_rows(p, m0, m0 + lanes, k_padded, rows);
  for (int64_t k0 = 0; k0 < k_padded; k0 += 64) {
    for (int q = 0; q < 4; ++q) { /* float32 values 16q .. 16q + 16 of these 64 */
      __m512 block[TILE_LANES];
      for (int lane = 0; lane < TILE_LANES; ++lane) {
        if (lane >= lanes) {
          block[lane] = _mm512_setzero_ps();
          continue;
        }
        const __m512i v = _mm512_load_si512(rows + lane * k_padded + k0 + (q / 2) * 32);
        block[lane] = q % 2 ? bf16_high_to_f32(v) : bf16_low_to_f32(v);
      }
      transpose16(block);
      for (int j = 0; j < TILE_LANES; ++j) _mm512_store_ps(dest + (k0 + 16 * q + j) * TILE_LANES, block[j]);
    }
  }
}

/* ---- weights ------------------------------------------------------------------ */

/* The codes of the panel FMA_PREFETCH_PANELS after (n0, k0) in this thread's order
 * (k0 first, then the next 64 weight rows), row c, into L2. */
FMA_TARGET ALWAYS_INLINE void prefetch_ahead(const fp8_scaled_mm_params* p, int64_t n0, int64_t n_end, int64_t k0,
                                             int64_t k_padded, int64_t c) {
  const int64_t blocks = (k_padded + FMA_PANEL_K - 1) / FMA_PANEL_K;
  const int64_t index = k0 / FMA_PANEL_K + FMA_PREFETCH_PANELS;
  const int64_t ahead_n = n0 + index / blocks * FMA_PANEL_COLS + c, ahead_k0 = index % blocks * FMA_PANEL_K;
  if (ahead_n >= n_end) return;
  const uint8_t* row = (const uint8_t*)p->b + ahead_n * p->b_col_stride + ahead_k0;
  for (int64_t kk = 0; kk < FMA_PANEL_K && ahead_k0 + kk < p->k; kk += 64) _mm_prefetch((const char*)(row + kk), _MM_HINT_T1);
}

/* Weight rows [n0, n0 + cols) at K [k0, k0 + k_block) -> panel[c * FMA_PANEL_K + k] float32,
 * k < k_block (rows past cols zero; codes past K zero). The rows lie FMA_PANEL_K apart
 * whatever k_block is, so that the register tiles address the rows they broadcast from as
 * one pointer plus constant offsets: with the stride a variable, the 1-vector tile (16
 * rows) kept 7 of its 16 row pointers on the stack and reloaded them every k. FP8Linear,
 * 2 threads, Intel Xeon without AMX, M = 12 and 16 on that tile, 7 alternated rounds:
 * 1.22-1.35x faster on 4096 x 4096, 14336 x 4096, 1536 x 576 and 576 x 1536 (the same
 * bits; M = 32-256 0.97-1.07x, noise). Folded block scales (p->fold_b): the panel is one
 * block of 128 k and its rows lie in one block of 128 weight rows. */
FMA_TARGET static void widen_panel(const fp8_scaled_mm_params* p, const widen_tables_t* t, int64_t n0, int64_t cols,
                                   int64_t n_end, int64_t k0, int64_t k_block, int64_t k_padded, float* panel) {
  for (int64_t c = cols; c < FMA_PANEL_COLS; ++c) memset(panel + c * FMA_PANEL_K, 0, sizeof(float) * (size_t)k_block);
  const widen_tables_t tables =
      p->fold_b ? shifted_tables(t, p->b_format, p->fold_b[(n0 / FP8_SCALE_BLOCK) * p->fold_k_blocks + k0 / FP8_SCALE_BLOCK])
                : *t;
  const int64_t in_k = p->k - k0 < k_block ? (p->k > k0 ? p->k - k0 : 0) : k_block;
  const int64_t whole = in_k & ~(int64_t)63;
  for (int64_t c = 0; c < cols; ++c) {
    prefetch_ahead(p, n0, n_end, k0, k_padded, c);
    const uint8_t* row = (const uint8_t*)p->b + (n0 + c) * p->b_col_stride + k0;
    float* dest = panel + c * FMA_PANEL_K;
    int64_t kk = 0;
    for (; kk < whole; kk += 64) {
      __m512i out0, out1;
      widen64(&tables, _mm512_loadu_si512(row + kk), &out0, &out1);
      store_f32x64(out0, out1, dest + kk);
    }
    for (; kk < k_block; kk += 64) {
      __m512i out0, out1;
      widen64(&tables, _mm512_maskz_loadu_epi8(tail_mask64(in_k - kk), row + kk), &out0, &out1);
      store_f32x64(out0, out1, dest + kk);
    }
  }
}

/* ---- register tiles ------------------------------------------------------------ */

/* VECTORS x 16 activation rows by COLS weight rows (panel rows FMA_PANEL_K apart) over `ks` k. Sums: sums[j * sums_stride
 * + v * 16 + lane]. K-blocked calls (BLOCKED): the ks k are one block of 128 (kb), summed
 * from zero and added into the sums times scale_a (scale_rows[v]) * scale_b. */
FMA_TARGET ALWAYS_INLINE void fma_block(const float* activations, int64_t group_stride, const float* panel,
                                        int64_t ks, float* sums, int64_t sums_stride, int first,
                                        const fp8_scaled_mm_params* p, const __m512* scale_rows, int64_t n_first,
                                        int64_t kb, const int VECTORS, const int COLS, const int BLOCKED) {
  __m512 acc[FMA_VECTORS][16];
  for (int v = 0; v < VECTORS; ++v)
    for (int j = 0; j < COLS; ++j)
      acc[v][j] = first || BLOCKED ? _mm512_setzero_ps() : _mm512_loadu_ps(sums + j * sums_stride + v * TILE_LANES);
  for (int64_t k = 0; k < ks; ++k) {
    __m512 a[FMA_VECTORS];
    for (int v = 0; v < VECTORS; ++v) a[v] = _mm512_load_ps(activations + v * group_stride + k * TILE_LANES);
    for (int j = 0; j < COLS; ++j) {
      const __m512 b = _mm512_set1_ps(panel[j * FMA_PANEL_K + k]);
      for (int v = 0; v < VECTORS; ++v) acc[v][j] = _mm512_fmadd_ps(a[v], b, acc[v][j]);
    }
  }
  if (BLOCKED) { /* scales read before the first store (as the bf16 tile kernel's tile_block) */
    float scale_b[16];
    for (int j = 0; j < COLS; ++j) scale_b[j] = fp8_block_scale_b(p, n_first + j, kb);
    __m512 scale_a[FMA_VECTORS];
    for (int v = 0; v < VECTORS; ++v) scale_a[v] = scale_rows[v];
    for (int j = 0; j < COLS; ++j)
      for (int v = 0; v < VECTORS; ++v) {
        float* at = sums + j * sums_stride + v * TILE_LANES;
        const __m512 scale = _mm512_mul_ps(scale_a[v], _mm512_set1_ps(scale_b[j]));
        _mm512_storeu_ps(at, first ? _mm512_mul_ps(acc[v][j], scale) : _mm512_fmadd_ps(acc[v][j], scale, _mm512_loadu_ps(at)));
      }
    return;
  }
  for (int v = 0; v < VECTORS; ++v)
    for (int j = 0; j < COLS; ++j) _mm512_storeu_ps(sums + j * sums_stride + v * TILE_LANES, acc[v][j]);
}

/* 16 weight rows against VECTORS groups of 16 rows: 16 columns at once for 1 vector, 2 x 8
 * for 2 or 3, 6 + 6 + 4 for 4 (at most 24 accumulators). */
FMA_TARGET ALWAYS_INLINE void fma_columns16(const float* a, int64_t group_stride, const float* b, int64_t ks,
                                            float* sums, int64_t rows, int first, const fp8_scaled_mm_params* p, const __m512* scales, int64_t n_first,
                                            int64_t kb, const int VECTORS, const int BLOCKED) {
  if (VECTORS == 1) {
    fma_block(a, group_stride, b, ks, sums, rows, first, p, scales, n_first, kb, 1, 16, BLOCKED);
  } else if (VECTORS == 4) {
    fma_block(a, group_stride, b, ks, sums, rows, first, p, scales, n_first, kb, 4, 6, BLOCKED);
    fma_block(a, group_stride, b + 6 * FMA_PANEL_K, ks, sums + 6 * rows, rows, first, p, scales,
              n_first + 6, kb, 4, 6, BLOCKED);
    fma_block(a, group_stride, b + 12 * FMA_PANEL_K, ks, sums + 12 * rows, rows, first, p, scales,
              n_first + 12, kb, 4, 4, BLOCKED);
  } else {
    fma_block(a, group_stride, b, ks, sums, rows, first, p, scales, n_first, kb, VECTORS, 8, BLOCKED);
    fma_block(a, group_stride, b + 8 * FMA_PANEL_K, ks, sums + 8 * rows, rows, first, p, scales,
              n_first + 8, kb, VECTORS, 8, BLOCKED);
  }
}

/* The register tiles of `vectors` groups of 16 rows against the panel's `cols` weight
 * rows, 16 at a time; compiled once per BLOCKED and number of vectors, each as a function
 * of its own so that each keeps its accumulators in registers. */
#define FMA_PANEL_TILES(VECTORS, BLOCKED)                                                                         \
  FMA_TARGET __attribute__((noinline)) static void panel_tiles_##VECTORS##_##BLOCKED(                             \
      const float* a, int64_t group_stride, const float* panel, int64_t k_block, int64_t cols, float* sums,        \
      int64_t rows, int first, const fp8_scaled_mm_params* p, const __m512* scales, int64_t n0, int64_t kb) {     \
    for (int64_t c0 = 0; c0 < cols; c0 += 16)                                                                      \
      fma_columns16(a, group_stride, panel + c0 * FMA_PANEL_K, k_block, sums + c0 * rows, rows, first, p, scales, \
                    n0 + c0, kb, VECTORS, BLOCKED);                                                                \
  }
FMA_PANEL_TILES(1, 0)
FMA_PANEL_TILES(2, 0)
FMA_PANEL_TILES(3, 0)
FMA_PANEL_TILES(4, 0)
FMA_PANEL_TILES(1, 1)
FMA_PANEL_TILES(2, 1)
FMA_PANEL_TILES(3, 1)
FMA_PANEL_TILES(4, 1)
#undef FMA_PANEL_TILES

typedef void (*panel_tiles_fn)(const float*, int64_t, const float*, int64_t, int64_t, float*, int64_t, int,
                               const fp8_scaled_mm_params*, const __m512*, int64_t, int64_t);
static const panel_tiles_fn panel_tiles[2][FMA_VECTORS + 1] = {
    {NULL, panel_tiles_1_0, panel_tiles_2_0, panel_tiles_3_0, panel_tiles_4_0},
    {NULL, panel_tiles_1_1, panel_tiles_2_1, panel_tiles_3_1, panel_tiles_4_1}};

/* Rows [m_begin, m_end) (one chunk: whole groups from a group boundary) against weight
 * rows [n_begin, n_end), panel by panel. */
FMA_TARGET static void fma_rows(const fp8_scaled_mm_params* p, const fp8_cpu_mm_plan* plan, const float* packed,
                                uint8_t* scratch, int64_t m_begin, int64_t m_end, int64_t n_begin, int64_t n_end) {
  const widen_tables_t t = load_widen_tables(p->b_format);
  const int64_t kp = plan->k_padded;
  const int64_t group_stride = kp * TILE_LANES;
  const int64_t rows = (m_end - m_begin + TILE_LANES - 1) / TILE_LANES * TILE_LANES;
  float* panel = (float*)scratch;
  float* sums = panel + FMA_PANEL_COLS * FMA_PANEL_K;
  const int blocked = fp8_k_blocked(p);
  for (int64_t n0 = n_begin; n0 < n_end; n0 += FMA_PANEL_COLS) {
    const int64_t cols = n_end - n0 < FMA_PANEL_COLS ? n_end - n0 : FMA_PANEL_COLS;
    for (int64_t k0 = 0; k0 < kp; k0 += FMA_PANEL_K) {
      const int64_t k_block = kp - k0 < FMA_PANEL_K ? kp - k0 : FMA_PANEL_K;
      widen_panel(p, &t, n0, cols, n_end, k0, k_block, kp, panel);
      const int64_t kb = k0 / FP8_SCALE_BLOCK;
      for (int64_t r0 = 0; r0 < rows;) {
        const int64_t groups_left = (rows - r0) / TILE_LANES;
        /* as the bf16 tile kernel: 3 vectors, a remainder of 4 as one tile, never 3 + 1 */
        const int vectors = groups_left == 1 ? 1 : groups_left == 2 ? 2 : groups_left == 4 ? 4 : 3;
        const float* a = packed + ((m_begin + r0) / TILE_LANES) * group_stride + k0 * TILE_LANES;
        __m512 scale_rows[FMA_VECTORS];
        if (blocked)
          for (int v = 0; v < vectors; ++v) scale_rows[v] = fp8_block_scale_a16(p, m_begin + r0 + v * TILE_LANES, kb);
        panel_tiles[blocked][vectors](a, group_stride, panel, k_block, cols, sums + r0, rows, k0 == 0, p,
                                      blocked ? scale_rows : NULL, n0, kb);
        r0 += vectors * TILE_LANES;
      }
    }
    fp8_bf16_tile_epilogue(p, sums, fp8_sums_by_column(rows), m_begin, m_end, n0, cols);
  }
}

/* ---- entry points ---------------------------------------------------------------- */

int64_t fp8_fma_scratch_bytes(const fp8_cpu_mm_plan* plan) {
  const int64_t chunk_rows = plan->m_padded < FMA_ROW_CHUNK ? plan->m_padded : FMA_ROW_CHUNK;
  const int64_t compute = (FMA_PANEL_COLS * FMA_PANEL_K + FMA_PANEL_COLS * chunk_rows) * (int64_t)sizeof(float);
  const int64_t prepare = TILE_LANES * plan->k_padded * (int64_t)sizeof(uint16_t);
  return compute > prepare ? compute : prepare;
}

FMA_TARGET void fp8_fma_prepare(const fp8_scaled_mm_params* p, const fp8_cpu_mm_plan* plan, void* workspace,
                                void* scratch, int64_t m_begin, int64_t m_end) {
  for (int64_t group = m_begin / TILE_LANES; group * TILE_LANES < m_end; ++group)
    pack_group(p, group, plan->k_padded, (float*)workspace, (uint16_t*)scratch);
}

/* Rows in equal chunks of whole groups, at most FMA_ROW_CHUNK rows each, each over all
 * of this thread's weight rows (the bf16 tile kernel's chunks: a chunk's activations for
 * one panel and its sums stay in cache between panels). */
FMA_TARGET void fp8_fma_compute(const fp8_scaled_mm_params* p, const fp8_cpu_mm_plan* plan, const void* workspace,
                                void* scratch, int64_t m_begin, int64_t m_end, int64_t n_begin, int64_t n_end) {
  fp8_bf16_build_widen_tables();
  const int64_t groups = (m_end - m_begin + TILE_LANES - 1) / TILE_LANES;
  const int64_t chunks = (groups * TILE_LANES + FMA_ROW_CHUNK - 1) / FMA_ROW_CHUNK;
  const int64_t chunk_rows = (groups + chunks - 1) / chunks * TILE_LANES;
  for (int64_t m0 = m_begin; m0 < m_end; m0 += chunk_rows)
    fma_rows(p, plan, (const float*)workspace, (uint8_t*)scratch, m0, m_end - m0 < chunk_rows ? m_end : m0 + chunk_rows,
             n_begin, n_end);
}

#endif /* FP8_X86_KERNELS */
