// The emulator's runtime (see emulator.h): fibers and barriers, mma.sync, and the few
// CUDA runtime functions the launchers call, answered for emulated devices.
#include "emulator.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <sys/mman.h>
#include <ucontext.h>

#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

// UBSan's options for this module (tests/cuda_emulation.py sets the variable before the
// module loads: UBSAN_OPTIONS set from Python after start-up is not read).
extern "C" const char* __ubsan_default_options() {
  const char* options = getenv("FP8LINEAR_EMULATOR_UBSAN");
  return options != nullptr ? options : "";
}

namespace fp8emu {
namespace {

constexpr size_t kStackBytes = 256 << 10;  // per emulated thread: its registers and locals
constexpr unsigned kMaxThreadsPerBlock = 1024;

struct Fiber {
  ucontext_t context;
  uint3 thread;
  bool done = false;
  // Blocked until *waiting_on differs from waiting_for (a barrier's generation).
  const unsigned long* waiting_on = nullptr;
  unsigned long waiting_for = 0;
  const char* waiting_where = "";
};

struct Warp {
  unsigned arrived = 0, mask = 0;
  unsigned long generation = 0;
  uint64_t slots[32];
  uint32_t a[32][4], b[32][2];
};

struct Block {
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  unsigned live = 0, arrived = 0;
  unsigned long generation = 0;
  unsigned long serial = 0;  // which block of the process this is
  const char* barrier_file = "";  // where the threads waiting at __syncthreads wait
  int barrier_line = 0;
  size_t current = 0;
  ucontext_t scheduler;
  void (*body)(void*) = nullptr;
  void* context = nullptr;
  std::string failure;
};

thread_local Block* running = nullptr;
thread_local unsigned long block_serial = 0;
// the block each __shared__ variable was last filled for
thread_local std::unordered_map<void*, unsigned long> shared_filled;
thread_local std::string failure_message;
thread_local cudaError_t pending_error = cudaSuccess;
thread_local int current_device = 0;

// Fiber stacks, kept between launches (one launch at a time: __shared__ is static).
std::mutex launch_mutex;
char* stacks = nullptr;
size_t stack_count = 0;

char* stack_of(size_t index) {
  if (index >= stack_count) {
    const size_t count = kMaxThreadsPerBlock;
    void* memory = mmap(nullptr, count * kStackBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                        -1, 0);
    if (memory == MAP_FAILED) return nullptr;
    stacks = static_cast<char*>(memory);
    stack_count = count;
    // a stack that overflows faults on its guard page instead of overwriting its neighbour
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    for (size_t i = 0; i < count; ++i) mprotect(stacks + i * kStackBytes, page, PROT_NONE);
  }
  return stacks + index * kStackBytes;
}

Fiber& me() { return running->fibers[running->current]; }

unsigned linear_id(const uint3& t) { return t.x + blockDim.x * (t.y + blockDim.y * t.z); }

void wait_on(const unsigned long* generation, const char* where) {
  Fiber& fiber = me();
  fiber.waiting_on = generation;
  fiber.waiting_for = *generation;
  fiber.waiting_where = where;
  swapcontext(&fiber.context, &running->scheduler);
}

void release_block_barrier_if_complete(Block& block) {
  if (block.arrived > 0 && block.arrived == block.live) {
    block.arrived = 0;
    ++block.generation;
  }
}

void fiber_main() {
  Block& block = *running;
  block.body(block.context);
  Fiber& fiber = block.fibers[block.current];
  fiber.done = true;
  --block.live;
  release_block_barrier_if_complete(block);  // exited threads no longer hold __syncthreads back
  const unsigned id = linear_id(fiber.thread);
  const Warp& warp = block.warps[id / 32];
  if (warp.arrived > 0 && ((warp.mask >> (id % 32)) & 1u)) {
    char what[160];
    snprintf(what, sizeof what, "a warp collective waits for a lane that has exited (thread %u of block (%u,%u,%u))", id,
             blockIdx.x, blockIdx.y, blockIdx.z);
    block.failure = what;
  }
  // returns to block.scheduler through uc_link
}

std::string describe_deadlock(const Block& block) {
  std::string text = "deadlock: every live thread waits on a barrier that cannot complete:";
  int shown = 0;
  for (const Fiber& fiber : block.fibers) {
    if (fiber.done) continue;
    if (shown++ == 8) {
      text += " ...";
      break;
    }
    char line[160];
    snprintf(line, sizeof line, " thread (%u,%u,%u) at %s;", fiber.thread.x, fiber.thread.y, fiber.thread.z,
             fiber.waiting_where);
    text += line;
  }
  return text;
}

// One block: its threads run until each exits, switching only at barriers.
std::string run_block(Block& block, unsigned threads) {
  block.fibers.assign(threads, Fiber{});
  block.warps.assign((threads + 31) / 32, Warp{});
  block.live = threads;
  block.arrived = 0;
  block.failure.clear();
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));  // each stack's guard page
  for (unsigned i = 0; i < threads; ++i) {
    Fiber& fiber = block.fibers[i];
    fiber.thread = make_uint3(i % blockDim.x, (i / blockDim.x) % blockDim.y, i / (blockDim.x * blockDim.y));
    char* stack = stack_of(i);
    if (stack == nullptr) return "could not map the emulated threads' stacks";
    getcontext(&fiber.context);
    fiber.context.uc_stack.ss_sp = stack + page;
    fiber.context.uc_stack.ss_size = kStackBytes - page;
    fiber.context.uc_link = &block.scheduler;
    makecontext(&fiber.context, fiber_main, 0);
  }
  block.serial = ++block_serial;
  const bool descending = (blockIdx.x + blockIdx.y + blockIdx.z) % 2 == 1;
  for (;;) {
    bool alive = false, progressed = false;
    for (size_t step = 0; step < block.fibers.size(); ++step) {
      const size_t i = descending ? block.fibers.size() - 1 - step : step;
      Fiber& fiber = block.fibers[i];
      if (fiber.done) continue;
      alive = true;
      if (fiber.waiting_on != nullptr && *fiber.waiting_on == fiber.waiting_for) continue;
      fiber.waiting_on = nullptr;
      block.current = i;
      threadIdx = fiber.thread;
      swapcontext(&block.scheduler, &fiber.context);
      progressed = true;
      if (!block.failure.empty()) return block.failure;
    }
    if (!alive) return "";
    if (!progressed) return describe_deadlock(block);
  }
}

const char* name_of(MmaType type) {
  switch (type) {
    case kMmaE4M3: return "e4m3";
    case kMmaE5M2: return "e5m2";
    case kMmaF16: return "f16";
    default: return "bf16";
  }
}

// The value of an operand element, written from the formats' definitions (OCP FP8,
// IEEE binary16, bfloat16), independently of the kernels' own conversions.
double element_value(uint32_t code, MmaType type) {
  switch (type) {
    case kMmaE4M3: {
      const int sign = code & 0x80 ? -1 : 1, exponent = (code >> 3) & 0xF, mantissa = code & 7;
      if (exponent == 0xF && mantissa == 7) return NAN;
      return sign * (exponent == 0 ? ldexp(mantissa, -9) : ldexp(8 + mantissa, exponent - 10));
    }
    case kMmaE5M2: {
      const int sign = code & 0x80 ? -1 : 1, exponent = (code >> 2) & 0x1F, mantissa = code & 3;
      if (exponent == 0x1F) return mantissa ? NAN : sign * INFINITY;
      return sign * (exponent == 0 ? ldexp(mantissa, -16) : ldexp(4 + mantissa, exponent - 17));
    }
    case kMmaF16: {
      const int sign = code & 0x8000 ? -1 : 1, exponent = (code >> 10) & 0x1F, mantissa = code & 0x3FF;
      if (exponent == 0x1F) return mantissa ? NAN : sign * INFINITY;
      return sign * (exponent == 0 ? ldexp(mantissa, -24) : ldexp(1024 + mantissa, exponent - 25));
    }
    default: {
      const uint32_t bits = code << 16;
      float value;
      memcpy(&value, &bits, sizeof value);
      return value;
    }
  }
}

// Element (row, k) of A and (k, column) of B from the warp's fragment registers.
// m16n8k32, 8-bit types: a lane (4 g + t) holds A rows g (registers 0, 2) and g + 8
// (1, 3), k = 4t..4t+3 (registers 0, 1) and 16 + 4t.. (2, 3), one byte each, k ascending;
// B column g, k = 4t.. (register 0) and 16 + 4t.. (register 1).
// m16n8k16, 16-bit types: A rows g (registers 0, 2) and g + 8 (1, 3), k = 2t, 2t + 1
// (registers 0, 1) and 8 + 2t.. (2, 3), low half first; B column g, k = 2t.. (register 0)
// and 8 + 2t.. (register 1).
uint32_t a_element(const Warp& warp, int row, int k, bool eight_bit) {
  if (eight_bit) {
    const int lane = 4 * (row % 8) + (k % 16) / 4, reg = (row >= 8) + 2 * (k >= 16);
    return (warp.a[lane][reg] >> (8 * (k % 4))) & 0xFFu;
  }
  const int lane = 4 * (row % 8) + (k % 8) / 2, reg = (row >= 8) + 2 * (k >= 8);
  return (warp.a[lane][reg] >> (16 * (k % 2))) & 0xFFFFu;
}

uint32_t b_element(const Warp& warp, int k, int column, bool eight_bit) {
  if (eight_bit) {
    const int lane = 4 * column + (k % 16) / 4, reg = k >= 16;
    return (warp.b[lane][reg] >> (8 * (k % 4))) & 0xFFu;
  }
  const int lane = 4 * column + (k % 8) / 2, reg = k >= 8;
  return (warp.b[lane][reg] >> (16 * (k % 2))) & 0xFFFFu;
}

}  // namespace

unsigned lane_id() { return linear_id(threadIdx) % 32; }

uint64_t* warp_slots() { return running->warps[linear_id(threadIdx) / 32].slots; }

void fault(const char* what) {
  Block& block = *running;
  char where[200];
  snprintf(where, sizeof where, " (block (%u,%u,%u), thread (%u,%u,%u))", blockIdx.x, blockIdx.y, blockIdx.z, threadIdx.x,
           threadIdx.y, threadIdx.z);
  block.failure = std::string(what) + where;
  Fiber& fiber = me();
  fiber.done = true;
  setcontext(&block.scheduler);
  abort();  // setcontext does not return
}

const char* last_failure() { return failure_message.c_str(); }

void shared_declared(void* variable, size_t bytes) {
  unsigned long& filled = shared_filled[variable];
  if (filled != running->serial) {
    memset(variable, 0xFF, bytes);
    filled = running->serial;
  }
}

void sync_block(const char* file, int line) {
  Block& block = *running;
  // every thread of a block must reach the same __syncthreads (the CUDA guide: undefined
  // otherwise, and a hang or a wrong result on the hardware)
  if (block.arrived == 0) {
    block.barrier_file = file;
    block.barrier_line = line;
  } else if (block.barrier_line != line || strcmp(block.barrier_file, file) != 0) {
    char what[400];
    snprintf(what, sizeof what, "threads of one block wait at different __syncthreads (%s:%d and %s:%d)",
             block.barrier_file, block.barrier_line, file, line);
    fault(what);
  }
  if (++block.arrived == block.live) {
    block.arrived = 0;
    ++block.generation;
    return;
  }
  wait_on(&block.generation, "__syncthreads");
}

void sync_warp(unsigned mask) {
  Block& block = *running;
  const unsigned id = linear_id(threadIdx), lane = id % 32, first = id - lane;
  Warp& warp = block.warps[id / 32];
  if (!((mask >> lane) & 1u)) fault("a warp collective whose mask leaves out the calling lane");
  for (unsigned l = 0; l < 32; ++l) {
    if (!((mask >> l) & 1u)) continue;
    if (first + l >= block.fibers.size()) fault("a warp collective names a lane the block does not have");
    if (block.fibers[first + l].done) fault("a warp collective waits for a lane that has exited");
  }
  if (warp.arrived == 0) {
    warp.mask = mask;
  } else if (warp.mask != mask) {
    fault("lanes of one warp reach a collective with different masks");
  }
  if (++warp.arrived == static_cast<unsigned>(__builtin_popcount(mask))) {
    warp.arrived = 0;
    ++warp.generation;
    return;
  }
  wait_on(&warp.generation, "a warp collective");
}

int kernel_arch();

void mma(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], MmaType a_type, MmaType b_type) {
  Block& block = *running;
  const unsigned id = linear_id(threadIdx), lane = id % 32;
  Warp& warp = block.warps[id / 32];
  const bool eight_bit = a_type == kMmaE4M3 || a_type == kMmaE5M2;
  if (eight_bit != (b_type == kMmaE4M3 || b_type == kMmaE5M2) ||
      (!eight_bit && a_type != b_type)) {
    char what[96];
    snprintf(what, sizeof what, "mma.sync has no .%s.%s variant", name_of(a_type), name_of(b_type));
    fault(what);
  }
  // what the code compiled for the device's architecture does: nvcc builds these wrappers
  // as a trap below sm_89 (fp8) and sm_80 (16-bit), as it does the kernels' cp.async
  if (kernel_arch() < (eight_bit ? 89 : 80)) fault("__trap(): mma.sync of this type is not compiled for this architecture");
  for (int r = 0; r < 4; ++r) warp.a[lane][r] = a[r];
  for (int r = 0; r < 2; ++r) warp.b[lane][r] = b[r];
  sync_warp(0xFFFFFFFFu);  // mma.sync.aligned: the whole warp, converged
  const int g = lane / 4, t = lane % 4, depth = eight_bit ? 32 : 16;
  for (int e = 0; e < 4; ++e) {
    const int row = g + 8 * (e / 2), column = 2 * t + e % 2;
    double sum = 0.0;  // every product exact; the sum exact for e4m3, else rounded in double before float
    for (int k = 0; k < depth; ++k) {
      sum += element_value(a_element(warp, row, k, eight_bit), a_type) *
             element_value(b_element(warp, k, column, eight_bit), b_type);
    }
    d[e] = static_cast<float>(sum);
  }
  sync_warp(0xFFFFFFFFu);  // the fragments stay until every lane has read them
}

void run_grid(dim3 grid, dim3 block_shape, size_t dynamic_shared_bytes, void (*body)(void*), void* context) {
  const std::lock_guard<std::mutex> lock(launch_mutex);
  failure_message.clear();
  const uint64_t threads = static_cast<uint64_t>(block_shape.x) * block_shape.y * block_shape.z;
  // the hardware's launch limits (compute capability 8.x / 9.0)
  if (threads == 0 || threads > kMaxThreadsPerBlock || block_shape.z > 64 || grid.x == 0 || grid.y == 0 ||
      grid.z == 0 || grid.x > 0x7FFFFFFFu || grid.y > 65535 || grid.z > 65535 || dynamic_shared_bytes > 0) {
    char text[240];
    snprintf(text, sizeof text,
             "invalid launch configuration: grid (%u,%u,%u), block (%u,%u,%u), %zu bytes of dynamic shared memory "
             "(which the emulator does not model)",
             grid.x, grid.y, grid.z, block_shape.x, block_shape.y, block_shape.z, dynamic_shared_bytes);
    failure_message = text;
    pending_error = cudaErrorInvalidConfiguration;
    return;
  }
  if (kernel_arch() == 0) {
    failure_message = "the build has no code for this device";
    pending_error = cudaErrorNoKernelImageForDevice;
    return;
  }
  Block block;
  block.body = body;
  block.context = context;
  Block* const outer = running;
  running = &block;
  gridDim = grid;
  blockDim = block_shape;
  std::string failure;
  for (unsigned z = 0; z < grid.z && failure.empty(); ++z) {
    for (unsigned y = 0; y < grid.y && failure.empty(); ++y) {
      for (unsigned x = 0; x < grid.x && failure.empty(); ++x) {
        blockIdx = make_uint3(x, y, z);
        failure = run_block(block, static_cast<unsigned>(threads));
      }
    }
  }
  running = outer;
  if (!failure.empty()) {
    failure_message = failure;
    pending_error = cudaErrorLaunchFailure;
  }
}

// ---- emulated devices ---------------------------------------------------------
// Index: what a test asks for. kernel_arch is the architecture a build's code runs as
// there (an 8.0+PTX build on a Hopper GPU runs as 80; 0: the build has no code for it).
struct EmulatedDevice {
  int major, minor, multiprocessors, kernel_arch;
};
const EmulatedDevice kDevices[] = {
    {9, 0, 132, 90},  // 0: H100 / H200
    {8, 9, 128, 89},  // 1: Ada (L40S, RTX 4090)
    {8, 0, 108, 80},  // 2: A100
    {7, 5, 40, 75},   // 3: T4 (our generic kernel only)
    {9, 0, 132, 80},  // 4: H100 with a build whose newest code is sm_80 (8.0+PTX)
    {8, 9, 128, 0},   // 5: Ada with a build that has no code for it
};
constexpr int kDeviceCount = sizeof kDevices / sizeof kDevices[0];

int kernel_arch() { return kDevices[current_device].kernel_arch; }

void copy_async16(void* shared, const void* global, bool inside) {
  if (kernel_arch() < 80) fault("__trap(): cp.async is not compiled for this architecture");
  if (inside) {
    memcpy(shared, global, 16);
  } else {
    memset(shared, 0, 16);
  }
}

}  // namespace fp8emu

// ---- the CUDA runtime functions the launchers call --------------------------------

extern "C" {

cudaError_t cudaGetLastError(void) {
  const cudaError_t error = fp8emu::pending_error;
  fp8emu::pending_error = cudaSuccess;
  return error;
}

cudaError_t cudaPeekAtLastError(void) { return fp8emu::pending_error; }

const char* cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument (emulated)";
    case cudaErrorLaunchFailure: return "unspecified launch failure (emulated)";
    case cudaErrorInvalidDevice: return "invalid device ordinal (emulated)";
    case cudaErrorNoKernelImageForDevice: return "no kernel image is available for execution on the device (emulated)";
    default: return "unknown error (emulated)";
  }
}

const char* cudaGetErrorName(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorNoKernelImageForDevice: return "cudaErrorNoKernelImageForDevice";
    default: return "cudaErrorUnknown";
  }
}

cudaError_t cudaGetDevice(int* device) {
  *device = fp8emu::current_device;
  return cudaSuccess;
}

// A failing runtime call leaves its error for cudaGetLastError, as CUDA's runtime does.
static cudaError_t failed(cudaError_t error) {
  fp8emu::pending_error = error;
  return error;
}

cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device >= fp8emu::kDeviceCount) return failed(cudaErrorInvalidDevice);
  fp8emu::current_device = device;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, enum cudaDeviceAttr attribute, int device) {
  if (device < 0 || device >= fp8emu::kDeviceCount) return failed(cudaErrorInvalidDevice);
  const fp8emu::EmulatedDevice& d = fp8emu::kDevices[device];
  switch (attribute) {
    case cudaDevAttrComputeCapabilityMajor: *value = d.major; return cudaSuccess;
    case cudaDevAttrComputeCapabilityMinor: *value = d.minor; return cudaSuccess;
    case cudaDevAttrMultiProcessorCount: *value = d.multiprocessors; return cudaSuccess;
    default: return failed(cudaErrorInvalidValue);
  }
}

cudaError_t cudaFuncGetAttributes(struct cudaFuncAttributes* attributes, const void*) {
  *attributes = cudaFuncAttributes{};
  const int arch = fp8emu::kDevices[fp8emu::current_device].kernel_arch;
  if (arch == 0) return failed(cudaErrorNoKernelImageForDevice);
  attributes->ptxVersion = arch;
  attributes->binaryVersion = arch;
  attributes->maxThreadsPerBlock = 1024;
  return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void* pointer, int value, size_t bytes, cudaStream_t) {
  memset(pointer, value, bytes);
  return cudaSuccess;
}

}  // extern "C"
