"""Run a Numba-simulator suite in a child process.

``NUMBA_ENABLE_CUDASIM`` is read when numba is first imported, and a test process may have imported it before
(tests/helpers/sim_plugin.py says why), so a simulator suite runs in its own interpreter.

Superseded by tests/helpers/sim_plugin.py, which collects every ``*_sim_suite.py`` test as its own id; kept
only while tests/manager/test_manager_sim.py and test_sweep.py's ``test_sweep_simulator_suite`` still call it.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class SuiteRun:
    returncode: int
    summary: str  # pytest's last line
    report: str  # the tail of the child's stdout and stderr
    seconds: float


def run_simulator_suite(suite: Path, timeout: int) -> SuiteRun:
    """``pytest -q -m sim suite`` under the CUDA simulator, with ``KV_CANARY_REQUIRE_GPU`` removed (a simulator
    run is a CPU run, even inside a GPU run)."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    env.pop("KV_CANARY_REQUIRE_GPU", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "sim", str(suite)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    lines = proc.stdout.strip().splitlines()
    return SuiteRun(proc.returncode, lines[-1] if lines else "", (proc.stdout + proc.stderr)[-20000:],
                    time.perf_counter() - start)
