/* scaled_mm with AVX-512 float32 FMA dot products, for AVX-512 CPUs without AVX512-BF16
 * and for float32/float16 activations in weight-only mode (whose products with fp8 are
 * not exact in bf16). The avx2 variant's kernels are in gemm_avx2.c.
 *
 * Activations are widened once into a float32 workspace ([M][k_padded], zero
 * padded); weight rows (contiguous K bytes each, the layout of w.t()) are widened
 * in registers by gathering from the 256-entry decode table, which is exact by
 * construction and small enough to stay in L1. Each output is a dot product over
 * K held in vector partial sums and reduced once at the end.
 */
#include <immintrin.h>
#include <string.h>

#include "cpu_internal.h"

#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
#define ALWAYS_INLINE static inline __attribute__((always_inline))

enum { FLOAT_ROWS = 4, FLOAT_COLS = 4 };

void fp8_float_prepare(const fp8_scaled_mm_params* p, const fp8_cpu_mm_plan* plan, void* workspace,
                       int64_t m_begin, int64_t m_end, float fp8_factor) {
  const float* decode = fp8_decode_table(p->a_format);
  for (int64_t m = m_begin; m < m_end; ++m) {
    float* row = (float*)workspace + m * plan->k_padded;
    for (int64_t k = 0; k < p->k; ++k) {
      const int64_t offset = m * p->a_row_stride + k * p->a_col_stride;
      row[k] = p->a_is_float ? fp8_load_float(p->a, p->a_float_dtype, offset)
                             : decode[((const uint8_t*)p->a)[offset]] * fp8_factor;
    }
    for (int64_t k = p->k; k < plan->k_padded; ++k) row[k] = 0.0f;
  }
}

/* ROWS activation rows x COLS weight rows; 16 k per step. */
AVX512_TARGET ALWAYS_INLINE void dot_block_avx512(const fp8_scaled_mm_params* p, const float* activations,
                                                  int64_t k_padded, const float* decode, int64_t m0, int64_t n0,
                                                  const int ROWS, const int COLS, const int BLOCKED) {
  __m512 acc[FLOAT_ROWS][FLOAT_COLS], total[FLOAT_ROWS][FLOAT_COLS];
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < COLS; ++c) acc[r][c] = total[r][c] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < k_padded; k0 += 16) {
    const __mmask16 mask = p->k - k0 >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (p->k - k0)) - 1u);
    __m512 w[FLOAT_COLS];
    for (int c = 0; c < COLS; ++c) {
      const uint8_t* row = (const uint8_t*)p->b + (n0 + c) * p->b_col_stride + k0;
      const __m512i codes = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mask, row));
      w[c] = _mm512_i32gather_ps(codes, decode, 4); /* padding codes are 0 -> 0.0 */
    }
    for (int r = 0; r < ROWS; ++r) {
      const __m512 a = _mm512_loadu_ps(activations + (m0 + r) * k_padded + k0);
      for (int c = 0; c < COLS; ++c) acc[r][c] = _mm512_fmadd_ps(a, w[c], acc[r][c]);
    }
    /* K-blocked scales: each block's sums, scaled, join the totals lane by lane */
    if (BLOCKED && ((k0 + 16) % FP8_SCALE_BLOCK == 0 || k0 + 16 >= k_padded)) {
      for (int r = 0; r < ROWS; ++r) {
        for (int c = 0; c < COLS; ++c) {
          total[r][c] = _mm512_fmadd_ps(acc[r][c], _mm512_set1_ps(fp8_k_block_scale(p, m0 + r, n0 + c, k0 / FP8_SCALE_BLOCK)), total[r][c]);
          acc[r][c] = _mm512_setzero_ps();
        }
      }
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < COLS; ++c) fp8_store_dot_sum(p, m0 + r, n0 + c, _mm512_reduce_add_ps(BLOCKED ? total[r][c] : acc[r][c]));
}

/* Blocks of up to FLOAT_ROWS activation rows by FLOAT_COLS weight rows, with
 * one-row and one-column tails. */
#define FLOAT_DOT_CALL(BLOCK, ROWS, COLS)                                          \
  do {                                                                             \
    if (blocked) BLOCK(p, a, kp, decode, m0, n, ROWS, COLS, 1);                    \
    else BLOCK(p, a, kp, decode, m0, n, ROWS, COLS, 0);                            \
  } while (0)
#define FLOAT_DOT_DRIVER(NAME, BLOCK, TARGET)                                                          \
  TARGET static void NAME(const fp8_scaled_mm_params* p, const fp8_cpu_mm_plan* plan, const float* a, \
                          int64_t m_begin, int64_t m_end, int64_t n_begin, int64_t n_end) {            \
    const float* decode = fp8_decode_table(p->b_format);                                               \
    const int64_t kp = plan->k_padded;                                                                 \
    const int blocked = fp8_k_blocked(p);                                                              \
    int64_t m0 = m_begin;                                                                              \
    for (; m0 + FLOAT_ROWS <= m_end; m0 += FLOAT_ROWS) {                                               \
      int64_t n = n_begin;                                                                             \
      for (; n + FLOAT_COLS <= n_end; n += FLOAT_COLS) FLOAT_DOT_CALL(BLOCK, FLOAT_ROWS, FLOAT_COLS);   \
      for (; n < n_end; ++n) FLOAT_DOT_CALL(BLOCK, FLOAT_ROWS, 1);                                     \
    }                                                                                                  \
    for (; m0 < m_end; ++m0) {                                                                         \
      int64_t n = n_begin;                                                                             \
      for (; n + FLOAT_COLS <= n_end; n += FLOAT_COLS) FLOAT_DOT_CALL(BLOCK, 1, FLOAT_COLS);            \
      for (; n < n_end; ++n) FLOAT_DOT_CALL(BLOCK, 1, 1);                                              \
    }                                                                                                  \
  }

FLOAT_DOT_DRIVER(float_dot_avx512, dot_block_avx512, AVX512_TARGET)

void fp8_float_compute(const fp8_scaled_mm_params* p, const fp8_cpu_mm_plan* plan, const void* workspace,
                       int64_t m_begin, int64_t m_end, int64_t n_begin, int64_t n_end) {
  float_dot_avx512(p, plan, (const float*)workspace, m_begin, m_end, n_begin, n_end);
}
