"""Device -> host: the step's report (the :class:`~canary.manager.block.ReportBlock`, then the step's
``req_pool_indices``) brought to the host without syncing the engine's stream (canary/manager/transfer.py).

:class:`HostMailbox` (host arrays): a copy in the call. :class:`CudaMailbox`: pinned report slots, filled by copies,
a memset and an event per report, or by the report kernel (``kernels/report.cu``, the CuPy backend) writing each
report into the next slot of a pinned mailbox and publishing it by its sequence number, which the host polls.
Either way a report is ``snapshot`` (queued), then ``take`` / ``read`` (its words, pinned memory itself), then
``release`` (its slot free again).

:attr:`CudaMailbox.done` and :attr:`CudaMailbox.reports` are what the staging (:mod:`.staging`) knows of the
stream's progress: a report known to have run tells that everything its stream ran before it has too.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import fail
from ..interop.adapter import ArrayView, as_view
from ..interop.cudart import D2H, OnDevice, runtime
from .block import ReportBlock
from .transfer import Pinned


class HostMailbox:
    """Host arrays: a report is a copy made in the call."""

    report_launch = None

    def __init__(self, block: ReportBlock):
        self.block = block

    def full(self) -> bool:
        return False

    def order_report(self, stream) -> None:
        pass

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

    def close(self) -> None:
        pass


@dataclass
class _Detached:
    """A report copied out of its pinned slot (:meth:`CudaMailbox.detach`), waiting for the manager's decode."""
    words: np.ndarray
    rpi: np.ndarray | None


class _Snap:
    """One queued report (a slotted class: one is made every step). ``buf``: the copy's buffer (``None``: a mailbox
    slot written by the report kernel); ``bs``: req_pool_indices words after the block (``None``: not this step);
    ``step``, ``stream``; ``seq``: the report kernel's sequence number (mailbox slot ``seq % slots``)."""

    __slots__ = ("buf", "bs", "step", "stream", "seq")

    def __init__(self, buf: Pinned | None, bs: int | None, step: int, stream: int, seq: int = 0):
        self.buf, self.bs, self.step, self.stream, self.seq = buf, bs, step, stream, seq


class CudaMailbox:
    """Pinned report slots on CUDA device ``ordinal`` (module docstring).

    ``block``: the :class:`ReportBlock` a report carries; ``b_cap``: the largest batch (``req_pool_indices`` words
    after the block). ``report_kernel``: ``(counter, make)`` to report through ``kernels/report.cu``: ``counter``
    a zeroed ``[1]`` int64 device array, ``make(**layout)`` its launcher (the ``report`` family's
    ``ReportLaunch``). The kernel writes each report into the next slot of a pinned mailbox and publishes it by its
    sequence number, which the host polls: no copy, memset or event per step, and a launch that an eager step's
    CUDA graph can hold (:meth:`report_device`). ``None``: copies, a memset and an event per report (any backend).
    """

    def __init__(self, ordinal: int, *, block: ReportBlock, b_cap: int, report_kernel=None, depth: int = 3):
        self.ordinal = ordinal
        self.block = block
        self.block_ptr = as_view(block.array, "report_block").ptr
        self.b_cap = int(b_cap)
        self.block_bytes = 8 * block.words
        self.rt = runtime()
        with OnDevice(self.rt, ordinal):
            self.snap_bufs = [Pinned(self.block_bytes + 8 * self.b_cap) for _ in range(depth + 1)]
        self._free_snaps = list(self.snap_bufs)
        self.reports = 0  # reports queued (the next one's step number)
        self._unread = 0  # reports queued and not released
        self.report_launch = None
        if report_kernel is not None:
            counter, make = report_kernel
            self.slot_words = 1 + block.words + self.b_cap
            self.mail_slots = 2 * (depth + 1)
            with OnDevice(self.rt, ordinal):
                self.mailbox = Pinned(8 * self.mail_slots * self.slot_words)
            self.mailbox.words[:] = 0  # no slot published yet (sequence numbers start at 1)
            self._order_ev = self.mailbox.ev  # marks the last report's stream position when the stream changes
            self.report_launch = make(block_ptr=self.block_ptr, words=block.words, index_words=block.index_words,
                                      mailbox_ptr=self.mailbox.ptr, slot_words=self.slot_words,
                                      slots=self.mail_slots,
                                      counter_ptr=as_view(counter, "report_counter").ptr)
            self._counter = counter  # kept alive: the launch holds its pointer
        self._report_stream = None
        # stream -> the last step whose report is known to have run there: everything the stream ran before it
        # has too, the staging's copies included, so their buffers are free without asking the driver.
        self.done: dict[int, int] = {}

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
            self.reports += 1
            self._unread += 1
            return _Snap(buf, None if rpi is None else bs, self.reports - 1, stream)

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
        self.reports += 1
        self._unread += 1
        return _Snap(None, bs if has_rpi else None, self.reports - 1, stream, seq=self.reports)

    def _ran(self, snap: _Snap) -> None:
        if self.done.get(snap.stream, -1) < snap.step:
            self.done[snap.stream] = snap.step

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
            if self.done.get(snap.stream, -1) < snap.step:
                self.done[snap.stream] = snap.step
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
            for b in self.snap_bufs:
                b.wait()
                b.free()
            if self.report_launch is not None:
                self.rt.device_synchronize()  # no report kernel may still write the mailbox
                self.mailbox.free()
