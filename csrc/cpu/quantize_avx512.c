/* quantize_fp8 inner loops with AVX-512 (F, BW, VL, DQ): 16 elements a step.
 * The encoding is the scalar encoder of fp8.h done lane-wise on the float bits,
 * so both round once, to nearest even, from the float32 quotient. */
#include "cpu_internal.h" /* FP8_X86_KERNELS */
#if FP8_X86_KERNELS /* the whole file: x86-64 only */

#include <immintrin.h>

#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,f16c,fma")))

AVX512_TARGET static inline __m512 load16(const void* x, fp8_float_dtype dtype, int64_t i,
                                          __mmask16 mask) {
  switch (dtype) {
    case FP8_BFLOAT16: {
      const __m256i h = _mm256_maskz_loadu_epi16(mask, (const uint16_t*)x + i);
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    case FP8_FLOAT16:
      return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, (const uint16_t*)x + i));
    default: return _mm512_maskz_loadu_ps(mask, (const float*)x + i);
  }
}

/* No software prefetch: the passes once prefetched 8 KiB ahead (past the 4 KiB pages where
 * the hardware prefetchers stop), through a small helper that GCC split off and then dropped
 * as free of side effects from 2026-12-02 on. Compiled in again, switched in one process
 * (6 alternated rounds, 2 threads, AMD EPYC Zen 4): dynamic per-tensor bf16, 64 Mi elements
 * 12.09 -> 12.18 ms, 2048 x 14336 3.78 -> 3.75, 2048 x 4096 0.532 -> 0.535, 256 x 4096
 * 0.081 -> 0.086. No gain; not kept. */

/* bf16 / fp16: the magnitudes of 16-bit floats order as their bit patterns do, so the
 * largest finite one is found on the 16-bit codes themselves, 32 per vector, without
 * widening them (widened to float32 first, 16 at a time, this pass took half as long as
 * the quantize pass after it: 512 x 576 bf16, dynamic per-tensor, one core). */
AVX512_TARGET static inline __attribute__((always_inline)) uint32_t amax_16bit(const uint16_t* x, fp8_float_dtype dtype,
                                                                                 int64_t n) {
  const __m512i magnitude_mask = _mm512_set1_epi16(0x7FFF);
  const __m512i inf_bits = _mm512_set1_epi16(dtype == FP8_BFLOAT16 ? 0x7F80 : 0x7C00);
  __m512i amax0 = _mm512_setzero_si512(), amax1 = _mm512_setzero_si512();
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    const __m512i m0 = _mm512_and_si512(_mm512_loadu_si512(x + i), magnitude_mask);
    const __m512i m1 = _mm512_and_si512(_mm512_loadu_si512(x + i + 32), magnitude_mask);
    amax0 = _mm512_mask_max_epu16(amax0, _mm512_cmplt_epu16_mask(m0, inf_bits), amax0, m0);
    amax1 = _mm512_mask_max_epu16(amax1, _mm512_cmplt_epu16_mask(m1, inf_bits), amax1, m1);
  }
  for (; i < n; i += 32) {
    const __mmask32 mask = n - i >= 32 ? ~(__mmask32)0 : (__mmask32)((1u << (n - i)) - 1u);
    const __m512i m0 = _mm512_and_si512(_mm512_maskz_loadu_epi16(mask, x + i), magnitude_mask);
    amax0 = _mm512_mask_max_epu16(amax0, _mm512_cmplt_epu16_mask(m0, inf_bits), amax0, m0);
  }
  const __m512i amax = _mm512_max_epu16(amax0, amax1);
  const __m512i wide = _mm512_max_epu32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(amax)),
                                        _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(amax, 1)));
  const uint32_t bits = _mm512_reduce_max_epu32(wide);
  return dtype == FP8_BFLOAT16 ? bits << 16 : fp8_float_bits(fp8_half_to_float((uint16_t)bits));
}

/* fp8_span_amax_avx512's body, inlined into the group pass too */
AVX512_TARGET static inline __attribute__((always_inline)) uint32_t amax_span(const void* x, fp8_float_dtype dtype,
                                                                                int64_t n) {
  if (dtype != FP8_FLOAT32) return amax_16bit((const uint16_t*)x, dtype, n);
  const __m512i magnitude_mask = _mm512_set1_epi32(0x7FFFFFFF);
  const __m512i inf_bits = _mm512_set1_epi32(0x7F800000);
  /* two accumulators hide the max latency */
  __m512i amax0 = _mm512_setzero_si512(), amax1 = _mm512_setzero_si512();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512i m0 = _mm512_and_si512(_mm512_castps_si512(load16(x, dtype, i, 0xFFFF)), magnitude_mask);
    const __m512i m1 = _mm512_and_si512(_mm512_castps_si512(load16(x, dtype, i + 16, 0xFFFF)), magnitude_mask);
    amax0 = _mm512_mask_max_epu32(amax0, _mm512_cmplt_epu32_mask(m0, inf_bits), amax0, m0);
    amax1 = _mm512_mask_max_epu32(amax1, _mm512_cmplt_epu32_mask(m1, inf_bits), amax1, m1);
  }
  for (; i < n; i += 16) {
    const __mmask16 mask = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1u);
    const __m512i m0 = _mm512_and_si512(_mm512_castps_si512(load16(x, dtype, i, mask)), magnitude_mask);
    amax0 = _mm512_mask_max_epu32(amax0, _mm512_cmplt_epu32_mask(m0, inf_bits), amax0, m0);
  }
  return _mm512_reduce_max_epu32(_mm512_max_epu32(amax0, amax1));
}

AVX512_TARGET uint32_t fp8_span_amax_avx512(const void* x, fp8_float_dtype dtype, int64_t n) {
  return amax_span(x, dtype, n);
}

typedef struct {
  __m512i max_code, min_normal_bits, magic_bits, rebias_round_half, shift_mask;
  __m512 magic;
  int shift;
} encode_constants;

AVX512_TARGET static inline encode_constants make_constants(fp8_format format) {
  const int mantissa_bits = format == FP8_E4M3FN ? 3 : 2;
  const int bias = format == FP8_E4M3FN ? 7 : 15;
  encode_constants c;
  c.shift = 23 - mantissa_bits;
  c.max_code = _mm512_set1_epi32(format == FP8_E4M3FN ? FP8_E4M3FN_MAX_CODE : FP8_E5M2_MAX_CODE);
  c.min_normal_bits = _mm512_set1_epi32((127 + 1 - bias) << 23);
  c.magic_bits = _mm512_set1_epi32((127 + 1 - bias - mantissa_bits + 23) << 23);
  c.magic = _mm512_castsi512_ps(c.magic_bits);
  c.rebias_round_half = _mm512_set1_epi32((int)(((uint32_t)(bias - 127) << 23) + ((1u << (c.shift - 1)) - 1u)));
  c.shift_mask = _mm512_set1_epi32(1);
  return c;
}

/* The fp8 code of each float32 lane (in the low byte of the lane). */
AVX512_TARGET static inline __m512i encode16_lanes(__m512 y, const encode_constants* c) {
  const __m512i u = _mm512_castps_si512(y);
  const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(u, 24), _mm512_set1_epi32(0x80));
  const __m512i magnitude = _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF));
  /* normal numbers: round to nearest even at the format's mantissa width */
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(magnitude, (unsigned)c->shift), c->shift_mask);
  __m512i code = _mm512_add_epi32(_mm512_add_epi32(magnitude, c->rebias_round_half), odd);
  code = _mm512_srli_epi32(code, (unsigned)c->shift);
  /* subnormals: let the FPU round by adding a magic number whose ulp is the step */
  const __mmask16 is_subnormal = _mm512_cmplt_epu32_mask(magnitude, c->min_normal_bits);
  const __m512 sum = _mm512_add_ps(_mm512_castsi512_ps(magnitude), c->magic);
  code = _mm512_mask_sub_epi32(code, is_subnormal, _mm512_castps_si512(sum), c->magic_bits);
  /* saturation: the code grows with the magnitude, and every magnitude from FMAX up
   * (inf included) has a code at or above FMAX's */
  code = _mm512_min_epu32(code, c->max_code);
  const __mmask16 is_nan = _mm512_cmpgt_epu32_mask(magnitude, _mm512_set1_epi32(0x7F800000));
  code = _mm512_mask_mov_epi32(code, is_nan, _mm512_set1_epi32(0x7F));
  return _mm512_or_si512(code, sign);
}

AVX512_TARGET static inline __m128i encode16(__m512 y, const encode_constants* c) {
  return _mm512_cvtepi32_epi8(encode16_lanes(y, c));
}

/* The span's codes with the encoder's constants made by the caller (once for many spans). */
AVX512_TARGET static inline __attribute__((always_inline)) void quantize_span(const void* x, fp8_float_dtype dtype,
                                                                              int64_t n, float scale, uint8_t* q,
                                                                              const encode_constants* constants) {
  const encode_constants c = *constants;
  const __m512 divisor = _mm512_set1_ps(scale);
  int64_t i = 0;
  if (dtype == FP8_BFLOAT16) {
    /* 32 bf16 at a time, split into even and odd elements by shifts (no shuffles:
     * bf16 is the high half of a float32); the two sets of codes then interleave
     * back into order as the bytes of 16-bit lanes (one narrowing) */
    for (; i + 32 <= n; i += 32) {
      const __m512i v = _mm512_loadu_si512((const uint16_t*)x + i);
      const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000u)));
      const __m512i codes_even = encode16_lanes(_mm512_div_ps(even, divisor), &c);
      const __m512i codes_odd = encode16_lanes(_mm512_div_ps(odd, divisor), &c);
      const __m512i pairs = _mm512_or_si512(codes_even, _mm512_slli_epi32(codes_odd, 8));
      _mm256_storeu_si256((__m256i*)(q + i), _mm512_cvtepi32_epi16(pairs));
    }
  }
  for (; i + 32 <= n; i += 32) {
    /* a true division: x * (1 / scale) would round differently */
    const __m512 y0 = _mm512_div_ps(load16(x, dtype, i, 0xFFFF), divisor);
    const __m512 y1 = _mm512_div_ps(load16(x, dtype, i + 16, 0xFFFF), divisor);
    _mm_storeu_si128((__m128i*)(q + i), encode16(y0, &c));
    _mm_storeu_si128((__m128i*)(q + i + 16), encode16(y1, &c));
  }
  for (; i + 16 <= n; i += 16) {
    /* a true division: x * (1 / scale) would round differently */
    const __m512 y = _mm512_div_ps(load16(x, dtype, i, 0xFFFF), divisor);
    _mm_storeu_si128((__m128i*)(q + i), encode16(y, &c));
  }
  if (i < n) {
    const __mmask16 mask = (__mmask16)((1u << (n - i)) - 1u);
    const __m512 y = _mm512_div_ps(load16(x, dtype, i, mask), divisor);
    _mm_mask_storeu_epi8(q + i, mask, encode16(y, &c));
  }
}

AVX512_TARGET void fp8_span_quantize_avx512(const void* x, fp8_float_dtype dtype, int64_t n,
                                            float scale, uint8_t* q, fp8_format format) {
  const encode_constants c = make_constants(format);
  quantize_span(x, dtype, n, scale, q, &c);
}

/* Groups of one row: group i is x[i * group, min(n, (i + 1) * group)). One call per row
 * for all its amaxes, then one for all its codes, so that nothing but the divisor changes
 * from group to group. Called per group of 128 (the amax, the scale, the codes, then the
 * next group's), the functions above took 1.35-1.37x as long: bf16, dynamic groups of 128,
 * Intel Xeon with AMX, 2 threads, 512 x 576 78.9 -> 57.1 us, 512 x 1536 200.7 -> 147.1 us
 * (medians of 3 alternating runs of 200 calls). A reciprocal instead of the division (with
 * a check of the lanes near a rounding boundary, exact) made them slower: the loop is
 * bound by its vector instructions, not by the divider. */
AVX512_TARGET void fp8_span_amax_groups_avx512(const void* x, fp8_float_dtype dtype, int64_t n, int64_t group,
                                               uint32_t* amax_bits) {
  const int64_t size = fp8_float_bytes(dtype);
  for (int64_t c = 0, g = 0; c < n; c += group, ++g) {
    const int64_t length = n - c < group ? n - c : group;
    amax_bits[g] = amax_span((const char*)x + c * size, dtype, length);
  }
}

AVX512_TARGET void fp8_span_quantize_groups_avx512(const void* x, fp8_float_dtype dtype, int64_t n, int64_t group,
                                                   const float* scales, uint8_t* q, fp8_format format) {
  const encode_constants c = make_constants(format);
  const int64_t size = fp8_float_bytes(dtype);
  for (int64_t i = 0, g = 0; i < n; i += group, ++g)
    quantize_span((const char*)x + i * size, dtype, n - i < group ? n - i : group, scales[g], q + i, &c);
}

#endif /* FP8_X86_KERNELS */
