"""Which compute path a device gets, and the one-time warning on non-native paths."""
from __future__ import annotations

import os
import sys
import threading
import warnings

import torch

from ._native import native

__all__ = ["backend", "FP8PathWarning", "CPU", "CUDA_FP8", "CUDA_UPCONVERT"]

CPU = "cpu"
CUDA_FP8 = "cuda-fp8"
CUDA_UPCONVERT = "cuda-upconvert"

_EXPLANATIONS = {
    CPU: "CPUs have no FP8 arithmetic: the C kernels widen fp8 in registers (exactly, to bf16 "
    "or float32) and accumulate in float32; weights stay 8-bit in memory",
    CUDA_UPCONVERT: "this GPU is below compute capability 8.9 (no FP8 tensor cores), or this build "
    "has no 8.9+ code for it (TORCH_CUDA_ARCH_LIST): fp8 weights are widened inside fp8linear's "
    "kernels; weights stay 8-bit in memory",
}


class FP8PathWarning(UserWarning):
    """FP8Linear runs on a path without native FP8 arithmetic (said once per path)."""


def backend(device: torch.device | str | None = None) -> str:
    """The compute path FP8Linear takes on ``device`` (default: the CPU).

    ``"cuda-fp8"``: FP8 tensor cores (compute capability >= 8.9, and a build with code
    for it: ``TORCH_CUDA_ARCH_LIST``);
    ``"cuda-upconvert"``: an older GPU (or a build without 8.9+ code), fp8 weights
    widened inside the kernels;
    ``"cpu"``: the C kernels (AMX / AVX512-BF16 / AVX-512 / AVX2 / scalar, by the CPU).
    """
    device = torch.device("cpu" if device is None else device)
    if device.type == "cpu":
        return CPU
    if device.type == "cuda":
        if not native().cuda_built():
            raise RuntimeError(
                "fp8linear was built without CUDA kernels (torch without CUDA, or nvcc not "
                "found at build time); rebuild with a CUDA torch and nvcc on PATH"
            )
        index = device.index if device.index is not None else torch.cuda.current_device()
        # the kernels' view of the device: an sm_80-only build runs as sm_80 on any GPU
        path = native().cuda_device_path(index)
        if path == "none":
            major, minor = torch.cuda.get_device_capability(index)
            raise RuntimeError(
                f"fp8linear's CUDA kernels have no code for cuda:{index} (compute capability {major}.{minor}): "
                f"the build's TORCH_CUDA_ARCH_LIST had neither {major}.{minor} nor PTX of an older architecture; "
                f'add "{major}.{minor}" to it and rebuild (pip install --no-build-isolation .)'
            )
        return CUDA_FP8 if path == "fp8" else CUDA_UPCONVERT
    raise ValueError(f"fp8linear supports cpu and cuda devices, got {device}")


_warned: set[str] = set()
_warned_lock = threading.Lock()


def cpu_kernel_variant() -> str:
    """The CPU kernel variant in use (e.g. 'avx512_bf16')."""
    return native().cpu_variant()


# Frames in these directories are skipped when the warning picks the line it names: the
# call of the model or layer in the user's code, not torch's Module.__call__ or ours.
_INTERNAL_DIRS = tuple(os.path.dirname(os.path.abspath(path)) + os.sep for path in (torch.__file__, __file__))


def _user_stacklevel() -> int:
    """warnings.warn's stacklevel of the first caller outside torch and fp8linear."""
    frame, level = sys._getframe(1), 1  # level 1: the function calling warnings.warn
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL_DIRS):
        frame, level = frame.f_back, level + 1
    return level


# Devices whose path warn_once_if_not_native has settled (warned about, or native): FP8Linear's
# forward takes its fast path only for inputs on these, so every path still warns once.
_settled: set[torch.device] = set()


def warn_once_if_not_native(device: torch.device) -> None:
    """Warn the first time a non-native path runs, naming it and why."""
    if torch.compiler.is_compiling():  # traced code has already warned in eager mode, or will not need to
        return
    if device.type == "meta":  # shapes only: no kernel runs
        return
    if not (device.type == "cpu" and CPU in _warned):  # the common case, once per forward: no device parsing
        path = backend(device)
        if path != CUDA_FP8 and path not in _warned:
            with _warned_lock:
                first = path not in _warned
                _warned.add(path)
            if first:
                detail = f" ({cpu_kernel_variant()} kernels)" if path == CPU else ""
                warnings.warn(f"fp8linear: using the '{path}' path{detail}: {_EXPLANATIONS[path]}.", FP8PathWarning,
                              stacklevel=_user_stacklevel())
    _settled.add(device)
