"""Host entry points of the canary write and verify kernels and of the expected-token scatter (SPEC 4).

:class:`CanaryRecords` binds a :class:`~canary.contract.state.CanaryState` and a :class:`~canary.contract.realkv.RealKV` once, then
launches per step: :meth:`CanaryRecords.write` after the step's KV stores, :meth:`CanaryRecords.verify` on a verify
plan, :meth:`CanaryRecords.drain` to read violations. Every argument is validated on the host before any launch
(``kv-canary:`` messages naming the argument, expected and actual values; no silent casts). Semantics:
``docs/records.md``.

Backends (docs/records.md 8): the NumPy reference for host arrays, the CuPy kernels of ``kernels/records.cu``
and their Numba twin ``kernels/records_numba.py`` for CUDA arrays; each call launches on the caller's stream.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from .. import backends
from ..backends.args import DEFAULT_LAUNCH, LaunchConfig, RecordVerifyArgs, RecordWriteArgs, ScatterArgs
from ..errors import fail, worded
from ..interop.adapter import HOST, INT_WIDTHS, ArrayView, as_view, check_same_device, check_view
from ..interop.overlap import Spans, spans
from ..interop.streams import launch_stream
from ..interop.callviews import CallViews, Reuse, fingerprint
from ..contract.plans import (INT32, INT64, VerifyPlan, WritePlan, check_padding_slot, view_verify_plan,
                              view_write_plan)
from ..contract.realkv import RealKV
from ..contract.realkv import real_kv as make_real_kv
from ..contract.ring import KernelTag, RingReport, encode_tag
from ..contract.state import CanaryState, bind_state



def _same_device(views: list[ArrayView], device_id: int, what: str) -> None:
    for v in views:
        if v.device_id != device_id:
            where = "host memory" if device_id == HOST else f"cuda:{device_id}"
            raise fail(ValueError, f"{v.name}: expected the device of {what} ({where}), got {v.where}")


class CanaryRecords:
    """A bound canary: ``state`` (:class:`CanaryState`), ``real_kv`` (:class:`RealKV`, a sequence of sources
    for :func:`canary.real_kv` in mode ALL, or ``None`` for mode NONE), ``backend`` ("auto",
    "reference", "cupy", "numba"; "auto": the reference for host arrays, else CuPy if installed, else Numba).

    ``launch_config``: :class:`~canary.LaunchConfig` (block sizes under Numba's simulator; engines keep the
    default).

    ``padding_slot``: ``0`` (default: slot 0 is the padding slot, which verify skips, and a predecessor 0 has no
    link) or ``-1`` (slot 0 is real: verified like any slot, a predecessor 0 is chain-checked, and a predecessor
    :data:`~canary.MISSING_SLOT` has no link), SPEC 3.2 "No reserved slot" and 4. Use the value the planner of
    the verified plans was bound with; a :class:`~canary.records.layers.CanaryLayers` bound to these records
    follows it. The write is the same in both. ``TypeError`` for a non-int, ``ValueError`` for another int.

    Binding validates the state and the sources once (a source sharing memory with the state is refused: its
    hash would cover bytes the kernels rewrite) and, on a GPU backend, packs their pointers: the caller's
    arrays must stay alive and in place while the canary is used (the canary keeps references to them).
    Raises ``ValueError`` / ``TypeError`` for bad arguments (including sources that do not cover every slot),
    :class:`~canary.errors.BackendUnavailableError` when the backend's library is missing.
    """

    def __init__(self, state: CanaryState, real_kv: RealKV | Any = None, *, backend: str = "auto",
                 launch_config: LaunchConfig = DEFAULT_LAUNCH, padding_slot: int = 0):
        self.state = state
        self.padding_slot = check_padding_slot(padding_slot)
        self.views = dataclasses.replace(bind_state(state), padding_slot=self.padding_slot)
        if real_kv is None:
            real_kv = make_real_kv(())
        elif not isinstance(real_kv, RealKV):
            real_kv = make_real_kv(real_kv)
        self.real_kv = real_kv
        if real_kv.sources and real_kv.device_id != self.views.device_id:
            def where(d):
                return "host memory" if d == HOST else f"cuda:{d}"

            raise fail(ValueError, f"{real_kv.sources[0].name}: expected the canary buffer's device "
                                   f"({where(self.views.device_id)}), got {where(real_kv.device_id)}")
        real_kv.check_covers(self.views.num_slots, "state.canary_buffer")
        for src in real_kv.sources:
            # A source inside the state would hash bytes the kernels rewrite: false REAL_KV violations.
            self.views.spans.check_range(f"{src.name}.array", src.device_id, src.ptr,
                                         (src.rows - 1) * src.row_stride_bytes + src.row_bytes)
        v = self.views
        # Host state's NumPy arrays: a caller may clear their writeable flag after binding, and the reference
        # would then fail half-way through a launch; each call reads the flags first.
        self._host_state = tuple((a.name, a.host) for a in (v.canary_buffer, v.ring, v.ring_write_index,
                                                             v.slot_run_counter, v.kernel_run_counter)
                                 if a.host is not None)
        self._views: dict = {}  # name -> (object, launch stream, (pointer, shape), view) of the last call
        self._module = backends.resolve(backend, self.views.device_id, family="records")
        self.backend = self._module.NAME
        if not isinstance(launch_config, LaunchConfig):
            raise fail(TypeError, f"launch_config: expected a LaunchConfig, got {type(launch_config).__name__}")
        self._bound = self._module.bind(self.views, real_kv, launch_config)
        # Calls repeated over the same arrays on the same stream (callviews.Reuse): by plan, a few at a time
        # (the manager alternates its step's plan and its sweep's).
        self._reuse: dict = {}
        prepare = getattr(self._bound, "prepare_write", None)  # backends.protocols.PreparesCalls: optional
        self._prepare = (prepare, self._bound.prepare_verify) if prepare else None

    def warmup(self) -> None:
        """Compile and load the kernels, so that later calls only launch (graph-capturable)."""
        self._bound.warmup()

    @property
    def num_slots(self) -> int:
        return self.views.num_slots

    def write(
        self,
        write_plan: WritePlan,
        *,
        out_cache_loc: Any,
        input_ids: Any,
        positions: Any,
        expected_input_ids: Any = None,
        expected_positions: Any = None,
        launch_tag: int = 0,
        stream: Any = None,
    ) -> None:
        """Write the canary records of a step's new tokens (docs/records.md, "Write").

        ``write_plan``: the step's :class:`WritePlan` (``write_offsets`` index the entry arrays).
        ``out_cache_loc``, ``input_ids``, ``positions``: ``[N]`` (KV slot, token id, position of each new
        token; slot < 0 = skip). ``expected_input_ids`` / ``expected_positions``: optional ``[N]`` asserts
        (-1 = no expectation). Each of the five is int32 or int64, independently, read as its dtype (no cast,
        no copy; SPEC 2 (*)); another dtype is a ``TypeError``. ``launch_tag``: call-site id recorded in ring rows, in [0, 2**55). ``stream``:
        where the kernel runs (a CuPy / torch / cuda.core / Numba stream or a raw handle; default: the current
        stream of the library that owns ``state.canary_buffer``; host arrays take none). Never syncs. Raises
        ``TypeError`` / ``ValueError`` (``kv-canary:``, naming the argument) before anything is launched, among
        them for an array sharing memory with the state (which the kernels write) and, on the host, for state
        made read-only after binding.
        """
        go = CallViews(self.views.device_id, stream, self.state.canary_buffer, self.views.spans, self._views)
        objs = None
        if go.reusable and type(write_plan) is WritePlan:
            objs = (write_plan.write_offsets, write_plan.write_seed_slot_indices, write_plan.write_num_valid_reqs,
                    out_cache_loc, input_ids, positions, expected_input_ids, expected_positions)
            hit = self._reuse.get(("w", id(write_plan)))
            if hit is not None and hit.matches(objs, go.handle, (type(launch_tag), launch_tag)):
                self._launch(hit.launch, go.handle)
                return
        encode_tag(KernelTag.WRITE, launch_tag)
        if self._host_state:
            self._check_host_state()
        _vec = go.vec
        wp = view_write_plan(write_plan, go.view, name="write_plan", writable=False)
        loc = _vec(out_cache_loc, "out_cache_loc", INT_WIDTHS)
        n = loc.shape[0]
        ids = _vec(input_ids, "input_ids", INT_WIDTHS, length=n)
        pos = _vec(positions, "positions", INT_WIDTHS, length=n)
        exp_ids = (None if expected_input_ids is None
                   else _vec(expected_input_ids, "expected_input_ids", INT_WIDTHS, length=n))
        exp_pos = (None if expected_positions is None
                   else _vec(expected_positions, "expected_positions", INT_WIDTHS, length=n))
        views = wp.all() + [loc, ids, pos] + [v for v in (exp_ids, exp_pos) if v is not None]
        _same_device(views, self.views.device_id, "state.canary_buffer")
        args = RecordWriteArgs(wp, loc, ids, pos, exp_ids, exp_pos, int(launch_tag))
        if objs is not None and go.reusable and self._prepare is not None:
            self._launch(self._keep(("w", id(write_plan)), objs, go.handle, launch_tag, self._prepare[0](args)),
                         go.handle)
            return
        self._bound.write(args, go.handle)

    def verify(self, verify_plan: VerifyPlan, *, launch_tag: int = 0, stream: Any = None) -> None:
        """Verify the entries of a :class:`VerifyPlan` (docs/records.md, "Verify"): ``[C]`` int64 entry arrays,
        ``[1]`` int32 ``verify_num_valid`` and ``enable``. ``launch_tag`` and ``stream`` as in :meth:`write`.
        Never syncs; errors as in :meth:`write`."""
        go = CallViews(self.views.device_id, stream, self.state.canary_buffer, self.views.spans, self._views)
        objs = None
        if go.reusable and type(verify_plan) is VerifyPlan:
            p = verify_plan
            objs = (p.verify_slot_indices, p.verify_expected_tokens, p.verify_expected_positions,
                    p.verify_prev_slot_indices, p.verify_num_valid, p.enable)
            hit = self._reuse.get(("v", id(verify_plan)))
            if hit is not None and hit.matches(objs, go.handle, (type(launch_tag), launch_tag)):
                self._launch(hit.launch, go.handle)
                return
        encode_tag(KernelTag.VERIFY, launch_tag)
        if self._host_state:
            self._check_host_state()
        vp = view_verify_plan(verify_plan, go.view, name="verify_plan", writable=False, status=False)
        _same_device(vp.all(), self.views.device_id, "state.canary_buffer")
        args = RecordVerifyArgs(vp, int(launch_tag))
        if objs is not None and go.reusable and self._prepare is not None:
            self._launch(self._keep(("v", id(verify_plan)), objs, go.handle, launch_tag, self._prepare[1](args)),
                         go.handle)
            return
        self._bound.verify(args, go.handle)

    def prepare_verify(self, verify_plan: VerifyPlan, *, launch_tag: int = 0, stream: Any = None) -> Any:
        """Check a verify of ``verify_plan`` once, as :meth:`verify` does (same errors), and pack its launch for
        :meth:`launch_prepared`; ``None`` where the backend launches no prepared call (the host's reference, Numba)
        or an array needed a DLPack stream handshake. For a caller that owns the plan and never moves its arrays
        (the manager): the launch then costs no view, check or argument packing."""
        go = CallViews(self.views.device_id, stream, self.state.canary_buffer, self.views.spans, self._views)
        encode_tag(KernelTag.VERIFY, launch_tag)
        vp = view_verify_plan(verify_plan, go.view, name="verify_plan", writable=False, status=False)
        _same_device(vp.all(), self.views.device_id, "state.canary_buffer")
        if self._prepare is None or not go.reusable:
            return None
        return self._prepare[1](RecordVerifyArgs(vp, int(launch_tag)))

    def launch_prepared(self, prepared: Any, *, stream: Any = None) -> None:
        """Launch what :meth:`prepare_verify` returned, on ``stream`` (as in :meth:`verify`). Never syncs."""
        self._bound.launch_prepared(prepared, launch_stream(self.views.device_id, stream, self.state.canary_buffer)[0])

    def _launch(self, prepared, handle: int) -> None:
        self._bound.launch_prepared(prepared, handle)

    def _keep(self, key, objs: tuple, handle: int, launch_tag, prepared):
        prints = fingerprint(objs)
        if prints is not None:
            if len(self._reuse) >= 4 and key not in self._reuse:  # each entry keeps its arrays alive
                self._reuse.pop(next(iter(self._reuse)))
            self._reuse[key] = Reuse(objs, prints, handle, (type(launch_tag), launch_tag), prepared)
        return prepared

    def _check_host_state(self) -> None:
        for name, arr in self._host_state:
            if not arr.flags.writeable:
                raise fail(ValueError, f"{name}: expected a writable array, got a read-only one (its writeable flag "
                                       f"was cleared after the canary was bound); set flags.writeable = True again")

    def drain(self) -> RingReport:
        """Read and reset the violation ring (syncs): see :meth:`CanaryState.drain`."""
        return self.state.drain()


@worded("scatter_expected_tokens")
def scatter_expected_tokens(
    *,
    req_to_verify_expected_tokens: Any,
    req_pool_indices: Any,
    tokens: Any,
    token_offsets: Any,
    column_starts: Any,
    column_offset: int = 0,
    backend: str = "auto",
    stream: Any = None,
) -> None:
    """Scatter a flat per-request token stream into the expected-token pool (docs/records.md, "Scatter").

    For each batch row ``r < bs`` with ``rp = req_pool_indices[r]`` in ``[1, pool_rows)`` and each ``j`` in
    ``[0, end - start)`` with ``start, end = clamp(token_offsets[r], 0, N), clamp(token_offsets[r+1], 0, N)``:
    ``pool[rp, column_starts[r] + column_offset + j] = tokens[start + j]``; columns outside ``[0, pool_cols)``
    are skipped (and a clamped start shifts the row's tokens: offsets are trusted, clamping keeps reads in
    bounds). Arguments: ``req_to_verify_expected_tokens`` ``[pool_rows, pool_cols]`` int32 (written),
    ``req_pool_indices`` ``[bs]`` int64, ``tokens`` ``[N]`` int64 or int32 (stored as their low 32 bits),
    ``token_offsets`` ``[>= bs+1]`` int64 (a :class:`WritePlan`'s ``write_offsets`` fits: ``tokens`` is then the
    step's ``input_ids``), ``column_starts`` ``[bs]`` int64 (``prefix_lens`` fits), ``column_offset`` (the
    ``kv_token_id_vs_position_offset``). ``backend`` and ``stream`` as for :class:`CanaryRecords` (default stream:
    the current stream of the library that owns the pool; host arrays take none). Never syncs. Two batch rows
    scattering to the same cell race on a GPU (the reference keeps the later row). An input sharing memory with
    the pool is refused (``ValueError`` naming both).
    """
    pool_view = as_view(req_to_verify_expected_tokens, "req_to_verify_expected_tokens")
    go = CallViews(pool_view.device_id, stream, req_to_verify_expected_tokens)
    if pool_view.device_id != HOST:  # view it again, ordered on the launch stream
        pool_view = as_view(req_to_verify_expected_tokens, "req_to_verify_expected_tokens", stream_ptr=go.stream_ptr,
                            launch_stream=go.launch_stream, ordered_lib=go.ordered_lib)
    pool = check_view(pool_view, dtype=INT32, ndim=2, writable=True)
    rpi = go.vec(req_pool_indices, "req_pool_indices", INT64)
    bs = rpi.shape[0]
    tok_view = as_view(tokens, "tokens", stream_ptr=go.stream_ptr, launch_stream=go.launch_stream,
                       ordered_lib=go.ordered_lib)
    if tok_view.dtype not in (INT64, INT32):
        raise fail(TypeError, f"tokens: expected dtype int64 or int32, got {tok_view.dtype.name}")
    tok = check_view(tok_view, dtype=tok_view.dtype, ndim=1)
    offs = go.vec(token_offsets, "token_offsets", INT64)
    if offs.shape[0] < bs + 1:
        raise fail(ValueError, f"token_offsets: expected length >= bs + 1 = {bs + 1}, got {offs.shape[0]}")
    starts = go.vec(column_starts, "column_starts", INT64, length=bs)
    if isinstance(column_offset, bool) or not isinstance(column_offset, (int, np.integer)):
        raise fail(TypeError, f"column_offset: expected an int, got {type(column_offset).__name__}")
    if not -(1 << 62) <= int(column_offset) <= (1 << 62):  # as the planner's offset: column sums stay in int64
        raise fail(ValueError, f"column_offset: expected an int in [-2**62, 2**62], got {column_offset}")
    device = check_same_device([pool, rpi, tok, offs, starts])
    written = Spans(spans([pool]), device)
    for v in (rpi, tok, offs, starts):
        written.check(v)  # the kernel writes the pool while it reads these
    module = backends.resolve(backend, device, family="records")
    module.scatter(ScatterArgs(pool, rpi, tok, offs, starts, int(column_offset)), go.handle)
