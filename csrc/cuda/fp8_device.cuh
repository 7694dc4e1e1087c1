// FP8 and float conversions for the CUDA kernels. The portable functions are
// __host__ __device__ and integer-exact ports of ../fp8.h, so the same code runs
// (and is tested, see tests/test_cuda_compile.py) on the host; on sm_89+ the
// hardware conversions replace them where they round identically.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>
#include <string.h>

#include "../kernels.h"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define FP8LINEAR_HARDWARE_FP8 1
#else
#define FP8LINEAR_HARDWARE_FP8 0
#endif

namespace fp8cuda {

__host__ __device__ __forceinline__ uint32_t bits_of(float value) {
  uint32_t bits;
  memcpy(&bits, &value, sizeof bits);
  return bits;
}

__host__ __device__ __forceinline__ float float_of(uint32_t bits) {
  float value;
  memcpy(&value, &bits, sizeof value);
  return value;
}

template <fp8_format kFormat>
struct Fp8Traits;

template <>
struct Fp8Traits<FP8_E4M3FN> {
  static constexpr int kMantissaBits = 3, kBias = 7;
  static constexpr uint32_t kMaxCode = FP8_E4M3FN_MAX_CODE;
  static constexpr uint32_t kMaxBits = 0x43E00000u;  // 448.0f
  static constexpr float kMax = FP8_E4M3FN_MAX;
  static constexpr __nv_fp8_interpretation_t kInterpretation = __NV_E4M3;
};

template <>
struct Fp8Traits<FP8_E5M2> {
  static constexpr int kMantissaBits = 2, kBias = 15;
  static constexpr uint32_t kMaxCode = FP8_E5M2_MAX_CODE;
  static constexpr uint32_t kMaxBits = 0x47600000u;  // 57344.0f
  static constexpr float kMax = FP8_E5M2_MAX;
  static constexpr __nv_fp8_interpretation_t kInterpretation = __NV_E5M2;
};

// float32 -> fp8 exactly as fp8_encode_generic in ../fp8.h: one round-to-nearest-even,
// finite overflow and +-inf saturate to +-max, NaN -> sign | 0x7F, -0 keeps its sign.
template <fp8_format kFormat>
__host__ __device__ __forceinline__ uint8_t encode_fp8_portable(float x) {
  using T = Fp8Traits<kFormat>;
  const uint32_t bits = bits_of(x);
  const uint32_t sign = (bits >> 24) & 0x80u;
  const uint32_t magnitude = bits & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u) return static_cast<uint8_t>(sign | 0x7Fu);
  if (magnitude >= T::kMaxBits) return static_cast<uint8_t>(sign | T::kMaxCode);
  constexpr uint32_t kMinNormalBits = static_cast<uint32_t>(127 + 1 - T::kBias) << 23;
  constexpr int kShift = 23 - T::kMantissaBits;
  if (magnitude < kMinNormalBits) {
    // Adding 2^(min subnormal exponent + 23) makes the FPU round |x| to a multiple of
    // the smallest subnormal (nearest even); the sum's low bits are then the code.
    constexpr uint32_t kMagicBits = static_cast<uint32_t>(127 + 1 - T::kBias - T::kMantissaBits + 23) << 23;
    const float sum = float_of(magnitude) + float_of(kMagicBits);
    return static_cast<uint8_t>(sign | ((bits_of(sum) - kMagicBits) & 0xFFu));
  }
  const uint32_t odd = (magnitude >> kShift) & 1u;
  const uint32_t rounded = magnitude + (static_cast<uint32_t>(T::kBias - 127) << 23) + ((1u << (kShift - 1)) - 1u) + odd;
  return static_cast<uint8_t>(sign | ((rounded >> kShift) & 0x7Fu));
}

// Two values at once: lo -> low byte, hi -> high byte. On sm_89+ one cvt.rn.satfinite
// (round to nearest even once, saturating finite overflow and infinities) for both;
// NaN is left to the caller, which knows the sign of the original input.
template <fp8_format kFormat>
__device__ __forceinline__ uint16_t encode_fp8_pair(float lo, float hi) {
#if FP8LINEAR_HARDWARE_FP8
  return __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, Fp8Traits<kFormat>::kInterpretation);
#else
  return static_cast<uint16_t>(encode_fp8_portable<kFormat>(lo) | (encode_fp8_portable<kFormat>(hi) << 8));
#endif
}

// fp8 -> float32, exact for every code (as ../fp8.h: never forms a float32 subnormal).
template <fp8_format kFormat>
__host__ __device__ __forceinline__ float decode_fp8(uint32_t code) {
  const uint32_t sign = (code & 0x80u) << 24;
  if (kFormat == FP8_E4M3FN) {
    const uint32_t exponent = (code >> 3) & 0xFu, mantissa = code & 0x7u;
    if (exponent == 0xFu && mantissa == 0x7u) return float_of(sign | 0x7FC00000u);
    if (exponent == 0) return float_of(bits_of(static_cast<float>(mantissa) * 0x1p-9f) | sign);
    return float_of(sign | ((exponent + 120u) << 23) | (mantissa << 20));
  } else {
    const uint32_t exponent = (code >> 2) & 0x1Fu, mantissa = code & 0x3u;
    if (exponent == 0x1Fu) return float_of(sign | (mantissa ? 0x7FC00000u : 0x7F800000u));
    if (exponent == 0) return float_of(bits_of(static_cast<float>(mantissa) * 0x1p-16f) | sign);
    return float_of(sign | ((exponent + 112u) << 23) | (mantissa << 21));
  }
}

__host__ __device__ __forceinline__ float decode_fp8(uint32_t code, fp8_format format) {
  return format == FP8_E4M3FN ? decode_fp8<FP8_E4M3FN>(code) : decode_fp8<FP8_E5M2>(code);
}

// Two fp8 codes (low 16 bits of `pair`) -> float16x2 bits, exact (every e4m3 and e5m2
// value is a float16), NaN and infinity kept. The integer path: an e5m2 code is the
// high byte of its float16; an e4m3 code's 7 magnitude bits shifted left by 7 are the
// value times 2^-8 as float16 bits (subnormals included), so one exact multiply by 256
// restores it; code 0x7F would come out as 480 and is patched to NaN.
template <fp8_format kFormat>
__host__ __device__ __forceinline__ uint32_t widen_fp8x2_to_f16x2_portable(uint32_t pair) {
  const uint32_t spread = (pair & 0xFFu) | ((pair & 0xFF00u) << 8);  // code i at bit 16 * i
  if (kFormat == FP8_E5M2) return spread << 8;
  const uint32_t sign = (spread & 0x00800080u) << 8;
  const uint32_t magnitude = (spread & 0x007F007Fu) << 7;
  // A lane is 0x3F80 (the largest) only for code 0x7F; adding 0x80 sets bit 14 only there.
  const uint32_t nan_lanes = ((magnitude + 0x00800080u) & 0x40004000u) >> 14;
  __half2 value;
  const uint32_t value_bits = sign | magnitude;
  memcpy(&value, &value_bits, sizeof value);
  const uint32_t two_256_bits = 0x5C005C00u;  // (256.0, 256.0) in float16
  __half2 two_256;
  memcpy(&two_256, &two_256_bits, sizeof two_256);
  const __half2 product = __hmul2(value, two_256);
  uint32_t result;
  memcpy(&result, &product, sizeof result);
  return result | (nan_lanes * 0x7E00u);
}

template <fp8_format kFormat>
__device__ __forceinline__ uint32_t widen_fp8x2_to_f16x2(uint32_t pair) {
#if FP8LINEAR_HARDWARE_FP8
  const __half2_raw raw = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair & 0xFFFFu),
                                                     Fp8Traits<kFormat>::kInterpretation);
  uint32_t result;
  memcpy(&result, &raw, sizeof result);
  return result;
#else
  return widen_fp8x2_to_f16x2_portable<kFormat>(pair);
#endif
}

// Two fp8 codes -> bfloat16x2 bits, exact: through float16 and float32, both exact.
template <fp8_format kFormat>
__device__ __forceinline__ uint32_t widen_fp8x2_to_bf16x2(uint32_t pair) {
  const uint32_t half_bits = widen_fp8x2_to_f16x2<kFormat>(pair);
  __half2 half_pair;
  memcpy(&half_pair, &half_bits, sizeof half_pair);
  const __nv_bfloat162 result = __float22bfloat162_rn(__half22float2(half_pair));
  uint32_t bits;
  memcpy(&bits, &result, sizeof bits);
  return bits;
}

// ---- float32 / bfloat16 / float16 values as raw storage ----------------------

template <fp8_float_dtype kDtype>
struct FloatTraits;

template <>
struct FloatTraits<FP8_FLOAT32> {
  using Storage = uint32_t;
  __device__ __forceinline__ static float to_float(Storage bits) { return __uint_as_float(bits); }
  __device__ __forceinline__ static uint32_t sign_bit(Storage bits) { return bits >> 31; }
};

template <>
struct FloatTraits<FP8_BFLOAT16> {
  using Storage = uint16_t;
  __device__ __forceinline__ static float to_float(Storage bits) { return __uint_as_float(static_cast<uint32_t>(bits) << 16); }
  __device__ __forceinline__ static uint32_t sign_bit(Storage bits) { return bits >> 15; }
};

template <>
struct FloatTraits<FP8_FLOAT16> {
  using Storage = uint16_t;
  __device__ __forceinline__ static float to_float(Storage bits) { return __half2float(__ushort_as_half(bits)); }
  __device__ __forceinline__ static uint32_t sign_bit(Storage bits) { return bits >> 15; }
};

// Element `offset` of a float32/bfloat16/float16 array chosen at run time (bias, the
// generic kernel's operands): a switch per element is cheap next to the memory access.
__device__ __forceinline__ float load_float(const void* data, fp8_float_dtype dtype, int64_t offset) {
  switch (dtype) {
    case FP8_BFLOAT16: return FloatTraits<FP8_BFLOAT16>::to_float(static_cast<const uint16_t*>(data)[offset]);
    case FP8_FLOAT16: return FloatTraits<FP8_FLOAT16>::to_float(static_cast<const uint16_t*>(data)[offset]);
    default: return static_cast<const float*>(data)[offset];
  }
}

// One rounding (to nearest even) from float32 to the output dtype, as torch's casts.
__device__ __forceinline__ void store_float(void* data, fp8_float_dtype dtype, int64_t offset, float value) {
  switch (dtype) {
    case FP8_BFLOAT16: static_cast<__nv_bfloat16*>(data)[offset] = __float2bfloat16_rn(value); break;
    case FP8_FLOAT16: static_cast<__half*>(data)[offset] = __float2half_rn(value); break;
    default: static_cast<float*>(data)[offset] = value; break;
  }
}

}  // namespace fp8cuda
