"""Sampled verification (SPEC 3.7) against a full plan of the same number of entries, on one GPU.

The claim to measure: a step over its verify budget costs no more than a step that fits it, so a budget is a
cost bound. For each pair, the sampled workload has many more entries than its capacity ``C`` (the planner
verifies ``C`` of them, rotating), and its full twin has exactly ``C`` entries over the same batch size. Each
configuration is checked against the NumPy reference first (poisoned outputs, cursors included, one eager
call from zeroed cursors), then timed as device time per plan in CUDA-graph replay (the cursors advance inside
the graph at every replay, as in serving).

A second full twin verifies, in the sampled workload's own rows, as many entries a row as the sampled step
takes (``sampled_takes``): the same batch, the same entries a row, everything but the sampling itself.

Usage: ``python benchmarks/bench_sampled.py [--backends cupy,numba] [--out DIR]``; prints a table and writes
``benchmarks/results/sampled-<gpu>-<time>.json``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import cupy  # noqa: E402

from bench_plan import git_commit, gpu_info, graph_us, paged_lut, paged_table  # noqa: E402
from canary import CanaryPlanner, PlanStatus, VerifyPlan, WritePlan  # noqa: E402
from canary.backends.reference.plan import plan_arrays  # noqa: E402

FIELDS = ("verify_slot_indices", "verify_expected_tokens", "verify_expected_positions", "verify_prev_slot_indices",
          "verify_num_valid", "enable", "status", "write_offsets", "write_seed_slot_indices", "write_num_valid_reqs")


def batch(rng, bs, p_lo, p_hi, C, W=0):
    P = rng.integers(p_lo, p_hi + 1, size=bs).astype(np.int64)
    if W:
        P = np.maximum(P, 1)
    E = np.ones(bs, np.int64)
    rpi = rng.permutation(np.arange(1, bs + 1)).astype(np.int64)
    r2t, num_slots = paged_table(rng, bs + 1, p_hi + 1)
    lut = paged_lut(rng, num_slots) if W else None
    return dict(r2t=r2t, rpi=rpi, P=P, E=E, C=C, lut=lut, W=W)


def sampled_takes(w):
    """Each row's take in the sampled step of ``w`` (SPEC 3.7, C >= n: every row here has entries)."""
    L = np.minimum(w["P"], w["W"]) if w["W"] else w["P"]
    C, n, total = int(w["C"]), int((L > 0).sum()), int(L.sum())
    assert C >= n and total > C
    rank = np.concatenate([[0], np.cumsum(L > 0)]).astype(np.int64)
    off = np.concatenate([[0], np.cumsum(L)]).astype(np.int64)
    first = rank + ((C - n) * (off - rank)) // (total - n)  # products < 2^63 for these sizes
    return np.diff(first)


def pairs(rng):
    """(name, sampled workload, full workload of C entries, full workload of the sampled takes). The first full
    twin has rows of C / bs entries each (no warp pass straddles two rows in decode); the second verifies, in
    the sampled workload's own rows and tables, exactly as many entries a row as the sampled step takes, so that
    the two differ only by what sampling adds."""
    out = []
    for name, bs, lo, hi, C, W in [("bs256_decode", 256, 512, 4096, 1 << 16, 0),
                                   ("bs4096", 4096, 256, 1024, 1 << 20, 0),
                                   ("swa_bs256", 256, 4096, 32768, 1 << 16, 4096),
                                   ("bs8_tiny_budget", 8, 512, 4096, 64, 0)]:
        sampled = batch(rng, bs, lo, hi, C, W)
        per_row = C // bs
        full = batch(rng, bs, per_row, per_row, C, W)  # the same configuration (LUT included), C entries
        full["P"][: C - per_row * bs] += 1  # exactly C entries
        assert int(full["P"].sum()) == C
        same_takes = dict(sampled, P=sampled_takes(sampled))
        out.append((name, sampled, full, same_takes))
    return out


def poisoned(w):
    """Output buffers filled with a pattern no plan writes, so that unwritten elements show."""
    bs, C = len(w["rpi"]), w["C"]
    out = {k: np.full(C, 0x5A5A5A5A5A5A5A5A, np.int64) for k in FIELDS[:4]}
    out.update({k: np.full(1, 0x5A5A5A5A, np.int32) for k in ("verify_num_valid", "enable", "status",
                                                             "write_num_valid_reqs")})
    out["write_offsets"] = np.full(bs + 1, 0x5A5A5A5A5A5A5A5A, np.int64)
    out["write_seed_slot_indices"] = np.full(bs, 0x5A5A5A5A5A5A5A5A, np.int64)
    return out


def reference(w, cursors):
    out = poisoned(w)
    plan_arrays(req_to_token=w["r2t"], lut=w["lut"], pool=None, swa_window_size=w["W"], token_offset=0,
                req_pool_indices=w["rpi"], prefix_lens=w["P"], extend_seq_lens=w["E"], valid_lens=None, out=out,
                cursors=cursors)
    return out


class Bound:
    def __init__(self, backend, w):
        self.w = w
        bs = len(w["rpi"])
        self.vp = VerifyPlan.allocate(verify_capacity=w["C"], device=0, max_reqs=w["r2t"].shape[0])
        self.wp = WritePlan.allocate(write_req_capacity=bs, device=0)
        self.dev = {k: cupy.asarray(w[k]) for k in ("r2t", "rpi", "P", "E")}
        self.planner = CanaryPlanner(backend=backend, verify_plan_out=self.vp, write_plan_out=self.wp,
                                     req_to_token=self.dev["r2t"], swa_window_size=w["W"],
                                     full_to_swa_index_mapping=None if w["lut"] is None else cupy.asarray(w["lut"]))
        self.planner.warmup()

    def call(self, stream=None):
        self.planner.plan(req_pool_indices=self.dev["rpi"], prefix_lens=self.dev["P"], extend_seq_lens=self.dev["E"],
                          stream=stream)

    def check(self) -> str | None:
        cursors = np.zeros(self.w["r2t"].shape[0], np.int64)
        for k, v in poisoned(self.w).items():
            getattr(self.vp if k in FIELDS[:7] else self.wp, k)[...] = cupy.asarray(v)
        self.vp.verify_cursors[...] = 0
        want = reference(self.w, cursors)
        self.call()
        cupy.cuda.Device().synchronize()
        for k, v in want.items():
            got = cupy.asnumpy(getattr(self.vp if k in FIELDS[:7] else self.wp, k))
            if not np.array_equal(got, v):
                return f"{k} differs"
        if not np.array_equal(cupy.asnumpy(self.vp.verify_cursors), cursors):
            return "verify_cursors differ"
        return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="cupy,numba")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    rows, ok = [], True
    for name, sampled, full, same_takes in pairs(rng):
        for backend in args.backends.split(","):
            res = {}
            for kind, w in (("sampled", sampled), ("full", full), ("full_takes", same_takes)):
                b = Bound(backend, w)
                err = b.check()
                status = int(cupy.asnumpy(b.vp.status)[0])
                want_bit = PlanStatus.SAMPLED if kind == "sampled" else 0
                if err or (status & PlanStatus.SAMPLED) != want_bit:
                    ok = False
                    print(f"CHECK FAILED {name} {backend} {kind}: {err or f'status {status}'}")
                res[kind] = graph_us([b], 200)
                res[f"{kind}_entries"] = int((np.minimum(w["P"], w["W"]) if w["W"] else w["P"]).sum())
            rows.append(dict(workload=name, backend=backend, capacity=sampled["C"], **res))
            print(f"{name:16} {backend:6} C={sampled['C']:8d} sampled {res['sampled']:7.1f} us "
                  f"({res['sampled_entries']} entries)  full {res['full']:7.1f} us  ratio "
                  f"{res['sampled'] / res['full']:.2f}  full of the takes {res['full_takes']:7.1f} us  ratio "
                  f"{res['sampled'] / res['full_takes']:.2f}")
    info = gpu_info()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"sampled-{info.get('name', 'gpu').replace(' ', '_')}-{time.strftime('%Y%m%dT%H%M%S')}.json"
    path.write_text(json.dumps(dict(commit=git_commit(), gpu=info, checks_ok=ok, rows=rows), indent=1))
    print(f"wrote {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
