"""Driver / host overhead: the host cost of the CUDA calls the manager's eager step is made of, one by one.

What each way of making a call costs the host thread (harness.host_time: median over ``--rounds`` calls, us,
the stream synced outside the clock after each): a kernel launch through CuPy's ``Function`` (one packed
argument, as the backends launch), through ``cuda.bindings``' ``cuLaunchKernel`` with a prepacked parameter
array, and through ``ctypes`` on ``libcuda``; device-to-host and host-to-device copies of pinned memory, a
memset, an event record and query, a capture query and a current-device query through ``cuda.bindings`` and
through CuPy's runtime module. Then the manager's own step (``bench_manager.build``), its sections timed by
wrapping each method with a clock. ``--dry``: the sections only, on host arrays. Writes
benchmarks/results/driver.json.

    python benchmarks/bench_driver.py [--rounds 2000] [--sections-only] [--dry]
"""
from __future__ import annotations

import ctypes
import statistics
import time

import numpy as np

import harness

SRC = r"""
struct P { unsigned long long w[40]; };
extern "C" __global__ void empty_kernel(const P p) { if (p.w[0] == 12345 && threadIdx.x == 1000) ((int*)p.w[1])[0] = 1; }
"""


def timed(fn, repeats: int, sync) -> float:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - a call this version lacks: recorded as NaN
        print("  failed:", type(exc).__name__, exc)
        return float("nan")
    return harness.host_time(fn, check=None, sync=sync, rounds=repeats, warmup=50).median


def primitives(repeats: int) -> dict[str, float]:
    cp = harness.cupy()
    from cuda.bindings import driver, runtime
    from cupy_backends.cuda.api import runtime as cprt

    stream = cp.cuda.Stream(non_blocking=True)
    h = stream.ptr
    sync = stream.synchronize
    mod = cp.RawModule(code=SRC)
    fn = mod.get_function("empty_kernel")
    words = np.zeros(40, dtype=np.uint64)
    from cupy.cuda.function import CPointer

    args = (CPointer(words.ctypes.data),)
    kfn = fn.kernel
    res = {}
    res["launch cupy Function (1 packed arg)"] = timed(lambda: kfn((1,), (128,), args, stream=stream), repeats, sync)
    res["launch cupy RawKernel (1 packed arg)"] = timed(lambda: fn((1,), (128,), args, stream=stream), repeats, sync)
    cufn = driver.CUfunction(kfn.ptr)
    cust = driver.CUstream(h)
    params = (ctypes.c_void_p * 1)(words.ctypes.data)
    pptr = ctypes.addressof(params)
    try:
        err = driver.cuLaunchKernel(cufn, 1, 1, 1, 128, 1, 1, 0, cust, pptr, 0)
        sync()
        res["launch cuda.bindings cuLaunchKernel (int params)"] = timed(
            lambda: driver.cuLaunchKernel(cufn, 1, 1, 1, 128, 1, 1, 0, cust, pptr, 0), repeats, sync)
        res["  (its result)"] = float(int(err[0]))
    except Exception as exc:  # noqa: BLE001 - recorded: an API that refuses an int
        print("cuLaunchKernel int params:", exc)
    libcuda = ctypes.CDLL("libcuda.so.1")
    launch = libcuda.cuLaunchKernel
    launch.restype = ctypes.c_int
    launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    fptr = kfn.ptr
    rc = launch(fptr, 1, 1, 1, 128, 1, 1, 0, h, pptr, None)
    res["launch ctypes libcuda cuLaunchKernel"] = timed(lambda: launch(fptr, 1, 1, 1, 128, 1, 1, 0, h, pptr, None),
                                                        repeats, sync)
    res["  (ctypes rc)"] = float(rc)

    dev = cp.zeros(4096, dtype=np.int64)
    dptr = dev.data.ptr
    hptr = int(runtime.cudaMallocHost(8 * 4096)[1])
    try:
        ev = cprt.eventCreateWithFlags(2)  # disable timing
    except Exception:  # noqa: BLE001
        ev = int(runtime.cudaEventCreateWithFlags(runtime.cudaEventDisableTiming)[1])
    d2h, h2d = runtime.cudaMemcpyKind.cudaMemcpyDeviceToHost, runtime.cudaMemcpyKind.cudaMemcpyHostToDevice
    for nbytes in (64, 16384):
        res[f"memcpy D2H {nbytes} B cuda.bindings"] = timed(
            lambda n=nbytes: runtime.cudaMemcpyAsync(hptr, dptr, n, d2h, h), repeats, sync)
        res[f"memcpy D2H {nbytes} B cupy runtime"] = timed(
            lambda n=nbytes: cprt.memcpyAsync(hptr, dptr, n, 2, h), repeats, sync)
    res["memcpy H2D 2 KiB cuda.bindings"] = timed(lambda: runtime.cudaMemcpyAsync(dptr, hptr, 2048, h2d, h), repeats,
                                                  sync)
    res["memcpy H2D 2 KiB cupy runtime"] = timed(lambda: cprt.memcpyAsync(dptr, hptr, 2048, 1, h), repeats, sync)
    res["memset 8 B cuda.bindings"] = timed(lambda: runtime.cudaMemsetAsync(dptr, 0, 8, h), repeats, sync)
    res["memset 8 B cupy runtime"] = timed(lambda: cprt.memsetAsync(dptr, 0, 8, h), repeats, sync)
    bev = runtime.cudaEventCreateWithFlags(runtime.cudaEventDisableTiming)[1]
    res["event record cuda.bindings"] = timed(lambda: runtime.cudaEventRecord(bev, h), repeats, sync)
    res["event record cupy runtime"] = timed(lambda: cprt.eventRecord(ev, h), repeats, sync)
    res["event query cuda.bindings"] = timed(lambda: runtime.cudaEventQuery(bev), repeats, sync)
    res["event query cupy runtime (raises if not ready)"] = timed(lambda: cprt.eventQuery(ev), repeats, sync)
    res["stream is capturing cuda.bindings driver"] = timed(lambda: driver.cuStreamIsCapturing(h), repeats, sync)
    res["stream is capturing cupy runtime"] = timed(lambda: cprt.streamIsCapturing(h), repeats, sync)
    res["get device cuda.bindings"] = timed(runtime.cudaGetDevice, repeats, sync)
    res["get device cupy runtime"] = timed(cprt.getDevice, repeats, sync)
    res["cupy get_current_stream"] = timed(cp.cuda.get_current_stream, repeats, sync)
    # CUDA graphs of the same calls, captured on the stream, launched whole
    def graph_of(body):
        stream.begin_capture()
        body()
        return stream.end_capture()

    kargs = dict(stream=stream)
    g1 = graph_of(lambda: kfn((1,), (128,), args, **kargs))
    g2 = graph_of(lambda: (kfn((1,), (128,), args, **kargs), kfn((1,), (128,), args, **kargs)))
    g3 = graph_of(lambda: (cprt.memcpyAsync(hptr, dptr, 16384, 2, h), cprt.memcpyAsync(hptr + 16384, dptr, 64, 2, h),
                           cprt.memsetAsync(dptr, 0, 8, h)))
    g4 = graph_of(lambda: (kfn((1,), (128,), args, **kargs), cprt.memcpyAsync(hptr, dptr, 16384, 2, h),
                           cprt.memcpyAsync(hptr + 16384, dptr, 64, 2, h), cprt.memsetAsync(dptr, 0, 8, h)))
    for name, g in (("1 kernel", g1), ("2 kernels", g2), ("2 D2H copies + memset", g3),
                    ("1 kernel + 2 copies + memset", g4)):
        res[f"graph launch: {name} (cupy Graph.launch)"] = timed(lambda g=g: g.launch(stream), repeats, sync)
    try:
        gexec = g1._graph_exec if hasattr(g1, "_graph_exec") else g1.graphExec
        res["graph launch: 1 kernel (cupy runtime.graphLaunch)"] = timed(lambda: cprt.graphLaunch(gexec, h), repeats,
                                                                         sync)
    except Exception as exc:  # noqa: BLE001
        print("graphLaunch:", exc)
    try:
        from cuda.bindings import driver as drv
        ex = drv.CUgraphExec(int(gexec))
        err, nodes, n = drv.cuGraphGetNodes(drv.CUgraph(int(g1._graph if hasattr(g1, "_graph") else g1.graph)), 0)
        err, nodes, n = drv.cuGraphGetNodes(drv.CUgraph(int(g1._graph if hasattr(g1, "_graph") else g1.graph)), n)
        err, kp = drv.cuGraphKernelNodeGetParams(nodes[0])
        res["graph exec kernel node set params (cuda.bindings)"] = timed(
            lambda: drv.cuGraphExecKernelNodeSetParams(ex, nodes[0], kp), repeats, sync)
        res["graph launch after set params (cuda.bindings launch)"] = timed(
            lambda: (drv.cuGraphExecKernelNodeSetParams(ex, nodes[0], kp), drv.cuGraphLaunch(ex, cust)), repeats, sync)
    except Exception as exc:  # noqa: BLE001
        print("kernel node params:", type(exc).__name__, exc)
    res["python: 40-word numpy store"] = timed(lambda: words.__setitem__(3, 7), repeats, sync)
    runtime.cudaFreeHost(hptr)
    return res


def sections(cp, repeats: int, bs: int, context: int, device=0) -> dict[str, float]:
    """The manager's step with each named method wrapped by a clock: total us per step spent inside each."""
    from bench_manager import build

    from canary.manager import manager as mm

    m, ids, before, after = build(cp, bs, context, device=device)
    acc: dict[str, int] = {}

    def wrap(owner, name, label):
        orig = getattr(owner, name, None)
        if orig is None:  # a host manager has no transfer object
            return

        def inner(*a, **k):
            t0 = time.perf_counter_ns()
            try:
                return orig(*a, **k)
            finally:
                acc[label] = acc.get(label, 0) + time.perf_counter_ns() - t0
        setattr(owner, name, inner)

    g = m.groups[0]
    wrap(g.planner, "plan", "plan (reuse check + launch)")
    wrap(g.records, "launch_prepared", "verify launch_prepared")
    wrap(g.records, "write", "write (reuse check + launch)")
    wrap(m._transfer, "stage", "stage (H2D copy + event)")
    wrap(m._transfer, "snapshot", "snapshot (D2H copies, event, memset)")
    wrap(m, "_handle_reports", "handle reports (query + decode)")
    wrap(m, "_launch", "resolve stream (x2)")
    wrap(mm, "is_capturing", "capture query (x2)")
    if m._eager is not None:
        wrap(m._eager, "launch", "eager graph lookup + launch (x2)")
        wrap(m._eager, "observe", "eager graph observe / capture")
    sync = cp.cuda.get_current_stream().synchronize if hasattr(cp, "cuda") else (lambda: None)
    total = []
    for i in range(repeats + 50):
        if i == 50:
            acc.clear()
        t0 = time.perf_counter_ns()
        m.before_forward(request_ids=ids, **before)
        m.after_kv_store(**after)
        if i >= 50:
            total.append(time.perf_counter_ns() - t0)
        sync()
    out = {k: v / repeats / 1e3 for k, v in sorted(acc.items(), key=lambda kv: -kv[1])}
    out["STEP total (median)"] = statistics.median(total) / 1e3
    if m._eager is not None:
        out["graph replays per step"] = m._eager.replays / (repeats + 50)
    m.close()
    return out


def main() -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--sections-only", action="store_true", help="skip the primitives")
    args = ap.parse_args()
    bench = harness.Bench("driver", args, "host time per call: perf_counter_ns around each call, the stream synced "
                          "outside the clock, 50 warm-up calls, median of 2000 calls; sections: wrapped methods' "
                          "total per step over 500 steps")
    repeats = bench.rounds(2000)
    if not (args.sections_only or bench.dry):
        for name, us in primitives(repeats).items():
            if name.startswith("  ("):  # a call's return code, not a time
                bench.extra[name.strip(" ()")] = us
            else:
                bench.figure(f"driver {name}", None if us != us else us, error="call failed" if us != us else None)
    workloads = ((1, 32), (4, 16)) if bench.dry else ((1, 4096), (256, 2048))
    for bs, ctx in workloads:
        for name, us in sections(bench.xp, min(repeats, 500), bs, ctx, bench.device).items():
            unit = "replays" if name.startswith("graph replays") else "us"
            bench.figure(f"manager bs{bs} section: {name}", us, unit, bs=bs, context=ctx)
    return bench.finish()


if __name__ == "__main__":
    raise SystemExit(main())
