"""CuPy backend: the CUDA C kernels of ``kernels/plan.cu`` compiled by NVRTC through ``cupy.RawModule``.

Compilation happens once per process and specialization (LUT present, expected-token pool present); the
module is loaded once per device. ``bind`` packs every launch argument that does not change between calls
and allocates the row-offset scratch, so a call only fills in the per-step pointers and ``bs``, then issues
two launches on the caller's stream: no allocation, compilation, module load or host sync.
"""
from __future__ import annotations

import functools
import numpy as np

from . import StaticArgs, StepArgs, cupy_backend_source, import_cupy

NAME = "cupy"
ON_DEVICE = True

cupy = import_cupy()

ROWS_THREADS = 1024  # must match ROWS_THREADS in plan.cu
ENTRY_THREADS = 256
BLOCKS_PER_SM = 8  # entries grid: enough resident blocks to hide gather latency, fixed so graphs stay valid




def suffix(has_lut: bool, has_pool: bool) -> str:
    return f"lut{int(has_lut)}_pool{int(has_pool)}"


@functools.lru_cache(maxsize=None)
def _module() -> "cupy.RawModule":
    """All four specializations live in one module: one NVRTC compile per process (CuPy caches it on disk)."""
    return cupy.RawModule(code=cupy_backend_source(), options=("--std=c++17",))


class _Stream:
    """What ``cupy.cuda.function.Function`` reads of a stream: its raw handle."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr


def _ptr(view) -> np.uint64:
    return np.uint64(0 if view is None else view.ptr)


class Bound:
    def __init__(self, static: StaticArgs):
        self.static = s = static
        self.device_id = s.device_id
        has_lut = s.full_to_swa_index_mapping is not None
        has_pool = s.req_to_verify_expected_tokens is not None
        self._has_pool = has_pool
        module, sfx = _module(), suffix(has_lut, has_pool)
        with cupy.cuda.Device(self.device_id):
            self._rows = module.get_function(f"canary_plan_rows_{sfx}")
            self._entries = module.get_function(f"canary_plan_entries_{sfx}")
            self.row_offsets = cupy.zeros(s.max_batch_size + 1, dtype=cupy.int64)
            sms = cupy.cuda.Device(self.device_id).attributes["MultiProcessorCount"]
        cap = s.verify_capacity
        self._entry_grid = (max(1, min(-(-cap // ENTRY_THREADS), sms * BLOCKS_PER_SM)),)
        lut, pool, r2t = s.full_to_swa_index_mapping, s.req_to_verify_expected_tokens, s.req_to_token
        i64 = np.int64
        self._rows_static = (
            _ptr(r2t), i64(r2t.strides[0]), i64(s.req_pool_index_bound), i64(s.max_seq_len),
            _ptr(lut), i64(0 if lut is None else lut.shape[0]),
            i64(0 if pool is None else pool.shape[1]), i64(s.swa_window_size),
        )
        self._rows_tail = (
            i64(cap), i64(s.write_req_capacity), np.uint64(self.row_offsets.data.ptr), _ptr(s.write_offsets),
            _ptr(s.write_seed_slot_indices), _ptr(s.verify_num_valid), _ptr(s.enable), _ptr(s.status),
            _ptr(s.write_num_valid_reqs),
        )
        self._entries_static = (
            _ptr(r2t), i64(r2t.strides[0]), _ptr(lut), i64(0 if lut is None else lut.shape[0]), _ptr(pool),
            i64(0 if pool is None else pool.strides[0]), i64(s.kv_token_id_vs_position_offset),
            i64(s.swa_window_size),
        )
        self._entries_tail = (
            np.uint64(self.row_offsets.data.ptr), _ptr(s.verify_slot_indices), _ptr(s.verify_expected_tokens),
            _ptr(s.verify_expected_positions), _ptr(s.verify_prev_slot_indices), _ptr(s.enable), _ptr(s.status),
        )
        self._streams: dict[int, _Stream] = {}

    def warmup(self) -> None:
        with cupy.cuda.Device(self.device_id):
            self._rows.kernel  # noqa: B018 - compiles (once per process) and loads the module on this device
            self._entries.kernel  # noqa: B018

    def launch(self, step: StepArgs, stream: int) -> None:
        st = self._streams.get(stream)
        if st is None:
            st = self._streams[stream] = _Stream(stream)
        rpi, pre, ext = np.uint64(step.req_pool_indices.ptr), np.uint64(step.prefix_lens.ptr), np.uint64(
            step.extend_seq_lens.ptr
        )
        vl = _ptr(step.valid_lens)
        bs = np.int64(step.bs)
        dev = cupy.cuda.runtime.getDevice()
        if dev != self.device_id:
            cupy.cuda.runtime.setDevice(self.device_id)
        try:
            self._rows.kernel(
                (1,), (ROWS_THREADS,), (rpi, pre, ext, vl) + self._rows_static + (bs,) + self._rows_tail, stream=st
            )
            self._entries.kernel(
                self._entry_grid, (ENTRY_THREADS,), (rpi, pre, vl) + self._entries_static + (bs,) + self._entries_tail,
                stream=st,
            )
        finally:
            if dev != self.device_id:
                cupy.cuda.runtime.setDevice(dev)


def bind(static: StaticArgs) -> Bound:
    return Bound(static)
