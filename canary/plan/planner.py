"""The public entry points: ``CanaryPlanner`` (bind once, plan every step) and ``launch_canary_plan_kernels``."""
from __future__ import annotations

import dataclasses
import inspect
from collections import OrderedDict
from typing import Any

import numpy as np

from .. import backends
from ..backends.args import DEFAULT_LAUNCH, LaunchConfig, StaticArgs, StepArgs
from ..errors import PlanStatus, check_keywords, fail, worded
from ..interop.adapter import INT_WIDTHS, ArrayView, as_view, check_same_device, check_view
from ..interop.callviews import CallViews, Reuse, fingerprint
from ..interop.hostcopy import to_host
from ..interop.overlap import Spans, check_disjoint, spans
from ..contract.plans import (
    INT32, INT64, VERIFY_ENTRY_FIELDS, VERIFY_SCALAR_FIELDS, WRITE_FIELDS, VerifyPlan, WritePlan, check_padding_slot,
    raise_for_status, view_verify_plan, view_write_plan,
)
from ..contract.kvindex import FORM_PAGES, FORM_TOKENS
from .index import INDEX_ARRAYS, bind_index, first_bad_row_of, step_index


# The bound of the int arguments that enter the plan's int64 index arithmetic: positions (< 2**31) plus or minus
# one of them cannot overflow.
MAX_INDEX_ARG = 1 << 62


def _int_arg(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise fail(TypeError, f"{name}: expected an int, got {type(value).__name__}")
    return int(value)


def bind_static(
    *,
    verify_plan_out: VerifyPlan,
    write_plan_out: WritePlan,
    req_to_token: Any = None, block_table: Any = None, kv_indptr: Any = None, kv_indices: Any = None,
    page_size: int | None = None,
    swa_window_size: int = 0,
    full_to_swa_index_mapping: Any = None,
    req_to_verify_expected_tokens: Any = None,
    kv_token_id_vs_position_offset: int = 0,
    padding_rows_carry_tokens: bool = False,
    verify_capacity: int | None = None,
    max_batch_size: int | None = None,
    on_overflow: str = "sample",
    padding_slot: int = 0,
) -> StaticArgs:
    """Validate and view everything a planner binds once (SPEC 3.3; the index in one of its forms, 3.8). Raises
    ``ValueError`` / ``TypeError``."""
    vp = view_verify_plan(verify_plan_out, as_view, name="verify_plan_out", writable=True)
    wp = view_write_plan(write_plan_out, as_view, name="write_plan_out", writable=True)
    cap, r_cap = vp.capacity, wp.capacity
    if verify_capacity is not None and _int_arg("verify_capacity", verify_capacity) != cap:
        raise fail(
            ValueError,
            f"verify_capacity: expected verify_plan_out.verify_slot_indices.shape[0] = {cap}, got {verify_capacity}",
        )
    index = bind_index(req_to_token=req_to_token, block_table=block_table, kv_indptr=kv_indptr,
                       kv_indices=kv_indices, page_size=page_size)

    window = _int_arg("swa_window_size", swa_window_size)
    if not 0 <= window <= MAX_INDEX_ARG:  # the plan's window arithmetic is int64 (SPEC 3.3)
        raise fail(ValueError, f"swa_window_size: expected 0 (full attention) or a window in [1, 2**62], got {window}")
    lut = None
    if full_to_swa_index_mapping is not None:
        lut = check_view(as_view(full_to_swa_index_mapping, "full_to_swa_index_mapping"), dtype=INT64, ndim=1)
    elif window > 0:
        raise fail(
            ValueError,
            f"full_to_swa_index_mapping: expected a [lut_len] int64 array with swa_window_size = {window}, got None",
        )
    pool = None
    if req_to_verify_expected_tokens is not None:
        pool = check_view(as_view(req_to_verify_expected_tokens, "req_to_verify_expected_tokens"), dtype=np.int32,
                          ndim=2)
    offset = _int_arg("kv_token_id_vs_position_offset", kv_token_id_vs_position_offset)
    if not -MAX_INDEX_ARG <= offset <= MAX_INDEX_ARG:  # position + offset is int64 (SPEC 3.3)
        raise fail(ValueError, f"kv_token_id_vs_position_offset: expected an int in [-2**62, 2**62], got {offset}")
    if not isinstance(padding_rows_carry_tokens, (bool, np.bool_)):
        raise fail(TypeError, f"padding_rows_carry_tokens: expected a bool, got "
                              f"{type(padding_rows_carry_tokens).__name__} {padding_rows_carry_tokens!r}")
    padding_slot = check_padding_slot(padding_slot)

    mbs = r_cap if max_batch_size is None else _int_arg("max_batch_size", max_batch_size)
    if mbs < 0:
        raise fail(ValueError, f"max_batch_size: expected >= 0, got {mbs}")
    cursors = _bind_sampling(on_overflow, verify_plan_out, cap=cap, max_batch_size=mbs, max_reqs=None if
                             index.form == FORM_PAGES else index.rows, max_seq_len=index.max_seq_len)
    outputs = vp.all() + wp.all() + ([cursors] if cursors is not None else [])
    inputs = index.arrays + [v for v in (lut, pool) if v is not None]
    device_id = check_same_device(outputs + inputs)
    out_spans = spans(outputs)
    check_disjoint(out_spans, spans(inputs))
    return StaticArgs(
        req_to_token=index.table if index.form == FORM_TOKENS else None,
        kv_index=index if index.paged else None,
        full_to_swa_index_mapping=lut,
        req_to_verify_expected_tokens=pool,
        swa_window_size=window,
        kv_token_id_vs_position_offset=offset,
        padding_rows_carry_tokens=bool(padding_rows_carry_tokens),
        **{f: getattr(vp, f) for f in VERIFY_ENTRY_FIELDS + VERIFY_SCALAR_FIELDS},
        **{f: getattr(wp, f) for f in WRITE_FIELDS},
        verify_capacity=cap,
        write_req_capacity=r_cap,
        max_batch_size=mbs,
        verify_cursors=cursors,
        device_id=device_id,
        output_spans=Spans(out_spans, device_id),
        padding_slot=padding_slot,
    )


ON_OVERFLOW = ("sample", "skip")


def _bind_sampling(on_overflow: Any, verify_plan_out: VerifyPlan, *, cap: int, max_batch_size: int,
                   max_reqs: int | None, max_seq_len: int) -> ArrayView | None:
    """Check ``on_overflow`` and, when sampling, view ``verify_cursors`` (SPEC 3.7); ``None`` for ``"skip"``.
    ``max_reqs``: the index's rows (``None`` for a page list, whose cursors may have any length: SPEC 3.8)."""
    if on_overflow not in ON_OVERFLOW:
        raise fail(ValueError, f"on_overflow: expected 'sample' (verify verify_capacity entries of a step that has "
                               f"more, rotating) or 'skip' (verify none of them), got {on_overflow!r}")
    if on_overflow == "skip":
        return None
    if verify_plan_out.verify_cursors is None:
        rows = "max_reqs" if max_reqs is None else max_reqs  # a page list: the rows req_pool_indices names
        raise fail(ValueError, f"verify_plan_out.verify_cursors: expected a [max_reqs] = [{rows}] int64 array "
                               f"for on_overflow='sample' (the default; allocate it with VerifyPlan.allocate(..., "
                               f"max_reqs={rows})), or on_overflow='skip' (SGLang's: an overflowing step verifies "
                               f"nothing), got None")
    cursors = check_view(as_view(verify_plan_out.verify_cursors, "verify_plan_out.verify_cursors"), dtype=INT64,
                         ndim=1, length=max_reqs, writable=True)
    if cap < 1:
        raise fail(ValueError, f"verify_capacity: expected >= 1 for on_overflow='sample' (a step samples "
                               f"verify_capacity entries), got {cap}; use on_overflow='skip' for a plan that never "
                               f"verifies")
    check_sampling_bound(cap, max_batch_size, max_seq_len)
    return cursors


def check_sampling_bound(cap: int, max_batch_size: int, max_seq_len: int) -> None:
    """The sampled offsets multiply the capacity by a count of entries (at most bs * max_seq_len) in int64."""
    if cap * max(max_batch_size, 1) * max(max_seq_len, 1) >= 1 << 62:
        raise fail(ValueError, f"verify_capacity: expected verify_capacity * max_batch_size * max_seq_len < 2**62 "
                               f"for on_overflow='sample', got {cap} * {max_batch_size} * {max_seq_len}")


_BIND_PARAMETERS = inspect.signature(bind_static).parameters
_REQUIRED = tuple(k for k, p in _BIND_PARAMETERS.items() if p.default is p.empty)


class CanaryPlanner:
    """A reusable planner: binds the static buffers once, then builds a plan per step with :meth:`plan`.

    Static arguments (all keyword-only):

    - ``verify_plan_out`` / ``write_plan_out``: :class:`VerifyPlan` / :class:`WritePlan` over caller arrays;
      ``verify_capacity`` ``C`` and ``write_req_capacity`` ``R`` are their lengths.
    - The index the attention reads, exactly one form (SPEC 3.8): ``req_to_token``, ``[max_reqs, max_seq_len]``
      int32 slot ids (row stride >= ``max_seq_len``); or ``block_table``, ``[max_reqs, max_blocks]`` int32 or int64
      block ids, and ``page_size`` ``S`` (slot ``b * S + p % S``, block 0 = padding); or ``kv_indptr`` (``[>= bs + 1]``
      int32 / int64) and ``kv_indices`` (``[nnz]`` int32 / int64 block ids), rows keyed by batch row, and ``page_size``.
    - ``swa_window_size``: 0 (full attention) or the window ``W > 0`` in tokens (needs the LUT).
    - ``full_to_swa_index_mapping``: ``[lut_len]`` int64 full-pool slot -> SWA-pool slot, or ``None``.
    - ``req_to_verify_expected_tokens``: ``[pool_rows, pool_cols]`` int32 expected token ids, or ``None``.
    - ``kv_token_id_vs_position_offset``: added to a position before indexing the expected-token row
      (0 for a target model, +1 for an EAGLE draft).
    - ``padding_rows_carry_tokens``: where the step's token arrays (``out_cache_loc``, ``input_ids``,
      ``positions``) put the tokens of padding rows (``req_pool_indices == 0``), SPEC 3.2. ``False`` (default,
      SGLang's convention): nowhere among the active rows' tokens (padding rows add no write entries; any
      padding tokens lie past ``write_offsets[bs]``). ``True`` (a fixed-shape batch that keeps finished
      requests' rows in place, anywhere in the batch, tokens and all): a padding row's ``E`` tokens sit at its
      place in batch order, so ``write_offsets`` counts them and the row's seed is
      :data:`~canary.contract.plans.SKIP_SEED`, which makes the canary write skip them. The wrong choice shifts
      every later row's tokens: the canary then reports violations on a clean run.
    - ``padding_slot``: 0 (slot 0 / block 0 are padding) or -1 (real; negatives mark padding): SPEC 3.2.
    - ``verify_capacity``: optional; must equal ``C`` when given.
    - ``max_batch_size``: largest ``bs`` accepted (default ``R``); sizes the planner's scratch.
    - ``on_overflow``: what a step whose verify entries exceed ``C`` does (SPEC 3.7). ``"sample"`` (default):
      verify ``C`` of them, chosen by a rotation kept in ``verify_plan_out.verify_cursors`` so that every cached
      token is verified again within a bounded number of steps; status bit ``SAMPLED``, ``enable`` stays 1.
      ``"skip"`` (SGLang's): verify none, status bit ``OVERFLOW``, ``enable = 0``.
    - ``backend``: ``"auto"``, ``"reference"``, ``"cupy"`` or ``"numba"`` (SPEC 3.5).
    - ``launch_config``: :class:`~canary.LaunchConfig` (the fused kernel's batch limit, simulator block sizes);
      engines keep the default, tests and benchmarks vary it.

    Raises ``ValueError`` / ``TypeError`` for bad arguments (SPEC 3.3: among them outputs sharing memory with
    each other or with an input, named both), ``TypeError`` naming ``CanaryPlanner`` for an unknown or missing
    keyword, :class:`BackendUnavailableError` when the backend's library is missing.
    """

    def __init__(self, *args: Any, backend: str = "auto", launch_config: LaunchConfig = DEFAULT_LAUNCH,
                 **static: Any):
        # Python's own errors would name the internal bind_static
        check_keywords("CanaryPlanner", args, static, ("backend", "launch_config", *_BIND_PARAMETERS), _REQUIRED)
        self._bind(bind_static(**static), backend, launch_config)

    @classmethod
    def _from_static(cls, static: StaticArgs, module, bound) -> "CanaryPlanner":
        """A planner over arguments ``bind_static`` already checked, on ``module`` with ``bound`` (``None``: bind
        now): the one-shot entry point's planner of one call."""
        planner = cls.__new__(cls)
        planner._bind(static, module.NAME, DEFAULT_LAUNCH, module, bound)
        return planner

    def _bind(self, static: StaticArgs, backend: str, launch_config: LaunchConfig, module=None, bound=None) -> None:
        if not isinstance(launch_config, LaunchConfig):
            raise fail(TypeError, f"launch_config: expected a LaunchConfig, got {type(launch_config).__name__}")
        self.static = static
        self.launch_config = launch_config
        self._module = module if module is not None else backends.resolve(backend, static.device_id)
        self.backend = self._module.NAME
        self._bound = bound if bound is not None else self._module.bind(static, launch_config)
        self._step_views: dict = {}  # CallViews' cache: last step's views of the same buffers
        self.last_step: StepArgs | None = None
        self._reuse: Reuse | None = None  # the last checked step (callviews.Reuse), for a call repeating it
        # Host outputs' NumPy arrays: a caller may clear their writeable flag after binding, and the reference
        # would then fail half-way through a plan; plan() reads the flags first (a few attribute reads).
        self._host_outputs = tuple(
            (v.name, v.host, v.host.shape, v.host.strides) for f in _OUTPUT_FIELDS + ("verify_cursors",)
            if (v := getattr(static, f)) is not None and v.device_id < 0 and v.host is not None
        )

    @property
    def verify_capacity(self) -> int:
        return self.static.verify_capacity

    @property
    def write_req_capacity(self) -> int:
        return self.static.write_req_capacity

    @property
    def max_batch_size(self) -> int:
        return self.static.max_batch_size

    def warmup(self) -> None:
        """Compile and load everything a call needs, so that later calls only launch (graph-capturable)."""
        self._bound.warmup()

    def _step(self, rpi, prefix, ext, valid_lens, go: CallViews, pool_indices=None, index_arrays=None) -> StepArgs:
        s = self.static

        def view(obj, name, length=None):
            v = go.view(obj, name)  # last step's view when the same buffer is ordered on the same stream
            shape = v.shape
            dt = v.dtype
            if (dt == INT64 or dt == INT32) and len(shape) == 1 and (length is None or shape[0] == length) and (
                    shape[0] <= 1 or v.strides[0] == 1) and v.ptr % dt.itemsize == 0:
                return v  # the common case, checked in one expression; check_view words any failure
            return check_view(v, dtype=INT_WIDTHS, ndim=1, length=length)  # int32 or int64 each (SPEC 2 (*))

        first = view(rpi, "req_pool_indices")
        bs = first.shape[0]
        views = [first, view(prefix, "prefix_lens", bs), view(ext, "extend_seq_lens", bs)]
        has_pool = s.req_to_verify_expected_tokens is not None
        if has_pool and valid_lens is None:
            raise fail(
                ValueError,
                "req_to_verify_expected_tokens_valid_lens: expected a [bs] int64 array because "
                "req_to_verify_expected_tokens is bound, got None",
            )
        if valid_lens is not None and not has_pool:
            raise fail(
                ValueError,
                "req_to_verify_expected_tokens: expected an expected-token pool because "
                "req_to_verify_expected_tokens_valid_lens was given, got None",
            )
        vl = None
        if valid_lens is not None:
            vl = view(valid_lens, "req_to_verify_expected_tokens_valid_lens", bs)
            views.append(vl)
        q = None
        if pool_indices is not None:
            if not has_pool:
                raise fail(
                    ValueError,
                    "expected_token_pool_indices: expected None because no expected-token pool "
                    "(req_to_verify_expected_tokens) is bound, got an array",
                )
            q = view(pool_indices, "expected_token_pool_indices", bs)
            views.append(q)
        if bs > s.write_req_capacity:
            raise fail(
                ValueError, f"req_pool_indices: expected bs <= write_req_capacity = {s.write_req_capacity}, got bs = {bs}"
            )
        if bs > s.max_batch_size:
            raise fail(ValueError, f"req_pool_indices: expected bs <= max_batch_size = {s.max_batch_size}, got bs = {bs}")
        index = None
        if index_arrays is not None or s.kv_index is not None:  # a page list's kv_indptr is checked every step
            index = step_index(s.index, bs, go.view, **dict(zip(INDEX_ARRAYS[1:], index_arrays or ())))
            if index is not None:
                views += index.arrays
                if s.sample:
                    check_sampling_bound(s.verify_capacity, s.max_batch_size, index.max_seq_len)
        for v in views:
            if v.device_id != s.device_id:
                where = "host memory" if s.device_id < 0 else f"cuda:{s.device_id}"
                raise fail(ValueError, f"{v.name}: expected the plan's device ({where}), got {v.where}")
        return StepArgs(views[0], views[1], views[2], vl, bs, q, index)

    @worded("CanaryPlanner.plan", method=True)
    def plan(
        self,
        *,
        req_pool_indices: Any,
        prefix_lens: Any,
        extend_seq_lens: Any,
        req_to_verify_expected_tokens_valid_lens: Any = None,
        expected_token_pool_indices: Any = None,
        stream: Any = None,
        check: bool = False,
        block_table: Any = None,
        kv_indptr: Any = None,
        kv_indices: Any = None,
    ) -> PlanStatus | None:
        """Build one step's plan into the bound buffers.

        Per-step arrays: ``[bs]`` int32 or int64 each (independently, read as their dtype: SPEC 2 (*); another
        dtype is a ``TypeError``), on the plan's device, not sharing memory with any output (checked
        when a buffer is first seen; the same buffer as last step is not checked again).
        ``expected_token_pool_indices`` (only with an expected-token pool; ``None``: ``req_pool_indices``): the
        pool row each batch row reads, so that an engine can key the pool by request identity rather than by
        the reusable ``req_to_token`` row (SPEC 3.2). ``block_table`` / ``kv_indptr`` / ``kv_indices``: this step's
        index arrays in place of the bound ones (SPEC 3.8; an engine that rebuilds them each step), of the bound
        form only: ``[max_reqs, max_blocks]`` int32 / int64 of the bound shape; ``[>= bs + 1]`` int32 or int64,
        ``[nnz]`` int32 or int64 (either or both). ``stream``: where the
        kernels run (default: the current stream of the library that owns the outputs); host arrays take none
        (``ValueError``). Host outputs made read-only after binding are refused before anything is written.
        Never syncs unless ``check=True``, which syncs and raises :class:`CanaryInputError` on input-fault status
        bits, naming the first offending batch row (recomputed on the host from the inputs), else returns the
        status.
        """
        if check is not False and check is not True and not isinstance(check, np.bool_):
            raise fail(TypeError, f"check: expected a bool, got {type(check).__name__} {check!r}")
        s = self.static
        go = CallViews(s.device_id, stream, s.verify_slot_indices.owner, s.output_spans, self._step_views)
        objs = (req_pool_indices, prefix_lens, extend_seq_lens, req_to_verify_expected_tokens_valid_lens,
                expected_token_pool_indices, block_table, kv_indptr, kv_indices)
        hit = self._reuse
        if hit is not None and not check and go.reusable and hit.matches(objs, go.handle, None):
            self._bound.launch(hit.launch, go.handle)  # the same step buffers as a checked call: no views again
            self.last_step = hit.launch
            return None
        for name, arr, shape, strides in self._host_outputs:
            if not arr.flags.writeable:
                raise fail(ValueError, f"{name}: expected a writable output array, got a read-only "
                                       f"one (its writeable flag was cleared after the planner was bound); set "
                                       f"flags.writeable = True again, or bind writable buffers")
            if arr.shape != shape or arr.strides != strides:
                raise fail(ValueError, f"{name}: expected the shape {shape} and strides {strides} it was bound with, "
                                       f"got {arr.shape} and {arr.strides} (reshaped in place after binding); bind "
                                       f"the planner again")
        index_arrays = objs[5:] if any(a is not None for a in objs[5:]) else None
        step = self._step(req_pool_indices, prefix_lens, extend_seq_lens, req_to_verify_expected_tokens_valid_lens, go,
                          expected_token_pool_indices, index_arrays)
        self._bound.launch(step, go.handle)
        if go.reusable:
            prints = fingerprint(objs)
            self._reuse = None if prints is None else Reuse(objs, prints, go.handle, None, step)
        self.last_step = step  # the manager's report copies the step's req_pool_indices through its view
        if not check:
            return None
        status = PlanStatus(int(to_host(self.static.status.owner)[0]))
        if status & ~(PlanStatus.OVERFLOW | PlanStatus.SAMPLED):
            row, why = first_bad_row_of(self.static, step.index, status, req_pool_indices, prefix_lens,
                                        extend_seq_lens, req_to_verify_expected_tokens_valid_lens,
                                        expected_token_pool_indices)
            raise_for_status(status, row, **({"row_unknown": why} if why else {}))
        return status

_OUTPUT_FIELDS = VERIFY_ENTRY_FIELDS + VERIFY_SCALAR_FIELDS + WRITE_FIELDS


# The one-shot entry's cache: device backends' bound launchers, which are costly to make (scratch allocation,
# argument packing) and are made here over views stripped of their arrays (addresses, layouts and device only).
# An entry therefore holds nothing of the caller's: the caller's arrays die when the caller drops them. The key
# is everything such a launcher is made of, so an entry found for new arrays at the same addresses and layouts
# is exactly the launcher a fresh bind would make (its scratch is re-armed by every launch). Host backends bind
# nothing worth keeping, and their binding holds the caller's arrays: they bind per call.
_BOUND: "OrderedDict[tuple, tuple]" = OrderedDict()
_BOUND_CACHE_SIZE = 8
_VIEW_FIELDS = ("req_to_token", "full_to_swa_index_mapping", "req_to_verify_expected_tokens", "verify_cursors"
                ) + _OUTPUT_FIELDS
_NO_INDEX = ((), None, None)


def _view_key(v: ArrayView | None) -> tuple:
    return () if v is None else (v.ptr, v.shape, v.strides, v.dtype.str, v.device_id)


def _bare(v: ArrayView | None) -> ArrayView | None:
    return None if v is None else v._replace(owner=None, host=None)


def _one_shot_planner(static: StaticArgs, backend: str) -> CanaryPlanner:
    if static.device_id < 0:
        return CanaryPlanner._from_static(static, backends.resolve(backend, static.device_id), None)
    kv = static.kv_index  # a block table or page list (SPEC 3.8): its views and page size are the launcher's too
    index_key = _NO_INDEX if kv is None else (
        (kv.form, kv.page_size), _view_key(kv.table), _view_key(kv.kv_indptr))
    key = (backend, static.swa_window_size, static.kv_token_id_vs_position_offset, static.max_batch_size,
           static.padding_rows_carry_tokens, static.padding_slot) + index_key + tuple(
        _view_key(getattr(static, f)) for f in _VIEW_FIELDS)
    hit = _BOUND.get(key)
    if hit is None:
        module = backends.resolve(backend, static.device_id)
        bare = dataclasses.replace(static, **{f: _bare(getattr(static, f)) for f in _VIEW_FIELDS})
        if kv is not None:
            bare = dataclasses.replace(bare, kv_index=dataclasses.replace(
                kv, table=_bare(kv.table), kv_indptr=_bare(kv.kv_indptr)))
        hit = _BOUND[key] = (module, module.bind(bare, DEFAULT_LAUNCH))
        while len(_BOUND) > _BOUND_CACHE_SIZE:
            _BOUND.popitem(last=False)
    else:
        _BOUND.move_to_end(key)
    return CanaryPlanner._from_static(static, *hit)


@worded("launch_canary_plan_kernels")
def launch_canary_plan_kernels(
    *,
    verify_plan_out: VerifyPlan,
    write_plan_out: WritePlan,
    req_pool_indices: Any,
    prefix_lens: Any,
    extend_seq_lens: Any,
    req_to_token: Any = None,
    swa_window_size: int = 0,
    full_to_swa_index_mapping: Any = None,
    verify_capacity: int | None = None,
    req_to_verify_expected_tokens: Any = None,
    req_to_verify_expected_tokens_valid_lens: Any = None,
    expected_token_pool_indices: Any = None,
    kv_token_id_vs_position_offset: int = 0,
    padding_rows_carry_tokens: bool = False,
    on_overflow: str = "sample",
    padding_slot: int = 0,
    backend: str = "auto",
    stream: Any = None,
    check: bool = False,
    block_table: Any = None,
    kv_indptr: Any = None,
    kv_indices: Any = None,
    page_size: int | None = None,
) -> PlanStatus | None:
    """Build one canary plan (SPEC 3.2) into ``verify_plan_out`` and ``write_plan_out``: SGLang's entry point.

    Same arguments as :class:`CanaryPlanner` (the index in exactly one of its forms, SPEC 3.8: ``req_to_token``,
    or ``block_table`` and ``page_size``, or ``kv_indptr``, ``kv_indices`` and ``page_size``) plus the per-step
    arrays ``req_pool_indices``, ``prefix_lens``, ``extend_seq_lens`` (``[bs]`` int32 or int64, ``req_pool_indices == 0``
    = padding) and
    ``req_to_verify_expected_tokens_valid_lens`` and ``expected_token_pool_indices`` (``[bs]`` int32 or int64, with the
    expected-token pool only; the second optional, SPEC 3.2).
    ``verify_capacity`` must equal ``verify_plan_out.verify_slot_indices.shape[0]`` (``ValueError`` naming
    both). Validates everything on the host each call; on a GPU backend it keeps up to 8 bound launchers keyed
    by the static buffers' addresses and layouts (never the arrays themselves), so repeated calls on the same
    buffers reuse scratch and packed arguments. The call keeps no reference to any argument once it returns:
    like any stream-ordered library call, the caller keeps the arrays alive (or frees them stream-ordered, as
    torch's and CuPy's allocators do) until the stream has run the plan. A serving loop should hold a
    :class:`CanaryPlanner` instead.
    """
    static = bind_static(
        verify_plan_out=verify_plan_out,
        write_plan_out=write_plan_out,
        req_to_token=req_to_token,
        swa_window_size=swa_window_size,
        full_to_swa_index_mapping=full_to_swa_index_mapping,
        req_to_verify_expected_tokens=req_to_verify_expected_tokens,
        kv_token_id_vs_position_offset=kv_token_id_vs_position_offset,
        verify_capacity=verify_capacity,
        padding_rows_carry_tokens=padding_rows_carry_tokens,
        on_overflow=on_overflow,
        padding_slot=padding_slot,
        block_table=block_table,
        kv_indptr=kv_indptr,
        kv_indices=kv_indices,
        page_size=page_size,
    )
    planner = _one_shot_planner(static, backend)
    try:
        return planner.plan(
            req_pool_indices=req_pool_indices,
            prefix_lens=prefix_lens,
            extend_seq_lens=extend_seq_lens,
            req_to_verify_expected_tokens_valid_lens=req_to_verify_expected_tokens_valid_lens,
            expected_token_pool_indices=expected_token_pool_indices,
            stream=stream,
            check=check,
        )
    finally:  # the cached launcher outlives the call: it must not keep this call's arrays (see above)
        forget = getattr(planner._bound, "forget_step", None)  # backends.protocols.ForgetsStep: optional
        if forget is not None:
            forget()
