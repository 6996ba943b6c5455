"""The communicators a distributed manager agrees over (docs/integration.md "Distributed", SPEC 4.3).

One small protocol, :class:`Communicator`: a rank, a size and one host-level collective, an all-reduce of a
``[n]`` int64 NumPy array. The manager's per-step agreement needs nothing else (its rare all-gather is a sum
of one-row-per-rank arrays). Adapters for the communicators engines already run:

- :class:`TorchDistributedCommunicator`: a ``torch.distributed`` process group, gloo (host tensors: the
  cheapest; engines keep one beside their NCCL group, e.g. a ``cpu_group``) or NCCL (a device tensor on a side
  stream, read back: a wait for the group's earlier collectives on the GPU).
- :class:`CupyNcclCommunicator`: CuPy's ``cupy.cuda.nccl.NcclCommunicator`` (torch-free engines).
- :class:`LocalCommunicator`: one rank (the identity), for a single-process manager and tests.

torch and CuPy are imported by the adapter that needs them, when it is built: ``import canary`` imports neither.
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..errors import fail

OPS = ("max", "min", "sum")


@runtime_checkable
class Communicator(Protocol):
    """What the manager's agreement calls: ``rank`` (this process's rank in the group, ``0 <= rank < size``),
    ``size`` (the group's ranks) and :meth:`all_reduce`. Every rank of the group calls :meth:`all_reduce` with
    arrays of the same length in the same order (a collective); it returns when every rank's array is in."""

    rank: int
    size: int

    def all_reduce(self, words: np.ndarray, op: str) -> np.ndarray:
        """``words``: ``[n]`` int64 host array (not modified); ``op``: ``"max"``, ``"min"`` or ``"sum"`` (sum
        wraps mod 2^64). Returns a new ``[n]`` int64 host array, the same on every rank."""
        ...


def check_words(words: Any, op: str) -> np.ndarray:
    """``words`` as a contiguous ``[n]`` int64 NumPy array; ``ValueError`` / ``TypeError`` otherwise."""
    if op not in OPS:
        raise fail(ValueError, f"op: expected one of {OPS}, got {op!r}")
    if not isinstance(words, np.ndarray) or words.dtype != np.int64 or words.ndim != 1:
        raise fail(TypeError, f"words: expected a [n] int64 NumPy array, got "
                              f"{getattr(words, 'dtype', type(words).__name__)} {getattr(words, 'shape', '')}")
    return np.ascontiguousarray(words)


class LocalCommunicator:
    """One rank: :meth:`all_reduce` returns a copy (what a group of one agrees on)."""

    rank, size = 0, 1

    def all_reduce(self, words: np.ndarray, op: str) -> np.ndarray:
        return check_words(words, op).copy()


class TorchDistributedCommunicator:
    """A ``torch.distributed`` process group (``group``: ``None`` for the default group).

    A gloo group reduces host tensors (no device work at all). An NCCL group reduces a device tensor on
    ``device`` (default: ``torch.cuda.current_device()``), copied there and back on a side stream of the
    adapter's own, so that the engine's stream is never waited for; NCCL orders the group's collectives on its
    own stream, though, so the read back waits for the group's collectives issued before (the engine's last
    ones): pass the engine's gloo group where there is one. Raises ``ImportError`` (how to install) without
    torch, ``ValueError`` when ``torch.distributed`` is not initialized."""

    def __init__(self, group: Any = None, *, device: Any = None):
        try:
            import torch
            import torch.distributed as dist
        except ImportError as exc:
            raise fail(ImportError, "communicator: expected torch for a TorchDistributedCommunicator: pip install "
                                    "torch") from exc
        if not dist.is_available() or not dist.is_initialized():
            raise fail(ValueError, "group: expected an initialized torch.distributed (init_process_group), got "
                                   "none")
        self._torch, self._dist, self.group = torch, dist, group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.backend = str(dist.get_backend(group)).lower()
        self._ops = {"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "sum": dist.ReduceOp.SUM}
        self._device, self._stream = None, None
        if self.backend == "nccl":  # pragma: no cover - needs GPUs (tests/manager/test_manager_ranks.py, gpu)
            self._device = torch.device("cuda", torch.cuda.current_device() if device is None else device)
            self._stream = torch.cuda.Stream(self._device)

    def all_reduce(self, words: np.ndarray, op: str) -> np.ndarray:
        words = check_words(words, op)
        torch = self._torch
        if self._stream is None:
            t = torch.from_numpy(words.copy())
            self._dist.all_reduce(t, op=self._ops[op], group=self.group)
            return t.numpy()
        with torch.cuda.stream(self._stream):  # pragma: no cover - needs GPUs
            t = torch.from_numpy(words).to(self._device, non_blocking=False)
            self._dist.all_reduce(t, op=self._ops[op], group=self.group)
            out = t.cpu().numpy()
        return out


class CupyNcclCommunicator:
    """CuPy's NCCL communicator: ``comm`` a ``cupy.cuda.nccl.NcclCommunicator`` of ``size`` ranks (this one
    ``comm.rank_id()``), reduced on ``stream`` (default: a non-blocking stream of the adapter's own on the
    current device; pass a communicator the engine's own collectives do not use, or the engine's stream, since
    NCCL needs one order of a communicator's collectives on every rank). Each call copies the words to the
    device, reduces them and copies them back (a sync of that stream only). Raises ``ImportError`` (how to
    install) without CuPy."""

    def __init__(self, comm: Any, *, stream: Any = None):  # pragma: no cover - needs GPUs
        try:
            import cupy
            from cupy.cuda import nccl
        except ImportError as exc:
            raise fail(ImportError, "communicator: expected CuPy with NCCL for a CupyNcclCommunicator: pip install "
                                    "cupy-cuda12x (NCCL comes with it: python -m cupyx.tools.install_library "
                                    "--library nccl --cuda 12.x)") from exc
        self._cupy, self._nccl, self.comm = cupy, nccl, comm
        self.rank, self.size = int(comm.rank_id()), int(comm.size())
        self.stream = cupy.cuda.Stream(non_blocking=True) if stream is None else stream
        self._ops = {"max": nccl.NCCL_MAX, "min": nccl.NCCL_MIN, "sum": nccl.NCCL_SUM}

    def all_reduce(self, words: np.ndarray, op: str) -> np.ndarray:  # pragma: no cover - needs GPUs
        words = check_words(words, op)
        cupy = self._cupy
        with self.stream:
            buf = cupy.asarray(words)
            self.comm.allReduce(buf.data.ptr, buf.data.ptr, words.shape[0], self._nccl.NCCL_INT64, self._ops[op],
                                self.stream.ptr)
            out = cupy.asnumpy(buf, stream=self.stream)
        self.stream.synchronize()
        return out
