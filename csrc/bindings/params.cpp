#include "params.h"

namespace fp8linear {

fp8_quantize_params quantize_params_of(const RowView& view, const at::Tensor& q, fp8_format format) {
  fp8_quantize_params p{};
  p.x = view.x.data_ptr();
  p.rows = view.rows;
  p.cols = view.cols;
  p.x_row_stride = view.row_stride;
  p.x_col_stride = view.col_stride;
  p.x_dtype = float_dtype_of(view.x.scalar_type(), "x");
  p.q = static_cast<uint8_t*>(q.data_ptr());
  p.format = format;
  return p;
}

fp8_scaled_mm_params scaled_mm_params_of(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                                         const at::Tensor& scale_b, const at::Tensor& bias, const at::Tensor& out) {
  fp8_scaled_mm_params p{};
  p.a = a.data_ptr();
  p.a_is_float = !is_fp8(a.scalar_type());
  p.a_float_dtype = p.a_is_float ? float_dtype_of(a.scalar_type(), "a") : FP8_FLOAT32;
  p.a_row_stride = a.stride(0);
  p.a_col_stride = a.stride(1);
  p.b = static_cast<const uint8_t*>(b.data_ptr());
  p.b_row_stride = b.stride(0);
  p.b_col_stride = b.stride(1);
  p.m = a.size(0);
  p.n = b.size(1);
  p.k = a.size(1);
  p.a_format = p.a_is_float ? FP8_E4M3FN : fp8_format_of(a.scalar_type(), "a");
  p.b_format = fp8_format_of(b.scalar_type(), "b");
  p.scale_a = scale_a.data_ptr<float>();
  p.scale_b = scale_b.data_ptr<float>();
  p.scale_a_blocked = scale_a_is_blocked(scale_a, p.m, p.k);
  p.scale_b_blocked = scale_b_is_blocked(scale_b, p.k, p.n);
  p.scale_a_per_row = !p.scale_a_blocked && scale_is_per_row_or_column(scale_a);
  p.scale_b_per_col = !p.scale_b_blocked && scale_is_per_row_or_column(scale_b);
  p.scale_a_row_stride = p.scale_a_blocked ? scale_a.stride(0) : 0;
  p.scale_b_k_stride = p.scale_b_blocked ? scale_b.stride(0) : 0;
  p.scale_b_n_stride = p.scale_b_blocked ? scale_b.stride(1) : 0;
  TORCH_INTERNAL_ASSERT(!p.scale_a_blocked || scale_a.stride(1) == 1, "blocked scale_a must be contiguous");
  p.bias = bias.defined() ? bias.data_ptr() : nullptr;
  p.bias_dtype = bias.defined() ? float_dtype_of(bias.scalar_type(), "bias") : FP8_FLOAT32;
  p.out = out.data_ptr();
  p.out_row_stride = out.stride(0);
  p.out_dtype = float_dtype_of(out.scalar_type(), "out_dtype");
  return p;
}

}  // namespace fp8linear
