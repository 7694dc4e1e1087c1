"""FP8Linear: a drop-in replacement for nn.Linear with fp8 weights (W8A8 or weight-only)."""
from __future__ import annotations

import dataclasses
import importlib
import math
import sys
import threading
import weakref

import torch
from torch import nn

from . import ops
from .backend import warn_once_if_not_native

__all__ = ["FP8Config", "FP8Linear"]

WEIGHT_GRANULARITIES = ("tensor", "channel", "block")
ACTIVATION_MODES = ("dynamic", "static", "none")
ACTIVATION_GRANULARITIES = ("tensor", "token", "group")
BLOCK = ops.SCALE_BLOCK  # 128: weight blocks of 128 x 128, activation groups of 128


def weight_scale_shape(granularity: str, out_features: int, in_features: int) -> tuple[int, ...]:
    """The shape of weight_scale: () per tensor, [N, 1] per channel, [ceil(N/128), ceil(K/128)] per block."""
    if granularity == "channel":
        return (out_features, 1)
    if granularity == "block":
        return (-(-out_features // BLOCK), -(-in_features // BLOCK))
    return ()


@dataclasses.dataclass(frozen=True)
class FP8Config:
    """How an FP8Linear quantizes.

    weight_granularity: one weight scale per tensor (``"tensor"``), per output
        channel (``"channel"``, shape ``[N, 1]``), or per block of 128 x 128
        (``"block"``, shape ``[ceil(N / 128), ceil(K / 128)]``: DeepSeek-V3 / Qwen3 FP8).
    activations: ``"dynamic"`` (scale from each call's input), ``"static"`` (a
        calibrated ``input_scale``), or ``"none"`` (weight-only: inputs stay in
        their precision, fp8 weights are widened inside the kernels).
    activation_granularity: dynamic scale per tensor, per token (row), or per token
        and group of 128 input features (``"group"``, as block-wise checkpoints expect).
    fp8_dtype: the fp8 format of weights and activations.
    scale_fmt: ``"ue8m0"`` (block weights only): the dynamic group scales of the
        activations, and the block scales of weights this config quantizes, are rounded up
        to powers of two, as DeepSeek's inference code does for checkpoints whose config
        says ``"scale_fmt": "ue8m0"`` (DeepSeek-V3.1 and later). With power-of-two scales on
        both sides the AMX and AVX512-BF16 kernels fold the scales into the operands and
        run block-wise layers about as fast as per-channel ones; the activations keep up to one bit less
        precision. None (default): scales are any float32.
    """

    weight_granularity: str = "tensor"
    activations: str = "dynamic"
    activation_granularity: str = "tensor"
    fp8_dtype: torch.dtype = torch.float8_e4m3fn
    scale_fmt: str | None = None

    def __post_init__(self):
        def check(name, value, allowed):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")

        check("weight_granularity", self.weight_granularity, WEIGHT_GRANULARITIES)
        check("activations", self.activations, ACTIVATION_MODES)
        check("activation_granularity", self.activation_granularity, ACTIVATION_GRANULARITIES)
        check("fp8_dtype", self.fp8_dtype, ops.FP8_DTYPES)
        if self.activations == "static" and self.activation_granularity != "tensor":
            raise ValueError("static activations use one calibrated scale per tensor: "
                             "activation_granularity must be 'tensor'")
        check("scale_fmt", self.scale_fmt, ops.SCALE_FORMATS)
        if self.scale_fmt is not None and self.weight_granularity != "block":
            raise ValueError(f"scale_fmt {self.scale_fmt!r} is for block-wise weights (weight_granularity 'block'), "
                             f"got weight_granularity {self.weight_granularity!r}")

    def describe(self) -> str:
        dtype = str(self.fp8_dtype).replace("torch.float8_", "")
        weight_unit = "block 128x128" if self.weight_granularity == "block" else self.weight_granularity
        weights = f"weights {dtype} per-{weight_unit}"
        if self.scale_fmt is not None:
            weights += f" ({self.scale_fmt} scales)"
        if self.activations == "none":
            return weights + ", activations not quantized (weight-only)"
        unit = "group of 128" if self.activation_granularity == "group" else self.activation_granularity
        granularity = "per-tensor" if self.activations == "static" else f"per-{unit}"
        return weights + f", activations {self.activations} {granularity}"


def _resolve_config(config: FP8Config | None, options: dict) -> FP8Config:
    if config is not None and options:
        raise ValueError("pass either config= or FP8Config fields as keywords, not both")
    return config if config is not None else FP8Config(**options)


_KERNEL_DTYPES = frozenset(ops.FLOAT_DTYPES)  # activation dtypes the kernels take; float64 is computed in float32
_ACTIVATION_OP_GRANULARITY = {"tensor": "tensor", "token": "row", "group": "group"}
_WEIGHT_OP_GRANULARITY = {"tensor": "tensor", "channel": "row", "block": "block"}
_AUTOCAST_DEVICES = frozenset(("cpu", "cuda"))  # torch.is_autocast_enabled refuses "meta"
# A forward without autograd, outside torch.compile, is one native call (the fast path,
# forward): the quantization and the product composed in C++, the checks in C++. At decode
# the Python around two op calls cost more than the kernels of a small layer (SmolLM2 on
# an AMD EPYC Zen 3, a 64 x 64 layer at M = 1: ~40 us a call, ~16 of them the two calls);
# at prompt sizes it cost 12-40 us a call as well (Intel Xeon with AMX, 576 x 576 at M = 64
# and 512), 5% of SmolLM2's prefill. Above _FUSED_MAX_ROWS rows (tokens), CPU inputs with
# dynamic activations are quantized once for the layers fed the same tensor (q, k and v;
# gate and up: _LastQuantizedInput); at or below it, a quantization in C costs less than
# the reuse's bookkeeping in Python. _FAST_MAX_ROWS caps the fast path (tests set it to -1
# to compare it with the full path).
_FUSED_MAX_ROWS = 16
_FAST_MAX_ROWS = sys.maxsize
_LINEAR_ACTIVATIONS = ops.LINEAR_ACTIVATIONS
_LINEAR_GRANULARITIES = ops.LINEAR_GRANULARITIES
# FP8Linear's fast path (forward) reads fp8linear.backend's settled devices (the module by
# import: fp8linear.backend, the package's attribute, is the function of that name).
_backend = importlib.import_module(".backend", __package__)
_is_compiling = torch.compiler.is_compiling
_FROZEN_WEIGHT = ("FP8Linear's weight is fp8 and frozen: gradients for it are not supported (set "
                  "weight.requires_grad = False). Train adapters such as LoRA on top of the layer, which "
                  "get input gradients, or keep the layer an nn.Linear to train it.")


class _LastQuantizedInput(threading.local):
    """Per thread: the last dynamically quantized CPU input of an FP8Linear, so that the
    layers a model feeds the same tensor (q, k and v; gate and up) quantize it once.

    ``entry`` is ``(weak reference to the input, (its version, data pointer, shape), (fp8
    dtype, granularity), (q, scale))``. A hit needs the same tensor object, unmodified
    since (torch's version counter, which every in-place torch operation bumps, through
    any view; the data pointer and shape, which ``x.data = ...`` changes without it), and
    the same quantization. Writes that bypass the version counter (through ``x.data`` or
    ``x.numpy()``) are not seen. The weak reference drops the entry when the input is freed, so the
    quantized copy lives no longer than the input, and a new tensor at the same address
    never matches. Inference-mode tensors have no version counter: they are never reused.
    """

    entry = None
    forget = None  # this thread's weak-reference callback, made once (_quantize_dynamic)


_LAST_QUANTIZED = _LastQuantizedInput()


def _forget_callback(state: dict):
    """The weak-reference callback that clears `state`'s entry (one thread's: the callback
    may run on whichever thread frees the input) if it is still that reference's."""

    def forget(reference):
        current = state.get("entry")
        if current is not None and current[0] is reference:
            state["entry"] = None

    return forget


def _kept_quantization(source: torch.Tensor, key: tuple):
    """(state, the kept (q, scale) of ``source`` under ``key``, or None): the reuse
    described in _LastQuantizedInput, for a CPU tensor outside inference mode. ``state``
    (version, data pointer, shape) is what _keep_quantization records with it."""
    entry = _LAST_QUANTIZED.entry
    state = (source._version, source.data_ptr(), source.shape)
    if entry is not None and entry[0]() is source and entry[1] == state and entry[2] == key:
        return state, entry[3]
    return state, None


def _keep_quantization(source: torch.Tensor, state: tuple, key: tuple, quantized) -> None:
    holder = _LAST_QUANTIZED
    forget = holder.forget
    if forget is None:
        forget = holder.forget = _forget_callback(holder.__dict__)
    holder.entry = (weakref.ref(source, forget), state, key, quantized)


def _activation_scale_fmt(config: FP8Config) -> str | None:
    """The scale_fmt of the activations' dynamic quantization: the config's for groups."""
    return config.scale_fmt if config.activation_granularity == "group" else None


def _linear_granularity(config: FP8Config) -> str:
    """The LINEAR_GRANULARITIES key of a config's dynamic activations (also the granularity
    in _LastQuantizedInput's keys: "group-ue8m0" is not "group")."""
    scale_fmt = _activation_scale_fmt(config)
    return config.activation_granularity + (f"-{scale_fmt}" if scale_fmt else "")


def _quantize_dynamic(x2d: torch.Tensor, source: torch.Tensor | None, config: FP8Config):
    """ops.quantize_fp8 of x2d with dynamic scales; ``source`` (the layer's input, of
    which x2d is the 2-D view) allows the reuse described in _LastQuantizedInput."""
    granularity = _ACTIVATION_OP_GRANULARITY[config.activation_granularity]
    scale_fmt = _activation_scale_fmt(config)
    key = (config.fp8_dtype, _linear_granularity(config))
    reusable = (source is not None and not torch.compiler.is_compiling() and source.is_cpu
                and not source.is_inference())
    if not reusable:
        return ops.quantize_fp8(x2d, dtype=config.fp8_dtype, granularity=granularity, scale_fmt=scale_fmt)
    state, quantized = _kept_quantization(source, key)
    if quantized is None:
        quantized = ops.quantize_fp8(x2d, dtype=config.fp8_dtype, granularity=granularity, scale_fmt=scale_fmt)
        _keep_quantization(source, state, key, quantized)
    return quantized


def _fast_dynamic_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         bias: torch.Tensor | None, granularity: int, reuse_granularity: str) -> torch.Tensor | None:
    """The fast path of a layer with dynamic activations on a CPU input of more than
    _FUSED_MAX_ROWS rows: ops.dynamic_linear_if_plain with the reuse of _LastQuantizedInput
    (the same entries as the full path's _quantize_dynamic); None where the full path runs.
    The native call quantizes to the weight's fp8 dtype, hence the key's (the config's,
    which the config setter keeps equal to it)."""
    key = (weight.dtype, reuse_granularity)
    if x.is_inference():  # no version counter: never reused
        state, quantized = None, None
    else:
        state, quantized = _kept_quantization(x, key)
    result = ops.dynamic_linear_if_plain(x, weight, weight_scale, bias, granularity, quantized, _FAST_MAX_ROWS)
    if result is None:
        return None
    out, used = result
    if state is not None and quantized is None:
        _keep_quantization(x, state, key, used)
    return out


def _product(x2d: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
             activation_scale: torch.Tensor | None, config: FP8Config, out_dtype: torch.dtype,
             source: torch.Tensor | None = None) -> torch.Tensor:
    """The layer's output for a 2-D input: quantize the activations as config says (with
    ``activation_scale``: the static input_scale, or the unit scale of weight-only layers),
    then one scaled_mm. ``source``: the layer's input tensor, whose dynamic quantization may
    be reused (_LastQuantizedInput)."""
    if config.activations == "none":
        a, scale_a = x2d, activation_scale
    elif config.activations == "static":
        a, scale_a = ops.quantize_fp8(x2d, activation_scale, dtype=config.fp8_dtype)
    else:
        a, scale_a = _quantize_dynamic(x2d, source, config)
    # per-channel weight scales [N, 1] are the per-column scales [1, N] of w.t(), block
    # scales [N/128, K/128] the [K/128, N/128] of w.t(): both are weight_scale.t()
    scale_b = weight_scale.t() if weight_scale.dim() else weight_scale
    return ops.scaled_mm(a, weight.t(), scale_a, scale_b, bias=bias, out_dtype=out_dtype)


def _input_gradient(grad_out: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    blocked: bool) -> torch.Tensor:
    """``grad_out @ (weight * weight_scale)`` in float32, the dequantized weight made a block
    of rows at a time (16 MB of float32): never a full-precision copy of the weight."""
    grad_out = grad_out.float()
    out_features, in_features = weight.shape
    rows = max(1, (1 << 22) // max(1, in_features))
    if blocked:  # whole blocks of 128 rows, so that each chunk's scales are whole rows of the grid
        rows = max(BLOCK, rows // BLOCK * BLOCK)
    grad = grad_out.new_zeros(grad_out.shape[0], in_features)
    for start in range(0, out_features, rows):
        block = weight[start:start + rows].float()  # exact: every fp8 value is a float32
        if blocked:
            grid = weight_scale[start // BLOCK:(start + rows) // BLOCK + 1]
            scale = grid.repeat_interleave(BLOCK, 0)[:block.shape[0]].repeat_interleave(BLOCK, 1)[:, :in_features]
        else:
            scale = weight_scale[start:start + rows] if weight_scale.dim() else weight_scale
        grad.addmm_(grad_out[:, start:start + rows], block * scale)
    return grad


class _FP8LinearFunction(torch.autograd.Function):
    """The layer's product with a backward for the input (and a trainable bias).

    The input gradient is that of the dequantized layer, ``grad_out @ (W_fp8 * scale)``;
    the activation quantization is passed through as the identity (the straight-through
    estimator that quantization-aware and adapter training use): for weight-only layers
    this is the exact gradient of the forward, for W8A8 that of its unrounded version.
    """

    @staticmethod
    def forward(ctx, x2d, weight, weight_scale, bias, activation_scale, config, out_dtype):
        ctx.save_for_backward(weight, weight_scale)
        ctx.blocked = config.weight_granularity == "block"
        ctx.input_dtype = x2d.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return _product(x2d, weight, weight_scale, bias, activation_scale, config, out_dtype)

    @staticmethod
    def backward(ctx, grad_out):
        weight, weight_scale = ctx.saved_tensors
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = _input_gradient(grad_out, weight, weight_scale, ctx.blocked).to(ctx.input_dtype)
        if ctx.needs_input_grad[3]:
            grad_bias = grad_out.float().sum(0).to(ctx.bias_dtype)
        return grad_x, None, None, grad_bias, None, None, None


def _check_scale_value(name: str, scale: torch.Tensor) -> None:
    """A stored scale must be finite and > 0; checked when it is set, never per call."""
    if scale.dtype != torch.float32:
        raise ValueError(f"{name} must be torch.float32, got {scale.dtype}")
    if scale.numel() and not bool(torch.all(torch.isfinite(scale) & (scale > 0))):
        raise ValueError(f"{name} must be finite and > 0, got {scale.flatten()[:8].tolist()}")


class FP8Linear(nn.Module):
    """``y = x @ W.T + b`` with W stored as fp8 ``[out_features, in_features]``.

    Constructed like ``nn.Linear`` plus the fields of :class:`FP8Config`; usually
    made from an existing layer with :meth:`from_linear`. The output has the
    input's dtype (float32, bfloat16 or float16); the bias keeps its precision.

    State: ``weight`` (fp8 ``[N, K]``), ``weight_scale`` (float32 ``()``, ``[N, 1]``
    or ``[ceil(N / 128), ceil(K / 128)]``), ``bias`` (optional) and, for static activations,
    ``input_scale`` (float32 ``()``, set by calibration or loading).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None,
                 dtype: torch.dtype | None = None, *, config: FP8Config | None = None, **options):
        super().__init__()
        self.config = _resolve_config(config, options)
        self.in_features = in_features
        self.out_features = out_features
        factory = {"device": device}
        self.weight = nn.Parameter(torch.zeros(out_features, in_features, dtype=self.config.fp8_dtype, **factory),
                                   requires_grad=False)
        scale_shape = weight_scale_shape(self.config.weight_granularity, out_features, in_features)
        self.register_buffer("weight_scale", torch.ones(scale_shape, dtype=torch.float32, **factory))
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype or torch.float32, **factory),
                                     requires_grad=False)
        else:
            self.register_parameter("bias", None)
        if self.config.activations == "static":
            # NaN until calibrated or loaded; the flag spares forward a device sync to check it.
            self.register_buffer("input_scale", torch.full((), math.nan, dtype=torch.float32, **factory))
        else:
            self.input_scale = None
        # weight-only layers multiply by this instead of an activation scale; a buffer
        # follows the layer across devices, so forward allocates nothing for it
        self.register_buffer("unit_scale", torch.ones((), dtype=torch.float32, **factory), persistent=False)
        self.register_load_state_dict_pre_hook(FP8Linear._check_loaded_state)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, config: FP8Config | None = None, **options) -> "FP8Linear":
        """An FP8Linear holding ``linear``'s weight quantized once (``linear`` is not modified)."""
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"from_linear needs an nn.Linear, got {type(linear).__name__}")
        weight = linear.weight.detach()
        if weight.dtype not in _KERNEL_DTYPES:
            hint = ": convert the layer first, e.g. linear.float()" if weight.is_floating_point() else ""
            raise ValueError(f"linear.weight must be float32, bfloat16 or float16, got {weight.dtype}{hint}")
        if weight.device.type == "meta":
            raise ValueError("linear.weight is on the meta device (not materialized): load the weights first")
        config = _resolve_config(config, options)
        q, scale = ops.quantize_fp8(weight, dtype=config.fp8_dtype, granularity=_WEIGHT_OP_GRANULARITY[config.weight_granularity],
                                    scale_fmt=config.scale_fmt)
        bias = linear.bias.detach().clone() if linear.bias is not None else None
        return cls.from_fp8(q, scale, bias=bias, config=config)

    @classmethod
    def from_fp8(cls, weight: torch.Tensor, weight_scale: torch.Tensor, *, bias: torch.Tensor | None = None,
                 input_scale: torch.Tensor | None = None, config: FP8Config | None = None,
                 **options) -> "FP8Linear":
        """An FP8Linear holding already-quantized tensors as they are, without copying them.

        This is how checkpoints are loaded: building the layer from a full-precision
        weight and quantizing it again would need the memory of a bf16 model and
        would not reproduce the stored fp8 bytes. ``weight`` is fp8 ``[N, K]`` of
        ``config.fp8_dtype``; ``weight_scale`` float32 ``()`` (per-tensor),
        ``[N, 1]`` (per-channel) or ``[ceil(N / 128), ceil(K / 128)]`` (per-block); ``bias`` ``[N]``; ``input_scale`` float32 ``()`` for
        static activations (without it the layer waits for calibration, as from_linear's
        does), refused otherwise. All on one device.
        """
        layer_config = _resolve_config(config, options)
        if weight.dtype != layer_config.fp8_dtype or weight.dim() != 2:
            raise ValueError(f"weight must be a 2-D {layer_config.fp8_dtype} tensor [N, K], "
                             f"got {weight.dim()}-D {weight.dtype}")
        out_features, in_features = weight.shape
        scale_shape = weight_scale_shape(layer_config.weight_granularity, out_features, in_features)
        if tuple(weight_scale.shape) != scale_shape:
            raise ValueError(f"weight_scale for per-{layer_config.weight_granularity} weights must have shape "
                             f"{list(scale_shape)}, got {list(weight_scale.shape)}")
        _check_scale_value("weight_scale", weight_scale)
        if bias is not None and (bias.dim() != 1 or bias.shape[0] != out_features or not bias.is_floating_point()):
            raise ValueError(f"bias must be a float tensor of shape [{out_features}], "
                             f"got {bias.dtype} {list(bias.shape)}")
        if input_scale is not None and layer_config.activations != "static":
            raise ValueError(f"input_scale is only used with activations='static', "
                             f"this layer has {layer_config.activations!r}")
        tensors = [t for t in (weight, weight_scale, bias, input_scale) if t is not None]
        if len({t.device for t in tensors}) != 1:
            raise ValueError(f"weight, scales and bias must be on one device, got {[str(t.device) for t in tensors]}")
        layer = cls(in_features, out_features, bias=bias is not None, device="meta",
                    dtype=bias.dtype if bias is not None else None, config=layer_config)
        layer.weight = nn.Parameter(weight.detach(), requires_grad=False)
        layer.weight_scale = weight_scale.detach()
        layer.unit_scale = torch.ones((), dtype=torch.float32, device=weight.device)
        if bias is not None:
            layer.bias = nn.Parameter(bias.detach(), requires_grad=False)
        if input_scale is not None:
            layer.set_input_scale(input_scale)
        elif layer.input_scale is not None:
            layer.input_scale = torch.full((), math.nan, dtype=torch.float32, device=weight.device)
        return layer

    def set_input_scale(self, scale: torch.Tensor | float) -> None:
        """Set the static activation scale (finite, > 0); used by calibration and loaders."""
        if self.config.activations != "static":
            raise ValueError(f"input_scale is only used with activations='static', this layer has {self.config.activations!r}")
        if not isinstance(scale, (torch.Tensor, float, int)) or isinstance(scale, bool):
            raise TypeError(f"input_scale must be a float or a one-element tensor, got {type(scale).__name__}")
        scale = torch.as_tensor(scale, dtype=torch.float32)
        if scale.numel() != 1:
            raise ValueError(f"input_scale is one value per layer (static activations are per-tensor): "
                             f"expected one element, got shape {list(scale.shape)}")
        scale = scale.reshape(()).to(self.weight.device)
        _check_scale_value("input_scale", scale)
        self.input_scale = scale
        self._input_scale_ready = True

    def clear_input_scale(self) -> None:
        """Forget the static activation scale: forward refuses to run until one is set."""
        if self.input_scale is not None:
            self.input_scale = torch.full((), math.nan, dtype=torch.float32, device=self.input_scale.device)
        self._input_scale_ready = False

    @property
    def input_scale_ready(self) -> bool:
        """Whether a static layer has its input_scale (from calibration, loading or set_input_scale)."""
        return self._input_scale_ready

    @property
    def config(self) -> FP8Config:
        """The layer's FP8Config (a setter keeps what forward derives from it in step)."""
        return self.__dict__["_config"]

    @config.setter
    def config(self, config: FP8Config) -> None:
        if not isinstance(config, FP8Config):
            raise TypeError(f"config must be an FP8Config, got {type(config).__name__}")
        # the weight's dtype is the activations' fp8 dtype on every path (the native ones
        # read it from the weight): a config of another one would split the paths
        weight = self.__dict__.get("_parameters", {}).get("weight")
        if weight is not None and weight.dtype != config.fp8_dtype:
            raise ValueError(f"config.fp8_dtype must be the weight's dtype {weight.dtype}, got {config.fp8_dtype}: "
                             f"make a new layer (from_fp8) for another fp8 format")
        self.__dict__["_config"] = config
        self._set_fast_path(self.__dict__.get("_scale_ready", False))

    def _set_fast_path(self, ready: bool) -> None:
        """What forward's fast path reads: fp8linear::linear's codes for this layer and,
        through the flag, _fast_scale."""
        config = self.config
        self._linear_codes = (_LINEAR_ACTIVATIONS[config.activations], _LINEAR_GRANULARITIES[_linear_granularity(config)])
        # the granularity of _LastQuantizedInput's key for dynamic activations, None for the others
        self._reuse_granularity = _linear_granularity(config) if config.activations == "dynamic" else None
        self._input_scale_ready = ready

    @property
    def _input_scale_ready(self) -> bool:
        return self.__dict__["_scale_ready"]

    @_input_scale_ready.setter
    def _input_scale_ready(self, ready: bool) -> None:
        # _fast_scale: the buffer forward's fast path passes as activation scale ("" for
        # none: dynamic activations), or None while a static layer waits for its scale
        # (no fast path: the full one raises)
        self.__dict__["_scale_ready"] = ready
        activations = self.config.activations
        self.__dict__["_fast_scale"] = ("input_scale" if ready else None) if activations == "static" else (
            "unit_scale" if activations == "none" else "")

    def _check_loaded_state(self, state_dict, prefix, *args):
        for name in ("weight_scale", "input_scale"):
            if prefix + name in state_dict:
                _check_scale_value(prefix + name, state_dict[prefix + name])
        if prefix + "input_scale" in state_dict and self.input_scale is not None:
            self._input_scale_ready = True
        weight = state_dict.get(prefix + "weight")
        if weight is not None and weight.dtype != self.config.fp8_dtype:
            raise ValueError(f"{prefix}weight must be {self.config.fp8_dtype}, got {weight.dtype}")

    def _apply(self, fn, recurse=True):
        # model.to(torch.bfloat16) must move fp8 weights and float32 scales without
        # converting them: fp8 counts as floating point for nn.Module.to.
        kept = {name: t.detach() for name, t in self._fp8_state()}
        super()._apply(fn, recurse)
        for name, original in kept.items():
            current = getattr(self, name)
            if current.dtype != original.dtype:
                restored = original.to(device=current.device)
                if name == "weight":
                    self.weight = nn.Parameter(restored, requires_grad=False)
                else:
                    setattr(self, name, restored)
        if self.bias is not None and self.bias.dtype not in _KERNEL_DTYPES:
            # model.double(): the bias stays in a dtype the kernels add (float32), as
            # float64 inputs are computed in float32
            self.bias = nn.Parameter(self.bias.detach().to(torch.float32), requires_grad=self.bias.requires_grad)
        return self

    # Plain pickle cannot serialize fp8 tensors in torch (their storage reduce looks up
    # a dtype attribute that fp8 storages lack), so the weight travels as its bytes.
    def __getstate__(self):
        state = self.__dict__.copy()
        state["_parameters"] = dict(state["_parameters"])
        weight = state["_parameters"].pop("weight")
        state["_fp8_weight_bytes"] = (weight.detach().view(torch.uint8), weight.dtype)
        return state

    def __setstate__(self, state):
        data, dtype = state.pop("_fp8_weight_bytes")
        super().__setstate__(state)
        self._parameters = {"weight": nn.Parameter(data.view(dtype), requires_grad=False), **self._parameters}
        # pickles from before the fast path kept the config and the flag under other names
        if "config" in self.__dict__:
            self.__dict__["_config"] = self.__dict__.pop("config")
        self._set_fast_path(state.get("_scale_ready", self.__dict__.pop("_input_scale_ready", False)))

    def _fp8_state(self):
        yield "weight", self.weight
        yield "weight_scale", self.weight_scale
        yield "unit_scale", self.unit_scale
        if self.input_scale is not None:
            yield "input_scale", self.input_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Decode calls small layers hundreds of times per token: the Python here costs
        # as much as the kernels for SmolLM2's 576 x 576, so nothing is done twice. The
        # parameters and buffers are read from their dicts once each: through
        # nn.Module.__getattr__ each of five reads cost ~0.5 us; reading them once saved
        # 1.4 us of a 16.7 us call (64 x 64, M = 1, Intel Xeon with AMX).
        parameters, buffers = self._parameters, self._buffers
        weight, bias = parameters["weight"], parameters["bias"]
        # The fast path: an eager call whose device has had its path settled is one native
        # call, which also makes the tests it needs (ops.linear_if_plain, or for inputs
        # whose quantization sibling layers reuse ops.dynamic_linear_if_plain), or returns
        # None for the full path below. In decode each layer's Python runs with cold
        # caches (the weights streamed in between evict them): on SmolLM2's 192 x 576 layers
        # at M = 1 (AMD EPYC Zen 3, 2 threads, cycling through 200 MB of layers) the full
        # path took 44.9 us a call, this one 26.9, bf16 nn.Linear 27.9 (docs/design.md,
        # forward, item 8).
        if not _is_compiling() and (scale_buffer := self._fast_scale) is not None and x.device in _backend._settled:
            if (reused := self._reuse_granularity) is not None and x.is_cpu and x.numel() > _FUSED_MAX_ROWS * self.in_features:
                out = _fast_dynamic_linear(x, weight, buffers["weight_scale"], bias, self._linear_codes[1], reused)
            else:
                out = ops.linear_if_plain(x, weight, buffers["weight_scale"], bias,
                                          buffers[scale_buffer] if scale_buffer else None, *self._linear_codes,
                                          _FAST_MAX_ROWS)
            if out is not None:
                return out
        device = x.device
        warn_once_if_not_native(device)
        in_features = self.in_features
        if x.dim() == 0 or x.shape[-1] != in_features:
            raise ValueError(f"input's last dimension must be in_features={in_features}, got shape {tuple(x.shape)}")
        if weight.requires_grad:
            raise RuntimeError(_FROZEN_WEIGHT)
        input_dtype = x.dtype
        if input_dtype not in _KERNEL_DTYPES:
            if input_dtype != torch.float64:
                raise ValueError(f"FP8Linear's input must be float32, bfloat16 or float16 (float64 is computed in "
                                 f"float32), got {input_dtype}")
            x = x.to(torch.float32)
        else:
            device_type = device.type
            if device_type in _AUTOCAST_DEVICES and torch.is_autocast_enabled(device_type):
                x = x.to(torch.get_autocast_dtype(device_type))  # as nn.Linear: compute and return that dtype
        leading = x.shape[:-1]
        config = self.config
        if config.activations == "none":
            activation_scale = buffers["unit_scale"]
        elif config.activations == "static":
            if not self._input_scale_ready:
                raise RuntimeError("input_scale is not set: run fp8linear.calibrate(model, batches) "
                                   "or load a checkpoint with input scales before the forward pass")
            activation_scale = buffers["input_scale"]
        else:
            activation_scale = None
        weight_scale = buffers["weight_scale"]
        if torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)):
            x2d = x if len(leading) == 1 else x.reshape(-1, in_features)
            out = _FP8LinearFunction.apply(x2d, weight, weight_scale, bias, activation_scale, config, x2d.dtype)
            out = out if len(leading) == 1 else out.view(*leading, self.out_features)
        elif not torch.compiler.is_compiling() and in_features and x.numel() <= _FUSED_MAX_ROWS * in_features:
            # decode-sized, eager: one op call (see _FUSED_MAX_ROWS). Compiled graphs have no
            # Python between the ops to save and keep the two ops in view; the compile test
            # comes first so that tracing never guards on the number of rows.
            out = ops.linear(x, weight, weight_scale, bias, activation_scale, *self._linear_codes)
        else:
            x2d = x if len(leading) == 1 else x.reshape(-1, in_features)
            out = _product(x2d, weight, weight_scale, bias, activation_scale, config, x2d.dtype, x)
            out = out if len(leading) == 1 else out.view(*leading, self.out_features)
        return out if input_dtype != torch.float64 else out.to(torch.float64)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, {self.config.describe()}")
