"""The Numba twin's device hash functions on the frozen vectors (shared by the GPU and simulator suites)."""
from __future__ import annotations

import numpy as np
from numba import cuda  # a module global: the simulator swaps it for its fake inside kernels
from helpers.hash_vectors import CHAIN_LINK_VECTORS, FOLD_SLOT, MIX3_VECTORS, MULMOD_VECTORS, REAL_KV_FOLD_VECTORS, SPLITMIX64_VECTORS, fold_vector_sources

from canary.backends.sources import numba_kernels
from canary.contract.records_layout import MAX_SOURCES

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
    check_numba_chain()
    check_numba_folds()


def check_numba_chain() -> None:
    """records_numba.chain_link and mulmod_p on CHAIN_LINK_VECTORS and MULMOD_VECTORS."""

    @cuda.jit
    def chain_vectors(ph, tok, pos, link, a, b, ab):
        i = cuda.threadIdx.x
        if i < ph.shape[0]:
            link[i] = cn.chain_link(ph[i], tok[i], pos[i])
        if i < a.shape[0]:
            ab[i] = cn.mulmod_p(a[i], b[i])

    ph, tok, pos = (np.array(col, dtype=np.uint64) for col in list(zip(*CHAIN_LINK_VECTORS))[:3])
    a, b = (np.array(col, dtype=np.uint64) for col in list(zip(*MULMOD_VECTORS))[:2])
    link, ab = cuda.to_device(np.zeros_like(ph)), cuda.to_device(np.zeros_like(a))
    chain_vectors[1, 32](*(cuda.to_device(v) for v in (ph, tok, pos)), link, cuda.to_device(a), cuda.to_device(b), ab)
    assert link.copy_to_host().tolist() == [w for *_, w in CHAIN_LINK_VECTORS]
    assert ab.copy_to_host().tolist() == [w for *_, w in MULMOD_VECTORS]


def check_numba_folds() -> None:
    """records_numba.fold_slot on REAL_KV_FOLD_VECTORS: each source laid out as helpers.hash_vectors says."""

    @cuda.jit
    def fold_vector(kv0, kv1, kv2, kv3, kvp, num_sources, slot, out):
        if cuda.threadIdx.x == 0:
            out[0] = cn.fold_slot(kv0, kv1, kv2, kv3, kvp, num_sources, slot)

    got = []
    for sources, _ in REAL_KV_FOLD_VECTORS:
        arrays = fold_vector_sources(sources)
        kvp = np.zeros(MAX_SOURCES * cn.KV_FIELDS, dtype=np.int64)
        for k, arr in enumerate(arrays):
            n = arr.size // 2
            kvp[k * cn.KV_FIELDS + cn.KV_ROW_STRIDE_WORDS] = n
            kvp[k * cn.KV_FIELDS + cn.KV_PAGE_SIZE] = 1
            kvp[k * cn.KV_FIELDS + cn.KV_WORDS_PER_TOKEN] = n
            kvp[k * cn.KV_FIELDS + cn.KV_READ_WORDS] = n
        arrays += [np.zeros(1, dtype=np.uint64)] * (MAX_SOURCES - len(arrays))  # absent: never read
        out = cuda.to_device(np.full(1, 0xDEAD, dtype=np.uint64))
        fold_vector[1, 1](*(cuda.to_device(a) for a in arrays), cuda.to_device(kvp), np.int64(len(sources)),
                          np.int64(FOLD_SLOT), out)
        got.append(int(out.copy_to_host()[0]))
    assert got == [h for _, h in REAL_KV_FOLD_VECTORS]
