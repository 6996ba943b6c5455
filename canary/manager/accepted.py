"""Device token ids copied at the accept (``accept_tokens_batch`` with a device array; issue 26 item 3).

The rule: the manager copies a device ``token_ids`` array, on the accepting stream (``accept_tokens_batch``'s
``stream``, default: the current stream of the array's library), into a slot of its own device ring at the
accept, and the next step reads that slot, never the engine's array. An engine may therefore reuse, zero or
refill its sampled-id buffer right after the accept (transformers' continuous batching does, before the next
forward): the trap of a zero-copy read at the next step (false ``VERIFY_TOKEN`` from tokens overwritten
meanwhile) cannot happen.

The ring: ``ACCEPT_SLOTS`` slots of ``max_batch_size`` int64 words, allocated with the manager (no allocation per
call, so an accept is graph-safe and a step's graph holds a slot's fixed address: one graph per slot, as for the
pinned staging buffers). Each accept takes the next slot, so several accepts before one step keep their tokens.
A slot is held from its accept until the step's read of it is launched (:meth:`AcceptRing.release`); an accept
that finds its slot still held (``ACCEPT_SLOTS`` accepts queued without a step) first reads that slot's tokens
to the host (a sync, off the decode path: the update then goes through the host scatter).

Streams: a step on another stream than the accept's waits for the copy's event (outside a capture: inside one,
an event of uncaptured work cannot be waited for, so an engine capturing its own graphs accepts on the step's
stream); an accept on another stream than the last read of its slot waits for that read's event.
"""
from __future__ import annotations

import numpy as np

from ..interop.adapter import ArrayView, as_view
from ..interop.cudart import D2D, D2H, OnDevice, runtime

ACCEPT_SLOTS = 4


class HeldTokens:
    """One ring slot: ``ptr`` (``b_cap`` int64 words), the update holding it (``None``: free), the held tokens'
    count and dtype, and the streams and events of its last copy and read."""

    __slots__ = ("ring", "index", "ptr", "update", "n", "dtype", "copy_stream", "read_stream", "copy_ev", "read_ev")

    def __init__(self, ring: "AcceptRing", index: int, ptr: int):
        from .transfer import Event

        self.ring, self.index, self.ptr = ring, index, ptr
        self.update = None
        self.n, self.dtype = 0, np.dtype(np.int64)
        self.copy_stream = self.read_stream = None
        self.copy_ev, self.read_ev = Event(), Event()

    def read_host(self) -> np.ndarray:
        """The held tokens as ``[n]`` int64 on the host (a sync on the copy's stream)."""
        rt, out = self.ring.rt, np.empty(self.n, self.dtype)
        with OnDevice(rt, self.ring.ordinal):
            if self.n:
                rt.memcpy_async(out.ctypes.data, self.ptr, out.nbytes, D2H, self.copy_stream)
            rt.stream_synchronize(self.copy_stream)
        return out.astype(np.int64)


class AcceptRing:
    """The ring over ``ring`` (a device array of ``ACCEPT_SLOTS * b_cap`` int64 on CUDA device ``ordinal``)."""

    def __init__(self, ordinal: int, ring, b_cap: int):
        self.ordinal, self.ring, self.b_cap = ordinal, ring, int(b_cap)
        self.rt = runtime()
        base = as_view(ring, "accept_ring").ptr
        with OnDevice(self.rt, ordinal):
            self.slots = [HeldTokens(self, i, base + 8 * self.b_cap * i) for i in range(ACCEPT_SLOTS)]
        self._next = 0

    def hold(self, view: ArrayView, stream: int, update) -> tuple[ArrayView, HeldTokens]:
        """Copy ``view`` (``[n]`` int32 or int64 device token ids, ``n <= b_cap``) into the next slot on ``stream``;
        ``update`` (the :class:`~canary.manager.pool.RowTokens` of the accept) holds it. Returns ``(the slot's view
        in the tokens' dtype, the slot)``: the update's ``device``."""
        held = self.slots[self._next]
        self._next = (self._next + 1) % ACCEPT_SLOTS
        rt = self.rt
        last = held.update
        if last is not None and last.tokens is None and last.device is not None and last.device[1] is held:
            last.tokens = held.read_host()  # still unread: its tokens to the host first (module docstring)
            last.device = None
        n = int(view.shape[0])
        with OnDevice(rt, self.ordinal):
            if held.read_stream is not None and held.read_stream != stream and not rt.is_capturing(stream):
                rt.stream_wait_event(stream, held.read_ev.ev)
            if n:
                rt.memcpy_async(held.ptr, view.ptr, n * view.dtype.itemsize, D2D, stream)
            rt.event_record(held.copy_ev.ev, stream)
        held.update, held.n, held.dtype, held.copy_stream = update, n, view.dtype, stream
        return view._replace(name="token_ids (the manager's copy)", ptr=held.ptr, strides=(1,), owner=self.ring,
                             readonly=True), held

    def before_read(self, held: HeldTokens, stream: int) -> None:
        """Order the step's read of ``held`` on ``stream`` behind its copy (another stream, outside a capture)."""
        if held.copy_stream is not None and held.copy_stream != stream and not self.rt.is_capturing(stream):
            with OnDevice(self.rt, self.ordinal):
                self.rt.stream_wait_event(stream, held.copy_ev.ev)

    def release(self, held: HeldTokens, stream: int) -> None:
        """The step's read of ``held`` is launched on ``stream``: the slot is free for the next accept after it."""
        with OnDevice(self.rt, self.ordinal):
            self.rt.event_record(held.read_ev.ev, stream)
        held.update, held.read_stream = None, stream

    def close(self) -> None:
        for held in self.slots:
            held.copy_ev.free()
            held.read_ev.free()
