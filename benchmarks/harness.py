"""The benchmarks' one timing method and one results schema (docs/performance.md, "Method").

Every ``benchmarks/bench_*.py`` builds a :class:`Bench` from its command line, times through
:func:`device_time` (GPU work) or :func:`host_time` (what a host thread pays per call), records each figure with
:meth:`Bench.figure` and ends with :meth:`Bench.finish`, which writes ``<out>/<benchmark>.json`` (default
``benchmarks/results/``: the latest result of each benchmark; git keeps the history).

Timing, both clocks: the output is checked first (``check`` returns ``None`` or a message; a message records the
figure as failed and nothing is timed), then warm-up calls keep compilation and module loads out, then
``rounds`` rounds are timed and the figure is their median, with min / max / quartiles beside it.
``device_time``: the calls captured once in a CUDA graph on a side stream, CUDA events around ``replays``
replays a round. ``host_time``: ``time.perf_counter_ns`` around each call, the stream synced outside the clock.

``--dry``: no GPU, no CuPy (a CPU in a second or two): the benchmark runs tiny workloads on host arrays (the
reference backend), checks them, and "times" them with the host clock, so that its argument parsing, its check
and the schema writer are exercised (``tests/usage/test_benchmarks_smoke.py``). Dry figures are not results.

Targets and SGLang's anchors are read from the "Targets" and "Anchors" tables of docs/performance.md (one
place); a figure carries a ``key`` (``plan.bs256_decode``, ``records.bs1_decode_ctx4k.ALL``) to find them.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
# a dry run's JSON is a smoke run's, never a result: by default it lands outside the committed results
DRY_RESULTS = Path(tempfile.gettempdir()) / "kv-canary-dry-results"
DOC = ROOT / "docs" / "performance.md"
SCHEMA = "kv-canary-bench/1"
# Device-to-device copy on the H200, bytes read + written per second (bench_plan's measurement); dry runs and
# host-only benchmarks compute floors with it, GPU runs measure their own.
H200_COPY_BANDWIDTH = 4.24e12

for _p in (str(ROOT), str(ROOT / "benchmarks")):
    if _p not in sys.path:
        sys.path.insert(0, _p)


@dataclass(frozen=True)
class Timing:
    """Median and spread of ``rounds`` timed rounds, in ``unit`` per call."""

    median: float
    min: float
    max: float
    q1: float
    q3: float
    rounds: int
    unit: str = "us"

    @classmethod
    def of(cls, samples: list[float], unit: str = "us") -> "Timing":
        s = sorted(samples)
        q = statistics.quantiles(s, n=4, method="inclusive") if len(s) > 1 else [s[0]] * 3
        return cls(statistics.median(s), s[0], s[-1], q[0], q[2], len(s), unit)

    def seconds(self) -> "Timing":
        """The same timing in seconds (from us)."""
        f = 1e-6
        return Timing(self.median * f, self.min * f, self.max * f, self.q1 * f, self.q3 * f, self.rounds, "s")

    def spread(self) -> dict:
        return {"min": self.min, "max": self.max, "q1": self.q1, "q3": self.q3, "rounds": self.rounds}


class CheckFailed(AssertionError):
    """A benchmark's output differs from what it must be: the figure is not timed."""


def require(check: Callable[[], str | None] | None) -> None:
    """Run ``check``; raise :class:`CheckFailed` with its message, if any."""
    problem = check() if check is not None else None
    if problem:
        raise CheckFailed(problem)


def cupy():
    """CuPy, imported on first use (dry runs and ``import harness`` never import it)."""
    import cupy as cp

    return cp


def device_time(call: Callable[[Any], None], *, check: Callable[[], str | None] | None, dry: bool,
                rounds: int = 7, replays: int = 50, calls_per_replay: int = 1, warmup: int = 3,
                around: tuple[Callable[[], None], Callable[[], None]] | None = None) -> Timing:
    """Device time of one ``call(stream)``, us: checked, warmed, captured in a CUDA graph on a side stream, then
    ``rounds`` rounds of ``replays`` replays between two CUDA events, divided by ``replays * calls_per_replay``
    (a graph may hold several calls: independent buffer sets, so that one call's data is not in L2 when its turn
    comes round). ``around``: host work before and after each replay (one replay a round then, ``rounds *
    replays`` rounds). Dry: ``call(None)`` on the host clock. Raises :class:`CheckFailed`."""
    if calls_per_replay < 1 or replays < 1:  # checked in dry runs too: the smoke test then sees a bad count
        raise ValueError(f"kv-canary: calls_per_replay / replays: expected >= 1, got {calls_per_replay} / {replays}")
    require(check)
    if dry:
        return host_time(lambda: call(None), check=None, sync=lambda: None, rounds=min(rounds, 3), warmup=1)
    cp = cupy()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        for _ in range(warmup):
            call(stream)
        stream.synchronize()
        stream.begin_capture()
        call(stream)
        graph = stream.end_capture()
        graph.upload(stream)
        for _ in range(warmup):
            graph.launch(stream)
        stream.synchronize()
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        samples = []
        if around is None:
            for _ in range(rounds):
                start.record(stream)
                for _ in range(replays):
                    graph.launch(stream)
                stop.record(stream)
                stop.synchronize()
                samples.append(cp.cuda.get_elapsed_time(start, stop) * 1e3 / (replays * calls_per_replay))
        else:
            for _ in range(rounds * replays):
                around[0]()
                start.record(stream)
                graph.launch(stream)
                stop.record(stream)
                around[1]()
                stop.synchronize()
                samples.append(cp.cuda.get_elapsed_time(start, stop) * 1e3 / calls_per_replay)
    return Timing.of(samples)


def host_time(call: Callable[[], None], *, check: Callable[[], str | None] | None, sync: Callable[[], None],
              rounds: int = 300, warmup: int = 20, after: Callable[[], None] | None = None,
              clock: Callable[[], int] = time.perf_counter_ns) -> Timing:
    """Host time of one ``call()``, us: checked, ``warmup`` calls, then ``rounds`` calls each timed alone with
    ``clock`` (ns); ``sync()`` (and ``after()``) run outside the clock after each, so every call starts with an
    idle GPU. Raises :class:`CheckFailed`."""
    require(check)
    for _ in range(warmup):
        call()
        sync()
        if after:
            after()
    samples = []
    for _ in range(max(1, rounds)):
        t0 = clock()
        call()
        samples.append((clock() - t0) / 1e3)
        sync()
        if after:
            after()
    return Timing.of(samples)


def wall_time(call: Callable[[], None], *, calls: int, sync: Callable[[], None], rounds: int,
              per_round: int = 1) -> Timing:
    """Wall time per call, us, host overhead and device work together (an eager step as the engine sees it): one
    warm-up call, then ``rounds`` rounds of ``calls`` calls and one ``sync()`` each, divided by ``calls *
    per_round`` (a call that runs several steps says how many)."""
    call()
    sync()
    samples = []
    for _ in range(max(1, rounds)):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            call()
        sync()
        samples.append((time.perf_counter_ns() - t0) / 1e3 / (calls * per_round))
    return Timing.of(samples)


def copy_bandwidth(dry: bool) -> float:
    """Device-to-device copy of 1 GiB, bytes read + written per second (the floors' denominator); dry: the
    H200's figure."""
    if dry:
        return H200_COPY_BANDWIDTH
    cp = cupy()
    n = 1 << 30
    a, b = cp.empty(n, cp.uint8), cp.empty(n, cp.uint8)
    a.fill(1)
    for _ in range(3):
        b[...] = a
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(20):
        b[...] = a
    stop.record()
    stop.synchronize()
    bw = 2 * n * 20 / (cp.cuda.get_elapsed_time(start, stop) / 1e3)
    del a, b
    cp.get_default_memory_pool().free_all_blocks()
    return bw


def git_commit() -> str:
    if os.environ.get("KV_CANARY_COMMIT"):
        return os.environ["KV_CANARY_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (out.stdout.strip() or "unknown") + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


_SMI = "name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem"


def gpu_info(dry: bool) -> dict:
    """GPU 0's name and driver, and its clocks (MHz) where nvidia-smi reads them; dry: no GPU."""
    if dry:
        return {"name": None, "driver": None, "clocks_mhz": None}
    try:
        line = subprocess.run(["nvidia-smi", f"--query-gpu={_SMI}", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
        v = [x.strip() for x in line.split(",")]
        num = lambda s: int(s) if s.isdigit() else None  # noqa: E731 - "[N/A]" where unreadable
        return {"name": v[0], "driver": v[1], "clocks_mhz": {"sm": num(v[2]), "mem": num(v[3]),
                                                             "max_sm": num(v[4]), "max_mem": num(v[5])}}
    except (OSError, IndexError, subprocess.SubprocessError):
        try:
            name = cupy().cuda.runtime.getDeviceProperties(0)["name"]
            name = name.decode() if isinstance(name, bytes) else str(name)
        except Exception:  # noqa: BLE001 - no readable GPU (bench_host --fake)
            name = None
        return {"name": name, "driver": None, "clocks_mhz": None}


def _table(section: str) -> list[list[str]]:
    """The rows of the first Markdown table under ``## section`` in docs/performance.md, cells stripped of
    backticks."""
    text = DOC.read_text()
    m = re.search(rf"^## {re.escape(section)}\s*$(.*?)(?=^## |\Z)", text, re.M | re.S)
    if not m:
        raise LookupError(f"kv-canary: docs/performance.md has no '## {section}' section")
    rows = [[c.strip().strip("`") for c in line.strip().strip("|").split("|")]
            for line in m.group(1).splitlines() if line.startswith("|")]
    return rows[2:]  # past the header and its rule


def targets() -> dict[str, tuple[str, float, str]]:
    """key -> (bound "<=" or ">=", value, unit), from the Targets table."""
    return {r[0]: (r[2], float(r[3]), r[4]) for r in _table("Targets")}


def anchors() -> dict[str, float]:
    """key -> SGLang's figure (us), from the Anchors table."""
    return {r[0]: float(r[2]) for r in _table("Anchors") if r[2] not in ("", "-")}


def _lookup(table: dict, key: str | None):
    while key:  # records.bs1_prefill_32k.ALL falls back to records.bs1_prefill_32k
        if key in table:
            return table[key]
        key = key.rpartition(".")[0]
    return None


def parser(doc: str | None) -> argparse.ArgumentParser:
    """The options every benchmark has: ``--dry``, ``--out``, ``--rounds``."""
    from canary.replay.cli import Parser  # the command's error style: the usage, then "kv-canary: MESSAGE", exit 2

    ap = Parser(description=(doc or "").strip().splitlines()[0] if doc else None,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry", action="store_true", help="no GPU: tiny workloads on the host (a smoke run)")
    ap.add_argument("--out", default=None, help="folder of <benchmark>.json (default benchmarks/results; with "
                    f"--dry, {DRY_RESULTS})")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds per figure (default: the benchmark's)")
    return ap


class Bench:
    """One benchmark run: its figures and what the JSON says about where they come from."""

    def __init__(self, name: str, args: argparse.Namespace, method: str):
        self.name, self.args, self.dry = name, args, bool(args.dry)
        self.method = ("dry run: host clock on tiny host workloads, no GPU (not a result); " if self.dry else "") \
            + method
        self.figures: list[dict] = []
        self.extra: dict = {}
        self._targets, self._anchors = targets(), anchors()
        self._bw: float | None = None

    @property
    def xp(self):
        """The array module: NumPy when dry, else CuPy."""
        if self.dry:
            import numpy

            return numpy
        return cupy()

    @property
    def device(self):
        return "cpu" if self.dry else 0

    def rounds(self, default: int) -> int:
        return self.args.rounds or (min(default, 3) if self.dry else default)

    def bandwidth(self) -> float:
        if self._bw is None:
            self._bw = copy_bandwidth(self.dry)
            print(f"copy bandwidth (read + write): {self._bw / 1e12:.2f} TB/s", flush=True)
        return self._bw

    def floor_us(self, min_bytes: float) -> float:
        """The fewest bytes over the copy bandwidth, us."""
        return min_bytes / self.bandwidth() * 1e6

    def figure(self, name: str, value: float | Timing | None, unit: str = "us", *, key: str | None = None,
               floor: float | None = None, anchor: float | None = None, error: str | None = None,
               **extra) -> dict:
        """Record one figure; ``key`` finds its target and SGLang anchor (docs/performance.md)."""
        t = value if isinstance(value, Timing) else None
        row = {"name": name, "value": t.median if t else value, "unit": t.unit if t else unit, "key": key,
               "floor": floor, "anchor": anchor if anchor is not None else _lookup(self._anchors, key),
               "target": None, "spread": t.spread() if t else None, "error": error}
        tgt = _lookup(self._targets, key)
        if tgt is not None and tgt[2] == row["unit"]:
            row["target"] = {"bound": tgt[0], "value": tgt[1]}
        row.update(extra)
        self.figures.append(row)
        shown = "ERROR " + error if error else f"{row['value']:.3f} {row['unit']}" if row["value"] is not None \
            else "-"
        print(f"{name:48} {shown}" + (f"  floor {floor:.2f}" if floor else "")
              + (f"  anchor {row['anchor']}" if row["anchor"] else ""), flush=True)
        return row

    def attempt(self, name: str, fn: Callable[[], Timing | float], unit: str = "us", **kw) -> dict:
        """``figure(name, fn())``; a failed check or an exception records the figure as failed and goes on (one
        broken implementation must not hide the rest)."""
        try:
            return self.figure(name, fn(), unit, **kw)
        except Exception as exc:  # noqa: BLE001 - recorded, and the exit status says so
            return self.figure(name, None, unit, error=f"{type(exc).__name__}: {exc}"[:500], **kw)

    def result(self) -> dict:
        return {"schema": SCHEMA, "benchmark": self.name, "commit": git_commit(),
                "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "dry": self.dry, "gpu": gpu_info(self.dry),
                "method": self.method, "copy_bandwidth_Bps": self._bw,
                "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]), "figures": self.figures,
                "extra": self.extra}

    def finish(self) -> int:
        """Write ``<out>/<benchmark>.json``; exit status 1 when a figure failed."""
        result = self.result()
        validate(result)
        out = Path(self.args.out) if self.args.out else DRY_RESULTS if self.dry else RESULTS
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"{self.name}.json"
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {path}")
        return 1 if any(f["error"] for f in self.figures) else 0


_TOP = {"schema": str, "benchmark": str, "commit": str, "date": str, "dry": bool, "gpu": dict, "method": str,
        "figures": list, "extra": dict}
_FIGURE = ("name", "value", "unit", "key", "floor", "anchor", "target", "spread", "error")


def validate(result: dict) -> None:
    """Raise ``ValueError`` unless ``result`` follows the schema (what the smoke test checks)."""
    for k, t in _TOP.items():
        if not isinstance(result.get(k), t):
            raise ValueError(f"kv-canary: result field {k!r}: expected {t.__name__}, got {result.get(k)!r}")
    if result["schema"] != SCHEMA or not {"name", "driver", "clocks_mhz"} <= result["gpu"].keys():
        raise ValueError(f"kv-canary: result schema {result['schema']!r} / gpu {result['gpu']!r}")
    if not result["figures"]:
        raise ValueError("kv-canary: a result without figures")
    for f in result["figures"]:
        missing = [k for k in _FIGURE if k not in f]
        if missing or not isinstance(f["name"], str) or not isinstance(f["unit"], str):
            raise ValueError(f"kv-canary: figure {f.get('name')!r}: missing {missing}")
        if f["error"] is None and not isinstance(f["value"], (int, float)):
            raise ValueError(f"kv-canary: figure {f['name']!r}: no value and no error")
