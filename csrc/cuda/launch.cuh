// Host-side helpers shared by the launchers: error messages and launch checks,
// and the compile-time dispatch over (float dtype, fp8 format).
#pragma once

#include <cuda_runtime_api.h>
#include <stdint.h>

#include <type_traits>

#include "../kernels.h"

namespace fp8cuda {

// "what: <CUDA error string> (<error name>)" in a thread-local buffer (valid until the
// next message on this thread). Defined in device.cu.
const char* error_message(const char* what, cudaError_t error);
// A formatted message without a CUDA error code.
const char* error_text(const char* format, ...);

// Checks the launch just made; kernel faults surface at the next synchronizing call.
inline const char* check_launch(const char* kernel) {
  const cudaError_t error = cudaGetLastError();
  return error == cudaSuccess ? nullptr : error_message(kernel, error);
}

__host__ __device__ inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline bool is_aligned(const void* pointer, int64_t bytes) {
  return reinterpret_cast<uintptr_t>(pointer) % static_cast<uintptr_t>(bytes) == 0;
}

template <fp8_float_dtype kDtype>
using DtypeConstant = std::integral_constant<fp8_float_dtype, kDtype>;
template <fp8_format kFormat>
using FormatConstant = std::integral_constant<fp8_format, kFormat>;

// body(DtypeConstant, FormatConstant) instantiated for the run-time pair.
template <class Body>
const char* dispatch_dtype_format(fp8_float_dtype dtype, fp8_format format, Body&& body) {
  auto with_format = [&](auto dtype_constant) {
    return format == FP8_E4M3FN ? body(dtype_constant, FormatConstant<FP8_E4M3FN>{})
                                : body(dtype_constant, FormatConstant<FP8_E5M2>{});
  };
  switch (dtype) {
    case FP8_BFLOAT16: return with_format(DtypeConstant<FP8_BFLOAT16>{});
    case FP8_FLOAT16: return with_format(DtypeConstant<FP8_FLOAT16>{});
    default: return with_format(DtypeConstant<FP8_FLOAT32>{});
  }
}

}  // namespace fp8cuda
