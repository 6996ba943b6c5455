"""The manager's counters (:meth:`CanaryManager.stats`) and their optional Prometheus export."""
from __future__ import annotations

from typing import Any

from ..contract.move_layout import MoveFault
from ..errors import fail

_KNOWN_FAULTS = sum(int(b) for b in MoveFault)


class Stats:
    """Totals since the manager was built, updated as step reports are decoded."""

    def __init__(self, groups: list[str]):
        self.groups = groups
        self.steps = 0  # before_forward calls (step boundaries)
        self.decoded_steps = 0  # step reports read back
        self.verified = {g: 0 for g in groups}  # verify entries processed (the kernels' own counters)
        self.written = {g: 0 for g in groups}
        self.sampled_steps = {g: 0 for g in groups}
        self.input_error_steps = {g: 0 for g in groups}
        self.violations: dict[str, int] = {}  # reason name -> new violations (first sightings)
        self.repeats = 0  # sightings of an already reported slot
        self.dropped = 0  # ring rows lost to overflow
        self.move_faults: dict[str, int] = {}  # the record movers' fault name -> entries refused (moves.py)

    def count_move_faults(self, faults: int, refused: int) -> None:
        """One report's move status word (the faults since the last report, any group): its refused entries
        counted under the fault's name, or under ``"SOURCE_RANGE|DEST_RANGE"`` when that report saw both (its
        entries cannot be told apart then)."""
        names = MoveFault(int(faults) & _KNOWN_FAULTS).names
        key = "|".join(names) if names else "UNKNOWN"
        self.move_faults[key] = self.move_faults.get(key, 0) + int(refused)

    def as_dict(self, protected_tokens: int) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "decoded_steps": self.decoded_steps,
            "protected_tokens": protected_tokens,
            "verified_entries": dict(self.verified),
            "written_entries": dict(self.written),
            "sampled_steps": dict(self.sampled_steps),
            "input_error_steps": dict(self.input_error_steps),
            "violations_by_reason": dict(self.violations),
            "repeated_sightings": self.repeats,
            "ring_dropped": self.dropped,
            "move_faults": dict(self.move_faults),
        }


class PrometheusMetrics:
    """``prometheus_client`` counters and a gauge on ``registry`` (names in docs/integration.md); ``ranks``: a
    :class:`~canary.Ranks` whose labels every metric carries too."""

    def __init__(self, registry: Any, ranks: Any = None):
        try:
            import prometheus_client as pc
        except ImportError as exc:
            raise fail(ImportError, "metrics: expected prometheus_client for Prometheus metrics: pip install "
                                    "prometheus_client (or, in the checkout, pip install '.[prometheus]')") from exc
        if registry is not True and not hasattr(registry, "register"):
            raise fail(TypeError, f"metrics: expected None, True (the default registry) or a prometheus_client "
                                  f"CollectorRegistry, got {type(registry).__name__}")
        kw = {} if registry is True else {"registry": registry}
        if ranks is not None:  # every metric labelled tp_rank / pp_rank / dp_rank too (distributed.py)
            from .distributed import RankedMetrics

            pc = RankedMetrics(pc, ranks)
        self.violations = pc.Counter("kv_canary_violations_total", "KV slots found corrupted (first sightings)",
                                     ["group", "reason"], **kw)
        self.verified = pc.Counter("kv_canary_verified_entries_total", "Cached KV records verified", ["group"], **kw)
        self.written = pc.Counter("kv_canary_written_entries_total", "KV records written", ["group"], **kw)
        self.sampled = pc.Counter("kv_canary_sampled_steps_total",
                                  "Steps whose verify entries exceeded the budget and were sampled", ["group"], **kw)
        self.dropped = pc.Counter("kv_canary_ring_dropped_total", "Violations lost to ring overflow", ["group"], **kw)
        self.steps = pc.Counter("kv_canary_steps_total", "Step reports decoded", **kw)
        self.protected = pc.Gauge("kv_canary_protected_tokens", "Expected tokens held for running requests", **kw)
