"""The replay's printed report: its tables (built with rich's ``Table``, passed in so that this module imports
no rich) and the fault lines above them; the progress lines of a run whose output is not a terminal; the JSON
summary's provenance and the atomic write of its files (``--json``, ``--plot``)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import canary

# Progress without a terminal (a CI log, a pipe): a line at most every PROGRESS_INTERVAL_S seconds, and one at
# each tenth of the trace's tokens if a fifth of that interval has passed since the last line (so that a run
# of a few seconds prints none).
PROGRESS_INTERVAL_S = 10.0


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
    t.add_row(f"{what} steps (capacity {s['verify_capacity']})", str(s[f"{what}_steps"]))
    # With the canary the manager's before_forward is timed: the plan and the verify.
    what = "before_forward (plan + verify)" if "canary" in s else "plan time"
    t.add_row(f"{what} / step (us)", *dist(s["plan_time_us"], "{:.1f}"))
    if s.get("offload_tier"):
        t.add_row(f"offloads / restores (tier {s['offload_tier']} tokens)", f"{s['offloads']} / {s['restores']}")
    if "pd" in s:
        d = s["pd"]
        t.add_row("pd transfers / digest checks / mismatches", f"{d['transfers']} / {d['digest_checks']} / "
                  f"{d['digest_mismatches']}")
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
                t.add_row(f"{key} \\[{name}]", str(v))  # escaped: rich would read [name] as a style tag
        else:
            t.add_row(key, str(value))
    return t


def fault_table(c: dict, Table) -> Any:
    """The per-fault detection table (``Table``: rich's): asked / applied / first-violation steps, the steps
    until detection, and the kernels and reasons of the violations at the first detection step."""
    t = Table(title="kv-canary replay: injected faults")
    ranks = any("rank_delays" in f for f in c["faults"])  # --ranks: each rank's delay (canary.replay.ranks)
    cols = ("fault", "asked", "applied", "detected", "delay") + (("ranks (delay)",) if ranks else ()) + ("kernel",
                                                                                                        "reasons")
    for col in cols:
        t.add_column(col, justify="left" if col in ("fault", "kernel", "reasons", "ranks (delay)") else "right")

    def cell(v):
        return "-" if v is None else str(v)

    for f in c["faults"]:
        on = [_rank_delays(f["rank_delays"])] if ranks else []
        t.add_row(f["kind"], str(f["requested_step"]), cell(f["applied_step"]), cell(f["first_violation_step"]),
                  cell(f["steps_to_detection"]), *on, "\n".join(f["kernels"]) or "-",
                  "\n".join(f["reasons"]) or ("NOT DETECTED" if f["applied_step"] is not None else "NOT APPLIED"))
    # one name a line: fits 80 columns
    return t


def _rank_delays(delays: list) -> str:
    """``0,1 (1)``: the ranks that detected a fault, grouped by their delay (steps); ``-``: none did."""
    by: dict[int, list[str]] = {}
    for r, d in enumerate(delays):
        if d is not None:
            by.setdefault(d, []).append(str(r))
    return "\n".join(f"{','.join(rs)} ({d})" for d, rs in sorted(by.items())) or "-"


def fault_lines(c: dict) -> list[str]:
    """One line per fault: what it did, for the log above the tables."""
    return [f"FAULT {f['kind']}@{f['requested_step']}: {f['what']}"
            + (f" (step {f['applied_step']}; requests {', '.join(map(str, f['requests']))})" if f["applied_step"]
               is not None else "") for f in c["faults"]]


class ProgressLog:
    """Progress lines on stderr for a run whose output is not a terminal (rich's bar shows only on one): the
    step, the share of the trace's tokens written so far (the total is known before the run; the number of
    steps is not), the requests finished, the time so far and an estimate of the time left, linear in the
    tokens. ``clock``: seconds (``time.monotonic``), replaceable for tests."""

    def __init__(self, total_tokens: int, total_requests: int, *, clock: Callable[[], float] = time.monotonic,
                 stream=None):
        self.total_tokens, self.total_requests = max(1, total_tokens), total_requests
        self.clock, self.stream = clock, stream if stream is not None else sys.stderr
        self.start = self.last = clock()
        self.tokens = 0
        self.tenth = 0  # the last tenth of the tokens reported

    def update(self, steps_done: int, step_tokens: int, finished: int) -> None:
        self.tokens += step_tokens
        now, frac = self.clock(), min(1.0, self.tokens / self.total_tokens)
        tenth = int(frac * 10)
        if now - self.last < PROGRESS_INTERVAL_S and (tenth <= self.tenth or now - self.last < PROGRESS_INTERVAL_S / 5):
            return
        self.last, self.tenth = now, max(tenth, self.tenth)
        spent = now - self.start
        eta = f"ETA {spent * (1 - frac) / frac:.0f} s" if frac > 0 else "ETA unknown"
        print(f"kv-canary replay: step {steps_done}, {frac:.0%} of the trace's tokens, {finished}/"
              f"{self.total_requests} requests finished, {spent:.1f} s, {eta}", file=self.stream, flush=True)


def git_commit() -> str | None:
    """The commit of the checkout that ``canary`` is imported from (``KV_CANARY_COMMIT`` when set: a tree copied
    without its ``.git``), or ``None`` (an installed wheel, no git). Only a checkout whose top holds this very
    package counts: a wheel installed in a virtual environment inside another repository is not that one."""
    if os.environ.get("KV_CANARY_COMMIT"):
        return os.environ["KV_CANARY_COMMIT"]
    package = Path(canary.__file__).resolve().parent
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel", "HEAD"], cwd=package, capture_output=True,
                             text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = top.stdout.split()
    if top.returncode != 0 or len(lines) != 2 or Path(lines[0]).resolve() / "canary" != package:
        return None
    try:  # a tree that differs from its commit says so (a copied tree with an older .git, say), as the benchmarks do
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=package,
                               capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        dirty = ""
    return lines[1] + ("-dirty" if dirty else "")


def provenance(argv: list[str] | None = None) -> dict:
    """The JSON summary's ``version``, ``commit`` and ``command`` (the argument vector, program name first)."""
    return {"version": canary.__version__, "commit": git_commit(),
            "command": list(sys.argv if argv is None else argv)}


def write_json(path: str, summary: dict) -> None:
    """Write ``summary`` to ``path`` as indented JSON, atomically (:func:`write_atomic`). Raises ``OSError``."""

    def fill(f) -> None:
        json.dump(summary, f, indent=2)
        f.write("\n")

    write_atomic(path, fill, binary=False)


def write_atomic(path: str, fill: Callable[[Any], None], binary: bool = True) -> None:
    """Write ``path`` atomically: ``fill`` writes the content to a file object (binary, or text with
    ``binary=False``, encoded as ``open`` would), a temporary file in the same directory, which is then flushed to
    disk and renamed over ``path`` (a symbolic link's target), so that a reader sees the old file or the whole new
    one, never a part. Raises ``OSError`` (or what ``fill`` raises); the temporary file is removed then."""
    target = Path(os.path.realpath(path))
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp's 0600 would be a surprise: the mode open() would give
        with os.fdopen(fd, "wb" if binary else "w") as f:
            fill(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
