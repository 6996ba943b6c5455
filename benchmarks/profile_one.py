"""Run one benchmark workload a few times through the CuPy planner: a target for Nsight Compute.

    ncu --clock-control none -k regex:canary python benchmarks/profile_one.py bs4096 [--two-pass | --impl=numba]
"""
import sys

import cupy
import numpy as np

import bench_plan

name = sys.argv[1]
two_pass = "--two-pass" in sys.argv
impl = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--impl=")), "cupy_two_pass" if two_pass else "cupy")
inp = next(w for w in bench_plan.workloads(np.random.default_rng(2026), False) if w.name == name)
b = bench_plan.Bound(impl, inp)
for _ in range(3):
    b.call()
cupy.cuda.Device().synchronize()
print(name, "ok")
