"""Resolve the ``stream=`` argument to a raw ``cudaStream_t`` handle (SPEC 3.6)."""
from __future__ import annotations

import sys
from typing import Any

from ..errors import fail
from .cudart import runtime
from .libs import library_of


def stream_handle(stream: Any) -> int:
    """Raw handle of a CuPy / torch / cuda.core / Numba stream, an object with ``__cuda_stream__``, or an int."""
    if isinstance(stream, int) and not isinstance(stream, bool):
        return stream
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:
        return int(proto()[1])
    for attr in ("cuda_stream", "ptr"):  # torch.cuda.Stream, cupy.cuda.Stream
        value = getattr(stream, attr, None)
        if isinstance(value, int):
            return value
    handle = getattr(stream, "handle", None)  # numba-cuda Stream: a ctypes c_void_p
    if handle is not None and hasattr(handle, "value"):
        return int(handle.value or 0)
    raise fail(
        TypeError,
        f"stream: expected a CuPy/torch/cuda.core/Numba stream, an object with __cuda_stream__ or a raw handle, "
        f"got {type(stream).__name__}",
    )


def is_capturing(handle: int) -> bool:
    """Whether the stream ``handle`` is capturing a CUDA graph (driver query; no sync). False without a driver."""
    try:
        rt = runtime()
    except ImportError:  # pragma: no cover - no CUDA bindings: nothing can be capturing through us
        return False
    return rt.is_capturing(handle)


def _capturing_elsewhere(owner_lib: str, device_id: int) -> str | None:
    """The name of an imported library other than ``owner_lib`` whose current stream is capturing a graph."""
    torch = sys.modules.get("torch")
    if owner_lib != "torch" and torch is not None and torch.cuda.is_initialized():
        if torch.cuda.is_current_stream_capturing():
            return "torch"
    cupy = sys.modules.get("cupy")
    if owner_lib != "cupy" and cupy is not None:
        try:
            ptr = cupy.cuda.get_current_stream(device_id).ptr
        except Exception:  # noqa: BLE001 - CuPy without a usable device: it captures nothing
            return None
        if ptr not in (0, 1, 2) and is_capturing(ptr):
            return "cupy"
    return None


def current_stream(owner: Any, device_id: int) -> int:
    """The current stream of the array library that owns ``owner`` (an output array), on ``device_id``.

    Only libraries already imported by the caller are consulted: this never imports torch or CuPy.
    """
    module = library_of(owner)
    if module == "torch" and "torch" in sys.modules:
        torch = sys.modules["torch"]
        # torch's raw query is a C call; torch.cuda.current_stream builds a Stream object through several Python
        # layers (a few microseconds, paid twice a step by an explicit stream=)
        raw = getattr(getattr(torch, "_C", None), "_cuda_getCurrentRawStream", None)
        if raw is not None:
            return int(raw(device_id))
        return int(torch.cuda.current_stream(device_id).cuda_stream)
    if module == "cupy" and "cupy" in sys.modules:
        return int(sys.modules["cupy"].cuda.get_current_stream(device_id).ptr)
    return 0  # the legacy default stream, like a plain CUDA launch


def dlpack_stream(handle: int) -> int:
    """DLPack's consumer-stream value for ``handle``: 0 is not allowed there, the legacy default stream is 1."""
    return 1 if handle == 0 else handle


class LaunchStream:
    """A launch stream already resolved by :func:`launch_stream` (``handle``, ``ordered_lib``): what a caller
    making several library calls on one stream passes as their ``stream``, so that each call skips resolving it
    again (the current-stream query and the other libraries' capture checks cost microseconds each)."""

    __slots__ = ("handle", "ordered_lib")

    def __init__(self, handle: int, ordered_lib: str | None):
        self.handle, self.ordered_lib = handle, ordered_lib


def launch_stream(device_id: int, stream: Any, owner: Any) -> tuple[int, str | None]:
    """``(handle, ordered_lib)`` of a launch on ``device_id`` (-1: host, ``(0, None)``): ``stream`` if given, else
    the current stream of the library owning ``owner`` (an output array), whose arrays are then known to be
    ordered on it (``ordered_lib``: that library's name, for the adapter's fast path). ``ValueError`` for a
    stream with host arrays: nothing would run on it, and silently dropping it would hide a caller's mix-up.
    A :class:`LaunchStream` is returned as it was resolved."""
    if type(stream) is LaunchStream:
        return stream.handle, stream.ordered_lib
    if device_id < 0:
        if stream is not None:
            shown = repr(stream) if isinstance(stream, int) else type(stream).__name__
            raise fail(ValueError, f"stream: expected None for host arrays (host arrays take no stream: the work "
                                   f"runs on the host, in the call), got {shown}; pass CUDA arrays to run on a "
                                   f"stream, or drop stream=")
        return 0, None
    if stream is not None:
        return stream_handle(stream), None
    lib = library_of(owner)
    if lib == "cupy":  # current_stream's common case inline (a call per step of every per-step call)
        handle = sys.modules["cupy"].cuda.get_current_stream(device_id).ptr
    else:
        handle = current_stream(owner, device_id)
    # No stream given: a graph capture running on another library's current stream would silently miss this
    # launch (a stale graph on every replay). Only other libraries are asked, so the common eager call costs
    # no driver query when the owner's library is the only one in use.
    other = _capturing_elsewhere(lib, device_id)
    if other is not None:
        raise fail(RuntimeError, f"stream: expected the stream of the {other} graph capture in progress, got "
                                 f"stream=None, which launches on the current stream of the outputs' library "
                                 f"({lib}), outside the capture; pass stream={other}'s current stream")
    return handle, lib
