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
        tail = device.partition(":")[2]
        if device not in ("cuda", f"cuda:{tail}") or (tail and not tail.isdigit()):
            raise fail(ValueError, f"device: expected 'cpu', a CUDA ordinal or 'cuda:N', got {device!r}")
        ordinal = int(tail or 0)
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
            try:
                with cuda.gpus[ordinal]:
                    return cuda.to_device(np.zeros(n, dtype=dt))
            except Exception as exc:  # no driver, no such device: numba raises several types
                raise _no_device(device, exc) from exc

        return empty_numba

    def empty(n, dt):
        try:
            with cupy.cuda.Device(ordinal):
                return cupy.zeros(n, dtype=dt)
        except cupy.cuda.runtime.CUDARuntimeError as exc:
            raise _no_device(device, exc) from exc

    return empty


def _no_device(device: Any, exc: Exception) -> BackendUnavailableError:
    return BackendUnavailableError(f"kv-canary: device: expected a usable CUDA device for device={device!r} "
                                   f"(pass device='cpu' for host arrays), got {type(exc).__name__}: {exc}")


def _capacity(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise fail(TypeError, f"{name}: expected an int, got {type(value).__name__} {value!r}")
    if int(value) < 0:
        raise fail(ValueError, f"{name}: expected >= 0, got {value}")
    return int(value)


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
        _capacity("verify_capacity", verify_capacity)
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
        _capacity("write_req_capacity", write_req_capacity)
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
