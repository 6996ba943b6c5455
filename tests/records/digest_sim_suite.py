"""The block digest's Numba twin against the NumPy reference, in the CUDA simulator (SPEC 4.2). Each test is its
own id under ``pytest -m sim`` (tests/helpers/sim_plugin.py runs it in a simulator process); in this process:
``python -m pytest -q -m sim --numba-sim tests/records/digest_sim_suite.py``."""
from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
from helpers import digest_cases as dc

from canary import BlockDigest
from canary.backends.args import LaunchConfig

pytestmark = [pytest.mark.sim,
              pytest.mark.skipif(importlib.util.find_spec("numba_cuda") is None,
                                 reason="needs numba-cuda: pip install -e '.[sim]'"),
              pytest.mark.skipif(os.environ.get("NUMBA_ENABLE_CUDASIM") != "1", reason="needs the CUDA simulator")]


def _twin(case, launch_config=None):
    want = dc.run_case(case, "reference", np.array)
    got = dc.run_case(case, "numba", np.array, launch_config=launch_config or LaunchConfig(simulator_threads=8))
    dc.assert_twin(case, got, want)


@pytest.mark.parametrize("case", dc.hand_cases(), ids=repr)
def test_hand_cases(case):
    _twin(case)


@pytest.mark.parametrize("seed", range(24))
def test_random_cases(seed):
    _twin(dc.random_case(seed))


def test_random_cases_hypothesis():
    hypothesis = pytest.importorskip("hypothesis")

    @hypothesis.settings(max_examples=8, deadline=None, derandomize=True,
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(seed=hypothesis.strategies.integers(1000, 2**32 - 1))
    def check(seed):
        _twin(dc.random_case(seed))

    check()


@pytest.mark.parametrize("threads", [1, 4, 32])
def test_block_sizes_change_nothing(threads):
    """Another block size walks the units with other strides and splits: the same bytes out."""
    for case in dc.hand_cases()[:4]:
        _twin(case, LaunchConfig(simulator_threads=threads))


def test_the_scratch_is_zero_after_every_call():
    """The grid's last block re-arms the scratch: a poisoned call sequence leaves it zero, so the next call starts
    from nothing (a CUDA graph replays with no reset)."""
    case = dc.hand_cases()[3]
    rng = np.random.default_rng(0)
    k = rng.integers(0, 256, (6, 4, 2, 32), dtype=np.uint8)
    bd = BlockDigest([[k]], backend="numba", max_blocks=4, launch_config=LaunchConfig(simulator_threads=8))
    for lens in ([1, 4, 0], [9, 2, 3], None):
        out = np.zeros(3, np.int64)
        bd.compute(kv_indptr=np.array([0, 1, 2, 3]), kv_indices=np.array([5, -1, 2]), block_positions=np.arange(3),
                   block_lens=None if lens is None else np.array(lens), out=out)
        assert not bd._bound.scratch.any(), case
