"""Numba backend: the kernels of ``kernels/plan_numba.py`` (the twin of ``kernels/plan.cu``) through numba-cuda.

``bind`` does everything that does not change between calls, on the device holding the buffers: eager
compilation of the (LUT, pool) specialization (with plan.cu's launch bounds), device arrays over the static
buffers (zero-copy, from their pointers, never synchronizing as numba does by default for
CUDA-Array-Interface arguments), the scratch (plan.cu's layout: head words + the two-pass row table, zeroed
once), the grids (from verify_capacity, the SM count and each kernel's occupancy, as the CuPy backend) and the
launch arguments (plan.cu's ``PlanParams`` order), marshalled once: a call lays out only the seven per-step
words and launches through ``cuda.core.launch`` (``_FastLaunch``; where this numba-cuda's internals differ,
numba's ordinary ``kernel[grid, block, stream](*args)`` instead, per-step device arrays cached by pointer).
``warmup`` loads the module on the device. A call issues one launch (bs <= ``FUSED_MAX_BS``) or two on the
caller's stream (a raw handle, wrapped once per handle with ``cuda.external_stream``): no allocation,
compilation, module load or host sync, so it can be captured in a CUDA graph.

Under the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``, what CI runs) the "device" is host memory:
``ON_DEVICE`` is False, the planner's host arrays go to the kernels as NumPy arrays (inputs copied in only,
outputs copied in and back, as the simulator does), streams are ignored (launches run synchronously), and
the blocks are small (``SIMULATOR_THREADS``, or ``LaunchConfig.simulator_threads``: one Python thread per CUDA
thread).
"""
from __future__ import annotations

import ctypes
import warnings

import numpy as np

from ..args import DEFAULT_LAUNCH, KVIndex, LaunchConfig, StaticArgs, StepArgs
from ...contract.kvindex import FORM_PAGES
from ...contract.plan_layout import entry_grid
from ..sources import numba_kernels
from . import ON_DEVICE, SIMULATOR, PerformanceWarning, cuda, device_array, flat_len

__all__ = ["NAME", "ON_DEVICE", "bind", "Bound", "STEP_CACHE_SIZE"]  # the backend interface (ON_DEVICE: from the package)

NAME = "numba"
plan_numba = numba_kernels("plan_numba")

ROWS_THREADS = plan_numba.ROWS_THREADS
ENTRY_THREADS = plan_numba.ENTRY_THREADS
FUSED_MAX_BS = plan_numba.FUSED_MAX_BS
ITEMS = plan_numba.ITEMS
BLOCKS_PER_SM = 4  # resident blocks per SM when the occupancy API cannot say (plan.cu's ENTRY_MIN_BLOCKS)
# The simulator runs one Python thread per CUDA thread and one block after another: the same kernels with
# small blocks keep CI fast and also exercise multi-row chunks and the grid-stride loop on small cases
# (LaunchConfig.simulator_threads changes them at bind).
SIMULATOR_THREADS = 32
SIMULATOR_SMS = 1
STEP_CACHE_SIZE = 64  # per-step device arrays kept per planner, keyed by (pointer, length)


def _occupancy(kernel, threads: int) -> int:
    """Resident blocks per SM of a compiled kernel (driver occupancy API, current context); the constant
    ``BLOCKS_PER_SM`` where this numba-cuda cannot say."""
    try:
        overload = next(iter(kernel.overloads.values()))
        from numba.cuda.cudadrv.devices import get_context

        func = overload._codelibrary.get_cufunc()
        return max(1, int(get_context().get_active_blocks_per_multiprocessor(func, threads, 0)))
    except Exception:  # noqa: BLE001 - an internal API: fall back, never fail the bind
        return BLOCKS_PER_SM


class _FastLaunch:
    """A pre-specialized kernel launched through ``cuda.core.launch`` with its arguments marshalled once.

    Numba's ``kernel[grid, block, stream](*args)`` types and converts all 32 arguments on every call; here the
    static ones are converted once (by the kernel's own ``_prepare_args``) and a call only lays out the seven
    per-step words (``STEP_FIELDS`` first, ``STEP_TAIL`` last). Built only when the layout of a 1-D int32 device array argument is the one this class
    writes (checked at bind); otherwise the backend keeps numba's ordinary launch.
    """

    def __init__(self, dispatcher, static_args: tuple, probe):
        from cuda.core import LaunchConfig, launch

        from numba.cuda._compat import CUDA_CORE_GE_1_0

        self._overload = overload = next(iter(dispatcher.overloads.values()))
        self._launch = launch
        self._config_cls, self._cooperative_key = LaunchConfig, (
            "is_cooperative" if CUDA_CORE_GE_1_0 else "cooperative_launch")
        types = overload.argument_types
        n_step, n_tail = len(plan_numba.STEP_FIELDS), len(plan_numba.STEP_TAIL)
        if len(types) != len(plan_numba.PARAMS) or len(static_args) != len(types) - n_step - n_tail:
            raise ValueError("unexpected kernel signature")
        got: list = []
        overload._prepare_args(types[0], probe, 0, [], got)  # a 1-D int32 device array (a step array's words)
        if got != self.array_words(probe.device_ctypes_pointer.value, probe.shape[0]):
            raise ValueError(f"unexpected array argument layout: {got}")
        static: list = []
        for ty, val in zip(types[n_step:len(types) - n_tail], static_args):
            retr: list = []
            overload._prepare_args(ty, val, 0, retr, static)
            if retr:
                raise ValueError("an argument needs a copy back")
        self._static = tuple(static)
        self._kernel = overload._codelibrary.get_cufunc().kernel  # loads the module in the current context
        self._configs: dict = {}

    @staticmethod
    def array_words(ptr: int, n: int) -> list:
        """What numba passes for a 1-D contiguous int32 array of ``n`` elements (a step array as its int32
        words, plan_numba.load_int): meminfo, parent, size, itemsize, data, shape, strides."""
        return [0, 0, n, 4, ptr, n, 4]

    @staticmethod
    def view_words(view) -> list:
        """:meth:`array_words` of a per-step int32 or int64 view: its int32 words (two an int64 element)."""
        n = view.shape[0] * (view.dtype.itemsize // 4)
        return [0, 0, n, 4, view.ptr, n, 4]

    def config(self, grid: int, block: int):
        key = (grid, block)
        cfg = self._configs.get(key)
        if cfg is None:
            cfg = self._configs[key] = self._config_cls(grid=grid, block=block, shmem_size=0,
                                                        **{self._cooperative_key: False})
        return cfg

    def __call__(self, stream, config, step_words: list, tail_words: list) -> None:
        self._launch(stream, config, self._kernel, *step_words, *self._static, *tail_words)


def _host_flat(view) -> np.ndarray:
    """Simulator: the flat 1-D view of a host 2-D array (row stride kept), as the kernels index it."""
    arr = view.host
    return np.lib.stride_tricks.as_strided(arr, shape=(flat_len(view),), strides=(arr.itemsize,),
                                           writeable=False)


def _host_table(view) -> np.ndarray:
    """Simulator: the index's int32 table as the kernels index it (a 2-D table flat, row stride kept)."""
    return _host_flat(view) if len(view.shape) == 2 else view.host


def _table_len(view) -> int:
    return flat_len(view) if len(view.shape) == 2 else view.shape[0]


class Bound:
    def __init__(self, static: StaticArgs, launch: LaunchConfig = DEFAULT_LAUNCH):
        s = static
        self.static = s
        self.device_id = s.device_id
        has_lut = s.full_to_swa_index_mapping is not None
        has_pool = s.req_to_verify_expected_tokens is not None
        lut, pool = s.full_to_swa_index_mapping, s.req_to_verify_expected_tokens
        self._index = index = s.index
        self.fused_max_bs = FUSED_MAX_BS if launch.fused_max_bs is None else min(launch.fused_max_bs, FUSED_MAX_BS)
        self._launchers: dict[int, tuple] = {}
        self._step_arrays: dict[tuple[int, int], object] = {}
        self._fast = None  # (fused, rows, entries) _FastLaunch, on a GPU where numba-cuda allows it
        n_scratch = plan_numba.scratch_words(s.write_req_capacity)
        if SIMULATOR:
            self._gpu = None
            if launch.simulator_threads == "gpu":
                self.rows_threads, self.entry_threads = ROWS_THREADS, ENTRY_THREADS
            else:
                self.rows_threads = self.entry_threads = launch.simulator_threads or SIMULATOR_THREADS
            sms = SIMULATOR_SMS
            kernels = plan_numba.plan_kernels(has_lut, has_pool, self.rows_threads, self.entry_threads, index.form,
                                              s.padding_slot)
            self.scratch = np.zeros(n_scratch, dtype=np.int64)
            inp = cuda.In  # inputs are copied in only: a read-only caller array is never written back
            self._dummy_i32 = inp(np.zeros(1, np.int32))  # kv_indptr without a page list
            index_values = self._index_values(index)
            lut_a = inp(lut.host if has_lut else np.zeros(1, np.int64))
            pool_a = inp(_host_flat(pool) if has_pool else np.zeros(1, np.int32))
            out = {name: getattr(s, name).host for name in _OUTPUTS}
            cursors_a = s.verify_cursors.host if s.sample else np.zeros(1, np.int64)
            occupancy = (BLOCKS_PER_SM, BLOCKS_PER_SM)
        else:
            self._gpu = cuda.gpus[self.device_id]
            self.rows_threads, self.entry_threads = ROWS_THREADS, ENTRY_THREADS
            with self._gpu:
                kernels = plan_numba.plan_kernels(has_lut, has_pool, self.rows_threads, self.entry_threads,
                                                  index.form, s.padding_slot)
                sms = int(self._gpu.MULTIPROCESSOR_COUNT)
                # Head words must start at zero; every launch leaves them so. A synchronous copy, at bind only.
                self.scratch = cuda.to_device(np.zeros(n_scratch, dtype=np.int64))
                self._dummy_i32 = cuda.to_device(np.zeros(1, np.int32))  # kv_indptr without a page list
                index_values = self._index_values(index)
                lut_a = (device_array(lut.ptr, lut.shape[0], np.int64, owner=lut.owner) if has_lut
                         else cuda.to_device(np.zeros(1, np.int64)))
                pool_a = (device_array(pool.ptr, flat_len(pool), np.int32, owner=pool.owner) if has_pool
                          else cuda.to_device(np.zeros(1, np.int32)))
                out = {}
                for name in _OUTPUTS:
                    v = getattr(s, name)
                    out[name] = device_array(v.ptr, v.shape[0], v.dtype, owner=v.owner)
                cur = s.verify_cursors
                cursors_a = (device_array(cur.ptr, cur.shape[0], np.int64, owner=cur.owner) if s.sample
                             else cuda.to_device(np.zeros(1, np.int64)))  # never read with sample = 0
                occupancy = (_occupancy(kernels[0], self.entry_threads), _occupancy(kernels[2], self.entry_threads))
        self._fused, self._rows, self._entries = kernels
        self.grid_fused = entry_grid(s.verify_capacity, sms, occupancy[0], self.entry_threads)
        self.grid = entry_grid(s.verify_capacity, sms, occupancy[1], self.entry_threads)  # the entries grid
        values = dict(
            rp_bound=s.max_reqs, pool_rows=s.pool_rows, lut=lut_a, lut_len=0 if lut is None else lut.shape[0],
            pool=pool_a,
            pool_row_stride=0 if pool is None else pool.strides[0], pool_cols=0 if pool is None else pool.shape[1],
            token_offset=s.kv_token_id_vs_position_offset, window=s.swa_window_size,
            padding_rows_carry_tokens=int(s.padding_rows_carry_tokens), verify_capacity=s.verify_capacity,
            write_req_capacity=s.write_req_capacity,
            slots=out["verify_slot_indices"], expected=out["verify_expected_tokens"],
            positions=out["verify_expected_positions"], prevs=out["verify_prev_slot_indices"],
            num_valid=out["verify_num_valid"], enable=out["enable"], status=out["status"],
            write_offsets=out["write_offsets"], seeds=out["write_seed_slot_indices"],
            write_num_valid_reqs=out["write_num_valid_reqs"], scratch=self.scratch,
            cursors=cursors_a, sample=int(s.sample), **index_values,
        )
        # The launch arguments between the per-step ones, in PlanParams order.
        fields = plan_numba.PARAM_FIELDS
        self._static_names = fields[len(plan_numba.STEP_FIELDS):len(fields) - len(plan_numba.STEP_TAIL)]
        self._values = values
        self._static_args = tuple(values[name] for name in self._static_names)
        if not SIMULATOR and launch.numba_fast_launch:
            with self._gpu:
                try:
                    self._fast = tuple(_FastLaunch(k, self._static_args, self._dummy_i32) for k in kernels)
                    self._fast_configs = (self._fast[0].config(self.grid_fused, self.entry_threads),
                                          self._fast[1].config(1, self.rows_threads),
                                          self._fast[2].config(self.grid, self.entry_threads))
                    self._dummy_words = _FastLaunch.array_words(self._dummy_i32.device_ctypes_pointer.value, 1)
                except Exception:  # noqa: BLE001 - internal numba-cuda / cuda.core API: numba's launch instead
                    self._fast = None

    def _index_values(self, index: KVIndex) -> dict:
        """The index's kernel arguments (plan_numba.INDEX_FIELDS): its table as a flat array of int32 words (two
        an entry for an int64 paged table, ``table_wide``), an int64 kv_indptr as its int32 words
        (``kv_indptr_wide``), the key stride and bounds (SPEC 3.8)."""
        t, ptr = index.table, index.kv_indptr
        words = 1 if ptr is None else ptr.dtype.itemsize // 4
        if SIMULATOR:
            table = cuda.In(_host_table(t).view(np.int32))
            indptr = self._dummy_i32 if ptr is None else cuda.In(ptr.host.view(np.int32))
        else:
            table = device_array(t.ptr, _table_len(t) * (t.dtype.itemsize // 4), np.int32, owner=t.owner)
            indptr = (self._dummy_i32 if ptr is None
                      else device_array(ptr.ptr, ptr.shape[0] * words, np.int32, owner=ptr.owner))
        return dict(req_to_token=table, r2t_row_stride=index.key_stride, max_seq_len=index.max_seq_len,
                    page_size=index.page_size, kv_indptr=indptr, kv_indptr_wide=int(words == 2),
                    kv_nnz=t.shape[0] if index.form == FORM_PAGES else 0, table_wide=index.table_wide)

    def _step_static_args(self, index: KVIndex) -> tuple:
        """The bound arguments with a step's own index in place of the bound one."""
        values = dict(self._values, **self._index_values(index))
        return tuple(values[name] for name in self._static_names)

    def _launcher(self, stream: int, plain: bool = False) -> tuple:
        """The three configured kernels for ``stream`` (a raw handle); made once per handle on a GPU.
        With the fast path: ``(stream object,)`` for ``cuda.core.launch``."""
        key = (stream, plain)  # plain: numba's own launch even where the fast path is bound
        pair = self._launchers.get(key)
        if pair is not None:
            return pair
        # The simulator has no external streams and runs every launch synchronously.
        stream_obj = 0 if (SIMULATOR or stream == 0) else cuda.external_stream(stream)
        if self._fast is not None and not plain:
            from numba.cuda.cudadrv import driver

            pair = (driver._to_core_stream(stream_obj),)
            self._launchers[key] = pair
            return pair
        with warnings.catch_warnings():
            # Small grids are by design here (one block for the rows): silence numba's low-occupancy warning.
            warnings.simplefilter("ignore", PerformanceWarning)
            pair = (
                self._fused[self.grid_fused, self.entry_threads, stream_obj],
                self._rows[1, self.rows_threads, stream_obj],
                self._entries[self.grid, self.entry_threads, stream_obj],
            )
        if not SIMULATOR:  # simulator kernels keep their configuration on the shared kernel object: redo it
            self._launchers[key] = pair
        return pair

    def _step_array(self, view):
        """Device array over a per-step ``[bs]`` int32 or int64 input as its int32 words (plan_numba.load_int),
        cached by (pointer, words).

        Safe without holding the caller's array: the device array is only a pointer and a length on this
        planner's device, so a new array at the same address is described exactly the same way.
        """
        key = (view.ptr, view.shape[0] * (view.dtype.itemsize // 4))
        a = self._step_arrays.get(key)
        if a is None:
            if len(self._step_arrays) >= STEP_CACHE_SIZE:
                self._step_arrays.clear()
            a = self._step_arrays[key] = device_array(view.ptr, key[1], np.int32)
        return a

    def launch(self, step: StepArgs, stream: int) -> None:
        wide = _step_wide(step)
        if SIMULATOR:
            static_args = self._static_args if step.index is None else self._step_static_args(step.index)

            def inp(v):  # a step array's int32 words, copied in only
                return cuda.In(v.host.view(np.int32))
            vl = self._dummy_i32 if step.valid_lens is None else inp(step.valid_lens)
            rpi = inp(step.req_pool_indices)
            q = rpi if step.pool_indices is None else inp(step.pool_indices)
            args = (rpi, inp(step.prefix_lens), inp(step.extend_seq_lens), vl,
                    step.bs) + static_args + (q, wide)
            self._run(self._launcher(0), args, step.bs)
            return
        if self._fast is not None and step.index is None:
            # Six per-step words; everything else was marshalled at bind.
            words = _FastLaunch.view_words
            vl = self._dummy_words if step.valid_lens is None else words(step.valid_lens)
            rpi = words(step.req_pool_indices)
            q = step.pool_indices
            tail_words = (rpi if q is None else words(q)) + [ctypes.c_int64(wide)]
            step_words = (rpi + words(step.prefix_lens) + words(step.extend_seq_lens)
                          + vl + [ctypes.c_int64(step.bs)])
            (stream_obj,) = self._launcher(stream)
            fused, rows, entries = self._fast
            cfg_fused, cfg_rows, cfg_entries = self._fast_configs
            with self._gpu:  # the kernels' context (the buffers' device), whatever the current device is
                if step.bs <= self.fused_max_bs:
                    fused(stream_obj, cfg_fused, step_words, tail_words)
                else:
                    rows(stream_obj, cfg_rows, step_words, tail_words)
                    entries(stream_obj, cfg_entries, step_words, tail_words)
            return
        with self._gpu:  # launch on the device holding the buffers, whatever the current device is
            static_args = self._static_args if step.index is None else self._step_static_args(step.index)
            vl = self._dummy_i32 if step.valid_lens is None else self._step_array(step.valid_lens)
            rpi = self._step_array(step.req_pool_indices)
            q = rpi if step.pool_indices is None else self._step_array(step.pool_indices)
            args = (rpi, self._step_array(step.prefix_lens),
                    self._step_array(step.extend_seq_lens), vl, step.bs) + static_args + (q, wide)
            # A step's own index: numba's launch, which lays out every argument (the fast path marshalled the
            # bound ones at bind)
            self._run(self._launcher(stream, plain=step.index is not None), args, step.bs)

    def _run(self, launchers: tuple, args: tuple, bs: int) -> None:
        fused, rows, entries = launchers
        if bs <= self.fused_max_bs:
            fused(*args)
        else:
            rows(*args)
            entries(*args)

    def warmup(self) -> None:
        """Load the kernels' module on the planner's device (compilation happened at bind)."""
        if SIMULATOR:
            return
        with self._gpu:
            for kernel in (self._fused, self._rows, self._entries):
                for overload in kernel.overloads.values():
                    overload.bind()


_OUTPUTS = (
    "verify_slot_indices", "verify_expected_tokens", "verify_expected_positions", "verify_prev_slot_indices",
    "verify_num_valid", "enable", "status", "write_offsets", "write_seed_slot_indices", "write_num_valid_reqs",
)


def _step_wide(step: StepArgs) -> int:
    """The kernels' ``step_wide``: StepArgs.step_wide, with an absent expected_token_pool_indices' bit set as
    req_pool_indices' (the kernels then read that array in its place, plan_numba's docstring)."""
    wide = step.step_wide
    if step.pool_indices is None and wide & plan_numba.STEP_WIDE_REQ_POOL_INDICES:
        wide |= plan_numba.STEP_WIDE_EXPECTED_TOKEN_POOL_INDICES
    return wide


def bind(static: StaticArgs, launch: LaunchConfig = DEFAULT_LAUNCH) -> Bound:
    return Bound(static, launch)
