"""Eager steps that repeat the last step's arrays, launched as one CUDA graph each (issue 13's host budget).

A kernel launch costs the H200 host about 5 us, a CUDA-graph launch about 2.4 us whatever its kernels
(``benchmarks/bench_driver.py``, docs/history/gpu-runs-log.md runs 51-52). An engine that keeps static step buffers (as
engines ready for CUDA graphs do, running eagerly at the batch sizes they did not capture) passes the same array
objects every step, only their contents change. For such a step the manager's launches in
:meth:`~CanaryManager.before_forward` (the scatter of the tokens accepted since the last step, each group's plan,
verify and layer verify) and in :meth:`~CanaryManager.after_kv_store` (each group's write and layer write, then
the step's report kernel when no sweep runs between) are the launches it made last step, argument for argument:
here they are captured once, on a private stream, and replayed on the engine's stream as one graph per call. What
a graph bakes in and may change between steps is in its key: the batch size, the groups, the scatter's row and
token counts, the report's ``req_pool_indices`` pointer and batch size.

When a call may be replayed: the same objects (``is``) with the same data pointers and shapes as at capture
(:func:`~canary.interop.callviews.fingerprint`), the same batch size, groups and launch stream, exactly the
conditions under which the planner and the records reuse a checked launch (:class:`~canary.interop.callviews.Reuse`),
so a replay skips no check a direct call would make. A call is captured the second time in a row it is seen
(a one-off shape is not worth a capture) and only when every array is of the library whose current stream
is the launch stream (no DLPack stream handshake to replay). Not captured: an SWA group whose slots the manager
translates (the translation runs on the array library's current stream), backends other than CuPy's. Every
other step launches directly, as before. ``CanaryManager(eager_graphs=False)`` turns this off.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

from ..interop.adapter import fast_device_view
from ..interop.callviews import fingerprint
from ..interop.cudart import OnDevice, on_device
from ..interop.streams import LaunchStream
from ..interop.libs import library_of

# per call site: each keeps its step arrays alive. An engine's batch changes size every few steps, its token
# count with it, the pinned staging buffer of the accepted tokens rotates (a graph per buffer) and async
# batching alternates two sets of step buffers (a graph per set): 32 keeps every such key of a running engine
MAX_GRAPHS = 32


class _Entry:
    __slots__ = ("objs", "prints", "handle", "graph", "extra")

    def __init__(self, objs, prints, handle, graph, extra):
        self.objs, self.prints, self.handle, self.graph, self.extra = objs, prints, handle, graph, extra


class EagerGraphs:
    """The captured calls of one manager on CUDA device ``ordinal`` (module docstring). ``rt``: the runtime of
    :mod:`canary.interop.cudart`."""

    def __init__(self, rt, ordinal: int):
        self.rt, self.ordinal = rt, ordinal
        self._stream = None  # the private capture stream, made at the first capture
        self._graphs: dict[tuple, _Entry] = {}
        self._seen: dict[tuple, tuple] = {}  # (call site, key) -> (objs, prints, handle) of its last direct call
        self.captures = self.replays = self.direct = 0  # direct: calls that found no graph to replay
        # why each direct call found none, per call site: "new" (no graph of its key yet), "stream" (captured for
        # another launch stream), "arrays" (other array objects), "layout" (their pointers or shapes changed)
        self.misses: dict[str, int] = {}
        self.broken = False  # a capture failed: never capture again

    def launch(self, site: str, key: tuple, objs: tuple, st: LaunchStream) -> Any:
        """Replay the graph of ``(site, key)`` for ``objs`` on ``st`` and return what its capture returned, or
        ``MISS``."""
        e = self._graphs.get((site, key))
        why = None
        if e is None:
            why = "new"
        elif e.handle != st.handle:
            why = "stream"
        elif any(a is not b for a, b in zip(objs, e.objs)):
            why = "arrays"
        elif fingerprint(objs) != e.prints:
            why = "layout"
        if why is not None:
            self.direct += 1
            name = f"{site} {why}"
            self.misses[name] = self.misses.get(name, 0) + 1
            return MISS
        # the graph was instantiated in this device's context
        on_device(self.rt, self.ordinal, self.rt.graph_launch, e.graph, st.handle)
        self.replays += 1
        return e.extra

    def observe(self, site: str, key: tuple, objs: tuple, st: LaunchStream, owner: Any,
                body: Callable[[LaunchStream], Any]) -> None:
        """After a direct call of ``(site, key)`` over ``objs`` on ``st``: if it repeats the last direct call of
        ``(site, key)`` and may be replayed (module docstring; ``owner``: an array of the manager's, whose library
        must be the step arrays'), capture ``body`` (the call's launches, given the stream to launch on) for the
        next call to replay. Launches nothing itself: the direct call already did."""
        if self.broken:
            return
        try:  # nothing here may fail the step: the direct call already launched it
            prints = fingerprint(objs)
            last = self._seen.pop((site, key), None)
            if len(self._seen) >= 2 * MAX_GRAPHS:
                self._seen.pop(next(iter(self._seen)))
            self._seen[(site, key)] = (objs, prints, st.handle)
            if prints is None or last is None or last[2] != st.handle or last[1] != prints:
                return
            if any(a is not b for a, b in zip(objs, last[0])):
                return
            lib = _one_library(objs + (owner,), st)
            if lib is not None:
                self._capture(site, key, objs, prints, st.handle, lib, body)
        except Exception as exc:  # noqa: BLE001 - lose the speed, not the step
            self.broken = True
            logging.getLogger("kv_canary").warning(
                f"kv-canary: eager_graphs: expected to capture the manager's launches on a private stream, got "
                f"{type(exc).__name__}: {exc}; every later step launches directly")

    def _capture(self, site, key, objs, prints, handle, lib, body) -> None:
        rt = self.rt
        with OnDevice(rt, self.ordinal):
            if self._stream is None:
                self._stream = rt.stream_create()
            s = self._stream
            rt.begin_capture(s)
            try:
                extra = body(LaunchStream(s, lib))
            except BaseException:
                rt.graph_destroy(rt.end_capture(s))
                raise
            graph = rt.end_capture(s)
            try:
                exe = rt.graph_instantiate(graph)
            finally:
                rt.graph_destroy(graph)
        with OnDevice(rt, self.ordinal):
            prev = self._graphs.pop((site, key), None)  # the same call over other arrays: replaced
            if prev is not None:
                rt.graph_exec_destroy(prev.graph)
            if len(self._graphs) >= 2 * MAX_GRAPHS:  # the oldest capture goes (each keeps its arrays alive)
                rt.graph_exec_destroy(self._graphs.pop(next(iter(self._graphs))).graph)
        self._graphs[(site, key)] = _Entry(objs, prints, handle, exe, extra)
        self.captures += 1
        self._seen.pop((site, key), None)

    def forget(self) -> None:
        """Drop every graph (and the arrays they keep alive)."""
        with OnDevice(self.rt, self.ordinal):
            for e in self._graphs.values():
                self.rt.graph_exec_destroy(e.graph)
            self._graphs.clear()
            self._seen.clear()

    def close(self) -> None:
        self.forget()
        if self._stream is not None:
            with OnDevice(self.rt, self.ordinal):
                self.rt.stream_destroy(self._stream)
            self._stream = None


class _Miss:
    def __repr__(self) -> str:
        return "MISS"


MISS = _Miss()


def _one_library(objs: tuple, st: LaunchStream) -> str | None:
    """The library of every array in ``objs`` (``None`` entries skipped) if each is viewed on ``st`` without a
    DLPack stream handshake (its library's current stream is the launch stream), else ``None``."""
    lib = None
    for o in objs:
        if o is None:
            continue
        name = library_of(o)
        if lib is None:
            lib = name
        elif name != lib:
            return None
        if fast_device_view(o, "step array", st.handle, st.ordered_lib) is None:
            return None
    return lib
