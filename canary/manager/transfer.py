"""Moving the manager's small per-step data between host and device without syncing the engine's stream: the
ground both directions stand on (pinned host memory, the CUDA runtime) and the pair a manager holds.

Host arrays (the reference backend and Numba's simulator): plain reads and writes, done in the call. CUDA arrays
of any library: pinned host memory and the CUDA runtime (``cuda.bindings``, which the GPU backends already need),
so it works the same for torch, CuPy and Numba arrays. Every runtime call costs the host a driver round trip, so
each direction is one copy per step:

- host -> device (:mod:`.staging`: pool rows and valid lengths of the step, one buffer; queued expected tokens,
  one buffer per scatter launch): staged in one of a few pinned buffers, copied asynchronously on the engine's
  stream; an event per buffer says when it may be refilled.
- device -> host (:mod:`.mailbox`: the :class:`~canary.manager.block.ReportBlock`: every group's ring, write
  index, counters and plan status; then the step's ``req_pool_indices``): after the step's writes, copied on the
  engine's stream into pinned memory, then the ring write indexes cleared by one memset behind the copy (stream
  order, not a host sync), so every snapshot holds exactly one step's rows. The host reads a snapshot once its
  event has completed (``cudaEventQuery``: never blocks).

The only host waits: reusing a pinned buffer whose previous copy has not run yet (the host is ``depth`` steps
ahead of the GPU), and the mailbox's ``wait`` (``manager.flush()``, a deliberate sync).
"""
from __future__ import annotations

import numpy as np

from ..errors import fail
from ..interop.cudart import runtime
from ..interop.memview import host_view


def _rt():
    try:
        from cuda.bindings import runtime
    except ImportError as exc:  # pragma: no cover - the GPU backends need cuda-core, which brings it
        raise fail(ImportError, "device: the manager's device transfers need cuda.bindings: pip install "
                                "'cuda-core[cu13]' (or, in the checkout, pip install '.[cuda13]')") from exc
    return runtime


def _check(result, what: str):
    rt = _rt()
    err = result[0] if isinstance(result, tuple) else result
    if err != rt.cudaError_t.cudaSuccess:
        raise fail(RuntimeError, f"{what}: expected cudaSuccess, got {err}")
    if isinstance(result, tuple):
        return result[1] if len(result) == 2 else result[1:]
    return None


class Pinned:
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
        self.evented = True  # the event marks that use (else only the step's report does: CudaStaging._stage_buf)

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


class Event:
    """One CUDA event without timing (``ev``: the handle the per-step runtime calls take)."""

    def __init__(self):
        rt = _rt()
        self.event = _check(rt.cudaEventCreateWithFlags(rt.cudaEventDisableTiming), "cudaEventCreateWithFlags")
        self.ev = runtime().event_handle(self.event)

    def free(self) -> None:
        _rt().cudaEventDestroy(self.event)


def _strides(shape, dtype) -> tuple[int, ...]:
    out, acc = [], np.dtype(dtype).itemsize
    for n in reversed(shape):
        out.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(out))


class Transfer:
    """Both directions of one manager: ``staging`` (host -> device, :mod:`.staging`) and ``mailbox`` (device ->
    host, :mod:`.mailbox`), two objects with their own state. The manager's rooms call each directly (no layer
    on the per-step path); this pair is the one handle on the transfer as a whole: :meth:`close`, and what looks
    at either side by attribute (tests, benchmarks): a name read or set here is that of the side that has it
    (the staging's first), so that a replaced attribute is the one the rooms call."""

    __slots__ = ("staging", "mailbox")

    def __init__(self, staging, mailbox):
        object.__setattr__(self, "staging", staging)
        object.__setattr__(self, "mailbox", mailbox)

    def __getattr__(self, name: str):
        for side in (self.staging, self.mailbox):
            if hasattr(side, name):
                return getattr(side, name)
        raise AttributeError(f"kv-canary: transfer: expected an attribute of the staging or the mailbox, got {name!r}")

    def __setattr__(self, name: str, value) -> None:
        for side in (self.staging, self.mailbox):
            if hasattr(side, name):
                setattr(side, name, value)
                return
        raise AttributeError(f"kv-canary: transfer: expected an attribute of the staging or the mailbox, got {name!r}")

    def close(self) -> None:
        """Free the pinned buffers of both sides (host arrays: nothing to free)."""
        self.staging.close()
        self.mailbox.close()


def open_transfer(ordinal: int | None, *, block, pool, qv, q, valid, upd, u_cap: int, backend: str, empty) -> Transfer:
    """The transfer of a manager on CUDA device ``ordinal`` (``None``: host arrays, plain copies): ``block`` its
    report block, ``pool`` its expected-token pool, ``qv`` (``q``, ``valid``: its halves) and ``upd`` its staging
    area (``u_cap`` scatter rows; :class:`~canary.manager.staging.CudaStaging`), ``empty`` its allocator. What the
    backend offers is asked of the registry: its ``report`` family (the report kernel, else copies) and its
    records' ``prepare_append`` (the decode batch's append on the device, else the append scatter)."""
    # Imported here: both sides import this module's Pinned
    from .. import backends
    from ..interop.adapter import as_view
    from .mailbox import CudaMailbox, HostMailbox
    from .staging import CudaStaging, DeviceScatter, HostStaging, append_scatter

    if ordinal is None:
        return Transfer(HostStaging(), HostMailbox(block))
    report = None
    kernel = backends.optional(backend, "report")  # the report written by a kernel (kernels/report.cu); else copies
    if kernel is not None:
        report = (empty(1, np.int64), lambda **layout: kernel.ReportLaunch(ordinal, **layout))
    device_append = None
    prepare = getattr(backends.load(backend, "records"), "prepare_append", None)
    if prepare is not None:  # device token ids appended on the device (kernels/records.cu)
        device_append = prepare(as_view(pool, "pool"), as_view(q, "staging.q"), as_view(valid, "staging.valid"))
    scatter = DeviceScatter.over(pool, upd, u_cap, backend)
    append = None if device_append else append_scatter(empty, pool, qv, upd, ordinal, backend)
    mailbox = CudaMailbox(ordinal, block=block, b_cap=int(as_view(qv, "qv").shape[0]) // 2, report_kernel=report)
    accept = None
    if device_append:  # device token ids stay on the device: copied at the accept into the manager's ring
        from .accepted import ACCEPT_SLOTS, AcceptRing

        b = int(as_view(qv, "qv").shape[0]) // 2
        accept = AcceptRing(ordinal, empty(ACCEPT_SLOTS * b, np.int64), b)
    staging = CudaStaging(ordinal, staging={"qv": qv, "upd": upd}, u_cap=u_cap, scatter=scatter, progress=mailbox,
                          append=append, device_append=device_append, accept_ring=accept)
    return Transfer(staging, mailbox)
