"""``CanaryManager``: the host side an engine switches on in a few lines (docs/integration.md).

Bound once per engine / rank over one or more :class:`~canary.manager.KVGroup`; per step, two calls matching the
forward (:meth:`CanaryManager.before_forward`, :meth:`CanaryManager.after_kv_store`); expected tokens kept by
request identity (:meth:`~CanaryManager.add_request`, :meth:`~CanaryManager.accept_tokens`,
:meth:`~CanaryManager.finish_request`); violations read back one step later without syncing the engine's stream.

The manager holds the public calls; each job is a room of its own: the step state machine (``steps.py``) and its
launch stream (``streams.py``), the staging (``staging.py``), the mailbox (``mailbox.py``), the report decoder
(``decode.py``), the token intake and the request calls (``intake.py``) and the records moved with the KV
(``moves.py``)."""
from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable, Hashable, Sequence

import numpy as np

from .. import backends
from ..errors import fail, worded
from ..interop.cudart import runtime
from ..interop.devices import allocator, cuda_ordinal
from ..interop.hostcopy import to_host
from ..interop.streams import is_capturing
from .block import ReportBlock
from .decode import DecoderSetting, ReportDecoder
from .distributed import DistributedManager, check_distributed
from .eager import EagerGraphs
from .groups import BOUND_ATTRS, BoundGroup, KVGroup, bind_group, bound_of, check_bound, check_groups, rebound
from .guard import Guarded, request_call, step_call
from .index import index_shape, step_arrays
from .intake import RequestCalls, TokenIntake
from .moves import RecordMoves
from .pool import RequestPool
from .report import SlotViolation
from .slots import warmup as warmup_slots
from .staging import DeviceScatter, append_scatter
from .stats import PrometheusMetrics, Stats
from .steps import Steps
from .streams import StreamResolver
from .sweep import Sweeper, check_budget
from .suppress import ReportedSlots
from .transfer import open_transfer

MODES = ("log", "raise")


class CanaryManager(Guarded, RequestCalls, RecordMoves, DistributedManager):
    """Detect KV-cache corruption around an engine's forward: plan, verify, write, report; move the records with
    KV that moves (:meth:`gather_records`, :meth:`scatter_records`, :meth:`move_records`: SPEC 4.1).

    Arguments (keyword-only after ``groups``):

    - ``groups``: a :class:`KVGroup` or a sequence of them (full attention, sliding window, a draft model's pool).
    - ``max_batch_size``: the largest batch (rows, padding included) a step passes.
    - ``device``: ``"cpu"`` (host NumPy arrays; the reference backend) or a CUDA ordinal / ``"cuda:N"``;
      ``library``: ``"cupy"``, ``"torch"`` or ``"numba"`` for the arrays the manager allocates (as
      :meth:`canary.VerifyPlan.allocate`; a torch engine passes ``"torch"``). ``backend``: as for the planner.
    - ``on_violation``: ``"log"`` (default: one ``logging`` line per new violation on logger ``kv_canary``,
      at most ``log_limit`` per step, then a summary line), ``"raise"`` (:class:`CanaryViolationError` at the
      next step boundary) or a callable taking a ``Violations`` (a list of the new :class:`SlotViolation`
      records, with ``dropped`` and ``step``: canary/manager/report.py).
    - ``ring_capacity``: violation rows kept per group per step (more are counted as dropped and reported).
    - ``max_requests``: requests that may hold expected tokens at once (default: ``2 * max_reqs``; a finished
      request's pool row is reused last, so stale reads of it are still checked).
    - ``max_step_tokens``: new tokens per step (sizes an SWA group's slot translation and the token staging);
      default ``max(4096, max_seq_len)``.
    - ``stats_every``: log :meth:`stats` as one JSON line every N decoded steps (0: never).
    - ``metrics``: ``None``, ``True`` (the default ``prometheus_client`` registry) or a ``CollectorRegistry``.
    - ``health_steps``: a group scheduled in this many consecutive decoded steps whose kernels did not run
      (launch counters unchanged) raises :class:`CanaryHealthError`, in every mode.
    - ``forget_after``: a reported slot seen again within this many steps is a repeat (counted in the record).
    - ``sweep_budget``: cached-prefix entries each group verifies per step (a :class:`KVGroup`'s own
      ``sweep_budget`` wins; 0, the default: no sweep). ``prefix_source``: ``None`` (register prefixes with
      :meth:`cache_prefix` / :meth:`evict_prefix`) or a callable, called once per step, returning the cache's
      prefixes as ``(key, slots, tokens[, start_position])`` tuples (docs/integration.md 5b).
    - ``eager_graphs``: replay an eager step that repeats the last step's arrays (static step buffers) as one
      CUDA graph per call instead of launching its kernels one by one (CuPy backend; canary/manager/eager.py
      says when a step qualifies). Same launches, same checks, less host time; ``False``: always launch directly.
    - ``ranks``: a :class:`~canary.Ranks` (``tp_rank`` / ``pp_rank`` / ``dp_rank``: labels of the reports, logs,
      stats and metrics); ``communicator``: a :class:`~canary.interop.collectives.Communicator` of the
      tensor-parallel group, or ``{"tp": c, "pp": c}``, to agree on each step with the other ranks (SPEC 4.3).
    Raises ``ValueError`` / ``TypeError`` (``kv-canary:`` messages) for bad arguments,
    :class:`~canary.BackendUnavailableError` when the device's libraries are missing.
    """

    # The report decoder reads these per report: set on the manager after construction, they take effect there
    on_violation, log_limit, stats_every, health_steps, metrics = (DecoderSetting() for _ in range(5))

    @worded("CanaryManager", method=True)
    def __init__(self, groups: KVGroup | Sequence[KVGroup], *, max_batch_size: int, device: Any = "cpu",
                 library: str | None = None, backend: str = "auto", on_violation: str | Callable = "log",
                 ring_capacity: int = 256, max_requests: int | None = None, max_step_tokens: int | None = None,
                 log_limit: int = 8, stats_every: int = 0, metrics: Any = None, health_steps: int = 4,
                 forget_after: int = 64, sweep_budget: int = 0, prefix_source: Callable | None = None,
                 eager_graphs: bool = True, ranks: Any = None, communicator: Any = None):
        specs, (ranks, comms) = check_groups(groups), check_distributed(ranks, communicator)
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
        self.max_batch_size, self.ordinal = int(max_batch_size), cuda_ordinal(device)
        if self.ordinal is not None:
            # The backend's library before anything else: the per-step runtime calls' binding is chosen at their
            # first use (canary/interop/cudart.py runtime), here by the marks' pinned buffers below, and it is
            # CuPy's, the cheaper, only if CuPy is imported by then (the GPU profile of run 139 found the
            # transformers integration on cuda.bindings: 12 enum objects a step)
            backends.resolve(backend, self.ordinal, "records")
        empty = allocator(device, library)
        max_reqs, max_seq_len = index_shape(specs[0])
        rows = (2 * max_reqs if max_requests is None else int(max_requests)) + 1
        cols = max_seq_len + 1  # + 1: a draft group reads column position + 1
        self.pool_array = empty(rows * cols, np.int32).reshape(rows, cols)
        self.requests = RequestPool(rows, cols, len(specs))
        b = self.max_batch_size
        step_tokens = int(max_step_tokens or max(4096, max_seq_len))
        u = max(64, 2 * self.max_batch_size)
        # The host-to-device staging area: the plan's pool rows and valid lengths, then the expected-token
        # scatter's update (rows, columns, offsets, tokens), back to back so that one copy can fill both.
        staging = empty(2 * b + 3 * u + 1 + step_tokens, np.int64)
        self._qv, upd = staging[:2 * b], staging[2 * b:]
        self._q, self._valid = self._qv[:b], self._qv[b:]
        block = ReportBlock([s.name for s in specs], int(ring_capacity), empty, comms and self.ordinal is not None)
        self._marks = ReportedSlots([int(g.num_slots) for g in specs], self.ordinal)  # suppress.py
        self.groups: list[BoundGroup] = [
            bind_group(i, g, pool=self.pool_array, device=device, library=library, backend=backend,
                       max_batch_size=self.max_batch_size, ring_capacity=int(ring_capacity), max_step_tokens=step_tokens,
                       empty=empty, report=block.groups[i], reported_slots=self._marks.arrays[i])
            for i, g in enumerate(specs)
        ]
        self.backend = self.groups[0].records.backend
        # The transfer's two sides (transfer.py): their report kernel and device append are the backend's if it has
        # them (the registry's answer), else copies and the general scatter
        self._transfer = open_transfer(self.ordinal, block=block, pool=self.pool_array, qv=self._qv, q=self._q,
                                       valid=self._valid, upd=upd, u_cap=u, backend=self.backend, empty=empty)
        staging_side, mailbox = self._transfer.staging, self._transfer.mailbox
        # -- sweep hook (canary/manager/sweep.py) --
        self._sweep = Sweeper(self.groups, check_budget("sweep_budget", sweep_budget), empty, self.ordinal,
                              prefix_source)
        self.stats_ = Stats([g.name for g in self.groups])
        metrics = None if metrics is None or metrics is False else PrometheusMetrics(metrics, ranks)
        self._intake = TokenIntake(self.requests, staging_side, self.ordinal, self.max_batch_size)
        # _launch's common case bound once: arrays of CuPy's, no stream given; the capture query of
        # canary/interop/cudart.py's runtime
        self._streams = StreamResolver(self.ordinal, self.pool_array)
        self._launch = self._streams.resolve
        self._launch_capture = self._streams.resolve_capture  # before_forward / after_kv_store: one capture query
        self._is_capturing = runtime().is_capturing if self.ordinal is not None else None
        eager_ok = getattr(backends.load(self.backend, "records"), "EAGER_GRAPHS", False)  # a backend capability
        self._eager = (EagerGraphs(runtime(), self.ordinal)
                       if eager_graphs and self.ordinal is not None and eager_ok else None)
        self._steps = Steps(self.groups, ordinal=self.ordinal, pool_array=self.pool_array, q=self._q,
                            valid=self._valid, rows=self._intake.rows, requests=self.requests, staging=staging_side,
                            mailbox=mailbox, eager=self._eager, sweep=self._sweep, stats_=self.stats_,
                            rpi_snap=empty(b, np.int64))
        self._decoder = ReportDecoder(self.groups, block, pending=self._steps.pending, mailbox=mailbox,
                                      stats_=self.stats_, metrics=metrics, requests=self.requests,
                                      sweep=self._sweep, on_violation=on_violation, log_limit=int(log_limit),
                                      stats_every=int(stats_every), health_steps=int(health_steps),
                                      forget_after=int(forget_after), marks=self._marks)
        self._select, self._handle_reports = self._steps.select, self._decoder.handle_reports
        self._by_name, self._all_names = self._steps.by_name, self._steps.all_names
        # The rooms' state as the tests and benchmarks read it (the same objects)
        self._pending, self._last_counters = self._steps.pending, self._decoder.last_counters
        # The calling contract (guard.py): the lock the request calls and the step calls hold (re-entrant: a
        # callback may call add_request / finish_request), the step thread, the step call in progress
        self._lock = threading.RLock()
        self._thread, self._busy, self._closed = None, None, False
        self._movers, self._move_status = {}, block.move_status  # moves.py: each report carries the move faults
        self._bind_ranks(ranks, comms, block)  # distributed.py: the labels, the per-step agreement

    # The step machine's open step and whether its report joins the after_kv_store graph (tests read and set them)
    _step = property(lambda self: self._steps.step)
    _report_in_graph = property(lambda self: self._steps.report_in_graph,
                                lambda self, value: setattr(self._steps, "report_in_graph", value))

    # -- binding -------------------------------------------------------------------------------------------------
    @step_call(bound=False)
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
        self._steps.prepare_verifies(st)

    def close(self) -> None:
        """Handle every queued report (:meth:`flush`: a host sync; the last step's violations are delivered, and
        may raise as a step call would), then free the pinned host buffers and the captured graphs (GPU). Every
        later call raises ``RuntimeError`` except :meth:`stats` and :attr:`open_violations`; a second close does
        nothing. Callable from any thread (it waits for a step in progress); ``with CanaryManager(...) as m:``
        calls it on exit."""
        if not self._closed:
            self._close()

    @step_call(bound=False)
    def _close(self) -> None:
        try:
            self._handle_reports(wait=True)
        finally:
            self._closed = True
            self._movers.clear()
            if self._eager is not None:
                self._eager.close()
            self._transfer.close()
            self._sweep.close()
            self._marks.close()
            self._streams.close()

    @step_call()
    def rebind(self, group: str | None = None, **buffers: Any) -> None:
        """Bind a group's rebuilt buffers (``group``: its name; ``None``: every group), between steps. An engine
        that rebuilds a buffer a :class:`KVGroup` bound (its index: ``req_to_token``, ``block_table``, ``kv_indptr``,
        ``kv_indices``; ``full_to_swa_index_mapping``, the KV pool behind ``real_kv_sources`` / ``layer_sources``)
        calls it before its next step (or passes a rebuilt block table or page list to :meth:`before_forward`
        each step); the keywords (those names) give the new values, set on the group's KVGroup too, and a name
        not given is read again from the KVGroup (``rebind("full")`` after ``kv_group.req_to_token = new``). The
        plans, the canary records, the expected tokens and the layer table (of as many layers) stay: rebind
        buffers whose contents the engine carried over (the same slots hold the same KV, the same rows the same
        slots). CUDA graphs the engine captured over the manager's calls hold the old buffers: capture them again.
        Without it, the next :meth:`before_forward` raises ``RuntimeError`` naming the buffer and this call (an
        assigned attribute or a moved CuPy / torch storage: what the manager can see); a rebuilt buffer it cannot
        see would be read as missing or corrupt KV.

        Raises ``RuntimeError`` while a step is open, ``ValueError`` / ``TypeError`` as binding does (a
        ``req_to_token`` of another shape, an unknown group or keyword); nothing is rebound then."""
        if self._steps.step is not None:
            raise fail(RuntimeError, f"rebind: expected no open step, got step {self._steps.step.index} open (call "
                                     f"it after after_kv_store / end_step)")
        bad = sorted(set(buffers) - set(BOUND_ATTRS))
        if bad:
            raise fail(TypeError, f"rebind: expected keywords among {list(BOUND_ATTRS)}, got {bad}")
        sel = self._select(None if group is None else [group])
        made = []
        for g in sel:  # every group bound before any is changed: a refusal leaves all as they were
            spec = dataclasses.replace(g.spec, **buffers)
            made.append((g, spec, rebound(g, spec, pool=self.pool_array, max_batch_size=self.max_batch_size)))
        for g, spec, (planner, records, layers) in made:
            for name, value in buffers.items():
                setattr(g.spec, name, value)
            g.planner, g.records, g.layers, g.verify_launch = planner, records, layers, None
            g.bound = bound_of(g.spec)
        self._drop_movers(sel)  # bound again to the new records and layers at their next call
        self._marks.clear()  # a rebuilt buffer may hold other slots' KV
        self._steps.prepared = False  # the verifies are packed again (GPU) before the next step
        if self._eager is not None:
            self._eager.forget()  # its graphs launch the old planners' and records' kernels

    def _append_scatter(self, empty, upd) -> DeviceScatter:
        # What a manager without the backend's device append builds (staging.append_scatter; tests build it too)
        return append_scatter(empty, self.pool_array, self._qv, upd, self.ordinal, self.backend)

    # -- per step ------------------------------------------------------------------------------------------------
    @step_call()
    def before_forward(self, *, req_pool_indices: Any, prefix_lens: Any, extend_seq_lens: Any,
                       request_ids: Sequence[Hashable] | None, groups: Sequence[str] | None = None,
                       stream: Any = None, block_table: Any = None, kv_indptr: Any = None,
                       kv_indices: Any = None) -> None:
        """Plan and verify the step (before attention reads the KV), on ``stream``.

        ``req_pool_indices`` (``rp``), ``prefix_lens`` (``P``), ``extend_seq_lens`` (``E``): ``[bs]`` int32 / int64
        (SPEC 2; device arrays on a GPU; row 0 = padding). ``request_ids``: host sequence of ``bs``
        engine request ids (``None`` for padding rows). ``groups``: names of the groups this forward reads (default:
        all; a draft model's forward passes its own group). ``block_table`` / ``kv_indptr`` / ``kv_indices``: the
        step's index arrays in place of a group's bound ones (SPEC 3.8; an engine that rebuilds them each step): an
        array for every planned group bound with that form, or ``{group name: array}``; checked on the host like the
        bound ones. ``ValueError`` for a request id listed twice and, with host arrays, an out-of-range ``rp``,
        ``P`` or ``E`` (docs/integration.md 3). Reports of earlier steps that have reached the host are handled
        first: logged, raised (:class:`CanaryViolationError`) or passed to the callback;
        :class:`CanaryHealthError` when the kernels stopped running. While ``stream`` is capturing a CUDA graph
        only the launches are recorded: call :meth:`begin_step` before each replay and :meth:`end_step` after.
        Never syncs the engine's stream. A call that raises leaves no step open: the engine may call it again,
        and :meth:`after_kv_store` without a successful :meth:`before_forward` raises before writing anything.
        """
        sel = self._select(groups)
        handle, st, capturing = self._launch_capture(stream)
        bs = self._steps.batch_size(req_pool_indices, self.max_batch_size)  # before the step opens, as every check
        index = step_arrays(sel, block_table=block_table, kv_indptr=kv_indptr, kv_indices=kv_indices)
        if not capturing:
            steps = self._steps
            steps.check_request_ids(request_ids, bs)
            check_bound(sel)  # a rebuilt buffer the manager would still read: refused, naming rebind
            steps.check_lengths(sel, req_pool_indices, prefix_lens, extend_seq_lens)  # host arrays
            steps.begin(request_ids, groups, handle, self._poll_ready, self._eager is not None, index)
            try:
                if not steps.prepared:
                    steps.prepare_verifies(st)
                if self._eager is None:
                    steps.plan_and_verify(sel, req_pool_indices, prefix_lens, extend_seq_lens, bs, st, index)
                else:
                    steps.eager_plan_and_verify(sel, req_pool_indices, prefix_lens, extend_seq_lens, bs, st, index)
            except BaseException:
                steps.recover(handle)
                raise
        else:
            steps = self._steps
            steps.plan_and_verify(sel, req_pool_indices, prefix_lens, extend_seq_lens, bs, st, index)
            steps.graph_inputs[bs] = steps.inputs  # what begin_step / end_step report for this graph's replays
            steps.graph_index[bs] = index  # the page lists its replays read (their reports' attributions)

    @step_call()
    def after_kv_store(self, *, out_cache_loc: Any, input_ids: Any, positions: Any,
                       groups: Sequence[str] | None = None, out_cache_loc_by_group: dict[str, Any] | None = None,
                       stream: Any = None) -> None:
        """Write the canary records of the step's new tokens (after the step's KV stores), then queue the step's
        report for the host (read at a later :meth:`before_forward`).

        ``out_cache_loc``, ``input_ids``, ``positions``: ``[N]`` int32 / int64 (slot, token id, position of each new
        token; slot < 0: skipped). An SWA group's slots are ``full_to_swa_index_mapping[out_cache_loc]``,
        computed into a preallocated buffer on the launch stream (torch, CuPy and NumPy arrays; a negative slot
        stays negative, a slot past the mapping becomes one the write reports as ``SLOT_RANGE``:
        ``canary/manager/slots.py``), unless ``out_cache_loc_by_group[name]`` (``[N]`` int32/64) gives them. Every
        group's slots are checked or translated before any group writes. ``groups``: the step's (its
        :meth:`before_forward`'s) by default; a group it did not plan is a ``ValueError``. ``stream`` as in
        :meth:`before_forward`. Raises ``TypeError`` for arrays that are not int32 or int64.
        """
        sel = self._select(groups)
        handle, st, capturing = self._launch_capture(stream)
        steps = self._steps
        step = steps.step
        if not capturing and step is None:  # before any write: no record is written for a step never opened
            raise fail(RuntimeError, "after_kv_store: expected a step opened by before_forward / begin_step, got none")
        if not capturing and not (groups is None and step.groups is self._all_names):
            groups, sel = steps.store_groups(groups, sel, step)
        if not capturing and step.tokens is not None:
            steps.check_tokens(step, out_cache_loc, input_ids, positions)
        in_graph = False
        if capturing or self._eager is None or out_cache_loc_by_group or (
                steps.translates and any(g.loc_scratch is not None for g in sel)):
            steps.write(sel, out_cache_loc, input_ids, positions, out_cache_loc_by_group, st)
        else:
            names = self._all_names if groups is None else tuple(g.name for g in sel)
            in_graph = steps.eager_write(sel, names, out_cache_loc, input_ids, positions, st)
        if not capturing:
            self._note_entries(sel, out_cache_loc, input_ids, positions, out_cache_loc_by_group)
            steps.end(handle, st, reported=in_graph)

    @step_call()
    def begin_step(self, request_ids: Sequence[Hashable] | None, *, groups: Sequence[str] | None = None,
                   stream: Any = None) -> None:
        """The host half of :meth:`before_forward`: handle ready reports, then stage the step's expected-token
        pool rows and valid lengths (and queued tokens) on ``stream``. A CUDA-graph engine calls it before each
        replay of a graph that captured :meth:`before_forward` / :meth:`after_kv_store`."""
        steps = self._steps
        steps.begin(request_ids, groups, self._launch(stream)[0], self._poll_ready)
        # The report of the engine's graph of this batch size names its captured req_pool_indices, whatever eager
        # step ran in between (an eager step at another batch size leaves its own in steps.inputs).
        steps.inputs = steps.graph_inputs.get(steps.step.bs, steps.inputs)

    @step_call()
    def end_step(self, *, stream: Any = None) -> None:
        """The host half of :meth:`after_kv_store`: stage and launch the cached-prefix sweep of the step's groups
        (eager, never captured), then queue the device-to-host copy of the step's report."""
        self._steps.end(*self._launch(stream))

    @step_call()
    def poll(self) -> None:
        """Handle every step report that has reached the host (never waits). :meth:`before_forward` calls it."""
        self._handle_reports(wait=False)

    def _poll_ready(self) -> None:
        # The step calls' own poll, inside their guard (tests replace it to hold reports back)
        self._handle_reports(wait=False)

    @step_call()
    def flush(self) -> None:
        """Wait for every queued step report and handle it (a host sync: at shutdown, or in tests)."""
        self._handle_reports(wait=True)

    # -- cached-prefix sweep (docs/integration.md 5b; the rotation lives in canary/manager/sweep.py) -------------
    @request_call
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

    @request_call
    def evict_prefix(self, key: Hashable) -> None:
        """Stop sweeping a cached prefix. Call it when the cache frees the slots, before they are handed out
        again: a slot swept after its reuse is reported. ``KeyError`` for a key not cached."""
        self._sweep.evict(key)
        self._marks.release_prefix(key)

    @step_call()
    def sweep(self, *, stream: Any = None) -> None:
        """An idle step: verify the next ``sweep_budget`` cached entries of every swept group with no forward
        (an engine with nothing to run calls it from its idle loop). Handles ready reports first, like
        :meth:`before_forward`; its own report is read at a later call. Not graph-capturable (host staging)."""
        handle, st = self._launch(stream)
        if self.ordinal is not None and is_capturing(handle):
            raise fail(RuntimeError, "sweep: expected a stream that is not capturing a CUDA graph, got a capturing "
                                     "one (the sweep stages its entries on the host)")
        steps = self._steps
        inputs, steps.inputs = steps.inputs, None
        try:
            steps.begin([], [], handle, self._poll_ready)
            steps.step.sweep = tuple(self._sweep.sweeps)
            steps.end(handle, st)
        finally:
            steps.inputs = inputs

    # -- stats ---------------------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Totals: ``steps``, ``decoded_steps``, ``protected_tokens`` (expected tokens held for running requests),
        per group ``verified_entries`` / ``written_entries`` (the kernels' counters) / ``sampled_steps`` /
        ``input_error_steps``, ``violations_by_reason`` (new violations per reason name), ``repeated_sightings``,
        ``ring_dropped``, ``reported_slots_marked`` (docs/integration.md 7); how the step calls launched:
        ``graph_captures`` / ``graph_replays`` / ``direct_calls`` (eager graphs: calls replayed, or launched
        directly for want of a graph; ``None`` without them), ``graph_misses`` (``{"<before|after> <why>": calls}``,
        why a direct call found no graph: ``new``, ``stream``, ``arrays``, ``layout``), ``stream_handshakes`` (explicit ``stream=`` calls
        ordered after the library's current stream), ``move_faults`` (the record moves' refused entries by fault
        name, ``{"SOURCE_RANGE": n, "DEST_RANGE": n}``, from the reports: moves.py). As of the last decoded report."""
        with self._lock:
            e = self._eager
            return {**self._decoder.stats(), "graph_captures": e.captures if e else 0, "graph_replays": e.replays
                    if e else 0, "direct_calls": e.direct if e else None,
                    "graph_misses": dict(e.misses) if e else {}, "stream_handshakes": self._streams.handshakes}

    @property
    def open_violations(self) -> list[SlotViolation]:
        """The violations reported within ``forget_after`` steps, with their counts and steps."""
        with self._lock:
            return list(self._decoder.dedup.open.values())

    def staged_expected_tokens(self, bs: int) -> tuple[np.ndarray, np.ndarray]:
        """What the last step staged for its plans, first ``bs`` rows: ``(valid lengths, pool rows)``, its
        ``req_to_verify_expected_tokens_valid_lens`` and ``expected_token_pool_indices`` (``[bs]`` int64 each; a
        pool row indexes ``pool_array``) as NumPy arrays (:func:`canary.to_host`: device arrays are copied, a sync;
        a host manager's are views of its staging, rewritten by the next step). A diagnostic read (a replay's
        reference check), never for the hot path. Raises ``ValueError`` for ``bs`` outside ``[0, max_batch_size]``."""
        if isinstance(bs, bool) or not isinstance(bs, (int, np.integer)) or not 0 <= int(bs) <= self.max_batch_size:
            raise fail(ValueError, f"bs: expected an int in [0, max_batch_size = {self.max_batch_size}], got {bs!r}")
        bs = int(bs)
        with self._lock:
            if self._closed:
                self._refuse("staged_expected_tokens")
            return to_host(self._valid[:bs]), to_host(self._q[:bs])
