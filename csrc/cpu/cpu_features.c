/* syscall() is declared by unistd.h only with _GNU_SOURCE when compiled as strict C11
 * (g++ defines it already) */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
/* Which CPU kernel variant runs: detected once from CPUID/XGETBV (never from
 * compile flags) and, for AMX, from the OS's permission; overridable for tests. */
#include <stddef.h>

#include "cpu_internal.h"

typedef struct {
  fp8_cpu_variant best_without_amx; /* scalar .. avx512_bf16 */
  int amx_usable;
  int fma_over_bf16;                /* an Intel CPU: float32 FMAs outrun vdpbf16ps (avx512_fma) */
  const char* amx_status;           /* "" when AMX is usable, else why not */
} cpu_features;

#if FP8_X86_KERNELS
#include <cpuid.h>

#if defined(__linux__)
#include <errno.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

static uint64_t read_xcr0(void) {
  uint32_t eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return ((uint64_t)edx << 32) | eax;
}

/* Linux lets a process use the AMX tile data (8 KiB more state per thread) only after
 * asking, once per process: without it the first tile instruction raises SIGILL. The
 * answer covers every thread of the process, present and future. */
static const char* request_amx_permission(void) {
#if defined(__linux__) && defined(SYS_arch_prctl)
  enum { ARCH_GET_XCOMP_PERM = 0x1022, ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };
  /* syscall() is variadic and the kernel reads unsigned longs */
  uint64_t permitted = 0;
  if (syscall(SYS_arch_prctl, (unsigned long)ARCH_GET_XCOMP_PERM, &permitted) == 0 &&
      (permitted >> XFEATURE_XTILEDATA) & 1)
    return "";
  if (syscall(SYS_arch_prctl, (unsigned long)ARCH_REQ_XCOMP_PERM, (unsigned long)XFEATURE_XTILEDATA) != 0) {
    /* ENOSPC: a thread's signal stack is too small for the tile state; EINVAL: an old kernel */
    return errno == ENOSPC ? "Linux refused AMX permission (arch_prctl: a signal stack is too small for the tile state)"
                           : "Linux refused AMX permission (arch_prctl ARCH_REQ_XCOMP_PERM failed; kernel older than 5.16?)";
  }
  permitted = 0;
  if (syscall(SYS_arch_prctl, (unsigned long)ARCH_GET_XCOMP_PERM, &permitted) != 0 ||
      !((permitted >> XFEATURE_XTILEDATA) & 1))
    return "Linux did not grant AMX permission (arch_prctl ARCH_GET_XCOMP_PERM)";
  return "";
#else
  return "AMX is used on Linux only (its per-process permission is requested with arch_prctl)";
#endif
}

/* AMX is used only when every layer agrees: the CPU (CPUID leaf 7: AMX-TILE, AMX-BF16),
 * the OS (XCR0: tile config and data state enabled), a palette with 8 tiles of 16 rows
 * x 64 bytes (CPUID leaf 0x1D: some VMs advertise AMX without one, and fault on use),
 * and the per-process permission. Anything less falls back to the AVX512-BF16 kernels. */
static const char* detect_amx(uint64_t xcr0, uint32_t leaf7_edx) {
  if (!((leaf7_edx >> 24) & 1) || !((leaf7_edx >> 22) & 1)) return "the CPU has no AMX-TILE / AMX-BF16 (CPUID leaf 7)";
  if ((xcr0 & 0x60000) != 0x60000) return "the OS has not enabled the AMX tile state (XCR0 bits 17-18)";
  uint32_t eax, ebx, ecx, edx;
  if (!__get_cpuid_count(0x1D, 0, &eax, &ebx, &ecx, &edx) || eax < 1) return "CPUID leaf 0x1D reports no tile palette";
  __get_cpuid_count(0x1D, 1, &eax, &ebx, &ecx, &edx);
  const uint32_t bytes_per_tile = eax >> 16, bytes_per_row = ebx & 0xFFFF, tiles = ebx >> 16, rows = ecx & 0xFFFF;
  if (bytes_per_tile < 1024 || bytes_per_row < 64 || tiles < 8 || rows < 16)
    return "tile palette 1 is smaller than 8 tiles of 16 rows x 64 bytes (CPUID leaf 0x1D)";
  return request_amx_permission();
}

static cpu_features detect(void) {
  cpu_features features = {FP8_CPU_SCALAR, 0, 0, "the CPU has no AVX-512"};
  uint32_t eax, ebx, ecx, edx;
  if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return features;
  /* "GenuineIntel" in ebx, edx, ecx */
  const int intel = ebx == 0x756E6547u && edx == 0x49656E69u && ecx == 0x6C65746Eu;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return features;
  const int osxsave = (ecx >> 27) & 1, has_fma = (ecx >> 12) & 1, has_f16c = (ecx >> 29) & 1;
  if (!osxsave) return features;
  const uint64_t xcr0 = read_xcr0();
  const int os_avx = (xcr0 & 0x6) == 0x6, os_avx512 = (xcr0 & 0xE6) == 0xE6;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return features;
  const uint32_t leaf7_edx = edx;
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
  features.best_without_amx = best;
  /* the AMX kernels widen and pack with the AVX512-BF16 variant's code */
  features.amx_status = best == FP8_CPU_AVX512_BF16 ? detect_amx(xcr0, leaf7_edx)
                                                    : "the CPU lacks AVX512-BF16 / VBMI, which the AMX kernels also use";
  features.amx_usable = features.amx_status[0] == '\0';
  /* vdpbf16ps (zmm) per ns on one core against vfmadd231ps: Intel Xeon Emerald Rapids
   * 1.45 vs 6.0 (90 vs 193 GFLOP/s); AMD Zen 5 7.3 vdpbf16ps, twice its FMAs' flops, and
   * Zen 4 the same ratio (docs/performance-notes.md). Taken for every Intel CPU with
   * AVX512-BF16 and VBMI (Sapphire Rapids has Emerald Rapids' cores; Granite Rapids not
   * measured); with AMX usable the AMX kernels run instead. */
  features.fma_over_bf16 = intel && best == FP8_CPU_AVX512_BF16;
  return features;
}
#else
static cpu_features detect(void) {
  cpu_features features = {FP8_CPU_SCALAR, 0, 0, "not an x86-64 CPU"};
  return features;
}
#endif

/* Detected once: the first caller detects (0 -> 1) and publishes (1 -> 2); callers that
 * come meanwhile wait for it, so nothing reads `features` while it is written. */
static cpu_features features;
static int features_state = 0; /* 0 not detected, 1 detecting, 2 ready (GCC atomics: C and C++) */
static int active_variant = -1;

static const cpu_features* get_features(void) {
  if (__atomic_load_n(&features_state, __ATOMIC_ACQUIRE) == 2) return &features;
  int expected = 0;
  if (__atomic_compare_exchange_n(&features_state, &expected, 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
    features = detect();
    __atomic_store_n(&features_state, 2, __ATOMIC_RELEASE);
  } else {
    while (__atomic_load_n(&features_state, __ATOMIC_ACQUIRE) != 2) {
    }
  }
  return &features;
}

fp8_cpu_variant fp8_cpu_best_variant(void) {
  const cpu_features* f = get_features();
  return f->amx_usable ? FP8_CPU_AMX : f->fma_over_bf16 ? FP8_CPU_AVX512_FMA : f->best_without_amx;
}

int fp8_cpu_variant_supported(fp8_cpu_variant variant) {
  const cpu_features* f = get_features();
  switch (variant) {
    case FP8_CPU_AMX: return f->amx_usable;
    case FP8_CPU_AMX_EMULATED:
    case FP8_CPU_AVX512_FMA: return f->best_without_amx >= FP8_CPU_AVX512_BF16;
    default: return variant >= FP8_CPU_SCALAR && variant <= f->best_without_amx;
  }
}

const char* fp8_cpu_amx_status(void) { return get_features()->amx_status; }

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
  static const char* const names[FP8_CPU_VARIANT_COUNT] = {"scalar", "avx2", "avx512", "avx512_bf16", "amx",
                                                           "amx_emulated", "avx512_fma"};
  return (variant >= 0 && variant < FP8_CPU_VARIANT_COUNT) ? names[variant] : "unknown";
}
