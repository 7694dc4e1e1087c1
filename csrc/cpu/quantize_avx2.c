/* quantize_fp8 inner loops with AVX2 + FMA + F16C: 8 elements a step, the same
 * lane-wise encoding as the AVX-512 file. Tails go to the scalar loop. */
#include "cpu_internal.h" /* FP8_X86_KERNELS */
#if FP8_X86_KERNELS /* the whole file: x86-64 only */

#include <immintrin.h>

#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))

AVX2_TARGET static inline __m256 load8(const void* x, fp8_float_dtype dtype, int64_t i) {
  switch (dtype) {
    case FP8_BFLOAT16: {
      const __m128i h = _mm_loadu_si128((const __m128i*)((const uint16_t*)x + i));
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    case FP8_FLOAT16:
      return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)((const uint16_t*)x + i)));
    default: return _mm256_loadu_ps((const float*)x + i);
  }
}

AVX2_TARGET uint32_t fp8_span_amax_avx2(const void* x, fp8_float_dtype dtype, int64_t n) {
  const __m256i magnitude_mask = _mm256_set1_epi32(0x7FFFFFFF);
  const __m256i inf_bits = _mm256_set1_epi32(0x7F800000);
  __m256i amax0 = _mm256_setzero_si256(), amax1 = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i m0 = _mm256_and_si256(_mm256_castps_si256(load8(x, dtype, i)), magnitude_mask);
    const __m256i m1 = _mm256_and_si256(_mm256_castps_si256(load8(x, dtype, i + 8)), magnitude_mask);
    /* magnitudes are < 2^31, so signed compares order them; non-finite lanes become 0 */
    amax0 = _mm256_max_epi32(amax0, _mm256_and_si256(m0, _mm256_cmpgt_epi32(inf_bits, m0)));
    amax1 = _mm256_max_epi32(amax1, _mm256_and_si256(m1, _mm256_cmpgt_epi32(inf_bits, m1)));
  }
  uint32_t lanes[8];
  _mm256_storeu_si256((__m256i*)lanes, _mm256_max_epi32(amax0, amax1));
  uint32_t amax_bits = fp8_span_amax_scalar((const char*)x + i * fp8_float_bytes(dtype), dtype, n - i);
  for (int l = 0; l < 8; ++l)
    if (lanes[l] > amax_bits) amax_bits = lanes[l];
  return amax_bits;
}

AVX2_TARGET static inline __m128i encode8(__m256 y, fp8_format format) {
  const int mantissa_bits = format == FP8_E4M3FN ? 3 : 2;
  const int bias = format == FP8_E4M3FN ? 7 : 15;
  const int shift = 23 - mantissa_bits;
  const __m256i u = _mm256_castps_si256(y);
  const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(u, 24), _mm256_set1_epi32(0x80));
  const __m256i magnitude = _mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF));
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(magnitude, shift), _mm256_set1_epi32(1));
  __m256i code = _mm256_add_epi32(magnitude, _mm256_set1_epi32((int)((uint32_t)(bias - 127) << 23)));
  code = _mm256_add_epi32(code, _mm256_add_epi32(_mm256_set1_epi32((1 << (shift - 1)) - 1), odd));
  code = _mm256_srli_epi32(code, shift);
  const __m256i magic_bits = _mm256_set1_epi32((127 + 1 - bias - mantissa_bits + 23) << 23);
  const __m256 sum = _mm256_add_ps(_mm256_castsi256_ps(magnitude), _mm256_castsi256_ps(magic_bits));
  const __m256i subnormal_code = _mm256_sub_epi32(_mm256_castps_si256(sum), magic_bits);
  const __m256i is_subnormal = _mm256_cmpgt_epi32(_mm256_set1_epi32((127 + 1 - bias) << 23), magnitude);
  code = _mm256_blendv_epi8(code, subnormal_code, is_subnormal);
  const __m256i max_bits_minus_one = _mm256_set1_epi32((int)fp8_float_bits(fp8_format_max(format)) - 1);
  const __m256i saturates = _mm256_cmpgt_epi32(magnitude, max_bits_minus_one);
  const __m256i max_code = _mm256_set1_epi32(format == FP8_E4M3FN ? FP8_E4M3FN_MAX_CODE : FP8_E5M2_MAX_CODE);
  code = _mm256_blendv_epi8(code, max_code, saturates);
  const __m256i is_nan = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7F800000));
  code = _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7F), is_nan);
  code = _mm256_or_si256(code, sign);
  const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(code), _mm256_extracti128_si256(code, 1));
  return _mm_packus_epi16(words, words);
}

AVX2_TARGET void fp8_span_quantize_avx2(const void* x, fp8_float_dtype dtype, int64_t n,
                                        float scale, uint8_t* q, fp8_format format) {
  const __m256 divisor = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 y = _mm256_div_ps(load8(x, dtype, i), divisor);
    _mm_storel_epi64((__m128i*)(q + i), encode8(y, format));
  }
  fp8_span_quantize_scalar((const char*)x + i * fp8_float_bytes(dtype), dtype, n - i,
                           scale, q + i, format);
}

#endif /* FP8_X86_KERNELS */
