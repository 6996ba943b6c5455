"""Records that move: the Numba twin against the NumPy reference, in the CUDA simulator (SPEC 4.1). Each test is its
own id under ``pytest -m sim`` (tests/helpers/sim_plugin.py runs it in a simulator process); in this process:
``python -m pytest -q -m sim --numba-sim tests/records/move_sim_suite.py``."""
from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
from helpers import move_cases as mc
from helpers import arrival_cases, move_engine

from canary.backends.args import LaunchConfig

pytestmark = [pytest.mark.sim,
              pytest.mark.skipif(importlib.util.find_spec("numba_cuda") is None,
                                 reason="needs numba-cuda: pip install -e '.[sim]'"),
              pytest.mark.skipif(os.environ.get("NUMBA_ENABLE_CUDASIM") != "1", reason="needs the CUDA simulator")]


def _twin(case, launch_config=None, slot_dtype=None):
    want = mc.run_case(case, "reference", np.array)
    got = mc.run_case(case, "numba", np.array, launch_config=launch_config, slot_dtype=slot_dtype)
    mc.assert_twin(case, got, want)


@pytest.mark.parametrize("case", mc.hand_cases(), ids=repr)
def test_hand_cases(case):
    _twin(case)


@pytest.mark.parametrize("seed", range(40))
def test_random_cases(seed):
    _twin(mc.random_case(seed))


def test_random_cases_hypothesis():
    hypothesis = pytest.importorskip("hypothesis")

    @hypothesis.settings(max_examples=15, deadline=None, derandomize=True,
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(seed=hypothesis.strategies.integers(1000, 2**32 - 1))
    def check(seed):
        _twin(mc.random_case(seed))

    check()


@pytest.mark.parametrize("name", ["copy_chain", "copy_cycle", "one_slot_layers", "out_of_range_by_one"])
@pytest.mark.parametrize("dtype", [np.int32, np.int64], ids=["int32", "int64"])
def test_slot_widths(name, dtype):
    """SPEC 2 (*): int32 and int64 lists of the same values move the same rows."""
    case = [c for c in mc.hand_cases() if c.name == name][0]
    mc.assert_twin(case, mc.run_case(case, "numba", np.array, slot_dtype=dtype),
                   mc.run_case(case, "reference", np.array))


@pytest.mark.parametrize("threads", [8, 64])
def test_block_sizes(threads):
    for case in mc.hand_cases():
        if case.name in ("many_entries", "copy_chain_layers", "wide_slots"):
            _twin(case, LaunchConfig(simulator_threads=threads))


@pytest.mark.parametrize("scenario", move_engine.SCENARIOS)
def test_round_trips_through_plan_and_verify(scenario):
    """The planner, write, verify and the mover all on the Numba twins: what the reference finds, they find."""
    want = move_engine.run_scenario(scenario, "reference")
    assert move_engine.run_scenario(scenario, "numba") == want


@pytest.mark.parametrize("fault", list(arrival_cases.FAULTS))
def test_restores_checked_on_arrival(fault):
    """SPEC 4.1 "Checked on arrival" on the Numba twins (the rotation on, where the fault allows it)."""
    kw = dict(num_layers=0 if fault in arrival_cases.NO_LAYERS else 3)
    assert arrival_cases.restore(fault, "numba", **kw) == arrival_cases.restore(fault, "reference", **kw)


@pytest.mark.parametrize("scenario", ["shared_prefix", "fork"])
def test_shared_blocks_and_forks(scenario):
    run = getattr(arrival_cases, scenario)
    assert run(move_engine.Pool("numba", expected_tokens=True)) == run(move_engine.Pool("reference",
                                                                                         expected_tokens=True))
