"""The manager's calls that move canary records with the KV (SPEC 4.1; docs/integration.md 7b): offload and
restore (:meth:`RecordMoves.gather_records` / :meth:`RecordMoves.scatter_records`), a copy-on-write fork or a
defragmentation (:meth:`RecordMoves.move_records`), and their buffers (:meth:`RecordMoves.allocate_record_rows`).

Each group gets one :class:`~canary.RecordMover`, built at its first call and bound to the group's records and,
when the group rotates layers, its layer table, so a row is the record's four words then the slot's layer hashes.
Its status word is the group's pair of words in the manager's report block (canary/manager/block.py): every step
report carries the faults since the last one and clears them, so :meth:`CanaryManager.stats` counts them
(``move_faults``) with no read of its own. A mover launched on another stream while a report runs there may lose
the faults of that one launch to the report's clear (stream order is the engine's: the same stream loses none).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import fail
from ..interop.devices import pinned_allocator
from ..interop.libs import library_of
from ..records.move import RecordMover
from .groups import BoundGroup
from .guard import request_call, step_call


def _renamed(call, own: str, name: str):
    """``call()``, with the mover's errors about its argument ``own`` worded for the manager's ``name``."""
    try:
        return call()
    except (TypeError, ValueError) as exc:
        msg = str(exc)
        if msg.startswith(f"kv-canary: {own}:"):
            raise type(exc)(msg.replace(f"kv-canary: {own}:", f"kv-canary: {name}:", 1)) from None
        raise


class RecordMoves:
    """:class:`~canary.CanaryManager`'s record moves (module docstring). The manager sets ``_movers`` (group
    index -> its :class:`~canary.RecordMover`) and ``_move_status`` (each group's ``[2]`` int64 status word in
    the report block)."""

    groups: list[BoundGroup]
    ordinal: int | None
    pool_array: Any
    _movers: dict
    _move_status: list

    def _move_group(self, group: Any) -> BoundGroup:
        names = [g.name for g in self.groups]
        if group is None:
            if len(self.groups) > 1:
                raise fail(ValueError, f"group: expected a group name among {names} or its index (the manager has "
                                       f"{len(names)} groups: which one's records move?), got None")
            return self.groups[0]
        if isinstance(group, str):
            for g in self.groups:
                if g.name == group:
                    return g
            raise fail(ValueError, f"group: expected a group name among {names}, got {group!r}")
        if isinstance(group, bool) or not isinstance(group, (int, np.integer)):
            raise fail(TypeError, f"group: expected a group name (str) or index (int), got {type(group).__name__}")
        if not 0 <= int(group) < len(self.groups):
            raise fail(ValueError, f"group: expected an index in [0, {len(self.groups)}), got {int(group)}")
        return self.groups[int(group)]

    def _mover(self, g: BoundGroup, handle: int = 0) -> RecordMover:
        mover = self._movers.get(g.index)
        if mover is None:
            if self.ordinal is not None and handle and self._is_capturing(handle):
                raise fail(RuntimeError, f"group {g.name!r}: expected its record mover built before a CUDA graph "
                                         f"capture (its first call allocates its scratch), got a capturing stream: "
                                         f"call allocate_record_rows or a move once outside the capture")
            mover = RecordMover(g.records, g.layers, status=self._move_status[g.index])
            mover.warmup()
            self._movers[g.index] = mover
        return mover

    def _drop_movers(self, groups) -> None:
        # Rebound records and layers (rebind): the next call binds a mover to them (the same tables underneath)
        for g in groups:
            self._movers.pop(g.index, None)

    def record_row_words(self, *, group: Any = None) -> int:
        """Words of a slot's row in ``group``: 4 record words, plus one layer hash per layer when the group rotates
        layers (SPEC 4.1)."""
        g = self._move_group(group)
        return 4 + (0 if g.layers is None else g.layers.num_layers)

    @request_call
    def allocate_record_rows(self, n: int, *, group: Any = None, pinned: bool | None = None) -> Any:
        """A zeroed buffer of ``n`` rows for :meth:`gather_records` / :meth:`scatter_records`: ``[n, row_words]``
        int64 (``row_words``: :meth:`record_row_words`). On the manager's device by default (its library's array);
        ``pinned=True``: pinned host memory that the kernels reach through unified addressing (an offload's
        destination; a NumPy array for CuPy and Numba, a pinned CPU tensor for torch), host memory on a
        ``device="cpu"`` manager. ``group``: the group's name or index, required when the manager has several.
        Allocates (call it outside the step loop's hot path, and outside a CUDA graph capture). Raises
        ``TypeError`` / ``ValueError`` (``kv-canary:``) for a bad ``n``, ``group`` or ``pinned``."""
        if pinned is not None and not isinstance(pinned, bool):
            raise fail(TypeError, f"pinned: expected True, False or None, got {pinned!r}")
        mover = self._mover(self._move_group(group))
        if not pinned or self.ordinal is None:
            return mover.allocate_rows(n)
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or int(n) < 0:
            raise fail(ValueError, f"n: expected an int >= 0, got {n!r}")
        lib = library_of(self.pool_array)
        empty = pinned_allocator(lib if lib in ("cupy", "torch", "numba") else None)
        return empty(int(n) * mover.row_words, np.int64).reshape(int(n), mover.row_words)

    @step_call()
    def gather_records(self, slots: Any, out: Any, *, group: Any = None, stream: Any = None) -> None:
        """Offload: ``out[i] = row(slots[i])`` (SPEC 4.1), the record and its layer hashes, a zero row for a
        negative slot or one ``>= num_slots`` (the latter counted in :meth:`stats` ``move_faults`` as
        ``SOURCE_RANGE``). ``slots``: ``[n]`` int32 / int64; ``out``: ``[>= n, row_words]`` int64, on the manager's
        device or in pinned host memory (:meth:`allocate_record_rows`). Launch it after the KV copy out of those
        slots is queued, on the same ``stream`` (as for :meth:`before_forward`; default: the current stream), and
        before anything overwrites them. Never syncs. Raises ``TypeError`` / ``ValueError`` (``kv-canary:``,
        naming the argument) before any launch."""
        g = self._move_group(group)
        handle, st = self._launch(stream)
        self._mover(g, handle).gather(slots, out, stream=st)

    @step_call()
    def scatter_records(self, rows: Any, slots: Any, *, group: Any = None, stream: Any = None) -> None:
        """Restore: ``row(slots[i]) = rows[i]`` for each slot in ``[0, num_slots)`` (SPEC 4.1); a negative slot is
        skipped, one ``>= num_slots`` skipped and counted (``DEST_RANGE``). ``rows``: ``[>= n, row_words]`` int64
        as :meth:`gather_records`' ``out``; ``slots``: ``[n]`` int32 / int64. Launch it after the KV copy into
        those slots and before the next step that verifies them, then point the index at them. A slot listed
        twice is the caller's error. Never syncs; errors as :meth:`gather_records`."""
        g = self._move_group(group)
        handle, st = self._launch(stream)
        mover = self._mover(g, handle)
        _renamed(lambda: mover.scatter(slots, rows, stream=st), "src", "rows")

    @step_call()
    def move_records(self, src_slots: Any, dst_slots: Any, *, group: Any = None, stream: Any = None) -> None:
        """Inside the pool (a copy-on-write fork, a defragmentation): ``row(dst_slots[i]) = row(src_slots[i])`` as
        if every source were read before any destination is written (SPEC 4.1: overlapping lists work; a source
        listed twice is a fork). ``src_slots``, ``dst_slots``: ``[n]`` int32 / int64 each, ``n <= 1024`` (the
        mover's copy capacity: split longer moves). Two launches on ``stream``, on the stream of the KV copy,
        before the next verify of the destinations. Never syncs. Raises ``ValueError`` (``kv-canary:``) for lists
        of different lengths or longer than 1024, and as :meth:`gather_records`."""
        g = self._move_group(group)
        handle, st = self._launch(stream)
        self._mover(g, handle).copy(src_slots, dst_slots, stream=st)
