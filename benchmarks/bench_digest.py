"""The block digest of KV bytes in flight (SPEC 4.2) on the GPU: compute and check in GB/s, beside a plain device
copy of the same bytes (CuPy), and their ratio.

    python benchmarks/bench_digest.py [--workloads offload_1k one_block long_block] [--backends cupy numba] [--dry]

Workloads: ``--layers`` layers of K and V, ``--heads`` heads of ``--head-bytes`` bytes each (8 x 128 bf16: 256), pages
of ``--page-size`` tokens, stacked ``[L, pages, page_size, heads, head_bytes]`` per kind (one layer a view):
``offload_1k`` 1,024 one-page blocks (a batch offloaded to host memory), ``one_block`` one page (one block shipped
alone), ``long_block`` one block of 256 pages (a long prefill handed to decode). Per workload and backend: a
correctness check first (the first blocks' digests against the NumPy reference over a host copy of their pages),
then the device time of ``compute`` and of ``check`` (CUDA events around ``--replays`` replays of a captured
graph, median of ``--rounds``) and of copying as many pages of every layer and kind (``dst[:, :n] = src[:, :n]``,
one copy kernel a kind). Figures: each time (us), each in GB/s of KV bytes read (the copy: bytes copied), and
digest / copy (GB/s over GB/s: above 1, the digest reads the bytes faster than a copy moves them). Writes
digest.json in benchmarks/results/ (``--out``).
"""
from __future__ import annotations

import numpy as np

import harness

from canary import BlockDigest
from canary.interop.hostcopy import to_host

SAMPLE = 8  # blocks checked against the reference


def workloads(dry: bool) -> dict:
    """name -> (blocks, pages a block)."""
    if dry:
        return {"offload_1k": (16, 1), "one_block": (1, 1), "long_block": (1, 8)}
    return {"offload_1k": (1024, 1), "one_block": (1, 1), "long_block": (1, 256)}


class Model:
    """The stacked K and V pools and a BlockDigest over their per-layer views."""

    def __init__(self, xp, backend: str, layers: int, pages: int, ps: int, heads: int, hb: int, blocks: int):
        rng = np.random.default_rng(0)
        shape = (layers, pages, ps, heads, hb)
        self.kv = [xp.asarray(rng.integers(0, 256, shape, dtype=np.uint8)) for _ in range(2)]
        self.dst = [xp.zeros(shape, dtype=xp.uint8) for _ in range(2)]
        self.digest = BlockDigest([[self.kv[0][i], self.kv[1][i]] for i in range(layers)], max_blocks=blocks,
                                  backend=backend)
        self.digest.warmup()
        self.layers = layers


def run(bench: harness.Bench, name: str, backend: str, a) -> None:
    xp = bench.xp
    blocks, per = workloads(bench.dry)[name]
    pages = blocks * per
    m = Model(xp, backend, a.layers, pages, a.page_size, a.heads, a.head_bytes, blocks)
    order = np.random.default_rng(1).permutation(pages).astype(np.int64)  # blocks in scattered pages
    indptr = xp.asarray(np.arange(0, pages + 1, per, dtype=np.int64))
    indices = xp.asarray(order)
    positions = xp.asarray(np.arange(blocks, dtype=np.int64) * per * a.page_size)
    out = xp.zeros(blocks, dtype=xp.int64)
    mismatch = xp.zeros(blocks, dtype=xp.uint8)
    count = xp.zeros(1, dtype=xp.int32)
    nbytes = pages * a.page_size * m.digest.layers.lane_bytes()
    blocks_ = dict(kv_indptr=indptr, kv_indices=indices, block_positions=positions)

    def compute(s):
        m.digest.compute(**blocks_, out=out, stream=s)

    def check(s):
        m.digest.check(**blocks_, expected=out, mismatch_out=mismatch, count_out=count, stream=s)

    def copy(s):
        for src, dst in zip(m.kv, m.dst):
            dst[:, :pages] = src[:, :pages]  # the same pages of every layer: one strided copy a kind

    def compute_ok() -> str | None:
        compute(None)
        got = np.asarray(to_host(out))[:SAMPLE]
        n = got.shape[0]
        sel = order[: n * per]
        host = [np.asarray(to_host(t[:, xp.asarray(sel)])) for t in m.kv]  # [L, n * per, ...] of the sample
        ref = BlockDigest([[host[0][i], host[1][i]] for i in range(m.layers)], max_blocks=n)
        want = np.zeros(n, dtype=np.int64)
        ref.compute(kv_indptr=np.arange(0, n * per + 1, per), kv_indices=np.arange(n * per),
                    block_positions=np.asarray(to_host(positions))[:n], out=want)
        return None if (got == want).all() else f"digests differ from the reference: {got[:3]} vs {want[:3]}"

    def check_ok() -> str | None:
        check(None)
        c = int(np.asarray(to_host(count))[0])
        return None if c == 0 else f"check: {c} mismatches against the digests compute wrote"

    info = dict(workload=name, backend=backend, blocks=blocks, bytes=nbytes, layers=a.layers, heads=a.heads,
                head_bytes=a.head_bytes, page_size=a.page_size)
    times = {}
    for what, body, ok in (("compute", compute, compute_ok), ("check", check, check_ok), ("copy", copy, None)):
        if what == "copy" and backend != bench.backends[0]:
            continue  # the same copy for every backend
        label = f"digest {name} {'copy' if what == 'copy' else f'{backend} {what}'}"
        row = bench.attempt(label, lambda: harness.device_time(body, check=ok, dry=bench.dry, rounds=bench.rounds(7),
                                                               replays=a.replays), **info)
        if row["value"]:
            times[what] = row["value"]
            bench.figure(f"{label} GB/s", nbytes / (row["value"] * 1e-6) / 1e9, "GB/s", **info)
    if "copy" in times:
        bench.copy_us[name] = times["copy"]
    copy_us = bench.copy_us.get(name)
    for what in ("compute", "check"):
        if what in times and copy_us:
            bench.figure(f"digest {name} {backend} {what} / copy", copy_us / times[what], "x", **info)


def main() -> int:
    p = harness.parser(__doc__)
    p.add_argument("--workloads", nargs="+", default=["offload_1k", "one_block", "long_block"])
    p.add_argument("--backends", nargs="+", default=["cupy", "numba"])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-bytes", type=int, default=256, help="bytes of one head of one token (128 bf16: 256)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--replays", type=int, default=20)
    a = p.parse_args()
    bench = harness.Bench("digest", a, "device time per call: CUDA-graph replay, CUDA events around --replays "
                          "replays, median of 7 rounds; GB/s of KV bytes read (copy: bytes copied)")
    if bench.dry:
        a.backends, a.layers, a.heads, a.head_bytes, a.page_size = ["reference"], 2, 2, 32, 4
    bench.backends = a.backends
    bench.copy_us = {}
    for name in a.workloads:
        for b in a.backends:
            run(bench, name, b, a)
    return bench.finish()


if __name__ == "__main__":
    raise SystemExit(main())
