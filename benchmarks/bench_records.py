"""Records step (SPEC 4): the verify and write kernels per step on the GPU, CuPy and Numba (docs/performance.md).

    python benchmarks/bench_records.py [--backends cupy numba] [--workloads ...] [--modes NONE ALL] [--dry]

For each workload (a step's verify plan and write entries, built by the planner from a random batch) and each
real-KV mode: a correctness check first (one step on the backend against the NumPy reference from the same
state: canary buffer and counters byte for byte), then device time of one step (verify, then write) and of the
write alone in CUDA-graph replay, and eager wall time per step (host overhead included). With NONE and ALL both
timed, the real-KV hashing rate: the KV bytes an ALL step folds over its extra time against NONE, as a fraction
of the copy bandwidth. Writes benchmarks/results/records.json.
"""
from __future__ import annotations


import numpy as np

import harness

from canary import CanaryPlanner, CanaryRecords, CanaryState, RealKVMode, VerifyPlan, WritePlan, real_kv

KV_BYTES_PER_TOKEN = 256  # e.g. 1 KV head x 128 dims x bf16, of one layer's K (the real-KV source)


def workloads(dry: bool = False) -> list[dict]:
    """(name, bs, prefix range, extend range); ``dry``: the same names, tiny."""
    if dry:
        return [{"name": "bs1_decode_ctx4k", "bs": 1, "prefix": (64, 64), "extend": (1, 1)},
                {"name": "bs32_prefill", "bs": 4, "prefix": (0, 16), "extend": (8, 16)}]
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

    def __init__(self, w: dict, backend: str, mode: RealKVMode, rng, xp=None, device=0):
        if xp is None:
            xp = harness.cupy()
        self.xp = xp
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
        vp = VerifyPlan.allocate(verify_capacity=cap, device=device, max_reqs=r2t.shape[0])
        wp = WritePlan.allocate(write_req_capacity=bs, device=device)
        a = xp.asarray
        planner = CanaryPlanner(verify_plan_out=vp, write_plan_out=wp, req_to_token=a(r2t),
                                backend="reference" if backend == "reference" else "cupy")
        planner.plan(req_pool_indices=a(np.arange(1, bs + 1, dtype=np.int64)), prefix_lens=a(prefix.astype(np.int64)),
                     extend_seq_lens=a(extend.astype(np.int64)))
        rows = np.repeat(np.arange(1, bs + 1), extend)
        cols = np.concatenate([np.arange(p, p + e) for p, e in zip(prefix, extend)])
        self.loc = a(r2t[rows, cols].astype(np.int64))
        self.ids = a(rng.integers(0, 32000, size=self.writes))
        self.pos = a(cols.astype(np.int64))
        self.kv = a(rng.integers(0, 256, size=(num_slots, KV_BYTES_PER_TOKEN), dtype=np.uint8))
        self.state = CanaryState.allocate(num_slots=num_slots, ring_capacity=1 << 16, device=device)
        sources = [(self.kv, 1, KV_BYTES_PER_TOKEN)] if mode != RealKVMode.NONE else []
        self.canary = CanaryRecords(self.state, real_kv(sources, mode) if sources else None, backend=backend)
        self.canary.warmup()
        self.vp, self.wp = vp, wp
        # Fill the prefix records once (a write of every prefix slot), so verify reads real records.
        pcols = np.concatenate([np.arange(0, p) for p in prefix]) if self.entries else np.zeros(0, np.int64)
        prow = np.repeat(np.arange(1, bs + 1), prefix)
        self.prefill = dict(out_cache_loc=a(r2t[prow, pcols].astype(np.int64)),
                            input_ids=a(np.zeros(self.entries, np.int64)), positions=a(pcols.astype(np.int64)))
        pwp = WritePlan.allocate(write_req_capacity=bs, device=device)
        pwp.write_offsets[...] = a(np.concatenate([[0], np.cumsum(prefix)]).astype(np.int64))
        pwp.write_seed_slot_indices[...] = -1
        pwp.write_num_valid_reqs[...] = bs
        self.canary.write(pwp, **self.prefill)

    def __call__(self, stream=None) -> None:
        self.canary.verify(self.vp, stream=stream)
        self.write(stream)

    def write(self, stream=None) -> None:
        self.canary.write(self.wp, out_cache_loc=self.loc, input_ids=self.ids, positions=self.pos, stream=stream)


def check(step: Step, mode: RealKVMode) -> str | None:
    """One step on the backend and on the reference from the same state: same buffer, counters, ring total."""
    from canary.interop.hostcopy import to_host


    host = {k: to_host(getattr(step.state, k)).copy() for k in ("canary_buffer", "ring", "ring_write_index",
                                                                 "slot_run_counter", "kernel_run_counter",
                                                                 "check_flags")}
    ref_state = CanaryState(**host)
    kv_host = to_host(step.kv)
    src = [(kv_host, 1, KV_BYTES_PER_TOKEN)] if mode != RealKVMode.NONE else []
    ref = CanaryRecords(ref_state, real_kv(src, mode) if src else None)
    h = {f: to_host(getattr(step.vp, f)) for f in ("verify_slot_indices", "verify_expected_tokens",
                                                         "verify_expected_positions", "verify_prev_slot_indices",
                                                         "verify_num_valid", "enable", "status")}
    ref.verify(VerifyPlan(**h))
    hw = {f: to_host(getattr(step.wp, f)) for f in ("write_offsets", "write_seed_slot_indices",
                                                          "write_num_valid_reqs")}
    ref.write(WritePlan(**hw), out_cache_loc=to_host(step.loc), input_ids=to_host(step.ids),
              positions=to_host(step.pos))
    step()
    if hasattr(step.xp, "cuda"):
        step.xp.cuda.Device().synchronize()
    for k in ("canary_buffer", "slot_run_counter", "kernel_run_counter", "ring_write_index"):
        if to_host(getattr(step.state, k)).tobytes() != getattr(ref_state, k).tobytes():
            return f"{k} differs from the reference"
    return None


def eager_us(step: Step, calls: int, rounds: int) -> harness.Timing:
    """Wall time per step, host overhead included: ``calls`` steps, one sync, median of ``rounds``."""
    sync = step.xp.cuda.Device().synchronize if hasattr(step.xp, "cuda") else (lambda: None)
    return harness.wall_time(step, calls=calls, sync=sync, rounds=rounds)


def main() -> int:
    p = harness.parser(__doc__)
    p.add_argument("--backends", nargs="+", default=["cupy", "numba"])
    p.add_argument("--workloads", nargs="+", help="only these workload names (default: all)")
    p.add_argument("--modes", nargs="+", default=["NONE", "PARTIAL", "ALL"], choices=["NONE", "PARTIAL", "ALL"])
    args = p.parse_args()
    bench = harness.Bench("records", args, "device time per step (verify + write) and per write: CUDA-graph replay, "
                          "CUDA events around 50 replays, median of 7 rounds; eager: wall time of 200 steps and "
                          "one sync, median of 5 rounds")
    bench.extra["kv_bytes_per_token"] = KV_BYTES_PER_TOKEN
    backends = ["reference"] if bench.dry else args.backends
    modes = ["NONE", "ALL"] if bench.dry else args.modes
    step_us: dict = {}
    for w in workloads(bench.dry):
        if args.workloads and w["name"] not in args.workloads:
            continue
        for mode in (RealKVMode[m] for m in modes):
            for backend in backends:
                step = Step(w, backend, mode, np.random.default_rng(1), bench.xp, bench.device)
                write_floor = bench.floor_us(write_min_bytes(step.writes, mode))
                floor = write_floor + bench.floor_us(verify_min_bytes(step.entries, mode))
                info = dict(backend=backend, mode=mode.name, verify_entries=step.entries, write_entries=step.writes)
                name = f"records {w['name']} {mode.name} {backend}"
                row = bench.attempt(f"{name} step", lambda: harness.device_time(
                    step, check=lambda: check(step, mode), dry=bench.dry, rounds=bench.rounds(7)),
                    key=f"records.{w['name']}.{mode.name}", floor=floor, **info)
                if row["error"]:
                    continue
                step_us[(w["name"], mode.name, backend)] = (row["value"],
                                                               (step.entries + step.writes) * kv_read_bytes(mode))
                bench.attempt(f"{name} write", lambda: harness.device_time(
                    step.write, check=None, dry=bench.dry, rounds=bench.rounds(7)), floor=write_floor, **info)
                bench.attempt(f"{name} eager", lambda: eager_us(step, 2 if bench.dry else 200, bench.rounds(5)),
                              **info)
    for (wl, mode, backend), (all_us, kv_bytes) in step_us.items():
        none = step_us.get((wl, "NONE", backend))
        if mode == "ALL" and none and all_us > none[0] and kv_bytes:
            rate = kv_bytes / ((all_us - none[0]) * 1e-6)  # bytes folded per second of the ALL step's extra time
            bench.figure(f"records {wl} {backend} real-KV hashing", rate / bench.bandwidth(), "fraction",
                         key="records.hash_bandwidth", backend=backend, kv_bytes=kv_bytes)
    return bench.finish()


if __name__ == "__main__":
    raise SystemExit(main())
