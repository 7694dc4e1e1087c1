/* What the AVX2 kernels share (gemm_avx2.c: the dot kernel and the dispatch;
 * gemm_avx2_panel.c: the panel kernel): the target attribute, the register blocks, and
 * the float16 route's widening of fp8 codes (described in gemm_avx2.c). */
#ifndef FP8LINEAR_AVX2_KERNELS_H
#define FP8LINEAR_AVX2_KERNELS_H

#include <immintrin.h>
#include <string.h>

#include "cpu_internal.h"

#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))
#define ALWAYS_INLINE static inline __attribute__((always_inline))

enum { DOT_ROWS = 4, DOT_COLS = 4, PANEL_ROWS = 6, PANEL_COLS = 16 };

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

/* The panel kernel over rows [m_begin, m_end) x weight rows [n_begin, n_end), on the
 * float32 workspace fp8_avx2_panel_prepare filled (gemm_avx2_panel.c). */
void fp8_avx2_panel_compute(const fp8_scaled_mm_params* p, const fp8_cpu_mm_plan* plan, const float* a, void* scratch,
                            int64_t m_begin, int64_t m_end, int64_t n_begin, int64_t n_end);

#endif
