"""FP8Linear and the ops behave as nn.Linear and torch ops do on inputs off the main road:
meta tensors, mixed devices, autocast, model.double(), wrong argument types, and the
one-time warning naming the user's line."""
import importlib
import warnings

import pytest
import torch
from torch import nn

import fp8linear
from fp8linear import FP8Linear

backend_module = importlib.import_module("fp8linear.backend")  # fp8linear.backend is also a function

FP8 = torch.float8_e4m3fn


def small_layer(**options):
    torch.manual_seed(0)
    layer = FP8Linear.from_linear(nn.Linear(33, 17), **options)
    if options.get("activations") == "static":
        layer.set_input_scale(0.01)
    return layer


# ---------------------------------------------------------------------------------------
# meta tensors and mixed devices


@pytest.mark.parametrize("scheme", list(fp8linear.SCHEMES))
def test_a_model_on_meta_computes_shapes_on_meta(scheme):
    model = nn.Sequential(small_layer(**fp8linear.SCHEMES[scheme])).to("meta")
    assert model[0].weight.device.type == "meta" and model[0].weight.dtype == FP8
    out = model(torch.randn(4, 5, 33, device="meta"))
    assert out.device.type == "meta" and out.shape == (4, 5, 17) and out.dtype == torch.float32


def test_a_cpu_input_to_a_meta_model_raises_as_nn_linear_does():
    # before: uninitialized CPU memory came back (values like 3.6e27, different each call)
    with pytest.raises(RuntimeError, match="device"):
        nn.Linear(33, 17).to("meta")(torch.randn(4, 33))
    model = nn.Sequential(small_layer()).to("meta")
    with pytest.raises(RuntimeError, match="must be on a's device cpu, got meta"):
        model(torch.randn(4, 33))


def test_ops_refuse_an_operand_on_meta_among_cpu_ones():
    a, scale_a = fp8linear.quantize_fp8(torch.randn(4, 33))
    w, scale_w = fp8linear.quantize_fp8(torch.randn(17, 33))
    bias = torch.randn(17)
    operands = {"b": w.t(), "scale_a": scale_a, "scale_b": scale_w, "bias": bias}
    for name in operands:
        moved = dict(operands, **{name: operands[name].to("meta")})
        with pytest.raises(RuntimeError, match=f"{name} must be on a's device cpu, got meta"):
            fp8linear.scaled_mm(a, moved["b"], moved["scale_a"], moved["scale_b"], bias=moved["bias"])
    with pytest.raises(RuntimeError, match="a's device meta, got cpu"):
        fp8linear.scaled_mm(a.to("meta"), w.t(), scale_a, scale_w)
    with pytest.raises(RuntimeError, match="scale must be on x's device cpu, got meta"):
        fp8linear.quantize_fp8(torch.randn(4, 33), torch.ones((), device="meta"))


def test_ops_on_meta_return_meta():
    q, scale = fp8linear.quantize_fp8(torch.randn(4, 33, device="meta"), granularity="row")
    assert q.device.type == "meta" and q.dtype == FP8 and scale.shape == (4, 1)
    w = torch.empty(17, 33, dtype=FP8, device="meta")
    out = fp8linear.scaled_mm(q, w.t(), scale, torch.ones((), device="meta"),
                              bias=torch.zeros(17, device="meta"), out_dtype=torch.float16)
    assert out.device.type == "meta" and out.shape == (4, 17) and out.dtype == torch.float16


@pytest.mark.parametrize("scheme", list(fp8linear.SCHEMES))
@pytest.mark.parametrize("shape", [(33,), (5, 33), (2, 3, 33), (2, 1, 3, 33), (0, 33), (2, 0, 33)])
def test_any_number_of_leading_dimensions(scheme, shape):
    # as nn.Linear: [..., in_features] -> [..., out_features]
    layer = small_layer(**fp8linear.SCHEMES[scheme])
    x = torch.randn(shape)
    out = layer(x)
    assert out.shape == shape[:-1] + (layer.out_features,) and out.dtype == x.dtype
    rows = x.reshape(-1, 33)
    assert torch.equal(out.reshape(-1, layer.out_features), layer(rows))  # the same rows as one 2-D call


# ---------------------------------------------------------------------------------------
# autocast and dtype conversions of the model


@pytest.mark.parametrize("scheme", list(fp8linear.SCHEMES))
@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16])
def test_autocast_gives_the_dtype_nn_linear_gives(scheme, autocast_dtype):
    layer = small_layer(**fp8linear.SCHEMES[scheme])
    x = torch.randn(3, 33)
    with torch.autocast("cpu", dtype=autocast_dtype):
        expected_dtype = nn.Linear(33, 17)(x).dtype
        out = layer(x)
    assert expected_dtype == autocast_dtype and out.dtype == autocast_dtype
    assert torch.equal(out, layer(x.to(autocast_dtype)))  # computed in the autocast dtype
    assert layer(x).dtype == torch.float32  # and nothing sticks once autocast is off


def test_model_double_keeps_working():
    # before: model.double() converted the bias to float64 and every later forward failed
    layer = small_layer()
    model = nn.Sequential(layer, nn.ReLU()).double()
    assert layer.weight.dtype == FP8 and layer.weight_scale.dtype == torch.float32
    assert layer.bias.dtype == torch.float32  # the kernels add a float32/bf16/fp16 bias
    x = torch.randn(5, 33, dtype=torch.float64)
    out = model(x)
    assert out.dtype == torch.float64
    # float64 inputs are computed in float32
    assert torch.equal(out, torch.relu(layer(x.float())).double())
    assert model.float()(x.float()).dtype == torch.float32


def test_model_half_and_bfloat16_convert_the_bias_as_nn_linear_does():
    layer = small_layer()
    layer.to(torch.bfloat16)
    assert layer.bias.dtype == torch.bfloat16 and layer.weight.dtype == FP8
    assert layer(torch.randn(2, 33, dtype=torch.bfloat16)).dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------
# clear errors


def test_ops_name_the_argument_of_a_wrong_type():
    x = torch.randn(4, 8)
    q, s = fp8linear.quantize_fp8(x)
    w, sw = fp8linear.quantize_fp8(torch.randn(3, 8))
    with pytest.raises(TypeError, match="quantize_fp8: x must be a torch.Tensor, got str"):
        fp8linear.quantize_fp8("x")
    with pytest.raises(TypeError, match="quantize_fp8: scale must be a torch.Tensor or None, got float"):
        fp8linear.quantize_fp8(x, 0.5)
    with pytest.raises(TypeError, match="quantize_fp8: dtype must be a torch.dtype, got str"):
        fp8linear.quantize_fp8(x, dtype="float8_e4m3fn")
    with pytest.raises(ValueError, match="granularity must be one of"):
        fp8linear.quantize_fp8(x, granularity=None)
    with pytest.raises(TypeError, match="scaled_mm: a must be a torch.Tensor, got NoneType"):
        fp8linear.scaled_mm(None, w.t(), s, sw)
    with pytest.raises(TypeError, match="scaled_mm: scale_b must be a torch.Tensor, got float"):
        fp8linear.scaled_mm(q, w.t(), s, 1.0)
    with pytest.raises(TypeError, match="scaled_mm: bias must be a torch.Tensor or None, got list"):
        fp8linear.scaled_mm(q, w.t(), s, sw, bias=[0.0, 0.0, 0.0])
    with pytest.raises(TypeError, match="scaled_mm: out_dtype must be a torch.dtype, got str"):
        fp8linear.scaled_mm(q, w.t(), s, sw, out_dtype="bfloat16")


def test_layer_errors_name_the_argument():
    with pytest.raises(ValueError, match="linear.weight must be float32, bfloat16 or float16, got torch.float64"):
        FP8Linear.from_linear(nn.Linear(4, 3).double())
    static = small_layer(activations="static")
    with pytest.raises(ValueError, match="expected one element, got shape \\[2\\]"):
        static.set_input_scale(torch.ones(2))
    with pytest.raises(TypeError, match="input_scale must be a float or a one-element tensor, got str"):
        static.set_input_scale("0.1")
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="input_scale must be finite and > 0"):
            static.set_input_scale(bad)
    assert static.input_scale_ready and float(static.input_scale) == pytest.approx(0.01)  # unchanged
    with pytest.raises(ValueError, match="in_features=33, got shape \\(\\)"):
        small_layer()(torch.tensor(2.0))


# ---------------------------------------------------------------------------------------
# the one-time warning


def test_the_path_warning_names_the_callers_line(monkeypatch):
    monkeypatch.setattr(backend_module, "_warned", set())
    monkeypatch.setattr(backend_module, "_settled", set())  # forward's fast path skips settled devices
    model = nn.Sequential(nn.Sequential(small_layer()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(torch.randn(2, 33))  # the line the warning must point at
    path_warnings = [w for w in caught if issubclass(w.category, fp8linear.FP8PathWarning)]
    assert len(path_warnings) == 1
    assert path_warnings[0].filename == __file__, path_warnings[0].filename
