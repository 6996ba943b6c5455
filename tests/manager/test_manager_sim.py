"""The manager's Numba-simulator suite, in a child process (see tests/numba_sim/test_numba_sim.py for why)."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
from helpers.sim_child import run_simulator_suite

SUITE = Path(__file__).resolve().parent / "manager_sim_suite.py"


@pytest.mark.sim
@pytest.mark.skipif(importlib.util.find_spec("numba_cuda") is None, reason="needs numba-cuda: pip install -e '.[sim]'")
def test_manager_simulator_suite():
    run = run_simulator_suite(SUITE, timeout=1200)
    assert run.returncode == 0, run.report
    assert re.search(r"\b2 passed", run.summary), run.report
