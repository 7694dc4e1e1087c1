// quantize_fp8 on the GPU: q = rne(clamp(x / scale, -FMAX, FMAX)), bit-exact with
// fp8linear/reference.py (an IEEE division, one rounding, saturation, NaN and -0 kept).
//
// Memory-bound: a bfloat16 element costs 3 bytes of traffic (2 read, 1 written), so
// loads are 16-byte vectors where the rows allow and the conversion is one cvt per
// two values on sm_89+. The dynamic per-tensor scale never reaches the host: an amax
// kernel reduces into one device word that the quantize kernel turns into the scale.
#include <math.h>

#include <algorithm>

#include "cuda_kernels.h"
#include "fp8_device.cuh"
#include "launch.cuh"

namespace fp8cuda {
namespace {

constexpr int kThreads = 256;
// Tensors up to this many elements are quantized per tensor by a single block in one
// launch (amax and quantize back to back); decode-sized activations take this path.
constexpr int64_t kSingleBlockElements = 1 << 16;

// x seen as [rows, cols] (strides in elements); q is contiguous [rows, cols].
struct QuantizeArgs {
  const void* x;
  int64_t rows, cols, row_stride, col_stride;
  uint8_t* q;
  // Every full chunk is one aligned 16-byte load of x and one aligned store of its codes.
  bool vectorized;
};

// One 16-byte piece of a row: 4 float32 or 8 bfloat16/float16 values.
template <fp8_float_dtype kDtype>
struct Chunk {
  using Storage = typename FloatTraits<kDtype>::Storage;
  static constexpr int kSize = 16 / sizeof(Storage);
  Storage value[kSize];
};

template <fp8_float_dtype kDtype>
__host__ __device__ constexpr int chunk_size() {
  return Chunk<kDtype>::kSize;
}

// How many values chunk `chunk` of a row holds (a row's last chunk may be short); chunk < chunks.
template <fp8_float_dtype kDtype>
__device__ __forceinline__ int chunk_count(const QuantizeArgs& args, int64_t chunk) {
  constexpr int kSize = Chunk<kDtype>::kSize;
  const int64_t left = args.cols - chunk * kSize;
  return left < kSize ? static_cast<int>(left) : kSize;
}

// Loads chunk `chunk` of `row`; returns how many values it holds (chunk_count).
template <fp8_float_dtype kDtype>
__device__ __forceinline__ int load_chunk(const QuantizeArgs& args, int64_t row, int64_t chunk, Chunk<kDtype>& out) {
  using Storage = typename Chunk<kDtype>::Storage;
  constexpr int kSize = Chunk<kDtype>::kSize;
  const int64_t col = chunk * kSize;
  const int count = chunk_count<kDtype>(args, chunk);
  const Storage* x = static_cast<const Storage*>(args.x);
  if (args.vectorized && count == kSize) {
    const uint4 bits = __ldg(reinterpret_cast<const uint4*>(x + row * args.row_stride + col));
    memcpy(out.value, &bits, sizeof bits);
  } else {
#pragma unroll
    for (int i = 0; i < kSize; ++i) {
      out.value[i] = i < count ? x[row * args.row_stride + (col + i) * args.col_stride] : Storage(0);
    }
  }
  return count;
}

template <fp8_float_dtype kDtype>
__device__ __forceinline__ float chunk_amax(const Chunk<kDtype>& chunk, int count, float amax) {
#pragma unroll
  for (int i = 0; i < Chunk<kDtype>::kSize; ++i) {
    const float magnitude = fabsf(FloatTraits<kDtype>::to_float(chunk.value[i]));
    // Only finite values count: one inf must not zero the rest of the tensor.
    if (i < count && magnitude <= 3.402823466e38f) amax = fmaxf(amax, magnitude);
  }
  return amax;
}

// Stores the codes of `chunk` quantized with `scale` at q_row[col...].
template <fp8_float_dtype kDtype, fp8_format kFormat>
__device__ __forceinline__ void quantize_chunk(const QuantizeArgs& args, int64_t row, int64_t chunk_index,
                                               const Chunk<kDtype>& chunk, int count, float scale) {
  using Traits = FloatTraits<kDtype>;
  constexpr int kSize = Chunk<kDtype>::kSize;
  uint32_t words[kSize / 4];  // the codes, four per word (registers, not a local array)
#pragma unroll
  for (int i = 0; i < kSize; i += 2) {
    const float lo = Traits::to_float(chunk.value[i]), hi = Traits::to_float(chunk.value[i + 1]);
    // __fdiv_rn: the IEEE quotient even if someone builds with fast-math division.
    uint32_t pair = encode_fp8_pair<kFormat>(__fdiv_rn(lo, scale), __fdiv_rn(hi, scale));
    // NaN stays NaN with the input's sign (the quotient's NaN sign is not specified).
    if (lo != lo) pair = (pair & 0xFF00u) | (Traits::sign_bit(chunk.value[i]) << 7) | 0x7Fu;
    if (hi != hi) pair = (pair & 0x00FFu) | (Traits::sign_bit(chunk.value[i + 1]) << 15) | 0x7F00u;
    if (i % 4 == 0) {
      words[i / 4] = pair;
    } else {
      words[i / 4] |= pair << 16;
    }
  }
  uint8_t* q = args.q + row * args.cols + chunk_index * kSize;
  if (args.vectorized && count == kSize) {
    if constexpr (kSize == 8) {
      *reinterpret_cast<uint2*>(q) = make_uint2(words[0], words[1]);
    } else {
      *reinterpret_cast<uint32_t*>(q) = words[0];
    }
  } else {
#pragma unroll
    for (int i = 0; i < kSize; ++i) {
      if (i < count) q[i] = static_cast<uint8_t>(words[i / 4] >> (8 * (i % 4)));
    }
  }
}

// The scale rule (docs/design.md) in double, as scale_from_amax in checks.h.
template <fp8_format kFormat>
__device__ __forceinline__ float scale_from_amax(float amax) {
  const double fmax = Fp8Traits<kFormat>::kMax;
  const double scale = static_cast<double>(amax) / fmax;
  const double floor = 1.0 / (fmax * 512.0);
  return static_cast<float>(scale > floor ? scale : floor);
}

// Maximum over the threadIdx.x group of a row (blockDim.x threads, a power of two);
// every thread of the block must call it. `shared` holds one float per warp.
__device__ __forceinline__ float row_group_max(float value, float* shared) {
  const int width = blockDim.x < 32 ? blockDim.x : 32;
  for (int offset = width / 2; offset > 0; offset /= 2) {
    value = fmaxf(value, __shfl_xor_sync(0xFFFFFFFFu, value, offset));
  }
  if (blockDim.x <= 32) return value;
  // Groups wider than a warp: blockDim.x / 32 warps per row, combined in shared memory.
  const int warps_per_row = blockDim.x / 32, warp_in_row = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) shared[threadIdx.y * warps_per_row + warp_in_row] = value;
  __syncthreads();
  for (int w = 0; w < warps_per_row; ++w) value = fmaxf(value, shared[threadIdx.y * warps_per_row + w]);
  __syncthreads();  // `shared` is reused by the next row
  return value;
}

// Layout of the loops below: threadIdx.x walks the chunks of a row, threadIdx.y picks
// rows; the grid strides over both, so any [rows, cols] is covered.
template <fp8_float_dtype kDtype>
__global__ void __launch_bounds__(kThreads) tensor_amax_kernel(QuantizeArgs args, unsigned int* amax_bits) {
  const int64_t chunks = ceil_div(args.cols, chunk_size<kDtype>());
  float amax = 0.0f;
  for (int64_t row = blockIdx.y * static_cast<int64_t>(blockDim.y) + threadIdx.y; row < args.rows;
       row += static_cast<int64_t>(gridDim.y) * blockDim.y) {
    for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < chunks;
         c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      Chunk<kDtype> chunk;
      const int count = load_chunk(args, row, c, chunk);
      amax = chunk_amax(chunk, count, amax);
    }
  }
  for (int offset = 16; offset > 0; offset /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, offset));
  __shared__ float warp_amax[kThreads / 32];
  const int thread = threadIdx.y * blockDim.x + threadIdx.x;
  if (thread % 32 == 0) warp_amax[thread / 32] = amax;
  __syncthreads();
  if (thread == 0) {
    for (int w = 1; w < kThreads / 32; ++w) amax = fmaxf(amax, warp_amax[w]);
    // Non-negative floats order like their bit patterns, so an integer max is a float max.
    if (amax > 0.0f) atomicMax(amax_bits, __float_as_uint(amax));
  }
}

enum class ScaleSource { kTensor, kRow, kAmax };

template <fp8_float_dtype kDtype, fp8_format kFormat, ScaleSource kSource>
__global__ void __launch_bounds__(kThreads)
    quantize_kernel(QuantizeArgs args, const float* __restrict__ scale, const unsigned int* __restrict__ amax_bits,
                    float* __restrict__ scale_out) {
  float tensor_scale = 0.0f;
  if constexpr (kSource == ScaleSource::kAmax) {
    tensor_scale = scale_from_amax<kFormat>(__uint_as_float(*amax_bits));
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0 && threadIdx.y == 0) *scale_out = tensor_scale;
  } else if constexpr (kSource == ScaleSource::kTensor) {
    tensor_scale = __ldg(scale);
  }
  const int64_t chunks = ceil_div(args.cols, chunk_size<kDtype>());
  for (int64_t row = blockIdx.y * static_cast<int64_t>(blockDim.y) + threadIdx.y; row < args.rows;
       row += static_cast<int64_t>(gridDim.y) * blockDim.y) {
    const float row_scale = kSource == ScaleSource::kRow ? __ldg(scale + row) : tensor_scale;
    for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < chunks;
         c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      Chunk<kDtype> chunk;
      const int count = load_chunk(args, row, c, chunk);
      quantize_chunk<kDtype, kFormat>(args, row, c, chunk, count, row_scale);
    }
  }
}

// Dynamic scale per row: the row's threads reduce its amax, then quantize it. The
// first kHeldChunks chunks of each thread are loaded together (one memory latency, not
// one per chunk) and kept in registers for the second pass: a decode-sized row (up
// to 16 Ki bfloat16 values with 256 threads) is read once. Also the single-block
// per-tensor path (the tensor as one row), where this latency is the kernel's time.
constexpr int kHeldChunks = 8;

// kPowerOfTwo: each scale rounded up to a power of two (scale_fmt "ue8m0"); a template
// argument, since a flag read at run time made the float32 kernel spill at sm_80.
template <fp8_float_dtype kDtype, fp8_format kFormat, bool kPowerOfTwo>
__global__ void __launch_bounds__(kThreads) quantize_rows_dynamic_kernel(QuantizeArgs args, float* __restrict__ row_scales) {
  __shared__ float shared[kThreads / 32];
  const int64_t chunks = ceil_div(args.cols, chunk_size<kDtype>());
  // The loop bound is uniform over the block, so every thread reaches the reductions.
  for (int64_t first_row = blockIdx.x * static_cast<int64_t>(blockDim.y); first_row < args.rows;
       first_row += static_cast<int64_t>(gridDim.x) * blockDim.y) {
    const int64_t row = first_row + threadIdx.y;
    const bool active = row < args.rows;
    Chunk<kDtype> held[kHeldChunks];
    // held chunk i is chunk held_chunk(i) of the row; its valid elements are recomputed
    // where needed rather than held (8 more registers made the float32 kernel spill at
    // sm_80 and sm_89)
    auto held_chunk = [&](int i) { return threadIdx.x + static_cast<int64_t>(i) * blockDim.x; };
    auto held_count = [&](int i) {
      return active && held_chunk(i) < chunks ? chunk_count<kDtype>(args, held_chunk(i)) : 0;
    };
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < kHeldChunks; ++i) {
      if (held_count(i) > 0) load_chunk(args, row, held_chunk(i), held[i]);
    }
#pragma unroll
    for (int i = 0; i < kHeldChunks; ++i) amax = chunk_amax(held[i], held_count(i), amax);
    for (int64_t c = threadIdx.x + static_cast<int64_t>(kHeldChunks) * blockDim.x; active && c < chunks;
         c += blockDim.x) {
      Chunk<kDtype> chunk;
      const int count = load_chunk(args, row, c, chunk);
      amax = chunk_amax(chunk, count, amax);
    }
    float scale = scale_from_amax<kFormat>(row_group_max(amax, shared));
    if (kPowerOfTwo) scale = fp8_power_of_two_ceil(scale);
    if (!active) continue;
    if (threadIdx.x == 0) row_scales[row] = scale;
#pragma unroll
    for (int i = 0; i < kHeldChunks; ++i) {
      const int count = held_count(i);
      if (count > 0) {
        quantize_chunk<kDtype, kFormat>(args, row, held_chunk(i), held[i], count, scale);
      }
    }
    for (int64_t c = threadIdx.x + static_cast<int64_t>(kHeldChunks) * blockDim.x; c < chunks; c += blockDim.x) {
      Chunk<kDtype> chunk;
      const int count = load_chunk(args, row, c, chunk);
      quantize_chunk<kDtype, kFormat>(args, row, c, chunk, count, scale);
    }
  }
}

QuantizeArgs args_of(const fp8_quantize_params* p) {
  const int64_t element_bytes = fp8_float_bytes(p->x_dtype);
  const int64_t size = 16 / element_bytes;
  QuantizeArgs args{p->x, p->rows, p->cols, p->x_row_stride, p->x_col_stride, p->q, false};
  // Every full chunk must start on a 16-byte boundary of x and a `size`-byte boundary of q.
  args.vectorized = p->x_col_stride == 1 && is_aligned(p->x, 16) && is_aligned(p->q, size) &&
                    (p->rows == 1 || ((p->x_row_stride * element_bytes) % 16 == 0 && p->cols % size == 0));
  return args;
}

// Threads per row: the chunks of a row, rounded up to a power of two, at most a block.
dim3 block_shape(const fp8_quantize_params* p) {
  const int64_t chunks = ceil_div(p->cols, p->x_dtype == FP8_FLOAT32 ? 4 : 8);
  int threads_per_row = 1;
  while (threads_per_row < kThreads && threads_per_row < chunks) threads_per_row *= 2;
  return dim3(threads_per_row, kThreads / threads_per_row);
}

// Enough blocks to fill the GPU a few times over; the kernels stride over the rest.
dim3 grid_shape(const fp8_quantize_params* p, dim3 block, int multiprocessors) {
  const int64_t chunks = ceil_div(p->cols, p->x_dtype == FP8_FLOAT32 ? 4 : 8);
  const int64_t target = static_cast<int64_t>(multiprocessors > 0 ? multiprocessors : 1) * 8;
  const int64_t grid_x = std::min<int64_t>(ceil_div(chunks, block.x), target);
  const int64_t grid_y = std::min<int64_t>({ceil_div(p->rows, block.y), std::max<int64_t>(1, target / grid_x), 65535});
  return dim3(static_cast<unsigned>(grid_x), static_cast<unsigned>(grid_y));
}

}  // namespace
}  // namespace fp8cuda

using namespace fp8cuda;

const char* fp8_cuda_quantize_static_launch(const fp8_quantize_params* p, const float* scale, int per_row,
                                            int multiprocessors, cudaStream_t stream) {
  if (p->rows == 0 || p->cols == 0) return nullptr;
  const QuantizeArgs args = args_of(p);
  const dim3 block = block_shape(p), grid = grid_shape(p, block, multiprocessors);
  return dispatch_dtype_format(p->x_dtype, p->format, [&](auto dtype, auto format) {
    constexpr fp8_float_dtype kDtype = decltype(dtype)::value;
    constexpr fp8_format kFormat = decltype(format)::value;
    if (per_row) {
      quantize_kernel<kDtype, kFormat, ScaleSource::kRow><<<grid, block, 0, stream>>>(args, scale, nullptr, nullptr);
    } else {
      quantize_kernel<kDtype, kFormat, ScaleSource::kTensor><<<grid, block, 0, stream>>>(args, scale, nullptr, nullptr);
    }
    return check_launch("quantize_kernel (static scale)");
  });
}

const char* fp8_cuda_quantize_rows_dynamic_launch(const fp8_quantize_params* p, float* row_scales, int power_of_two,
                                                  cudaStream_t stream) {
  if (p->rows == 0 || p->cols == 0) return nullptr;
  const QuantizeArgs args = args_of(p);
  const dim3 block = block_shape(p);
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(ceil_div(p->rows, block.y), 1 << 20)));
  return dispatch_dtype_format(p->x_dtype, p->format, [&](auto dtype, auto format) {
    constexpr fp8_float_dtype kDtype = decltype(dtype)::value;
    constexpr fp8_format kFormat = decltype(format)::value;
    if (power_of_two) {
      quantize_rows_dynamic_kernel<kDtype, kFormat, true><<<grid, block, 0, stream>>>(args, row_scales);
    } else {
      quantize_rows_dynamic_kernel<kDtype, kFormat, false><<<grid, block, 0, stream>>>(args, row_scales);
    }
    return check_launch("quantize_rows_dynamic_kernel");
  });
}

const char* fp8_cuda_quantize_tensor_dynamic_launch(const fp8_quantize_params* p, unsigned int* amax_scratch,
                                                    float* scale_out, int multiprocessors, cudaStream_t stream) {
  if (p->rows == 0 || p->cols == 0) return nullptr;
  if (p->rows == 1 && p->cols <= kSingleBlockElements) {
    // One row: the per-row kernel's scale for that row is the tensor's scale.
    return fp8_cuda_quantize_rows_dynamic_launch(p, scale_out, 0, stream);
  }
  const cudaError_t status = cudaMemsetAsync(amax_scratch, 0, sizeof *amax_scratch, stream);
  if (status != cudaSuccess) return error_message("clearing the amax accumulator", status);
  const QuantizeArgs args = args_of(p);
  const dim3 block = block_shape(p), grid = grid_shape(p, block, multiprocessors);
  return dispatch_dtype_format(p->x_dtype, p->format, [&](auto dtype, auto format) {
    constexpr fp8_float_dtype kDtype = decltype(dtype)::value;
    constexpr fp8_format kFormat = decltype(format)::value;
    tensor_amax_kernel<kDtype><<<grid, block, 0, stream>>>(args, amax_scratch);
    if (const char* error = check_launch("tensor_amax_kernel")) return error;
    quantize_kernel<kDtype, kFormat, ScaleSource::kAmax><<<grid, block, 0, stream>>>(args, nullptr, amax_scratch, scale_out);
    return check_launch("quantize_kernel (dynamic per-tensor scale)");
  });
}

const char* fp8_cuda_quantize_launch(const fp8_quantize_params* p, const float* static_scale, int per_row,
                                     float* scale_out, unsigned int* amax_scratch, int multiprocessors,
                                     cudaStream_t stream) {
  if (static_scale != nullptr) return fp8_cuda_quantize_static_launch(p, static_scale, per_row, multiprocessors, stream);
  if (per_row) return fp8_cuda_quantize_rows_dynamic_launch(p, scale_out, 0, stream);
  return fp8_cuda_quantize_tensor_dynamic_launch(p, amax_scratch, scale_out, multiprocessors, stream);
}
