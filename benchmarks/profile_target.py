"""One benchmark workload run a few times, eagerly: a target for Nsight Compute (tools/gpu_profile.sh).

    ncu --clock-control none -k regex:canary_plan python benchmarks/profile_target.py plan bs4096 [cupy|cupy_two_pass|numba]
    ncu ... python benchmarks/profile_target.py plan bs1 cupy block_table   (the index form, SPEC 3.8)
    ncu ... -k regex:canary_verify python benchmarks/profile_target.py records bs1_decode_ctx4k ALL [cupy|numba]
    ncu ... -k regex:canary_plan python benchmarks/profile_target.py sampled bs4096 sampled|full

The workloads are bench_plan.py's, bench_records.py's and bench_sampled.py's (the same seeds); a sampled run's
first call starts from zeroed cursors, later calls continue the rotation, as in serving. Not a benchmark: it
times nothing (the host-side cProfile is ``bench_host.py --profile``).
"""
from __future__ import annotations

import sys

import numpy as np

import harness


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in ("plan", "records", "sampled"):
        print(__doc__, file=sys.stderr)
        return 2
    cp = harness.cupy()
    kind, name = argv[0], argv[1]
    if kind == "plan":
        import bench_plan

        inp = next(w for w in bench_plan.workloads(np.random.default_rng(2026), False) if w.name == name)
        form = argv[3] if len(argv) > 3 else "req_to_token"
        b = bench_plan.Bound(argv[2] if len(argv) > 2 else "cupy", inp, cp, form)
        calls = 3
    elif kind == "records":
        import bench_records

        from canary import RealKVMode

        w = next(w for w in bench_records.workloads() if w["name"] == name)
        step = bench_records.Step(w, argv[3] if len(argv) > 3 else "cupy", RealKVMode[argv[2]],
                                  np.random.default_rng(2026))
        b = type("B", (), {"call": staticmethod(step)})
        calls = 3
    else:
        import bench_sampled

        pair = next(p for p in bench_sampled.pairs(np.random.default_rng(0)) if p[0].startswith(name))
        b = bench_sampled.Bound("cupy", pair[1] if argv[2] == "sampled" else pair[2], cp, 0)
        calls = 6  # tools/gpu_profile.sh profiles the fourth
    for _ in range(calls):
        b.call()
    cp.cuda.Device().synchronize()
    print(" ".join(argv), "ok")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
