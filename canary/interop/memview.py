"""Zero-copy NumPy views of host memory with a chosen dtype, shape and byte strides (what ``as_strided`` does)."""
from __future__ import annotations

from typing import Any

import numpy as np


class _Interface:
    """Carries an ``__array_interface__``; ``base`` keeps the memory's owner alive."""

    def __init__(self, interface: dict, base: Any):
        self.__array_interface__ = interface
        self.base = base


def host_view(ptr: int, shape: tuple[int, ...], strides: tuple[int, ...], dtype: Any, owner: Any,
              readonly: bool = False) -> np.ndarray:
    """A NumPy array over ``ptr`` (host memory owned by ``owner``); ``strides`` in bytes. Never copies."""
    interface = {
        "data": (int(ptr), bool(readonly)),
        "shape": tuple(int(n) for n in shape),
        "strides": tuple(int(s) for s in strides),
        "typestr": np.dtype(dtype).str,
        "version": 3,
    }
    return np.asarray(_Interface(interface, owner))
