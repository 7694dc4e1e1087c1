"""Pure-PyTorch references that mirror the kernels' arithmetic exactly.

Tests compare every kernel variant against these. They are written for clarity,
not speed, and never rely on torch's own overflow behaviour of ``.to(float8)``
(which changed between releases): values are clamped first.
"""
from __future__ import annotations

import torch

__all__ = ["dynamic_scale", "scale_from_amax", "quantize_fp8", "scaled_mm", "scaled_mm_float64"]


def _fmax(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def dynamic_scale(x: torch.Tensor, dtype: torch.dtype, granularity: str = "tensor") -> torch.Tensor:
    """``max(amax / FMAX, 1 / (FMAX * 512))`` over the finite |x|, computed in float64."""
    magnitude = x.float().abs()
    magnitude = torch.where(torch.isfinite(magnitude), magnitude, torch.zeros_like(magnitude))
    if granularity == "tensor":
        amax = magnitude.max() if magnitude.numel() else torch.zeros((), dtype=torch.float32, device=x.device)
    elif granularity == "row":
        if magnitude.shape[-1] == 0:
            amax = torch.zeros((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
        else:
            amax = magnitude.amax(dim=-1, keepdim=True)
    else:
        raise ValueError(f"granularity must be 'tensor' or 'row', got {granularity!r}")
    return scale_from_amax(amax, dtype)


def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The scale rule on its own: ``max(amax / FMAX, 1 / (FMAX * 512))`` in float64, as float32."""
    fmax = _fmax(dtype)
    return (amax.double() / fmax).clamp(min=1.0 / (fmax * 512.0)).float()


def quantize_fp8(
    x: torch.Tensor,
    scale: torch.Tensor | None = None,
    *,
    dtype: torch.dtype = torch.float8_e4m3fn,
    granularity: str = "tensor",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of ops.quantize_fp8: true division, clamp, one rounding."""
    if scale is None:
        scale = dynamic_scale(x, dtype, granularity)
    fmax = _fmax(dtype)
    q = (x.float() / scale).clamp(-fmax, fmax).to(dtype)
    return q, scale


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Reference of ops.scaled_mm in float32: exact products, float32 sums, one rounding."""
    out = (a.float() @ b.float()) * (scale_a.float() * scale_b.float())
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def scaled_mm_float64(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The exact result (float64) that the tolerances of docs/design.md are measured against."""
    out = (a.double() * scale_a.double()) @ (b.double() * scale_b.double())
    if bias is not None:
        out = out + bias.double()
    return out
