// Argument checks shared by the CPU and CUDA implementations of every op: each
// check lives here once (the fake impls in fp8linear/ops.py mirror them for
// torch.compile). Messages name the argument, what was expected and what came.
#pragma once

#include <torch/types.h>

#include "../kernels.h"

namespace fp8linear {

// float8_e4m3fn / float8_e5m2 -> the kernels' enum; anything else is refused.
fp8_format fp8_format_of(at::ScalarType dtype, const char* argument);

inline bool is_fp8(at::ScalarType dtype) { return dtype == at::kFloat8_e4m3fn || dtype == at::kFloat8_e5m2; }

// float32 / bfloat16 / float16 -> the kernels' enum; anything else is refused.
fp8_float_dtype float_dtype_of(at::ScalarType dtype, const char* argument);

// Checks of quantize_fp8's arguments; returns the expected scale shape.
std::vector<int64_t> check_quantize_args(const at::Tensor& x, const std::optional<at::Tensor>& scale,
                                         at::ScalarType dtype, bool per_row);

// Checks of scaled_mm's arguments (dtypes, ranks, shapes, devices).
void check_scaled_mm_args(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                          const at::Tensor& scale_b, const std::optional<at::Tensor>& bias,
                          at::ScalarType out_dtype);

// A scale given to an op must be finite and > 0: checked for CPU tensors, where it costs a
// read of a few floats; a CUDA scale is not read (that would be a device sync per call).
void check_scale_values(const at::Tensor& scale, const char* argument);

// After check_scaled_mm_args a scale is either one element or one per row/column
// ([M, 1] / [1, N]); with M or N = 1 the two readings agree.
inline bool scale_is_per_row_or_column(const at::Tensor& scale) { return scale.numel() != 1; }

// The dynamic scale rule (docs/design.md): max(amax / FMAX, 1 / (FMAX * 512)), in double.
inline float scale_from_amax(float amax, fp8_format format) {
  const double fmax = fp8_format_max(format);
  const double scale = static_cast<double>(amax) / fmax;
  const double floor = 1.0 / (fmax * 512.0);
  return static_cast<float>(scale > floor ? scale : floor);
}

// x seen as [rows, cols] over its last dimension (a 0-d tensor is [1, 1]).
struct RowView {
  at::Tensor x;  // the tensor the strides below belong to (x itself, or a copy if it can't be viewed)
  int64_t rows, cols, row_stride, col_stride;
};
RowView row_view(const at::Tensor& x);

}  // namespace fp8linear
