"""The two ops, quantize_fp8 and scaled_mm (and linear, FP8Linear's forward composed of
them in C++, and FP8Linear's native fast path): the only caller of torch.ops.fp8linear.*.

Each wrapper documents its contract (docs/design.md, numerics); the fake (meta)
implementation beside each op mirrors the checks in csrc/bindings/checks.cpp so
that torch.compile sees the same shapes and errors.
"""
from __future__ import annotations

import torch

from ._native import available, native

__all__ = ["quantize_fp8", "dequantize_fp8", "scaled_mm", "FP8_DTYPES", "fp8_max"]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
GRANULARITIES = ("tensor", "row", "group", "block")
#: quantize_fp8's scale_fmt: None (any float32 scale) or "ue8m0" (dynamic scales rounded up to powers of two).
SCALE_FORMATS = (None, "ue8m0")
#: The block of scaled_mm's block-wise scales (DeepSeek-V3 / Qwen3 FP8 checkpoints): 128 x 128
#: weight blocks, activation groups of 128 along K.
SCALE_BLOCK = 128


def _check_types(op: str, tensors: dict, optional: dict, dtypes: dict) -> None:
    """TypeError naming the argument for a non-tensor operand or a non-dtype dtype: the
    dispatcher's own message for these names a schema, not the call."""
    for name, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(value).__name__}")
    for name, value in optional.items():
        if value is not None and not isinstance(value, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor or None, got {type(value).__name__}")
    for name, value in dtypes.items():
        if not isinstance(value, torch.dtype):
            raise TypeError(f"{op}: {name} must be a torch.dtype, got {type(value).__name__} {value!r}")


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an fp8 dtype (448 for e4m3fn, 57344 for e5m2)."""
    if dtype not in FP8_DTYPES:
        raise ValueError(f"dtype must be one of {FP8_DTYPES}, got {dtype}")
    return float(torch.finfo(dtype).max)


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
    """Quantize ``x`` (float32/bfloat16/float16, any shape and strides) to fp8.

    Returns ``(q, scale)`` with ``x ≈ q.float() * scale``. With ``scale=None`` the
    scale is dynamic: ``max(amax / FMAX, 1 / (FMAX * 512))`` over the finite
    elements of the whole tensor (``granularity="tensor"``, scale shape ``()``) or
    of each row over the last dimension (``"row"``, scale shape
    ``x.shape[:-1] + (1,)``), of each group of ``group_size`` consecutive elements of
    the last dimension (``"group"``, activations of block-wise layers: scale shape
    ``x.shape[:-1] + (ceil(K / group_size),)``), or of each ``block_size`` block of a 2-D
    ``x`` (``"block"``, weights: scale shape ``[ceil(N / 128), ceil(K / 128)]`` for the
    default 128 x 128); partial blocks at the edges have their own scale, and a block of
    zeros gets the floor. ``scale_fmt="ue8m0"`` (granularities "group" and "block") rounds
    each dynamic scale up to a power of two, ``2 ** ceil(log2(scale))`` of the float32 scale,
    as DeepSeek's inference code quantizes for checkpoints whose config says so: a power of
    two apart from block to block, block-wise products then run as fast as per-channel ones
    on the AMX kernels. A given ``scale`` (float32, that shape) is used as
    is; it must be finite and > 0 (checked for CPU tensors; a CUDA scale is not read,
    which would cost a device sync per call: there a 0, negative or non-finite scale
    gives saturated or NaN values). Each element is ``rne(clamp(x / scale, -FMAX, FMAX))``:
    one rounding, saturating, NaN kept.
    """
    if not isinstance(x, torch.Tensor) or (scale is not None and not isinstance(scale, torch.Tensor)) \
            or not isinstance(dtype, torch.dtype):
        _check_types("quantize_fp8", {"x": x}, {"scale": scale}, {"dtype": dtype})
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if scale_fmt not in SCALE_FORMATS:
        raise ValueError(f"scale_fmt must be one of {SCALE_FORMATS}, got {scale_fmt!r}")
    power_of_two = scale_fmt == "ue8m0"
    if power_of_two and granularity not in ("group", "block"):
        raise ValueError(f"scale_fmt 'ue8m0' applies to granularity 'group' and 'block', got {granularity!r}")
    native()
    if granularity == "group":
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be a positive int, got {group_size!r}")
        return torch.ops.fp8linear.quantize_fp8_blocks(x, scale, dtype, 1, group_size, power_of_two)
    if granularity == "block":
        if (not isinstance(block_size, (tuple, list)) or len(block_size) != 2
                or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in block_size)):
            raise ValueError(f"block_size must be two positive ints (rows, cols), got {block_size!r}")
        if block_size[0] == 1:
            raise ValueError("block_size (1, g) is a group: use granularity='group', group_size=g")
        return torch.ops.fp8linear.quantize_fp8_blocks(x, scale, dtype, block_size[0], block_size[1], power_of_two)
    return torch.ops.fp8linear.quantize_fp8(x, scale, dtype, granularity == "row")


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q.float() * scale`` in ``dtype``: the inverse of quantize_fp8 up to rounding."""
    if q.dtype not in FP8_DTYPES:
        raise ValueError(f"q must be one of {FP8_DTYPES}, got {q.dtype}")
    if scale.dtype != torch.float32:
        raise ValueError(f"scale must be torch.float32, got {scale.dtype}")
    return (q.to(torch.float32) * scale).to(dtype)


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``(a.float() * scale_a) @ (b.float() * scale_b) + bias`` rounded once to ``out_dtype``.

    a ``[M, K]`` and b ``[K, N]`` are fp8 with any strides (pass a Linear weight
    ``[N, K]`` as ``w.t()``); ``a`` may also be float32/bfloat16/float16 for
    weight-only use (fp8 weights widened inside the kernel, never copied); scale_a is ``()`` or ``[M, 1]``, scale_b ``()`` or
    ``[1, N]``, float32; bias ``[N]``. Any M, N, K, aligned or not: the semantics
    of ``torch._scaled_mm`` without its alignment and hardware limits.

    Block-wise scales (128 along K): scale_a ``[M, ceil(K / 128)]`` (per token and group
    of 128 k, from ``quantize_fp8(x, granularity="group")``) and/or scale_b
    ``[ceil(K / 128), ceil(N / 128)]`` (a weight's ``[ceil(N / 128), ceil(K / 128)]`` block
    scales transposed, as ``w_scale.t()``). Then each block of 128 k is summed in float32
    on its own and ``out[m, n] = sum_kb scale_a(m, kb) * scale_b(kb, n) * sum_kb[m, n]``. Scales must be
    finite and > 0 (checked for CPU tensors only, as in quantize_fp8).
    """
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and isinstance(scale_a, torch.Tensor)
            and isinstance(scale_b, torch.Tensor) and (bias is None or isinstance(bias, torch.Tensor))
            and isinstance(out_dtype, torch.dtype)):
        _check_types("scaled_mm", {"a": a, "b": b, "scale_a": scale_a, "scale_b": scale_b}, {"bias": bias},
                     {"out_dtype": out_dtype})
    native()
    return torch.ops.fp8linear.scaled_mm(a, b, scale_a, scale_b, bias, out_dtype)


#: fp8linear::linear's codes for how the input is quantized (FP8Config.activations) and
#: at which granularity when dynamic (FP8Config.activation_granularity; "group-ue8m0": per
#: group with power-of-two scales, FP8Config.scale_fmt "ue8m0").
LINEAR_ACTIVATIONS = {"none": 0, "static": 1, "dynamic": 2}
LINEAR_GRANULARITIES = {"tensor": 0, "token": 1, "group": 2, "group-ue8m0": 3}
_linear_op = None


def linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
           activation_scale: torch.Tensor | None, activations: int, granularity: int) -> torch.Tensor:
    """FP8Linear's forward in one op call (its full path uses it up to 16 rows): ``x`` ``[..., K]``
    quantized as ``activations`` / ``granularity`` say (LINEAR_ACTIVATIONS,
    LINEAR_GRANULARITIES; ``activation_scale`` the static input scale, or the unit scale of
    weight-only layers) and multiplied by ``weight`` ``[N, K]`` with its ``weight_scale``:
    ``[..., N]`` in x's dtype, bit for bit what quantize_fp8 and scaled_mm give. No checks
    here: FP8Linear's state is checked where it is set, and the ops check the rest."""
    global _linear_op
    if _linear_op is None:
        native()
        _linear_op = torch.ops.fp8linear.linear.default  # one overload: skips the packet's resolution per call
    return _linear_op(x, weight, weight_scale, bias, activation_scale, activations, granularity)


def linear_if_plain(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                    activation_scale: torch.Tensor | None, activations: int, granularity: int,
                    max_rows: int) -> torch.Tensor | None:
    """FP8Linear's fast path: :func:`linear` called from C++ through the dispatcher (~2 us
    less than the boxed torch.ops call, and below autograd's dispatch keys, whose boxed
    fallback the ops would take otherwise) for an input of at most ``max_rows`` rows that is a
    plain float32/bfloat16/float16 CPU or CUDA tensor of the weight's in_features, with no
    autograd to record and no autocast, torch function or dispatch mode on (the full list
    of cases is linear_if_plain's in csrc/bindings/ops.cpp); None otherwise (the caller
    takes its full path). Outside torch.compile only."""
    return native().linear_if_plain(x, weight, weight_scale, bias, activation_scale, activations, granularity, max_rows)


def dynamic_linear_if_plain(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                            bias: torch.Tensor | None, granularity: int,
                            quantized: tuple[torch.Tensor, torch.Tensor] | None, max_rows: int
                            ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] | None:
    """:func:`linear_if_plain` for a layer with dynamic activations, reusing ``quantized``,
    the ``(q, scale)`` an earlier layer made of this same ``x`` with this granularity and
    the weight's fp8 dtype, or quantizing ``x`` if it is None. Returns
    ``(out, (q, scale))``, the quantization used, for the next layer fed ``x``; or None
    where linear_if_plain would. The caller vouches for ``quantized`` (FP8Linear's
    _LastQuantizedInput)."""
    q, scale = quantized if quantized is not None else (None, None)
    result = native().dynamic_linear_if_plain(x, weight, weight_scale, bias, granularity, q, scale, max_rows)
    return None if result is None else (result[0], (result[1], result[2]))


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _check_device(tensor: torch.Tensor, name: str, expected: torch.device, owner: str) -> None:
    # RuntimeError, as the bindings' TORCH_CHECK and nn.Linear raise for mixed devices.
    # Without this the Meta kernel (this fake) would answer a call that mixes a meta
    # tensor with CPU ones with an uninitialized CPU tensor.
    if tensor.device != expected:
        raise RuntimeError(f"{name} must be on {owner}'s device {expected}, got {tensor.device}")


def _register_fakes() -> None:
    @torch.library.register_fake("fp8linear::quantize_fp8")
    def _quantize_fp8_fake(x, scale, dtype, per_row):
        _check(x.dtype in FLOAT_DTYPES, f"x must be torch.float32, torch.bfloat16 or torch.float16, got {x.dtype}")
        _check(dtype in FP8_DTYPES, f"dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
        if per_row:
            _check(x.dim() >= 1, "granularity 'row' needs x with at least 1 dimension, got a 0-d tensor")
            scale_shape = (*x.shape[:-1], 1)
        else:
            scale_shape = ()
        if scale is not None:
            _check(scale.dtype == torch.float32, f"scale must be torch.float32, got {scale.dtype}")
            _check_device(scale, "scale", x.device, "x")
            if per_row:
                _check(tuple(scale.shape) == scale_shape, f"scale for granularity 'row' must have shape {scale_shape}")
            else:
                _check(scale.numel() == 1 and scale.dim() <= 2, "scale for granularity 'tensor' must have one element")
        q = x.new_empty(x.shape, dtype=dtype)
        out_scale = scale.clone() if scale is not None else x.new_empty(scale_shape, dtype=torch.float32)
        return q, out_scale

    @torch.library.register_fake("fp8linear::quantize_fp8_blocks")
    def _quantize_fp8_blocks_fake(x, scale, dtype, block_rows, block_cols, power_of_two=False):
        _check(x.dtype in FLOAT_DTYPES, f"x must be torch.float32, torch.bfloat16 or torch.float16, got {x.dtype}")
        _check(dtype in FP8_DTYPES, f"dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
        _check(block_rows >= 1 and block_cols >= 1, f"block sizes must be >= 1, got {block_rows} x {block_cols}")
        if block_rows == 1:
            _check(x.dim() >= 1, "granularity 'group' needs x with at least 1 dimension, got a 0-d tensor")
            scale_shape = (*x.shape[:-1], -(-x.shape[-1] // block_cols))
        else:
            _check(x.dim() == 2, f"granularity 'block' needs a 2-D x [rows, cols], got {x.dim()}-D")
            scale_shape = (-(-x.shape[0] // block_rows), -(-x.shape[1] // block_cols))
        if scale is not None:
            _check(scale.dtype == torch.float32, f"scale must be torch.float32, got {scale.dtype}")
            _check_device(scale, "scale", x.device, "x")
            _check(tuple(scale.shape) == scale_shape,
                   f"scale for blocks of {block_rows} x {block_cols} must have shape {list(scale_shape)}")
        q = x.new_empty(x.shape, dtype=dtype)
        out_scale = scale.clone() if scale is not None else x.new_empty(scale_shape, dtype=torch.float32)
        return q, out_scale

    @torch.library.register_fake("fp8linear::scaled_mm")
    def _scaled_mm_fake(a, b, scale_a, scale_b, bias, out_dtype):
        _check(a.dim() == 2, f"a must be 2-D [M, K], got {a.dim()}-D")
        _check(b.dim() == 2, f"b must be 2-D [K, N], got {b.dim()}-D")
        _check(a.dtype in FP8_DTYPES + FLOAT_DTYPES, f"a must be torch.float8_e4m3fn or torch.float8_e5m2 (or a float dtype for weight-only), got {a.dtype}")
        _check(b.dtype in FP8_DTYPES, f"b must be torch.float8_e4m3fn or torch.float8_e5m2, got {b.dtype}")
        _check(out_dtype in FLOAT_DTYPES, f"out_dtype must be torch.float32, torch.bfloat16 or torch.float16, got {out_dtype}")
        _check(a.shape[1] == b.shape[0], f"a [M, K] and b [K, N] must share K: {tuple(a.shape)}, {tuple(b.shape)}")
        m, n = a.shape[0], b.shape[1]
        for tensor, name in ((b, "b"), (scale_a, "scale_a"), (scale_b, "scale_b")):
            _check_device(tensor, name, a.device, "a")
        _check(scale_a.dtype == torch.float32 and scale_b.dtype == torch.float32, "scale_a and scale_b must be torch.float32")
        k_blocks, n_blocks = -(-a.shape[1] // SCALE_BLOCK), -(-n // SCALE_BLOCK)
        _check((scale_a.numel() == 1 and scale_a.dim() <= 2) or tuple(scale_a.shape) in ((m, 1), (m, k_blocks)),
               f"scale_a must have shape () (per tensor), [M, 1] = [{m}, 1] (per row) or "
               f"[M, ceil(K / 128)] = [{m}, {k_blocks}] (per row and block of 128 k)")
        _check((scale_b.numel() == 1 and scale_b.dim() <= 2) or tuple(scale_b.shape) in ((1, n), (k_blocks, n_blocks)),
               f"scale_b must have shape () (per tensor), [1, N] = [1, {n}] (per column) or "
               f"[ceil(K / 128), ceil(N / 128)] = [{k_blocks}, {n_blocks}] (per 128 x 128 block)")
        if bias is not None:
            _check(bias.dim() == 1 and bias.shape[0] == n, f"bias must have shape [N] = [{n}]")
            _check_device(bias, "bias", a.device, "a")
        return a.new_empty((m, n), dtype=out_dtype)


if available():
    _register_fakes()
