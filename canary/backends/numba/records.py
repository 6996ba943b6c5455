"""Numba backend of the canary records: the kernels of ``kernels/records_numba.py`` (the twin of
``kernels/records.cu``).

Imported only when requested; refuses a numpy numba-cuda cannot compile under and a missing numba-cuda with
:class:`BackendUnavailableError` (the guards of this backend's ``__init__``). ``bind``
compiles the kernels (once per process) and builds, zero-copy and without syncing, the word views of the
state and of the real-KV sources; a call wraps the per-call arrays (cached by pointer) and launches with
numba's ``kernel[grid, block, stream]`` on the caller's stream. Under the CUDA simulator the "device" is host
memory (``ON_DEVICE`` False) and the blocks are small, as in the Numba planner.
"""
from __future__ import annotations

import warnings

import numpy as np

from ...interop.memview import host_view
from ...contract.realkv import RealKV
from ...contract.ring import KernelTag, encode_tag
from ...contract.state import StateViews
from ..args import DEFAULT_LAUNCH, LaunchConfig, RecordVerifyArgs, RecordWriteArgs, ScatterArgs
from ...contract.records_layout import MAX_SOURCES, verify_grid, write_grid
from ..sources import numba_kernels
from . import ON_DEVICE, SIMULATOR, PerformanceWarning, cuda, device_array

NAME = "numba"
__all__ = ["NAME", "ON_DEVICE", "Bound", "bind", "scatter"]

records_numba = numba_kernels("records_numba")

# The simulator runs one Python thread per CUDA thread: small blocks keep CI fast and still take several
# chunks per request and several grid-stride rounds on small cases. Tests may change these before binding.
SIMULATOR_THREADS = 32
SIMULATOR_SMS = 1
BLOCKS_PER_SM = 8  # resident verify / write blocks per SM (256 threads: 2048 per SM on every GPU since sm_60)
_CACHE_SIZE = 64


def _threads(launch: LaunchConfig = DEFAULT_LAUNCH) -> tuple[int, int, int]:
    """Block sizes of write, verify, scatter: the kernels' own on a GPU, small ones under the simulator."""
    if SIMULATOR and launch.simulator_threads != "gpu":
        return (launch.simulator_threads or SIMULATOR_THREADS,) * 3
    return records_numba.WRITE_THREADS, records_numba.VERIFY_THREADS, records_numba.SCATTER_THREADS


def _kernels(launch: LaunchConfig = DEFAULT_LAUNCH, padding_slot: int = 0):
    return records_numba.canary_kernels(*_threads(launch), padding_slot)


class Arrays:
    """Numba arrays over caller memory: device arrays from pointers (no copy, no sync) on a GPU, NumPy views
    of host memory under the simulator. Per-call arrays are cached by (pointer, length, dtype)."""

    def __init__(self, device_id: int):
        self.gpu = None if SIMULATOR else cuda.gpus[device_id]
        self._cache: dict = {}
        self._dummies: dict = {}
        self._streams: dict = {}
        for dtype in (np.int64, np.uint64, np.int32, np.uint8):  # now, not inside a later CUDA-graph capture
            self.dummy(dtype)

    def words(self, ptr: int, n: int, dtype, owner, host_owner=None):
        """``n`` elements of ``dtype`` at ``ptr`` (the memory of ``owner``; ``host_owner``: its host array)."""
        if n == 0:
            return self.dummy(dtype)
        if SIMULATOR:
            return host_view(ptr, (n,), (np.dtype(dtype).itemsize,), dtype, host_owner)
        with self.gpu:
            return device_array(ptr, n, dtype, owner=owner)

    def dummy(self, dtype):
        """A one-element array for an absent input (never read)."""
        dtype = np.dtype(dtype)
        d = self._dummies.get(dtype)
        if d is None:
            z = np.zeros(1, dtype=dtype)
            if not SIMULATOR:
                with self.gpu:
                    z = cuda.to_device(z)  # a synchronous copy, at construction
            d = self._dummies[dtype] = z
        return d

    def int_words(self, view):
        """A per-call int32 or int64 1-D array as the kernels' int32 words (two an element for int64: their
        ``load_int``), cached as :meth:`vector` caches; ``None``: a dummy."""
        if view is None:
            return self.dummy(np.int32)
        n = view.shape[0] * (view.dtype.itemsize // 4)
        if SIMULATOR:
            return cuda.In(view.host.view(np.int32)) if n else self.dummy(np.int32)
        key = (view.ptr, n, "words")
        a = self._cache.get(key)
        if a is None:
            if len(self._cache) >= _CACHE_SIZE:
                self._cache.clear()
            a = self._cache[key] = self.words(view.ptr, n, np.int32, None)
        return a

    def vector(self, view, dtype=None):
        """A per-call 1-D array (unit stride: checked by the caller)."""
        if view is None:
            return self.dummy(dtype or np.int64)
        if SIMULATOR:
            # Copied in only: the simulator never writes back into a (maybe read-only) caller input.
            return cuda.In(view.host) if view.shape[0] else self.dummy(view.dtype)
        key = (view.ptr, view.shape[0], view.dtype.str)
        a = self._cache.get(key)
        if a is None:
            if len(self._cache) >= _CACHE_SIZE:
                self._cache.clear()
            a = self._cache[key] = self.words(view.ptr, view.shape[0], view.dtype, None)
        return a

    def stream(self, handle: int):
        if SIMULATOR or handle == 0:
            return 0
        s = self._streams.get(handle)
        if s is None:
            with self.gpu:
                s = self._streams[handle] = cuda.external_stream(handle)
        return s


def flat_words(rows: int, row_stride_bytes: int, row_bytes: int) -> int:
    """8-byte words spanned by ``rows`` rows of ``row_bytes`` bytes, ``row_stride_bytes`` apart (a real-KV source)."""
    return 0 if rows == 0 else ((rows - 1) * row_stride_bytes + row_bytes) // 8


def load_kernels(arr: "Arrays", kernels) -> None:
    """Load compiled kernels' module on ``arr``'s device (nothing to load in the simulator)."""
    if SIMULATOR:
        return
    with arr.gpu:
        for kernel in kernels:
            for overload in kernel.overloads.values():
                overload.bind()


class Bound:
    """The records kernels bound to a canary. What :mod:`.layers` builds on is public: ``arrays`` (the
    :class:`Arrays` of the canary's device), ``state_args`` (the state's launch arguments, records_numba's order),
    ``kv_params`` (the real-KV layout words) and ``sms`` (the SM count the grids are sized from)."""

    def __init__(self, state: StateViews, real_kv: RealKV, launch: LaunchConfig = DEFAULT_LAUNCH):
        self.state = state
        self.real_kv = real_kv
        self.device_id = state.device_id
        self.arrays = arr = Arrays(state.device_id)
        self._write_kernel, self._verify_kernel = _kernels(launch, state.padding_slot)[:2]
        self.write_threads, self.verify_threads, _ = _threads(launch)
        s = state
        buf = s.canary_buffer
        # Only the four fields of each slot are touched: the last slot needs 32 bytes, not a full stride.
        canary_words = ((s.num_slots - 1) * s.slot_stride_bytes + 32) // 8
        ring_stride = s.ring_row_stride
        ring_words = 0 if s.ring_capacity == 0 else (s.ring_capacity - 1) * ring_stride + 8
        self.state_args = (
            arr.words(buf.ptr, canary_words, np.uint64, buf.owner, buf.host), s.num_slots, s.slot_stride_bytes // 8,
            arr.words(s.ring.ptr, ring_words, np.uint64, s.ring.owner, s.ring.host), ring_stride, s.ring_capacity,
            arr.words(s.ring_write_index.ptr, 1, np.uint32, s.ring_write_index.owner, s.ring_write_index.host),
            arr.words(s.slot_run_counter.ptr, 2, np.uint64, s.slot_run_counter.owner, s.slot_run_counter.host),
            arr.words(s.kernel_run_counter.ptr, 2, np.uint64, s.kernel_run_counter.owner, s.kernel_run_counter.host),
            arr.words(s.check_flags.ptr, 1, np.int32, s.check_flags.owner, s.check_flags.host),
            *self._reported(s),
        )
        sources = list(real_kv.sources) if real_kv.active else []
        kvp = np.zeros(MAX_SOURCES * records_numba.KV_FIELDS, dtype=np.int64)
        kv_arrays = []
        for k in range(MAX_SOURCES):
            if k < len(sources):
                src = sources[k]
                b = k * records_numba.KV_FIELDS
                kvp[b + records_numba.KV_ROW_STRIDE_WORDS] = src.row_stride_bytes // 8
                kvp[b + records_numba.KV_PAGE_SIZE] = src.page_size
                kvp[b + records_numba.KV_WORDS_PER_TOKEN] = src.num_bytes_per_token // 8
                kvp[b + records_numba.KV_READ_WORDS] = src.words(real_kv.mode)
                n = flat_words(src.rows, src.row_stride_bytes, src.row_bytes)
                kv_arrays.append(arr.words(src.ptr, n, np.uint64, src.owner, None if src.bytes is None else src.bytes))
            else:
                kv_arrays.append(arr.dummy(np.uint64))
        if not SIMULATOR:
            with arr.gpu:
                kvp = cuda.to_device(kvp)  # once, at bind
            sms = int(arr.gpu.MULTIPROCESSOR_COUNT)
        else:
            sms = SIMULATOR_SMS
        self._kv_params = kvp
        self._kv_args = (*kv_arrays, kvp, len(sources))  # records_numba's real-KV arguments, in order
        self.sms = sms

    def _reported(self, s: StateViews) -> tuple:
        """The kernels' ``reported_slots, has_reported_slots`` (a one-byte dummy when not given)."""
        r = s.reported_slots
        if r is None:
            return self.arrays.dummy(np.uint8), 0
        return self.arrays.words(r.ptr, s.num_slots, np.uint8, r.owner, r.host), 1

    @property
    def kv_params(self):
        """The ``[MAX_SOURCES * KV_FIELDS]`` int64 layout words of the real-KV sources (a device array on a GPU)."""
        return self._kv_params

    def warmup(self) -> None:
        """Load the kernels' module on the canary's device (compilation happened at bind)."""
        load_kernels(self.arrays, (self._write_kernel, self._verify_kernel))

    def write(self, a: RecordWriteArgs, stream: int) -> None:
        v = self.arrays.vector
        r_cap = a.plan.write_seed_slot_indices.shape[0]
        w = self.arrays.int_words
        args = self.state_args + (np.uint64(encode_tag(KernelTag.WRITE, a.launch_tag)),) + self._kv_args + (
            v(a.plan.write_offsets), v(a.plan.write_seed_slot_indices), v(a.plan.write_num_valid_reqs), r_cap,
            w(a.out_cache_loc), w(a.input_ids), w(a.positions), a.out_cache_loc.shape[0], w(a.expected_input_ids),
            w(a.expected_positions), int(a.expected_input_ids is not None), int(a.expected_positions is not None),
            a.entry_wide,
        )
        grid = write_grid(r_cap, self.sms, 2 if SIMULATOR else BLOCKS_PER_SM)
        launch_kernel(self.arrays, self._write_kernel, grid, self.write_threads, stream, args)

    def verify(self, a: RecordVerifyArgs, stream: int) -> None:
        v = self.arrays.vector
        cap = a.plan.verify_slot_indices.shape[0]
        args = self.state_args + (np.uint64(encode_tag(KernelTag.VERIFY, a.launch_tag)),) + self._kv_args + (
            v(a.plan.verify_slot_indices), v(a.plan.verify_expected_tokens), v(a.plan.verify_expected_positions),
            v(a.plan.verify_prev_slot_indices), cap, v(a.plan.verify_num_valid), v(a.plan.enable),
        )
        grid = verify_grid(cap, self.sms, 2 if SIMULATOR else BLOCKS_PER_SM, self.verify_threads)
        launch_kernel(self.arrays, self._verify_kernel, grid, self.verify_threads, stream, args)


def launch_kernel(arr: Arrays, kernel, grid: int, block: int, stream: int, args: tuple) -> None:
    """Launch a compiled kernel on ``arr``'s device and the raw stream handle ``stream`` (synchronously, on the
    host, under the simulator)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PerformanceWarning)  # small grids are by design (work items per capacity)
        if SIMULATOR:
            # The simulator computes with NumPy scalars, which warn when u64 arithmetic wraps (by design here).
            warnings.filterwarnings("ignore", "overflow encountered", RuntimeWarning)
            kernel[grid, block](*args)
            return
        with arr.gpu:
            kernel[grid, block, arr.stream(stream)](*args)


def bind(state: StateViews, real_kv: RealKV, launch: LaunchConfig = DEFAULT_LAUNCH) -> Bound:
    return Bound(state, real_kv, launch)


_SCATTER_ARRAYS: dict[int, Arrays] = {}


def scatter(a: ScatterArgs, stream: int) -> None:
    """One scatter launch: one block per batch row."""
    pool = a.pool
    arr = _SCATTER_ARRAYS.get(pool.device_id)
    if arr is None:
        arr = _SCATTER_ARRAYS[pool.device_id] = Arrays(pool.device_id)
    rows, cols = pool.shape
    row_stride = a.pool_row_stride
    flat = 0 if rows == 0 or cols == 0 else (rows - 1) * row_stride + cols
    pool_arr = arr.words(pool.ptr, flat, np.int32, pool.owner, pool.host)
    kernels = _kernels()
    kernel = kernels[2] if a.tokens.dtype == np.dtype(np.int64) else kernels[3]
    bs = a.req_pool_indices.shape[0]
    args = (pool_arr, rows, cols, row_stride, arr.vector(a.req_pool_indices), bs, arr.vector(a.tokens, a.tokens.dtype),
            a.tokens.shape[0], arr.vector(a.token_offsets), arr.vector(a.column_starts), np.int64(a.column_offset))
    launch_kernel(arr, kernel, max(bs, 1), _threads()[2], stream, args)
