/* scaled_mm on CPUs with AVX2 + FMA + F16C and no AVX512-BF16 (AMD Zen 2/3, Intel Haswell
 * to Comet Lake; AVX-512 CPUs without AVX512-BF16, Skylake-SP to Ice Lake), and for float32
 * / float16 activations (weight-only layers) on every CPU with AVX2: float32 FMA products over activations widened once into a float32
 * workspace (fp8_float_prepare, times fp8_avx2_activation_factor; the panel kernel's by
 * fp8_avx2_panel_prepare, which adds a table of block-wise activation scales) and weights widened in
 * registers, by one of two routes.
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
 * each code is sign-extended into a 32-bit lane (vpmovsxbd), shifted left by 20 and
 * masked, which puts its sign on float32's and its 7 magnitude bits on the low exponent
 * and top mantissa bits: the lane reads the value times 2^-120 exactly, e4m3 subnormals as
 * float32 denormals. The activations carry 2^100 (fp8_avx2_activation_factor: fp8 values
 * times 2^100 stay below 2^116) and each sum is multiplied by 2^20 at the end (exact;
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
 * - panel (above those rows, always by the float16 route): a block of 16 weight rows x
 *   FP8_AVX2_KC k is widened and transposed once into a float32 panel ([k][16]), which a
 *   6 x 16 register block (12 accumulators, 6 broadcast activations, 2 panel loads per k)
 *   then multiplies with every activation row of the tile: the widening is paid once per
 *   tile of rows, not per row. Sums accumulate in a float32 block of the tile's rows x 16
 *   in the thread's scratch.
 * Both sum per block of FP8_SCALE_BLOCK k when a scale varies along K (block-wise). */
#include <immintrin.h>
#include <string.h>

#include "cpu_internal.h"

#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))
#define ALWAYS_INLINE static inline __attribute__((always_inline))

enum { DOT_ROWS = 4, DOT_COLS = 4, PANEL_ROWS = 6, PANEL_COLS = 16 };

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

/* 16-bit lanes holding code << 8 -> float16 bits (e4m3fn: the value times 2^-8; the low
 * byte may hold anything, the mask clears it). The arithmetic shift copies the sign into
 * bit 14 as well, where the mask clears it; NaN codes become all ones (a float16 NaN). */
AVX2_TARGET ALWAYS_INLINE __m256i half16(__m256i high_codes, const fp8_format FORMAT) {
  if (FORMAT == FP8_E5M2) return high_codes;
  const __m256i h = _mm256_and_si256(_mm256_srai_epi16(high_codes, 1), _mm256_set1_epi16((short)0xBF80));
  const __m256i magnitude = _mm256_set1_epi16(0x3F80);
  return _mm256_or_si256(h, _mm256_cmpeq_epi16(_mm256_and_si256(h, magnitude), magnitude));
}

/* float16 bits (half16's) -> float32: e4m3fn's times 256, which brings them back to the
 * weight's value. */
AVX2_TARGET ALWAYS_INLINE __m256 half_to_float(__m128i half, const fp8_format FORMAT) {
  const __m256 v = _mm256_cvtph_ps(half);
  return FORMAT == FP8_E4M3FN ? _mm256_mul_ps(v, _mm256_set1_ps(256.0f)) : v;
}

/* The float32 route: 8 e4m3fn codes at row[0..8) -> their values times 2^-120, in order
 * (NaN codes as 480 * 2^-120). */
AVX2_TARGET ALWAYS_INLINE __m256 widen8_float32_route(const uint8_t* row) {
  const __m256i lanes = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)row));
  return _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(lanes, 20), _mm256_set1_epi32((int)0x87F00000u)));
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

/* The 8 codes at row[0..8) (bytes at or past `left` read as 0), in order, by the float16
 * route (NaN codes as NaN). */
AVX2_TARGET ALWAYS_INLINE __m256 widen8(const uint8_t* row, int64_t left, const fp8_format FORMAT) {
  uint64_t chunk = 0;
  if (left >= 8) {
    memcpy(&chunk, row, 8);
  } else if (left > 0) {
    memcpy(&chunk, row, (size_t)left);
  }
  const __m128i high_codes = _mm_unpacklo_epi8(_mm_setzero_si128(), _mm_cvtsi64_si128((long long)chunk));
  /* the 256-bit form on the low half: one operation as well on AVX2 CPUs */
  return half_to_float(_mm256_castsi256_si128(half16(_mm256_castsi128_si256(high_codes), FORMAT)), FORMAT);
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
  for (int c = 0; c < COLS; ++c) {
    const uint8_t* row = weights[c] + k0;
    uint8_t tail[32] __attribute__((aligned(32)));
    if (TAIL) { /* k - k0 is 1..31 here */
      memset(tail, 0, sizeof tail);
      memcpy(tail, row, (size_t)(k - k0));
      row = tail;
    }
    if (FLOAT32_ROUTE) {
      const __m256i bytes = _mm256_loadu_si256((const __m256i*)row);
      *nan_max = _mm256_max_epu8(*nan_max, _mm256_and_si256(bytes, _mm256_set1_epi8(0x7F)));
      /* 16 codes at a time: two widened vectors live, not four. With 8 sums and the
       * route's constants, four left the 4 x 2 block's loop 14 stack accesses per 128 k,
       * two leave 2 (4096 x 4096 per-channel, M = 16 4.59-4.75 -> 4.35-4.46 ms, M = 256
       * 72.1-72.2 -> 70.0-71.0 ms). Block-wise calls ran 4-7% slower this way while their
       * blocks were inlined into one large function; as functions of their own (below,
       * DOT_F32_FN) they gain from it too */
      for (int half = 0; half < 2; ++half) {
        const __m256 w0 = widen8_float32_route(row + 16 * half), w1 = widen8_float32_route(row + 16 * half + 8);
        for (int r = 0; r < ROWS; ++r) {
          const float* a = activations[r] + k0 + 16 * half;
          __m256* sum = acc[r][c];
          sum[0] = _mm256_fmadd_ps(_mm256_loadu_ps(a), w0, sum[0]);
          sum[PARTS - 1] = _mm256_fmadd_ps(_mm256_loadu_ps(a + 8), w1, sum[PARTS - 1]);
        }
      }
      continue;
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

/* The scratch of the panel kernel: the panel, the scales of its k-blocks (block-wise
 * calls), and the float32 sums of the tile's rows x 16. */
static int64_t panel_floats(void) { return (int64_t)FP8_AVX2_KC * PANEL_COLS; }
static int64_t panel_scale_floats(void) { return (int64_t)FP8_AVX2_KC / FP8_SCALE_BLOCK * PANEL_COLS; }

int64_t fp8_avx2_scratch_bytes(const fp8_cpu_mm_plan* plan) {
  if (plan->method != FP8_MM_AVX2_PANEL) return 0;
  return (panel_floats() + panel_scale_floats() + plan->tile_m * PANEL_COLS) * (int64_t)sizeof(float);
}

/* 8 x 8 floats: v[i] holds row i on entry, column i on return. */
AVX2_TARGET ALWAYS_INLINE void transpose8(__m256 v[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(v[i], v[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(v[i], v[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    v[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

/* panel[k][c] = weight row n0 + c at k = k_begin + k, for k < k_len (a multiple of 8) and
 * c < 16; rows at or past n_end and k at or past K read as 0. */
AVX2_TARGET ALWAYS_INLINE void fill_panel(const fp8_scaled_mm_params* p, int64_t n0, int64_t n_end, int64_t k_begin,
                                          int64_t k_len, float* panel, const fp8_format FORMAT) {
  for (int half = 0; half < 2; ++half) {
    const uint8_t* rows[8];
    int valid[8];
    for (int j = 0; j < 8; ++j) {
      const int64_t n = n0 + half * 8 + j;
      valid[j] = n < n_end;
      rows[j] = (const uint8_t*)p->b + (valid[j] ? n : n0) * p->b_col_stride;
    }
    for (int64_t k = 0; k < k_len; k += 8) {
      const int64_t left = p->k - (k_begin + k);
      __m256 v[8];
      for (int j = 0; j < 8; ++j) v[j] = valid[j] ? widen8(rows[j] + k_begin + k, left, FORMAT) : _mm256_setzero_ps();
      transpose8(v);
      for (int j = 0; j < 8; ++j) _mm256_store_ps(panel + (k + j) * PANEL_COLS + half * 8, v[j]);
    }
  }
}

/* sums[r][0..16) += (activation rows m0.. x panel over k_len k), ROWS <= 6 rows. With
 * `scales` (block-wise calls) the products are summed per block of 128 k, and block j's
 * sums scaled by row_scale[r] * scales[j * 16 + c] before they
 * join `sums`: one call per panel, as for the other calls (a call per block of 128 k, as
 * before, measured within 1% of it: 4096 x 4096, M = 256, one thread, AMD EPYC Zen 3). */
AVX2_TARGET ALWAYS_INLINE void panel_block(const float* a, int64_t lda, const float* panel, int64_t k_len,
                                           float* sums, const float* row_scale, int64_t row_scale_stride,
                                           const float* scales, const int ROWS) {
  const int64_t step = scales ? FP8_SCALE_BLOCK : k_len;
  for (int64_t k0 = 0, j = 0; k0 < k_len; k0 += step, ++j) {
    const int64_t k_end = k_len - k0 < step ? k_len : k0 + step;
    /* the accumulators as named variables: as an array, built with -fwrapv (as Python's
     * flags build extensions), GCC 12 kept a copy of it on the stack, 12 stores per k step,
     * which halved the loop's speed */
    __m256 acc0_0 = _mm256_setzero_ps(), acc0_1 = acc0_0, acc1_0 = acc0_0, acc1_1 = acc0_0, acc2_0 = acc0_0,
           acc2_1 = acc0_0, acc3_0 = acc0_0, acc3_1 = acc0_0, acc4_0 = acc0_0, acc4_1 = acc0_0, acc5_0 = acc0_0,
           acc5_1 = acc0_0;
    for (int64_t k = k0; k < k_end; ++k) {
      const __m256 b0 = _mm256_load_ps(panel + k * PANEL_COLS), b1 = _mm256_load_ps(panel + k * PANEL_COLS + 8);
#define PANEL_FMA(R)                                                 \
  if (ROWS > R) {                                                    \
    const __m256 x = _mm256_broadcast_ss(a + R * lda + k);           \
    acc##R##_0 = _mm256_fmadd_ps(x, b0, acc##R##_0);                 \
    acc##R##_1 = _mm256_fmadd_ps(x, b1, acc##R##_1);                 \
  }
      PANEL_FMA(0) PANEL_FMA(1) PANEL_FMA(2) PANEL_FMA(3) PANEL_FMA(4) PANEL_FMA(5)
#undef PANEL_FMA
    }
    const __m256 acc[PANEL_ROWS][2] = {{acc0_0, acc0_1}, {acc1_0, acc1_1}, {acc2_0, acc2_1},
                                       {acc3_0, acc3_1}, {acc4_0, acc4_1}, {acc5_0, acc5_1}};
    for (int r = 0; r < ROWS; ++r) {
      float* s = sums + r * PANEL_COLS;
      if (scales) {
        const __m256 row = _mm256_set1_ps(row_scale[j * row_scale_stride + r]);
        const float* col = scales + j * PANEL_COLS;
        _mm256_store_ps(s, _mm256_fmadd_ps(acc[r][0], _mm256_mul_ps(row, _mm256_load_ps(col)), _mm256_load_ps(s)));
        _mm256_store_ps(s + 8, _mm256_fmadd_ps(acc[r][1], _mm256_mul_ps(row, _mm256_load_ps(col + 8)), _mm256_load_ps(s + 8)));
      } else {
        _mm256_store_ps(s, _mm256_add_ps(acc[r][0], _mm256_load_ps(s)));
        _mm256_store_ps(s + 8, _mm256_add_ps(acc[r][1], _mm256_load_ps(s + 8)));
      }
    }
  }
}

/* panel_block for each number of rows, as functions of their own: inlined into the large
 * compute function, the e4m3fn copy of its loop kept an accumulator on the stack (a store
 * and a reload of it per k step) and ran at half the e5m2 copy's speed (one thread, AMD
 * EPYC Zen 3, M = 256, N = 512, K = 4096, built without -fwrapv: 25.3 ms against 12.0). */
#define PANEL_BLOCK_FN(ROWS)                                                                                     \
  AVX2_TARGET __attribute__((noinline)) static void panel_block_##ROWS(const float* a, int64_t lda,              \
                                                                      const float* panel, int64_t k_len,         \
                                                                      float* sums, const float* row_scale,       \
                                                                      int64_t row_scale_stride,                  \
                                                                      const float* scales) {                     \
    panel_block(a, lda, panel, k_len, sums, row_scale, row_scale_stride, scales, ROWS);                        \
  }
PANEL_BLOCK_FN(1)
PANEL_BLOCK_FN(2)
PANEL_BLOCK_FN(3)
PANEL_BLOCK_FN(4)
PANEL_BLOCK_FN(5)
PANEL_BLOCK_FN(6)

/* Block-wise calls: the activations' scales as a table [block of 128 k][row] after the
 * float32 activations in the workspace, so that each block of rows finds its rows' scales
 * side by side. Looked up per block of 6 rows and 128 k, they took ~3% of a block-wise
 * call's time, more than the scaled adds of the sums (M = 256, 4096 x 4096). */
static int64_t panel_row_scale_floats(const fp8_scaled_mm_params* p) {
  return fp8_k_blocked(p) ? (p->k + FP8_SCALE_BLOCK - 1) / FP8_SCALE_BLOCK * p->m : 0;
}

int64_t fp8_avx2_panel_workspace_bytes(const fp8_scaled_mm_params* p, const fp8_cpu_mm_plan* plan) {
  return (p->m * plan->k_padded + panel_row_scale_floats(p)) * (int64_t)sizeof(float);
}

void fp8_avx2_panel_prepare(const fp8_scaled_mm_params* p, const fp8_cpu_mm_plan* plan, void* workspace,
                            int64_t m_begin, int64_t m_end) {
  fp8_float_prepare(p, plan, workspace, m_begin, m_end, fp8_avx2_activation_factor(p));
  if (!fp8_k_blocked(p)) return;
  float* row_scales = (float*)workspace + p->m * plan->k_padded;
  const int64_t blocks = (p->k + FP8_SCALE_BLOCK - 1) / FP8_SCALE_BLOCK;
  for (int64_t m = m_begin; m < m_end; ++m)
    for (int64_t kb = 0; kb < blocks; ++kb) row_scales[kb * p->m + m] = fp8_k_block_scale_a(p, m, kb);
}

/* The tile's rows in blocks of 6 (the last one 1-6 rows) against one panel; block-wise
 * calls pass the scale_b part of the panel's blocks of 128 k (the first one kb) in
 * `scales` and the table of scale_a in `row_scales`. */
AVX2_TARGET ALWAYS_INLINE void panel_rows(const fp8_scaled_mm_params* p, const float* a, int64_t lda, int64_t m_begin,
                                          int64_t m_end, const float* panel, int64_t k_len, float* sums,
                                          const float* scales, const float* row_scales, int64_t kb) {
  for (int64_t m0 = m_begin; m0 < m_end; m0 += PANEL_ROWS) {
    const int rows = m_end - m0 < PANEL_ROWS ? (int)(m_end - m0) : PANEL_ROWS;
    const float* row_scale = scales ? row_scales + kb * p->m + m0 : NULL;
    const float* x = a + m0 * lda;
    float* s = sums + (m0 - m_begin) * PANEL_COLS;
    switch (rows) {
      case 6: panel_block_6(x, lda, panel, k_len, s, row_scale, p->m, scales); break;
      case 5: panel_block_5(x, lda, panel, k_len, s, row_scale, p->m, scales); break;
      case 4: panel_block_4(x, lda, panel, k_len, s, row_scale, p->m, scales); break;
      case 3: panel_block_3(x, lda, panel, k_len, s, row_scale, p->m, scales); break;
      case 2: panel_block_2(x, lda, panel, k_len, s, row_scale, p->m, scales); break;
      default: panel_block_1(x, lda, panel, k_len, s, row_scale, p->m, scales); break;
    }
  }
}

/* float32 -> bf16, round to nearest even, NaN kept quiet (as fp8_float_to_bf16). */
AVX2_TARGET ALWAYS_INLINE __m128i float8_to_bf16(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  const __m256i bits = _mm256_blendv_epi8(rounded, quiet, nan);
  /* the low 16 bits of each lane, in order */
  const __m256i packed = _mm256_packus_epi32(bits, bits); /* values < 65536: no saturation */
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

/* The sums of rows [m_begin, m_end) x columns n0 .. n0 + cols (cols <= 16) -> out. */
AVX2_TARGET ALWAYS_INLINE void panel_epilogue(const fp8_scaled_mm_params* p, const float* sums, int64_t m_begin,
                                              int64_t m_end, int64_t n0, int64_t cols) {
  float col_scale[PANEL_COLS] __attribute__((aligned(32))), bias[PANEL_COLS] __attribute__((aligned(32)));
  const int blocked = fp8_k_blocked(p);
  for (int c = 0; c < PANEL_COLS; ++c) {
    const int64_t n = n0 + (c < cols ? c : 0);
    col_scale[c] = blocked ? 1.0f : fp8_scale_b(p, n);
    bias[c] = p->bias ? fp8_load_float(p->bias, p->bias_dtype, n) : 0.0f;
  }
  for (int64_t m = m_begin; m < m_end; ++m) {
    const float row_scale = blocked ? 1.0f : fp8_scale_a(p, m);
    const float* s = sums + (m - m_begin) * PANEL_COLS;
    float values[PANEL_COLS] __attribute__((aligned(32)));
    for (int h = 0; h < PANEL_COLS; h += 8) {
      const __m256 scale = _mm256_mul_ps(_mm256_set1_ps(row_scale), _mm256_load_ps(col_scale + h));
      _mm256_store_ps(values + h, _mm256_fmadd_ps(_mm256_load_ps(s + h), scale, _mm256_load_ps(bias + h)));
    }
    const int64_t at = m * p->out_row_stride + n0;
    if (cols == PANEL_COLS && p->out_dtype == FP8_BFLOAT16) {
      uint16_t* out = (uint16_t*)p->out + at;
      _mm_storeu_si128((__m128i*)out, float8_to_bf16(_mm256_load_ps(values)));
      _mm_storeu_si128((__m128i*)(out + 8), float8_to_bf16(_mm256_load_ps(values + 8)));
    } else if (cols == PANEL_COLS && p->out_dtype == FP8_FLOAT32) {
      memcpy((float*)p->out + at, values, sizeof values);
    } else {
      for (int64_t c = 0; c < cols; ++c) fp8_store_float(p->out, p->out_dtype, at + c, values[c]);
    }
  }
}

AVX2_TARGET ALWAYS_INLINE void panel_compute(const fp8_scaled_mm_params* p, const fp8_cpu_mm_plan* plan, const float* a,
                                             void* scratch, int64_t m_begin, int64_t m_end, int64_t n_begin,
                                             int64_t n_end, const fp8_format FORMAT) {
  float* panel = (float*)scratch;
  float* scales = panel + panel_floats();
  float* sums = scales + panel_scale_floats();
  const int64_t kp = plan->k_padded;
  const int blocked = fp8_k_blocked(p);
  const float* row_scales = a + p->m * kp; /* block-wise: fp8_avx2_panel_prepare's table */
  for (int64_t n0 = n_begin; n0 < n_end; n0 += PANEL_COLS) {
    const int64_t cols = n_end - n0 < PANEL_COLS ? n_end - n0 : PANEL_COLS;
    memset(sums, 0, sizeof(float) * (size_t)((m_end - m_begin) * PANEL_COLS));
    for (int64_t k0 = 0; k0 < kp; k0 += FP8_AVX2_KC) {
      const int64_t k_len = kp - k0 < FP8_AVX2_KC ? kp - k0 : FP8_AVX2_KC;
      fill_panel(p, n0, n_end, k0, k_len, panel, FORMAT);
      if (!blocked) {
        panel_rows(p, a + k0, kp, m_begin, m_end, panel, k_len, sums, NULL, NULL, 0);
        continue;
      }
      /* block-wise: the scale_b part of the panel's blocks of 128 k, then the rows (each
       * block of rows sums per block of 128 k) */
      for (int64_t j = 0; j < k_len; j += FP8_SCALE_BLOCK) {
        const int64_t kb = (k0 + j) / FP8_SCALE_BLOCK;
        float* block_scales = scales + (j / FP8_SCALE_BLOCK) * PANEL_COLS;
        for (int c = 0; c < PANEL_COLS; ++c) block_scales[c] = fp8_k_block_scale_b(p, n0 + (c < cols ? c : 0), kb);
      }
      panel_rows(p, a + k0, kp, m_begin, m_end, panel, k_len, sums, scales, row_scales, k0 / FP8_SCALE_BLOCK);
    }
    panel_epilogue(p, sums, m_begin, m_end, n0, cols);
  }
}

#define AVX2_KERNEL(FORMAT)                                                                 \
  do {                                                                                       \
    if (panel) panel_compute(p, plan, a, scratch, m_begin, m_end, n_begin, n_end, FORMAT);   \
    else dot_rows(p, plan, a, m_begin, m_end, n_begin, n_end, FORMAT, 0);                    \
  } while (0)

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
  const int panel = plan->method == FP8_MM_AVX2_PANEL;
  if (p->b_format == FP8_E5M2) AVX2_KERNEL(FP8_E5M2);
  else AVX2_KERNEL(FP8_E4M3FN); /* e4m3fn weights against float activations */
}
#undef AVX2_KERNEL
