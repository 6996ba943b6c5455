"""Time the layer rotation's kernels per step on the GPU (CuPy): verify_layer + write_layers beside the main
verify + write, in CUDA-graph replay (docs/records.md 10, docs/integration.md 5c).

    python benchmarks/bench_layers.py [--layers 32 64] [--backends cupy numba] [--dry]

Workload: a decode step of ``bs`` requests with ``ctx`` cached tokens each (verify entries ``bs * ctx``, one new
token per request), token-major K and V per layer of ``--bytes`` bytes per token each. Per layer count: a
correctness check first (the table after one write_layers against the NumPy fold of every layer), then the device
time of one step of each pair (CUDA events around ``--replays`` replays of a captured graph, median of
``--rounds``). Writes benchmarks/results/layers.json.
"""
from __future__ import annotations

import numpy as np

import harness

from canary import CanaryLayers, CanaryRecords, CanaryState, VerifyPlan, WritePlan, real_kv
from canary.contract.realkv import fold
from canary.interop.hostcopy import to_host


def run(bench: harness.Bench, layers: int, backend: str, bs: int, ctx: int, nbytes: int, replays: int) -> None:
    xp, device = bench.xp, bench.device
    rng = np.random.default_rng(0)
    num_slots = bs * (ctx + 1) + 1
    k = xp.asarray(rng.integers(0, 256, (layers, num_slots, nbytes), dtype=np.uint8))
    v = xp.asarray(rng.integers(0, 256, (layers, num_slots, nbytes), dtype=np.uint8))
    state = CanaryState.allocate(num_slots=num_slots, ring_capacity=1024, device=device)
    records = CanaryRecords(state, real_kv([(k[0], 1, nbytes), (v[0], 1, nbytes)]), backend=backend)
    rot = CanaryLayers(records, [[(k[i], 1, nbytes), (v[i], 1, nbytes)] for i in range(layers)], backend=backend)
    records.warmup()
    rot.warmup()
    slots = 1 + rng.permutation(num_slots - 1)
    cached, new = slots[: bs * ctx], slots[bs * ctx: bs * ctx + bs]
    wp = WritePlan.allocate(write_req_capacity=bs, device=device)
    wp.write_offsets[:] = xp.arange(bs + 1, dtype=xp.int64)
    wp.write_seed_slot_indices[:] = -1
    wp.write_num_valid_reqs[:] = bs
    loc = xp.asarray(new.astype(np.int64))
    ids = xp.arange(bs, dtype=xp.int64)
    pos = xp.zeros(bs, dtype=xp.int64)
    vp = VerifyPlan.allocate(verify_capacity=bs * ctx, device=device)
    vp.verify_slot_indices[:] = xp.asarray(cached.astype(np.int64))
    vp.verify_expected_tokens[:] = -1
    vp.verify_expected_positions[:] = 0
    vp.verify_prev_slot_indices[:] = -1
    vp.verify_num_valid[:] = bs * ctx
    vp.enable[:] = 1
    # The cached slots' records (each its own one-token request at position 0, so the main verify is clean), then
    # every layer's fold of them; the check compares the table with the reference fold.
    n = bs * ctx
    prefill = WritePlan(write_offsets=xp.arange(n + 1, dtype=xp.int64),
                        write_seed_slot_indices=xp.full(n, -1, dtype=xp.int64),
                        write_num_valid_reqs=xp.asarray([n], dtype=xp.int32))
    records.write(prefill, out_cache_loc=vp.verify_slot_indices, input_ids=xp.zeros(n, dtype=xp.int64),
                  positions=xp.zeros(n, dtype=xp.int64))
    rot.write(prefill, out_cache_loc=vp.verify_slot_indices)

    def check() -> str | None:
        sample = cached[:4096]
        hk, hv = to_host(k[:, sample]), to_host(v[:, sample])
        table = to_host(rot.table.layer_hashes[xp.asarray(sample)])
        for i in range(layers):
            want = fold(real_kv([(hk[i], 1, nbytes), (hv[i], 1, nbytes)]), np.arange(sample.shape[0]))
            if not (table[:, i] == want).all():
                return f"layer {i}: the table differs from the reference fold"
        report = state.drain()
        return f"violations: {[str(x) for x in report][:3]}" if report.total else None

    def main_step(s):
        records.verify(vp, stream=s)
        records.write(wp, out_cache_loc=loc, input_ids=ids, positions=pos, stream=s)

    def layer_step(s):
        rot.verify(vp, stream=s)
        rot.write(wp, out_cache_loc=loc, stream=s)

    info = dict(layers=layers, backend=backend, bs=bs, ctx=ctx, bytes_per_token=nbytes)
    for what, body, chk in (("main verify + write", main_step, check), ("verify_layer + write_layers", layer_step,
                                                                        None)):
        bench.attempt(f"layers {layers} {backend} {what}", lambda: harness.device_time(
            body, check=chk, dry=bench.dry, rounds=bench.rounds(7), replays=replays), **info)
    report = state.drain()
    if report.total:
        bench.figure(f"layers {layers} {backend} clean ring", None, error=f"{report.total} violations after timing")


def main() -> int:
    p = harness.parser(__doc__)
    p.add_argument("--layers", type=int, nargs="+", default=[32, 64])
    p.add_argument("--backends", nargs="+", default=["cupy", "numba"])
    p.add_argument("--bs", type=int, default=256)
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--bytes", type=int, default=256, help="bytes per token of each of K and V, per layer")
    p.add_argument("--replays", type=int, default=50)
    a = p.parse_args()
    bench = harness.Bench("layers", a, "device time per step: CUDA-graph replay, CUDA events around --replays "
                          "replays, median of 7 rounds")
    if bench.dry:
        a.layers, a.backends, a.bs, a.ctx, a.bytes = [2], ["reference"], 4, 16, 16
    for b in a.backends:
        for n in a.layers:
            run(bench, n, b, a.bs, a.ctx, a.bytes, a.replays)
    return bench.finish()


if __name__ == "__main__":
    raise SystemExit(main())
