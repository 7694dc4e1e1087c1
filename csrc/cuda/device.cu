// Per-device properties (queried once) and the launchers' error messages.
#include <stdarg.h>
#include <stdio.h>

#include <mutex>

#include "cuda_kernels.h"
#include "launch.cuh"

namespace fp8cuda {
namespace {

thread_local char message_buffer[512];

}  // namespace

const char* error_message(const char* what, cudaError_t error) {
  snprintf(message_buffer, sizeof message_buffer, "fp8linear CUDA: %s: %s (%s)", what, cudaGetErrorString(error),
           cudaGetErrorName(error));
  return message_buffer;
}

const char* error_text(const char* format, ...) {
  va_list arguments;
  va_start(arguments, format);
  vsnprintf(message_buffer, sizeof message_buffer, format, arguments);
  va_end(arguments);
  return message_buffer;
}

}  // namespace fp8cuda

namespace {

// Compiled like every kernel of the build: its attributes say which code the device runs.
__global__ void arch_probe_kernel() {}

// The PTX target our kernels run as on `device` (0: no code for it; not an error here,
// the launches say so). Leaves no error pending. Callers hold a device guard for
// `device` (the ops and the bindings do), so the switch below is a fallback: switching
// back would create a context on the previous device.
int kernel_arch_of(int device) {
  int previous = 0;
  if (cudaGetDevice(&previous) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  cudaFuncAttributes attributes{};
  cudaError_t status = previous == device ? cudaSuccess : cudaSetDevice(device);
  if (status == cudaSuccess) status = cudaFuncGetAttributes(&attributes, arch_probe_kernel);
  if (previous != device) cudaSetDevice(previous);
  if (status != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return attributes.ptxVersion;
}

constexpr int kMaxDevices = 64;
fp8_cuda_device_info device_infos[kMaxDevices];
std::once_flag device_once[kMaxDevices];
cudaError_t device_errors[kMaxDevices];

}  // namespace

const char* fp8_cuda_pending_error(const char* op) {
  const cudaError_t error = cudaGetLastError();
  if (error == cudaSuccess) return nullptr;
  return fp8cuda::error_text(
      "fp8linear CUDA: %s: a CUDA error raised before this call was pending (left by an earlier operation, or a "
      "fault of an earlier kernel, fp8linear's included, that surfaced only now): %s (%s)",
      op, cudaGetErrorString(error), cudaGetErrorName(error));
}

const fp8_cuda_device_info* fp8_cuda_device(int device, const char** error) {
  if (device < 0 || device >= kMaxDevices) {
    *error = fp8cuda::error_text("fp8linear CUDA: device index %d is out of range", device);
    return nullptr;
  }
  std::call_once(device_once[device], [device] {
    fp8_cuda_device_info& info = device_infos[device];
    cudaError_t status = cudaDeviceGetAttribute(&info.major, cudaDevAttrComputeCapabilityMajor, device);
    if (status == cudaSuccess) status = cudaDeviceGetAttribute(&info.minor, cudaDevAttrComputeCapabilityMinor, device);
    if (status == cudaSuccess) {
      status = cudaDeviceGetAttribute(&info.multiprocessors, cudaDevAttrMultiProcessorCount, device);
    }
    if (status == cudaSuccess) {
      info.kernel_arch = kernel_arch_of(device);
    } else {
      cudaGetLastError();  // (an invalid index: reported below, not left pending for the next op)
    }
    device_errors[device] = status;
  });
  if (device_errors[device] != cudaSuccess) {
    *error = fp8cuda::error_message("querying the device's properties", device_errors[device]);
    return nullptr;
  }
  *error = nullptr;
  return &device_infos[device];
}
