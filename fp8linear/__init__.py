"""fp8linear: run any PyTorch model's nn.Linear layers in FP8 with one call.

    import fp8linear
    fp8linear.quantize_model(model, "fp8")        # nn.Linear -> FP8Linear, in place
    fp8linear.memory_report(model)                 # weight bytes before/after
    fp8linear.calibrate(model, batches)            # input scales of static layers
    fp8linear.save_quantized(model, "out")         # compressed-tensors FP8 checkpoint (vLLM, transformers)
    model = fp8linear.load_quantized("out")        # back, without full-precision weights

The ops (``quantize_fp8``, ``scaled_mm``) work on CPU and CUDA tensors; see
``fp8linear.backend(device)`` for the compute path a device gets.
"""
from .backend import FP8PathWarning, backend
from .calibration import CalibrationReport, calibrate
from .checkpoint import load_quantized, save_quantized
from .convert import QUANTIZATIONS, SCHEMES, ConversionReport, quantize_model
from .linear import FP8Config, FP8Linear
from .memory import MemoryReport, memory_report
from .ops import dequantize_fp8, quantize_fp8, scaled_mm
from .quantize_checkpoint import CheckpointConversion, quantize_checkpoint

__version__ = "0.1.0"

__all__ = [
    "CalibrationReport",
    "CheckpointConversion",
    "FP8Config",
    "FP8Linear",
    "FP8PathWarning",
    "ConversionReport",
    "MemoryReport",
    "QUANTIZATIONS",
    "SCHEMES",
    "backend",
    "calibrate",
    "dequantize_fp8",
    "load_quantized",
    "memory_report",
    "quantize_checkpoint",
    "quantize_fp8",
    "quantize_model",
    "save_quantized",
    "scaled_mm",
]
