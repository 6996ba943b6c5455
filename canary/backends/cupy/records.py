"""CuPy backend of the canary records: the kernels of ``kernels/records.cu`` (write, verify, scatter) through NVRTC.

``bind`` packs everything fixed for a canary (state pointers, real-KV sources) into the parameter words of
records.cu's ``WriteParams`` / ``VerifyParams`` (``records_layout``); a call writes the per-call words (plan and
entry pointers, capacities, the tag) and issues one launch on the caller's stream: no allocation, compile,
module load or host sync after ``warmup``, so calls can be captured in a CUDA graph.
"""
from __future__ import annotations

import numpy as np

from ...contract.realkv import RealKV
from ...contract.ring import KernelTag, encode_tag
from ...contract.state import StateViews
from ..args import DEFAULT_LAUNCH, LaunchConfig, RecordVerifyArgs, RecordWriteArgs, ScatterArgs
from ...contract.records_layout import (
    APPEND_FIELDS, MAX_SOURCES, REAL_KV_FIELDS, SCATTER_FIELDS, SCATTER_THREADS, VERIFY_FIELDS, VERIFY_THREADS,
    LOOKBACK_ITEMS, WRITE_FIELDS, WRITE_THREADS, lookback_words, verify_grid, write_grid,
)
from . import OnDevice, Params, Streams, cupy, load_functions, raw_module

NAME = "cupy"
ON_DEVICE = True
# The manager may capture an eager step's launches (plan, verify, write, report) into a CUDA graph of its own
# and replay it (canary/manager/eager.py): CuPy launches record into a capture; a Numba launch host-syncs
# its arguments, which a capture forbids, so the other backends leave this out (False).
EAGER_GRAPHS = True

_DTYPE_SUFFIX = {np.dtype(np.int64): "i64", np.dtype(np.int32): "i32"}


def _ptr(view) -> int:
    return 0 if view is None else view.ptr


def state_words(state: StateViews) -> dict:
    return dict(
        canary=state.canary_buffer.ptr, num_slots=state.num_slots, slot_stride=state.slot_stride_bytes,
        ring=state.ring.ptr, ring_row_stride=state.ring_row_stride,
        ring_capacity=state.ring_capacity, ring_write_index=state.ring_write_index.ptr,
        slot_run_counter=state.slot_run_counter.ptr, kernel_run_counter=state.kernel_run_counter.ptr,
        check_flags=state.check_flags.ptr, tag=0,
        reported_slots=0 if state.reported_slots is None else state.reported_slots.ptr,
    )


def records_defines(state: StateViews) -> tuple:
    """records.cu's defines for the records' ``padding_slot`` (SPEC 3.2 "No reserved slot"): one module each."""
    return (("CANARY_PADDING_NEG", "1"),) if state.padding_slot == -1 else ()


def real_kv_words(real_kv: RealKV) -> dict:
    """records.cu's ``RealKVParams``: ``num_sources = 0`` in mode NONE (nothing read, nothing compared)."""
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


class Bound:
    def __init__(self, state: StateViews, real_kv: RealKV, launch: LaunchConfig = DEFAULT_LAUNCH):
        self.state = state
        self.real_kv = real_kv  # keeps the sources alive while their pointers sit in the params
        self.device_id = state.device_id
        fixed = self._fixed = {**state_words(state), **real_kv_words(real_kv)}
        # The write's look-back scratch (records.cu look_back): zero now and again after every launch. One a
        # canary, so its writes must not run concurrently on two streams (they share the records anyway).
        with cupy.cuda.Device(self.device_id):
            self._lookback = cupy.zeros(lookback_words(LOOKBACK_ITEMS), dtype=np.uint64)
        self._write_fixed = {**fixed, "lookback": self._lookback.data.ptr, "lookback_items": LOOKBACK_ITEMS}
        self._write = Params(WRITE_FIELDS, self._write_fixed)
        self._verify = Params(VERIFY_FIELDS, fixed)
        self._streams = Streams()
        self._fns = None

    def warmup(self) -> None:
        """Compile (once per process) and load the module on this device; later calls only launch."""
        if self._fns is not None:
            return
        fns, per_sm, self._sms = load_functions(
            self.device_id, "records", (("canary_write", WRITE_THREADS), ("canary_verify", VERIFY_THREADS)),
            records_defines(self.state))
        self._write_blocks_per_sm, self._verify_blocks_per_sm = per_sm
        self._fns = fns

    @staticmethod
    def _write_words(a: RecordWriteArgs) -> dict:
        return dict(
            tag=encode_tag(KernelTag.WRITE, a.launch_tag), write_offsets=a.plan.write_offsets.ptr,
            write_seed_slot_indices=a.plan.write_seed_slot_indices.ptr,
            write_num_valid_reqs=a.plan.write_num_valid_reqs.ptr,
            write_req_capacity=a.plan.write_seed_slot_indices.shape[0], out_cache_loc=a.out_cache_loc.ptr,
            input_ids=a.input_ids.ptr, positions=a.positions.ptr, num_entries=a.out_cache_loc.shape[0],
            expected_input_ids=_ptr(a.expected_input_ids), expected_positions=_ptr(a.expected_positions),
            entry_wide=a.entry_wide,
        )

    @staticmethod
    def _verify_words(a: RecordVerifyArgs) -> dict:
        return dict(
            tag=encode_tag(KernelTag.VERIFY, a.launch_tag), verify_slot_indices=a.plan.verify_slot_indices.ptr,
            verify_expected_tokens=a.plan.verify_expected_tokens.ptr,
            verify_expected_positions=a.plan.verify_expected_positions.ptr,
            verify_prev_slot_indices=a.plan.verify_prev_slot_indices.ptr,
            verify_capacity=a.plan.verify_slot_indices.shape[0],
            verify_num_valid=a.plan.verify_num_valid.ptr, enable=a.plan.enable.ptr,
        )

    def write(self, a: RecordWriteArgs, stream: int) -> None:
        if self._fns is None:
            self.warmup()
        r_cap = a.plan.write_seed_slot_indices.shape[0]
        self._write.set(self._write_words(a))
        with OnDevice(self.device_id):
            grid = write_grid(r_cap, self._sms, self._write_blocks_per_sm)
            self._fns[0]((grid,), (WRITE_THREADS,), self._write.args, stream=self._streams.get_stream(stream))

    def verify(self, a: RecordVerifyArgs, stream: int) -> None:
        if self._fns is None:
            self.warmup()
        cap = a.plan.verify_slot_indices.shape[0]
        self._verify.set(self._verify_words(a))
        grid = verify_grid(cap, self._sms, self._verify_blocks_per_sm)
        with OnDevice(self.device_id):
            self._fns[1]((grid,), (VERIFY_THREADS,), self._verify.args, stream=self._streams.get_stream(stream))

    # A call repeated over the same arrays (CanaryRecords keeps it, callviews.Reuse) launches with words of its
    # own, packed once: no argument is converted again.
    def prepare_write(self, a: RecordWriteArgs) -> tuple:
        if self._fns is None:
            self.warmup()
        params = Params(WRITE_FIELDS, {**self._write_fixed, **self._write_words(a)})
        grid = write_grid(a.plan.write_seed_slot_indices.shape[0], self._sms, self._write_blocks_per_sm)
        return self._fns[0], (grid,), (WRITE_THREADS,), params.args, params

    def prepare_verify(self, a: RecordVerifyArgs) -> tuple:
        if self._fns is None:
            self.warmup()
        params = Params(VERIFY_FIELDS, {**self._fixed, **self._verify_words(a)})
        grid = verify_grid(a.plan.verify_slot_indices.shape[0], self._sms, self._verify_blocks_per_sm)
        return self._fns[1], (grid,), (VERIFY_THREADS,), params.args, params

    def launch_prepared(self, prepared: tuple, stream: int) -> None:
        fn, grid, block, args, _ = prepared
        st = self._streams.get(stream) or self._streams.get_stream(stream)
        dev = cupy.cuda.runtime.getDevice()
        if dev != self.device_id:
            cupy.cuda.runtime.setDevice(self.device_id)
            try:
                fn(grid, block, args, stream=st)
            finally:
                cupy.cuda.runtime.setDevice(dev)
        else:
            fn(grid, block, args, stream=st)


def bind(state: StateViews, real_kv: RealKV, launch: LaunchConfig = DEFAULT_LAUNCH) -> Bound:
    return Bound(state, real_kv, launch)


_SCATTER_STREAMS = Streams()
_SCATTER_FNS: dict[tuple[int, str], object] = {}


def _scatter_fn(device_id: int, suffix: str):
    """The loaded scatter kernel for a device (loaded once: later calls may sit inside a graph capture)."""
    fn = _SCATTER_FNS.get((device_id, suffix))
    if fn is None:
        with cupy.cuda.Device(device_id):
            fn = raw_module("records").get_function(f"canary_scatter_{suffix}").kernel
            _SCATTER_FNS[(device_id, suffix)] = fn
    return fn


def _scatter_values(a: ScatterArgs) -> dict:
    pool = a.pool
    return dict(
        pool=pool.ptr, pool_rows=pool.shape[0], pool_cols=pool.shape[1],
        pool_row_stride=a.pool_row_stride,
        req_pool_indices=a.req_pool_indices.ptr, bs=a.req_pool_indices.shape[0], tokens=a.tokens.ptr,
        num_tokens=a.tokens.shape[0], token_offsets=a.token_offsets.ptr, column_starts=a.column_starts.ptr,
        column_offset=a.column_offset,
    )


def scatter(a: ScatterArgs, stream: int) -> None:
    """One scatter launch: one block per batch row (grid from ``bs``, a capacity: graph-safe)."""
    values = _scatter_values(a)
    params = Params(SCATTER_FIELDS, values)
    fn = _scatter_fn(a.pool.device_id, _DTYPE_SUFFIX[a.tokens.dtype])
    with OnDevice(a.pool.device_id):
        fn((max(values["bs"], 1),), (SCATTER_THREADS,), params.args, stream=_SCATTER_STREAMS.get_stream(stream))


class PreparedAppend:
    """``kernels/records.cu``'s ``canary_append_tokens`` over fixed staging (the plan's pool rows ``q`` and valid
    lengths ``valid``, ``[B]`` int64 device arrays) into ``pool``: a launch names the tokens' device pointer, their
    dtype and the row count ``n`` (canary/manager/staging.py, ``_AppendCall``)."""

    def __init__(self, pool, q, valid):
        self.device_id = pool.device_id
        stride = pool.strides[0] if pool.shape[0] > 1 else pool.shape[1]
        self._params = Params(APPEND_FIELDS, dict(pool=pool.ptr, pool_rows=pool.shape[0], pool_cols=pool.shape[1],
                                                  pool_row_stride=stride, q=q.ptr, valid=valid.ptr, tokens=0, n=0))
        self._words, self._args = self._params.words, self._params.args
        self._tokens, self._n = APPEND_FIELDS.index("tokens"), APPEND_FIELDS.index("n")
        with cupy.cuda.Device(self.device_id):
            module = raw_module("records")
            self._fns = {np.dtype(np.int64): module.get_function("canary_append_tokens_i64").kernel,
                         np.dtype(np.int32): module.get_function("canary_append_tokens_i32").kernel}
        self._streams = Streams()

    def launch(self, tokens_ptr: int, dtype, n: int, stream: int) -> None:
        w = self._words
        w[self._tokens], w[self._n] = tokens_ptr, n
        with OnDevice(self.device_id):
            self._fns[dtype]((max(-(-n // SCATTER_THREADS), 1),), (SCATTER_THREADS,), self._args,
                             stream=self._streams.get_stream(stream))


def prepare_append(pool, q, valid) -> PreparedAppend:
    return PreparedAppend(pool, q, valid)


class PreparedScatter:
    """A scatter over fixed arrays whose row and token counts change per call (the manager's staging area):
    packed once, a launch rewrites two words."""

    def __init__(self, a: ScatterArgs):
        self._params = Params(SCATTER_FIELDS, _scatter_values(a))
        self._words, self._args = self._params.words, self._params.args
        self._bs, self._n = SCATTER_FIELDS.index("bs"), SCATTER_FIELDS.index("num_tokens")
        self._fn = _scatter_fn(a.pool.device_id, _DTYPE_SUFFIX[a.tokens.dtype])
        self.device_id = a.pool.device_id

    def launch(self, bs: int, num_tokens: int, stream: int) -> None:
        w = self._words
        w[self._bs], w[self._n] = bs, num_tokens
        with OnDevice(self.device_id):
            self._fn((max(bs, 1),), (SCATTER_THREADS,), self._args, stream=_SCATTER_STREAMS.get_stream(stream))


def prepare_scatter(a: ScatterArgs) -> PreparedScatter:
    return PreparedScatter(a)
