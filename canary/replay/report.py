"""The replay's printed report: its tables (built with rich's ``Table``, passed in so that this module imports
no rich) and the fault lines above them."""
from __future__ import annotations

from typing import Any


def summary_table(s: dict, Table) -> Any:
    """The replay's summary as a table (``Table``: rich's): the plans, then the canary's rows."""
    t = Table(title=f"kv-canary replay: {s['trace']}, backend {s['backend']}")
    for col in ("metric", "value / p50", "p99", "max"):
        t.add_column(col, justify="left" if col == "metric" else "right")

    def dist(v, f):
        return f.format(v["p50"]), f.format(v["p99"]), f.format(v["max"])

    bs = s["batch_size"]
    t.add_row("steps", str(s["steps"]))
    t.add_row("requests finished", f"{s['requests_finished']} / {s['requests']}")
    t.add_row("batch size, mean (active / padded)", f"{bs['mean_active']:.1f} / {bs['mean_padded']:.1f}")
    t.add_row("verify entries / step", *dist(s["verify_entries_per_step"], "{:.0f}"))
    t.add_row("write entries / step", *dist(s["write_entries_per_step"], "{:.0f}"))
    # Steps above the capacity: each verified a sample, or (skip) nothing.
    what = "sampled" if s["on_overflow"] == "sample" else "overflow"
    t.add_row(f"{what} steps (capacity {s['verify_capacity']})", str(s["overflow_steps"]))
    # With the canary the manager's before_forward is timed: the plan and the verify.
    what = "before_forward (plan + verify)" if "canary" in s else "plan time"
    t.add_row(f"{what} / step (us)", *dist(s["plan_time_us"], "{:.1f}"))
    t.add_row("steps checked vs reference", str(s["checked_steps"]))
    t.add_row("mismatches", str(s["mismatches"]))
    if "canary" in s:
        for row in table_rows(s["canary"]):
            t.add_row(*row)
    t.add_row("wall time (s)", f"{s['wall_time_s']:.1f}")
    return t


def table_rows(c: dict) -> list[tuple[str, ...]]:
    """The canary's rows of the summary table (``c``: the summary's ``canary`` object)."""
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
