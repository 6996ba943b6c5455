"""The arrays of one library call, viewed on the call's launch stream (the planner's step and the records')."""
from __future__ import annotations

from typing import Any

from .adapter import HOST, ArrayView, as_view, check_view, fast_device_view, identity
from .overlap import Spans
from .streams import dlpack_stream, launch_stream


class CallViews:
    """Where a call runs: the raw stream handle, and how to view the call's arrays ordered on it.

    ``written``: byte ranges the call's kernels write (the canary state, the pool); every array viewed here
    is refused if it shares memory with them. ``cache``: a dict kept across calls: a CuPy array or torch tensor
    that is the same object as last call's (same pointer and shape), viewed by attributes on the launch stream,
    reuses that call's view, checks included. Views that needed a DLPack stream handshake are never reused: the
    handshake orders the producer's writes before this call's launch, every call.
    """

    __slots__ = ("handle", "stream_ptr", "launch_stream", "ordered_lib", "written", "cache")

    def __init__(self, device_id: int, stream: Any, owner: Any, written: Spans | None = None,
                 cache: dict | None = None):
        self.handle, self.ordered_lib = launch_stream(device_id, stream, owner)
        on_device = device_id != HOST
        self.stream_ptr = dlpack_stream(self.handle) if on_device else -1
        self.launch_stream = self.handle if on_device else None
        self.written = written
        self.cache = cache

    def view(self, obj: Any, name: str) -> ArrayView:
        cache, stream = self.cache, self.launch_stream
        v = ident = None
        if cache is not None and stream is not None:
            ident = identity(obj)
            if ident is not None:
                hit = cache.get(name)
                if hit is not None and hit[0] is obj and hit[1] == stream and hit[2] == ident:
                    return hit[3]
                v = fast_device_view(obj, name, stream, self.ordered_lib)
        if v is None:
            ident = None
            v = as_view(obj, name, stream_ptr=self.stream_ptr, launch_stream=stream, ordered_lib=self.ordered_lib)
        if self.written is not None:
            self.written.check(v)  # the kernels write there: an input sharing it would change under them
        if ident is not None:
            cache[name] = (obj, stream, ident, v)
        return v

    def vec(self, obj: Any, name: str, dtype, length: int | None = None, writable: bool = False) -> ArrayView:
        return check_view(self.view(obj, name), dtype=dtype, ndim=1, length=length, writable=writable)
