"""The Numba twin's device hash functions on the frozen vectors (shared by the GPU and simulator suites)."""
from __future__ import annotations

import numpy as np
from numba import cuda  # a module global: the simulator swaps it for its fake inside kernels
from helpers.hash_vectors import MIX3_VECTORS, SPLITMIX64_VECTORS

from canary.backends.sources import numba_kernels

cn = numba_kernels("records_numba")


def check_numba_hashes() -> None:
    @cuda.jit
    def hash_vectors(x, sx, a, b, c, m):
        i = cuda.threadIdx.x
        if i < x.shape[0]:
            sx[i] = cn.splitmix64(x[i])
        if i < a.shape[0]:
            m[i] = cn.mix3(a[i], b[i], c[i])

    x = np.array([v for v, _ in SPLITMIX64_VECTORS], dtype=np.uint64)
    a, b, c = (np.array(col, dtype=np.uint64) for col in list(zip(*MIX3_VECTORS))[:3])
    dx, da, db, dc = (cuda.to_device(v) for v in (x, a, b, c))
    dsx, dm = cuda.to_device(np.zeros_like(x)), cuda.to_device(np.zeros_like(a))
    hash_vectors[1, 32](dx, dsx, da, db, dc, dm)
    assert dsx.copy_to_host().tolist() == [y for _, y in SPLITMIX64_VECTORS]
    assert dm.copy_to_host().tolist() == [w for *_, w in MIX3_VECTORS]
