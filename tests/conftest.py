"""Test configuration: tests marked ``gpu`` are skipped where no CUDA GPU is visible; Hypothesis replays.

``has_gpu()`` is true only when CuPy imports and sees at least one device. It is evaluated lazily (CuPy is
imported only when a collected test carries the ``gpu`` marker). The ``gpu`` and ``sim`` markers are declared
in pyproject.toml. This folder is on ``sys.path`` during tests: ``from helpers.plan_cases import ...`` works
anywhere under ``tests/``.

``KV_CANARY_REQUIRE_GPU=1`` (set by the GPU runs; unset, empty or ``0`` on CPU runs): the run must use the GPU.
Before collection, CuPy must import, see a device and run a kernel, cuda-core must import, numba-cuda must find
the driver (not the simulator: ``NUMBA_ENABLE_CUDASIM`` must be unset), and the ``cupy`` and ``numba`` backends
of both kernel families must load; otherwise the run stops with a usage error listing every problem (exit
status 4). During the run, a test that skips because the GPU stack is missing (a backend's ``kv-canary:``
unavailable message, ``importorskip`` of cupy / numba / cuda-core, no GPU, NVVM unavailable) fails instead.
Skips for optional extras (torch, JAX, a second GPU) stay skips. Implementation: ``helpers/gpu_guard.py``.

Hypothesis: the profile ``ci`` (loaded here, before any test module is imported, so every ``@settings`` inherits
it) derandomizes every Hypothesis test: each run draws the same examples, so a failure replays on the next run
and on another machine. ``pytest --hypothesis-profile=explore`` draws fresh random examples instead (for a
local bug hunt; pin what it finds as a hand case).
"""
from __future__ import annotations

import functools

import pytest
from helpers import gpu_guard

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


def pytest_configure(config):
    gpu_guard.check_session()  # KV_CANARY_REQUIRE_GPU=1: a usable GPU stack, or a UsageError


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items or gpu_guard.required() or has_gpu():
        return  # KV_CANARY_REQUIRE_GPU=1: never skip for want of a GPU (the session check found one)
    skip = pytest.mark.skip(reason="needs a CUDA GPU: none visible to CuPy (cupy.cuda.runtime.getDeviceCount() == 0 "
                                   "or CuPy missing)")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if gpu_guard.required():
        gpu_guard.fail_environment_skip(report)
    return report
