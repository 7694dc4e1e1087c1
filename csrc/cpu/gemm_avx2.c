/* scaled_mm on CPUs with AVX2 + FMA + F16C and no AVX512-BF16 (AMD Zen 2/3, Intel Haswell
 * to Comet Lake; AVX-512 CPUs without AVX512-BF16, Skylake-SP to Ice Lake), and for float32
 * / float16 activations (weight-only layers) on every CPU with AVX2: float32 FMA products
 * over activations widened once into a float32 workspace (fp8_float_prepare, times
 * fp8_avx2_activation_factor; the panel kernel's by fp8_avx2_panel_prepare, which adds a
 * table of block-wise activation scales) and weights widened in registers, by one of two
 * routes.
 *
 * The float16 route (e5m2 weights, or float activations: weight-only layers): an fp8 code
 * becomes float16 bits with a few integer operations (16 codes per register), then
 * float32 through vcvtph2ps. A byte unpack puts each code in the high byte of a 16-bit
 * lane: for e5m2 that is already its float16. For e4m3fn, shifted right by one, the
 * magnitude's exponent (bias 7) lands in float16's exponent field (bias 15) and its
 * mantissa on top of float16's, so the bits read the value times 2^-8, subnormals
 * included, and a multiply by 256 restores it (float activations could overflow if they
 * carried the factor instead). Magnitude 0x7F (NaN) would read 480 * 2^-8: its lane is
 * set to all ones, a float16 NaN. No float32 subnormal is ever formed (the smallest e4m3
 * value times 2^-8 is 2^-17), and vcvtph2ps converts float16 subnormals whatever MXCSR
 * says, so flushed denormals (torch.set_flush_denormal(True)) change nothing. Gathering
 * from the decode table, as before, ran at a quarter of the speed (4096 x 4096 at M = 1
 * from memory, 2 threads, AMD EPYC Zen 3: 9.4 -> 2.0-2.4 ms).
 *
 * The float32 route (e4m3fn weights against fp8 activations, W8A8, the default scheme):
 * each code is loaded into the top byte of a 32-bit lane (an unaligned load 3 bytes before
 * it: four loads cover 32 codes, lane j of load t holding code 4j + t, and the activations
 * are laid out in that order), shifted right by 4 (arithmetic) and masked, which puts its
 * sign on float32's and its 7 magnitude bits on the low exponent and top mantissa bits:
 * the lane reads the value times 2^-120 exactly, e4m3 subnormals as float32 denormals.
 * The activations carry 2^100 (fp8_avx2_activation_factor: fp8 values times 2^100 stay
 * below 2^116) and each sum is multiplied by 2^20 at the end (exact;
 * block-wise calls: each block's sum, before its scales), so every nonzero product is at
 * least 2^-45, far from float32's denormals. Denormal weights must not
 * be read as zero: the kernel clears MXCSR's DAZ bit while it runs and restores it (Zen 3
 * multiplies denormals at full speed). On a Zen 3 vcvtph2ps and the float16 route's
 * shuffles compete with the FMAs for the same two pipes: 32 codes against one activation
 * row took ~8 cycles that way and ~5.5 this way (the instruction sequences timed alone);
 * the dot kernel at M = 1 on weights in L2 (256 x 1024, one thread) went from 23.8 to
 * 18.1 us. NaN codes (magnitude 0x7F) read 480 * 2^-120: the kernel keeps the largest
 * code magnitude of the weight rows it reads (two operations per 32 codes) and makes an
 * output NaN at the end when its weight row holds a NaN code, which is what the product
 * would have made it (NaN times anything, 0 included, is NaN).
 *
 * Two kernels:
 * - dot (the float32 route up to FP8_AVX2_FLOAT32_DOT_MAX_ROWS, the float16 route up to
 *   FP8_AVX2_DOT_MAX_ROWS):
 *   each output a dot product over K in vector partial sums; the rows in blocks of up to
 *   4, each block against 4 (1-2 rows) or 2 (3-4 rows) weight rows at a time, so a block
 *   is one pass over its weights, widened once; the weights in chunks that stay in L2
 *   while every block of rows passes over them.
 * - panel (gemm_avx2_panel.c; above those rows, always by the float16 route): a block of
 *   16 weight rows x FP8_AVX2_KC k is widened and transposed once into a float32 panel
 *   ([k][16]), which a 6 x 16 register block (12 accumulators, 6 broadcast activations, 2
 *   panel loads per k; with AVX-512, 12 x 16 in 12 zmm) then multiplies with every
 *   activation row of the tile: the widening is paid once per tile of rows, not per row.
 *   Sums accumulate in float32 blocks of the tile's rows x 16 in the thread's scratch, for
 *   128 weight rows at a time, so that each K panel of the activations is read from memory
 *   once per 128 weight rows.
 * Both sum per block of FP8_SCALE_BLOCK k when a scale varies along K (block-wise). */
#include "cpu_internal.h" /* FP8_X86_KERNELS */
#if FP8_X86_KERNELS /* the whole file: x86-64 only */

#include "avx2_kernels.h"

/* What the float32 route's activations carry, and its sums are multiplied back by. */
#define FLOAT32_ROUTE_ACTIVATION_FACTOR 0x1p100f
#define FLOAT32_ROUTE_SUM_FACTOR 0x1p20f

/* The float32 route takes e4m3fn weights against fp8 activations (up to
 * FP8_AVX2_FLOAT32_DOT_MAX_ROWS rows; above, the panel kernel's float16 route): those carry
 * its factor exactly (fp8 values are at most 57344, times 2^100); float32/bf16/fp16
 * activations could overflow, and e5m2 weights widen to float16 as they are. */
int fp8_avx2_float32_route(const fp8_scaled_mm_params* p) {
  return p->b_format == FP8_E4M3FN && !p->a_is_float && p->m <= FP8_AVX2_FLOAT32_DOT_MAX_ROWS;
}

float fp8_avx2_activation_factor(const fp8_scaled_mm_params* p) {
  return fp8_avx2_float32_route(p) ? FLOAT32_ROUTE_ACTIVATION_FACTOR : 1.0f;
}

/* The float32 route: vector t (0..3) of the 32 codes at row[0..32) -> codes 4j + t (j =
 * 0..7, lane j) as their values times 2^-120 (NaN codes as 480 * 2^-120). A 32-byte load
 * from row - 3 + t puts code 4j + t in the top byte of lane j (the other three bytes are
 * its neighbours); an arithmetic shift right by 4 moves its magnitude to bits 20-26 and
 * copies its sign over bits 27-31, and the mask keeps bit 31 and bits 20-26. FIRST (the
 * row's first 32 k, where row - 3 may lie before the weights): the same lanes shifted in
 * from `bytes`, row[0..32), 3 - t bytes left within each 128-bit half. The activations are
 * laid out to match (fp8_float_prepare's lanes4). */
AVX2_TARGET ALWAYS_INLINE __m256 widen8_float32_route(const uint8_t* row, __m256i bytes, const int t, const int FIRST) {
  __m256i lanes;
  if (FIRST)
    lanes = t == 0 ? _mm256_slli_si256(bytes, 3) : t == 1 ? _mm256_slli_si256(bytes, 2)
          : t == 2 ? _mm256_slli_si256(bytes, 1) : bytes;
  else
    lanes = _mm256_loadu_si256((const __m256i*)(row - 3 + t));
  return _mm256_castsi256_ps(_mm256_and_si256(_mm256_srai_epi32(lanes, 4), _mm256_set1_epi32((int)0x87F00000u)));
}

/* The 32 codes at row[0..32) -> w[0..4) = codes 0..8, 8..16, 16..24, 24..32 by the float16
 * route (in-lane unpacks leave the codes in the order 0..8, 16..24, 8..16, 24..32: w[1]
 * and w[2] are swapped back here, which costs nothing). The float32 route widens 16 codes
 * at a time in dot_step. */
AVX2_TARGET ALWAYS_INLINE void widen32(const uint8_t* row, __m256 w[4], const fp8_format FORMAT) {
  const __m256i bytes = _mm256_loadu_si256((const __m256i*)row);
  /* e4m3fn: half16's mask clears the low byte, so it may hold a copy of the code (no zero
   * register needed); e5m2 takes its float16 as it is */
  const __m256i low_byte = FORMAT == FP8_E5M2 ? _mm256_setzero_si256() : bytes;
  const __m256i low = half16(_mm256_unpacklo_epi8(low_byte, bytes), FORMAT);
  const __m256i high = half16(_mm256_unpackhi_epi8(low_byte, bytes), FORMAT);
  w[0] = half_to_float(_mm256_castsi256_si128(low), FORMAT);
  w[2] = half_to_float(_mm256_extracti128_si256(low, 1), FORMAT);
  w[1] = half_to_float(_mm256_castsi256_si128(high), FORMAT);
  w[3] = half_to_float(_mm256_extracti128_si256(high, 1), FORMAT);
}

AVX2_TARGET ALWAYS_INLINE float sum8(__m256 v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter)));
}

/* Whether weight row[0..k) holds an e4m3fn NaN code (the float32 route's rare path). */
static int row_has_nan(const uint8_t* row, int64_t k) {
  for (int64_t i = 0; i < k; ++i)
    if ((row[i] & 0x7F) == 0x7F) return 1;
  return 0;
}

/* Partial sums per output: with one activation row, two (each output's FMAs chain
 * through its sums, 4 cycles apiece: 4 weight rows x 2 sums keep 8 chains going). */
enum { DOT_PARTS = 2 };

/* ROWS activation rows x COLS weight rows over the 32 k at k0; the last step of a row
 * (TAIL) reads its end from a zero-padded copy. The float32 route keeps in `nan_max` the
 * largest code magnitude seen (0x7F: a NaN). */
AVX2_TARGET ALWAYS_INLINE void dot_step(const uint8_t* const* weights, int64_t weight_stride, int64_t k,
                                        const float* const* activations, int64_t k0,
                                        __m256 acc[DOT_ROWS][DOT_COLS][DOT_PARTS], __m256i* nan_max,
                                        const int ROWS, const int COLS, const int TAIL, const int BLOCKED,
                                        const fp8_format FORMAT, const int FLOAT32_ROUTE) {
  const int PARTS = ROWS == 1 ? 2 : 1;
  if (!TAIL) {
    /* the same bytes of the next block's rows (harmless past the end: a prefetch never
     * faults). Each weight row is a stream of only K bytes, which the hardware prefetcher
     * picks up late: 1536 x 576 at M = 1 from memory, 2 threads, AMD EPYC Zen 3, 0.25 ->
     * 0.16 ms; a fixed distance ahead in the same rows (1 KiB) or into L2 gained less, and
     * so did 2 or 3 blocks ahead. prefetchnta (to leave the caches to the model's other work
     * between decode calls) changed nothing measurable: SmolLM2 decode, FP8 / bf16 speed,
     * 4 processes each, alternated, medians of 9 rounds: 1.22-1.25 with T0, 1.24-1.27 */
    for (int c = 0; c < COLS; ++c) _mm_prefetch((const char*)weights[c] + COLS * weight_stride + k0, _MM_HINT_T0);
  }
  if (FLOAT32_ROUTE) {
    /* Vector t of each weight row's 32 k (widen8_float32_route) against activations
     * [8t, 8t + 8) of the step, laid out to match: t outermost, so that each activation
     * vector is loaded once for the COLS weight rows; the unrolled loops keep the sums in
     * registers (indexed by t in a loop GCC did not unroll, they went to the stack and the
     * kernel lost its gain). Against sign-extending 8 codes to 32-bit lanes (vpmovsxbd)
     * and shifting them left, which took one shuffle more per 8 codes, this measured (AMD
     * EPYC Zen 1, where 256-bit operations take two 128-bit ones: cpu family 23 model 1,
     * medians of 11 alternations in one process): one thread on weights in L2, M = 1 and
     * 2 1.20x faster (256 x 1024, 512 x 576; the call's fixed ~16 us included), M = 4-16
     * 1.05-1.08x; 2 threads from memory, 4096 x 4096 M = 1 1.29x (10.8 -> 14.0 GB/s), M = 2
     * 1.31x, M = 4 and 16 1.07-1.09x, SmolLM2's layers M = 1 1.12-1.17x, M = 2 1.21-1.23x,
     * M = 4 and 16 1.00-1.04x. Using vpmulhw (the multiply pipe) instead of the shift for
     * two of the four vectors measured 1-2% slower. benchmarks/avx2_widen_peak.c times this
     * loop alone against that and the other widenings tried, all slower on the Zen 1. */
    const uint8_t* rows[DOT_COLS];
    uint8_t tail[DOT_COLS][40] __attribute__((aligned(32)));
    for (int c = 0; c < COLS; ++c) {
      rows[c] = weights[c] + k0;
      if (TAIL) { /* k - k0 is 1..31 here; the copy starts 4 bytes in, so row - 3 is inside it */
        memset(tail[c], 0, sizeof tail[c]);
        memcpy(tail[c] + 4, rows[c], (size_t)(k - k0));
        rows[c] = tail[c] + 4;
      }
    }
    const int first = !TAIL && k0 == 0;
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) {
      __m256 x[DOT_ROWS];
      for (int r = 0; r < ROWS; ++r) x[r] = _mm256_loadu_ps(activations[r] + k0 + 8 * t);
#pragma GCC unroll 4
      for (int c = 0; c < COLS; ++c) {
        const __m256i bytes = _mm256_loadu_si256((const __m256i*)rows[c]); /* the load of t = 3 */
        if (t == 3) *nan_max = _mm256_max_epu8(*nan_max, _mm256_and_si256(bytes, _mm256_set1_epi8(0x7F)));
        const __m256 w = first ? widen8_float32_route(rows[c], bytes, t, 1)
                               : widen8_float32_route(rows[c], bytes, t, 0);
        for (int r = 0; r < ROWS; ++r) {
          __m256* sum = acc[r][c];
          sum[t & (PARTS - 1)] = _mm256_fmadd_ps(x[r], w, sum[t & (PARTS - 1)]);
        }
      }
    }
    return;
  }
  for (int c = 0; c < COLS; ++c) {
    const uint8_t* row = weights[c] + k0;
    uint8_t tail[32] __attribute__((aligned(32)));
    if (TAIL) { /* k - k0 is 1..31 here */
      memset(tail, 0, sizeof tail);
      memcpy(tail, row, (size_t)(k - k0));
      row = tail;
    }
    __m256 w[4];
    widen32(row, w, FORMAT);
    for (int r = 0; r < ROWS; ++r) {
      const float* a = activations[r] + k0;
      __m256* sum = acc[r][c];
      sum[0] = _mm256_fmadd_ps(_mm256_loadu_ps(a), w[0], sum[0]);
      sum[PARTS - 1] = _mm256_fmadd_ps(_mm256_loadu_ps(a + 8), w[1], sum[PARTS - 1]);
      sum[0] = _mm256_fmadd_ps(_mm256_loadu_ps(a + 16), w[2], sum[0]);
      sum[PARTS - 1] = _mm256_fmadd_ps(_mm256_loadu_ps(a + 24), w[3], sum[PARTS - 1]);
    }
  }
}

/* Block-wise: the sums of one block of 128 k, scaled, join the totals; the sums restart.
 * The float32 route's sums are first brought back from their 2^-20 (exact), so that tiny
 * scales cannot push a scaled block sum into float32's denormals. (Not inlined, as a call
 * per block, it made block-wise calls 1.4-1.7x slower: 4096 x 4096, M = 1-256.) Two
 * rewrites of the fold measured slower (one thread, M = 256, N = 512, K = 4096, AMD EPYC
 * Zen 3, 21.0 ms then): the scale products formed first and one broadcast-FMA per sum,
 * 23.2-23.9 ms; the products of 32 blocks at a time formed before the k loop, 31.6 ms.
 * What did help was register allocation: see DOT_F32_FN. Measured after it (19.0-19.2 ms
 * as here; 16.4-16.5 with the fold left out, wrong results, so the fold costs ~15%): each
 * block's 8 sums reduced to one vector (hadd tree) and scaled with one FMA, 19.0-19.3; the
 * scale products built as a vector and broadcast from memory or by vpermps, 20.7-21.3; the
 * activation scales (times 2^20) gathered into a table per call, 18.4-18.5, not kept for
 * its bound on K and the overflow of scales above 2^107 it would need to handle. Later
 * (4096 x 4096, one thread, block-wise / per-channel time, medians of 11 alternations):
 * 1.16-1.17 at M = 4 and 16 as here, 1.12-1.14 with the 2^20 multiply left out (wrong
 * results), 1.17-1.18 with the 2^20 moved onto the scalar scale product behind a check for
 * its overflow (a scalar multiply, compare and branch per sum instead of the vector
 * multiply). */
AVX2_TARGET ALWAYS_INLINE void dot_fold_block(__m256 acc[DOT_ROWS][DOT_COLS][DOT_PARTS],
                                              float total[DOT_ROWS][DOT_COLS][8], const float* const* scale_a,
                                              const float* const* scale_b, int64_t at_a, int64_t at_b,
                                              const int ROWS, const int COLS, const int FLOAT32_ROUTE) {
  const int PARTS = ROWS == 1 ? 2 : 1;
  for (int r = 0; r < ROWS; ++r) {
    for (int c = 0; c < COLS; ++c) {
      const __m256 scale = _mm256_set1_ps(scale_a[r][at_a] * scale_b[c][at_b]);
      __m256 sum = PARTS == 2 ? _mm256_add_ps(acc[r][c][0], acc[r][c][PARTS - 1]) : acc[r][c][0];
      if (FLOAT32_ROUTE) sum = _mm256_mul_ps(sum, _mm256_set1_ps(FLOAT32_ROUTE_SUM_FACTOR));
      _mm256_store_ps(total[r][c], _mm256_fmadd_ps(sum, scale, _mm256_load_ps(total[r][c])));
      for (int h = 0; h < PARTS; ++h) acc[r][c][h] = _mm256_setzero_ps();
    }
  }
}

AVX2_TARGET ALWAYS_INLINE void dot_block(const fp8_scaled_mm_params* p, const float* activations, int64_t k_padded,
                                         int64_t m0, int64_t n0, const int ROWS, const int COLS, const int BLOCKED,
                                         const fp8_format FORMAT, const int FLOAT32_ROUTE) {
  const int PARTS = ROWS == 1 ? 2 : 1;
  const uint8_t* weights[DOT_COLS];
  const float* rows[DOT_ROWS];
  for (int c = 0; c < COLS; ++c) weights[c] = (const uint8_t*)p->b + (n0 + c) * p->b_col_stride;
  for (int r = 0; r < ROWS; ++r) rows[r] = activations + (m0 + r) * k_padded;
  const int64_t k = p->k, weight_stride = p->b_col_stride;
  /* block-wise: each scale as a pointer and a step per block of 128 k; the scaled sums of
   * the blocks so far kept in memory (touched once per 128 k), so that the loop's
   * accumulators and widened weights keep the registers (as __m256 variables, and with
   * fp8_k_block_scale's lookups per block, the block-wise calls took 1.4-2x the
   * per-channel time at M = 2-16) */
  const float* scale_a[DOT_ROWS];
  const float* scale_b[DOT_COLS];
  const int64_t step_a = fp8_k_block_scale_a_step(p), step_b = fp8_k_block_scale_b_step(p);
  if (BLOCKED) {
    for (int r = 0; r < ROWS; ++r) scale_a[r] = fp8_k_block_scale_a_at(p, m0 + r);
    for (int c = 0; c < COLS; ++c) scale_b[c] = fp8_k_block_scale_b_at(p, n0 + c);
  }
  __m256 acc[DOT_ROWS][DOT_COLS][DOT_PARTS];
  __m256i nan_max = _mm256_setzero_si256();
  float total[DOT_ROWS][DOT_COLS][8] __attribute__((aligned(32)));
  for (int r = 0; r < ROWS; ++r) {
    for (int c = 0; c < COLS; ++c) {
      for (int h = 0; h < PARTS; ++h) acc[r][c][h] = _mm256_setzero_ps();
      if (BLOCKED) _mm256_store_ps(total[r][c], _mm256_setzero_ps());
    }
  }
  const int64_t k_full = k & ~(int64_t)31;
#define DOT_STEP(K0, TAIL) \
  dot_step(weights, weight_stride, k, rows, K0, acc, &nan_max, ROWS, COLS, TAIL, BLOCKED, FORMAT, FLOAT32_ROUTE)
  int64_t k0 = 0, kb = 0;
  /* 128 k at a time in straight code (for block-wise calls one block, folded after it) */
  for (; k0 + FP8_SCALE_BLOCK <= k_full; k0 += FP8_SCALE_BLOCK, ++kb) {
    DOT_STEP(k0, 0);
    DOT_STEP(k0 + 32, 0);
    DOT_STEP(k0 + 64, 0);
    DOT_STEP(k0 + 96, 0);
    if (BLOCKED) dot_fold_block(acc, total, scale_a, scale_b, kb * step_a, kb * step_b, ROWS, COLS, FLOAT32_ROUTE);
  }
  /* the rest: less than 128 k (for block-wise calls the last, partial block) */
  if (k0 < k_padded) {
    for (; k0 < k_full; k0 += 32) DOT_STEP(k0, 0);
    if (k0 < k_padded) DOT_STEP(k0, 1);
    if (BLOCKED) dot_fold_block(acc, total, scale_a, scale_b, kb * step_a, kb * step_b, ROWS, COLS, FLOAT32_ROUTE);
  }
#undef DOT_STEP
  float sums[DOT_ROWS][DOT_COLS];
  for (int r = 0; r < ROWS; ++r) {
    for (int c = 0; c < COLS; ++c) {
      const __m256 sum = PARTS == 2 ? _mm256_add_ps(acc[r][c][0], acc[r][c][PARTS - 1]) : acc[r][c][0];
      sums[r][c] = sum8(BLOCKED ? _mm256_load_ps(total[r][c]) : sum);
      if (FLOAT32_ROUTE && !BLOCKED) sums[r][c] *= FLOAT32_ROUTE_SUM_FACTOR; /* blocked: in the fold */
    }
  }
  if (FLOAT32_ROUTE && _mm256_movemask_epi8(_mm256_cmpeq_epi8(nan_max, _mm256_set1_epi8(0x7F))) != 0) {
    for (int c = 0; c < COLS; ++c)
      if (row_has_nan(weights[c], k))
        for (int r = 0; r < ROWS; ++r) sums[r][c] = __builtin_nanf("");
  }
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < COLS; ++c) fp8_store_dot_sum(p, m0 + r, n0 + c, sums[r][c]);
}

/* The float32 route's blocks of rows as functions of their own. Inlined, all of them, into
 * the one large compute function, GCC 12 allocated the block-wise loop's registers badly
 * (a register copy after most FMAs, stack spills); alone, each block's loop keeps its sums
 * and constants in registers. A call per block of 1-4 rows x 1-4 columns costs nothing
 * measurable. Measured alternately, one thread, AMD EPYC Zen 3 (medians of 9, ms):
 *   block-wise   M = 256, N = 512,  K = 4096:  20.9-23.0 -> 19.2-19.5
 *   block-wise   M = 16,  N = 4096, K = 4096:  10.6      -> 9.6-9.7
 *   per-channel  M = 256, N = 512,  K = 4096:  16.9-18.0 -> 16.5-16.6
 *   per-channel  M = 16,  N = 4096, K = 4096:  8.44-8.45 -> 8.46-8.47 */
#define DOT_F32_FN(ROWS, COLS, BLOCKED)                                                                          \
  AVX2_TARGET __attribute__((noinline)) static void dot_f32_##ROWS##_##COLS##_##BLOCKED(                        \
      const fp8_scaled_mm_params* p, const float* a, int64_t kp, int64_t m0, int64_t n) {                      \
    dot_block(p, a, kp, m0, n, ROWS, COLS, BLOCKED, FP8_E4M3FN, 1);                                            \
  }
#define DOT_F32_FNS(ROWS, COLS) DOT_F32_FN(ROWS, COLS, 0) DOT_F32_FN(ROWS, COLS, 1)
DOT_F32_FNS(1, 4)
DOT_F32_FNS(1, 1)
DOT_F32_FNS(2, 4)
DOT_F32_FNS(2, 1)
DOT_F32_FNS(3, 2)
DOT_F32_FNS(3, 1)
DOT_F32_FNS(4, 2)
DOT_F32_FNS(4, 1)

#define DOT_CALL(ROWS, COLS)                                                                 \
  do {                                                                                       \
    if (FLOAT32_ROUTE) {                                                                     \
      if (blocked) dot_f32_##ROWS##_##COLS##_1(p, a, kp, m0, n);                              \
      else dot_f32_##ROWS##_##COLS##_0(p, a, kp, m0, n);                                      \
    } else if (blocked) dot_block(p, a, kp, m0, n, ROWS, COLS, 1, FORMAT, FLOAT32_ROUTE);    \
    else dot_block(p, a, kp, m0, n, ROWS, COLS, 0, FORMAT, FLOAT32_ROUTE);                  \
  } while (0)

/* 4 weight rows at a time against 1-2 activation rows, 2 against 3-4 (accumulators
 * and widened weights within the 16 vector registers) */
#define DOT_ROW_BLOCKS(ROWS, COLS)                                             \
  do {                                                                         \
    for (; n + COLS <= chunk_end; n += COLS) DOT_CALL(ROWS, COLS);             \
    for (; n < chunk_end; ++n) DOT_CALL(ROWS, 1);                              \
  } while (0)

AVX2_TARGET ALWAYS_INLINE void dot_rows(const fp8_scaled_mm_params* p, const fp8_cpu_mm_plan* plan, const float* a,
                                        int64_t m_begin, int64_t m_end, int64_t n_begin, int64_t n_end,
                                        const fp8_format FORMAT, const int FLOAT32_ROUTE) {
  const int64_t kp = plan->k_padded;
  const int blocked = fp8_k_blocked(p);
  /* the weights in chunks of about FP8_AVX2_DOT_CHUNK_BYTES, each chunk against all the
   * rows: every block of 4 rows after the first reads the chunk from L2, not memory */
  int64_t chunk = FP8_AVX2_DOT_CHUNK_BYTES / (kp > 0 ? kp : 1);
  chunk = chunk < 4 ? 4 : chunk & ~(int64_t)3;
  for (int64_t chunk_begin = n_begin; chunk_begin < n_end; chunk_begin += chunk) {
    const int64_t chunk_end = n_end - chunk_begin < chunk ? n_end : chunk_begin + chunk;
    for (int64_t m0 = m_begin; m0 < m_end; m0 += DOT_ROWS) { /* all rows (up to 4) against each weight */
      const int64_t rows = m_end - m0 < DOT_ROWS ? m_end - m0 : DOT_ROWS;
      int64_t n = chunk_begin;
      switch (rows) {
        case 4: DOT_ROW_BLOCKS(4, 2); break;
        case 3: DOT_ROW_BLOCKS(3, 2); break;
        case 2: DOT_ROW_BLOCKS(2, 4); break;
        default: DOT_ROW_BLOCKS(1, 4); break;
      }
    }
  }
}
#undef DOT_ROW_BLOCKS
#undef DOT_CALL

AVX2_TARGET void fp8_avx2_compute(const fp8_scaled_mm_params* p, const fp8_cpu_mm_plan* plan, const void* workspace,
                                  void* scratch, int64_t m_begin, int64_t m_end, int64_t n_begin, int64_t n_end) {
  const float* a = (const float*)workspace;
  if (fp8_avx2_float32_route(p)) { /* the float32 route: the dot kernel */
    /* e4m3 subnormal weights are float32 denormals, which DAZ (torch.set_flush_denormal(True))
     * would read as zero; MXCSR is the thread's own */
    const unsigned int csr = _mm_getcsr();
    enum { DENORMALS_ARE_ZERO = 1u << 6 };
    if (csr & DENORMALS_ARE_ZERO) _mm_setcsr(csr & ~(unsigned int)DENORMALS_ARE_ZERO);
    dot_rows(p, plan, a, m_begin, m_end, n_begin, n_end, FP8_E4M3FN, 1);
    if (csr & DENORMALS_ARE_ZERO) _mm_setcsr(csr);
    return;
  }
  if (plan->method == FP8_MM_AVX2_PANEL) {
    fp8_avx2_panel_compute(p, plan, a, scratch, m_begin, m_end, n_begin, n_end);
  } else if (p->b_format == FP8_E5M2) {
    dot_rows(p, plan, a, m_begin, m_end, n_begin, n_end, FP8_E5M2, 0);
  } else {
    dot_rows(p, plan, a, m_begin, m_end, n_begin, n_end, FP8_E4M3FN, 0); /* e4m3fn against float activations */
  }
}

#endif /* FP8_X86_KERNELS */
