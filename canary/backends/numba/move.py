"""Numba backend of records that move: ``canary_gather_rows`` / ``canary_scatter_rows`` of
``kernels/records_move_numba.py`` (the twin of ``kernels/records_move.cu``).

``bind`` compiles the kernels (once per process and block size) and builds the word views of the records, the
layer table and the status word, zero-copy and without syncing; a call wraps the list and the buffer (cached by
pointer on a GPU) and launches on the caller's stream, as :mod:`.records` does. Under the CUDA simulator the
"device" is host memory and the blocks are small.
"""
from __future__ import annotations

import numpy as np

from ...contract.move_layout import STATUS_WORDS, move_grid
from ..args import DEFAULT_LAUNCH, LaunchConfig, MoveArgs, MoveTables
from ..sources import numba_kernels
from . import ON_DEVICE as _ON_DEVICE
from . import SIMULATOR, cuda
from .records import BLOCKS_PER_SM, SIMULATOR_SMS, SIMULATOR_THREADS, Arrays, launch_kernel, load_kernels

NAME = "numba"
ON_DEVICE = _ON_DEVICE

records_move_numba = numba_kernels("records_move_numba")
_CACHE_SIZE = 64


def _threads(launch: LaunchConfig) -> int:
    if SIMULATOR and launch.simulator_threads != "gpu":
        return launch.simulator_threads or SIMULATOR_THREADS
    return records_move_numba.MOVE_THREADS


class Bound:
    def __init__(self, tables: MoveTables, launch: LaunchConfig = DEFAULT_LAUNCH):
        self.tables = t = tables
        self.threads = _threads(launch)
        self._arr = arr = Arrays(t.device_id)
        buf = t.canary_buffer
        # Only the four fields of each slot are touched: the last slot needs 32 bytes, not a full stride.
        canary_words = ((t.num_slots - 1) * t.slot_stride_bytes + 32) // 8
        h, st = t.layer_hashes, t.status
        self._fixed = (
            arr.words(buf.ptr, canary_words, np.uint64, buf.owner, buf.host), t.num_slots, t.slot_stride_bytes // 8,
            arr.dummy(np.uint64) if h is None else arr.words(h.ptr, t.num_slots * t.num_layers, np.uint64, h.owner,
                                                             h.host),
            t.num_layers,
        )
        self._status = arr.words(st.ptr, STATUS_WORDS, np.uint64, st.owner, st.host)
        self._kernels = records_move_numba.move_kernels(self.threads)
        self._sms = SIMULATOR_SMS if SIMULATOR else int(arr.gpu.MULTIPROCESSOR_COUNT)
        self._rows: dict = {}

    def warmup(self) -> None:
        load_kernels(self._arr, self._kernels)

    def _rows_words(self, rows, n: int, row_stride: int, written: bool):
        """The buffer's first ``n`` rows as flat u64 words. In the simulator a read-only input is copied in only
        (the simulator writes every argument back otherwise)."""
        flat = 0 if n == 0 else (n - 1) * row_stride + rows.shape[1]
        if flat == 0:
            return self._arr.dummy(np.uint64)
        if SIMULATOR:
            words = self._arr.words(rows.ptr, flat, np.uint64, rows.owner, rows.host)
            return words if written else cuda.In(words)
        key = (rows.ptr, flat)
        a = self._rows.get(key)
        if a is None:
            if len(self._rows) >= _CACHE_SIZE:
                self._rows.clear()
            a = self._rows[key] = self._arr.words(rows.ptr, flat, np.uint64, rows.owner)
        return a

    def _launch(self, k: int, a: MoveArgs, stream: int) -> None:
        n = a.slots.shape[0]
        stride = a.row_stride
        args = self._fixed + (self._arr.int_words(a.slots), n, a.slots_wide,
                              self._rows_words(a.rows, n, stride, written=k == 0), stride, self._status)
        grid = move_grid(n, self.tables.row_words, self._sms, 2 if SIMULATOR else BLOCKS_PER_SM, self.threads)
        launch_kernel(self._arr, self._kernels[k], grid, self.threads, stream, args)

    def gather(self, a: MoveArgs, stream: int) -> None:
        self._launch(0, a, stream)

    def scatter(self, a: MoveArgs, stream: int) -> None:
        self._launch(1, a, stream)


def bind(tables: MoveTables, launch: LaunchConfig = DEFAULT_LAUNCH) -> Bound:
    return Bound(tables, launch)
