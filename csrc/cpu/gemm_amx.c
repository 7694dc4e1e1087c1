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
 * Three kernels, by M and K (the dot kernel of gemm_avx512_bf16.c keeps M = 1, see gemm.c):
 * - the stream kernel (M <= 64, gemm_amx_stream.c): the weights are read once, from
 *   memory, 16 rows side by side over all of K; C tiles stay in registers for all of K;
 * - the full-K kernel (M > 64, K <= AMX_FULL_K_MAX): panels of 32 weight rows x all of
 *   K, each used by a chunk of activation rows, with 2 x 2 C tiles (4 tile loads per 4
 *   tile products, the most reuse 8 tiles allow) kept in registers for all of K, and each
 *   32 x 32 output block finished right after its products;
 * - the panel kernel (M > 64, larger K): panels of 64 weight rows x 256 k, each used by a
 *   chunk of up to 512 activation rows, with 2 x 2 C tiles whose sums are kept in memory
 *   between K blocks.
 *
 * The same kernel bodies run either on the hardware or on a C model of the tile
 * registers (the amx_emulated variant, amx_tiles.h), so that their logic is tested on
 * any CPU with AVX512-BF16: QEMU does not emulate AMX and Intel's SDE is not installable
 * here.
 *
 * Tiles belong to the thread: each call saves the thread's tile configuration
 * (sttilecfg), loads its own, and on leaving restores the saved one or, if the thread
 * had none, releases the tiles (tilerelease), so that oneDNN's tile use in the same
 * thread (bf16 nn.Linear) finds what it left. The per-process permission is requested
 * once in cpu_features.c, which selects this variant only if it was granted.
 */
#include <string.h>

#include "amx_kernels.h"

enum {
  AMX_PANEL_COLS = 64,              /* weight rows widened together: 4 A tiles tall */
  AMX_K_BLOCK = 256,                /* k per widened panel: 64 x 256 bf16 = 32 KiB */
  AMX_ROW_CHUNK = 512,              /* activation rows per sweep over the weights */
  AMX_COL_BLOCK = 512,              /* weight rows whose panels share a K block of activations */
  AMX_FULL_K_COLS = 32,             /* the full-K kernel's panels: 2 A tiles tall, all of K */
  AMX_FULL_K_MAX = FP8_AMX_FULL_K_MAX, /* up to this (padded) K */
  AMX_FULL_K_CHUNK_BYTES = 1 << 20  /* packed activations per row chunk of the full-K kernel: half of L2 */
};

/* ---- weight panels ----------------------------------------------------------- */

/* A panel is weight rows [n0, n0 + cols) at k [k0, k0 + k_block), widened into A
 * tiles: panel[group of 16 rows][k step of 32][16 rows][32 bf16], each tile 1 KiB
 * contiguous (rows past `cols` are zero). widen64 gives a row's 64 k as two halves in
 * interleave order; each half is one k step's tile row, matching the packed
 * activations' pairs. The widening is cut into units of 64 codes of one row, so that
 * the next panel can be widened a few units at a time between the tile products of
 * this one: the shuffles then run on the vector ports while the AMX unit multiplies.
 * In phases of their own, the two added up (4096 x 4096, M = 1024, one core: the
 * widening cost 12 of 33.5 ms). */
typedef struct {
  uintptr_t src;         /* the next unit's 64 codes (an integer: past the last weight row it
                          * runs beyond the weights, never read there) */
  uint16_t* dest;        /* where its first half goes (the second: one tile further) */
  int64_t b_col_stride;  /* codes between weight rows */
  int64_t k_left;        /* codes of a row from the next unit to the end of K */
  int64_t k_left_row;    /* codes of a row from the panel's k0 to the end of K */
  int64_t units_per_row; /* k_block / 64 */
  int64_t steps;         /* k_block / 32: tiles per row group */
  int64_t col, unit;     /* the next unit: panel row, and 64-code unit within it */
  int64_t cols;          /* rows of the panel that exist (the others, up to its height, are zero) */
  int64_t height;        /* rows of the panel: AMX_PANEL_COLS, or AMX_FULL_K_COLS for the full-K kernel */
  int64_t left;          /* units still to widen */
  uint16_t* panel;
} panel_widener;

ALWAYS_INLINE uint16_t* panel_row(uint16_t* panel, int64_t steps, int64_t col) {
  return panel + (col / AMX_ROWS) * steps * AMX_TILE_BF16 + (col % AMX_ROWS) * AMX_K;
}

static panel_widener panel_widener_of(const fp8_scaled_mm_params* p, int64_t n0, int64_t cols, int64_t k0,
                                      int64_t k_block, uint16_t* panel, int64_t height) {
  panel_widener w;
  w.src = (uintptr_t)(p->b + n0 * p->b_col_stride + k0);
  w.b_col_stride = p->b_col_stride;
  w.k_left = w.k_left_row = p->k - k0;
  w.units_per_row = k_block / 64;
  w.steps = k_block / AMX_K;
  w.col = w.unit = 0;
  w.cols = cols;
  w.height = height;
  w.left = height * w.units_per_row;
  w.panel = panel;
  w.dest = panel_row(panel, w.steps, 0);
  return w;
}

/* `count` more units (or all that are left), row by row: no division in the loop, which
 * runs between tile products. */
BF16_TARGET ALWAYS_INLINE void widen_units(panel_widener* w, const widen_tables_t* t, int64_t count) {
  for (count = count < w->left ? count : w->left; count > 0; --count) {
    if (w->col < w->cols) {
      /* into L2, the same unit of the panel widened after this one (the next 64 weight
       * rows, in the order of next_panel): 64 rows at a time are more streams than the
       * hardware prefetchers follow, and the same row's next K block, which the tile
       * kernel prefetches, is used only a column block later (M = 1024, 4096 x 4096,
       * one core: 26.1 -> 24.8 ms) */
      _mm_prefetch(address_at((const void*)w->src, w->height * w->b_col_stride), _MM_HINT_T1);
      __m512i out0, out1;
      widen64(t, _mm512_maskz_loadu_epi8(tail_mask64(w->k_left), (const void*)w->src), &out0, &out1);
      _mm512_store_si512(w->dest, out0);
      _mm512_store_si512(w->dest + AMX_TILE_BF16, out1);
    } else {
      _mm512_store_si512(w->dest, _mm512_setzero_si512());
      _mm512_store_si512(w->dest + AMX_TILE_BF16, _mm512_setzero_si512());
    }
    --w->left;
    if (++w->unit < w->units_per_row) {
      w->src += 64;
      w->k_left -= 64;
      w->dest += 2 * AMX_TILE_BF16;
    } else {
      w->unit = 0;
      ++w->col;
      w->src += (uintptr_t)(w->b_col_stride - 64 * (w->units_per_row - 1));
      w->k_left = w->k_left_row;
      w->dest = panel_row(w->panel, w->steps, w->col);
    }
  }
}

/* ---- the kernel body ---------------------------------------------------------- */

/* One k step of 32 on the 2 x 2 block of C tiles 0-3 (those that exist: weight-row
 * groups g, g + 1 x activation-row groups r, r + 1): A tiles 4-5 from the panels' row
 * groups g and g + 1, B tiles 6-7 from the packed activations of groups r and r + 1.
 * `b_once`: the B tiles are not used again soon (the full-K kernel, whose activations
 * stream past a panel), so they are loaded with TILELOADDT1, which keeps them from
 * evicting the panel from L1. Tile products alone (K = 576, 512 rows past one panel, one
 * core) took 95 cycles per step with plain loads, 79 with this, 66 all from L1; in the
 * full-K kernel, 2 threads, M = 512: 1536 x 576 608 -> 582 us, 576 x 576 220 -> 202. The
 * panel kernel reads each B tile twice (two column pairs), so it keeps plain loads
 * (with this hint, 4096 x 14336, M = 512: 32.3 -> 35.4 ms). */
BF16_TARGET ALWAYS_INLINE void tile_step(const uint16_t* panel_g, const uint16_t* panel_g1, const uint32_t* b0,
                                         const uint32_t* b1, int64_t s, const int b_once, const int both_cols,
                                         const int both_rows, const int emulated, amx_model* model) {
  TILE_LOAD(4, panel_g + s * AMX_TILE_BF16, 64);
  if (b_once) TILE_LOAD_T1(6, b0 + s * AMX_ROWS * AMX_ROWS, 64);
  else TILE_LOAD(6, b0 + s * AMX_ROWS * AMX_ROWS, 64);
  TILE_DPBF16PS(0, 4, 6);
  if (both_rows) {
    if (b_once) TILE_LOAD_T1(7, b1 + s * AMX_ROWS * AMX_ROWS, 64);
    else TILE_LOAD(7, b1 + s * AMX_ROWS * AMX_ROWS, 64);
    TILE_DPBF16PS(1, 4, 7);
  }
  if (both_cols) {
    TILE_LOAD(5, panel_g1 + s * AMX_TILE_BF16, 64);
    TILE_DPBF16PS(2, 5, 6);
    if (both_rows) TILE_DPBF16PS(3, 5, 7);
  }
}

/* K-blocked calls: the C tiles 0-3 that exist, one block of 128 k, stored into `tiles`
 * (4 KiB, one 1 KiB tile each) and added with block kb's scales into their running sums
 * s00, s01 (weight-row group g; activation-row groups r, r + 1), s10, s11 (group g + 1);
 * scale_rows[0], [1]: scale_a of the two activation-row groups (fp8_block_scale_a16). */
BF16_TARGET ALWAYS_INLINE void add_block_tiles(const fp8_scaled_mm_params* p, float* tiles, float* s00, float* s01,
                                               float* s10, float* s11, int64_t n_first, const __m512* scale_rows,
                                               int64_t kb, int first, const int both_cols, const int both_rows,
                                               const int emulated, amx_model* model) {
  const int64_t tile_floats = AMX_ROWS * AMX_ROWS, stride = AMX_ROWS * (int64_t)sizeof(float);
  TILE_STORE(0, tiles, stride);
  add_scaled_block(p, tiles, s00, n_first, scale_rows[0], kb, first);
  if (both_rows) {
    TILE_STORE(1, tiles + tile_floats, stride);
    add_scaled_block(p, tiles + tile_floats, s01, n_first, scale_rows[1], kb, first);
  }
  if (both_cols) {
    TILE_STORE(2, tiles + 2 * tile_floats, stride);
    add_scaled_block(p, tiles + 2 * tile_floats, s10, n_first + AMX_ROWS, scale_rows[0], kb, first);
  }
  if (both_cols && both_rows) {
    TILE_STORE(3, tiles + 3 * tile_floats, stride);
    add_scaled_block(p, tiles + 3 * tile_floats, s11, n_first + AMX_ROWS, scale_rows[1], kb, first);
  }
}

/* C tiles for weight-row groups g, g + 1 (if both) and activation-row groups r, r + 1
 * (if both) over one widened panel: their sums (one contiguous 1 KiB block per C tile,
 * `col_group` floats from group g to g + 1) are loaded (or zeroed for the first K
 * block), accumulated over `steps` k steps, and stored back; `widen_per_step` units of
 * the next panel are widened after each step's products. */
BF16_TARGET ALWAYS_INLINE void tile_block(const uint16_t* panel_g, const uint16_t* panel_g1, const uint32_t* b0,
                                          const uint32_t* b1, int64_t steps, float* sums, int64_t col_group, int first,
                                          panel_widener* next, const widen_tables_t* t, int64_t widen_per_step,
                                          const fp8_scaled_mm_params* p, int64_t n_first, const __m512* scale_rows,
                                          int64_t kb, float* block_tiles, const uint32_t* prefetch_b, const float* prefetch_sums,
                                          const int both_cols, const int both_rows,
                                          const int emulated, amx_model* model) {
  const int64_t sums_stride = AMX_ROWS * (int64_t)sizeof(float);
  float* s00 = sums;                          /* weight rows g*16.., activation rows r*16.. */
  float* s01 = sums + AMX_ROWS * AMX_ROWS;    /* activation rows (r + 1)*16.. */
  float* s10 = sums + col_group;              /* weight rows (g + 1)*16.. */
  float* s11 = s10 + AMX_ROWS * AMX_ROWS;
  /* K-blocked scales: this panel is one block of 128 k, summed from zero in the C tiles
   * and added into the sums with its scales (add_scaled_block) */
  const int64_t sums_lines_per_step = (64 + steps - 1) / steps;
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
    if (prefetch_b) { /* this step's two activation tiles of the next row pair */
      const char* q0 = (const char*)(prefetch_b + s * AMX_ROWS * AMX_ROWS);
      const char* q1 = q0 + (b1 - b0) * sizeof(uint32_t);
      for (int i = 0; i < 16; ++i) {
        _mm_prefetch(q0 + 64 * i, _MM_HINT_T0);
        _mm_prefetch(q1 + 64 * i, _MM_HINT_T0);
      }
    }
    /* lines [s, s + 1) * sums_lines_per_step of the next block's four C tiles' sums: 64
     * lines in two 2 KiB pieces (its weight-row groups) */
    for (int64_t i = s * sums_lines_per_step; prefetch_sums && i < (s + 1) * sums_lines_per_step && i < 64; ++i)
      _mm_prefetch((const char*)(prefetch_sums + (i >> 5) * col_group) + (i & 31) * 64, _MM_HINT_T0);
    widen_units(next, t, widen_per_step);
  }
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

/* fn(args..., both_cols, both_rows, emulated, model) with both flags as constants, so
 * that each of the four shapes of a 2 x 2 block compiles without their branches. */
#define TWO_BY_TWO_CASES(fn, ...)                                                               \
  switch ((both_cols ? 2 : 0) + (both_rows ? 1 : 0)) {                                          \
    case 3: fn(__VA_ARGS__, 1, 1, emulated, model); break;                                      \
    case 2: fn(__VA_ARGS__, 1, 0, emulated, model); break;                                      \
    case 1: fn(__VA_ARGS__, 0, 1, emulated, model); break;                                      \
    default: fn(__VA_ARGS__, 0, 0, emulated, model); break;                                     \
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
        /* Prefetched into L1 during this block's steps: the next row pair's activation
         * tiles, during its last column pair (~8 steps before their use), and the sums
         * the next block loads (past the first K block). Presumably hardware prefetch
         * covers neither (no counters to tell in the VM measured): each group's packed
         * activations of one K block (8 KiB) lie far from the next group's, and the sums
         * are read 4 KiB at a time. scaled_mm, Intel Xeon with AMX, time with / without,
         * medians of 8-20 alternated calls: 4096 x 14336, M = 512-2048: 0.91-0.96 (two
         * runs on a host whose base time doubled meanwhile: 1.11, 1.45); 14336 x 4096:
         * 0.88-0.91 (one run 1.06); 4096 x 4096: 0.93-0.98. Results unchanged. */
        float* block_sums = panel_sums + g * layout.col_group + (r0 / AMX_ROWS) * layout.row_group;
        const float* next_sums = g + 2 < col_groups ? block_sums + 2 * layout.col_group
                                 : r0 + 2 * AMX_ROWS < rows ? panel_sums + (r0 / AMX_ROWS + 2) * layout.row_group
                                                            : NULL;
        const float* prefetch_sums = k0 != 0 ? next_sums : NULL;
        const uint32_t* prefetch_b = g + 2 >= col_groups && r0 + 2 * AMX_ROWS < rows ? b0 + 2 * group_stride : NULL;
        const uint16_t* panel_g = panel + g * steps * AMX_TILE_BF16;
        TWO_BY_TWO_CASES(tile_block, panel_g, panel_g + steps * AMX_TILE_BF16, b0, b0 + group_stride, steps,
                         block_sums, layout.col_group,
                         k0 == 0, &next, &t, widen_per_step, p, n0 + g * AMX_ROWS, scale_rows + r0 / AMX_ROWS,
                         k0 / FP8_SCALE_BLOCK, block_tiles, prefetch_b, prefetch_sums)
      }
    }
    widen_units(&next, &t, next.left); /* whatever the steps left */
    if (k0 + k_block >= kp) fp8_bf16_tile_epilogue(p, panel_sums, layout, m_begin, m_end, n0, cols);
  }
#undef PANEL_COLS_AT
#undef K_BLOCK_AT
}

/* ---- the full-K kernel (M > 64, K <= AMX_FULL_K_MAX) ------------------------- */

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

/* A finished 32 x 32 block whose epilogue (scale, bias, rounding, store) is spread among
 * the tile products of the next block, one 16 x 16 piece at a time, from a buffer of its
 * own. Leaving the epilogue out (wrong results) made this kernel 1.3x faster at K = 576
 * and 1.8x at K = 128 (M = 2048, Intel Xeon with AMX, 2 threads); spread like this it
 * overlaps the tile products only in part: 3-6% faster than between blocks at
 * M = 512, K = 576-1536, within +-3% at M = 2048. */
typedef struct {
  const float* sums;      /* its tiles (or K-blocked totals), [weight group][activation group][16][16] */
  int64_t m_begin, m_end; /* its rows */
  int64_t n0, cols;       /* its weight rows */
  int col_groups, count, done; /* pieces: (row group, weight-row group) pairs, and how many are written */
} pending_epilogue;

static const fp8_sums_layout full_k_layout = {AMX_ROWS, 2 * AMX_ROWS * AMX_ROWS, AMX_ROWS * AMX_ROWS};

BF16_TARGET ALWAYS_INLINE void pending_piece(const fp8_scaled_mm_params* p, pending_epilogue* e) {
  const int64_t r0 = (e->done / e->col_groups) * AMX_ROWS, c0 = (e->done % e->col_groups) * AMX_ROWS;
  fp8_bf16_tile_epilogue16(p, e->sums, full_k_layout, e->m_begin, e->m_end, e->n0, e->cols, r0, c0);
  ++e->done;
}

BF16_TARGET ALWAYS_INLINE void pending_finish(const fp8_scaled_mm_params* p, pending_epilogue* e) {
  while (e->done < e->count) pending_piece(p, e);
}

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
    /* the previous block's pieces, evenly over the steps (piece i at the first step s
     * with i * steps < (s + 1) * count) */
    if (pending->done < pending->count && pending->done * steps < (s + 1) * pending->count) pending_piece(p, pending);
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
  pending_epilogue pending = {buffers, 0, 0, 0, 0, 1, 0, 0};
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
        pending.sums = blocked ? totals : tiles;
        pending.m_begin = m0 + r0;
        pending.m_end = m0 + r0 + 2 * AMX_ROWS < m1 ? m0 + r0 + 2 * AMX_ROWS : m1;
        pending.n0 = n0;
        pending.cols = cols;
        pending.col_groups = both_cols ? 2 : 1;
        pending.count = pending.col_groups * (both_rows ? 2 : 1);
        pending.done = 0;
        buffer ^= 1;
      }
      widen_units(&next, &t, next.left); /* whatever the steps left */
    }
  }
  pending_finish(p, &pending);
#undef FULL_K_COLS_AT
}

/* Scratch per thread: two panels, the sums of a column block of one row chunk, and
 * (emulated only) the model's tile registers. */
enum { AMX_PANEL_BYTES = AMX_PANEL_COLS * AMX_K_BLOCK * (int)sizeof(uint16_t) };

static int64_t sums_bytes(const fp8_cpu_mm_plan* plan) {
  const int64_t chunk_rows = plan->m_padded < AMX_ROW_CHUNK ? plan->m_padded : AMX_ROW_CHUNK;
  return AMX_COL_BLOCK * chunk_rows * (int64_t)sizeof(float);
}

/* Where the emulated tile registers go: after what the kernel uses (the stream kernel:
 * up to 4 KiB to place its buffers, 2 x 2 KiB of them, 4 KiB of sums and 4 KiB of
 * block-wise totals; the panel kernel: two panels, the sums, and 4 KiB of block tiles).
 * 64-byte aligned. */
enum { AMX_BLOCK_TILES_BYTES = 4 * AMX_ROWS * AMX_ROWS * (int)sizeof(float) };

static int full_k(const fp8_cpu_mm_plan* plan) {
  return plan->m_padded > FP8_AMX_STREAM_MAX_ROWS && plan->k_padded <= AMX_FULL_K_MAX;
}

/* The full-K kernel's scratch: two panels, twice 4 KiB of tiles and 4 of totals, the scale_a table. */
static int64_t full_k_scratch_bytes(const fp8_cpu_mm_plan* plan) {
  const int64_t k_blocks = (plan->k_padded + FP8_SCALE_BLOCK - 1) / FP8_SCALE_BLOCK;
  return 2 * AMX_FULL_K_COLS * plan->k_padded * (int64_t)sizeof(uint16_t) + 4 * AMX_BLOCK_TILES_BYTES +
         full_k_chunk_rows(plan->k_padded) / AMX_ROWS * k_blocks * 64;
}

static int64_t model_offset(const fp8_cpu_mm_plan* plan) {
  if (plan->m_padded <= FP8_AMX_STREAM_MAX_ROWS) return fp8_amx_stream_scratch_bytes(plan);
  if (full_k(plan)) return full_k_scratch_bytes(plan);
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
    amx_full_k(p, plan, packed, scratch, m_begin, m_end, n_begin, n_end, emulated, model);
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
