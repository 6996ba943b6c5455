"""A manager call's launch stream: resolved once per call (an explicit ``stream=`` of any library, or the current
stream of the arrays' library), and, for an explicit one, the arrays' library ordered before it once per call."""
from __future__ import annotations

import sys
from typing import Any

from ..errors import fail
from ..interop.cudart import runtime
from ..interop.streams import LaunchStream, current_stream, launch_stream, library_of, stream_handle


# Stream types whose handle is fixed for the object's life (torch.cuda.Stream, CuPy's streams): their handle is
# read once per object, not once per call (an object of another type, e.g. a __cuda_stream__ proxy, is asked
# every call: it may answer a different stream each time)
_FIXED_STREAM_MODULES = ("torch.cuda.streams", "cupy.cuda.stream", "cupy_backends.cuda.stream")


class StreamResolver:
    """A call's launch stream on CUDA device ``ordinal`` (``None``: host arrays), for arrays like ``pool_array``."""

    def __init__(self, ordinal: int | None, pool_array: Any):
        self.ordinal, self.pool_array = ordinal, pool_array
        self._streams: dict[tuple, LaunchStream] = {}  # (handle, ordered library) -> its LaunchStream
        # resolve's common case: arrays of CuPy's, no stream given (cupy.cuda.get_current_stream)
        self._cupy_current = (sys.modules["cupy"].cuda.get_current_stream
                              if ordinal is not None and library_of(pool_array) == "cupy" else None)
        self._lib = library_of(pool_array) if ordinal is not None else None
        self._event = None  # the explicit-stream handshake's event (transfer.Event), made at the first one
        self.handshakes = 0  # explicit-stream calls that ordered the library's current stream before theirs
        self._last_stream: Any = None  # the last explicit stream object of a fixed-handle type (kept alive) ...
        self._last_handle = 0  # ... and its handle
        self._current: Any = None  # () -> the current stream of the arrays' library (bound at first use)
        self._rt = None

    def _handle_of(self, stream: Any) -> int:
        if stream is self._last_stream:
            return self._last_handle
        handle = stream_handle(stream)
        if type(stream).__module__ in _FIXED_STREAM_MODULES:
            self._last_stream, self._last_handle = stream, handle
        return handle

    def _current_of_lib(self) -> Any:
        lib, ordinal = self._lib, self.ordinal
        if lib == "torch":
            torch = sys.modules["torch"]
            raw = getattr(getattr(torch, "_C", None), "_cuda_getCurrentRawStream", None)
            if raw is not None:  # a C call (torch.cuda.current_stream builds a Stream through Python layers)
                return lambda: int(raw(ordinal))
        return lambda: current_stream(self.pool_array, ordinal)

    def _explicit(self, stream: Any, capturing: bool | None = None) -> tuple[int, str | None, bool | None]:
        """An explicit ``stream`` (torch, CuPy, cuda.core, Numba, ``__cuda_stream__`` or a raw handle): the arrays
        of the manager's library (``library=``, the engine's) are then ordered on it once per call, not once per
        array: when that library's current stream is another one, an event recorded there and waited for on
        ``stream`` (what DLPack's handshake does for each array, about 2 us of host time in all); inside a graph
        capture the graph's own dependencies order them (no event: it would invalidate the capture). Their views
        and the eager graphs then take the fast path, as with no stream given. ``(handle, ordered library,
        whether the stream is capturing: None where not asked)``."""
        handle = self._handle_of(stream)
        lib = self._lib
        if lib not in ("cupy", "torch") or lib not in sys.modules:
            return handle, None, None
        if self._current is None:
            self._current = self._current_of_lib()
        current = self._current()
        if current != handle:
            rt = self._rt
            if rt is None:
                rt = self._rt = runtime()
            capturing = rt.is_capturing(handle)
            if not capturing:
                if self._event is None:
                    from .transfer import Event

                    self._event = Event()
                rt.event_record(self._event.ev, current)
                rt.stream_wait_event(handle, self._event.ev)
                self.handshakes += 1
            return handle, lib, capturing
        return handle, lib, None

    def close(self) -> None:
        if self._event is not None:
            self._event.free()
            self._event = None
        self._last_stream = None

    def resolve(self, stream: Any) -> tuple[int, Any]:
        """The launch stream, resolved once per call: ``(raw handle, what the planner and records take as their
        stream)``; host arrays: ``(0, None)``."""
        return self.resolve_capture(stream)[:2]

    def resolve_capture(self, stream: Any) -> tuple[int, Any, bool]:
        """:meth:`resolve` and whether the launch stream is capturing a CUDA graph (one driver query a call:
        the explicit-stream handshake's own, when it made one)."""
        if self.ordinal is None:
            if stream is not None:
                raise fail(ValueError, "stream: expected None for a manager on device='cpu' (host arrays take no "
                                       f"stream), got {type(stream).__name__}")
            return 0, None, False
        cupy_current = self._cupy_current
        capturing = None
        if stream is None and cupy_current is not None and "torch" not in sys.modules:
            # launch_stream's answer for CuPy-owned arrays when no other library could be capturing: the current
            # CuPy stream, ordered for CuPy arrays (the common eager call, without its generic checks)
            handle, lib = cupy_current(self.ordinal).ptr, "cupy"
        elif stream is not None and type(stream) is not LaunchStream:
            handle, lib, capturing = self._explicit(stream)
        else:
            handle, lib = launch_stream(self.ordinal, stream, self.pool_array)
        st = self._streams.get((handle, lib))
        if st is None:  # one per stream seen (a handful), not one per call
            st = LaunchStream(handle, lib)
            if len(self._streams) < 64:
                self._streams[(handle, lib)] = st
        if capturing is None:
            rt = self._rt
            if rt is None:
                rt = self._rt = runtime()
            capturing = rt.is_capturing(handle)
        return handle, st, capturing
