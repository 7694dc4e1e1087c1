/* fp8 -> bf16 widening in AVX-512 registers, shared by the AVX512-BF16 kernels
 * (gemm_avx512_bf16.c, gemm_avx512_bf16_skinny.c, gemm_avx512_bf16_dot.c), their epilogue
 * (gemm_bf16_epilogue.c) and the AMX kernels (gemm_amx.c), with the 16 x 16 float transpose
 * that activation packing and the epilogues share. Only csrc/cpu/ includes this.
 *
 * 64 fp8 bytes -> two vectors of 32 bf16 with two 128-entry byte table lookups
 * (vpermt2b: high and low byte of each bf16, indexed by the 7 magnitude bits), the
 * sign OR-ed into the high byte, and an interleave. The interleave (vpunpck{l,h}bw)
 * works within 128-bit lanes, so the 64 values come out permuted ("interleave
 * order"); activations are widened with the same permutation, and a dot product does
 * not care about the order of its terms. */
#ifndef FP8LINEAR_BF16_WIDEN_H
#define FP8LINEAR_BF16_WIDEN_H

#include <immintrin.h>

#include "cpu_internal.h"

#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vbmi")))
#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* Activation rows per vector in the layout fp8_bf16_prepare packs them in for the tile,
 * skinny and AMX kernels (groups of 16 rows, a vector per k-pair). */
enum { TILE_LANES = 16 };

/* ---- widening tables ------------------------------------------------------ */

/* [format][0 = high byte, 1 = low byte][magnitude]: the bf16 bits of each code,
 * built by fp8_bf16_build_widen_tables() (idempotent; call before loading them). */
extern uint8_t fp8_bf16_widen_tables[2][2][128];
void fp8_bf16_build_widen_tables(void);

typedef struct {
  __m512i high0, high1, low0, low1, sign;
} widen_tables_t;

BF16_TARGET ALWAYS_INLINE widen_tables_t load_widen_tables(fp8_format format) {
  widen_tables_t t;
  t.high0 = _mm512_load_si512(fp8_bf16_widen_tables[format][0]);
  t.high1 = _mm512_load_si512(fp8_bf16_widen_tables[format][0] + 64);
  t.low0 = _mm512_load_si512(fp8_bf16_widen_tables[format][1]);
  t.low1 = _mm512_load_si512(fp8_bf16_widen_tables[format][1] + 64);
  t.sign = _mm512_set1_epi8((char)0x80);
  return t;
}

/* 64 fp8 codes -> 2 x 32 bf16 in "interleave order": out0 holds elements
 * 0-7, 16-23, 32-39, 48-55 and out1 the others. */
BF16_TARGET ALWAYS_INLINE void widen64(const widen_tables_t* t, __m512i codes, __m512i* out0, __m512i* out1) {
  __m512i high = _mm512_permutex2var_epi8(t->high0, codes, t->high1);
  const __m512i low = _mm512_permutex2var_epi8(t->low0, codes, t->low1);
  high = _mm512_ternarylogic_epi32(high, codes, t->sign, 0xF8); /* high | (codes & 0x80) */
  *out0 = _mm512_unpacklo_epi8(low, high);
  *out1 = _mm512_unpackhi_epi8(low, high);
}

/* 32 bf16 values times 2^shift (`delta`: shift << 7 in every 16-bit lane), exactly for
 * results that stay normal (fp8_cpu_scaled_mm_fold keeps them so): the shift is added to
 * the exponent field of the finite nonzero lanes; zeros, infinities and NaNs are kept. */
BF16_TARGET ALWAYS_INLINE __m512i fold_exponent(__m512i v, __m512i delta) {
  const __m512i magnitude = _mm512_and_si512(v, _mm512_set1_epi16(0x7FFF));
  /* 1 <= magnitude <= 0x7F7F (0x7F80: infinity, above: NaN), as magnitude - 1 < 0x7F7F unsigned */
  const __mmask32 finite_nonzero =
      _mm512_cmp_epu16_mask(_mm512_sub_epi16(magnitude, _mm512_set1_epi16(1)), _mm512_set1_epi16(0x7F7F), _MM_CMPINT_LT);
  return _mm512_mask_add_epi16(v, finite_nonzero, v, delta);
}

/* widen64's two vectors times 2^shift (fold_exponent), both halves of 64 codes of one block. */
BF16_TARGET ALWAYS_INLINE void fold64(int shift, __m512i* out0, __m512i* out1) {
  if (shift == 0) return;
  const __m512i delta = _mm512_set1_epi16((short)(shift * 128));
  *out0 = fold_exponent(*out0, delta);
  *out1 = fold_exponent(*out1, delta);
}

/* The tables of t with every finite nonzero entry times 2^shift (|shift| <= 32, results
 * normal): where one shift serves many rows (the AMX stream kernel: 16 rows x 64 k per
 * step), ~10 operations per step instead of fold64's 8 per row. The bf16 bits are
 * high << 8 | low, the exponent's lowest bit the low byte's top bit: an odd shift flips
 * that bit and carries into the high byte where it was set; shift >> 1 (rounded down)
 * goes into the high byte. Zeros, NaN (e4m3 0x7F, e5m2 from 0x7D) and e5m2's infinity
 * (0x7C) keep their entries. */
BF16_TARGET ALWAYS_INLINE widen_tables_t shifted_tables(const widen_tables_t* t, fp8_format format, int shift) {
  if (shift == 0) return *t;
  /* finite nonzero magnitudes: 1-63 of the first table half, and 64-126 (e4m3) or 64-123 (e5m2) */
  const __mmask64 finite0 = ~(__mmask64)1;
  const __mmask64 finite1 = format == FP8_E4M3FN ? ~(__mmask64)0 >> 1 : ((__mmask64)1 << 60) - 1;
  widen_tables_t s = *t;
  const __m512i half = _mm512_set1_epi8((char)(shift >> 1)); /* (arithmetic shift: rounds down) */
  s.high0 = _mm512_mask_add_epi8(t->high0, finite0, t->high0, half);
  s.high1 = _mm512_mask_add_epi8(t->high1, finite1, t->high1, half);
  if (shift & 1) {
    const __m512i top = _mm512_set1_epi8((char)0x80), one = _mm512_set1_epi8(1);
    s.high0 = _mm512_mask_add_epi8(s.high0, _mm512_movepi8_mask(t->low0) & finite0, s.high0, one);
    s.high1 = _mm512_mask_add_epi8(s.high1, _mm512_movepi8_mask(t->low1) & finite1, s.high1, one);
    s.low0 = _mm512_mask_blend_epi8(finite0, t->low0, _mm512_xor_si512(t->low0, top));
    s.low1 = _mm512_mask_blend_epi8(finite1, t->low1, _mm512_xor_si512(t->low1, top));
  }
  return s;
}

/* The same permutation for 64 bf16 values already in memory (weight-only, bf16 input). */
BF16_TARGET ALWAYS_INLINE void permute64_bf16(__m512i v0, __m512i v1, __m512i* out0, __m512i* out1) {
  const __m512i index0 = _mm512_set_epi16(55, 54, 53, 52, 51, 50, 49, 48, 39, 38, 37, 36, 35, 34, 33, 32,
                                          23, 22, 21, 20, 19, 18, 17, 16, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i index1 = _mm512_add_epi16(index0, _mm512_set1_epi16(8));
  *out0 = _mm512_permutex2var_epi16(v0, index0, v1);
  *out1 = _mm512_permutex2var_epi16(v0, index1, v1);
}

/* The first `count` of 64 bytes (none for count <= 0: a load past the end of K reads nothing). */
ALWAYS_INLINE __mmask64 tail_mask64(int64_t count) {
  return count >= 64 ? ~(__mmask64)0 : count <= 0 ? (__mmask64)0 : (((__mmask64)1 << count) - 1);
}

/* 64 weight codes from `src` (the first `count` of them; zeros past it) widened into
 * dest[0, 64), 64-byte aligned. */
BF16_TARGET ALWAYS_INLINE void widen64_store(const widen_tables_t* t, const uint8_t* src, int64_t count,
                                             uint16_t* dest) {
  __m512i out0, out1;
  widen64(t, _mm512_maskz_loadu_epi8(tail_mask64(count), src), &out0, &out1);
  _mm512_store_si512(dest, out0);
  _mm512_store_si512(dest + 32, out1);
}

/* ---- block-wise scales ------------------------------------------------------ */

/* scale_a(m, kb) of the 16 activation rows from m0 (0 for rows past M: padding) for a
 * K-blocked call: one masked gather (blocked scale_a), masked load (per row) or
 * broadcast (per tensor). Built per tile and block of 128 k, a scalar loop cost the
 * AMX panel kernel ~25% (4096 x 4096, M = 256: 1.41x the per-channel time, 1.11x with
 * the scales left out). */
BF16_TARGET ALWAYS_INLINE __m512 fp8_block_scale_a16(const fp8_scaled_mm_params* p, int64_t m0, int64_t kb) {
  const int64_t valid = p->m - m0;
  const __mmask16 mask = valid >= 16 ? (__mmask16)0xFFFF : valid <= 0 ? (__mmask16)0 : (__mmask16)((1u << valid) - 1u);
  if (p->scale_a_blocked) {
    const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32((int)p->scale_a_row_stride));
    const float* base = mask ? fp8_k_block_scale_a_at(p, m0) + kb * fp8_k_block_scale_a_step(p) : p->scale_a;
    return _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mask, rows, base, 4);
  }
  if (p->scale_a_per_row) return _mm512_maskz_loadu_ps(mask, mask ? fp8_k_block_scale_a_at(p, m0) : p->scale_a);
  return _mm512_maskz_mov_ps(mask, _mm512_set1_ps(p->scale_a[0]));
}

/* scale_b(kb, n) for a weight row of a tile, which may lie past N (padding rows: any
 * valid scale, their outputs are never stored). */
ALWAYS_INLINE float fp8_block_scale_b(const fp8_scaled_mm_params* p, int64_t n, int64_t kb) {
  return fp8_k_block_scale_b(p, n < p->n ? n : p->n - 1, kb);
}

/* ---- epilogue pieces ------------------------------------------------------- */

/* scale_b of output columns [n, n + 16) (masked) of a call whose scales do not vary along K:
 * one per column, or the one scale broadcast. */
BF16_TARGET ALWAYS_INLINE __m512 load_scale_b16(const fp8_scaled_mm_params* p, int64_t n, __mmask16 mask) {
  return p->scale_b_per_col ? _mm512_maskz_loadu_ps(mask, p->scale_b + n) : _mm512_set1_ps(p->scale_b[0]);
}

/* bias[n, n + 16) (masked) as float32, zero without a bias. */
BF16_TARGET ALWAYS_INLINE __m512 load_bias16(const fp8_scaled_mm_params* p, int64_t n, __mmask16 mask) {
  if (!p->bias) return _mm512_setzero_ps();
  switch (p->bias_dtype) {
    case FP8_BFLOAT16: {
      const __m256i bits = _mm256_maskz_loadu_epi16(mask, (const uint16_t*)p->bias + n);
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
    }
    case FP8_FLOAT16: return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, (const uint16_t*)p->bias + n));
    default: return _mm512_maskz_loadu_ps(mask, (const float*)p->bias + n);
  }
}

/* x[0] in every lane by a load from memory (vbroadcastss m32: a load port, no shuffle); as
 * _mm512_set1_ps of a value just stored, the compiler turned it into register permutes,
 * on the port the transposes need. */
BF16_TARGET ALWAYS_INLINE __m512 broadcast_from_memory(const float* x) {
  __m512 r;
  __asm__("vbroadcastss %1, %0" : "=v"(r) : "m"(*x));
  return r;
}

/* ---- in-register transpose (activation packing, epilogues) --------------- */

/* In-register transpose of 16 x 16 floats: r[i][j] -> r[j][i] (64 shuffles). */
BF16_TARGET ALWAYS_INLINE void transpose16(__m512 r[16]) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) { /* per 128-bit lane: pairs of rows interleaved */
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int g = 0; g < 4; ++g) { /* u[4g + q], lane L: column 4L + q of rows 4g..4g+3 */
    const __m512d t0 = _mm512_castps_pd(t[4 * g]), t1 = _mm512_castps_pd(t[4 * g + 1]);
    const __m512d t2 = _mm512_castps_pd(t[4 * g + 2]), t3 = _mm512_castps_pd(t[4 * g + 3]);
    u[4 * g] = _mm512_castpd_ps(_mm512_unpacklo_pd(t0, t2));
    u[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(t0, t2));
    u[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(t1, t3));
    u[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(t1, t3));
  }
  for (int q = 0; q < 4; ++q) { /* gather lane L of u[q], u[4+q], u[8+q], u[12+q] */
    const __m512 v0 = _mm512_shuffle_f32x4(u[q], u[4 + q], 0x44), v1 = _mm512_shuffle_f32x4(u[q], u[4 + q], 0xEE);
    const __m512 w0 = _mm512_shuffle_f32x4(u[8 + q], u[12 + q], 0x44), w1 = _mm512_shuffle_f32x4(u[8 + q], u[12 + q], 0xEE);
    r[q] = _mm512_shuffle_f32x4(v0, w0, 0x88);
    r[4 + q] = _mm512_shuffle_f32x4(v0, w0, 0xDD);
    r[8 + q] = _mm512_shuffle_f32x4(v1, w1, 0x88);
    r[12 + q] = _mm512_shuffle_f32x4(v1, w1, 0xDD);
  }
}

#endif
