"""Moving the manager's small per-step data between host and device without syncing the engine's stream.

:class:`HostTransfer` (host arrays, the reference backend and Numba's simulator): plain reads and writes, done
in the call. :class:`CudaTransfer` (CUDA arrays of any library): pinned host memory and the CUDA runtime
(``cuda.bindings``, which the GPU backends already need), so it works the same for torch, CuPy and Numba arrays:

- host -> device (expected tokens, pool rows and valid lengths of the step): staged in one of a few pinned
  buffers, copied asynchronously on the engine's stream; an event per buffer says when it may be refilled.
- device -> host (violation ring, counters, plan status, the step's batch inputs): after the step's writes, a
  side stream waits for the engine's stream and copies into pinned memory; the engine's stream then waits for
  that copy (a device-side dependency, not a host sync) before clearing the ring's write index, so every
  snapshot holds exactly one step's rows. The host reads a snapshot once its event has completed
  (``cudaEventQuery``: never blocks).

The only host waits: reusing a pinned buffer whose previous copy has not run yet (the host is ``depth`` steps
ahead of the GPU), and :meth:`CudaTransfer.wait` (``manager.flush()``, a deliberate sync).
"""
from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ..errors import fail
from ..interop.adapter import as_view
from ..interop.memview import host_view


@dataclass
class Piece:
    """One array to snapshot: ``name``, its view's pointer, shape and dtype (device) or the array (host)."""

    name: str
    array: Any
    shape: tuple[int, ...]
    dtype: np.dtype
    ptr: int = 0
    nbytes: int = 0  # computed once by piece(): the per-step snapshot only reads it


def piece(array: Any, name: str, length: int | None = None) -> Piece:
    v = as_view(array, name)
    shape = tuple(v.shape if length is None else (length,) + tuple(v.shape[1:]))
    dtype = np.dtype(v.dtype)
    return Piece(name, array, shape, dtype, v.ptr, math.prod(shape) * dtype.itemsize)


class HostTransfer:
    """Host arrays: every transfer is a copy done in the call."""

    def stage(self, pool: np.ndarray, updates, q_out, valid_out, q: np.ndarray, valid: np.ndarray, stream) -> None:
        for row, col, toks in updates:
            pool[row, col:col + toks.shape[0]] = toks  # the low 32 bits, as the scatter stores them
        q_out[: q.shape[0]] = q
        valid_out[: valid.shape[0]] = valid

    def snapshot(self, pieces: Sequence[Piece], resets: Sequence[Any], stream) -> dict[str, np.ndarray]:
        out = {p.name: np.array(as_view(p.array, p.name).host[: p.shape[0]]) for p in pieces}
        for index in resets:
            index[0] = 0
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
        self.nbytes = max(int(nbytes), 64)
        self.ptr = int(_check(rt.cudaMallocHost(self.nbytes), "cudaMallocHost"))
        self.event = _check(rt.cudaEventCreateWithFlags(rt.cudaEventDisableTiming), "cudaEventCreateWithFlags")
        self.pending = False

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
    layout: list[tuple[str, int, tuple[int, ...], np.dtype]]


class CudaTransfer:
    """Pinned buffers and a side stream on CUDA device ``ordinal`` (module docstring).

    ``staging``: the device arrays the host-to-device copies fill: ``rows``, ``cols`` ``[U]``, ``offsets``
    ``[U + 1]``, ``tokens`` ``[T]`` int64 (expected-token updates, scattered by ``scatter``), and the plan inputs
    ``q``, ``valid`` ``[max_batch_size]`` int64. ``scatter(rows, tokens, offsets, cols, stream)`` launches the
    expected-token scatter on slices of them.
    """

    def __init__(self, ordinal: int, *, staging: dict[str, Any], snapshot_bytes: int, scatter, depth: int = 3):
        rt = _rt()
        self.ordinal = ordinal
        self.scatter = scatter
        self.dev = staging
        self.ptrs = {k: as_view(v, f"staging.{k}").ptr for k, v in staging.items()}
        self.u_cap = int(as_view(staging["rows"], "rows").shape[0])
        self.t_cap = int(as_view(staging["tokens"], "tokens").shape[0])
        self.b_cap = int(as_view(staging["q"], "q").shape[0])
        with _OnDevice(ordinal):
            self.side = _check(rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking), "cudaStreamCreateWithFlags")
            self.step_done = _check(rt.cudaEventCreateWithFlags(rt.cudaEventDisableTiming), "cudaEventCreate")
            stage_bytes = 8 * (2 * self.b_cap + 3 * self.u_cap + 1 + self.t_cap)
            self.stage_bufs = [_Pinned(stage_bytes) for _ in range(depth)]
            self.snap_bufs = [_Pinned(snapshot_bytes) for _ in range(depth + 1)]
        self._next_stage = 0
        self._free_snaps = list(self.snap_bufs)

    # -- host -> device ------------------------------------------------------------------------------------------
    def _stage_buf(self) -> _Pinned:
        buf = self.stage_bufs[self._next_stage]
        self._next_stage = (self._next_stage + 1) % len(self.stage_bufs)
        buf.wait()  # the host is len(stage_bufs) steps ahead of the GPU: the only wait on this path
        return buf

    def _h2d(self, buf: _Pinned, host: np.ndarray, dst: str, stream: int) -> None:
        rt = _rt()
        src = host.__array_interface__["data"][0]
        _check(rt.cudaMemcpyAsync(self.ptrs[dst], src, host.nbytes, rt.cudaMemcpyKind.cudaMemcpyHostToDevice,
                                  stream), "cudaMemcpyAsync")

    def stage(self, pool, updates, q_out, valid_out, q: np.ndarray, valid: np.ndarray, stream: int) -> None:
        rt = _rt()
        with _OnDevice(self.ordinal):
            chunks = _chunks(updates, self.u_cap, self.t_cap)
            for rows, cols, offsets, tokens in chunks:
                buf = self._stage_buf()
                u, t = rows.shape[0], tokens.shape[0]
                parts = [("rows", rows), ("cols", cols), ("offsets", offsets), ("tokens", tokens)]
                off = 0
                for name, host in parts:
                    view = buf.array(off, host.shape, np.int64)
                    view[:] = host
                    self._h2d(buf, view, name, stream)
                    off += host.nbytes
                self.scatter(self.dev["rows"][:u], self.dev["tokens"][:t], self.dev["offsets"][:u + 1],
                             self.dev["cols"][:u], stream)
                _check(rt.cudaEventRecord(buf.event, stream), "cudaEventRecord")
                buf.pending = True
            buf = self._stage_buf()
            n = q.shape[0]
            qv, vv = buf.array(0, (n,), np.int64), buf.array(8 * n, (n,), np.int64)
            qv[:], vv[:] = q, valid
            self._h2d(buf, qv, "q", stream)
            self._h2d(buf, vv, "valid", stream)
            _check(rt.cudaEventRecord(buf.event, stream), "cudaEventRecord")
            buf.pending = True

    # -- device -> host ------------------------------------------------------------------------------------------
    def snapshot(self, pieces: Sequence[Piece], resets: Sequence[Any], stream: int) -> _Snap:
        rt = _rt()
        with _OnDevice(self.ordinal):
            if not self._free_snaps:  # every buffer holds an unread snapshot: the host is far ahead; wait
                raise fail(RuntimeError, "snapshot: expected a free pinned report buffer, got none (read the "
                                         "pending reports first)")
            buf = self._free_snaps.pop(0)
            _check(rt.cudaEventRecord(self.step_done, stream), "cudaEventRecord")
            _check(rt.cudaStreamWaitEvent(self.side, self.step_done, 0), "cudaStreamWaitEvent")
            layout, off = [], 0
            for p in pieces:
                off = -(-off // 8) * 8
                _check(rt.cudaMemcpyAsync(buf.ptr + off, p.ptr, p.nbytes, rt.cudaMemcpyKind.cudaMemcpyDeviceToHost,
                                          self.side), "cudaMemcpyAsync")
                layout.append((p.name, off, p.shape, p.dtype))
                off += p.nbytes
            if off > buf.nbytes:
                raise fail(RuntimeError, f"snapshot: expected at most {buf.nbytes} bytes, got {off}")
            _check(rt.cudaEventRecord(buf.event, self.side), "cudaEventRecord")
            buf.pending = True
            _check(rt.cudaStreamWaitEvent(stream, buf.event, 0), "cudaStreamWaitEvent")
            for index in resets:
                _check(rt.cudaMemsetAsync(as_view(index, "ring_write_index").ptr, 0, 4, stream), "cudaMemsetAsync")
            return _Snap(buf, layout)

    def ready(self, snap: _Snap) -> bool:
        return snap.buf.done()

    def wait(self, snap: _Snap) -> None:
        snap.buf.wait()

    def read(self, snap: _Snap) -> dict[str, np.ndarray]:
        return {name: np.array(snap.buf.array(off, shape, dtype)) for name, off, shape, dtype in snap.layout}

    def release(self, snap: _Snap) -> None:
        self._free_snaps.append(snap.buf)

    def close(self) -> None:
        rt = _rt()
        with _OnDevice(self.ordinal):
            rt.cudaStreamSynchronize(self.side)
            for b in self.stage_bufs + self.snap_bufs:
                b.wait()
                b.free()
            rt.cudaEventDestroy(self.step_done)
            rt.cudaStreamDestroy(self.side)


def _chunks(updates, u_cap: int, t_cap: int):
    """Split ``(row, col, tokens)`` updates into scatter launches of at most ``u_cap`` rows, ``t_cap`` tokens."""
    rows, cols, toks, n = [], [], [], 0

    def emit():
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum([t.shape[0] for t in toks], out=offsets[1:])
        return (np.asarray(rows, dtype=np.int64), np.asarray(cols, dtype=np.int64), offsets,
                np.concatenate(toks).astype(np.int64))

    for row, col, t in updates:
        for lo in range(0, t.shape[0], t_cap):  # a prompt longer than the staging area: several pieces
            part = t[lo:lo + t_cap]
            if len(rows) == u_cap or n + part.shape[0] > t_cap:
                yield emit()
                rows, cols, toks, n = [], [], [], 0
            rows.append(row)
            cols.append(col + lo)
            toks.append(part)
            n += part.shape[0]
    if rows:
        yield emit()
