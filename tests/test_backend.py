"""backend(): the compute path of a device, and the one-time warning."""
import warnings

import pytest
import torch
from torch import nn

import importlib

import fp8linear

# the package exports the function backend(), which shadows the submodule's name
backend_module = importlib.import_module("fp8linear.backend")


def test_cpu_path():
    assert fp8linear.backend() == "cpu"
    assert fp8linear.backend("cpu") == "cpu"
    assert fp8linear.backend(torch.device("cpu")) == "cpu"


def test_unknown_device_is_refused():
    with pytest.raises(ValueError, match="cpu and cuda"):
        fp8linear.backend("meta")


def test_first_forward_warns_once_naming_the_path(monkeypatch):
    monkeypatch.setattr(backend_module, "_warned", set())
    monkeypatch.setattr(backend_module, "_settled", set())  # forward's fast path skips settled devices
    layer = fp8linear.FP8Linear.from_linear(nn.Linear(8, 4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layer(torch.randn(2, 8))
        layer(torch.randn(2, 8))
    messages = [str(w.message) for w in caught if issubclass(w.category, fp8linear.FP8PathWarning)]
    assert len(messages) == 1
    assert "'cpu' path" in messages[0] and backend_module.cpu_kernel_variant() in messages[0]


def test_cpu_variants_can_be_forced_and_refused():
    module = fp8linear._native.native()
    supported = module.cpu_variants_supported()
    assert supported[0] == "scalar"
    with pytest.raises(ValueError, match="unknown CPU variant"):
        module.set_cpu_variant("sse9")
    previous = module.cpu_variant()
    module.set_cpu_variant("scalar")
    assert module.cpu_variant() == "scalar"
    module.set_cpu_variant(previous)


class _FakeCudaBuild:
    """native() of a CUDA build, with the path it reports for every device."""

    def __init__(self, path):
        self.path = path

    def cuda_built(self):
        return True

    def cuda_device_path(self, index):
        return self.path


@pytest.mark.parametrize("path, expected", [("fp8", "cuda-fp8"), ("upconvert", "cuda-upconvert"),
                                            ("generic", "cuda-upconvert"), ("none", None)])
def test_cuda_path_of_the_build(monkeypatch, path, expected):
    # (runs without a GPU: the build's answer for the device is faked)
    monkeypatch.setattr(backend_module, "native", lambda: _FakeCudaBuild(path))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (7, 5))
    if expected is not None:
        assert fp8linear.backend("cuda:0") == expected
        return
    # a build with no code for the GPU (a T4 under the default TORCH_CUDA_ARCH_LIST): said
    # before any kernel fails to launch, with the fix
    with pytest.raises(RuntimeError, match=r"no code for cuda:0 \(compute capability 7\.5\).*add \"7\.5\""):
        fp8linear.backend("cuda:0")
