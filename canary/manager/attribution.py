"""Who a violation names (docs/integration.md 4, ``SlotViolation.requests`` and ``writers``): the requests whose
index maps the violated slot at its position, and those whose write landed there, looked up when the report is
decoded, through the group's index as the report's step reads it (:class:`RowCache`), on the error path only."""
from __future__ import annotations

from typing import Hashable

import numpy as np

from ..contract.plans import MISSING_SLOT, mark_missing
from ..contract.ring import FailReason, KernelTag
from ..interop.adapter import as_view
from ..interop.hostcopy import to_host
from .groups import BoundGroup
from .index import NOT_HELD, host_index
from .pool import RequestPool


class Attribution:
    """The attributions of one manager's reports over its request pool ``requests``."""

    def __init__(self, requests: RequestPool):
        self.requests = requests

    def writers(self, g: BoundGroup, v, rec, rpi: np.ndarray | None, owners: tuple, rows: RowCache) -> tuple:
        """Requests whose write landed in ``v.slot`` although they do not own it at ``v.position``, with the
        position their row maps to it (SlotViolation.writers). A write row: the step's batch rows (every running
        request's last row when the step's rows are not known) whose row maps the expected position to the slot,
        else any position. A verify row: the batch rows, then running requests by their last row, mapping the slot
        at another position. Reads a column, or the candidates' rows (a sync each, on the error path only)."""
        slot = v.slot
        if not rows.first_slot <= slot < g.spec.num_slots or v.reasons & (FailReason.MISSING | FailReason.SLOT_RANGE):
            return ()  # no real slot: nothing maps it (slot 0, the padding slot, is in every unwritten entry)
        index = rows.index
        if index is None:
            return ()
        write = v.kernel == KernelTag.WRITE
        candidates = self.candidates(rec, rpi, live=not write or rpi is None, index=index)
        if not candidates:
            return ()
        if write:
            exp = v.expected_position
            if exp is not None and exp != v.position and 0 <= exp < index.max_seq_len:
                column = rows.column(exp)
                hit = tuple((rid, exp) for rid, key in candidates if (rid, exp) not in owners
                            and index.has(key) and column[key] == slot and self.holds(g, rid, exp))
                if hit:
                    return hit
        out: list[tuple[Hashable, int]] = []
        for rid, q in rows.mapping(candidates, slot):
            if q != v.position and (rid, q) not in owners and (rid, q) not in out and self.holds(g, rid, q):
                out.append((rid, q))
        return tuple(out)

    def holds(self, g: BoundGroup, rid: Hashable, position: int) -> bool:
        """Whether request ``rid``'s KV in group ``g`` may hold ``position`` (an attribution's test): when the
        engine reports accepted tokens, only a position its last step could have written: one whose token the step
        planned with (``position + kv_token_id_vs_position_offset`` below the request's expected-token count at
        that step: a KV entry is computed from its token) and, with host arrays, below that step's
        ``prefix_lens + extend_seq_lens`` (a chunked prefill's part). A reused row keeps its previous request's
        slots past the new request's length (no engine clears a freed row): a report must not name a request
        through them. No bound when the engine never accepts tokens (its counts stay at the prompts) or for an id
        never added."""
        pool = self.requests
        if not pool.accepting:
            return True
        req = pool.lookup(rid)
        if req is None:
            return True
        written = int(pool.written[g.index, req.row])
        return position + g.spec.kv_token_id_vs_position_offset < int(pool.planned[g.index, req.row]) and (
            written < 0 or position < written)

    def candidates(self, rec, rpi: np.ndarray | None, live: bool = True, index=None) -> list[tuple[Hashable, int]]:
        """``(request_id, key)`` of the requests an attribution looks at, in order: the step's batch rows, then
        (``live``) the running requests not in the batch. ``key`` is the request's row in ``index``: for a token
        table or block table its ``req_to_token`` row (the step's, a running request's last one); for a page list
        (``index.by_batch_row``) its batch row in the step whose page list is current (:class:`PageIndex`), found
        by request id: a request not in that batch is left out (it cannot be attributed)."""
        out: list[tuple[Hashable, int]] = []
        if rpi is not None:
            out += [(rid, int(rp)) for rid, rp in zip(rec.request_ids, rpi.tolist()) if rid is not None and rp]
        by_batch_row = index is not None and index.by_batch_row
        if live:
            in_batch = {rid for rid, _ in out}
            out += [(rid, req.last_req_pool_index) for rid, req in self.requests.live.items()
                    if rid not in in_batch and (req.last_req_pool_index or by_batch_row)]
        if by_batch_row:
            keys = [(rid, index.key(rid)) for rid, _ in out]
            out = [(rid, r) for rid, r in keys if r is not None]
        return out

    def holders(self, g: BoundGroup, v, rec, rpi: np.ndarray | None,
                rows: "RowCache") -> tuple[tuple[Hashable, int], ...]:
        """Requests whose index maps ``v.position`` to ``v.slot`` now: the step's batch rows, then running requests
        (:meth:`candidates`). "Now" is when the report is decoded: a token table's or block table's rows as they
        are, a request by its row in the step (or its last row); a page list (rows keyed by batch row, rebuilt
        each step) as the step whose page list is current reads it: the step being opened by the
        ``before_forward`` / ``begin_step`` that decodes the report, else (``poll``, ``flush``, ``close``) the
        last planned step, each request by its batch row there; a request not in that batch is not named. A
        MISSING row (no real slot at the position) names the requests whose position has no real slot now (a 0,
        or a real slot mapped to 0) and, when the row has a predecessor slot, whose previous position maps to
        it. Reads a column or two of the index through ``rows`` (a sync, on the error path only)."""
        p = v.position
        index = rows.index
        if index is None or not 0 <= p < index.max_seq_len:
            return ()
        candidates = self.candidates(rec, rpi, index=index)
        if not candidates:
            return ()
        lut = g.spec.full_to_swa_index_mapping
        lut_len = None if lut is None else as_view(lut, "lut").shape[0]

        def translate(raw: int) -> int:
            if lut is None or raw < 0:
                return raw
            return int(np.asarray(to_host(lut[raw:raw + 1]))[0]) if raw < lut_len else -1

        column = rows.raw_column(p)
        prev = v.predecessor_slot
        missing = prev is not None
        pad = g.spec.padding_slot
        # a predecessor that is a slot (MISSING_SLOT or 0 when it is none: SPEC 3.2) names the request
        before = rows.raw_column(p - 1) if missing and prev >= (0 if pad == -1 else 1) and p > 0 else None
        out = []
        for rid, key in candidates:
            if not index.has(key) or not self.holds(g, rid, p):
                continue
            raw = int(column[key])
            if raw == NOT_HELD:  # a page row that does not hold the position
                continue
            if missing:
                hit = int(mark_missing(raw, translate(raw), pad)) == MISSING_SLOT and (
                    before is None or translate(int(before[key])) == prev)
            else:
                hit = translate(raw) == v.slot
            if hit and (rid, p) not in out:
                out.append((rid, p))
        return tuple(out)


class RowCache:
    """``g``'s index as the attributions of one report read it (:func:`~canary.manager.index.host_index`: a token
    table or block table as it is, a page list as the step whose page list is current reads it): columns and rows
    copied to the host once each, translated to the group's own slots (an SWA group's through its full-to-SWA
    mapping, -1 past it; a page row's :data:`~canary.manager.index.NOT_HELD` stays)."""

    def __init__(self, g: BoundGroup):
        self.index, self.lut = host_index(g), g.spec.full_to_swa_index_mapping  # None: nothing to attribute
        self.first_slot = 0 if g.spec.padding_slot == -1 else 1  # the lowest real slot (SPEC 3.2)
        self._lut: np.ndarray | None = None
        self._raw: dict[int, np.ndarray] = {}
        self._cols: dict[int, np.ndarray] = {}
        self._rows: dict[int, np.ndarray] = {}
        self._index: dict[tuple, tuple] = {}

    def _translate(self, raw: np.ndarray) -> np.ndarray:
        raw = raw.astype(np.int64)
        if self.lut is None:
            return raw
        if self._lut is None:
            self._lut = np.asarray(to_host(self.lut)).astype(np.int64)
        inside = (raw >= 0) & (raw < self._lut.shape[0])
        return np.where(inside, self._lut[np.where(inside, raw, 0)], np.where(raw < 0, raw, -1))

    def raw_column(self, p: int) -> np.ndarray:
        """Every key's raw slot at position ``p`` (before the SWA mapping)."""
        got = self._raw.get(p)
        if got is None:
            got = self._raw[p] = self.index.column(p)
        return got

    def column(self, p: int) -> np.ndarray:
        got = self._cols.get(p)
        if got is None:
            got = self._cols[p] = self._translate(self.raw_column(p))
        return got

    def row(self, key: int) -> np.ndarray:
        got = self._rows.get(key)
        if got is None:
            got = self._rows[key] = self._translate(self.index.row(key))
        return got

    def mapping(self, candidates: list[tuple[Hashable, int]], slot: int) -> list[tuple[Hashable, int]]:
        """``(request_id, position)`` of every position of the candidates' rows that maps to ``slot``, in candidate
        then position order. The candidates' rows are indexed once per report (sorted by slot): a report of many
        rows searches it, not every row again."""
        key = tuple(candidates)
        got = self._index.get(key)
        if got is None:
            slots, who, pos = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
            for i, (_, k) in enumerate(candidates):
                if self.index.has(k):
                    row = self.row(k)
                    at = np.flatnonzero(row >= self.first_slot)
                    slots.append(row[at]), who.append(np.full(at.shape[0], i, np.int64)), pos.append(at)
            slots, who, pos = np.concatenate(slots), np.concatenate(who), np.concatenate(pos)
            order = np.argsort(slots, kind="stable")
            got = self._index[key] = (slots[order], who[order], pos[order])
        slots, who, pos = got
        lo, hi = np.searchsorted(slots, slot, "left"), np.searchsorted(slots, slot, "right")
        return [(candidates[i][0], q) for i, q in zip(who[lo:hi].tolist(), pos[lo:hi].tolist())]
