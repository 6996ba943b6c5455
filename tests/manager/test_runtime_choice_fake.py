"""A CUDA manager resolves its backend (importing CuPy) before its first per-step runtime call, so that the
cheaper binding is chosen (runtime_fake_child.py, a child process: the fake CuPy must not meet the session's
imports)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).resolve().parent / "runtime_fake_child.py"


def _has_cuda_bindings() -> bool:
    try:  # find_spec of a submodule imports its parent, and raises when there is no `cuda` package at all
        return importlib.util.find_spec("cuda.bindings") is not None
    except ImportError:
        return False


@pytest.mark.skipif(not _has_cuda_bindings(), reason="needs cuda-bindings (its driver constants); "
                    "pip install -e '.[sim]'")
def test_the_backend_is_resolved_before_the_first_runtime_call():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    done = subprocess.run([sys.executable, str(CHILD)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), (done.stdout + done.stderr)[-4000:]
