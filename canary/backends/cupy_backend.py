"""CuPy backend: the CUDA C kernels of ``kernels/plan.cu``, compiled by NVRTC through ``cupy.RawModule``.

One compile per process (all specializations in one module; CuPy also caches it on disk), one module load
per device. ``bind`` packs every launch argument into one by-value ``PlanParams`` struct (uint64 words in a
NumPy array whose address CuPy hands to ``cuLaunchKernel``), allocates the scratch and fixes the grid
from ``verify_capacity``. A call then writes five words (the per-step pointers and ``bs``) and issues one
launch (``bs <= FUSED_MAX_BS``) or two, on the caller's stream: no allocation, compilation, module load or
host sync, so the call can be captured in a CUDA graph.
"""
from __future__ import annotations

import functools

import numpy as np

from . import StaticArgs, StepArgs, cupy_backend_source, import_cupy
from .plan_layout import (
    ENTRY_THREADS, FUSED_MAX_BS, PARAM_FIELDS, ROWS_THREADS, entry_grid, scratch_words,
)

NAME = "cupy"
ON_DEVICE = True

cupy = import_cupy()
from cupy.cuda.function import CPointer  # noqa: E402 - what CuPy launches with: the address of one argument

_STEP_WORDS = tuple(PARAM_FIELDS.index(n) for n in ("req_pool_indices", "prefix_lens", "extend_seq_lens",
                                                     "valid_lens", "bs"))


def suffix(has_lut: bool, has_pool: bool) -> str:
    return f"lut{int(has_lut)}_pool{int(has_pool)}"


@functools.lru_cache(maxsize=None)
def _module() -> "cupy.RawModule":
    return cupy.RawModule(code=cupy_backend_source(), options=("--std=c++17",))


class _Stream:
    """All ``cupy.cuda.function.Function`` reads of a stream: its raw handle."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr


def _word(value: int) -> int:
    return int(value) & 0xFFFFFFFFFFFFFFFF  # int64 fields travel as their two's-complement bit pattern


class Bound:
    def __init__(self, static: StaticArgs):
        s = static
        self.device_id = s.device_id
        sfx = suffix(s.full_to_swa_index_mapping is not None, s.req_to_verify_expected_tokens is not None)
        module = _module()
        with cupy.cuda.Device(self.device_id):
            self._fused = module.get_function(f"canary_plan_fused_{sfx}")
            self._rows = module.get_function(f"canary_plan_rows_{sfx}")
            self._entries = module.get_function(f"canary_plan_entries_{sfx}")
            # Head words re-armed by every launch, then the two-pass row table (bs <= R).
            self.scratch = cupy.zeros(scratch_words(s.write_req_capacity), dtype=cupy.int64)
            self._sms = cupy.cuda.Device(self.device_id).attributes["MultiProcessorCount"]
        lut, pool, r2t = s.full_to_swa_index_mapping, s.req_to_verify_expected_tokens, s.req_to_token
        values = dict(
            req_to_token=r2t.ptr, r2t_row_stride=r2t.strides[0], rp_bound=s.req_pool_index_bound,
            max_seq_len=s.max_seq_len, lut=0 if lut is None else lut.ptr, lut_len=0 if lut is None else lut.shape[0],
            pool=0 if pool is None else pool.ptr, pool_row_stride=0 if pool is None else pool.strides[0],
            pool_cols=0 if pool is None else pool.shape[1], token_offset=s.kv_token_id_vs_position_offset,
            window=s.swa_window_size, verify_capacity=s.verify_capacity, write_req_capacity=s.write_req_capacity,
            slots=s.verify_slot_indices.ptr, expected=s.verify_expected_tokens.ptr,
            positions=s.verify_expected_positions.ptr, prevs=s.verify_prev_slot_indices.ptr,
            num_valid=s.verify_num_valid.ptr, enable=s.enable.ptr, status=s.status.ptr,
            write_offsets=s.write_offsets.ptr, seeds=s.write_seed_slot_indices.ptr,
            write_num_valid_reqs=s.write_num_valid_reqs.ptr, scratch=self.scratch.data.ptr,
        )
        self._words = np.zeros(len(PARAM_FIELDS), dtype=np.uint64)  # the struct's bytes, word by word
        for name, value in values.items():
            self._words[PARAM_FIELDS.index(name)] = _word(value)
        # The launch reads the parameter's bytes through this pointer (cuLaunchKernel copies them), so a call
        # costs no argument conversion at all; the words stay alive with this object.
        self._args = (CPointer(self._words.ctypes.data),)
        self.static = static  # also keeps the caller's arrays alive while their pointers sit in the params
        self._streams: dict[int, _Stream] = {}
        self._fns = None
        self.fused_max_bs = FUSED_MAX_BS  # benchmarks set -1 to time the two-launch path on small batches too

    def warmup(self) -> None:
        """Compile (once per process) and load the module on this device; later launches only launch."""
        if self._fns is None:
            from cupy_backends.cuda.api.driver import occupancyMaxActiveBlocksPerMultiprocessor as occupancy

            with cupy.cuda.Device(self.device_id):
                fns = tuple(k.kernel for k in (self._fused, self._rows, self._entries))
                cap = self.static.verify_capacity
                self._grids = tuple(
                    (entry_grid(cap, self._sms, occupancy(fn.ptr, ENTRY_THREADS, 0)),) for fn in (fns[0], fns[2])
                )
                self._fns = fns

    def launch(self, step: StepArgs, stream: int) -> None:
        st = self._streams.get(stream)
        if st is None:
            st = self._streams[stream] = _Stream(stream)
        w, i = self._words, _STEP_WORDS
        w[i[0]] = step.req_pool_indices.ptr
        w[i[1]] = step.prefix_lens.ptr
        w[i[2]] = step.extend_seq_lens.ptr
        w[i[3]] = 0 if step.valid_lens is None else step.valid_lens.ptr
        w[i[4]] = step.bs
        if self._fns is None:
            self.warmup()
        fused, rows, entries = self._fns
        dev = cupy.cuda.runtime.getDevice()
        if dev != self.device_id:
            cupy.cuda.runtime.setDevice(self.device_id)
        try:
            if step.bs <= self.fused_max_bs:
                fused(self._grids[0], (ENTRY_THREADS,), self._args, stream=st)
            else:
                rows((1,), (ROWS_THREADS,), self._args, stream=st)
                entries(self._grids[1], (ENTRY_THREADS,), self._args, stream=st)
        finally:
            if dev != self.device_id:
                cupy.cuda.runtime.setDevice(dev)


def bind(static: StaticArgs) -> Bound:
    return Bound(static)
