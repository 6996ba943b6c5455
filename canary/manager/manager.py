"""``CanaryManager``: the host side an engine switches on in a few lines (docs/integration.md).

Bound once per engine / rank over one or more :class:`~canary.manager.KVGroup`; per step, two calls matching the
forward (:meth:`CanaryManager.before_forward`, :meth:`CanaryManager.after_kv_store`); expected tokens kept by
request identity (:meth:`~CanaryManager.add_request`, :meth:`~CanaryManager.accept_tokens`,
:meth:`~CanaryManager.finish_request`); violations read back one step later without syncing the engine's stream.
"""
from __future__ import annotations

import json
import logging
import sys
from collections import deque
from typing import Any, Callable, Hashable, Sequence

import numpy as np

from ..errors import INPUT_ERROR_BITS, PlanStatus, fail, worded
from ..interop.adapter import HOST, as_view, identity
from ..interop.cudart import H2D, OnDevice, runtime
from ..interop.devices import allocator, cuda_ordinal
from ..interop.hostcopy import to_host
from ..contract.plans import MISSING_SLOT, mark_missing
from ..interop.streams import LaunchStream, is_capturing, launch_stream, library_of
from ..contract.ring import KernelTag, decode
from .groups import BoundGroup, KVGroup, bind_group, check_groups
from .layers import verify_layers, write_layers
from .pool import RequestPool, RowTokens, host_token_array
from .report import (
    CanaryHealthError, CanaryViolationError, Deduplicator, SlotViolation, kernel_name, log, log_violations,
    overflow_line,
)
from .stats import PrometheusMetrics, Stats
from .slots import translate as translate_slots, warmup as warmup_slots
from .sweep import Sweeper, check_budget
from .block import ReportBlock
from .eager import _MISS, EagerGraphs
from .transfer import CudaTransfer, DeviceScatter, HostTransfer

MODES = ("log", "raise")
# Plain ints for the per-step decode (enum arithmetic costs a microsecond a use there)
_SAMPLED, _INPUT_ERRORS = int(PlanStatus.SAMPLED), int(INPUT_ERROR_BITS)
_WRITE_COUNTER, _VERIFY_COUNTER = KernelTag.WRITE.counter_index, KernelTag.VERIFY.counter_index
_QUIET_MASK = _SAMPLED | _INPUT_ERRORS  # status bits a decode counts or logs: a report without them is quiet
_NONE: tuple = ()  # a quiet report's new violations


class _StepRecord:
    """One step: its index, request ids, groups, batch size and ``sweep``, the groups whose sweep runs at
    end_step (``None``: those of ``groups``). A slotted class: one is made every step."""

    __slots__ = ("index", "request_ids", "groups", "bs", "sweep")

    def __init__(self, index: int, request_ids: tuple, groups: tuple, bs: int):
        self.index, self.request_ids, self.groups, self.bs, self.sweep = index, request_ids, groups, bs, None


class CanaryManager:
    """Detect KV-cache corruption around an engine's forward: plan, verify, write, report.

    Arguments (keyword-only after ``groups``):

    - ``groups``: a :class:`KVGroup` or a sequence of them (full attention, sliding window, a draft model's pool).
    - ``max_batch_size``: the largest batch (rows, padding included) a step passes.
    - ``device``: ``"cpu"`` (host NumPy arrays; the reference backend) or a CUDA ordinal / ``"cuda:N"``;
      ``library``: ``"cupy"``, ``"torch"`` or ``"numba"`` for the arrays the manager allocates (as
      :meth:`canary.VerifyPlan.allocate`; a torch engine passes ``"torch"``). ``backend``: as for the planner.
    - ``on_violation``: ``"log"`` (default: one ``logging`` line per new violation on logger ``kv_canary``,
      at most ``log_limit`` per step, then a summary line), ``"raise"`` (:class:`CanaryViolationError` at the
      next step boundary) or a callable taking the list of new :class:`SlotViolation` records.
    - ``ring_capacity``: violation rows kept per group per step (more are counted as dropped and reported).
    - ``max_requests``: requests that may hold expected tokens at once (default: ``2 * max_reqs``; a finished
      request's pool row is reused last, so stale reads of it are still checked).
    - ``max_step_tokens``: new tokens per step (sizes an SWA group's slot translation and the token staging);
      default ``max(4096, max_seq_len)``.
    - ``stats_every``: log :meth:`stats` as one JSON line every N decoded steps (0: never).
    - ``metrics``: ``None``, ``True`` (the default ``prometheus_client`` registry) or a ``CollectorRegistry``.
    - ``health_steps``: a group scheduled in this many consecutive decoded steps whose kernels did not run
      (launch counters unchanged) raises :class:`CanaryHealthError`, in every mode.
    - ``forget_after``: a reported slot seen again within this many steps is a repeat (counted in the record),
      not a new report.
    - ``sweep_budget``: cached-prefix entries each group verifies per step (a :class:`KVGroup`'s own
      ``sweep_budget`` wins; 0, the default: no sweep). ``prefix_source``: ``None`` (register prefixes with
      :meth:`cache_prefix` / :meth:`evict_prefix`) or a callable, called once per step, returning the cache's
      prefixes as ``(key, slots, tokens[, start_position])`` tuples (docs/integration.md 5b).

    - ``eager_graphs``: replay an eager step that repeats the last step's arrays (static step buffers) as one
      CUDA graph per call instead of launching its kernels one by one (CuPy backend; canary/manager/eager.py
      says when a step qualifies). Same launches, same checks, less host time; ``False``: always launch directly.

    Raises ``ValueError`` / ``TypeError`` (``kv-canary:`` messages) for bad arguments,
    :class:`~canary.BackendUnavailableError` when the device's libraries are missing.
    """

    @worded("CanaryManager", method=True)
    def __init__(self, groups: KVGroup | Sequence[KVGroup], *, max_batch_size: int, device: Any = "cpu",
                 library: str | None = None, backend: str = "auto", on_violation: str | Callable = "log",
                 ring_capacity: int = 256, max_requests: int | None = None, max_step_tokens: int | None = None,
                 log_limit: int = 8, stats_every: int = 0, metrics: Any = None, health_steps: int = 4,
                 forget_after: int = 64, sweep_budget: int = 0, prefix_source: Callable | None = None,
                 eager_graphs: bool = True):
        specs = check_groups(groups)
        for name, value, low in (("max_batch_size", max_batch_size, 1), ("ring_capacity", ring_capacity, 1),
                                 ("log_limit", log_limit, 0), ("stats_every", stats_every, 0),
                                 ("health_steps", health_steps, 1), ("forget_after", forget_after, 0),
                                 ("max_requests", 1 if max_requests is None else max_requests, 1),
                                 ("max_step_tokens", 1 if max_step_tokens is None else max_step_tokens, 1)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) < low:
                raise fail(ValueError, f"{name}: expected an int >= {low}, got {value!r}")
        if not isinstance(eager_graphs, bool):
            raise fail(TypeError, f"eager_graphs: expected True or False, got {eager_graphs!r}")
        if not (callable(on_violation) or on_violation in MODES):
            raise fail(ValueError, f"on_violation: expected 'log', 'raise' or a callable taking a list of "
                                   f"SlotViolation, got {on_violation!r}")
        self.on_violation = on_violation
        self.max_batch_size = int(max_batch_size)
        self.log_limit, self.stats_every, self.health_steps = int(log_limit), int(stats_every), int(health_steps)
        self.ordinal = cuda_ordinal(device)
        empty = allocator(device, library)
        max_reqs, max_seq_len = as_view(specs[0].req_to_token, "groups[0].req_to_token").shape
        rows = (2 * max_reqs if max_requests is None else int(max_requests)) + 1
        cols = max_seq_len + 1  # + 1: a draft group reads column position + 1
        self.pool_array = empty(rows * cols, np.int32).reshape(rows, cols)
        self.requests = RequestPool(rows, cols)
        b = self.max_batch_size
        step_tokens = int(max_step_tokens or max(4096, max_seq_len))
        u = max(64, 2 * self.max_batch_size)
        # The host-to-device staging area: the plan's pool rows and valid lengths, then the expected-token
        # scatter's update (rows, columns, offsets, tokens), back to back so that one copy can fill both.
        staging = empty(2 * b + 3 * u + 1 + step_tokens, np.int64)
        self._qv, upd = staging[:2 * b], staging[2 * b:]
        self._q, self._valid = self._qv[:b], self._qv[b:]
        self._step_inputs: dict[int, tuple] = {}  # bs -> (q[:bs], valid[:bs]): the same objects every step
        self._block = ReportBlock([s.name for s in specs], int(ring_capacity), empty)
        g = len(specs)  # the block words a step's decode reads first (block.py): the write indexes, then the heads
        self._head_words = np.array(list(range(g)) + [h + k for h in self._block.heads for k in range(5)], np.int64)
        assert g > 1 or self._head_words.tolist() == list(range(6))
        self.groups: list[BoundGroup] = [
            bind_group(i, g, pool=self.pool_array, device=device, library=library, backend=backend,
                       max_batch_size=self.max_batch_size, ring_capacity=int(ring_capacity),
                       max_step_tokens=step_tokens, empty=empty, report=self._block.groups[i])
            for i, g in enumerate(specs)
        ]
        self._by_name = {g.name: g for g in self.groups}
        self._all_names = tuple(g.name for g in self.groups)
        self.backend = self.groups[0].records.backend
        if self.ordinal is None:
            self._transfer = HostTransfer(self._block)
        else:
            report = None
            if self.backend == "cupy":  # the report written by a kernel (kernels/report.cu); else copies
                from ..backends.cupy.report import ReportLaunch

                ordinal = self.ordinal
                report = (empty(1, np.int64), lambda **layout: ReportLaunch(ordinal, **layout))
            device_append = None
            if self.backend == "cupy":  # device token ids appended on the device (kernels/records.cu)
                from ..backends.cupy.records import prepare_append

                device_append = prepare_append(as_view(self.pool_array, "pool"), as_view(self._q, "staging.q"),
                                               as_view(self._valid, "staging.valid"))
            self._transfer = CudaTransfer(self.ordinal, block=self._block, staging={"qv": self._qv, "upd": upd},
                                          u_cap=u, scatter=DeviceScatter.over(self.pool_array, upd, u, self.backend),
                                          append=None if device_append else self._append_scatter(empty, upd),
                                          device_append=device_append,
                                          report_kernel=report)
        # -- sweep hook (canary/manager/sweep.py) --
        self._sweep = Sweeper(self.groups, check_budget("sweep_budget", sweep_budget), empty, self.ordinal,
                              prefix_source)
        # An eager step's report joins its after_kv_store graph: written by the report kernel, and no sweep between
        self._report_in_graph = self._transfer.report_launch is not None and not self._sweep
        self.stats_ = Stats([g.name for g in self.groups])
        self.metrics = None if metrics is None or metrics is False else PrometheusMetrics(metrics)
        self._dedup = Deduplicator(int(forget_after))
        self._pending: deque = deque()
        self._prepared = False  # _prepare_verifies ran
        self._step: _StepRecord | None = None
        self._inputs: tuple | None = None
        self._launches = {g.name: (0, 0) for g in self.groups}
        self._streams: dict[tuple, LaunchStream] = {}  # (handle, ordered library) -> its LaunchStream
        self._tokens_view: tuple | None = None  # (array, identity, view) of the last device token ids
        self._ids_cache: tuple | None = None  # (type, snapshot, tuple) of the last request ids (_ids)
        self._one_group = self.groups[0].name if len(self.groups) == 1 else None  # _decode's quiet path
        # _launch's common case: arrays of CuPy's, no stream given (cupy.cuda.get_current_stream), and the capture
        # query bound once (canary/interop/cudart.py's runtime)
        self._cupy_current = (sys.modules["cupy"].cuda.get_current_stream
                              if self.ordinal is not None and library_of(self.pool_array) == "cupy" else None)
        self._is_capturing = runtime().is_capturing if self.ordinal is not None else None
        self._stalled = {g.name: 0 for g in self.groups}
        self._last_counters = {g.name: (0, 0) for g in self.groups}
        self._last_rows: tuple | None = None  # (request ids, req_pool_indices) of the last decoded batch
        self._rows_cache: tuple | None = None  # (request ids, pool members version, pool rows) of _begin
        self._last_staged: tuple | None = None  # (pool rows, pool version, stream) of the last staging
        self._deferred: tuple | None = None  # (scatter, rows, tokens, copy): the staging left to before_forward
        self._taken: list | None = None  # the pool updates that staging carries (queued again if never launched)
        self._graph_inputs: dict[int, tuple] = {}  # bs -> the report inputs of the engine's captured graph
        self._eager = (EagerGraphs(runtime(), self.ordinal)
                       if eager_graphs and self.ordinal is not None and self.backend == "cupy" else None)
        self._translates = any(g.loc_scratch is not None for g in self.groups)  # an SWA group translates slots
        self._closed = False

    # -- binding -------------------------------------------------------------------------------------------------
    def warmup(self) -> None:
        """Compile and load every kernel, so that the per-step calls only launch (graph-capturable)."""
        handle, st = self._launch(None)
        for g in self.groups:
            g.planner.warmup()
            g.records.warmup()
            if g.layers is not None:
                g.layers.warmup()
            if g.loc_scratch is not None:
                warmup_slots(g.spec.full_to_swa_index_mapping, g.loc_scratch, handle)
        self._prepare_verifies(st)

    def _prepare_verifies(self, stream: Any) -> None:
        # Each group's plan arrays are the manager's and never move: their verify is checked and packed once
        # (eager: at warmup, else the first step outside a capture), then only launched.
        self._prepared = True
        if self.ordinal is not None:
            for g in self.groups:
                g.verify_launch = g.records.prepare_verify(g.verify_plan, launch_tag=g.verify_tag, stream=stream)

    def close(self) -> None:
        """Free the pinned host buffers and the captured graphs (GPU); the manager is unusable afterwards. A
        second call does nothing."""
        if self._closed:
            return
        self._closed = True
        if self._eager is not None:
            self._eager.close()
        if isinstance(self._transfer, CudaTransfer):
            self._transfer.close()
        self._sweep.close()

    def _append_scatter(self, empty, upd) -> DeviceScatter:
        # The decode batch's scatter (CudaTransfer.stage_append) over the staging area, and its constant offsets
        # 0, 1, ..., B, copied once (a sync, at construction): for managers without the device append (Numba).
        b = self.max_batch_size
        self._append_offsets = empty(b + 1, np.int64)
        host = np.arange(b + 1, dtype=np.int64)
        rt = runtime()
        with OnDevice(rt, self.ordinal):
            rt.memcpy_async(as_view(self._append_offsets, "staging.offsets").ptr, host.ctypes.data, host.nbytes, H2D, 0)
            rt.stream_synchronize(0)
        return DeviceScatter.appending(self.pool_array, self._qv, upd, self._append_offsets, self.backend)

    # -- expected tokens -----------------------------------------------------------------------------------------
    def add_request(self, request_id: Hashable, prompt_token_ids: Sequence[int] | np.ndarray) -> None:
        """Start tracking a request: its own expected-token pool row, holding its prompt (``[P]`` int token ids,
        host). Raises ``ValueError`` for a request already running, ``None`` as an id, a prompt longer than
        ``max_seq_len + 1``; ``RuntimeError`` when every pool row is taken (raise ``max_requests``)."""
        self.requests.add(request_id, prompt_token_ids)
        self._last_rows = None

    def accept_tokens(self, request_id: Hashable, token_ids: Sequence[int] | np.ndarray) -> None:
        """Append a step's accepted tokens (host ints: the sampled token, or a speculative step's accepted drafts
        and bonus token; never rejected drafts). They reach the device at the next :meth:`before_forward`.
        Raises ``KeyError`` for a request not running, ``ValueError`` past ``max_seq_len + 1`` tokens."""
        self.requests.accept(request_id, token_ids)

    def accept_tokens_batch(self, request_ids: Sequence[Hashable], token_ids: Any) -> None:
        """:meth:`accept_tokens` for a whole decode batch at once: ``token_ids[i]`` is the one token request
        ``request_ids[i]`` accepted this step (a plain decode step's sampled tokens). Requests must be running and
        distinct; ``None`` marks a padding row (a batch padded to a graph size), whose token is ignored. One update
        for the batch instead of one per request: the host cost of a step that accepts a token for each of 256
        requests drops from about 1 us a request to a few numpy calls (docs/performance.md). For several tokens a
        request (speculative decoding), call :meth:`accept_tokens` per request.

        ``token_ids``: ``[bs]`` host ints (a list, a NumPy array, a CPU tensor), or the engine's device array of
        sampled token ids (int64 or int32, contiguous, on this manager's device; any DLPack / CUDA-array-interface
        array). A device array is read where it is by the next :meth:`before_forward` (or :meth:`begin_step`), on
        its launch stream (CuPy backend): keep its values until then, and use another buffer for a second accept
        before that step. On a Numba-backend or CPU manager its values are copied to the host here (a sync).

        Raises ``KeyError`` for a request not running; ``ValueError`` for a request listed twice, a length
        mismatch, a request past ``max_seq_len + 1`` tokens (nothing is accepted then), a device array on another
        device or not contiguous; ``TypeError`` for token ids that are not integers."""
        ids = self._ids(request_ids)
        if token_ids is None:
            raise fail(TypeError, f"token_ids: expected one token id per request ([{len(ids)}] host ints or a device "
                                  f"array), got None")
        if type(token_ids) not in (list, tuple, np.ndarray):
            token_ids = self._device_tokens(ids, token_ids)
            if token_ids is None:
                return
        toks = host_token_array(token_ids, "token_ids")
        if toks.shape[0] != len(ids) or getattr(token_ids, "ndim", 1) != 1:  # a list: host_token_array's 1-D check
            raise fail(ValueError, f"token_ids: expected one token per request ([{len(ids)}]), got shape "
                                   f"{tuple(np.shape(token_ids))}")
        if len(ids):
            self.requests.accept_batch(ids, toks.astype(np.int64, copy=True), self._batch_rows)

    def _device_tokens(self, ids: tuple, token_ids: Any) -> Any:
        """accept_tokens_batch's arrays that are not NumPy's: device token ids are queued zero-copy when this
        manager appends on the device (returns ``None``); otherwise returns host values for the host path (a
        device array copied to the host: a sync, e.g. a Numba-backend manager)."""
        ident = identity(token_ids)  # an engine's static buffer: its checked view reused while the same array
        last = self._tokens_view
        if ident is not None and last is not None and last[0] is token_ids and last[1] == ident:
            view = last[2]
        else:
            t = type(token_ids)  # the type's attributes: an instance's __cuda_array_interface__ builds a dict
            if not (hasattr(t, "__cuda_array_interface__") or hasattr(t, "__dlpack__")):
                return token_ids  # a sequence of another kind: NumPy reads it
            view = as_view(token_ids, "token_ids")
            self._tokens_view = None
            if view.device_id == HOST:
                return view.host
            if self._transfer.device_append is None:
                return to_host(token_ids)
            if len(view.shape) != 1:
                raise fail(ValueError, f"token_ids: expected one token per request ([{len(ids)}]), got shape "
                                       f"{tuple(view.shape)}")
            if view.dtype not in (np.dtype(np.int64), np.dtype(np.int32)):
                raise fail(TypeError, f"token_ids: expected int64 or int32 device token ids, got dtype {view.dtype}")
            if view.device_id != self.ordinal:
                raise fail(ValueError, f"token_ids: expected host ints or an array on cuda:{self.ordinal} (the "
                                       f"manager's device), got an array on cuda:{view.device_id}")
            if view.shape[0] > 1 and view.strides[0] != 1:
                raise fail(ValueError, f"token_ids: expected a contiguous device array (stride 1), got stride "
                                       f"{view.strides[0]}")
            if ident is not None:  # checked: the next call over the same array reuses it
                self._tokens_view = (token_ids, ident, view)
        if view.shape[0] != len(ids):
            raise fail(ValueError, f"token_ids: expected one token per request ([{len(ids)}]), got shape "
                                   f"{tuple(view.shape)}")
        if len(ids):
            self.requests.accept_batch(ids, None, self._batch_rows, device=(view, token_ids))
        return None

    def _ids(self, request_ids: Any) -> tuple:
        """The request ids as a tuple; the same tuple object as last call when the caller passes the same ids in a
        list or tuple (compared with a snapshot, element by element: the caller may refill its list), so that the
        per-batch caches downstream compare by identity."""
        c = self._ids_cache
        t = type(request_ids)
        if c is not None and t is c[0] and request_ids == c[1]:
            return c[2]
        if request_ids is None:
            return ()
        if t is np.ndarray:
            return tuple(request_ids.tolist())
        ids = tuple(request_ids)
        if t is list:
            self._ids_cache = (list, list(request_ids), ids)
        elif t is tuple:
            self._ids_cache = (tuple, request_ids, ids)
        return ids

    def _batch_rows(self, ids: tuple) -> np.ndarray | None:
        # The pool rows _begin holds for this batch: accept_batch adopts the same array, so that _begin can tell a
        # decode batch accepting for exactly its own rows by identity (stage_append).
        last = self._rows_cache
        return last[2] if last is not None and last[1] == self.requests.members and last[0] == ids else None

    def finish_request(self, request_id: Hashable) -> None:
        """Stop tracking a request. Its pool row keeps its tokens until every other free row was reused, so a
        stale forward naming it is still checked. Raises ``KeyError`` for a request not running."""
        self.requests.finish(request_id)
        self._last_rows = None

    # -- per step ------------------------------------------------------------------------------------------------
    def before_forward(self, *, req_pool_indices: Any, prefix_lens: Any, extend_seq_lens: Any,
                       request_ids: Sequence[Hashable] | None, groups: Sequence[str] | None = None,
                       stream: Any = None) -> None:
        """Plan and verify the step (before attention reads the KV), on ``stream``.

        ``req_pool_indices``, ``prefix_lens``, ``extend_seq_lens``: ``[bs]`` int64 arrays of the engine (device
        arrays on a GPU; row 0 of ``req_to_token`` = padding). ``request_ids``: host sequence of ``bs`` engine
        request ids (``None`` for padding rows). ``groups``: names of the groups this forward reads (default:
        all; a draft model's forward passes its own group). Reports of earlier steps that have reached the
        host are handled first: logged, raised (:class:`CanaryViolationError`) or passed to the callback;
        :class:`CanaryHealthError` when the kernels stopped running. While ``stream`` is capturing a CUDA graph
        only the launches are recorded: call :meth:`begin_step` before each replay and :meth:`end_step` after.
        Never syncs the engine's stream. A call that raises leaves no step open: the engine may call it again,
        and :meth:`after_kv_store` without a successful :meth:`before_forward` raises before writing anything.
        """
        sel = self._select(groups)
        handle, st = self._launch(stream)
        capturing = self.ordinal is not None and self._is_capturing(handle)
        try:
            bs = int(req_pool_indices.shape[0])  # an attribute read: no DLPack export inside a capture
        except (AttributeError, IndexError, TypeError):
            raise fail(TypeError, f"req_pool_indices: expected a [bs] int64 array, got {type(req_pool_indices).__name__}"
                                  f"{' of shape ' + str(tuple(req_pool_indices.shape)) if hasattr(req_pool_indices, 'shape') else ''}"
                       ) from None
        # Checked before the step opens: a refused call leaves no step behind (a retry, or an after_kv_store
        # that writes with the last step's plan, would otherwise follow).
        if bs > self.max_batch_size:
            raise fail(ValueError, f"req_pool_indices: expected bs <= max_batch_size = {self.max_batch_size}, "
                                   f"got {bs}")
        if not capturing:
            try:
                n_ids = 0 if request_ids is None else len(request_ids)
            except TypeError:
                raise fail(TypeError, f"request_ids: expected a list of bs = {bs} request ids (None for padding "
                                      f"rows), got {type(request_ids).__name__}") from None
            if n_ids != bs:
                raise fail(ValueError, f"request_ids: expected one id per batch row (bs = {bs}), got {n_ids}")
            self._begin(request_ids, groups, handle, defer_scatter=self._eager is not None)
            try:
                if not self._prepared:
                    self._prepare_verifies(st)
                if self._eager is None:
                    self._plan_and_verify(sel, req_pool_indices, prefix_lens, extend_seq_lens, bs, st)
                else:
                    self._eager_plan_and_verify(sel, req_pool_indices, prefix_lens, extend_seq_lens, bs, st)
            except BaseException:
                d, self._deferred = self._deferred, None
                try:
                    if d is not None:  # the staged tokens still reach the pool (it was not launched: once now)
                        try:
                            self._transfer.launch_deferred(d, handle)
                        except BaseException:
                            self._requeue()  # still not launched: the next staging takes the update again
                            raise
                        self._taken = None
                        self._transfer.deferred_launched(d, handle)
                finally:
                    self._last_staged = None  # the next call stages again
                    self._taken = None
                    self._abandon_step()
                raise
        else:
            self._plan_and_verify(sel, req_pool_indices, prefix_lens, extend_seq_lens, bs, st)
            self._graph_inputs[bs] = self._inputs  # what begin_step / end_step report for this graph's replays

    def _eager_plan_and_verify(self, sel, req_pool_indices, prefix_lens, extend_seq_lens, bs: int, st) -> None:
        # The staging's last expected-token scatter (its row and token counts in the key) joins the graph, and so
        # does an append's copy (its staging buffer and size in the key: a graph per buffer). It stays in
        # self._deferred until launched, so that a call that raises first still launches it.
        scatter = self._deferred
        key, objs = (self._step.groups, bs, scatter), (req_pool_indices, prefix_lens, extend_seq_lens)
        got = self._eager.launch("before", key, objs, st)
        if got is not _MISS:
            self._deferred = self._taken = None  # launched: never again (the device append is not idempotent)
            if scatter is not None:
                self._transfer.deferred_launched(scatter, st.handle)
            self._inputs = got
            return
        if scatter is not None:
            self._transfer.launch_deferred(scatter, st.handle)
            self._deferred = self._taken = None
            self._transfer.deferred_launched(scatter, st.handle)
        self._plan_and_verify(sel, req_pool_indices, prefix_lens, extend_seq_lens, bs, st)

        def body(stream):
            if scatter is not None:
                self._transfer.launch_deferred(scatter, stream.handle)
            self._plan_and_verify(sel, req_pool_indices, prefix_lens, extend_seq_lens, bs, stream)
            return self._inputs

        self._eager.observe("before", key, objs, st, self.pool_array, body)

    def _requeue(self) -> None:
        # Taken updates that never launched (a staging that raised, or the launch left to before_forward,
        # self._deferred): queued again, ahead of anything queued since.
        if self._taken:
            self.requests.updates[:0] = self._taken
        self._taken = None

    def _abandon_step(self) -> None:
        # A before_forward that raised after opening its step: the step is dropped (not counted, no report).
        # Launches it made before the error report with the next step's snapshot, which copies the same ring.
        self._step = None
        self.stats_.steps -= 1

    def _plan_and_verify(self, sel, req_pool_indices, prefix_lens, extend_seq_lens, bs: int, st: Any) -> None:
        qv = self._step_inputs.get(bs)
        if qv is None:  # sliced once per batch size: the planner then reuses its views of the same objects
            qv = self._step_inputs[bs] = (self._q[:bs], self._valid[:bs])
        q, valid = qv
        for g in sel:
            g.planner.plan(req_pool_indices=req_pool_indices, prefix_lens=prefix_lens, extend_seq_lens=extend_seq_lens,
                           req_to_verify_expected_tokens_valid_lens=valid, expected_token_pool_indices=q,
                           stream=st)
            if g.verify_launch is not None:  # the group's own plan, checked and packed at warmup
                g.records.launch_prepared(g.verify_launch, stream=st)
            else:
                g.records.verify(g.verify_plan, launch_tag=g.verify_tag, stream=st)
            verify_layers(g, st)
        # The report copies req_pool_indices through the planner's view of it (ordered on this stream).
        rpi = sel[0].planner.last_step.req_pool_indices if sel else as_view(req_pool_indices, "req_pool_indices")
        self._inputs = (rpi, bs)

    def after_kv_store(self, *, out_cache_loc: Any, input_ids: Any, positions: Any,
                       groups: Sequence[str] | None = None, out_cache_loc_by_group: dict[str, Any] | None = None,
                       stream: Any = None) -> None:
        """Write the canary records of the step's new tokens (after the step's KV stores), then queue the step's
        report for the host (read at a later :meth:`before_forward`).

        ``out_cache_loc``, ``input_ids``, ``positions``: ``[N]`` int64 (slot, token id, position of each new
        token; slot < 0: skipped). An SWA group's slots are ``full_to_swa_index_mapping[out_cache_loc]``,
        computed into a preallocated buffer on the launch stream (torch, CuPy and NumPy arrays; a negative slot
        stays negative, a slot past the mapping becomes one the write reports as ``SLOT_RANGE``:
        ``canary/manager/slots.py``), unless ``out_cache_loc_by_group[name]`` (``[N]`` int64) gives them. Every
        group's slots are checked or translated before any group writes. ``groups``: the step's (its
        :meth:`before_forward`'s) by default; a group it did not plan is a ``ValueError``. ``stream`` as in
        :meth:`before_forward`. Raises ``TypeError`` for slots that are not int64.
        """
        sel = self._select(groups)
        handle, st = self._launch(stream)
        capturing = self.ordinal is not None and self._is_capturing(handle)
        step = self._step
        if not capturing and step is None:  # before any write: no record is written for a step never opened
            raise fail(RuntimeError, "after_kv_store: expected a step opened by before_forward / begin_step, got none")
        if not capturing and not (groups is None and step.groups is self._all_names):
            # A group the step did not plan has no write plan for it (its last one is another step's): the step's
            # groups by default, and naming another is an error.
            if groups is None:
                groups = step.groups
                sel = self._select(groups)
            else:
                extra = [g.name for g in sel if g.name not in step.groups]
                if extra:
                    raise fail(ValueError, f"groups: expected groups this step's before_forward planned "
                                           f"({list(step.groups)}), got {extra}")
        in_graph = False
        if capturing or self._eager is None or out_cache_loc_by_group or (
                self._translates and any(g.loc_scratch is not None for g in sel)):
            self._write(sel, out_cache_loc, input_ids, positions, out_cache_loc_by_group, st)
        else:
            names = self._all_names if groups is None else tuple(g.name for g in sel)
            in_graph = self._eager_write(sel, names, out_cache_loc, input_ids, positions, st)
        if not capturing:
            self._end(handle, st, reported=in_graph)

    def _eager_write(self, sel, names, out_cache_loc, input_ids, positions, st) -> bool:
        """The writes through a replayed graph when they may be (canary/manager/eager.py); returns whether the
        graph also launched the step's report. The report joins the graph when nothing runs between the writes
        and it (no sweep) and the transfer reports through its kernel; ``_end`` then only records it."""
        inputs = self._inputs
        report = self._report_in_graph and inputs is not None
        key = (names, inputs[0].ptr, inputs[1]) if report else (names, None, None)
        objs = (out_cache_loc, input_ids, positions)
        if report:
            self._free_report_slot()  # before the graph: it holds the report's launch
            self._transfer.order_report(st.handle)
        got = self._eager.launch("after", key, objs, st)
        if got is not _MISS:
            return got
        self._write(sel, out_cache_loc, input_ids, positions, None, st)

        def body(stream):
            self._write(sel, out_cache_loc, input_ids, positions, None, stream)
            if report:
                self._transfer.report_device(inputs[0], inputs[1], stream.handle)
            return report

        self._eager.observe("after", key, objs, st, self.pool_array, body)
        return False

    def _write(self, sel, out_cache_loc, input_ids, positions, out_cache_loc_by_group, st) -> None:
        # Every group's slots first (translated, or checked when given by group), then the writes: an input that
        # fails for one group fails the call before any group has written.
        locs, n = [], None
        if out_cache_loc_by_group:  # input_ids' length, once (not 1-D: the first write refuses it, before any write)
            ids = as_view(input_ids, "input_ids")
            n = ids.shape[0] if len(ids.shape) == 1 else None
        for g in sel:
            loc = out_cache_loc_by_group.get(g.name) if out_cache_loc_by_group else None
            if loc is not None:
                self._check_group_loc(g.name, loc, n)
            elif g.loc_scratch is not None:
                loc = translate_slots(g.spec.full_to_swa_index_mapping, out_cache_loc, g.loc_scratch,
                                      0 if st is None else st.handle)
            else:
                loc = out_cache_loc
            locs.append(loc)
        for g, loc in zip(sel, locs):
            g.records.write(g.write_plan, out_cache_loc=loc, input_ids=input_ids, positions=positions,
                            launch_tag=g.write_tag, stream=st)
            write_layers(g, loc, st)

    @staticmethod
    def _check_group_loc(name: str, loc: Any, n: int | None) -> None:
        """``out_cache_loc_by_group[name]``: ``[n]`` int64, one per token of ``input_ids`` (``n``: its length,
        ``None`` when it is not 1-D); the write checks the rest."""
        arg = f"out_cache_loc_by_group[{name!r}]"
        view = as_view(loc, arg)
        if len(view.shape) != 1 or (n is not None and view.shape[0] != n):
            raise fail(ValueError, f"{arg}: expected [N] slots, one per token of input_ids ([{n}]), "
                                   f"got shape {tuple(view.shape)}")
        if view.dtype != np.dtype(np.int64):
            raise fail(TypeError, f"{arg}: expected int64 slots, got dtype {view.dtype}")

    def begin_step(self, request_ids: Sequence[Hashable] | None, *, groups: Sequence[str] | None = None,
                   stream: Any = None) -> None:
        """The host half of :meth:`before_forward`: handle ready reports, then stage the step's expected-token
        pool rows and valid lengths (and queued tokens) on ``stream``. A CUDA-graph engine calls it before each
        replay of a graph that captured :meth:`before_forward` / :meth:`after_kv_store`."""
        self._begin(request_ids, groups, self._launch(stream)[0])
        # The report of the engine's graph of this batch size names its captured req_pool_indices, whatever eager
        # step ran in between (an eager step at another batch size leaves its own in self._inputs).
        self._inputs = self._graph_inputs.get(self._step.bs, self._inputs)

    def _begin(self, request_ids, groups, handle: int, defer_scatter: bool = False) -> None:
        self._deferred = None
        if self._step is not None:
            raise fail(RuntimeError, f"before_forward: expected the previous step ({self._step.index}) closed by "
                                     f"after_kv_store / end_step, got a new step first")
        if self._pending:
            self.poll()
        ids = self._ids(request_ids)
        bs = len(ids)
        if bs > self.max_batch_size:
            raise fail(ValueError, f"request_ids: expected at most max_batch_size = {self.max_batch_size} ids, "
                                   f"got {bs}")
        pool = self.requests
        last = self._rows_cache
        if last is not None and last[1] == pool.members and (last[0] is ids or last[0] == ids):
            ids, q = last[0], last[2]  # the same batch, no request added or finished since: the same pool rows
        else:
            # RequestPool.lookup inlined (a few hundred ids a step): running, else finished but not reused, else
            # row 0 (None itself is never a key), whose count is 0: an id never added has no expected tokens, only
            # chain, position and KV checks.
            live, retired = pool.live.get, pool.retired.get
            q = np.zeros(bs, dtype=np.int64)
            try:
                for i, rid in enumerate(ids):
                    r = live(rid) or retired(rid)
                    if r is not None:
                        q[i] = r.row
            except TypeError:  # before the step opens: a refused call leaves none
                raise fail(TypeError, f"request_ids[{i}]: expected a hashable request id (or None), got "
                                      f"{type(ids[i]).__name__}") from None
            held = pool.batch_rows(ids)  # accept_batch's rows for these ids: the same array (see _batch_rows)
            if held is not None and np.array_equal(held, q):
                q = held
            self._rows_cache = (ids, pool.members, q)
        # Nothing to stage when the pool rows are the last staged ones and no count changed since (no token
        # accepted, no request added or finished: no update queued either), on the same stream: the device area
        # holds them (ordered behind the last copy). Another stream copies again: the last copy may not have run
        # by the time that stream's plan reads the area.
        last = self._last_staged
        updates = pool.updates
        if last is None or last[0] is not q or last[1] != pool.version or last[2] != handle or updates:
            one = updates[0] if len(updates) == 1 else None
            taken = pool.take_updates()
            try:
                if type(one) is RowTokens and one.rows is q and (
                        one.device is not None or self._transfer.device_append is not None):
                    # Tokens for exactly this step's rows: appended on the device (device token ids where they
                    # are, host ints from pinned memory), which also advances the plan's valid lengths there (no
                    # copy when it holds these rows' lengths from before the accept).
                    synced = last is not None and last[0] is q and last[1] == one.version and last[2] == handle
                    self._deferred = self._transfer.stage_device_append(q, one, handle, synced, defer_scatter)
                elif type(one) is RowTokens and one.rows is q and self._transfer.append is not None:
                    # A decode batch that accepted one token a request for exactly this step's rows: the scatter
                    # reads the plan's staged rows and valid lengths (the tokens' columns are valid - 1).
                    self._deferred = self._transfer.stage_append(q, one.ends, one.tokens, handle, defer_scatter)
                else:
                    self._deferred = self._transfer.stage(self.pool_array, taken, self._q, self._valid, q,
                                                          pool.counts[q], handle, defer_scatter)
            except BaseException:
                # Not launched (or only in part: a scatter is idempotent, and the append launches last): the next
                # staging takes them again, from a fresh copy of the rows and lengths.
                self._taken = taken
                self._requeue()
                self._last_staged = None
                raise
            self._taken = taken if self._deferred is not None else None
            self._last_staged = (q, pool.version, handle)
        names = self._all_names if groups is None else tuple(g.name for g in self._select(groups))
        self._step = _StepRecord(self.stats_.steps, ids, names, bs)
        self.stats_.steps += 1

    def end_step(self, *, stream: Any = None) -> None:
        """The host half of :meth:`after_kv_store`: stage and launch the cached-prefix sweep of the step's groups
        (eager, never captured), then queue the device-to-host copy of the step's report."""
        self._end(*self._launch(stream))

    def _end(self, handle: int, st: Any, reported: bool = False) -> None:
        """``reported``: the step's report kernel ran inside the replayed graph (only its host half is left)."""
        if self._step is None:
            raise fail(RuntimeError, "after_kv_store: expected a step opened by before_forward / begin_step, got none")
        if self._sweep:
            self._run_sweep(self._step, handle, st)
        rpi, bs = self._inputs if self._inputs is not None else (None, 0)
        if reported:
            token = self._transfer.report_host(rpi is not None, bs, handle)
        else:
            self._free_report_slot()
            token = self._transfer.snapshot(rpi, bs, handle)
        self._pending.append((self._step, token))
        self._step = None

    def _free_report_slot(self) -> None:
        # Before a report launch: when every report slot holds an unread report (the host that many steps ahead of
        # the GPU), the oldest is copied out of its slot (a host wait for it), to be decoded in turn.
        if self._transfer.full():
            i = next(i for i, (_, t) in enumerate(self._pending) if self._transfer.holds_slot(t))
            self._pending[i] = (self._pending[i][0], self._transfer.detach(self._pending[i][1]))

    def poll(self) -> None:
        """Handle every step report that has reached the host (never waits). :meth:`before_forward` calls it."""
        self._handle_reports(wait=False)

    def flush(self) -> None:
        """Wait for every queued step report and handle it (a host sync: at shutdown, or in tests)."""
        self._handle_reports(wait=True)

    # -- cached-prefix sweep (docs/integration.md 5b; the rotation lives in canary/manager/sweep.py) -------------
    def cache_prefix(self, key: Hashable, slots: Any, tokens: Any, start_position: int = 0, *,
                     prev_slot: int | None = None, groups: Sequence[str] | None = None) -> None:
        """Register a cached prefix for the sweep: ``slots`` (``[n]`` ints, host or device: a device array is
        copied, a sync) hold positions ``start_position .. start_position + n - 1``; ``tokens`` (``[n]`` ints or
        ``None``: no token check) their token ids. Position ``p``'s predecessor is the slot of ``p - 1`` in the same
        prefix; the first entry's is ``prev_slot`` (``None``: the chain anchor at position 0, otherwise the chain
        check of that one entry is skipped). ``groups``: the groups holding this KV (default: every swept
        group). Register only KV whose store was already launched (this step's included). Raises ``ValueError``
        / ``TypeError`` (``kv-canary:``) for a key already cached, slots outside a group's pool, bad lengths."""
        self._sweep.cache(key, slots, tokens, start_position, prev_slot, groups, self._by_name)

    def evict_prefix(self, key: Hashable) -> None:
        """Stop sweeping a cached prefix. Call it when the cache frees the slots, before they are handed out
        again: a slot swept after its reuse is reported. ``KeyError`` for a key not cached."""
        self._sweep.evict(key)

    def sweep(self, *, stream: Any = None) -> None:
        """An idle step: verify the next ``sweep_budget`` cached entries of every swept group with no forward
        (an engine with nothing to run calls it from its idle loop). Handles ready reports first, like
        :meth:`before_forward`; its own report is read at a later call. Not graph-capturable (host staging)."""
        handle, st = self._launch(stream)
        if self.ordinal is not None and is_capturing(handle):
            raise fail(RuntimeError, "sweep: expected a stream that is not capturing a CUDA graph, got a capturing "
                                     "one (the sweep stages its entries on the host)")
        inputs, self._inputs = self._inputs, None
        try:
            self._begin([], [], handle)
            self._step.sweep = tuple(self._sweep.sweeps)
            self._end(handle, st)
        finally:
            self._inputs = inputs

    def _run_sweep(self, rec: _StepRecord, handle: int, stream: Any) -> None:
        # Staged and launched here, after the step's writes and on the host just before the launch: a prefix
        # registered with this step's tokens is verified after they are written, and one evicted before this call
        # is never staged. Both are eager, outside any CUDA graph (end_step always is).
        self._sweep.refresh(self._by_name)
        names = rec.groups if rec.sweep is None else rec.sweep
        for sw in self._sweep.stage(names, handle):
            sw.group.records.verify(sw.plan, launch_tag=sw.tag, stream=stream)

    # -- stats ---------------------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Totals: ``steps``, ``decoded_steps``, ``protected_tokens`` (expected tokens held for running requests),
        per group ``verified_entries`` / ``written_entries`` (the kernels' counters) / ``sampled_steps`` /
        ``input_error_steps``, ``violations_by_reason`` (new violations per reason name), ``repeated_sightings``,
        ``ring_dropped``. As of the last decoded report."""
        out = self.stats_.as_dict(self.requests.protected_tokens())
        if self._sweep:
            out.update(self._sweep.stats())
        return out

    @property
    def open_violations(self) -> list[SlotViolation]:
        """The violations reported within ``forget_after`` steps, with their counts and steps."""
        return list(self._dedup.open.values())

    # -- internals -----------------------------------------------------------------------------------------------
    def _select(self, groups: Sequence[str] | None) -> list[BoundGroup]:
        if groups is None:
            return self.groups
        if isinstance(groups, str):
            groups = [groups]
        elif not isinstance(groups, (list, tuple)):
            raise fail(TypeError, f"groups: expected a list of group names among {sorted(self._by_name)}, got "
                                  f"{type(groups).__name__}")
        out = []
        for name in groups:
            g = self._by_name.get(name)
            if g is None:
                raise fail(ValueError, f"groups: expected names among {sorted(self._by_name)}, got {name!r}")
            out.append(g)
        return out

    def _launch(self, stream: Any) -> tuple[int, Any]:
        """The launch stream, resolved once per call: ``(raw handle, what the planner and records take as their
        stream)``; host arrays: ``(0, None)``."""
        if self.ordinal is None:
            if stream is not None:
                raise fail(ValueError, "stream: expected None for a manager on device='cpu' (host arrays take no "
                                       f"stream), got {type(stream).__name__}")
            return 0, None
        cupy_current = self._cupy_current
        if stream is None and cupy_current is not None and "torch" not in sys.modules:
            # launch_stream's answer for CuPy-owned arrays when no other library could be capturing: the current
            # CuPy stream, ordered for CuPy arrays (the common eager call, without its generic checks)
            handle, lib = cupy_current(self.ordinal).ptr, "cupy"
        else:
            handle, lib = launch_stream(self.ordinal, stream, self.pool_array)
        st = self._streams.get((handle, lib))
        if st is None:  # one per stream seen (a handful), not one per call
            st = LaunchStream(handle, lib)
            if len(self._streams) < 64:
                self._streams[(handle, lib)] = st
        return handle, st


    def _handle_reports(self, wait: bool) -> None:
        new: list[SlotViolation] = []
        dropped, last_step = 0, None
        pending, transfer = self._pending, self._transfer
        while pending:
            rec, token = pending[0]
            got = transfer.take(token)
            if got is None:
                if not wait:
                    break
                transfer.wait(token)
                got = transfer.read(token)
            pending.popleft()
            words, rpi = got
            try:
                found, lost = self._decode(rec, words, rpi)
            finally:
                transfer.release(token)  # the words (and rows) stay the buffer's until here
            if found:
                new += found
            dropped += lost
            last_step = rec.index
        if last_step is None:
            return
        if self._dedup.open:
            self._dedup.expire(last_step)
        if new or dropped or self.stats_every:
            self._dispatch(new, dropped, last_step)

    def _note_rows(self, rec: _StepRecord, rpi: np.ndarray) -> None:
        # Each request's last req_to_token row (for _holders). A decode step repeats the last batch: nothing to do
        # (add_request / finish_request forget the last batch, so a new request under an old id is noted). The
        # rows are compared as bytes and the ids by identity first (_begin hands a repeated batch the same tuple).
        raw = rpi.tobytes()
        last = self._last_rows
        if last is not None and last[1] == raw and (last[0] is rec.request_ids or last[0] == rec.request_ids):
            return
        live, retired = self.requests.live.get, self.requests.retired.get
        for rid, rp in zip(rec.request_ids, rpi.tolist()):
            if rp:
                req = live(rid) or retired(rid)
                if req is not None:
                    req.last_req_pool_index = rp
        self._last_rows = (rec.request_ids, raw)

    def _decode(self, rec: _StepRecord, words: np.ndarray, rpi: np.ndarray | None
                ) -> tuple[list[SlotViolation], int]:
        # Read straight from the block's words (canary/manager/block.py): a step with no ring rows decodes its
        # counters and statuses only.
        st = self.stats_
        st.decoded_steps += 1
        if rpi is not None:
            self._note_rows(rec, rpi)
        metrics = self.metrics
        name = self._one_group
        if name is not None and metrics is None:
            # One group, no metrics: a quiet report (no ring row, no status bit the stats count) needs its counters
            # only. [write index, slot counters [2], kernel counters [2], status] (block.py).
            vals = words[:6].tolist()
            if not vals[0] & 0xFFFFFFFF and not vals[5] & _QUIET_MASK:
                st.written[name], st.verified[name] = vals[1 + _WRITE_COUNTER], vals[1 + _VERIFY_COUNTER]
                now = (vals[3 + _WRITE_COUNTER], vals[3 + _VERIFY_COUNTER])
                if name in rec.groups:
                    before = self._last_counters[name]
                    stalled = 0 if now[0] > before[0] and now[1] > before[1] else self._stalled[name] + 1
                    self._stalled[name] = stalled
                    if stalled >= self.health_steps:
                        self._health_failed(name, stalled, rec.index)
                self._last_counters[name] = now
                return _NONE, 0
        new, dropped = [], 0
        block = self._block
        n_groups = len(self.groups)
        # The ring write indexes [G], then each group's head: slot counters [2], kernel counters [2], the plan's
        # status, in one conversion (one group's are contiguous: a slice).
        vals = (words[:n_groups + 5] if n_groups == 1 else words[self._head_words]).tolist()
        for i, g in enumerate(self.groups):
            name = g.name
            head = vals[n_groups + 5 * i:n_groups + 5 * i + 5]
            st.written[name], st.verified[name] = head[_WRITE_COUNTER], head[_VERIFY_COUNTER]
            now = (head[2 + _WRITE_COUNTER], head[2 + _VERIFY_COUNTER])
            status = head[4] & 0xFFFFFFFF  # the int32 in the word's low half (bits, all below 2^31)
            if name in rec.groups:
                before = self._last_counters[name]
                ran = now[0] > before[0] and now[1] > before[1]
                self._stalled[name] = 0 if ran else self._stalled[name] + 1
                if status & _SAMPLED:
                    st.sampled_steps[name] += 1
                if status & _INPUT_ERRORS:
                    st.input_error_steps[name] += 1
                    bits = PlanStatus(status)
                    log.warning(f"kv-canary: plan input error group={name} step={rec.index} status={status} "
                                f"({'|'.join(b.name for b in PlanStatus if b and b in bits)}): that step verified "
                                f"nothing")
            self._last_counters[name] = now
            index = vals[i] & 0xFFFFFFFF  # the ring's int32 write index, read as its uint32 count
            if index:
                ring = words[block.rings[i]].reshape(block.ring_capacity, -1)
                report = decode(ring, index)
                if report.dropped:
                    dropped += report.dropped
                    st.dropped += report.dropped
                    log.warning(overflow_line(name, rec.index, report.dropped, report.capacity))
                    if metrics:
                        metrics.dropped.labels(group=name).inc(report.dropped)
                for viol in report:
                    # A MISSING row's slot names no request (MISSING_SLOT); its predecessor slot does, so that
                    # another request losing the same position is a new record, not a repeat
                    key = (name, int(viol.kernel), viol.slot, viol.position, int(viol.reasons), viol.predecessor_slot)
                    made = self._dedup.see(key, rec.index, lambda: self._record(g, viol, rec, rpi))
                    if made is None:
                        st.repeats += 1
                    else:
                        new.append(made)
            if metrics:
                metrics.verified.labels(group=name).inc(max(0, st.verified[name] - getattr(g, "_m_verified", 0)))
                metrics.written.labels(group=name).inc(max(0, st.written[name] - getattr(g, "_m_written", 0)))
                g._m_verified, g._m_written = st.verified[name], st.written[name]
                if name in rec.groups and status & _SAMPLED:
                    metrics.sampled.labels(group=name).inc()
        for name, n in self._stalled.items():
            if n >= self.health_steps:
                self._health_failed(name, n, rec.index)
        for viol in new:
            for reason in viol.reason_names or ("NONE",):
                st.violations[reason] = st.violations.get(reason, 0) + 1
                if metrics:
                    metrics.violations.labels(group=viol.group, reason=reason).inc()
        if metrics:
            metrics.steps.inc()
            metrics.protected.set(self.requests.protected_tokens())
        return new, dropped

    @staticmethod
    def _health_failed(name: str, n: int, step: int) -> None:
        raise CanaryHealthError(
            f"kv-canary: health: expected the kernels of group {name!r} to run every scheduled step, got launch "
            f"counters unchanged for {n} consecutive steps (up to step {step}): the canary calls are no longer "
            f"launched (a CUDA graph captured without them, or a stream mix-up)")

    def _record(self, g: BoundGroup, v, rec: _StepRecord, rpi: np.ndarray | None) -> SlotViolation:
        sw = self._sweep.sweeps.get(g.name)
        kernel = "sweep" if sw is not None and v.launch_tag == sw.tag else kernel_name(v)
        if v.layer is not None:
            kernel = "verify"  # the layer rotation's verify_layer: the row names its layer
        return SlotViolation(group=g.name, kernel=kernel, slot=v.slot, position=v.position, reasons=v.reasons,
                             requests=self._holders(g, v, rec, rpi), first_step=rec.index, last_step=rec.index,
                             count=1, stored_token=v.stored_token, expected_token=v.expected_token, raw=v,
                             steps=[rec.index], prefixes=self._sweep.holders(g.name, v.slot, v.position),
                             layer=v.layer)

    def _holders(self, g: BoundGroup, v, rec: _StepRecord, rpi: np.ndarray | None
                 ) -> tuple[tuple[Hashable, int], ...]:
        """Requests whose ``req_to_token`` row maps ``v.position`` to ``v.slot`` now: the step's batch rows, then
        running requests by their last row. A MISSING row (no real slot at the position) names the requests whose
        position has no real slot now (a 0, or a real slot mapped to 0) and, when the row has a predecessor slot,
        whose previous position maps to it. Reads a column or two of the table (a sync, on the error path only)."""
        p = v.position
        r2t = g.spec.req_to_token
        max_reqs, max_seq_len = as_view(r2t, "req_to_token").shape
        if not 0 <= p < max_seq_len:
            return ()
        candidates: list[tuple[Hashable, int]] = []
        if rpi is not None:
            candidates += [(rid, int(rp)) for rid, rp in zip(rec.request_ids, rpi.tolist()) if rid is not None and rp]
        in_batch = {rid for rid, _ in candidates}
        candidates += [(rid, req.last_req_pool_index) for rid, req in self.requests.live.items()
                       if rid not in in_batch and req.last_req_pool_index]
        if not candidates:
            return ()
        lut = g.spec.full_to_swa_index_mapping
        lut_len = None if lut is None else as_view(lut, "lut").shape[0]

        def translate(raw: int) -> int:
            if lut is None or raw < 0:
                return raw
            return int(np.asarray(to_host(lut[raw:raw + 1]))[0]) if raw < lut_len else -1

        column = np.asarray(to_host(r2t[:, p])).astype(np.int64)
        prev = v.predecessor_slot
        missing = prev is not None
        before = np.asarray(to_host(r2t[:, p - 1])).astype(np.int64) if missing and prev > 0 and p > 0 else None
        out = []
        for rid, rp in candidates:
            if not 0 < rp < max_reqs:
                continue
            raw = int(column[rp])
            if missing:
                hit = int(mark_missing(raw, translate(raw))) == MISSING_SLOT and (
                    before is None or translate(int(before[rp])) == prev)
            else:
                hit = translate(raw) == v.slot
            if hit and (rid, p) not in out:
                out.append((rid, p))
        return tuple(out)

    def _dispatch(self, new: list[SlotViolation], dropped: int, step: int) -> None:
        if self.stats_every and self.stats_.decoded_steps % self.stats_every == 0:
            logging.getLogger("kv_canary").info("kv-canary: stats " + json.dumps(self.stats(), default=str))
        if not new and not dropped:
            return
        if self.on_violation == "log":
            log_violations(new, step, self.log_limit)
        elif self.on_violation == "raise":
            first = new[0].line() if new else "none kept"
            raise CanaryViolationError(
                f"kv-canary: violations: expected none, got {len(new)} new and {dropped} dropped to ring overflow "
                f"by step {step}; first: {first}", new, dropped, step)
        elif new:
            self.on_violation(new)
