"""The manager's CUDA transfer path (report block, copies, memsets, staging) without a GPU: on the NumPy stand-in
for CuPy and the CUDA runtime of tests/helpers/fakecuda.py, in a child process (transfer_fake_child.py)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).resolve().parent / "transfer_fake_child.py"


def _has_cuda_bindings() -> bool:
    try:  # find_spec of a submodule imports its parent, and raises when there is no `cuda` package at all
        return importlib.util.find_spec("cuda.bindings") is not None
    except ImportError:
        return False


@pytest.mark.skipif(not _has_cuda_bindings(), reason="needs cuda-bindings (its driver constants); "
                    "pip install -e '.[sim]'")
@pytest.mark.parametrize("report", ["kernel", "copy"])
def test_one_copy_each_way_per_step_and_violations_reported_one_step_late(report):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    done = subprocess.run([sys.executable, str(CHILD), report], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), (done.stdout + done.stderr)[-4000:]
