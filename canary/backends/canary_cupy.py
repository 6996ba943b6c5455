"""CuPy backend of the canary: the kernels of ``kernels/canary.cu`` (write, verify, scatter) through NVRTC.

``bind`` packs everything fixed for a canary (state pointers, real-KV sources) into the parameter words of
canary.cu's ``WriteParams`` / ``VerifyParams`` (``canary_layout``); a call writes the per-call words (plan and
entry pointers, capacities, the tag) and issues one launch on the caller's stream: no allocation, compile,
module load or host sync after ``warmup``, so calls can be captured in a CUDA graph.
"""
from __future__ import annotations

import functools

import numpy as np

from ..realkv import RealKV
from ..ring import KernelTag, StateViews, encode_tag
from . import CanaryVerifyArgs, CanaryWriteArgs, ScatterArgs, cupy_backend_source, import_cupy
from .canary_layout import (
    MAX_SOURCES, REAL_KV_FIELDS, SCATTER_FIELDS, SCATTER_THREADS, VERIFY_FIELDS, VERIFY_THREADS,
    WRITE_FIELDS, WRITE_THREADS, verify_grid,
)

NAME = "cupy"
ON_DEVICE = True

cupy = import_cupy()
from cupy.cuda.function import CPointer  # noqa: E402 - the address of one by-value struct argument

from .cupy_backend import _Stream, _word  # noqa: E402 - the same stream wrapper and int64 bit pattern

_DTYPE_SUFFIX = {np.dtype(np.int64): "i64", np.dtype(np.int32): "i32"}


@functools.lru_cache(maxsize=None)
def _module() -> "cupy.RawModule":
    return cupy.RawModule(code=cupy_backend_source("canary"), options=("--std=c++17",))


def _ptr(view) -> int:
    return 0 if view is None else view.ptr


def state_words(state: StateViews) -> dict:
    return dict(
        canary=state.canary_buffer.ptr, num_slots=state.num_slots, slot_stride=state.slot_stride_bytes,
        ring=state.ring.ptr, ring_row_stride=state.ring_row_stride,
        ring_capacity=state.ring_capacity, ring_write_index=state.ring_write_index.ptr,
        slot_run_counter=state.slot_run_counter.ptr, kernel_run_counter=state.kernel_run_counter.ptr,
        check_flags=state.check_flags.ptr, tag=0,
    )


def real_kv_words(real_kv: RealKV) -> dict:
    """canary.cu's ``RealKVParams``: ``num_sources = 0`` in mode NONE (nothing read, nothing compared)."""
    out = {name: 0 for name in REAL_KV_FIELDS}
    if not real_kv.active:
        return out
    out["num_sources"] = len(real_kv.sources)
    for k, src in enumerate(real_kv.sources[:MAX_SOURCES]):
        out[f"base{k}"] = src.ptr
        out[f"row_stride_bytes{k}"] = src.row_stride_bytes
        out[f"page_size{k}"] = src.page_size
        out[f"num_bytes_per_token{k}"] = src.num_bytes_per_token
        out[f"read_words{k}"] = src.words(real_kv.mode)
    return out


class _Params:
    """One struct's uint64 words and the argument tuple pointing at them (cuLaunchKernel copies the bytes at
    launch, so rewriting the words for the next call is safe)."""

    def __init__(self, fields: tuple, values: dict):
        self.index = {name: i for i, name in enumerate(fields)}
        self.words = np.zeros(len(fields), dtype=np.uint64)
        self.set(values)
        self.args = (CPointer(self.words.ctypes.data),)

    def set(self, values: dict) -> None:
        w, index = self.words, self.index
        for name, value in values.items():
            w[index[name]] = _word(value)


def _stream(cache: dict, handle: int) -> _Stream:
    st = cache.get(handle)
    if st is None:
        st = cache[handle] = _Stream(handle)
    return st


class _OnDevice:
    """Run on ``device_id`` whatever the current device is."""

    def __init__(self, device_id: int):
        self.device_id = device_id

    def __enter__(self):
        self.prev = cupy.cuda.runtime.getDevice()
        if self.prev != self.device_id:
            cupy.cuda.runtime.setDevice(self.device_id)

    def __exit__(self, *exc):
        if self.prev != self.device_id:
            cupy.cuda.runtime.setDevice(self.prev)


class Bound:
    def __init__(self, state: StateViews, real_kv: RealKV):
        self.state = state
        self.real_kv = real_kv  # keeps the sources alive while their pointers sit in the params
        self.device_id = state.device_id
        fixed = {**state_words(state), **real_kv_words(real_kv)}
        self._write = _Params(WRITE_FIELDS, fixed)
        self._verify = _Params(VERIFY_FIELDS, fixed)
        self._streams: dict[int, _Stream] = {}
        self._fns = None

    def warmup(self) -> None:
        """Compile (once per process) and load the module on this device; later calls only launch."""
        if self._fns is not None:
            return
        from cupy_backends.cuda.api.driver import occupancyMaxActiveBlocksPerMultiprocessor as occupancy

        with cupy.cuda.Device(self.device_id):
            module = _module()
            write = module.get_function("canary_write").kernel
            verify = module.get_function("canary_verify").kernel
            sms = cupy.cuda.Device(self.device_id).attributes["MultiProcessorCount"]
            self._verify_blocks_per_sm = occupancy(verify.ptr, VERIFY_THREADS, 0)
            self._sms = sms
            self._fns = (write, verify)

    def write(self, a: CanaryWriteArgs, stream: int) -> None:
        if self._fns is None:
            self.warmup()
        r_cap = a.write_seed_slot_indices.shape[0]
        self._write.set(dict(
            tag=encode_tag(KernelTag.WRITE, a.launch_tag), write_offsets=a.write_offsets.ptr,
            write_seed_slot_indices=a.write_seed_slot_indices.ptr, write_num_valid_reqs=a.write_num_valid_reqs.ptr,
            write_req_capacity=r_cap, out_cache_loc=a.out_cache_loc.ptr, input_ids=a.input_ids.ptr,
            positions=a.positions.ptr, num_entries=a.out_cache_loc.shape[0],
            expected_input_ids=_ptr(a.expected_input_ids), expected_positions=_ptr(a.expected_positions),
        ))
        with _OnDevice(self.device_id):
            self._fns[0]((max(r_cap, 1),), (WRITE_THREADS,), self._write.args, stream=_stream(self._streams, stream))

    def verify(self, a: CanaryVerifyArgs, stream: int) -> None:
        if self._fns is None:
            self.warmup()
        cap = a.verify_slot_indices.shape[0]
        self._verify.set(dict(
            tag=encode_tag(KernelTag.VERIFY, a.launch_tag), verify_slot_indices=a.verify_slot_indices.ptr,
            verify_expected_tokens=a.verify_expected_tokens.ptr,
            verify_expected_positions=a.verify_expected_positions.ptr,
            verify_prev_slot_indices=a.verify_prev_slot_indices.ptr, verify_capacity=cap,
            verify_num_valid=a.verify_num_valid.ptr, enable=a.enable.ptr,
        ))
        grid = verify_grid(cap, self._sms, self._verify_blocks_per_sm)
        with _OnDevice(self.device_id):
            self._fns[1]((grid,), (VERIFY_THREADS,), self._verify.args, stream=_stream(self._streams, stream))


def bind(state: StateViews, real_kv: RealKV) -> Bound:
    return Bound(state, real_kv)


_SCATTER_STREAMS: dict[int, _Stream] = {}
_SCATTER_FNS: dict[tuple[int, str], object] = {}


def _scatter_fn(device_id: int, suffix: str):
    """The loaded scatter kernel for a device (loaded once: later calls may sit inside a graph capture)."""
    fn = _SCATTER_FNS.get((device_id, suffix))
    if fn is None:
        with cupy.cuda.Device(device_id):
            fn = _SCATTER_FNS[(device_id, suffix)] = _module().get_function(f"canary_scatter_{suffix}").kernel
    return fn


def scatter(a: ScatterArgs, stream: int) -> None:
    """One scatter launch: one block per batch row (grid from ``bs``, a capacity: graph-safe)."""
    pool = a.pool
    values = dict(
        pool=pool.ptr, pool_rows=pool.shape[0], pool_cols=pool.shape[1],
        pool_row_stride=a.pool_row_stride,
        req_pool_indices=a.req_pool_indices.ptr, bs=a.req_pool_indices.shape[0], tokens=a.tokens.ptr,
        num_tokens=a.tokens.shape[0], token_offsets=a.token_offsets.ptr, column_starts=a.column_starts.ptr,
        column_offset=a.column_offset,
    )
    params = _Params(SCATTER_FIELDS, values)
    fn = _scatter_fn(pool.device_id, _DTYPE_SUFFIX[a.tokens.dtype])
    with _OnDevice(pool.device_id):
        fn((max(values["bs"], 1),), (SCATTER_THREADS,), params.args, stream=_stream(_SCATTER_STREAMS, stream))
