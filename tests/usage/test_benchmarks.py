"""The CPU benchmark script runs and checks what it times (a tiny workload: the timing itself is not tested)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_reference_small_workload():
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_reference.py"), "--bs", "3", "--seq-len", "40",
           "--repeats", "2"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (result["benchmark"], result["bs"], result["seq_len"], result["entries"]) == ("reference_plan", 3, 40, 120)
    assert result["correct"] is True and result["error"] is None and result["repeats"] == 2
    assert len(result["seconds"]) == 2 and result["min_s"] <= result["median_s"]


def test_bench_reference_check_catches_a_wrong_plan():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_reference", ROOT / "benchmarks" / "bench_reference.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    w = bench.workload(2, 8, seed=3)
    vp, wp = bench.plans(2, 16)
    assert bench.check(w, vp, wp) == "status: expected 0, got 1515870810"  # still poisoned: nothing planned
    bench.CanaryPlanner(verify_plan_out=vp, write_plan_out=wp, req_to_token=w["req_to_token"]).plan(
        **{k: w[k] for k in ("req_pool_indices", "prefix_lens", "extend_seq_lens")})
    assert bench.check(w, vp, wp) is None
    vp.verify_prev_slot_indices[9] += 1
    assert bench.check(w, vp, wp) == "verify_prev_slot_indices: differs from req_to_token at 9"
