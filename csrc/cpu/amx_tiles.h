/* The AMX tile instructions the kernels of gemm_amx*.c use, either on the hardware or
 * as a C model of the tile registers (the amx_emulated variant), behind the same macros.
 *
 * The model follows the pseudocode of TDPBF16PS in Intel's SDM, and was matched bit for
 * bit against an Emerald Rapids on 3 million outputs of random, tiny (subnormal) and
 * signed-zero operands: for each output and each instruction, the even-k and the odd-k
 * products are summed in two float32 fused multiply-add chains (round to nearest even;
 * bf16 inputs and the C input with denormals taken as zero, every result with
 * denormals flushed), then C + (even + odd). Not bit-identical to vdpbf16ps, whose
 * order differs; both are float32 sums of exact products. tests/test_amx.py compares
 * the two on AMX hardware, also where products and sums cross float32's smallest
 * normal. Only amx_kernels.h includes this. */
#ifndef FP8LINEAR_AMX_TILES_H
#define FP8LINEAR_AMX_TILES_H

#include <string.h>

#include "bf16_widen.h"

enum { AMX_TILE_ROWS = 16, AMX_TILE_BYTES_PER_ROW = 64 };

/* The 64-byte operand of ldtilecfg / sttilecfg (palette 1). */
typedef struct {
  uint8_t palette, start_row, reserved[14];
  uint16_t bytes_per_row[16];
  uint8_t rows[16];
} __attribute__((aligned(64))) amx_tile_config;

/* ---- the tile registers as a C model (amx_emulated) ------------------------ */

typedef struct {
  amx_tile_config config;
  uint8_t tile[8][AMX_TILE_ROWS * AMX_TILE_BYTES_PER_ROW] __attribute__((aligned(64)));
} amx_model;

static inline void model_load(amx_model* model, int t, const void* base, int64_t stride) {
  const int rows = model->config.rows[t], width = model->config.bytes_per_row[t];
  memset(model->tile[t], 0, sizeof model->tile[t]);
  for (int r = 0; r < rows; ++r) memcpy(model->tile[t] + r * 64, (const uint8_t*)base + r * stride, (size_t)width);
}

static inline void model_store(const amx_model* model, int t, void* base, int64_t stride) {
  const int rows = model->config.rows[t], width = model->config.bytes_per_row[t];
  for (int r = 0; r < rows; ++r) memcpy((uint8_t*)base + r * stride, model->tile[t] + r * 64, (size_t)width);
}

static inline void model_zero(amx_model* model, int t) { memset(model->tile[t], 0, sizeof model->tile[t]); }

/* Denormals as zero (inputs) and flushed to zero (results), keeping the sign. */
BF16_TARGET ALWAYS_INLINE __m512 flush_denormals(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __mmask16 denormal = _mm512_testn_epi32_mask(bits, _mm512_set1_epi32(0x7F800000));
  return _mm512_castsi512_ps(_mm512_mask_and_epi32(bits, denormal, bits, _mm512_set1_epi32((int)0x80000000u)));
}

/* TDPBF16PS c += a . b as the SDM's pseudocode has it: C has rows(c) rows of
 * bytes_per_row(c) / 4 float32, A rows(c) rows of bytes_per_row(a) / 4 bf16 pairs, B
 * one row of pairs per pair of A. Vectorized over the (up to 16) columns of C. */
BF16_TARGET static inline void model_dpbf16ps(amx_model* model, int c, int a, int b) {
  const int rows = model->config.rows[c], columns = model->config.bytes_per_row[c] / 4;
  const int pairs = model->config.bytes_per_row[a] / 4;
  const __mmask16 column_mask = (__mmask16)((1u << columns) - 1u);
  const uint32_t* a_tile = (const uint32_t*)model->tile[a];
  const uint32_t* b_tile = (const uint32_t*)model->tile[b];
  float* c_tile = (float*)model->tile[c];
  const __m512i high_half = _mm512_set1_epi32((int)0xFFFF0000u);
  for (int m = 0; m < rows; ++m) {
    __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
    for (int k = 0; k < pairs; ++k) {
      const uint32_t a_pair = a_tile[m * 16 + k];
      const __m512 a_even = flush_denormals(_mm512_castsi512_ps(_mm512_set1_epi32((int)(a_pair << 16))));
      const __m512 a_odd = flush_denormals(_mm512_castsi512_ps(_mm512_set1_epi32((int)(a_pair & 0xFFFF0000u))));
      const __m512i b_pairs = _mm512_maskz_loadu_epi32(column_mask, b_tile + k * 16);
      const __m512 b_even = flush_denormals(_mm512_castsi512_ps(_mm512_slli_epi32(b_pairs, 16)));
      const __m512 b_odd = flush_denormals(_mm512_castsi512_ps(_mm512_and_si512(b_pairs, high_half)));
      even = flush_denormals(_mm512_fmadd_ps(a_even, b_even, even));
      odd = flush_denormals(_mm512_fmadd_ps(a_odd, b_odd, odd));
    }
    const __m512 c_row = flush_denormals(_mm512_maskz_loadu_ps(column_mask, c_tile + m * 16));
    const __m512 sum = flush_denormals(_mm512_add_ps(c_row, flush_denormals(_mm512_add_ps(even, odd))));
    _mm512_mask_storeu_ps(c_tile + m * 16, column_mask, sum);
  }
}

/* ---- the tile instructions: hardware or model ------------------------------ */

/* Own inline assembly rather than GCC 12's intrinsics: its _tile_loadconfig tells the
 * compiler it reads 8 bytes, which let it drop the stores to a config on the stack
 * (SIGILL at the next tile instruction), and its _tile_loadd has no memory operand,
 * so a buffer written just before could be loaded before the stores. Here the config
 * is a 64-byte memory operand and loads and stores clobber memory. Tile numbers are
 * part of the instruction, hence macros. `emulated` is a compile-time constant in
 * each instantiation of the kernel body; `model` is NULL on hardware. */
#define TILE_LOAD_WITH(instruction, t, base, stride)                                                             \
  do {                                                                                                          \
    if (emulated) model_load(model, t, base, stride);                                                           \
    else __asm__ volatile(instruction " (%0,%1,1), %%tmm" #t ::"r"(base), "r"((int64_t)(stride)) : "memory");  \
  } while (0)
#define TILE_LOAD(t, base, stride) TILE_LOAD_WITH("tileloadd", t, base, stride)
/* TILELOADDT1: the same load, with the hint that the data is not reused soon (kept out of L1) */
#define TILE_LOAD_T1(t, base, stride) TILE_LOAD_WITH("tileloaddt1", t, base, stride)
#define TILE_STORE(t, base, stride)                                                                             \
  do {                                                                                                          \
    if (emulated) model_store(model, t, base, stride);                                                          \
    else __asm__ volatile("tilestored %%tmm" #t ", (%0,%1,1)" ::"r"(base), "r"((int64_t)(stride)) : "memory"); \
  } while (0)
#define TILE_ZERO(t)                                              \
  do {                                                            \
    if (emulated) model_zero(model, t);                           \
    else __asm__ volatile("tilezero %%tmm" #t ::);                \
  } while (0)
#define TILE_DPBF16PS(c, a, b)                                                    \
  do {                                                                            \
    if (emulated) model_dpbf16ps(model, c, a, b);                                 \
    else __asm__ volatile("tdpbf16ps %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::);     \
  } while (0)

static inline void hardware_load_config(const amx_tile_config* config) { __asm__ volatile("ldtilecfg %0" ::"m"(*config)); }
static inline void hardware_store_config(amx_tile_config* config) { __asm__ volatile("sttilecfg %0" : "=m"(*config)); }
static inline void hardware_release(void) { __asm__ volatile("tilerelease" ::: "memory"); }

/* Tiles 0-3: C (weight-row group 0/1 x activation-row group 0/1), 4-5: A, 6-7: B; all full. */
static inline void fill_config(amx_tile_config* config) {
  memset(config, 0, sizeof *config);
  config->palette = 1;
  for (int t = 0; t < 8; ++t) {
    config->rows[t] = AMX_TILE_ROWS;
    config->bytes_per_row[t] = AMX_TILE_BYTES_PER_ROW;
  }
}

#endif
