"""The cached-prefix sweep on the Numba backend under the CUDA simulator (host arrays).

Run by ``test_sweep.py::test_sweep_simulator_suite`` in a child process with ``NUMBA_ENABLE_CUDASIM=1`` (numba
reads it once, at import); by hand: ``NUMBA_ENABLE_CUDASIM=1 python -m pytest -q -m sim
tests/manager/sweep_sim_suite.py``.
"""
from __future__ import annotations

import math
import os

import pytest

if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
    pytest.skip("run with NUMBA_ENABLE_CUDASIM=1 (tests/manager/test_sweep.py does)", allow_module_level=True)

from helpers.manager_engine import ToyEngine  # noqa: E402

from canary import BackendUnavailableError, FailReason  # noqa: E402

pytestmark = [pytest.mark.sim, pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")]


def test_numba_sweep_finds_a_flip_in_a_cached_prefix_within_the_bound_and_forgets_evicted_ones():
    got = []
    try:
        e = ToyEngine(backend="numba", on_violation=got.append, sweep_budget=3)
    except BackendUnavailableError as exc:
        pytest.skip(str(exc))
    prompts = {"c0": [31, 32, 33, 34], "c1": [41, 42, 43]}
    slots = {}
    for rid, prompt in prompts.items():
        e.add(rid, prompt)
        e.forward([(rid, len(prompt))])
        slots[rid] = e.r2t_host[e.reqs[rid]["row"], :len(prompt)].copy()
        e.finish(rid, free_row=False)
        e.manager.cache_prefix(rid, slots[rid], prompt)
    e.add("live", [7, 8])
    e.decode_step(["live"])
    e.manager.flush()
    assert got == []
    e.flip("full", int(slots["c0"][2]))
    for _ in range(math.ceil(7 / 3)):
        e.decode_step(["live"])
    e.manager.flush()
    v = got[0][0]
    assert (v.kernel, v.position, v.reasons, v.prefixes) == ("sweep", 2, FailReason.REAL_KV, (("c0", 2),))
    got.clear()
    e.manager.evict_prefix("c0")
    for _ in range(4):
        e.decode_step(["live"])
    e.manager.flush()
    assert got == [] and e.manager.stats()["cached_entries"] == {"full": 3}
