#include "checks.h"

#include <ATen/TensorUtils.h>

#include <cmath>
#include <sstream>

namespace fp8linear {
namespace {

std::string shape_string(c10::IntArrayRef sizes) {
  std::ostringstream out;
  out << sizes;
  return out.str();
}

bool is_one_element(const at::Tensor& t) { return t.numel() == 1 && t.dim() <= 2; }

}  // namespace

fp8_format fp8_format_of(at::ScalarType dtype, const char* argument) {
  if (dtype == at::kFloat8_e4m3fn) return FP8_E4M3FN;
  if (dtype == at::kFloat8_e5m2) return FP8_E5M2;
  TORCH_CHECK_VALUE(false, argument, " must be torch.float8_e4m3fn or torch.float8_e5m2, got ", dtype);
}

fp8_float_dtype float_dtype_of(at::ScalarType dtype, const char* argument) {
  if (dtype == at::kFloat) return FP8_FLOAT32;
  if (dtype == at::kBFloat16) return FP8_BFLOAT16;
  if (dtype == at::kHalf) return FP8_FLOAT16;
  TORCH_CHECK_VALUE(false, argument, " must be torch.float32, torch.bfloat16 or torch.float16, got ", dtype);
}

std::vector<int64_t> check_quantize_args(const at::Tensor& x, const std::optional<at::Tensor>& scale,
                                         at::ScalarType dtype, bool per_row) {
  float_dtype_of(x.scalar_type(), "x");
  fp8_format_of(dtype, "dtype");
  std::vector<int64_t> scale_shape;
  if (per_row) {
    TORCH_CHECK_VALUE(x.dim() >= 1, "granularity 'row' needs x with at least 1 dimension, got a 0-d tensor");
    scale_shape = x.sizes().vec();
    scale_shape.back() = 1;
  }
  if (scale.has_value()) {
    const at::Tensor& s = *scale;
    TORCH_CHECK_VALUE(s.scalar_type() == at::kFloat, "scale must be torch.float32, got ", s.scalar_type());
    TORCH_CHECK(s.device() == x.device(), "scale must be on x's device ", x.device(), ", got ", s.device());
    if (per_row) {
      TORCH_CHECK_VALUE(s.sizes().vec() == scale_shape, "scale for granularity 'row' must have shape ",
                        shape_string(scale_shape), " (x.shape[:-1] + (1,)), got ", shape_string(s.sizes()));
    } else {
      TORCH_CHECK_VALUE(is_one_element(s), "scale for granularity 'tensor' must have one element (shape () or [1]), got shape ",
                        shape_string(s.sizes()));
    }
  }
  return scale_shape;
}

void check_scaled_mm_args(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                          const at::Tensor& scale_b, const std::optional<at::Tensor>& bias,
                          at::ScalarType out_dtype) {
  TORCH_CHECK_VALUE(a.dim() == 2, "a must be 2-D [M, K], got ", a.dim(), "-D shape ", shape_string(a.sizes()));
  TORCH_CHECK_VALUE(b.dim() == 2, "b must be 2-D [K, N], got ", b.dim(), "-D shape ", shape_string(b.sizes()));
  // a may also be float32/bfloat16/float16 (weight-only: activations not quantized)
  if (!is_fp8(a.scalar_type())) {
    TORCH_CHECK_VALUE(a.scalar_type() == at::kFloat || a.scalar_type() == at::kBFloat16 || a.scalar_type() == at::kHalf,
                      "a must be torch.float8_e4m3fn or torch.float8_e5m2 (or float32/bfloat16/float16 for weight-only), got ",
                      a.scalar_type());
  }
  fp8_format_of(b.scalar_type(), "b");
  float_dtype_of(out_dtype, "out_dtype");
  TORCH_CHECK_VALUE(a.size(1) == b.size(0), "a [M, K] and b [K, N] must share K: a has shape ",
                    shape_string(a.sizes()), ", b has shape ", shape_string(b.sizes()));
  const int64_t m = a.size(0), n = b.size(1);
  const struct {
    const at::Tensor& tensor;
    const char* name;
  } operands[] = {{b, "b"}, {scale_a, "scale_a"}, {scale_b, "scale_b"}};
  for (const auto& operand : operands) {
    TORCH_CHECK(operand.tensor.device() == a.device(), operand.name, " must be on a's device ", a.device(), ", got ",
                operand.tensor.device());
  }
  TORCH_CHECK_VALUE(scale_a.scalar_type() == at::kFloat, "scale_a must be torch.float32, got ", scale_a.scalar_type());
  TORCH_CHECK_VALUE(scale_b.scalar_type() == at::kFloat, "scale_b must be torch.float32, got ", scale_b.scalar_type());
  const int64_t k_blocks = scale_blocks(a.size(1)), n_blocks = scale_blocks(n);
  TORCH_CHECK_VALUE(is_one_element(scale_a) || scale_a.sizes() == c10::IntArrayRef({m, 1}) ||
                        scale_a.sizes() == c10::IntArrayRef({m, k_blocks}),
                    "scale_a must have shape () (per tensor), [M, 1] = [", m, ", 1] (per row) or [M, ceil(K / 128)] = [",
                    m, ", ", k_blocks, "] (per row and block of 128 k), got ", shape_string(scale_a.sizes()));
  TORCH_CHECK_VALUE(is_one_element(scale_b) || scale_b.sizes() == c10::IntArrayRef({1, n}) ||
                        scale_b.sizes() == c10::IntArrayRef({k_blocks, n_blocks}),
                    "scale_b must have shape () (per tensor), [1, N] = [1, ", n,
                    "] (per column) or [ceil(K / 128), ceil(N / 128)] = [", k_blocks, ", ", n_blocks,
                    "] (per 128 x 128 block: a weight's block scales [ceil(N / 128), ceil(K / 128)] transposed), got ",
                    shape_string(scale_b.sizes()));
  if (bias.has_value()) {
    const at::Tensor& t = *bias;
    float_dtype_of(t.scalar_type(), "bias");
    TORCH_CHECK(t.device() == a.device(), "bias must be on a's device ", a.device(), ", got ", t.device());
    TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == n, "bias must have shape [N] = [", n, "], got ",
                      shape_string(t.sizes()));
  }
}

void check_scale_values(const at::Tensor& scale, const char* argument) {
  if (!scale.device().is_cpu() || scale.numel() == 0) return;  // elsewhere reading it would cost a device sync
  // Read through the strides (a weight's block scales come transposed): no copy per call.
  const bool two_d = scale.dim() == 2;
  const at::Tensor values = two_d ? scale : scale.contiguous();
  const int64_t rows = two_d ? values.size(0) : 1, cols = two_d ? values.size(1) : values.numel();
  const int64_t row_stride = two_d ? values.stride(0) : 0, col_stride = two_d ? values.stride(1) : 1;
  const float* data = values.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const float v = data[r * row_stride + c * col_stride];
      // NaN fails the first comparison, +inf the second
      TORCH_CHECK_VALUE(v > 0.0f && std::isfinite(v), argument, " must be finite and > 0 (a dequantization multiplier), got ",
                        v, scale.numel() > 1 ? " at flat index " : "",
                        scale.numel() > 1 ? std::to_string(r * cols + c) : "");
    }
  }
}

bool scale_a_is_blocked(const at::Tensor& scale_a, int64_t m, int64_t k) {
  return scale_a.dim() == 2 && scale_a.size(1) != 1 && scale_a.size(0) == m && scale_a.size(1) == scale_blocks(k) &&
         !is_one_element(scale_a);
}

bool scale_b_is_blocked(const at::Tensor& scale_b, int64_t k, int64_t n) {
  return scale_b.dim() == 2 && !is_one_element(scale_b) && !(scale_b.size(0) == 1 && scale_b.size(1) == n) &&
         scale_b.size(0) == scale_blocks(k) && scale_b.size(1) == scale_blocks(n);
}

std::vector<int64_t> check_quantize_blocks_args(const at::Tensor& x, const std::optional<at::Tensor>& scale,
                                                at::ScalarType dtype, int64_t block_rows, int64_t block_cols) {
  float_dtype_of(x.scalar_type(), "x");
  fp8_format_of(dtype, "dtype");
  TORCH_CHECK_VALUE(block_rows >= 1 && block_cols >= 1, "block sizes must be >= 1, got ", block_rows, " x ", block_cols);
  std::vector<int64_t> scale_shape;
  if (block_rows == 1) {
    TORCH_CHECK_VALUE(x.dim() >= 1, "granularity 'group' needs x with at least 1 dimension, got a 0-d tensor");
    scale_shape = x.sizes().vec();
    scale_shape.back() = (x.size(-1) + block_cols - 1) / block_cols;
  } else {
    TORCH_CHECK_VALUE(x.dim() == 2, "granularity 'block' needs a 2-D x [rows, cols], got ", x.dim(), "-D shape ",
                      shape_string(x.sizes()));
    scale_shape = {(x.size(0) + block_rows - 1) / block_rows, (x.size(1) + block_cols - 1) / block_cols};
  }
  if (scale.has_value()) {
    const at::Tensor& s = *scale;
    TORCH_CHECK_VALUE(s.scalar_type() == at::kFloat, "scale must be torch.float32, got ", s.scalar_type());
    TORCH_CHECK(s.device() == x.device(), "scale must be on x's device ", x.device(), ", got ", s.device());
    TORCH_CHECK_VALUE(s.sizes().vec() == scale_shape, "scale for blocks of ", block_rows, " x ", block_cols,
                      " must have shape ", shape_string(scale_shape), ", got ", shape_string(s.sizes()));
  }
  return scale_shape;
}

RowView row_view(const at::Tensor& x) {
  const int64_t cols = x.dim() == 0 ? 1 : x.size(-1);
  const int64_t rows = cols == 0 ? 0 : x.numel() / cols;
  if (x.numel() == 0 || x.dim() <= 1) {
    return {x, rows, cols, cols, x.dim() == 1 ? x.stride(0) : 1};
  }
  // Leading dimensions collapse into one row stride when the strides allow it;
  // otherwise (rare: a permuted batch, say) the rows are gathered into a copy.
  const int64_t shape[2] = {rows, cols};
  std::optional<std::vector<int64_t>> strides =
      at::detail::computeStride(x.sizes(), x.strides(), at::IntArrayRef(shape, 2));
  if (strides.has_value()) return {x, rows, cols, (*strides)[0], (*strides)[1]};
  at::Tensor copy = x.reshape({rows, cols}).contiguous();
  return {copy, rows, cols, cols, 1};
}

RowView quantize_view(const at::Tensor& x, bool per_row) {
  if (per_row || !x.is_contiguous()) return row_view(x);
  return {x, x.numel() == 0 ? 0 : 1, x.numel(), x.numel(), 1};
}

}  // namespace fp8linear
