/* The one entry-point header between the bindings and every kernel, CPU and CUDA.
 * Torch-free: plain parameter structs (pointers, int64_t sizes and strides in
 * elements) so that kernels can be compiled, tested and read without torch. */
#ifndef FP8LINEAR_KERNELS_H
#define FP8LINEAR_KERNELS_H

#include <stdint.h>
#include <string.h>

#include "fp8.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { FP8_FLOAT32 = 0, FP8_BFLOAT16 = 1, FP8_FLOAT16 = 2 } fp8_float_dtype;

/* ---- quantize_fp8 ------------------------------------------------------- */

typedef struct {
  const void* x;                          /* [rows, cols] float32 / bfloat16 / float16 */
  int64_t rows, cols;
  int64_t x_row_stride, x_col_stride;     /* in elements */
  fp8_float_dtype x_dtype;
  uint8_t* q;                             /* [rows, cols] fp8 codes, contiguous */
  fp8_format format;
} fp8_quantize_params;

/* ---- scaled_mm ---------------------------------------------------------- */

/* Block-wise scales (DeepSeek-V3 / Qwen3 FP8 checkpoints): one scale per 128 k. */
enum { FP8_SCALE_BLOCK = 128 };

typedef struct {
  const void* a;                          /* [M, K] fp8, or float (weight-only: a_is_float) */
  int64_t a_row_stride, a_col_stride;
  int a_is_float;                         /* a holds a_float_dtype values, not a_format codes */
  fp8_float_dtype a_float_dtype;
  const uint8_t* b;                       /* [K, N] fp8 (a Linear weight [N, K] seen as w.t()) */
  int64_t b_row_stride, b_col_stride;
  int64_t m, n, k;
  fp8_format a_format, b_format;
  const float* scale_a;                   /* [1] or [M], or blocked: [M, ceil(K / 128)] */
  int scale_a_per_row;
  const float* scale_b;                   /* [1] or [N], or blocked: [ceil(K / 128), ceil(N / 128)] */
  int scale_b_per_col;
  /* K-blocked scales: out[m, n] = sum over k blocks kb of 128 of
   *   scale_a(m, kb) * scale_b(kb, n) * (float32 sum of the products in kb),
   * scale_a(m, kb) = scale_a[m * scale_a_row_stride + kb] when scale_a_blocked (else the
   * per-tensor / per-row scale), scale_b(kb, n) = scale_b[kb * scale_b_k_stride +
   * (n / 128) * scale_b_n_stride] when scale_b_blocked (else per tensor / column). */
  int scale_a_blocked, scale_b_blocked;
  int64_t scale_a_row_stride;
  int64_t scale_b_k_stride, scale_b_n_stride;
  /* Block scales folded into the operands (fp8_cpu_scaled_mm_fold: the CPU AMX kernels,
   * the AVX512-BF16 eight-row, skinny and tile kernels and the avx512_fma FMA tiles only;
   * NULL everywhere else): the widened bf16 values of a's row m in block
   * kb of 128 k are multiplied by 2^fold_a[m * fold_k_blocks + kb], b's weight row n by
   * 2^fold_b[(n / 128) * fold_k_blocks + kb] (exponent offsets in [-FP8_FOLD_MAX_SHIFT, 0],
   * exact in bf16), and the call is no longer K-blocked: the per-row / per-column scales
   * left are the blocks' common factors. */
  const int8_t* fold_a;
  const int8_t* fold_b;
  int64_t fold_k_blocks;
  const void* bias;                       /* [N] or NULL, contiguous */
  fp8_float_dtype bias_dtype;
  void* out;                              /* [M, N], row stride out_row_stride, unit column stride */
  int64_t out_row_stride;
  fp8_float_dtype out_dtype;
} fp8_scaled_mm_params;

/* ---- CPU ----------------------------------------------------------------
 * Each function handles a range of the problem so that the bindings can spread
 * ranges over torch's intra-op thread pool. */

typedef enum {
  FP8_CPU_SCALAR = 0,
  FP8_CPU_AVX2 = 1,
  FP8_CPU_AVX512 = 2,      /* AVX-512 F/BW/VL */
  FP8_CPU_AVX512_BF16 = 3, /* + AVX512-BF16 dot products and AVX512-VBMI byte permutes */
  FP8_CPU_AMX = 4,         /* + AMX-BF16 tile products for the GEMMs (Sapphire Rapids and later) */
  /* The AMX kernels with every tile instruction replaced by a C model of it that
   * follows Intel's pseudocode (and matches the hardware bit for bit): tests the AMX
   * kernels' logic on any CPU with AVX512-BF16. Never picked as the best variant. */
  FP8_CPU_AMX_EMULATED = 5,
  /* The avx512_bf16 variant with float32 FMA register tiles instead of vdpbf16ps ones for
   * M >= 10 (gemm_avx512_fma.c): the best variant of Intel CPUs with AVX512-BF16 and VBMI
   * but no usable AMX, whose vdpbf16ps runs at a quarter of their FMAs' rate. */
  FP8_CPU_AVX512_FMA = 6,
  FP8_CPU_VARIANT_COUNT = 7
} fp8_cpu_variant;

const char* fp8_cpu_variant_name(fp8_cpu_variant variant);
/* The best variant this CPU (and OS) supports. */
fp8_cpu_variant fp8_cpu_best_variant(void);
/* Whether this CPU can run `variant`. For AMX that takes CPUID (AMX-TILE, AMX-BF16, a tile
 * palette of 8 tiles x 16 rows x 64 bytes), the OS (XCR0 tile state bits) and Linux's
 * per-process permission (arch_prctl ARCH_REQ_XCOMP_PERM), requested once, here. */
int fp8_cpu_variant_supported(fp8_cpu_variant variant);
/* Why AMX is not used on this machine ("" if it is): for messages and tests. */
const char* fp8_cpu_amx_status(void);
/* The variant the kernels use now; set_variant returns 0 (and changes nothing)
 * if the CPU can't run it. Tests force each supported variant in turn. */
fp8_cpu_variant fp8_cpu_active_variant(void);
int fp8_cpu_set_variant(fp8_cpu_variant variant);

/* amax of the finite |x| of each row in [row_begin, row_end) over the columns
 * [col_begin, col_end); row_amax[i] is for row row_begin + i. */
void fp8_cpu_row_amax(const fp8_quantize_params* p, int64_t row_begin, int64_t row_end,
                      int64_t col_begin, int64_t col_end, float* row_amax);

/* q = rne(clamp(x / scale, -FMAX, FMAX)) over the given rows and columns;
 * the scale of row r is scale[r * scale_row_stride] (stride 0: one scale). */
void fp8_cpu_quantize(const fp8_quantize_params* p, int64_t row_begin, int64_t row_end,
                      int64_t col_begin, int64_t col_end, const float* scale,
                      int64_t scale_row_stride);

/* Groups of `group` columns along each row in [row_begin, row_end) (the last one per row
 * possibly partial), rows with unit column stride: one scale per group, scales[row *
 * groups_per_row + g]; dynamic: computed from the group's amax by scale_of and written
 * there, else read. One call per range of rows: the kernel variant is picked once, not
 * per group. */
void fp8_cpu_quantize_groups(const fp8_quantize_params* p, int64_t row_begin, int64_t row_end, int64_t group,
                             float* scales, int dynamic, float (*scale_of)(float amax, fp8_format format));

/* scaled_mm runs in three steps: plan (which kernel, how much memory), prepare
 * (activations widened into the workspace, rows [m_begin, m_end)), then compute
 * (outputs [m_begin, m_end) x [n_begin, n_end)). The bindings spread prepare over
 * rows and compute over tiles of the plan's sizes. The caller provides all memory:
 * the workspace, shared by the threads (prepare writes it, compute reads it), and a
 * scratch area for each thread (panels and sums of the GEMM kernels), so that the
 * kernels allocate nothing per call: a fresh buffer of a megabyte costs page faults,
 * and on a VM that hands freed memory back to its host, faults through the host (the
 * AMX kernel at M = 1024 ran at half speed in such phases). */
typedef enum {
  FP8_MM_SCALAR = 0,     /* any strides; decodes through tables */
  FP8_MM_FLOAT_DOT = 1,  /* AVX2 float32 FMA dot kernel: the avx2/avx512 variants, float32/float16 activations */
  FP8_MM_BF16_DOT = 2,   /* bf16 dot products along K: small M (GEMV) */
  FP8_MM_BF16_TILE = 3,  /* bf16 register tiles over packed activations: larger M (plan.skinny: the skinny kernel) */
  FP8_MM_AMX = 4,        /* AMX tile products over the same packed activations (amx / amx_emulated variants) */
  FP8_MM_AVX2_PANEL = 5, /* AVX2: float32 register blocks over widened weight panels, M above the dot kernel's */
  FP8_MM_FMA_TILE = 6    /* AVX-512 float32 FMA register tiles over packed activations (avx512_fma variant, M >= 10) */
} fp8_cpu_mm_method;

typedef struct {
  fp8_cpu_mm_method method;
  fp8_cpu_variant variant;
  int64_t k_padded;          /* K rounded up to the kernel's step; workspace rows have this length */
  int64_t m_padded;          /* M rounded up to the kernel's row block */
  int64_t workspace_bytes;   /* shared by the threads, 64-byte aligned */
  int64_t scratch_bytes;     /* per thread, 64-byte aligned */
  int64_t tile_m, tile_n;    /* a good work unit for one thread */
  int64_t fold_offset;       /* where in the workspace fp8_cpu_scaled_mm_fold may put its tables; -1: no fold */
  int skinny;                /* FP8_MM_BF16_TILE: the skinny kernel (M <= 64) runs, not the register tiles */
} fp8_cpu_mm_plan;

/* threads: how many threads will share the call's tiles (the kernel for 64 padded rows depends
 * on how evenly its tiles split among them) */
fp8_cpu_mm_plan fp8_cpu_scaled_mm_plan(const fp8_scaled_mm_params* p, int64_t threads);
void fp8_cpu_scaled_mm_prepare(const fp8_scaled_mm_params* p, const fp8_cpu_mm_plan* plan, void* workspace,
                               void* scratch, int64_t m_begin, int64_t m_end);
void fp8_cpu_scaled_mm(const fp8_scaled_mm_params* p, const fp8_cpu_mm_plan* plan, const void* workspace,
                       void* scratch, int64_t m_begin, int64_t m_end, int64_t n_begin, int64_t n_end);

/* Block-wise calls (fp8_k_blocked) whose scales differ along K by powers of two only:
 * per row of a, every scale_a(m, kb) is c_m * 2^e(m, kb) with one c_m, and per block of
 * 128 weight rows every scale_b(kb, n) is c_n * 2^e(kb, n) (all of them when scale_fmt is
 * "ue8m0": powers of two), within 2^FP8_FOLD_MAX_SHIFT of the row's largest. Then the
 * powers of two go into the widened bf16 operands (exact: e4m3 and e5m2 values times 2^-32
 * or more stay normal in bf16, and their products in float32), each output is one float32
 * sum over all of K, and c_m * c_n scales it once at the end, as a per-token, per-channel
 * call: the AMX kernels then keep their C tiles over all of K instead of storing and
 * adding them, scaled, every 128 k (and the AVX512-BF16 skinny and tile kernels sum
 * 256 k or all of K at a time instead of each 128 k apart). Products exact, float32 sums
 * in another order: the same contract. If the plan allows it (fold_offset >= 0) and the scales qualify, writes
 * the folded call's scales and exponent tables into workspace + plan->fold_offset, sets
 * *folded and returns 1; else returns 0 and the call runs K-blocked. Before prepare. */
enum { FP8_FOLD_MAX_SHIFT = 32 };
int fp8_cpu_scaled_mm_fold(const fp8_scaled_mm_params* p, const fp8_cpu_mm_plan* plan, void* workspace,
                           fp8_scaled_mm_params* folded);

/* Reads bytes [0, bytes) of data once (XOR checksum): the benchmarks' memory probe. */
uint64_t fp8_cpu_read_probe(const void* data, int64_t bytes);

/* The block-scale lookups below are the one rule for the CPU kernels and the CUDA ones
 * (compiled for both by nvcc); scales are read through FP8_SCALE_LOAD, a read-only
 * cached load in device code. */
#ifdef __CUDACC__
#define FP8_HOST_DEVICE __host__ __device__
#else
#define FP8_HOST_DEVICE
#endif
#ifdef __CUDA_ARCH__
#define FP8_SCALE_LOAD(pointer) __ldg(pointer)
#else
#define FP8_SCALE_LOAD(pointer) (*(pointer))
#endif

/* The smallest power of two >= scale (positive, finite, below 2^127, as the dynamic scale
 * rule's are), on the float32 bits: scale_fmt "ue8m0", as DeepSeek's reference inference
 * rounds its activation scales. One rule for the CPU bindings and the CUDA kernels. */
static inline FP8_HOST_DEVICE float fp8_power_of_two_ceil(float scale) {
  uint32_t bits;
  memcpy(&bits, &scale, sizeof bits);
  if (bits & 0x7FFFFFu) bits = (bits & 0x7F800000u) + 0x800000u;
  memcpy(&scale, &bits, sizeof bits);
  return scale;
}

/* Bytes per element of a float dtype: 4 for float32, 2 for bf16 and fp16. */
static inline FP8_HOST_DEVICE int64_t fp8_float_bytes(fp8_float_dtype dtype) { return dtype == FP8_FLOAT32 ? 4 : 2; }

/* The call restricted to rows [m0, m1) of a, scale_a (and fold_a) and out: the CUDA
 * launcher's parts of a call over 2^20 rows, the CPU bindings' tail rows. */
static inline fp8_scaled_mm_params fp8_scaled_mm_rows(const fp8_scaled_mm_params* p, int64_t m0, int64_t m1) {
  fp8_scaled_mm_params part = *p;
  const int64_t a_bytes = p->a_is_float ? fp8_float_bytes(p->a_float_dtype) : 1;
  part.a = (const char*)p->a + m0 * p->a_row_stride * a_bytes;
  part.out = (char*)p->out + m0 * p->out_row_stride * fp8_float_bytes(p->out_dtype);
  part.scale_a = p->scale_a + (p->scale_a_blocked ? m0 * p->scale_a_row_stride : p->scale_a_per_row ? m0 : 0);
  if (p->fold_a) part.fold_a = p->fold_a + m0 * p->fold_k_blocks;
  part.m = m1 - m0;
  return part;
}

/* Whether either scale varies along K (block-wise scaling). */
static inline FP8_HOST_DEVICE int fp8_k_blocked(const fp8_scaled_mm_params* p) {
  return p->scale_a_blocked || p->scale_b_blocked;
}

/* scale_a(m) and scale_b(n) of a call whose scales do not vary along K: per tensor, per
 * row of a, per column of b (0 <= m < M, 0 <= n < N). */
static inline FP8_HOST_DEVICE float fp8_scale_a(const fp8_scaled_mm_params* p, int64_t m) {
  return FP8_SCALE_LOAD(p->scale_a + (p->scale_a_per_row ? m : 0));
}
static inline FP8_HOST_DEVICE float fp8_scale_b(const fp8_scaled_mm_params* p, int64_t n) {
  return FP8_SCALE_LOAD(p->scale_b + (p->scale_b_per_col ? n : 0));
}

/* The scales of a K-blocked call as a pointer and a step, for kernels that walk K block
 * by block: scale_b(kb, n) = fp8_k_block_scale_b_at(p, n)[kb * fp8_k_block_scale_b_step(p)]
 * (0 <= n < N), scale_a(m, kb) = fp8_k_block_scale_a_at(p, m)[kb * fp8_k_block_scale_a_step(p)]
 * (0 <= m < M); a scale that does not vary along K has step 0. */
static inline FP8_HOST_DEVICE const float* fp8_k_block_scale_b_at(const fp8_scaled_mm_params* p, int64_t n) {
  return p->scale_b + (p->scale_b_blocked ? (n / FP8_SCALE_BLOCK) * p->scale_b_n_stride : p->scale_b_per_col ? n : 0);
}
static inline FP8_HOST_DEVICE int64_t fp8_k_block_scale_b_step(const fp8_scaled_mm_params* p) {
  return p->scale_b_blocked ? p->scale_b_k_stride : 0;
}
static inline FP8_HOST_DEVICE const float* fp8_k_block_scale_a_at(const fp8_scaled_mm_params* p, int64_t m) {
  return p->scale_a + (p->scale_a_blocked ? m * p->scale_a_row_stride : p->scale_a_per_row ? m : 0);
}
static inline FP8_HOST_DEVICE int64_t fp8_k_block_scale_a_step(const fp8_scaled_mm_params* p) {
  return p->scale_a_blocked ? 1 : 0;
}

/* scale_b(kb, n) of a K-blocked call (kb: the block of 128 k; 0 <= n < N). The value
 * lookups spell out what the pointer and step above give, since in this form nvcc keeps
 * the K-blocked GEMV's registers for sm_89 within its budget (through the pointer and
 * step, or a select on the pointer, it spilled 8-12 bytes). */
static inline FP8_HOST_DEVICE float fp8_k_block_scale_b(const fp8_scaled_mm_params* p, int64_t n, int64_t kb) {
  return p->scale_b_blocked
             ? FP8_SCALE_LOAD(p->scale_b + kb * p->scale_b_k_stride + (n / FP8_SCALE_BLOCK) * p->scale_b_n_stride)
             : fp8_scale_b(p, n);
}

/* scale_a(m, kb) of a K-blocked call (kb: the block of 128 k; 0 <= m < M). */
static inline FP8_HOST_DEVICE float fp8_k_block_scale_a(const fp8_scaled_mm_params* p, int64_t m, int64_t kb) {
  return p->scale_a_blocked ? FP8_SCALE_LOAD(p->scale_a + m * p->scale_a_row_stride + kb)
                            : fp8_scale_a(p, m);
}

/* scale_a(m, kb) * scale_b(kb, n) of a K-blocked call. */
static inline FP8_HOST_DEVICE float fp8_k_block_scale(const fp8_scaled_mm_params* p, int64_t m, int64_t n, int64_t kb) {
  return fp8_k_block_scale_a(p, m, kb) * fp8_k_block_scale_b(p, n, kb);
}

#ifdef __cplusplus
}
#endif

#endif /* FP8LINEAR_KERNELS_H */
