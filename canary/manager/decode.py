"""The manager's step reports, read back: decoded from the report block's words (canary/manager/block.py),
deduplicated, counted (stats, metrics, health) and dispatched to the manager's ``on_violation``.

One :class:`ReportDecoder` per manager. Its per-step path (:meth:`ReportDecoder.handle_reports`, from the
manager's ``poll``) takes each queued report whose words have reached the host from the mailbox
(canary/manager/mailbox.py), decodes it and releases it; a quiet report (no ring row, no status bit the stats
count) of a one-group manager without metrics decodes its counters only. Who a violation names: canary/manager/
attribution.py.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any, Callable

import numpy as np

from ..errors import INPUT_ERROR_BITS, PlanStatus
from ..contract.ring import KernelTag, decode
from .attribution import Attribution, RowCache
from .block import ReportBlock
from .groups import BoundGroup
from .report import CanaryHealthError, CanaryViolationError, Deduplicator, SlotViolation, Violations, kernel_name, \
    kind_of, log, log_violations, overflow_line, sightings
from .stats import Stats

# Plain ints for the per-step decode (enum arithmetic costs a microsecond a use there)
_SAMPLED, _INPUT_ERRORS = int(PlanStatus.SAMPLED), int(INPUT_ERROR_BITS)
_WRITE_COUNTER, _VERIFY_COUNTER = KernelTag.WRITE.counter_index, KernelTag.VERIFY.counter_index
_QUIET_MASK = _SAMPLED | _INPUT_ERRORS  # status bits a decode counts or logs: a report without them is quiet
_NONE: tuple = ()  # a quiet report's new violations


class DecoderSetting:
    """A :class:`CanaryManager` attribute kept on its :class:`ReportDecoder` (``on_violation``, ``log_limit``,
    ``stats_every``, ``health_steps``, ``metrics``): the decoder reads it per report, so a manager's
    ``m.on_violation = callback`` after construction takes effect."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, manager, owner=None):
        return self if manager is None else getattr(manager._decoder, self.name)

    def __set__(self, manager, value) -> None:
        setattr(manager._decoder, self.name, value)


class ReportDecoder:
    """The reports of ``groups`` (bound over ``block``), queued in ``pending`` (``(step record, mailbox token)``
    pairs, oldest first; the step machine appends them) and read through ``mailbox``.

    ``stats_``: the manager's :class:`Stats`; ``metrics``: its ``PrometheusMetrics`` or ``None``; ``requests``:
    its ``RequestPool`` (who holds a reported slot); ``sweep``: its ``Sweeper`` (a swept entry's prefixes);
    ``on_violation``, ``log_limit``, ``stats_every``, ``health_steps``, ``forget_after``: the manager's arguments;
    ``marks``: its :class:`~canary.manager.suppress.ReportedSlots`.
    """

    def __init__(self, groups: list[BoundGroup], block: ReportBlock, *, pending, mailbox, stats_: Stats,
                 metrics: Any, requests, sweep, on_violation: str | Callable, log_limit: int, stats_every: int,
                 health_steps: int, forget_after: int, marks=None):
        self.marks = marks  # suppress.py's ReportedSlots (None: the rings are not filtered)
        self.groups, self.block, self.pending, self.mailbox = groups, block, pending, mailbox
        self.stats_, self.metrics, self.requests, self.sweep = stats_, metrics, requests, sweep
        self.names = Attribution(requests)  # who each violation names
        self.on_violation, self.log_limit = on_violation, log_limit
        self.stats_every, self.health_steps = stats_every, health_steps
        g = len(groups)  # the block words a step's decode reads first (block.py): the write indexes, the move
        # status words, then the heads
        self._head_words = np.array(list(range(3 * g)) + [h + k for h in block.heads for k in range(5)], np.int64)
        # one group's head words are the block's first 8 unless agreement words lie between (block.py)
        self._first8 = g == 1 and self._head_words.tolist() == list(range(8))
        self.dedup = Deduplicator(int(forget_after))
        self.stalled = {g.name: 0 for g in groups}
        self.last_counters = {g.name: (0, 0) for g in groups}
        self.last_rows: tuple | None = None  # (request ids, req_pool_indices) of the last decoded batch
        self.unhealthy: tuple | None = None  # (group, steps stalled, step) of a health failure not yet raised
        self._one_group = groups[0].name if self._first8 else None  # decode's quiet path
        # distributed.py: the rank's labels (and what its log lines end with), the per-step agreement
        self.ranks, self.suffix, self.agreement = None, "", None

    def stats(self) -> dict[str, Any]:
        """The manager's :meth:`~canary.CanaryManager.stats`."""
        out = self.stats_.as_dict(self.requests.protected_tokens())
        if self.marks is not None:
            out["reported_slots_marked"] = self.marks.marked
        if self.sweep:
            out.update(self.sweep.stats())
        if self.ranks is not None:
            out["ranks"] = dataclasses.asdict(self.ranks)
        if self.agreement is not None:
            out["agreement"] = self.agreement.stats()
        return out

    def handle_reports(self, wait: bool) -> None:
        """Decode every queued report that has reached the host, oldest first (``wait``: every queued one,
        waiting for each), then dispatch what they found. A health failure stops the decoding at its report (the
        later ones stay queued): what was decoded up to it is dispatched first, then :class:`CanaryHealthError`
        is raised, carrying those new violations. With an ``agreement`` (distributed.py) every queued report but
        the newest ``lag - 1`` is decoded, waited for if need be, each reduced with the other ranks'."""
        new: list[SlotViolation] = []
        dropped, last_step = 0, None
        pending, transfer, agreement = self.pending, self.mailbox, self.agreement
        # A distributed manager decodes a fixed number of reports per call, waiting for them (distributed.py): the
        # same steps on every rank, so that every rank reduces the same summaries at the same call
        must = len(pending) if wait else 0 if agreement is None else len(pending) - agreement.lag + 1
        while pending:
            if agreement is not None and must <= 0:
                break
            must -= 1
            rec, token = pending[0]
            got = transfer.take(token)
            if got is None:
                if must < 0:
                    break
                transfer.wait(token)
                got = transfer.read(token)
            pending.popleft()
            words, rpi = got
            if rpi is not None and rec.narrow:  # int32 rows in the low halves of the words (Steps.snapshot_rows)
                rpi = rpi.view(np.int32)[::2].astype(np.int64)
            try:
                found, lost = self.decode(rec, words, rpi)
                if agreement is not None:
                    found = agreement.agree(rec, words, rpi, found)
            finally:
                transfer.release(token)  # the words (and rows) stay the buffer's until here
            if found:
                new += found
            dropped += lost
            last_step = rec.index
            if self.unhealthy is not None and agreement is None:
                break
        if last_step is None:
            return
        if self.dedup.open:
            self.dedup.expire(last_step)
        health, self.unhealthy = self.unhealthy, None
        if new or dropped or self.stats_every:
            try:
                self.dispatch(new, dropped, last_step)
            except CanaryViolationError as err:  # mode "raise": the health failure wins, carrying the violations
                if health is None:
                    raise
                raise self.health_error(*health, err.violations) from err
        if health is not None:
            raise self.health_error(*health, new)

    def note_rows(self, rec, rpi: np.ndarray) -> None:
        # Each request's last req_to_token row (for holders). A decode step repeats the last batch: nothing to do
        # (add_request / finish_request forget the last batch, so a new request under an old id is noted). The
        # rows are compared as bytes and the ids by identity first (the intake hands a repeated batch the same tuple).
        raw = rpi.tobytes()
        last = self.last_rows
        if last is not None and last[1] == raw and (last[0] is rec.request_ids or last[0] == rec.request_ids):
            return
        live, retired = self.requests.live.get, self.requests.retired.get
        for rid, rp in zip(rec.request_ids, rpi.tolist()):
            if rp:
                req = live(rid) or retired(rid)
                if req is not None:
                    req.last_req_pool_index = rp
        self.last_rows = (rec.request_ids, raw)

    def decode(self, rec, words: np.ndarray, rpi: np.ndarray | None) -> tuple[list[SlotViolation], int]:
        """The new violations and the ring rows dropped of step ``rec`` (a ``StepRecord``: canary/manager/steps.py),
        from its report's ``words`` and its ``req_pool_indices`` ``rpi`` (``None``: not that step's)."""
        # Read straight from the block's words (canary/manager/block.py): a step with no ring rows decodes its
        # counters and statuses only.
        st = self.stats_
        st.decoded_steps += 1
        if rpi is not None:
            self.note_rows(rec, rpi)
        metrics = self.metrics
        name = self._one_group
        if name is not None and metrics is None:
            # One group, no metrics: a quiet report (no ring row, no move fault, no status bit the stats count)
            # needs its counters only. [write index, move status [2], slot counters [2], kernel counters [2],
            # status] (block.py).
            vals = words[:8].tolist()
            if not vals[0] & 0xFFFFFFFF and not vals[1] and not vals[2] and not vals[7] & _QUIET_MASK:
                st.written[name], st.verified[name] = vals[3 + _WRITE_COUNTER], vals[3 + _VERIFY_COUNTER]
                now = (vals[5 + _WRITE_COUNTER], vals[5 + _VERIFY_COUNTER])
                if name in rec.groups:
                    before = self.last_counters[name]
                    stalled = 0 if now[0] > before[0] and now[1] > before[1] else self.stalled[name] + 1
                    self.stalled[name] = stalled
                    if stalled >= self.health_steps and self.unhealthy is None:
                        self.unhealthy = (name, stalled, rec.index)
                self.last_counters[name] = now
                return _NONE, 0
        new, dropped = [], 0
        block = self.block
        n_groups = len(self.groups)
        # The ring write indexes [G], the move status words [G, 2], then each group's head: slot counters [2],
        # kernel counters [2], the plan's status, in one conversion (one group's are contiguous: a slice).
        vals = (words[:8] if self._first8 else words[self._head_words]).tolist()
        heads = 3 * n_groups
        for i, g in enumerate(self.groups):
            name = g.name
            head = vals[heads + 5 * i:heads + 5 * i + 5]
            if vals[n_groups + 2 * i] or vals[n_groups + 2 * i + 1]:
                st.count_move_faults(vals[n_groups + 2 * i], vals[n_groups + 2 * i + 1])
            st.written[name], st.verified[name] = head[_WRITE_COUNTER], head[_VERIFY_COUNTER]
            now = (head[2 + _WRITE_COUNTER], head[2 + _VERIFY_COUNTER])
            status = head[4] & 0xFFFFFFFF  # the int32 in the word's low half (bits, all below 2^31)
            if name in rec.groups:
                before = self.last_counters[name]
                ran = now[0] > before[0] and now[1] > before[1]
                self.stalled[name] = 0 if ran else self.stalled[name] + 1
                if status & _SAMPLED:
                    st.sampled_steps[name] += 1
                if status & _INPUT_ERRORS:
                    st.input_error_steps[name] += 1
                    bits = PlanStatus(status)
                    log.warning(f"kv-canary: plan input error group={name} step={rec.index} status={status} "
                                f"({'|'.join(b.name for b in PlanStatus if b and b in bits)}): that step verified "
                                f"nothing" + self.suffix)
            self.last_counters[name] = now
            index = vals[i] & 0xFFFFFFFF  # the ring's int32 write index, read as its uint32 count
            if index:
                ring = words[block.rings[i]].reshape(block.ring_capacity, -1)
                report = decode(ring, index)
                if report.dropped:
                    dropped += report.dropped
                    st.dropped += report.dropped
                    log.warning(overflow_line(name, rec.index, report.dropped, report.capacity) + self.suffix)
                    if metrics:
                        metrics.dropped.labels(group=name).inc(report.dropped)
                rows = RowCache(g)  # the index reads of this report's attributions, shared
                for viol, reasons, seen in sightings(report.violations):
                    # A MISSING row's slot names no request (MISSING_SLOT); its predecessor slot does, so that
                    # another request losing the same position is a new record, not a repeat
                    key = (name, kind_of(viol.kernel), viol.slot, viol.position, int(reasons), viol.predecessor_slot)
                    made = self.dedup.see(key, rec.index, lambda: self.record(g, viol, reasons, seen, rec, rpi, rows))
                    if made is None:
                        st.repeats += 1
                    else:
                        new.append(made)
                    if report.dropped and self.marks is not None:  # suppress.py: let the next rings name others
                        self.marks.mark(g.index, made or self.dedup.open[key], seen)
            if metrics:
                metrics.verified.labels(group=name).inc(max(0, st.verified[name] - getattr(g, "_m_verified", 0)))
                metrics.written.labels(group=name).inc(max(0, st.written[name] - getattr(g, "_m_written", 0)))
                g._m_verified, g._m_written = st.verified[name], st.written[name]
                if name in rec.groups and status & _SAMPLED:
                    metrics.sampled.labels(group=name).inc()
        if self.unhealthy is None:
            for name, n in self.stalled.items():
                if n >= self.health_steps:
                    self.unhealthy = (name, n, rec.index)  # raised once this call's reports are dispatched
                    break
        if metrics:
            metrics.steps.inc()
            metrics.protected.set(self.requests.protected_tokens())
        return new, dropped

    @staticmethod
    def health_error(name: str, n: int, step: int, violations: list[SlotViolation]) -> CanaryHealthError:
        return CanaryHealthError(
            f"kv-canary: health: expected the kernels of group {name!r} to run every scheduled step, got launch "
            f"counters unchanged for {n} consecutive steps (up to step {step}): the canary calls are no longer "
            f"launched (a CUDA graph captured without them, or a stream mix-up)", violations)

    def record(self, g: BoundGroup, v, reasons, seen: tuple, rec, rpi: np.ndarray | None,
               rows: RowCache) -> SlotViolation:
        sw = self.sweep.sweeps.get(g.name)
        kernel = "sweep" if sw is not None and v.launch_tag == sw.tag else kernel_name(v)
        layer = next((r.layer for r in seen if r.layer is not None), None)
        if layer is not None:
            kernel = "verify"  # the layer rotation's verify_layer: the row names its layer
        owners = self.names.holders(g, v, rec, rpi, rows)
        return SlotViolation(group=g.name, kernel=kernel, slot=v.slot, position=v.position, reasons=reasons,
                             requests=owners, first_step=rec.index, last_step=rec.index,
                             count=1, stored_token=v.stored_token, expected_token=v.expected_token, raw=v,
                             steps=[rec.index], prefixes=self.sweep.holders(g.name, v.slot, v.position),
                             layer=layer, writers=self.names.writers(g, v, rec, rpi, owners, rows), rows=seen,
                             ranks=self.ranks)

    def dispatch(self, new: list[SlotViolation], dropped: int, step: int) -> None:
        # A new violation counts (stats, metrics) and stays marked seen only once delivered: a callback that
        # raises leaves its violations unseen and uncounted, so that their next sighting reports them again.
        if new:
            self.count(new, 1)
        if self.stats_every and self.stats_.decoded_steps % self.stats_every == 0:
            logging.getLogger("kv_canary").info("kv-canary: stats " + json.dumps(self.stats(), default=str))
        if not new and not dropped:
            return
        if self.on_violation == "log":
            log_violations(new, step, self.log_limit)
        elif self.on_violation == "raise":
            self.meter(new)
            first = new[0].line() if new else "none kept"
            raise CanaryViolationError(
                f"kv-canary: violations: expected none, got {len(new)} new and {dropped} dropped to ring overflow "
                f"by step {step}; first: {first}", new, dropped, step)
        else:  # a callback: called when rows were dropped too, even if every kept row was a repeat
            try:
                self.on_violation(Violations(new, dropped, step))
            except BaseException:
                self.count(new, -1)
                self.dedup.forget(new)
                if self.marks is not None:
                    self.marks.release(new)
                raise
        self.meter(new)

    def count(self, new: list[SlotViolation], sign: int) -> None:
        st = self.stats_.violations
        for viol in new:
            for reason in viol.reason_names or ("NONE",):
                st[reason] = st.get(reason, 0) + sign
                if not st[reason]:
                    del st[reason]

    def meter(self, new: list[SlotViolation]) -> None:
        # Prometheus counters never go down: counted once the violations are delivered
        if self.metrics:
            for viol in new:
                for reason in viol.reason_names or ("NONE",):
                    self.metrics.violations.labels(group=viol.group, reason=reason).inc()
