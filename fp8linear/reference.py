"""Pure-PyTorch references that mirror the kernels' arithmetic exactly.

Tests compare every kernel variant against these. They are written for clarity,
not speed, and never rely on torch's own overflow behaviour of ``.to(float8)``
(which changed between releases): values are clamped first.
"""
from __future__ import annotations

import torch

__all__ = ["dynamic_scale", "scale_from_amax", "quantize_fp8", "scaled_mm", "scaled_mm_float64", "block_scales",
           "expand_block_scales"]

SCALE_BLOCK = 128


def _fmax(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def _blocks(x: torch.Tensor, granularity: str, group_size: int, block_size: tuple[int, int]) -> tuple[int, int]:
    """(block rows, block cols) of x seen as [rows, last dim]."""
    return (1, group_size) if granularity == "group" else tuple(block_size)


def block_scales(x: torch.Tensor, dtype: torch.dtype, block_rows: int, block_cols: int) -> torch.Tensor:
    """The dynamic scale of each block of x seen as [rows, cols] (partial edge blocks
    included; a block of zeros or non-finite values gets the floor), shape
    [ceil(rows / block_rows), ceil(cols / block_cols)]."""
    cols = x.shape[-1]
    rows = x.numel() // cols if cols else int(torch.Size(x.shape[:-1]).numel())
    x2 = x.reshape(rows, cols).float()
    row_blocks, col_blocks = -(-rows // block_rows), -(-cols // block_cols)
    magnitude = x2.abs()
    magnitude = torch.where(torch.isfinite(magnitude), magnitude, torch.zeros_like(magnitude))
    padded = torch.zeros(row_blocks * block_rows, col_blocks * block_cols, device=x.device)
    padded[:rows, :cols] = magnitude
    amax = padded.reshape(row_blocks, block_rows, col_blocks, block_cols).amax(dim=(1, 3))
    return scale_from_amax(amax, dtype)


def expand_block_scales(scale: torch.Tensor, rows: int, cols: int, block_rows: int, block_cols: int) -> torch.Tensor:
    """Block scales [row blocks, col blocks] repeated to one per element of [rows, cols]."""
    return scale.repeat_interleave(block_rows, 0).repeat_interleave(block_cols, 1)[:rows, :cols]


def dynamic_scale(x: torch.Tensor, dtype: torch.dtype, granularity: str = "tensor", *,
                  group_size: int = SCALE_BLOCK, block_size: tuple[int, int] = (SCALE_BLOCK, SCALE_BLOCK)) -> torch.Tensor:
    """``max(amax / FMAX, 1 / (FMAX * 512))`` over the finite |x|, computed in float64."""
    if granularity in ("group", "block"):
        block_rows, block_cols = _blocks(x, granularity, group_size, block_size)
        scale = block_scales(x, dtype, block_rows, block_cols)
        return scale.reshape(*x.shape[:-1], scale.shape[-1]) if granularity == "group" else scale
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


def power_of_two_ceil(scale: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= each (positive, normal) float32 scale: scale_fmt "ue8m0".
    By frexp, exactly (log2 of a float just above a power of two can round to an integer)."""
    mantissa, exponent = torch.frexp(scale.float())  # scale = mantissa * 2^exponent, mantissa in [0.5, 1)
    return torch.ldexp(torch.ones_like(mantissa), exponent - (mantissa == 0.5).to(exponent.dtype))


def quantize_fp8(
    x: torch.Tensor,
    scale: torch.Tensor | None = None,
    *,
    dtype: torch.dtype = torch.float8_e4m3fn,
    granularity: str = "tensor",
    group_size: int = SCALE_BLOCK,
    block_size: tuple[int, int] = (SCALE_BLOCK, SCALE_BLOCK),
    scale_fmt: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of ops.quantize_fp8: true division, clamp, one rounding."""
    if scale is None:
        scale = dynamic_scale(x, dtype, granularity, group_size=group_size, block_size=block_size)
        if scale_fmt == "ue8m0":
            scale = power_of_two_ceil(scale)
    fmax = _fmax(dtype)
    divisor = scale
    if granularity in ("group", "block"):
        block_rows, block_cols = _blocks(x, granularity, group_size, block_size)
        cols = x.shape[-1]
        rows = x.numel() // cols if cols else int(torch.Size(x.shape[:-1]).numel())
        scale_grid = scale.reshape(-(-rows // block_rows), -(-cols // block_cols))
        divisor = expand_block_scales(scale_grid, rows, cols, block_rows, block_cols).reshape(x.shape)
    q = (x.float() / divisor).clamp(-fmax, fmax).to(dtype)
    return q, scale


def _k_blocked(scale_a: torch.Tensor, scale_b: torch.Tensor, m: int, k: int, n: int) -> bool:
    k_blocks = -(-k // SCALE_BLOCK)
    a_blocked = scale_a.dim() == 2 and tuple(scale_a.shape) == (m, k_blocks) and k_blocks != 1
    b_blocked = (scale_b.dim() == 2 and scale_b.numel() != 1 and tuple(scale_b.shape) != (1, n)
                 and tuple(scale_b.shape) == (k_blocks, -(-n // SCALE_BLOCK)))
    return a_blocked or b_blocked


def _scale_along_k(scale_a: torch.Tensor, scale_b: torch.Tensor, m: int, k: int, n: int, kb: int) -> torch.Tensor:
    """[M, N] scale_a(m, kb) * scale_b(kb, n) of K block kb."""
    k_blocks = -(-k // SCALE_BLOCK)
    sa = scale_a.float()
    sa = sa[:, kb:kb + 1] if sa.dim() == 2 and sa.shape == (m, k_blocks) and k_blocks != 1 else sa.reshape(-1, 1)
    sb = scale_b.float()
    if sb.dim() == 2 and sb.numel() != 1 and tuple(sb.shape) != (1, n):
        sb = sb[kb].repeat_interleave(SCALE_BLOCK)[:n].reshape(1, n)
    else:
        sb = sb.reshape(1, -1)
    return sa * sb


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Reference of ops.scaled_mm in float32: exact products, float32 sums, one rounding;
    with block-wise scales, a float32 sum per block of 128 k, scaled, then summed."""
    m, k, n = a.shape[0], a.shape[1], b.shape[1]
    if _k_blocked(scale_a, scale_b, m, k, n):
        out = torch.zeros(m, n, dtype=torch.float32, device=a.device)
        for kb, k0 in enumerate(range(0, k, SCALE_BLOCK)):
            partial = a[:, k0:k0 + SCALE_BLOCK].float() @ b[k0:k0 + SCALE_BLOCK].float()
            out += _scale_along_k(scale_a, scale_b, m, k, n, kb) * partial
        if bias is not None:
            out = out + bias.float()
        return out.to(out_dtype)
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
    m, k, n = a.shape[0], a.shape[1], b.shape[1]
    if _k_blocked(scale_a, scale_b, m, k, n):
        out = torch.zeros(m, n, dtype=torch.float64, device=a.device)
        for kb, k0 in enumerate(range(0, k, SCALE_BLOCK)):
            partial = a[:, k0:k0 + SCALE_BLOCK].double() @ b[k0:k0 + SCALE_BLOCK].double()
            out += _scale_along_k(scale_a, scale_b, m, k, n, kb).double() * partial
        return out + bias.double() if bias is not None else out
    out = (a.double() * scale_a.double()) @ (b.double() * scale_b.double())
    if bias is not None:
        out = out + bias.double()
    return out
