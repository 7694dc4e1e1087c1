/* The AVX2 panel kernel (FP8_MM_AVX2_PANEL): gemm_avx2.c describes both AVX2 kernels and
 * the float16 route this one widens by; this file is its code. */
#include "cpu_internal.h" /* FP8_X86_KERNELS */
#if FP8_X86_KERNELS /* the whole file: x86-64 only */

#include "avx2_kernels.h"

/* Weight rows whose sums are kept while each panel of FP8_AVX2_KC k passes over them:
 * the tile's activations for that k (up to 256 rows x 1 KiB) are then read from memory
 * once per PANEL_N_BLOCK weight rows and from L2 for the other panels of the block, instead
 * of once per panel of 16 (which made the kernel stream all of its activations again for
 * every 16 weight rows). */
enum { PANEL_N_BLOCK = 128 };

/* The scratch of the panel kernel: the panel, the scales of its k-blocks (block-wise
 * calls), and the float32 sums of the tile's rows x PANEL_N_BLOCK, by panel of 16. */
static int64_t panel_floats(void) { return (int64_t)FP8_AVX2_KC * PANEL_COLS; }
static int64_t panel_scale_floats(void) { return (int64_t)FP8_AVX2_KC / FP8_SCALE_BLOCK * PANEL_COLS; }

int64_t fp8_avx2_scratch_bytes(const fp8_cpu_mm_plan* plan) {
  if (plan->method != FP8_MM_AVX2_PANEL) return 0;
  return (panel_floats() + panel_scale_floats() + plan->tile_m * PANEL_N_BLOCK) * (int64_t)sizeof(float);
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

/* The same blocks with AVX-512 (the avx512 variant and above: AVX-512 CPUs without
 * AVX512-BF16, and float32/float16 activations on the bf16 variants). One zmm holds a panel
 * row's 16 columns, so a block takes up to 12 activation rows (12 accumulators, one panel
 * load and 12 broadcasts per k) where the AVX2 block takes 6 rows in two ymm each. Every
 * output is the same float32 chain in k order with the same scaling per block of 128 k, so
 * both give the same bits (test_avx2.py compares them). */
#define AVX512_TARGET __attribute__((target("avx512f,avx2,fma,f16c")))
enum { PANEL_ROWS_512 = 12 };

AVX512_TARGET ALWAYS_INLINE void panel_block512(const float* a, int64_t lda, const float* panel, int64_t k_len,
                                                float* sums, const float* row_scale, int64_t row_scale_stride,
                                                const float* scales, const int ROWS) {
  const int64_t step = scales ? FP8_SCALE_BLOCK : k_len;
  for (int64_t k0 = 0, j = 0; k0 < k_len; k0 += step, ++j) {
    const int64_t k_end = k_len - k0 < step ? k_len : k0 + step;
    /* named variables, as in panel_block */
    __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0, acc4 = acc0, acc5 = acc0,
           acc6 = acc0, acc7 = acc0, acc8 = acc0, acc9 = acc0, acc10 = acc0, acc11 = acc0;
    for (int64_t k = k0; k < k_end; ++k) {
      const __m512 b = _mm512_loadu_ps(panel + k * PANEL_COLS);
#define PANEL_FMA512(R) \
  if (ROWS > R) acc##R = _mm512_fmadd_ps(_mm512_set1_ps(a[R * lda + k]), b, acc##R);
      PANEL_FMA512(0) PANEL_FMA512(1) PANEL_FMA512(2) PANEL_FMA512(3) PANEL_FMA512(4) PANEL_FMA512(5)
      PANEL_FMA512(6) PANEL_FMA512(7) PANEL_FMA512(8) PANEL_FMA512(9) PANEL_FMA512(10) PANEL_FMA512(11)
#undef PANEL_FMA512
    }
    const __m512 acc[PANEL_ROWS_512] = {acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, acc8, acc9, acc10, acc11};
    for (int r = 0; r < ROWS; ++r) {
      float* s = sums + r * PANEL_COLS;
      if (scales) {
        const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(row_scale[j * row_scale_stride + r]),
                                           _mm512_loadu_ps(scales + j * PANEL_COLS));
        _mm512_storeu_ps(s, _mm512_fmadd_ps(acc[r], scale, _mm512_loadu_ps(s)));
      } else {
        _mm512_storeu_ps(s, _mm512_add_ps(acc[r], _mm512_loadu_ps(s)));
      }
    }
  }
}

#define PANEL_BLOCK512_FN(ROWS)                                                                                  \
  AVX512_TARGET __attribute__((noinline)) static void panel_block512_##ROWS(                                    \
      const float* a, int64_t lda, const float* panel, int64_t k_len, float* sums, const float* row_scale,       \
      int64_t row_scale_stride, const float* scales) {                                                          \
    panel_block512(a, lda, panel, k_len, sums, row_scale, row_scale_stride, scales, ROWS);                     \
  }
PANEL_BLOCK512_FN(1)
PANEL_BLOCK512_FN(2)
PANEL_BLOCK512_FN(3)
PANEL_BLOCK512_FN(4)
PANEL_BLOCK512_FN(5)
PANEL_BLOCK512_FN(6)
PANEL_BLOCK512_FN(7)
PANEL_BLOCK512_FN(8)
PANEL_BLOCK512_FN(9)
PANEL_BLOCK512_FN(10)
PANEL_BLOCK512_FN(11)
PANEL_BLOCK512_FN(12)

typedef void (*panel_block512_fn)(const float*, int64_t, const float*, int64_t, float*, const float*, int64_t,
                                  const float*);
static const panel_block512_fn panel_blocks512[PANEL_ROWS_512 + 1] = {
    NULL,             panel_block512_1, panel_block512_2, panel_block512_3,  panel_block512_4,
    panel_block512_5, panel_block512_6, panel_block512_7, panel_block512_8,  panel_block512_9,
    panel_block512_10, panel_block512_11, panel_block512_12};

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
  fp8_float_prepare(p, plan, workspace, m_begin, m_end); /* never the float32 route's */
  if (!fp8_k_blocked(p)) return;
  float* row_scales = (float*)workspace + p->m * plan->k_padded;
  const int64_t blocks = (p->k + FP8_SCALE_BLOCK - 1) / FP8_SCALE_BLOCK;
  for (int64_t m = m_begin; m < m_end; ++m)
    for (int64_t kb = 0; kb < blocks; ++kb) row_scales[kb * p->m + m] = fp8_k_block_scale_a(p, m, kb);
}

/* The tile's rows in blocks of 6 (the last one 1-6 rows; `wide`: 12 with AVX-512) against one panel; block-wise
 * calls pass the scale_b part of the panel's blocks of 128 k (the first one kb) in
 * `scales` and the table of scale_a in `row_scales`. */
AVX2_TARGET ALWAYS_INLINE void panel_rows(const fp8_scaled_mm_params* p, const float* a, int64_t lda, int64_t m_begin,
                                          int64_t m_end, const float* panel, int64_t k_len, float* sums,
                                          const float* scales, const float* row_scales, int64_t kb, const int wide) {
  if (wide) { /* AVX-512: blocks of 12 rows (the last one 1-12) */
    for (int64_t m0 = m_begin; m0 < m_end; m0 += PANEL_ROWS_512) {
      const int rows = m_end - m0 < PANEL_ROWS_512 ? (int)(m_end - m0) : PANEL_ROWS_512;
      panel_blocks512[rows](a + m0 * lda, lda, panel, k_len, sums + (m0 - m_begin) * PANEL_COLS,
                            scales ? row_scales + kb * p->m + m0 : NULL, p->m, scales);
    }
    return;
  }
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
                                             int64_t n_end, const fp8_format FORMAT, const int wide) {
  float* panel = (float*)scratch;
  float* scales = panel + panel_floats();
  float* sums = scales + panel_scale_floats();
  const int64_t kp = plan->k_padded;
  const int blocked = fp8_k_blocked(p);
  const float* row_scales = a + p->m * kp; /* block-wise: fp8_avx2_panel_prepare's table */
  const int64_t panel_sums = (m_end - m_begin) * PANEL_COLS; /* floats per panel of 16 weight rows */
  for (int64_t block = n_begin; block < n_end; block += PANEL_N_BLOCK) {
    const int64_t block_end = n_end - block < PANEL_N_BLOCK ? n_end : block + PANEL_N_BLOCK;
    const int64_t panels = (block_end - block + PANEL_COLS - 1) / PANEL_COLS;
    memset(sums, 0, sizeof(float) * (size_t)(panels * panel_sums));
    for (int64_t k0 = 0; k0 < kp; k0 += FP8_AVX2_KC) {
      const int64_t k_len = kp - k0 < FP8_AVX2_KC ? kp - k0 : FP8_AVX2_KC;
      for (int64_t n0 = block; n0 < block_end; n0 += PANEL_COLS) {
        float* s = sums + (n0 - block) / PANEL_COLS * panel_sums;
        fill_panel(p, n0, n_end, k0, k_len, panel, FORMAT);
        if (!blocked) {
          panel_rows(p, a + k0, kp, m_begin, m_end, panel, k_len, s, NULL, NULL, 0, wide);
          continue;
        }
        /* block-wise: the scale_b part of the panel's blocks of 128 k, then the rows (each
         * block of rows sums per block of 128 k) */
        const int64_t cols = n_end - n0 < PANEL_COLS ? n_end - n0 : PANEL_COLS;
        for (int64_t j = 0; j < k_len; j += FP8_SCALE_BLOCK) {
          const int64_t kb = (k0 + j) / FP8_SCALE_BLOCK;
          float* block_scales = scales + (j / FP8_SCALE_BLOCK) * PANEL_COLS;
          for (int c = 0; c < PANEL_COLS; ++c) block_scales[c] = fp8_k_block_scale_b(p, n0 + (c < cols ? c : 0), kb);
        }
        panel_rows(p, a + k0, kp, m_begin, m_end, panel, k_len, s, scales, row_scales, k0 / FP8_SCALE_BLOCK, wide);
      }
    }
    for (int64_t n0 = block; n0 < block_end; n0 += PANEL_COLS)
      panel_epilogue(p, sums + (n0 - block) / PANEL_COLS * panel_sums, m_begin, m_end, n0,
                     n_end - n0 < PANEL_COLS ? n_end - n0 : PANEL_COLS);
  }
}

AVX2_TARGET void fp8_avx2_panel_compute(const fp8_scaled_mm_params* p, const fp8_cpu_mm_plan* plan, const float* a,
                                        void* scratch, int64_t m_begin, int64_t m_end, int64_t n_begin, int64_t n_end) {
  const int wide = plan->variant >= FP8_CPU_AVX512; /* every variant from avx512 has AVX-512F */
  if (p->b_format == FP8_E5M2) panel_compute(p, plan, a, scratch, m_begin, m_end, n_begin, n_end, FP8_E5M2, wide);
  else panel_compute(p, plan, a, scratch, m_begin, m_end, n_begin, n_end, FP8_E4M3FN, wide);
}

#endif /* FP8_X86_KERNELS */
