"""Run one pair of benchmarks/bench_sampled.py a few times, eagerly: a target for Nsight Compute.

    ncu --clock-control none -k regex:canary_plan python benchmarks/profile_sampled.py bs4096 sampled|full

The first call starts from zeroed cursors; later calls continue the rotation, as in serving.
"""
import sys

import cupy
import numpy as np

import bench_sampled

name, kind = sys.argv[1], sys.argv[2]
pair = next(p for p in bench_sampled.pairs(np.random.default_rng(0)) if p[0].startswith(name))
b = bench_sampled.Bound("cupy", pair[1] if kind == "sampled" else pair[2])
for _ in range(6):
    b.call()
cupy.cuda.Device().synchronize()
print(name, kind, "status", int(cupy.asnumpy(b.vp.status)[0]))
