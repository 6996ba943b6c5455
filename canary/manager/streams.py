"""A manager call's launch stream: resolved once per call (an explicit ``stream=`` of any library, or the current
stream of the arrays' library), and, for an explicit one, the arrays' library ordered before it once per call."""
from __future__ import annotations

import sys
from typing import Any

from ..errors import fail
from ..interop.cudart import runtime
from ..interop.streams import LaunchStream, current_stream, is_capturing, launch_stream, library_of, stream_handle


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

    def _explicit(self, stream: Any) -> tuple[int, str | None]:
        """An explicit ``stream`` (torch, CuPy, cuda.core, Numba, ``__cuda_stream__`` or a raw handle): the arrays
        of the manager's library (``library=``, the engine's) are then ordered on it once per call, not once per
        array: when that library's current stream is another one, an event recorded there and waited for on
        ``stream`` (what DLPack's handshake does for each array, about 2 us of host time in all); inside a graph
        capture the graph's own dependencies order them (no event: it would invalidate the capture). Their views
        and the eager graphs then take the fast path, as with no stream given."""
        handle = stream_handle(stream)
        lib = self._lib
        if lib not in ("cupy", "torch") or lib not in sys.modules:
            return handle, None
        current = current_stream(self.pool_array, self.ordinal)
        if current != handle and not is_capturing(handle):
            if self._event is None:
                from .transfer import Event

                self._event = Event()
            rt = runtime()
            rt.event_record(self._event.ev, current)
            rt.stream_wait_event(handle, self._event.ev)
            self.handshakes += 1
        return handle, lib

    def close(self) -> None:
        if self._event is not None:
            self._event.free()
            self._event = None

    def resolve(self, stream: Any) -> tuple[int, Any]:
        """The launch stream, resolved once per call: ``(raw handle, what the planner and records take as their
        stream)``; host arrays: ``(0, None)``."""
        if self.ordinal is None:
            if stream is not None:
                raise fail(ValueError, "stream: expected None for a manager on device='cpu' (host arrays take no "
                                       f"stream), got {type(stream).__name__}")
            return 0, None
        cupy_current = self._cupy_current
        if stream is None and cupy_current is not None and "torch" not in sys.modules:
            # launch_stream's answer for CuPy-owned arrays when no other library could be capturing: the current
            # CuPy stream, ordered for CuPy arrays (the common eager call, without its generic checks)
            handle, lib = cupy_current(self.ordinal).ptr, "cupy"
        elif stream is not None and type(stream) is not LaunchStream:
            handle, lib = self._explicit(stream)
        else:
            handle, lib = launch_stream(self.ordinal, stream, self.pool_array)
        st = self._streams.get((handle, lib))
        if st is None:  # one per stream seen (a handful), not one per call
            st = LaunchStream(handle, lib)
            if len(self._streams) < 64:
                self._streams[(handle, lib)] = st
        return handle, st
