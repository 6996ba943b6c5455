"""Test configuration: tests marked ``gpu`` are skipped where no CUDA GPU is visible.

``has_gpu()`` is true only when CuPy imports and sees at least one device. It is evaluated lazily (CuPy is
imported only when a collected test carries the ``gpu`` marker). The ``gpu`` and ``sim`` markers are declared
in pyproject.toml. This folder is on ``sys.path`` during tests: ``from cases import ...`` works anywhere
under ``tests/``.
"""
from __future__ import annotations

import functools

import pytest


@functools.lru_cache(maxsize=None)
def has_gpu() -> bool:
    """True iff CuPy is importable and ``cupy.cuda.runtime.getDeviceCount() > 0``."""
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount()) > 0
    except Exception:  # ImportError, CUDARuntimeError (no driver / no device), anything else
        return False


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items or has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: none visible to CuPy (cupy.cuda.runtime.getDeviceCount() == 0 "
                                   "or CuPy missing)")
    for item in gpu_items:
        item.add_marker(skip)
