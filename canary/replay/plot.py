"""``kv-canary replay --plot PATH``: a picture of the run, for an operator who would rather look than read.

Panels sharing the step axis: the entries each step asked to verify and those its plan verified, against the
budget (the verify capacity); with the canary, the staleness (per step, the longest run of consecutive
unverified steps over the tokens it asked for; and the largest so far); with ``--inject``, one row per fault,
from its applied step to its detected step. Each fault is also a vertical line over the other panels: solid
where it was applied, dashed where it was detected.

The series are host lists of ints that the replay already has each step (:class:`Series`, kept only with
``--plot``); the faults and the totals come from the summary. matplotlib is imported only to draw (and by
:func:`formats`, which the options call to refuse a missing matplotlib or an unknown suffix before the run),
through its object API with no pyplot: no display, no global backend, the canvas chosen by the file's format.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .report import write_atomic

NEEDS_MATPLOTLIB = "--plot: needs matplotlib: pip install matplotlib (or, in the checkout, pip install '.[plot]')"
# One colour a fault, in order (matplotlib's tab10 without its grey, which the asked entries use).
FAULT_COLOURS = ("tab:red", "tab:purple", "tab:green", "tab:brown", "tab:pink", "tab:olive", "tab:cyan",
                 "tab:orange", "tab:blue")


def formats() -> dict[str, str] | None:
    """The file formats matplotlib writes (suffix without the dot, lower case -> name), or ``None`` when
    matplotlib cannot be imported."""
    try:
        import matplotlib  # noqa: F401  (first: a submodule left in sys.modules would not fail its own import)
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        return None
    return FigureCanvasBase.get_supported_filetypes()


def suffix(path: str) -> str:
    """The format a path asks for: its suffix without the dot, lower case (``""`` for none)."""
    return Path(path).suffix[1:].lower()


@dataclass
class Series:
    """What the plot needs of each step, appended once a step (index = step): ``asked`` its verify entries (all
    the cached tokens of its running requests, SPEC 3.2), ``verified`` the entries its plan verified
    (``verify_num_valid``, 0 when ``enable = 0``), ``staleness`` (with the canary only; else empty) the
    longest run of consecutive steps, over the tokens it asked for, that a token has gone unverified as of
    this step (0: it verified everything it asked)."""

    asked: list[int] = field(default_factory=list)
    verified: list[int] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)


def write_plot(path: str, series: Series, summary: dict) -> None:
    """Draw the run and write it to ``path`` atomically, in the format its suffix names (checked before the
    run). Raises ``ImportError`` without matplotlib, ``OSError`` when the file cannot be written."""
    figure = draw(series, summary)
    write_atomic(path, lambda f: figure.savefig(f, format=suffix(path), dpi=110))


def _fault_label(f: dict) -> str:
    name = f"{f['kind']}@{f['requested_step']}"
    if f["applied_step"] is None:
        return f"{name}: NOT APPLIED"
    if not f["detected"]:
        return f"{name}: applied {f['applied_step']}, NOT DETECTED"
    return f"{name}: applied {f['applied_step']}, detected {f['first_violation_step']} (+{f['steps_to_detection']})"


def draw(series: Series, summary: dict) -> Any:
    """The figure of a run (a ``matplotlib.figure.Figure``), from its :class:`Series` and its summary."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    c = summary.get("canary")
    faults = c["faults"] if c is not None else []
    stale = c is not None and len(series.staleness) == len(series.asked)
    heights = [3.0] + ([2.0] if stale else []) + ([0.5 + 0.35 * len(faults)] if faults else [])
    fig = Figure(figsize=(11, 1.2 + sum(heights)), layout="constrained")
    axes = fig.subplots(len(heights), 1, sharex=True, squeeze=False, height_ratios=heights)[:, 0]
    steps = range(len(series.asked))
    cap = summary["verify_capacity"]
    what = "interrupted after " if summary["interrupted"] else ""
    fig.suptitle(f"kv-canary replay: trace {summary['trace']}, backend {summary['backend']}, {what}"
                 f"{summary['steps']} steps, verify capacity {cap} ({summary['on_overflow']} above it)")

    ax = axes[0]
    ax.plot(steps, series.asked, color="tab:gray", linewidth=0.8, label="asked (the step's cached tokens)")
    done = "verified" if c is not None else "in the plan (--plan-only: not verified)"
    ax.plot(steps, series.verified, color="tab:blue", linewidth=1.0, label=done)
    ax.fill_between(steps, series.verified, series.asked, color="tab:orange", alpha=0.35, linewidth=0,
                    label="left unverified" if c is not None else "left out of the plan")
    ax.axhline(cap, color="black", linestyle=":", linewidth=1.2, label=f"budget (verify capacity {cap})")
    ax.set_ylabel("verify entries / step")
    # Headroom above the data and the budget line for the legend.
    ax.set_ylim(bottom=0, top=max(1, cap, max(series.asked, default=0)) * 1.35)
    ax.legend(loc="upper right", fontsize="small", framealpha=0.9)
    ax.grid(alpha=0.3)

    if stale:
        ax = axes[1]
        ax.plot(steps, series.staleness, color="tab:orange", linewidth=0.9, label="this step (max over tokens)")
        running, top = [], 0
        for s in series.staleness:
            top = max(top, s)
            running.append(top)
        ax.plot(steps, running, color="tab:red", linewidth=1.2, linestyle="--", label=f"max so far ({top})")
        if c["max_sweep_steps"]:
            ax.axhline(c["max_sweep_steps"], color="black", linestyle=":", linewidth=1.0,
                       label=f"max sweep bound (SPEC 3.7, {c['max_sweep_steps']})")
        ax.set_ylabel("staleness (steps)")
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # whole steps: no 2.5 ticks
        ax.set_ylim(bottom=0, top=max(1, top, c["max_sweep_steps"]) * 1.5)  # room for the legend
        ax.legend(loc="upper right", fontsize="small", framealpha=0.9)
        ax.grid(alpha=0.3)

    if faults:
        _faults(axes[-1], axes[:-1], faults, len(series.asked))
    axes[-1].set_xlabel("step")
    axes[-1].set_xlim(0, max(1, len(series.asked) - 1))
    return fig


def _faults(ax: Any, others: Any, faults: list[dict], steps: int) -> None:
    """One row a fault (first at the top): a bar from its applied step to its detected step, or to the run's end
    (red, hatched) when it was not detected; its label to the right of the bar. The others panels get a
    vertical line at each applied (solid) and detected (dashed) step."""
    end = max(0, steps - 1)
    for k, f in enumerate(faults):
        colour, y = FAULT_COLOURS[k % len(FAULT_COLOURS)], len(faults) - 1 - k
        applied, found = f["applied_step"], f["first_violation_step"]
        label = _fault_label(f)
        if applied is None:
            ax.text(0, y, f"  {label}", va="center", fontsize="small", color="tab:red")
            continue
        for other in others:
            other.axvline(applied, color=colour, linewidth=1.0, alpha=0.8)
            if found is not None:
                other.axvline(found, color=colour, linewidth=1.0, linestyle="--", alpha=0.8)
        if found is None:
            ax.barh(y, end - applied, left=applied, height=0.5, color="none", edgecolor="tab:red", hatch="//")
        ax.plot([applied], [y], marker="o", color=colour)
        if found is not None:
            ax.plot([applied, found], [y, y], color=colour, linewidth=2)
            ax.plot([found], [y], marker="X", markersize=9, color=colour)
        at = found if found is not None else applied
        # Left of the marker in the last third of the run, so that the label stays inside the axes.
        right = at <= 2 * end / 3
        ax.text(at, y, f"  {label}  " if right else f"{label}  ", va="center", ha="left" if right else "right",
                fontsize="small", color="tab:red" if found is None else "black")
    ax.set_yticks([])
    ax.set_ylim(-0.7, len(faults) - 0.3)
    ax.set_ylabel("faults")
    ax.grid(axis="x", alpha=0.3)
