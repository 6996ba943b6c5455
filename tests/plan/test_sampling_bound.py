"""SPEC 3.7's guarantee, on the reference planner over many consecutive steps, cursors carried over.

Stable layout (the same batch, the same windows, step after step), any capacity from 1 to ``total - 1``: every
(row, position) is verified at least once in any ``K`` consecutive steps, with ``K`` per request as SPEC 3.7
states it (``C > n``: ``ceil((total - n) / (C - n))``, and ``ceil(L / take)`` per request; ``C = n``: ``L``;
``C < n``: ``ceil(n / C) * L``), and each step's takes obey the bound of SPEC 3.7. Decode growth (every prefix
one longer each step): the staleness measured here stays below the current step's ``K`` (docs/replay.md).
"""
from __future__ import annotations

import numpy as np
import pytest

from canary import CanaryPlanner, PlanStatus, VerifyPlan, WritePlan
from canary.replay.coverage import sweep_bound  # K of SPEC 3.7, the bound the replay reports

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

MAX_REQS = 8


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class Rig:
    """A reference planner over ``req_to_token[rp, p] = rp * seq + p + 1`` (so a slot names its (row, position)),
    with an identity LUT when a sliding window is planned."""

    def __init__(self, *, seq: int, cap: int, bs: int, window: int, cursors: np.ndarray):
        self.seq = seq
        r2t = (np.arange(MAX_REQS * seq, dtype=np.int32) + 1).reshape(MAX_REQS, seq)
        lut = np.arange(MAX_REQS * seq + 1, dtype=np.int64) if window else None
        self.vp = VerifyPlan.allocate(verify_capacity=cap, max_reqs=MAX_REQS)
        self.vp.verify_cursors[:] = cursors
        self.wp = WritePlan.allocate(write_req_capacity=bs)
        self.planner = CanaryPlanner(backend="reference", verify_plan_out=self.vp, write_plan_out=self.wp,
                                     req_to_token=r2t, swa_window_size=window, full_to_swa_index_mapping=lut)

    def step(self, rpi: np.ndarray, prefix: np.ndarray) -> tuple[PlanStatus, np.ndarray, np.ndarray]:
        """Plan one step; returns its status and the verified entries' request rows and positions."""
        status = self.planner.plan(req_pool_indices=rpi, prefix_lens=prefix,
                                   extend_seq_lens=np.where(rpi != 0, 1, 0).astype(np.int64), check=True)
        nv = int(self.vp.verify_num_valid[0])
        rows, pos = np.divmod(self.vp.verify_slot_indices[:nv] - 1, self.seq)
        assert np.array_equal(pos, self.vp.verify_expected_positions[:nv])
        return status, rows, pos


@st.composite
def layouts(draw, max_prefix: int = 40, windows: tuple[int, ...] = (0, 0, 1, 2, 3, 8, 17)):
    """A batch of distinct request rows (some with an empty window) among padding rows, a window (one of
    ``windows``), a capacity that samples, and any starting cursors."""
    n_req = draw(st.integers(1, MAX_REQS - 1))
    rows = draw(st.permutations(range(1, MAX_REQS)))[:n_req]
    prefix = draw(st.lists(st.integers(0, max_prefix), min_size=n_req, max_size=n_req))
    pads = draw(st.lists(st.integers(0, n_req), max_size=3))  # where padding rows sit in the batch
    rpi, pl = list(rows), list(prefix)
    for at in sorted(pads, reverse=True):
        rpi.insert(at, 0)
        pl.insert(at, draw(st.integers(-5, 10 ** 6)))  # a padding row's P is garbage, never read
    window = draw(st.sampled_from(windows))
    rpi, pl = np.array(rpi, dtype=np.int64), np.array(pl, dtype=np.int64)
    total = int(_lengths(rpi, pl, window).sum())
    hypothesis.assume(total >= 2)
    cap = draw(st.integers(1, total - 1))
    cursors = np.array(draw(st.lists(st.integers(-3, max_prefix + 3), min_size=MAX_REQS, max_size=MAX_REQS)),
                       dtype=np.int64)
    return rpi, pl, window, cap, cursors


def _lengths(rpi: np.ndarray, prefix: np.ndarray, window: int) -> np.ndarray:
    """``L[r]`` of each batch row (0 for padding rows)."""
    p = np.where(rpi != 0, prefix, 0)
    return np.minimum(p, window) if window else p


def _take_bound(lengths: np.ndarray, cap: int) -> np.ndarray:
    """SPEC 3.7's lower bound on each row's take for ``C >= n``."""
    n, total = int((lengths > 0).sum()), int(lengths.sum())
    return np.where(lengths > 0, 1 + (cap - n) * (lengths - 1) // (total - n), 0)


@hypothesis.settings(max_examples=100, deadline=None, suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(layout=layouts())
def test_a_stable_layout_is_swept_within_k_steps(layout):
    rpi, prefix, window, cap, cursors = layout
    lengths = _lengths(rpi, prefix, window)
    n, total = int((lengths > 0).sum()), int(lengths.sum())
    start = np.where(rpi != 0, np.maximum(prefix - window, 0) if window else 0, 0)
    rig = Rig(seq=64, cap=cap, bs=len(rpi), window=window, cursors=cursors)
    # Per batch row, the steps within which each of its tokens is verified again (SPEC 3.7).
    if cap > n:
        k_all = ceil_div(total - n, cap - n)
        take = _take_bound(lengths, cap)
        bound = np.where(lengths > 0, np.minimum(k_all, ceil_div(lengths, np.maximum(take, 1))), 0)
        assert (take * k_all >= lengths).all()
    elif cap == n:
        bound = lengths.copy()
    else:
        bound = ceil_div(n, cap) * lengths
    steps = 2 * int(bound.max())
    run = {int(r): np.zeros(int(length), dtype=np.int64) for r, length in zip(rpi, lengths) if length}
    longest = {r: 0 for r in run}
    for _ in range(steps):
        status, rows, pos = rig.step(rpi, prefix)
        assert status == PlanStatus.SAMPLED and len(rows) == cap
        takes = np.array([int((rows == r).sum()) if r else 0 for r in rpi])
        assert takes.sum() == cap and (takes[lengths == 0] == 0).all()
        if cap >= n:
            assert (takes >= _take_bound(lengths, cap)).all()
        else:
            assert set(takes.tolist()) <= {0, 1}
        for i, r in enumerate(rpi.tolist()):
            if not lengths[i]:
                continue
            run[r] += 1
            run[r][pos[rows == r] - start[i]] = 0
            longest[r] = max(longest[r], int(run[r].max()))
    for i, r in enumerate(rpi.tolist()):
        if lengths[i]:
            # Any bound[i] consecutive steps verify each token: it is never unverified bound[i] steps in a row.
            assert longest[r] <= bound[i] - 1, (r, longest[r], bound[i])


@hypothesis.settings(max_examples=100, deadline=None, suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(layout=layouts(windows=(0,)), steps=st.integers(1, 150))
def test_decode_growth_stays_within_the_current_k(layout, steps):
    """Every request appends one token per step, windows that do not slide. A token's staleness (consecutive
    steps asked and unverified) never reaches the ``K`` of the current step's layout: the figure docs/replay.md
    compares with. (``K`` itself grows with the batch's context at a fixed capacity, and the staleness with it.
    A sliding window, a layout that moves, can exceed it by a step or two while it moves, from some starting
    cursors: the growing-window bound of the next test covers it.)"""
    rpi, prefix, window, cap, cursors = layout
    seq = 40 + steps + 2
    rig = Rig(seq=seq, cap=cap, bs=len(rpi), window=window, cursors=cursors)
    active = rpi != 0
    run = np.zeros((MAX_REQS, seq), dtype=np.int64)  # per (request row, position)
    for _ in range(steps):
        lengths = _lengths(rpi, prefix, window)
        _, rows, pos = rig.step(rpi, prefix)
        windows = [(int(rpi[i]), max(int(prefix[i]) - window, 0) if window else 0, int(prefix[i]))
                   for i in np.flatnonzero(active)]
        for r, lo, hi in windows:
            run[r, :lo] = 0  # left the window: its run is over
            run[r, lo:hi] += 1
        run[rows, pos] = 0
        k = sweep_bound(lengths, cap)
        assert int(run.max()) <= k - 1, (int(run.max()), k)
        prefix = np.where(active, prefix + 1, prefix)


@hypothesis.settings(max_examples=200, deadline=None, suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(layout=layouts(), steps=st.integers(1, 200), g=st.sampled_from([1, 1, 2, 4]))
def test_growing_windows_are_swept_within_the_bound(layout, steps, g):
    """SPEC 3.7, growing windows: with ``C >= n`` every request appends ``g`` positions per step, and a position
    present in a window of ``L`` positions is verified within ``ceil(L / t) + ceil((L + g * ceil(L / t)) / t)``
    steps, ``t`` the request's smallest take meanwhile (``3 * ceil(L / t)`` for decode, ``g = 1``). (A walk going
    up the window, as before, never wrapped when it advanced no faster than the window grew: with ``C = n`` a
    request's first positions waited as long as it ran.)"""
    rpi, prefix, window, cap, cursors = layout
    active = rpi != 0
    hypothesis.assume(cap >= int(active.sum()))  # C >= n on every step: empty windows grow too
    seq = 40 + g * steps + 2
    rig = Rig(seq=seq, cap=cap, bs=len(rpi), window=window, cursors=cursors)
    run = np.zeros((MAX_REQS, seq), dtype=np.int64)  # consecutive steps unverified, per (request row, position)
    started = np.zeros((MAX_REQS, seq), dtype=np.int64)  # the window's length when that run began
    least = np.full(MAX_REQS, 1 << 40, dtype=np.int64)  # each request's smallest take so far
    for _ in range(steps):
        lengths = _lengths(rpi, prefix, window)
        status, rows, pos = rig.step(rpi, prefix)
        for i in np.flatnonzero(active & (lengths > 0)):
            r, hi = int(rpi[i]), int(prefix[i])
            lo = hi - int(lengths[i])
            run[r, :lo] = 0  # left the window: nothing more to verify there
            fresh = run[r, lo:hi] == 0
            started[r, lo:hi][fresh] = lengths[i]
            run[r, lo:hi] += 1
            if status & PlanStatus.SAMPLED:
                least[r] = min(least[r], int((rows == r).sum()))
        run[rows, pos] = 0
        t = np.maximum(least, 1)[:, None]
        wrap = ceil_div(started, t)
        bound = wrap + ceil_div(started + g * wrap, t)
        waiting = run > 0
        assert (run[waiting] <= bound[waiting]).all(), (int(run.max()), int(bound[waiting].min()))
        prefix = np.where(active, prefix + g, prefix)
