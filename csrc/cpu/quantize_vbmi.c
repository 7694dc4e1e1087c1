/* quantize_fp8 of bf16 inputs by table (AVX-512 + VBMI: the variants from avx512_bf16 up).
 *
 * x / scale splits into a power of two and a mantissa quotient: with x = 2^(ex - 127) * mx
 * and scale = 2^(es - 127) * ms (mx, ms in [1, 2)), x / scale = 2^(ex - es) * (mx / ms),
 * and, as long as the quotient is a normal float32, rounding it to float32 commutes with
 * the power of two: RN32(x / scale) = 2^(ex - es) * RN32(mx / ms). A bf16 has 7 mantissa
 * bits, so RN32(mx / ms) takes one of 128 values per scale; rounding 2^D * q to an fp8
 * normal number rounds q's mantissa at the format's width, and the code is
 *
 *   code = (D + bias) * 2^mb + N[m],  N[m] = rne((q - 1) * 2^mb)         for q >= 1,
 *                                          rne((2q - 1) * 2^mb) - 2^mb   for q < 1,
 *
 * (mb = 3 mantissa bits for e4m3fn, 2 for e5m2; N[m] = 2^mb is the carry into the next
 * binade). One 128-entry byte table per scale (vpermi2b), built with true float32
 * divisions, so every code is the one rne(x / scale) gives: bit-exact with the
 * division kernel, checked for all 65536 bf16 values over 5000 scales of both formats.
 *
 * The formula holds for fp8 normal results; codes above the largest finite saturate
 * (inf too); NaN keeps 0x7F; zeros and bf16 subnormals give 0 (|x / scale| <= 2^-42 for
 * the scales taken here). Results in or near the fp8 subnormal range (the formula's code
 * in [-mb * 2^mb, 2^mb]: the exponent field 1 or less, where the step is the subnormal
 * one) are computed by division for the lanes concerned, in the 32-element steps that
 * have any (common in activations with outliers: a per-tensor scale is set by the
 * largest value). The formula reads a bf16 subnormal as 2^-127 * 1.m and inf as
 * 2^128 * 1.0; both still give the right codes (0, and the saturated largest finite) as
 * long as the scale keeps them far from the fp8 range: a review sweep over every scale
 * exponent found the first wrong codes below 2^-113 and above 2^111 (e5m2; e4m3fn:
 * 2^-121, 2^118). Scales outside [2^-84, 2^100], a wide margin inside those, and
 * fp16/float32 inputs take the division kernel for the whole span. (The table is built
 * with the current MXCSR rounding, as the division kernel divides with it: both assume
 * the default, round to nearest.)
 *
 * Speed (Intel Xeon with AMX, 2 threads, per-tensor scales, M = 128-2048 rows of 576-4096):
 * 1.6-1.8x the division kernel; per-row scales 1.2-1.6x. */
#include "cpu_internal.h" /* FP8_X86_KERNELS */
#if FP8_X86_KERNELS /* the whole file: x86-64 only */

#include <immintrin.h>
#include <string.h>

#define VBMI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi")))

enum { SCALE_EXPONENT_MIN = 127 - 84, SCALE_EXPONENT_MAX = 127 + 100, FRESH_TABLE_MIN_ELEMENTS = 512 };

/* (bytes, loaded unaligned: thread-local storage of a dlopen'ed library need not honour
 * a 64-byte alignment) */
typedef struct {
  uint8_t entries[128]; /* N[m] + 2^mb for m = 0..127 */
  uint32_t scale_bits;  /* the scale they were built for */
  int format, ready;
} code_table;

/* The table of `scale`; 0 if the scale is outside the range this kernel takes. */
VBMI_TARGET static int build_table(float scale, fp8_format format, code_table* t) {
  uint32_t bits;
  memcpy(&bits, &scale, sizeof bits);
  const int exponent = (int)((bits >> 23) & 0xFF);
  if (exponent < SCALE_EXPONENT_MIN || exponent > SCALE_EXPONENT_MAX || (bits >> 31)) return 0;
  const int mb = format == FP8_E4M3FN ? 3 : 2;
  const __m512 step = _mm512_set1_ps((float)(1 << mb));
  const __m512 ms = _mm512_castsi512_ps(_mm512_set1_epi32((int)((bits & 0x7FFFFFu) | (127u << 23))));
  const __m512 one = _mm512_set1_ps(1.0f);
  uint8_t* entries = t->entries;
  for (int m0 = 0; m0 < 128; m0 += 16) {
    const __m512i m = _mm512_add_epi32(_mm512_set1_epi32(m0), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    /* mx = 1 + m / 128, exactly: the bf16 mantissa m under an exponent of 0 */
    const __m512 mx = _mm512_castsi512_ps(_mm512_or_si512(_mm512_slli_epi32(m, 16), _mm512_set1_epi32(127 << 23)));
    const __m512 q = _mm512_div_ps(mx, ms); /* a true division: RN32(mx / ms) */
    const __mmask16 below_one = _mm512_cmp_ps_mask(q, one, _CMP_LT_OQ);
    /* (q - 1) or (2q - 1) is exact; times 2^mb exact; rounded to nearest even */
    const __m512 y = _mm512_mask_sub_ps(_mm512_sub_ps(q, one), below_one, _mm512_add_ps(q, q), one);
    const __m512 rounded = _mm512_roundscale_ps(_mm512_mul_ps(y, step), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    /* + 2^mb, - 2^mb again below one: N[m] + 2^mb in [0, 2^(mb + 1)] */
    const __m512 entry = _mm512_mask_add_ps(_mm512_add_ps(rounded, step), below_one, rounded, _mm512_setzero_ps());
    _mm_storeu_si128((__m128i*)(entries + m0), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(entry)));
  }
  t->scale_bits = bits;
  t->format = (int)format;
  t->ready = 1;
  return 1;
}

/* The codes of |x / scale| below twice the smallest normal (the two binades where
 * the fp8 step is the subnormal one), for the 32 bf16 of v, in its 16-bit lanes: by a
 * true division and a magic-number sum that rounds to that step, as the division kernel
 * does for its subnormals. */
VBMI_TARGET static inline __m512i small_codes(__m512i v, __m512 divisor, __m512 magic) {
  const __m512i magnitude = _mm512_set1_epi32(0x7FFFFFFF);
  const __m512 even = _mm512_castsi512_ps(_mm512_and_si512(_mm512_slli_epi32(v, 16), magnitude));
  const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(0x7FFF0000)));
  const __m512i codes_even = _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(_mm512_div_ps(even, divisor), magic)),
                                              _mm512_castps_si512(magic));
  const __m512i codes_odd = _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(_mm512_div_ps(odd, divisor), magic)),
                                             _mm512_castps_si512(magic));
  /* (a large even lane's difference reaches past 16 bits: blend, not or) */
  return _mm512_mask_blend_epi16(0xAAAAAAAAu, codes_even, _mm512_slli_epi32(codes_odd, 16));
}

/* Whether `scale` is in the range the table formula takes (see above). */
static int table_takes(uint32_t scale_bits) {
  const int exponent = (int)((scale_bits >> 23) & 0xFF);
  return exponent >= SCALE_EXPONENT_MIN && exponent <= SCALE_EXPONENT_MAX && !(scale_bits >> 31);
}

/* What the table loop keeps in registers for one table: a span's scale adds only its
 * exponent (offset) and the divisor of its subnormal lanes. */
typedef struct {
  __m512i exponent_mask, max_code, subnormal_low, subnormal_span, magnitude_mask, inf_bits, nan_code, sign_bit;
  __m512i table_low, table_high;
  __m512 magic;
  int mb, bias;
} table_constants;

VBMI_TARGET static inline table_constants constants_of(const code_table* t, fp8_format format) {
  table_constants c;
  c.mb = format == FP8_E4M3FN ? 3 : 2;
  c.bias = format == FP8_E4M3FN ? 7 : 15;
  c.exponent_mask = _mm512_set1_epi16((short)(0xFF << c.mb));
  c.max_code = _mm512_set1_epi16(format == FP8_E4M3FN ? FP8_E4M3FN_MAX_CODE : FP8_E5M2_MAX_CODE);
  /* codes in [-mb * 2^mb, 2^mb]: results in the subnormal binades or their rounding
   * edges, where the normal formula does not hold (below: under half the smallest
   * subnormal, code 0) */
  c.subnormal_low = _mm512_set1_epi16((short)(-c.mb * (1 << c.mb)));
  c.subnormal_span = _mm512_set1_epi16((short)((1 << c.mb) + c.mb * (1 << c.mb)));
  c.magnitude_mask = _mm512_set1_epi16(0x7FFF);
  c.inf_bits = _mm512_set1_epi16(0x7F80);
  c.nan_code = _mm512_set1_epi16(0x7F);
  c.sign_bit = _mm512_set1_epi16(0x80);
  /* a float32 whose ulp is the smallest subnormal: the sum rounds |x / scale| to it */
  c.magic = _mm512_castsi512_ps(_mm512_set1_epi32((127 + 1 - c.bias - c.mb + 23) << 23));
  c.table_low = _mm512_loadu_si512(t->entries);
  c.table_high = _mm512_loadu_si512(t->entries + 64);
  return c;
}

/* q[0, n) of bf16 x by the table of `c` (built for scale's significand; the exponent goes
 * into the codes here), the last n % 32 by the division kernel. */
VBMI_TARGET static inline __attribute__((always_inline)) void quantize_by_table(
    const uint16_t* in, int64_t n, float scale, const table_constants* c, uint8_t* q, fp8_format format) {
  uint32_t bits;
  memcpy(&bits, &scale, sizeof bits);
  const int exponent = (int)((bits >> 23) & 0xFF);
  /* code = (ex - es + bias) * 2^mb + N[m] = (ex << mb) + (N[m] + 2^mb) + offset */
  const __m512i offset = _mm512_set1_epi16((short)((c->bias - exponent - 1) * (1 << c->mb)));
  const __m512 divisor = _mm512_set1_ps(scale);
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512i v = _mm512_loadu_si512(in + i);
    /* N[m] + 2^mb by the low byte of each bf16 (its 7 mantissa bits index the table),
     * zero in the high byte */
    const __m512i entry = _mm512_maskz_permutex2var_epi8(0x5555555555555555ull, c->table_low, v, c->table_high);
    __m512i code = _mm512_and_si512(_mm512_srli_epi16(v, 7 - c->mb), c->exponent_mask);
    code = _mm512_add_epi16(_mm512_add_epi16(code, entry), offset);
    const __mmask32 small = _mm512_cmple_epu16_mask(_mm512_sub_epi16(code, c->subnormal_low), c->subnormal_span);
    if (small) code = _mm512_mask_mov_epi16(code, small, small_codes(v, divisor, c->magic));
    code = _mm512_max_epi16(_mm512_min_epi16(code, c->max_code), _mm512_setzero_si512());
    code = _mm512_mask_mov_epi16(code, _mm512_cmpgt_epu16_mask(_mm512_and_si512(v, c->magnitude_mask), c->inf_bits),
                                 c->nan_code);
    code = _mm512_ternarylogic_epi32(code, _mm512_srli_epi16(v, 8), c->sign_bit, 0xF8); /* code | (sign & 0x80) */
    _mm256_storeu_si256((__m256i*)(q + i), _mm512_cvtepi16_epi8(code));
  }
  if (i < n) fp8_span_quantize_avx512(in + i, FP8_BFLOAT16, n - i, scale, q + i, format);
}

/* Per thread: the table of the last scale (per-tensor scales build it once per call and
 * thread, per-row scales once per row: 8 steps of 16 divisions and roundings), and the
 * one of power-of-two scales (significand 1), which every group of a ue8m0 quantization
 * shares whatever its exponent. */
static __thread code_table last_table, power_of_two_table;

/* The table for `scale`, or NULL where the division kernel should run: a table of
 * another significand costs about what 450 elements save, so shorter spans with a scale
 * of their own (groups of 128) keep the division kernel (groups ran at 0.75x its speed
 * when they built tables), unless the scale is a power of two, whose table is built once. */
VBMI_TARGET static const code_table* table_for(float scale, fp8_format format, int64_t n) {
  uint32_t bits;
  memcpy(&bits, &scale, sizeof bits);
  if (!table_takes(bits)) return NULL;
  const uint32_t significand = bits & 0x7FFFFFu;
  code_table* t = significand == 0 ? &power_of_two_table : &last_table;
  if (t->ready && (t->scale_bits & 0x7FFFFFu) == significand && t->format == (int)format) return t;
  if (significand != 0 && n < FRESH_TABLE_MIN_ELEMENTS) return NULL;
  return build_table(scale, format, t) ? t : NULL;
}

VBMI_TARGET void fp8_span_quantize_vbmi(const void* x, fp8_float_dtype dtype, int64_t n, float scale, uint8_t* q,
                                        fp8_format format) {
  const code_table* t = dtype == FP8_BFLOAT16 && n >= 32 ? table_for(scale, format, n) : NULL;
  if (t == NULL) {
    fp8_span_quantize_avx512(x, dtype, n, scale, q, format);
    return;
  }
  const table_constants c = constants_of(t, format);
  quantize_by_table((const uint16_t*)x, n, scale, &c, q, format);
}

/* Groups of one row (as fp8_span_quantize_groups_avx512): bf16 groups whose scales are
 * all powers of two in the table's range (scale_fmt "ue8m0") by the one power-of-two
 * table, its constants kept in registers across the groups; any other row by the division
 * kernel (a table per group would cost more than it saves). */
VBMI_TARGET void fp8_span_quantize_groups_vbmi(const void* x, fp8_float_dtype dtype, int64_t n, int64_t group,
                                               const float* scales, uint8_t* q, fp8_format format) {
  int tabled = dtype == FP8_BFLOAT16 && group >= 32;
  for (int64_t g = 0; tabled && g * group < n; ++g) {
    uint32_t bits;
    memcpy(&bits, &scales[g], sizeof bits);
    tabled = (bits & 0x7FFFFFu) == 0 && table_takes(bits);
  }
  if (!tabled) {
    fp8_span_quantize_groups_avx512(x, dtype, n, group, scales, q, format);
    return;
  }
  const uint16_t* in = (const uint16_t*)x;
  const table_constants c = constants_of(table_for(1.0f, format, n), format); /* built once per thread and format */
  for (int64_t i = 0, g = 0; i < n; i += group, ++g)
    quantize_by_table(in + i, n - i < group ? n - i : group, scales[g], &c, q + i, format);
}

#endif /* FP8_X86_KERNELS */
