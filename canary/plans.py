"""The plan outputs: keyword-only dataclasses over the caller's own arrays (SPEC 3.1)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import INPUT_ERROR_BITS, BackendUnavailableError, CanaryInputError, PlanStatus, fail
from .hostcopy import to_host


def _allocator(device: Any):
    """Return ``empty(n, dtype)`` for ``device``: "cpu" -> NumPy; an int or "cuda:N" -> CuPy on that device."""
    if device in ("cpu", None):
        return lambda n, dt: np.zeros(n, dtype=dt)
    if isinstance(device, str) and device.startswith("cuda"):
        ordinal = int(device.partition(":")[2] or 0)
    elif isinstance(device, int) and not isinstance(device, bool):
        ordinal = device
    else:
        raise fail(ValueError, f"device: expected 'cpu', a CUDA ordinal or 'cuda:N', got {device!r}")
    from .backends import import_cupy

    try:
        cupy = import_cupy()
    except BackendUnavailableError:
        try:  # Numba-only installs get Numba device arrays
            from numba import cuda
        except ImportError:
            raise BackendUnavailableError(
                "kv-canary: device: allocating on a CUDA device needs CuPy or numba-cuda: "
                "pip install 'kv-canary[cuda13]' (or [cuda12], or [numba])"
            ) from None

        def empty_numba(n, dt):
            with cuda.gpus[ordinal]:
                return cuda.to_device(np.zeros(n, dtype=dt))

        return empty_numba

    def empty(n, dt):
        with cupy.cuda.Device(ordinal):
            return cupy.zeros(n, dtype=dt)

    return empty


@dataclass(kw_only=True)
class VerifyPlan:
    """Verify side of a plan; capacity ``C = verify_slot_indices.shape[0]``.

    Fields (caller-owned, any NumPy / DLPack / CUDA-Array-Interface arrays):
    ``verify_slot_indices``, ``verify_expected_tokens``, ``verify_expected_positions``,
    ``verify_prev_slot_indices``: ``[C]`` int64; ``verify_num_valid``, ``enable``, ``status``: ``[1]`` int32.
    """

    verify_slot_indices: Any
    verify_expected_tokens: Any
    verify_expected_positions: Any
    verify_prev_slot_indices: Any
    verify_num_valid: Any
    enable: Any
    status: Any

    @classmethod
    def allocate(cls, *, verify_capacity: int, device: Any = "cpu") -> "VerifyPlan":
        """Allocate zeroed buffers: NumPy for ``device="cpu"``; for a CUDA ordinal or ``"cuda:N"``, CuPy arrays
        (Numba device arrays where only numba-cuda is installed). Raises ``ValueError`` for a negative capacity
        or an unknown device, :class:`BackendUnavailableError` when no GPU array library is installed."""
        if int(verify_capacity) < 0:
            raise fail(ValueError, f"verify_capacity: expected >= 0, got {verify_capacity}")
        empty = _allocator(device)
        c = int(verify_capacity)
        return cls(
            verify_slot_indices=empty(c, np.int64),
            verify_expected_tokens=empty(c, np.int64),
            verify_expected_positions=empty(c, np.int64),
            verify_prev_slot_indices=empty(c, np.int64),
            verify_num_valid=empty(1, np.int32),
            enable=empty(1, np.int32),
            status=empty(1, np.int32),
        )

    def read_status(self) -> PlanStatus:
        """Copy ``status`` to the host (a sync for device arrays) and decode it."""
        return PlanStatus(int(to_host(self.status)[0]))

    def check(self) -> PlanStatus:
        """Sync, then raise :class:`CanaryInputError` if the last plan flagged an input fault.

        Returns the status otherwise (``OVERFLOW`` alone is a sizing signal, not an error: ``enable`` is 0
        and ``verify_num_valid`` holds the capacity).
        """
        status = self.read_status()
        raise_for_status(status)
        return status


@dataclass(kw_only=True)
class WritePlan:
    """Write side of a plan; capacity ``R = write_seed_slot_indices.shape[0]``.

    Fields: ``write_offsets`` ``[R+1]`` int64, ``write_seed_slot_indices`` ``[R]`` int64,
    ``write_num_valid_reqs`` ``[1]`` int32.
    """

    write_offsets: Any
    write_seed_slot_indices: Any
    write_num_valid_reqs: Any

    @classmethod
    def allocate(cls, *, write_req_capacity: int, device: Any = "cpu") -> "WritePlan":
        """Allocate zeroed buffers: NumPy for ``device="cpu"``; for a CUDA ordinal or ``"cuda:N"``, CuPy arrays
        (Numba device arrays where only numba-cuda is installed). Raises ``ValueError`` for a negative capacity
        or an unknown device, :class:`BackendUnavailableError` when no GPU array library is installed."""
        if int(write_req_capacity) < 0:
            raise fail(ValueError, f"write_req_capacity: expected >= 0, got {write_req_capacity}")
        empty = _allocator(device)
        r = int(write_req_capacity)
        return cls(
            write_offsets=empty(r + 1, np.int64),
            write_seed_slot_indices=empty(r, np.int64),
            write_num_valid_reqs=empty(1, np.int32),
        )


def raise_for_status(status: PlanStatus, first_bad_row: int | None = None) -> None:
    bad = PlanStatus(status & INPUT_ERROR_BITS)
    if not bad:
        return
    names = "|".join(b.name for b in PlanStatus if b and b in status)
    where = f"; first offending batch row: {first_bad_row}" if first_bad_row is not None else ""
    raise CanaryInputError(
        f"kv-canary: status: expected no input-error bits, got {int(status)} ({names}){where}",
        status,
        first_bad_row,
    )
