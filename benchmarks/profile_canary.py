"""Run one canary workload's verify + write a few times through the CuPy backend: a target for Nsight Compute.

    ncu --clock-control none -k regex:canary_verify python benchmarks/profile_canary.py bs1_decode_ctx4k ALL [numba]
"""
import sys

import cupy
import numpy as np

import bench_canary
from canary import RealKVMode

name, mode = sys.argv[1], sys.argv[2]
backend = sys.argv[3] if len(sys.argv) > 3 else "cupy"
w = next(w for w in bench_canary.workloads(None) if w["name"] == name)
step = bench_canary.Step(w, backend, RealKVMode[mode], np.random.default_rng(2026))
for _ in range(3):
    step()
cupy.cuda.Device().synchronize()
print(name, mode, backend, "ok")
