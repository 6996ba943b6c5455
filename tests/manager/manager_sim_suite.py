"""CanaryManager on the Numba backend under the CUDA simulator (host arrays): a clean run and a detection.

Run by ``test_manager_sim.py`` in a child process with ``NUMBA_ENABLE_CUDASIM=1`` (numba reads it once, at
import); by hand: ``NUMBA_ENABLE_CUDASIM=1 python -m pytest -q -m sim tests/manager/manager_sim_suite.py``.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
    pytest.skip("run with NUMBA_ENABLE_CUDASIM=1 (tests/manager/test_manager_sim.py does)", allow_module_level=True)

from helpers.manager_engine import ToyEngine  # noqa: E402

from canary import BackendUnavailableError, FailReason  # noqa: E402

pytestmark = [pytest.mark.sim, pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")]


def engine(got) -> ToyEngine:
    try:
        e = ToyEngine(backend="numba", groups=("full", "swa"), on_violation=got.append)
    except BackendUnavailableError as exc:
        pytest.skip(str(exc))
    e.add("a", [5, 6, 7, 8])
    e.add("b", [9, 10])
    for _ in range(2):
        e.decode_step(["a", "b"])
    return e


def test_clean_run():
    got = []
    e = engine(got)
    e.manager.flush()
    s = e.manager.stats()
    assert got == [] and s["decoded_steps"] == 2 and s["verified_entries"]["full"] == 6


def test_detection_one_step_late():
    got = []
    e = engine(got)
    e.flip("full", e.slot_of("b", 1))
    e.decode_step(["a", "b"])
    assert got == []
    e.forward([("a", 1), ("b", 1)])
    v = got[0][0]
    assert (v.group, v.position, v.reasons, v.requests) == ("full", 1, FailReason.REAL_KV, (("b", 1),))


def test_mass_corruption_names_every_slot_once_within_the_bound():
    """The reference's scenario (test_manager_mass.py) on the Numba twins: 100x a one-row ring."""
    from helpers.manager_engine import check_mass_corruption, mass_corruption

    try:
        run = mass_corruption(requests=4, prompt=25, ring_capacity=1, backend="numba")
    except BackendUnavailableError as exc:
        pytest.skip(str(exc))
    check_mass_corruption(run)


def test_a_page_lists_violations_name_the_requests_a_token_table_names():
    """A byte flipped and a block handed to two requests, decoded at the next step (its batch rows in another
    order): a page list (page size 4, int32 kv_indptr) names what a token table names, as the reference's
    test_manager_page_attribution.py checks."""
    from helpers.page_engine import PageListEngine

    def run(form):
        try:
            e = PageListEngine(form, 4, np.int32, backend="numba")
        except BackendUnavailableError as exc:
            pytest.skip(str(exc))
        e.add("a", 1, range(10, 19))
        e.add("b", 3, range(40, 46))
        out = [e.step([("a", 9), ("b", 6)])]
        e.k[e.slot("a", 1), 3] ^= 0x10
        p = e.rows["b"][2]
        e.bt[e.rows["b"][0], p // 4] = e.bt[e.rows["a"][0], 0]  # b's next page is a's first block
        out += [e.decode(["a", "b"], flush=False), e.decode(["b", "a"], flush=False), e.decode(["a", "b"])]
        e.m.close()
        return [[(v.kernel, v.slot, v.position, int(v.reasons), v.requests, v.writers) for v in vs] for vs in out]

    want = run("req_to_token")
    named = [v for vs in want for v in vs]
    assert (("a", 1),) in [v[4] for v in named] and any(v[4] and v[5] for v in named)
    assert run("page_list") == want
    assert run("page_list_per_step") == want
