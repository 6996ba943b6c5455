"""Which slots' violations the manager already holds, as the kernels read it: each group's ``reported_slots``
(SPEC 4; docs/records.md 6.1), so that under mass corruption the ring fills with slots not named yet instead of
the same first rows every step.

The rule: when a step's report dropped rows (more violations than the ring holds), every verify row it kept
marks its slot (bit 1; a ``MISSING`` row marks its predecessor slot with bit 2), held by the record it was
decoded into. The kernels then skip those slots' rows, so the next steps' rings hold new slots. A mark is
released when a request or cached prefix its record names finishes or is evicted (the slot may be handed to
another request, whose own violations must be named), when the record's delivery failed (its next sighting is
new again), and all at once by :meth:`ReportedSlots.clear` (a rebound buffer). A record that names no request
and no prefix marks nothing: nobody would release it.

The arrays are host memory the kernels read in place: NumPy for a host manager, pinned host memory for a GPU
one (read through unified addressing, only by a failing row: a clean step never touches them), so a mark costs
the host one byte store and no copy. A byte changed while a launch runs is seen by it or by the next one:
either is correct.
"""
from __future__ import annotations

from typing import Hashable

import numpy as np

from ..contract.ring import KernelTag

SLOT_BIT, PREDECESSOR_BIT = 1, 2


class ReportedSlots:
    """One ``[num_slots]`` uint8 array per group (``arrays[i]``, the state's ``reported_slots``), and which
    records hold which marks."""

    def __init__(self, num_slots: list[int], ordinal: int | None):
        self._pinned = []
        self.arrays: list[np.ndarray] = []
        for n in num_slots:
            if ordinal is None:
                self.arrays.append(np.zeros(int(n), dtype=np.uint8))
            else:
                from .transfer import Pinned

                buf = Pinned(int(n))
                self._pinned.append(buf)
                arr = buf.array(0, (int(n),), np.uint8)
                arr[:] = 0
                self.arrays.append(arr)
        self._held: dict[int, tuple] = {}  # id(record) -> (record, ((group, slot, bit), ...))
        self._count: dict[tuple[int, int, int], int] = {}  # (group, slot, bit) -> records holding it
        self.marked_steps = 0  # reports whose overflow marked slots (stats)

    def mark(self, group: int, record, rows) -> None:
        """Mark the slots of ``rows`` (the ring rows a record was decoded from), held by ``record``."""
        if not (record.requests or record.writers or record.prefixes) or id(record) in self._held:
            return
        arr = self.arrays[group]
        n = arr.shape[0]
        marks = []
        for v in rows:
            if v.kernel not in (KernelTag.VERIFY, KernelTag.VERIFY_LAYER):
                continue
            prev = v.predecessor_slot  # a MISSING row's slot names none: its predecessor does
            slot, bit = (v.slot, SLOT_BIT) if prev is None else (prev, PREDECESSOR_BIT)
            if 0 <= slot < n:
                marks.append((group, int(slot), bit))
        if not marks:
            return
        self._held[id(record)] = (record, tuple(marks))
        for key in marks:
            self._count[key] = self._count.get(key, 0) + 1
            arr[key[1]] |= key[2]

    def release(self, records) -> None:
        """Unmark what ``records`` hold (a record holding nothing is ignored)."""
        for r in records:
            held = self._held.pop(id(r), None)
            if held is None:
                continue
            for key in held[1]:
                left = self._count[key] - 1
                if left:
                    self._count[key] = left
                else:
                    del self._count[key]
                    self.arrays[key[0]][key[1]] &= ~key[2] & 0xFF

    def release_request(self, request_id: Hashable) -> None:
        """A request finished: release the records that name it."""
        self.release([r for r, _ in self._held.values()
                      if any(rid == request_id for rid, _ in r.requests + r.writers)])

    def release_prefix(self, key: Hashable) -> None:
        """A cached prefix was evicted: release the records that name it."""
        self.release([r for r, _ in self._held.values() if any(k == key for k, _ in r.prefixes)])

    def clear(self) -> None:
        self._held.clear()
        self._count.clear()
        for arr in self.arrays:
            arr[:] = 0

    @property
    def marked(self) -> int:
        """Slots marked now, over every group."""
        return len(self._count)

    def close(self) -> None:
        for buf in self._pinned:
            buf.free()
        self._pinned = []
