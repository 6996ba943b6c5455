"""Records that move (SPEC 4.1, :class:`canary.RecordMover`) on the GPU: gather, scatter and the in-pool copy in
GB/s of row bytes, beside a plain device copy, a host-to-device and a device-to-host copy of the same bytes.

    python benchmarks/bench_move.py [--workloads offload_16k offload_16k_layers fork_4k] [--backends cupy numba]
                                    [--dry]

A slot's row is its record's four int64 fields, then its layer-hash row (``4 + layers`` words). Workloads, in a
pool of ``--slots`` slots: ``offload_16k`` the rows of 16,384 scattered slots (1,024 pages of 16 tokens: a batch
offloaded to host memory and restored), ``offload_16k_layers`` the same with a ``--layers``-layer table (the
rotation's hashes move too), ``fork_4k`` an in-pool copy of 4,096 slots (copy-on-write forks). Per workload and
backend: a correctness check first (the gathered rows against the records and table read back on the host; a
scatter then gather returns the scattered rows; the copy's destinations hold the sources' rows), then the device
time of each call (CUDA events around ``--replays`` replays of a captured graph, median of the rounds) into a
device buffer and into pinned host memory, and of the same bytes copied device to device, host to device and
device to host (one ``cudaMemcpyAsync`` each). Figures: each time (us) and its GB/s of row bytes, and each call
over the copy that moves its bytes the same way (above 1: faster than that copy). Writes move.json in
benchmarks/results/ (``--out``).
"""
from __future__ import annotations

import numpy as np

import harness

from canary import CanaryLayers, CanaryRecords, CanaryState, RecordMover
from canary.interop.hostcopy import to_host
from canary.records.layers import LayerTable

KV_BYTES = 16  # a layer source's bytes a token: the table only needs a source to bind, the mover never reads it


def workloads(dry: bool) -> dict:
    """name -> (slots moved, layer table on, copy in the pool)."""
    n, f = (64, 16) if dry else (16384, 4096)
    return {"offload_16k": (n, False, False), "offload_16k_layers": (n, True, False), "fork_4k": (f, False, True)}


class Pool:
    """Records (random bytes), optionally a layer table, and a mover with room for the largest copy."""

    def __init__(self, bench: harness.Bench, backend: str, slots: int, layers: int, copy_capacity: int):
        xp, rng = bench.xp, np.random.default_rng(0)
        self.state = CanaryState.allocate(slots, device=bench.device)
        self.state.canary_buffer[...] = xp.asarray(
            rng.integers(-2**62, 2**62, (slots, self.state.canary_buffer.shape[1] // 8)).view(np.uint8))
        self.records = CanaryRecords(self.state, None, backend=backend)
        self.table = self.layers = None
        if layers:
            self.kv = xp.zeros((layers, slots, KV_BYTES), dtype=xp.uint8)
            self.table = LayerTable.allocate(slots, layers, device=bench.device)
            self.table.layer_hashes[...] = xp.asarray(rng.integers(-2**62, 2**62, (slots, layers)))
            self.layers = CanaryLayers(self.records, [[(self.kv[i], 1, KV_BYTES)] for i in range(layers)],
                                       table=self.table, backend=backend)
        self.mover = RecordMover(self.records, self.layers, copy_capacity=copy_capacity, backend=backend)
        self.mover.warmup()

    def rows(self, slots: np.ndarray) -> np.ndarray:
        """The rows of ``slots`` read back on the host (the reference the checks compare with)."""
        buf = np.asarray(to_host(self.state.canary_buffer)).view(np.int64)[:, :4]
        out = buf[slots]
        if self.table is not None:
            out = np.concatenate([out, np.asarray(to_host(self.table.layer_hashes))[slots]], axis=1)
        return out


def _pinned(bench: harness.Bench, shape: tuple) -> object:
    if bench.dry:
        return np.zeros(shape, dtype=np.int64)
    import cupyx

    return cupyx.zeros_pinned(shape, dtype=np.int64)


def run(bench: harness.Bench, name: str, backend: str, a) -> None:
    xp = bench.xp
    n, with_layers, in_pool = workloads(bench.dry)[name]
    slots = a.slots if not bench.dry else 4 * n
    pool = Pool(bench, backend, slots, a.layers if with_layers else 0, n)
    m, words = pool.mover, pool.mover.row_words
    rng = np.random.default_rng(1)
    picked = rng.choice(slots, size=2 * n, replace=False).astype(np.int64)
    src_host, dst_host = picked[:n], picked[n:]
    src, dst = xp.asarray(src_host), xp.asarray(dst_host)
    dev_rows = m.allocate_rows(n)
    host_rows = _pinned(bench, (n, words))
    nbytes = n * words * 8
    info = dict(workload=name, backend=backend, slots=n, row_words=words, bytes=nbytes)
    want = pool.rows(src_host)

    def gathered(out) -> str | None:
        m.gather(src, out)
        bench_sync()
        got = np.asarray(to_host(out))
        return None if np.array_equal(got, want) else "gather: rows differ from the records read back"

    def scattered(rows) -> str | None:
        rows[...] = xp.asarray(want) if rows is dev_rows else want
        m.scatter(dst, rows)
        bench_sync()
        return None if np.array_equal(pool.rows(dst_host), want) else "scatter: the slots do not hold the rows"

    def copied() -> str | None:
        before = pool.rows(src_host)
        m.copy(src, dst)
        bench_sync()
        return None if np.array_equal(pool.rows(dst_host), before) else "copy: destinations differ from sources"

    def bench_sync():
        if not bench.dry:
            xp.cuda.Device().synchronize()

    calls = []
    if in_pool:
        calls.append(("copy", lambda s: m.copy(src, dst, stream=s), copied, "d2d"))
    else:
        calls += [("gather device", lambda s: m.gather(src, dev_rows, stream=s), lambda: gathered(dev_rows), "d2d"),
                  ("gather pinned", lambda s: m.gather(src, host_rows, stream=s), lambda: gathered(host_rows), "d2h"),
                  ("scatter device", lambda s: m.scatter(dst, dev_rows, stream=s), lambda: scattered(dev_rows), "d2d"),
                  ("scatter pinned", lambda s: m.scatter(dst, host_rows, stream=s), lambda: scattered(host_rows),
                   "h2d")]
    for what, body, ok, _ in calls:
        label = f"move {name} {backend} {what}"
        row = bench.attempt(label, lambda: harness.device_time(body, check=ok, dry=bench.dry, rounds=bench.rounds(7),
                                                               replays=a.replays), **info)
        if row["value"]:
            bench.times[(name, backend, what)] = row["value"]
            bench.figure(f"{label} GB/s", nbytes / (row["value"] * 1e-6) / 1e9, "GB/s", **info)
    if backend == bench.backends[0]:
        copies(bench, name, n, words, info)
    for what, _, _, way in calls:
        t, c = bench.times.get((name, backend, what)), bench.copy_us.get((name, way))
        if t and c:
            bench.figure(f"move {name} {backend} {what} / {way} copy", c / t, "x", **info)


def copies(bench: harness.Bench, name: str, n: int, words: int, info: dict) -> None:
    """The same bytes copied device to device, host to device and device to host: what each call is compared
    with (dry: NumPy copies of host arrays for the device-to-device row; no host-to-device in a dry run)."""
    xp = bench.xp
    nbytes = n * words * 8
    d0, d1 = xp.zeros((n, words), dtype=np.int64), xp.zeros((n, words), dtype=np.int64)
    h = _pinned(bench, (n, words))
    bodies = {"d2d": lambda s: d1.__setitem__(Ellipsis, d0)}
    if not bench.dry:
        rt = xp.cuda.runtime
        bodies["h2d"] = lambda s: rt.memcpyAsync(d0.data.ptr, h.ctypes.data, nbytes, rt.memcpyHostToDevice, s.ptr)
        bodies["d2h"] = lambda s: rt.memcpyAsync(h.ctypes.data, d0.data.ptr, nbytes, rt.memcpyDeviceToHost, s.ptr)
    for way, body in bodies.items():
        label = f"move {name} {way} copy"
        row = bench.attempt(label, lambda: harness.device_time(body, check=None, dry=bench.dry, rounds=bench.rounds(7),
                                                               replays=bench.args.replays), **info)
        if row["value"]:
            bench.copy_us[(name, way)] = row["value"]
            bench.figure(f"{label} GB/s", nbytes / (row["value"] * 1e-6) / 1e9, "GB/s", **info)


def main() -> int:
    p = harness.parser(__doc__)
    p.add_argument("--workloads", nargs="+", default=list(workloads(False)))
    p.add_argument("--backends", nargs="+", default=["cupy", "numba"])
    p.add_argument("--slots", type=int, default=1 << 20, help="slots of the pool")
    p.add_argument("--layers", type=int, default=32, help="layers of offload_16k_layers's table")
    p.add_argument("--replays", type=int, default=20)
    a = p.parse_args()
    bench = harness.Bench("move", a, "device time per call: CUDA-graph replay, CUDA events around --replays "
                          "replays, median of 7 rounds; GB/s of row bytes moved (8 * (4 + layers) a slot)")
    if bench.dry:
        a.backends, a.layers = ["reference"], 3
    bench.backends = a.backends
    bench.times, bench.copy_us = {}, {}
    for name in a.workloads:
        for b in a.backends:
            run(bench, name, b, a)
    return bench.finish()


if __name__ == "__main__":
    raise SystemExit(main())
