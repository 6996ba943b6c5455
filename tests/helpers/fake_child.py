"""The fake-CUDA child scripts' runner: a child installs tests/helpers/fakecuda.py's stand-in CuPy and runtime in a
process of its own (they must not meet the test session's imports) and prints ``OK`` at the end. The fake takes its
driver constants from cuda-bindings, so these tests carry :data:`needs_cuda_bindings`."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def has_cuda_bindings() -> bool:
    try:  # find_spec of a submodule imports its parent, and raises when there is no `cuda` package at all
        return importlib.util.find_spec("cuda.bindings") is not None
    except ImportError:
        return False


needs_cuda_bindings = pytest.mark.skipif(not has_cuda_bindings(), reason="needs cuda-bindings (its driver "
                                         "constants); pip install -e '.[sim]'")


def run_fake_child(script: Path, *args: str, timeout: float = 300) -> None:
    """Run ``script`` with ``args`` from the repository root (the CUDA simulator off); assert it printed ``OK``."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    done = subprocess.run([sys.executable, str(script), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), (done.stdout + done.stderr)[-4000:]
