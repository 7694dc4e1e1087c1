/* Block scales that differ along K by powers of two only, folded into the operands
 * (fp8_cpu_scaled_mm_fold in kernels.h says when and why). */
#include <float.h>
#include <string.h>

#include "cpu_internal.h"

/* What the fold writes into the workspace: per-row scale_a (M floats) and per-column
 * scale_b (N floats) for the scales it folds, then the exponent tables. */
int64_t fp8_cpu_fold_bytes(const fp8_scaled_mm_params* p) {
  const int64_t k_blocks = (p->k + FP8_SCALE_BLOCK - 1) / FP8_SCALE_BLOCK;
  const int64_t n_blocks = (p->n + FP8_SCALE_BLOCK - 1) / FP8_SCALE_BLOCK;
  return (p->m + p->n) * (int64_t)sizeof(float) + (p->m + n_blocks) * k_blocks;
}

static uint32_t float_bits(float value) {
  uint32_t bits;
  memcpy(&bits, &value, sizeof bits);
  return bits;
}

/* One row of scales (count of them, `step` floats apart): if all are positive normal
 * floats with the same significand and exponents within FP8_FOLD_MAX_SHIFT of the
 * largest, writes each one's exponent offset from the largest (<= 0) to shifts[i], the
 * largest to *common, and returns 1. */
static int fold_row(const float* scales, int64_t step, int64_t count, int8_t* shifts, float* common) {
  const uint32_t first = float_bits(scales[0]);
  const uint32_t significand = first & 0x7FFFFFu;
  int max_exponent = 0;
  for (int64_t i = 0; i < count; ++i) {
    const uint32_t bits = float_bits(scales[i * step]);
    const int exponent = (int)(bits >> 23); /* sign included: a negative scale fails below */
    if (exponent < 1 || exponent > 254 || (bits & 0x7FFFFFu) != significand) return 0;
    if (exponent > max_exponent) max_exponent = exponent;
  }
  for (int64_t i = 0; i < count; ++i) {
    const int shift = (int)(float_bits(scales[i * step]) >> 23) - max_exponent;
    if (shift < -FP8_FOLD_MAX_SHIFT) return 0;
    shifts[i] = (int8_t)shift;
  }
  const uint32_t bits = ((uint32_t)max_exponent << 23) | significand;
  memcpy(common, &bits, sizeof bits);
  return 1;
}

/* The largest of `count` scales `step` floats apart. */
static float largest(const float* scales, int64_t step, int64_t count) {
  float value = scales[0];
  for (int64_t i = 1; i < count; ++i) value = scales[i * step] > value ? scales[i * step] : value;
  return value;
}

int fp8_cpu_scaled_mm_fold(const fp8_scaled_mm_params* p, const fp8_cpu_mm_plan* plan, void* workspace,
                           fp8_scaled_mm_params* folded) {
  /* Float activations (weight-only) are not folded: tdpbf16ps and vdpbf16ps flush products below
   * 2^-126, and a weight block shifted by 2^-32 would move that threshold for x * w up to
   * 2^-94, where bf16 activations can reach (fp8 ones cannot: their products are >= 2^-32). */
  if (plan->fold_offset < 0 || !fp8_k_blocked(p) || p->a_is_float) return 0;
  const int64_t k_blocks = (p->k + FP8_SCALE_BLOCK - 1) / FP8_SCALE_BLOCK;
  const int64_t n_blocks = (p->n + FP8_SCALE_BLOCK - 1) / FP8_SCALE_BLOCK;
  float* scale_rows = (float*)((uint8_t*)workspace + plan->fold_offset);
  float* scale_cols = scale_rows + p->m;
  int8_t* shifts_a = (int8_t*)(scale_cols + p->n);
  int8_t* shifts_b = shifts_a + p->m * k_blocks;
  *folded = *p;
  folded->fold_k_blocks = k_blocks;
  if (p->scale_a_blocked) {
    for (int64_t m = 0; m < p->m; ++m)
      if (!fold_row(fp8_k_block_scale_a_at(p, m), 1, k_blocks, shifts_a + m * k_blocks, scale_rows + m)) return 0;
    folded->scale_a = scale_rows;
    folded->scale_a_blocked = 0;
    folded->scale_a_per_row = 1;
    folded->scale_a_row_stride = 0;
    folded->fold_a = shifts_a;
  }
  if (p->scale_b_blocked) {
    for (int64_t nb = 0; nb < n_blocks; ++nb) {
      float common;
      if (!fold_row(fp8_k_block_scale_b_at(p, nb * FP8_SCALE_BLOCK), p->scale_b_k_stride, k_blocks,
                    shifts_b + nb * k_blocks, &common))
        return 0;
      const int64_t n_end = (nb + 1) * FP8_SCALE_BLOCK < p->n ? (nb + 1) * FP8_SCALE_BLOCK : p->n;
      for (int64_t n = nb * FP8_SCALE_BLOCK; n < n_end; ++n) scale_cols[n] = common;
    }
    folded->scale_b = scale_cols;
    folded->scale_b_blocked = 0;
    folded->scale_b_per_col = 1;
    folded->scale_b_k_stride = folded->scale_b_n_stride = 0;
    folded->fold_b = shifts_b;
  }
  /* the common factors multiply once per output: where their largest product would
   * overflow, while no block's product of scales does, keep the blocks */
  const float largest_a = largest(folded->scale_a, 1, folded->scale_a_per_row ? p->m : 1);
  const float largest_b = largest(folded->scale_b, 1, folded->scale_b_per_col ? p->n : 1);
  if (!((double)largest_a * (double)largest_b <= (double)FLT_MAX)) return 0;
  return 1;
}
