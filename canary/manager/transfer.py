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
from ..interop.memview import host_view
from .block import ReportBlock


class HostTransfer:
    """Host arrays: every transfer is a copy done in the call."""

    def stage(self, pool: np.ndarray, updates, q_out, valid_out, q: list[int], valid: list[int], stream) -> None:
        for row, col, toks in updates:
            # int64 first: the pool keeps the low 32 bits, as the scatter stores them
            pool[row, col:col + len(toks)] = np.asarray(toks, dtype=np.int64)
        q_out[: len(q)] = q
        valid_out[: len(valid)] = valid

    def __init__(self, block: ReportBlock):
        self.block = block

    def snapshot(self, rpi: ArrayView | None, bs: int, stream) -> dict[str, np.ndarray]:
        b = self.block
        out = b.split(np.array(b.array))
        if rpi is not None:
            out["rpi"] = np.array(rpi.host[:bs])
        b.array[:b.index_words] = 0
        return out

    def ready(self, token) -> bool:
        return True

    def read(self, token) -> dict[str, np.ndarray]:
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


class _OnDevice:
    def __init__(self, ordinal: int):
        self.ordinal = ordinal

    def __enter__(self):
        rt = _rt()
        self.prev = _check(rt.cudaGetDevice(), "cudaGetDevice")
        if self.prev != self.ordinal:
            _check(rt.cudaSetDevice(self.ordinal), "cudaSetDevice")

    def __exit__(self, *exc):
        if self.prev != self.ordinal:
            _rt().cudaSetDevice(self.prev)
        return False


class _Pinned:
    """``nbytes`` of pinned host memory and an event marking the last copy that used it."""

    def __init__(self, nbytes: int):
        rt = _rt()
        self.nbytes = -(-max(int(nbytes), 64) // 8) * 8
        self.ptr = int(_check(rt.cudaMallocHost(self.nbytes), "cudaMallocHost"))
        self.event = _check(rt.cudaEventCreateWithFlags(rt.cudaEventDisableTiming), "cudaEventCreateWithFlags")
        self.pending = False
        self.words = self.array(0, (self.nbytes // 8,), np.int64)  # viewed once: a view costs ~5 us to make
        self.step, self.stream = -1, None  # the step and stream of the last copy that used it

    def array(self, offset: int, shape, dtype) -> np.ndarray:
        return host_view(self.ptr + offset, tuple(shape), _strides(shape, dtype), dtype, self)

    def done(self) -> bool:
        if not self.pending:
            return True
        rt = _rt()
        err = rt.cudaEventQuery(self.event)[0]
        if err == rt.cudaError_t.cudaSuccess:
            self.pending = False
            return True
        if err != rt.cudaError_t.cudaErrorNotReady:
            raise fail(RuntimeError, f"cudaEventQuery: expected cudaSuccess or cudaErrorNotReady, got {err}")
        return False

    def wait(self) -> None:
        if self.pending:
            _check(_rt().cudaEventSynchronize(self.event), "cudaEventSynchronize")
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


@dataclass
class _Snap:
    buf: _Pinned
    bs: int | None  # req_pool_indices copied after the block (None: not this step)
    step: int
    stream: int


class CudaTransfer:
    """Pinned buffers on CUDA device ``ordinal`` (module docstring).

    ``block``: the :class:`ReportBlock` a snapshot copies. ``staging``: the device arrays the host-to-device
    copies fill: ``qv`` ``[2 B]`` int64 (the plan's pool rows ``[0, B)`` and valid lengths ``[B, 2 B)``,
    ``B = max_batch_size``) and ``upd`` ``[3 U + 1 + T]`` int64 (a scatter's ``rows`` ``[U]``, ``cols`` ``[U]``,
    ``offsets`` ``[U + 1]`` and ``tokens`` ``[T]``, back to back). ``scatter(k, t, stream)`` launches the
    expected-token scatter of the first ``k`` rows and ``t`` tokens staged there (a :class:`DeviceScatter`).
    """

    def __init__(self, ordinal: int, *, block: ReportBlock, staging: dict[str, Any], u_cap: int, scatter,
                 depth: int = 3):
        self.ordinal = ordinal
        self.block = block
        self.scatter = scatter
        self.qv, self.upd = staging["qv"], staging["upd"]
        self.qv_ptr = as_view(self.qv, "staging.qv").ptr
        self.upd_ptr = as_view(self.upd, "staging.upd").ptr
        self.block_ptr = as_view(block.array, "report_block").ptr
        self.b_cap = int(as_view(self.qv, "qv").shape[0]) // 2
        self.u_cap = int(u_cap)
        self.t_cap = int(as_view(self.upd, "upd").shape[0]) - 3 * self.u_cap - 1
        u = self.u_cap
        self.block_bytes = 8 * block.words
        with _OnDevice(ordinal):
            stage_bytes = 8 * max(2 * self.b_cap, 3 * u + 1 + self.t_cap)
            self.stage_bufs = [_Pinned(stage_bytes) for _ in range(depth)]
            self.snap_bufs = [_Pinned(self.block_bytes + 8 * self.b_cap) for _ in range(depth + 1)]
        self._next_stage = 0
        self._free_snaps = list(self.snap_bufs)
        self._step = 0  # snapshots taken
        # stream -> the last step whose snapshot is known to have run there: everything the stream ran before it
        # has too, its staging copies included, so their buffers are free without asking the driver.
        self._done: dict[int, int] = {}

    # -- host -> device ------------------------------------------------------------------------------------------
    def _stage_buf(self) -> _Pinned:
        buf = self.stage_bufs[self._next_stage]
        self._next_stage = (self._next_stage + 1) % len(self.stage_bufs)
        if buf.pending and self._done.get(buf.stream, -1) >= buf.step:
            buf.pending = False
        buf.wait()  # the host is len(stage_bufs) steps ahead of the GPU: the only wait on this path
        return buf

    def _used(self, buf: _Pinned, stream: int) -> None:
        buf.pending, buf.step, buf.stream = True, self._step, stream

    def stage(self, pool, updates, q_out, valid_out, q: list[int], valid: list[int], stream: int) -> None:
        rt = _rt()
        h2d = rt.cudaMemcpyKind.cudaMemcpyHostToDevice
        u = self.u_cap
        with _OnDevice(self.ordinal):
            for rows, cols, offsets, tokens in _chunks(updates, self.u_cap, self.t_cap) if updates else ():
                buf = self._stage_buf()
                k, t = rows.shape[0], tokens.shape[0]
                w = buf.words
                w[:k], w[u:u + k], w[2 * u:2 * u + k + 1] = rows, cols, offsets
                w[3 * u + 1:3 * u + 1 + t] = tokens
                _check(rt.cudaMemcpyAsync(self.upd_ptr, buf.ptr, 8 * (3 * u + 1 + t), h2d, stream), "cudaMemcpyAsync")
                self.scatter(k, t, stream)
                _check(rt.cudaEventRecord(buf.event, stream), "cudaEventRecord")
                self._used(buf, stream)
            buf = self._stage_buf()
            n, b = len(q), self.b_cap
            w = buf.words
            w[:n], w[b:b + n] = q, valid
            _check(rt.cudaMemcpyAsync(self.qv_ptr, buf.ptr, 8 * (b + n), h2d, stream), "cudaMemcpyAsync")
            _check(rt.cudaEventRecord(buf.event, stream), "cudaEventRecord")
            self._used(buf, stream)

    # -- device -> host ------------------------------------------------------------------------------------------
    def snapshot(self, rpi: ArrayView | None, bs: int, stream: int) -> _Snap:
        rt = _rt()
        d2h = rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
        with _OnDevice(self.ordinal):
            if not self._free_snaps:  # every buffer holds an unread snapshot: the host is far ahead; wait
                raise fail(RuntimeError, "snapshot: expected a free pinned report buffer, got none (read the "
                                         "pending reports first)")
            buf = self._free_snaps.pop(0)
            _check(rt.cudaMemcpyAsync(buf.ptr, self.block_ptr, self.block_bytes, d2h, stream), "cudaMemcpyAsync")
            if rpi is not None:
                if bs > self.b_cap:
                    raise fail(RuntimeError, f"snapshot: expected bs <= {self.b_cap}, got {bs}")
                _check(rt.cudaMemcpyAsync(buf.ptr + self.block_bytes, rpi.ptr, 8 * bs, d2h, stream),
                       "cudaMemcpyAsync")
            _check(rt.cudaEventRecord(buf.event, stream), "cudaEventRecord")
            buf.pending = True
            # Behind the copy on the same stream: the next step's rows start at 0 and this snapshot keeps these.
            _check(rt.cudaMemsetAsync(self.block_ptr, 0, 8 * self.block.index_words, stream), "cudaMemsetAsync")
            self._step += 1
            return _Snap(buf, None if rpi is None else bs, self._step - 1, stream)

    def _ran(self, snap: _Snap) -> None:
        if self._done.get(snap.stream, -1) < snap.step:
            self._done[snap.stream] = snap.step

    def ready(self, snap: _Snap) -> bool:
        if snap.buf.done():
            self._ran(snap)
            return True
        return False

    def wait(self, snap: _Snap) -> None:
        snap.buf.wait()
        self._ran(snap)

    def read(self, snap: _Snap) -> dict[str, np.ndarray]:
        n = self.block.words
        host = np.array(snap.buf.words[:n + (snap.bs or 0)])  # one copy out of the pinned buffer it reuses
        out = self.block.split(host[:n])
        if snap.bs is not None:
            out["rpi"] = host[n:]
        return out

    def release(self, snap: _Snap) -> None:
        self._free_snaps.append(snap.buf)

    def close(self) -> None:
        with _OnDevice(self.ordinal):
            for b in self.stage_bufs + self.snap_bufs:
                b.wait()
                b.free()


class DeviceScatter:
    """The expected-token scatter of :class:`CudaTransfer`'s ``upd`` staging into the pool, on ``backend``: views
    of both checked once here (the public ``scatter_expected_tokens`` checks every argument on every call), a
    call then only sizes them (``k`` rows, ``t`` tokens) and launches."""

    def __init__(self, pool: Any, upd: Any, u_cap: int, backend: str):
        from .. import backends
        from ..interop.adapter import check_view

        pv = check_view(as_view(pool, "req_to_verify_expected_tokens"), dtype=np.int32, ndim=2, writable=True)
        uv = check_view(as_view(upd, "staging.upd"), dtype=np.int64, ndim=1)
        self.module = backends.resolve(backend, pv.device_id, family="records")
        self.pool = pv
        u = int(u_cap)
        self.parts = [uv._replace(name=name, ptr=uv.ptr + 8 * off, strides=(1,))
                      for name, off in (("rows", 0), ("cols", u), ("offsets", 2 * u), ("tokens", 3 * u + 1))]

    def __call__(self, k: int, t: int, stream: int) -> None:
        from ..backends.args import ScatterArgs

        rows, cols, offsets, tokens = self.parts
        self.module.scatter(ScatterArgs(self.pool, rows._replace(shape=(k,)), tokens._replace(shape=(t,)),
                                        offsets._replace(shape=(k + 1,)), cols._replace(shape=(k,)), 0), stream)


def _chunks(updates, u_cap: int, t_cap: int):
    """Split ``(row, col, tokens)`` updates (tokens: an int64 array or a list of ints) into scatter launches of at
    most ``u_cap`` rows and ``t_cap`` tokens: ``(rows, cols, offsets, tokens)`` int64 arrays each."""
    rows, cols, lens, toks, n = [], [], [], [], 0

    def emit():
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        if all(type(t) is list for t in toks):  # a decode step: one token or a few per request
            flat = np.array(list(chain.from_iterable(toks)), dtype=np.int64)
        else:
            flat = np.concatenate([np.asarray(t, dtype=np.int64) for t in toks])
        return np.array(rows, dtype=np.int64), np.array(cols, dtype=np.int64), offsets, flat

    for row, col, t in updates:
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
