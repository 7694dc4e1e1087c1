// CPU implementations of the ops: checks (shared), then ranges of the problem
// spread over torch's intra-op thread pool, each range handed to a C kernel.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "../kernels.h"
#include "checks.h"
#include "params.h"

namespace fp8linear {
namespace {

// A fresh multi-megabyte buffer costs one page fault per 4 KiB on first touch,
// which for a memory-bound kernel can take longer than the kernel itself (64 MiB:
// ~16k faults). Asking for transparent huge pages cuts that 512-fold; torch's CPU
// allocator does the same only when THP_MEM_ALLOC_ENABLE=1 is set.
void advise_huge_pages(void* data, int64_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kPage = 4096, kMinimum = 4 << 20;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(data);
  const uintptr_t end = begin + static_cast<uintptr_t>(bytes);
  const uintptr_t aligned_begin = (begin + kPage - 1) & ~(kPage - 1), aligned_end = end & ~(kPage - 1);
  if (aligned_end > aligned_begin && aligned_end - aligned_begin >= kMinimum) {
    madvise(reinterpret_cast<void*>(aligned_begin), aligned_end - aligned_begin, MADV_HUGEPAGE);  // a hint: failure is harmless
  }
#else
  (void)data;
  (void)bytes;
#endif
}

void advise_huge_pages(const at::Tensor& tensor) { advise_huge_pages(tensor.data_ptr(), tensor.numel() * tensor.element_size()); }

#if !defined(__SANITIZE_ADDRESS__)
// A buffer from aligned_alloc (64-byte aligned, any size), freed with std::free.
struct FreeBuffer {
  void operator()(uint8_t* pointer) const { std::free(pointer); }
};
using Buffer = std::unique_ptr<uint8_t, FreeBuffer>;

int64_t round_up(int64_t value, int64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

Buffer allocate_kernel_memory(int64_t bytes, const char* what) {
  Buffer buffer(static_cast<uint8_t*>(std::aligned_alloc(64, static_cast<size_t>(round_up(bytes, 64)))));
  TORCH_CHECK(buffer, "fp8linear: could not allocate ", bytes, " bytes of scaled_mm ", what);
  return buffer;
}

// The plan's workspace (the packed activations, shared by the call's threads), kept by
// each calling thread between calls and grown when a call needs more: fresh buffers of
// megabytes per call cost page faults, and on VMs that hand freed memory back to the
// host (free page reporting), faults through the host; the AMX kernel at M = 1024 (8 MiB
// of workspace) ran at half speed in such phases. Calls whose workspace is over
// kKeptWorkspaceBytes (M x K beyond ~32 M elements) get a buffer of their own, freed after.
class KernelMemory {
 public:
  uint8_t* get(int64_t bytes) {
    if (bytes <= kept_bytes_) return kept_.get();
    Buffer fresh = allocate_kernel_memory(bytes, "workspace");
    advise_huge_pages(fresh.get(), bytes);
    if (bytes > kKeptWorkspaceBytes) {
      once_ = std::move(fresh);
      return once_.get();
    }
    kept_ = std::move(fresh);
    kept_bytes_ = bytes;
    return kept_.get();
  }
  void release_once() { once_.reset(); }

 private:
  static constexpr int64_t kKeptWorkspaceBytes = int64_t{64} << 20;
  Buffer kept_, once_;
  int64_t kept_bytes_ = 0;
};

// A thread's scratch area for the kernels (the widened weight panel, the register tiles'
// sums: at most ~1 MiB), a buffer of the thread's own, allocated and first touched by the
// thread that runs the kernels, kept between calls and grown when a call needs more. It
// used to follow the workspace in the caller's buffer, thread t's at t x scratch_bytes:
// there the second thread of two ran its equal share of the tile kernel 6% slower than
// the first in the host's calm periods and 25% slower in others (1536 x 576 at M = 2048,
// AMD EPYC Zen 4: 9.1 and 10.8 ms against 8.55), and the call waited for it. The slowness
// followed the scratch slot (given the other thread's slot, the first thread was the slow
// one) and went away with a 64 KiB gap between the slots, not with a 4 KiB one; the
// mechanism (cache sets, prefetchers) is not known. Each thread's own buffer: both 8.6 ms.
uint8_t* thread_scratch(int64_t bytes) {
  thread_local Buffer buffer;
  thread_local int64_t buffer_bytes = 0;
  if (bytes > buffer_bytes) {
    buffer.reset();  // the old one first (a failed allocation below leaves none, and size 0)
    buffer_bytes = 0;
    buffer = allocate_kernel_memory(bytes, "scratch");
    buffer_bytes = bytes;
  }
  return buffer.get();
}

#else
// scaled_mm's memory in the instrumented build: one allocation per buffer, each exactly
// as large as the plan says (ASan's redzones follow each), freed after the call.
class ExactBuffers {
 public:
  ExactBuffers(int64_t workspace_bytes, int64_t scratch_bytes, int64_t threads) {
    workspace_ = allocate(workspace_bytes);
    for (int64_t t = 0; t < threads; ++t) scratch_.push_back(allocate(scratch_bytes));
  }
  ExactBuffers(const ExactBuffers&) = delete;
  ExactBuffers& operator=(const ExactBuffers&) = delete;
  ~ExactBuffers() {
    std::free(workspace_);
    for (uint8_t* buffer : scratch_) std::free(buffer);
  }
  uint8_t* workspace() const { return workspace_; }
  uint8_t* scratch(int64_t thread) const { return scratch_[static_cast<size_t>(thread)]; }

 private:
  static uint8_t* allocate(int64_t bytes) {
    void* pointer = nullptr;  // posix_memalign: any size (aligned_alloc wants a multiple of 64)
    TORCH_CHECK(posix_memalign(&pointer, 64, static_cast<size_t>(bytes)) == 0, "fp8linear: could not allocate ",
                bytes, " bytes of scaled_mm workspace");
    return static_cast<uint8_t*>(pointer);
  }
  uint8_t* workspace_ = nullptr;
  std::vector<uint8_t*> scratch_;
};
#endif

// Work below this many elements per task is not worth a thread.
constexpr int64_t kQuantizeGrain = 1 << 15;
constexpr int64_t kQuantizeChunk = 1 << 18;
constexpr int64_t kQuantizeMinTask = 3 << 14;  // per-tensor: elements a thread must get to be woken
constexpr int64_t kScaledMmGrain = 1 << 16;

// Rows per task when a task is a whole row: at least kQuantizeGrain elements.
int64_t quantize_row_grain(const fp8_quantize_params& p) {
  return std::max<int64_t>(1, kQuantizeGrain / std::max<int64_t>(1, p.cols));
}

// How a contiguous tensor, one long row, is cut for quantize_per_tensor: chunks of
// `chunk` elements (a multiple of 64, so that each starts on a cache line), `grain` of
// them per thread. Only threads with at least kQuantizeMinTask elements are woken, and
// they get equal shares: chunks of kQuantizeGrain, the last one short, had left one
// thread 32K elements and the other 4.8K at M = 64, K = 576 (36.8K elements), slower
// than one thread. Per tensor, bf16, 2 threads, medians of 15 x 200 calls, us, this cut
// vs that one, 3 alternated process rounds (Intel Xeon with AMX): 64 x 576 8.5-8.6 vs
// 10.0-11.2, 128 x 576 12.7-13.0 vs 14.8-15.4, 256 x 576 16.6-17.8 vs 18.7-19.1,
// 512 x 576 25.2-26.5 vs 28.0-29.5, 2048 x 576 93.5-94.1 vs 104-116 (the same 8 chunks
// there, of 147456 elements instead of 147457: the old ones started off cache lines,
// the likely cause). Thresholds of 32K, 64K and 96K elements per thread were slower at
// 128-256 rows of 576 in at least one of two runs.
struct RowSplit {
  int64_t chunk, grain;
};

RowSplit split_long_row(int64_t cols, int64_t threads) {
  const int64_t workers = std::clamp<int64_t>(cols / kQuantizeMinTask, 1, std::max<int64_t>(1, threads));
  // up to 4 chunks per thread (the quantize pass walks them backwards), none over kQuantizeChunk
  int64_t per_worker = std::clamp<int64_t>(cols / (workers * kQuantizeMinTask), 1, 4);
  per_worker = std::max(per_worker, (cols + workers * kQuantizeChunk - 1) / (workers * kQuantizeChunk));
  const int64_t chunks = workers * per_worker;
  return {((cols + chunks - 1) / chunks + 63) / 64 * 64, per_worker};
}

// One scale for the whole tensor: a parallel amax, then a parallel quantize.
// Long rows are split by columns so that a single huge row still uses every thread.
float quantize_per_tensor(const fp8_quantize_params& p, std::optional<float> static_scale) {
  // Chunks of a long row: small enough that the last ones the amax pass read are still in
  // the last-level cache when the quantize pass, going backwards, reads them again.
  const RowSplit split = split_long_row(p.cols, at::get_num_threads());
  const int64_t col_chunk = p.rows == 1 ? split.chunk : p.cols;
  const int64_t col_chunks = (p.cols + col_chunk - 1) / col_chunk;
  const int64_t row_grain = p.rows == 1 ? split.grain : quantize_row_grain(p);
  const int64_t tasks = p.rows * col_chunks;
  float scale;
  if (static_scale.has_value()) {
    scale = *static_scale;
  } else {
    std::vector<float> amax(static_cast<size_t>(tasks), 0.0f);
    at::parallel_for(0, tasks, row_grain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t row = t / col_chunks, col = (t % col_chunks) * col_chunk;
        fp8_cpu_row_amax(&p, row, row + 1, col, std::min(p.cols, col + col_chunk), &amax[static_cast<size_t>(t)]);
      }
    });
    const float tensor_amax = amax.empty() ? 0.0f : *std::max_element(amax.begin(), amax.end());
    scale = scale_from_amax(tensor_amax, p.format);
  }
  // Backwards: each thread starts with what its amax pass read last (the same split of
  // [0, tasks) over the threads), part of which is still cached (up to the L3's size of a
  // tensor that does not fit, instead of none of it).
  at::parallel_for(0, tasks, row_grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = end - 1; t >= begin; --t) {
      const int64_t row = t / col_chunks, col = (t % col_chunks) * col_chunk;
      fp8_cpu_quantize(&p, row, row + 1, col, std::min(p.cols, col + col_chunk), &scale, 0);
    }
  });
  return scale;
}

// One scale per row: amax and quantize of a row run back to back, while it is in cache.
void quantize_per_row(const fp8_quantize_params& p, float* scales, bool dynamic) {
  const int64_t row_grain = quantize_row_grain(p);
  at::parallel_for(0, p.rows, row_grain, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      if (dynamic) {
        float amax;
        fp8_cpu_row_amax(&p, row, row + 1, 0, p.cols, &amax);
        scales[row] = scale_from_amax(amax, p.format);
      }
      fp8_cpu_quantize(&p, row, row + 1, 0, p.cols, scales, 1);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> quantize_fp8_cpu(const at::Tensor& x, const std::optional<at::Tensor>& scale,
                                                    at::ScalarType dtype, bool per_row) {
  const std::vector<int64_t> scale_shape = check_quantize_args(x, scale, dtype, per_row);
  if (scale.has_value()) check_scale_values(*scale, "scale");
  const fp8_format format = fp8_format_of(dtype, "dtype");
  at::Tensor q = at::empty(x.sizes(), x.options().dtype(dtype));
  advise_huge_pages(q);
  if (x.numel() == 0) {  // nothing to quantize: a dynamic scale is the floor (amax 0)
    at::Tensor floor = at::full(scale_shape, scale_from_amax(0.0f, format), x.options().dtype(at::kFloat));
    return {q, scale.has_value() ? scale->clone() : floor};
  }
  const RowView view = quantize_view(x, per_row);  // holds the copy of x that row_view may make
  const fp8_quantize_params p = quantize_params_of(view, q, format);
  if (!per_row) {
    std::optional<float> static_scale;
    if (scale.has_value()) static_scale = scale->item<float>();
    const float used = quantize_per_tensor(p, static_scale);
    // a static scale comes back as a copy: an op's outputs must not alias its inputs
    return {q, scale.has_value() ? scale->clone() : at::full({}, used, x.options().dtype(at::kFloat))};
  }
  at::Tensor scales = scale.has_value() ? scale->contiguous() : at::empty(scale_shape, x.options().dtype(at::kFloat));
  quantize_per_row(p, scales.data_ptr<float>(), !scale.has_value());
  return {q, scale.has_value() ? scale->clone() : scales};
}

// One scale per block of block_rows x block_cols (block_rows = 1: groups along the last
// dimension): a task per block, its amax (dynamic) and quantization back to back.
// power_of_two: dynamic scales rounded up to powers of two.
std::tuple<at::Tensor, at::Tensor> quantize_fp8_blocks_cpu(const at::Tensor& x, const std::optional<at::Tensor>& scale,
                                                           at::ScalarType dtype, int64_t block_rows, int64_t block_cols,
                                                           bool power_of_two) {
  const std::vector<int64_t> scale_shape = check_quantize_blocks_args(x, scale, dtype, block_rows, block_cols);
  if (scale.has_value()) check_scale_values(*scale, "scale");
  const fp8_format format = fp8_format_of(dtype, "dtype");
  at::Tensor q = at::empty(x.sizes(), x.options().dtype(dtype));
  advise_huge_pages(q);
  float (*const rule)(float, fp8_format) = power_of_two ? power_of_two_scale_from_amax : scale_from_amax;
  at::Tensor scales = scale.has_value() ? scale->contiguous() : at::empty(scale_shape, x.options().dtype(at::kFloat));
  if (x.numel() == 0) {  // nothing to quantize: dynamic scales are the floor (amax 0)
    if (!scale.has_value()) scales.fill_(rule(0.0f, format));
    return {q, scale.has_value() ? scale->clone() : scales};
  }
  const RowView view = row_view(x);
  const fp8_quantize_params p = quantize_params_of(view, q, format);
  const int64_t row_blocks = (p.rows + block_rows - 1) / block_rows;
  const int64_t col_blocks = (p.cols + block_cols - 1) / block_cols;
  const bool dynamic = !scale.has_value();
  float* const scale_data = scales.data_ptr<float>();  // row-major [row_blocks, col_blocks]
  if (block_rows == 1 && p.x_col_stride == 1) {
    // groups along contiguous rows: a task per range of rows, the variant picked once per
    // task (per group, the calls below cost ~25% of the time at groups of 128)
    const int64_t row_grain = quantize_row_grain(p);
    at::parallel_for(0, p.rows, row_grain, [&](int64_t begin, int64_t end) {
      fp8_cpu_quantize_groups(&p, begin, end, block_cols, scale_data, dynamic ? 1 : 0, rule);
    });
    return {q, scale.has_value() ? scale->clone() : scales};
  }
  const int64_t grain = std::max<int64_t>(1, kQuantizeGrain / (block_rows * block_cols));
  at::parallel_for(0, row_blocks * col_blocks, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> row_amax(static_cast<size_t>(std::min(block_rows, p.rows)));
    for (int64_t t = begin; t < end; ++t) {
      const int64_t r0 = (t / col_blocks) * block_rows, c0 = (t % col_blocks) * block_cols;
      const int64_t r1 = std::min(p.rows, r0 + block_rows), c1 = std::min(p.cols, c0 + block_cols);
      if (dynamic) {
        fp8_cpu_row_amax(&p, r0, r1, c0, c1, row_amax.data());
        scale_data[t] = rule(*std::max_element(row_amax.begin(), row_amax.begin() + (r1 - r0)), format);
      }
      fp8_cpu_quantize(&p, r0, r1, c0, c1, scale_data + t, 0);
    }
  });
  return {q, scale.has_value() ? scale->clone() : scales};
}

// The tile kernel's tiles as the plan sizes them can leave threads idle on small layers:
// 576 weight rows are 9 tiles of 64, 5 for one thread and 4 for the other. Splitting M
// too, into row tiles of whole groups of 16 rows (at least 96 rows each), evens the
// shares out (SmolLM2's 576 x 1536 at M = 2048, 2 threads: 0.72x -> 0.81x of bf16
// nn.Linear measured side by side).
//
// With enough rows the AVX512-BF16 tile kernel gets one row tile per thread, all columns
// each: thread t then computes on the rows it packed in prepare (at::parallel_for cuts both
// ranges alike) and writes whole output rows. Split by columns, every thread reads all
// the packed activations for each weight panel, half of them written by another core.
// The price: each thread reads the whole weight instead of its share. FP8Linear, 2
// threads, AMD EPYC Zen 4, by columns -> by rows, medians of 6-8 alternated rounds in one
// process: M = 256 1536 x 576 1.08x faster, 4096 x 4096 1.07x, 14336 x 4096 1.06x, 4096 x
// 14336 1.00x; M = 512 1.04-1.11x; M = 2048 1.02-1.04x. With 96 rows a thread (M = 192)
// the Llama shapes ran 0.97-1.01x (the weight read twice over fewer rows), so a weight
// over kSmallWeightBytes takes 128 rows a thread. One a core's L2 holds is read again at
// little cost: from 48 rows a thread, SmolLM2's four shapes (0.1-0.9 MB) ran 1.02-1.32x
// faster at M = 96-224 (medians of 11 alternated rounds), where 2048 x 2048 and 896 x 4864
// (4.2-4.4 MB) ran 0.98-1.01x and the Llama shapes 0.93-1.00x. The AMX kernels keep the
// split by columns (not measured on an Intel Xeon).
constexpr int64_t kRowsPerThreadForRowSplit = 128;
constexpr int64_t kRowsPerThreadForRowSplitSmallWeight = 48;
constexpr int64_t kSmallWeightBytes = int64_t{1} << 20;

fp8_cpu_mm_plan balance_tiles(fp8_cpu_mm_plan plan, int64_t n, int64_t k, int64_t threads) {
  const bool tile = plan.method == FP8_MM_BF16_TILE || plan.method == FP8_MM_FMA_TILE;
  if ((!tile && plan.method != FP8_MM_AMX) || threads <= 1) return plan;
  const int64_t groups = plan.m_padded / 16;
  const int64_t row_split_rows = n * k <= kSmallWeightBytes ? kRowsPerThreadForRowSplitSmallWeight
                                                           : kRowsPerThreadForRowSplit;
  if (tile && plan.m_padded / threads >= row_split_rows) {
    plan.tile_m = (groups + threads - 1) / threads * 16;  // prepare's 16-row blocks per thread
    return plan;
  }
  const auto waste = [&](int64_t tiles) {  // the busiest thread's excess over an even share
    const int64_t busiest = (tiles + threads - 1) / threads;
    return static_cast<double>(busiest * threads - tiles) / static_cast<double>(tiles);
  };
  const int64_t tiles_n = (n + plan.tile_n - 1) / plan.tile_n;
  int64_t row_tiles = 1;
  while (waste(tiles_n * row_tiles) > 0.05 && plan.m_padded / (row_tiles + 1) >= 96) ++row_tiles;
  if (row_tiles == 1) return plan;  // (the eight-row kernel's 8 rows are less than one group)
  // even row tiles, in whole groups of 16 rows (the packed activations' unit)
  plan.tile_m = (groups + row_tiles - 1) / row_tiles * 16;
  return plan;
}

// One call's plan run over torch's thread pool: the plan's memory, folded block scales,
// the activations' prepare pass, then the output's tiles.
void run_scaled_mm(const fp8_scaled_mm_params& given) {
  const int64_t m = given.m, n = given.n;
  const int64_t threads = at::get_num_threads();
  const fp8_cpu_mm_plan plan = balance_tiles(fp8_cpu_scaled_mm_plan(&given, threads), n, given.k, threads);
#if defined(__SANITIZE_ADDRESS__)
  // The instrumented build (make sanitize) gives the workspace and each thread's scratch
  // fresh buffers of exactly the sizes the plan asked for, freed after the call: in the
  // kept buffers below, which may be larger, a kernel writing past its share would go
  // unseen.
  ExactBuffers exact(plan.workspace_bytes, plan.scratch_bytes, threads);
  uint8_t* const workspace = exact.workspace();
  const auto scratch = [&] { return exact.scratch(at::get_thread_num() % threads); };
#else
  thread_local KernelMemory kernel_memory;
  uint8_t* const workspace = kernel_memory.get(plan.workspace_bytes);
  // (a call made inside another parallel region runs its loops on the calling thread alone)
  const int64_t scratch_bytes = plan.scratch_bytes;
  const auto scratch = [scratch_bytes] { return thread_scratch(scratch_bytes); };
#endif
  // Block scales a power of two apart: folded into the operands, the call runs per row and column.
  fp8_scaled_mm_params folded;
  const fp8_scaled_mm_params& p = fp8_cpu_scaled_mm_fold(&given, &plan, workspace, &folded) ? folded : given;
  // Activations are widened once (rows in blocks of 16: the tile kernel packs 16 rows together) ...
  const int64_t row_blocks = (m + 15) / 16;
  at::parallel_for(0, row_blocks, 1, [&](int64_t begin, int64_t end) {
    fp8_cpu_scaled_mm_prepare(&p, &plan, workspace, scratch(), begin * 16, std::min(m, end * 16));
  });
  // ... then each thread takes whole tiles of the output.
  const int64_t tiles_m = (m + plan.tile_m - 1) / plan.tile_m, tiles_n = (n + plan.tile_n - 1) / plan.tile_n;
  // A thread's share must be worth waking it: below ~64K multiply-adds (a 64 x 64
  // layer at M = 1: 4K) the pool's start-up costs more than the work.
  const int64_t tile_work = std::max<int64_t>(1, std::min(m, plan.tile_m) * std::min(n, plan.tile_n) * p.k);
  const int64_t grain = std::max<int64_t>(1, kScaledMmGrain / tile_work);
  at::parallel_for(0, tiles_m * tiles_n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end;) {
      // consecutive tiles of one tile row are merged into one call: fewer setups per thread
      const int64_t tile_row = t / tiles_n, first_col = t % tiles_n;
      const int64_t last_col = std::min(tiles_n, first_col + (end - t));
      const int64_t m0 = tile_row * plan.tile_m;
      fp8_cpu_scaled_mm(&p, &plan, workspace, scratch(), m0, std::min(m, m0 + plan.tile_m), first_col * plan.tile_n,
                        std::min(n, last_col * plan.tile_n));
      t += last_col - first_col;
    }
  });
#if !defined(__SANITIZE_ADDRESS__)
  kernel_memory.release_once();
#endif
}

// The AVX512-BF16 skinny and tile kernels work on groups of 16 rows, so M = 16q + r
// pays for a whole group of padding rows for its last r rows. Up to kMaxTailRows of them
// run as a call of their own (the dot kernel for r <= 4, the eight-row kernel for
// r = 5-8), after the 16q rows. Likewise M = 9, which the skinny kernel would pad to 16,
// runs as 8 rows on the eight-row kernel and 1 on the dot kernel (each reading the
// weight; FP8Linear, 2 threads, AMD EPYC Zen 4, weights cycled from memory, medians of
// 5-7 rounds in turns with the padded call: 1.08-1.27x faster on the Llama-3-8B shapes,
// 1.16-1.24x on SmolLM2's; M = 10 as 8 + 2 ran 0.92-0.93x on 14336 x 4096).
constexpr int64_t kMaxTailRows = 8;

int64_t tail_rows(const fp8_scaled_mm_params& p) {
  const int64_t tail = p.m == 9 ? 1 : p.m > 16 ? p.m % 16 : 0;
  if (tail == 0 || tail > kMaxTailRows) return 0;
  const fp8_cpu_mm_plan plan = fp8_cpu_scaled_mm_plan(&p, at::get_num_threads());
  return plan.method == FP8_MM_BF16_TILE || plan.method == FP8_MM_FMA_TILE ? tail : 0;
}

at::Tensor scaled_mm_cpu(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                         const at::Tensor& scale_b, const std::optional<at::Tensor>& bias,
                         at::ScalarType out_dtype) {
  check_scaled_mm_args(a, b, scale_a, scale_b, bias, out_dtype);
  check_scale_values(scale_a, "scale_a");
  check_scale_values(scale_b, "scale_b");
  const int64_t m = a.size(0), n = b.size(1);
  at::Tensor out = at::empty({m, n}, a.options().dtype(out_dtype));
  advise_huge_pages(out);
  if (m == 0 || n == 0) return out;
  // Scales and bias are tiny; contiguous() copies only if a caller passed them strided.
  const at::Tensor scale_a_c = scale_a.contiguous(), scale_b_c = scale_b_for_kernels(scale_b, a.size(1), b.size(1));
  const at::Tensor bias_c = bias.has_value() ? bias->contiguous() : at::Tensor();
  const fp8_scaled_mm_params given = scaled_mm_params_of(a, b, scale_a_c, scale_b_c, bias_c, out);
  const int64_t tail = tail_rows(given);
  if (tail == 0) {
    run_scaled_mm(given);
  } else {
    run_scaled_mm(fp8_scaled_mm_rows(&given, 0, m - tail));
    run_scaled_mm(fp8_scaled_mm_rows(&given, m - tail, m));
  }
  return out;
}

}  // namespace

// For tests and benchmarks: which kernel scaled_mm picks for these operands on the CPU,
// and whether their block scales fold into the operands (fp8_cpu_scaled_mm_fold).
std::tuple<std::string, bool> cpu_scaled_mm_plan(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                                                 const at::Tensor& scale_b) {
  check_scaled_mm_args(a, b, scale_a, scale_b, std::nullopt, at::kFloat);
  TORCH_CHECK_VALUE(a.is_cpu() && b.is_cpu() && scale_a.is_cpu() && scale_b.is_cpu(),
                    "cpu_scaled_mm_plan: the CPU kernels' plan needs CPU tensors");
  check_scale_values(scale_a, "scale_a");
  check_scale_values(scale_b, "scale_b");
  const at::Tensor out = at::empty({a.size(0), b.size(1)}, a.options().dtype(at::kFloat));
  const at::Tensor scale_a_c = scale_a.contiguous(), scale_b_c = scale_b_for_kernels(scale_b, a.size(1), b.size(1));
  const fp8_scaled_mm_params p = scaled_mm_params_of(a, b, scale_a_c, scale_b_c, at::Tensor(), out);
  const fp8_cpu_mm_plan plan = fp8_cpu_scaled_mm_plan(&p, at::get_num_threads());
  static const char* const names[] = {"scalar", "float_dot", "bf16_dot", "bf16_tile", "amx", "avx2_panel", "fma_tile"};
  bool folded = false;
  if (plan.fold_offset >= 0) {
    const at::Tensor workspace = at::empty({plan.workspace_bytes}, at::kByte);
    fp8_scaled_mm_params unused;
    folded = fp8_cpu_scaled_mm_fold(&p, &plan, workspace.data_ptr(), &unused) != 0;
  }
  // (the AVX512-BF16 tile method runs the skinny kernel or the register tiles: plan.skinny)
  return {plan.skinny ? "bf16_skinny" : names[plan.method], folded};
}

TORCH_LIBRARY_IMPL(fp8linear, CPU, m) {
  m.impl("quantize_fp8", &quantize_fp8_cpu);
  m.impl("quantize_fp8_blocks", &quantize_fp8_blocks_cpu);
  m.impl("scaled_mm", &scaled_mm_cpu);
}

}  // namespace fp8linear
