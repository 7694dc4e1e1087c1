"""FP8Linear against nn.Linear, and its behaviour as a module."""
import copy
import io
import pickle

import pytest
import torch
from torch import nn

import fp8linear
from fp8linear import FP8Config, FP8Linear
from conftest import FLOAT_DTYPES


def sqnr_db(reference: torch.Tensor, out: torch.Tensor) -> float:
    reference, out = reference.double(), out.double()
    return 10 * torch.log10(reference.pow(2).sum() / (reference - out).pow(2).sum()).item()


SCHEMES = {
    "per-tensor": (dict(), 25.0),
    "per-channel+per-token": (dict(weight_granularity="channel", activation_granularity="token"), 28.0),
    "weight-only per-channel": (dict(weight_granularity="channel", activations="none"), 28.0),
    "e5m2 per-channel+per-token": (dict(weight_granularity="channel", activation_granularity="token",
                                        fp8_dtype=torch.float8_e5m2), 20.0),
}


@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_close_to_nn_linear(scheme, dtype, cpu_variant):
    options, min_db = SCHEMES[scheme]
    linear = nn.Linear(256, 96).to(dtype)
    x = torch.randn(4, 7, 256, dtype=dtype)
    layer = FP8Linear.from_linear(linear, **options)
    out = layer(x)
    assert out.dtype == dtype and out.shape == (4, 7, 96)
    assert sqnr_db(linear(x), out) >= min_db


def test_static_activations_need_a_scale_then_match_dynamic():
    linear = nn.Linear(64, 32)
    x = torch.randn(10, 64)
    layer = FP8Linear.from_linear(linear, activations="static")
    with pytest.raises(RuntimeError, match="input_scale is not set"):
        layer(x)
    layer.set_input_scale(x.abs().max() / 448)
    dynamic = FP8Linear.from_linear(linear)
    assert torch.equal(layer(x), dynamic(x))  # same scale, same numbers
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="input_scale must be finite and > 0"):
            layer.set_input_scale(bad)


def test_state_dict_round_trip_and_checks():
    linear = nn.Linear(48, 20)
    layer = FP8Linear.from_linear(linear, weight_granularity="channel", activations="static")
    layer.set_input_scale(0.01)
    state = layer.state_dict()
    assert set(state) == {"weight", "weight_scale", "bias", "input_scale"}
    assert state["weight"].dtype == torch.float8_e4m3fn and state["weight_scale"].shape == (20, 1)
    fresh = FP8Linear(48, 20, weight_granularity="channel", activations="static")
    fresh.load_state_dict(state)
    x = torch.randn(3, 48)
    assert torch.equal(fresh(x), layer(x))
    broken = dict(state, weight_scale=torch.zeros(20, 1))
    with pytest.raises(ValueError, match="weight_scale must be finite and > 0"):
        FP8Linear(48, 20, weight_granularity="channel", activations="static").load_state_dict(broken)
    with pytest.raises(ValueError, match="weight must be torch.float8_e4m3fn"):
        FP8Linear(48, 20, weight_granularity="channel", activations="static").load_state_dict(
            dict(state, weight=state["weight"].float()))


def test_to_deepcopy_pickle_keep_fp8():
    layer = FP8Linear.from_linear(nn.Linear(32, 16))
    x = torch.randn(2, 32)
    expected = layer(x)
    assert torch.equal(copy.deepcopy(layer)(x), expected)
    assert torch.equal(pickle.loads(pickle.dumps(layer))(x), expected)
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    assert torch.equal(torch.load(buffer, weights_only=False)(x), expected)
    layer.to(torch.bfloat16)  # must not turn the fp8 weight or the float32 scale into bf16
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.dtype == torch.float32
    assert layer.bias.dtype == torch.bfloat16
    assert layer(x.bfloat16()).dtype == torch.bfloat16
    layer.to("cpu")
    assert layer.weight.dtype == torch.float8_e4m3fn


def test_repr_names_the_options():
    layer = FP8Linear(8, 4, bias=False, weight_granularity="channel", activation_granularity="token")
    text = repr(layer)
    assert "in_features=8" in text and "bias=False" in text
    assert "weights e4m3fn per-channel" in text and "activations dynamic per-token" in text


def test_bad_options_and_inputs():
    with pytest.raises(ValueError, match="activations must be one of"):
        FP8Config(activations="sometimes")
    with pytest.raises(ValueError, match="fp8_dtype must be one of"):
        FP8Config(fp8_dtype=torch.int8)
    with pytest.raises(ValueError, match="activation_granularity must be 'tensor'"):
        FP8Config(activations="static", activation_granularity="token")
    with pytest.raises(ValueError, match="from_linear needs an nn.Linear"):
        FP8Linear.from_linear(nn.Conv1d(2, 2, 1))
    layer = FP8Linear.from_linear(nn.Linear(8, 4))
    with pytest.raises(ValueError, match="in_features=8"):
        layer(torch.randn(3, 9))
    with pytest.raises(ValueError, match="input must be float32, bfloat16 or float16"):
        layer(torch.ones(3, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match="in_features=8"):
        layer(torch.tensor(1.0))  # 0-d


def test_from_linear_leaves_the_original_alone():
    linear = nn.Linear(16, 8)
    before = linear.weight.detach().clone()
    FP8Linear.from_linear(linear)
    assert torch.equal(linear.weight, before) and linear.weight.dtype == torch.float32


def test_weight_memory_is_halved():
    layer = FP8Linear.from_linear(nn.Linear(1024, 512, bias=False).bfloat16())
    report = fp8linear.memory_report(nn.Sequential(layer))
    assert report.converted_bytes == 1024 * 512 + 4
    assert report.ratio <= 0.51


def test_torch_compile_fullgraph_matches_eager():
    torch._dynamo.reset()
    layer = FP8Linear.from_linear(nn.Linear(64, 48), weight_granularity="channel", activation_granularity="token")
    x = torch.randn(5, 64)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), layer(x))


FUSED_SCHEMES = {
    "per-tensor": dict(),
    "per-channel+per-token": dict(weight_granularity="channel", activation_granularity="token"),
    "block+group": dict(weight_granularity="block", activation_granularity="group"),
    "static": dict(activations="static"),
    "weight-only block": dict(weight_granularity="block", activations="none"),
    "e5m2 per-channel": dict(weight_granularity="channel", activation_granularity="token", fp8_dtype=torch.float8_e5m2),
}


@pytest.mark.parametrize("scheme", list(FUSED_SCHEMES))
@pytest.mark.parametrize("dtype", (*FLOAT_DTYPES, torch.float64))
@pytest.mark.parametrize("shape", [(300,), (0, 300), (1, 300), (5, 300), (16, 300), (2, 3, 300), (2, 8, 300),
                                   (17, 300), (3, 7, 300)])
@pytest.mark.parametrize("bias", [True, False])
def test_fast_path_matches_the_two_ops(monkeypatch, scheme, dtype, shape, bias, cpu_variant):
    # without autograd the forward is one native call (quantization and product composed
    # in C++; above 16 rows with the reuse of the input's dynamic quantization): it must
    # give the bits of the full path, two op calls from Python
    from fp8linear import linear as linear_module

    layer = FP8Linear.from_linear(nn.Linear(300, 136, bias=bias), **FUSED_SCHEMES[scheme])  # 136: a partial block
    if layer.config.activations == "static":
        layer.set_input_scale(0.05)
    x = (torch.randn(shape) * 3).to(dtype)
    with torch.no_grad():
        layer(x)  # settles the device's path: the next call takes the fast path where it applies
        linear_module._LAST_QUANTIZED.entry = None
        y = x.clone()  # a fresh tensor, held: its quantization stays kept while it lives
        fast = layer(y)  # quantized in the native call
        rows = y.numel() // 300
        kept = linear_module._LAST_QUANTIZED.entry is not None
        assert kept == (layer.config.activations == "dynamic" and rows > 16 and dtype != torch.float64)
        fast_reused = layer(y)  # the quantization kept by the first call, where one is kept
        monkeypatch.setattr(linear_module, "_FUSED_MAX_ROWS", -1)  # -1: 0 rows too
        monkeypatch.setattr(linear_module, "_FAST_MAX_ROWS", -1)
        linear_module._LAST_QUANTIZED.entry = None
        two_ops = layer(x)
    assert fast.dtype == dtype and fast.shape == (*shape[:-1], 136)
    assert torch.equal(fast, two_ops) and torch.equal(fast_reused, two_ops)


def calls_of_fast_path(monkeypatch, calls: list, reusing: list | None = None) -> list:
    """Appends to `calls` the input shape of each forward FP8Linear's fast path ran (those
    of ops.dynamic_linear_if_plain, the path that reuses sibling layers' quantization, to
    `reusing` instead if given)."""
    from fp8linear import ops

    def counted(original, into):
        def call(*args):
            out = original(*args)
            if out is not None:
                into.append(args[0].shape)
            return out
        return call

    monkeypatch.setattr(ops, "linear_if_plain", counted(ops.linear_if_plain, calls))
    monkeypatch.setattr(ops, "dynamic_linear_if_plain",
                        counted(ops.dynamic_linear_if_plain, calls if reusing is None else reusing))
    return calls


def test_the_fast_path_takes_every_size_without_autograd(monkeypatch):
    layer = FP8Linear.from_linear(nn.Linear(64, 32))
    static = FP8Linear.from_linear(nn.Linear(64, 32), activations="static")
    static.set_input_scale(0.1)
    with torch.no_grad():
        layer(torch.randn(1, 64))  # settles the CPU's path (the first call takes the full one)
    calls, reusing = [], []
    calls_of_fast_path(monkeypatch, calls, reusing)
    with torch.no_grad():
        for rows in (1, 16, 17, 40):
            layer(torch.randn(rows, 64))
        layer(torch.randn(2, 8, 64))
        layer(torch.randn(3, 8, 64))
        static(torch.randn(40, 64))
        layer(torch.randn(40, 64, dtype=torch.float64))  # converted by the full path
    # up to 16 rows, and layers without dynamic activations: one ops.linear_if_plain call;
    # above 16 rows with dynamic activations: the call that reuses sibling layers' quantization
    assert calls == [(1, 64), (16, 64), (2, 8, 64), (40, 64)]
    assert reusing == [(17, 64), (40, 64), (3, 8, 64)]
    layer(torch.randn(40, 64, requires_grad=True)).sum().backward()  # autograd keeps the two ops
    assert len(calls) == 4 and len(reusing) == 3


@pytest.mark.parametrize("rows", [2, 40])  # 40: above 16 rows, the fast path that reuses the input's quantization
def test_the_fast_path_steps_aside_where_it_would_differ(monkeypatch, rows):
    # forward's fast path (one native call, fewest checks) must give what the full path
    # gives, and leave to it whatever it does not handle: autocast, torch function modes,
    # tensor subclasses, autograd, float64, wrong shapes, frozen-weight and missing-scale errors
    from torch.overrides import TorchFunctionMode
    from fp8linear import ops

    calls = calls_of_fast_path(monkeypatch, [])
    layer = FP8Linear.from_linear(nn.Linear(64, 32), weight_granularity="channel", activation_granularity="token")
    x = torch.randn(rows, 64)
    # the op the full path's forward shows to modes and subclasses: one ops.linear up to 16
    # rows, quantize_fp8 (unless kept from the call before) and scaled_mm above
    full_path_op = "fp8linear.linear.default" if rows <= 16 else "fp8linear.scaled_mm"
    with torch.no_grad():
        layer(x)  # the first call on a device settles its path (and warns once)
        calls.clear()
        expected = layer(x)
        assert calls == [(rows, 64)]
        calls.clear()
        assert torch.equal(ops.linear(x, layer.weight, layer.weight_scale, layer.bias, None, 2, 1), expected)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert layer(x).dtype == torch.bfloat16
        assert layer(x.double()).dtype == torch.float64

        class Recorder(TorchFunctionMode):
            def __init__(self):
                super().__init__()
                self.seen = []

            def __torch_function__(self, func, types, args=(), kwargs=None):
                self.seen.append(str(func))
                return func(*args, **(kwargs or {}))

        with Recorder() as mode:
            assert torch.equal(layer(x), expected)
        assert any(full_path_op in seen for seen in mode.seen)

        class Logged(torch.Tensor):
            seen = []

            @classmethod
            def __torch_function__(cls, func, types, args=(), kwargs=None):
                cls.seen.append(str(func))
                return super().__torch_function__(func, types, args, kwargs or {})

        out = layer(x.as_subclass(Logged))
        assert type(out) is Logged and any(full_path_op in seen for seen in Logged.seen)
        with pytest.raises(ValueError, match="in_features=64"):
            layer(torch.randn(rows, 63))
        with pytest.raises(ValueError, match="in_features=64, got shape \\(\\)"):
            layer(torch.tensor(1.0))
    assert calls == []
    layer(x)  # grad mode, nothing requires grad: fast
    assert len(calls) == 1
    leaf = x.clone().requires_grad_()
    layer(leaf).sum().backward()
    assert leaf.grad is not None and len(calls) == 1
    layer.weight.requires_grad_(True)
    with pytest.raises(RuntimeError, match="frozen"), torch.no_grad():
        layer(x)
    layer.weight.requires_grad_(False)

    static = FP8Linear.from_linear(nn.Linear(64, 32), activations="static")
    calls.clear()
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="input_scale is not set"):
            static(x)
        static.set_input_scale(0.05)
        static(x)
        assert len(calls) == 1
        static.clear_input_scale()
        with pytest.raises(RuntimeError, match="input_scale is not set"):
            static(x)


@pytest.mark.parametrize("rows", [2, 40])
def test_the_fast_path_steps_aside_for_dispatch_modes_scales_with_grad_and_k_0(monkeypatch, rows):
    from torch.utils._python_dispatch import TorchDispatchMode

    calls = calls_of_fast_path(monkeypatch, [])
    layer = FP8Linear.from_linear(nn.Linear(64, 32))
    x = torch.randn(rows, 64)
    with torch.no_grad():
        layer(x)  # settles the device
        calls.clear()
        expected = layer(x)
        with torch.inference_mode():
            assert torch.equal(layer(x), expected)
        assert len(calls) == 2

        class Recorder(TorchDispatchMode):
            def __init__(self):
                super().__init__()
                self.seen = []

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                self.seen.append(str(func))
                return func(*args, **(kwargs or {}))

        with Recorder() as mode:  # sees the ops the composite is made of, as on the full path
            assert torch.equal(layer(x.clone()), expected)  # a fresh tensor: no kept quantization
        assert "fp8linear.quantize_fp8.default" in mode.seen and "fp8linear.scaled_mm.default" in mode.seen
        assert len(calls) == 2
    # a scale that requires grad under grad mode: the full path's output records it
    layer.weight_scale.requires_grad_(True)
    out = layer(x)
    assert out.requires_grad and len(calls) == 2
    layer.weight_scale.requires_grad_(False)
    with torch.no_grad():
        empty = FP8Linear.from_linear(nn.Linear(0, 5))  # K = 0: the full path, as before
        assert torch.equal(empty(torch.randn(rows, 0)), empty.bias.expand(rows, 5))
    assert len(calls) == 2


def test_a_config_of_another_fp8_dtype_than_the_weight_is_refused():
    # the native paths quantize activations to the weight's dtype, the Python path to the
    # config's: they must not differ
    from dataclasses import replace

    layer = FP8Linear.from_linear(nn.Linear(40, 24))
    with pytest.raises(ValueError, match="fp8_dtype must be the weight's dtype"):
        layer.config = replace(layer.config, fp8_dtype=torch.float8_e5m2)
    assert layer.config.fp8_dtype == torch.float8_e4m3fn


def test_reassigning_the_config_keeps_the_fast_path_in_step():
    layer = FP8Linear.from_linear(nn.Linear(40, 24), weight_granularity="channel", activation_granularity="token")
    weight_only = FP8Linear.from_fp8(layer.weight, layer.weight_scale, bias=layer.bias,
                                     weight_granularity="channel", activations="none")
    layer.config = weight_only.config
    x = torch.randn(3, 40)
    with torch.no_grad():
        assert torch.equal(layer(x), weight_only(x))
    with pytest.raises(TypeError, match="FP8Config"):
        layer.config = {"activations": "none"}


def test_layers_pickled_before_the_fast_path_still_run():
    # a pickle of FP8Linear made before the fast path has its readiness flag under the old
    # attribute name and none of the fast path's fields
    layer = FP8Linear.from_linear(nn.Linear(32, 16), activations="static")
    layer.set_input_scale(0.1)
    x = torch.randn(3, 32)
    expected = layer(x)
    state = layer.__getstate__()
    state["_input_scale_ready"] = state.pop("_scale_ready")
    state["config"] = state.pop("_config")
    del state["_fast_scale"], state["_linear_codes"]
    old = FP8Linear.__new__(FP8Linear)
    old.__setstate__(state)
    assert old.input_scale_ready and torch.equal(old(x), expected)


def test_linear_op_checks_and_opcheck():
    from fp8linear import ops

    layer = FP8Linear.from_linear(nn.Linear(40, 24), weight_granularity="channel", activation_granularity="token")
    x, w, s, b = torch.randn(3, 40), layer.weight, layer.weight_scale, layer.bias
    with pytest.raises(ValueError, match="in_features=40"):
        ops.linear(torch.randn(3, 41), w, s, b, None, 2, 1)
    with pytest.raises(ValueError, match="activations must be"):
        ops.linear(x, w, s, b, None, 3, 1)
    with pytest.raises(ValueError, match="granularity must be"):
        ops.linear(x, w, s, b, None, 2, 5)
    with pytest.raises(ValueError, match="activation_scale is needed"):
        ops.linear(x, w, s, b, None, 1, 0)
    empty = FP8Linear.from_linear(nn.Linear(0, 5))  # K = 0: the bias
    out = ops.linear(torch.randn(2, 3, 0), empty.weight, empty.weight_scale, empty.bias, None, 2, 0)
    assert out.shape == (2, 3, 5) and torch.equal(out, empty.bias.expand(2, 3, 5))
    # test_schema would compare fp8 inputs with arithmetic torch lacks on the CPU (as for scaled_mm)
    tests = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.fp8linear.linear.default, (x, w, s, b, None, 2, 1), test_utils=tests)
    torch.library.opcheck(torch.ops.fp8linear.linear.default, (x.bfloat16().unsqueeze(0), w, s, None, torch.ones(()), 0, 0),
                          test_utils=tests)
