"""CUDA-graph capture with every array owner × every capturing library (GPU only).

Each scenario runs in its own process (``capture_child.py``; a failed capture poisons the process): plan,
verify and write captured once, inputs refilled in place, replayed three times, every replay compared with
the NumPy reference. With ``stream=`` the capturing stream, every owner captures correctly; with no stream the
default is the current stream of the outputs' library, which is captured when that library is the one
capturing and is refused with a ``kv-canary: stream:`` error otherwise (never a silent stale graph).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CHILD = Path(__file__).resolve().parent / "capture_child.py"
ROOT = Path(__file__).resolve().parents[2]
OWNERS = ("torch", "cupy", "numba", "cai", "cai2")  # cai2: CUDA Array Interface v2
CAPTURES = ("torch", "cupy")


def _run(owner: str, capture: str, stream: str) -> str:
    pytest.importorskip("torch")
    pytest.importorskip("numba.cuda")
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    done = subprocess.run([sys.executable, str(CHILD), owner, capture, stream], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.gpu
@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("owner", OWNERS)
def test_capture_with_the_capturing_stream(owner, capture):
    assert _run(owner, capture, "given") == "OK"


@pytest.mark.gpu
@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("owner", OWNERS)
def test_capture_with_the_default_stream(owner, capture):
    out = _run(owner, capture, "default")
    if owner == capture:  # the outputs' library is the one capturing: its current stream is captured
        assert out == "OK"
    else:
        assert out.startswith("RAISED kv-canary: stream: expected the stream of the"), out
