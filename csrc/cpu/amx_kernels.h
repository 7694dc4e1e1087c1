/* What the AMX kernels share: gemm_amx.c (the panel kernel, and the entry that
 * configures the tiles and dispatches), gemm_amx_full_k.c (the full-K kernel) and
 * gemm_amx_stream.c (the stream kernel, M <= 64). Only those three include this. */
#ifndef FP8LINEAR_AMX_KERNELS_H
#define FP8LINEAR_AMX_KERNELS_H

#include "amx_tiles.h"

/* The address `offset` bytes from `base`, for prefetches, which may point past the
 * weights (the next panel or group of the last one): computed as an integer, since
 * forming such a pointer by pointer arithmetic is undefined in C. */
ALWAYS_INLINE const char* address_at(const void* base, int64_t offset) {
  return (const char*)((uintptr_t)base + (uintptr_t)offset);
}

enum {
  AMX_ROWS = 16,                    /* rows of every tile */
  AMX_K = 32,                       /* k per tile product: 16 pairs of bf16 (64 bytes) per A-tile row */
  AMX_TILE_BF16 = AMX_ROWS * AMX_K  /* bf16 per A tile: 1 KiB */
};

/* ---- block-wise scales ------------------------------------------------------- */

/* K-blocked calls (fp8_k_blocked) sum each block of 128 k in C tiles of its own; this
 * adds one such tile (`tile`: 16 weight rows from n0, a multiple of 16, x 16 activation
 * rows from m0, stored [weight row][activation row]) into the running sums `sums` (same
 * layout) with the block's scales: sums[j][i] (+)= scale_b(kb, n0 + j) * scale_a(m0 + i, kb)
 * * tile[j][i]. The 16 weight rows share one block of 128, so scale_b is one number;
 * scale_a varies along the tile's row (`scale_a`: fp8_block_scale_a16 of m0 and kb, which
 * the kernels build once per panel or call, not per tile). Rows past M get scale 0. */
BF16_TARGET ALWAYS_INLINE void add_scaled_block(const fp8_scaled_mm_params* p, const float* tile, float* sums,
                                                int64_t n0, __m512 scale_a, int64_t kb, int first) {
  const __m512 scale = _mm512_mul_ps(scale_a, _mm512_set1_ps(fp8_block_scale_b(p, n0, kb)));
  for (int j = 0; j < 16; ++j) {
    /* a per-column scale_b (scale_a blocked) differs per weight row */
    const __m512 row_scale =
        p->scale_b_per_col ? _mm512_mul_ps(scale_a, _mm512_set1_ps(fp8_block_scale_b(p, n0 + j, kb))) : scale;
    const __m512 value = _mm512_load_ps(tile + j * 16);
    _mm512_store_ps(sums + j * 16, first ? _mm512_mul_ps(value, row_scale)
                                         : _mm512_fmadd_ps(value, row_scale, _mm512_load_ps(sums + j * 16)));
  }
}

/* ---- what the full-K and panel kernels share --------------------------------- */

enum {
  AMX_ROW_CHUNK = 512, /* activation rows per sweep over the weights */
  AMX_BLOCK_TILES_BYTES = 4 * AMX_ROWS * AMX_ROWS * (int)sizeof(float) /* a 2 x 2 block's C tiles, stored */
};

/* A finished 32 x 32 block of the output whose epilogue (scale, bias, rounding, store) is
 * spread among the tile products of the next block, one 16 x 16 piece at a time, while
 * its sums are still in L1: the full-K kernel's from a buffer of its own, the panel
 * kernel's (in its last K block) from the panel's sums. Leaving the epilogue out (wrong
 * results) made the full-K kernel 1.3x faster at K = 576 and 1.8x at K = 128 (M = 2048,
 * Intel Xeon with AMX, 2 threads); spread like this it overlaps the tile products only
 * in part: 3-6% faster than between blocks at M = 512, K = 576-1536, within +-3% at
 * M = 2048; in the panel kernel 1-4% faster than a pass over each panel's sums. */
typedef struct {
  const float* sums;      /* its first tile's sums (or K-blocked totals) */
  fp8_sums_layout layout; /* where its other tiles are */
  int64_t m_begin, m_end; /* its rows */
  int64_t n0, cols;       /* its weight rows */
  int col_groups, count, done; /* pieces: (row group, weight-row group) pairs, and how many are written */
} pending_epilogue;

/* No block pending yet. */
static inline pending_epilogue no_pending_epilogue(const float* sums, fp8_sums_layout layout) {
  const pending_epilogue e = {sums, layout, 0, 0, 0, 0, 1, 0, 0};
  return e;
}

/* The block of rows [m_begin, min(m_begin + 32, m_end)) x weight rows [n0, n0 + cols)
 * (cols <= 32) is pending, its sums from `sums`. */
ALWAYS_INLINE void pending_block(pending_epilogue* e, const float* sums, int64_t m_begin, int64_t m_end, int64_t n0,
                                 int64_t cols, const int both_rows) {
  e->sums = sums;
  e->m_begin = m_begin;
  e->m_end = m_begin + 2 * AMX_ROWS < m_end ? m_begin + 2 * AMX_ROWS : m_end;
  e->n0 = n0;
  e->cols = cols;
  e->col_groups = cols > AMX_ROWS ? 2 : 1;
  e->count = e->col_groups * (both_rows ? 2 : 1);
  e->done = 0;
}

BF16_TARGET ALWAYS_INLINE void pending_piece(const fp8_scaled_mm_params* p, pending_epilogue* e) {
  const int64_t r0 = (e->done / e->col_groups) * AMX_ROWS, c0 = (e->done % e->col_groups) * AMX_ROWS;
  fp8_bf16_tile_epilogue16(p, e->sums, e->layout, e->m_begin, e->m_end, e->n0, e->cols, r0, c0);
  ++e->done;
}

/* After k step s of `steps`: the pieces evenly over the steps (piece i at the first step
 * s with i * steps < (s + 1) * count). */
BF16_TARGET ALWAYS_INLINE void pending_step(const fp8_scaled_mm_params* p, pending_epilogue* e, int64_t s,
                                            int64_t steps) {
  if (e->done < e->count && e->done * steps < (s + 1) * e->count) pending_piece(p, e);
}

BF16_TARGET ALWAYS_INLINE void pending_finish(const fp8_scaled_mm_params* p, pending_epilogue* e) {
  while (e->done < e->count) pending_piece(p, e);
}

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
  const int8_t* fold;    /* p->fold_b (power-of-two block scales folded into the weights), or NULL */
  int64_t fold_k_blocks, n0, k0; /* its row length, and the panel's first weight row and k */
} panel_widener;

ALWAYS_INLINE uint16_t* panel_row(uint16_t* panel, int64_t steps, int64_t col) {
  return panel + (col / AMX_ROWS) * steps * AMX_TILE_BF16 + (col % AMX_ROWS) * AMX_K;
}

static inline panel_widener panel_widener_of(const fp8_scaled_mm_params* p, int64_t n0, int64_t cols, int64_t k0,
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
  w.fold = p->fold_b;
  w.fold_k_blocks = p->fold_k_blocks;
  w.n0 = n0;
  w.k0 = k0;
  return w;
}

/* `count` more units (or all that are left), row by row: no division in the loop, which
 * runs between tile products (the fold's divisions by 128 are shifts). FOLD: w->fold is
 * set, a constant, so that the loop without it is the one before the fold existed. With
 * a test of w->fold per unit, per-tensor scaled_mm at M = 2048 on the panel kernel took
 * ~1.05x the time of the kernel before the fold (4096 x 4096 and 14336 x 4096, Intel Xeon
 * with AMX, 2 threads, medians of 7 alternated process rounds); with the test once per
 * call, ~1.00 (9 rounds, each round's ratio 0.87-1.09). */
BF16_TARGET ALWAYS_INLINE void widen_units_of(panel_widener* w, const widen_tables_t* t, int64_t count, const int FOLD) {
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
      if (FOLD) /* the unit's block of 128 weight rows and of 128 k */
        fold64(w->fold[(w->n0 + w->col) / FP8_SCALE_BLOCK * w->fold_k_blocks + (w->k0 + w->unit * 64) / FP8_SCALE_BLOCK],
               &out0, &out1);
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

BF16_TARGET ALWAYS_INLINE void widen_units(panel_widener* w, const widen_tables_t* t, int64_t count) {
  if (w->fold) {
    widen_units_of(w, t, count, 1);
  } else {
    widen_units_of(w, t, count, 0);
  }
}

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

/* fn(args..., both_cols, both_rows, emulated, model) with both flags as constants, so
 * that each of the four shapes of a 2 x 2 block compiles without their branches. */
#define TWO_BY_TWO_CASES(fn, ...)                                                               \
  switch ((both_cols ? 2 : 0) + (both_rows ? 1 : 0)) {                                          \
    case 3: fn(__VA_ARGS__, 1, 1, emulated, model); break;                                      \
    case 2: fn(__VA_ARGS__, 1, 0, emulated, model); break;                                      \
    case 1: fn(__VA_ARGS__, 0, 1, emulated, model); break;                                      \
    default: fn(__VA_ARGS__, 0, 0, emulated, model); break;                                     \
  }

/* The stream kernel (gemm_amx_stream.c), on tiles gemm_amx.c has configured: the real
 * instructions, or the model's. Its scratch: what it uses, before the model. */
int64_t fp8_amx_stream_scratch_bytes(const fp8_cpu_mm_plan* plan);
void fp8_amx_stream_hardware(const fp8_scaled_mm_params* p, const fp8_cpu_mm_plan* plan, const uint32_t* packed,
                             uint8_t* scratch, int64_t m_begin, int64_t m_end, int64_t n_begin, int64_t n_end);
void fp8_amx_stream_emulated(const fp8_scaled_mm_params* p, const fp8_cpu_mm_plan* plan, const uint32_t* packed,
                             uint8_t* scratch, int64_t m_begin, int64_t m_end, int64_t n_begin, int64_t n_end,
                             amx_model* model);

/* The full-K kernel (gemm_amx_full_k.c: M > 64, K <= FP8_AMX_FULL_K_MAX), likewise, and
 * its scratch (before the model). */
int64_t fp8_amx_full_k_scratch_bytes(const fp8_cpu_mm_plan* plan);
void fp8_amx_full_k_hardware(const fp8_scaled_mm_params* p, const fp8_cpu_mm_plan* plan, const uint32_t* packed,
                             uint8_t* scratch, int64_t m_begin, int64_t m_end, int64_t n_begin, int64_t n_end);
void fp8_amx_full_k_emulated(const fp8_scaled_mm_params* p, const fp8_cpu_mm_plan* plan, const uint32_t* packed,
                             uint8_t* scratch, int64_t m_begin, int64_t m_end, int64_t n_begin, int64_t n_end,
                             amx_model* model);

#endif
