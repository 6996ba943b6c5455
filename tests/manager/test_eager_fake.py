"""Eager graphs change nothing the device holds (eager_fake_child.py): on tests/helpers/fakecuda.py, a manager
replaying its calls as CUDA graphs, one launching directly and a host manager, driven by the same random engine
schedules, hold the same expected-token pool and valid lengths after every step. A child process: the fake CuPy
must not meet the test session's imports."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).resolve().parent / "eager_fake_child.py"


def _has_cuda_bindings() -> bool:
    try:
        return importlib.util.find_spec("cuda.bindings") is not None
    except ImportError:
        return False


@pytest.mark.skipif(not _has_cuda_bindings(), reason="needs cuda-bindings (its driver constants); "
                    "pip install -e '.[sim]'")
def test_eager_graphs_hold_what_direct_launches_and_the_host_hold():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    done = subprocess.run([sys.executable, str(CHILD), *map(str, range(6))], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), (done.stdout + done.stderr)[-4000:]
