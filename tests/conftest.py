"""Test configuration: tests marked ``gpu`` are skipped where no CUDA GPU is visible; Hypothesis replays.

``has_gpu()`` is true only when CuPy imports and sees at least one device. It is evaluated lazily (CuPy is
imported only when a collected test carries the ``gpu`` marker). The ``gpu`` and ``sim`` markers are declared
in pyproject.toml. This folder is on ``sys.path`` during tests: ``from helpers.plan_cases import ...`` works
anywhere under ``tests/``.

Hypothesis: the profile ``ci`` (loaded here, before any test module is imported, so every ``@settings`` inherits
it) derandomizes every Hypothesis test: each run draws the same examples, so a failure replays on the next run
and on another machine. ``pytest --hypothesis-profile=explore`` draws fresh random examples instead (for a
local bug hunt; pin what it finds as a hand case).
"""
from __future__ import annotations

import functools

import pytest

try:
    from hypothesis import settings as _hypothesis_settings
except ImportError:  # pragma: no cover - hypothesis is part of the [test] extra
    _hypothesis_settings = None
else:
    _hypothesis_settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
    _hypothesis_settings.register_profile("explore", derandomize=False, deadline=None, print_blob=True)
    _hypothesis_settings.load_profile("ci")


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
