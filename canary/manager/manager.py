"""``CanaryManager``: the host side an engine switches on in a few lines (docs/integration.md).

Bound once per engine / rank over one or more :class:`~canary.manager.KVGroup`; per step, two calls matching the
forward (:meth:`CanaryManager.before_forward`, :meth:`CanaryManager.after_kv_store`); expected tokens kept by
request identity (:meth:`~CanaryManager.add_request`, :meth:`~CanaryManager.accept_tokens`,
:meth:`~CanaryManager.finish_request`); violations read back one step later without syncing the engine's stream.
"""
from __future__ import annotations

import json
import logging
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Sequence

import numpy as np

from ..errors import INPUT_ERROR_BITS, PlanStatus, fail
from ..interop.adapter import as_view
from ..interop.devices import allocator, cuda_ordinal
from ..interop.hostcopy import to_host
from ..interop.streams import LaunchStream, is_capturing, launch_stream
from ..records.ring import KernelTag, decode
from .groups import BoundGroup, KVGroup, bind_group, check_groups
from .layers import verify_layers, write_layers
from .pool import RequestPool
from .report import (
    CanaryHealthError, CanaryViolationError, Deduplicator, SlotViolation, kernel_name, log, log_violations,
    overflow_line,
)
from .stats import PrometheusMetrics, Stats
from .sweep import Sweeper, check_budget
from .block import ReportBlock
from .transfer import CudaTransfer, DeviceScatter, HostTransfer

MODES = ("log", "raise")


@dataclass
class _StepRecord:
    index: int
    request_ids: tuple
    groups: tuple[str, ...]
    bs: int
    sweep: tuple[str, ...] | None = None  # groups whose sweep runs at end_step (None: those of ``groups``)


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

    Raises ``ValueError`` / ``TypeError`` (``kv-canary:`` messages) for bad arguments,
    :class:`~canary.BackendUnavailableError` when the device's libraries are missing.
    """

    def __init__(self, groups: KVGroup | Sequence[KVGroup], *, max_batch_size: int, device: Any = "cpu",
                 library: str | None = None, backend: str = "auto", on_violation: str | Callable = "log",
                 ring_capacity: int = 256, max_requests: int | None = None, max_step_tokens: int | None = None,
                 log_limit: int = 8, stats_every: int = 0, metrics: Any = None, health_steps: int = 4,
                 forget_after: int = 64, sweep_budget: int = 0, prefix_source: Callable | None = None):
        specs = check_groups(groups)
        for name, value, low in (("max_batch_size", max_batch_size, 1), ("ring_capacity", ring_capacity, 1),
                                 ("log_limit", log_limit, 0), ("stats_every", stats_every, 0),
                                 ("health_steps", health_steps, 1), ("forget_after", forget_after, 0),
                                 ("max_requests", 1 if max_requests is None else max_requests, 1),
                                 ("max_step_tokens", 1 if max_step_tokens is None else max_step_tokens, 1)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) < low:
                raise fail(ValueError, f"{name}: expected an int >= {low}, got {value!r}")
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
        self._qv = empty(2 * b, np.int64)  # the plan's pool rows, then valid lengths: one host-to-device copy
        self._q, self._valid = self._qv[:b], self._qv[b:]
        self._step_inputs: dict[int, tuple] = {}  # bs -> (q[:bs], valid[:bs]): the same objects every step
        step_tokens = int(max_step_tokens or max(4096, max_seq_len))
        self._block = ReportBlock([s.name for s in specs], int(ring_capacity), empty)
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
            u = max(64, 2 * self.max_batch_size)
            upd = empty(3 * u + 1 + step_tokens, np.int64)
            self._transfer = CudaTransfer(self.ordinal, block=self._block, staging={"qv": self._qv, "upd": upd},
                                          u_cap=u, scatter=DeviceScatter(self.pool_array, upd, u, self.backend))
        # -- sweep hook (canary/manager/sweep.py) --
        self._sweep = Sweeper(self.groups, check_budget("sweep_budget", sweep_budget), empty, self.ordinal,
                              prefix_source)
        self.stats_ = Stats([g.name for g in self.groups])
        self.metrics = None if metrics is None or metrics is False else PrometheusMetrics(metrics)
        self._dedup = Deduplicator(int(forget_after))
        self._pending: deque = deque()
        self._prepared = False  # _prepare_verifies ran
        self._step: _StepRecord | None = None
        self._inputs: tuple | None = None
        self._launches = {g.name: (0, 0) for g in self.groups}
        self._stalled = {g.name: 0 for g in self.groups}
        self._last_counters = {g.name: (0, 0) for g in self.groups}

    # -- binding -------------------------------------------------------------------------------------------------
    def warmup(self) -> None:
        """Compile and load every kernel, so that the per-step calls only launch (graph-capturable)."""
        for g in self.groups:
            g.planner.warmup()
            g.records.warmup()
            if g.layers is not None:
                g.layers.warmup()
        self._prepare_verifies(self._launch(None)[1])

    def _prepare_verifies(self, stream: Any) -> None:
        # Each group's plan arrays are the manager's and never move: their verify is checked and packed once
        # (eager: at warmup, else the first step outside a capture), then only launched.
        self._prepared = True
        if self.ordinal is not None:
            for g in self.groups:
                g.verify_launch = g.records.prepare_verify(g.verify_plan, launch_tag=g.verify_tag, stream=stream)

    def close(self) -> None:
        """Free the pinned host buffers (GPU); the manager is unusable afterwards."""
        if isinstance(self._transfer, CudaTransfer):
            self._transfer.close()
        self._sweep.close()

    # -- expected tokens -----------------------------------------------------------------------------------------
    def add_request(self, request_id: Hashable, prompt_token_ids: Sequence[int] | np.ndarray) -> None:
        """Start tracking a request: its own expected-token pool row, holding its prompt (``[P]`` int token ids,
        host). Raises ``ValueError`` for a request already running, ``None`` as an id, a prompt longer than
        ``max_seq_len + 1``; ``RuntimeError`` when every pool row is taken (raise ``max_requests``)."""
        self.requests.add(request_id, prompt_token_ids)

    def accept_tokens(self, request_id: Hashable, token_ids: Sequence[int] | np.ndarray) -> None:
        """Append a step's accepted tokens (host ints: the sampled token, or a speculative step's accepted drafts
        and bonus token; never rejected drafts). They reach the device at the next :meth:`before_forward`.
        Raises ``KeyError`` for a request not running, ``ValueError`` past ``max_seq_len + 1`` tokens."""
        self.requests.accept(request_id, token_ids)

    def finish_request(self, request_id: Hashable) -> None:
        """Stop tracking a request. Its pool row keeps its tokens until every other free row was reused, so a
        stale forward naming it is still checked. Raises ``KeyError`` for a request not running."""
        self.requests.finish(request_id)

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
        capturing = self.ordinal is not None and is_capturing(handle)
        bs = int(req_pool_indices.shape[0])  # an attribute read: no DLPack export inside a capture
        # Checked before the step opens: a refused call leaves no step behind (a retry, or an after_kv_store
        # that writes with the last step's plan, would otherwise follow).
        if bs > self.max_batch_size:
            raise fail(ValueError, f"req_pool_indices: expected bs <= max_batch_size = {self.max_batch_size}, "
                                   f"got {bs}")
        if not capturing:
            n_ids = 0 if request_ids is None else len(request_ids)
            if n_ids != bs:
                raise fail(ValueError, f"request_ids: expected one id per batch row (bs = {bs}), got {n_ids}")
            self._begin(request_ids, groups, handle)
            try:
                if not self._prepared:
                    self._prepare_verifies(st)
                self._plan_and_verify(sel, req_pool_indices, prefix_lens, extend_seq_lens, bs, st)
            except BaseException:
                self._abandon_step()
                raise
        else:
            self._plan_and_verify(sel, req_pool_indices, prefix_lens, extend_seq_lens, bs, st)

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
        computed into a preallocated buffer (values must lie in the mapping; torch, CuPy and NumPy arrays), unless
        ``out_cache_loc_by_group[name]`` gives them. ``groups`` and ``stream`` as in :meth:`before_forward`.
        """
        sel = self._select(groups)
        handle, st = self._launch(stream)
        capturing = self.ordinal is not None and is_capturing(handle)
        if not capturing and self._step is None:  # before any write: no record is written for a step never opened
            raise fail(RuntimeError, "after_kv_store: expected a step opened by before_forward / begin_step, got none")
        for g in sel:
            loc = out_cache_loc_by_group.get(g.name) if out_cache_loc_by_group else None
            if loc is None:
                loc = out_cache_loc if g.loc_scratch is None else self._translate(g, out_cache_loc)
            g.records.write(g.write_plan, out_cache_loc=loc, input_ids=input_ids, positions=positions,
                            launch_tag=g.write_tag, stream=st)
            write_layers(g, loc, st)
        if not capturing:
            self._end(handle, st)

    def begin_step(self, request_ids: Sequence[Hashable] | None, *, groups: Sequence[str] | None = None,
                   stream: Any = None) -> None:
        """The host half of :meth:`before_forward`: handle ready reports, then stage the step's expected-token
        pool rows and valid lengths (and queued tokens) on ``stream``. A CUDA-graph engine calls it before each
        replay of a graph that captured :meth:`before_forward` / :meth:`after_kv_store`."""
        self._begin(request_ids, groups, self._launch(stream)[0])

    def _begin(self, request_ids, groups, handle: int) -> None:
        if self._step is not None:
            raise fail(RuntimeError, f"before_forward: expected the previous step ({self._step.index}) closed by "
                                     f"after_kv_store / end_step, got a new step first")
        if self._pending:
            self.poll()
        ids = [] if request_ids is None else (request_ids.tolist() if isinstance(request_ids, np.ndarray)
                                              else list(request_ids))
        bs = len(ids)
        if bs > self.max_batch_size:
            raise fail(ValueError, f"request_ids: expected at most max_batch_size = {self.max_batch_size} ids, "
                                   f"got {bs}")
        # RequestPool.lookup inlined (a few hundred ids a step): running, else finished but not reused, else None
        # (None itself is never a key). An id never added has no expected tokens: only chain, position, KV checks.
        live, retired = self.requests.live.get, self.requests.retired.get
        reqs = [live(rid) or retired(rid) for rid in ids]
        q = [0 if r is None else r.row for r in reqs]
        valid = [0 if r is None else len(r.tokens) for r in reqs]
        self._transfer.stage(self.pool_array, self.requests.take_updates(), self._q, self._valid, q, valid, handle)
        names = self._all_names if groups is None else tuple(g.name for g in self._select(groups))
        self._step = _StepRecord(self.stats_.steps, tuple(ids), names, bs)
        self.stats_.steps += 1

    def end_step(self, *, stream: Any = None) -> None:
        """The host half of :meth:`after_kv_store`: stage and launch the cached-prefix sweep of the step's groups
        (eager, never captured), then queue the device-to-host copy of the step's report."""
        self._end(*self._launch(stream))

    def _end(self, handle: int, st: Any) -> None:
        if self._step is None:
            raise fail(RuntimeError, "after_kv_store: expected a step opened by before_forward / begin_step, got none")
        if self._sweep:
            self._run_sweep(self._step, handle, st)
        rpi, bs = self._inputs if self._inputs is not None else (None, 0)
        token = self._transfer.snapshot(rpi, bs, handle)
        self._pending.append((self._step, token))
        self._step = None

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
        handle, lib = launch_stream(self.ordinal, stream, self.pool_array)
        return handle, LaunchStream(handle, lib)

    def _translate(self, g: BoundGroup, loc: Any) -> Any:
        n, cap = int(loc.shape[0]), int(g.loc_scratch.shape[0])
        if n > cap:
            raise fail(ValueError, f"out_cache_loc: expected at most max_step_tokens = {cap} tokens, got {n}")
        out = g.loc_scratch[:n]
        lut = g.spec.full_to_swa_index_mapping
        module = type(out).__module__.split(".")[0]
        if module == "torch":
            __import__("torch").index_select(lut, 0, loc, out=out)
        elif module == "cupy":
            __import__("cupy").take(lut, loc, out=out)
        elif isinstance(out, np.ndarray):
            np.take(lut, loc, out=out)
        else:
            raise fail(TypeError, f"out_cache_loc_by_group: expected the {g.name!r} group's SWA slots for "
                                  f"{type(out).__name__} arrays (the manager translates torch, CuPy and NumPy only)")
        return out

    def _handle_reports(self, wait: bool) -> None:
        new: list[SlotViolation] = []
        dropped, last_step = 0, None
        while self._pending:
            rec, token = self._pending[0]
            if not self._transfer.ready(token):
                if not wait:
                    break
                self._transfer.wait(token)
            self._pending.popleft()
            data = self._transfer.read(token)
            self._transfer.release(token)
            got, lost = self._decode(rec, data)
            new += got
            dropped += lost
            last_step = rec.index
        if last_step is None:
            return
        self._dedup.expire(last_step)
        self._dispatch(new, dropped, last_step)

    def _decode(self, rec: _StepRecord, data: dict[str, np.ndarray]) -> tuple[list[SlotViolation], int]:
        st = self.stats_
        st.decoded_steps += 1
        rpi = data.get("rpi")
        if rpi is not None:
            live, retired = self.requests.live.get, self.requests.retired.get
            for rid, rp in zip(rec.request_ids, rpi.tolist()):
                if rp:
                    req = live(rid) or retired(rid)
                    if req is not None:
                        req.last_req_pool_index = rp
        new, dropped = [], 0
        for g in self.groups:
            name = g.name
            slots, launches = data[f"{name}.slots"], data[f"{name}.launches"]
            w, v = KernelTag.WRITE.counter_index, KernelTag.VERIFY.counter_index
            st.written[name], st.verified[name] = int(slots[w]), int(slots[v])
            now = (int(launches[w]), int(launches[v]))
            if name in rec.groups:
                before = self._last_counters[name]
                ran = now[0] > before[0] and now[1] > before[1]
                self._stalled[name] = 0 if ran else self._stalled[name] + 1
                status = PlanStatus(int(data[f"{name}.status"][0]))
                if PlanStatus.SAMPLED in status:
                    st.sampled_steps[name] += 1
                if status & INPUT_ERROR_BITS:
                    st.input_error_steps[name] += 1
                    log.warning(f"kv-canary: plan input error group={name} step={rec.index} status={int(status)} "
                                f"({'|'.join(b.name for b in PlanStatus if b and b in status)}): that step verified "
                                f"nothing")
            self._last_counters[name] = now
            report = decode(data[f"{name}.ring"], int(data[f"{name}.index"][0]))
            if report.dropped:
                dropped += report.dropped
                st.dropped += report.dropped
                log.warning(overflow_line(name, rec.index, report.dropped, report.capacity))
                if self.metrics:
                    self.metrics.dropped.labels(group=name).inc(report.dropped)
            for v in report:
                key = (name, int(v.kernel), v.slot, v.position, int(v.reasons))
                made = self._dedup.see(key, rec.index, lambda: self._record(g, v, rec, data))
                if made is None:
                    st.repeats += 1
                else:
                    new.append(made)
            if self.metrics:
                m = self.metrics
                m.verified.labels(group=name).inc(max(0, st.verified[name] - getattr(g, "_m_verified", 0)))
                m.written.labels(group=name).inc(max(0, st.written[name] - getattr(g, "_m_written", 0)))
                g._m_verified, g._m_written = st.verified[name], st.written[name]
                if name in rec.groups and PlanStatus.SAMPLED in PlanStatus(int(data[f"{name}.status"][0])):
                    m.sampled.labels(group=name).inc()
        for name, n in self._stalled.items():
            if n >= self.health_steps:
                raise CanaryHealthError(
                    f"kv-canary: health: expected the kernels of group {name!r} to run every scheduled step, got "
                    f"launch counters unchanged for {n} consecutive steps (up to step {rec.index}): the canary "
                    f"calls are no longer launched (a CUDA graph captured without them, or a stream mix-up)")
        for v in new:
            for reason in v.reason_names or ("NONE",):
                st.violations[reason] = st.violations.get(reason, 0) + 1
                if self.metrics:
                    self.metrics.violations.labels(group=v.group, reason=reason).inc()
        if self.metrics:
            self.metrics.steps.inc()
            self.metrics.protected.set(self.requests.protected_tokens())
        return new, dropped

    def _record(self, g: BoundGroup, v, rec: _StepRecord, data) -> SlotViolation:
        sw = self._sweep.sweeps.get(g.name)
        kernel = "sweep" if sw is not None and v.launch_tag == sw.tag else kernel_name(v)
        if v.layer is not None:
            kernel = "verify"  # the layer rotation's verify_layer: the row names its layer
        return SlotViolation(group=g.name, kernel=kernel, slot=v.slot, position=v.position, reasons=v.reasons,
                             requests=self._holders(g, v, rec, data), first_step=rec.index, last_step=rec.index,
                             count=1, stored_token=v.stored_token, expected_token=v.expected_token, raw=v,
                             steps=[rec.index], prefixes=self._sweep.holders(g.name, v.slot, v.position),
                             layer=v.layer)

    def _holders(self, g: BoundGroup, v, rec: _StepRecord, data) -> tuple[tuple[Hashable, int], ...]:
        """Requests whose ``req_to_token`` row maps ``v.position`` to ``v.slot`` now: the step's batch rows, then
        running requests by their last row. Reads one column of the table (a sync, on the error path only)."""
        p = v.position
        r2t = g.spec.req_to_token
        max_reqs, max_seq_len = as_view(r2t, "req_to_token").shape
        if not 0 <= p < max_seq_len:
            return ()
        candidates: list[tuple[Hashable, int]] = []
        rpi = data.get("rpi")
        if rpi is not None:
            candidates += [(rid, int(rp)) for rid, rp in zip(rec.request_ids, rpi.tolist()) if rid is not None and rp]
        in_batch = {rid for rid, _ in candidates}
        candidates += [(rid, req.last_req_pool_index) for rid, req in self.requests.live.items()
                       if rid not in in_batch and req.last_req_pool_index]
        if not candidates:
            return ()
        column = np.asarray(to_host(r2t[:, p])).astype(np.int64)
        lut = g.spec.full_to_swa_index_mapping
        out = []
        for rid, rp in candidates:
            if not 0 < rp < max_reqs:
                continue
            slot = int(column[rp])
            if lut is not None and 0 <= slot:
                slot = int(np.asarray(to_host(lut[slot:slot + 1]))[0]) if slot < as_view(lut, "lut").shape[0] else -1
            if slot == v.slot and (rid, p) not in out:
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
