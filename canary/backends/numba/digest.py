"""Numba backend of the block digest: ``canary_digest`` / ``canary_digest_check`` of ``kernels/digest_numba.py``
(the twin of ``kernels/digest.cu``).

``bind`` compiles the kernels for the tuple of per-tensor word arrays (once per tuple length and process), builds
the tensors' word views zero-copy and allocates the zeroed scratch; a call wraps the per-call arrays (cached by
pointer on a GPU) and launches on the caller's stream, as :mod:`.records` does.
"""
from __future__ import annotations

import numpy as np

from ...contract.digest import DigestLayers
from ...contract.digest_layout import DIGEST_THREADS, digest_grid, digest_splits, scratch_words
from ..args import DEFAULT_LAUNCH, DigestArgs, LaunchConfig
from ..sources import numba_kernels
from . import ON_DEVICE as _ON_DEVICE
from . import SIMULATOR, cuda
from .records import BLOCKS_PER_SM, SIMULATOR_THREADS, Arrays, launch_kernel, load_kernels

NAME = "numba"
ON_DEVICE = _ON_DEVICE

digest_numba = numba_kernels("digest_numba")
_CACHE_SIZE = 64


def _threads(launch: LaunchConfig) -> int:
    if SIMULATOR and launch.simulator_threads != "gpu":
        return launch.simulator_threads or SIMULATOR_THREADS
    return DIGEST_THREADS


class Bound:
    def __init__(self, layers: DigestLayers, max_blocks: int, launch: LaunchConfig = DEFAULT_LAUNCH):
        self.layers = layers
        self.threads = _threads(launch)
        self.arrays = arr = Arrays(layers.device_id)
        words = []
        for layer in layers.layers:
            for t in layer:
                host = None if t.words is None else t.owner
                words.append(arr.words(t.ptr, t.span_bytes // 8, np.uint64, t.owner, host))
        self._words = tuple(words)
        kp = np.zeros(digest_numba.DIGEST_MAX_KINDS * digest_numba.KP_FIELDS, dtype=np.int64)
        for k in range(layers.num_kinds):
            t, b = layers.kind(k), k * digest_numba.KP_FIELDS
            kp[b + digest_numba.KP_HEADS] = t.heads
            kp[b + digest_numba.KP_HEAD_VECS] = t.head_bytes // 16
            kp[b + digest_numba.KP_PAGE_STRIDE] = t.page_stride // 8
            kp[b + digest_numba.KP_TOKEN_STRIDE] = t.token_stride // 8
            kp[b + digest_numba.KP_HEAD_STRIDE] = t.head_stride // 8
        n_scratch = scratch_words(max_blocks)
        if SIMULATOR:
            self.scratch = np.zeros(n_scratch, dtype=np.uint64)
            self._kp = kp
            self._sms = 1
        else:
            with arr.gpu:
                self.scratch = cuda.to_device(np.zeros(n_scratch, dtype=np.uint64))  # once, at bind
                self._kp = cuda.to_device(kp)
            self._sms = int(arr.gpu.MULTIPROCESSOR_COUNT)
        self.max_blocks = int(max_blocks)
        self._kernels = digest_numba.digest_kernels(len(words), self.threads)
        self._units = max(layers.kind(k).heads * layers.kind(k).head_bytes // 16 for k in range(layers.num_kinds))
        self._cache: dict = {}

    def warmup(self) -> None:
        """Load the kernels' module on the tensors' device (compilation happened at bind)."""
        load_kernels(self.arrays, self._kernels)

    def _view(self, view, dtype, write: bool):
        """A per-call array as ``dtype`` elements: written back under the simulator when ``write``; cached by
        pointer on a GPU (no copy, no sync)."""
        arr = self.arrays
        if view is None:
            return arr.dummy(dtype)
        n = view.shape[0] * view.dtype.itemsize // np.dtype(dtype).itemsize
        if n == 0:
            return arr.dummy(dtype)
        if SIMULATOR:
            host = view.host.view(dtype)
            return host if write else cuda.In(host)
        key = (view.ptr, n, np.dtype(dtype).str)
        a = self._cache.get(key)
        if a is None:
            if len(self._cache) >= _CACHE_SIZE:
                self._cache.clear()
            a = self._cache[key] = arr.words(view.ptr, n, dtype, None)
        return a

    def _launch(self, which: int, a: DigestArgs, stream: int) -> None:
        lay = self.layers
        resident = self._sms * (2 if SIMULATOR else BLOCKS_PER_SM)
        splits = digest_splits(a.num_blocks, lay.num_layers, lay.num_kinds, a.kv_indices.shape[0] * lay.page_size,
                               self._units, resident, self.threads)
        w = self.arrays.int_words
        count = a.count
        wide_count = count is not None and count.dtype.itemsize == 8
        args = (lay.num_layers, lay.num_kinds, lay.layer_offset, lay.head_offset, self._words, lay.num_pages,
                lay.page_size, self._kp, w(a.kv_indptr), w(a.kv_indices), w(a.block_positions), w(a.block_lens),
                int(a.block_lens is not None), a.num_blocks, a.kv_indices.shape[0], a.index_wide, splits,
                self._view(a.out, np.uint64, True), self._view(a.status, np.uint8, True), int(a.status is not None),
                self._view(a.expected, np.uint64, False), self._view(a.mismatch, np.uint8, True),
                self._view(None if wide_count else count, np.int32, True),
                self._view(count if wide_count else None, np.int64, True), self.scratch, self.max_blocks)
        grid = digest_grid(a.num_blocks, lay.num_layers, lay.num_kinds, splits, resident)
        launch_kernel(self.arrays, self._kernels[which], grid, self.threads, stream, args)

    def compute(self, a: DigestArgs, stream: int) -> None:
        self._launch(0, a, stream)

    def check(self, a: DigestArgs, stream: int) -> None:
        self._launch(1, a, stream)


def bind(layers: DigestLayers, max_blocks: int, launch: LaunchConfig = DEFAULT_LAUNCH) -> Bound:
    return Bound(layers, max_blocks, launch)
