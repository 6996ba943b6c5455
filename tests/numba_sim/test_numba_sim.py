"""The Numba backend in CI, where there is no GPU.

The simulator suite (``tests/numba_sim/numba_sim_suite.py``) needs ``NUMBA_ENABLE_CUDASIM=1`` before numba is
first imported, and this file's PTX checks need the real numba-cuda: ``tests/helpers/sim_plugin.py`` runs the
suite's tests in a simulator process, each as its own test id, under ``pytest -m sim``.

The tests here: the backend's install guards (numpy >= 2.5, numba-cuda missing), that
``import canary`` stays free of numba, and an NVVM compile of every kernel for sm_90 (the simulator runs the
kernels as Python; this catches Numba typing errors, which it cannot). The compile tests skip only when libNVVM
or libdevice is missing, decided by a probe that compiles nothing (``nvvm`` fixture); once it passes, any
exception from compiling our kernels is a failure. The compiles take most of a minute on 2 cores and need numba-cuda: they
are ``sim``-marked too, and skip without numba-cuda (the [sim] extra).
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from canary import BackendUnavailableError

ROOT = Path(__file__).resolve().parents[2]
IN_SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
HAS_NUMBA_CUDA = importlib.util.find_spec("numba_cuda") is not None  # does not import numba
INSTALL_HINT = "pip install 'numba-cuda[cu13]'"  # the library's own message (canary/interop/libs.py)
NO_NUMBA_CUDA = "needs numba-cuda: pip install -e '.[sim]'"


def _numpy_too_new() -> bool:
    major, minor = (int(re.match(r"\d+", p).group()) for p in np.__version__.split(".")[:2])
    return (major, minor) >= (2, 5)


# ---------------------------------------------------------------------------------------------------------------
# Install guards (SPEC 3.3: a backend whose library is missing -> BackendUnavailableError with the install command)


def _forget_numba_backend(monkeypatch):
    """Make the next import of ``canary.backends.numba`` (and its ``plan``) run its guards anew."""
    for name in ("canary.backends.numba", "canary.backends.numba.plan", "canary.backends.numba.records"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    import canary.backends as pkg

    monkeypatch.delattr(pkg, "numba", raising=False)


def _fresh_import_backend(monkeypatch):
    """Import the Numba planner backend anew through the backend loader (as the planner does)."""
    from canary.backends import load

    _forget_numba_backend(monkeypatch)
    return load("numba")


def _check_message(exc: BackendUnavailableError) -> None:
    msg = str(exc)
    assert msg.startswith("kv-canary:"), msg
    assert INSTALL_HINT in msg, msg
    assert "numba" in msg


def test_numpy_25_is_refused_before_numba_is_imported(monkeypatch):
    monkeypatch.setattr(np, "__version__", "2.5.2")
    # With numba made unimportable too, only a check that runs before the numba import can name numpy.
    monkeypatch.setitem(sys.modules, "numba", None)
    monkeypatch.setitem(sys.modules, "numba.cuda", None)
    with pytest.raises(BackendUnavailableError) as info:
        _fresh_import_backend(monkeypatch)
    _check_message(info.value)
    assert "numpy 2.5.2" in str(info.value) and "row_stack" in str(info.value)


@pytest.mark.parametrize("version", ["2.5.0", "2.5.0rc1", "3.0.0", "2.10.1"])
def test_numpy_versions_refused(monkeypatch, version):
    monkeypatch.setattr(np, "__version__", version)
    monkeypatch.setitem(sys.modules, "numba", None)
    with pytest.raises(BackendUnavailableError, match="cannot run with numpy"):
        _fresh_import_backend(monkeypatch)


def test_missing_numba_is_refused(monkeypatch):
    monkeypatch.setattr(np, "__version__", "2.4.4")
    monkeypatch.setitem(sys.modules, "numba", None)  # `from numba import cuda` now raises ImportError
    monkeypatch.setitem(sys.modules, "numba.cuda", None)
    with pytest.raises(BackendUnavailableError) as info:
        _fresh_import_backend(monkeypatch)
    _check_message(info.value)
    assert "needs numba-cuda" in str(info.value)


def test_missing_numba_through_resolve(monkeypatch):
    from canary.backends import resolve

    monkeypatch.setattr(np, "__version__", "2.4.4")
    monkeypatch.setitem(sys.modules, "numba", None)
    _forget_numba_backend(monkeypatch)
    with pytest.raises(BackendUnavailableError) as info:
        resolve("numba", 0)  # CUDA arrays on device 0: the backend module is imported, and refuses
    _check_message(info.value)


def test_import_canary_does_not_import_numba():
    code = (
        "import sys, canary, canary.backends, canary.plan.planner, canary.backends.reference.plan, canary.records.api\n"
        "bad = sorted(m for m in sys.modules if m == 'numba' or m.startswith(('numba.', 'numba_cuda')))\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ---------------------------------------------------------------------------------------------------------------
# NVVM compile of every kernel (no GPU needed)


@functools.lru_cache(maxsize=None)
def nvvm_missing() -> str | None:
    """Why numba-cuda cannot use libNVVM here (``None``: it can), found without compiling any kernel.

    Asks numba's own ``nvvm.is_available()``, then loads the library for real (``NVVM().get_version()`` calls
    into libNVVM) and looks for libdevice. Only those errors mean "NVVM unavailable"; an ImportError of numba-cuda
    itself is a broken install and propagates.
    """
    from numba.cuda.cudadrv import nvvm

    if not nvvm.is_available():
        return "numba.cuda.cudadrv.nvvm.is_available() is False (cuda.bindings.nvvm or libNVVM missing)"
    load_errors = (nvvm.NvvmSupportError, OSError, RuntimeError) + ((nvvm.nvvmError,) if nvvm.nvvmError else ())
    try:
        version = nvvm.NVVM().get_version()
    except load_errors as exc:  # RuntimeError covers cuda.bindings' NotSupportedError / FunctionNotFoundError
        return f"libNVVM does not load: {type(exc).__name__}: {exc}"
    if not nvvm.get_libdevice():
        return f"libNVVM {version} found, libdevice not found"
    return None


@pytest.fixture
def nvvm():
    """Skip (before compiling anything) where libNVVM is genuinely unavailable."""
    reason = nvvm_missing()
    if reason is not None:
        pytest.skip(f"NVVM unavailable: {reason}")


@pytest.mark.sim
@pytest.mark.skipif(not HAS_NUMBA_CUDA, reason=NO_NUMBA_CUDA)
@pytest.mark.skipif(IN_SIMULATOR, reason="the simulator has no compiler")
@pytest.mark.skipif(_numpy_too_new(), reason=f"numba-cuda cannot compile with numpy {np.__version__} (>= 2.5)")
@pytest.mark.parametrize("padding_slot", [0, -1], ids=["padding0", "padding-1"])  # SPEC 3.2 "No reserved slot"
@pytest.mark.parametrize("form", [0, 1, 2], ids=["req_to_token", "block_table", "page_list"])
@pytest.mark.parametrize("has_lut,has_pool", [(False, False), (True, False), (False, True), (True, True)])
def test_kernels_compile_for_sm90(monkeypatch, nvvm, has_lut, has_pool, form, padding_slot):
    from types import SimpleNamespace

    from numba import cuda

    import numba.cuda.dispatcher as dispatcher
    from canary.backends.sources import numba_kernels

    plan_numba = numba_kernels("plan_numba")

    # Device functions compile for "the current device"; there is none here. Say it is an sm_90 (H200).
    monkeypatch.setattr(dispatcher, "get_current_device", lambda: SimpleNamespace(compute_capability=(9, 0)))
    sfx = plan_numba.suffix(has_lut, has_pool, form)
    for kernel in plan_numba.kernel_functions(has_lut, has_pool, form=form, padding_slot=padding_slot):
        ptx, _ = cuda.compile_ptx(kernel, plan_numba.SIGNATURE, cc=(9, 0),
                                  launch_bounds=plan_numba.launch_bounds(kernel.__name__))
        assert ".maxntid" in ptx  # plan.cu's __launch_bounds__
        assert kernel.__name__.endswith(sfx) and kernel.__name__ in ptx  # plan.cu's kernel name, mangled
        assert ".local" not in ptx, f"{kernel.__name__}: local memory (spills or local arrays)"


@pytest.mark.sim
@pytest.mark.skipif(not HAS_NUMBA_CUDA, reason=NO_NUMBA_CUDA)
@pytest.mark.skipif(IN_SIMULATOR, reason="the simulator has no compiler")
@pytest.mark.skipif(_numpy_too_new(), reason=f"numba-cuda cannot compile with numpy {np.__version__} (>= 2.5)")
@pytest.mark.parametrize("padding_slot", [0, -1], ids=["padding0", "padding-1"])
def test_canary_kernels_compile_for_sm90(monkeypatch, nvvm, padding_slot):
    """The canary twin (kernels/records_numba.py): every kernel types and compiles, in u64 arithmetic only."""
    from types import SimpleNamespace

    from numba import cuda

    import numba.cuda.dispatcher as dispatcher
    from canary.backends.sources import numba_kernels

    cn = numba_kernels("records_numba")
    monkeypatch.setattr(dispatcher, "get_current_device", lambda: SimpleNamespace(compute_capability=(9, 0)))
    write, verify, scatter = cn.kernel_functions(padding_slot=padding_slot)
    sigs = [(write, cn.WRITE_PARAMS), (verify, cn.VERIFY_PARAMS), (scatter, cn.scatter_params("int64[::1]")),
            (scatter, cn.scatter_params("int32[::1]"))]
    for kernel, params in sigs:
        ptx, _ = cuda.compile_ptx(kernel, cn._signature(params), cc=(9, 0))
        assert kernel.__name__ in ptx  # records.cu's kernel name, mangled
        # A float anywhere means Numba promoted a u64 / i64 mix to float64: wrong bits, silently.
        assert not re.search(r"\bcvt\.rn\.f64|\.f64\b", ptx), f"{kernel.__name__}: float64 arithmetic in the PTX"
        assert ".local" not in ptx, f"{kernel.__name__}: local memory (spills or local arrays)"


@pytest.mark.sim
@pytest.mark.skipif(not HAS_NUMBA_CUDA, reason=NO_NUMBA_CUDA)
@pytest.mark.skipif(IN_SIMULATOR, reason="the simulator has no compiler")
@pytest.mark.skipif(_numpy_too_new(), reason=f"numba-cuda cannot compile with numpy {np.__version__} (>= 2.5)")
def test_agree_kernel_compiles_for_sm90(monkeypatch, nvvm):
    """The agreement twin (kernels/agree_numba.py, SPEC 4.3): it types and compiles, in u64 arithmetic only."""
    from types import SimpleNamespace

    from numba import cuda

    import numba.cuda.dispatcher as dispatcher
    from canary.backends.sources import numba_kernels

    ag = numba_kernels("agree_numba")
    monkeypatch.setattr(dispatcher, "get_current_device", lambda: SimpleNamespace(compute_capability=(9, 0)))
    kernel = ag.kernel_function(ag.AGREE_THREADS)
    ptx, _ = cuda.compile_ptx(kernel, "void({})".format(", ".join(ty for _, ty in ag.AGREE_ARGS)), cc=(9, 0))
    assert "canary_agree" in ptx
    assert not re.search(r"\bcvt\.rn\.f64|\.f64\b", ptx), "canary_agree: float64 arithmetic in the PTX"
    assert ".local" not in ptx, "canary_agree: local memory (spills or local arrays)"


@pytest.fixture
def fresh_probe():
    nvvm_missing.cache_clear()
    yield nvvm_missing
    nvvm_missing.cache_clear()


@pytest.mark.skipif(not HAS_NUMBA_CUDA, reason="numba-cuda is not installed")
@pytest.mark.skipif(IN_SIMULATOR, reason="the simulator has no compiler")
def test_nvvm_probe_skips_only_for_a_missing_library(monkeypatch, fresh_probe):
    from numba.cuda.cudadrv import nvvm

    class Broken:
        def __init__(self, exc):
            self.exc = exc

        def __call__(self):
            return self

        def get_version(self):
            raise self.exc

    monkeypatch.setattr(nvvm, "is_available", lambda: False)
    assert "is_available() is False" in fresh_probe()
    fresh_probe.cache_clear()
    monkeypatch.setattr(nvvm, "is_available", lambda: True)
    monkeypatch.setattr(nvvm, "NVVM", Broken(nvvm.NvvmSupportError("libNVVM is not available")))
    assert fresh_probe() == "libNVVM does not load: NvvmSupportError: libNVVM is not available"
    fresh_probe.cache_clear()
    monkeypatch.setattr(nvvm, "NVVM", Broken(OSError("libnvvm.so.4: cannot open shared object file")))
    assert fresh_probe().startswith("libNVVM does not load: OSError: libnvvm.so.4")
    fresh_probe.cache_clear()
    monkeypatch.setattr(nvvm, "NVVM", Broken(ValueError("a bug, not a missing library")))
    with pytest.raises(ValueError, match="a bug"):  # not turned into a skip
        fresh_probe()
    fresh_probe.cache_clear()
    monkeypatch.setattr(nvvm, "NVVM", lambda: type("Ok", (), {"get_version": lambda self: (2, 0)})())
    monkeypatch.setattr(nvvm, "get_libdevice", lambda: None)
    assert fresh_probe() == "libNVVM (2, 0) found, libdevice not found"
