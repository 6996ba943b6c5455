"""CanaryManager in a CUDA graph (SPEC 6): device time of the manager's step against its kernels alone.

The manager's ``before_forward`` + ``after_kv_store`` of a decode step, captured in a CUDA graph and replayed
(``begin_step`` / ``end_step`` around each replay, as an engine's graph runner does), against a graph of the
kernels alone (plan, verify, write on the manager's own plans and state: the same launches without the
expected-token staging and the report copy); bs = 1 and bs = 256 decode. The manager's eager host time is
bench_host.py's. Writes benchmarks/results/manager.json.

    python benchmarks/bench_manager.py [--rounds 200] [--dry]
"""
from __future__ import annotations

import numpy as np

import harness

from canary import CanaryManager, KVGroup

WORKLOADS = {"bs1_decode": (1, 4096), "bs256_decode": (256, 2048)}  # (bs, context per request)
PAGE = 16


def build(cp, bs: int, context: int, prompt: int | None = None, device=0, **manager_kw):
    """A manager over one full-attention group whose requests each own ``context + 1`` slots (slot 0: padding),
    prefilled, and one decode step's static inputs. Each request's prompt is ``prompt`` tokens (default:
    ``context``). Arrays are built with NumPy and moved by ``cp.asarray`` only, so that a stand-in for CuPy
    (tests/helpers/fakecuda.py) can run it, or NumPy itself (``device="cpu"``). ``manager_kw``: more
    ``CanaryManager`` arguments."""
    max_reqs, max_seq = bs + 1, context + 1
    a = cp.asarray
    r2t = a(np.arange(max_reqs * max_seq, dtype=np.int32).reshape(max_reqs, max_seq))
    slots = max_reqs * max_seq
    k = cp.zeros((-(-slots // PAGE), PAGE, 8, 128), dtype=np.float16)  # 2 KiB a token; the canary reads 256 B
    m = CanaryManager([KVGroup(name="full", req_to_token=r2t, num_slots=slots, verify_capacity=bs * context,
                               real_kv_sources=[(k, PAGE, 2048, 256)])],
                      max_batch_size=bs, device=device, on_violation="raise", **manager_kw)
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


def run(bench: harness.Bench) -> None:
    xp, dry = bench.xp, bench.dry
    for name, (bs, context) in (DRY if dry else WORKLOADS).items():
        m, ids, before, after = build(xp, bs, context, device=bench.device)

        def manager_body(stream=None):
            m.before_forward(request_ids=ids, **before)
            m.after_kv_store(**after)

        def clean() -> str | None:  # on_violation="raise": a violation raises here
            manager_body()
            m.flush()
            return None

        g = m.groups[0]

        def kernels_body(stream=None):
            g.planner.plan(req_to_verify_expected_tokens_valid_lens=m._valid[:bs],
                           expected_token_pool_indices=m._q[:bs], **before)
            g.records.verify(g.verify_plan, launch_tag=g.verify_tag)
            g.records.write(g.write_plan, launch_tag=g.write_tag, **after)
            g.state.ring_write_index[...] = 0  # what the manager's report does between steps

        info = dict(bs=bs, context=context, verify_entries=bs * (context - 1))
        rounds = bench.rounds(200)
        # One replay a round: the host halves (begin_step / end_step) run between replays.
        mgr = bench.attempt(f"manager {name} graph", lambda: harness.device_time(
            manager_body, check=clean, dry=dry, rounds=rounds, replays=1,
            around=(lambda: m.begin_step(ids), lambda: (m.end_step(), m.flush()))), **info)
        m.flush()
        alone = bench.attempt(f"manager {name} kernels alone", lambda: harness.device_time(
            kernels_body, check=None, dry=dry, rounds=rounds, replays=1), **info)
        if mgr["value"] is not None and alone["value"] is not None:
            bench.figure(f"manager {name} graph overhead", mgr["value"] - alone["value"], **info)
        m.close()


DRY = {"bs1_decode": (1, 32), "bs256_decode": (4, 16)}


def main() -> int:
    args = harness.parser(__doc__).parse_args()
    bench = harness.Bench("manager", args, "device time per step: CUDA-graph replay, CUDA events around each "
                          "replay (the manager's host halves between replays), median of 200 rounds")
    run(bench)
    return bench.finish()


if __name__ == "__main__":
    raise SystemExit(main())
