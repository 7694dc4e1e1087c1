/* The two OCP OFP8 formats in plain C (no torch, no intrinsics): constants,
 * float32 -> fp8 encoding (one round-to-nearest-even, saturating, NaN kept) and
 * fp8 -> float32 decoding. Every kernel's scalar tail and the scalar variants use
 * these, so the vector variants are tested against the same arithmetic.
 * Valid C99 and C++ (the extension's C files may be built by either compiler). */
#ifndef FP8LINEAR_FP8_H
#define FP8LINEAR_FP8_H

#include <stdint.h>
#include <string.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { FP8_E4M3FN = 0, FP8_E5M2 = 1 } fp8_format;

#define FP8_E4M3FN_MAX 448.0f
#define FP8_E5M2_MAX 57344.0f
#define FP8_E4M3FN_MAX_CODE 0x7E /* 448 */
#define FP8_E5M2_MAX_CODE 0x7B   /* 57344 */

static inline float fp8_format_max(fp8_format format) {
  return format == FP8_E4M3FN ? FP8_E4M3FN_MAX : FP8_E5M2_MAX;
}

static inline uint32_t fp8_float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

static inline float fp8_bits_float(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* Generic encoder for a format with `mantissa_bits` and exponent `bias`.
 * Saturates every finite overflow and +-inf to +-max_code; NaN -> sign|0x7F.
 * Subnormals: adding |x| to 2^(min_subnormal_exponent + 23) makes the FPU round
 * |x| to a multiple of the smallest subnormal with the current (nearest-even)
 * rounding, and the low bits of the sum are then the fp8 code. */
static inline uint8_t fp8_encode_generic(float x, int mantissa_bits, int bias,
                                         uint32_t max_code, float max_value) {
  const uint32_t u = fp8_float_bits(x);
  const uint8_t sign = (uint8_t)((u >> 24) & 0x80);
  const uint32_t magnitude = u & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u) return (uint8_t)(sign | 0x7F);
  if (magnitude >= fp8_float_bits(max_value)) return (uint8_t)(sign | max_code);
  /* min normal of the format: 2^(1 - bias) */
  const uint32_t min_normal_bits = (uint32_t)(127 + 1 - bias) << 23;
  const int shift = 23 - mantissa_bits;
  if (magnitude < min_normal_bits) {
    /* smallest subnormal = 2^(1 - bias - mantissa_bits); the magic's ulp equals it */
    const uint32_t magic_bits = (uint32_t)(127 + 1 - bias - mantissa_bits + 23) << 23;
    const float sum = fp8_bits_float(magnitude) + fp8_bits_float(magic_bits);
    return (uint8_t)(sign | (uint8_t)(fp8_float_bits(sum) - magic_bits));
  }
  const uint32_t odd = (magnitude >> shift) & 1u;
  const uint32_t rounded =
      magnitude + ((uint32_t)(bias - 127) << 23) + ((1u << (shift - 1)) - 1u) + odd;
  return (uint8_t)(sign | (uint8_t)(rounded >> shift));
}

static inline uint8_t fp8_e4m3fn_from_float(float x) {
  return fp8_encode_generic(x, 3, 7, FP8_E4M3FN_MAX_CODE, FP8_E4M3FN_MAX);
}

static inline uint8_t fp8_e5m2_from_float(float x) {
  return fp8_encode_generic(x, 2, 15, FP8_E5M2_MAX_CODE, FP8_E5M2_MAX);
}

static inline uint8_t fp8_from_float(float x, fp8_format format) {
  return format == FP8_E4M3FN ? fp8_e4m3fn_from_float(x) : fp8_e5m2_from_float(x);
}

/* Decoding never forms a float32 subnormal, so it is exact even when the FPU
 * flushes denormals (torch.set_flush_denormal(True)). */
static inline float fp8_e4m3fn_to_float(uint8_t code) {
  const uint32_t sign = (uint32_t)(code & 0x80) << 24;
  const uint32_t exponent = (code >> 3) & 0xF, mantissa = code & 0x7;
  if (exponent == 0xF && mantissa == 0x7) return fp8_bits_float(sign | 0x7FC00000u);
  if (exponent == 0) {
    const float value = (float)mantissa * 0x1p-9f;
    return fp8_bits_float(fp8_float_bits(value) | sign);
  }
  return fp8_bits_float(sign | ((exponent + 120u) << 23) | (mantissa << 20));
}

static inline float fp8_e5m2_to_float(uint8_t code) {
  const uint32_t sign = (uint32_t)(code & 0x80) << 24;
  const uint32_t exponent = (code >> 2) & 0x1F, mantissa = code & 0x3;
  if (exponent == 0x1F) return fp8_bits_float(sign | (mantissa ? 0x7FC00000u : 0x7F800000u));
  if (exponent == 0) {
    const float value = (float)mantissa * 0x1p-16f;
    return fp8_bits_float(fp8_float_bits(value) | sign);
  }
  return fp8_bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 21));
}

static inline float fp8_to_float(uint8_t code, fp8_format format) {
  return format == FP8_E4M3FN ? fp8_e4m3fn_to_float(code) : fp8_e5m2_to_float(code);
}

/* bfloat16 / float16 <-> float32 for the kernels' scalar paths. */
static inline float fp8_bf16_to_float(uint16_t h) { return fp8_bits_float((uint32_t)h << 16); }

static inline uint16_t fp8_float_to_bf16(float f) {
  const uint32_t u = fp8_float_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40);
  return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline float fp8_half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  const uint32_t exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
  if (exponent == 0x1F) return fp8_bits_float(sign | 0x7F800000u | (mantissa << 13));
  if (exponent == 0) {
    const float value = (float)mantissa * 0x1p-24f;
    return fp8_bits_float(fp8_float_bits(value) | sign);
  }
  return fp8_bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

/* float32 -> float16, round to nearest even, overflow -> inf (as a cast in torch). */
static inline uint16_t fp8_float_to_half(float f) {
  const uint32_t u = fp8_float_bits(f);
  const uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
  const uint32_t magnitude = u & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u) return (uint16_t)(sign | 0x7E00 | ((magnitude >> 13) & 0x3FF));
  if (magnitude >= 0x477FF000u) return (uint16_t)(sign | 0x7C00); /* >= 65520 rounds to inf */
  if (magnitude < 0x38800000u) { /* below 2^-14: float16 subnormal */
    const uint32_t magic_bits = (uint32_t)(127 - 24 + 23) << 23; /* ulp 2^-24 */
    const float sum = fp8_bits_float(magnitude) + fp8_bits_float(magic_bits);
    return (uint16_t)(sign | (uint16_t)(fp8_float_bits(sum) - magic_bits));
  }
  const uint32_t odd = (magnitude >> 13) & 1u;
  const uint32_t rounded = magnitude + ((uint32_t)(15 - 127) << 23) + 0xFFFu + odd;
  return (uint16_t)(sign | (uint16_t)(rounded >> 13));
}

#ifdef __cplusplus
}
#endif

#endif /* FP8LINEAR_FP8_H */
