"""``kv-canary replay --canary`` / ``--inject``: the canary end to end on every replayed step, and its report.

:class:`CanaryReplay` wraps an :class:`canary.replay.engine.EngineKV` and an :class:`canary.replay.faults.Injector`. The ring is
drained after every step: one sync per step, and each violation's detection step is then exact.

Attribution: a violation found at step ``t`` belongs to the fault applied last (at a step ``<= t``) that either
made its slot wrong (``Fault.slots``) or involves the request it was found in (``Fault.requests``). The
request of a violation is the active request whose ``req_to_token`` entry at the violation's position maps to
its slot; a verify row's position is the one the plan expects, so a corrupted slot is found in the request that
reads it, and chain violations that a fault causes at the next slot of the same request are attributed too.
Violations of no fault are *unattributed* (in a clean run, every violation is).
"""
from __future__ import annotations

from time import perf_counter_ns
from typing import Any

import numpy as np

from canary import MISSING_SLOT, KernelTag, Violation
from canary.contract.plans import mark_missing

from .coverage import Coverage
from .engine import EngineKV, StepLog
from .faults import Fault, Injector
from .scheduler import Scheduler, Step

MAX_SHOWN_VIOLATIONS = 5


def violation_requests(violations: list[Violation], step: Step, r2t: np.ndarray, lut: np.ndarray | None,
                       window: int = 0) -> np.ndarray:
    """Trace request id of each violation (-1: in no active request), vectorized over violations x rows.
    ``window``: the sliding window, which tells a MISSING row's request from those whose position was evicted."""
    n = step.num_active
    if not violations or not n:
        return np.full(len(violations), -1, dtype=np.int64)
    slot = np.array([v.slot for v in violations], dtype=np.int64)
    pos = np.array([v.position for v in violations], dtype=np.int64)
    inside = (pos >= 0) & (pos < r2t.shape[1])
    raw = r2t[step.req_pool_indices[:n][None, :], np.clip(pos, 0, r2t.shape[1] - 1)[:, None]].astype(np.int64)
    cand = raw if lut is None else lut[raw]
    # A MISSING row names no slot: its request is one whose slot at that position is the padding slot (a 0 in its
    # row, or a real slot mapped to nothing) although its verify window holds the position (elsewhere a 0 mapping
    # is a legitimate eviction).
    prefix = step.prefix_lens[:n][None, :]
    needed = (pos[:, None] < prefix) & (pos[:, None] >= (np.maximum(prefix - window, 0) if window else 0))
    missing = (slot == MISSING_SLOT)[:, None]
    no_slot = mark_missing(raw, cand) == MISSING_SLOT
    match = np.where(missing, no_slot & needed, cand == slot[:, None]) & inside[:, None]
    return np.where(match.any(axis=1), step.request_ids[match.argmax(axis=1)], -1)


class CanaryReplay:
    """The canary side of a replay: run it after each planned step, then :meth:`summary`."""

    def __init__(self, sched: Scheduler, *, xp: Any, device: Any, backend: str, faults: list[Fault]):
        self.kv = EngineKV(sched, xp=xp, device=device, backend=backend)
        self.injector = Injector(list(faults))
        self.faults = self.injector.faults
        self.total = self.dropped = 0
        self.unattributed: list[tuple[int, Violation]] = []
        self.unattributed_count = 0
        self.by_fault: list[list[tuple[int, Violation]]] = [[] for _ in self.faults]
        self.times_us: list[float] = []
        self.coverage = Coverage(self.kv.r2t, self.kv.lut, self.kv.window)

    @property
    def pool(self) -> Any:
        return self.kv.pool

    @property
    def health_state(self):
        """The canary state whose counters the summary reports."""
        return self.kv.state

    def valid_lens(self, step: Step) -> np.ndarray:
        return self.kv.valid_lens(step)

    def pool_indices(self, step: Step) -> np.ndarray | None:
        return self.kv.pool_indices(step)

    def run(self, step: Step, plans, *, req_to_token: Any, lut: Any) -> StepLog:
        """Run the canary around ``step`` (planned into ``plans``; the plan done), then attribute violations."""
        self.coverage.add(step, plans[0])  # before the faults' hooks edit req_to_token: what the plan read
        t0 = perf_counter_ns()
        log = self.kv.run(step, plans[0], plans[1], req_to_token=req_to_token, lut=lut,
                          before_write=self.injector.before_write, after_write=self.injector.after_write)
        self.times_us.append((perf_counter_ns() - t0) / 1e3)  # drain synced: device work is done
        rep = log.report
        self.total += rep.total
        self.dropped += rep.dropped
        found = list(rep.violations)
        owners = violation_requests(found, step, self.kv.r2t, self.kv.lut, self.kv.window)
        for v, req in zip(found, owners.tolist()):
            k = self._fault_of(v, req, step.index)
            if k is None:
                self.unattributed_count += 1
                if len(self.unattributed) < MAX_SHOWN_VIOLATIONS:
                    self.unattributed.append((step.index, v))
            else:
                self.by_fault[k].append((step.index, v))
        return log

    def _fault_of(self, v: Violation, req: int, index: int) -> int | None:
        best = None
        for k, f in enumerate(self.faults):
            mine = f.applied and f.applied_step <= index and (v.slot in f.slots or req in f.requests)
            if mine and (best is None or f.applied_step >= self.faults[best].applied_step):
                best = k
        return best

    @property
    def failed(self) -> bool:
        """Exit-status rule: a clean run with violations, or an injected fault never detected."""
        if not self.faults:
            return self.total > 0
        return any(not hits for hits in self.by_fault)

    def summary(self) -> dict:
        h = self.health_state.health()
        faults = []
        for f, hits in zip(self.faults, self.by_fault):
            first = hits[0][0] if hits else None
            at_first = [v for s, v in hits if s == first]
            faults.append({
                "kind": f.kind,
                "requested_step": f.requested_step,
                "applied_step": f.applied_step,
                "first_violation_step": first,
                "steps_to_detection": None if first is None else first - f.applied_step,
                "detected": bool(hits),
                "kernels": _names({_kernel(v) for v in at_first}),
                "reasons": _names({n for v in at_first for n in v.reason_names}),
                "violations": len(hits),
                "all_reasons": _names({n for _, v in hits for n in v.reason_names}),
                "slot": f.slot,
                "position": f.position,
                "requests": list(f.requests),
                "what": f.describe(),
            })
        times = np.array(self.times_us or [0.0])
        return {
            "drain_every_steps": 1,
            "ring_capacity": self.health_state.ring.shape[0],
            "real_kv_mode": self.kv.real_kv.mode.name,
            "num_layers": self.kv.num_layers,
            "violations": self.total,
            "dropped": self.dropped,
            "unattributed_violations": self.unattributed_count,
            "first_unattributed": [f"step {s}: {v}" for s, v in self.unattributed],
            "health": {"write_slots": h.write_slots, "verify_slots": h.verify_slots,
                       "write_launches": h.write_launches, "verify_launches": h.verify_launches},
            "time_us": {"p50": float(np.percentile(times, 50)), "p99": float(np.percentile(times, 99)),
                        "max": float(times.max())},
            **self.coverage.summary(),
            "faults": faults,
            "failed": self.failed,
        }


def _kernel(v: Violation) -> str:
    return v.kernel.name.lower() if isinstance(v.kernel, KernelTag) else f"kind{v.kernel}"


def _names(items: set[str]) -> list[str]:
    order = {"write": 0, "verify": 1}
    return sorted(items, key=lambda s: (order.get(s, 2), s))


def table_rows(c: dict) -> list[tuple[str, ...]]:
    """Rows of the replay's summary table."""
    h, t = c["health"], c["time_us"]
    return [
        ("canary entries verified / written", f"{h['verify_slots']} / {h['write_slots']}"),
        ("canary violations (unattributed)", f"{c['violations']} ({c['unattributed_violations']})"),
        ("canary after the plan / step (us)", f"{t['p50']:.1f}", f"{t['p99']:.1f}", f"{t['max']:.1f}"),
        ("steps unverified / sampled", f"{c['unverified_steps']} / {c['sampled_steps']}"),
        ("verified fraction (token-steps)", f"{c['verified_fraction']:.4f}"),
        ("max staleness (steps)", str(c["max_staleness_steps"])),
        ("max sweep bound (steps, SPEC 3.7)", str(c["max_sweep_steps"])),
    ]


def manager_table(st: dict, Table) -> Any:
    """``CanaryManager.stats()`` as a table (``Table``: rich's): one row per counter, per group where it has one."""
    t = Table(title="kv-canary replay: CanaryManager.stats()")
    t.add_column("stat", justify="left")
    t.add_column("value", justify="right")
    for key, value in st.items():
        if isinstance(value, dict):
            if not value:
                t.add_row(key, "-")
            for name, v in value.items():
                t.add_row(f"{key} [{name}]", str(v))
        else:
            t.add_row(key, str(value))
    return t


def fault_table(c: dict, Table) -> Any:
    """The per-fault detection table (``Table``: rich's): asked / applied / first-violation steps, the steps
    until detection, and the kernels and reasons of the violations at the first detection step."""
    t = Table(title="kv-canary replay: injected faults")
    for col in ("fault", "asked", "applied", "detected", "delay", "kernel", "reasons"):
        t.add_column(col, justify="left" if col in ("fault", "kernel", "reasons") else "right")

    def cell(v):
        return "-" if v is None else str(v)

    for f in c["faults"]:
        t.add_row(f["kind"], str(f["requested_step"]), cell(f["applied_step"]), cell(f["first_violation_step"]),
                  cell(f["steps_to_detection"]), "\n".join(f["kernels"]) or "-",
                  "\n".join(f["reasons"]) or "NOT DETECTED")  # one name a line: fits 80 columns
    return t


def fault_lines(c: dict) -> list[str]:
    """One line per fault: what it did, for the log above the tables."""
    return [f"FAULT {f['kind']}@{f['requested_step']}: {f['what']}"
            + (f" (step {f['applied_step']}; requests {', '.join(map(str, f['requests']))})" if f["applied_step"]
               is not None else "") for f in c["faults"]]
