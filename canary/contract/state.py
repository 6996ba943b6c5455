"""The canary records' device state: :class:`CanaryState` (caller-owned arrays), its validated views
(:class:`StateViews`, :func:`bind_state`), and the host operations on it (drain, health, check flags).

Layouts and the ring format: :mod:`canary.contract.ring`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import fail
from ..interop.adapter import HOST, ArrayView, as_view, check_same_device, check_view
from ..interop.overlap import Spans, check_disjoint, spans
from ..interop.cudart import pinned_host
from ..interop.devices import allocator, on_device_of, zero_fill
from ..interop.hostcopy import to_host
from ..interop.memview import host_view
from .ring import (
    CANARY_FIELDS, DEFAULT_CHECK_FLAGS, MIN_SLOT_STRIDE_BYTES, NUM_COUNTERS, RING_ROW_WORDS, CheckFlags, Health,
    RingReport, coerce_check_flags, decode,
)

@dataclass(kw_only=True, frozen=True)
class CanaryState:
    """The caller-owned device state of one canary (one KV pool): see the module docstring for layouts.

    Fields: ``canary_buffer`` ``[num_slots, slot_stride_bytes]`` uint8, ``ring`` ``[ring_capacity, 8]`` int64,
    ``ring_write_index`` ``[1]`` int32, ``slot_run_counter`` and ``kernel_run_counter`` ``[2]`` int64,
    ``check_flags`` ``[1]`` int32, and the optional ``reported_slots`` ``[num_slots]`` uint8 (SPEC 4: the slots
    whose verify rows the caller already holds; ``None``: every row is appended), which may also be pinned host
    memory for a CUDA state (the kernels read it through unified addressing, so the host updates it without a
    copy). Frozen: a :class:`~canary.CanaryRecords` binds these arrays' memory,
    so swapping one for another afterwards would leave the kernels writing the old one; update contents in place.
    """

    canary_buffer: Any
    ring: Any
    ring_write_index: Any
    slot_run_counter: Any
    kernel_run_counter: Any
    check_flags: Any
    reported_slots: Any = None

    @classmethod
    def allocate(
        cls,
        num_slots: int,
        slot_stride_bytes: int = MIN_SLOT_STRIDE_BYTES,
        ring_capacity: int = 1024,
        device: Any = "cpu",
        check_flags: CheckFlags | int = DEFAULT_CHECK_FLAGS,
        library: str | None = None,
        reported_slots: bool = False,
    ) -> CanaryState:
        """Allocate zeroed state: NumPy for ``device="cpu"``; for a CUDA ordinal or ``"cuda:N"``, arrays of
        ``library`` (``"cupy"``, ``"torch"``, ``"numba"``; default CuPy, else Numba), so that later calls run on
        that library's current stream by default; ``reported_slots=True`` adds a zeroed ``reported_slots`` array on the
        same device. Raises ``TypeError`` / ``ValueError`` for bad sizes, an unknown
        device or library, :class:`~canary.BackendUnavailableError` when the library is not installed."""
        for name, value, low in (("num_slots", num_slots, 1), ("slot_stride_bytes", slot_stride_bytes,
                                                                 MIN_SLOT_STRIDE_BYTES),
                                 ("ring_capacity", ring_capacity, 0)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise fail(TypeError, f"{name}: expected an int, got {type(value).__name__}")
            if int(value) < low:
                raise fail(ValueError, f"{name}: expected >= {low}, got {value}")
        if int(slot_stride_bytes) % 8:
            raise fail(ValueError, f"slot_stride_bytes: expected a multiple of 8, got {slot_stride_bytes}")
        flag_value = int(coerce_check_flags(check_flags))
        empty = allocator(device, library)
        n, stride, cap = int(num_slots), int(slot_stride_bytes), int(ring_capacity)
        flags = empty(1, np.int32)
        with on_device_of(flags):
            flags[0] = flag_value
        return cls(
            canary_buffer=empty(n * stride, np.uint8).reshape(n, stride),
            ring=empty(cap * RING_ROW_WORDS, np.int64).reshape(cap, RING_ROW_WORDS),
            ring_write_index=empty(1, np.int32),
            slot_run_counter=empty(NUM_COUNTERS, np.int64),
            kernel_run_counter=empty(NUM_COUNTERS, np.int64),
            check_flags=flags,
            reported_slots=empty(n, np.uint8) if reported_slots else None,
        )

    def set_check_flags(self, flags: CheckFlags | int | str) -> None:
        """Write the device flag word (stream-ordered on the array library's current stream). ``flags``: as
        :func:`coerce_check_flags` takes them."""
        value = int(coerce_check_flags(flags, "flags"))
        try:
            with on_device_of(self.check_flags):
                self.check_flags[0] = value
        except ValueError as exc:  # a read-only array
            raise fail(ValueError, f"state.check_flags: expected a writable array, got a read-only one ({exc})") from exc

    def health(self) -> Health:
        """Copy the counters to the host (a sync for device arrays)."""
        with on_device_of(self.slot_run_counter):
            return Health.from_counters(to_host(self.slot_run_counter), to_host(self.kernel_run_counter))

    def read(self) -> RingReport:
        """Decode the ring without resetting it (a sync for device arrays)."""
        with on_device_of(self.ring):
            return decode(to_host(self.ring), int(to_host(self.ring_write_index)[0]), self.health())

    def drain(self) -> RingReport:
        """Decode the ring, then reset it (write index and used rows to 0) so that new violations are kept.

        Host API: syncs for device arrays; call it between steps, never inside a CUDA-graph capture.
        Counters are not reset (they are monotonic health counters).
        """
        report = self.read()
        used = min(report.total, report.capacity)
        with on_device_of(self.ring):
            if used:
                zero_fill(self.ring[:used])
            zero_fill(self.ring_write_index)
        return report


@dataclass(frozen=True)
class StateViews:
    """Validated views of a :class:`CanaryState`; ``fields`` is the host ``[num_slots, 4]`` int64 view."""

    canary_buffer: ArrayView
    ring: ArrayView
    ring_write_index: ArrayView
    slot_run_counter: ArrayView
    kernel_run_counter: ArrayView
    check_flags: ArrayView
    num_slots: int
    slot_stride_bytes: int
    ring_capacity: int
    device_id: int
    fields: np.ndarray | None  # host only
    spans: Spans | None = None  # the state arrays' byte ranges: what per-call arrays and sources must not touch
    reported_slots: ArrayView | None = None
    # The convention of the records bound over these views (SPEC 3.2 "No reserved slot", 4): 0, slot 0 is padding
    # (verify skips it, a predecessor 0 has no link); -1, slot 0 is a slot like any other and a predecessor
    # MISSING_SLOT has no link. Set by CanaryRecords; the layer rotation bound to it follows.
    padding_slot: int = 0

    def host(self, name: str) -> np.ndarray:
        return getattr(self, name).host

    @property
    def ring_row_stride(self) -> int:
        """Elements between ring rows (a one-row ring has no stride of its own: the row length)."""
        return self.ring.strides[0] if self.ring_capacity > 1 else RING_ROW_WORDS


def bind_state(state: CanaryState) -> StateViews:
    """Validate a :class:`CanaryState` (SPEC 3.3 style errors) and view it zero-copy."""
    if not isinstance(state, CanaryState):
        raise fail(TypeError, f"state: expected a CanaryState, got {type(state).__name__}")
    buf = as_view(state.canary_buffer, "state.canary_buffer")
    if len(buf.shape) == 2 and buf.shape[0] < 1:
        raise fail(ValueError, f"state.canary_buffer: expected at least 1 slot (slot 0 is padding), got {buf.shape[0]}")
    buf = check_view(buf, dtype=np.uint8, ndim=2, writable=True)
    num_slots, width = buf.shape
    if width < MIN_SLOT_STRIDE_BYTES:
        raise fail(ValueError, f"state.canary_buffer: expected rows of >= {MIN_SLOT_STRIDE_BYTES} bytes, got {width}")
    # One slot has no stride to check: use the smallest legal one (only slot 0's 32 bytes are ever touched).
    stride = buf.strides[0] if num_slots > 1 else -(-width // 8) * 8
    if stride % 8 or buf.ptr % 8:
        raise fail(ValueError, f"state.canary_buffer: expected 8-byte aligned slots, got base address {buf.ptr:#x} and "
                               f"slot stride {stride} bytes")
    ring = check_view(as_view(state.ring, "state.ring"), dtype=np.int64, ndim=2, writable=True)
    if ring.shape[1] != RING_ROW_WORDS:
        raise fail(ValueError, f"state.ring: expected shape [ring_capacity, {RING_ROW_WORDS}], got {ring.shape}")
    widx = check_view(as_view(state.ring_write_index, "state.ring_write_index"), dtype=np.int32, ndim=1, length=1,
                      writable=True)
    slot_runs = check_view(as_view(state.slot_run_counter, "state.slot_run_counter"), dtype=np.int64, ndim=1,
                           length=NUM_COUNTERS, writable=True)
    kernel_runs = check_view(as_view(state.kernel_run_counter, "state.kernel_run_counter"), dtype=np.int64, ndim=1,
                             length=NUM_COUNTERS, writable=True)
    flags = check_view(as_view(state.check_flags, "state.check_flags"), dtype=np.int32, ndim=1, length=1)
    device = check_same_device([buf, ring, widx, slot_runs, kernel_runs, flags])
    reported = None
    if state.reported_slots is not None:
        reported = check_view(as_view(state.reported_slots, "state.reported_slots"), dtype=np.uint8, ndim=1,
                              length=num_slots)
        if reported.device_id != device and not (device != HOST and reported.device_id == HOST
                                                 and pinned_host(reported.ptr)):
            raise fail(ValueError, f"state.reported_slots: expected an array on the state's device "
                                   f"({buf.where}) or pinned host memory, got {reported.where}")
    state_spans = spans([buf, ring, widx, slot_runs, kernel_runs, flags]
                        + ([reported] if reported is not None and reported.device_id == device else []))
    check_disjoint(state_spans)
    fields = None
    if device == HOST:
        fields = host_view(buf.ptr, (num_slots, len(CANARY_FIELDS)), (stride, 8), np.int64, buf.host)
    return StateViews(buf, ring, widx, slot_runs, kernel_runs, flags, num_slots, stride, ring.shape[0], device,
                      fields, Spans(state_spans, device), reported)
