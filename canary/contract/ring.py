"""The canary records' format (SPEC 4): slot fields, ring rows, fail reasons, kernel tags, check flags, and the
host decoding of ring rows into :class:`Violation` records.

Layouts (the contract the reference and the CUDA / Numba twins share, see ``docs/records.md``):

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

:class:`~canary.contract.state.CanaryState` holds the caller's arrays; its ``drain`` decodes the ring with
:func:`decode`.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import fail

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
    "expected_aux",  # write: the expected position (-1: none); verify: the expected chain hash (0: not checked),
                     # or in a MISSING row the entry's predecessor slot (the request's slot at position - 1)
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
    """Fail-reason bits of a ring row (SPEC 4; ``SLOT_RANGE`` and ``MISSING`` are this project's additions)."""

    NONE = 0
    CHAIN = 1  # verify: stored prev_hash != link(prev_slot)
    POSITION = 2  # verify: stored position != the plan's expected position
    REAL_KV = 4  # verify: stored real_kv_hash != a fresh fold of the real KV bytes
    WRITE_TOKEN = 8  # write: input_ids[i] != expected_input_ids[i] (when that is not -1)
    WRITE_POSITION = 16  # write: positions[i] != expected_positions[i], or != previous + 1 (chain-position check)
    VERIFY_TOKEN = 32  # verify: stored token != the plan's expected token (when that is not -1, check on)
    SLOT_RANGE = 64  # a slot (or verify's prev_slot) outside the canary buffer: nothing read or written there
    MISSING = 128  # verify: the plan's slot is MISSING_SLOT, an in-window position with no real slot (a 0 in its
                   # req_to_token row, or its SWA mapping cleared); the row's expected_aux: its predecessor slot

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(b.name for b in FailReason if b and b in self)


_ALL_REASONS = sum(int(b) for b in FailReason)  # a corrupt row's unknown bits are dropped, not raised on


class KernelTag(enum.IntEnum):
    """Which kernel wrote a ring row (low 8 bits of the tag column); ``tag - 1`` indexes the counters.

    ``VERIFY_LAYER`` (the layer rotation, :mod:`canary.records.layers`) counts in the verify counters, and its
    rows carry the layer in the low :data:`LAYER_BITS` bits of their launch tag (:func:`encode_layer_tag`).
    """

    WRITE = 1
    VERIFY = 2
    VERIFY_LAYER = 3

    @property
    def counter_index(self) -> int:
        return 1 if self == KernelTag.VERIFY_LAYER else int(self) - 1


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


LAYER_BITS = 16  # VERIFY_LAYER rows: the layer below the caller's launch tag
MAX_LAYERS = 1 << LAYER_BITS
MAX_LAYER_LAUNCH_TAG = MAX_LAUNCH_TAG >> LAYER_BITS


def encode_layer_tag(launch_tag: int = 0) -> int:
    """The tag column of a ``VERIFY_LAYER`` row for layer 0: ``((launch_tag << 16) << 8) | 3``; the kernel ORs
    ``layer << 8`` into it. ``launch_tag`` is in [0, 2**39). Raises ``TypeError`` / ``ValueError``."""
    if isinstance(launch_tag, bool) or not isinstance(launch_tag, (int, np.integer)):
        raise fail(TypeError, f"launch_tag: expected an int, got {type(launch_tag).__name__}")
    if not 0 <= int(launch_tag) <= MAX_LAYER_LAUNCH_TAG:
        raise fail(ValueError, f"launch_tag: expected an int in [0, {MAX_LAYER_LAUNCH_TAG}] (layer rows keep "
                               f"{LAYER_BITS} bits of it for the layer), got {launch_tag}")
    return encode_tag(KernelTag.VERIFY_LAYER, int(launch_tag) << LAYER_BITS)


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
    layer: int | None = None  # VERIFY_LAYER rows: the layer whose bytes changed (launch_tag is then the caller's)

    @property
    def reason_names(self) -> tuple[str, ...]:
        return self.reasons.names

    @property
    def expected_chain_hash(self) -> int | None:
        """Verify rows: the ``prev_hash`` the slot should hold (``None`` for write rows, MISSING rows or when not
        checked)."""
        if self.kernel != KernelTag.VERIFY or self.expected_aux == 0 or FailReason.MISSING in self.reasons:
            return None
        return self.expected_aux

    @property
    def predecessor_slot(self) -> int | None:
        """MISSING rows: the entry's predecessor slot (its ``verify_prev_slot_indices``, -1 at position 0), the
        request's own slot at ``position - 1``, which names the request (the row's slot names none); ``None``
        for other rows."""
        if self.kernel != KernelTag.VERIFY or FailReason.MISSING not in self.reasons:
            return None
        return self.expected_aux

    @property
    def expected_position(self) -> int | None:
        """Write rows: the expected position (``None`` for verify rows, or -1: no expectation)."""
        return self.expected_aux if self.kernel == KernelTag.WRITE and self.expected_aux != -1 else None

    def __str__(self) -> str:
        kind = self.kernel.name.lower() if isinstance(self.kernel, KernelTag) else f"kind{self.kernel}"
        tag = f"[{self.launch_tag}]" if self.launch_tag else ""
        if self.layer is not None:
            tag += f" layer {self.layer}"
        parts = [f"{kind}{tag} slot {self.slot} pos {self.position}: {'|'.join(self.reason_names) or 'NONE'}",
                 f"token {self.stored_token}"]
        if self.expected_token != -1:
            parts.append(f"expected token {self.expected_token}")
        if self.kernel == KernelTag.WRITE:
            if self.expected_aux != -1:
                parts.append(f"expected pos {self.expected_aux}")
        elif FailReason.MISSING in self.reasons:
            parts.append(f"prev slot {self.expected_aux}")
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
    launch_tag, layer = tag >> KIND_BITS, None
    if kernel == KernelTag.VERIFY_LAYER:
        launch_tag, layer = launch_tag >> LAYER_BITS, launch_tag & (MAX_LAYERS - 1)
    return Violation(
        kernel=kernel,
        launch_tag=launch_tag,
        slot=int(row[COL_SLOT]),
        position=int(row[COL_POSITION]),
        stored_token=int(row[COL_STORED_TOKEN]),
        expected_token=int(row[COL_EXPECTED_TOKEN]),
        stored_chain_hash=int(row[COL_STORED_HASH]),
        expected_aux=int(row[COL_EXPECTED_AUX]),
        reasons=FailReason(int(row[COL_REASONS]) & _ALL_REASONS),
        layer=layer,
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

