"""The ranks' agreement (SPEC 4.3, canary/manager/distributed.py) per step: the manager's host time with the
agreement on and off, and the bytes all-reduced (issue 29).

``--ranks N`` processes (default 2), each one rank of a ``torch.distributed`` process group joined through the
replay's own :class:`canary.replay.ranks.RankContext` (gloo on the CPU; ``--device cuda``: NCCL, one GPU a rank).
Every rank builds bench_manager.py's manager and decode step twice over the same inputs: once with
``Ranks(tp_rank=r, tp_size=N)`` and a :class:`canary.TorchDistributedCommunicator` (agreement on), once without
(off), and times the same ``before_forward`` + ``after_kv_store`` of a decode step on each (the report of the
step before decoded inside the call, as bench_host.py's ``manager bsN``; the agreement runs there). Figures:

- ``agree <workload> off`` / ``on``: host time per step, us (``harness.host_time``: median of ``--rounds``
  calls, each timed alone; a barrier outside the clock after every call, so that the ranks start each step
  together and ``on`` times the collective, not the other rank's lag);
- ``agree <workload> cost``: ``on - off``, us;
- ``agree <workload> wall off`` / ``wall on``: wall time per step, device work included (``harness.wall_time``;
  on the CPU there is no device work, so these are the host figures without the barrier between calls);
- ``agree <workload> on: note`` / ``agree`` / ``all_reduce``: where the ``on`` calls' time goes: the host
  digests of the step's entries and plan (``Agreement.note``), the summary and its reduce (``Agreement.agree``)
  and, inside it, the all-reduce (each a median and spread over the timed calls; the parts' medians need not add
  up to the step's); ``on: rank skew at all_reduce``: how far apart the ranks entered each all-reduce (the first
  waits that long in it), median, us;
- ``agree all_reduce alone``: one MAX all-reduce of the summary's words over the communicator, the ranks
  entering it together (after a barrier), us; ``after 1 ms of compute``: the same with 1 ms of NumPy work on
  every rank between the barrier and the call (outside the clock), as in a step: on a host with fewer free
  cores than ranks the all-reduce then waits for the other rank to be scheduled again;
- ``agree <workload> bytes``: the bytes this rank all-reduced per step, from ``Agreement.stats()``
  (``bytes_reduced / agreed_steps``), checked against the formula below (a mismatch fails the figure).

Bytes all-reduced per step and rank, the clean path (no rank saw a violation, the summaries agree): one MAX
all-reduce per scope of ``G * (1 + 2 * F)`` int64 words, ``G`` the KV groups, ``F = len(FIELDS) = 6`` (written,
verified, status, batch, plan, entries): each group's flag, its words, and their negations (the MIN carried
through the MAX), so ``8 * G * 13 = 104 * G`` bytes per scope (``"tp"``, and ``"pp"`` with pipeline stages: the
``pp`` words are as many, those not compared zeroed). A step where the ranks disagree adds one SUM all-reduce of
``size * G * (1 + F)`` words per scope (every rank's summary gathered): ``56 * size * G`` bytes. This benchmark's
manager has one group and one scope: 104 bytes a step.

Only ``--device cpu`` (gloo, host arrays: the reference backend) has been run. ``--device cuda`` (NCCL, CuPy
arrays, the digests on the device: ``kernels/agree.cu``) is the same code and is unmeasured: it needs ``--ranks``
GPUs, and its host figures then sync the stream outside the clock, its wall figures include the device time.

    python benchmarks/bench_agree.py [--ranks 2] [--device cpu|cuda] [--rounds 200] [--name agree-cpu-gloo] [--dry]
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

import harness

WORKLOADS = {"bs1_decode": (1, 512), "bs32_decode": (32, 256)}  # (bs, context per request)
DRY = {"bs1_decode": (1, 16), "bs4_decode": (4, 16)}
WORDS_PER_GROUP = 1 + 2 * 6  # the flag, FIELDS and their negations (distributed.py Agreement.agree)


def formula_bytes(groups: int, scopes: int = 1) -> int:
    """The clean path's bytes all-reduced per step and rank (the module docstring's formula)."""
    return 8 * groups * WORDS_PER_GROUP * scopes


class Parts:
    """Clocks around the agreement's pieces on one manager (``on``): the host digests of each step's entries and
    plan (``note``, in ``after_kv_store``), the summary and reduce (``agree``, in the report's decode) and, inside
    it, the all-reduce itself; each call's ns kept while ``timing``."""

    def __init__(self, agreement):
        self.timing, self.ns = False, {"note": [], "agree": [], "all_reduce": []}
        self.entered: list[int] = []  # when this rank entered each timed all-reduce
        agreement.note = self._clocked("note", agreement.note)
        agreement.agree = self._clocked("agree", agreement.agree)
        agreement.comms = [(scope, _Clocked(comm, self)) for scope, comm in agreement.comms]

    def _clocked(self, part, fn):
        def call(*a, **kw):
            t0 = time.perf_counter_ns()
            try:
                return fn(*a, **kw)
            finally:
                if self.timing:
                    self.ns[part].append(time.perf_counter_ns() - t0)
        return call


class _Clocked:
    """A communicator whose ``all_reduce`` is clocked into ``parts``."""

    def __init__(self, comm, parts: Parts):
        self.rank, self.size, self._parts = comm.rank, comm.size, parts
        self._reduce = parts._clocked("all_reduce", comm.all_reduce)

    def all_reduce(self, words, op):
        if self._parts.timing:  # CLOCK_MONOTONIC: one clock for every process of the host
            self._parts.entered.append(time.monotonic_ns())
        return self._reduce(words, op)


def paired(steps: dict, sync, barrier, rounds: int, warmup: int, parts: Parts) -> dict:
    """Host time of each of ``steps`` (mode -> call), us, timed in turns within every round (the order alternating),
    so that both see the same load (2 CPUs, other work on them); ``sync`` and a barrier outside the clock after
    each call: every rank starts every call together."""
    samples = {k: [] for k in steps}
    order = list(steps)
    for i in range(warmup + rounds):
        for mode in order if i % 2 else order[::-1]:
            parts.timing = i >= warmup
            t0 = time.perf_counter_ns()
            steps[mode]()
            dt = time.perf_counter_ns() - t0
            parts.timing = False
            sync()
            barrier()
            if i >= warmup:
                samples[mode].append(dt / 1e3)
    return {k: harness.Timing.of(v) for k, v in samples.items()}


def run_rank(args) -> int:
    from canary.replay import ranks as rank_procs

    cuda = args.device == "cuda"
    ctx = rank_procs.join("cupy" if cuda else "host")
    rounds = args.rounds or (3 if args.dry else 200)
    bench = harness.Bench(args.name, args, f"host time per step: perf_counter around before_forward + "
                          f"after_kv_store of a decode step, median of {rounds} calls, a barrier outside "
                          f"the clock after each; {args.ranks} ranks, torch.distributed "
                          f"{'NCCL' if cuda else 'gloo'}, one process a rank")
    from bench_manager import build

    if cuda:
        import cupy as xp

        sync, device = xp.cuda.get_current_stream().synchronize, ctx.rank
    else:
        xp, sync, device = np, (lambda: None), "cpu"
    barrier = ctx.dist.barrier
    extra = {"ranks": args.ranks, "device": args.device, "backend": "nccl" if cuda else "gloo",
             "cpus": os.cpu_count(), "load_average_at_start": os.getloadavg(), "workloads": {}}
    words = np.zeros(WORDS_PER_GROUP, np.int64)
    bench.attempt("agree all_reduce alone", lambda: harness.host_time(
        lambda: ctx.communicator.all_reduce(words, "max"), check=None, sync=lambda: None, rounds=rounds,
        warmup=min(20, rounds), after=barrier), words=int(words.shape[0]), bytes=8 * int(words.shape[0]))
    spin = np.ones(4096)

    def barrier_then_busy(us: float = 1000.0):  # both ranks compute 1 ms after the barrier, outside the clock
        barrier()
        t0 = time.perf_counter_ns()
        while time.perf_counter_ns() - t0 < us * 1e3:
            spin.sum()

    bench.attempt("agree all_reduce after 1 ms of compute", lambda: harness.host_time(
        lambda: ctx.communicator.all_reduce(words, "max"), check=None, sync=lambda: None, rounds=rounds,
        warmup=min(20, rounds), after=barrier_then_busy), words=int(words.shape[0]), bytes=8 * int(words.shape[0]))
    for name, (bs, context) in (DRY if bench.dry else WORKLOADS).items():
        info = dict(bs=bs, context=context, verify_entries=bs * (context - 1))
        steps = {}
        for mode in ("off", "on"):
            kw = dict(ranks=ctx.ranks, communicator=ctx.communicator) if mode == "on" else {}
            m, ids, before, after = build(xp, bs, context, device=device, **kw)

            def step(m=m, ids=ids, before=before, after=after):
                m.before_forward(request_ids=ids, **before)
                m.after_kv_store(**after)

            steps[mode] = (m, step)
        parts = Parts(steps["on"][0]._agreement)
        t = paired({k: v[1] for k, v in steps.items()}, sync, barrier, rounds, min(20, rounds), parts)
        for mode in ("off", "on"):
            bench.figure(f"agree {name} {mode}", t[mode], **info)
        bench.figure(f"agree {name} cost", t["on"].median - t["off"].median, **info)
        for part, ns in parts.ns.items():  # where the cost goes, per timed "on" call
            bench.figure(f"agree {name} on: {part}", harness.Timing.of([x / 1e3 for x in ns]), **info)
        every = [None] * ctx.size  # the ranks' skew at each all-reduce: what the first to enter waits in it
        ctx.dist.all_gather_object(every, parts.entered, group=ctx.objects)
        if len({len(e) for e in every}) == 1 and every[0]:
            skew = np.max(every, axis=0) - np.min(every, axis=0)
            bench.figure(f"agree {name} on: rank skew at all_reduce", harness.Timing.of((skew / 1e3).tolist()),
                         **info)
        for mode in ("off", "on"):
            barrier()
            bench.attempt(f"agree {name} wall {mode}", lambda: harness.wall_time(
                steps[mode][1], calls=10, sync=sync, rounds=max(1, rounds // 10)), **info)
        for mode, (m, _) in steps.items():
            m.flush()
            if mode == "on":
                a = m.stats()["agreement"]
                per = a["bytes_reduced"] / max(1, a["agreed_steps"])
                want = formula_bytes(len(m.groups))
                problem = None if per == want and a["gathers"] == 0 else (
                    f"bytes per step {per} (gathers {a['gathers']}), expected {want} (formula, no gather)")
                bench.figure(f"agree {name} bytes", per, "B", error=problem, formula=want, groups=len(m.groups),
                             **info)
                extra["workloads"][name] = {**info, "agreement": a}
            m.close()
    extra["load_average_at_end"] = os.getloadavg()
    bench.extra = extra
    parts = [None] * args.ranks  # every rank's medians, beside rank 0's figures
    ctx.dist.all_gather_object(parts, {f["name"]: f["value"] for f in bench.figures}, group=ctx.objects)
    extra["per_rank_medians"] = parts
    ctx.close()
    rank_procs.end(bench.finish() if ctx.rank == 0 else int(any(f["error"] for f in bench.figures)))


def main() -> int:
    p = harness.parser(__doc__)
    p.add_argument("--ranks", type=int, default=2, help="rank processes (default 2)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: gloo over host arrays; cuda: NCCL, one GPU a rank (unmeasured)")
    p.add_argument("--name", default="agree", help="the results file's name: agree, or agree-<variant>")
    args = p.parse_args()
    if args.ranks < 2:
        p.error(f"argument --ranks: expected an int >= 2 (the ranks agree with each other), got {args.ranks}")
    if args.dry and args.device == "cuda":
        p.error("argument --device: expected cpu with --dry (no GPU), got cuda")
    import importlib.util

    from canary.replay import ranks as rank_procs

    if importlib.util.find_spec("torch") is None:  # before any rank starts: one message, not one traceback a rank
        p.error(f"argument --ranks: expected torch for the ranks' process group (torch.distributed) with --ranks "
                f"{args.ranks}, got no torch: "
                f"{rank_procs.NEEDS_TORCH}")
    if not rank_procs.is_worker():  # this script again as every rank (the replay's --ranks launcher)
        return rank_procs.spawn([sys.executable, __file__, *sys.argv[1:]], args.ranks)
    return run_rank(args)


if __name__ == "__main__":
    raise SystemExit(main())
