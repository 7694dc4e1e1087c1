"""Training through FP8Linear: the input (and a trainable bias) gets the gradient of the
dequantized layer; the fp8 weight is frozen and asking for its gradient is an error."""
import warnings

import pytest
import torch
from torch import nn

import fp8linear
from fp8linear import FP8Linear
from fp8linear.backend import FP8PathWarning

SCHEMES = list(fp8linear.SCHEMES)


def make_layer(scheme, in_features=40, out_features=24, bias=True, seed=0):
    torch.manual_seed(seed)
    layer = FP8Linear.from_linear(nn.Linear(in_features, out_features, bias=bias), **fp8linear.SCHEMES[scheme])
    if scheme == "static":
        layer.set_input_scale(0.02)
    return layer


def dequantized_weight(layer):
    scale = layer.weight_scale.double()
    return layer.weight.double() * (scale if scale.dim() else scale.reshape(()))


def reference_input_grad(layer, grad_out):
    """grad_out @ W_deq in float64: the activation quantization passed through as identity."""
    return grad_out.double().reshape(-1, layer.out_features) @ dequantized_weight(layer)


def relative_error(got, expected):
    return ((got.double() - expected).norm() / expected.norm()).item()


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 1e-2)])
@pytest.mark.parametrize("shape", [(7, 40), (2, 3, 40), (1, 40)])
def test_input_gradient_is_that_of_the_dequantized_layer(scheme, dtype, tolerance, shape):
    layer = make_layer(scheme)
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    out = layer(x)
    assert out.requires_grad and out.dtype == dtype
    grad_out = torch.randn(out.shape, dtype=dtype)
    out.backward(grad_out)
    assert x.grad is not None and x.grad.dtype == dtype and x.grad.shape == x.shape
    expected = reference_input_grad(layer, grad_out).reshape(shape)
    assert relative_error(x.grad, expected) <= tolerance
    # the forward values are those of the no-grad path
    with torch.no_grad():
        assert torch.equal(out.detach(), layer(x.detach()))


def test_gradcheck_of_a_weight_only_layer():
    # weight-only is linear in x: the numerical Jacobian (float64 input, computed in
    # float32) must match the analytical one
    layer = make_layer("weight-only", in_features=12, out_features=5)
    x = torch.randn(3, 12, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(layer, (x,), eps=1e-2, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_gradients_reach_the_layers_upstream(scheme):
    # a trainable nn.Linear before the FP8Linear: its gradients are no longer None,
    # and equal those through an nn.Linear holding the dequantized weight
    torch.manual_seed(1)
    first = nn.Linear(16, 40)
    fp8 = make_layer(scheme)
    model = nn.Sequential(first, nn.GELU(), fp8)
    x = torch.randn(6, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "autograd kernel was not registered" warning
        warnings.simplefilter("ignore", FP8PathWarning)
        model(x).square().sum().backward()
    assert first.weight.grad is not None and first.bias.grad is not None

    twin_first = nn.Linear(16, 40)
    twin_first.load_state_dict(first.state_dict())
    dense = nn.Linear(40, 24)
    with torch.no_grad():
        dense.weight.copy_(dequantized_weight(fp8).float())
        dense.bias.copy_(fp8.bias)
    hidden = nn.GELU()(twin_first(x))
    # the loss's gradient at the output is taken from the FP8 model's own output, so the
    # comparison isolates the backward pass through the FP8Linear
    with torch.no_grad():
        grad_out = 2 * model(x)
    (dense(hidden) * grad_out).sum().backward()
    tolerance = 1e-5 if scheme == "weight-only" else 1e-4
    assert relative_error(first.weight.grad, twin_first.weight.grad.double()) <= tolerance


def test_trainable_bias_gets_its_gradient():
    layer = make_layer("per-channel")
    layer.bias.requires_grad_(True)
    x = torch.randn(5, 40)  # no input gradient asked for: the bias alone turns autograd on
    grad_out = torch.randn(5, 24)
    layer(x).backward(grad_out)
    torch.testing.assert_close(layer.bias.grad, grad_out.sum(0))


def test_asking_for_the_fp8_weight_gradient_is_a_clear_error():
    layer = make_layer("per-tensor")
    layer.weight.requires_grad_(True)
    with pytest.raises(RuntimeError, match="weight is fp8 and frozen"):
        layer(torch.randn(2, 40))


def test_no_autograd_graph_without_a_gradient_to_compute():
    layer = make_layer("per-tensor")
    out = layer(torch.randn(2, 40))
    assert not out.requires_grad and out.grad_fn is None
    with torch.no_grad():
        assert layer(torch.randn(2, 40, requires_grad=True)).grad_fn is None


@pytest.mark.parametrize("scheme", ["per-channel", "weight-only"])
def test_input_gradient_under_torch_compile(scheme):
    torch._dynamo.reset()
    layer = make_layer(scheme)
    model = nn.Sequential(nn.Linear(16, 40), layer)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(4, 16)
    compiled(x).sum().backward()
    compiled_grad = model[0].weight.grad.clone()
    model[0].weight.grad = None
    model(x).sum().backward()
    torch.testing.assert_close(compiled_grad, model[0].weight.grad)
    torch._dynamo.reset()


def test_a_lora_adapter_on_a_frozen_fp8_base_trains():
    # the use case: a low-rank adapter beside a frozen FP8 layer learns to fit a target
    torch.manual_seed(2)
    base = make_layer("per-channel", in_features=32, out_features=16)
    down, up = nn.Linear(32, 4, bias=False), nn.Linear(4, 16, bias=False)
    nn.init.zeros_(up.weight)
    target = nn.Linear(32, 16)
    x = torch.randn(64, 32)
    with torch.no_grad():
        y = target(x)
    optimizer = torch.optim.Adam([*down.parameters(), *up.parameters()], lr=3e-2)
    losses = []
    for _ in range(60):
        optimizer.zero_grad()
        loss = (base(x) + up(down(x)) - y).square().mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    assert base.weight.grad is None
