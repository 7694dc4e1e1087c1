"""Layers fed the same input tensor (q, k and v; gate and up) quantize it once: the
dynamic quantization of a CPU input is kept per thread while that tensor lives
unmodified, and reused by the next layer that quantizes it the same way. These tests
check that the reuse happens, and that it never returns a stale or foreign result.
The reuse is for inputs above FP8Linear's fused size (more than 16 rows); smaller ones
quantize their own input in C++ (test_linear.py checks that path against the two ops),
so the inputs here have 20 rows or more. Both of forward's paths reuse: the fast one
(ops.dynamic_linear_if_plain, a native call) and the full one (ops.quantize_fp8, then
ops.scaled_mm, taken under autocast, torch function modes and the like)."""
import gc
import threading

import pytest
import torch
from torch import nn

import fp8linear
from fp8linear import FP8Linear, ops
from fp8linear import linear as linear_module


class QuantizeCalls:
    """Counts the quantizations of activations, on both of forward's paths; make layers
    with `layers`, which zeroes the count after quantizing their weights."""

    def __init__(self):
        self.count = 0
        self.fast_calls = 0  # forward calls the fast path answered with reuse (ops.dynamic_linear_if_plain)
        self.path = "fast"

    def layers(self, scheme="per-tensor", sizes=(24, 40, 8), in_features=72):
        torch.manual_seed(0)
        made = [FP8Linear.from_linear(nn.Linear(in_features, n), **fp8linear.SCHEMES[scheme]) for n in sizes]
        self.count = 0
        return made


@pytest.fixture(params=["fast", "full"])
def quantize_calls(monkeypatch, request):
    """The count, with forward's fast path (the default) or with its full path only."""
    calls = QuantizeCalls()
    original_quantize = ops.quantize_fp8
    original_dynamic = ops.dynamic_linear_if_plain
    original_linear = ops.linear_if_plain

    def counting_quantize(*args, **kwargs):
        calls.count += 1
        return original_quantize(*args, **kwargs)

    def counting_dynamic(x, weight, weight_scale, bias, granularity, quantized, max_rows):
        result = original_dynamic(x, weight, weight_scale, bias, granularity, quantized, max_rows)
        if result is not None:
            calls.fast_calls += 1
            calls.count += quantized is None  # it quantized x itself
        return result

    def counting_linear(*args):
        result = original_linear(*args)
        if result is not None and args[5] == ops.LINEAR_ACTIVATIONS["dynamic"]:
            calls.count += 1
        return result

    monkeypatch.setattr(ops, "quantize_fp8", counting_quantize)
    monkeypatch.setattr(ops, "dynamic_linear_if_plain", counting_dynamic)
    monkeypatch.setattr(ops, "linear_if_plain", counting_linear)
    calls.path = request.param
    if request.param == "full":
        monkeypatch.setattr(linear_module, "_FAST_MAX_ROWS", -1)
    with torch.no_grad():  # settles the CPU's path (forward's first call on a device takes the full one)
        FP8Linear.from_linear(nn.Linear(8, 8))(torch.randn(1, 8))
    linear_module._LAST_QUANTIZED.entry = None
    yield calls
    linear_module._LAST_QUANTIZED.entry = None


def fresh(layer, x):
    """The layer's output computed from a copy of x: no reuse possible."""
    return layer(x.clone())


@pytest.mark.parametrize("scheme", ["per-tensor", "per-channel", "block"])
def test_siblings_quantize_a_shared_input_once_with_the_same_outputs(quantize_calls, scheme):
    q, k, v = quantize_calls.layers(scheme)
    x = torch.randn(3, 7, 72, dtype=torch.bfloat16)
    with torch.no_grad():
        outputs = [q(x), k(x), v(x)]
        assert quantize_calls.count == 1
        assert quantize_calls.fast_calls == (3 if quantize_calls.path == "fast" else 0)
        expected = [fresh(layer, x) for layer in (q, k, v)]
    for out, reference in zip(outputs, expected):
        assert torch.equal(out, reference)


def test_an_in_place_change_between_layers_is_seen(quantize_calls):
    q, k, _ = quantize_calls.layers()
    x = torch.randn(20, 72, dtype=torch.bfloat16)
    with torch.no_grad():
        q(x)
        x[2].mul_(3.0)  # through a view: the version counter is shared
        out = k(x)
        assert quantize_calls.count == 2
        assert torch.equal(out, fresh(k, x))


def test_a_different_quantization_of_the_same_input_is_not_reused(quantize_calls):
    (per_tensor,) = quantize_calls.layers("per-tensor", sizes=(16,))
    (per_token,) = quantize_calls.layers("per-channel", sizes=(16,))
    x = torch.randn(20, 72) * torch.logspace(-3, 3, 20).unsqueeze(1)  # rows of very different magnitudes
    with torch.no_grad():
        a, b = per_tensor(x), per_token(x)
        assert quantize_calls.count == 2
        assert torch.equal(a, fresh(per_tensor, x)) and torch.equal(b, fresh(per_token, x))


def test_static_and_weight_only_layers_do_not_take_a_reused_input(quantize_calls):
    (dynamic,) = quantize_calls.layers("per-tensor", sizes=(16,))
    (static,) = quantize_calls.layers("static", sizes=(16,))
    static.set_input_scale(0.5)
    (weight_only,) = quantize_calls.layers("weight-only", sizes=(16,))
    x = torch.randn(20, 72, dtype=torch.bfloat16)
    with torch.no_grad():
        dynamic(x)
        out_static, out_weight_only = static(x), weight_only(x)
    assert torch.equal(out_static, fresh(static, x)) and torch.equal(out_weight_only, fresh(weight_only, x))


def test_inference_mode_tensors_are_never_reused(quantize_calls):
    # they carry no version counter, so an in-place change could not be seen
    q, k, _ = quantize_calls.layers()
    with torch.inference_mode():
        x = torch.randn(20, 72, dtype=torch.bfloat16)
        q(x)
        x.add_(1.0)
        out = k(x)
        assert quantize_calls.count == 2
        assert torch.equal(out, fresh(k, x))


def test_the_kept_quantization_is_dropped_with_its_input(quantize_calls):
    q, k, _ = quantize_calls.layers()
    x = torch.randn(64, 72, dtype=torch.bfloat16)
    with torch.no_grad():
        q(x)
    assert linear_module._LAST_QUANTIZED.entry is not None
    del x
    gc.collect()
    assert linear_module._LAST_QUANTIZED.entry is None
    # a new tensor, possibly at the same address and of the same shape, is quantized afresh
    y = torch.randn(64, 72, dtype=torch.bfloat16)
    with torch.no_grad():
        out = k(y)
    assert quantize_calls.count == 2
    assert torch.equal(out, fresh(k, y))


def test_another_thread_does_not_see_this_threads_input(quantize_calls):
    q, k, _ = quantize_calls.layers()
    x = torch.randn(20, 72, dtype=torch.bfloat16)
    with torch.no_grad():
        q(x)
    seen = []

    def other():
        seen.append(linear_module._LAST_QUANTIZED.entry)
        with torch.no_grad():
            seen.append(k(x))

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert seen[0] is None
    assert quantize_calls.count == 2  # the other thread quantized for itself
    assert torch.equal(seen[1], fresh(k, x))


def test_training_inputs_get_gradients_as_before(quantize_calls):
    q, k, _ = quantize_calls.layers()
    x = torch.randn(20, 72, requires_grad=True)
    (q(x).sum() + k(x).sum()).backward()
    x_again = x.detach().clone().requires_grad_(True)
    q(x_again).sum().backward()
    k(x_again).sum().backward()
    assert torch.equal(x.grad, x_again.grad)


def test_a_replaced_tensor_body_is_not_taken_for_the_kept_one(quantize_calls):
    # x.data = ... keeps the object and its version counter: the data pointer and the shape
    # in the entry tell the kept quantization from the new contents
    q, k, _ = quantize_calls.layers()
    x = torch.randn(20, 72, dtype=torch.bfloat16)
    with torch.no_grad():
        q(x)
        x.data = torch.randn(20, 72, dtype=torch.bfloat16) * 5
        out = k(x)
        assert quantize_calls.count == 2
        assert torch.equal(out, fresh(k, x))
        x.data = torch.randn(32, 72, dtype=torch.bfloat16)
        quantize_calls.count = 0
        out = k(x)
        assert quantize_calls.count == 1
        assert out.shape == (32, 40) and torch.equal(out, fresh(k, x))


def test_the_native_call_refuses_a_quantization_of_another_input():
    (layer,) = QuantizeCalls().layers(sizes=(16,))
    x = torch.randn(20, 72)
    q, scale = ops.quantize_fp8(x[:10])
    with pytest.raises(RuntimeError, match="not one of x"):
        ops.dynamic_linear_if_plain(x, layer.weight, layer.weight_scale, layer.bias, 0, (q, scale), 1 << 40)
    q, scale = ops.quantize_fp8(x, dtype=torch.float8_e5m2)
    with pytest.raises(RuntimeError, match="not one of x"):
        ops.dynamic_linear_if_plain(x, layer.weight, layer.weight_scale, layer.bias, 0, (q, scale), 1 << 40)
