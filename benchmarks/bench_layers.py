"""Time the layer rotation's kernels per step on the GPU (CuPy): verify_layer + write_layers beside the main
verify + write, in CUDA-graph replay (docs/records.md 10, docs/integration.md 5c).

    python benchmarks/bench_layers.py [--out benchmarks/results] [--layers 32 64] [--backends cupy numba]

Workload: a decode step of ``bs`` requests with ``ctx`` cached tokens each (verify entries ``bs * ctx``, one new
token per request), token-major K and V per layer of ``--bytes`` bytes per token each. Per layer count: a
correctness check first (the table after one write_layers against the NumPy fold of every layer), then the device
time of one step of each pair (CUDA events around ``--replays`` replays of a captured graph, median of
``--repeats``). Results: JSON beside the other benchmarks' and a table on stdout.
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
from bench_plan import git_commit, gpu_info  # noqa: E402

from canary import CanaryLayers, CanaryRecords, CanaryState, VerifyPlan, WritePlan, real_kv  # noqa: E402
from canary.contract.realkv import fold  # noqa: E402


def graph_time_us(launch, stream, replays: int, repeats: int) -> float:
    """Median device time of one ``launch()`` (the calls it makes captured once), in microseconds."""
    with stream:
        stream.begin_capture()
        launch(stream)
        graph = stream.end_capture()
    graph.launch(stream)
    stream.synchronize()
    times = []
    for _ in range(repeats):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        for _ in range(replays):
            graph.launch(stream)
        end.record(stream)
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) * 1e3 / replays)
    return float(np.median(times))


def run(layers: int, backend: str, bs: int, ctx: int, nbytes: int, replays: int, repeats: int) -> dict:
    rng = np.random.default_rng(0)
    num_slots = bs * (ctx + 1) + 1
    k = cupy.random.randint(0, 256, (layers, num_slots, nbytes), dtype=cupy.uint8)
    v = cupy.random.randint(0, 256, (layers, num_slots, nbytes), dtype=cupy.uint8)
    state = CanaryState.allocate(num_slots=num_slots, ring_capacity=1024, device=0)
    records = CanaryRecords(state, real_kv([(k[0], 1, nbytes), (v[0], 1, nbytes)]), backend=backend)
    rot = CanaryLayers(records, [[(k[i], 1, nbytes), (v[i], 1, nbytes)] for i in range(layers)], backend=backend)
    records.warmup()
    rot.warmup()
    slots = 1 + rng.permutation(num_slots - 1)
    cached, new = slots[: bs * ctx], slots[bs * ctx: bs * ctx + bs]
    wp = WritePlan.allocate(write_req_capacity=bs, device=0)
    wp.write_offsets[:] = cupy.arange(bs + 1, dtype=cupy.int64)
    wp.write_seed_slot_indices[:] = -1
    wp.write_num_valid_reqs[:] = bs
    loc = cupy.asarray(new.astype(np.int64))
    ids = cupy.arange(bs, dtype=cupy.int64)
    pos = cupy.zeros(bs, dtype=cupy.int64)
    vp = VerifyPlan.allocate(verify_capacity=bs * ctx, device=0)
    vp.verify_slot_indices[:] = cupy.asarray(cached.astype(np.int64))
    vp.verify_expected_tokens[:] = -1
    vp.verify_expected_positions[:] = 0
    vp.verify_prev_slot_indices[:] = -1
    vp.verify_num_valid[:] = bs * ctx
    vp.enable[:] = 1
    # The cached slots' records (each its own one-token request at position 0, so the main verify is clean), then
    # every layer's fold of them; the correctness check compares the table with the reference fold.
    n = bs * ctx
    prefill = WritePlan(write_offsets=cupy.arange(n + 1, dtype=cupy.int64),
                        write_seed_slot_indices=cupy.full(n, -1, dtype=cupy.int64),
                        write_num_valid_reqs=cupy.asarray([n], dtype=cupy.int32))
    records.write(prefill, out_cache_loc=vp.verify_slot_indices, input_ids=cupy.zeros(n, dtype=cupy.int64),
                  positions=cupy.zeros(n, dtype=cupy.int64))
    rot.write(prefill, out_cache_loc=vp.verify_slot_indices)
    cupy.cuda.Device().synchronize()
    sample = cached[:4096]
    hk, hv = cupy.asnumpy(k[:, sample]), cupy.asnumpy(v[:, sample])
    table = cupy.asnumpy(rot.table.layer_hashes[cupy.asarray(sample)])
    for i in range(layers):
        want = fold(real_kv([(hk[i], 1, nbytes), (hv[i], 1, nbytes)]), np.arange(sample.shape[0]))
        assert (table[:, i] == want).all(), f"layer {i}: the table differs from the reference fold"
    state.drain()
    stream = cupy.cuda.Stream(non_blocking=True)

    def main_step(s):
        records.verify(vp, stream=s)
        records.write(wp, out_cache_loc=loc, input_ids=ids, positions=pos, stream=s)

    def layer_step(s):
        rot.verify(vp, stream=s)
        rot.write(wp, out_cache_loc=loc, stream=s)

    out = {"layers": layers, "backend": backend, "bs": bs, "ctx": ctx, "bytes_per_token": nbytes,
           "main_us": graph_time_us(main_step, stream, replays, repeats),
           "rotation_us": graph_time_us(layer_step, stream, replays, repeats)}
    report = state.drain()
    assert report.total == 0, [str(x) for x in report][:5]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--layers", type=int, nargs="+", default=[32, 64])
    p.add_argument("--backends", nargs="+", default=["cupy", "numba"])
    p.add_argument("--bs", type=int, default=256)
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--bytes", type=int, default=256, help="bytes per token of each of K and V, per layer")
    p.add_argument("--replays", type=int, default=50)
    p.add_argument("--repeats", type=int, default=7)
    a = p.parse_args()
    rows = [run(n, b, a.bs, a.ctx, a.bytes, a.replays, a.repeats) for b in a.backends for n in a.layers]
    print(f"{'backend':8} {'layers':>6} {'main verify+write (us)':>24} {'verify_layer+write_layers (us)':>32}")
    for r in rows:
        print(f"{r['backend']:8} {r['layers']:>6} {r['main_us']:>24.1f} {r['rotation_us']:>32.1f}")
    result = {"commit": git_commit(), "gpu": gpu_info(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "rows": rows}
    os.makedirs(a.out, exist_ok=True)
    path = Path(a.out) / f"layers-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
