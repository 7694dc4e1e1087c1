/* Which CPU kernel variant runs: detected once from CPUID/XGETBV (never from
 * compile flags), overridable for tests. */
#include <stddef.h>

#include "cpu_internal.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>

static uint64_t read_xcr0(void) {
  uint32_t eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return ((uint64_t)edx << 32) | eax;
}

static fp8_cpu_variant detect_best_variant(void) {
  uint32_t eax, ebx, ecx, edx;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return FP8_CPU_SCALAR;
  const int osxsave = (ecx >> 27) & 1, has_fma = (ecx >> 12) & 1, has_f16c = (ecx >> 29) & 1;
  if (!osxsave) return FP8_CPU_SCALAR;
  const uint64_t xcr0 = read_xcr0();
  const int os_avx = (xcr0 & 0x6) == 0x6, os_avx512 = (xcr0 & 0xE6) == 0xE6;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return FP8_CPU_SCALAR;
  const int has_avx2 = (ebx >> 5) & 1;
  const int has_avx512 = ((ebx >> 16) & 1) /* F */ && ((ebx >> 30) & 1) /* BW */ &&
                         ((ebx >> 31) & 1) /* VL */ && ((ebx >> 17) & 1) /* DQ */;
  const int has_avx512_vbmi = (ecx >> 1) & 1; /* vpermt2b: the fp8 -> bf16 byte tables */
  uint32_t eax1 = 0, ebx1, ecx1, edx1;
  __get_cpuid_count(7, 1, &eax1, &ebx1, &ecx1, &edx1);
  const int has_avx512_bf16 = (eax1 >> 5) & 1;

  fp8_cpu_variant best = FP8_CPU_SCALAR;
  if (os_avx && has_avx2 && has_fma && has_f16c) best = FP8_CPU_AVX2;
  if (best == FP8_CPU_AVX2 && os_avx512 && has_avx512) best = FP8_CPU_AVX512;
  /* Cooper Lake has AVX512-BF16 without VBMI: it takes the AVX-512 variant */
  if (best == FP8_CPU_AVX512 && has_avx512_bf16 && has_avx512_vbmi) best = FP8_CPU_AVX512_BF16;
  return best;
}
#else
static fp8_cpu_variant detect_best_variant(void) { return FP8_CPU_SCALAR; }
#endif

/* -1 = not detected yet (GCC atomics: valid in both C and C++). Detection is
 * idempotent, so a race only repeats it. */
static int best_variant = -1;
static int active_variant = -1;

fp8_cpu_variant fp8_cpu_best_variant(void) {
  int best = __atomic_load_n(&best_variant, __ATOMIC_ACQUIRE);
  if (best < 0) {
    best = (int)detect_best_variant();
    __atomic_store_n(&best_variant, best, __ATOMIC_RELEASE);
  }
  return (fp8_cpu_variant)best;
}

int fp8_cpu_variant_supported(fp8_cpu_variant variant) {
  return variant >= FP8_CPU_SCALAR && variant <= fp8_cpu_best_variant();
}

fp8_cpu_variant fp8_cpu_active_variant(void) {
  const int active = __atomic_load_n(&active_variant, __ATOMIC_ACQUIRE);
  return active < 0 ? fp8_cpu_best_variant() : (fp8_cpu_variant)active;
}

int fp8_cpu_set_variant(fp8_cpu_variant variant) {
  if (!fp8_cpu_variant_supported(variant)) return 0;
  __atomic_store_n(&active_variant, (int)variant, __ATOMIC_RELEASE);
  return 1;
}

const char* fp8_cpu_variant_name(fp8_cpu_variant variant) {
  static const char* const names[FP8_CPU_VARIANT_COUNT] = {"scalar", "avx2", "avx512", "avx512_bf16"};
  return (variant >= 0 && variant < FP8_CPU_VARIANT_COUNT) ? names[variant] : "unknown";
}
