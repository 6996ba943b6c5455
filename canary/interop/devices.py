"""The one place that allocates arrays for the library's callers (plans, canary state, the replay).

``device``: ``"cpu"`` (host NumPy), a CUDA ordinal or ``"cuda:N"``. ``library``: which array library owns the
new arrays on a CUDA device: ``"cupy"``, ``"torch"`` or ``"numba"`` (an engine gets arrays of its own library,
so the default stream of every later call is the engine's); ``None`` picks CuPy, else Numba. Arrays are
zeroed; the library is imported only here, on first use.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..errors import BackendUnavailableError, fail
from .libs import INSTALL
from .libs import library_of

LIBRARIES = ("cupy", "torch", "numba")
_DEVICE_HELP = "expected 'cpu', a CUDA ordinal or 'cuda:N'"


def cuda_ordinal(device: Any) -> int | None:
    """``None`` for host memory ("cpu" or None), else the CUDA ordinal; ``ValueError`` for anything else."""
    if device in ("cpu", None):
        return None
    if isinstance(device, str) and device.startswith("cuda"):
        tail = device.partition(":")[2]
        if device == "cuda":
            return 0
        if device != f"cuda:{tail}" or not tail.isdigit():
            raise fail(ValueError, f"device: {_DEVICE_HELP}, got {device!r}")
        return int(tail)
    if isinstance(device, int) and not isinstance(device, bool) and device >= 0:
        return device
    raise fail(ValueError, f"device: {_DEVICE_HELP}, got {device!r}")


def _no_device(device: Any, exc: Exception) -> BackendUnavailableError:
    return BackendUnavailableError(f"kv-canary: device: expected a usable CUDA device for device={device!r} "
                                   f"(pass device='cpu' for host arrays), got {type(exc).__name__}: {exc}")


def _cupy_empty(ordinal: int, device: Any):
    import cupy

    def empty(n, dt):
        try:
            with cupy.cuda.Device(ordinal):
                return cupy.zeros(n, dtype=dt)
        except cupy.cuda.runtime.CUDARuntimeError as exc:
            raise _no_device(device, exc) from exc

    return empty


def _numba_empty(ordinal: int, device: Any):
    from numba import cuda

    def empty(n, dt):
        try:
            with cuda.gpus[ordinal]:
                return cuda.to_device(np.zeros(n, dtype=dt))
        except Exception as exc:  # noqa: BLE001 - no driver, no such device: numba raises several types
            raise _no_device(device, exc) from exc

    return empty


def _torch_empty(ordinal: int, device: Any):
    import torch

    def empty(n, dt):
        try:
            return torch.zeros(n, dtype=getattr(torch, np.dtype(dt).name), device=f"cuda:{ordinal}")
        except (RuntimeError, AssertionError) as exc:  # no CUDA build, no such device
            raise _no_device(device, exc) from exc

    return empty


def allocator(device: Any, library: str | None = None) -> Callable[[int, Any], Any]:
    """``empty(n, dtype)`` returning zeroed 1-D arrays on ``device`` owned by ``library`` (module docstring).

    Raises ``ValueError`` for an unknown device or library (or a library given with ``device="cpu"``),
    :class:`BackendUnavailableError` when the library is not installed.
    """
    ordinal = cuda_ordinal(device)
    if library is not None and library not in LIBRARIES:
        raise fail(ValueError, f"library: expected one of {', '.join(LIBRARIES)} or None, got {library!r}")
    if ordinal is None:
        if library is not None:
            raise fail(ValueError, f"library: expected None with device='cpu' (host arrays are NumPy), got {library!r}")
        return _sized(lambda n, dt: np.zeros(n, dtype=dt), device)
    makers = {"cupy": _cupy_empty, "numba": _numba_empty, "torch": _torch_empty}
    order = (library,) if library is not None else ("cupy", "numba")
    for lib in order:
        try:
            return _sized(makers[lib](ordinal, device), device)
        except ImportError:
            continue
    if library is None:
        raise BackendUnavailableError(f"kv-canary: device: allocating on a CUDA device needs CuPy or numba-cuda: "
                                      f"{INSTALL['cupy']}, or {INSTALL['numba']}")
    hint = INSTALL.get(library, "pip install torch")
    raise BackendUnavailableError(f"kv-canary: library: expected an installed {library} for library={library!r}, "
                                  f"got none: {hint}")


def pinned_allocator(library: str | None = None) -> Callable[[int, Any], Any]:
    """``empty(n, dtype)`` returning zeroed 1-D arrays in pinned (page-locked) host memory, which CUDA kernels
    read and write through unified addressing (an offload's destination), allocated by ``library``: ``"cupy"``
    (``cupyx.zeros_pinned``: a NumPy array), ``"torch"`` (a CPU tensor with ``pin_memory=True``) or ``"numba"``
    (``cuda.pinned_array``: a NumPy array); ``None`` picks CuPy, else Numba. The memory lives as long as the
    returned array. Raises ``ValueError`` for an unknown library, :class:`BackendUnavailableError` when it is not
    installed."""
    if library is not None and library not in LIBRARIES:
        raise fail(ValueError, f"library: expected one of {', '.join(LIBRARIES)} or None, got {library!r}")

    def cupy_pinned():
        import cupyx

        return lambda n, dt: cupyx.zeros_pinned(n, dtype=dt)

    def numba_pinned():
        from numba import cuda

        def empty(n, dt):
            out = cuda.pinned_array(n, dtype=dt)
            out[...] = 0
            return out
        return empty

    def torch_pinned():
        import torch

        return lambda n, dt: torch.zeros(n, dtype=getattr(torch, np.dtype(dt).name), pin_memory=True)

    makers = {"cupy": cupy_pinned, "numba": numba_pinned, "torch": torch_pinned}
    for lib in (library,) if library is not None else ("cupy", "numba"):
        try:
            return _sized(makers[lib](), "pinned host memory")
        except ImportError:
            continue
    hint = INSTALL.get(library or "cupy", "pip install torch")
    raise BackendUnavailableError(f"kv-canary: library: expected an installed {library or 'CuPy or numba-cuda'} "
                                  f"to allocate pinned host memory, got none: {hint}")


def _sized(empty: Callable[[int, Any], Any], device: Any) -> Callable[[int, Any], Any]:
    """``empty`` whose failures to allocate (a size past what the library or the device can hold) are kv-canary
    errors that give the size, not the library's own."""
    def sized(n: int, dt: Any) -> Any:
        try:
            return empty(n, dt)
        except (ValueError, MemoryError, OverflowError) as exc:
            raise fail(ValueError, f"size: expected {n} elements of {np.dtype(dt).name} to fit on device {device!r}, "
                                   f"got an allocation failure ({exc})") from None
    return sized


def zero_fill(obj: Any) -> None:
    """Zero a caller array in place with its own library (host API only: may sync)."""
    if hasattr(obj, "zero_"):  # torch
        obj.zero_()
    elif hasattr(obj, "fill"):  # NumPy, CuPy
        obj.fill(0)
    elif hasattr(obj, "copy_to_device"):  # numba device arrays
        obj.copy_to_device(np.zeros(obj.shape, dtype=obj.dtype))
    else:
        obj[...] = 0


class on_device_of:  # noqa: N801 - used as a context manager, like the libraries' own device guards
    """Make the device holding ``obj`` (a CuPy, Numba or torch array) current while host code operates on it.

    CuPy and Numba launch their fills and copies on the *current* device, so a state allocated on cuda:1 while
    cuda:0 is current would fail (or touch the wrong device) without this; torch tensors carry their device.
    Host arrays: nothing to do.
    """

    def __init__(self, obj: Any):
        self._guard = None
        module = library_of(obj)
        if module == "cupy":
            import cupy

            self._guard = cupy.cuda.Device(obj.device.id)
        elif hasattr(obj, "copy_to_host") and hasattr(obj, "__cuda_array_interface__"):  # numba device arrays
            from numba import cuda

            self._guard = cuda.gpus[_numba_device_id(obj)]

    def __enter__(self):
        if self._guard is not None:
            self._guard.__enter__()
        return self

    def __exit__(self, *exc):
        if self._guard is not None:
            return self._guard.__exit__(*exc)
        return False


def _numba_device_id(obj: Any) -> int:
    """The ordinal of the device holding a Numba device array (its allocation's context). Numba's element
    assignment launches a kernel in the *current* context: the wrong device would read another device's
    memory, an illegal address."""
    from .adapter import numba_device

    device = numba_device(obj)
    return 0 if device is None else device
