"""The step state machine: one step open at a time, from ``before_forward`` / ``begin_step`` to
``after_kv_store`` / ``end_step`` (canary/manager/manager.py holds those calls and their contracts).

:class:`Steps` opens a step (its :class:`StepRecord`), stages the batch's pool rows, valid lengths and queued
tokens (through the staging, canary/manager/staging.py, the update it took queued again if never launched),
launches each group's plan, verify and write (or replays them as one CUDA graph, canary/manager/eager.py), and
closes the step by queueing its report (the mailbox, canary/manager/mailbox.py) in ``pending``, which the
decoder (canary/manager/decode.py) reads.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import fail
from ..interop.adapter import INT_WIDTHS, as_view
from ..interop.cudart import D2D, OnDevice, runtime
from .eager import MISS
from .groups import BoundGroup
from .index import form_of, index_shape, open_pages
from .layers import verify_layers, write_layers
from .pool import RowTokens
from .slots import translate as translate_slots


_NONE: dict = {}  # no index arrays of the step's own (plan_and_verify)


class StepRecord:
    """One step: its index, request ids, groups, batch size and ``sweep``, the groups whose sweep runs at
    end_step (``None``: those of ``groups``); ``tokens``: the new tokens its before_forward planned when the host
    knows them (``(sum of host extend_seq_lens, exact)``, over the non-padding rows and not exact when the batch
    has padding rows, whose tokens may follow; ``None``: only the device knows). A slotted class: one is made
    every step."""

    __slots__ = ("index", "request_ids", "groups", "bs", "sweep", "tokens", "narrow")

    def __init__(self, index: int, request_ids: tuple, groups: tuple, bs: int):
        self.index, self.request_ids, self.groups, self.bs, self.sweep = index, request_ids, groups, bs, None
        self.tokens: int | None = None
        self.narrow = False  # its report's req_pool_indices words hold int32 rows in their low halves


class Steps:
    """The steps of a manager over ``groups``: ``pool_array`` and its staged rows ``q`` / lengths ``valid`` (the
    device area the plans read), ``rows`` (the intake's :meth:`~canary.manager.intake.TokenIntake.rows`),
    ``requests`` (the pool), ``staging`` and ``mailbox`` (the transfer's two sides, their attributes read at each
    call), ``eager`` (``EagerGraphs`` or ``None``), ``sweep`` (the ``Sweeper``), ``stats_`` (steps counted there).

    ``rpi_snap``: ``[max_batch_size]`` int64, the manager's own copy of each step's ``req_pool_indices``, taken at
    before_forward (on its stream, graph-capturable): the report names the rows the step planned, whatever the
    engine writes into its own buffer before after_kv_store.

    ``step``: the open step's record (``None``: none open); ``inputs``: ``(view of rpi_snap[:bs], bs, narrow)``
    the step's report copies (:meth:`snapshot_rows`); ``pending``: ``(record, mailbox token)`` of each queued report, oldest first."""

    def __init__(self, groups: list[BoundGroup], *, ordinal: int | None, pool_array: Any, q: Any, valid: Any,
                 rows: Callable, requests, staging, mailbox, eager, sweep, stats_, rpi_snap: Any):
        self.groups, self.ordinal, self.pool_array, self.q, self.valid = groups, ordinal, pool_array, q, valid
        self.rows, self.requests, self.staging, self.mailbox = rows, requests, staging, mailbox
        self.eager, self.sweep, self.stats_ = eager, sweep, stats_
        self.by_name = {g.name: g for g in groups}
        self.group_at: dict[tuple, np.ndarray] = {}  # step group names -> [k, 1] their indices (the pool's per group)
        self.last_planned: tuple | None = None  # (group names, pool rows, pool version) of the last planned counts
        self.all_names = tuple(g.name for g in groups)
        self.step_inputs: dict[int, tuple] = {}  # bs -> (q[:bs], valid[:bs]): the same objects every step
        # An eager step's report joins its after_kv_store graph: written by the report kernel, and no sweep between
        self.report_in_graph = mailbox.report_launch is not None and not sweep
        self.pending: deque = deque()
        self.prepared = False  # prepare_verifies ran
        self.step: StepRecord | None = None
        self.step_members = 0  # the pool's members version when the open step began
        self.closed: tuple | None = None  # (record, its step_members) of the last closed step
        self.inputs: tuple | None = None
        self.last_staged: tuple | None = None  # (pool rows, pool version, stream) of the last staging
        self.deferred: tuple | None = None  # (scatter, rows, tokens, copy): the staging left to before_forward
        self.taken: list | None = None  # the pool updates that staging carries (queued again if never launched)
        self.graph_inputs: dict[int, tuple] = {}  # bs -> the report inputs of the engine's captured graph
        self.translates = any(g.loc_scratch is not None for g in groups)  # an SWA group translates slots
        self.rpi_snap = rpi_snap
        self.rpi_views: dict[int, Any] = {}  # bs -> the view of rpi_snap[:bs] (the same object every step)
        self.paged = [g for g in groups if form_of(g.spec) == "page_list"]  # their page_rows are kept per step
        self.graph_index: dict[int, dict | None] = {}  # bs -> the step arrays the engine's captured graph reads
        self.rt = runtime() if ordinal is not None else None
        self.agree = None  # distributed.py's DeviceDigests of a GPU manager with a communicator

    def select(self, groups: Sequence[str] | None) -> list[BoundGroup]:
        if groups is None:
            return self.groups
        if isinstance(groups, str):
            groups = [groups]
        elif not isinstance(groups, (list, tuple)):
            raise fail(TypeError, f"groups: expected a list of group names among {sorted(self.by_name)}, got "
                                  f"{type(groups).__name__}")
        out = []
        for name in groups:
            g = self.by_name.get(name)
            if g is None:
                raise fail(ValueError, f"groups: expected names among {sorted(self.by_name)}, got {name!r}")
            out.append(g)
        return out

    def prepare_verifies(self, stream: Any) -> None:
        # Each group's plan arrays are the manager's and never move: their verify is checked and packed once
        # (eager: at warmup, else the first step outside a capture), then only launched.
        self.prepared = True
        if self.ordinal is not None:
            for g in self.groups:
                g.verify_launch = g.records.prepare_verify(g.verify_plan, launch_tag=g.verify_tag, stream=stream)

    def begin(self, request_ids, groups, handle: int, poll: Callable, defer_scatter: bool = False,
              index: Any = MISS) -> None:
        """Open a step for ``request_ids`` over ``groups`` (names; ``None``: all) on stream ``handle``: ``poll``
        (the manager's) first when reports are queued, then the batch's pool rows and queued tokens staged
        (``defer_scatter``: the last scatter left in ``deferred`` for the caller to launch). ``index``: the step's
        own index arrays (:func:`~canary.manager.index.step_arrays`; not given: a replay of the engine's graph,
        whose captured ones). Before ``poll``, each planned page-list group's ``page_rows`` becomes this step's:
        the engine has filled its page list for it, and the reports decoded now are attributed through it."""
        self.deferred = None
        if self.step is not None:
            raise fail(RuntimeError, f"before_forward: expected the previous step ({self.step.index}) closed by "
                                     f"after_kv_store / end_step, got a new step first")
        if self.paged:  # before the poll: the reports it decodes read this step's page lists
            open_pages(self.paged if groups is None else self.select(groups), request_ids, index,
                       self.graph_index if index is MISS else None)
        if self.pending:
            poll()
        ids, q = self.rows(request_ids)
        bs = len(ids)
        pool = self.requests
        # Nothing to stage when the pool rows are the last staged ones and no count changed since (no token
        # accepted, no request added or finished: no update queued either), on the same stream: the device area
        # holds them (ordered behind the last copy). Another stream copies again: the last copy may not have run
        # by the time that stream's plan reads the area.
        last = self.last_staged
        updates = pool.updates
        if last is None or last[0] is not q or last[1] != pool.version or last[2] != handle or updates:
            one = updates[0] if len(updates) == 1 else None
            taken = pool.take_updates()
            staging = self.staging
            try:
                if type(one) is RowTokens and one.rows is q and (
                        one.device is not None or staging.device_append is not None):
                    # Tokens for exactly this step's rows: appended on the device (device token ids where they
                    # are, host ints from pinned memory), which also advances the plan's valid lengths there (no
                    # copy when it holds these rows' lengths from before the accept).
                    synced = last is not None and last[0] is q and last[1] == one.version and last[2] == handle
                    self.deferred = staging.stage_device_append(q, one, handle, synced, defer_scatter)
                elif type(one) is RowTokens and one.rows is q and staging.append is not None:
                    # A decode batch that accepted one token a request for exactly this step's rows: the scatter
                    # reads the plan's staged rows and valid lengths (the tokens' columns are valid - 1).
                    self.deferred = staging.stage_append(q, one.ends, one.tokens, handle, defer_scatter)
                else:
                    self.deferred = staging.stage(self.pool_array, taken, self.q, self.valid, q, pool.counts[q],
                                                  handle, defer_scatter)
            except BaseException:
                # Not launched (or only in part: a scatter is idempotent, and the append launches last): the next
                # staging takes them again, from a fresh copy of the rows and lengths.
                self.taken = taken
                self.requeue()
                self.last_staged = None
                raise
            self.taken = taken if self.deferred is not None else None
            self.last_staged = (q, pool.version, handle)
        names = self.all_names if groups is None else tuple(g.name for g in self.select(groups))
        # the tokens this step's rows may write below, in the step's groups (attribution.py): every step, staged or
        # not (the last staging of these rows may have been another group's step)
        lp = self.last_planned
        if lp is None or lp[0] is not names or lp[1] is not q or lp[2] != pool.version:  # else: as they are
            at = self.group_at.get(names)
            if at is None:
                at = self.group_at[names] = np.array([self.by_name[n].index for n in names], np.int64)[:, None]
            pool.planned[at, q] = pool.counts[q]
            self.last_planned = (names, q, pool.version)
        self.step = StepRecord(self.stats_.steps, ids, names, bs)
        self.step_members = pool.members
        self.stats_.steps += 1

    def recover(self, handle: int) -> None:
        """After a before_forward that raised once its step was open: the staging it left to the call reaches the
        pool (launched once now, else queued again), the next call stages again, and the step is dropped."""
        d, self.deferred = self.deferred, None
        try:
            if d is not None:  # the staged tokens still reach the pool (it was not launched: once now)
                try:
                    self.staging.launch_deferred(d, handle)
                except BaseException:
                    self.requeue()  # still not launched: the next staging takes the update again
                    raise
                self.taken = None
                self.staging.deferred_launched(d, handle)
        finally:
            self.last_staged = None  # the next call stages again
            self.taken = None
            self.abandon()

    def store_groups(self, groups, sel, step: StepRecord):
        """after_kv_store's ``(groups, sel)``: a group the step did not plan has no write plan for it (its last one
        is another step's): the step's groups by default, and naming another is an error."""
        if groups is None:
            return step.groups, self.select(step.groups)
        extra = [g.name for g in sel if g.name not in step.groups]
        if extra:
            raise fail(ValueError, f"groups: expected groups this step's before_forward planned "
                                   f"({list(step.groups)}), got {extra}")
        return groups, sel

    def eager_plan_and_verify(self, sel, req_pool_indices, prefix_lens, extend_seq_lens, bs: int, st,
                              index: dict | None = None) -> None:
        # A decode batch's device append joins the graph (its call, a fixed address, and row count in the key; its
        # copy, if any, already launched by the staging); the general scatter does not. Either stays in
        # self.deferred until launched, so that a call that raises first still launches it. A step's own index
        # arrays (index.step_arrays) are objects of the call like the step arrays: a graph replays only for them.
        scatter = self.deferred
        if scatter is not None and scatter[0] is self.staging.scatter:
            # its row and token counts change with nearly every batch: ahead of the graph, keyed by the batch alone
            scatter = self._launch_deferred(scatter, st.handle)
        objs = (req_pool_indices, prefix_lens, extend_seq_lens)
        if index:
            objs += tuple(a for name in sorted(index) for _, a in sorted(index[name].items()))
        # The arrays' identities in the key too: an engine alternating two sets of buffers (async batching's
        # IO pairs) gets a graph per set, not a miss every step (a replay still checks them by ``is``)
        key = (self.step.groups, bs, scatter, None if not index else tuple(
            (name, tuple(sorted(index[name]))) for name in sorted(index)), tuple(map(id, objs)))
        got = self.eager.launch("before", key, objs, st)
        if got is not MISS:
            self.deferred = self.taken = None  # launched: never again (the device append is not idempotent)
            if scatter is not None:
                self.staging.deferred_launched(scatter, st.handle)
            self.inputs = got
            return
        if scatter is not None:
            self._launch_deferred(scatter, st.handle)
        self.plan_and_verify(sel, req_pool_indices, prefix_lens, extend_seq_lens, bs, st, index)

        def body(stream):
            if scatter is not None:
                self.staging.launch_deferred(scatter, stream.handle)
            self.plan_and_verify(sel, req_pool_indices, prefix_lens, extend_seq_lens, bs, stream, index)
            return self.inputs

        self.eager.observe("before", key, objs, st, self.pool_array, body)

    def _launch_deferred(self, scatter: tuple, handle: int) -> None:
        self.staging.launch_deferred(scatter, handle)
        self.deferred = self.taken = None  # launched: never again (the device append is not idempotent)
        self.staging.deferred_launched(scatter, handle)

    def requeue(self) -> None:
        # Taken updates that never launched (a staging that raised, or the launch left to before_forward,
        # self.deferred): queued again, ahead of anything queued since.
        if self.taken:
            self.requests.updates[:0] = self.taken
        self.taken = None

    def abandon(self) -> None:
        # A before_forward that raised after opening its step: the step is dropped (not counted, no report).
        # Launches it made before the error report with the next step's snapshot, which copies the same ring.
        self.step = None
        self.stats_.steps -= 1

    def plan_and_verify(self, sel, req_pool_indices, prefix_lens, extend_seq_lens, bs: int, st: Any,
                        index: dict | None = None) -> None:
        """``index``: the step's own index arrays by group name (canary/manager/index.py step_arrays), passed to
        those groups' planners in place of the bound ones (SPEC 3.8)."""
        qv = self.step_inputs.get(bs)
        if qv is None:  # sliced once per batch size: the planner then reuses its views of the same objects
            qv = self.step_inputs[bs] = (self.q[:bs], self.valid[:bs])
        q, valid = qv
        for g in sel:
            own = index.get(g.name, _NONE) if index else _NONE
            g.planner.plan(req_pool_indices=req_pool_indices, prefix_lens=prefix_lens, extend_seq_lens=extend_seq_lens,
                           req_to_verify_expected_tokens_valid_lens=valid, expected_token_pool_indices=q,
                           stream=st, **own)
            if g.verify_launch is not None:  # the group's own plan, checked and packed at warmup
                g.records.launch_prepared(g.verify_launch, stream=st)
            else:
                g.records.verify(g.verify_plan, launch_tag=g.verify_tag, stream=st)
            verify_layers(g, st)
        # The report reads the step's rows from the manager's copy, made here (ordered on this stream behind the
        # planner's view of them): an engine that refills its buffer before after_kv_store changes nothing.
        last = sel[0].planner.last_step if sel else None
        rpi = last.req_pool_indices if last is not None else as_view(req_pool_indices, "req_pool_indices")
        snap, narrow = self.snapshot_rows(rpi, bs, st)
        self.inputs = (snap, bs, narrow)
        if self.ordinal is None and self.step is not None and last is not None:
            # Host arrays: the step's token count is known here. A padding row (row 0) plans no tokens (its
            # extend_seq_lens is anything) and padding tokens may follow the active rows': at least the count then.
            active = snap.host != 0
            ext = last.extend_seq_lens.host
            rows = self.q[:bs][active]  # the prefix + extend the rows wrote up to (a chunked prefill's part), per group
            at = np.array([g.index for g in sel], np.int64)[:, None]
            self.requests.written[at, rows] = last.prefix_lens.host[active] + ext[active]
            self.requests.written[:, 0] = -1
            if (ext[active] < 0).any():  # the plan's BAD_EXTEND_LEN reports it as an input error: no count to hold
                self.step.tokens = None
            else:
                self.step.tokens = (int(ext.sum()), True) if active.all() else (int(ext[active].sum()), False)

    def snapshot_rows(self, rpi, bs: int, st: Any) -> tuple[Any, bool]:
        """Copy ``bs`` rows of ``rpi`` (int32 or int64) into ``rpi_snap`` (int64 words) on ``st``; returns the
        copy's view and whether its words hold int32 rows in their low halves (``narrow``: a device's int32
        ``rpi``, copied with a stride of 8 bytes, as the report's copies take 8-byte words; the decoder reads the
        low halves). On the host the assignment widens."""
        snap = self.rpi_views.get(bs)
        if snap is None:
            snap = self.rpi_views[bs] = as_view(self.rpi_snap[:bs], "req_pool_indices")
        narrow = self.ordinal is not None and rpi.dtype.itemsize == 4
        if bs:
            if self.ordinal is None:
                snap.host[...] = rpi.host[:bs]
            else:  # a device-to-device copy on the launch stream: recorded too while capturing
                with OnDevice(self.rt, self.ordinal):
                    if narrow:
                        self.rt.memcpy2d_async(snap.ptr, 8, rpi.ptr, 4, 4, bs, D2D, st.handle)
                    else:
                        self.rt.memcpy_async(snap.ptr, rpi.ptr, 8 * bs, D2D, st.handle)
        return snap, narrow

    def batch_size(self, req_pool_indices: Any, max_batch_size: int) -> int:
        """before_forward's ``bs`` from ``req_pool_indices``' shape (an attribute read: no DLPack export inside a
        capture), checked before the step opens: a refused call leaves no step behind (a retry, or an
        after_kv_store that writes with the last step's plan, would otherwise follow)."""
        try:
            shape = req_pool_indices.shape
            bs = int(shape[0])
        except (AttributeError, IndexError, TypeError):
            raise fail(TypeError, f"req_pool_indices: expected a [bs] int32 or int64 array, got "
                                  f"{type(req_pool_indices).__name__}"
                                  f"{' of shape ' + str(tuple(req_pool_indices.shape)) if hasattr(req_pool_indices, 'shape') else ''}"
                       ) from None
        if len(shape) != 1:  # its first extent is no batch size: request_ids would be blamed for it
            raise fail(ValueError, f"req_pool_indices: expected a [bs] int32 or int64 array, got shape {tuple(shape)}")
        if bs > max_batch_size:
            raise fail(ValueError, f"req_pool_indices: expected bs <= max_batch_size = {max_batch_size}, got {bs}")
        return bs

    @staticmethod
    def check_request_ids(request_ids: Any, bs: int) -> None:
        """``request_ids``: a sequence (not a str) of one id per batch row."""
        if isinstance(request_ids, (str, bytes, bytearray)):
            raise fail(TypeError, f"request_ids: expected a sequence of request ids, got "
                                  f"{type(request_ids).__name__} {request_ids!r}")
        try:
            n_ids = 0 if request_ids is None else len(request_ids)
        except TypeError:
            raise fail(TypeError, f"request_ids: expected a list of bs = {bs} request ids (None for padding "
                                  f"rows), got {type(request_ids).__name__}") from None
        if n_ids != bs:
            raise fail(ValueError, f"request_ids: expected one id per batch row (bs = {bs}), got {n_ids}")

    @staticmethod
    def check_lengths(sel, req_pool_indices: Any, prefix_lens: Any, extend_seq_lens: Any) -> None:
        """A host manager's (device="cpu") refusal, before the step opens, of what the plan would flag for an active
        row (SPEC 3.4 bits 2, 4, 32) one step late, after the engine's write of that step had put records the plan
        could not chain (false violations naming real requests): ``req_pool_indices`` outside ``[0, max_reqs)``,
        ``prefix_lens`` outside ``[0, max_seq_len]``, a negative ``extend_seq_lens`` (the bounds: the smallest
        of the groups ``sel``)."""
        arrays = (req_pool_indices, prefix_lens, extend_seq_lens)
        if not all(isinstance(a, np.ndarray) for a in arrays):
            return  # another library's host arrays: the plan's status bits report them
        rows, pre, ext = (a.reshape(-1) for a in arrays)
        n = min(rows.shape[0], pre.shape[0], ext.shape[0])
        rows, pre, ext = rows[:n], pre[:n], ext[:n]
        max_reqs, max_seq = (min(b) for b in zip(*(index_shape(g.spec) for g in sel)))
        active = rows != 0
        for name, values, bad, want in (
                ("req_pool_indices", rows, (rows < 0) | (rows >= max_reqs), f"a row in [0, max_reqs = {max_reqs})"),
                ("prefix_lens", pre, active & ((pre < 0) | (pre > max_seq)),
                 f"a prefix length in [0, max_seq_len = {max_seq}] for an active row"),
                ("extend_seq_lens", ext, active & (ext < 0), ">= 0 new tokens for an active row"),
                # new tokens past the row (bit 32 too): the write plan drops the row's, so the next rows' records
                # land in its entries' slots (false violations naming them). The prefix is in range here.
                ("extend_seq_lens", ext, active & (ext > max_seq - pre),
                 "at most max_seq_len - prefix_lens = {room} new tokens for an active row")):
            at = np.flatnonzero(bad)
            if at.size:
                i = int(at[0])
                want = want.format(room=max_seq - int(pre[i])) if "{room}" in want else want
                raise fail(ValueError, f"{name}[{i}]: expected {want} (req_pool_indices[{i}] = {int(rows[i])}), "
                                       f"got {int(values[i])}")

    @staticmethod
    def check_tokens(step: StepRecord, out_cache_loc, input_ids, positions) -> None:
        """after_kv_store's token arrays against the tokens the step planned, where the host knows them: a write
        of more or fewer tokens than the plan would report real requests' KV as corrupt a step later."""
        n, exact = step.tokens
        for name, arr in (("out_cache_loc", out_cache_loc), ("input_ids", input_ids), ("positions", positions)):
            shape = getattr(arr, "shape", None)
            if shape is None:
                shape = np.shape(arr) if isinstance(arr, (list, tuple)) else None
            if shape is not None and len(shape) == 1 and (shape[0] != n if exact else shape[0] < n):
                raise fail(ValueError, f"after_kv_store: {name}: expected {'' if exact else 'at least '}{n} tokens "
                                       f"(the step's extend_seq_lens sum{'' if exact else ' over its non-padding rows'}"
                                       f"), got {shape[0]}")

    def eager_write(self, sel, names, out_cache_loc, input_ids, positions, st) -> bool:
        """The writes through a replayed graph when they may be (canary/manager/eager.py); returns whether the
        graph also launched the step's report. The report joins the graph when nothing runs between the writes
        and it (no sweep) and the transfer reports through its kernel; ``end`` then only records it."""
        inputs = self.inputs
        report = self.report_in_graph and inputs is not None
        objs = (out_cache_loc, input_ids, positions)
        key = ((names, inputs[0].ptr, inputs[1]) if report else (names, None, None)) + (tuple(map(id, objs)),)
        if report:
            self.free_report_slot()  # before the graph: it holds the report's launch
            self.mailbox.order_report(st.handle)
        got = self.eager.launch("after", key, objs, st)
        if got is not MISS:
            return got
        self.write(sel, out_cache_loc, input_ids, positions, None, st)

        def body(stream):
            self.write(sel, out_cache_loc, input_ids, positions, None, stream)
            if report:
                self.mailbox.report_device(inputs[0], inputs[1], stream.handle)
            return report

        self.eager.observe("after", key, objs, st, self.pool_array, body)
        return False

    def write(self, sel, out_cache_loc, input_ids, positions, out_cache_loc_by_group, st) -> None:
        # Every group's slots first (translated, or checked when given by group), then the writes: an input that
        # fails for one group fails the call before any group has written.
        locs, n = [], None
        if out_cache_loc_by_group:  # input_ids' length, once (not 1-D: the first write refuses it, before any write)
            ids = as_view(input_ids, "input_ids")
            n = ids.shape[0] if len(ids.shape) == 1 else None
        for g in sel:
            loc = out_cache_loc_by_group.get(g.name) if out_cache_loc_by_group else None
            if loc is not None:
                self.check_group_loc(g.name, loc, n)
            elif g.loc_scratch is not None:
                loc = translate_slots(g.spec.full_to_swa_index_mapping, out_cache_loc, g.loc_scratch,
                                      0 if st is None else st.handle)
            locs.append(out_cache_loc if loc is None else loc)
        for g, loc in zip(sel, locs):
            g.records.write(g.write_plan, out_cache_loc=loc, input_ids=input_ids, positions=positions,
                            launch_tag=g.write_tag, stream=st)
            write_layers(g, loc, st)
        if self.agree is not None:  # a GPU manager's agreement words (distributed.py DeviceDigests), behind the writes
            self.agree(sel, out_cache_loc, input_ids, positions, out_cache_loc_by_group, st)

    @staticmethod
    def check_group_loc(name: str, loc: Any, n: int | None) -> None:
        """``out_cache_loc_by_group[name]``: ``[n]`` int32 or int64, one per token of ``input_ids`` (``n``: its length,
        ``None`` when it is not 1-D); the write checks the rest."""
        arg = f"out_cache_loc_by_group[{name!r}]"
        view = as_view(loc, arg)
        if len(view.shape) != 1 or (n is not None and view.shape[0] != n):
            raise fail(ValueError, f"{arg}: expected [N] slots, one per token of input_ids ([{n}]), "
                                   f"got shape {tuple(view.shape)}")
        if view.dtype not in INT_WIDTHS:
            raise fail(TypeError, f"{arg}: expected dtype int32 or int64 slots, got {view.dtype}")

    def end(self, handle: int, st: Any, reported: bool = False) -> None:
        """``reported``: the step's report kernel ran inside the replayed graph (only its host half is left)."""
        if self.step is None:
            raise fail(RuntimeError, "after_kv_store: expected a step opened by before_forward / begin_step, got none")
        if self.sweep:
            self.run_sweep(self.step, handle, st)
        rpi, bs, self.step.narrow = self.inputs if self.inputs is not None else (None, 0, False)
        if reported:
            token = self.mailbox.report_host(rpi is not None, bs, handle)
        else:
            self.free_report_slot()
            token = self.mailbox.snapshot(rpi, bs, handle)
        self.pending.append((self.step, token))
        self.closed = (self.step, self.step_members)
        self.step = None

    def free_report_slot(self) -> None:
        # Before a report launch: when every report slot holds an unread report (the host that many steps ahead of
        # the GPU), the oldest is copied out of its slot (a host wait for it), to be decoded in turn.
        if self.mailbox.full():
            i = next(i for i, (_, t) in enumerate(self.pending) if self.mailbox.holds_slot(t))
            self.pending[i] = (self.pending[i][0], self.mailbox.detach(self.pending[i][1]))

    def run_sweep(self, rec: StepRecord, handle: int, stream: Any) -> None:
        # Staged and launched here, after the step's writes and on the host just before the launch: a prefix
        # registered with this step's tokens is verified after they are written, and one evicted before this call
        # is never staged. Both are eager, outside any CUDA graph (end_step always is).
        self.sweep.refresh(self.by_name)
        names = rec.groups if rec.sweep is None else rec.sweep
        for sw in self.sweep.stage(names, handle):
            sw.group.records.verify(sw.plan, launch_tag=sw.tag, stream=stream)

