"""quantize_model: swap the nn.Linear layers of an existing model for FP8Linear."""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable

from torch import nn

from ._progress import progress_bar
from .linear import FP8Config, FP8Linear
from .ops import FLOAT_DTYPES

__all__ = ["quantize_model", "QUANTIZATIONS", "SCHEMES", "ConversionReport"]

logger = logging.getLogger("fp8linear")

#: The values of ``quantization=`` and what each means.
QUANTIZATIONS = {"fp8": "FP8Linear layers (fp8 weights; activations as the options say)"}

#: Named FP8Config options, as the command line and the quality benchmark offer them:
#: ``quantize_model(model, "fp8", **SCHEMES["per-channel"])``.
SCHEMES = {
    # one scale per weight tensor and per activation tensor: what every FP8 kernel runs
    "per-tensor": {},
    # a scale per output channel and per token: the best quality (llm-compressor's FP8_DYNAMIC)
    "per-channel": {"weight_granularity": "channel", "activation_granularity": "token"},
    # per-tensor activation scales calibrated once (fp8linear.calibrate): no amax per call
    "static": {"activations": "static"},
    # fp8 weights, activations left in their precision: half the weight memory, no activation error
    "weight-only": {"weight_granularity": "channel", "activations": "none"},
    # 128 x 128 weight blocks, activations per token and group of 128 (DeepSeek-V3, Qwen3 FP8,
    # llm-compressor's FP8_BLOCK)
    "block": {"weight_granularity": "block", "activation_granularity": "group"},
}


@dataclasses.dataclass
class ConversionReport:
    """What quantize_model did: converted layer names, and skipped ones with the reason."""

    converted: list[str] = dataclasses.field(default_factory=list)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"fp8linear: converted {len(self.converted)} linear layer(s), skipped {len(self.skipped)}"]
        lines += [f"  skipped {name}: {reason}" for name, reason in self.skipped.items()]
        return "\n".join(lines)


def tied_weights(model: nn.Module) -> dict[int, list[str]]:
    """For each nn.Linear (by id) whose weight another module also holds (tied embeddings),
    the names of the weight in those other modules. A module reachable under two names
    (a shared module) is one module: its weight is not tied."""
    holders: dict[int, list[tuple[int, str]]] = {}  # id(parameter) -> [(id(module), name)]
    for module_name, module in model.named_modules(remove_duplicate=False):
        for attribute, parameter in module._parameters.items():
            if parameter is not None:
                name = f"{module_name}.{attribute}" if module_name else attribute
                holders.setdefault(id(parameter), []).append((id(module), name))
    tied: dict[int, list[str]] = {}
    for module in model.modules():
        if isinstance(module, nn.Linear) and module.weight is not None:
            others = [name for key, name in holders.get(id(module.weight), []) if key != id(module)]
            if others:
                tied[id(module)] = others
    return tied


def skip_reason(module: nn.Module, fqn: str, skip_modules, filter_fn, *, check_weight: bool = True) -> str | None:
    """Why this nn.Linear is not converted, or None to convert it. ``check_weight=False``
    for a model skeleton whose weights are still in a checkpoint (on the meta device)."""
    if isinstance(module, FP8Linear):
        return "already an FP8Linear"
    if type(module) is not nn.Linear:
        # Subclasses (LoRA layers, MultiheadAttention's out_proj...) are used through
        # their own forward or their .weight by the parent: swapping them breaks the parent.
        return f"subclass {type(module).__qualname__} of nn.Linear, whose users may read .weight directly"
    name = fqn.rsplit(".", 1)[-1]
    if fqn in skip_modules or name in skip_modules:
        return "listed in skip_modules"
    if filter_fn is not None and not filter_fn(module, fqn):
        return "filter_fn returned False"
    if not check_weight:
        return None
    weight = module.weight
    if weight.device.type == "meta":
        return "weight on the meta device (not materialized)"
    if weight.dtype not in FLOAT_DTYPES:
        return f"weight dtype {weight.dtype} is not float32/bfloat16/float16"
    return None


def quantize_model(model: nn.Module, quantization: str | None = "fp8", *, skip_modules=("lm_head",),
                   filter_fn: Callable[[nn.Module, str], bool] | None = None, progress: bool | None = None,
                   **options) -> nn.Module:
    """Replace ``model``'s nn.Linear layers by FP8Linear, in place, and return ``model``.

    quantization: ``"fp8"``, or ``None`` to change nothing.
    skip_modules: names (last component, e.g. ``"lm_head"``) or full names of layers to keep.
    filter_fn: ``filter_fn(module, fqn) -> bool``; convert only where it returns True.
    progress: a tqdm progress bar over the layers (None: only when stderr is a terminal).
    options: the fields of :class:`FP8Config` (``weight_granularity``,
        ``activations``, ``activation_granularity``, ``fp8_dtype``); see SCHEMES.

    A module used in two places stays one shared module. A layer whose weight is tied to
    another module's parameter (an lm_head tied to the input embeddings) is kept:
    converting it would untie it, adding an fp8 copy beside the embedding. Every layer that is not
    converted is reported with the reason (log level WARNING when it could not be
    converted, INFO when it was excluded on purpose); the report is also stored
    as ``model.fp8linear_report``. If a conversion fails, the model is unchanged.
    """
    if quantization is None:
        return model
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {sorted(QUANTIZATIONS)} or None, got {quantization!r}")
    config = FP8Config(**options)
    skip_modules = {skip_modules} if isinstance(skip_modules, str) else set(skip_modules or ())

    report = ConversionReport()
    tied = tied_weights(model)
    to_convert: dict[int, nn.Linear] = {}  # id(old module) -> old module, so shared modules stay shared
    places: list[tuple[nn.Module, str, nn.Module]] = []  # (parent, attribute, old module)
    # First plan and build every replacement without touching the model, so that a
    # failure part way leaves it as it was.
    for parent_name, parent in model.named_modules(remove_duplicate=False):
        # _modules, not named_children(): the latter hides a child registered twice
        # under one parent, and both names must point at the replacement.
        for child_name, child in parent._modules.items():
            if not isinstance(child, nn.Linear):
                continue
            fqn = f"{parent_name}.{child_name}" if parent_name else child_name
            if id(child) in to_convert:
                places.append((parent, child_name, child))
                continue
            reason = skip_reason(child, fqn, skip_modules, filter_fn)
            if reason is None and id(child) in tied:
                # converting would untie it: an fp8 copy beside the embedding, and a
                # config (tie_word_embeddings) that no longer describes the model
                reason = f"weight tied to {tied[id(child)]}"
            if reason is not None:
                report.skipped.setdefault(fqn, reason)
                continue
            to_convert[id(child)] = child
            places.append((parent, child_name, child))
            report.converted.append(fqn)
    replacements = {key: FP8Linear.from_linear(linear, config=config)
                    for key, linear in progress_bar(progress, iterable=to_convert.items(), total=len(to_convert),
                                                    desc="Converting to FP8", unit="layer")}
    for parent, child_name, child in places:
        setattr(parent, child_name, replacements[id(child)])

    logger.info("%s", report)
    for name, reason in report.skipped.items():
        if reason.startswith(("weight", "subclass")):
            logger.warning("fp8linear: could not convert %s: %s", name, reason)
    if not report.converted:
        present = sum(isinstance(module, FP8Linear) for module in model.modules())
        if present:
            logger.warning("fp8linear: the model already holds %d FP8Linear layers; nothing was converted", present)
    model.fp8linear_report = report
    return model

