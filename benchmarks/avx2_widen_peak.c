/* The ceiling of the AVX2 W8A8 dot kernel's inner loop (gemm_avx2.c, the float32 route)
 * on one core, and the widenings it was measured against: each variant multiplies 4
 * e4m3fn weight rows by one float32 activation row as the kernel does at M = 1 (for
 * each 8 activations, a vector of 8 codes widened to float32 per weight row, one FMA
 * each), with everything in L1, so that only the instructions count. It prints
 * nanoseconds per 32 codes of one weight row and checks that every widening gives the
 * kernel's sums bit for bit (the same FMAs in the same order).
 *
 *   gcc -O2 -o /tmp/avx2_widen_peak benchmarks/avx2_widen_peak.c && /tmp/avx2_widen_peak
 *
 * `floor` loads the codes and multiplies them without widening (wrong sums, not
 * checked): what the loads and FMAs alone cost. docs/performance-notes.md (AMD EPYC Zen 1)
 * has the figures. */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define TARGET __attribute__((target("avx2,fma")))
#define INLINE TARGET static inline __attribute__((always_inline))
enum { K = 2048, COLS = 4, REPS = 400 };
static uint8_t weights[COLS][K + 64] __attribute__((aligned(64))); /* row c's codes at weights[c] + 32 */
static float activations[K] __attribute__((aligned(64)));         /* laid out as the kernel's lanes4 */

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* A 32-bit lane holding an e4m3 code in its top byte (anything below) -> the code's value
 * times 2^-120 (the kernel's widen8_float32_route, after its load). */
INLINE __m256 from_top_byte(__m256i lanes) {
  return _mm256_castsi256_ps(_mm256_and_si256(_mm256_srai_epi32(lanes, 4), _mm256_set1_epi32((int)0x87F00000u)));
}
/* Codes 4j + t of row[0..32) in lane j: the kernel's unaligned load 3 - t bytes before. */
INLINE __m256 kernel_widen(const uint8_t* row, int t) {
  return from_top_byte(_mm256_loadu_si256((const __m256i*)(row - 3 + t)));
}
/* The shift by vpmulhw (the multiply pipe): the top 16 bits times 2^12, high half. */
INLINE __m256 mulhw_widen(const uint8_t* row, int t) {
  const __m256i lanes = _mm256_loadu_si256((const __m256i*)(row - 3 + t));
  return _mm256_castsi256_ps(
      _mm256_and_si256(_mm256_mulhi_epi16(lanes, _mm256_set1_epi16(0x1000)), _mm256_set1_epi32((int)0x87F00000u)));
}
/* vpmaddubsw: 16 x the signed code in byte 2 (t even) or 3 (t odd) of each lane, into the
 * top 16 bits; the loads are 2 bytes before row (t = 0, 1) or at it (t = 2, 3). */
INLINE __m256 maddubs_widen(const uint8_t* row, int t) {
  const __m256i lanes = _mm256_loadu_si256((const __m256i*)(row - (t < 2 ? 2 : 0)));
  const __m256i select = _mm256_set1_epi32(t & 1 ? 0x10000000 : 0x00100000);
  return _mm256_castsi256_ps(_mm256_and_si256(_mm256_maddubs_epi16(select, lanes), _mm256_set1_epi32((int)0x87F00000u)));
}
/* One load of row[0..32), the lanes for t = 0..2 shifted in within each 128-bit half. */
INLINE __m256 byteshift_widen(const uint8_t* row, int t) {
  const __m256i bytes = _mm256_loadu_si256((const __m256i*)row);
  return from_top_byte(t == 0 ? _mm256_slli_si256(bytes, 3) : t == 1 ? _mm256_slli_si256(bytes, 2)
                       : t == 2 ? _mm256_slli_si256(bytes, 1) : bytes);
}
/* Two loads (2 bytes before row, and at it), the even t shifted left by 8 first. */
INLINE __m256 two_loads_widen(const uint8_t* row, int t) {
  __m256i lanes = _mm256_loadu_si256((const __m256i*)(row - (t < 2 ? 2 : 0)));
  if (!(t & 1)) lanes = _mm256_slli_epi32(lanes, 8);
  return from_top_byte(lanes);
}

enum { KERNEL, NO_NAN, MULHW_HALF, MADDUBS, MADDUBS_HALF, BYTESHIFT, BYTESHIFT_HALF, TWO_LOADS, FLOOR, VARIANTS };
static const char* const NAMES[VARIANTS] = {
    "kernel (load, shift, mask; NaN tracking)", "kernel without the NaN tracking", "vpmulhw for t = 0, 1",
    "vpmaddubsw for all t", "vpmaddubsw for t = 0, 1", "one load, byte shifts for t = 0..2",
    "byte shifts for t = 0, 2", "two loads, shift left for even t", "floor: loads and FMAs, no widening"};

/* The 4 rows' sums over K (times 2^-120), and the largest code magnitude in `nan_max`. */
#define VARIANT_FN(V)                                                                                         \
  TARGET __attribute__((noinline)) static void run_##V(float sums[COLS], int* nan_max) {                       \
    __m256 acc[COLS][2];                                                                                      \
    for (int c = 0; c < COLS; ++c) acc[c][0] = acc[c][1] = _mm256_setzero_ps();                               \
    __m256i largest = _mm256_setzero_si256();                                                                 \
    for (int k0 = 0; k0 < K; k0 += 32) {                                                                      \
      _Pragma("GCC unroll 4") for (int t = 0; t < 4; ++t) {                                                   \
        const __m256 x = _mm256_load_ps(activations + k0 + 8 * t);                                           \
        _Pragma("GCC unroll 4") for (int c = 0; c < COLS; ++c) {                                              \
          const uint8_t* row = weights[c] + 32 + k0;                                                          \
          if (V != NO_NAN && V != FLOOR && t == 3)                                                            \
            largest = _mm256_max_epu8(largest, _mm256_and_si256(_mm256_loadu_si256((const __m256i*)row),      \
                                                                _mm256_set1_epi8(0x7F)));                     \
          __m256 w;                                                                                           \
          switch (V) {                                                                                        \
            case MULHW_HALF: w = t < 2 ? mulhw_widen(row, t) : kernel_widen(row, t); break;                   \
            case MADDUBS: w = maddubs_widen(row, t); break;                                                   \
            case MADDUBS_HALF: w = t < 2 ? maddubs_widen(row, t) : kernel_widen(row, t); break;               \
            case BYTESHIFT: w = byteshift_widen(row, t); break;                                               \
            case BYTESHIFT_HALF: w = t % 2 == 0 ? byteshift_widen(row, t) : kernel_widen(row, t); break;      \
            case TWO_LOADS: w = two_loads_widen(row, t); break;                                               \
            case FLOOR: w = _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i*)(row - 3 + t))); break;    \
            default: w = kernel_widen(row, t); break;                                                         \
          }                                                                                                   \
          acc[c][t & 1] = _mm256_fmadd_ps(x, w, acc[c][t & 1]);                                               \
        }                                                                                                     \
      }                                                                                                       \
    }                                                                                                         \
    for (int c = 0; c < COLS; ++c) {                                                                          \
      float lanes[8];                                                                                         \
      _mm256_storeu_ps(lanes, _mm256_add_ps(acc[c][0], acc[c][1]));                                           \
      sums[c] = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7])); \
    }                                                                                                         \
    uint8_t bytes[32];                                                                                        \
    _mm256_storeu_si256((__m256i*)bytes, largest);                                                            \
    *nan_max = 0;                                                                                             \
    for (int i = 0; i < 32; ++i) *nan_max = bytes[i] > *nan_max ? bytes[i] : *nan_max;                        \
  }
VARIANT_FN(KERNEL)
VARIANT_FN(NO_NAN)
VARIANT_FN(MULHW_HALF)
VARIANT_FN(MADDUBS)
VARIANT_FN(MADDUBS_HALF)
VARIANT_FN(BYTESHIFT)
VARIANT_FN(BYTESHIFT_HALF)
VARIANT_FN(TWO_LOADS)
VARIANT_FN(FLOOR)
typedef void (*variant_fn)(float[COLS], int*);
static const variant_fn FNS[VARIANTS] = {run_KERNEL, run_NO_NAN, run_MULHW_HALF, run_MADDUBS, run_MADDUBS_HALF,
                                          run_BYTESHIFT, run_BYTESHIFT_HALF, run_TWO_LOADS, run_FLOOR};

int main(void) {
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) {
    puts("this CPU has no AVX2 + FMA");
    return 0;
  }
  srand(1);
  for (int c = 0; c < COLS; ++c)
    for (int i = 0; i < K + 64; ++i) {
      const int code = rand() & 0xFF;
      weights[c][i] = (uint8_t)((code & 0x7F) == 0x7F ? code - 1 : code); /* no NaN codes */
    }
  for (int i = 0; i < K; ++i) activations[i] = (float)(rand() % 17 - 8) * 0x1p100f; /* fp8-like, times 2^100 */
  float expected[COLS];
  int nan_max;
  run_KERNEL(expected, &nan_max);
  int failures = 0;
  for (int v = 0; v < VARIANTS; ++v) {
    float sums[COLS];
    FNS[v](sums, &nan_max);
    if (v != FLOOR && memcmp(sums, expected, sizeof sums) != 0) {
      printf("%s: sums differ from the kernel's\n", NAMES[v]);
      ++failures;
    }
  }
  /* best of 15 passes each, the variants in turns (the host's clock drifts) */
  double best[VARIANTS];
  for (int v = 0; v < VARIANTS; ++v) best[v] = 1e30;
  for (int pass = 0; pass < 15; ++pass)
    for (int v = 0; v < VARIANTS; ++v) {
      float sums[COLS];
      const double start = now();
      for (int r = 0; r < REPS; ++r) FNS[v](sums, &nan_max);
      const double ns = (now() - start) * 1e9 / REPS / (K / 32.0 * COLS);
      if (ns < best[v]) best[v] = ns;
    }
  printf("%-42s %18s %10s %14s\n", "widening", "ns per 32 codes", "G codes/s", "kernel / this");
  for (int v = 0; v < VARIANTS; ++v)
    printf("%-42s %18.2f %10.2f %14.2f\n", NAMES[v], best[v], 32.0 / best[v], best[KERNEL] / best[v]);
  return failures ? 1 : 0;
}
