"""The optional array libraries: which one owns an array, how to install each, and importing CuPy with that hint
when it is missing."""
from __future__ import annotations

from typing import Any

from ..errors import BackendUnavailableError

INSTALL = {
    # The package's extras are named as well, but only a checkout has them: no index serves kv-canary.
    "cupy": "pip install cupy-cuda13x 'cuda-core[cu13]' (CUDA 13 driver; cupy-cuda12x 'cuda-core[cu12]' for CUDA 12), or in the checkout pip install '.[cuda13]'",
    "numba": "pip install 'numba-cuda[cu13]' 'numpy<2.5' (numba-cuda cannot compile under numpy 2.5), or in the checkout pip install '.[numba]'",
}


def import_cupy():
    """Import CuPy or raise :class:`BackendUnavailableError` with the install command."""
    try:
        import cupy
    except ImportError as exc:
        raise BackendUnavailableError(f"kv-canary: backend 'cupy' needs CuPy: {INSTALL['cupy']}") from exc
    return cupy


_LIBRARY_OF: dict[type, str] = {}  # array type -> the top-level name of its module, decided once per type


def library_of(obj: Any) -> str:
    """``"cupy"``, ``"torch"``, ``"numpy"``, ...: the top-level module of ``obj``'s type."""
    t = type(obj)
    lib = _LIBRARY_OF.get(t)
    if lib is None:
        lib = _LIBRARY_OF[t] = t.__module__.split(".")[0]
    return lib
