"""Where the manager's eager host time goes: cProfile of decode steps on CuPy arrays (bs=1, ctx 4096), the top
functions by own time. A diagnostic for docs/performance.md, not a benchmark (the profiler slows every call).

    python benchmarks/profile_manager.py [--steps N]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from bench_manager import build  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    import cupy as cp

    m, ids, before, after = build(cp, 1, 4096)

    def step():
        m.before_forward(request_ids=ids, **before)
        m.after_kv_store(**after)

    for _ in range(50):
        step()
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    cp.cuda.Device().synchronize()
    print(f"eager: {(time.perf_counter() - t0) / args.steps * 1e6:.1f} us per step (no profiler)")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        step()
    cp.cuda.Device().synchronize()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.top)
    print(out.getvalue())
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(args.top)
    print(out.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
