"""Host -> device: the step's pool rows and valid lengths and the queued expected tokens, staged into the plan's
device area and scattered into the expected-token pool without syncing the engine's stream
(canary/manager/transfer.py).

:class:`HostStaging` (host arrays): plain writes in the call. :class:`CudaStaging`: a few pinned buffers, each
copied on the engine's stream (an event per buffer says when it may be refilled), then the scatter
(:class:`DeviceScatter`) or, for a decode batch's one token a row, the append (``canary_append_tokens`` of the
CuPy backend, or :meth:`DeviceScatter.appending`'s scatter). Whether a buffer is free is known first from the
reports (the mailbox's ``done``, :mod:`.mailbox`: a report that ran tells that its stream ran everything before
it), else from the buffer's event.
"""
from __future__ import annotations

from itertools import chain
from typing import Any

import numpy as np

from ..interop.adapter import as_view
from ..interop.cudart import H2D, OnDevice, on_device, runtime
from .accepted import HeldTokens
from .pool import RowTokens
from .transfer import Pinned

_INT64 = np.dtype(np.int64)


class HostStaging:
    """Host arrays: every transfer is a copy done in the call."""

    append = device_append = accept = None  # a GPU staging's alone

    def stage(self, pool: np.ndarray, updates, q_out, valid_out, q: np.ndarray, valid: np.ndarray, stream,
              defer_scatter: bool = False) -> None:
        for u in updates:
            # int64 first: the pool keeps the low 32 bits, as the scatter stores them
            if type(u) is RowTokens:
                keep = u.rows > 0  # padding rows (pool row 0) take no token
                pool[u.rows[keep], u.cols[keep]] = u.host_tokens()[keep]
                continue
            row, col, toks = u
            pool[row, col:col + len(toks)] = np.asarray(toks, dtype=np.int64)
        q_out[: len(q)] = q
        valid_out[: len(valid)] = valid

    def close(self) -> None:
        pass


class CudaStaging:
    """Pinned staging buffers on CUDA device ``ordinal`` (module docstring).

    ``staging``: the device arrays the host-to-device copies fill: ``qv`` ``[2 B]`` int64 (the plan's pool rows
    ``[0, B)`` and valid lengths ``[B, 2 B)``, ``B = max_batch_size``) and ``upd`` ``[3 U + 1 + T]`` int64 (a
    scatter's ``rows`` ``[U]``, ``cols`` ``[U]``, ``offsets`` ``[U + 1]`` and ``tokens`` ``[T]``, back to back).
    ``scatter(k, t, stream)`` launches the expected-token scatter of the first ``k`` rows and ``t`` tokens staged
    there (a :class:`DeviceScatter`). ``append``: the decode batch's scatter (:meth:`DeviceScatter.appending`,
    :meth:`stage_append`); ``device_append``: the backend's ``canary_append_tokens`` over the plan's staging
    (:meth:`stage_device_append`). ``progress``: the mailbox (:mod:`.mailbox`), whose ``reports`` numbers the
    step a buffer's use belongs to and whose ``done`` says which steps have run on each stream.
    """

    def __init__(self, ordinal: int, *, staging: dict[str, Any], u_cap: int, scatter, progress,
                 append: Any = None, device_append: Any = None, depth: int = 3, accept_ring: Any = None):
        self.ordinal = ordinal
        # device token ids are copied at the accept into this ring's slots (canary/manager/accepted.py); None:
        # no device append, so an accept copies them to the host
        self.accept = accept_ring
        self.scatter = scatter
        self.general = scatter  # the DeviceScatter itself (tests may wrap self.scatter)
        self.append = append
        # kernels/records.cu's canary_append_tokens over the plan's staging (the CuPy backend's PreparedAppend)
        self.device_append = device_append
        self._append_calls: dict[tuple, _AppendCall] = {}
        self.qv, self.upd = staging["qv"], staging["upd"]
        self.qv_ptr = as_view(self.qv, "staging.qv").ptr
        self.upd_ptr = as_view(self.upd, "staging.upd").ptr
        self.b_cap = int(as_view(self.qv, "qv").shape[0]) // 2
        self.u_cap = int(u_cap)
        self.t_cap = int(as_view(self.upd, "upd").shape[0]) - 3 * self.u_cap - 1
        u = self.u_cap
        self._arange = np.arange(u + 1, dtype=np.int64)
        self.rt = runtime()
        self.merged = self.upd_ptr == self.qv_ptr + 16 * self.b_cap  # one device area: one copy fills both
        if not self.merged:
            self.append = None  # its copy fills rows, valid lengths and tokens at once
        with OnDevice(self.rt, ordinal):
            stage_bytes = 8 * (2 * self.b_cap + 3 * u + 1 + self.t_cap)
            self.stage_bufs = [Pinned(stage_bytes) for _ in range(depth)]
        self._next_stage = 0
        self._progress = progress
        # stream -> the last step whose report is known to have run there (the mailbox's: the same dict)
        self._done: dict[int, int] = progress.done

    def _stage_buf(self) -> Pinned:
        buf = self.stage_bufs[self._next_stage]
        self._next_stage = (self._next_stage + 1) % len(self.stage_bufs)
        if buf.pending and self._done.get(buf.stream, -1) >= buf.step:
            buf.pending = False
        if buf.pending:  # the host is len(stage_bufs) steps ahead of the GPU: the only wait on this path
            with OnDevice(self.rt, self.ordinal):
                if buf.evented:
                    buf.wait()
                else:  # no event marks that use: its stream up to now (it had passed it by its report)
                    self.rt.stream_synchronize(buf.stream)
                    buf.pending = False
        return buf

    def _used(self, buf: Pinned, stream: int, evented: bool = True) -> None:
        buf.pending, buf.step, buf.stream, buf.evented = True, self._progress.reports, stream, evented

    def stage(self, pool, updates, q_out, valid_out, q: np.ndarray, valid: np.ndarray, stream: int,
              defer_scatter: bool = False) -> tuple | None:
        """Copy the step's pool rows, valid lengths and queued expected tokens to the device and scatter the
        tokens into the pool, on ``stream``. ``defer_scatter``: the last scatter is left to the caller (who
        launches it next on the same stream, in an eager step's graph, by :meth:`launch_deferred`): ``(scatter, k,
        t, None)`` is returned (``None``: no update)."""
        # A staging buffer holds the pool rows and valid lengths at [0, 2 B) and a scatter's update at [2 B, ...),
        # as the device area does when the manager allocates qv and upd back to back (self.merged): the first
        # scatter's copy then carries the rows and lengths too, one copy for both.
        # (The manager calls this only when the rows, the counts or the stream changed since the last call: the
        # device area keeps what the last copy put there, and only this method writes it.)
        rt, u, b = self.rt, self.u_cap, self.b_cap
        n = len(q)
        qv_due = True
        deferred = None
        with OnDevice(rt, self.ordinal):
            # Device token ids first, each scattered straight from the engine's array (their rows and columns
            # staged): before any host update's copy reuses the staging area. Updates write disjoint columns, so
            # their order does not matter.
            on_device = [x for x in updates if type(x) is RowTokens and x.tokens is None]
            if on_device:
                for x in on_device:
                    self._scatter_device_tokens(x, stream)
                updates = [x for x in updates if not (type(x) is RowTokens and x.tokens is None)]
            for rows, cols, offsets, tokens in _chunks(updates, self.u_cap, self.t_cap) if updates else ():
                if deferred is not None:  # an earlier chunk's scatter: before this chunk's copy overwrites it
                    self.launch_deferred(deferred, stream)
                buf = self._stage_buf()
                k, t = rows.shape[0], tokens.shape[0]
                w = buf.words
                o = 2 * b
                w[o:o + k], w[o + u:o + u + k], w[o + 2 * u:o + 2 * u + k + 1] = rows, cols, offsets
                w[o + 3 * u + 1:o + 3 * u + 1 + t] = tokens
                if qv_due and self.merged:
                    w[:n], w[b:b + n] = q, valid
                    rt.memcpy_async(self.qv_ptr, buf.ptr, 8 * (o + 3 * u + 1 + t), H2D, stream)
                    qv_due = False
                else:
                    rt.memcpy_async(self.upd_ptr, buf.ptr + 8 * o, 8 * (3 * u + 1 + t), H2D, stream)
                rt.event_record(buf.ev, stream)  # the copy read the buffer: free once it has run
                self._used(buf, stream)
                deferred = (self.scatter, k, t, None)
            if deferred is not None and not defer_scatter:
                self.launch_deferred(deferred, stream)
                deferred = None
            if qv_due:
                buf = self._stage_buf()
                w = buf.words
                w[:n], w[b:b + n] = q, valid
                rt.memcpy_async(self.qv_ptr, buf.ptr, 8 * (b + n), H2D, stream)
                rt.event_record(buf.ev, stream)
                self._used(buf, stream)
        return deferred

    def _scatter_device_tokens(self, x, stream: int) -> None:
        # One token a row from a device array (x: RowTokens with device set): its rows, columns and offsets
        # 0..k through a pinned buffer into the scatter's staging, then the general scatter kernel reading the
        # tokens where they are (padding rows, pool row 0, are skipped by the kernel).
        rt, u, b = self.rt, self.u_cap, self.b_cap
        k = x.rows.shape[0]
        buf = self._stage_buf()
        w = buf.words
        o = 2 * b
        w[o:o + k], w[o + u:o + u + k], w[o + 2 * u:o + 2 * u + k + 1] = x.rows, x.cols, self._arange[:k + 1]
        rt.memcpy_async(self.upd_ptr, buf.ptr + 8 * o, 8 * (3 * u + 1), H2D, stream)
        rt.event_record(buf.ev, stream)
        self._used(buf, stream)
        held = x.device[1]
        if type(held) is HeldTokens:
            self.accept.before_read(held, stream)
        self.general.launch_with_tokens(x.device[0], k, stream)
        if type(held) is HeldTokens:
            self.accept.release(held, stream)

    def stage_append(self, q: np.ndarray, valid: np.ndarray, tokens: np.ndarray, stream: int,
                     defer: bool = False) -> tuple | None:
        """:meth:`stage` of a decode batch's one accepted token a row, for the very rows ``q`` (``[n]``) the step
        plans, the valid lengths ``valid`` counting them: one copy of ``q``, ``valid`` and ``tokens`` and the
        :class:`DeviceScatter.appending` scatter, which takes its rows and columns from the plan's own staging
        (nothing else to pack or copy). Only when :attr:`append` is set (a merged staging area). ``defer``: the
        copy and the scatter are both left to the caller, returned as ``(scatter, k, t, (buffer index, bytes))``
        for :meth:`launch_deferred` (an eager step's graph holds the copy too: a copy from a fixed pinned buffer,
        so the graph is one per staging buffer) and then :meth:`deferred_launched`."""
        n, b = len(q), self.b_cap
        i = self._next_stage
        with OnDevice(self.rt, self.ordinal):
            buf = self._stage_buf()
        w = buf.words
        w[:n], w[b:b + n], w[2 * b:2 * b + n] = q, valid, tokens
        return self._launch_unless(defer, (self.append, n, n, (i, 8 * (2 * b + n))), stream)

    def stage_device_append(self, q: np.ndarray, one, stream: int, synced: bool, defer: bool = False
                            ) -> tuple | None:
        """A decode batch's tokens for exactly the rows ``q`` (``one``: a :class:`RowTokens`): ``canary_append_tokens``
        writes each row's token at column ``valid[r]`` and advances ``valid[r]`` on the device, so the rows and
        lengths are copied only when the device area does not already hold ``q`` and the lengths before this
        update (``synced``). The tokens are read where they are: the engine's device array (``one.device``), or,
        host ints, from the start of the device area's ``upd``, copied there with the rows and lengths (one copy
        when the area is merged). The copy is launched here, directly, never deferred: the append then reads
        fixed device addresses, so an eager step's graph (canary/manager/eager.py) is one per batch size, not one
        per staging buffer and copy size. ``defer`` as in :meth:`stage_append`."""
        n, b = len(q), self.b_cap
        host = one.device is None
        if host or not synced:
            buf = self._stage_buf()
            w = buf.words
            if not synced:
                w[:n], w[b:b + n] = q, one.cols
            if host:
                w[2 * b:2 * b + n] = one.tokens
            rt = self.rt
            with OnDevice(rt, self.ordinal):
                if host and not synced and self.merged:  # upd follows qv: rows, lengths and tokens at once
                    rt.memcpy_async(self.qv_ptr, buf.ptr, 8 * (2 * b + n), H2D, stream)
                else:
                    if not synced:
                        rt.memcpy_async(self.qv_ptr, buf.ptr, 8 * (b + n), H2D, stream)
                    if host:
                        rt.memcpy_async(self.upd_ptr, buf.ptr + 16 * b, 8 * n, H2D, stream)
            # free once this step's report has run (it follows the copy on the stream): no event to record
            self._used(buf, stream, evented=False)
        if host:
            ptr, dtype, obj = self.upd_ptr, _INT64, None
        else:
            view, obj = one.device
            ptr, dtype = view.ptr, view.dtype
            if type(obj) is HeldTokens:  # the manager's copy (accepted.py): behind the accept's copy
                self.accept.before_read(obj, stream)
        key = (ptr, dtype)
        call = self._append_calls.get(key)
        if call is None or call.obj is not obj:
            if len(self._append_calls) >= 8:  # a graph keyed by an evicted call keeps it (and its array) alive
                self._append_calls.pop(next(iter(self._append_calls)))
            call = self._append_calls[key] = _AppendCall(self.device_append, ptr, dtype, obj)
        return self._launch_unless(defer, (call, n, n, None), stream)

    def _launch_unless(self, defer: bool, deferred: tuple, stream: int) -> tuple | None:
        # The tail of stage_append and stage_device_append: left to the caller (defer), or launched here.
        if defer:
            return deferred
        self.launch_deferred(deferred, stream)
        self.deferred_launched(deferred, stream)
        return None

    def launch_deferred(self, deferred: tuple, stream: int) -> None:
        """Launch what :meth:`stage`, :meth:`stage_append` or :meth:`stage_device_append` left to the caller, on
        ``stream`` (capturable): the copy if any, then the scatter or the device append (once: it is not
        idempotent)."""
        fn, k, t, copy = deferred
        if copy is not None and copy[1]:
            with OnDevice(self.rt, self.ordinal):
                self.rt.memcpy_async(self.qv_ptr, self.stage_bufs[copy[0]].ptr, copy[1], H2D, stream)
        fn(k, t, stream)

    def deferred_launched(self, deferred: tuple, stream: int) -> None:
        """After :meth:`launch_deferred` ran on ``stream`` (directly or inside a replayed graph): its staging
        buffer is free once the stream gets here (and an accepted tokens' slot, accepted.py, once it is read)."""
        fn = deferred[0]
        if type(fn) is _AppendCall and type(fn.obj) is HeldTokens:
            self.accept.release(fn.obj, stream)
        copy = deferred[3]
        if copy is not None:
            buf = self.stage_bufs[copy[0]]
            if copy[1]:  # a copy from it: its event
                on_device(self.rt, self.ordinal, self.rt.event_record, buf.ev, stream)
                self._used(buf, stream)
            else:  # only the append reads it, before this step's report: the report marks its release (no event)
                self._used(buf, stream, evented=False)

    def close(self) -> None:
        with OnDevice(self.rt, self.ordinal):
            for b in self.stage_bufs:
                b.wait()
                b.free()
            if self.accept is not None:
                self.accept.close()


class _AppendCall:
    """``canary_append_tokens`` reading one device array of token ids (kept alive: a graph may hold its pointer);
    called as a deferred scatter, ``(k, t, stream)``, ``k = t`` = the batch's rows."""

    __slots__ = ("launcher", "ptr", "dtype", "obj")

    def __init__(self, launcher, ptr: int, dtype, obj):
        self.launcher, self.ptr, self.dtype, self.obj = launcher, ptr, dtype, obj

    def __call__(self, k: int, t: int, stream: int) -> None:
        self.launcher.launch(self.ptr, self.dtype, k, stream)


class DeviceScatter:
    """An expected-token scatter into the pool from fixed device staging (docs/records.md 7), on ``backend``: views
    of its arrays checked once here (the public ``scatter_expected_tokens`` checks every argument on every call),
    a call then only sizes them (``k`` rows, ``t`` tokens) and launches. ``parts``: the ``rows``, ``cols``,
    ``offsets`` and ``tokens`` int64 views at their capacities; the scatter writes row ``rows[i]``'s tokens from
    column ``cols[i] + column_offset``. :meth:`over` builds the general one, :meth:`appending` the decode
    batch's."""

    def __init__(self, pool: Any, parts: tuple, column_offset: int, backend: str):
        from .. import backends
        from ..interop.adapter import check_view

        pv = check_view(as_view(pool, "req_to_verify_expected_tokens"), dtype=np.int32, ndim=2, writable=True)
        self.module = backends.resolve(backend, pv.device_id, family="records")
        self.pool, self.parts, self.column_offset = pv, parts, int(column_offset)
        rows, _, _, tokens = parts
        prepare = getattr(self.module, "prepare_scatter", None)  # the CuPy backend packs the launch once
        self.prepared = None if prepare is None else prepare(self._args(rows.shape[0], tokens.shape[0]))

    @classmethod
    def over(cls, pool: Any, upd: Any, u_cap: int, backend: str) -> "DeviceScatter":
        """The scatter of :class:`CudaStaging`'s ``upd`` staging: ``rows`` ``[U]``, ``cols`` ``[U]``, ``offsets``
        ``[U + 1]``, ``tokens`` ``[T]`` back to back."""
        from ..interop.adapter import check_view

        uv = check_view(as_view(upd, "staging.upd"), dtype=np.int64, ndim=1)
        u = int(u_cap)
        spans = (("rows", 0, u), ("cols", u, u), ("offsets", 2 * u, u + 1),
                 ("tokens", 3 * u + 1, uv.shape[0] - 3 * u - 1))
        return cls(pool, tuple(uv._replace(name=n, ptr=uv.ptr + 8 * o, shape=(k,), strides=(1,)) for n, o, k in spans),
                   0, backend)

    @classmethod
    def appending(cls, pool: Any, qv: Any, upd: Any, offsets: Any, backend: str) -> "DeviceScatter":
        """A decode batch's scatter (:meth:`CudaStaging.stage_append`): one token a batch row, row ``r``'s into
        pool row ``q[r]`` at column ``valid[r] - 1``, reading the plan's own staged rows and valid lengths (``qv``),
        the tokens from the start of ``upd`` and ``offsets`` = ``0, 1, ..., B`` (a constant device array)."""
        from ..interop.adapter import check_view

        qvv = check_view(as_view(qv, "staging.qv"), dtype=np.int64, ndim=1)
        uv = check_view(as_view(upd, "staging.upd"), dtype=np.int64, ndim=1)
        ov = check_view(as_view(offsets, "staging.offsets"), dtype=np.int64, ndim=1)
        b = qvv.shape[0] // 2
        parts = (qvv._replace(name="rows", shape=(b,)), qvv._replace(name="cols", ptr=qvv.ptr + 8 * b, shape=(b,)),
                 ov._replace(name="offsets"), uv._replace(name="tokens", shape=(b,)))
        return cls(pool, parts, -1, backend)

    def _args(self, k: int, t: int, tokens=None):
        # tokens: a device view to read the tokens from instead of the staging's (launch_with_tokens)
        from ..backends.args import ScatterArgs

        rows, cols, offsets, staged = self.parts
        tokens = staged if tokens is None else tokens
        return ScatterArgs(self.pool, rows._replace(shape=(k,)), tokens._replace(shape=(t,)),
                           offsets._replace(shape=(k + 1,)), cols._replace(shape=(k,)), self.column_offset)

    def __call__(self, k: int, t: int, stream: int) -> None:
        if self.prepared is not None:
            self.prepared.launch(k, t, stream)
        else:
            self.module.scatter(self._args(k, t), stream)

    def launch_with_tokens(self, tokens, k: int, stream: int) -> None:
        """The first ``k`` staged rows' scatter, one token a row read from ``tokens`` (a checked ``[>= k]`` device
        view: the engine's own array), not from the staging."""
        self.module.scatter(self._args(k, k, tokens), stream)


def _chunks(updates, u_cap: int, t_cap: int):
    """Split ``(row, col, tokens)`` updates (tokens: an int64 array or a list of ints) and :class:`RowTokens` into
    scatter launches of at most ``u_cap`` rows and ``t_cap`` tokens: ``(rows, cols, offsets, tokens)`` int64
    arrays each (a batch's accepted tokens and a new request's prompt usually in one launch: the updates write
    disjoint columns, in any order)."""
    rows, cols, lens, toks, n = [], [], [], [], 0

    def emit():
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        if all(type(t) is list for t in toks):  # a decode step: one token or a few per request
            flat = np.array(list(chain.from_iterable(toks)), dtype=np.int64)
        else:
            flat = np.concatenate([np.asarray(t, dtype=np.int64) for t in toks])
        return np.array(rows, dtype=np.int64), np.array(cols, dtype=np.int64), offsets, flat

    for u in updates:
        if type(u) is RowTokens:  # one token a row: into the same launch as the others while it fits
            step = min(u_cap, t_cap)
            host = u.host_tokens()
            for lo in range(0, u.rows.shape[0], step):
                k = min(step, u.rows.shape[0] - lo)
                if len(rows) + k > u_cap or n + k > t_cap:
                    yield emit()
                    rows, cols, lens, toks, n = [], [], [], [], 0
                rows.extend(u.rows[lo:lo + k].tolist())
                cols.extend(u.cols[lo:lo + k].tolist())
                lens.extend([1] * k)
                toks.append(host[lo:lo + k])
                n += k
            continue
        row, col, t = u
        total = len(t)
        for lo in range(0, total, t_cap):  # a prompt longer than the staging area: several pieces
            part = t[lo:lo + t_cap] if total > t_cap else t
            k = len(part)
            if len(rows) == u_cap or n + k > t_cap:
                yield emit()
                rows, cols, lens, toks, n = [], [], [], [], 0
            rows.append(row)
            cols.append(col + lo)
            lens.append(k)
            toks.append(part)
            n += k
    if rows:
        yield emit()


def append_scatter(empty, pool: Any, qv: Any, upd: Any, ordinal: int, backend: str) -> DeviceScatter:
    """The decode batch's scatter (:meth:`CudaStaging.stage_append`) over the staging area (``qv``, ``upd``), and
    its constant offsets ``0, 1, ..., B`` (``B``: ``qv``'s batch size), copied once (a sync, at construction): for
    managers without the backend's device append (Numba). ``empty(n, dtype)``: the manager's allocator."""
    b = int(as_view(qv, "staging.qv").shape[0]) // 2
    offsets = empty(b + 1, np.int64)
    host = np.arange(b + 1, dtype=np.int64)
    rt = runtime()
    with OnDevice(rt, ordinal):
        rt.memcpy_async(as_view(offsets, "staging.offsets").ptr, host.ctypes.data, host.nbytes, H2D, 0)
        rt.stream_synchronize(0)
    out = DeviceScatter.appending(pool, qv, upd, offsets, backend)
    out.offsets_array = offsets  # kept alive: the scatter holds its pointer
    return out
