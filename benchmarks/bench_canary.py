"""Time the canary write and verify kernels per step on the GPU, CuPy and Numba (method: docs/performance.md).

    python benchmarks/bench_canary.py [--out benchmarks/results] [--backends cupy numba]

For each workload (a step's verify plan and write entries, built by the planner from a random batch) and each
real-KV mode: first a correctness check (the twin against the NumPy reference: canary buffer and counters byte
for byte), then device time of one step (verify, then write) in CUDA-graph replay (CUDA events around many
replays; median of repeats) and eager wall time per step (host overhead included). Results: JSON with commit,
GPU and clocks, and a table on stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import cupy  # noqa: E402
from bench_plan import copy_bandwidth, git_commit, gpu_info  # noqa: E402

from canary import CanaryPlanner, CanaryState, CanaryRecords, RealKVMode, VerifyPlan, WritePlan, real_kv  # noqa: E402

KV_BYTES_PER_TOKEN = 256  # e.g. 1 KV head x 128 dims x bf16, of one layer's K (the real-KV source)


def workloads(rng) -> list[dict]:
    """(name, bs, prefix range, extend range)."""
    return [
        {"name": "bs1_decode_ctx4k", "bs": 1, "prefix": (4096, 4096), "extend": (1, 1)},
        {"name": "bs256_decode_ctx1k", "bs": 256, "prefix": (512, 1536), "extend": (1, 1)},
        {"name": "bs32_prefill", "bs": 32, "prefix": (0, 512), "extend": (128, 512)},
        {"name": "bs8_prefill_2k", "bs": 8, "prefix": (0, 0), "extend": (2048, 2048)},
        {"name": "bs1_prefill_32k", "bs": 1, "prefix": (0, 0), "extend": (32768, 32768)},  # issue 14's targets
    ]


RECORD_BYTES = 32


def kv_read_bytes(mode: RealKVMode) -> int:
    """Real-KV bytes one fold reads per slot (one source of KV_BYTES_PER_TOKEN)."""
    return {RealKVMode.NONE: 0, RealKVMode.PARTIAL: 16, RealKVMode.ALL: KV_BYTES_PER_TOKEN}[mode]


def write_min_bytes(entries: int, mode: RealKVMode) -> int:
    """A write must read out_cache_loc, input_ids, positions (24 B an entry) and the real-KV bytes it folds, and
    store one record (32 B)."""
    return entries * (24 + RECORD_BYTES + kv_read_bytes(mode))


def verify_min_bytes(entries: int, mode: RealKVMode) -> int:
    """A verify must read its plan entry (4 int64: 32 B), the slot's record and its predecessor's (64 B), and
    the real-KV bytes it folds."""
    return entries * (32 + 2 * RECORD_BYTES + kv_read_bytes(mode))


class Step:
    """One workload on one backend and mode: plan once, then verify + write are what is timed."""

    def __init__(self, w: dict, backend: str, mode: RealKVMode, rng):
        bs = w["bs"]
        prefix = rng.integers(w["prefix"][0], w["prefix"][1] + 1, size=bs)
        extend = rng.integers(w["extend"][0], w["extend"][1] + 1, size=bs)
        max_seq = int((prefix + extend).max()) + 1
        num_slots = bs * max_seq + 1
        r2t = (1 + rng.permutation(num_slots - 1)[: bs * max_seq]).reshape(bs, max_seq).astype(np.int32)
        r2t = np.concatenate([np.zeros((1, max_seq), np.int32), r2t])  # row 0: padding
        self.entries = int(prefix.sum())
        self.writes = int(extend.sum())
        cap = max(self.entries, 1)
        vp = VerifyPlan.allocate(verify_capacity=cap, device=0, max_reqs=r2t.shape[0])
        wp = WritePlan.allocate(write_req_capacity=bs, device=0)
        a = cupy.asarray
        planner = CanaryPlanner(verify_plan_out=vp, write_plan_out=wp, req_to_token=a(r2t), backend="cupy")
        planner.plan(req_pool_indices=a(np.arange(1, bs + 1, dtype=np.int64)), prefix_lens=a(prefix.astype(np.int64)),
                     extend_seq_lens=a(extend.astype(np.int64)))
        rows = np.repeat(np.arange(1, bs + 1), extend)
        cols = np.concatenate([np.arange(p, p + e) for p, e in zip(prefix, extend)])
        self.loc = a(r2t[rows, cols].astype(np.int64))
        self.ids = a(rng.integers(0, 32000, size=self.writes))
        self.pos = a(cols.astype(np.int64))
        self.kv = cupy.asarray(rng.integers(0, 256, size=(num_slots, KV_BYTES_PER_TOKEN), dtype=np.uint8))
        self.state = CanaryState.allocate(num_slots=num_slots, ring_capacity=1 << 16, device=0)
        sources = [(self.kv, 1, KV_BYTES_PER_TOKEN)] if mode != RealKVMode.NONE else []
        self.canary = CanaryRecords(self.state, real_kv(sources, mode) if sources else None, backend=backend)
        self.canary.warmup()
        self.vp, self.wp = vp, wp
        # Fill the prefix records once (a write of every prefix slot), so verify reads real records.
        pcols = np.concatenate([np.arange(0, p) for p in prefix]) if self.entries else np.zeros(0, np.int64)
        prow = np.repeat(np.arange(1, bs + 1), prefix)
        self.prefill = dict(out_cache_loc=a(r2t[prow, pcols].astype(np.int64)),
                            input_ids=a(np.zeros(self.entries, np.int64)), positions=a(pcols.astype(np.int64)))
        pwp = WritePlan.allocate(write_req_capacity=bs, device=0)
        pwp.write_offsets[...] = a(np.concatenate([[0], np.cumsum(prefix)]).astype(np.int64))
        pwp.write_seed_slot_indices[...] = -1
        pwp.write_num_valid_reqs[...] = bs
        self.canary.write(pwp, **self.prefill)

    def __call__(self, stream=None) -> None:
        self.canary.verify(self.vp, stream=stream)
        self.write(stream)

    def write(self, stream=None) -> None:
        self.canary.write(self.wp, out_cache_loc=self.loc, input_ids=self.ids, positions=self.pos, stream=stream)


def check(step: Step, backend: str, mode: RealKVMode) -> str | None:
    """One step on the twin and on the reference from the same state: same buffer, counters, ring total."""
    from canary.interop.hostcopy import to_host

    host = {k: to_host(getattr(step.state, k)).copy() for k in ("canary_buffer", "ring", "ring_write_index",
                                                                 "slot_run_counter", "kernel_run_counter",
                                                                 "check_flags")}
    ref_state = CanaryState(**host)
    kv_host = cupy.asnumpy(step.kv)
    src = [(kv_host, 1, KV_BYTES_PER_TOKEN)] if mode != RealKVMode.NONE else []
    ref = CanaryRecords(ref_state, real_kv(src, mode) if src else None)
    h = {f: cupy.asnumpy(getattr(step.vp, f)) for f in ("verify_slot_indices", "verify_expected_tokens",
                                                         "verify_expected_positions", "verify_prev_slot_indices",
                                                         "verify_num_valid", "enable", "status")}
    ref.verify(VerifyPlan(**h))
    hw = {f: cupy.asnumpy(getattr(step.wp, f)) for f in ("write_offsets", "write_seed_slot_indices",
                                                          "write_num_valid_reqs")}
    ref.write(WritePlan(**hw), out_cache_loc=cupy.asnumpy(step.loc), input_ids=cupy.asnumpy(step.ids),
              positions=cupy.asnumpy(step.pos))
    step()
    cupy.cuda.Device().synchronize()
    for k in ("canary_buffer", "slot_run_counter", "kernel_run_counter", "ring_write_index"):
        if to_host(getattr(step.state, k)).tobytes() != getattr(ref_state, k).tobytes():
            return f"{k} differs from the reference"
    return None


def graph_us(step, replays: int = 200, repeats: int = 5) -> float:
    """Device time of one ``step(stream)`` call in CUDA-graph replay (a step: verify + write, or a write)."""
    stream = cupy.cuda.Stream(non_blocking=True)
    step(stream)
    stream.synchronize()
    with stream:
        stream.begin_capture()
        for _ in range(10):
            step(stream)
        graph = stream.end_capture()
    graph.launch(stream)
    stream.synchronize()
    out = []
    for _ in range(repeats):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        for _ in range(replays // 10):
            graph.launch(stream)
        end.record(stream)
        end.synchronize()
        out.append(cupy.cuda.get_elapsed_time(start, end) * 1e3 / replays)
    return float(np.median(out))


def eager_us(step: Step, calls: int = 200) -> float:
    step()
    cupy.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        step()
    cupy.cuda.Device().synchronize()
    return (time.perf_counter() - t0) * 1e6 / calls


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--backends", nargs="+", default=["cupy", "numba"])
    p.add_argument("--workloads", nargs="+", help="only these workload names (default: all)")
    p.add_argument("--modes", nargs="+", default=["NONE", "PARTIAL", "ALL"], choices=["NONE", "PARTIAL", "ALL"])
    args = p.parse_args()
    rng = np.random.default_rng(0)
    bw = copy_bandwidth()
    print(f"copy bandwidth (read + write): {bw / 1e12:.2f} TB/s", flush=True)
    rows = []
    for w in workloads(rng):
        if args.workloads and w["name"] not in args.workloads:
            continue
        for mode in (RealKVMode[m] for m in args.modes):
            for backend in args.backends:
                step = Step(w, backend, mode, np.random.default_rng(1))
                problem = check(step, backend, mode)
                write_floor = write_min_bytes(step.writes, mode) / bw * 1e6
                row = {"workload": w["name"], "mode": mode.name, "backend": backend, "verify_entries": step.entries,
                       "write_entries": step.writes, "check": problem or "ok",
                       "floor_us": write_floor + verify_min_bytes(step.entries, mode) / bw * 1e6,
                       "write_floor_us": write_floor}
                if problem is None:
                    row["graph_us"] = graph_us(step)
                    row["write_graph_us"] = graph_us(step.write)
                    row["eager_us"] = eager_us(step)
                rows.append(row)
                print(json.dumps(row), flush=True)
    result = {"commit": os.environ.get("KV_CANARY_COMMIT") or git_commit(), "gpu": gpu_info(),
              "kv_bytes_per_token": KV_BYTES_PER_TOKEN, "copy_bandwidth_Bps": bw, "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"canary-{result['gpu'].get('name', 'gpu').replace(' ', '_')}-{time.strftime('%Y%m%dT%H%M%S')}.json"
    (out / name).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{'workload':22} {'mode':8} {'backend':7} {'verify':>8} {'write':>6} {'floor':>7} {'graph us':>9} "
          f"{'w floor':>7} {'write us':>9} {'eager us':>9}")
    nan = float("nan")
    for r in rows:
        print(f"{r['workload']:22} {r['mode']:8} {r['backend']:7} {r['verify_entries']:8d} {r['write_entries']:6d} "
              f"{r['floor_us']:7.1f} {r.get('graph_us', nan):9.1f} {r['write_floor_us']:7.1f} "
              f"{r.get('write_graph_us', nan):9.1f} {r.get('eager_us', nan):9.1f}  {r['check']}")
    return 0 if all(r["check"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
