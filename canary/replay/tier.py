"""The replay's host tier (``--offload-tier``): where a preempted request's KV bytes and canary records wait.

The scheduler (:mod:`canary.replay.scheduler`) decides who is preempted and when it comes back; this module moves
the bytes. An offload copies the K and V bytes of every layer at the request's slots into the tier and gathers
the slots' record rows (SPEC 4.1: records and layer hashes) beside them; a restore scatters both into the new
slots. A restore is planned as a :class:`Restore` (which tier entry each new slot gets), so that the ``offload-*``
faults (:mod:`canary.replay.faults`) can edit the plan before it is carried out.

The tier is a ring of ``tokens`` entries: each offload takes the next ``n`` entries (wrapping to 0 when they do
not fit), so the copies of earlier offloads stay readable until the ring comes round to them (what an
``offload-stale`` restore returns). On a GPU the simulated tier lives on the canary's device.

The record moves go through the manager's ``gather_records`` / ``scatter_records`` / ``allocate_record_rows``
(docs/integration.md 7b), the calls an engine makes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .engine import K_BYTES, V_BYTES, EngineKV

def _gather(manager: Any, slots: Any, out: Any) -> None:
    """``out[i] = row(slots[i])`` (SPEC 4.1)."""
    manager.gather_records(slots, out)


def _scatter(manager: Any, rows: Any, slots: Any) -> None:
    """``row(slots[i]) = rows[i]`` (SPEC 4.1)."""
    manager.scatter_records(rows, slots)


def _rows(manager: Any, n: int) -> Any:
    """A zeroed ``[n, row_words]`` int64 buffer of record rows."""
    return manager.allocate_record_rows(n)


@dataclass
class Copy:
    """One offload's copy in the tier: ``n`` entries from ``start``, positions ``0..n-1`` of ``request``."""

    request: int
    start: int
    n: int
    live: bool = True  # not yet restored
    intact: bool = True  # no later copy has overwritten any of its entries


@dataclass
class Restore:
    """A restore's plan, host NumPy, one value per new slot (the request's positions ``0..n-1``): the tier entry
    whose record (``rec_src``), K bytes (``k_src``) and V bytes (``v_src``) the slot gets, ``-1``: none (the slot
    keeps what it held). ``k_bytes``: ``{new slot index: [layers, K_BYTES] uint8}``, K bytes put in place of the
    tier's (a fault). A fault edits the plan before :meth:`HostTier.restore` carries it out."""

    step: int
    request: int
    row: int
    slots: np.ndarray  # [n] int64, the new slots
    copy: Copy
    rec_src: np.ndarray
    k_src: np.ndarray
    v_src: np.ndarray
    k_bytes: dict


class HostTier:
    """The tier: ``tokens`` entries of every layer's K and V bytes and a record row each."""

    def __init__(self, kv: EngineKV, manager: Any, tokens: int):
        xp, L = kv.xp, kv.num_layers
        self.kv, self.manager, self.tokens = kv, manager, int(tokens)
        self.k = xp.zeros((L, self.tokens, K_BYTES), dtype=xp.uint8)
        self.v = xp.zeros((L, self.tokens, V_BYTES), dtype=xp.uint8)
        self.records = _rows(manager, self.tokens)
        self.copies: list[Copy] = []
        self.cursor = 0

    def _k_view(self) -> Any:
        """Every layer's K bytes, ``[L, slots, K_BYTES]`` uint8 (a view of the paged K sources)."""
        kv = self.kv
        return kv.layer_k.view(kv.xp.uint8).reshape(kv.num_layers, -1, K_BYTES)

    def offload(self, request: int, slots: np.ndarray) -> Copy:
        """Copy the KV bytes and records of ``slots`` (positions ``0..n-1`` of ``request``) into the tier."""
        xp, n = self.kv.xp, len(slots)
        start = self.cursor if self.cursor + n <= self.tokens else 0
        self.cursor = start + n
        for c in self.copies:  # the entries this copy takes: older copies there are gone
            if c.start < start + n and start < c.start + c.n:
                c.intact = False
        copy = Copy(request, start, n)
        self.copies = [c for c in self.copies if c.intact] + [copy]
        s = xp.asarray(slots)
        self.k[:, start : start + n] = self._k_view()[:, s]
        self.v[:, start : start + n] = self.kv.layer_v[:, s]
        _gather(self.manager, s, self.records[start : start + n])
        return copy

    def plan(self, step: int, request: int, row: int, slots: np.ndarray) -> Restore:
        """The clean restore of ``request``'s live copy into ``slots``: entry ``start + p`` for position ``p``."""
        copy = next(c for c in self.copies if c.live and c.request == request)
        src = copy.start + np.arange(len(slots), dtype=np.int64)
        return Restore(step, request, row, np.asarray(slots, dtype=np.int64), copy, src, src.copy(), src.copy(), {})

    def restore(self, r: Restore) -> None:
        """Carry out the plan: KV bytes first, then the records (SPEC 4.1: after the KV is in place)."""
        xp = self.kv.xp
        kview = self._k_view()
        for src, tier, dst in ((r.k_src, self.k, kview), (r.v_src, self.v, self.kv.layer_v)):
            keep = src >= 0
            dst[:, xp.asarray(r.slots[keep])] = tier[:, xp.asarray(src[keep])]
        for i, b in r.k_bytes.items():
            kview[:, int(r.slots[i])] = xp.asarray(b)
        keep = r.rec_src >= 0
        rows = self.records[xp.asarray(r.rec_src[keep])]
        _scatter(self.manager, rows, xp.asarray(r.slots[keep]))
        r.copy.live = False

    def stale_copy(self, request: int, n: int) -> Copy | None:
        """An earlier copy of another request still readable in the tier, of at least ``n`` entries."""
        return next((c for c in reversed(self.copies)
                     if not c.live and c.intact and c.request != request and c.n >= n), None)
