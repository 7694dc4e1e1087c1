"""fp8linear: run any PyTorch model's nn.Linear layers in FP8 with one call.

    import fp8linear
    fp8linear.quantize_model(model, "fp8")        # nn.Linear -> FP8Linear, in place
    fp8linear.memory_report(model)                 # weight bytes before/after

The ops (``quantize_fp8``, ``scaled_mm``) work on CPU and CUDA tensors; see
``fp8linear.backend(device)`` for the compute path a device gets.
"""
from .backend import FP8PathWarning, backend
from .convert import QUANTIZATIONS, ConversionReport, quantize_model
from .linear import FP8Config, FP8Linear
from .memory import MemoryReport, memory_report
from .ops import dequantize_fp8, quantize_fp8, scaled_mm

__version__ = "0.1.0"

__all__ = [
    "FP8Config",
    "FP8Linear",
    "FP8PathWarning",
    "ConversionReport",
    "MemoryReport",
    "QUANTIZATIONS",
    "backend",
    "dequantize_fp8",
    "memory_report",
    "quantize_fp8",
    "quantize_model",
    "scaled_mm",
]
