"""Static calibration: the input_scale of FP8Linear layers with activations="static".

calibrate(model, batches) runs the model over the batches with a forward pre-hook on
every static layer. While calibrating, a static layer quantizes each input with that
input's own per-tensor scale (dynamic per-tensor, as AutoFP8 calibrates), so the
activations downstream are those the quantized model will see; the hook records the
running amax. At the end each layer gets ``input_scale = max(amax / FMAX, 1 / (FMAX * 512))``
(the dynamic-scale rule of docs/design.md, in float64); a layer whose amax stayed 0 (no finite
nonzero input) gets no scale and is reported. If anything fails part way, every
layer gets back the state it had: scales are only set once all batches have run.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from ._progress import progress_bar
from .linear import FP8Linear
from .reference import scale_from_amax

__all__ = ["calibrate", "CalibrationReport", "text_batches"]

logger = logging.getLogger("fp8linear")


@dataclasses.dataclass
class CalibrationReport:
    """What calibrate did: the scale set per layer, from the amax seen over ``batches`` batches.

    uncalibrated: static layers no batch reached.
    no_signal: static layers whose inputs held no finite nonzero value (all zeros, NaN or
    inf): they give no range, and the floor scale would be a guess.
    Both are left as they were (an uncalibrated layer's forward raises until it gets a scale).
    """

    input_scales: dict[str, float] = dataclasses.field(default_factory=dict)
    amax: dict[str, float] = dataclasses.field(default_factory=dict)
    uncalibrated: list[str] = dataclasses.field(default_factory=list)
    no_signal: list[str] = dataclasses.field(default_factory=list)
    batches: int = 0

    def __str__(self) -> str:
        text = f"fp8linear: calibrated {len(self.input_scales)} static layer(s) over {self.batches} batch(es)"
        if self.uncalibrated:
            text += f"; no input reached {len(self.uncalibrated)}: {', '.join(self.uncalibrated)}"
        if self.no_signal:
            text += f"; no finite nonzero input reached {len(self.no_signal)}: {', '.join(self.no_signal)}"
        return text


def _finite_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| over the finite elements, float32 on x's device (no host sync)."""
    magnitude = x.detach().abs().float()
    magnitude = torch.where(torch.isfinite(magnitude), magnitude, torch.zeros((), device=x.device))
    return magnitude.max() if magnitude.numel() else torch.zeros((), device=x.device)


def _run(model: nn.Module, batch) -> None:
    if isinstance(batch, Mapping):
        model(**batch)
    elif isinstance(batch, (tuple, list)):
        model(*batch)
    else:
        model(batch)


def calibrate(model: nn.Module, batches: Iterable, *, progress: bool | None = None) -> CalibrationReport:
    """Set the ``input_scale`` of every static FP8Linear in ``model`` from ``batches``.

    Each batch is passed to ``model`` as ``model(**batch)`` (a mapping, e.g. a tokenizer's
    output), ``model(*batch)`` (a tuple or list) or ``model(batch)``, under
    ``torch.no_grad()``. Convert first with ``quantize_model(model, "fp8",
    activations="static")``; calibrating again replaces the scales. Returns a
    CalibrationReport (also logged); layers that no batch reached, and layers whose inputs
    held no finite nonzero value, are reported (with a warning) and left as they were. If
    a batch fails, the exception propagates and the model is as it was.
    """
    layers = {name: module for name, module in model.named_modules()
              if isinstance(module, FP8Linear) and module.config.activations == "static"}
    if not layers:
        raise ValueError("the model has no FP8Linear layer with activations='static': convert it with "
                         "fp8linear.quantize_model(model, 'fp8', activations='static') first")
    previous = {name: layer.input_scale if layer.input_scale_ready else None for name, layer in layers.items()}
    running: dict[str, torch.Tensor] = {}

    def make_hook(name: str, fp8_dtype: torch.dtype):
        def record_and_scale(layer: FP8Linear, args):
            amax = _finite_amax(args[0])
            running[name] = amax if name not in running else torch.maximum(running[name], amax)
            # quantize this input with its own scale: dynamic per-tensor while calibrating
            layer.set_input_scale(scale_from_amax(amax, fp8_dtype))
        return record_and_scale

    handles = [layer.register_forward_pre_hook(make_hook(name, layer.config.fp8_dtype))
               for name, layer in layers.items()]
    count = 0
    try:
        with torch.no_grad():
            for batch in progress_bar(progress, iterable=batches, desc="Calibrating", unit="batch"):
                _run(model, batch)
                count += 1
    finally:
        for handle in handles:
            handle.remove()
        for name, layer in layers.items():
            if previous[name] is None:
                layer.clear_input_scale()
            else:
                layer.set_input_scale(previous[name])
    if count == 0:
        raise ValueError("batches is empty: calibration needs at least one batch")

    report = CalibrationReport(batches=count)
    scales = {name: scale_from_amax(running[name], layers[name].config.fp8_dtype) for name in running}
    for name, layer in layers.items():
        if name not in scales:
            report.uncalibrated.append(name)
            continue
        if not bool(running[name] > 0):
            report.no_signal.append(name)
            continue
        layer.set_input_scale(scales[name])
        report.input_scales[name] = float(scales[name])
        report.amax[name] = float(running[name])
    logger.info("%s", report)
    if report.uncalibrated:
        logger.warning("fp8linear: static layers without calibration data (no batch reached them): %s",
                       ", ".join(report.uncalibrated))
    if report.no_signal:
        logger.warning("fp8linear: static layers left without a scale: their inputs saw no finite nonzero value: %s",
                       ", ".join(report.no_signal))
    return report


def text_batches(tokenizer, text: str, *, sequence_length: int = 512, count: int | None = 16) -> list[torch.Tensor]:
    """``text`` tokenized once and cut into ``[1, sequence_length]`` input_ids batches
    (default 512 tokens), at most ``count`` of them (default 16, the command line's
    --calibration-samples; None: every piece); the last, shorter piece is dropped unless
    it is the only one."""
    if isinstance(sequence_length, bool) or not isinstance(sequence_length, int) or sequence_length < 1:
        raise ValueError(f"sequence_length must be at least 1, got {sequence_length!r}")
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
        raise ValueError(f"count must be at least 1 or None, got {count!r}")
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"][0]
    if ids.numel() == 0:
        raise ValueError("the calibration text is empty after tokenization")
    pieces = [ids[start:start + sequence_length] for start in range(0, ids.numel(), sequence_length)]
    if len(pieces) > 1 and pieces[-1].numel() < sequence_length:
        pieces.pop()
    return [piece.unsqueeze(0) for piece in pieces[:count]]
