"""``kv-canary replay``: drive a planner with a real serving trace, step by step, and summarize the run.

Each step of :class:`canary.replay.scheduler.Scheduler` is planned by the chosen backend. The replay checks every
step against what the scheduler knows (``status``, ``enable`` and ``verify_num_valid`` must match the step's
entry count), and every ``--check-every`` steps it also builds the plan with the NumPy reference into a
second set of buffers and compares all output buffers byte for byte. Both sets are poisoned with the same
random values before a compared step, so a backend that writes where it must not (or misses a write) is
caught in the untouched regions too. The sampling cursors (SPEC 3.7) are state, not output: never poisoned,
and the reference keeps its own, planning every sampled step as well, so that they compare byte for byte too.

Plan time is host wall time around ``planner.plan``. On the GPU backends the clock stops after a stream
sync, so it is launch overhead plus device time plus the sync's latency (not the device time alone).

Unless ``--plan-only``, the canary runs end to end on every step, the simulated engine a client of
:class:`canary.CanaryManager` (:mod:`canary.replay.replay_manager`, whose ``before_forward`` does the plan), and
the replay measures what the plans left unverified (:mod:`canary.replay.coverage`); ``--inject KIND@STEP``
corrupts the simulated engine at a step (:mod:`canary.replay.faults`) to show that the canary detects it. The
options are parsed and checked in :mod:`canary.replay.options`, the tables built in :mod:`canary.replay.report`.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time
from dataclasses import fields
from typing import Any

import numpy as np

from canary import BackendUnavailableError, CanaryPlanner, PlanStatus, VerifyPlan, WritePlan, to_host

from . import ranks as rank_procs
from .plot import Series, write_plot
from .replay_manager import ManagerReplay
from .report import ProgressLog, fault_lines, fault_table, manager_table, provenance, summary_table, write_json
from .scheduler import Scheduler, default_buckets, load_trace

MAX_SHOWN_MISMATCHES = 5
WIDE = 200  # columns of the tables when the output is not a terminal (rich's default there is 80: rows wrap)
INTERRUPTED = 130  # the exit status of a run stopped by Ctrl-C (SIGINT), as a shell reports it: 128 + 2


def _error(message: str) -> None:
    """A usage, input or set-up error: one line on stderr, ``kv-canary:`` first, as argparse's (cli.Parser)."""
    message = message if message.startswith("kv-canary:") else f"kv-canary: {message}"
    print(message, file=sys.stderr, flush=True)


class _Arrays:
    """Where the plan's arrays live: host NumPy, CuPy, or Numba device arrays."""

    def __init__(self, kind: str):
        self.kind = kind
        self.xp = np
        if kind == "cupy":
            import cupy

            self.xp = cupy
        elif kind == "numba":
            from numba import cuda

            self.cuda = cuda

    def put(self, a: np.ndarray) -> Any:
        if self.kind == "cupy":
            return self.xp.asarray(a)
        if self.kind == "numba":
            return self.cuda.to_device(a)
        return a

    def update(self, dev: Any, host: np.ndarray, rows: np.ndarray | None = None) -> None:
        """Bring ``dev`` up to date with ``host`` (the host arrays are bound directly: nothing to do)."""
        if self.kind == "cupy":
            if rows is None:
                dev.set(host)
            elif len(rows):
                dev[self.xp.asarray(rows)] = self.xp.asarray(host[rows])
        elif self.kind == "numba":
            dev.copy_to_device(host)

    def fill(self, dev: Any, values: np.ndarray) -> None:
        if self.kind == "host":
            dev[...] = values
        else:
            self.update(dev, values)

    def sync(self) -> None:
        if self.kind == "cupy":
            self.xp.cuda.get_current_stream().synchronize()
        elif self.kind == "numba":
            self.cuda.synchronize()

    def plans(self, verify_capacity: int, write_req_capacity: int, max_reqs: int) -> tuple[VerifyPlan, WritePlan]:
        """Zeroed plans; ``max_reqs`` sizes the sampling cursors, which persist across the whole replay."""
        if self.kind != "numba":
            device = "cpu" if self.kind == "host" else self.xp.cuda.Device().id
            return (VerifyPlan.allocate(verify_capacity=verify_capacity, device=device, max_reqs=max_reqs),
                    WritePlan.allocate(write_req_capacity=write_req_capacity, device=device))
        def z(n, dt):
            return self.cuda.to_device(np.zeros(n, dtype=dt))

        c, r = verify_capacity, write_req_capacity
        return (
            VerifyPlan(verify_slot_indices=z(c, np.int64), verify_expected_tokens=z(c, np.int64),
                       verify_expected_positions=z(c, np.int64), verify_prev_slot_indices=z(c, np.int64),
                       verify_num_valid=z(1, np.int32), enable=z(1, np.int32), status=z(1, np.int32),
                       verify_cursors=z(max_reqs, np.int64)),
            WritePlan(write_offsets=z(r + 1, np.int64), write_seed_slot_indices=z(r, np.int64),
                      write_num_valid_reqs=z(1, np.int32)),
        )


def _no_cuda_driver() -> bool:
    """True when numba-cuda would find no CUDA driver either: on Linux, without its simulator or a driver path
    of its own, it loads ``libcuda.so`` or ``libcuda.so.1`` from the loader's path, ``/usr/lib`` or ``/usr/lib64``
    (numba_cuda's ``locate_driver_and_loader``), as tried here. Importing ``numba.cuda`` to learn the same
    costs 0.5-0.9 s of a host replay's start on a machine without a GPU."""
    if not sys.platform.startswith("linux") or os.environ.get("NUMBA_ENABLE_CUDASIM") or os.environ.get(
            "NUMBA_CUDA_DRIVER"):
        return False
    names = ("libcuda.so", "libcuda.so.1")
    for path in names + tuple(os.path.join(d, n) for d in ("/usr/lib", "/usr/lib64") for n in names):
        try:
            ctypes.CDLL(path)
            return False
        except OSError:
            pass
    return True


def _placement(backend: str) -> str:
    """``host``, ``cupy`` or ``numba``: CuPy arrays whenever CuPy works, so both GPU backends get them."""
    if backend == "reference":
        return "host"
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            return "cupy"
    except Exception:  # no CuPy, or CuPy without a driver/GPU
        pass
    if backend == "auto" and _no_cuda_driver():
        return "host"
    try:
        from numba import cuda

        if cuda.is_available():
            return "numba"
    except Exception:  # no numba-cuda, or no driver
        pass
    if backend == "auto":
        return "host"
    raise BackendUnavailableError(f"kv-canary: backend {backend!r} needs a CUDA GPU, and none was found")


def _buffers(plan_pair) -> list[tuple[str, Any]]:
    return [(f.name, getattr(p, f.name)) for p in plan_pair for f in fields(p) if getattr(p, f.name) is not None]


# The planner's state, not an output: poisoning it would change which entries the next sampled step verifies.
STATE_FIELDS = ("verify_cursors",)


def _want(entries: int, cap: int, sample: bool) -> list[int]:
    """(status, enable, verify_num_valid) of a clean step with ``entries`` verify entries (SPEC 3.2)."""
    if entries <= cap:
        return [int(PlanStatus.OK), 1, entries]
    if sample:
        return [int(PlanStatus.SAMPLED), 1, cap]
    return [int(PlanStatus.OVERFLOW), 0, cap]


def _diff(step: int, got: list, want: list) -> list[str]:
    """Byte-for-byte comparison of two buffer sets; one line per differing buffer."""
    out = []
    for (name, a), (_, b) in zip(got, want):
        a, b = to_host(a), to_host(b)
        if a.tobytes() != b.tobytes():
            i = int(np.flatnonzero(a != b)[0])
            out.append(f"step {step}: {name}[{i}] = {a[i]}, reference {b[i]}")
    return out


def _pct(values: list, q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


def run(args: argparse.Namespace) -> int:
    """Replay, print the report, write ``--json`` and ``--plot``; the exit status: 0 clean, 1 a mismatch, a violation of a
    clean run or a fault missed, 2 an input or set-up error (stderr), 130 interrupted (the partial report)."""
    try:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        from rich.table import Table
    except ImportError:
        _error("kv-canary: replay needs rich for its output: python -m pip install rich (or, in the checkout, "
               "python -m pip install \".[cli]\")")
        return 2
    console = Console()
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(width=WIDE)  # a log or a pipe: rows that wrap at 80 columns only get harder to read
    series = Series() if getattr(args, "plot", None) else None
    ctx = None
    if getattr(args, "ranks", 1) > 1:  # --ranks: this process launches the ranks, or is one (canary.replay.ranks)
        try:
            kind = _placement(args.backend)
            if not rank_procs.is_worker():
                return rank_procs.launch(args, kind)
            ctx = args.rank_ctx = rank_procs.join(kind)
        except (BackendUnavailableError, RuntimeError, ValueError, OSError) as exc:
            _error(str(exc))
            return 2
        if ctx.rank:  # rank 0 reports for every rank
            console = Console(file=open(os.devnull, "w"), width=WIDE)
    try:
        summary, problems = _replay(args, console, Progress, (TextColumn("{task.description}"), BarColumn(),
                                                               MofNCompleteColumn(), TimeElapsedColumn()), series)
    except MemoryError as exc:  # sizes inside the int32 range can still ask for more than the host has
        _error(f"kv-canary: the replay's arrays do not fit in memory ({exc}): lower --max-batch-size (now "
               f"{args.max_batch_size}), --kv-pool-tokens ({args.kv_pool_tokens}), --verify-capacity or "
               f"--num-layers ({args.num_layers})")
        return 2
    except (BackendUnavailableError, ValueError, TypeError, OSError) as exc:
        _error(str(exc))
        return 2
    if ctx is not None:
        summary, problems = ctx.merge(summary, problems)
        ctx.close()
        if ctx.rank:
            return _status(summary)
    if summary["interrupted"]:
        _error(f"kv-canary: interrupted after {summary['steps']} steps: the report of those steps follows")
    for line in problems[:MAX_SHOWN_MISMATCHES]:
        console.print(f"MISMATCH {line}", markup=False, highlight=False)
    if len(problems) > MAX_SHOWN_MISMATCHES:
        console.print(f"... and {len(problems) - MAX_SHOWN_MISMATCHES} more", markup=False)
    c = summary.get("canary")
    if c is not None:
        for line in fault_lines(c):
            console.print(line, markup=False, highlight=False, soft_wrap=True)
        for line in c["first_unattributed"]:
            console.print(f"VIOLATION {line}", markup=False, highlight=False)
        if c["unattributed_violations"] > len(c["first_unattributed"]):
            console.print(f"... and {c['unattributed_violations'] - len(c['first_unattributed'])} more", markup=False)
    console.print(summary_table(summary, Table))
    if c is not None:
        console.print(manager_table(c["manager"], Table))
    if c is not None and c["faults"]:
        console.print(fault_table(c, Table))
    if args.json:
        try:
            write_json(args.json, summary)
        except OSError as exc:  # checked at parse time; the directory can still go away during the run
            _error(f"kv-canary: --json {args.json}: cannot write the summary: {exc}")
            return 2
    if series is not None:
        try:
            write_plot(args.plot, series, summary)
        except (OSError, ImportError) as exc:  # as --json's; matplotlib was there when the options were checked
            _error(f"kv-canary: --plot {args.plot}: cannot write the plot: {exc}")
            return 2
    return _status(summary)


def _status(summary: dict) -> int:
    """The exit status of a finished replay (:func:`run`)."""
    c = summary.get("canary")
    if summary["interrupted"]:
        return INTERRUPTED
    return 1 if summary["mismatches"] or (c is not None and c["failed"]) else 0


def _check_pool(sched_args: dict, trace) -> None:
    """The longest request must fit in the pool (page 0 reserved): said with the options' names, before the
    scheduler (which names its parameters) would refuse it."""
    ps, pool = sched_args["page_size"], sched_args["kv_pool_tokens"]
    if not len(trace):
        return
    longest = int((trace.context_tokens + trace.generated_tokens - 1).max())
    pages = -(-longest // ps)
    if pages > pool // ps - 1:
        raise ValueError(f"kv-canary: --kv-pool-tokens {pool}: expected room for the longest request of trace "
                         f"{trace.name} ({longest} tokens, {pages} pages of --page-size {ps}, plus the reserved "
                         f"page 0): at least {(pages + 1) * ps}")


def _replay(args, console, Progress, columns, series: Series | None = None) -> tuple[dict, list[str]]:
    """The replay's loop; its summary and mismatch lines. ``series``: filled a step at a time for ``--plot``."""
    if getattr(args, "pd", False):  # the prefill-to-decode split has a loop of its own
        from .pd import replay_pd

        return replay_pd(args, console, Progress, columns, series)
    trace = load_trace(args.trace, args.max_requests)
    mbs = args.max_batch_size
    sched_args = dict(max_batch_size=mbs, page_size=args.page_size, kv_pool_tokens=args.kv_pool_tokens,
                      chunk_size=args.chunk_size, token_budget=args.token_budget, swa_window=args.swa_window,
                      pad_buckets=default_buckets(mbs) if args.pad else (), seed=args.seed,
                      offload_tier=args.offload_tier)
    _check_pool(sched_args, trace)
    sched = Scheduler(trace, **sched_args)
    cap = args.verify_capacity or max(1024, int(args.kv_pool_tokens * 0.6) // 1024 * 1024)
    kind = _placement(args.backend)
    want_canary = not args.plan_only
    if want_canary and kind == "numba":  # refused before numba is imported, or any work done
        if args.inject:
            raise BackendUnavailableError(
                "kv-canary: --inject: expected CuPy for the canary's GPU arrays (pip install cupy-cuda13x "
                "'cuda-core[cu13]'), got Numba device arrays only (CuPy is missing or sees no GPU)")
        print("kv-canary: note: Numba device arrays only (no CuPy): planning only, as with --plan-only",
              file=sys.stderr, flush=True)
        want_canary = False
    arrays = _Arrays(kind)
    r2t, lut = sched.req_to_token, sched.full_to_swa_index_mapping
    dev_r2t = arrays.put(r2t)
    dev_lut = None if lut is None else arrays.put(lut)
    max_reqs = r2t.shape[0]
    sample = args.on_overflow == "sample"
    session = _canary(args, sched, arrays, dev_r2t, dev_lut, cap) if want_canary else None
    if session is None:
        plans = arrays.plans(cap, mbs, max_reqs)
        static = dict(req_to_token=dev_r2t, swa_window_size=args.swa_window, full_to_swa_index_mapping=dev_lut,
                      max_batch_size=mbs, on_overflow=args.on_overflow)
        planner = CanaryPlanner(backend=args.backend, verify_plan_out=plans[0], write_plan_out=plans[1], **static)
        planner.warmup()
        pool = None
    else:  # the manager's planner, plans and expected-token pool
        plans, planner, pool = session.plans, session.group.planner, session.pool
    ref_plans = ref = None
    # The reference reads a host pool: the canary's own on the host, a copy refreshed before each compared step
    # on the GPU.
    ref_pool = pool if pool is None or arrays.kind == "host" else np.zeros(pool.shape, dtype=np.int32)
    if args.check_every:
        # Its own cursors, advanced on every step that moves the device's (below), so that they and the entries
        # they choose compare byte for byte on every checked step.
        ref_plans = (VerifyPlan.allocate(verify_capacity=cap, max_reqs=max_reqs),
                     WritePlan.allocate(write_req_capacity=mbs))
        ref = CanaryPlanner(backend="reference", verify_plan_out=ref_plans[0], write_plan_out=ref_plans[1],
                            req_to_token=r2t, swa_window_size=args.swa_window, full_to_swa_index_mapping=lut,
                            max_batch_size=mbs, req_to_verify_expected_tokens=ref_pool,
                            on_overflow=args.on_overflow)
    rng = np.random.default_rng([args.seed, 1])  # poison values, independent of the scheduler's stream

    verify, write, times_us, bs_active, bs_padded = [], [], [], [], []
    overflow = checked = 0
    interrupted = False
    problems: list[str] = []
    console.print(f"kv-canary replay: {len(trace)} requests of trace {trace.name}, backend {planner.backend} "
                  f"({arrays.kind} arrays), verify capacity {cap}", markup=False, highlight=False, soft_wrap=True)
    t_start = time.perf_counter()
    log = None if console.is_terminal else ProgressLog(int(sched.kv_len.sum()), len(trace))
    try:
        with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as progress:
            task = progress.add_task("requests finished", total=len(trace))
            for step in sched.steps():
                arrays.update(dev_r2t, r2t, step.req_pool_indices[: step.num_active])
                if lut is not None:
                    arrays.update(dev_lut, lut)
                inputs = dict(req_pool_indices=arrays.put(step.req_pool_indices),
                              prefix_lens=arrays.put(step.prefix_lens),
                              extend_seq_lens=arrays.put(step.extend_seq_lens))
                compare = bool(args.check_every) and step.index % args.check_every == 0
                # Only a sampled step moves the cursors (SPEC 3.7): the reference must plan each of them too.
                mirror = bool(args.check_every) and sample and step.verify_entries > cap
                if compare:
                    for (name, buf), (_, ref_buf) in zip(_buffers(plans), _buffers(ref_plans)):
                        if name in STATE_FIELDS:
                            continue
                        poison = rng.integers(np.iinfo(ref_buf.dtype).min, np.iinfo(ref_buf.dtype).max,
                                              size=ref_buf.shape, dtype=ref_buf.dtype, endpoint=True)
                        arrays.fill(buf, poison)
                        ref_buf[...] = poison
                arrays.sync()  # the copies above are not part of the plan's time
                t0 = time.perf_counter_ns()
                valid = q = None
                if session is None:
                    planner.plan(**inputs)
                else:  # the manager plans (and verifies) with the pool rows and valid lengths it keeps by request
                    session.before_forward(step, inputs)
                    valid, q = session.manager.staged_expected_tokens(step.bs)
                arrays.sync()
                times_us.append((time.perf_counter_ns() - t0) / 1e3)

                got = [int(to_host(getattr(plans[0], f))[0]) for f in ("status", "enable", "verify_num_valid")]
                want = _want(step.verify_entries, cap, sample)
                if got != want:
                    problems.append(f"step {step.index}: (status, enable, verify_num_valid) = {got}, expected {want}")
                if compare or mirror:
                    if compare and ref_pool is not None and ref_pool is not pool:
                        ref_pool[...] = to_host(pool)  # the pool moves no cursor: only compared steps need it fresh
                    ref.plan(req_pool_indices=step.req_pool_indices, prefix_lens=step.prefix_lens,
                             extend_seq_lens=step.extend_seq_lens, req_to_verify_expected_tokens_valid_lens=valid,
                             expected_token_pool_indices=q)
                if compare:
                    problems += _diff(step.index, _buffers(plans), _buffers(ref_plans))
                    checked += 1
                if session is not None:
                    session.run(step, req_to_token=dev_r2t, lut=dev_lut)
                overflow += step.verify_entries > cap  # what the scheduler knows; the plan's status is checked above
                verify.append(step.verify_entries)
                write.append(step.write_entries)
                bs_active.append(step.num_active)
                bs_padded.append(step.bs)
                if series is not None:  # appended with the step's other figures: an interrupted step has none
                    series.asked.append(step.verify_entries)
                    series.verified.append(got[2] if got[1] else 0)
                    if session is not None:
                        series.staleness.append(session.coverage.step_staleness)
                progress.update(task, completed=sched.num_finished, description=f"step {step.index + 1}")
                if log is not None:
                    log.update(step.index + 1, step.write_entries, sched.num_finished)
    except KeyboardInterrupt:  # Ctrl-C: the report of the steps so far, and exit 130 (run)
        interrupted = True
    wall = time.perf_counter() - t_start

    def stats(values, qs=(50, 99)):
        out = {f"p{q}": _pct(values, q) for q in qs}
        out["max"] = float(max(values, default=0))
        return out

    summary = {
        **provenance(),
        "interrupted": interrupted,
        "trace": trace.name,
        "requests": len(trace),
        "requests_finished": sched.num_finished,
        "steps": len(verify),
        "backend": planner.backend,
        "arrays": arrays.kind,
        "max_batch_size": mbs,
        "verify_capacity": cap,
        "on_overflow": args.on_overflow,
        "page_size": args.page_size,
        "chunk_size": args.chunk_size,
        "swa_window": args.swa_window,
        "padding": bool(args.pad),
        "seed": args.seed,
        "offload_tier": args.offload_tier,
        "offloads": sched.num_offloads,
        "restores": sched.num_restores,
        "batch_size": {"mean_active": float(np.mean(bs_active)) if bs_active else 0.0,
                       "mean_padded": float(np.mean(bs_padded)) if bs_padded else 0.0},
        "verify_entries_per_step": stats(verify),
        "write_entries_per_step": stats(write),
        # Steps above the capacity, by what the plan did with them (PlanStatus): one of the two is 0.
        "sampled_steps": overflow if sample else 0,
        "overflow_steps": 0 if sample else overflow,
        "plan_time_us": stats(times_us),
        "checked_steps": checked,
        "mismatches": len(problems),
        "wall_time_s": wall,
    }
    if session is not None:
        summary["canary"] = session.summary(interrupted=interrupted)
    return summary, problems


def _canary(args, sched: Scheduler, arrays: _Arrays, dev_r2t: Any, dev_lut: Any, cap: int) -> ManagerReplay:
    """The canary side of the replay: the simulated engine as a :class:`canary.CanaryManager` client."""
    device = "cpu" if arrays.kind == "host" else arrays.xp.cuda.Device().id
    return ManagerReplay(sched, xp=arrays.xp, device=device, backend=args.backend, faults=args.inject,
                         req_to_token=dev_r2t, lut=dev_lut, verify_capacity=cap, on_overflow=args.on_overflow,
                         num_layers=args.num_layers, layer_dwell=args.layer_dwell, offload_tier=args.offload_tier,
                         **_rank_args(getattr(args, "rank_ctx", None)))


def _rank_args(ctx: Any) -> dict:
    """The manager's ``ranks`` / ``communicator`` under ``--ranks`` (none otherwise)."""
    return {} if ctx is None else {"ranks": ctx.ranks, "communicator": ctx.communicator}
