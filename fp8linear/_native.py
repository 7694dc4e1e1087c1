"""Loading of the compiled extension fp8linear._C, with an actionable error at
first use (not at import) when it is missing or was built against another torch."""
from __future__ import annotations

import importlib

_module = None
_error: Exception | None = None


def native():
    """The fp8linear._C module; loading it also registers the torch.ops.fp8linear ops."""
    global _module, _error
    if _module is None and _error is None:
        try:
            _module = importlib.import_module("fp8linear._C")
        except ImportError as error:  # missing build, or an ABI mismatch with this torch
            _error = error
    if _module is None:
        raise RuntimeError(
            "fp8linear's native extension (fp8linear._C) could not be loaded: "
            f"{_error}. Build it against the installed torch with "
            "`pip install --no-build-isolation -e .` in the fp8linear checkout "
            "(or `make install`)."
        ) from _error
    return _module


def available() -> bool:
    try:
        native()
    except RuntimeError:
        return False
    return True
