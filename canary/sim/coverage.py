"""Verify coverage of a replay, computed on the host from what the simulator knows.

A step *asks* for every cached token of its running requests: row ``i``'s verify window, positions
``[window_start(P), P)`` (SPEC 3.2; with a sliding window only the last ``W``). The plan verifies its entries
``[0, verify_num_valid)`` when ``enable = 1``, and nothing when ``enable = 0`` (an OVERFLOW step: the
capacity was too small, and the whole step goes unverified). Every asked ``(token, step)`` pair is either
verified or not, and :class:`Coverage` counts them:

- ``unverified_steps``: steps that asked for at least one token and verified none;
- ``sampled_steps``: enabled steps that verified a strict subset of what they asked (status bit ``SAMPLED``,
  or ``0 < verify_num_valid < asked``);
- ``verified_fraction``: verified pairs / asked pairs (1.0 when nothing was asked);
- ``max_staleness_steps``: the longest run, over all tokens, of consecutive steps in which the token was asked
  and not verified. A verified step ends the run, and so does the token leaving the window or its request
  finishing. A step that does not schedule the token's request (``--token-budget``) neither extends nor ends
  it: the request's KV is not read in that step either.

Which tokens a sampled step verified is read from the plan: its entries ``[0, verify_num_valid)`` name their
slots, and the slots of the live tokens of the window are unique. A step verifies all or none of its tokens
today, which keeps the common case cheap: a row's runs are only touched when some step left it unverified.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from canary import PlanStatus, VerifyPlan, to_host

from .scheduler import Step

# The status bit of a plan that verified a sample of its entries (a later planner sets it; absent today).
SAMPLED = int(getattr(PlanStatus, "SAMPLED", 64))


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
        self.max_staleness = 0

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
        verified = min(nv, asked) if enable else 0
        self.asked += asked
        self.verified += verified
        if asked and not verified:
            self.unverified_steps += 1
        sampled = bool(enable) and bool(status & SAMPLED or 0 < nv < asked)
        self.sampled_steps += sampled

        # A row taken over by a new request starts with no runs: its old tokens left the cache.
        new = self.owner[rows] != reqs
        for row in rows[new & self.dirty[rows]].tolist():
            self.run[row] = 0
            self.dirty[row] = False
        self.owner[rows] = reqs
        if verified == asked:
            for row in rows[self.dirty[rows]].tolist():
                self.run[row] = 0
                self.dirty[row] = False
            return
        hit = self._verified_slots(plan, nv) if verified else None
        for i in range(n):
            row, a, b = int(rows[i]), int(lo[i]), int(end[i])
            if a == b:
                continue
            seg = self.run[row, a:b]
            seg += 1
            if hit is not None:
                seg[np.isin(self._slots(row, a, b), hit)] = 0
            self.dirty[row] = True
            self.max_staleness = max(self.max_staleness, int(seg.max()))

    def _slots(self, row: int, a: int, b: int) -> np.ndarray:
        s = self.r2t[row, a:b].astype(np.int64)
        return s if self.lut is None else self.lut[s]

    @staticmethod
    def _verified_slots(plan: VerifyPlan, nv: int) -> np.ndarray:
        return to_host(plan.verify_slot_indices)[:nv]

    def summary(self) -> dict[str, Any]:
        return {
            "unverified_steps": self.unverified_steps,
            "sampled_steps": self.sampled_steps,
            "verified_fraction": self.verified / self.asked if self.asked else 1.0,
            "max_staleness_steps": self.max_staleness,
            "cached_token_steps": self.asked,
            "verified_token_steps": self.verified,
        }
