/* scaled_mm on CPUs with AVX2 + FMA + F16C and no AVX-512 (AMD Zen 2/3, Intel Haswell to
 * Comet Lake): float32 FMA products over activations widened once into a float32
 * workspace (fp8_float_prepare, with fp8_avx2_activation_factor) and weights widened in
 * registers.
 *
 * Widening: an fp8 code becomes float16 bits with a few integer operations (16 codes per
 * register), then float32 through vcvtph2ps. A byte unpack puts each code in the high
 * byte of a 16-bit lane: for e5m2 that is already its float16. For e4m3fn, shifted right
 * by one, the magnitude's exponent (bias 7) lands in float16's exponent field (bias 15)
 * and its mantissa on top of float16's, so the bits read the value times 2^-8,
 * subnormals included; adding the sign bit (now bit 14) to itself moves it to bit 15.
 * Magnitude 0x7F (NaN) would read 480 * 2^-8: its lane is set to all ones, a float16
 * NaN. The factor 256 is carried by fp8 activations (widened times 256, exactly) or, for
 * float activations, restored by a multiply. No float32 subnormal is ever formed (the
 * smallest e4m3 value times 2^-8 is 2^-17), and vcvtph2ps converts float16 subnormals
 * whatever MXCSR says, so flushed denormals (torch.set_flush_denormal(True)) change
 * nothing. Gathering from the decode table, as before, ran at a quarter of the speed
 * (4096 x 4096 at M = 1 from memory, 2 threads, AMD EPYC Zen 3: 9.4 -> 2.0-2.4 ms).
 *
 * Two kernels:
 * - dot (M <= FP8_AVX2_DOT_MAX_ROWS): each output a dot product over K in vector partial
 *   sums; the rows in blocks of up to 4, each block against 4 (1-2 rows) or 2 (3-4 rows)
 *   weight rows at a time, so a block is one pass over the weights, widened once.
 * - panel (larger M): a block of 16 weight rows x FP8_AVX2_KC k is widened and transposed
 *   once into a float32 panel ([k][16]), which a 6 x 16 register block (12 accumulators,
 *   6 broadcast activations, 2 panel loads per k) then multiplies with every activation
 *   row of the tile: the widening is paid once per tile of rows, not per row. Sums
 *   accumulate in a float32 block of the tile's rows x 16 in the thread's scratch.
 * Both sum per block of FP8_SCALE_BLOCK k when a scale varies along K (block-wise). */
#include <immintrin.h>
#include <string.h>

#include "cpu_internal.h"

#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))
#define ALWAYS_INLINE static inline __attribute__((always_inline))

enum { DOT_ROWS = 4, DOT_COLS = 4, PANEL_ROWS = 6, PANEL_COLS = 16 };

/* Whether the activations in the workspace carry the factor 256 that e4m3fn weights
 * widened through float16 lack (fp8 activations: exact, their values being at most
 * 57344); float32/bf16/fp16 activations could overflow, so their weights are multiplied
 * back instead (one multiply per 8 weights more). */
static int activations_scaled(const fp8_scaled_mm_params* p) { return p->b_format == FP8_E4M3FN && !p->a_is_float; }

/* 16-bit lanes holding code << 8 -> float16 bits (e4m3fn: the value times 2^-8; NaN codes
 * as all ones, a float16 NaN). */
AVX2_TARGET ALWAYS_INLINE __m256i half16(__m256i high_codes, const fp8_format FORMAT) {
  if (FORMAT == FP8_E5M2) return high_codes;
  const __m256i x = _mm256_srli_epi16(high_codes, 1);
  const __m256i h = _mm256_add_epi16(x, _mm256_and_si256(x, _mm256_set1_epi16(0x4000)));
  const __m256i magnitude = _mm256_set1_epi16(0x3F80);
  return _mm256_or_si256(h, _mm256_cmpeq_epi16(_mm256_and_si256(x, magnitude), magnitude));
}

/* float16 bits -> float32; SCALE: times 256 (e4m3fn weights against unscaled activations). */
AVX2_TARGET ALWAYS_INLINE __m256 half_to_float(__m128i half, const int SCALE) {
  const __m256 v = _mm256_cvtph_ps(half);
  return SCALE ? _mm256_mul_ps(v, _mm256_set1_ps(256.0f)) : v;
}

/* Half H (0 or 1) of the 32 codes at row[0..32), bytes at or past `left` read as 0 (never
 * past the row's end): w[0] = codes 8H .. 8H + 8, w[1] = codes 16 + 8H .. 24 + 8H (the
 * order the in-lane byte unpack leaves them in; the activations are read to match). */
AVX2_TARGET ALWAYS_INLINE void widen_half32(const uint8_t* row, int64_t left, const int H, __m256 w[2],
                                            const fp8_format FORMAT, const int SCALE) {
  __m256i bytes;
  if (left >= 32) {
    bytes = _mm256_loadu_si256((const __m256i*)row);
  } else {
    uint8_t tail[32] = {0};
    if (left > 0) memcpy(tail, row, (size_t)left);
    bytes = _mm256_loadu_si256((const __m256i*)tail);
  }
  const __m256i zero = _mm256_setzero_si256();
  const __m256i high_codes = H ? _mm256_unpackhi_epi8(zero, bytes) : _mm256_unpacklo_epi8(zero, bytes);
  const __m256i half = half16(high_codes, FORMAT);
  w[0] = half_to_float(_mm256_castsi256_si128(half), SCALE);
  w[1] = half_to_float(_mm256_extracti128_si256(half, 1), SCALE);
}

/* The 8 codes at row[0..8) (as widen_half32 for `left`), in order. */
AVX2_TARGET ALWAYS_INLINE __m256 widen8(const uint8_t* row, int64_t left, const fp8_format FORMAT, const int SCALE) {
  uint64_t chunk = 0;
  if (left >= 8) {
    memcpy(&chunk, row, 8);
  } else if (left > 0) {
    memcpy(&chunk, row, (size_t)left);
  }
  const __m128i high_codes = _mm_unpacklo_epi8(_mm_setzero_si128(), _mm_cvtsi64_si128((long long)chunk));
  /* the 256-bit form on the low half: one operation as well on AVX2 CPUs */
  return half_to_float(_mm256_castsi256_si128(half16(_mm256_castsi128_si256(high_codes), FORMAT)), SCALE);
}

float fp8_avx2_activation_factor(const fp8_scaled_mm_params* p) { return activations_scaled(p) ? 256.0f : 1.0f; }

AVX2_TARGET ALWAYS_INLINE float sum8(__m256 v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter)));
}

/* ROWS activation rows x COLS weight rows over half H of the 32 k at k0; the last step
 * of a row (TAIL) reads its end byte by byte. */
AVX2_TARGET ALWAYS_INLINE void dot_step(const uint8_t* const* weights, int64_t weight_stride, int64_t k,
                                        const float* const* activations, int64_t k0, __m256 acc[DOT_ROWS][DOT_COLS],
                                        const int ROWS, const int COLS, const int H, const int TAIL,
                                        const fp8_format FORMAT, const int SCALE) {
  __m256 w[DOT_COLS][2];
  if (!TAIL && H == 0) {
    /* the same bytes of the next block's rows (harmless past the end: a prefetch never
     * faults). Each weight row is a stream of only K bytes, which the hardware prefetcher
     * picks up late: 1536 x 576 at M = 1 from memory, 2 threads, AMD EPYC Zen 3, 0.25 ->
     * 0.16 ms; a fixed distance ahead in the same rows (1 KiB) or into L2 gained less */
    for (int c = 0; c < COLS; ++c) _mm_prefetch((const char*)weights[c] + COLS * weight_stride + k0, _MM_HINT_T0);
  }
  for (int c = 0; c < COLS; ++c) widen_half32(weights[c] + k0, TAIL ? k - k0 : 32, H, w[c], FORMAT, SCALE);
  for (int r = 0; r < ROWS; ++r) {
    const float* a = activations[r] + k0 + 8 * H;
    const __m256 a0 = _mm256_loadu_ps(a), a1 = _mm256_loadu_ps(a + 16);
    for (int c = 0; c < COLS; ++c) acc[r][c] = _mm256_fmadd_ps(a1, w[c][1], _mm256_fmadd_ps(a0, w[c][0], acc[r][c]));
  }
}

AVX2_TARGET ALWAYS_INLINE void dot_block(const fp8_scaled_mm_params* p, const float* activations, int64_t k_padded,
                                         int64_t m0, int64_t n0, const int ROWS, const int COLS, const int BLOCKED,
                                         const fp8_format FORMAT, const int SCALE) {
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
  __m256 acc[DOT_ROWS][DOT_COLS];
  float total[DOT_ROWS][DOT_COLS][8] __attribute__((aligned(32)));
  for (int r = 0; r < ROWS; ++r) {
    for (int c = 0; c < COLS; ++c) {
      acc[r][c] = _mm256_setzero_ps();
      if (BLOCKED) _mm256_store_ps(total[r][c], _mm256_setzero_ps());
    }
  }
  const int64_t k_full = k & ~(int64_t)31;
  for (int64_t k0 = 0, kb = 0; k0 < k_padded; ++kb) {
    /* up to the end of K, or of this block of 128 k */
    const int64_t k_stop = BLOCKED && k0 + FP8_SCALE_BLOCK < k_padded ? k0 + FP8_SCALE_BLOCK : k_padded;
    const int64_t k_stop_full = k_stop < k_full ? k_stop : k_full;
    for (; k0 < k_stop_full; k0 += 32) {
      dot_step(weights, weight_stride, k, rows, k0, acc, ROWS, COLS, 0, 0, FORMAT, SCALE);
      dot_step(weights, weight_stride, k, rows, k0, acc, ROWS, COLS, 1, 0, FORMAT, SCALE);
    }
    for (; k0 < k_stop; k0 += 32) {
      dot_step(weights, weight_stride, k, rows, k0, acc, ROWS, COLS, 0, 1, FORMAT, SCALE);
      dot_step(weights, weight_stride, k, rows, k0, acc, ROWS, COLS, 1, 1, FORMAT, SCALE);
    }
    if (BLOCKED) {
      for (int r = 0; r < ROWS; ++r) {
        for (int c = 0; c < COLS; ++c) {
          const __m256 scale = _mm256_set1_ps(scale_a[r][kb * step_a] * scale_b[c][kb * step_b]);
          _mm256_store_ps(total[r][c], _mm256_fmadd_ps(acc[r][c], scale, _mm256_load_ps(total[r][c])));
          acc[r][c] = _mm256_setzero_ps();
        }
      }
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < COLS; ++c) fp8_store_dot_sum(p, m0 + r, n0 + c, sum8(BLOCKED ? _mm256_load_ps(total[r][c]) : acc[r][c]));
}

#define DOT_CALL(ROWS, COLS)                                                   \
  do {                                                                         \
    if (blocked) dot_block(p, a, kp, m0, n, ROWS, COLS, 1, FORMAT, SCALE);     \
    else dot_block(p, a, kp, m0, n, ROWS, COLS, 0, FORMAT, SCALE);             \
  } while (0)

/* 4 weight rows at a time against 1-2 activation rows, 2 against 3-4 (accumulators
 * and widened weights within the 16 vector registers) */
#define DOT_ROW_BLOCKS(ROWS)                                                   \
  do {                                                                         \
    const int COLS = (ROWS) <= 2 ? 4 : 2;                                      \
    for (; n + COLS <= n_end; n += COLS) DOT_CALL(ROWS, COLS);                 \
    for (; n < n_end; ++n) DOT_CALL(ROWS, 1);                                  \
  } while (0)

AVX2_TARGET ALWAYS_INLINE void dot_rows(const fp8_scaled_mm_params* p, const fp8_cpu_mm_plan* plan, const float* a,
                                        int64_t m_begin, int64_t m_end, int64_t n_begin, int64_t n_end,
                                        const fp8_format FORMAT, const int SCALE) {
  const int64_t kp = plan->k_padded;
  const int blocked = fp8_k_blocked(p);
  for (int64_t m0 = m_begin; m0 < m_end; m0 += DOT_ROWS) { /* all rows (up to 4) against each weight */
    const int64_t rows = m_end - m0 < DOT_ROWS ? m_end - m0 : DOT_ROWS;
    int64_t n = n_begin;
    switch (rows) {
      case 4: DOT_ROW_BLOCKS(4); break;
      case 3: DOT_ROW_BLOCKS(3); break;
      case 2: DOT_ROW_BLOCKS(2); break;
      default: DOT_ROW_BLOCKS(1); break;
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
                                          int64_t k_len, float* panel, const fp8_format FORMAT, const int SCALE) {
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
      for (int j = 0; j < 8; ++j) v[j] = valid[j] ? widen8(rows[j] + k_begin + k, left, FORMAT, SCALE) : _mm256_setzero_ps();
      transpose8(v);
      for (int j = 0; j < 8; ++j) _mm256_store_ps(panel + (k + j) * PANEL_COLS + half * 8, v[j]);
    }
  }
}

/* sums[r][0..16) += (activation rows m0.. x panel over k_len k), ROWS <= 6 rows; with
 * `scales` (block-wise calls) each row's products are scaled first by
 * row_scale[r] * scales[0..16). */
AVX2_TARGET ALWAYS_INLINE void panel_block(const float* a, int64_t lda, const float* panel, int64_t k_len,
                                           float* sums, const float* row_scale, const float* scales,
                                           const int ROWS) {
  __m256 acc[PANEL_ROWS][2];
  for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < k_len; ++k) {
    const __m256 b0 = _mm256_load_ps(panel + k * PANEL_COLS), b1 = _mm256_load_ps(panel + k * PANEL_COLS + 8);
    for (int r = 0; r < ROWS; ++r) {
      const __m256 x = _mm256_broadcast_ss(a + r * lda + k);
      acc[r][0] = _mm256_fmadd_ps(x, b0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(x, b1, acc[r][1]);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    float* s = sums + r * PANEL_COLS;
    if (scales) {
      const __m256 row = _mm256_set1_ps(row_scale[r]);
      _mm256_store_ps(s, _mm256_fmadd_ps(acc[r][0], _mm256_mul_ps(row, _mm256_load_ps(scales)), _mm256_load_ps(s)));
      _mm256_store_ps(s + 8, _mm256_fmadd_ps(acc[r][1], _mm256_mul_ps(row, _mm256_load_ps(scales + 8)), _mm256_load_ps(s + 8)));
    } else {
      _mm256_store_ps(s, _mm256_add_ps(acc[r][0], _mm256_load_ps(s)));
      _mm256_store_ps(s + 8, _mm256_add_ps(acc[r][1], _mm256_load_ps(s + 8)));
    }
  }
}

/* The tile's rows in blocks of 6 (the last one 1-6 rows) against one panel. */
AVX2_TARGET ALWAYS_INLINE void panel_rows(const fp8_scaled_mm_params* p, const float* a, int64_t lda, int64_t m_begin,
                                          int64_t m_end, const float* panel, int64_t k_len, float* sums,
                                          const float* scales, int64_t kb) {
  for (int64_t m0 = m_begin; m0 < m_end; m0 += PANEL_ROWS) {
    const int rows = m_end - m0 < PANEL_ROWS ? (int)(m_end - m0) : PANEL_ROWS;
    float row_scale[PANEL_ROWS];
    if (scales) { /* scale_a of block kb: the scale_b part is in `scales` */
      for (int r = 0; r < rows; ++r) row_scale[r] = fp8_k_block_scale_a(p, m0 + r, kb);
    }
    const float* x = a + m0 * lda;
    float* s = sums + (m0 - m_begin) * PANEL_COLS;
    switch (rows) {
      case 6: panel_block(x, lda, panel, k_len, s, row_scale, scales, 6); break;
      case 5: panel_block(x, lda, panel, k_len, s, row_scale, scales, 5); break;
      case 4: panel_block(x, lda, panel, k_len, s, row_scale, scales, 4); break;
      case 3: panel_block(x, lda, panel, k_len, s, row_scale, scales, 3); break;
      case 2: panel_block(x, lda, panel, k_len, s, row_scale, scales, 2); break;
      default: panel_block(x, lda, panel, k_len, s, row_scale, scales, 1); break;
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
                                             int64_t n_end, const fp8_format FORMAT, const int SCALE) {
  float* panel = (float*)scratch;
  float* scales = panel + panel_floats();
  float* sums = scales + panel_scale_floats();
  const int64_t kp = plan->k_padded;
  const int blocked = fp8_k_blocked(p);
  for (int64_t n0 = n_begin; n0 < n_end; n0 += PANEL_COLS) {
    const int64_t cols = n_end - n0 < PANEL_COLS ? n_end - n0 : PANEL_COLS;
    memset(sums, 0, sizeof(float) * (size_t)((m_end - m_begin) * PANEL_COLS));
    for (int64_t k0 = 0; k0 < kp; k0 += FP8_AVX2_KC) {
      const int64_t k_len = kp - k0 < FP8_AVX2_KC ? kp - k0 : FP8_AVX2_KC;
      fill_panel(p, n0, n_end, k0, k_len, panel, FORMAT, SCALE);
      if (!blocked) {
        panel_rows(p, a + k0, kp, m_begin, m_end, panel, k_len, sums, NULL, 0);
        continue;
      }
      /* block-wise: one pass over the rows per block of 128 k, its sums scaled */
      for (int64_t j = 0; j < k_len; j += FP8_SCALE_BLOCK) {
        const int64_t kb = (k0 + j) / FP8_SCALE_BLOCK;
        float* block_scales = scales + (j / FP8_SCALE_BLOCK) * PANEL_COLS;
        for (int c = 0; c < PANEL_COLS; ++c) block_scales[c] = fp8_k_block_scale_b(p, n0 + (c < cols ? c : 0), kb);
        const int64_t len = k_len - j < FP8_SCALE_BLOCK ? k_len - j : FP8_SCALE_BLOCK;
        panel_rows(p, a + k0 + j, kp, m_begin, m_end, panel + j * PANEL_COLS, len, sums, block_scales, kb);
      }
    }
    panel_epilogue(p, sums, m_begin, m_end, n0, cols);
  }
}

#define AVX2_KERNEL(FORMAT, SCALE)                                                           \
  do {                                                                                       \
    if (panel) panel_compute(p, plan, a, scratch, m_begin, m_end, n_begin, n_end, FORMAT, SCALE); \
    else dot_rows(p, plan, a, m_begin, m_end, n_begin, n_end, FORMAT, SCALE);                 \
  } while (0)

AVX2_TARGET void fp8_avx2_compute(const fp8_scaled_mm_params* p, const fp8_cpu_mm_plan* plan, const void* workspace,
                                  void* scratch, int64_t m_begin, int64_t m_end, int64_t n_begin, int64_t n_end) {
  const float* a = (const float*)workspace;
  const int panel = plan->method == FP8_MM_AVX2_PANEL;
  if (p->b_format == FP8_E5M2) AVX2_KERNEL(FP8_E5M2, 0);
  else if (activations_scaled(p)) AVX2_KERNEL(FP8_E4M3FN, 0);
  else AVX2_KERNEL(FP8_E4M3FN, 1);
}
#undef AVX2_KERNEL
