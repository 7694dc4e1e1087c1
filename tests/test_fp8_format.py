"""csrc/fp8.h: every code decodes exactly; encoding matches ml_dtypes and torch."""
import ml_dtypes
import numpy as np
import pytest
import torch

import fp8linear
from conftest import FP8_DTYPES, bytes_of

ML_DTYPES = {torch.float8_e4m3fn: ml_dtypes.float8_e4m3fn, torch.float8_e5m2: ml_dtypes.float8_e5m2}


@pytest.mark.parametrize("dtype", FP8_DTYPES)
def test_every_code_decodes_exactly(dtype, cpu_variant):
    # a [256, 1] of every code times b = [[1.0]] with unit scales returns each code's value
    codes = torch.arange(256, dtype=torch.uint8).view(dtype).reshape(256, 1)
    one = torch.tensor([[1.0]]).to(dtype)
    unit = torch.ones(())
    out = fp8linear.scaled_mm(codes, one, unit, unit, out_dtype=torch.float32).flatten()
    expected = torch.from_numpy(np.arange(256, dtype=np.uint8).view(ML_DTYPES[dtype]).astype(np.float32))
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(out), nan)
    assert torch.equal(out[~nan], expected[~nan])
    assert torch.equal(out[~nan], codes.flatten().float()[~nan])  # torch agrees
    # signs survive (a sum starting at +0 cannot keep -0, so zeros are left out)
    nonzero = ~nan & (expected != 0)
    assert torch.equal(torch.signbit(out[nonzero]), torch.signbit(expected[nonzero]))


@pytest.mark.parametrize("dtype", FP8_DTYPES)
@pytest.mark.parametrize("k", [1, 80])
@pytest.mark.parametrize("m", [3, 8, 40, 300])  # (AVX512-BF16) dot, eight-row, skinny, tile kernels
@pytest.mark.parametrize("activations", ["fp8", "bf16"])  # W8A8, weight-only
def test_every_weight_code_decodes_exactly(dtype, k, m, activations, cpu_variant):
    # the weight side, in a Linear weight's layout (b = w.t(), rows of w contiguous): w's row
    # n holds code n at k-index n % k and zeros elsewhere, so with a = ones each output is
    # that code's value (k = 80: the codes spread over a row, and a tail past 64)
    codes = torch.arange(256, dtype=torch.uint8)
    w = torch.zeros(256, k, dtype=torch.uint8)
    w[torch.arange(256), torch.arange(256) % k] = codes
    a = torch.ones(m, k).to(dtype if activations == "fp8" else torch.bfloat16)
    unit = torch.ones(())
    out = fp8linear.scaled_mm(a, w.view(dtype).t(), unit, unit, out_dtype=torch.float32)
    expected = torch.from_numpy(np.arange(256, dtype=np.uint8).view(ML_DTYPES[dtype]).astype(np.float32))
    nan = torch.isnan(expected)
    for row in out:
        assert torch.equal(torch.isnan(row), nan)
        assert torch.equal(row[~nan], expected[~nan])


def _interesting_floats(dtype):
    fmax = torch.finfo(dtype).max
    tiny = torch.finfo(dtype).smallest_normal
    values = [0.0, -0.0, 1.0, -1.0, 1.0625 + 2**-20, fmax, -fmax, fmax * 1.03, fmax * 1.0712, 1e30, -1e30,
              float("inf"), float("-inf"), float("nan"), 1e-40, -1e-40, tiny, tiny / 2, tiny / 3, tiny * 0.75]
    # every code's value and the midpoints between neighbours (ties must go to even)
    codes = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    finite = codes[torch.isfinite(codes)].unique()
    midpoints = (finite[1:].double() + finite[:-1].double()) / 2
    around = torch.cat([midpoints, midpoints.nextafter(torch.tensor(np.inf, dtype=torch.float64)),
                        midpoints.nextafter(torch.tensor(-np.inf, dtype=torch.float64))]).float()
    return torch.cat([torch.tensor(values), finite, around])


@pytest.mark.parametrize("dtype", FP8_DTYPES)
def test_encoding_matches_ml_dtypes(dtype, cpu_variant):
    x = _interesting_floats(dtype)
    q, _ = fp8linear.quantize_fp8(x, torch.ones(()), dtype=dtype)
    fmax = float(torch.finfo(dtype).max)
    # ml_dtypes rounds once but does not saturate: clamp first, as the contract says
    expected = np.clip(x.numpy(), -fmax, fmax).astype(ML_DTYPES[dtype]).view(np.uint8)
    got = bytes_of(q).numpy()
    nan = np.isnan(x.numpy())
    assert np.array_equal(got[~nan], expected[~nan])
    assert torch.isnan(q.float()[torch.from_numpy(nan)]).all()


def test_double_rounding_example_rounds_once():
    # 1.0625 + 2^-20 rounds to 1.125 directly but to 1.0 through float16 (FP8-FACTS.md)
    q, _ = fp8linear.quantize_fp8(torch.tensor([1.0625 + 2**-20]), torch.ones(()))
    assert q.float().item() == 1.125


def test_saturation_and_ties_at_the_top_of_e4m3():
    x = torch.tensor([464.0, 465.0, 480.0, float("inf"), -464.0, float("-inf")])
    q, _ = fp8linear.quantize_fp8(x, torch.ones(()))
    assert q.float().tolist() == [448.0, 448.0, 448.0, 448.0, -448.0, -448.0]
