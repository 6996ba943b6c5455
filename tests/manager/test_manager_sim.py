"""The manager's Numba-simulator suite, in a child process (see tests/numba_sim/test_numba_sim.py for why)."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SUITE = Path(__file__).resolve().parent / "manager_sim_suite.py"


@pytest.mark.sim
@pytest.mark.skipif(importlib.util.find_spec("numba_cuda") is None, reason="needs numba-cuda: pip install -e '.[sim]'")
def test_manager_simulator_suite():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    env.pop("KV_CANARY_REQUIRE_GPU", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "sim", str(SUITE)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    report = (proc.stdout + proc.stderr)[-20000:]
    assert proc.returncode == 0, report
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert re.search(r"\b2 passed", summary), report
