"""The canary's device state: canary buffer, violation ring, health counters, check flags (SPEC 4).

Layouts (the contract the reference and the CUDA / Numba twins share, see ``docs/canary.md``):

- ``canary_buffer`` ``[num_slots, slot_stride_bytes]`` uint8, ``slot_stride_bytes >= 32`` and a multiple of 8,
  base 8-byte aligned. Slot ``s`` holds four int64 fields at byte offsets 0, 8, 16, 24: ``token``,
  ``position``, ``prev_hash``, ``real_kv_hash`` (bytes past 32 are never touched). Slot 0 is the padding slot.
- ``ring`` ``[ring_capacity, 8]`` int64 violation rows, **fill-once**: a launch claims row indices with an
  atomic add on ``ring_write_index`` (``[1]`` int32 holding a uint32 counter) and writes a row only when its
  index is ``< ring_capacity``; the index keeps counting past the capacity, so ``index - capacity`` rows were
  dropped. Row fields, in order: :data:`RING_FIELDS`.
- ``slot_run_counter`` / ``kernel_run_counter`` ``[2]`` int64 health counters, element ``tag - 1`` for
  :class:`KernelTag` ``tag`` (0: write, 1: verify): entries processed, and launches (a verify skipped by
  ``enable == 0`` still counts as a launch).
- ``check_flags`` ``[1]`` int32, :class:`CheckFlags`: optional checks read by every launch on the device, so
  they can be toggled without re-capturing a CUDA graph.

:class:`CanaryState` holds the caller's arrays (any NumPy / DLPack / CUDA-Array-Interface objects);
:func:`bind_state` validates them; :meth:`CanaryState.drain` turns ring rows into :class:`Violation` records.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import numpy as np

from .adapter import HOST, ArrayView, as_view, check_same_device, check_view
from .errors import fail
from .hostcopy import to_host
from .memview import host_view

# Canary buffer fields: int64 word index in a slot (byte offset = 8 * index).
TOKEN, POSITION, PREV_HASH, REAL_KV_HASH = 0, 1, 2, 3
CANARY_FIELDS = ("token", "position", "prev_hash", "real_kv_hash")
MIN_SLOT_STRIDE_BYTES = 32

# Ring row columns.
RING_FIELDS = (
    "tag",  # (launch_tag << 8) | KernelTag
    "slot",
    "position",  # write: the position written; verify: the position the plan expects at this slot
    "stored_token",  # write: the token written; verify: the token read from the slot
    "expected_token",  # write: the expected-token assert (-1: none); verify: the plan's expected token (-1: none)
    "stored_chain_hash",  # write: the prev_hash written; verify: the prev_hash read from the slot
    "expected_aux",  # write: the expected position (-1: none); verify: the expected chain hash (0: not checked)
    "fail_reasons",  # FailReason bits
)
RING_ROW_WORDS = len(RING_FIELDS)
(COL_TAG, COL_SLOT, COL_POSITION, COL_STORED_TOKEN, COL_EXPECTED_TOKEN, COL_STORED_HASH, COL_EXPECTED_AUX,
 COL_REASONS) = range(RING_ROW_WORDS)

KIND_BITS = 8  # low bits of the tag column: the KernelTag; above them: the caller's launch tag
MAX_LAUNCH_TAG = (1 << (63 - KIND_BITS)) - 1
NUM_COUNTERS = 2
_U32 = 1 << 32


class FailReason(enum.IntFlag):
    """Fail-reason bits of a ring row (SPEC 4; ``SLOT_RANGE`` is this project's addition)."""

    NONE = 0
    CHAIN = 1  # verify: stored prev_hash != link(prev_slot)
    POSITION = 2  # verify: stored position != the plan's expected position
    REAL_KV = 4  # verify: stored real_kv_hash != a fresh fold of the real KV bytes
    WRITE_TOKEN = 8  # write: input_ids[i] != expected_input_ids[i] (when that is not -1)
    WRITE_POSITION = 16  # write: positions[i] != expected_positions[i], or != previous + 1 (chain-position check)
    VERIFY_TOKEN = 32  # verify: stored token != the plan's expected token (when that is not -1, check on)
    SLOT_RANGE = 64  # a slot (or verify's prev_slot) outside the canary buffer: nothing read or written there

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(b.name for b in FailReason if b and b in self)


class KernelTag(enum.IntEnum):
    """Which kernel wrote a ring row (low 8 bits of the tag column); ``tag - 1`` indexes the counters."""

    WRITE = 1
    VERIFY = 2

    @property
    def counter_index(self) -> int:
        return int(self) - 1


class CheckFlags(enum.IntFlag):
    """Optional checks, read from the device ``check_flags`` word by each launch."""

    NONE = 0
    WRITE_POSITION_CHAIN = 1  # write: positions[i] == previous stored position + 1 (SPEC 4's chain-position check)
    VERIFY_TOKEN = 2  # verify: compare stored tokens with the plan's expected tokens


DEFAULT_CHECK_FLAGS = CheckFlags.WRITE_POSITION_CHAIN | CheckFlags.VERIFY_TOKEN
_ALL_CHECKS = int(DEFAULT_CHECK_FLAGS)


def coerce_check_flags(value: Any, name: str = "check_flags") -> CheckFlags:
    """A :class:`CheckFlags`, an int in [0, 3], or names joined by ``|`` ("WRITE_POSITION_CHAIN|VERIFY_TOKEN",
    case-insensitive; "all" and "none" too). Raises ``TypeError`` / ``ValueError`` (``kv-canary:``)."""
    if isinstance(value, str):
        flags = 0
        for part in (p.strip().upper() for p in value.split("|")):
            if part == "ALL":
                flags |= _ALL_CHECKS
            elif part in CheckFlags.__members__:
                flags |= int(CheckFlags[part])
            else:
                raise fail(ValueError, f"{name}: expected flag names {', '.join(m for m in CheckFlags.__members__)} "
                                       f"or 'all', joined by '|', got {value!r}")
        return CheckFlags(flags)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise fail(TypeError, f"{name}: expected CheckFlags, an int or flag names, got {type(value).__name__} "
                              f"{value!r}")
    if not 0 <= int(value) <= _ALL_CHECKS:
        raise fail(ValueError, f"{name}: expected bits of {_ALL_CHECKS} (an int in [0, {_ALL_CHECKS}]), got {value}")
    return CheckFlags(int(value))


def encode_tag(kind: KernelTag, launch_tag: int = 0) -> int:
    """The tag column value: ``(launch_tag << 8) | kind``. ``launch_tag`` (a call-site id) is in [0, 2**55)."""
    if isinstance(launch_tag, bool) or not isinstance(launch_tag, (int, np.integer)):
        raise fail(TypeError, f"launch_tag: expected an int, got {type(launch_tag).__name__}")
    if not 0 <= int(launch_tag) <= MAX_LAUNCH_TAG:
        raise fail(ValueError, f"launch_tag: expected an int in [0, {MAX_LAUNCH_TAG}], got {launch_tag}")
    return (int(launch_tag) << KIND_BITS) | int(kind)


def _allocator(device: Any):
    from .plans import (
        _allocator as plans_allocator,  # one place decides what a device means
    )

    return plans_allocator(device)


def _zero(obj: Any) -> None:
    """Zero a caller array in place with its own library (host API only: may sync)."""
    if hasattr(obj, "zero_"):  # torch
        obj.zero_()
    elif hasattr(obj, "fill"):  # NumPy, CuPy
        obj.fill(0)
    else:
        obj[...] = 0


@dataclass(kw_only=True, frozen=True)
class CanaryState:
    """The caller-owned device state of one canary (one KV pool): see the module docstring for layouts.

    Fields: ``canary_buffer`` ``[num_slots, slot_stride_bytes]`` uint8, ``ring`` ``[ring_capacity, 8]`` int64,
    ``ring_write_index`` ``[1]`` int32, ``slot_run_counter`` and ``kernel_run_counter`` ``[2]`` int64,
    ``check_flags`` ``[1]`` int32. Frozen: a :class:`~canary.write_verify.KVCanary` binds these arrays' memory,
    so swapping one for another afterwards would leave the kernels writing the old one; update contents in place.
    """

    canary_buffer: Any
    ring: Any
    ring_write_index: Any
    slot_run_counter: Any
    kernel_run_counter: Any
    check_flags: Any

    @classmethod
    def allocate(
        cls,
        num_slots: int,
        slot_stride_bytes: int = MIN_SLOT_STRIDE_BYTES,
        ring_capacity: int = 1024,
        device: Any = "cpu",
        check_flags: CheckFlags | int = DEFAULT_CHECK_FLAGS,
    ) -> CanaryState:
        """Allocate zeroed state: NumPy for ``device="cpu"``, CuPy for a CUDA ordinal or ``"cuda:N"``."""
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
        empty = _allocator(device)
        n, stride, cap = int(num_slots), int(slot_stride_bytes), int(ring_capacity)
        flags = empty(1, np.int32)
        flags[0] = flag_value
        return cls(
            canary_buffer=empty(n * stride, np.uint8).reshape(n, stride),
            ring=empty(cap * RING_ROW_WORDS, np.int64).reshape(cap, RING_ROW_WORDS),
            ring_write_index=empty(1, np.int32),
            slot_run_counter=empty(NUM_COUNTERS, np.int64),
            kernel_run_counter=empty(NUM_COUNTERS, np.int64),
            check_flags=flags,
        )

    def set_check_flags(self, flags: CheckFlags | int | str) -> None:
        """Write the device flag word (stream-ordered on the array library's current stream). ``flags``: as
        :func:`coerce_check_flags` takes them."""
        value = int(coerce_check_flags(flags, "flags"))
        try:
            self.check_flags[0] = value
        except ValueError as exc:  # a read-only array
            raise fail(ValueError, f"state.check_flags: expected a writable array, got a read-only one ({exc})") from exc

    def health(self) -> Health:
        """Copy the counters to the host (a sync for device arrays)."""
        return Health.from_counters(to_host(self.slot_run_counter), to_host(self.kernel_run_counter))

    def read(self) -> RingReport:
        """Decode the ring without resetting it (a sync for device arrays)."""
        return decode(to_host(self.ring), int(to_host(self.ring_write_index)[0]), self.health())

    def drain(self) -> RingReport:
        """Decode the ring, then reset it (write index and used rows to 0) so that new violations are kept.

        Host API: syncs for device arrays; call it between steps, never inside a CUDA-graph capture.
        Counters are not reset (they are monotonic health counters).
        """
        report = self.read()
        used = min(report.total, report.capacity)
        if used:
            _zero(self.ring[:used])
        _zero(self.ring_write_index)
        return report


@dataclass(frozen=True)
class Health:
    """Health counters: entries processed and launches, per kernel."""

    write_slots: int
    verify_slots: int
    write_launches: int
    verify_launches: int

    @classmethod
    def from_counters(cls, slot_runs: np.ndarray, kernel_runs: np.ndarray) -> Health:
        w, v = KernelTag.WRITE.counter_index, KernelTag.VERIFY.counter_index
        return cls(int(slot_runs[w]), int(slot_runs[v]), int(kernel_runs[w]), int(kernel_runs[v]))


@dataclass(frozen=True)
class Violation:
    """One decoded ring row."""

    kernel: KernelTag | int  # an int when the row's kind is unknown (a corrupt row)
    launch_tag: int
    slot: int
    position: int
    stored_token: int
    expected_token: int
    stored_chain_hash: int
    expected_aux: int
    reasons: FailReason

    @property
    def reason_names(self) -> tuple[str, ...]:
        return self.reasons.names

    @property
    def expected_chain_hash(self) -> int | None:
        """Verify rows: the ``prev_hash`` the slot should hold (``None`` for write rows or when not checked)."""
        return self.expected_aux if self.kernel == KernelTag.VERIFY and self.expected_aux != 0 else None

    @property
    def expected_position(self) -> int | None:
        """Write rows: the expected position (``None`` for verify rows, or -1: no expectation)."""
        return self.expected_aux if self.kernel == KernelTag.WRITE and self.expected_aux != -1 else None

    def __str__(self) -> str:
        kind = self.kernel.name.lower() if isinstance(self.kernel, KernelTag) else f"kind{self.kernel}"
        tag = f"[{self.launch_tag}]" if self.launch_tag else ""
        parts = [f"{kind}{tag} slot {self.slot} pos {self.position}: {'|'.join(self.reason_names) or 'NONE'}",
                 f"token {self.stored_token}"]
        if self.expected_token != -1:
            parts.append(f"expected token {self.expected_token}")
        if self.kernel == KernelTag.WRITE:
            if self.expected_aux != -1:
                parts.append(f"expected pos {self.expected_aux}")
        elif FailReason.CHAIN in self.reasons:  # the chain hashes only mean something when they disagree
            parts.append(f"prev_hash {self.stored_chain_hash & 0xFFFF_FFFF_FFFF_FFFF:#018x}")
            if self.expected_aux != 0:
                parts.append(f"expected {self.expected_aux & 0xFFFF_FFFF_FFFF_FFFF:#018x}")
        return ", ".join(parts)


@dataclass(frozen=True)
class RingReport:
    """What the ring held: ``violations`` (at most ``capacity``), ``total`` recorded since the last reset,
    ``dropped = total - len(violations)``, and the health counters."""

    violations: tuple[Violation, ...]
    total: int
    capacity: int
    health: Health | None = None

    @property
    def dropped(self) -> int:
        return self.total - len(self.violations)

    def __len__(self) -> int:
        return len(self.violations)

    def __iter__(self):
        return iter(self.violations)


def decode_row(row: np.ndarray) -> Violation:
    tag = int(row[COL_TAG])
    kind = tag & ((1 << KIND_BITS) - 1)
    try:
        kernel: KernelTag | int = KernelTag(kind)
    except ValueError:
        kernel = kind
    return Violation(
        kernel=kernel,
        launch_tag=tag >> KIND_BITS,
        slot=int(row[COL_SLOT]),
        position=int(row[COL_POSITION]),
        stored_token=int(row[COL_STORED_TOKEN]),
        expected_token=int(row[COL_EXPECTED_TOKEN]),
        stored_chain_hash=int(row[COL_STORED_HASH]),
        expected_aux=int(row[COL_EXPECTED_AUX]),
        reasons=FailReason(int(row[COL_REASONS]) & 0x7F),
    )


def decode(ring: np.ndarray, write_index: int, health: Health | None = None) -> RingReport:
    """Decode host ring rows. ``write_index`` is the int32 word, read as the uint32 count it holds."""
    ring = np.asarray(ring)
    total = int(write_index) % _U32
    cap = ring.shape[0]
    rows = ring[: min(total, cap)]
    return RingReport(tuple(decode_row(r) for r in rows), total, cap, health)


def append_rows(ring: np.ndarray, write_index: np.ndarray, rows: np.ndarray) -> None:
    """Reference ring append: claim ``len(rows)`` indices from ``write_index[0]`` (uint32 arithmetic, wrapping
    at 2**32) and write row ``k`` at index ``old + k`` iff that index is ``< ring_capacity``."""
    k = rows.shape[0]
    if k == 0:
        return
    old = int(write_index[0]) % _U32
    idx = (old + np.arange(k, dtype=np.int64)) % _U32
    keep = idx < ring.shape[0]
    ring[idx[keep]] = rows[keep]
    new = (old + k) % _U32
    write_index[0] = new - _U32 if new >> 31 else new  # the uint32 count's int32 bit pattern


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

    def host(self, name: str) -> np.ndarray:
        return getattr(self, name).host

    @property
    def ring_row_stride(self) -> int:
        """Elements between ring rows (a one-row ring has no stride of its own: the row length)."""
        return self.ring.strides[0] if self.ring_capacity > 1 else RING_ROW_WORDS


def _check_disjoint(spans: list[tuple[ArrayView, int]]) -> None:
    """State arrays must not share memory: a violation counted into the flag word, say, would switch checks off."""
    ranges = sorted((v.ptr, v.ptr + n, v.name) for v, n in spans if n > 0)
    for (a0, a1, an), (b0, _, bn) in zip(ranges, ranges[1:]):
        if b0 < a1:
            raise fail(ValueError, f"{bn}: expected memory separate from {an}, got an overlap at {b0:#x} "
                                   f"({an} spans [{a0:#x}, {a1:#x}))")


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
    _check_disjoint([(buf, (num_slots - 1) * stride + width if num_slots else 0),
                     (ring, (ring.shape[0] - 1) * ring.strides[0] * 8 + RING_ROW_WORDS * 8 if ring.shape[0] else 0),
                     (widx, 4), (slot_runs, 8 * NUM_COUNTERS), (kernel_runs, 8 * NUM_COUNTERS), (flags, 4)])
    fields = None
    if device == HOST:
        fields = host_view(buf.ptr, (num_slots, len(CANARY_FIELDS)), (stride, 8), np.int64, buf.host)
    return StateViews(buf, ring, widx, slot_runs, kernel_runs, flags, num_slots, stride, ring.shape[0], device,
                      fields)
