"""fp8linear: run any PyTorch model's nn.Linear layers in FP8 with one call."""
from .ops import dequantize_fp8, quantize_fp8, scaled_mm

__version__ = "0.1.0"
