"""Build, check and time every plan implementation on the GPU in one run (method: docs/performance.md).

    python benchmarks/bench_plan.py [--quick] [--out benchmarks/results]

For each workload and implementation: correctness first (poisoned outputs, all 10 buffers byte for byte
against the NumPy reference), then eager wall time per call through the planner (host overhead included:
N calls, one sync at the end) and device time per plan in CUDA-graph replay (a graph of several plans over
independent buffer sets, so one plan's data is not still in L2 when it comes round again; CUDA events around
many replays; median of repeats). Each figure sits beside its floor (minimum bytes over the measured
device-to-device copy bandwidth) and SPEC 5's anchors. Results: JSON under --out (commit, GPU, clocks).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import cupy  # noqa: E402

from canary import CanaryPlanner, LaunchConfig, VerifyPlan, WritePlan  # noqa: E402
from canary.backends.reference.plan import plan_arrays  # noqa: E402
from canary.interop.callviews import CallViews  # noqa: E402

OUTPUTS = (
    "verify_slot_indices", "verify_expected_tokens", "verify_expected_positions", "verify_prev_slot_indices",
    "verify_num_valid", "enable", "status", "write_offsets", "write_seed_slot_indices", "write_num_valid_reqs",
)
# SPEC 5: SGLang's planner on one H200, device time per plan in CUDA-graph replay (us), by workload.
SGLANG_ANCHORS_US = {"bs1": 6.8, "bs256_decode": 23.0, "bs4096": 112.0, "swa_bs256": 41.0}
TARGETS_US = {"bs1": 4.0, "bs256_decode": 9.0, "bs4096": 30.0, "swa_bs256": 20.0}


@dataclass
class Inputs:
    """One plan's inputs as NumPy arrays."""

    name: str
    req_to_token: np.ndarray
    req_pool_indices: np.ndarray
    prefix_lens: np.ndarray
    extend_seq_lens: np.ndarray
    verify_capacity: int
    lut: np.ndarray | None = None
    swa_window_size: int = 0

    @property
    def bs(self) -> int:
        return len(self.req_pool_indices)

    @property
    def entries(self) -> int:
        P = self.prefix_lens[self.req_pool_indices != 0]
        return int((np.minimum(P, self.swa_window_size) if self.swa_window_size else P).sum())

    def min_bytes(self) -> int:
        """Each input read once, each output written once: per entry a 4-byte slot read (its predecessor is the
        previous entry's slot) and 4 int64 stores, plus 8 bytes of LUT per entry; per row 24 bytes read and
        16 written (write offset, seed)."""
        per_entry = 4 + 32 + (8 if self.lut is not None else 0)
        return self.entries * per_entry + self.bs * (24 + 16)


PAGE = 16  # tokens per KV page, as in the replay's scheduler


def paged_table(rng, rows: int, cols: int) -> tuple[np.ndarray, int]:
    """A req_to_token whose rows are pages of PAGE consecutive slots drawn from a shuffled pool, as a paged
    allocator hands them out (page 0 reserved: slot 0 is the padding slot). Returns it and the slot count."""
    pages_per_row = -(-cols // PAGE)
    num_pages = rows * pages_per_row + 1
    pages = rng.permutation(np.arange(1, num_pages, dtype=np.int64)).reshape(rows, pages_per_row)
    j = np.arange(cols)
    table = pages[:, j // PAGE] * PAGE + j % PAGE
    return np.ascontiguousarray(table, dtype=np.int32), num_pages * PAGE  # fancy indexing gave F order


def paged_lut(rng, num_slots: int) -> np.ndarray:
    """full slot -> SWA slot, page for page (a sliding-window pool paged like the full one)."""
    num_pages = num_slots // PAGE
    swa_pages = np.concatenate([[0], rng.permutation(np.arange(1, num_pages, dtype=np.int64))])
    s = np.arange(num_slots, dtype=np.int64)
    return swa_pages[s // PAGE] * PAGE + s % PAGE


def workloads(rng: np.random.Generator, quick: bool) -> list[Inputs]:
    def batch(name, bs, p_lo, p_hi, e_lo, e_hi, C, W=0):
        P = rng.integers(p_lo, p_hi + 1, size=bs).astype(np.int64)
        E = rng.integers(e_lo, e_hi + 1, size=bs).astype(np.int64)
        rpi = rng.permutation(np.arange(1, bs + 1)).astype(np.int64)
        r2t, num_slots = paged_table(rng, bs + 1, p_hi + e_hi)
        lut = paged_lut(rng, num_slots) if W else None
        return Inputs(name, r2t, rpi, P, E, C, lut, W)

    out = [
        batch("bs1", 1, 64, 256, 1, 1, C=4096),
        batch("bs8_decode", 8, 512, 4096, 1, 1, C=8 * 4096),
        batch("bs256_decode", 256, 512, 4096, 1, 1, C=1 << 20),
        batch("bs32_prefill", 32, 0, 8192, 1, 2048, C=32 * 8192),
        batch("swa_bs256", 256, 4096, 32768, 1, 1, C=256 * 4096, W=4096),
        batch("bs4096", 4096, 256, 1024, 1, 1, C=4096 * 1024),
    ]
    if quick:
        out = [w for w in out if w.name in ("bs1", "bs256_decode")]
    return out


def trace_steps(count: int) -> list[Inputs]:
    """Real step shapes: the bundled conversation trace through the scheduler, ``count`` steps spread evenly."""
    from canary.replay.scheduler import Scheduler, default_buckets, load_trace

    sched = Scheduler(load_trace("conv", 300), max_batch_size=64, pad_buckets=default_buckets(64), seed=0)
    steps = []
    for st in sched.steps():
        steps.append(Inputs(f"trace{st.index}", st.req_to_token.copy(), st.req_pool_indices.copy(),
                            st.prefix_lens.copy(), st.extend_seq_lens.copy(), 1 << 17))
    pick = np.linspace(0, len(steps) - 1, count).astype(int)
    return [steps[i] for i in pick]


def reference(inp: Inputs) -> dict[str, np.ndarray]:
    out = poisoned(inp)
    plan_arrays(req_to_token=inp.req_to_token, lut=inp.lut, pool=None, swa_window_size=inp.swa_window_size,
                token_offset=0, req_pool_indices=inp.req_pool_indices, prefix_lens=inp.prefix_lens,
                extend_seq_lens=inp.extend_seq_lens, valid_lens=None, out=out)
    return out


_INT32 = ("verify_num_valid", "enable", "status", "write_num_valid_reqs")


def poisoned(inp: Inputs) -> dict[str, np.ndarray]:
    """Output buffers filled with a pattern no plan writes, so that unwritten elements show."""
    C, R = inp.verify_capacity, inp.bs
    sizes = dict(write_offsets=R + 1, write_seed_slot_indices=R)
    out = {k: np.full(sizes.get(k, C), 0x5A5A5A5A5A5A5A5A, dtype=np.int64) for k in OUTPUTS if k not in _INT32}
    out.update({k: np.full(1, 0x5A5A5A5A, dtype=np.int32) for k in _INT32})
    return out


class Bound:
    """One implementation bound to its own device copy of one workload."""

    def __init__(self, impl: str, inp: Inputs):
        self.impl, self.inp = impl, inp
        self.dev = {k: cupy.asarray(v) for k, v in (("req_to_token", inp.req_to_token),
                    ("req_pool_indices", inp.req_pool_indices), ("prefix_lens", inp.prefix_lens),
                    ("extend_seq_lens", inp.extend_seq_lens))}
        self.lut = None if inp.lut is None else cupy.asarray(inp.lut)
        self.out = {k: cupy.asarray(v) for k, v in poisoned(inp).items()}
        self.step = {k: self.dev[k] for k in ("req_pool_indices", "prefix_lens", "extend_seq_lens")}
        if impl == "torch":
            import torch

            from torch_planner import torch_plan

            t = {k: torch.from_dlpack(v) for k, v in self.dev.items()}
            to = {k: torch.from_dlpack(v) for k, v in self.out.items()}
            tl = None if self.lut is None else torch.from_dlpack(self.lut)

            def call(stream=None):
                torch_plan(req_pool_indices=t["req_pool_indices"], prefix_lens=t["prefix_lens"],
                           extend_seq_lens=t["extend_seq_lens"], req_to_token=t["req_to_token"],
                           swa_window_size=inp.swa_window_size, full_to_swa_index_mapping=tl, out=to)

            self.call, self.capturable = call, False
            return
        backend = "cupy" if impl.startswith("cupy") else "numba"
        two_pass = impl == "cupy_two_pass"  # the scan + per-entry binary search shape of SGLang's planner
        # Every workload's capacity holds all its entries: the cursors are bound (on_overflow="sample", the
        # default) but never read, so the timings are those of the plain plan.
        self.cursors = cupy.zeros(inp.req_to_token.shape[0], dtype=cupy.int64)
        self.planner = CanaryPlanner(
            backend=backend, launch_config=LaunchConfig(fused_max_bs=-1 if two_pass else None),
            verify_plan_out=VerifyPlan(**{k: self.out[k] for k in OUTPUTS[:7]}, verify_cursors=self.cursors),
            write_plan_out=WritePlan(**{k: self.out[k] for k in OUTPUTS[7:]}),
            req_to_token=self.dev["req_to_token"], swa_window_size=inp.swa_window_size,
            full_to_swa_index_mapping=self.lut,
        )
        self.planner.warmup()
        self.call = lambda stream=None: self.planner.plan(**self.step, stream=stream)
        self.capturable = True

    def outputs(self) -> dict[str, np.ndarray]:
        return {k: cupy.asnumpy(v) for k, v in self.out.items()}


def check(b: Bound, want: dict[str, np.ndarray]) -> str | None:
    b.call()
    cupy.cuda.Device().synchronize()
    got = b.outputs()
    for k in OUTPUTS:
        if got[k].shape != want[k].shape or not np.array_equal(got[k], want[k]):
            bad = np.flatnonzero(got[k] != want[k]) if got[k].shape == want[k].shape else [-1]
            return f"{k} differs (first index {int(bad[0])}: got {got[k].flat[bad[0]]}, want {want[k].flat[bad[0]]})"
    return None


def eager_us(bs_list: list[Bound], calls: int) -> float:
    for b in bs_list:
        b.call()
    cupy.cuda.Device().synchronize()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            for b in bs_list:
                b.call()
        cupy.cuda.Device().synchronize()
        times.append((time.perf_counter() - t0) / (calls * len(bs_list)) * 1e6)
    return float(np.median(times))


def graph_us(bs_list: list[Bound], replays: int) -> float:
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        for b in bs_list:
            b.call(stream=stream)
        stream.synchronize()
        stream.begin_capture()
        for b in bs_list:
            b.call(stream=stream)
        graph = stream.end_capture()
        graph.upload(stream)
        for _ in range(3):
            graph.launch(stream)
        stream.synchronize()
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        times = []
        for _ in range(7):
            start.record(stream)
            for _ in range(replays):
                graph.launch(stream)
            stop.record(stream)
            stop.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, stop) * 1e3 / (replays * len(bs_list)))
    return float(np.median(times))


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second."""
    n = 1 << 30
    a, b = cupy.empty(n, cupy.uint8), cupy.empty(n, cupy.uint8)
    a.fill(1)
    for _ in range(3):
        b[...] = a
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(20):
        b[...] = a
    stop.record()
    stop.synchronize()
    return 2 * n * 20 / (cupy.cuda.get_elapsed_time(start, stop) / 1e3)


def host_breakdown(inp: Inputs) -> dict[str, float]:
    """Where an eager CuPy call spends its host time (bs = 1): the whole call, then its parts."""
    b = Bound("cupy", inp)
    p = b.planner
    n = 2000
    for _ in range(50):
        b.call()
    res = {}
    t0 = time.perf_counter()
    for _ in range(n):
        b.call()
    res["plan_call_us"] = (time.perf_counter() - t0) / n * 1e6
    handle = cupy.cuda.get_current_stream().ptr
    st = p.static

    def views(h):  # what plan() does before its checks: the launch stream and the step-view cache
        return CallViews(st.device_id, h, st.verify_slot_indices.owner, st.output_spans, p._step_views)

    t0 = time.perf_counter()
    for _ in range(n):
        p._step(b.step["req_pool_indices"], b.step["prefix_lens"], b.step["extend_seq_lens"], None, views(handle))
    res["views_and_checks_us"] = (time.perf_counter() - t0) / n * 1e6
    step = p._step(b.step["req_pool_indices"], b.step["prefix_lens"], b.step["extend_seq_lens"], None, views(handle))
    t0 = time.perf_counter()
    for _ in range(n):
        p._bound.launch(step, handle)
    res["launch_us"] = (time.perf_counter() - t0) / n * 1e6
    cupy.cuda.Device().synchronize()
    return res


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except Exception:
        return os.environ.get("KV_CANARY_COMMIT", "unknown")


def gpu_info() -> dict:
    q = "name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,power.draw"
    try:
        line = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True,
                              text=True).stdout.strip().splitlines()[0]
        return dict(zip(q.split(","), [x.strip() for x in line.split(",")]))
    except Exception as exc:  # pragma: no cover
        return {"error": str(exc)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="two workloads, fewer repeats")
    ap.add_argument("--impls", default="cupy,cupy_two_pass,numba,torch")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--sets", type=int, default=4, help="independent buffer sets per graph (L2 rotation)")
    args = ap.parse_args()
    rng = np.random.default_rng(2026)
    impls = args.impls.split(",")
    bw = copy_bandwidth()
    print(f"copy bandwidth (read + write): {bw / 1e12:.2f} TB/s", flush=True)
    rows = []
    groups = [[w] for w in workloads(rng, args.quick)]
    groups.append(trace_steps(8 if args.quick else 32))
    for group in groups:
        name = group[0].name if len(group) == 1 else "trace_mix"
        entries = sum(w.entries for w in group) / len(group)
        floor_us = sum(w.min_bytes() for w in group) / len(group) / bw * 1e6
        wants = [reference(w) for w in group]
        for impl in impls:
            row = dict(workload=name, impl=impl, bs=group[0].bs, entries=entries, floor_us=floor_us,
                       min_bytes=sum(w.min_bytes() for w in group) / len(group),
                       anchor_sglang_us=SGLANG_ANCHORS_US.get(name), target_us=TARGETS_US.get(name))
            sets = None
            try:
                sets = [[Bound(impl, w) for w in group] for _ in range(max(1, args.sets if len(group) == 1 else 1))]
                for s in sets[:1]:
                    for b, want in zip(s, wants):
                        err = check(b, want)
                        if err:
                            raise AssertionError(f"{b.inp.name}: {err}")
                row["correct"] = True
                flat = [b for s in sets for b in s]
                calls = 20 if args.quick else (200 if entries < 1e6 else 50)
                row["eager_us"] = eager_us(flat[: len(group)], calls)
                if flat[0].capturable:
                    row["graph_us"] = graph_us(flat, 10 if args.quick else 50)
                    row["graph_vs_floor"] = row["graph_us"] / floor_us
            except Exception as exc:  # record and go on: one broken implementation must not hide the rest
                row["error"] = f"{type(exc).__name__}: {exc}"[:500]
            rows.append(row)
            print(json.dumps(row), flush=True)
            sets = None
            cupy.get_default_memory_pool().free_all_blocks()
    breakdown = host_breakdown(workloads(np.random.default_rng(1), True)[0])
    result = dict(commit=git_commit(), gpu=gpu_info(), date=time.strftime("%Y-%m-%d %H:%M:%S"),
                  python=platform.python_version(), cupy=cupy.__version__, numpy=np.__version__,
                  copy_bandwidth_Bps=bw, host_breakdown_bs1=breakdown, rows=rows)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    gpu = result["gpu"].get("name", "gpu").replace(" ", "-")
    path = out_dir / f"plan-{time.strftime('%Y%m%d-%H%M%S')}-{gpu}-{result['commit'][:8]}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {path}")
    print(f"host breakdown (bs=1, cupy): {breakdown}")
    print(f"{'workload':14} {'impl':14} {'entries':>9} {'floor':>7} {'graph':>8} {'eager':>8} {'SGLang':>7} {'target':>7}")
    for r in rows:
        g = r.get("graph_us")
        print(f"{r['workload']:14} {r['impl']:14} {r['entries']:9.0f} {r['floor_us']:7.1f} "
              f"{(f'{g:8.1f}' if g else '       -')} {r.get('eager_us', float('nan')):8.1f} "
              f"{(r['anchor_sglang_us'] or float('nan')):7.1f} {(r['target_us'] or float('nan')):7.1f}"
              f"{'  ERROR ' + r['error'] if 'error' in r else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
