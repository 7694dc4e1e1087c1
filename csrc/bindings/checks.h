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

// Blocks of FP8_SCALE_BLOCK (128) along a dimension of `size`.
inline int64_t scale_blocks(int64_t size) { return (size + FP8_SCALE_BLOCK - 1) / FP8_SCALE_BLOCK; }

// K-blocked scales of scaled_mm (after check_scaled_mm_args): scale_a [M, ceil(K/128)]
// other than [M, 1]; scale_b [ceil(K/128), ceil(N/128)] other than [1, N] and one element.
bool scale_a_is_blocked(const at::Tensor& scale_a, int64_t m, int64_t k);
bool scale_b_is_blocked(const at::Tensor& scale_b, int64_t k, int64_t n);

// After check_scaled_mm_args a scale that is not blocked is either one element or one
// per row/column ([M, 1] / [1, N]); with M or N = 1 the two readings agree.
inline bool scale_is_per_row_or_column(const at::Tensor& scale) { return scale.numel() != 1; }

// scale_b as the kernels read it: blocked scales with their strides (weight_scale.t() of a
// layer is a transposed view: no copy per call), the others contiguous. (scale_a is
// always made contiguous: activation scales come from quantize_fp8, contiguous.)
inline at::Tensor scale_b_for_kernels(const at::Tensor& scale_b, int64_t k, int64_t n) {
  return scale_b_is_blocked(scale_b, k, n) ? scale_b : scale_b.contiguous();
}

// Checks of quantize_fp8_blocks's arguments (blocks of block_rows x block_cols over x
// seen as [rows, cols]; block_rows = 1: groups along the last dimension, any rank;
// block_rows > 1: x 2-D); returns the scale shape.
std::vector<int64_t> check_quantize_blocks_args(const at::Tensor& x, const std::optional<at::Tensor>& scale,
                                                at::ScalarType dtype, int64_t block_rows, int64_t block_cols);

// The dynamic scale rule (docs/design.md): max(amax / FMAX, 1 / (FMAX * 512)), in double.
inline float scale_from_amax(float amax, fp8_format format) {
  const double fmax = fp8_format_max(format);
  const double scale = static_cast<double>(amax) / fmax;
  const double floor = 1.0 / (fmax * 512.0);
  return static_cast<float>(scale > floor ? scale : floor);
}

// The dynamic scale rule, then rounded up to a power of two.
inline float power_of_two_scale_from_amax(float amax, fp8_format format) {
  return fp8_power_of_two_ceil(scale_from_amax(amax, format));
}

// x seen as [rows, cols] over its last dimension (a 0-d tensor is [1, 1]).
struct RowView {
  at::Tensor x;  // the tensor the strides below belong to (x itself, or a copy if it can't be viewed)
  int64_t rows, cols, row_stride, col_stride;
};
RowView row_view(const at::Tensor& x);
// The view quantize_fp8 works on: a contiguous tensor is one long row for a per-tensor
// scale (so that every thread or block gets a share of it); otherwise row_view.
RowView quantize_view(const at::Tensor& x, bool per_row);

}  // namespace fp8linear
