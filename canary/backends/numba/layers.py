"""Numba backend of the layer rotation: ``canary_write_layers`` / ``canary_verify_layer`` of
``kernels/records_numba.py`` (the twin of records.cu's).

``bind`` compiles the kernels for the tuple of per-layer word arrays (once per tuple length and process) and
builds the word views of the state, the table and every layer's sources, zero-copy; a call wraps the per-call
arrays and launches on the caller's stream (as :mod:`.records` does).
"""
from __future__ import annotations

import numpy as np

from ...contract.ring import KernelTag, encode_tag
from ...contract.state import StateViews
from ..args import DEFAULT_LAUNCH, LaunchConfig
from ...contract.layers_layout import layer_grid
from . import ON_DEVICE as _ON_DEVICE
from . import SIMULATOR
from .records import BLOCKS_PER_SM, SIMULATOR_THREADS, Bound as RecordsBound, flat_words
from .records import launch_kernel, load_kernels, records_numba

NAME = "numba"
ON_DEVICE = _ON_DEVICE


def _threads(launch: LaunchConfig) -> int:
    if SIMULATOR and launch.simulator_threads != "gpu":
        return launch.simulator_threads or SIMULATOR_THREADS
    return records_numba.LAYER_THREADS


class Bound:
    def __init__(self, state: StateViews, views, launch: LaunchConfig = DEFAULT_LAUNCH):
        self.state = state
        self.views = views
        self.threads = _threads(launch)
        records = RecordsBound(state, views.kv.layers[0], launch)  # the state's word views and layer 0's kvp
        self._arr = arr = records.arrays
        self._state_args = records.state_args
        kv = views.kv
        kvp = records.kv_params
        words = []
        for layer in kv.layers:
            for src in layer.sources:
                n = flat_words(src.rows, src.row_stride_bytes, src.row_bytes)
                words.append(arr.words(src.ptr, n, np.uint64, src.owner, None if src.bytes is None else src.bytes))
        h, c = views.layer_hashes, views.layer_cursor
        self._table_args = (kvp, kv.num_sources, tuple(words), kv.num_layers, views.dwell,
                            arr.words(h.ptr, h.shape[0] * h.shape[1], np.uint64, h.owner, h.host),
                            arr.words(c.ptr, c.shape[0], np.int32, c.owner, c.host))
        self._write_kernel, self._verify_kernel = records_numba.layer_kernels(len(words), self.threads,
                                                                               state.padding_slot)
        self._sms = records.sms

    def warmup(self) -> None:
        load_kernels(self._arr, (self._write_kernel, self._verify_kernel))

    def _args(self, tag: int, write=None, loc=None, verify=None) -> tuple:
        v, d = self._arr.vector, self._arr.dummy
        if write is not None:
            w = (v(write.write_offsets), v(write.write_seed_slot_indices), v(write.write_num_valid_reqs),
                 write.write_seed_slot_indices.shape[0], self._arr.int_words(loc), loc.shape[0])
            wide = int(loc.dtype.itemsize == 8)  # ENTRY_WIDE_OUT_CACHE_LOC
        else:
            w = (d(np.int64), d(np.int64), d(np.int32), 0, d(np.int32), 0)
            wide = 0
        if verify is not None:
            r = (v(verify.verify_slot_indices), v(verify.verify_expected_tokens),
                 v(verify.verify_expected_positions), verify.verify_slot_indices.shape[0], v(verify.verify_num_valid),
                 v(verify.enable))
        else:
            r = (d(np.int64), d(np.int64), d(np.int64), 0, d(np.int32), d(np.int32))
        return self._state_args + (np.uint64(tag),) + self._table_args + w + r + (wide,)

    def write(self, plan, out_cache_loc, stream: int) -> None:
        args = self._args(encode_tag(KernelTag.WRITE), write=plan, loc=out_cache_loc)
        grid = layer_grid(out_cache_loc.shape[0] * self.views.num_layers, self._sms,
                          2 if SIMULATOR else BLOCKS_PER_SM, self.threads)
        launch_kernel(self._arr, self._write_kernel, grid, self.threads, stream, args)

    def verify(self, plan, tag: int, stream: int) -> None:
        args = self._args(tag, verify=plan)
        grid = layer_grid(plan.verify_slot_indices.shape[0], self._sms, 2 if SIMULATOR else BLOCKS_PER_SM,
                          self.threads)
        launch_kernel(self._arr, self._verify_kernel, grid, self.threads, stream, args)


def bind(state: StateViews, views, launch: LaunchConfig = DEFAULT_LAUNCH) -> Bound:
    return Bound(state, views, launch)
