/* The epilogue of the AVX512-BF16 tile and skinny kernels and of the AMX kernels: float32
 * sums kept by output column (fp8_sums_layout, cpu_internal.h) -> out, scaled, biased and
 * rounded once to out's dtype, 16 x 16 at a time, transposed in registers so that each
 * output row is written with one (masked) vector store. */
#include "cpu_internal.h" /* FP8_X86_KERNELS */
#if FP8_X86_KERNELS /* the whole file: x86-64 only */

#include "bf16_widen.h"

/* In-register transpose of 16 x 16 16-bit values held two rows to a register (24 byte
 * permutes, single-uop vpermt2b, against the 64 shuffles of transpose16 on twice the
 * bytes): v[j] holds columns 2j (words 0-15) and 2j + 1 (words 16-31), word i of each half
 * in row i; on return v[k] holds rows 2k and 2k + 1, word i of each half in column i.
 * Stage s exchanges one bit between the register index and the word index (register
 * bit s: from column bit s + 1 to row bit s + 1) over the pairs j, j + 2^s; the last stage
 * also puts the words in their final order. Output o of stage s (register bit s = o)
 * takes word w from register `sel` of the pair, word `from`: */
#define TW_BYTE(sel, from, i) ((sel) * 64 + (from) * 2 + (i) % 2)
#define TW0(o, i) TW_BYTE(((i) / 2 >> 1) & 1, ((i) / 2 & ~2) | ((o) << 1), i)
#define TW1(o, i) TW_BYTE(((i) / 2 >> 2) & 1, ((i) / 2 & ~4) | ((o) << 2), i)
#define TW2(o, i) TW_BYTE(((i) / 2 >> 3) & 1, (((i) / 2 >> 4) & 1) | ((i) / 2 & 6) | ((o) << 3) | (((i) / 2 & 1) << 4), i)
#define TW8(f, o, b) f(o, b), f(o, b + 1), f(o, b + 2), f(o, b + 3), f(o, b + 4), f(o, b + 5), f(o, b + 6), f(o, b + 7)
#define TW64(f, o) \
  {TW8(f, o, 0), TW8(f, o, 8), TW8(f, o, 16), TW8(f, o, 24), TW8(f, o, 32), TW8(f, o, 40), TW8(f, o, 48), TW8(f, o, 56)}
static const uint8_t transpose_words_index[3][2][64] __attribute__((aligned(64))) = {
    {TW64(TW0, 0), TW64(TW0, 1)}, {TW64(TW1, 0), TW64(TW1, 1)}, {TW64(TW2, 0), TW64(TW2, 1)}};
#undef TW64
#undef TW8
#undef TW2
#undef TW1
#undef TW0
#undef TW_BYTE

BF16_TARGET ALWAYS_INLINE void transpose16_words(__m512i v[8]) {
  /* both loops unrolled, so that v stays in registers: with the pair test inside the
   * loop over j, GCC kept v on the stack and each permute stored and reloaded it (the
   * bf16 epilogue alone, 16 x 16 pieces from L1, one core of an Intel Xeon: 108 -> 77
   * cycles a piece) */
#pragma GCC unroll 3
  for (int s = 0; s < 3; ++s) {
    const __m512i index0 = _mm512_load_si512(transpose_words_index[s][0]);
    const __m512i index1 = _mm512_load_si512(transpose_words_index[s][1]);
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) { /* the pairs j, j + 2^s: j the i-th index without bit s */
      const int j = ((i >> s) << (s + 1)) | (i & ((1 << s) - 1));
      const __m512i a = v[j], b = v[j | (1 << s)];
      v[j] = _mm512_permutex2var_epi8(a, index0, b);
      v[j | (1 << s)] = _mm512_permutex2var_epi8(a, index1, b);
    }
  }
}

/* 16-bit outputs (bfloat16, float16: DTYPE): the block is scaled, biased and rounded
 * while still by column (one scale_b and bias per column, the rows' scale_a along it;
 * the same product and fma as store_block_rows, so the same bits), two columns to a
 * register, and only then transposed, in 16-bit values (transpose16_words). */
BF16_TARGET ALWAYS_INLINE void store_block_16bit(const fp8_scaled_mm_params* p, const float* sums_block, int64_t col,
                                                int64_t m_first, int64_t valid_rows, int64_t n, __mmask16 mask,
                                                __m512 scale_b, __m512 bias, const int DTYPE, const int BLOCKED) {
  /* per column, broadcast from memory (a load, not a shuffle) */
  float scale_b_cols[16] __attribute__((aligned(64))), bias_cols[16] __attribute__((aligned(64)));
  _mm512_store_ps(scale_b_cols, scale_b);
  _mm512_store_ps(bias_cols, bias);
  const __mmask16 row_mask = valid_rows >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << valid_rows) - 1u);
  const __m512 scale_a = BLOCKED ? _mm512_set1_ps(1.0f)
                         : p->scale_a_per_row ? _mm512_maskz_loadu_ps(row_mask, p->scale_a + m_first)
                                              : _mm512_set1_ps(p->scale_a[0]);
  __m512i v[8];
  for (int c = 0; c < 16; c += 2) {
    const __m512 value0 = _mm512_fmadd_ps(_mm512_loadu_ps(sums_block + c * col),
                                          _mm512_mul_ps(scale_a, broadcast_from_memory(scale_b_cols + c)), broadcast_from_memory(bias_cols + c));
    const __m512 value1 = _mm512_fmadd_ps(_mm512_loadu_ps(sums_block + (c + 1) * col),
                                          _mm512_mul_ps(scale_a, broadcast_from_memory(scale_b_cols + c + 1)),
                                          broadcast_from_memory(bias_cols + c + 1));
    if (DTYPE == FP8_BFLOAT16) {
      v[c / 2] = (__m512i)_mm512_cvtne2ps_pbh(value1, value0); /* value0 in the low half */
    } else {
      const int rounding = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
      v[c / 2] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtps_ph(value0, rounding)),
                                    _mm512_cvtps_ph(value1, rounding), 1);
    }
  }
  transpose16_words(v);
  uint16_t* out = (uint16_t*)p->out + m_first * p->out_row_stride + n;
  for (int k = 0; k < 8; ++k) {
    if (2 * k >= valid_rows) break;
    _mm256_mask_storeu_epi16(out + 2 * k * p->out_row_stride, mask, _mm512_castsi512_si256(v[k]));
    if (2 * k + 1 < valid_rows)
      _mm256_mask_storeu_epi16(out + (2 * k + 1) * p->out_row_stride, mask, _mm512_extracti64x4_epi64(v[k], 1));
  }
}

/* float32 outputs: rows j < valid_rows of a transposed 16 x 16 block -> out rows
 * m_first + j, columns n.. (mask): scaled, biased (BLOCKED a constant, so that the
 * unrolled loop keeps the block in registers). */
BF16_TARGET ALWAYS_INLINE void store_block_rows(const fp8_scaled_mm_params* p, const __m512 block[16], int64_t m_first,
                                               int64_t valid_rows, int64_t n, __mmask16 mask, __m512 scale_b,
                                               __m512 bias, const int BLOCKED) {
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) {
    if (j >= valid_rows) break;
    const int64_t m = m_first + j;
    /* K-blocked calls: the sums come with their scales applied per block of 128 k */
    const __m512 scale = BLOCKED ? scale_b : _mm512_mul_ps(_mm512_set1_ps(fp8_scale_a(p, m)), scale_b);
    _mm512_mask_storeu_ps((float*)p->out + m * p->out_row_stride + n, mask, _mm512_fmadd_ps(block[j], scale, bias));
  }
}

/* Sums by output column (layout: cpu_internal.h) -> out: the 16 x 16 block of rows
 * m_begin + r0.. and columns c0.. (r0, c0 multiples of 16), transposed in registers so
 * that each output row is written with one (masked) vector store. */
BF16_TARGET ALWAYS_INLINE void tile_epilogue16(const fp8_scaled_mm_params* p, const float* sums, fp8_sums_layout layout,
                                              int64_t m_begin, int64_t m_end, int64_t n0, int64_t cols, int64_t r0,
                                              int64_t c0) {
  const int64_t valid_rows = m_end - m_begin - r0 < 16 ? m_end - m_begin - r0 : 16;
  const __mmask16 mask = cols - c0 >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (cols - c0)) - 1u);
  const int64_t n = n0 + c0;
  /* K-blocked calls: the sums come with their scales applied per block of 128 k */
  const int blocked = fp8_k_blocked(p);
  const __m512 scale_b = blocked ? _mm512_set1_ps(1.0f) : load_scale_b16(p, n, mask);
  const __m512 bias = load_bias16(p, n, mask);
  /* columns past `cols` are never stored */
  const float* sums_block = sums + (c0 / 16) * layout.col_group + (r0 / 16) * layout.row_group;
  const int64_t m_first = m_begin + r0;
#define STORE_16BIT(DTYPE)                                                                                \
  if (blocked) {                                                                                          \
    store_block_16bit(p, sums_block, layout.col, m_first, valid_rows, n, mask, scale_b, bias, DTYPE, 1);  \
  } else {                                                                                                \
    store_block_16bit(p, sums_block, layout.col, m_first, valid_rows, n, mask, scale_b, bias, DTYPE, 0);  \
  }
  switch (p->out_dtype) {
    case FP8_BFLOAT16: STORE_16BIT(FP8_BFLOAT16) return;
    case FP8_FLOAT16: STORE_16BIT(FP8_FLOAT16) return;
    default: break;
  }
#undef STORE_16BIT
  __m512 block[16];
  for (int c = 0; c < 16; ++c) block[c] = _mm512_loadu_ps(sums_block + c * layout.col);
  transpose16(block);
  if (blocked) {
    store_block_rows(p, block, m_first, valid_rows, n, mask, scale_b, bias, 1);
  } else {
    store_block_rows(p, block, m_first, valid_rows, n, mask, scale_b, bias, 0);
  }
}

BF16_TARGET void fp8_bf16_tile_epilogue16(const fp8_scaled_mm_params* p, const float* sums, fp8_sums_layout layout,
                                          int64_t m_begin, int64_t m_end, int64_t n0, int64_t cols, int64_t r0,
                                          int64_t c0) {
  tile_epilogue16(p, sums, layout, m_begin, m_end, n0, cols, r0, c0);
}

BF16_TARGET void fp8_bf16_tile_epilogue(const fp8_scaled_mm_params* p, const float* sums, fp8_sums_layout layout,
                                        int64_t m_begin, int64_t m_end, int64_t n0, int64_t cols) {
  /* Row blocks outer: the (up to 64) columns of an output row are written back to back,
   * whole cache lines at a time; column blocks outer wrote each line in pieces at
   * different times, each piece a store miss of its own (AMX kernel, M = 1024,
   * 4096 x 4096, one core: 24.8 -> 23.8 ms). */
  for (int64_t r0 = 0; r0 < m_end - m_begin; r0 += 16)
    for (int64_t c0 = 0; c0 < cols; c0 += 16) tile_epilogue16(p, sums, layout, m_begin, m_end, n0, cols, r0, c0);
}

#endif /* FP8_X86_KERNELS */
