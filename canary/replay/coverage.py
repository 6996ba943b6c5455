"""Verify coverage of a replay, computed on the host from what the simulator knows.

A step *asks* for every cached token of its running requests: row ``i``'s verify window, positions
``[window_start(P), P)`` (SPEC 3.2; with a sliding window only the last ``W``). The plan verifies exactly its
entries ``[0, verify_num_valid)`` when ``enable = 1``: all of them on a step within the capacity, a rotating
sample of ``C`` on a step above it (``on_overflow="sample"``, status bit ``SAMPLED``, SPEC 3.7), and nothing
when ``enable = 0`` (``on_overflow="skip"``: an OVERFLOW step goes unverified as a whole). Every asked
``(token, step)`` pair is either verified or not, and :class:`Coverage` counts them:

- ``unverified_steps``: steps that asked for at least one token and verified none;
- ``sampled_steps``: enabled steps that verified a strict subset of what they asked (status bit ``SAMPLED``,
  or ``0 < verify_num_valid < asked``);
- ``verified_fraction``: verified pairs / asked pairs (1.0 when nothing was asked);
- ``max_staleness_steps``: the longest run, over all tokens, of consecutive steps in which the token was asked
  and not verified. A verified step ends the run, and so does the token leaving the window or its request
  finishing. A step that does not schedule the token's request (``--token-budget``) neither extends nor ends
  it: the request's KV is not read in that step either;
- ``max_sweep_steps``: the largest sweep bound of SPEC 3.7 over the sampled steps, as if each step's layout
  were stable: ``ceil((total - n) / (C - n))`` for ``C > n``, ``ceil(n / C) * max L`` for ``C <= n`` (0 when
  nothing was sampled). A token is verified at least once in any that many consecutive steps of a stable
  layout, so ``max_staleness_steps`` stays below it unless decode growth and batch changes push it over.

Which pairs a step verified is read from the plan: an asked pair ``(row, p)`` is verified when an entry of
``[0, verify_num_valid)`` has its slot (``MISSING_SLOT`` for a cleared SWA mapping, as the planner writes it)
and its position; the live tokens of a window have unique slots, so the pair names one token. A step that
verifies everything it asked (the common case) costs nothing per token: only rows left with unverified
tokens hold nonzero runs.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from canary import MISSING_SLOT, PlanStatus, VerifyPlan, to_host
from canary.contract.plans import mark_missing, translate

from .scheduler import Step

SAMPLED = int(PlanStatus.SAMPLED)


def _keys(slots: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """One int64 per (slot, position): slots are int32 values (or MISSING_SLOT, folded onto -1: no slot is
    negative otherwise once translated, and -1 marks an out-of-range slot the verify cannot match anyway)."""
    s = np.where(slots == MISSING_SLOT, -1, slots).astype(np.int64)
    return (s << 32) | (positions.astype(np.int64) & 0xFFFFFFFF)


def _member(slots: np.ndarray, positions: np.ndarray, entry_slots: np.ndarray, entry_positions: np.ndarray
            ) -> np.ndarray:
    """Whether each (slot, position) pair is among the entries' pairs, as ``np.isin`` of their :func:`_keys`.

    Through a table of each slot's entry position when every slot is a plain index and no slot has two entry
    positions (a sane plan); ``np.isin`` (a sort of both sides, 50 ms a sampled step) otherwise."""
    if entry_slots.shape[0] == 0 or slots.shape[0] == 0:
        return np.zeros(slots.shape[0], dtype=bool)
    lo = min(int(slots.min()), int(entry_slots.min()))
    hi = max(int(slots.max()), int(entry_slots.max()))
    if lo >= 0 and hi < max(1 << 20, 8 * slots.shape[0]):  # a table of at most 8 MiB or 8 words a pair
        mask = np.int64(0xFFFFFFFF)  # _keys compares positions modulo 2**32
        table = np.full(hi + 1, -1, dtype=np.int64)
        want = entry_positions.astype(np.int64) & mask
        table[entry_slots] = want
        if np.array_equal(table[entry_slots], want):
            return table[slots] == (positions.astype(np.int64) & mask)
    return np.isin(_keys(slots, positions), _keys(entry_slots, entry_positions))


def sweep_bound(lengths: np.ndarray, cap: int) -> int:
    """SPEC 3.7's sweep bound of one sampled step with window lengths ``lengths`` and capacity ``cap``."""
    lengths = lengths[lengths > 0]
    n, total = len(lengths), int(lengths.sum())
    if total <= cap:
        return 1
    if cap > n:
        return -(-(total - n) // (cap - n))
    return -(-n // cap) * int(lengths.max())


class Coverage:
    """Per-step coverage bookkeeping; feed it every planned step with :meth:`add`, then read :meth:`summary`.

    ``r2t`` / ``lut``: the host ``req_to_token`` table and full-to-SWA LUT the plans were built from;
    ``window``: the sliding window (0: full attention).
    """

    def __init__(self, r2t: np.ndarray, lut: np.ndarray | None, window: int):
        self.r2t, self.lut, self.window = r2t, lut, window
        # Per (row, position): steps the token has gone unverified in a row. Only rows flagged dirty hold
        # nonzero values, so a fully verified step costs nothing per token.
        self.run = np.zeros(r2t.shape, dtype=np.int32)
        self.dirty = np.zeros(r2t.shape[0], dtype=bool)
        self.owner = np.full(r2t.shape[0], -1, dtype=np.int64)  # the request whose runs a row holds
        self.steps = self.unverified_steps = self.sampled_steps = 0
        self.asked = self.verified = 0
        self.max_staleness = self.max_sweep = 0
        self.step_staleness = 0  # the last step's longest run (0: it verified all it asked), for --plot

    def add(self, step: Step, plan: VerifyPlan) -> None:
        """Account for ``step``, whose verify plan is ``plan`` (already planned)."""
        self.steps += 1
        n = step.num_active
        rows = step.req_pool_indices[:n]
        reqs = step.request_ids[:n]
        end = step.prefix_lens[:n]
        lo = np.maximum(end - self.window, 0) if self.window else np.zeros(n, dtype=np.int64)
        asked = int((end - lo).sum())
        status, enable, nv = (int(to_host(getattr(plan, f))[0]) for f in ("status", "enable", "verify_num_valid"))
        nv = nv if enable else 0
        self.asked += asked

        # A row taken over by a new request starts with no runs: its old tokens left the cache.
        new = self.owner[rows] != reqs
        self._clean(rows[new])
        self.owner[rows] = reqs
        self.step_staleness = 0
        if nv >= asked and not status & SAMPLED:  # everything asked is in the plan (SPEC 3.2)
            self.verified += asked
            self._clean(rows)
            return
        if status & SAMPLED:
            self.max_sweep = max(self.max_sweep, sweep_bound(end - lo, plan.verify_slot_indices.shape[0]))
        hit, r, p = self._verified(plan, nv, rows, lo, end)
        verified = int(hit.sum())
        self.verified += verified
        self.unverified_steps += bool(asked and not verified)
        self.sampled_steps += bool(nv and (status & SAMPLED or nv < asked))
        at = r * self.run.shape[1] + p  # 1-D indices: 2-D fancy indexing is several times slower
        run = self.run.reshape(-1)
        runs = np.take(run, at) + 1
        runs[hit] = 0
        run[at] = runs
        self.dirty[rows] = True
        if runs.size:
            self.step_staleness = int(runs.max())
            self.max_staleness = max(self.max_staleness, self.step_staleness)

    def _clean(self, rows: np.ndarray) -> None:
        for row in rows[self.dirty[rows]].tolist():
            self.run[row] = 0
            self.dirty[row] = False

    def _verified(self, plan: VerifyPlan, nv: int, rows: np.ndarray, lo: np.ndarray, end: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Whether each asked pair is among the plan's entries, with the pairs' rows and positions."""
        count = end - lo
        which = np.repeat(np.arange(len(rows)), count)
        first = np.cumsum(count) - count
        r = rows[which]
        p = lo[which] + np.arange(int(count.sum()), dtype=np.int64) - first[which]
        if not nv:
            return np.zeros(len(r), dtype=bool), r, p
        raw = np.take(self.r2t.reshape(-1), r * self.r2t.shape[1] + p).astype(np.int64)
        slot, _ = translate(raw, self.lut)
        slot = mark_missing(raw, slot)  # as the planner writes a position without a real slot
        entry_slots = to_host(plan.verify_slot_indices)[:nv]
        return _member(slot, p, entry_slots, to_host(plan.verify_expected_positions)[:nv]), r, p

    def summary(self) -> dict[str, Any]:
        return {
            "unverified_steps": self.unverified_steps,
            "sampled_steps": self.sampled_steps,
            "verified_fraction": self.verified / self.asked if self.asked else 1.0,
            "max_staleness_steps": self.max_staleness,
            "max_sweep_steps": self.max_sweep,
            "cached_token_steps": self.asked,
            "verified_token_steps": self.verified,
        }
