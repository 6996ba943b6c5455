"""Test configuration: tests marked ``gpu`` are deselected where no CUDA GPU is visible; Hypothesis replays.

``has_gpu()`` is true only when CuPy imports and sees at least one device. It is evaluated lazily (CuPy is
imported only when a collected test carries the ``gpu`` marker). The ``gpu``, ``sim`` and ``slow`` markers are
declared in pyproject.toml, whose ``addopts`` deselect the ``sim`` and ``slow`` tests unless ``-m`` asks for
them. Deselected rather than skipped, the thousands of GPU tests print no ``s`` each: the terminal summary ends
with a ``kv-canary: not run:`` line that counts what was deselected and why, and a ``kv-canary: skipped:`` line
that groups the skips by reason. This folder is on ``sys.path`` during tests: ``from helpers import ...`` works
anywhere under ``tests/``.

``KV_CANARY_REQUIRE_GPU=1`` (set by the GPU runs; unset, empty or ``0`` on CPU runs): the run must use the GPU.
Before collection, CuPy must import, see a device and run a kernel, cuda-core must import, numba-cuda must find
the driver (not the simulator: ``NUMBA_ENABLE_CUDASIM`` must be unset), and the ``cupy`` and ``numba`` backends
of both kernel families must load; otherwise the run stops with a usage error listing every problem (exit
status 4). GPU tests are then never deselected, and a test that skips because the GPU stack is missing (a
backend's ``kv-canary:`` unavailable message, ``importorskip`` of cupy / numba / cuda-core, no GPU, NVVM
unavailable) fails instead. Skips for optional extras (torch, JAX, a second GPU) stay skips. Implementation:
``helpers/gpu_guard.py``.

Hypothesis: the profile ``ci`` (loaded here, before any test module is imported, so every ``@settings`` inherits
it) derandomizes every Hypothesis test: each run draws the same examples, so a failure replays on the next run
and on another machine. ``pytest --hypothesis-profile=explore`` draws fresh random examples instead (for a
local bug hunt; pin what it finds as a hand case).

Shared fixtures:

- ``backend`` (str): the kernel backend a test runs on, one test id per backend: ``reference`` (no mark),
  ``cupy`` and ``numba`` (marked ``gpu``); in a simulator process (``--numba-sim``, below) ``numba`` is marked
  ``sim`` instead and runs on the Numba CUDA simulator with host arrays. A module narrows the set with a
  ``BACKENDS`` list (e.g. ``["cupy", "numba"]``) and names its kernel family with ``BACKEND_FAMILY``
  (``"plan"``, the default, or ``"records"``). A backend whose library does not load skips the test with its
  ``kv-canary:`` reason (a failure under ``KV_CANARY_REQUIRE_GPU=1``). A test that parametrizes ``backend``
  itself keeps its own values.
- ``xp`` (module): the array module of the ``backend``'s arrays: ``numpy`` for ``reference`` (and for
  ``numba`` in the simulator), ``cupy`` for ``cupy`` and ``numba`` device arrays (skips without CuPy). A test
  that parametrizes ``xp`` itself keeps its own values.

Numba simulator (``helpers/sim_plugin.py``): the ``*_sim_suite.py`` files run under ``NUMBA_ENABLE_CUDASIM=1``,
which numba reads once per process. ``pytest --numba-sim`` (or the variable set) makes this process the
simulator and collects them directly; any other run with a ``-m`` that can select ``sim`` collects each of
their tests as its own id and runs them in one child ``pytest --numba-sim``, each proxy reporting its own
test's outcome (``pytest -m sim tests/numba_sim -k NAME`` runs one). The default run starts no child.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest
from helpers import gpu_guard, sim_plugin

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


def pytest_addoption(parser):
    sim_plugin.addoption(parser)  # --numba-sim


def pytest_configure(config):
    sim_plugin.configure(config)  # first: --numba-sim sets NUMBA_ENABLE_CUDASIM, which the GPU check refuses
    gpu_guard.check_session()  # KV_CANARY_REQUIRE_GPU=1: a usable GPU stack, or a UsageError


ALL_BACKENDS = ("reference", "cupy", "numba")


def _backend_param(config, name: str):
    if name == "reference":
        return pytest.param(name, id=name)
    mark = pytest.mark.sim if name == "numba" and sim_plugin.simulator_mode(config) else pytest.mark.gpu
    return pytest.param(name, marks=mark, id=name)


def _parametrized_by_the_test(metafunc, argname: str) -> bool:
    for mark in metafunc.definition.iter_markers("parametrize"):
        names = mark.args[0] if mark.args else mark.kwargs.get("argnames", ())
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        if argname in names:
            return True
    return False


def pytest_generate_tests(metafunc):
    if "backend" in metafunc.fixturenames and not _parametrized_by_the_test(metafunc, "backend"):
        names = getattr(metafunc.module, "BACKENDS", ALL_BACKENDS)
        metafunc.parametrize("backend", [_backend_param(metafunc.config, n) for n in names], indirect=True)


@pytest.fixture
def backend(request):
    """The backend's name (module docstring); skips when its library does not load."""
    name = request.param
    if name != "reference":
        gpu_guard.backend_or_skip(name, getattr(request.module, "BACKEND_FAMILY", "plan"))
    return name


@pytest.fixture
def xp(request, backend):
    """The array module of ``backend``'s arrays: numpy (reference, the simulator) or cupy."""
    if backend == "reference" or (backend == "numba" and sim_plugin.simulator_mode(request.config)):
        return np
    return pytest.importorskip("cupy")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if gpu_guard.required():
        gpu_guard.fail_environment_skip(report)
    return report


NO_GPU = pytest.StashKey[int]()  # GPU tests deselected because no GPU is visible
DESELECTED = pytest.StashKey[dict]()  # marker -> tests of it deselected by the -m expression
DEFAULT_MARKEXPR = "not sim and not slow"  # pyproject.toml's addopts
OPT_IN = {  # markers that pyproject.toml's addopts deselect, and how to run their tests
    "sim": "`pytest -m sim` runs them and the Numba-simulator suites (*_sim_suite.py), needs .[sim]",
    "slow": "`pytest -m slow` runs them",
}


@pytest.hookimpl(trylast=True)  # after -m: only the GPU tests the run asked for count as not run for want of a GPU
def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items or gpu_guard.required() or has_gpu():
        return  # KV_CANARY_REQUIRE_GPU=1: never drop a GPU test (the session check found a GPU)
    config.stash[NO_GPU] = config.stash.get(NO_GPU, 0) + len(gpu_items)
    config.hook.pytest_deselected(items=gpu_items)
    items[:] = [item for item in items if item.get_closest_marker("gpu") is None]


def pytest_deselected(items):
    if not items or items[0].config.option.markexpr != DEFAULT_MARKEXPR:
        return  # a -m or -k of the caller's own: what it left out is what it asked to leave out
    for item in items:
        marker = next((m for m in OPT_IN if item.get_closest_marker(m)), None)
        if marker and not item.get_closest_marker("gpu"):  # a GPU test is counted as one
            counts = item.config.stash.setdefault(DESELECTED, {})
            counts[marker] = counts.get(marker, 0) + 1


def _tests(n: int, kind: str) -> str:
    return f"{n} {kind} test{'' if n == 1 else 's'}"


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """One line for the tests not run (deselected), one for the skipped ones grouped by reason."""
    not_run = []
    if config.stash.get(NO_GPU, 0):
        not_run.append(f"{_tests(config.stash[NO_GPU], 'gpu')} (no CUDA GPU visible to CuPy)")
    for marker, n in config.stash.get(DESELECTED, {}).items():
        not_run.append(f"{_tests(n, marker)} ({OPT_IN[marker]})")
    if not_run:
        terminalreporter.write_line("kv-canary: not run: " + "; ".join(not_run))
    reasons: dict[str, int] = {}
    for report in terminalreporter.stats.get("skipped", []):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        reasons[reason] = reasons.get(reason, 0) + 1
    if reasons:
        terminalreporter.write_line("kv-canary: skipped: " + "; ".join(
            f"{n} ({reason})" for reason, n in sorted(reasons.items(), key=lambda r: -r[1])))
