"""``KV_CANARY_REQUIRE_GPU=1`` (tests/conftest.py, tests/helpers/gpu_guard.py): a GPU run that cannot use the GPU
fails instead of skipping; a CPU run (the variable unset or 0) is unaffected."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import gpu_guard

import canary.backends
from canary import BackendUnavailableError

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"


# --------------------------------------------------------------------------------------------------------------
# The variable and the session check


@pytest.mark.parametrize("value,want", [(None, False), ("", False), ("0", False), ("1", True), (" 1 ", True)])
def test_required_values(value, want):
    env = {} if value is None else {gpu_guard.ENV: value}
    assert gpu_guard.required(env) is want


@pytest.mark.parametrize("value", ["yes", "true", "2"])
def test_required_refuses_other_values(value):
    with pytest.raises(pytest.UsageError, match=f"^kv-canary: KV_CANARY_REQUIRE_GPU: expected 0 or 1, got '{value}'$"):
        gpu_guard.required({gpu_guard.ENV: value})


def test_cpu_run_never_probes(monkeypatch):
    def boom():
        raise AssertionError("probed without KV_CANARY_REQUIRE_GPU=1")

    monkeypatch.setattr(gpu_guard, "PROBES", (boom,))
    gpu_guard.check_session({})
    gpu_guard.check_session({gpu_guard.ENV: "0"})


def test_session_check_lists_every_problem(monkeypatch):
    monkeypatch.setattr(gpu_guard, "PROBES", (lambda: ["no cupy"], lambda: [], lambda: ["no numba", "no driver"]))
    with pytest.raises(pytest.UsageError) as info:
        gpu_guard.check_session({gpu_guard.ENV: "1"})
    assert str(info.value) == ("kv-canary: KV_CANARY_REQUIRE_GPU=1: expected a usable GPU, CuPy and numba-cuda, got:\n"
                               "  - no cupy\n  - no numba\n  - no driver")


def test_session_check_passes_a_working_stack(monkeypatch):
    monkeypatch.setattr(gpu_guard, "PROBES", (lambda: [], lambda: []))
    gpu_guard.check_session({gpu_guard.ENV: "1"})


# --------------------------------------------------------------------------------------------------------------
# The probes, with the libraries faked (they run the same with or without a GPU)


def _fake_cupy(count, *, total=None):
    def get_count():
        if isinstance(count, Exception):
            raise count
        return count

    def arange(n, dtype):
        a = np.arange(n, dtype=dtype)
        return a if total is None else np.full(n, total, dtype=dtype)

    return SimpleNamespace(cuda=SimpleNamespace(runtime=SimpleNamespace(getDeviceCount=get_count)), arange=arange,
                           int64=np.int64)


def test_cupy_probe(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)
    (msg,) = gpu_guard.cupy_problems()
    assert msg.startswith("CuPy does not import: ModuleNotFoundError: import of cupy halted"), msg
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(0))
    assert gpu_guard.cupy_problems() == ["CuPy sees no CUDA device (cupy.cuda.runtime.getDeviceCount() == 0)"]
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(RuntimeError("cudaErrorNoDevice: no CUDA-capable device")))
    assert gpu_guard.cupy_problems() == [
        "CuPy cannot use the GPU: RuntimeError: cudaErrorNoDevice: no CUDA-capable device"]
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(1, total=5))
    assert gpu_guard.cupy_problems() == ["CuPy computed sum(3 * arange(4)) = 60, expected 18"]
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(2))
    assert gpu_guard.cupy_problems() == []


def test_numba_probe(monkeypatch):
    assert gpu_guard.numba_problems({"NUMBA_ENABLE_CUDASIM": "1"}) == [
        "NUMBA_ENABLE_CUDASIM is set: numba-cuda would run its simulator, not the GPU"]
    monkeypatch.setitem(sys.modules, "numba", None)
    (msg,) = gpu_guard.numba_problems({})
    assert msg.startswith("numba-cuda does not import: ModuleNotFoundError: import of numba halted"), msg
    monkeypatch.setitem(sys.modules, "numba", SimpleNamespace(cuda=SimpleNamespace(is_available=lambda: False)))
    assert gpu_guard.numba_problems({"NUMBA_ENABLE_CUDASIM": "0"}) == [
        "numba-cuda finds no usable CUDA driver or device (numba.cuda.is_available() is False)"]
    monkeypatch.setitem(sys.modules, "numba", SimpleNamespace(cuda=SimpleNamespace(is_available=lambda: True)))
    assert gpu_guard.numba_problems({}) == []


def test_cuda_core_probe(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda.core.utils", None)
    (msg,) = gpu_guard.cuda_core_problems()
    assert msg.startswith("cuda-core does not import: ModuleNotFoundError: import of cuda.core.utils halted"), msg


def test_backend_probe(monkeypatch):
    def load(name, family="plan"):
        if name == "numba":
            raise BackendUnavailableError(f"kv-canary: backend 'numba' needs numba-cuda ({family})")
        return SimpleNamespace(NAME=name)

    monkeypatch.setattr(canary.backends, "load", load)
    assert gpu_guard.backend_problems() == [
        "backend 'numba' (plan) does not load: BackendUnavailableError: kv-canary: backend 'numba' needs numba-cuda "
        "(plan)",
        "backend 'numba' (records) does not load: BackendUnavailableError: kv-canary: backend 'numba' needs "
        "numba-cuda (records)",
    ]
    monkeypatch.setattr(canary.backends, "load", lambda name, family="plan": SimpleNamespace(NAME=name))
    assert gpu_guard.backend_problems() == []


# --------------------------------------------------------------------------------------------------------------
# Skips that mean "no GPU stack" become failures; others stay skips


def _skipped(reason: str, when: str = "call") -> pytest.TestReport:
    return pytest.TestReport("t.py::test_x", ("t.py", 3, "test_x"), {}, "skipped", ("t.py", 3, f"Skipped: {reason}"),
                             when)


@pytest.mark.parametrize("reason", [
    "kv-canary: backend 'cupy' needs CuPy: pip install cupy-cuda13x 'cuda-core[cu13]'",
    "could not import 'cupy': No module named 'cupy'",
    "could not import 'numba.cuda': No module named 'numba'",
    "could not import 'cuda.core': No module named 'cuda'",
    "needs a CUDA GPU: none visible to CuPy (cupy.cuda.runtime.getDeviceCount() == 0 or CuPy missing)",
    "numba-cuda is not installed (pip install 'numba-cuda[cu13]')",
    "NVVM unavailable: libNVVM does not load: OSError: libnvvm.so",
])
@pytest.mark.parametrize("when", ["setup", "call"])
def test_environment_skips_fail(reason, when):
    report = _skipped(reason, when)
    gpu_guard.fail_environment_skip(report)
    assert report.failed and not report.skipped
    assert report.longrepr == f"KV_CANARY_REQUIRE_GPU=1: this test may not skip for a missing GPU stack; it skipped " \
                              f"with: {reason}"


@pytest.mark.parametrize("reason", [
    "needs two GPUs",
    "could not import 'torch': No module named 'torch'",
    "could not import 'jax': No module named 'jax'",
    "torch has no CUDA here",
    "numpy 2.4.6 < 2.5: the backend loads",
])
def test_other_skips_stay_skips(reason):
    report = _skipped(reason)
    gpu_guard.fail_environment_skip(report)
    assert report.skipped and report.longrepr == ("t.py", 3, f"Skipped: {reason}")


def test_passed_report_untouched():
    report = pytest.TestReport("t.py::test_x", ("t.py", 3, "test_x"), {}, "passed", None, "call")
    gpu_guard.fail_environment_skip(report)
    assert report.passed and report.longrepr is None


# --------------------------------------------------------------------------------------------------------------
# End to end: pytest processes with and without the variable


def _pytest(tmp_path, *args, require: str | None, plugins=()) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in (gpu_guard.ENV, "NUMBA_ENABLE_CUDASIM")}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(tmp_path), str(ROOT), env.get("PYTHONPATH", "")])
    if require is not None:
        env[gpu_guard.ENV] = require
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *(a for p in plugins for a in ("-p", p)),
           *args]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_required_run_without_a_gpu_stops_before_collection():
    """CUDA_VISIBLE_DEVICES="" hides every GPU, so this holds on GPU runners too: exit status 4, every problem."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env.update({gpu_guard.ENV: "1", "CUDA_VISIBLE_DEVICES": ""})
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only",
           str(TESTS / "usage" / "test_hypothesis_profile.py")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, out
    assert "kv-canary: KV_CANARY_REQUIRE_GPU=1: expected a usable GPU, CuPy and numba-cuda, got:" in out, out
    assert "\n  - CuPy " in out and "\n  - numba-cuda " in out, out
    assert "test_hypothesis_tests_are_derandomized" not in out  # nothing was collected


SKIPPING = textwrap.dedent('''
    import pytest


    def test_backend_missing():
        pytest.skip("kv-canary: backend 'cupy' needs CuPy: pip install cupy-cuda13x 'cuda-core[cu13]'")


    def test_needs_two_gpus():
        pytest.skip("needs two GPUs")


    def test_runs():
        pass
''')


def test_conftest_turns_environment_skips_into_failures(tmp_path):
    """tests/conftest.py's hooks, loaded as a plugin into a run of a scratch file; a second plugin makes the
    session check see a working GPU stack (no probes), so only the skip conversion decides."""
    (tmp_path / "test_skipping.py").write_text(SKIPPING)
    (tmp_path / "gpu_stack_ok.py").write_text("from helpers import gpu_guard\n\ngpu_guard.PROBES = ()\n")
    plugins = ("gpu_stack_ok", "conftest")
    required = _pytest(tmp_path, "-rA", "test_skipping.py", require="1", plugins=plugins)
    out = required.stdout + required.stderr
    assert required.returncode == pytest.ExitCode.TESTS_FAILED, out
    assert "1 failed, 1 passed, 1 skipped" in out, out
    assert "FAILED test_skipping.py::test_backend_missing" in out and "SKIPPED [1] test_skipping.py" in out, out
    cpu = _pytest(tmp_path, "test_skipping.py", require=None, plugins=plugins)
    out = cpu.stdout + cpu.stderr
    assert cpu.returncode == pytest.ExitCode.OK and "1 passed, 2 skipped" in out, out
