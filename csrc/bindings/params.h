// Kernel parameter structs (csrc/kernels.h) filled from checked tensors; shared by
// the CPU and CUDA implementations so both hand kernels the same view of an op.
#pragma once

#include <torch/types.h>

#include "../kernels.h"
#include "checks.h"

namespace fp8linear {

fp8_quantize_params quantize_params_of(const RowView& view, const at::Tensor& q, fp8_format format);

// scale_a, scale_b (unless blocked: then any strides) and bias (if defined) must be
// contiguous; out is [M, N] row-major.
fp8_scaled_mm_params scaled_mm_params_of(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                                         const at::Tensor& scale_b, const at::Tensor& bias, const at::Tensor& out);

}  // namespace fp8linear
