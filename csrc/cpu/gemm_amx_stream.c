/* scaled_mm with AMX for M <= 64 (FP8_AMX_STREAM_MAX_ROWS): the stream kernel. The
 * tiles are configured, and the layouts described, in gemm_amx.c.
 *
 * Few activation rows: the weights are read once, from memory, and the kernel must
 * stream them. 16 weight rows at a time over all of K, in steps of 64 k: the two A
 * tiles of a step (k halves) come from a 2 KiB buffer widened during the tile products
 * three steps earlier (AMX_STREAM_BUFFERS), and the C tiles stay in registers for all of K. On this Xeon
 * 4-16 rows streamed side by side read at the full bandwidth of a plain read loop,
 * while the panel kernel's order (256 bytes of each of 512 rows per K block) read at
 * ~37% of it at M = 16. Up to 4 groups of 16 activation rows (M <= 64): one group
 * sums the low and high halves of each step in C0 and C1 (two chains of tile products
 * instead of one), two groups in C0, C1 (low) and C2, C3 (high); three or four groups
 * have one C tile each, and a step runs all groups' low halves, then all high halves,
 * so that the products on one C tile are apart. */
#include "cpu_internal.h" /* FP8_X86_KERNELS */
#if FP8_X86_KERNELS /* the whole file: x86-64 only */

#include <string.h>

#include "amx_kernels.h"

enum {
  AMX_STREAM_ROWS = 16,      /* weight rows streamed side by side */
  AMX_STREAM_STEP = 64,      /* k per step: one cache line of each row */
  AMX_STREAM_PREFETCH = 256, /* bytes ahead in each row, into L1 */
  /* widened steps: this one and the next three. With two (this one and the next), each
   * step's A tiles were loaded right after the vector stores that widened them, and the
   * tile load waited for those stores to drain: 39% of the kernel's samples at M = 48
   * sat on that load (1536 x 576, 2 threads), and M = 48 took longer than M = 64. With
   * four, scaled_mm time over the two-buffer kernel's (medians of 3 alternated process
   * rounds, Intel Xeon with AMX, 2 threads): M = 48 0.78-0.96 (1536 x 576 104 vs 134
   * us), M = 4-16 0.92-0.98, M = 32-64 0.94-1.00. Four, not three: with an even count
   * each step's stores stay 2 KiB away, modulo 4 KiB, from the B tiles the next step
   * loads (see `placed`), as with two. */
  AMX_STREAM_BUFFERS = 4,
  /* its scratch: up to 4 KiB to place the buffers, 4 x 2 KiB of them, 4 KiB of sums and
   * 4 KiB of block-wise totals; then the block-wise scale_a table */
  AMX_STREAM_SCRATCH_BYTES = 5 * 4096
};

/* One step of the stream kernel: 64 codes of each of the 16 weight rows from `src`
 * (`cols` of them exist; the others are zeros), widened into the two A tiles at dest, times
 * 2^shift (folded block scales: the 16 rows and 64 k lie in one block of 128 x 128, so one
 * set of shifted tables serves them all). */
BF16_TARGET ALWAYS_INLINE void widen_stream_step(const widen_tables_t* tables, fp8_format format, const uint8_t* src,
                                                 int64_t stride, int64_t cols, int64_t k, int64_t k_left, int shift,
                                                 uint16_t* dest) {
  const widen_tables_t shifted = shifted_tables(tables, format, shift);
  const widen_tables_t* t = &shifted;
  const __mmask64 mask = tail_mask64(k_left);
  /* Each row's prefetch runs AMX_STREAM_PREFETCH bytes ahead; near the end of the row
   * (k codes long) it continues in the same row of the next group, so that the next
   * group's 16 streams do not start cold (K = 4096, 64 steps per group: 0.62 -> 0.58 ms
   * at M = 1, 2 threads, weights from memory). */
  const int64_t ahead = k_left <= AMX_STREAM_PREFETCH ? AMX_STREAM_ROWS * stride + AMX_STREAM_PREFETCH - k
                                                      : AMX_STREAM_PREFETCH;
  for (int r = 0; r < AMX_STREAM_ROWS; ++r) {
    __m512i out0 = _mm512_setzero_si512(), out1 = _mm512_setzero_si512();
    if (r < cols) {
      _mm_prefetch(address_at(src, r * stride + ahead), _MM_HINT_T0);
      widen64(t, _mm512_maskz_loadu_epi8(mask, src + r * stride), &out0, &out1);
    }
    _mm512_store_si512(dest + r * AMX_K, out0);
    _mm512_store_si512(dest + AMX_TILE_BF16 + r * AMX_K, out1);
  }
}

/* Steps in the order the stream kernel takes them: all of K for one group of 16
 * weight rows, then the next group. */
typedef struct {
  int64_t n0, k0;
} stream_step;

static stream_step next_stream_step(stream_step at, int64_t kp) {
  at.k0 += AMX_STREAM_STEP;
  if (at.k0 >= kp) {
    at.k0 = 0;
    at.n0 += AMX_STREAM_ROWS;
  }
  return at;
}

BF16_TARGET ALWAYS_INLINE void amx_stream(const fp8_scaled_mm_params* p, const fp8_cpu_mm_plan* plan,
                                          const uint32_t* packed, uint8_t* scratch, int64_t m_begin, int64_t m_end,
                                          int64_t n_begin, int64_t n_end, const int emulated, amx_model* model) {
  const widen_tables_t t = load_widen_tables(p->b_format);
  const int64_t kp = plan->k_padded;
  const int64_t group_stride = (kp / 2) * AMX_ROWS;
  const int64_t groups = (m_end - m_begin + AMX_ROWS - 1) / AMX_ROWS; /* 1..4 */
  const int two_groups = groups == 2, four_groups = groups == 4;
  const uint32_t* b_group0 = packed + (m_begin / AMX_ROWS) * group_stride;
  const uint32_t* b_group1 = b_group0 + group_stride;
  const uint32_t* b_group2 = b_group1 + group_stride;
  const uint32_t* b_group3 = b_group2 + group_stride;
  /* The step's stores into the next buffer, and the next step's B tiles loaded from the
   * packed activations (2 KiB further per step), must not share their page offsets: a
   * load waits on an older store to the same address bits 0-11 (4K aliasing). With the
   * buffers 2 KiB away from the B tiles modulo 4 KiB they never do for one group of
   * rows (M = 8, 4096 x 4096 from L3: 0.61 ms per call when they did, 0.47 ms). */
  const uintptr_t b_offset = (uintptr_t)b_group0 % 4096, scratch_offset = (uintptr_t)scratch % 4096;
  uint8_t* placed = scratch + (b_offset + 2048 + 4096 - scratch_offset) % 4096;
  uint16_t* buffers[AMX_STREAM_BUFFERS];
  for (int i = 0; i < AMX_STREAM_BUFFERS; ++i) buffers[i] = (uint16_t*)placed + 2 * AMX_TILE_BF16 * i;
  float* sums = (float*)(placed + AMX_STREAM_BUFFERS * 2 * AMX_TILE_BF16 * sizeof(uint16_t)); /* 4 C tiles */
  const int64_t tile_floats = AMX_ROWS * AMX_ROWS;
  /* K-blocked scales: the C tiles hold one block of 128 k at a time; each block, summed
   * per group as at the end below, joins these running sums with its scales */
  const int blocked = fp8_k_blocked(p);
  float* totals = sums + 4 * tile_floats;
  /* and scale_a of every (block of 128 k, row group), built once per call (4096 x 4096,
   * M = 64: 1.19x the per-channel time when built at every flush) */
  __m512* scale_table = (__m512*)(scratch + AMX_STREAM_SCRATCH_BYTES);
  if (blocked)
    for (int64_t kb = 0; kb * FP8_SCALE_BLOCK < kp; ++kb)
      for (int64_t group = 0; group < groups; ++group)
        scale_table[kb * 4 + group] = fp8_block_scale_a16(p, m_begin + group * AMX_ROWS, kb);
#define STREAM_COLS_AT(n0) (n_end - (n0) < AMX_STREAM_ROWS ? n_end - (n0) : AMX_STREAM_ROWS)
  /* the steps already widened: AMX_STREAM_BUFFERS - 1 of them ahead of the one in use */
  stream_step ahead = {n_begin, 0};
#define WIDEN_AHEAD(buffer)                                                                                 \
  widen_stream_step(&t, p->b_format, p->b + ahead.n0 * p->b_col_stride + ahead.k0, p->b_col_stride, STREAM_COLS_AT(ahead.n0), \
                    p->k, p->k - ahead.k0,                                                                  \
                    p->fold_b ? p->fold_b[ahead.n0 / FP8_SCALE_BLOCK * p->fold_k_blocks + ahead.k0 / FP8_SCALE_BLOCK] \
                              : 0,                                                                          \
                    buffer)
  for (int i = 0; i < AMX_STREAM_BUFFERS - 1 && ahead.n0 < n_end; ++i, ahead = next_stream_step(ahead, kp))
    WIDEN_AHEAD(buffers[i]);
  /* the sums, [weight row][activation row] per group; up to 2 groups, each group's two
   * halves (C0 + C2 and C1 + C3 for two, C0 + C1 for one) are added here */
#define STORE_GROUP_SUMS()                                                                               \
  do {                                                                                                   \
    TILE_STORE(0, sums, 64);                                                                             \
    TILE_STORE(1, sums + tile_floats, 64);                                                               \
    if (groups >= 2) TILE_STORE(2, sums + 2 * tile_floats, 64);                                          \
    if (groups >= 2) TILE_STORE(3, sums + 3 * tile_floats, 64);                                          \
    if (groups <= 2) {                                                                                   \
      for (int64_t group = 0; group < groups; ++group) {                                                 \
        float* low = sums + (groups == 2 ? group : 0) * tile_floats;                                     \
        const float* high = low + (groups == 2 ? 2 : 1) * tile_floats;                                   \
        for (int64_t i = 0; i < tile_floats; i += 16)                                                    \
          _mm512_store_ps(low + i, _mm512_add_ps(_mm512_load_ps(low + i), _mm512_load_ps(high + i)));   \
      }                                                                                                  \
    }                                                                                                    \
  } while (0)
  int64_t step = 0;
  for (int64_t n0 = n_begin; n0 < n_end; n0 += AMX_STREAM_ROWS) {
    TILE_ZERO(0);
    TILE_ZERO(1);
    if (groups >= 2) TILE_ZERO(2);
    if (groups >= 2) TILE_ZERO(3);
    for (int64_t k0 = 0; k0 < kp; k0 += AMX_STREAM_STEP, ++step) {
      const uint16_t* a = buffers[step % AMX_STREAM_BUFFERS];
      const int64_t pair0 = k0 / 2; /* the step's first k-pair */
      TILE_LOAD(4, a, 64);
      TILE_LOAD(5, a + AMX_TILE_BF16, 64);
      if (groups > 2) { /* C0..C3 = groups; all groups' low halves, then all high halves */
#define B_TILE(group, half) (b_group##group + (pair0 + (half) * AMX_ROWS) * AMX_ROWS)
        for (int half = 0; half < 2; ++half) {
          TILE_LOAD(6, B_TILE(0, half), 64);
          TILE_LOAD(7, B_TILE(1, half), 64);
          if (half == 0) {
            TILE_DPBF16PS(0, 4, 6);
            TILE_DPBF16PS(1, 4, 7);
          } else {
            TILE_DPBF16PS(0, 5, 6);
            TILE_DPBF16PS(1, 5, 7);
          }
          TILE_LOAD(6, B_TILE(2, half), 64);
          if (four_groups) TILE_LOAD(7, B_TILE(3, half), 64);
          if (half == 0) {
            TILE_DPBF16PS(2, 4, 6);
            if (four_groups) TILE_DPBF16PS(3, 4, 7);
          } else {
            TILE_DPBF16PS(2, 5, 6);
            if (four_groups) TILE_DPBF16PS(3, 5, 7);
          }
        }
#undef B_TILE
      } else if (two_groups) {
        TILE_LOAD(6, b_group0 + pair0 * AMX_ROWS, 64);
        TILE_LOAD(7, b_group1 + pair0 * AMX_ROWS, 64);
        TILE_DPBF16PS(0, 4, 6);
        TILE_DPBF16PS(1, 4, 7);
        TILE_LOAD(6, b_group0 + (pair0 + AMX_ROWS) * AMX_ROWS, 64);
        TILE_LOAD(7, b_group1 + (pair0 + AMX_ROWS) * AMX_ROWS, 64);
        TILE_DPBF16PS(2, 5, 6);
        TILE_DPBF16PS(3, 5, 7);
      } else {
        TILE_LOAD(6, b_group0 + pair0 * AMX_ROWS, 64);
        TILE_LOAD(7, b_group0 + (pair0 + AMX_ROWS) * AMX_ROWS, 64);
        TILE_DPBF16PS(0, 4, 6);
        TILE_DPBF16PS(1, 5, 7);
      }
      if (ahead.n0 < n_end) {
        WIDEN_AHEAD(buffers[(step + AMX_STREAM_BUFFERS - 1) % AMX_STREAM_BUFFERS]);
        ahead = next_stream_step(ahead, kp);
      }
      if (blocked && ((k0 + AMX_STREAM_STEP) % FP8_SCALE_BLOCK == 0 || k0 + AMX_STREAM_STEP >= kp)) {
        STORE_GROUP_SUMS();
        for (int64_t group = 0; group < groups; ++group)
          add_scaled_block(p, sums + group * tile_floats, totals + group * tile_floats, n0,
                           scale_table[(k0 / FP8_SCALE_BLOCK) * 4 + group], k0 / FP8_SCALE_BLOCK, k0 < FP8_SCALE_BLOCK);
        TILE_ZERO(0);
        TILE_ZERO(1);
        if (groups >= 2) TILE_ZERO(2);
        if (groups >= 2) TILE_ZERO(3);
      }
    }
    const fp8_sums_layout layout = {AMX_ROWS, 0, tile_floats}; /* group g at tile g */
    if (blocked) {
      fp8_bf16_tile_epilogue(p, totals, layout, m_begin, m_end, n0, STREAM_COLS_AT(n0));
      continue;
    }
    STORE_GROUP_SUMS();
    fp8_bf16_tile_epilogue(p, sums, layout, m_begin, m_end, n0, STREAM_COLS_AT(n0));
  }
#undef STORE_GROUP_SUMS
#undef STREAM_COLS_AT
#undef WIDEN_AHEAD
}

/* The scale_a table for K-blocked calls: one vector per (block of 128 k, row group),
 * after the kernel's AMX_STREAM_SCRATCH_BYTES. */
int64_t fp8_amx_stream_scratch_bytes(const fp8_cpu_mm_plan* plan) {
  return AMX_STREAM_SCRATCH_BYTES + (plan->k_padded / FP8_SCALE_BLOCK + 1) * 4 * 64;
}

BF16_TARGET void fp8_amx_stream_hardware(const fp8_scaled_mm_params* p, const fp8_cpu_mm_plan* plan,
                                         const uint32_t* packed, uint8_t* scratch, int64_t m_begin, int64_t m_end,
                                         int64_t n_begin, int64_t n_end) {
  amx_stream(p, plan, packed, scratch, m_begin, m_end, n_begin, n_end, 0, NULL);
}

BF16_TARGET void fp8_amx_stream_emulated(const fp8_scaled_mm_params* p, const fp8_cpu_mm_plan* plan,
                                         const uint32_t* packed, uint8_t* scratch, int64_t m_begin, int64_t m_end,
                                         int64_t n_begin, int64_t n_end, amx_model* model) {
  amx_stream(p, plan, packed, scratch, m_begin, m_end, n_begin, n_end, 1, model);
}

#endif /* FP8_X86_KERNELS */
