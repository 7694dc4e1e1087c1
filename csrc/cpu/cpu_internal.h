/* Declarations shared by the CPU kernel files: one function per ISA for each
 * contiguous inner loop. Only csrc/cpu/ includes this. */
#ifndef FP8LINEAR_CPU_INTERNAL_H
#define FP8LINEAR_CPU_INTERNAL_H

#include "../kernels.h"

/* Every kernel variant but the scalar one is x86-64 code (intrinsics, CPUID, AMX), and is
 * compiled on x86-64 only: each such file is wrapped in #if FP8_X86_KERNELS, and the
 * dispatch in gemm.c, quantize.c and read_probe.c leaves them out elsewhere. On other CPUs (aarch64,
 * ...) the extension builds with the scalar kernels alone, which cpu_features.c reports
 * as the best variant (tests/test_build.py compiles csrc/cpu for aarch64). */
#if defined(__x86_64__) || defined(_M_X64)
#define FP8_X86_KERNELS 1
#else
#define FP8_X86_KERNELS 0
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Largest finite |x| of x[0..n) as float32 bits (0 if none is finite). */
typedef uint32_t (*fp8_span_amax_fn)(const void* x, fp8_float_dtype dtype, int64_t n);
/* q[i] = rne(clamp(x[i] / scale)) for i in [0, n). */
typedef void (*fp8_span_quantize_fn)(const void* x, fp8_float_dtype dtype, int64_t n,
                                     float scale, uint8_t* q, fp8_format format);

uint32_t fp8_span_amax_scalar(const void* x, fp8_float_dtype dtype, int64_t n);
uint32_t fp8_span_amax_avx2(const void* x, fp8_float_dtype dtype, int64_t n);
uint32_t fp8_span_amax_avx512(const void* x, fp8_float_dtype dtype, int64_t n);

void fp8_span_quantize_scalar(const void* x, fp8_float_dtype dtype, int64_t n, float scale,
                              uint8_t* q, fp8_format format);
void fp8_span_quantize_avx2(const void* x, fp8_float_dtype dtype, int64_t n, float scale,
                            uint8_t* q, fp8_format format);
void fp8_span_quantize_avx512(const void* x, fp8_float_dtype dtype, int64_t n, float scale,
                              uint8_t* q, fp8_format format);
/* The same for the groups of one row (group i: x[i * group, min(n, (i + 1) * group))),
 * each with its own scale: amax_bits[i] (as fp8_span_amax), scales[i]. */
void fp8_span_amax_groups_avx512(const void* x, fp8_float_dtype dtype, int64_t n, int64_t group,
                                 uint32_t* amax_bits);
void fp8_span_quantize_groups_avx512(const void* x, fp8_float_dtype dtype, int64_t n, int64_t group,
                                     const float* scales, uint8_t* q, fp8_format format);
/* bf16 by a per-scale table (quantize_vbmi.c), else as fp8_span_quantize_avx512; needs VBMI. */
void fp8_span_quantize_vbmi(const void* x, fp8_float_dtype dtype, int64_t n, float scale,
                            uint8_t* q, fp8_format format);
/* Groups as fp8_span_quantize_groups_avx512; bf16 groups with power-of-two scales by one
 * shared table (quantize_vbmi.c). */
void fp8_span_quantize_groups_vbmi(const void* x, fp8_float_dtype dtype, int64_t n, int64_t group,
                                   const float* scales, uint8_t* q, fp8_format format);

/* Element at index i of a float32/bf16/fp16 array, as float32. */
static inline float fp8_load_float(const void* x, fp8_float_dtype dtype, int64_t i) {
  switch (dtype) {
    case FP8_BFLOAT16: return fp8_bf16_to_float(((const uint16_t*)x)[i]);
    case FP8_FLOAT16: return fp8_half_to_float(((const uint16_t*)x)[i]);
    default: return ((const float*)x)[i];
  }
}

static inline void fp8_store_float(void* out, fp8_float_dtype dtype, int64_t i, float v) {
  switch (dtype) {
    case FP8_BFLOAT16: ((uint16_t*)out)[i] = fp8_float_to_bf16(v); break;
    case FP8_FLOAT16: ((uint16_t*)out)[i] = fp8_float_to_half(v); break;
    default: ((float*)out)[i] = v; break;
  }
}

/* Output (m, n) of a float32 dot kernel from its sum: scaled (unless a K-blocked call
 * applied the scales per block), biased and rounded once. */
static inline void fp8_store_dot_sum(const fp8_scaled_mm_params* p, int64_t m, int64_t n, float sum) {
  const float scale = fp8_k_blocked(p) ? 1.0f : fp8_scale_a(p, m) * fp8_scale_b(p, n);
  const float bias = p->bias ? fp8_load_float(p->bias, p->bias_dtype, n) : 0.0f;
  fp8_store_float(p->out, p->out_dtype, m * p->out_row_stride + n, sum * scale + bias);
}

/* Bytes fp8_cpu_scaled_mm_fold (fold_scales.c) may write at plan->fold_offset. */
int64_t fp8_cpu_fold_bytes(const fp8_scaled_mm_params* p);

/* Up to this many (padded) activation rows the AVX512-BF16 variant may run its skinny
 * kernel (16 weight rows at a time, the plan's tile_n; at exactly this many, plan.skinny
 * says whether it does), above it the tile kernel. */
enum { FP8_BF16_SKINNY_MAX_ROWS = 64 };
/* M = 5-8 on the AVX512-BF16 variant: padded to this many rows (the plan's m_padded; one
 * block of rows, never split), the eight-row kernel, 16 weight rows at a time. */
enum { FP8_BF16_ROWS8 = 8 };

/* The AVX512-BF16 kernels (gemm_avx512_bf16.c, gemm_avx512_bf16_skinny.c,
 * gemm_avx512_bf16_dot.c); scratch: fp8_bf16_scratch_bytes per thread. */
int64_t fp8_bf16_scratch_bytes(const fp8_cpu_mm_plan* plan);
void fp8_bf16_prepare(const fp8_scaled_mm_params* p, const fp8_cpu_mm_plan* plan, void* workspace, void* scratch,
                      int64_t m_begin, int64_t m_end);
void fp8_bf16_compute(const fp8_scaled_mm_params* p, const fp8_cpu_mm_plan* plan, const void* workspace,
                      void* scratch, int64_t m_begin, int64_t m_end, int64_t n_begin, int64_t n_end);
/* Its dot kernel (gemm_avx512_bf16_dot.c), on the activation rows that prepare widened. */
void fp8_bf16_dot_compute(const fp8_scaled_mm_params* p, const fp8_cpu_mm_plan* plan, const uint16_t* activations,
                          int64_t m_begin, int64_t m_end, int64_t n_begin, int64_t n_end);
/* Its skinny and eight-row kernels (gemm_avx512_bf16_skinny.c, M = 5-64), on the row groups
 * that prepare packed; scratch: their block-wise scale_a table. */
void fp8_bf16_skinny_compute(const fp8_scaled_mm_params* p, const fp8_cpu_mm_plan* plan, const uint32_t* packed,
                             void* scratch, int64_t m_begin, int64_t m_end, int64_t n_begin, int64_t n_end);
/* Activation rows [m_begin, m_end) widened to bf16 as the AVX512-BF16 kernels widen them
 * (k_padded values a row, zero past K, interleave order, folded block scales applied),
 * row m at out + (m - m_begin) * k_padded. */
void fp8_bf16_widen_activation_rows(const fp8_scaled_mm_params* p, int64_t m_begin, int64_t m_end, int64_t k_padded,
                                    uint16_t* out);

/* The avx512_fma variant's float32 FMA tile kernel (gemm_avx512_fma.c, FP8_MM_FMA_TILE):
 * activations packed by prepare into the workspace (fp8_fma_workspace_bytes: [m_padded /
 * 16][k_padded][16] float32), per-thread scratch fp8_fma_scratch_bytes; its sums go through
 * fp8_bf16_tile_epilogue. */
enum { FP8_FMA_MIN_ROWS = 10 }; /* from this M on; below, the avx512_bf16 variant's kernels (gemm.c) */
int64_t fp8_fma_workspace_bytes(const fp8_cpu_mm_plan* plan);
int64_t fp8_fma_scratch_bytes(const fp8_cpu_mm_plan* plan);
void fp8_fma_prepare(const fp8_scaled_mm_params* p, const fp8_cpu_mm_plan* plan, void* workspace, void* scratch,
                     int64_t m_begin, int64_t m_end);
void fp8_fma_compute(const fp8_scaled_mm_params* p, const fp8_cpu_mm_plan* plan, const void* workspace,
                     void* scratch, int64_t m_begin, int64_t m_end, int64_t n_begin, int64_t n_end);

/* Where the float32 sum of output column c, row r (both from 0) of a block lies:
 * sums[(c / 16) * col_group + (c % 16) * col + (r / 16) * row_group + r % 16]. */
typedef struct {
  int64_t col, col_group, row_group;
} fp8_sums_layout;

/* sums[col][row], `rows` (a multiple of 16) floats per column. */
static inline fp8_sums_layout fp8_sums_by_column(int64_t rows) {
  fp8_sums_layout layout = {rows, 16 * rows, 16};
  return layout;
}

/* Sums -> out rows [m_begin, m_end) x columns [n0, n0 + cols), scaled, biased, rounded. */
void fp8_bf16_tile_epilogue(const fp8_scaled_mm_params* p, const float* sums, fp8_sums_layout layout,
                            int64_t m_begin, int64_t m_end, int64_t n0, int64_t cols);
/* One 16 x 16 block of it: rows m_begin + r0.., columns n0 + c0.. (r0, c0 multiples of 16,
 * r0 < m_end - m_begin, c0 < cols), so that a kernel can spread the epilogue of one
 * block of the output among the tile products of the next. */
void fp8_bf16_tile_epilogue16(const fp8_scaled_mm_params* p, const float* sums, fp8_sums_layout layout,
                              int64_t m_begin, int64_t m_end, int64_t n0, int64_t cols, int64_t r0, int64_t c0);

/* The AMX kernels (gemm_amx*.c): plan->variant picks the real tile instructions or
 * their C model; activations packed by fp8_bf16_prepare. Up to FP8_AMX_STREAM_MAX_ROWS
 * (padded) rows the stream kernel runs, 16 weight rows at a time (the plan's tile_n);
 * above, 64 at a time, the full-K kernel up to a padded K of FP8_AMX_FULL_K_MAX (the C
 * tiles kept over all of K: 4096 x 1024 at M = 2048, 2 threads, 2.21 -> 2.33 TFLOP/s;
 * 576 x 576 2.00 -> 2.40; even at K = 1536 and 2048; slower at 4096, 2.44 -> 2.15), the
 * panel kernel above. */
enum { FP8_AMX_STREAM_MAX_ROWS = 64, FP8_AMX_FULL_K_MAX = 2048 };
int64_t fp8_amx_scratch_bytes(const fp8_cpu_mm_plan* plan);
void fp8_amx_compute(const fp8_scaled_mm_params* p, const fp8_cpu_mm_plan* plan, const void* workspace,
                     void* scratch, int64_t m_begin, int64_t m_end, int64_t n_begin, int64_t n_end);

/* Activation rows [m_begin, m_end) -> float32 workspace rows of plan->k_padded (zero
 * padded) for the AVX2 kernels (gemm.c). For calls the dot kernel takes by its float32
 * route (fp8_avx2_float32_route), the fp8 activations are multiplied by
 * fp8_avx2_activation_factor (a power of two: exact) and, within each 32 k, position
 * 8t + j holds k = 4j + t (t = 0..3, j = 0..7), the order in which that route widens the
 * weights (gemm_avx2.c); other calls get the activations as they are, in order. */
void fp8_float_prepare(const fp8_scaled_mm_params* p, const fp8_cpu_mm_plan* plan, void* workspace,
                       int64_t m_begin, int64_t m_end);

/* The AVX2 kernels (gemm_avx2.c, gemm_avx2_panel.c), over the same float32 workspace (K rounded up to 32;
 * the panel kernel's also holds a table of block-wise activation scales after it):
 * the dot kernel (FP8_MM_FLOAT_DOT: the avx2 and avx512 variants, and float32 / float16
 * activations on the bf16 variants) and the panel kernel
 * (FP8_MM_AVX2_PANEL: panels of FP8_AVX2_KC k, a multiple of FP8_SCALE_BLOCK, tiles of at
 * most FP8_AVX2_TILE_M rows, its scratch fp8_avx2_scratch_bytes). The dot kernel takes
 * e4m3fn weights against fp8 activations (fp8_avx2_float32_route) up to
 * FP8_AVX2_FLOAT32_DOT_MAX_ROWS rows, and the rest (the float16 route) up to
 * FP8_AVX2_DOT_MAX_ROWS; the panel kernel, which widens and transposes each weight once per
 * tile of rows, takes larger M. One thread, AMD EPYC Zen 3, built with the extension's
 * flags, 4096 x 4096 from memory, ms dot / panel, e4m3fn against fp8, per-channel
 * (block-wise): M = 16 8.35 / 9.89 (9.62 / 9.99), M = 20 10.7 / 11.7 (12.1 / 12.3), M = 24
 * 12.7 / 12.6 (14.8 / 12.9), M = 32 16.5 / 16.3 (19.0 / 16.8), M = 64 33.1 / 27.3 (39-40 /
 * 28-30); e5m2 (without -fwrapv) M = 8 4.72 / 6.44, M = 12 7.06 / 7.19, M = 16 9.38 /
 * 9.07. Through scaled_mm (2 threads), the panel against the dot kernel at M = 256:
 * 4096 x 4096 67.8 -> 52.0 ms per-channel, 78.5-79.2 -> 56.9-57.3 block-wise; 1536 x 576
 * 4.39 -> 2.78, 5.04 -> 2.95. (Until the panel's accumulators became named variables, the
 * float32 route took every M: the array GCC kept a stack copy of under -fwrapv made the
 * e4m3fn panel run at half speed.) The dot kernel walks the weights in chunks of about
 * FP8_AVX2_DOT_CHUNK_BYTES, each against all of its rows, so that the blocks of 4 rows
 * after the first read the chunk from L2 (64 KiB to 1 MiB chunks: the same within 5% at
 * M = 64-1024 on 4096 x 4096). */
enum { FP8_AVX2_DOT_MAX_ROWS = 16, FP8_AVX2_FLOAT32_DOT_MAX_ROWS = 20, FP8_AVX2_KC = 256, FP8_AVX2_TILE_M = 256, FP8_AVX2_DOT_CHUNK_BYTES = 256 * 1024 };
/* Whether the avx2 dot kernel runs this call by its float32 route (see gemm_avx2.c). */
int fp8_avx2_float32_route(const fp8_scaled_mm_params* p);
int64_t fp8_avx2_scratch_bytes(const fp8_cpu_mm_plan* plan);
/* The panel kernel's workspace: the float32 activations, and for block-wise calls a table
 * of their scales; fp8_avx2_panel_prepare fills rows [m_begin, m_end) of both. */
int64_t fp8_avx2_panel_workspace_bytes(const fp8_scaled_mm_params* p, const fp8_cpu_mm_plan* plan);
void fp8_avx2_panel_prepare(const fp8_scaled_mm_params* p, const fp8_cpu_mm_plan* plan, void* workspace,
                            int64_t m_begin, int64_t m_end);
/* What fp8 activations are widened times for the avx2 kernels (in fp8_float_prepare). */
float fp8_avx2_activation_factor(const fp8_scaled_mm_params* p);
void fp8_avx2_compute(const fp8_scaled_mm_params* p, const fp8_cpu_mm_plan* plan, const void* workspace,
                      void* scratch, int64_t m_begin, int64_t m_end, int64_t n_begin, int64_t n_end);

/* 256-entry decode tables (fp8 code -> float32), built once. */
const float* fp8_decode_table(fp8_format format);

#ifdef __cplusplus
}
#endif

#endif
