"""CanaryManager cost on a GPU (CuPy arrays): host overhead per step in eager mode, and device time inside a CUDA
graph against the planner and records kernels alone.

- eager: wall time of ``before_forward`` + ``after_kv_store`` (no sync inside: what the engine's host thread
  pays), median over ``--repeats`` steps, bs = 1 and bs = 256 decode;
- graph: the same two calls captured in a CUDA graph, replayed ``--repeats`` times between CUDA events, against a
  graph of the kernels alone (plan, verify, write on the manager's own plans and state: the same launches
  without the expected-token staging and the report copy).

Prints a table and writes ``benchmarks/results/manager-<time>-<gpu>-<commit>.json``.

    python benchmarks/bench_manager.py [--repeats 200]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from canary import CanaryManager, KVGroup  # noqa: E402

WORKLOADS = {"bs1_decode": (1, 4096), "bs256_decode": (256, 2048)}  # (bs, context per request)
PAGE = 16


def build(cp, bs: int, context: int, prompt: int | None = None, **manager_kw):
    """A manager over one full-attention group whose requests each own ``context + 1`` slots (slot 0: padding),
    prefilled, and one decode step's static inputs. Each request's prompt is ``prompt`` tokens (default:
    ``context``). Arrays are built with NumPy and moved by ``cp.asarray`` only, so that a stand-in for CuPy
    (benchmarks/fakecuda.py) can run it. ``manager_kw``: more ``CanaryManager`` arguments."""
    max_reqs, max_seq = bs + 1, context + 1
    a = cp.asarray
    r2t = a(np.arange(max_reqs * max_seq, dtype=np.int32).reshape(max_reqs, max_seq))
    slots = max_reqs * max_seq
    k = cp.zeros((-(-slots // PAGE), PAGE, 8, 128), dtype=np.float16)  # 2 KiB a token; the canary reads 256 B
    m = CanaryManager([KVGroup(name="full", req_to_token=r2t, num_slots=slots, verify_capacity=bs * context,
                               real_kv_sources=[(k, PAGE, 2048, 256)])],
                      max_batch_size=bs, device=0, on_violation="raise", **manager_kw)
    m.warmup()
    ids = [f"r{i}" for i in range(bs)]
    for rid in ids:
        m.add_request(rid, np.zeros(context if prompt is None else prompt, dtype=np.int64))
    rows = np.arange(1, bs + 1, dtype=np.int64)
    rpi = a(rows)
    # Prefill every request's first context - 1 tokens once, so that the timed decode steps verify a clean cache
    # (an unwritten one would fill the ring with violations and time the reporting instead).
    n = context - 1
    m.before_forward(request_ids=ids, req_pool_indices=rpi, prefix_lens=a(np.zeros(bs, np.int64)),
                     extend_seq_lens=a(np.full(bs, n, np.int64)))
    m.after_kv_store(out_cache_loc=a((rows[:, None] * max_seq + np.arange(n)[None, :]).reshape(-1)),
                     input_ids=a(np.zeros(bs * n, np.int64)), positions=a(np.tile(np.arange(n, dtype=np.int64), bs)))
    m.flush()
    before = dict(req_pool_indices=rpi, prefix_lens=a(np.full(bs, context - 1, np.int64)),
                  extend_seq_lens=a(np.ones(bs, np.int64)))
    after = dict(out_cache_loc=a(rows * max_seq + context - 1), input_ids=a(np.zeros(bs, np.int64)),
                 positions=a(np.full(bs, context - 1, np.int64)))
    return m, ids, before, after


def eager_us(cp, m, ids, before, after, repeats: int) -> float:
    stream = cp.cuda.get_current_stream()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        m.before_forward(request_ids=ids, **before)
        m.after_kv_store(**after)
        times.append((time.perf_counter_ns() - t0) / 1e3)
        stream.synchronize()  # outside the clock: each step starts with an idle GPU (and the report of this step
        # has landed: the next before_forward decodes it inside the clock, as an engine's does)
    return statistics.median(times)


def graph_us(cp, body, repeats: int, around=None) -> float:
    """Device time per replay of ``body`` captured on a side stream (CUDA events around ``repeats`` replays)."""
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        body()  # warm, outside the capture
        s.synchronize()
        s.begin_capture()
        body()
        graph = s.end_capture()
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        total = 0.0
        for _ in range(repeats):
            if around:
                around[0]()
            start.record(s)
            graph.launch(s)
            stop.record(s)
            if around:
                around[1]()
            stop.synchronize()
            total += cp.cuda.get_elapsed_time(start, stop) * 1e3
    return total / repeats


def run(repeats: int) -> list[dict]:
    import cupy as cp

    rows = []
    for name, (bs, context) in WORKLOADS.items():
        m, ids, before, after = build(cp, bs, context)
        eager = eager_us(cp, m, ids, before, after, repeats)
        m.flush()

        def manager_body():
            m.before_forward(request_ids=ids, **before)
            m.after_kv_store(**after)

        # Eager warm-up call inside graph_us runs the host halves itself; replays need begin_step / end_step.
        in_graph = graph_us(cp, manager_body, repeats,
                            around=(lambda: m.begin_step(ids), lambda: (m.end_step(), m.flush())))
        g = m.groups[0]

        def kernels_body():
            g.planner.plan(req_to_verify_expected_tokens_valid_lens=m._valid[:bs],
                           expected_token_pool_indices=m._q[:bs], **before)
            g.records.verify(g.verify_plan, launch_tag=g.verify_tag)
            g.records.write(g.write_plan, launch_tag=g.write_tag, **after)
            g.state.ring_write_index[...] = 0  # what the manager's report does between steps

        alone = graph_us(cp, kernels_body, repeats)
        m.close()
        rows.append({"workload": name, "bs": bs, "context": context, "verify_entries": bs * (context - 1),
                     "eager_host_us": eager, "graph_manager_us": in_graph, "graph_kernels_us": alone,
                     "graph_overhead_us": in_graph - alone})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="folder of the JSON record")
    args = ap.parse_args()
    try:
        import cupy as cp

        if cp.cuda.runtime.getDeviceCount() == 0:
            raise RuntimeError("no GPU")
    except Exception as exc:  # noqa: BLE001 - no CuPy, no driver, no GPU
        print(f"kv-canary: bench_manager: expected a CUDA GPU with CuPy, got none ({exc})", file=sys.stderr)
        return 2
    rows = run(args.repeats)
    print(f"{'workload':14} {'entries':>9} {'eager host us':>14} {'graph mgr us':>13} {'graph kernels us':>17}")
    for r in rows:
        print(f"{r['workload']:14} {r['verify_entries']:>9} {r['eager_host_us']:>14.1f} {r['graph_manager_us']:>13.1f} "
              f"{r['graph_kernels_us']:>17.1f}")
    gpu = cp.cuda.runtime.getDeviceProperties(0)["name"].decode().replace(" ", "-")
    try:
        commit = subprocess.run(["git", "rev-parse", "--short=8", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip() or "unknown"
    except OSError:
        commit = "unknown"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    out = Path(args.out) / f"manager-{time.strftime('%Y%m%d-%H%M%S')}-{gpu}-{commit}.json"
    out.write_text(json.dumps({"benchmark": "manager", "gpu": gpu, "commit": commit, "repeats": args.repeats,
                               "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
