"""A CUDA manager resolves its backend (importing CuPy) before its first per-step runtime call, so that the
cheaper binding is chosen (runtime_fake_child.py, a child process: the fake CuPy must not meet the session's
imports)."""
from __future__ import annotations

from pathlib import Path

from helpers.fake_child import needs_cuda_bindings, run_fake_child

CHILD = Path(__file__).resolve().parent / "runtime_fake_child.py"


@needs_cuda_bindings
def test_the_backend_is_resolved_before_the_first_runtime_call():
    run_fake_child(CHILD)
