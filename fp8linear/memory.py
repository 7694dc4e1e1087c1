"""memory_report: the weight memory of a model's linear layers, in bytes."""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from .linear import FP8Linear

__all__ = ["MemoryReport", "memory_report"]


def _bytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


@dataclasses.dataclass
class MemoryReport:
    """Bytes of the linear layers' weights (+ scales and biases).

    converted_bytes: what the FP8Linear layers hold now (fp8 weights, scales, biases).
    converted_bf16_bytes: what the same layers would hold in bf16 (weights and biases).
    other_linear_bytes: the nn.Linear layers left as they were (e.g. lm_head).
    """

    converted_layers: int = 0
    converted_bytes: int = 0
    converted_bf16_bytes: int = 0
    other_linear_layers: int = 0
    other_linear_bytes: int = 0

    @property
    def ratio(self) -> float:
        """converted_bytes / converted_bf16_bytes (about 0.5 for fp8 weights)."""
        return self.converted_bytes / self.converted_bf16_bytes if self.converted_bf16_bytes else float("nan")

    def __str__(self) -> str:
        mb = 1e6
        if not self.converted_layers:
            return (f"no FP8Linear layers; {self.other_linear_layers} nn.Linear layers: "
                    f"{self.other_linear_bytes / mb:.1f} MB")
        return (f"{self.converted_layers} FP8Linear layers: {self.converted_bytes / mb:.1f} MB "
                f"(bf16: {self.converted_bf16_bytes / mb:.1f} MB, ratio {self.ratio:.3f}); "
                f"{self.other_linear_layers} other nn.Linear layers: {self.other_linear_bytes / mb:.1f} MB")


def memory_report(model: nn.Module) -> MemoryReport:
    """Count the bytes of every FP8Linear and nn.Linear in ``model`` (shared ones once)."""
    report = MemoryReport()
    for module in model.modules():  # modules() yields a shared module once
        if isinstance(module, FP8Linear):
            report.converted_layers += 1
            report.converted_bytes += sum(_bytes(t) for t in (module.weight, module.weight_scale,
                                                              module.input_scale, module.bias))
            report.converted_bf16_bytes += 2 * (module.weight.numel() + (module.bias.numel() if module.bias is not None else 0))
        elif isinstance(module, nn.Linear):
            report.other_linear_layers += 1
            report.other_linear_bytes += _bytes(module.weight) + _bytes(module.bias)
    return report
