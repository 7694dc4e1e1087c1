/* quantize_fp8 on the CPU: the scalar variant, and the one place that picks the
 * ISA variant for the contiguous inner loops. Strided rows (column stride != 1)
 * always take the scalar loop: they are rare and a gather would not be faster. */
#include "cpu_internal.h"

uint32_t fp8_span_amax_scalar(const void* x, fp8_float_dtype dtype, int64_t n) {
  uint32_t amax_bits = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t magnitude = fp8_float_bits(fp8_load_float(x, dtype, i)) & 0x7FFFFFFFu;
    /* |x| as bits orders like |x| as float; inf and NaN (>= 0x7F800000) are skipped */
    if (magnitude < 0x7F800000u && magnitude > amax_bits) amax_bits = magnitude;
  }
  return amax_bits;
}

void fp8_span_quantize_scalar(const void* x, fp8_float_dtype dtype, int64_t n, float scale,
                              uint8_t* q, fp8_format format) {
  /* the encoder saturates and keeps NaN, which is exactly clamp-then-round */
  if (format == FP8_E4M3FN) {
    for (int64_t i = 0; i < n; ++i) q[i] = fp8_e4m3fn_from_float(fp8_load_float(x, dtype, i) / scale);
  } else {
    for (int64_t i = 0; i < n; ++i) q[i] = fp8_e5m2_from_float(fp8_load_float(x, dtype, i) / scale);
  }
}

static fp8_span_amax_fn pick_amax(void) {
#if FP8_X86_KERNELS
  switch (fp8_cpu_active_variant()) {
    case FP8_CPU_SCALAR: return fp8_span_amax_scalar;
    case FP8_CPU_AVX2: return fp8_span_amax_avx2;
    default: return fp8_span_amax_avx512;
  }
#else
  return fp8_span_amax_scalar;
#endif
}

static fp8_span_quantize_fn pick_quantize(void) {
#if FP8_X86_KERNELS
  switch (fp8_cpu_active_variant()) {
    case FP8_CPU_SCALAR: return fp8_span_quantize_scalar;
    case FP8_CPU_AVX2: return fp8_span_quantize_avx2;
    case FP8_CPU_AVX512: return fp8_span_quantize_avx512;
    default: return fp8_span_quantize_vbmi; /* avx512_bf16 and the AMX variants have VBMI */
  }
#else
  return fp8_span_quantize_scalar;
#endif
}

void fp8_cpu_row_amax(const fp8_quantize_params* p, int64_t row_begin, int64_t row_end,
                      int64_t col_begin, int64_t col_end, float* row_amax) {
  const fp8_span_amax_fn span_amax = pick_amax();
  const int64_t size = fp8_float_bytes(p->x_dtype);
  for (int64_t r = row_begin; r < row_end; ++r) {
    const char* row = (const char*)p->x + (r * p->x_row_stride + col_begin * p->x_col_stride) * size;
    uint32_t bits = 0;
    if (p->x_col_stride == 1) {
      bits = span_amax(row, p->x_dtype, col_end - col_begin);
    } else {
      for (int64_t c = 0; c < col_end - col_begin; ++c) {
        const uint32_t b = fp8_span_amax_scalar(row + c * p->x_col_stride * size, p->x_dtype, 1);
        if (b > bits) bits = b;
      }
    }
    row_amax[r - row_begin] = fp8_bits_float(bits);
  }
}

void fp8_cpu_quantize(const fp8_quantize_params* p, int64_t row_begin, int64_t row_end,
                      int64_t col_begin, int64_t col_end, const float* scale,
                      int64_t scale_row_stride) {
  const fp8_span_quantize_fn span_quantize = pick_quantize();
  const int64_t size = fp8_float_bytes(p->x_dtype);
  for (int64_t r = row_begin; r < row_end; ++r) {
    const char* row = (const char*)p->x + (r * p->x_row_stride + col_begin * p->x_col_stride) * size;
    uint8_t* q = p->q + r * p->cols + col_begin;
    const float row_scale = scale[r * scale_row_stride];
    if (p->x_col_stride == 1) {
      span_quantize(row, p->x_dtype, col_end - col_begin, row_scale, q, p->format);
    } else {
      for (int64_t c = 0; c < col_end - col_begin; ++c)
        fp8_span_quantize_scalar(row + c * p->x_col_stride * size, p->x_dtype, 1, row_scale,
                                 q + c, p->format);
    }
  }
}

void fp8_cpu_quantize_groups(const fp8_quantize_params* p, int64_t row_begin, int64_t row_end, int64_t group,
                             float* scales, int dynamic, float (*scale_of)(float amax, fp8_format format)) {
  const fp8_span_amax_fn span_amax = pick_amax();
  const fp8_span_quantize_fn span_quantize = pick_quantize();
  const int64_t size = fp8_float_bytes(p->x_dtype);
  const int64_t groups = (p->cols + group - 1) / group;
#if FP8_X86_KERNELS
  /* AVX-512: a row at a time, all its amaxes, then all its scales, then all its codes
   * (up to CHUNK groups at a time); the others group by group */
  const int whole_rows = fp8_cpu_active_variant() >= FP8_CPU_AVX512;
  /* with VBMI (avx512_bf16 and up), rows of power-of-two group scales (ue8m0) go through
   * one code table: bf16, dynamic groups of 128, 2 threads, Intel Xeon with AMX, time over
   * per-token quantization of the same input (medians of 15 alternated rounds), 256 x 576
   * 0.87 (division kernel: 1.26), 256 x 1536 1.14 (1.69), 512 x 576 0.83 (1.29), 256 x
   * 4096 1.33 (1.97); the rest of the gap is the per-group amax reductions */
  void (*const quantize_groups)(const void*, fp8_float_dtype, int64_t, int64_t, const float*, uint8_t*, fp8_format) =
      fp8_cpu_active_variant() >= FP8_CPU_AVX512_BF16 ? fp8_span_quantize_groups_vbmi : fp8_span_quantize_groups_avx512;
  enum { CHUNK = 256 };
  uint32_t amax_bits[CHUNK];
#endif
  for (int64_t r = row_begin; r < row_end; ++r) {
    const char* row = (const char*)p->x + r * p->x_row_stride * size;
    uint8_t* q = p->q + r * p->cols;
    float* row_scales = scales + r * groups;
#if FP8_X86_KERNELS
    if (whole_rows) {
      for (int64_t g0 = 0; g0 < groups; g0 += CHUNK) {
        const int64_t c0 = g0 * group, n = p->cols - c0 < CHUNK * group ? p->cols - c0 : CHUNK * group;
        if (dynamic) {
          fp8_span_amax_groups_avx512(row + c0 * size, p->x_dtype, n, group, amax_bits);
          for (int64_t g = 0; g * group < n; ++g) row_scales[g0 + g] = scale_of(fp8_bits_float(amax_bits[g]), p->format);
        }
        quantize_groups(row + c0 * size, p->x_dtype, n, group, row_scales + g0, q + c0, p->format);
      }
      continue;
    }
#endif
    for (int64_t g = 0, c = 0; g < groups; ++g, c += group) {
      const int64_t n = p->cols - c < group ? p->cols - c : group;
      if (dynamic) row_scales[g] = scale_of(fp8_bits_float(span_amax(row + c * size, p->x_dtype, n)), p->format);
      span_quantize(row + c * size, p->x_dtype, n, row_scales[g], q + c, p->format);
    }
  }
}
