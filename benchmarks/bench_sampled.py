"""Sampled verification (SPEC 3.7) against a full plan of the same number of entries, on one GPU.

The claim to measure: a step over its verify budget costs no more than a step that fits it, so a budget is a
cost bound. For each pair, the sampled workload has many more entries than its capacity ``C`` (the planner
verifies ``C`` of them, rotating), and its full twin has exactly ``C`` entries over the same batch size. Each
configuration is checked against the NumPy reference first (poisoned outputs, cursors included, one eager
call from zeroed cursors), then timed as device time per plan in CUDA-graph replay (the cursors advance inside
the graph at every replay, as in serving).

A second full twin verifies, in the sampled workload's own rows, as many entries a row as the sampled step
takes (``sampled_takes``): the same batch, the same entries a row, everything but the sampling itself.

Usage: ``python benchmarks/bench_sampled.py [--backends cupy,numba] [--dry]``; writes
benchmarks/results/sampled.json (the ratio sampled / full beside its target, docs/performance.md).
"""
from __future__ import annotations

import numpy as np

import harness
from bench_plan import paged_lut, paged_table

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
    r2t, num_slots, _pages = paged_table(rng, bs + 1, p_hi + 1)
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


def pairs(rng, dry: bool = False):
    """(name, sampled workload, full workload of C entries, full workload of the sampled takes). The first full
    twin has rows of C / bs entries each (no warp pass straddles two rows in decode); the second verifies, in
    the sampled workload's own rows and tables, exactly as many entries a row as the sampled step takes, so that
    the two differ only by what sampling adds."""
    out = []
    shapes = [("bs256_decode", 256, 512, 4096, 1 << 16, 0), ("bs4096", 4096, 256, 1024, 1 << 20, 0),
              ("swa_bs256", 256, 4096, 32768, 1 << 16, 4096), ("bs8_tiny_budget", 8, 512, 4096, 64, 0)]
    if dry:
        shapes = [("bs256_decode", 8, 32, 128, 64, 0), ("swa_bs256", 8, 64, 256, 64, 32)]
    for name, bs, lo, hi, C, W in shapes:
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
    def __init__(self, backend, w, xp, device):
        self.w, self.xp = w, xp
        bs = len(w["rpi"])
        self.vp = VerifyPlan.allocate(verify_capacity=w["C"], device=device, max_reqs=w["r2t"].shape[0])
        self.wp = WritePlan.allocate(write_req_capacity=bs, device=device)
        self.dev = {k: xp.asarray(w[k]) for k in ("r2t", "rpi", "P", "E")}
        self.planner = CanaryPlanner(backend=backend, verify_plan_out=self.vp, write_plan_out=self.wp,
                                     req_to_token=self.dev["r2t"], swa_window_size=w["W"],
                                     full_to_swa_index_mapping=None if w["lut"] is None else xp.asarray(w["lut"]))
        self.planner.warmup()

    def call(self, stream=None):
        self.planner.plan(req_pool_indices=self.dev["rpi"], prefix_lens=self.dev["P"], extend_seq_lens=self.dev["E"],
                          stream=stream)

    def host(self, a) -> np.ndarray:
        return np.asarray(a.get() if hasattr(a, "get") else a)

    def check(self, want_sampled: bool) -> str | None:
        """One eager call from zeroed cursors on poisoned outputs against the reference, cursors and the
        SAMPLED status bit included."""
        cursors = np.zeros(self.w["r2t"].shape[0], np.int64)
        for k, v in poisoned(self.w).items():
            getattr(self.vp if k in FIELDS[:7] else self.wp, k)[...] = self.xp.asarray(v)
        self.vp.verify_cursors[...] = 0
        want = reference(self.w, cursors)
        self.call()
        if hasattr(self.xp, "cuda"):
            self.xp.cuda.Device().synchronize()
        for k, v in want.items():
            if not np.array_equal(self.host(getattr(self.vp if k in FIELDS[:7] else self.wp, k)), v):
                return f"{k} differs"
        if not np.array_equal(self.host(self.vp.verify_cursors), cursors):
            return "verify_cursors differ"
        status = int(self.host(self.vp.status)[0])
        if bool(status & PlanStatus.SAMPLED) != want_sampled:
            return f"status {status}: SAMPLED bit expected {int(want_sampled)}"
        return None


def main() -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--backends", default="cupy,numba")
    args = ap.parse_args()
    bench = harness.Bench("sampled", args, "device time per plan: CUDA-graph replay (the cursors advance at every "
                          "replay), CUDA events around 200 replays, median of 7 rounds")
    backends = ["reference"] if bench.dry else args.backends.split(",")
    rng = np.random.default_rng(0)
    for name, sampled, full, same_takes in pairs(rng, bench.dry):
        for backend in backends:
            res = {}
            for kind, w in (("sampled", sampled), ("full", full), ("full_takes", same_takes)):
                b = Bound(backend, w, bench.xp, bench.device)
                entries = int((np.minimum(w["P"], w["W"]) if w["W"] else w["P"]).sum())
                res[kind] = bench.attempt(f"sampled {name} {backend} {kind}", lambda: harness.device_time(
                    b.call, check=lambda: b.check(kind == "sampled"), dry=bench.dry, rounds=bench.rounds(7),
                    replays=200), backend=backend, capacity=int(sampled["C"]), entries=entries)["value"]
            for twin in ("full", "full_takes"):
                if res["sampled"] is not None and res[twin] is not None:
                    bench.figure(f"sampled {name} {backend} sampled/{twin}", res["sampled"] / res[twin], "x",
                                 key="sampled.ratio" if twin == "full" else None, backend=backend)
    return bench.finish()


if __name__ == "__main__":
    raise SystemExit(main())
