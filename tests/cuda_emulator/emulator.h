// A SIMT emulator that runs fp8linear's CUDA kernels (csrc/cuda) on the CPU, for the
// tests of tests/test_cuda_emulated.py: every kernel's logic (indexing, tiling, edge
// handling, warp collectives, the mma fragment layouts) checked against the reference
// on machines without a GPU. Force-included (g++ -include) in front of each .cu file,
// which is compiled as C++ after tests/cuda_emulation.py rewrites its launches
// (`kernel<<<grid, block, shared, stream>>>(args)` -> fp8emu::launch(...)).
//
// The model, from the CUDA programming guide and the PTX ISA:
// - each CUDA thread is a fiber with its own stack (its registers); the blocks of a
//   grid run one after another, the threads of a block interleaved only at barriers,
//   so nothing relies on warps running in lockstep (independent thread scheduling);
// - __shared__ variables are static: one copy, shared by the threads of the running block,
//   filled with 0xFF bytes (NaN as float32 and as fp8) by the first thread of each block
//   that reaches the declaration (tests/cuda_emulation.py follows each __shared__
//   declaration with fp8emu::shared_declared), so that a read of shared memory no thread
//   has written gives NaN;
// - the threads of even blocks run in ascending order between barriers, those of odd
//   blocks in descending order: a thread that reads what another writes without a
//   barrier between them reads the fill in one of the two;
// - __syncthreads waits for every thread of the block that has not exited, and all of
//   them must wait at the same __syncthreads;
// - warp collectives (__shfl_xor_sync, __syncwarp, mma.sync) wait for every lane of their
//   mask; a mask naming a lane that has exited or that the block lacks is a fault (stricter
//   than PTX, where only reading an exited lane is undefined), as are mismatched masks
//   and a block in which every live thread waits on something that never completes;
// - mma.sync m16n8k32 (fp8) and m16n8k16 (f16/bf16) gather the warp's fragments by the
//   PTX ISA's layouts ("Matrix Fragments for mma.m16n8k32 / mma.m16n8k16") and return
//   D = A B from exact products summed in double, then rounded to float32 (exact sums for
//   e4m3; real tensor cores round differently: the tests' tolerances hold for both);
// - cp.async copies at once (16 bytes, or zeros for a source size of 0);
// - code that nvcc compiles to a trap for the emulated device's architecture (fp8 mma.sync
//   below sm_89, 16-bit mma.sync and cp.async below sm_80) traps.
// These faults surface as launch errors through cudaGetLastError with a message
// (fp8emu::last_failure), right after the launch (on a GPU, at the next synchronizing
// call). A memory fault (a read past a guard page, a stack overflow onto a fiber
// stack's guard page) kills the process as it would on the CPU, and a thread that loops
// forever without reaching a barrier hangs it.
//
// Not emulated: cuBLASLt, streams (everything is synchronous), dynamic shared memory,
// memory ordering (races other than the missing barrier above go unseen), the sm_89+
// hardware conversions (the portable ones run).
#pragma once

#include <cuda_runtime_api.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <type_traits>
#include <utility>

#ifndef FP8LINEAR_CUDA_EMULATION
#error "emulator.h is for builds with -DFP8LINEAR_CUDA_EMULATION"
#endif

#undef __shared__
#define __shared__ static
#undef __launch_bounds__
#define __launch_bounds__(...)

// The built-in variables of the running thread (set by the scheduler at each switch).
inline thread_local uint3 threadIdx;
inline thread_local uint3 blockIdx;
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;

namespace fp8emu {

// The calling thread's lane and the emulation's collectives (emulator.cpp).
unsigned lane_id();
void sync_block(const char* file, int line);
void sync_warp(unsigned mask);
// A __shared__ variable's declaration was reached: the first time in a block, its bytes
// become 0xFF (a GPU's shared memory holds whatever was there).
void shared_declared(void* variable, size_t bytes);
// Room for one 64-bit value per lane of the calling thread's warp (shuffles).
uint64_t* warp_slots();
[[noreturn]] void fault(const char* what);
// The message of the last launch that failed on this thread ("" if none).
const char* last_failure();

// The operand types of the emulated mma.sync.
enum MmaType { kMmaE4M3, kMmaE5M2, kMmaF16, kMmaBF16 };
// D = A B for one m16n8k32 (8-bit types) or m16n8k16 (16-bit types) tile: a warp
// collective; `a` and `b` are the calling lane's fragment registers.
void mma(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], MmaType a_type, MmaType b_type);

// Runs body() as every thread of every block of the grid; returns once all are done.
// Launch errors (configuration, faults) are left for cudaGetLastError.
void run_grid(dim3 grid, dim3 block, size_t dynamic_shared_bytes, void (*body)(void*), void* context);

template <class Body>
void launch(dim3 grid, dim3 block, size_t dynamic_shared_bytes, cudaStream_t, Body&& body) {
  using B = std::remove_reference_t<Body>;
  run_grid(grid, block, dynamic_shared_bytes, [](void* context) { (*static_cast<B*>(context))(); },
           const_cast<void*>(static_cast<const void*>(&body)));
}
// <<<grid, block>>> and <<<grid, block, shared>>>
template <class Body>
void launch(dim3 grid, dim3 block, Body&& body) {
  launch(grid, block, 0, nullptr, std::forward<Body>(body));
}
template <class Body>
void launch(dim3 grid, dim3 block, size_t dynamic_shared_bytes, Body&& body) {
  launch(grid, block, dynamic_shared_bytes, nullptr, std::forward<Body>(body));
}

// cp.async.cg.shared.global with src-size 16 or 0: the copy is complete on return.
void copy_async16(void* shared, const void* global, bool inside);

}  // namespace fp8emu

// ---- device intrinsics on the host -------------------------------------------

// (a macro, so that threads waiting at different __syncthreads can be told apart)
#define __syncthreads() fp8emu::sync_block(__FILE__, __LINE__)
inline void __syncwarp(unsigned mask = 0xFFFFFFFFu) { fp8emu::sync_warp(mask); }
[[noreturn]] inline void __trap() { fp8emu::fault("__trap() (a kernel reached code that traps on this architecture)"); }

template <class T>
inline T __ldg(const T* pointer) { return *pointer; }
template <class T>
inline T __ldcs(const T* pointer) { return *pointer; }

inline float __uint_as_float(unsigned bits) {
  float value;
  memcpy(&value, &bits, sizeof value);
  return value;
}
inline unsigned __float_as_uint(float value) {
  unsigned bits;
  memcpy(&bits, &value, sizeof bits);
  return bits;
}
inline float __int_as_float(int bits) { return __uint_as_float(static_cast<unsigned>(bits)); }
inline int __float_as_int(float value) { return static_cast<int>(__float_as_uint(value)); }

inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned shift) {
  const uint64_t both = (static_cast<uint64_t>(hi) << 32) | lo;
  return static_cast<unsigned>(both >> (shift & 31u));
}
inline unsigned __funnelshift_l(unsigned lo, unsigned hi, unsigned shift) {
  const uint64_t both = (static_cast<uint64_t>(hi) << 32) | lo;
  return static_cast<unsigned>((both << (shift & 31u)) >> 32);
}

// Arithmetic with the rounding named (the host's IEEE float32, no contraction: the
// emulation is compiled with -ffp-contract=off).
inline float __fdiv_rn(float x, float y) { return x / y; }
inline float __fmul_rn(float x, float y) { return x * y; }
inline float __fadd_rn(float x, float y) { return x + y; }
inline float __frcp_rn(float x) { return 1.0f / x; }

// Atomics: the threads of the emulation never run at the same time.
inline unsigned atomicMax(unsigned* address, unsigned value) {
  const unsigned old = *address;
  if (value > old) *address = value;
  return old;
}
inline int atomicMax(int* address, int value) {
  const int old = *address;
  if (value > old) *address = value;
  return old;
}
inline unsigned atomicAdd(unsigned* address, unsigned value) {
  const unsigned old = *address;
  *address = old + value;
  return old;
}
inline float atomicAdd(float* address, float value) {
  const float old = *address;
  *address = old + value;
  return old;
}

// __shfl_xor_sync: each lane of `mask` gets the value of lane (lane ^ lane_mask); with a
// width below 32, a source in a later segment of `width` lanes gives the lane its own
// value (the CUDA guide); a source outside the mask is undefined: a fault here.
template <class T>
inline T __shfl_xor_sync(unsigned mask, T value, int lane_mask, int width = 32) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "shuffles move up to 64 bits");
  uint64_t* slots = fp8emu::warp_slots();
  const unsigned me = fp8emu::lane_id();
  uint64_t bits = 0;
  memcpy(&bits, &value, sizeof value);
  slots[me] = bits;
  fp8emu::sync_warp(mask);
  unsigned source = me ^ static_cast<unsigned>(lane_mask);
  if (width < 32 && source / static_cast<unsigned>(width) > me / static_cast<unsigned>(width)) source = me;
  if (source >= 32 || !((mask >> source) & 1u)) fp8emu::fault("__shfl_xor_sync reads a lane outside its mask");
  const uint64_t got = slots[source];
  fp8emu::sync_warp(mask);  // nobody overwrites a slot before every lane has read
  T result;
  memcpy(&result, &got, sizeof result);
  return result;
}

// cudaFuncGetAttributes(&attributes, kernel) as cuda_runtime.h's template allows it.
template <class T>
inline cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attributes, T* entry) {
  return cudaFuncGetAttributes(attributes, reinterpret_cast<const void*>(entry));
}
