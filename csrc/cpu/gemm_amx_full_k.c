/* scaled_mm with AMX for M > 64 at K <= FP8_AMX_FULL_K_MAX: the full-K kernel. The tiles
 * are configured, and the layouts described, in gemm_amx.c; the weight panels and the
 * tile step it shares with the panel kernel are in amx_kernels.h. */
#include "cpu_internal.h" /* FP8_X86_KERNELS */
#if FP8_X86_KERNELS /* the whole file: x86-64 only */

#include "amx_kernels.h"

enum {
  AMX_FULL_K_COLS = 32,            /* its panels: 2 A tiles tall, all of K */
  AMX_FULL_K_CHUNK_BYTES = 1 << 20 /* packed activations per row chunk: half of L2 */
};

/* Moderate K (SmolLM2's 576 and 1536): the C tiles stay in registers for all of K, so
 * that no partial sums go to memory and back, and each 32 x 32 block of the output is
 * finished (scaled, rounded, stored) right after its tile products, from L1. Panels of
 * 32 weight rows x all of K (36 KiB at K = 576), widened while the previous one is used,
 * each used by a chunk of activation rows whose packed K (up to 1 MiB) stays in L2.
 * The panel kernel's 64 x 256 panels with sums in memory between K blocks ran the tile
 * products at ~1.5-1.7 TFLOP/s per core at K = 576 in a microbenchmark of both loop
 * orders on this Xeon, this order at ~2.0-2.2 (peak ~3.2 from L1). */

/* Rows of a chunk: its packed activations (rows x K bf16) within AMX_FULL_K_CHUNK_BYTES,
 * a multiple of 32, at least 32 and at most AMX_ROW_CHUNK. */
static int64_t full_k_chunk_rows(int64_t k_padded) {
  int64_t rows = AMX_FULL_K_CHUNK_BYTES / (k_padded * (int64_t)sizeof(uint16_t)) / 32 * 32;
  if (rows < 32) rows = 32;
  return rows < AMX_ROW_CHUNK ? rows : AMX_ROW_CHUNK;
}

/* A block's stored tiles (or K-blocked totals): [weight group][activation group][16][16]. */
static const fp8_sums_layout full_k_layout = {AMX_ROWS, 2 * AMX_ROWS * AMX_ROWS, AMX_ROWS * AMX_ROWS};

/* One 32 x 32 block over all of K: C tiles 0-3 (weight-row group g, g + 1 x activation-row
 * group r, r + 1), left in `tiles` ([weight group][activation group][16][16]); K-blocked
 * calls sum each block of 128 k in the tiles and add it, scaled, into `totals` (same
 * layout), whose final values are left there instead. */
BF16_TARGET ALWAYS_INLINE void full_k_block(const uint16_t* panel_g, const uint16_t* panel_g1, const uint32_t* b0,
                                            const uint32_t* b1, int64_t steps, float* tiles, float* totals,
                                            panel_widener* next, const widen_tables_t* t, int64_t widen_per_step,
                                            const fp8_scaled_mm_params* p, int64_t n_first, const __m512* scale_rows,
                                            int64_t scale_rows_stride, pending_epilogue* pending,
                                            const int both_cols, const int both_rows, const int emulated,
                                            amx_model* model) {
  const int64_t tile_floats = AMX_ROWS * AMX_ROWS, stride = AMX_ROWS * (int64_t)sizeof(float);
  const int blocked = fp8_k_blocked(p);
  const int64_t steps_per_block = (int64_t)FP8_SCALE_BLOCK / AMX_K;
  TILE_ZERO(0);
  if (both_rows) TILE_ZERO(1);
  if (both_cols) TILE_ZERO(2);
  if (both_cols && both_rows) TILE_ZERO(3);
  for (int64_t s = 0; s < steps; ++s) {
    tile_step(panel_g, panel_g1, b0, b1, s, 1, both_cols, both_rows, emulated, model);
    widen_units(next, t, widen_per_step);
    pending_step(p, pending, s, steps); /* the previous block's epilogue */
    if (blocked && ((s + 1) % steps_per_block == 0 || s + 1 == steps)) {
      const int64_t kb = s / steps_per_block;
      add_block_tiles(p, tiles, totals, totals + tile_floats, totals + 2 * tile_floats, totals + 3 * tile_floats,
                      n_first, scale_rows + kb * scale_rows_stride, kb, kb == 0, both_cols, both_rows, emulated,
                      model);
      TILE_ZERO(0);
      if (both_rows) TILE_ZERO(1);
      if (both_cols) TILE_ZERO(2);
      if (both_cols && both_rows) TILE_ZERO(3);
    }
  }
  pending_finish(p, pending); /* (fewer steps than pieces) */
  if (blocked) return;
  TILE_STORE(0, tiles, stride);
  if (both_rows) TILE_STORE(1, tiles + tile_floats, stride);
  if (both_cols) TILE_STORE(2, tiles + 2 * tile_floats, stride);
  if (both_cols && both_rows) TILE_STORE(3, tiles + 3 * tile_floats, stride);
}

/* Rows [m_begin, m_end) (m_begin a multiple of 16) x weight rows [n_begin, n_end), in row
 * chunks of full_k_chunk_rows; within a chunk panel by panel, each over all its rows.
 * `scratch`: two panels, then two buffers of 4 KiB of tiles and 4 KiB of totals (one
 * for the block being multiplied, one for the block whose epilogue is pending), then
 * (K-blocked) the chunk's scale_a table, one vector per (block of 128 k, row group). */
BF16_TARGET ALWAYS_INLINE void amx_full_k(const fp8_scaled_mm_params* p, const fp8_cpu_mm_plan* plan,
                                          const uint32_t* packed, uint8_t* scratch, int64_t m_begin, int64_t m_end,
                                          int64_t n_begin, int64_t n_end, const int emulated, amx_model* model) {
  const widen_tables_t t = load_widen_tables(p->b_format);
  const int64_t kp = plan->k_padded, steps = kp / AMX_K;
  const int64_t group_stride = (kp / 2) * AMX_ROWS;
  const int64_t panel_bf16 = AMX_FULL_K_COLS * kp;
  uint16_t* panels[2] = {(uint16_t*)scratch, (uint16_t*)scratch + panel_bf16};
  float* const buffers = (float*)(scratch + 2 * panel_bf16 * (int64_t)sizeof(uint16_t));
  const int64_t buffer_floats = 8 * AMX_ROWS * AMX_ROWS; /* tiles, then totals */
  __m512* scale_table = (__m512*)(buffers + 2 * buffer_floats);
  const int blocked = fp8_k_blocked(p);
  const int64_t k_blocks = (kp + FP8_SCALE_BLOCK - 1) / FP8_SCALE_BLOCK;
  const int64_t chunk = full_k_chunk_rows(kp);
  pending_epilogue pending = no_pending_epilogue(buffers, full_k_layout);
  int buffer = 0;
#define FULL_K_COLS_AT(n0) (n_end - (n0) < AMX_FULL_K_COLS ? n_end - (n0) : AMX_FULL_K_COLS)
  /* panels in order: chunk by chunk, within a chunk n_begin to n_end */
  panel_widener next = panel_widener_of(p, n_begin, FULL_K_COLS_AT(n_begin), 0, kp, panels[0], AMX_FULL_K_COLS);
  widen_units(&next, &t, next.left);
  int current = 0;
  for (int64_t m0 = m_begin; m0 < m_end; m0 += chunk) {
    const int64_t m1 = m_end - m0 < chunk ? m_end : m0 + chunk;
    const int64_t rows = (m1 - m0 + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS, row_groups = rows / AMX_ROWS;
    const uint32_t* chunk_packed = packed + (m0 / AMX_ROWS) * group_stride;
    /* K-blocked scales: scale_a of every (block of 128 k, row group) of the chunk, built
     * once for all of its panels; table[kb * row_groups + group] */
    if (blocked)
      for (int64_t kb = 0; kb < k_blocks; ++kb)
        for (int64_t g = 0; g < row_groups; ++g) scale_table[kb * row_groups + g] = fp8_block_scale_a16(p, m0 + g * AMX_ROWS, kb);
    for (int64_t n0 = n_begin; n0 < n_end; n0 += AMX_FULL_K_COLS, current ^= 1) {
      const int64_t cols = FULL_K_COLS_AT(n0);
      const int both_cols = cols > AMX_ROWS;
      const uint16_t* panel = panels[current];
      /* the next panel: this chunk's next one, or the next chunk's first */
      const int64_t next_n0 = n0 + AMX_FULL_K_COLS < n_end ? n0 + AMX_FULL_K_COLS : n_begin;
      if (n0 + AMX_FULL_K_COLS < n_end || m1 < m_end) {
        next = panel_widener_of(p, next_n0, FULL_K_COLS_AT(next_n0), 0, kp, panels[current ^ 1], AMX_FULL_K_COLS);
      } else {
        next.left = 0;
      }
      const int64_t total_steps = (row_groups + 1) / 2 * steps;
      const int64_t widen_per_step = (next.left + total_steps - 1) / total_steps;
      for (int64_t r0 = 0; r0 < rows; r0 += 2 * AMX_ROWS) {
        const int both_rows = rows - r0 > AMX_ROWS;
        const uint32_t* b0 = chunk_packed + (r0 / AMX_ROWS) * group_stride;
        float* tiles = buffers + buffer * buffer_floats;
        float* totals = tiles + 4 * AMX_ROWS * AMX_ROWS;
        TWO_BY_TWO_CASES(full_k_block, panel, panel + steps * AMX_TILE_BF16, b0, b0 + group_stride, steps, tiles, totals, &next,
                           &t, widen_per_step, p, n0, scale_table + r0 / AMX_ROWS, row_groups, &pending)
        /* this block's epilogue: during the next block's products */
        pending_block(&pending, blocked ? totals : tiles, m0 + r0, m1, n0, cols, both_rows);
        buffer ^= 1;
      }
      widen_units(&next, &t, next.left); /* whatever the steps left */
    }
  }
  pending_finish(p, &pending);
#undef FULL_K_COLS_AT
}

/* The full-K kernel's scratch: two panels, twice 4 KiB of tiles and 4 of totals, the scale_a table. */
int64_t fp8_amx_full_k_scratch_bytes(const fp8_cpu_mm_plan* plan) {
  const int64_t k_blocks = (plan->k_padded + FP8_SCALE_BLOCK - 1) / FP8_SCALE_BLOCK;
  return 2 * AMX_FULL_K_COLS * plan->k_padded * (int64_t)sizeof(uint16_t) + 4 * AMX_BLOCK_TILES_BYTES +
         full_k_chunk_rows(plan->k_padded) / AMX_ROWS * k_blocks * 64;
}

BF16_TARGET void fp8_amx_full_k_hardware(const fp8_scaled_mm_params* p, const fp8_cpu_mm_plan* plan,
                                         const uint32_t* packed, uint8_t* scratch, int64_t m_begin, int64_t m_end,
                                         int64_t n_begin, int64_t n_end) {
  amx_full_k(p, plan, packed, scratch, m_begin, m_end, n_begin, n_end, 0, NULL);
}

BF16_TARGET void fp8_amx_full_k_emulated(const fp8_scaled_mm_params* p, const fp8_cpu_mm_plan* plan,
                                         const uint32_t* packed, uint8_t* scratch, int64_t m_begin, int64_t m_end,
                                         int64_t n_begin, int64_t n_end, amx_model* model) {
  amx_full_k(p, plan, packed, scratch, m_begin, m_end, n_begin, n_end, 1, model);
}

#endif /* FP8_X86_KERNELS */
