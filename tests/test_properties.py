"""Property-based tests (hypothesis) of both ops against fp8linear.reference, every CPU variant.

Shapes (0, 1, odd, tails of every kernel's blocks), strides (transposed, sliced out of a
larger tensor whose other elements are NaN or huge, strided, expanded rows), dtypes, both fp8
formats, granularities and values (normal, huge, tiny, subnormal, inf and NaN) are drawn
together, so that combinations no hand-written case lists get tried. Quantization must be
bit-exact; products meet the tolerances of tests/test_scaled_mm.py against the float64
reference.

Each example also draws the CPU variant it runs on, so that every variant sees examples of its
own. Deterministic (derandomize=True): every run tries the same examples.
FP8LINEAR_PROPERTY_EXAMPLES sets how many per test (`make sanitize` runs more than the normal suite's
1000 and 500).
"""
import math
import os

import torch
from hypothesis import HealthCheck, assume, given, settings, strategies as st

import fp8linear
from fp8linear import reference
from fp8linear._native import native
from conftest import FLOAT_DTYPES, FP8_DTYPES, assert_same_fp8, forced_cpu_variant, relative_error
from test_scaled_mm import TOLERANCE


def properties(default_examples):
    """Deterministic settings; FP8LINEAR_PROPERTY_EXAMPLES (if set) is the number of examples."""
    return settings(
        derandomize=True,
        deadline=None,
        max_examples=int(os.environ.get("FP8LINEAR_PROPERTY_EXAMPLES", default_examples)),
        database=None,  # derandomized: nothing to remember between runs, and no .hypothesis/ in the tree
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


VARIANTS = st.sampled_from(native().cpu_variants_supported())

# Edges of the kernels' blocks (16 rows, 16/32/64 k and weight rows, 64 rows of the AMX
# stream kernel) and arbitrary sizes; 0 last: hypothesis favours the first elements, and an
# empty operand is one case among many.
EDGE_SIZES = [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 129, 0]


def sizes(largest):
    return st.one_of(st.sampled_from([s for s in EDGE_SIZES if s <= largest]), st.integers(1, largest))


def fmax(dtype):
    return float(torch.finfo(dtype).max)


def generator(seed):
    return torch.Generator().manual_seed(seed)


# ---- quantize_fp8 -------------------------------------------------------------------------

def _float_values(shape, x_dtype, fp8_dtype, kind, scale, gen):
    """Values of `kind` in float32 (converted to x_dtype by the caller)."""
    x = torch.randn(shape, generator=gen)
    if kind == "normal":
        return x * 2.0 ** int(torch.randint(-12, 12, (), generator=gen))
    if kind == "wide":  # each element its own binade: subnormal fp8 results, saturation, underflow to 0
        return x * torch.exp2(torch.randint(-40, 40, shape, generator=gen).float())
    if kind == "huge":  # near the largest finite value of x_dtype
        return x.sign() * fmax(x_dtype) * torch.empty(shape).uniform_(0.25, 1.0, generator=gen)
    if kind == "tiny":  # subnormals of x_dtype (bf16 and float32 share theirs)
        smallest_normal = torch.finfo(x_dtype).smallest_normal
        return x * smallest_normal * torch.exp2(-torch.randint(0, 12, shape, generator=gen).float())
    if kind == "codes":
        # fp8 values and the midpoints between neighbours, times the static scale (if any): x / scale
        # then lands on a code or a tie (exactly, where the product is exact in x_dtype: the scale
        # kinds "power_of_two" and "odd"), so ties-to-even and a true division are what count
        codes = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).view(fp8_dtype).float()
        codes = torch.where(torch.isfinite(codes), codes, torch.zeros_like(codes))
        neighbour = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).view(fp8_dtype).float()
        neighbour = torch.where(torch.isfinite(neighbour), neighbour, codes)
        midpoint = torch.rand(shape, generator=gen) < 0.5
        values = torch.where(midpoint, (codes.double() + neighbour.double()) / 2, codes.double())
        return values * (1.0 if scale is None else scale.double())
    raise AssertionError(kind)


SPECIALS = [float("inf"), float("-inf"), float("nan"), -0.0, 0.0]


def _with_specials(x, probability, gen):
    if probability == 0 or x.numel() == 0:
        return x
    picked = torch.rand(x.shape, generator=gen) < probability
    which = torch.randint(0, len(SPECIALS), x.shape, generator=gen)
    specials = torch.tensor(SPECIALS)[which]
    return torch.where(picked, specials, x)


def _laid_out(values, layout, filler, gen):
    """`values` (any shape) in a tensor with the layout's strides; the elements around a view are
    `filler` (NaN, or the largest finite value, which a stray read would make the amax)."""
    if values.dim() == 0 or layout == "contiguous":
        return values.clone()
    if layout == "transposed":  # every dimension reversed in memory
        order = list(reversed(range(values.dim())))
        return values.permute(order).contiguous().permute(order)
    if layout == "sliced":  # an inner window of a larger tensor
        padding = [int(p) for p in torch.randint(1, 4, (values.dim(),), generator=gen)]
        big = torch.full([s + p for s, p in zip(values.shape, padding)], filler, dtype=values.dtype)
        window = big[tuple(slice(p // 2 + p % 2, p // 2 + p % 2 + s) for s, p in zip(values.shape, padding))]
        window.copy_(values)
        return window
    if layout == "strided":  # every other element of the last dimension
        big = torch.full((*values.shape[:-1], 2 * values.shape[-1]), filler, dtype=values.dtype)
        view = big[..., ::2]
        view.copy_(values)
        return view
    if layout == "expanded":  # the first index of dimension 0 repeated (stride 0)
        return values[:1].expand(values.shape)
    raise AssertionError(layout)


@st.composite
def quantize_cases(draw):
    dims = draw(st.sampled_from([2, 1, 3, 0]))
    if dims == 3:
        shape = (draw(sizes(5)), draw(sizes(9)), draw(sizes(70)))
    elif dims == 2:
        shape = (draw(sizes(40)), draw(sizes(300)))
    elif dims == 1:
        shape = (draw(st.one_of(sizes(300), st.sampled_from([1023, 1024, 1025, 4097]))),)
    else:
        shape = ()
    x_dtype = draw(st.sampled_from(FLOAT_DTYPES))
    fp8_dtype = draw(st.sampled_from(FP8_DTYPES))
    granularity = "tensor" if dims == 0 else draw(st.sampled_from(["tensor", "row"]))
    kind = draw(st.sampled_from(["codes", "normal", "wide", "huge", "tiny"]))
    specials = draw(st.sampled_from([0.0, 0.0, 0.01, 0.2, 1.0]))  # 1.0: only inf, NaN and zeros
    layout = draw(st.sampled_from(["contiguous", "sliced", "transposed", "strided", "expanded"]))
    filler = draw(st.sampled_from([float("nan"), fmax(x_dtype)]))
    # None: dynamic. A static scale: a power of two, 3, 5 or 7 times one (x = tie * scale is then
    # exact in every x_dtype, and 1 / scale is not: a multiplication by it rounds differently),
    # or any float.
    static = draw(st.sampled_from([None, "odd", None, "power_of_two", "any"]))
    scale_exponent = draw(st.integers(-24, 24))
    seed = draw(st.integers(0, 2**32 - 1))
    return draw(VARIANTS), (shape, x_dtype, fp8_dtype, granularity, kind, specials, layout, filler, static,
                            scale_exponent, seed)


def _static_scale(shape, granularity, static, exponent, gen):
    shape = () if granularity == "tensor" else (*shape[:-1], 1)
    if static == "power_of_two":
        scale = torch.full(shape, 2.0**exponent)
    elif static == "odd":
        scale = torch.tensor([3.0, 5.0, 7.0])[torch.randint(0, 3, shape, generator=gen)] * 2.0**exponent
    else:
        scale = torch.empty(shape).uniform_(1.0, 2.0, generator=gen) * 2.0**exponent
    return scale.float()


@properties(1000)  # ~1 s on 2 idle cores (300 missed a multiplication by 1 / scale in the bf16 loop; 500 found it)
@given(variant_and_case=quantize_cases())
def test_quantize_matches_reference_bit_for_bit(variant_and_case):
    variant, case = variant_and_case
    with forced_cpu_variant(variant):
        _check_quantize(*case)


def _check_quantize(shape, x_dtype, fp8_dtype, granularity, kind, specials, layout, filler, static, exponent, seed):
    gen = generator(seed)
    scale = None if static is None else _static_scale(shape, granularity, static, exponent, gen)
    values = _float_values(shape, x_dtype, fp8_dtype, kind, scale, gen)
    values = _with_specials(values.float(), specials, gen).to(x_dtype)
    x = _laid_out(values, layout, filler, gen)
    q, s = fp8linear.quantize_fp8(x, scale, dtype=fp8_dtype, granularity=granularity)
    q_ref, s_ref = reference.quantize_fp8(x, scale, dtype=fp8_dtype, granularity=granularity)
    assert s.dtype == torch.float32 and s.shape == s_ref.shape
    assert torch.equal(s, s_ref)
    assert_same_fp8(q, q_ref)


# ---- scaled_mm ------------------------------------------------------------------------------

def _fp8_codes(shape, dtype, kind, specials, gen):
    """fp8 values of `kind`; with `specials`, some NaN (and, in e5m2, ±inf) codes among them."""
    if kind == "normal":
        q = reference.quantize_fp8(torch.randn(shape, generator=gen), dtype=dtype)[0].view(torch.uint8)
    elif kind == "zeros":
        q = torch.zeros(shape, dtype=torch.uint8)
    else:
        q = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
        if kind == "subnormal":  # exponent bits cleared: subnormals and ±0
            q &= 0x87 if dtype == torch.float8_e4m3fn else 0x83
        finite = torch.isfinite(q.view(dtype).float())
        q = torch.where(finite, q, torch.zeros_like(q))  # "codes": every finite code, the largest included
    if specials and q.numel():
        special_codes = [0x7F, 0xFF] + ([0x7C, 0xFC] if dtype == torch.float8_e5m2 else [])
        picked = torch.rand(shape, generator=gen) < specials
        which = torch.randint(0, len(special_codes), shape, generator=gen)
        q = torch.where(picked, torch.tensor(special_codes, dtype=torch.uint8)[which], q)
    return q.view(dtype)


def _float_activations(shape, dtype, kind, specials, gen):
    """Weight-only activations. Subnormals only in float16: the bf16 kernels take bf16 subnormals
    as zero (documented in README.md, tested in test_amx.py), and float32 ones times fp8 give
    float32 subnormals, whose few bits are beyond any relative tolerance."""
    x = torch.randn(shape, generator=gen)
    if kind == "huge":
        x = x * (2.0**60 if dtype != torch.float16 else 2.0**13)
    elif kind == "subnormal":  # float16's own subnormals; tiny normal numbers in float32 and bf16
        x = x * (2.0**-100 if dtype != torch.float16 else 2.0**-20)
    elif kind == "zeros":
        x = torch.zeros(shape)
    elif kind == "codes":
        x = x * torch.exp2(torch.randint(-20, 20, shape, generator=gen).float())
    if specials and x.numel():
        picked = torch.rand(shape, generator=gen) < specials
        which = torch.randint(0, 3, shape, generator=gen)
        x = torch.where(picked, torch.tensor([float("nan"), float("inf"), float("-inf")])[which], x)
    return x.to(dtype)


def _filler(dtype):
    """What surrounds a sliced or strided operand: NaN, so that reading outside the view shows."""
    if dtype in FP8_DTYPES:
        return torch.full((), 0x7F, dtype=torch.uint8).view(dtype)  # NaN in both formats
    return torch.tensor(float("nan"), dtype=dtype)


def _matrix_laid_out(values, layout, gen):
    """A 2-D operand with the layout's strides, the same values."""
    rows, cols = values.shape
    if layout == "contiguous":
        return values.clone()
    if layout == "transposed":
        return values.t().contiguous().t()
    if layout == "sliced":  # a window of a larger matrix: row stride > cols, an offset
        top, left = (int(v) for v in torch.randint(0, 3, (2,), generator=gen))
        right = int(torch.randint(1, 40, (), generator=gen))
        big = _filler(values.dtype).expand(rows + top + 2, cols + left + right).clone()
        window = big[top:top + rows, left:left + cols]
        window.copy_(values)
        return window
    if layout == "strided":  # every other row and column
        big = _filler(values.dtype).expand(2 * rows, 2 * cols).clone()
        view = big[::2, ::2]
        view.copy_(values)
        return view
    if layout == "expanded":  # the first row repeated (row stride 0)
        return values[:1].expand(rows, cols) if rows else values.clone()
    raise AssertionError(layout)


@st.composite
def scaled_mm_cases(draw):
    m, k, n = draw(sizes(140)), draw(st.one_of(sizes(300), st.integers(250, 700))), draw(sizes(160))
    a_dtype = draw(st.sampled_from(FP8_DTYPES + FLOAT_DTYPES))  # float: weight-only
    b_dtype = draw(st.sampled_from(FP8_DTYPES))
    out_dtype = draw(st.sampled_from(FLOAT_DTYPES))
    a_kinds = ["normal", "codes", "subnormal", "zeros"] + (["huge"] if a_dtype in FLOAT_DTYPES else [])
    a_kind = draw(st.sampled_from(a_kinds))
    b_kind = draw(st.sampled_from(["normal", "codes", "subnormal", "zeros"]))
    a_specials = draw(st.sampled_from([0.0, 0.0, 0.0, 0.002, 0.05]))
    b_specials = draw(st.sampled_from([0.0, 0.0, 0.0, 0.002, 0.05]))
    a_layout = draw(st.sampled_from(["contiguous", "transposed", "sliced", "strided", "expanded"]))
    # b = w.t() with w [N, K] (a Linear weight: the fast kernels), or [K, N] row-major ("transposed")
    w_layout = draw(st.sampled_from(["contiguous", "sliced", "transposed", "strided", "expanded"]))
    scale_a_rows = draw(st.booleans())
    scale_b_cols = draw(st.booleans())
    scale_layout = draw(st.sampled_from(["contiguous", "contiguous", "expanded", "one_element"]))
    bias_dtype = draw(st.sampled_from([None, None] + list(FLOAT_DTYPES)))
    scale_exponent = draw(st.integers(-30, 30))
    seed = draw(st.integers(0, 2**32 - 1))
    return draw(VARIANTS), (m, k, n, a_dtype, b_dtype, out_dtype, a_kind, b_kind, a_specials, b_specials, a_layout,
                            w_layout, scale_a_rows, scale_b_cols, scale_layout, bias_dtype, scale_exponent, seed)


def _scale_values(shape, per_element, layout, exponent, gen):
    """Positive finite float32 scales: () (or [1, 1]) per tensor, else [M, 1] / [1, N]."""
    if not per_element:
        return torch.full(() if layout != "one_element" else (1, 1), 2.0**exponent)
    if layout == "expanded":
        return torch.full(shape, 1.5 * 2.0**exponent)
    return torch.empty(shape).uniform_(0.5, 2.0, generator=gen) * 2.0**exponent


def _scale_laid_out(values, layout):
    if values.numel() > 1 and layout == "expanded":  # one value expanded to the shape (stride 0)
        return values[:1, :1].expand(values.shape)
    if values.dim() == 2 and layout == "one_element":  # [M, 1] / [1, N] with the other stride
        return values.t().contiguous().t()
    return values


def _output_range(out_dtype):
    """Where the largest results are kept: in the output dtype's normal range, far from overflow."""
    if out_dtype == torch.float16:
        return 2.0**-10, 2.0**12
    return 2.0**-100, 2.0**100


def _fitting_shift(a, b, scale_a, scale_b, out_dtype):
    """The power of two for scale_b that keeps the largest finite sum of |products| below the
    top of the output dtype's range (float32 sums can't overflow) and the largest |result| above
    its bottom (far from subnormal outputs): rounding to out_dtype is then what is tested, not
    its overflow or underflow. Returns (shift, the largest sum of |products| after it)."""
    def finite(t):
        return t.double().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)

    if not (a.numel() and b.numel()):
        return 0, 0.0
    largest_sum = ((finite(a).abs() * scale_a.double()) @ (finite(b).abs() * scale_b.double())).max().item()
    largest_result = ((finite(a) * scale_a.double()) @ (finite(b) * scale_b.double())).abs().max().item()
    low, high = _output_range(out_dtype)
    shift = 0
    if largest_sum > high:
        shift = math.floor(math.log2(high / largest_sum))
    elif 0.0 < largest_result < low:
        shift = math.ceil(math.log2(low / largest_result))
    # a sum that cancels to a result 2^22 times smaller than its terms fits neither way
    assume(largest_sum * 2.0**shift <= high and (largest_result == 0.0 or largest_result * 2.0**shift >= low))
    return shift, largest_sum * 2.0**shift


def _assert_matches_exact(out, exact, out_dtype):
    """NaN and ±inf exactly where the float64 reference has them; the finite rest within tolerance."""
    nan = torch.isnan(exact)
    assert torch.equal(torch.isnan(out), nan)
    infinite = torch.isinf(exact)
    assert torch.equal(out[infinite].double(), exact[infinite])
    finite = ~nan & ~infinite
    assert relative_error(out[finite], exact[finite]) <= TOLERANCE[out_dtype]


@properties(500)  # ~2 s on 2 idle cores
@given(variant_and_case=scaled_mm_cases())
def test_scaled_mm_matches_reference(variant_and_case):
    variant, case = variant_and_case
    with forced_cpu_variant(variant):
        _check_scaled_mm(*case)


def _check_scaled_mm(m, k, n, a_dtype, b_dtype, out_dtype, a_kind, b_kind, a_specials, b_specials, a_layout,
                     w_layout, scale_a_rows, scale_b_cols, scale_layout, bias_dtype, exponent, seed):
    gen = generator(seed)
    if a_dtype in FP8_DTYPES:
        a_values = _fp8_codes((m, k), a_dtype, a_kind, a_specials, gen)
    else:
        a_values = _float_activations((m, k), a_dtype, a_kind, a_specials, gen)
    w_values = _fp8_codes((n, k), b_dtype, b_kind, b_specials, gen)
    a = _matrix_laid_out(a_values, a_layout, gen)
    b = _matrix_laid_out(w_values, w_layout, gen).t()
    scale_a = _scale_values((m, 1), scale_a_rows, scale_layout, exponent // 2, gen)
    scale_b = _scale_values((1, n), scale_b_cols, scale_layout, exponent - exponent // 2, gen)
    shift, largest = _fitting_shift(a, b, scale_a, scale_b, out_dtype)
    scale_b = scale_b * 2.0**shift
    assert torch.all(scale_b >= torch.finfo(torch.float32).smallest_normal) and torch.all(torch.isfinite(scale_b))
    scale_a, scale_b = _scale_laid_out(scale_a, scale_layout), _scale_laid_out(scale_b, scale_layout)
    bias = None
    if bias_dtype is not None:
        magnitude = largest if largest else 1.0
        if bias_dtype == torch.float16:
            magnitude = min(magnitude, 2.0**12)
        bias = (torch.randn(n, generator=gen).double() * magnitude).float().to(bias_dtype)
    out = fp8linear.scaled_mm(a, b, scale_a, scale_b, bias=bias, out_dtype=out_dtype)
    assert out.dtype == out_dtype and out.shape == (m, n)
    _assert_matches_exact(out, reference.scaled_mm_float64(a, b, scale_a, scale_b, bias=bias), out_dtype)
