/* scaled_mm with Intel AMX-BF16 tile products (Sapphire Rapids and later).
 *
 * The data layout is the AVX512-BF16 tile kernel's (gemm_avx512_bf16.c): activations
 * packed by groups of 16 rows as (k, k+1) pairs, which is exactly AMX's "VNNI" layout
 * for the B operand of TDPBF16PS (16 k-pairs x 16 rows x 2 bf16 = one 1 KiB tile); the
 * weight, in its canonical [N, K] layout, is the A operand: 16 weight rows x 32 k,
 * widened from fp8 into small buffers as the kernels go (bf16_widen.h), the next ones
 * between the tile products of the current ones. A tile product gives C^T, 16 output
 * columns x 16 rows, which the AVX512-BF16 epilogue transposes on its way out.
 *
 * Three kernels, by M and K (the dot kernel of gemm_avx512_bf16_dot.c keeps M = 1, see gemm.c):
 * - the stream kernel (M <= 64, gemm_amx_stream.c): the weights are read once, from
 *   memory, 16 rows side by side over all of K; C tiles stay in registers for all of K;
 * - the full-K kernel (M > 64, K <= FP8_AMX_FULL_K_MAX, gemm_amx_full_k.c): panels of 32
 *   weight rows x all of K, each used by a chunk of activation rows, with 2 x 2 C tiles
 *   (4 tile loads per 4 tile products, the most reuse 8 tiles allow) kept in registers
 *   for all of K, and each 32 x 32 output block finished right after its products;
 * - the panel kernel (M > 64, larger K, this file): panels of 64 weight rows x 256 k, each used by a
 *   chunk of up to 512 activation rows, with 2 x 2 C tiles whose sums are kept in memory
 *   between K blocks; in the last K block each 32 x 32 block's epilogue runs among the
 *   next block's tile products, from L1 (after each panel, from L2, it took 1-4% more
 *   time at M = 256-2048 on the Llama shapes, same bits). (Tried: 3 x 1 C tiles over 48-row panels, which load each
 *   activation tile from L2 once per panel instead of twice but each weight tile once
 *   per product: scaled_mm time over this kernel's, 2 threads, medians of 6 alternated
 *   processes, 4096 x 4096 x M = 1024 0.96, 14336 x 4096 x 512 1.07, 4096 x 14336 x 512
 *   1.04; not kept.)
 *
 * The same kernel bodies run either on the hardware or on a C model of the tile
 * registers (the amx_emulated variant, amx_tiles.h), so that their logic is tested on
 * any CPU with AVX512-BF16: QEMU does not emulate AMX and Intel's SDE is not installable
 * here.
 *
 * The pieces the full-K and panel kernels share (weight panels and their widening, the
 * tile step) are in amx_kernels.h; the tile configuration and the dispatch by M and K
 * are at the end of this file.
 *
 * Tiles belong to the thread: each call saves the thread's tile configuration
 * (sttilecfg), loads its own, and on leaving restores the saved one or, if the thread
 * had none, releases the tiles (tilerelease), so that oneDNN's tile use in the same
 * thread (bf16 nn.Linear) finds what it left. The per-process permission is requested
 * once in cpu_features.c, which selects this variant only if it was granted.
 */
#include "cpu_internal.h" /* FP8_X86_KERNELS */
#if FP8_X86_KERNELS /* the whole file: x86-64 only */

#include "amx_kernels.h"

enum {
  AMX_PANEL_COLS = 64, /* weight rows widened together: 4 A tiles tall */
  AMX_K_BLOCK = 256,   /* k per widened panel: 64 x 256 bf16 = 32 KiB */
  AMX_COL_BLOCK = 512  /* weight rows whose panels share a K block of activations */
};

/* ---- the panel kernel (M > 64, K > FP8_AMX_FULL_K_MAX) ----------------------- */

/* C tiles for weight-row groups g, g + 1 (if both) and activation-row groups r, r + 1
 * (if both) over one widened panel: their sums (one contiguous 1 KiB block per C tile,
 * `col_group` floats from group g to g + 1) are loaded (or zeroed for the first K
 * block), accumulated over `steps` k steps, and stored back; `widen_per_step` units of
 * the next panel are widened after each step's products. */
BF16_TARGET ALWAYS_INLINE void tile_block(const uint16_t* panel_g, const uint16_t* panel_g1, const uint32_t* b0,
                                          const uint32_t* b1, int64_t steps, float* sums, int64_t col_group, int first,
                                          panel_widener* next, const widen_tables_t* t, int64_t widen_per_step,
                                          const fp8_scaled_mm_params* p, int64_t n_first, const __m512* scale_rows,
                                          int64_t kb, float* block_tiles, pending_epilogue* pending, const int both_cols,
                                          const int both_rows, const int emulated, amx_model* model) {
  const int64_t sums_stride = AMX_ROWS * (int64_t)sizeof(float);
  float* s00 = sums;                          /* weight rows g*16.., activation rows r*16.. */
  float* s01 = sums + AMX_ROWS * AMX_ROWS;    /* activation rows (r + 1)*16.. */
  float* s10 = sums + col_group;              /* weight rows (g + 1)*16.. */
  float* s11 = s10 + AMX_ROWS * AMX_ROWS;
  /* K-blocked scales: this panel is one block of 128 k, summed from zero in the C tiles
   * and added into the sums with its scales (add_scaled_block) */
  const int blocked = fp8_k_blocked(p);
  if (first || blocked) {
    TILE_ZERO(0);
    if (both_rows) TILE_ZERO(1);
    if (both_cols) TILE_ZERO(2);
    if (both_cols && both_rows) TILE_ZERO(3);
  } else {
    TILE_LOAD(0, s00, sums_stride);
    if (both_rows) TILE_LOAD(1, s01, sums_stride);
    if (both_cols) TILE_LOAD(2, s10, sums_stride);
    if (both_cols && both_rows) TILE_LOAD(3, s11, sums_stride);
  }
  for (int64_t s = 0; s < steps; ++s) {
    tile_step(panel_g, panel_g1, b0, b1, s, 0, both_cols, both_rows, emulated, model);
    widen_units(next, t, widen_per_step);
    pending_step(p, pending, s, steps); /* the previous block's epilogue (amx_kernels.h) */
  }
  pending_finish(p, pending); /* (fewer steps than pieces) */
  if (blocked) {
    add_block_tiles(p, block_tiles, s00, s01, s10, s11, n_first, scale_rows, kb, first, both_cols, both_rows, emulated,
                    model);
    return;
  }
  TILE_STORE(0, s00, sums_stride);
  if (both_rows) TILE_STORE(1, s01, sums_stride);
  if (both_cols) TILE_STORE(2, s10, sums_stride);
  if (both_cols && both_rows) TILE_STORE(3, s11, sums_stride);
}

/* The order of the panels: weight rows in blocks of AMX_COL_BLOCK, and within a block
 * K block by K block over all of its panels, so that one K block of the chunk's packed
 * activations (AMX_ROW_CHUNK x AMX_K_BLOCK bf16) is read from L2 by every panel of the
 * block; panel by panel over all of K, the chunk's activations for all of K (4 MiB at
 * 512 rows, K = 4096) streamed from L3 once per panel. The block's sums (AMX_COL_BLOCK
 * x AMX_ROW_CHUNK float32) stay in L2. */
typedef struct {
  int64_t n0, k0;   /* the panel */
  int64_t block_n0; /* its block's first weight row */
} panel_position;

static panel_position next_panel(panel_position at, int64_t n_end, int64_t kp, int64_t k_block) {
  const int64_t block_end = at.block_n0 + AMX_COL_BLOCK < n_end ? at.block_n0 + AMX_COL_BLOCK : n_end;
  if (at.n0 + AMX_PANEL_COLS < block_end) {
    at.n0 += AMX_PANEL_COLS;
  } else if (at.k0 + k_block < kp) {
    at.n0 = at.block_n0;
    at.k0 += k_block;
  } else {
    at.block_n0 = at.n0 = block_end;
    at.k0 = 0;
  }
  return at;
}

/* Rows [m_begin, m_end) (one chunk, m_begin a multiple of 16) x weight rows [n_begin,
 * n_end): each panel widened while the previous one is used. */
BF16_TARGET ALWAYS_INLINE void amx_rows(const fp8_scaled_mm_params* p, const fp8_cpu_mm_plan* plan,
                                        const uint32_t* packed, int64_t m_begin, int64_t m_end, int64_t n_begin,
                                        int64_t n_end, uint16_t* panels[2], float* sums, float* block_tiles,
                                        const int emulated, amx_model* model) {
  const widen_tables_t t = load_widen_tables(p->b_format);
  const int64_t kp = plan->k_padded;
  /* K-blocked scales: panels of one block of 128 k each, so that each is summed alone */
  const int64_t k_block = fp8_k_blocked(p) ? (int64_t)FP8_SCALE_BLOCK : (int64_t)AMX_K_BLOCK;
  const int64_t group_stride = (kp / 2) * AMX_ROWS; /* uint32 between packed groups of 16 rows */
  const int64_t rows = (m_end - m_begin + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS;
  const int64_t row_pairs = (rows + 2 * AMX_ROWS - 1) / (2 * AMX_ROWS);
  /* each C tile's sums a contiguous 1 KiB block: [weight-row group][activation-row group][16][16]
   * (with a stride of `rows` floats the 16 rows of a tile fell into a few L1 sets) */
  const fp8_sums_layout layout = {AMX_ROWS, rows * AMX_ROWS, AMX_ROWS * AMX_ROWS};
#define PANEL_COLS_AT(n0) (n_end - (n0) < AMX_PANEL_COLS ? n_end - (n0) : AMX_PANEL_COLS)
#define K_BLOCK_AT(k0) (kp - (k0) < k_block ? kp - (k0) : k_block) /* a multiple of 64 */
  panel_position at = {n_begin, 0, n_begin};
  /* K-blocked scales: scale_a of block scale_k0 / 128 for every row group of the chunk; built
   * per panel, its masked gathers took ~6% of the call (4096 x 4096, M = 256, one core) */
  __m512 scale_rows[(int)AMX_ROW_CHUNK / AMX_ROWS + 1];
  int64_t scale_k0 = -1;
  /* a block finished in the last K block: its epilogue during the next block's products.
   * Its sums are not written again before that: the next block's are elsewhere in the
   * chunk's sums, and the pending block is finished before the next row chunk. */
  pending_epilogue pending = no_pending_epilogue(sums, layout);
  panel_widener next = panel_widener_of(p, at.n0, PANEL_COLS_AT(at.n0), 0, K_BLOCK_AT(0), panels[0], AMX_PANEL_COLS);
  widen_units(&next, &t, next.left);
  for (int current = 0; at.n0 < n_end; current ^= 1) {
    const int64_t n0 = at.n0, k0 = at.k0, cols = PANEL_COLS_AT(n0);
    const int64_t col_groups = (cols + AMX_ROWS - 1) / AMX_ROWS;
    const int64_t steps = K_BLOCK_AT(k0) / AMX_K;
    const uint16_t* panel = panels[current];
    float* panel_sums = sums + (n0 - at.block_n0) / AMX_ROWS * layout.col_group;
    at = next_panel(at, n_end, kp, k_block);
    if (at.n0 < n_end) {
      next = panel_widener_of(p, at.n0, PANEL_COLS_AT(at.n0), at.k0, K_BLOCK_AT(at.k0), panels[current ^ 1],
                              AMX_PANEL_COLS);
    } else {
      next.left = 0; /* nothing left to widen */
    }
    const int64_t total_steps = row_pairs * ((col_groups + 1) / 2) * steps;
    const int64_t widen_per_step = (next.left + total_steps - 1) / total_steps;
    /* K-blocked scales: scale_a of this panel's block of 128 k for every row group of the
     * chunk, built when the block changes (the panels of a column block share it) */
    if (fp8_k_blocked(p) && k0 != scale_k0) {
      for (int64_t g = 0; g < rows / AMX_ROWS; ++g) scale_rows[g] = fp8_block_scale_a16(p, m_begin + g * AMX_ROWS, k0 / FP8_SCALE_BLOCK);
      scale_k0 = k0;
    }
    for (int64_t r0 = 0; r0 < rows; r0 += 2 * AMX_ROWS) {
      const int both_rows = rows - r0 > AMX_ROWS;
      const uint32_t* b0 = packed + ((m_begin + r0) / AMX_ROWS) * group_stride + (k0 / 2) * AMX_ROWS;
      for (int64_t g = 0; g < col_groups; g += 2) {
        const int both_cols = g + 1 < col_groups;
        /* No software prefetch here: prefetching the next row pair's activation tiles and
         * the next block's sums into L1 during each block's steps measured 0.88-0.96 of the
         * time on 2026-12-03 (in one process, alternated), and 1.06-1.14 on 2026-12-05 in
         * both ways of measuring (FP8Linear in separate processes, 3 rounds; scaled_mm
         * with a switch in one process, medians of 12 alternated calls; M = 256-2048 on
         * the three Llama shapes, Intel Xeon with AMX, 2 threads): removed. */
        float* block_sums = panel_sums + g * layout.col_group + (r0 / AMX_ROWS) * layout.row_group;
        const uint16_t* panel_g = panel + g * steps * AMX_TILE_BF16;
        TWO_BY_TWO_CASES(tile_block, panel_g, panel_g + steps * AMX_TILE_BF16, b0, b0 + group_stride, steps,
                         block_sums, layout.col_group,
                         k0 == 0, &next, &t, widen_per_step, p, n0 + g * AMX_ROWS, scale_rows + r0 / AMX_ROWS,
                         k0 / FP8_SCALE_BLOCK, block_tiles, &pending)
        if (k0 + k_block >= kp) /* the block's sums are final */
          pending_block(&pending, block_sums, m_begin + r0, m_end, n0 + g * AMX_ROWS,
                        cols - g * AMX_ROWS < 2 * AMX_ROWS ? cols - g * AMX_ROWS : 2 * AMX_ROWS, both_rows);
      }
    }
    widen_units(&next, &t, next.left); /* whatever the steps left */
  }
  pending_finish(p, &pending);
#undef PANEL_COLS_AT
#undef K_BLOCK_AT
}

/* Scratch per thread: two panels, the sums of a column block of one row chunk, and
 * (emulated only) the model's tile registers. */
enum { AMX_PANEL_BYTES = AMX_PANEL_COLS * AMX_K_BLOCK * (int)sizeof(uint16_t) };

static int64_t sums_bytes(const fp8_cpu_mm_plan* plan) {
  const int64_t chunk_rows = plan->m_padded < AMX_ROW_CHUNK ? plan->m_padded : AMX_ROW_CHUNK;
  return AMX_COL_BLOCK * chunk_rows * (int64_t)sizeof(float);
}

/* Where the emulated tile registers go: after what the kernel uses (the stream kernel:
 * up to 4 KiB to place its buffers, 4 x 2 KiB of them, 4 KiB of sums and 4 KiB of
 * block-wise totals; the panel kernel: two panels, the sums, and 4 KiB of block tiles).
 * 64-byte aligned. */
static int full_k(const fp8_cpu_mm_plan* plan) {
  return plan->m_padded > FP8_AMX_STREAM_MAX_ROWS && plan->k_padded <= FP8_AMX_FULL_K_MAX;
}

static int64_t model_offset(const fp8_cpu_mm_plan* plan) {
  if (plan->m_padded <= FP8_AMX_STREAM_MAX_ROWS) return fp8_amx_stream_scratch_bytes(plan);
  if (full_k(plan)) return fp8_amx_full_k_scratch_bytes(plan);
  return 2 * AMX_PANEL_BYTES + sums_bytes(plan) + AMX_BLOCK_TILES_BYTES;
}

int64_t fp8_amx_scratch_bytes(const fp8_cpu_mm_plan* plan) {
  const int64_t compute = model_offset(plan) + (int64_t)sizeof(amx_model);
  const int64_t prepare = fp8_bf16_scratch_bytes(plan); /* the packing of the activations */
  return compute > prepare ? compute : prepare;
}

/* Rows in chunks of AMX_ROW_CHUNK, each over all of this range's weight rows. */
BF16_TARGET ALWAYS_INLINE void amx_compute(const fp8_scaled_mm_params* p, const fp8_cpu_mm_plan* plan,
                                           const uint32_t* packed, uint8_t* scratch, int64_t m_begin, int64_t m_end,
                                           int64_t n_begin, int64_t n_end, const int emulated, amx_model* model) {
  if (plan->m_padded <= FP8_AMX_STREAM_MAX_ROWS) {
    if (emulated) {
      fp8_amx_stream_emulated(p, plan, packed, scratch, m_begin, m_end, n_begin, n_end, model);
    } else {
      fp8_amx_stream_hardware(p, plan, packed, scratch, m_begin, m_end, n_begin, n_end);
    }
    return;
  }
  if (full_k(plan)) {
    if (emulated) {
      fp8_amx_full_k_emulated(p, plan, packed, scratch, m_begin, m_end, n_begin, n_end, model);
    } else {
      fp8_amx_full_k_hardware(p, plan, packed, scratch, m_begin, m_end, n_begin, n_end);
    }
    return;
  }
  uint16_t* panels[2] = {(uint16_t*)scratch, (uint16_t*)(scratch + AMX_PANEL_BYTES)};
  float* sums = (float*)(scratch + 2 * AMX_PANEL_BYTES);
  float* block_tiles = (float*)(scratch + 2 * AMX_PANEL_BYTES + sums_bytes(plan));
  for (int64_t m0 = m_begin; m0 < m_end; m0 += AMX_ROW_CHUNK)
    amx_rows(p, plan, packed, m0, m_end - m0 < AMX_ROW_CHUNK ? m_end : m0 + AMX_ROW_CHUNK, n_begin, n_end, panels,
             sums, block_tiles, emulated, model);
}

BF16_TARGET static void amx_compute_hardware(const fp8_scaled_mm_params* p, const fp8_cpu_mm_plan* plan,
                                             const uint32_t* packed, uint8_t* scratch, int64_t m_begin,
                                             int64_t m_end, int64_t n_begin, int64_t n_end) {
  amx_tile_config saved, ours;
  fill_config(&ours);
  hardware_store_config(&saved); /* all zero (palette 0) if this thread had no tiles configured */
  hardware_load_config(&ours);
  amx_compute(p, plan, packed, scratch, m_begin, m_end, n_begin, n_end, 0, NULL);
  if (saved.palette != 0) {
    hardware_load_config(&saved);
  } else {
    hardware_release();
  }
}

BF16_TARGET static void amx_compute_emulated(const fp8_scaled_mm_params* p, const fp8_cpu_mm_plan* plan,
                                             const uint32_t* packed, uint8_t* scratch, int64_t m_begin,
                                             int64_t m_end, int64_t n_begin, int64_t n_end) {
  amx_model* model = (amx_model*)(scratch + model_offset(plan));
  fill_config(&model->config);
  amx_compute(p, plan, packed, scratch, m_begin, m_end, n_begin, n_end, 1, model);
}

void fp8_amx_compute(const fp8_scaled_mm_params* p, const fp8_cpu_mm_plan* plan, const void* workspace,
                     void* scratch, int64_t m_begin, int64_t m_end, int64_t n_begin, int64_t n_end) {
  fp8_bf16_build_widen_tables();
  if (plan->variant == FP8_CPU_AMX) {
    amx_compute_hardware(p, plan, (const uint32_t*)workspace, (uint8_t*)scratch, m_begin, m_end, n_begin, n_end);
  } else {
    amx_compute_emulated(p, plan, (const uint32_t*)workspace, (uint8_t*)scratch, m_begin, m_end, n_begin, n_end);
  }
}

#endif /* FP8_X86_KERNELS */
