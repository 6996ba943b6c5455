"""Arrays that share memory on purpose, in any array library: for the overlap checks (SPEC 3.3).

``place(a, xp)`` puts a NumPy array into library ``xp`` ("numpy", "torch" (CPU, sharing memory), "cupy");
``alias(host, shape, dtype, xp)`` is a contiguous array of ``shape`` / ``dtype`` over the first bytes of
``host``; ``share(a, b, xp)`` returns ``(a, b)`` with the smaller one replaced by an alias inside the larger, so
the two overlap while each keeps its shape and dtype (and so passes every other check).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from canary.interop.adapter import as_view
from canary.interop.overlap import span_bytes
from canary.interop.memview import host_view

XPS = ("numpy", "torch", "cupy")


def place(a: np.ndarray, xp: str) -> Any:
    """``a`` in library ``xp``; NumPy and torch CPU share ``a``'s memory, CuPy copies it (2-D row stride kept)."""
    if xp == "numpy":
        return a
    if xp == "torch":
        import torch

        return torch.from_numpy(a)
    from helpers.plan_cases import to_xp

    return to_xp(a, xp)


def span_of(a: Any) -> int:
    return span_bytes(as_view(a, "a"))


def alias(host: Any, shape: tuple, dtype: Any, xp: str) -> Any:
    dtype = np.dtype(dtype)
    shape = tuple(int(n) for n in shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    assert nbytes <= span_of(host), (shape, dtype, span_of(host))
    if xp == "cupy":
        import cupy

        return cupy.ndarray(shape, dtype, memptr=host.data)
    strides = tuple(int(np.prod(shape[i + 1:], dtype=np.int64)) * dtype.itemsize for i in range(len(shape)))
    arr = host_view(as_view(host, "host").ptr, shape, strides, dtype, host)
    if xp == "torch":
        import torch

        return torch.from_numpy(arr)
    return arr


def _shape_dtype(a: Any) -> tuple[tuple, np.dtype]:
    v = as_view(a, "a")
    return v.shape, v.dtype


def share(a: Any, b: Any, xp: str) -> tuple[Any, Any]:
    """``(a, b)`` overlapping: the one that fits inside the other's span becomes an alias at its start."""
    b_shape, b_dtype = _shape_dtype(b)
    if b_dtype.itemsize * int(np.prod(b_shape, dtype=np.int64)) <= span_of(a):
        return a, alias(a, b_shape, b_dtype, xp)
    a_shape, a_dtype = _shape_dtype(a)
    return alias(b, a_shape, a_dtype, xp), b


def to_numpy(a: Any) -> np.ndarray:
    from helpers.plan_cases import to_numpy as convert

    return convert(a)


def overlap_message(a: str, b: str) -> str:
    """Regex of the refusal naming ``a`` and ``b`` (either order: the one at the higher address comes first)."""
    import re

    a, b = re.escape(a), re.escape(b)
    tail = r", got an overlap at 0x[0-9a-f]+ \(\S+ spans \[0x[0-9a-f]+, 0x[0-9a-f]+\)\)$"
    return rf"^kv-canary: (?:{a}: expected memory separate from {b}|{b}: expected memory separate from {a}){tail}"
