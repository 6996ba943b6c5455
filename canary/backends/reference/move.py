"""NumPy reference of records that move (SPEC 4.1): ``gather_rows`` and ``scatter_rows``.

The semantics ``canary_gather_rows`` / ``canary_scatter_rows`` of ``kernels/records_move.cu`` and
``kernels/records_move_numba.py`` reproduce byte for byte: the buffer rows, the records' four fields, the layer
table and the status word. A copy inside the pool is :func:`gather_rows` into the scratch, then
:func:`scatter_rows` from it (:class:`canary.records.move.RecordMover` does both). Inputs are validated host arrays;
outputs are updated in place. Duplicate destinations: the last row aimed at a slot is stored (a GPU may store any).
"""
from __future__ import annotations

import numpy as np

from ...contract.move_layout import RECORD_WORDS, STATUS_FAULTS, STATUS_REFUSED, MoveFault
from ..args import DEFAULT_LAUNCH, LaunchConfig, MoveArgs, MoveTables

NAME = "reference"
ON_DEVICE = False

_I64 = np.int64


def _refuse(status: np.ndarray, fault: MoveFault, count: int) -> None:
    """Fold ``count`` refused entries into the sticky status word (``[2]`` int64)."""
    if count:
        status[STATUS_FAULTS] |= int(fault)
        status[STATUS_REFUSED] += count


def gather_rows(tables: MoveTables, slots: np.ndarray, rows: np.ndarray) -> None:
    """``rows[i] = row(slots[i])`` for ``i < n``: the record's four fields, then its layer-hash row; a zero row for
    a slot outside ``[0, num_slots)`` (``SOURCE_RANGE`` for one past the end). ``slots`` ``[n]`` int32 or int64,
    ``rows`` ``[>= n, row_words]`` int64 (rows past ``n`` untouched)."""
    slots = np.asarray(slots).astype(_I64)
    n = slots.shape[0]
    inside = (slots >= 0) & (slots < tables.num_slots)
    at = slots[inside]
    out = np.zeros((n, tables.row_words), dtype=_I64)
    out[inside, :RECORD_WORDS] = tables.fields[at]
    if tables.num_layers:
        out[inside, RECORD_WORDS:] = tables.layer_hashes.host[at]
    rows[:n] = out
    _refuse(tables.status.host, MoveFault.SOURCE_RANGE, int(np.count_nonzero(slots >= tables.num_slots)))


def scatter_rows(tables: MoveTables, slots: np.ndarray, rows: np.ndarray) -> None:
    """``row(slots[i]) = rows[i]`` for ``i < n`` with ``0 <= slots[i] < num_slots``; a negative slot is skipped, one
    past the end refused (``DEST_RANGE``). A slot named twice keeps the later row."""
    slots = np.asarray(slots).astype(_I64)
    n = slots.shape[0]
    inside = np.flatnonzero((slots >= 0) & (slots < tables.num_slots))
    at = slots[inside]
    last = inside[at.shape[0] - 1 - np.unique(at[::-1], return_index=True)[1]]  # each slot's last entry
    src = np.array(rows[:n][last], dtype=_I64)
    tables.fields[slots[last]] = src[:, :RECORD_WORDS]
    if tables.num_layers:
        tables.layer_hashes.host[slots[last]] = src[:, RECORD_WORDS:]
    _refuse(tables.status.host, MoveFault.DEST_RANGE, int(np.count_nonzero(slots >= tables.num_slots)))


class Bound:
    """The reference behind :class:`canary.records.move.RecordMover`."""

    def __init__(self, tables: MoveTables, launch: LaunchConfig = DEFAULT_LAUNCH):
        self.tables = tables

    def warmup(self) -> None:
        pass

    def gather(self, a: MoveArgs, stream: int = 0) -> None:
        gather_rows(self.tables, a.slots.host, a.rows.host)

    def scatter(self, a: MoveArgs, stream: int = 0) -> None:
        scatter_rows(self.tables, a.slots.host, a.rows.host)


def bind(tables: MoveTables, launch: LaunchConfig = DEFAULT_LAUNCH) -> Bound:
    return Bound(tables, launch)
