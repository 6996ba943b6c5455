"""The plan outputs: keyword-only dataclasses over the caller's own arrays (SPEC 3.1)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import INPUT_ERROR_BITS, CanaryInputError, PlanStatus, fail
from ..interop.adapter import ArrayView, check_view
from ..interop.devices import allocator
from ..interop.hostcopy import to_host

INT64 = np.dtype(np.int64)
INT32 = np.dtype(np.int32)
VERIFY_ENTRY_FIELDS = (
    "verify_slot_indices", "verify_expected_tokens", "verify_expected_positions", "verify_prev_slot_indices",
)
VERIFY_SCALAR_FIELDS = ("verify_num_valid", "enable", "status")
WRITE_FIELDS = ("write_offsets", "write_seed_slot_indices", "write_num_valid_reqs")
# write_seed_slot_indices of a padding row whose tokens sit among the step's tokens (a planner bound with
# padding_rows_carry_tokens=True, SPEC 3.2): the canary write skips the row's entries. INT64_MIN, because every
# other negative seed already means "chain from the anchor" and can come from req_to_token (int32) itself.
SKIP_SEED = -(1 << 63)
# verify_slot_indices of an entry of an active row whose slot is the padding slot 0: its req_to_token value is 0
# (the row cleared or never filled while still read), or a real slot whose full-to-SWA mapping is 0 (the SWA page
# of a position the window still needs was freed). SPEC 3.2. Verify reports it (FailReason.MISSING) instead of
# skipping it as padding. -2**62: req_to_token is int32, and a LUT would have to hold this very value.
MISSING_SLOT = -(1 << 62)


PADDING_SLOTS = (0, -1)


def check_padding_slot(value: Any, name: str = "padding_slot") -> int:
    """``padding_slot`` (SPEC 3.2, "No reserved slot"): 0 (slot 0 is the padding slot, the default) or -1 (slot 0
    is real; a negative slot marks padding). Raises ``TypeError`` for a non-int, ``ValueError`` for another int;
    ``name``: the argument the message names."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise fail(TypeError, f"{name}: expected an int (0 or -1), got {type(value).__name__} {value!r}")
    if int(value) not in PADDING_SLOTS:
        raise fail(ValueError, f"{name}: expected 0 (slot 0 is the padding slot) or -1 (slot 0 is real, a "
                               f"negative slot marks padding), got {int(value)}")
    return int(value)


def mark_missing(raw: np.ndarray, slot: np.ndarray, padding_slot: int = 0) -> np.ndarray:
    """The verify slots of entries with req_to_token values ``raw`` and translations ``slot`` (``raw`` itself
    without a LUT): ``MISSING_SLOT`` where the position has no real slot (``raw == 0``, or ``raw > 0`` mapped to
    0), ``slot`` elsewhere (SPEC 3.2, "cleared mappings"). ``padding_slot=-1``: where ``slot < 0`` instead (a
    negative raw slot or translation; SPEC 3.2, "No reserved slot")."""
    if padding_slot == -1:
        return np.where(slot < 0, np.int64(MISSING_SLOT), slot)
    return np.where((raw == 0) | ((raw > 0) & (slot == 0)), np.int64(MISSING_SLOT), slot)


INT32_MAX = (1 << 31) - 1


def translate(raw: np.ndarray, lut: np.ndarray | None) -> tuple[np.ndarray, bool]:
    """``T`` of SPEC 3.2 on int64 ``raw``: negatives pass, else ``lut[x]``; ``x >= len(lut)`` gives -1.

    Returns the translated values and whether any value was out of the LUT's range (``BAD_SLOT``).
    """
    if lut is None:
        return raw, False
    out = raw.copy()
    nonneg = raw >= 0
    bad = nonneg & (raw >= lut.shape[0])
    ok = nonneg & ~bad
    out[ok] = lut[raw[ok]]
    out[bad] = -1
    return out, bool(bad.any())


def _capacity(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise fail(TypeError, f"{name}: expected an int, got {type(value).__name__} {value!r}")
    if not 0 <= int(value) <= INT32_MAX:  # the plan's counters (verify_num_valid, write_num_valid_reqs) are int32
        raise fail(ValueError, f"{name}: expected an int in [0, 2**31 - 1], got {value}")
    return int(value)


@dataclass(kw_only=True)
class VerifyPlan:
    """Verify side of a plan; capacity ``C = verify_slot_indices.shape[0]``.

    Fields (caller-owned, any NumPy / DLPack / CUDA-Array-Interface arrays):
    ``verify_slot_indices``, ``verify_expected_tokens``, ``verify_expected_positions``,
    ``verify_prev_slot_indices``: ``[C]`` int64; ``verify_num_valid``, ``enable``, ``status``: ``[1]`` int32;
    ``verify_cursors``: ``[max_reqs]`` int64 or ``None``, the sampled verification's rotation state (SPEC 3.7),
    read and advanced by the planner on the device at every sampled step, so it must persist across steps:
    entry ``rp`` is where request row ``rp``'s next sampled run starts (a position; any value is safe, one
    outside the row's window restarts the run at the window's start), entry 0 (the padding row's, never a
    request's) the first request of the rotation used when ``C`` is below the number of requests. Zeros are a
    valid start. A planner bound with ``on_overflow="sample"`` (the default) needs it; the records' verify
    never reads it.
    """

    verify_slot_indices: Any
    verify_expected_tokens: Any
    verify_expected_positions: Any
    verify_prev_slot_indices: Any
    verify_num_valid: Any
    enable: Any
    status: Any
    verify_cursors: Any = None

    @classmethod
    def allocate(cls, *, verify_capacity: int, device: Any = "cpu", library: str | None = None,
                 max_reqs: int | None = None) -> "VerifyPlan":
        """Allocate zeroed buffers: NumPy for ``device="cpu"``; for a CUDA ordinal or ``"cuda:N"``, arrays of
        ``library`` (``"cupy"``, ``"torch"``, ``"numba"``; default CuPy, else Numba: see
        :func:`canary.interop.devices.allocator`). A torch engine passes ``library="torch"`` so that every later
        call runs on torch's current stream by default. ``max_reqs`` (``req_to_token.shape[0]``) also allocates
        ``verify_cursors``, which a planner that samples (``on_overflow="sample"``, the default) needs; leave it
        out for a plan only the records' verify reads. Raises ``ValueError`` for a negative capacity or
        ``max_reqs``, an unknown device or library, :class:`BackendUnavailableError` when the library is not
        installed."""
        _capacity("verify_capacity", verify_capacity)
        if max_reqs is not None:
            _capacity("max_reqs", max_reqs)
        empty = allocator(device, library)
        c = int(verify_capacity)
        return cls(
            verify_slot_indices=empty(c, np.int64),
            verify_expected_tokens=empty(c, np.int64),
            verify_expected_positions=empty(c, np.int64),
            verify_prev_slot_indices=empty(c, np.int64),
            verify_num_valid=empty(1, np.int32),
            enable=empty(1, np.int32),
            status=empty(1, np.int32),
            verify_cursors=None if max_reqs is None else empty(int(max_reqs), np.int64),
        )

    def read_status(self) -> PlanStatus:
        """Copy ``status`` to the host (a sync for device arrays) and decode it."""
        try:
            return PlanStatus(int(to_host(self.status)[0]))
        except (IndexError, TypeError, ValueError, AttributeError):
            raise fail(TypeError, f"status: expected a [1] int32 array (the plan's status word), got "
                                  f"{type(self.status).__name__}") from None

    def check(self) -> PlanStatus:
        """Sync, then raise :class:`CanaryInputError` if the last plan flagged an input fault.

        Returns the status otherwise (``OVERFLOW`` alone is a sizing signal, not an error: ``enable`` is 0
        and ``verify_num_valid`` holds the capacity; ``SAMPLED`` says ``verify_capacity`` entries were verified
        out of more). The plan keeps only the status word, not the step's
        inputs, so the error's ``first_bad_row`` is ``None`` and its message says so: to have the first
        offending batch row named, plan with ``check=True`` (:meth:`CanaryPlanner.plan` or
        :func:`launch_canary_plan_kernels`), which recomputes it on the host from the inputs.
        """
        status = self.read_status()
        raise_for_status(status, row_unknown=ROW_UNKNOWN_CHECK)
        return status


@dataclass(kw_only=True)
class WritePlan:
    """Write side of a plan; capacity ``R = write_req_capacity = write_seed_slot_indices.shape[0]``.

    Fields: ``write_offsets`` ``[R+1]`` int64, ``write_seed_slot_indices`` ``[R]`` int64 (a slot, -1 for none,
    or :data:`SKIP_SEED` for a padding row whose entries the write skips), ``write_num_valid_reqs`` ``[1]`` int32.
    """

    write_offsets: Any
    write_seed_slot_indices: Any
    write_num_valid_reqs: Any

    @classmethod
    def allocate(cls, *, write_req_capacity: int, device: Any = "cpu", library: str | None = None) -> "WritePlan":
        """Allocate zeroed buffers: NumPy for ``device="cpu"``; for a CUDA ordinal or ``"cuda:N"``, arrays of
        ``library`` (``"cupy"``, ``"torch"``, ``"numba"``; default CuPy, else Numba: see
        :func:`canary.interop.devices.allocator`). A torch engine passes ``library="torch"`` so that every later
        call runs on torch's current stream by default. Raises ``ValueError`` for a negative capacity, an unknown
        device or library, :class:`BackendUnavailableError` when the library is not installed."""
        _capacity("write_req_capacity", write_req_capacity)
        empty = allocator(device, library)
        r = int(write_req_capacity)
        return cls(
            write_offsets=empty(r + 1, np.int64),
            write_seed_slot_indices=empty(r, np.int64),
            write_num_valid_reqs=empty(1, np.int32),
        )


ROW_UNKNOWN_CHECK = ("unknown (VerifyPlan.check() sees only the status word, not the step's inputs: plan with "
                     "check=True to have the row named)")
ROW_UNKNOWN_PLAN = ("unknown (the step's inputs, read back now, show no offending row: were they changed after the "
                    "plan was launched?)")


def raise_for_status(status: PlanStatus, first_bad_row: int | None = None, *, row_unknown: str = ROW_UNKNOWN_PLAN
                     ) -> None:
    """Raise :class:`CanaryInputError` for input-error bits; the message names ``first_bad_row``, or says why
    it is unknown (``row_unknown``)."""
    bad = PlanStatus(status & INPUT_ERROR_BITS)
    if not bad:
        return
    names = "|".join(b.name for b in PlanStatus if b and b in status)
    where = f"; first offending batch row: {first_bad_row if first_bad_row is not None else row_unknown}"
    raise CanaryInputError(
        f"kv-canary: status: expected no input-error bits, got {int(status)} ({names}){where}",
        status,
        first_bad_row,
    )


@dataclass(frozen=True)
class VerifyViews:
    """Checked views of a :class:`VerifyPlan`: four ``[C]`` int64 entry arrays, ``[1]`` int32 scalars."""

    verify_slot_indices: ArrayView
    verify_expected_tokens: ArrayView
    verify_expected_positions: ArrayView
    verify_prev_slot_indices: ArrayView
    verify_num_valid: ArrayView
    enable: ArrayView
    status: ArrayView | None  # None when the caller did not ask for it (the records kernels never read it)

    @property
    def capacity(self) -> int:
        return self.verify_slot_indices.shape[0]

    @property
    def entries(self) -> tuple[ArrayView, ...]:
        return tuple(getattr(self, f) for f in VERIFY_ENTRY_FIELDS)

    def all(self) -> list[ArrayView]:
        return [v for v in (*self.entries, self.verify_num_valid, self.enable, self.status) if v is not None]


@dataclass(frozen=True)
class WriteViews:
    """Checked views of a :class:`WritePlan`: ``[R+1]`` / ``[R]`` int64, ``[1]`` int32."""

    write_offsets: ArrayView
    write_seed_slot_indices: ArrayView
    write_num_valid_reqs: ArrayView

    @property
    def capacity(self) -> int:
        return self.write_seed_slot_indices.shape[0]

    def all(self) -> list[ArrayView]:
        return [self.write_offsets, self.write_seed_slot_indices, self.write_num_valid_reqs]


def view_verify_plan(plan: Any, view, *, name: str, writable: bool, status: bool = True) -> VerifyViews:
    """Check a :class:`VerifyPlan` (SPEC 3.3) and view its arrays with ``view(obj, qualified_name)``.

    The one set of checks behind the planner (outputs, ``writable=True``) and the records' verify (inputs).
    Raises ``TypeError`` / ``ValueError`` naming ``name.field``.
    """
    if not isinstance(plan, VerifyPlan):
        raise fail(TypeError, f"{name}: expected a VerifyPlan, got {type(plan).__name__}")
    entries = [check_view(view(getattr(plan, f), f"{name}.{f}"), dtype=INT64, ndim=1, writable=writable)
               for f in VERIFY_ENTRY_FIELDS]
    cap = entries[0].shape[0]
    for v in entries[1:]:
        if v.shape[0] != cap:
            raise fail(ValueError, f"{v.name}: expected capacity {cap} like verify_slot_indices, got {v.shape[0]}")
    scalars = [check_view(view(getattr(plan, f), f"{name}.{f}"), dtype=INT32, ndim=1, length=1, writable=writable)
               for f in VERIFY_SCALAR_FIELDS[: 3 if status else 2]]
    return VerifyViews(*entries, *scalars, *([] if status else [None]))


def view_write_plan(plan: Any, view, *, name: str, writable: bool) -> WriteViews:
    """Check a :class:`WritePlan` (SPEC 3.3) and view its arrays; as :func:`view_verify_plan`."""
    if not isinstance(plan, WritePlan):
        raise fail(TypeError, f"{name}: expected a WritePlan, got {type(plan).__name__}")
    seeds = check_view(view(plan.write_seed_slot_indices, f"{name}.write_seed_slot_indices"), dtype=INT64, ndim=1,
                       writable=writable)
    r_cap = seeds.shape[0]
    offsets = check_view(view(plan.write_offsets, f"{name}.write_offsets"), dtype=INT64, ndim=1, writable=writable)
    if offsets.shape[0] != r_cap + 1:
        raise fail(ValueError, f"{name}.write_offsets: expected length write_req_capacity + 1 = {r_cap + 1}, "
                               f"got {offsets.shape[0]}")
    num_reqs = check_view(view(plan.write_num_valid_reqs, f"{name}.write_num_valid_reqs"), dtype=INT32, ndim=1,
                          length=1, writable=writable)
    return WriteViews(offsets, seeds, num_reqs)
