/* The ceiling of the AVX512-BF16 kernels on one core: how many vdpbf16ps (zmm) per
 * nanosecond it sustains, with operands in registers and L1 in the register-tile shapes
 * the kernels use. bf16 nn.Linear (oneDNN) and the fp8 kernels both multiply with this
 * instruction on CPUs without AMX, so it bounds both once they are compute-bound
 * (docs/performance-notes.md, AMD EPYC Zen 4).
 *
 *   gcc -O3 -o /tmp/dpbf16_peak benchmarks/dpbf16_peak.c && /tmp/dpbf16_peak
 *
 * Each vdpbf16ps on zmm registers is 16 lanes x 2 products x 2 flops = 64 flops. */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <time.h>

#define TARGET __attribute__((target("avx512f,avx512bw,avx512bf16"), noinline))

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* VECTORS activation vectors loaded and COLS weight pairs broadcast per k-pair,
 * VECTORS x COLS independent accumulators: the tile kernel's 3 x 8 and 2 x 8. */
#define TILE(VECTORS, COLS)                                                                              \
  TARGET static float tile_##VECTORS##x##COLS(const uint32_t* a, const uint32_t* b, long pairs, long reps) { \
    __m512 acc[VECTORS][COLS];                                                                           \
    for (int v = 0; v < VECTORS; ++v)                                                                    \
      for (int c = 0; c < COLS; ++c) acc[v][c] = _mm512_setzero_ps();                                    \
    for (long r = 0; r < reps; ++r)                                                                      \
      for (long p = 0; p < pairs; ++p) {                                                                 \
        __m512bh av[VECTORS];                                                                            \
        for (int v = 0; v < VECTORS; ++v) av[v] = (__m512bh)_mm512_loadu_si512(a + (p * VECTORS + v) * 16); \
        for (int c = 0; c < COLS; ++c) {                                                                 \
          const __m512bh bv = (__m512bh)_mm512_set1_epi32((int)b[c * pairs + p]);                        \
          for (int v = 0; v < VECTORS; ++v) acc[v][c] = _mm512_dpbf16_ps(acc[v][c], av[v], bv);          \
        }                                                                                                \
      }                                                                                                  \
    __m512 sum = _mm512_setzero_ps();                                                                    \
    for (int v = 0; v < VECTORS; ++v)                                                                    \
      for (int c = 0; c < COLS; ++c) sum = _mm512_add_ps(sum, acc[v][c]);                                \
    return _mm512_reduce_add_ps(sum);                                                                    \
  }
TILE(3, 8)
TILE(2, 8)

enum { PAIRS = 64 };
static uint32_t activations[PAIRS * 3 * 16] __attribute__((aligned(64)));
static uint32_t weights[16 * PAIRS] __attribute__((aligned(64)));

int main(void) {
  if (!__builtin_cpu_supports("avx512bf16")) {
    printf("this CPU has no AVX512-BF16\n");
    return 1;
  }
  const long reps = 400000;
  struct {
    const char* name;
    float (*run)(const uint32_t*, const uint32_t*, long, long);
    int dots_per_pair;
  } shapes[] = {{"3 x 8", tile_3x8, 24}, {"2 x 8", tile_2x8, 16}};
  for (int i = 0; i < 2; ++i) {
    shapes[i].run(activations, weights, PAIRS, reps / 10); /* warm up */
    const double start = now();
    const float check = shapes[i].run(activations, weights, PAIRS, reps);
    const double seconds = now() - start;
    const double dots = (double)reps * PAIRS * shapes[i].dots_per_pair;
    printf("register tile %s: %.2f vdpbf16ps per ns = %.0f GFLOP/s on one core%s\n", shapes[i].name,
           dots / seconds * 1e-9, dots * 64 / seconds * 1e-9, check != 0.0f ? " (?)" : "");
  }
  return 0;
}
