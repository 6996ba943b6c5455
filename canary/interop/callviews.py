"""The arrays of one library call, viewed on the call's launch stream (the planner's step and the records')."""
from __future__ import annotations

from typing import Any

from .adapter import _IDENTITY_KIND, HOST, ArrayView, as_view, check_view, fast_device_view, identity
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

    __slots__ = ("handle", "stream_ptr", "launch_stream", "ordered_lib", "written", "cache", "reusable")

    def __init__(self, device_id: int, stream: Any, owner: Any, written: Spans | None = None,
                 cache: dict | None = None):
        self.handle, self.ordered_lib = launch_stream(device_id, stream, owner)
        on_device = device_id != HOST
        self.stream_ptr = dlpack_stream(self.handle) if on_device else -1
        self.launch_stream = self.handle if on_device else None
        self.written = written
        self.cache = cache
        self.reusable = on_device  # every view so far may be reused by a later call (see view())

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
            self.reusable = False
            v = as_view(obj, name, stream_ptr=self.stream_ptr, launch_stream=stream, ordered_lib=self.ordered_lib)
        if self.written is not None:
            self.written.check(v)  # the kernels write there: an input sharing it would change under them
        if ident is not None:
            cache[name] = (obj, stream, ident, v)
        return v

    def vec(self, obj: Any, name: str, dtype, length: int | None = None, writable: bool = False) -> ArrayView:
        return check_view(self.view(obj, name), dtype=dtype, ndim=1, length=length, writable=writable)


def fingerprint(objs) -> tuple | None:
    """:func:`~canary.interop.adapter.identity` of each object (``None`` stays ``None``), or ``None`` when one
    has no identity (its views are never reused)."""
    out = []
    for o in objs:
        if o is None:
            out.append(None)
            continue
        if _IDENTITY_KIND.get(type(o)) == 1:  # a CuPy array: identity's common case inline (every eager call)
            out.append((o.data.ptr, o.shape, o.dtype))
            continue
        ident = identity(o)
        if ident is None:
            return None
        out.append(ident)
    return tuple(out)


class Reuse:
    """One call's checked launch, kept for the next call over the same arrays: ``objs`` (the call's arrays,
    ``None`` for absent ones), their :func:`fingerprint`, the launch stream and ``extra`` (plain values that must
    be equal, such as a launch tag); ``launch``: what the backend prepared.

    A later call may skip its views and checks only if :meth:`matches`: the same objects (``is``) with the same
    pointers and shapes, on the same stream. Only calls whose every view was reusable (:class:`CallViews`'s
    ``reusable``: no DLPack stream handshake needed) are kept.
    """

    __slots__ = ("objs", "prints", "handle", "extra", "launch")

    def __init__(self, objs: tuple, prints: tuple, handle: int, extra: Any, launch: Any):
        self.objs, self.prints, self.handle, self.extra, self.launch = objs, prints, handle, extra, launch

    def matches(self, objs: tuple, handle: int, extra: Any) -> bool:
        if handle != self.handle or extra != self.extra:
            return False
        for a, b in zip(objs, self.objs):
            if a is not b:
                return False
        return fingerprint(objs) == self.prints
