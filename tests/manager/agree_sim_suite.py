"""The agreement kernel's Numba twin (kernels/agree_numba.py, the twin of kernels/agree.cu) against the host formula
of canary/manager/distributed.py (entries_digest / plan_digest, SPEC 4.3), in the CUDA simulator: the same bits on
random entries with skipped slots, MISSING_SLOT plan entries, zero counts and counts at or past the capacity. Each
test is its own id under ``pytest -m sim`` (tests/helpers/sim_plugin.py); in this process:
``python -m pytest -q -m sim --numba-sim tests/manager/agree_sim_suite.py``."""
from __future__ import annotations

import importlib.util
import os
from types import SimpleNamespace

import numpy as np
import pytest

from canary.contract.agree_layout import MASK63
from canary.contract.plans import MISSING_SLOT
from canary.interop.adapter import as_view
from canary.manager.distributed import entries_digest, plan_digest

pytestmark = [pytest.mark.sim,
              pytest.mark.skipif(importlib.util.find_spec("numba_cuda") is None,
                                 reason="needs numba-cuda: pip install -e '.[sim]'"),
              pytest.mark.skipif(os.environ.get("NUMBA_ENABLE_CUDASIM") != "1", reason="needs the CUDA simulator")]

I64 = np.iinfo(np.int64)


def _module():
    from canary import backends

    return backends.optional("numba", "agree")


def _plan(rng, cap: int, num_valid: int, missing: float = 0.2):
    slots = rng.integers(0, 1 << 40, cap, dtype=np.int64)
    slots[rng.random(cap) < missing] = MISSING_SLOT
    tokens = rng.integers(-(1 << 40), 1 << 40, cap, dtype=np.int64)
    positions = rng.integers(0, 1 << 20, cap, dtype=np.int64)
    return slots, tokens, positions, np.array([num_valid], np.int32)


def _entries(rng, n: int, widths=(np.int64, np.int64, np.int64), skipped: float = 0.25):
    loc = rng.integers(0, 1 << 30, n).astype(widths[0])
    loc[rng.random(n) < skipped] = -1
    tok = rng.integers(-(1 << 31), (1 << 31) - 1, n).astype(widths[1])  # int32 negatives: sign-extended
    pos = rng.integers(0, 1 << 20, n).astype(widths[2])
    return loc, tok, pos


def _device(plan, entries, threads: int, launches: int = 1):
    out = np.zeros(2, np.int64)
    views = [as_view(a, f"plan{k}") for k, a in enumerate(plan)]
    launch = _module().AgreeLaunch(-1, plan=tuple(views), out=as_view(out, "out"), threads=threads)
    for _ in range(launches):
        launch.launch(*(as_view(a, n) for a, n in zip(entries, ("loc", "tok", "pos"))), 0)
    return int(out[0]) & MASK63, int(out[1]) & MASK63, out


def _host(plan, entries):
    slots, tokens, positions, nv = plan
    vp = SimpleNamespace(verify_slot_indices=slots, verify_expected_tokens=tokens,
                         verify_expected_positions=positions, verify_num_valid=nv)
    return plan_digest(vp), entries_digest(*entries)


def test_the_backend_has_the_family():
    m = _module()
    assert m is not None and m.AgreeLaunch.__name__ == "AgreeLaunch"


@pytest.mark.parametrize("seed", range(16))
def test_random_entries_match_the_host_formula(seed):
    rng = np.random.default_rng(seed)
    cap = int(rng.integers(1, 70))
    nv = int(rng.integers(-3, cap + 4))  # negative and past the capacity: clamped as the host clamps
    widths = tuple(rng.choice([np.int32, np.int64]) for _ in range(3))
    plan, entries = _plan(rng, cap, nv), _entries(rng, int(rng.integers(0, 90)), widths)
    got = _device(plan, entries, threads=int(rng.choice([1, 4, 8, 32])))[:2]
    assert got == _host(plan, entries)


@pytest.mark.parametrize("case", ["zero", "no_valid", "no_entries", "at_capacity", "past_capacity", "all_skipped",
                                  "all_missing"])
def test_edge_counts(case):
    rng = np.random.default_rng(7)
    cap, n = 24, 40
    nv = {"zero": 0, "no_valid": 0, "at_capacity": cap, "past_capacity": cap + 5}.get(case, 11)
    plan = _plan(rng, cap, nv, missing=1.0 if case == "all_missing" else 0.2)
    entries = _entries(rng, 0 if case in ("zero", "no_entries") else n, skipped=1.0 if case == "all_skipped" else 0.25)
    got = _device(plan, entries, threads=4)[:2]
    want = _host(plan, entries)
    assert got == want
    if case == "zero":
        assert got == (0, 0)
    if case == "all_skipped":
        assert got[1] == 0
    if case in ("at_capacity", "past_capacity", "all_missing"):
        assert got[0] != 0


def test_extreme_values_wrap_as_the_host_does():
    """Tokens and positions at the int64 limits, slots at the largest non-negative int64: the sums wrap mod 2^64
    and the top bit is dropped when read, as on the host."""
    cap = n = 16
    plan = (np.full(cap, I64.max, np.int64), np.full(cap, I64.min, np.int64), np.full(cap, -1, np.int64),
            np.array([cap], np.int32))
    entries = (np.full(n, I64.max, np.int64), np.full(n, I64.min, np.int64), np.full(n, I64.max, np.int64))
    assert _device(plan, entries, threads=4)[:2] == _host(plan, entries)


def test_the_block_size_and_grid_change_nothing():
    rng = np.random.default_rng(11)
    plan, entries = _plan(rng, 200, 150), _entries(rng, 300)
    want = _host(plan, entries)
    for threads in (1, 2, 8, 32):  # the simulator's grid is 2 blocks: a grid-stride loop over the rest
        assert _device(plan, entries, threads=threads)[:2] == want


def test_launches_add_to_the_words():
    """The words are added to (the report clears them): two launches of one step's arrays hold twice each sum."""
    rng = np.random.default_rng(3)
    plan, entries = _plan(rng, 30, 30), _entries(rng, 30)
    _, _, out = _device(plan, entries, threads=4, launches=2)
    p, e = _host(plan, entries)
    twice = [(int(out[k]) & ((1 << 64) - 1)) for k in range(2)]
    ones = _device(plan, entries, threads=4)[2]
    assert twice == [(2 * (int(ones[k]) & ((1 << 64) - 1))) % (1 << 64) for k in range(2)]
    assert (int(ones[0]) & MASK63, int(ones[1]) & MASK63) == (p, e)


def test_order_of_the_entries_changes_nothing():
    rng = np.random.default_rng(5)
    plan, entries = _plan(rng, 40, 33), _entries(rng, 50)
    order = rng.permutation(50)
    shuffled = tuple(a[order] for a in entries)
    assert _device(plan, entries, threads=4)[:2] == _device(plan, shuffled, threads=8)[:2] == _host(plan, entries)
