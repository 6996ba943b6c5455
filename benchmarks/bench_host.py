"""Eager host time of the per-step calls (issues 13 and 14): the manager's step, records verify + write, plan.

What the engine's host thread pays per call, launches included, device time excluded (the stream is synced
outside the clock after each call): median over ``--repeats`` calls, us.

- ``manager bsN``: ``before_forward`` + ``after_kv_store`` of a decode step (one full-attention group, one
  real-KV source), bs = 1 (ctx 4096) and bs = 256 (ctx 2048), the report of the step before decoded inside
  the call (as in an engine); ``+tokens each`` / ``+tokens batch``: the same with one accepted token per
  request per step (a real decode loop: the expected tokens are staged every step), reported per request
  (``accept_tokens``) or for the batch (``accept_tokens_batch``), those calls timed too;
- ``records bsN``: ``CanaryRecords.verify`` + ``CanaryRecords.write`` of a decode step;
- ``plan bsN``: ``CanaryPlanner.plan`` with the expected-token pool (as the manager binds it), bs = 1, 8, 64, 256.

``--fake``: no GPU needed: a NumPy-backed stand-in for CuPy and the CUDA runtime (``benchmarks/fakecuda.py``)
whose launches do nothing, so the numbers are the pure Python host path (a proxy: compare before / after in
one run; timed in this thread's CPU time, less the stand-in's emulation of the kernels), with the driver calls a
GPU would pay counted per call.
``--profile NAME``: cProfile of one row. ``--split``: the manager rows' calls timed one by one too. ``--direct``:
the manager without its eager CUDA graphs.

    python benchmarks/bench_host.py [--repeats 300] [--fake] [--only manager] [--direct] [--profile "manager bs1"]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

MANAGER = {"bs1": (1, 4096), "bs256": (256, 2048)}  # (bs, context per request)
PLAN_BS = (1, 8, 64, 256)


MANAGER_KW: dict = {}  # --direct: {"eager_graphs": False}
SPLIT: dict = {}  # --split: {"clock": the clock, "parts": [(accept ns, before_forward ns, after_kv_store ns)]}


def manager_case(cp, bs: int, context: int, tokens: str | None):
    """bench_manager's manager and decode step; ``tokens``: one accepted token per request per step, reported
    ``"each"`` (``accept_tokens`` per request) or as a ``"batch"`` (``accept_tokens_batch``) or ``"device"``
    (``accept_tokens_batch`` with a device array), timed with the step
    (half the context is then prompt, so that the accepted tokens have room)."""
    from bench_manager import build

    m, ids, before, after = build(cp, bs, context, prompt=context // 2 if tokens else None, **MANAGER_KW)
    if tokens in ("batch", "device") and not hasattr(m, "accept_tokens_batch"):  # a tree from before it (a baseline)
        m.close()
        return None
    one, ones = [0], np.zeros(bs, dtype=np.int64)
    sampled = cp.asarray(ones)
    tick = SPLIT.get("clock")

    def accept():
        if tokens == "each":  # the engine's calls too
            for rid in ids:
                m.accept_tokens(rid, one)
        elif tokens == "batch":
            m.accept_tokens_batch(ids, ones)
        elif tokens == "device":  # the engine's sampled token ids, in its static device buffer
            m.accept_tokens_batch(ids, sampled)

    def call():
        if tick is None:
            accept()
            m.before_forward(request_ids=ids, **before)
            m.after_kv_store(**after)
            return
        t0 = tick()  # --split: each call's share, in the same clock (less the stand-in's emulation)
        accept()
        t1 = tick()
        m.before_forward(request_ids=ids, **before)
        t2 = tick()
        m.after_kv_store(**after)
        SPLIT["parts"].append((t1 - t0, t2 - t1, tick() - t2))

    # No poll outside the clock: the next call's before_forward decodes this step's report, as in an engine
    return call, None, m.close


def planner_case(cp, bs: int, context: int = 64):
    from canary import CanaryPlanner, VerifyPlan, WritePlan

    max_reqs, max_seq = bs + 1, context + 1
    r2t = cp.asarray(np.arange(max_reqs * max_seq, dtype=np.int32).reshape(max_reqs, max_seq))
    pool = cp.zeros((2 * max_reqs, max_seq + 1), dtype=np.int32)
    vp = VerifyPlan.allocate(verify_capacity=bs * context, device=0, max_reqs=max_reqs)
    wp = WritePlan.allocate(write_req_capacity=bs, device=0)
    p = CanaryPlanner(verify_plan_out=vp, write_plan_out=wp, req_to_token=r2t, req_to_verify_expected_tokens=pool,
                      max_batch_size=bs)
    p.warmup()
    a = cp.asarray
    step = dict(req_pool_indices=a(np.arange(1, bs + 1, dtype=np.int64)),
                prefix_lens=a(np.full(bs, context - 1, np.int64)), extend_seq_lens=a(np.ones(bs, np.int64)),
                req_to_verify_expected_tokens_valid_lens=a(np.full(bs, context, np.int64)),
                expected_token_pool_indices=a(np.arange(1, bs + 1, dtype=np.int64)))
    return p, vp, wp, step


def records_case(cp, bs: int, context: int):
    from canary import CanaryRecords, CanaryState

    p, vp, wp, step = planner_case(cp, bs, context)
    p.plan(**step)
    slots = (bs + 1) * (context + 1)
    k = cp.zeros((slots, 256), dtype=np.uint8)
    state = CanaryState.allocate(num_slots=slots, ring_capacity=256, device=0)
    rec = CanaryRecords(state, [(k, 1, 256)])
    rec.warmup()
    a = cp.asarray
    loc = a(np.arange(1, bs + 1, dtype=np.int64) * (context + 1) + context - 1)
    ids, pos = a(np.zeros(bs, np.int64)), a(np.full(bs, context - 1, np.int64))

    def call():
        rec.verify(vp, launch_tag=0)
        rec.write(wp, out_cache_loc=loc, input_ids=ids, positions=pos, launch_tag=1)

    return call


def cases(cp, only: list[str] | None):
    out = {}
    want = (lambda kind: not only or kind in only)
    if want("manager"):
        for name, (bs, ctx) in MANAGER.items():
            for tokens in (None, "each", "batch", "device"):
                out[f"manager {name}{' +tokens ' + tokens if tokens else ''}"] = \
                    lambda bs=bs, ctx=ctx, t=tokens: manager_case(cp, bs, ctx, t)
    if want("records"):
        for bs, ctx in ((1, 4096), (256, 2048)):
            out[f"records bs{bs}"] = lambda bs=bs, ctx=ctx: (records_case(cp, bs, ctx), None, None)
    if want("plan"):
        for bs in PLAN_BS:
            def make(bs=bs):
                p, _, _, step = planner_case(cp, bs)
                return (lambda: p.plan(**step)), None, None
            out[f"plan bs{bs}"] = make
    return out


def measure(call, after, sync, repeats: int, counts=None, clock=time.perf_counter_ns) -> tuple[float, dict]:
    for _ in range(20):
        call()
        sync()
        if after:
            after()
    times = []
    before = dict(counts) if counts is not None else {}
    for _ in range(repeats):
        t0 = clock()
        call()
        times.append((clock() - t0) / 1e3)
        sync()  # outside the clock: each call starts with an idle GPU
        if after:
            after()
    per_call = {}
    if counts is not None:
        per_call = {k: round((v - before.get(k, 0)) / repeats, 2) for k, v in counts.items()
                    if v - before.get(k, 0)}
    return statistics.median(times), per_call


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=300)
    ap.add_argument("--fake", action="store_true", help="no GPU: fake CuPy and CUDA runtime (benchmarks/fakecuda.py)")
    ap.add_argument("--only", nargs="+", choices=["manager", "records", "plan"])
    ap.add_argument("--profile", help="cProfile this row (e.g. 'manager bs1') instead of timing every row")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--split", action="store_true", help="manager rows: also each call's median (accept, "
                    "before_forward, after_kv_store)")
    ap.add_argument("--direct", action="store_true", help="the manager with eager_graphs=False (every launch direct)")
    args = ap.parse_args()
    if args.direct:
        MANAGER_KW["eager_graphs"] = False
    clock = time.perf_counter_ns
    counts = None
    if args.fake:
        import fakecuda

        fakecuda.install()
        counts = fakecuda.COUNTS
        # this thread's CPU time, less the stand-in's emulation of the kernels (the GPU's time, not ours)
        clock = lambda: time.thread_time_ns() - fakecuda.EMULATED_NS  # noqa: E731
    if args.split:
        SPLIT["clock"] = clock
    import cupy as cp

    def sync():
        cp.cuda.Device().synchronize()

    rows = []
    for name, make in cases(cp, args.only).items():
        if args.profile and name != args.profile:
            continue
        made = make()
        if made is None:
            continue
        call, after, close = made
        if args.profile:
            measure(call, after, sync, 50)
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.repeats):
                call()
                sync()
                if after:
                    after()
            prof.disable()
            for key in ("tottime", "cumulative"):
                out = io.StringIO()
                pstats.Stats(prof, stream=out).sort_stats(key).print_stats(args.top)
                print(out.getvalue())
            return 0
        # --fake: this thread's CPU time (on a shared machine, time spent descheduled is not the code's)
        SPLIT["parts"] = []
        us, per_call = measure(call, after, sync, args.repeats, counts, clock)
        row = {"call": name, "host_us": us, "driver_calls": per_call}
        if SPLIT["parts"]:
            parts = SPLIT["parts"][20:]  # past the warm-up calls
            row["split_us"] = {k: round(statistics.median(p[i] for p in parts) / 1e3, 1)
                               for i, k in enumerate(("accept", "before_forward", "after_kv_store"))}
        rows.append(row)
        print(f"{name:22} {us:8.1f} us   {json.dumps(row.get('split_us', per_call))}", flush=True)
        if close:
            close()
    if args.json:
        Path(args.json).write_text(json.dumps({"fake": args.fake, "repeats": args.repeats, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
