"""What the manager reports: :class:`SlotViolation` records, their deduplication across steps, the errors, and
the fixed-format log lines."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Hashable

from ..contract.ring import FailReason, KernelTag, Violation

log = logging.getLogger("kv_canary")

MAX_STEPS_KEPT = 16  # steps listed per record; the count keeps counting


class Violations(list):
    """What an ``on_violation`` callback receives: a list of the new :class:`SlotViolation` records, and
    ``dropped``, the ring rows lost to overflow in the same decoded steps (corrupted slots the ring could not name
    yet: more may be hiding), and ``step``, the last step decoded. The callback is called whenever either is
    non-zero, so a step whose kept rows are all repeats still says how many were dropped (the list is empty
    then)."""

    __slots__ = ("dropped", "step")

    def __init__(self, new, dropped: int, step: int | None):
        super().__init__(new)
        self.dropped, self.step = int(dropped), step


@dataclass
class SlotViolation:
    """One corrupted KV slot as the manager reports it (the same slot seen again later updates this record).

    - ``group``: the :class:`~canary.manager.KVGroup` name; ``kernel``: ``"verify"`` (a cached record no longer
      matches) or ``"write"`` (a write-time assert failed).
    - ``slot``: the slot in the group's pool (an SWA group's own slots); ``position``: the token position.
    - ``reasons``: :class:`~canary.FailReason` bits (``reason_names`` as strings).
    - ``requests``: ``(request_id, position)`` of every request found holding the slot when the report was
      decoded: the step's batch rows whose ``req_to_token`` row maps that position to the slot, and running
      requests whose last ``req_to_token`` row does (a recycled row names both the stale and the new owner): the
      owners of the position.
    - ``writers``: ``(request_id, position)`` of the requests whose write landed in the slot although they are
      not its owner at ``position``, each with the position its row maps to the slot. A write row: the step's
      batch request that wrote the slot (a token written at the wrong position: ``requests`` is then usually
      empty). A verify row: the other requests whose rows map the slot at another position (a block handed to
      two requests, or freed while still read and written again). ``()`` when none is found (a stray write
      through a wrong ``out_cache_loc`` names no row).
    - ``request_ids``: the distinct ids of ``requests``, then of ``writers`` (the requests to evict or abort).
    - ``first_step``, ``last_step``: manager step indices (0-based, counted by ``before_forward``);
      ``steps``: the first :data:`MAX_STEPS_KEPT` steps it was seen in; ``count``: how many steps it was seen in.
    - ``stored_token``, ``expected_token`` (-1: none), ``raw``: the first ring row (:class:`~canary.Violation`);
      ``rows``: every ring row of its first sighting (``raw`` first): the main verify's and the layer
      rotation's rows of one slot and position in one step are one sighting, ``reasons`` the union of theirs.
    - ``prefixes``: ``(key, position)`` of every cached prefix registered for the sweep that holds the slot at
      that position when the report was decoded (``kernel == "sweep"``: a cached block no request was reading).
    - ``layer``: the layer whose KV bytes changed, for a ``REAL_KV`` violation found by the layer rotation
      (docs/integration.md 5c); ``None`` otherwise (the main verify's real-KV check covers its own sources).
    - ``ranks``: the manager's :class:`~canary.Ranks` (``None``: none given), also at the end of the log line.
    """

    group: str
    kernel: str
    slot: int
    position: int
    reasons: FailReason
    requests: tuple[tuple[Hashable, int], ...]
    first_step: int
    last_step: int
    count: int
    stored_token: int
    expected_token: int
    raw: Violation
    steps: list[int] = field(default_factory=list)
    prefixes: tuple[tuple[Hashable, int], ...] = ()
    layer: int | None = None
    writers: tuple[tuple[Hashable, int], ...] = ()
    rows: tuple[Violation, ...] = ()
    ranks: Any = None

    @property
    def reason_names(self) -> tuple[str, ...]:
        return self.reasons.names

    @property
    def request_ids(self) -> tuple[Hashable, ...]:
        seen = []
        for rid, _ in self.requests + self.writers:
            if rid not in seen:
                seen.append(rid)
        return tuple(seen)

    def line(self) -> str:
        """The fixed-format log line (one per violation)."""
        reqs = ",".join(f"{rid}@{pos}" for rid, pos in self.requests) or "-"
        # Only sweep-era reports carry the field, so the line of a manager without a sweep keeps its format.
        cached = ",".join(f"{key}@{pos}" for key, pos in self.prefixes)
        cached = f" prefixes={cached}" if cached else ""
        if self.writers:  # only a record with writers: the others keep their format
            cached = " writers=" + ",".join(f"{rid}@{pos}" for rid, pos in self.writers) + cached
        layer = f" layer={self.layer}" if self.layer is not None else ""  # layer rows only: other lines keep their format
        return (f"kv-canary: violation group={self.group} kernel={self.kernel}{layer} step={self.first_step} "
                f"slot={self.slot} position={self.position} reasons={'|'.join(self.reason_names) or 'NONE'} "
                f"stored_token={self.stored_token} expected_token={self.expected_token} requests={reqs}{cached} "
                f"count={self.count}" + (self.ranks.suffix() if self.ranks is not None else ""))


class CanaryViolationError(RuntimeError):
    """Raised at a step boundary (``before_forward``) by a manager in mode ``"raise"``.

    ``violations``: the new :class:`SlotViolation` records of the decoded step(s); ``dropped``: ring rows lost to
    overflow; ``step``: the step the violations happened in.
    """

    def __init__(self, message: str, violations: list[SlotViolation], dropped: int, step: int):
        super().__init__(message)
        self.violations = violations
        self.dropped = dropped
        self.step = step


class CanaryHealthError(RuntimeError):
    """The canary kernels stopped running (their launch counters did not advance): raised in every mode.

    ``violations``: the new :class:`SlotViolation` records decoded in the same call, already delivered (logged,
    passed to the callback, counted); in mode ``"raise"`` they are these, the :class:`CanaryViolationError` being
    the ``__cause__``."""

    def __init__(self, message: str, violations: list[SlotViolation] | tuple = ()):
        super().__init__(message)
        self.violations = list(violations)


def kind_of(kernel: KernelTag | int) -> int:
    """The kind a sighting is keyed by: the layer rotation's rows are verify rows."""
    return int(KernelTag.VERIFY) if kernel == KernelTag.VERIFY_LAYER else int(kernel)


def sightings(rows) -> list[tuple[Violation, FailReason, tuple[Violation, ...]]]:
    """One step's ring rows of one group as sightings ``(first row, reasons, rows)``: the rows of one kind
    (:func:`kind_of`), slot, position and MISSING predecessor are one sighting (the main verify and the layer
    rotation seeing the same flipped byte), the main verify's rows first, ``reasons`` the union of theirs."""
    if len(rows) == 1:
        v = rows[0]
        return [(v, v.reasons, (v,))]
    by_key: dict[tuple, list[Violation]] = {}
    for v in rows:
        by_key.setdefault((kind_of(v.kernel), v.slot, v.position, v.predecessor_slot), []).append(v)
    out = []
    for vs in by_key.values():
        vs.sort(key=lambda v: v.kernel == KernelTag.VERIFY_LAYER)  # stable: the main verify's rows first
        reasons = FailReason.NONE
        for v in vs:
            reasons |= v.reasons
        out.append((vs[0], reasons, tuple(vs)))
    return out


def kernel_name(v: Violation) -> str:
    return v.kernel.name.lower() if isinstance(v.kernel, KernelTag) else f"kind{v.kernel}"


class Deduplicator:
    """Keeps the records of slots seen recently; one seen again within ``forget_after`` steps is a repeat."""

    def __init__(self, forget_after: int = 64):
        self.forget_after = forget_after
        self.open: dict[tuple, SlotViolation] = {}

    def see(self, key: tuple, step: int, make) -> SlotViolation | None:
        """The new record (first sight), or ``None`` for a repeat (whose record is updated)."""
        rec = self.open.get(key)
        if rec is not None and step - rec.last_step <= self.forget_after:
            if step != rec.last_step:
                rec.count += 1
                if len(rec.steps) < MAX_STEPS_KEPT:
                    rec.steps.append(step)
            rec.last_step = step
            return None
        rec = make()
        self.open[key] = rec
        return rec

    def forget(self, records: list[SlotViolation]) -> None:
        """Unmark ``records`` (their delivery failed): their slots' next sighting is new again."""
        ids = {id(r) for r in records}
        for k in [k for k, r in self.open.items() if id(r) in ids]:
            del self.open[k]

    def expire(self, step: int) -> None:
        stale = [k for k, r in self.open.items() if step - r.last_step > self.forget_after]
        for k in stale:
            del self.open[k]


def log_violations(new: list[SlotViolation], step: int, limit: int) -> None:
    """One line per new violation, at most ``limit`` per step, then one summary line of what was not logged."""
    for v in new[:limit]:
        log.error(v.line())
    rest = new[limit:]
    if rest:
        by_reason: dict[str, int] = {}
        for v in rest:
            name = "|".join(v.reason_names) or "NONE"
            by_reason[name] = by_reason.get(name, 0) + 1
        summary = ", ".join(f"{k}={n}" for k, n in sorted(by_reason.items()))
        log.error(f"kv-canary: {len(rest)} more violations of step {step} not logged (log_limit={limit}): {summary}")


def overflow_line(group: str, step: int, dropped: int, capacity: int) -> str:
    return (f"kv-canary: ring overflow group={group} step={step} dropped={dropped} ring_capacity={capacity}: "
            f"violations past the capacity were counted, not kept; raise ring_capacity")
