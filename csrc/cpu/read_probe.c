/* A memory read loop for the benchmarks: reads every byte once with the widest
 * loads the CPU has, so that "GB/s" figures of the kernels can be compared with
 * what this machine's memory delivers, measured in the same run. */
#include "cpu_internal.h"

#if FP8_X86_KERNELS
#include <immintrin.h>

__attribute__((target("avx512f"))) static uint64_t read_avx512(const uint8_t* data, int64_t bytes) {
  __m512i acc0 = _mm512_setzero_si512(), acc1 = _mm512_setzero_si512();
  __m512i acc2 = _mm512_setzero_si512(), acc3 = _mm512_setzero_si512();
  int64_t i = 0;
  for (; i + 256 <= bytes; i += 256) {
    /* hardware prefetchers stop at 4 KiB page boundaries; without this the probe
     * measured ~45 GB/s on 2 threads where the fp8 kernels (which prefetch) read 62 */
    for (int line = 0; line < 256; line += 64) _mm_prefetch((const char*)(data + i + 8192 + line), _MM_HINT_T0);
    acc0 = _mm512_xor_si512(acc0, _mm512_loadu_si512(data + i));
    acc1 = _mm512_xor_si512(acc1, _mm512_loadu_si512(data + i + 64));
    acc2 = _mm512_xor_si512(acc2, _mm512_loadu_si512(data + i + 128));
    acc3 = _mm512_xor_si512(acc3, _mm512_loadu_si512(data + i + 192));
  }
  uint64_t lanes[8];
  _mm512_storeu_si512(lanes, _mm512_xor_si512(_mm512_xor_si512(acc0, acc1), _mm512_xor_si512(acc2, acc3)));
  uint64_t checksum = 0;
  for (int l = 0; l < 8; ++l) checksum ^= lanes[l];
  for (; i < bytes; ++i) checksum ^= data[i];
  return checksum;
}
#endif

static uint64_t read_scalar(const uint8_t* data, int64_t bytes) {
  uint64_t checksum = 0;
  int64_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    uint64_t word;
    memcpy(&word, data + i, sizeof word);
    checksum ^= word;
  }
  for (; i < bytes; ++i) checksum ^= data[i];
  return checksum;
}

uint64_t fp8_cpu_read_probe(const void* data, int64_t bytes) {
#if FP8_X86_KERNELS
  if (fp8_cpu_active_variant() >= FP8_CPU_AVX512) return read_avx512((const uint8_t*)data, bytes);
#endif
  return read_scalar((const uint8_t*)data, bytes);
}
