"""canary/interop/cudart.py on a GPU: both bindings of the manager's per-step runtime calls do the same thing (the
CuPy one is chosen when CuPy is imported, ``cuda.bindings`` otherwise: a torch + Numba engine without CuPy)."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest


def _runtime(impl: str):
    from canary.interop import cudart

    return cudart._CupyRuntime() if impl == "cupy" else cudart._BindingsRuntime()


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["cupy", "cuda.bindings"])
def test_copies_memset_events_capture_and_graphs(impl):
    cupy = pytest.importorskip("cupy")
    from cuda.bindings import runtime as crt

    from canary.interop.cudart import D2H, H2D

    rt = _runtime(impl)
    assert rt.get_device() == 0
    rt.set_device(0)
    dev = cupy.arange(16, dtype=cupy.int64)
    cupy.cuda.Device().synchronize()
    err, hptr = crt.cudaMallocHost(8 * 16)
    assert err == crt.cudaError_t.cudaSuccess
    host = np.ctypeslib.as_array((ctypes.c_int64 * 16).from_address(int(hptr)))
    host[:] = -1
    err, ev = crt.cudaEventCreateWithFlags(crt.cudaEventDisableTiming)
    event = rt.event_handle(ev)
    s = rt.stream_create()
    try:
        rt.memcpy_async(int(hptr), dev.data.ptr, 8 * 16, D2H, s)
        rt.event_record(event, s)
        rt.event_synchronize(event)
        assert rt.event_done(event) and host.tolist() == list(range(16))
        rt.memset_async(dev.data.ptr, 0, 8 * 4, s)
        host[:4] = [7, 8, 9, 10]
        rt.memcpy_async(dev.data.ptr + 8 * 8, int(hptr), 8 * 4, H2D, s)
        rt.stream_synchronize(s)
        assert dev.get().tolist() == [0] * 4 + list(range(4, 8)) + [7, 8, 9, 10] + list(range(12, 16))
        # A graph of a memset, captured on the stream, replayed twice.
        assert not rt.is_capturing(s)
        rt.begin_capture(s)
        assert rt.is_capturing(s)
        rt.memset_async(dev.data.ptr + 8 * 12, 0, 8 * 4, s)
        graph = rt.end_capture(s)
        assert not rt.is_capturing(s)
        exe = rt.graph_instantiate(graph)
        rt.graph_destroy(graph)
        dev[12:] = 5
        cupy.cuda.Device().synchronize()
        rt.graph_launch(exe, s)
        rt.device_synchronize()
        assert dev.get()[12:].tolist() == [0] * 4
        rt.graph_exec_destroy(exe)
        with pytest.raises(RuntimeError, match="kv-canary: cudaMemsetAsync: expected cudaSuccess"):
            rt.memset_async(8, 0, 8, s)  # no device memory there
    finally:
        rt.stream_destroy(s)
        crt.cudaEventDestroy(ev)
        crt.cudaFreeHost(hptr)
