"""The NumPy reference planner on the host (no GPU, no CuPy): one step of ``--bs`` full-length decode rows.

    python benchmarks/bench_reference.py [--bs 256] [--seq-len 4096] [--rounds 5] [--dry]

The default workload is 256 rows of 4096 cached tokens (2**20 verify entries), which the reference (the host
fallback and the tests' oracle) must plan within its target (docs/performance.md, ``reference.plan``) on one CPU
core. Each round plans the same step through ``CanaryPlanner.plan`` into fresh poisoned outputs; the outputs are
checked (verify entries and write seeds, read off ``req_to_token``) before anything is timed. Writes
benchmarks/results/reference.json; the exit status is 1 when the check fails (a slow run still exits 0: judging
a timing is the reader's, not a test's).
"""
from __future__ import annotations

import platform

import numpy as np

import harness

from canary import CanaryPlanner, VerifyPlan, WritePlan

POISON64 = 0x5A5A5A5A5A5A5A5A


def workload(bs: int, seq_len: int, seed: int) -> dict:
    """``bs`` rows, each with ``seq_len`` cached tokens and one new one (a column left for it in its
    ``req_to_token`` row, which must hold it: SPEC 3.4 bit 32); row ``i`` uses pool row ``rpi[i]``."""
    rng = np.random.default_rng(seed)
    return dict(
        req_to_token=rng.integers(1, 1 << 31, size=(bs + 1, seq_len + 1), dtype=np.int32),
        req_pool_indices=rng.permutation(np.arange(1, bs + 1)).astype(np.int64),
        prefix_lens=np.full(bs, seq_len, dtype=np.int64),
        extend_seq_lens=np.ones(bs, dtype=np.int64),
    )


def plans(bs: int, entries: int) -> tuple[VerifyPlan, WritePlan]:
    i64 = lambda n: np.full(n, POISON64, dtype=np.int64)  # noqa: E731
    i32 = lambda: np.full(1, 0x5A5A5A5A, dtype=np.int32)  # noqa: E731
    # The capacity holds every entry, so the planner never samples; its cursors (one per req_to_token row) are
    # still required by the default on_overflow="sample" and stay as allocated.
    vp = VerifyPlan(verify_slot_indices=i64(entries), verify_expected_tokens=i64(entries),
                    verify_expected_positions=i64(entries), verify_prev_slot_indices=i64(entries),
                    verify_num_valid=i32(), enable=i32(), status=i32(),
                    verify_cursors=np.zeros(bs + 1, dtype=np.int64))
    wp = WritePlan(write_offsets=i64(bs + 1), write_seed_slot_indices=i64(bs), write_num_valid_reqs=i32())
    return vp, wp


def check(w: dict, vp: VerifyPlan, wp: WritePlan) -> str | None:
    """What is wrong with the plan of ``w`` (``None``: nothing)."""
    r2t, rpi = w["req_to_token"], w["req_pool_indices"]
    bs, seq_len = rpi.size, r2t.shape[1] - 1
    rows = r2t[rpi, :seq_len]
    want = {
        "status": (int(vp.status[0]), 0), "enable": (int(vp.enable[0]), 1),
        "verify_num_valid": (int(vp.verify_num_valid[0]), bs * seq_len),
        "write_num_valid_reqs": (int(wp.write_num_valid_reqs[0]), bs),
    }
    for name, (got, expected) in want.items():
        if got != expected:
            return f"{name}: expected {expected}, got {got}"
    prev = np.concatenate([np.full((bs, 1), -1), rows[:, :-1]], axis=1).reshape(-1)
    arrays = [("verify_slot_indices", vp.verify_slot_indices, rows.reshape(-1)),
              ("verify_expected_positions", vp.verify_expected_positions, np.tile(np.arange(seq_len), bs)),
              ("verify_prev_slot_indices", vp.verify_prev_slot_indices, prev),
              ("write_offsets", wp.write_offsets, np.arange(bs + 1)),
              ("write_seed_slot_indices", wp.write_seed_slot_indices, rows[:, -1])]
    for name, got, expected in arrays:
        if not np.array_equal(got, expected):
            return f"{name}: differs from req_to_token at {int(np.flatnonzero(got != expected)[0])}"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--bs", type=int, default=256, help="batch rows (default 256)")
    ap.add_argument("--seq-len", type=int, default=4096, help="cached tokens per row (default 4096)")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    bench = harness.Bench("reference", args, "host time per plan: perf_counter_ns around one CanaryPlanner.plan "
                          "into fresh poisoned outputs, median of 5 rounds")
    if bench.dry:
        args.bs, args.seq_len = 3, 40
    w = workload(args.bs, args.seq_len, args.seed)
    entries = args.bs * args.seq_len
    step = {k: w[k] for k in ("req_pool_indices", "prefix_lens", "extend_seq_lens")}
    fresh = {}

    def setup():  # fresh poisoned outputs before each timed plan, outside the clock
        fresh["vp"], fresh["wp"] = plans(args.bs, entries)
        fresh["planner"] = CanaryPlanner(verify_plan_out=fresh["vp"], write_plan_out=fresh["wp"],
                                         req_to_token=w["req_to_token"])

    def checked():
        setup()
        fresh["planner"].plan(**step)
        problem = check(w, fresh["vp"], fresh["wp"])
        setup()
        return problem

    row = bench.attempt(f"reference plan bs={args.bs} x {args.seq_len}", lambda: harness.host_time(
        lambda: fresh["planner"].plan(**step), check=checked, sync=lambda: None, after=setup,
        rounds=bench.rounds(5), warmup=0).seconds(), "s", key="reference.plan", bs=args.bs, seq_len=args.seq_len,
        entries=entries)
    if row["value"] is not None:
        row["entries_per_s"] = round(entries / row["value"])
    bench.extra.update(python=platform.python_version(), numpy=np.__version__, machine=platform.machine())
    return bench.finish()


if __name__ == "__main__":
    raise SystemExit(main())
