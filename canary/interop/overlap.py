"""Shared memory between arrays that must be separate (SPEC 3.3): byte spans of views, the pairwise check at
bind, and :class:`Spans` for checking per-call arrays against what was bound."""
from __future__ import annotations

from bisect import bisect_left

from ..errors import fail
from .adapter import ArrayView


def span_bytes(view: ArrayView) -> int:
    """Bytes from ``view.ptr`` to one past the last element the view reaches (0 when empty).

    Strides are non-negative (``as_view`` refuses others), so the span starts at ``view.ptr``. A 2-D array's
    span covers the gaps between its rows: memory there is treated as the array's own.
    """
    if 0 in view.shape or not view.shape:
        return view.dtype.itemsize if not view.shape else 0
    last = sum((n - 1) * abs(s) for n, s in zip(view.shape, view.strides))
    return (last + 1) * view.dtype.itemsize


def spans(views) -> list[tuple[ArrayView, int]]:
    """``(view, span_bytes(view))`` of each view that is not ``None``."""
    return [(v, span_bytes(v)) for v in views if v is not None]


def _overlap(name: str, at: int, other: str, start: int, end: int) -> Exception:
    return fail(ValueError, f"{name}: expected memory separate from {other}, got an overlap at {at:#x} "
                            f"({other} spans [{start:#x}, {end:#x}))")


def check_disjoint(outputs: list[tuple[ArrayView, int]], inputs: list[tuple[ArrayView, int]] = ()) -> None:
    """Refuse shared memory: ``(view, byte length)`` pairs. ``outputs`` must be separate from each other and from
    every input; inputs may share memory with each other (both are only read).

    An output overlapping another output or an input would make a kernel read its own writes or clobber an
    input mid-launch (SPEC 3.3). Raises ``ValueError`` naming both arrays.
    """
    ranges = sorted([(v.device_id, v.ptr, v.ptr + n, v.name, True) for v, n in outputs if n > 0]
                    + [(v.device_id, v.ptr, v.ptr + n, v.name, False) for v, n in inputs if n > 0])
    # Sweeping by start address, a range overlaps an earlier one iff it starts before that one's end: keep the
    # furthest-reaching earlier output (what an input must clear) and earlier range of any kind (what an output
    # must clear), per device.
    reach_out = reach_any = None
    for r in ranges:
        if reach_any is not None and reach_any[0] != r[0]:
            reach_out = reach_any = None
        other = reach_any if r[4] else reach_out
        if other is not None and r[1] < other[2]:
            raise _overlap(r[3], r[1], other[3], other[1], other[2])
        if r[4] and (reach_out is None or r[2] > reach_out[2]):
            reach_out = r
        if reach_any is None or r[2] > reach_any[2]:
            reach_any = r


class Spans:
    """Byte ranges of arrays on one device already checked to be pairwise disjoint (``check_disjoint``), sorted
    so that another array is checked against all of them with one bisection.

    Holds addresses and names only, never the arrays. Used for what is bound once (plan outputs, canary state)
    against what arrives per call.
    """

    __slots__ = ("device_id", "_starts", "_ends", "_names")

    def __init__(self, pairs: list[tuple[ArrayView, int]], device_id: int):
        ranges = sorted((v.ptr, v.ptr + n, v.name) for v, n in pairs if n > 0)
        self.device_id = device_id
        self._starts = [r[0] for r in ranges]
        self._ends = [r[1] for r in ranges]
        self._names = [r[2] for r in ranges]

    def check_range(self, name: str, device_id: int, ptr: int, nbytes: int) -> None:
        """Refuse ``[ptr, ptr + nbytes)`` on ``device_id`` if it overlaps a range here (``ValueError`` naming both)."""
        if device_id != self.device_id or nbytes <= 0:
            return  # another device: the device check words that
        # Disjoint and sorted by start, so also by end: the last range starting before our end reaches furthest.
        i = bisect_left(self._starts, ptr + nbytes) - 1
        if i >= 0 and self._ends[i] > ptr:
            start = self._starts[i]
            raise _overlap(name, max(ptr, start), self._names[i], start, self._ends[i])

    def check(self, view: ArrayView) -> None:
        self.check_range(view.name, view.device_id, view.ptr, span_bytes(view))
