"""Eager graphs change nothing the device holds (eager_fake_child.py): on tests/helpers/fakecuda.py, a manager
replaying its calls as CUDA graphs, one launching directly and a host manager, driven by the same random engine
schedules, hold the same expected-token pool and valid lengths after every step. A child process: the fake CuPy
must not meet the test session's imports."""
from __future__ import annotations

from pathlib import Path

from helpers.fake_child import needs_cuda_bindings, run_fake_child

CHILD = Path(__file__).resolve().parent / "eager_fake_child.py"


@needs_cuda_bindings
def test_eager_graphs_hold_what_direct_launches_and_the_host_hold():
    run_fake_child(CHILD, *map(str, range(6)), timeout=600)
