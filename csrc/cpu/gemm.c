/* scaled_mm on the CPU: the scalar variant (any strides) and the one place that
 * picks the ISA variant. out = (a * scale_a) @ (b * scale_b) + bias with exact
 * fp8 products, float32 accumulation and one rounding to the output dtype. */
#include <stdlib.h>
#include <string.h>

#include "cpu_internal.h"

static float decode_tables[2][256];
static int decode_tables_ready = 0;

const float* fp8_decode_table(fp8_format format) {
  if (!__atomic_load_n(&decode_tables_ready, __ATOMIC_ACQUIRE)) {
    /* every thread computes the same values, so concurrent first calls are harmless */
    for (int code = 0; code < 256; ++code) {
      decode_tables[FP8_E4M3FN][code] = fp8_e4m3fn_to_float((uint8_t)code);
      decode_tables[FP8_E5M2][code] = fp8_e5m2_to_float((uint8_t)code);
    }
    __atomic_store_n(&decode_tables_ready, 1, __ATOMIC_RELEASE);
  }
  return decode_tables[format];
}

#if FP8_X86_KERNELS
/* Activation rows -> float32 rows of plan->k_padded, zero padded, for the AVX2 kernels
 * (gemm_avx2.c, gemm_avx2_panel.c); for the float32 route, times its factor and each 32 k
 * in its order (cpu_internal.h). */
void fp8_float_prepare(const fp8_scaled_mm_params* p, const fp8_cpu_mm_plan* plan, void* workspace,
                       int64_t m_begin, int64_t m_end) {
  const float* decode = fp8_decode_table(p->a_format);
  const float fp8_factor = fp8_avx2_activation_factor(p);
  const int lanes4 = fp8_avx2_float32_route(p);
  for (int64_t m = m_begin; m < m_end; ++m) {
    float* row = (float*)workspace + m * plan->k_padded;
    for (int64_t k = 0; k < p->k; ++k) {
      const int64_t offset = m * p->a_row_stride + k * p->a_col_stride;
      row[k] = p->a_is_float ? fp8_load_float(p->a, p->a_float_dtype, offset)
                             : decode[((const uint8_t*)p->a)[offset]] * fp8_factor;
    }
    for (int64_t k = p->k; k < plan->k_padded; ++k) row[k] = 0.0f;
    for (int64_t k0 = 0; lanes4 && k0 < plan->k_padded; k0 += 32) { /* k_padded: a multiple of 32 */
      float group[32];
      memcpy(group, row + k0, sizeof group);
      for (int t = 0; t < 4; ++t)
        for (int j = 0; j < 8; ++j) row[k0 + 8 * t + j] = group[4 * j + t];
    }
  }
}
#endif

/* Rows of A decoded a block at a time, so each B column is decoded once per block
 * (32 rows: 1.1-1.25x faster than 8 from M = 16 with the lanes below). */
enum { SCALAR_ROW_BLOCK = 32 };

/* sum a[i] * b[i] over [0, k) in SCALAR_LANES float32 partial sums (lane l takes every
 * i = l mod SCALAR_LANES, in order), added pairwise at the end: plain C that compilers
 * vectorize (SSE2 on any x86-64, NEON on aarch64) without reassociating a sum, where one
 * running sum waited on each add's latency. The scalar variant is what CPUs other than
 * x86-64 run. FP8Linear, scalar variant forced, AMD EPYC Zen 4 (SSE2 code), 2 threads,
 * one running sum and 8-row blocks -> lanes and 32-row blocks, time over bf16
 * nn.Linear's: 4096 x 4096 M = 1 4.8x -> 2.0x, M = 16 45x -> 5.5-6.2x, M = 256 91x ->
 * 11x (docs/performance-notes.md). */
enum { SCALAR_LANES = 16 };

static float dot_in_lanes(const float* a, const float* b, int64_t k) {
  float lanes[SCALAR_LANES] = {0.0f};
  int64_t i = 0;
  for (; i + SCALAR_LANES <= k; i += SCALAR_LANES)
    for (int l = 0; l < SCALAR_LANES; ++l) lanes[l] += a[i + l] * b[i + l];
  for (int l = 0; i + l < k; ++l) lanes[l] += a[i + l] * b[i + l];
  for (int width = SCALAR_LANES / 2; width > 0; width /= 2)
    for (int l = 0; l < width; ++l) lanes[l] += lanes[l + width];
  return lanes[0];
}

static void scaled_mm_scalar(const fp8_scaled_mm_params* p, int64_t m_begin, int64_t m_end,
                             int64_t n_begin, int64_t n_end) {
  const float* decode_a = fp8_decode_table(p->a_format);
  const float* decode_b = fp8_decode_table(p->b_format);
  const int64_t k = p->k;
  const int64_t block_rows = m_end - m_begin < SCALAR_ROW_BLOCK ? m_end - m_begin : SCALAR_ROW_BLOCK;
  float* a_block = (float*)malloc(sizeof(float) * (size_t)(block_rows * k + k + 1));
  float* b_column = a_block + block_rows * k;
  for (int64_t m0 = m_begin; m0 < m_end; m0 += block_rows) {
    const int64_t rows = m_end - m0 < block_rows ? m_end - m0 : block_rows;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t i = 0; i < k; ++i) {
        const int64_t offset = (m0 + r) * p->a_row_stride + i * p->a_col_stride;
        a_block[r * k + i] = p->a_is_float ? fp8_load_float(p->a, p->a_float_dtype, offset)
                                           : decode_a[((const uint8_t*)p->a)[offset]];
      }
    }
    for (int64_t n = n_begin; n < n_end; ++n) {
      for (int64_t i = 0; i < k; ++i) b_column[i] = decode_b[p->b[i * p->b_row_stride + n * p->b_col_stride]];
      const float scale_b = fp8_k_blocked(p) ? 1.0f : fp8_scale_b(p, n); /* blocked: per block below */
      const float bias = p->bias ? fp8_load_float(p->bias, p->bias_dtype, n) : 0.0f;
      for (int64_t r = 0; r < rows; ++r) {
        const float* a_row = a_block + r * k;
        if (fp8_k_blocked(p)) { /* a float32 sum per block of 128 k, scaled, then summed */
          float total = 0.0f;
          for (int64_t k0 = 0; k0 < k; k0 += FP8_SCALE_BLOCK) {
            const int64_t k1 = k - k0 < FP8_SCALE_BLOCK ? k : k0 + FP8_SCALE_BLOCK;
            total += fp8_k_block_scale(p, m0 + r, n, k0 / FP8_SCALE_BLOCK) * dot_in_lanes(a_row + k0, b_column + k0, k1 - k0);
          }
          fp8_store_float(p->out, p->out_dtype, (m0 + r) * p->out_row_stride + n, total + bias);
          continue;
        }
        const float acc = dot_in_lanes(a_row, b_column, k);
        const float scale = fp8_scale_a(p, m0 + r) * scale_b;
        /* K = 0: an empty sum, so exactly the bias, whatever the scales (0 * inf is NaN) */
        fp8_store_float(p->out, p->out_dtype, (m0 + r) * p->out_row_stride + n, (k == 0 ? 0.0f : acc * scale) + bias);
      }
    }
  }
  free(a_block);
}

/* Up to this many activation rows the dot kernel (one pass over the weights, every
 * row against every weight row) runs on the AVX512-BF16 variant; M = 5-8 take the
 * eight-row kernel (FP8_BF16_ROWS8), M = 9-64 the skinny kernel (groups of 16 rows).
 * The dot kernel widens each weight again for every 4 rows and, at M = 5-8, keeps 4 x 4
 * accumulators with half of each weight row's widening per 16 dot products; the
 * eight-row kernel widens each weight once with (at M = 8) every lane of its dot products on a real
 * row. scaled_mm, TFLOP/s, 2 threads, AMD EPYC Zen 4, builds alternated, three rounds,
 * dot -> eight-row: 4096 x 14336 M = 8 0.20-0.23 -> 0.30-0.34, M = 5 0.17-0.21 ->
 * 0.22-0.24; 4096 x 4096 M = 8 0.12-0.21 -> 0.29-0.31; 1536 x 576 M = 8 0.11-0.12 ->
 * 0.20-0.24. At M = 3-4 the eight-row kernel, padded to 8 rows, lost (dot vs eight-row,
 * medians of three: 4096 x 14336 M = 4 0.18 vs 0.16, M = 3 0.19 vs 0.11). (On a Zen 5 the dot
 * kernel had run M = 8 and the 16-row skinny kernel M = 9 at about one speed: 4096 x
 * 4096, 0.57 / 0.66 ms; the eight-row kernel was not measured there.) */
enum { DOT_MAX_ROWS = 4 };
/* M x N x K up to which the AMX variants keep the dot kernel for 2 <= M <= 4. */
enum { AMX_DOT_MAX_WORK = 2 << 20 };


#if FP8_X86_KERNELS
static int64_t round_up(int64_t value, int64_t multiple) { return (value + multiple - 1) / multiple * multiple; }
#endif

#if FP8_X86_KERNELS
/* The AVX512-BF16 skinny kernel up to 48 (padded) rows. At 64 rows (4 groups of 16) the
 * tile kernel's 4 x 16-row by 6-column register tiles (10 loads per 24 dot products,
 * where the skinny kernel loads 17 per 16) unless its 64-column tiles leave the busiest
 * of `threads` more than 1/8 over an even share; the skinny kernel's 16-column ones
 * balance better. Both sum each output in the same order (the same bits). FP8Linear at
 * M = 64, tile over skinny, AMD EPYC Zen 5, medians of 9 rounds alternated in one
 * process, 2 threads: 4096 x 4096 1.06-1.08x faster, 14336 x 4096 1.06-1.09x (0.96x in
 * a 7-round run), 4096 x 14336 1.04-1.14x, 1536 x 576 1.21-1.23x, 576 x 1536 1.12-1.15x,
 * 576 x 576 1.11-1.17x; 192 x 576 (three tiles for two threads) 0.93-1.03x, so it stays
 * skinny; one thread: the Llama shapes 0.96-0.99x, SmolLM2's 1.14-1.21x. Weights cycled
 * from memory (as in a model; 5-7 rounds): 0.86-1.08x before the tile kernel fetched its
 * first panel ahead (TILE_FIRST_PANEL_ROWS_AHEAD), 1.08-1.14x on 576 x 1536, 1536 x 576,
 * 4096 x 4096 and 1.06x on 576 x 576 with it. At 33-48 rows the tile kernel's 3-vector
 * tiles ran 0.93-0.96x on 4096 x 4096 and 1.02-1.13x on SmolLM2's shapes: no change
 * there. */
static int bf16_skinny(int64_t m_padded, int64_t n, int64_t threads) {
  if (m_padded != FP8_BF16_SKINNY_MAX_ROWS) return m_padded < FP8_BF16_SKINNY_MAX_ROWS;
  const int64_t workers = threads < 1 ? 1 : threads;
  const int64_t tiles = (n + 63) / 64, busiest = (tiles + workers - 1) / workers;
  return busiest * workers * 8 > tiles * 9;
}
#endif

fp8_cpu_mm_plan fp8_cpu_scaled_mm_plan(const fp8_scaled_mm_params* p, int64_t threads) {
  (void)threads; /* (the x86-64 kernels' choice) */
  fp8_cpu_mm_plan plan;
  memset(&plan, 0, sizeof plan);
  plan.variant = fp8_cpu_active_variant();
  plan.method = FP8_MM_SCALAR;
  plan.k_padded = p->k;
  plan.m_padded = p->m;
  plan.tile_m = p->m < 256 ? p->m : 256;
  plan.tile_n = 64;
  plan.fold_offset = -1;
  /* The fast kernels stream each weight row (output column) as K contiguous bytes,
   * the layout of a Linear weight passed as w.t(). */
  const int weight_rows_contiguous = p->b_row_stride == 1 || p->k == 1;
  if (p->k == 0 || !weight_rows_contiguous) return plan;
#if FP8_X86_KERNELS
  /* bf16 dot products are exact for fp8 and bf16 activations only. */
  const int activations_fit_bf16 = !p->a_is_float || p->a_float_dtype == FP8_BFLOAT16;
  const int amx = plan.variant == FP8_CPU_AMX || plan.variant == FP8_CPU_AMX_EMULATED;
  if (plan.variant >= FP8_CPU_AVX512_BF16 && activations_fit_bf16) {
    plan.k_padded = round_up(p->k, 64);
    /* With AMX the dot kernel keeps M = 1 and small problems of M <= 4, where a call of
     * the AMX kernels costs ~10-25 us more through torch's thread pool than its work
     * saves (576 x 576, M = 2: 23.6 vs 33.3 us); from M = 2 on large layers the AMX
     * stream kernel reads the weights faster (4096 x 4096 from memory, M = 4: 635 vs
     * 885 us; 2 threads, Emerald Rapids). */
    /* (K-blocked scales: every kernel here sums per block of 128 k) */
    const int dot = amx ? p->m == 1 || (p->m <= 4 && p->m * p->n * p->k <= AMX_DOT_MAX_WORK) : p->m <= DOT_MAX_ROWS;
    if (dot) {
      plan.method = FP8_MM_BF16_DOT;
      plan.tile_m = p->m;
      plan.tile_n = 16;
    } else if (amx) {
      plan.method = FP8_MM_AMX;
      plan.m_padded = round_up(p->m, 16);
      plan.tile_m = plan.m_padded; /* as the tile kernel: the bindings split M too when N alone does not even out */
      plan.tile_n = plan.m_padded <= FP8_AMX_STREAM_MAX_ROWS ? 16 : 64;
    } else if (plan.variant == FP8_CPU_AVX512_FMA && p->m >= FP8_FMA_MIN_ROWS) {
      /* float32 FMA register tiles (gemm_avx512_fma.c) from 10 rows (one group of 16
       * mostly real rows); up to 9 (M = 9: 8 + 1) the avx512_bf16 variant's dot and
       * eight-row kernels below, which keep 8 rows to a vector. FP8Linear, 2 threads,
       * Intel Xeon Emerald Rapids without AMX, weights in cache, 7 alternated rounds, time
       * of the bf16 kernels over the FMA tiles: M = 5 0.75-0.93, M = 8 0.76-0.89, M = 9
       * 0.79-0.91, M = 10 1.28-1.61, M = 12 1.25-1.59, M = 16 1.27-1.57 (4096 x 4096,
       * 14336 x 4096, 1536 x 576, 576 x 1536); from M = 32 (3 rounds): 4096 x 4096 M = 32
       * 7.68 -> 5.37 ms, M = 64 14.0 -> 8.1, M = 256 54.8 -> 36.6; 1536 x 576 M = 32 0.460
       * -> 0.333, M = 256 2.69 -> 1.45. */
      plan.method = FP8_MM_FMA_TILE;
      plan.m_padded = round_up(p->m, 16);
      plan.tile_m = plan.m_padded; /* as the tile kernel's */
      plan.tile_n = 64;
    } else {
      plan.method = FP8_MM_BF16_TILE;
      plan.m_padded = p->m <= FP8_BF16_ROWS8 ? FP8_BF16_ROWS8 : round_up(p->m, 16);
      plan.tile_m = plan.m_padded; /* all rows per tile; the bindings split M too when N alone does not even out */
      plan.skinny = bf16_skinny(plan.m_padded, p->n, threads);
      plan.tile_n = plan.skinny ? 16 : 64; /* the skinny kernel takes 16 weight rows at a time */
    }
    plan.workspace_bytes = plan.method == FP8_MM_FMA_TILE ? fp8_fma_workspace_bytes(&plan)
                                                          : plan.m_padded * plan.k_padded * (int64_t)sizeof(uint16_t);
    plan.scratch_bytes = plan.method == FP8_MM_AMX        ? fp8_amx_scratch_bytes(&plan)
                         : plan.method == FP8_MM_FMA_TILE ? fp8_fma_scratch_bytes(&plan)
                                                          : fp8_bf16_scratch_bytes(&plan);
    /* Block scales a power of two apart go into the operands (fp8_cpu_scaled_mm_fold) for
     * the AMX kernels, whose C tiles then stay in the tiles over all of K: block-wise at
     * M = 256 took 1.13-1.37x the per-channel time with a store and scaled add of every C
     * tile per 128 k (docs/performance-notes.md). The stream kernel (M <= 64), which
     * widens each weight for fewer rows, shifts its widening tables once per step instead
     * of each value: scaled_mm, 2 threads, Intel Xeon with AMX, over per-channel, medians
     * of 11 alternated rounds, M = 16-64: 0.94-1.07 (K-blocked 0.97-1.38; with the
     * exponent added to each widened value 1.00-1.21). The AVX512-BF16 skinny and tile
     * kernels fold the same way (shifted tables per step of 16 rows x 64 k, and per 128 k
     * of a 64-row panel): FP8Linear, block ue8m0 over per-channel, 2 threads, AMD EPYC
     * Zen 4, one run (bench_cpu.py): M = 64 1.01-1.14 -> 1.02-1.05, M = 256 1.11-1.14 ->
     * 1.01-1.03. The dot kernels and the AVX2 ones keep their per-block sums. */
    if ((plan.method == FP8_MM_AMX || plan.method == FP8_MM_BF16_TILE || plan.method == FP8_MM_FMA_TILE) &&
        fp8_k_blocked(p)) {
      plan.fold_offset = round_up(plan.workspace_bytes, 64);
      plan.workspace_bytes = plan.fold_offset + fp8_cpu_fold_bytes(p);
    }
  } else if (plan.variant >= FP8_CPU_AVX2) {
    /* The AVX2 kernels: the avx2 variant, AVX-512 CPUs without AVX512-BF16, and float32 /
     * float16 activations (weight-only) on the bf16 variants. An AVX-512 dot kernel that
     * widened the weights through 16-lane table gathers ran these before, 1.9-3.4x slower
     * at every M (Intel Xeon with AMX, that kernel and these forced, FP8Linear, 2 threads:
     * 4096 x 4096 W8A8 M = 1 2.01 vs 0.60 ms, M = 16 9.15 vs 4.97, M = 256 140 vs 61;
     * 576 x 576 M = 1 47 vs 20 us; weight-only float32, 4096 x 4096, M = 1 1.92 vs 0.92
     * ms, M = 256 141 vs 66). */
    plan.method = FP8_MM_FLOAT_DOT;
    plan.k_padded = round_up(p->k, 32);
    plan.tile_m = p->m < 64 ? p->m : 64;
    plan.tile_n = 32;
    plan.workspace_bytes = p->m * plan.k_padded * (int64_t)sizeof(float);
    if (p->m > FP8_AVX2_DOT_MAX_ROWS && !fp8_avx2_float32_route(p)) {
      plan.method = FP8_MM_AVX2_PANEL;
      plan.tile_m = p->m < FP8_AVX2_TILE_M ? p->m : FP8_AVX2_TILE_M;
      plan.workspace_bytes = fp8_avx2_panel_workspace_bytes(p, &plan);
      plan.scratch_bytes = fp8_avx2_scratch_bytes(&plan);
    }
  }
#endif
  return plan;
}

void fp8_cpu_scaled_mm_prepare(const fp8_scaled_mm_params* p, const fp8_cpu_mm_plan* plan, void* workspace,
                               void* scratch, int64_t m_begin, int64_t m_end) {
#if FP8_X86_KERNELS
  if (plan->method == FP8_MM_BF16_DOT || plan->method == FP8_MM_BF16_TILE || plan->method == FP8_MM_AMX)
    fp8_bf16_prepare(p, plan, workspace, scratch, m_begin, m_end);
  else if (plan->method == FP8_MM_FMA_TILE)
    fp8_fma_prepare(p, plan, workspace, scratch, m_begin, m_end);
  else if (plan->method == FP8_MM_AVX2_PANEL)
    fp8_avx2_panel_prepare(p, plan, workspace, m_begin, m_end);
  else if (plan->method == FP8_MM_FLOAT_DOT)
    fp8_float_prepare(p, plan, workspace, m_begin, m_end);
#else
  (void)p, (void)plan, (void)workspace, (void)scratch, (void)m_begin, (void)m_end; /* the scalar kernel reads a as it is */
#endif
}

void fp8_cpu_scaled_mm(const fp8_scaled_mm_params* p, const fp8_cpu_mm_plan* plan, const void* workspace,
                       void* scratch, int64_t m_begin, int64_t m_end, int64_t n_begin, int64_t n_end) {
  if (m_end > p->m) m_end = p->m;
  if (m_begin >= m_end || n_begin >= n_end) return;
  switch (plan->method) {
#if FP8_X86_KERNELS
    case FP8_MM_BF16_DOT:
    case FP8_MM_BF16_TILE: fp8_bf16_compute(p, plan, workspace, scratch, m_begin, m_end, n_begin, n_end); break;
    case FP8_MM_AMX: fp8_amx_compute(p, plan, workspace, scratch, m_begin, m_end, n_begin, n_end); break;
    case FP8_MM_FMA_TILE: fp8_fma_compute(p, plan, workspace, scratch, m_begin, m_end, n_begin, n_end); break;
    case FP8_MM_FLOAT_DOT:
    case FP8_MM_AVX2_PANEL: fp8_avx2_compute(p, plan, workspace, scratch, m_begin, m_end, n_begin, n_end); break;
#endif
    default: scaled_mm_scalar(p, m_begin, m_end, n_begin, n_end); break;
  }
}
