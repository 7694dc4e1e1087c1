/* The AVX512-BF16 skinny and eight-row kernels (M = 5-64): weight rows 16 at a time over
 * all of K, each group of activation rows packed by fp8_bf16_prepare against them with the
 * widening of the next small panel interleaved with the dot products of this one (1-2
 * groups: each group in turn over all of K; 3-4 groups: all of them per step of K).
 * gemm_avx512_bf16.c says how the AVX512-BF16 kernels widen fp8 and when each runs. */
#include "cpu_internal.h" /* FP8_X86_KERNELS */
#if FP8_X86_KERNELS /* the whole file: x86-64 only */

#include "bf16_widen.h"

/* ---- skinny kernel (groups of 16 activation rows, up to 64 rows) ----------- */

/* Weight rows 16 at a time, over all of K in steps of 64: the 16 x 64 bf16 panel
 * of the next step is widened while the dot products of this one run (one row of
 * it every two k-pairs, in L1), so the shuffles of the widening fill gaps among
 * the dot products instead of stalling them in a phase of their own; the 16 x 16
 * sums stay in registers for all of K (K-blocked calls: for each block of 128 k). The
 * tile kernel, which widens 64 x 256 panels between its register tiles, spent ~30% of
 * its time widening at M = 16.
 * 1-2 groups of 16 rows take it in turn, each widening the 16 weight rows again (3-4
 * groups: skinny_groups below, one widening for all, in steps of 128). Before
 * skinny_groups, up to 4 groups took this loop in turn: scaled_mm, 14336 x 4096, 2
 * threads, AMD EPYC Zen 4, three alternated rounds, tile kernel vs this: M = 48
 * 0.32-0.33 vs 0.38-0.41 TFLOP/s, M = 64 0.35-0.36 vs 0.39-0.42 (the tile kernel's 2 x 8
 * register tiles at M = 64 and this one's 1 x 16 both run at the dot products' rate
 * from L1 there; the tile kernel loses on its panel and sums traffic). */
enum { SKINNY_COLS = 16, SKINNY_STEP = 64, SKINNY_PREFETCH = 256 };

BF16_TARGET ALWAYS_INLINE void skinny_widen_row(const widen_tables_t* t, const uint8_t* row, int64_t k_left,
                                                uint16_t* dest, const uint8_t* next_block_line) {
  _mm_prefetch((const char*)(row + SKINNY_PREFETCH), _MM_HINT_T0);
  _mm_prefetch((const char*)next_block_line, _MM_HINT_T1);
  widen64_store(t, row, k_left, dest); /* the step after the last one reads nothing */
}

/* The 16 weight rows from n0 a skinny kernel reads, and what it prefetches and folds. */
typedef struct {
  const uint8_t* rows[SKINNY_COLS]; /* past the last column: column n0 again, its sums unused */
  /* The next 16 weight rows follow these in memory (16 x K bytes): one line of them is
   * fetched into L2 per row widened, so that the next block starts without waiting on
   * memory. With K = 576 a block is only 9 steps, and the first few of them stalled on
   * the lines that the prefetch within rows had not reached (1536 x 576, M = 16:
   * 0.113 -> 0.040 ms per call; 4096 x 4096: 0.76 -> 0.65 ms). */
  const uint8_t* next_block;
  /* folded block scales (p->fold_b): the 16 rows and each step's k lie in one block of
   * 128 x 128, so each step widens through one set of shifted tables */
  const int8_t* shifts;
} skinny_weights_t;

ALWAYS_INLINE skinny_weights_t skinny_weights(const fp8_scaled_mm_params* p, int64_t n0, int64_t cols) {
  skinny_weights_t w;
  for (int c = 0; c < SKINNY_COLS; ++c) w.rows[c] = p->b + (n0 + (c < cols ? c : 0)) * p->b_col_stride;
  w.next_block = p->b + (n0 + SKINNY_COLS) * p->b_col_stride;
  w.shifts = p->fold_b ? p->fold_b + (n0 / FP8_SCALE_BLOCK) * p->fold_k_blocks : NULL;
  return w;
}

/* A K-blocked call's 16 x 16 sums of block kb (`block_sums`, [column][16 rows]) scaled
 * into the totals at `sums` (column j at sums + j * stride): set for kb = 0, added after.
 * The block's sums go through memory before they are scaled: computed beside the live
 * accumulators, the scales took registers enough that the compiler kept the accumulators
 * in memory inside the step loop. */
BF16_TARGET ALWAYS_INLINE void skinny_add_block(const fp8_scaled_mm_params* p, const float* block_sums,
                                                __m512 scale_a, int64_t n0, int64_t kb, float* sums,
                                                int64_t stride) {
  /* block scale_b: the 16 columns lie in one block of 128 rows (n0 is a multiple of 16;
   * columns past N are padding), so one scale serves them all */
  const __m512 block_scale = _mm512_mul_ps(scale_a, _mm512_set1_ps(fp8_block_scale_b(p, n0, kb)));
  for (int j = 0; j < SKINNY_COLS; ++j) {
    const __m512 scale =
        p->scale_b_blocked ? block_scale : _mm512_mul_ps(scale_a, _mm512_set1_ps(fp8_block_scale_b(p, n0 + j, kb)));
    const __m512 block = _mm512_load_ps(block_sums + j * TILE_LANES);
    float* at = sums + j * stride;
    _mm512_store_ps(at, kb == 0 ? _mm512_mul_ps(block, scale) : _mm512_fmadd_ps(block, scale, _mm512_load_ps(at)));
  }
}

/* 16 weight rows from n0 (`cols` of them real) against one group of activation rows
 * over all of K, their sums into `sums` ([column][16 lanes]). The group is 16 rows
 * packed by pack_activation_group (a vector per k-pair, one row per lane, the weight's
 * pair broadcast as 32 bits) or, with EIGHT_ROWS, 8 rows packed by
 * pack_activation_rows8 (a vector per two k-pairs, lane 2r + h summing row r's pairs of
 * parity h, the weight's two pairs broadcast as 64 bits; the two lanes of a row are
 * added at the end into lane r). At M = 8 the eight-row form leaves no lane on a
 * padding row where a 16-row group would leave half of them, and still widens each
 * weight once.
 * Compiled once per BLOCKED and EIGHT_ROWS: with the K-blocked branch inside the step
 * loop, the compiler kept the 16 accumulators in memory and stored all of them after
 * every two k-pairs (16 zmm stores per 32 dot products), which held the kernel near
 * half the dot-product rate on an AMD EPYC Zen 4 (M = 16, 512 x 4096 from cache, one
 * thread: 0.12 TFLOP/s). */
BF16_TARGET ALWAYS_INLINE void skinny_columns(const fp8_scaled_mm_params* p, const widen_tables_t* t,
                                              const uint32_t* group, int64_t kp, int64_t n0,
                                              int64_t cols, uint16_t (*panels)[SKINNY_COLS * SKINNY_STEP],
                                              float* sums, const __m512* scale_a_blocks, const int BLOCKED,
                                              const int EIGHT_ROWS) {
  const int64_t k = p->k;
  const skinny_weights_t weights = skinny_weights(p, n0, cols);
  const uint8_t* const* rows = weights.rows;
  const uint8_t* next_block = weights.next_block;
  const int8_t* shifts = weights.shifts;
  int64_t next_line = 0;
  const widen_tables_t first = shifts ? shifted_tables(t, p->b_format, shifts[0]) : *t;
  for (int c = 0; c < SKINNY_COLS; ++c)
    skinny_widen_row(&first, rows[c], k, panels[0] + c * SKINNY_STEP, next_block + 64 * next_line++);
  /* k values per activation vector: 2 (a pair for 16 rows) or 4 (two pairs for 8 rows) */
  const int64_t k_per_vector = EIGHT_ROWS ? 4 : 2;
  /* K-blocked scales: each block of 128 k is summed from zero, and its sums, scaled, join
   * the totals kept in `sums` (in memory: 16 more registers would spill) */
  const int64_t span = BLOCKED ? (int64_t)FP8_SCALE_BLOCK : kp;
  for (int64_t block0 = 0; block0 < kp; block0 += span) {
    const int64_t block_end = kp - block0 < span ? kp : block0 + span;
    __m512 acc[SKINNY_COLS];
    for (int j = 0; j < SKINNY_COLS; ++j) acc[j] = _mm512_setzero_ps();
    for (int64_t k0 = block0; k0 < block_end; k0 += SKINNY_STEP) {
      const int step = (int)((k0 / SKINNY_STEP) & 1);
      const uint32_t* panel = (const uint32_t*)panels[step];
      uint16_t* next = panels[step ^ 1];
      const uint32_t* a = group + (k0 / k_per_vector) * TILE_LANES;
      const int64_t next_k = k0 + SKINNY_STEP;
      const widen_tables_t tables =
          shifts && next_k < kp ? shifted_tables(t, p->b_format, shifts[next_k / FP8_SCALE_BLOCK]) : *t;
      /* 32 k-pairs: per row of the next panel, two vectors of one pair or one of two */
      for (int c = 0; c < SKINNY_COLS; ++c) {
        skinny_widen_row(&tables, rows[c] + next_k, k - next_k, next + c * SKINNY_STEP, next_block + 64 * next_line++);
        for (int v = 0; v < (EIGHT_ROWS ? 1 : 2); ++v) {
          const int vector = EIGHT_ROWS ? c : 2 * c + v;
          const __m512bh av = (__m512bh)_mm512_load_si512(a + vector * TILE_LANES);
          for (int j = 0; j < SKINNY_COLS; ++j) {
            const uint32_t* w = panel + j * (SKINNY_STEP / 2) + (EIGHT_ROWS ? 2 * c : vector);
            const __m512i wv = EIGHT_ROWS ? _mm512_set1_epi64(*(const long long*)w) : _mm512_set1_epi32((int)*w);
            acc[j] = _mm512_dpbf16_ps(acc[j], av, (__m512bh)wv);
          }
        }
      }
    }
    if (!BLOCKED) {
      for (int j = 0; j < SKINNY_COLS; ++j) _mm512_store_ps(sums + j * TILE_LANES, acc[j]);
      continue;
    }
    float block_sums[(int)SKINNY_COLS * TILE_LANES] __attribute__((aligned(64)));
    for (int j = 0; j < SKINNY_COLS; ++j) _mm512_store_ps(block_sums + j * TILE_LANES, acc[j]);
    const int64_t kb = block0 / FP8_SCALE_BLOCK;
    const __m512 scale_a = _mm512_loadu_ps((const float*)(scale_a_blocks + kb));
    skinny_add_block(p, block_sums, scale_a, n0, kb, sums, TILE_LANES);
  }
  if (!EIGHT_ROWS) return;
  /* row r's two lanes added into lane r (lanes 8-15: never stored) */
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 2, 4, 6, 8, 10, 12, 14);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  for (int j = 0; j < SKINNY_COLS; ++j) {
    const __m512 v = _mm512_load_ps(sums + j * TILE_LANES);
    _mm512_store_ps(sums + j * TILE_LANES, _mm512_add_ps(_mm512_permutexvar_ps(even, v), _mm512_permutexvar_ps(odd, v)));
  }
}

/* ---- all groups per step (M = 33-64) -------------------------------------- */

/* With 3 or 4 groups of 16 rows, skinny_columns widened each weight row 3-4 times, once
 * per group, and on an AMD EPYC Zen 5 the widening's shuffles take the dot products'
 * pipes: with no widening at all (wrong results, for the bound) the skinny kernel ran
 * 1.11-1.13x faster at M = 64 (scaled_mm, one thread, 4096 x 4096 and 1536 x 576).
 * skinny_groups widens each step's panel once for all the groups and keeps their sums in
 * memory between steps (16 loads and 16 stores per 1024 dot products). scaled_mm on
 * quantized inputs, 2 threads, AMD EPYC Zen 5, medians of 7 rounds alternated in one
 * process, skinny_columns -> skinny_groups, bit-identical results: M = 64 1.05-1.08x
 * faster on the Llama-3-8B and SmolLM2 shapes (0.55-0.65 -> 0.59-0.70 TFLOP/s), block-
 * wise 1.08-1.11x, M = 48 1.01-1.05x; FP8Linear (bf16 input, its quantization included),
 * 7 rounds: M = 64 1.03-1.06x, M = 48 1.02x. At M = 32 the two were even (0.97-1.02x), at
 * M = 16 skinny_groups was 0.88x (11 rounds), so 1-2 groups keep skinny_columns. */
enum { GROUPS_STEP = 128, GROUPS_MIN = 3 };
/* G is 3 or 4 (FP8_BF16_SKINNY_MAX_ROWS / 16), and a step is one block of K-blocked
 * scales (kb = k0 / 128, one skinny_add_block and one set of shifted tables per step):
 * the array below has a negative size, a compile error, if either stops being true. */
typedef char skinny_groups_fit[(int)FP8_BF16_SKINNY_MAX_ROWS == 4 * (int)TILE_LANES &&
                                       (int)GROUPS_STEP == (int)FP8_SCALE_BLOCK
                                   ? 1
                                   : -1];

/* 16 weight rows from n0 (`cols` of them real) against G groups of 16 activation rows
 * (`group_stride` uint32 apart) over all of K in steps of 128 k: each step's 16 x 128
 * panel was widened during the step before, 32 widen64 calls spread over the first
 * passes (PER per pass, one every INTERVAL iterations of two k-pairs), and each group in
 * turn runs its dot products against it, its 16 x 16 sums loaded from and stored to
 * `sums` ([column][G x 16 rows]) around the pass (K-blocked scales: summed from zero
 * and scaled into `sums` by skinny_add_block, a step being one block of 128 k). The
 * last step may hold 64 k (k_padded: a multiple of 64) and widens nothing. */
BF16_TARGET ALWAYS_INLINE void skinny_groups(const fp8_scaled_mm_params* p, const widen_tables_t* t,
                                             const uint32_t* groups, int64_t group_stride, int64_t kp, int64_t n0,
                                             int64_t cols, uint16_t (*panels)[(int)SKINNY_COLS * GROUPS_STEP],
                                             float* sums, const __m512* scale_a_blocks, int64_t k_blocks,
                                             const int G, const int BLOCKED) {
  const int64_t k = p->k;
  const int64_t rows_total = G * TILE_LANES;
  const skinny_weights_t weights = skinny_weights(p, n0, cols);
  const uint8_t* const* rows = weights.rows;
  const uint8_t* next_block = weights.next_block;
  const int8_t* shifts = weights.shifts;
  int64_t next_line = 0;
  const widen_tables_t first = shifts ? shifted_tables(t, p->b_format, shifts[0]) : *t;
  for (int c = 0; c < SKINNY_COLS; ++c)
    for (int h = 0; h < 2; ++h)
      skinny_widen_row(&first, rows[c] + 64 * h, k - 64 * h, panels[0] + c * GROUPS_STEP + 64 * h,
                       next_block + 64 * next_line++);
  const int PER = G == 4 ? 8 : 16; /* G = 3: 16 in each of the first two passes */
  const int INTERVAL = 32 / PER;
  for (int64_t k0 = 0; k0 < kp; k0 += GROUPS_STEP) {
    const int step = (int)((k0 / GROUPS_STEP) & 1);
    const uint32_t* panel = (const uint32_t*)panels[step];
    uint16_t* next = panels[step ^ 1];
    const int64_t next_k = k0 + GROUPS_STEP;
    /* The step's tables are made from `t` read through a pointer the compiler cannot see
     * through (5 loads per step): with `t` held in registers beside them, GCC was one
     * register short, and the accumulator it kept on the stack chained every second dot
     * product through a store and a load (FP8Linear 4096 x 4096, M = 64, one thread:
     * 10.3 ms per call, skinny_columns ~6). */
    const widen_tables_t* base = t;
    __asm__ volatile("" : "+r"(base));
    const widen_tables_t tables =
        shifts && next_k < kp ? shifted_tables(base, p->b_format, shifts[next_k / FP8_SCALE_BLOCK]) : *base;
    const int iterations = (int)(kp - k0 < GROUPS_STEP ? (kp - k0) / 4 : GROUPS_STEP / 4);
    for (int g = 0; g < G; ++g) {
      float* group_sums = sums + g * TILE_LANES;
      __m512 acc[SKINNY_COLS];
      for (int j = 0; j < SKINNY_COLS; ++j)
        acc[j] = BLOCKED || k0 == 0 ? _mm512_setzero_ps() : _mm512_load_ps(group_sums + j * rows_total);
      const int widens = next_k < kp && g * PER < 32;
      /* pointers stepped, not indexed: with an int pair index GCC sign-extended and
       * recomputed every broadcast's address (3 integer operations per dot product, the
       * kernel at half speed) */
      const uint32_t* a_pair = groups + g * group_stride + (k0 / 2) * TILE_LANES;
      const uint32_t* w_pair = panel;
      for (int i = 0; i < iterations; ++i) {
        if (widens && i % INTERVAL == 0) {
          const int w = g * PER + i / INTERVAL, c = w >> 1, h = w & 1;
          skinny_widen_row(&tables, rows[c] + next_k + 64 * h, k - next_k - 64 * h,
                           next + c * GROUPS_STEP + 64 * h, next_block + 64 * next_line++);
        }
        for (int v = 0; v < 2; ++v) {
          const __m512bh av = (__m512bh)_mm512_load_si512(a_pair);
          for (int j = 0; j < SKINNY_COLS; ++j) {
            const __m512i wv = _mm512_set1_epi32((int)w_pair[j * (GROUPS_STEP / 2)]);
            acc[j] = _mm512_dpbf16_ps(acc[j], av, (__m512bh)wv);
          }
          a_pair += TILE_LANES;
          w_pair += 1;
        }
      }
      if (!BLOCKED) {
        for (int j = 0; j < SKINNY_COLS; ++j) _mm512_store_ps(group_sums + j * rows_total, acc[j]);
        continue;
      }
      float block_sums[(int)SKINNY_COLS * TILE_LANES] __attribute__((aligned(64)));
      for (int j = 0; j < SKINNY_COLS; ++j) _mm512_store_ps(block_sums + j * TILE_LANES, acc[j]);
      const int64_t kb = k0 / FP8_SCALE_BLOCK;
      skinny_add_block(p, block_sums, _mm512_loadu_ps((const float*)(scale_a_blocks + g * k_blocks + kb)), n0, kb,
                       group_sums, rows_total);
    }
  }
}

/* Rows [m_begin, m_end), m_begin a multiple of 16: for each 16 weight rows, every group
 * of 16 activation rows in turn (the weight rows read from memory once, from L1/L2 for
 * the groups after the first, and widened again per group between dot products), or with
 * 3-4 groups all of them per step of K (skinny_groups, each weight widened once).
 * M = 5-8 (the eight-row kernel): one group of 8 rows. */
BF16_TARGET void fp8_bf16_skinny_compute(const fp8_scaled_mm_params* p, const fp8_cpu_mm_plan* plan,
                                         const uint32_t* packed, void* scratch, int64_t m_begin, int64_t m_end,
                                         int64_t n_begin, int64_t n_end) {
  const widen_tables_t t = load_widen_tables(p->b_format);
  const int64_t kp = plan->k_padded;
  uint16_t panels[2][SKINNY_COLS * SKINNY_STEP] __attribute__((aligned(64)));
  float sums[(int)SKINNY_COLS * TILE_LANES] __attribute__((aligned(64)));
  const int blocked = fp8_k_blocked(p);
  /* M = 5-8: all rows in one group packed by pack_activation_rows8 (m_begin = 0) */
  const int eight_rows = plan->m_padded == FP8_BF16_ROWS8;
  /* K-blocked: each group's scale_a per block of 128 k, gathered once here rather than
   * for every 16 weight rows (M = 8, 4096 x 4096 block-wise, 2 threads: ~8% of a call);
   * eight rows: lane 2r + h takes row r's scale */
  __m512* scale_a_blocks = (__m512*)scratch; /* [group][k block] */
  const int64_t k_blocks = (kp + FP8_SCALE_BLOCK - 1) / FP8_SCALE_BLOCK;
  if (blocked)
    for (int64_t m0 = m_begin; m0 < m_end; m0 += TILE_LANES)
      for (int64_t kb = 0; kb < k_blocks; ++kb) {
        const __m512 rows_scale = fp8_block_scale_a16(p, m0, kb);
        _mm512_storeu_ps((float*)(scale_a_blocks + (m0 - m_begin) / TILE_LANES * k_blocks + kb),
                         eight_rows ? _mm512_permutexvar_ps(
                                          _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7), rows_scale)
                                    : rows_scale);
      }
  const int64_t groups = (m_end - m_begin + TILE_LANES - 1) / TILE_LANES;
  if (!eight_rows && groups >= GROUPS_MIN) {
    uint16_t step_panels[2][(int)SKINNY_COLS * GROUPS_STEP] __attribute__((aligned(64)));
    float group_sums[(int)SKINNY_COLS * FP8_BF16_SKINNY_MAX_ROWS] __attribute__((aligned(64)));
    const uint32_t* first = packed + (m_begin / TILE_LANES) * (kp / 2) * TILE_LANES;
    const int64_t stride = (kp / 2) * TILE_LANES;
    for (int64_t n0 = n_begin; n0 < n_end; n0 += SKINNY_COLS) {
      const int64_t cols = n_end - n0 < SKINNY_COLS ? n_end - n0 : SKINNY_COLS;
      float* const s = group_sums;
      if (groups == 3) {
        if (blocked) skinny_groups(p, &t, first, stride, kp, n0, cols, step_panels, s, scale_a_blocks, k_blocks, 3, 1);
        else skinny_groups(p, &t, first, stride, kp, n0, cols, step_panels, s, NULL, k_blocks, 3, 0);
      } else {
        if (blocked) skinny_groups(p, &t, first, stride, kp, n0, cols, step_panels, s, scale_a_blocks, k_blocks, 4, 1);
        else skinny_groups(p, &t, first, stride, kp, n0, cols, step_panels, s, NULL, k_blocks, 4, 0);
      }
      fp8_bf16_tile_epilogue(p, group_sums, fp8_sums_by_column(groups * TILE_LANES), m_begin, m_end, n0, cols);
    }
    return;
  }
  for (int64_t n0 = n_begin; n0 < n_end; n0 += SKINNY_COLS) {
    const int64_t cols = n_end - n0 < SKINNY_COLS ? n_end - n0 : SKINNY_COLS;
    for (int64_t m0 = m_begin; m0 < m_end; m0 += TILE_LANES) {
      const uint32_t* group = packed + (m0 / TILE_LANES) * (kp / 2) * TILE_LANES; /* [pair][16 rows] */
      const __m512* scales = scale_a_blocks + (m0 - m_begin) / TILE_LANES * k_blocks;
      if (eight_rows) {
        if (blocked) skinny_columns(p, &t, group, kp, n0, cols, panels, sums, scales, 1, 1);
        else skinny_columns(p, &t, group, kp, n0, cols, panels, sums, NULL, 0, 1);
      } else {
        if (blocked) skinny_columns(p, &t, group, kp, n0, cols, panels, sums, scales, 1, 0);
        else skinny_columns(p, &t, group, kp, n0, cols, panels, sums, NULL, 0, 0);
      }
      fp8_bf16_tile_epilogue(p, sums, fp8_sums_by_column(TILE_LANES), m0, m_end - m0 < TILE_LANES ? m_end : m0 + TILE_LANES,
                             n0, cols);
    }
  }
}

#endif /* FP8_X86_KERNELS */
