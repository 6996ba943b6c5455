"""The layer rotation's Numba twin against the NumPy reference, in the CUDA simulator. Each test is its own id
under ``pytest -m sim`` (tests/helpers/sim_plugin.py runs it in a simulator process); in this process:
``python -m pytest -q -m sim --numba-sim tests/records/layers_sim_suite.py``."""
from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
from helpers import layer_cases as lc

from canary.backends.args import LaunchConfig

pytestmark = [pytest.mark.sim,
              pytest.mark.skipif(importlib.util.find_spec("numba_cuda") is None,
                                 reason="needs numba-cuda: pip install -e '.[sim]'"),
              pytest.mark.skipif(os.environ.get("NUMBA_ENABLE_CUDASIM") != "1", reason="needs the CUDA simulator")]


def _twin(case, launch_config=None):
    want = lc.run_case(case, "reference", np.array)
    got = lc.run_case(case, "numba", np.array, launch_config=launch_config)
    lc.assert_twin(case, got, want)


@pytest.mark.parametrize("case", lc.hand_cases(), ids=repr)
def test_hand_cases(case):
    _twin(case)


@pytest.mark.parametrize("seed", range(40))
def test_random_cases(seed):
    _twin(lc.random_case(seed))


def test_random_cases_hypothesis():
    hypothesis = pytest.importorskip("hypothesis")

    @hypothesis.settings(max_examples=10, deadline=None, derandomize=True,
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(seed=hypothesis.strategies.integers(1000, 2**32 - 1))
    def check(seed):
        _twin(lc.random_case(seed))

    check()


@pytest.mark.parametrize("seed", range(8))
def test_int32_out_cache_loc(seed):
    """SPEC 2 (*): an int32 out_cache_loc folds what the int64 one folds."""
    case = lc.hand_cases()[seed] if seed < len(lc.hand_cases()) else lc.random_case(seed)
    lc.assert_twin(case, lc.run_case(case, "numba", np.array, loc_dtype=np.int32),
                   lc.run_case(case, "reference", np.array))


@pytest.mark.parametrize("threads", [8, 64])
def test_block_sizes(threads):
    for case in lc.hand_cases()[:2]:
        _twin(case, LaunchConfig(simulator_threads=threads))
