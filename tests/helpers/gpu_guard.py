"""``KV_CANARY_REQUIRE_GPU=1``: a GPU run that cannot use the GPU fails instead of skipping (tests/conftest.py).

Without the variable (or with ``0``), a machine without a GPU, CuPy or numba-cuda skips the GPU tests, as a CPU
run must. With ``1``, the GPU run's contract is that every GPU test runs:

- :func:`gpu_problems` runs once, before collection: CuPy imports, sees a device and runs a kernel; cuda-core
  imports; numba-cuda is not in simulator mode and finds the driver; ``canary.backends.load`` loads the
  ``cupy`` and ``numba`` modules of both kernel families. Any problem stops the run with a ``UsageError``
  that lists them all.
- :func:`fail_environment_skip` turns a test's skip whose reason says that the GPU stack is missing (a
  backend's ``kv-canary:`` ``BackendUnavailableError``, ``importorskip`` of cupy / numba / cuda-core, no GPU
  visible, NVVM unavailable) into a failure. Skips for optional extras (torch, JAX, a second GPU) stay skips.
"""
from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping

import pytest

ENV = "KV_CANARY_REQUIRE_GPU"

# Skip reasons that mean "the GPU stack is broken or missing" (matched anywhere in the reason).
ENVIRONMENT_SKIPS = re.compile(
    r"^kv-canary:"  # a backend's BackendUnavailableError, skipped with str(exc)
    r"|could not import '(cupy|numba|cuda)"  # pytest.importorskip
    r"|needs a CUDA GPU"  # the gpu marker's skip (tests/conftest.py)
    r"|numba-cuda is not installed"
    r"|NVVM unavailable"
)


def required(environ: Mapping[str, str] = os.environ) -> bool:
    """True iff ``KV_CANARY_REQUIRE_GPU=1``; unset, empty or ``0``: False; anything else is a usage error."""
    value = environ.get(ENV, "").strip()
    if value in ("", "0"):
        return False
    if value == "1":
        return True
    raise pytest.UsageError(f"kv-canary: {ENV}: expected 0 or 1, got {value!r}")


def _simulator(environ: Mapping[str, str]) -> bool:
    return environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")


def cupy_problems() -> list[str]:
    try:
        import cupy
    except Exception as exc:  # noqa: BLE001 - ImportError, or a broken install raising anything
        return [f"CuPy does not import: {type(exc).__name__}: {exc}"]
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
        if count < 1:
            return ["CuPy sees no CUDA device (cupy.cuda.runtime.getDeviceCount() == 0)"]
        got = int((cupy.arange(4, dtype=cupy.int64) * 3).sum())  # a kernel: driver and NVRTC work
    except Exception as exc:  # noqa: BLE001 - CUDARuntimeError (no driver / no device), NVRTC errors
        return [f"CuPy cannot use the GPU: {type(exc).__name__}: {exc}"]
    if got != 18:
        return [f"CuPy computed sum(3 * arange(4)) = {got}, expected 18"]
    return []


def cuda_core_problems() -> list[str]:
    try:
        from cuda.core.utils import StridedMemoryView  # noqa: F401 - what the adapter views device arrays with
    except Exception as exc:  # noqa: BLE001
        return [f"cuda-core does not import: {type(exc).__name__}: {exc}"]
    return []


def numba_problems(environ: Mapping[str, str] = os.environ) -> list[str]:
    if _simulator(environ):
        return ["NUMBA_ENABLE_CUDASIM is set: numba-cuda would run its simulator, not the GPU"]
    try:
        from numba import cuda

        available = bool(cuda.is_available())
    except Exception as exc:  # noqa: BLE001
        return [f"numba-cuda does not import: {type(exc).__name__}: {exc}"]
    if not available:
        return ["numba-cuda finds no usable CUDA driver or device (numba.cuda.is_available() is False)"]
    return []


def backend_problems() -> list[str]:
    from canary.backends import load

    out = []
    for backend in ("cupy", "numba"):
        for family in ("plan", "records"):
            try:
                load(backend, family)
            except Exception as exc:  # noqa: BLE001 - BackendUnavailableError above all
                out.append(f"backend {backend!r} ({family}) does not load: {type(exc).__name__}: {exc}")
    return out


PROBES: tuple[Callable[[], list[str]], ...] = (cupy_problems, cuda_core_problems, numba_problems, backend_problems)


def gpu_problems() -> list[str]:
    """Everything that keeps this machine from running the GPU tests (empty: nothing)."""
    return [problem for probe in PROBES for problem in probe()]


def check_session(environ: Mapping[str, str] = os.environ) -> None:
    """Raise ``pytest.UsageError`` listing the problems when the variable asks for a GPU and one is unusable."""
    if not required(environ):
        return
    problems = gpu_problems()
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise pytest.UsageError(f"kv-canary: {ENV}=1: expected a usable GPU, CuPy and numba-cuda, got:\n{lines}")


def skip_reason(report) -> str | None:
    """The reason of a skipped test report (``None`` if it did not skip)."""
    if not report.skipped:
        return None
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ")


def fail_environment_skip(report) -> None:
    """Turn ``report`` (a skipped test's) into a failure if its reason says the GPU stack is missing."""
    reason = skip_reason(report)
    if reason is None or hasattr(report, "wasxfail") or not ENVIRONMENT_SKIPS.search(reason):
        return
    report.outcome = "failed"
    report.longrepr = f"{ENV}=1: this test may not skip for a missing GPU stack; it skipped with: {reason}"


def backend_or_skip(backend: str, family: str = "plan") -> None:
    """Skip the calling test when the ``backend``'s library (its ``family`` module, "plan" or "records") cannot
    be loaded (its ``kv-canary:`` reason, which :func:`fail_environment_skip` turns into a failure in a GPU run)."""
    from canary import BackendUnavailableError
    from canary.backends import load

    try:
        load(backend, family)
    except BackendUnavailableError as exc:
        pytest.skip(str(exc))
