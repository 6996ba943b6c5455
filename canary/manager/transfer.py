"""Moving the manager's small per-step data between host and device without syncing the engine's stream.

:class:`HostTransfer` (host arrays, the reference backend and Numba's simulator): plain reads and writes, done
in the call. :class:`CudaTransfer` (CUDA arrays of any library): pinned host memory and the CUDA runtime
(``cuda.bindings``, which the GPU backends already need), so it works the same for torch, CuPy and Numba arrays.
Every runtime call costs the host a driver round trip, so each direction is one copy per step:

- host -> device (pool rows and valid lengths of the step, one buffer; queued expected tokens, one buffer per
  scatter launch): staged in one of a few pinned buffers, copied asynchronously on the engine's stream; an
  event per buffer says when it may be refilled.
- device -> host (the :class:`~canary.manager.block.ReportBlock`: every group's ring, write index, counters and
  plan status; then the step's ``req_pool_indices``): after the step's writes, copied on the engine's stream
  into pinned memory, then the ring write indexes cleared by one memset behind the copy (stream order, not a
  host sync), so every snapshot holds exactly one step's rows. The host reads a snapshot once its event has
  completed (``cudaEventQuery``: never blocks).

The only host waits: reusing a pinned buffer whose previous copy has not run yet (the host is ``depth`` steps
ahead of the GPU), and :meth:`CudaTransfer.wait` (``manager.flush()``, a deliberate sync).
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np

from ..errors import fail
from ..interop.adapter import ArrayView, as_view
from ..interop.cudart import D2H, H2D, OnDevice, on_device, runtime
from ..interop.memview import host_view
from .block import ReportBlock
from .pool import RowTokens


class HostTransfer:
    """Host arrays: every transfer is a copy done in the call."""

    report_launch = None

    def full(self) -> bool:
        return False

    def order_report(self, stream) -> None:
        pass

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

    def __init__(self, block: ReportBlock):
        self.block = block
        self.append = self.device_append = None  # a GPU transfer's alone

    def snapshot(self, rpi: ArrayView | None, bs: int, stream) -> tuple[np.ndarray, np.ndarray | None]:
        b = self.block
        out = (np.array(b.array), None if rpi is None else np.array(rpi.host[:bs]))
        b.array[:b.index_words] = 0
        return out

    def take(self, token) -> tuple[np.ndarray, np.ndarray | None]:
        return token

    def read(self, token) -> tuple[np.ndarray, np.ndarray | None]:
        return token

    def release(self, token) -> None:
        pass

    def wait(self, token) -> None:
        pass


def _rt():
    try:
        from cuda.bindings import runtime
    except ImportError as exc:  # pragma: no cover - the GPU backends need cuda-core, which brings it
        raise fail(ImportError, "device: the manager's device transfers need cuda.bindings: pip install "
                                "'kv-canary[cuda13]'") from exc
    return runtime


def _check(result, what: str):
    rt = _rt()
    err = result[0] if isinstance(result, tuple) else result
    if err != rt.cudaError_t.cudaSuccess:
        raise fail(RuntimeError, f"{what}: expected cudaSuccess, got {err}")
    if isinstance(result, tuple):
        return result[1] if len(result) == 2 else result[1:]
    return None


class _Pinned:
    """``nbytes`` of pinned host memory and an event marking the last copy that used it."""

    def __init__(self, nbytes: int):
        rt = _rt()
        self.nbytes = -(-max(int(nbytes), 64) // 8) * 8
        self.ptr = int(_check(rt.cudaMallocHost(self.nbytes), "cudaMallocHost"))
        self.event = _check(rt.cudaEventCreateWithFlags(rt.cudaEventDisableTiming), "cudaEventCreateWithFlags")
        self.fast = runtime()
        self.ev = self.fast.event_handle(self.event)  # what the per-step calls pass
        self.pending = False
        self.words = self.array(0, (self.nbytes // 8,), np.int64)  # viewed once: a view costs ~5 us to make
        self.step, self.stream = -1, None  # the step and stream of the last copy that used it
        self.evented = True  # the event marks that use (else only the step's report does: CudaTransfer._stage_buf)

    def array(self, offset: int, shape, dtype) -> np.ndarray:
        return host_view(self.ptr + offset, tuple(shape), _strides(shape, dtype), dtype, self)

    def done(self) -> bool:
        if not self.pending:
            return True
        if self.fast.event_done(self.ev):
            self.pending = False
            return True
        return False

    def wait(self) -> None:
        if self.pending:
            self.fast.event_synchronize(self.ev)
            self.pending = False

    def free(self) -> None:
        rt = _rt()
        rt.cudaEventDestroy(self.event)
        rt.cudaFreeHost(self.ptr)


def _strides(shape, dtype) -> tuple[int, ...]:
    out, acc = [], np.dtype(dtype).itemsize
    for n in reversed(shape):
        out.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(out))


_INT64 = np.dtype(np.int64)


@dataclass
class _Detached:
    """A report copied out of its pinned slot (:meth:`CudaTransfer.detach`), waiting for the manager's decode."""
    words: np.ndarray
    rpi: np.ndarray | None


class _Snap:
    """One queued report (a slotted class: one is made every step). ``buf``: the copy's buffer (``None``: a mailbox
    slot written by the report kernel); ``bs``: req_pool_indices words after the block (``None``: not this step);
    ``step``, ``stream``; ``seq``: the report kernel's sequence number (mailbox slot ``seq % slots``)."""

    __slots__ = ("buf", "bs", "step", "stream", "seq")

    def __init__(self, buf: _Pinned | None, bs: int | None, step: int, stream: int, seq: int = 0):
        self.buf, self.bs, self.step, self.stream, self.seq = buf, bs, step, stream, seq


class CudaTransfer:
    """Pinned buffers on CUDA device ``ordinal`` (module docstring).

    ``block``: the :class:`ReportBlock` a snapshot copies. ``staging``: the device arrays the host-to-device
    copies fill: ``qv`` ``[2 B]`` int64 (the plan's pool rows ``[0, B)`` and valid lengths ``[B, 2 B)``,
    ``B = max_batch_size``) and ``upd`` ``[3 U + 1 + T]`` int64 (a scatter's ``rows`` ``[U]``, ``cols`` ``[U]``,
    ``offsets`` ``[U + 1]`` and ``tokens`` ``[T]``, back to back). ``scatter(k, t, stream)`` launches the
    expected-token scatter of the first ``k`` rows and ``t`` tokens staged there (a :class:`DeviceScatter`).

    ``report_kernel``: ``(counter, make)`` to report through ``kernels/report.cu`` (the CuPy backend):
    ``counter`` a zeroed ``[1]`` int64 device array, ``make(**layout)`` its launcher
    (:class:`canary.backends.cupy.report.ReportLaunch`). The kernel writes each report into the next slot of a
    pinned mailbox and publishes it by its sequence number, which the host polls: no copy, memset or event per
    step, and a launch that an eager step's CUDA graph can hold (:meth:`report_device`). ``None``: copies, a
    memset and an event per report (any backend).
    """

    def __init__(self, ordinal: int, *, block: ReportBlock, staging: dict[str, Any], u_cap: int, scatter,
                 append: Any = None, device_append: Any = None, report_kernel: Any = None, depth: int = 3):
        self.ordinal = ordinal
        self.block = block
        self.scatter = scatter
        self.general = scatter  # the DeviceScatter itself (tests may wrap self.scatter)
        self.append = append
        # kernels/records.cu's canary_append_tokens over the plan's staging (the CuPy backend's PreparedAppend)
        self.device_append = device_append
        self._append_calls: dict[tuple, _AppendCall] = {}
        self.qv, self.upd = staging["qv"], staging["upd"]
        self.qv_ptr = as_view(self.qv, "staging.qv").ptr
        self.upd_ptr = as_view(self.upd, "staging.upd").ptr
        self.block_ptr = as_view(block.array, "report_block").ptr
        self.b_cap = int(as_view(self.qv, "qv").shape[0]) // 2
        self.u_cap = int(u_cap)
        self.t_cap = int(as_view(self.upd, "upd").shape[0]) - 3 * self.u_cap - 1
        u = self.u_cap
        self._arange = np.arange(u + 1, dtype=np.int64)
        self.block_bytes = 8 * block.words
        self.rt = runtime()
        self.merged = self.upd_ptr == self.qv_ptr + 16 * self.b_cap  # one device area: one copy fills both
        if not self.merged:
            self.append = None  # its copy fills rows, valid lengths and tokens at once
        with OnDevice(self.rt, ordinal):
            stage_bytes = 8 * (2 * self.b_cap + 3 * u + 1 + self.t_cap)
            self.stage_bufs = [_Pinned(stage_bytes) for _ in range(depth)]
            self.snap_bufs = [_Pinned(self.block_bytes + 8 * self.b_cap) for _ in range(depth + 1)]
        self._next_stage = 0
        self._free_snaps = list(self.snap_bufs)
        self._step = 0  # snapshots taken
        self._unread = 0  # snapshots taken and not released
        self.report_launch = None
        if report_kernel is not None:
            counter, make = report_kernel
            self.slot_words = 1 + block.words + self.b_cap
            self.mail_slots = 2 * (depth + 1)
            with OnDevice(self.rt, ordinal):
                self.mailbox = _Pinned(8 * self.mail_slots * self.slot_words)
            self.mailbox.words[:] = 0  # no slot published yet (sequence numbers start at 1)
            self._order_ev = self.mailbox.ev  # marks the last report's stream position when the stream changes
            self.report_launch = make(block_ptr=self.block_ptr, words=block.words, index_words=block.index_words,
                                      mailbox_ptr=self.mailbox.ptr, slot_words=self.slot_words,
                                      slots=self.mail_slots,
                                      counter_ptr=as_view(counter, "report_counter").ptr)
            self._counter = counter  # kept alive: the launch holds its pointer
        self._report_stream = None
        # stream -> the last step whose snapshot is known to have run there: everything the stream ran before it
        # has too, its staging copies included, so their buffers are free without asking the driver.
        self._done: dict[int, int] = {}

    # -- host -> device ------------------------------------------------------------------------------------------
    def _stage_buf(self) -> _Pinned:
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

    def _used(self, buf: _Pinned, stream: int, evented: bool = True) -> None:
        buf.pending, buf.step, buf.stream, buf.evented = True, self._step, stream, evented

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
        self.general.launch_with_tokens(x.device[0], k, stream)

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
        writes each row's token at column ``valid[r]`` and advances ``valid[r]`` on the device, so no copy at all
        when the device area already holds ``q`` and the lengths before this update (``synced``); else those are
        copied first. The tokens are read where they are: the engine's device array (``one.device``), or host
        ints written into a pinned staging buffer, which the kernel reads over the bus (pinned memory is mapped
        into the device's address space, as the report kernel's mailbox is), one buffer of the rotation a step.
        ``defer`` as in :meth:`stage_append` (then :meth:`deferred_launched` records the buffer's release)."""
        n, b = len(q), self.b_cap
        copy = None
        if one.device is None or not synced:
            # A staging buffer: host ints for the append to read, and / or the rows and lengths to copy first.
            # Either way it is in use until the launch has read it (launch_deferred, then deferred_launched).
            i = self._next_stage
            buf = self._stage_buf()
            w = buf.words
            nbytes = 0
            if not synced:
                w[:n], w[b:b + n] = q, one.cols
                nbytes = 8 * (b + n)
            copy = (i, nbytes)
        if one.device is None:
            w[2 * b:2 * b + n] = one.tokens
            ptr, dtype, obj = buf.ptr + 16 * b, _INT64, buf
        else:
            view, obj = one.device
            ptr, dtype = view.ptr, view.dtype
        key = (ptr, dtype)
        call = self._append_calls.get(key)
        if call is None or call.obj is not obj:
            if len(self._append_calls) >= 8:  # a graph keyed by an evicted call keeps it (and its array) alive
                self._append_calls.pop(next(iter(self._append_calls)))
            call = self._append_calls[key] = _AppendCall(self.device_append, ptr, dtype, obj)
        return self._launch_unless(defer, (call, n, n, copy), stream)

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
        buffer is free once the stream gets here."""
        copy = deferred[3]
        if copy is not None:
            buf = self.stage_bufs[copy[0]]
            if copy[1]:  # a copy from it: its event
                on_device(self.rt, self.ordinal, self.rt.event_record, buf.ev, stream)
                self._used(buf, stream)
            else:  # only the append reads it, before this step's report: the report marks its release (no event)
                self._used(buf, stream, evented=False)

    # -- device -> host ------------------------------------------------------------------------------------------
    @property
    def slots(self) -> int:
        """Reports that may be unread at once (the manager frees one before the next report)."""
        return len(self.snap_bufs) if self.report_launch is None else self.mail_slots

    def full(self) -> bool:
        """Whether every report slot holds an unread report (the host is that many steps ahead of the GPU): the
        manager reads the oldest (waiting for it) before the next :meth:`snapshot`."""
        return self._unread >= self.slots

    def snapshot(self, rpi: ArrayView | None, bs: int, stream: int) -> _Snap:
        """Queue the step's report on ``stream``: the report block and ``bs`` words of ``rpi`` (``None``: no
        batch) reach the host, then the ring write indexes are cleared for the next step (stream order)."""
        if rpi is not None and bs > self.b_cap:
            raise fail(RuntimeError, f"snapshot: expected bs <= {self.b_cap}, got {bs}")
        if self.report_launch is not None:
            self.order_report(stream)
            self.report_device(rpi, bs, stream)
            return self.report_host(rpi is not None, bs, stream)
        rt = self.rt
        with OnDevice(rt, self.ordinal):
            if not self._free_snaps:
                raise fail(RuntimeError, "snapshot: expected a free pinned report buffer, got none (read the "
                                         "pending reports first)")
            buf = self._free_snaps.pop()
            rt.memcpy_async(buf.ptr, self.block_ptr, self.block_bytes, D2H, stream)
            if rpi is not None:
                rt.memcpy_async(buf.ptr + self.block_bytes, rpi.ptr, 8 * bs, D2H, stream)
            rt.event_record(buf.ev, stream)
            buf.pending = True
            # Behind the copy on the same stream: the next step's rows start at 0 and this snapshot keeps these.
            rt.memset_async(self.block_ptr, 0, 8 * self.block.index_words, stream)
            self._step += 1
            self._unread += 1
            return _Snap(buf, None if rpi is None else bs, self._step - 1, stream)

    def holds_slot(self, snap) -> bool:
        return type(snap) is not _Detached

    def detach(self, snap: _Snap) -> _Detached:
        """Wait for ``snap`` (a host wait: only when every slot is unread), copy it out and free its slot."""
        self.wait(snap)
        words, rpi = self.read(snap)
        out = _Detached(np.array(words), None if rpi is None else np.array(rpi))
        self.release(snap)
        return out

    def order_report(self, stream: int) -> None:
        """Before a report launched on ``stream`` (directly or inside a graph): when the last report ran on another
        stream, make ``stream`` wait for it, so that the device numbers the reports in the order the host
        launched them (the mailbox slot of each is its number)."""
        last = self._report_stream
        if last is not None and last != stream:
            with OnDevice(self.rt, self.ordinal):
                self.rt.event_record(self._order_ev, last)
                self.rt.stream_wait_event(stream, self._order_ev)
        self._report_stream = stream

    def report_device(self, rpi: ArrayView | None, bs: int, stream: int) -> None:
        """The report kernel's launch alone (capturable; :meth:`order_report` first with the real stream);
        :meth:`report_host` must follow once per launch, in order, whether the launch ran directly or inside a
        replayed graph. ``bs`` is within the staging's batch size: the manager refused a larger batch first."""
        self.report_launch.launch(0 if rpi is None else rpi.ptr, 0 if rpi is None else bs, stream)

    def report_host(self, has_rpi: bool, bs: int, stream: int) -> _Snap:
        """The host's record of the next report kernel launch: its sequence number, hence its mailbox slot."""
        self._step += 1
        self._unread += 1
        return _Snap(None, bs if has_rpi else None, self._step - 1, stream, seq=self._step)

    def _ran(self, snap: _Snap) -> None:
        if self._done.get(snap.stream, -1) < snap.step:
            self._done[snap.stream] = snap.step

    def _slot(self, snap: _Snap) -> int:
        return (snap.seq % self.mail_slots) * self.slot_words

    def ready(self, snap: _Snap) -> bool:
        if type(snap) is _Detached:
            return True
        if snap.buf is None:
            done = int(self.mailbox.words[self._slot(snap)]) == snap.seq  # the kernel wrote this slot last
        else:
            done = snap.buf.done()
        if done:
            self._ran(snap)
        return done

    def take(self, snap) -> tuple[np.ndarray, np.ndarray | None] | None:
        """:meth:`ready` and :meth:`read` in one call (the decode's per-step path): the report's ``(words, rows)``
        if it has landed, else ``None``."""
        if type(snap) is _Snap and snap.buf is None:  # a mailbox slot
            o = (snap.seq % self.mail_slots) * self.slot_words
            mw = self.mailbox.words
            if mw.item(o) != snap.seq:
                return None
            if self._done.get(snap.stream, -1) < snap.step:
                self._done[snap.stream] = snap.step
            n = self.block.words
            words = mw[o + 1:o + 1 + n + (snap.bs or 0)]
            return words[:n], (words[n:n + snap.bs] if snap.bs is not None else None)
        return self.read(snap) if self.ready(snap) else None

    def wait(self, snap: _Snap) -> None:
        if type(snap) is _Detached:
            return
        if snap.buf is None:
            with OnDevice(self.rt, self.ordinal):
                self.rt.stream_synchronize(snap.stream)
            if not self.ready(snap):
                raise fail(RuntimeError, f"report: expected report {snap.seq} in the mailbox once its stream was "
                                         f"synchronized, got slot sequence {int(self.mailbox.words[self._slot(snap)])}"
                                         f" (a report launch lost or reordered)")
            return
        snap.buf.wait()
        self._ran(snap)

    def read(self, snap: _Snap) -> tuple[np.ndarray, np.ndarray | None]:
        """``(the block's words, the step's req_pool_indices or None)``: both pinned memory itself, valid until
        :meth:`release` (the decode reads a few words; copying the block cost more)."""
        if type(snap) is _Detached:
            return snap.words, snap.rpi
        n = self.block.words
        if snap.buf is None:
            o = self._slot(snap) + 1
            words = self.mailbox.words[o:o + n + (snap.bs or 0)]
        else:
            words = snap.buf.words
        return words[:n], (words[n:n + snap.bs] if snap.bs is not None else None)

    def release(self, snap: _Snap) -> None:
        if type(snap) is _Detached:
            return
        self._unread -= 1
        if snap.buf is not None:
            self._free_snaps.append(snap.buf)

    def close(self) -> None:
        with OnDevice(self.rt, self.ordinal):
            for b in self.stage_bufs + self.snap_bufs:
                b.wait()
                b.free()
            if self.report_launch is not None:
                self.rt.device_synchronize()  # no report kernel may still write the mailbox
                self.mailbox.free()


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
        """The scatter of :class:`CudaTransfer`'s ``upd`` staging: ``rows`` ``[U]``, ``cols`` ``[U]``, ``offsets``
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
        """A decode batch's scatter (:meth:`CudaTransfer.stage_append`): one token a batch row, row ``r``'s into
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
    arrays each."""
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
        if type(u) is RowTokens:  # one token a row: its own launches, cut by arrays
            step = min(u_cap, t_cap)
            for lo in range(0, u.rows.shape[0], step):
                k = min(step, u.rows.shape[0] - lo)
                yield (u.rows[lo:lo + k], u.cols[lo:lo + k], np.arange(k + 1, dtype=np.int64),
                       u.host_tokens()[lo:lo + k])
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
