"""torch.compile of converted models: one graph (fullgraph), the fp8 ops inside it as
custom ops (traced through their fake implementations), outputs equal to eager."""
import pytest
import torch
from torch import nn

import fp8linear
from fp8linear import FP8Linear
from tiny_models import logits, tiny_llama, token_ids

SCHEMES = list(fp8linear.SCHEMES)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def converted(scheme):
    model = tiny_llama()
    fp8linear.quantize_model(model, "fp8", **fp8linear.SCHEMES[scheme])
    if scheme == "static":
        fp8linear.calibrate(model, [token_ids(seed=7)])
    return model


@pytest.mark.parametrize("scheme", SCHEMES)
def test_converted_llama_fullgraph_equals_eager(scheme):
    model = converted(scheme)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    for length in (24, 9):  # a second shape recompiles (or runs a dynamic graph): still equal
        ids = token_ids(length=length)
        assert torch.equal(logits(compiled, ids), logits(model, ids))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_fp8_ops_are_in_the_graph(scheme):
    graphs = []

    def record(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    layer = FP8Linear.from_linear(nn.Linear(64, 48), **fp8linear.SCHEMES[scheme])
    if scheme == "static":
        layer.set_input_scale(0.01)
    x = torch.randn(3, 5, 64)
    assert torch.equal(torch.compile(layer, backend=record, fullgraph=True)(x), layer(x))
    assert len(graphs) == 1
    targets = {str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"}
    assert "fp8linear.scaled_mm" in targets
    quantize_op = "fp8linear.quantize_fp8_blocks" if scheme == "block" else "fp8linear.quantize_fp8"
    assert (quantize_op in targets) == (scheme != "weight-only")


def test_dynamic_rows_across_the_fused_size():
    # eager forwards of up to 16 rows are one fused op call; traced ones keep the two ops,
    # without a guard on the row count
    layer = FP8Linear.from_linear(nn.Linear(64, 48), weight_granularity="channel", activation_granularity="token")
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True, dynamic=True)
    for rows in (5, 40, 3):
        x = torch.randn(rows, 64)
        assert torch.equal(compiled(x), layer(x))


def test_inductor_runs_fp8linear():
    """The default backend: inductor cannot fuse into the custom ops, so the numbers are the eager ones."""
    layer = FP8Linear.from_linear(nn.Linear(64, 48), weight_granularity="channel", activation_granularity="token")
    x = torch.randn(5, 64)
    assert torch.equal(torch.compile(layer, fullgraph=True)(x), layer(x))
