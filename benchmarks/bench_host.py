"""Manager host time: eager host time of the per-step calls, the manager's step, records verify + write, plan.

What the engine's host thread pays per call, launches included, device time excluded (the stream is synced
outside the clock after each call): median over ``--rounds`` calls, us.

- ``manager bsN``: ``before_forward`` + ``after_kv_store`` of a decode step (one full-attention group, one
  real-KV source), bs = 1 (ctx 4096) and bs = 256 (ctx 2048), the report of the step before decoded inside
  the call (as in an engine); ``+tokens each`` / ``+tokens batch``: the same with one accepted token per
  request per step (a real decode loop: the expected tokens are staged every step), reported per request
  (``accept_tokens``) or for the batch (``accept_tokens_batch``), those calls timed too;
- ``records bsN``: ``CanaryRecords.verify`` + ``CanaryRecords.write`` of a decode step;
- ``plan bsN``: ``CanaryPlanner.plan`` with the expected-token pool (as the manager binds it), bs = 1, 8, 64, 256.

``--fake``: no GPU needed: a NumPy-backed stand-in for CuPy and the CUDA runtime (``tests/helpers/fakecuda.py``)
whose launches do nothing, so the numbers are the pure Python host path (a proxy: compare before / after in
one run; timed in this thread's CPU time, less the stand-in's emulation of the kernels), with the driver calls a
GPU would pay counted per call.
``--profile NAME``: cProfile of one row (printed; no result written). ``--split``: the manager rows' calls timed
one by one too. ``--direct``: the manager without its eager CUDA graphs. ``--dry``: host arrays (the reference
backend), tiny workloads. Writes benchmarks/results/host.json (``--fake``: host-fake.json).

    python benchmarks/bench_host.py [--rounds 300] [--fake] [--only manager] [--direct] [--profile "manager bs1"]
"""
from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import sys
import time

import numpy as np

import harness

MANAGER = {"bs1": (1, 4096), "bs32": (32, 1024), "bs256": (256, 2048)}  # (bs, context per request)
PLAN_BS = [1, 8, 64, 256]
RECORDS = [(1, 4096), (256, 2048)]  # (bs, context per request)
CHURN = [32, 48]  # (max batch, prompt tokens): churn_case


MANAGER_KW: dict = {}  # --direct: {"eager_graphs": False}; --dry: {"device": "cpu"}
DEVICE: dict = {"device": 0}  # --dry: "cpu"
GRAPHS: dict = {}  # a row's eager-graph counts (churn_case's close)
SPLIT: dict = {}  # --split: {"clock": the clock, "parts": [(accept ns, before_forward ns, after_kv_store ns)]}


def manager_case(cp, bs: int, context: int, tokens: str | None, stream: str | None = None):
    """bench_manager's manager and decode step; ``tokens``: one accepted token per request per step, reported
    ``"each"`` (``accept_tokens`` per request) or as a ``"batch"`` (``accept_tokens_batch``) or ``"device"``
    (``accept_tokens_batch`` with a device array), timed with the step
    (half the context is then prompt, so that the accepted tokens have room). ``stream``: the step calls get an
    explicit ``stream=``, CuPy's ``"current"`` stream or ``"other"``, a stream of their own (the arrays' library
    then ordered before it once a call, issue 26)."""
    if stream is not None and DEVICE["device"] == "cpu":  # --dry: a host manager takes no stream
        return None
    from bench_manager import build

    m, ids, before, after = build(cp, bs, context, prompt=context // 2 if tokens else None, **MANAGER_KW)
    if stream is not None:
        s = cp.cuda.get_current_stream() if stream == "current" else cp.cuda.Stream(non_blocking=True)
        before, after = dict(before, stream=s), dict(after, stream=s)
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


def churn_case(cp, cap: int = 32, prompt: int = 48, seed: int = 0):
    """An engine's loop with requests joining and leaving (issue 26's transformers run, in miniature): up to
    ``cap`` requests of prompts of ``prompt / 4`` to ``prompt`` tokens, each leaving after 8-72 new tokens, a new one joining (its whole
    prompt in the step, beside the others' decode tokens) as soon as a row is free, about one join every 3 steps.
    The batch is padded to a power of two (padding rows: row 0, id ``None``) and each padded size has its own
    static step arrays, refilled outside the clock, as an engine with static buffers does; the token arrays are
    padded to a power of two too (exact with ``--dry``: a host manager checks the count). Each call is one step:
    ``before_forward``, ``after_kv_store``, then, as transformers' ``update_batch`` does, ``accept_tokens_batch``
    of every request's sampled token in the batch's order (``None`` for one that leaves), ``finish_request`` /
    ``add_request``; the next batch then differs from the accepted one whenever a request left or joined. The
    tokens are consistent (a clean cache: ``on_violation="raise"``)."""
    from canary import CanaryManager, KVGroup

    rng = np.random.default_rng(seed)
    max_seq, max_reqs = prompt + 80, cap + 1
    a = cp.asarray
    r2t = a(np.arange(max_reqs * max_seq, dtype=np.int32).reshape(max_reqs, max_seq))
    m = CanaryManager(KVGroup(name="full", req_to_token=r2t, num_slots=max_reqs * max_seq,
                              verify_capacity=cap * max_seq), max_batch_size=cap,
                      max_step_tokens=1 << (cap * prompt - 1).bit_length(),
                      on_violation="raise", **{**DEVICE, **MANAGER_KW})
    m.warmup()

    def tok(n: int, p: np.ndarray | int):  # request n's token at position p
        return (n * 131 + np.asarray(p, dtype=np.int64) * 7) % 30011 + 1

    pow2 = (lambda n: 1 << max(0, n - 1).bit_length())
    steps = {b: [a(np.zeros(b, np.int64)) for _ in range(3)] for b in (pow2(1 << i) for i in range(cap.bit_length()))}
    tokens_cap = pow2(cap * prompt)
    toks = {}  # padded token count -> (out_cache_loc, input_ids, positions)
    live: dict[int, list] = {}  # request number -> [row, next position, last position, prompt length]
    free = list(range(cap, 0, -1))
    state = {"next": 0, "plan": None}

    def join():
        n = state["next"]
        state["next"] += 1
        p = int(rng.integers(prompt // 4, prompt + 1))
        live[n] = [free.pop(), 0, p + int(rng.integers(8, 73)), p]
        m.add_request(n, tok(n, np.arange(p)))

    for _ in range(cap // 2):
        join()

    def prepare():  # the engine's work: the next step's batch into its static buffers (outside the clock)
        order = sorted(live)
        rows = np.array([live[n][0] for n in order], np.int64)
        pre = np.array([live[n][1] for n in order], np.int64)
        ext = np.array([live[n][3] if not live[n][1] else 1 for n in order], np.int64)
        b = pow2(len(order))
        rpi, pv, ev = steps[b]
        pad = b - len(order)
        rpi[:] = a(np.concatenate([rows, np.zeros(pad, np.int64)]))
        pv[:] = a(np.concatenate([pre, np.zeros(pad, np.int64)]))
        ev[:] = a(np.concatenate([ext, np.zeros(pad, np.int64)]))
        pos = np.concatenate([np.arange(p, p + e) for p, e in zip(pre, ext)])
        ids = np.concatenate([tok(n, np.arange(p, p + e)) for n, p, e in zip(order, pre, ext)])
        loc = np.repeat(rows, ext) * max_seq + pos
        # a host manager knows the lengths and takes exactly the step's tokens; a device one takes padded arrays
        t = len(pos) if DEVICE["device"] == "cpu" else min(pow2(len(pos)), tokens_cap)
        if t not in toks:
            toks[t] = tuple(a(np.zeros(t, np.int64)) for _ in range(3))
        for arr, v in zip(toks[t], (loc, ids, pos)):
            arr[:] = a(np.concatenate([v, np.zeros(t - len(v), np.int64)]))
        # after the forward, the engine accepts each request's sampled token (its next position's), in the
        # batch's order, but not for a request that leaves: it is finished instead
        nxt = pre + ext
        stays = [n for n, q in zip(order, nxt) if q <= live[n][2]]
        accepted = ([n if n in stays else None for n in order] + [None] * pad,
                    np.array([int(tok(n, q)) if n in stays else 0 for n, q in zip(order, nxt)] + [0] * pad, np.int64))
        state["plan"] = (order + [None] * pad, (rpi, pv, ev), toks[t], dict(zip(order, nxt.tolist())), accepted)

    def call():
        ids, (rpi, pv, ev), (loc, inp, pos), nxt, (accept_ids, accepted) = state["plan"]
        m.before_forward(request_ids=ids, req_pool_indices=rpi, prefix_lens=pv, extend_seq_lens=ev)
        m.after_kv_store(out_cache_loc=loc, input_ids=inp, positions=pos)
        if any(i is not None for i in accept_ids):
            m.accept_tokens_batch(accept_ids, accepted)
        for n, q in nxt.items():
            r = live[n]
            r[1] = q
            if q > r[2]:
                m.finish_request(n)
                free.append(r[0])
                del live[n]
        if free and (len(live) < cap // 2 or rng.random() < 0.35):
            join()

    def after():
        prepare()

    def close():  # the eager graphs' counts over the row's calls, warm-up included (bench row "graphs")
        st = m.stats()
        GRAPHS.update({k: st[k] for k in ("graph_captures", "graph_replays", "direct_calls", "graph_misses")},
                      steps=st["decoded_steps"])
        m.close()

    prepare()
    return call, after, close


def planner_case(cp, bs: int, context: int = 64):
    from canary import CanaryPlanner, VerifyPlan, WritePlan

    max_reqs, max_seq = bs + 1, context + 1
    r2t = cp.asarray(np.arange(max_reqs * max_seq, dtype=np.int32).reshape(max_reqs, max_seq))
    pool = cp.zeros((2 * max_reqs, max_seq + 1), dtype=np.int32)
    vp = VerifyPlan.allocate(verify_capacity=bs * context, max_reqs=max_reqs, **DEVICE)
    wp = WritePlan.allocate(write_req_capacity=bs, **DEVICE)
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
    state = CanaryState.allocate(num_slots=slots, ring_capacity=256, **DEVICE)
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
            for stream in ("current", "other"):
                out[f"manager {name} stream={stream}"] = lambda bs=bs, ctx=ctx, s=stream: manager_case(cp, bs, ctx,
                                                                                                   None, s)
        out["manager churn"] = lambda: churn_case(cp, *CHURN)
    if want("records"):
        for bs, ctx in RECORDS:
            out[f"records bs{bs}"] = lambda bs=bs, ctx=ctx: (records_case(cp, bs, ctx), None, None)
    if want("plan"):
        for bs in PLAN_BS:
            def make(bs=bs):
                p, _, _, step = planner_case(cp, bs)
                return (lambda: p.plan(**step)), None, None
            out[f"plan bs{bs}"] = make
    return out


def main() -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--fake", action="store_true", help="no GPU: fake CuPy and CUDA runtime (tests/helpers/fakecuda.py)")
    ap.add_argument("--only", nargs="+", choices=["manager", "records", "plan"])
    ap.add_argument("--profile", help="cProfile this row (e.g. 'manager bs1') instead of timing every row")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--split", action="store_true", help="manager rows: also each call's median (accept, "
                    "before_forward, after_kv_store)")
    ap.add_argument("--direct", action="store_true", help="the manager with eager_graphs=False (every launch direct)")
    args = ap.parse_args()
    if args.direct:
        MANAGER_KW["eager_graphs"] = False
    clock = time.perf_counter_ns
    counts = None
    if args.fake and not args.dry:
        sys.path.insert(0, str(harness.ROOT / "tests" / "helpers"))
        import fakecuda

        fakecuda.install()
        counts = fakecuda.COUNTS
        # this thread's CPU time (on a shared machine, time descheduled is not the code's), less the stand-in's
        # emulation of the kernels (the GPU's time, not ours)
        clock = lambda: time.thread_time_ns() - fakecuda.EMULATED_NS  # noqa: E731
    bench = harness.Bench("host-fake" if args.fake and not args.dry else "host", args,
                          "host time per call: perf_counter_ns around each call (--fake: thread CPU time less the "
                          "stand-in's kernel emulation), the stream synced outside the clock, 20 warm-up calls, "
                          "median of 300 calls")
    if bench.dry:
        MANAGER.update({"bs1": (1, 32), "bs32": (2, 16), "bs256": (4, 16)})
        PLAN_BS[:] = [1, 4]
        RECORDS[:] = [(1, 32), (4, 16)]
        CHURN[:] = [4, 6]
        MANAGER_KW["device"] = DEVICE["device"] = "cpu"
    if args.split:
        SPLIT["clock"] = clock
    cp = bench.xp
    sync = (lambda: None) if bench.dry else (lambda: cp.cuda.Device().synchronize())
    rounds = bench.rounds(300)
    for name, make in cases(cp, args.only).items():
        if args.profile and name != args.profile:
            continue
        made = make()
        if made is None:
            continue
        call, after, close = made
        if args.profile:
            harness.host_time(call, check=None, sync=sync, after=after, rounds=50)
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(rounds):
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
        SPLIT["parts"] = []
        before = dict(counts) if counts is not None else {}
        # The calls check themselves: on_violation="raise", and the kernels' results are the GPU benchmarks'.
        row = bench.attempt(name, lambda: harness.host_time(call, check=None, sync=sync, after=after,
                                                            rounds=rounds, clock=clock, warmup=2 if bench.dry else 20))
        if counts is not None:
            row["driver_calls"] = {k: round((v - before.get(k, 0)) / (rounds + 20), 2) for k, v in counts.items()
                                   if v - before.get(k, 0)}
        if SPLIT["parts"]:
            parts = SPLIT["parts"][20:]  # past the warm-up calls
            row["split_us"] = {k: round(statistics.median(p[i] for p in parts) / 1e3, 1)
                               for i, k in enumerate(("accept", "before_forward", "after_kv_store"))}
        if close:
            GRAPHS.clear()
            close()
            if GRAPHS:
                row["graphs"] = dict(GRAPHS)
    return bench.finish()


if __name__ == "__main__":
    sys.exit(main())
