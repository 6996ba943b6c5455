"""The CUDA runtime calls made on every eager step (copies, memsets, events, capture and device queries), through
the cheapest binding at hand.

Measured on the H200 host (``benchmarks/bench_driver.py``, run 51, us per call): CuPy's runtime module (Cython,
plain ints in and out) costs 0.2-1.1 us less per call than ``cuda.bindings`` (which builds enum and handle
objects on every call and return): copy 2.5 vs 3.2, memset 1.7 vs 2.4, event record 0.7 vs 1.3, event query 1.8
vs 2.4, capture query 0.5 vs 0.9. The manager makes about ten of these calls a step, so :func:`runtime` picks
CuPy's when CuPy is already imported (never imports it) and ``cuda.bindings`` otherwise. Both raise
``RuntimeError`` with a ``kv-canary:`` message naming the call.
"""
from __future__ import annotations

import sys

from ..errors import fail

H2D, D2H, D2D = 1, 2, 3  # cudaMemcpyKind values (the CUDA runtime API's, fixed)
_NOT_READY = 600  # cudaErrorNotReady
_CAPTURE_NONE = 0  # cudaStreamCaptureStatusNone
_CAPTURE_THREAD_LOCAL = 1  # cudaStreamCaptureModeThreadLocal: other threads' calls are not refused meanwhile
_NON_BLOCKING = 1  # cudaStreamNonBlocking


class _CupyRuntime:
    name = "cupy"

    def __init__(self):
        from cupy_backends.cuda.api import runtime as rt

        self._rt = rt
        self._error = rt.CUDARuntimeError

    def _call(self, what: str, fn, *args):
        try:
            return fn(*args)
        except self._error as exc:
            raise fail(RuntimeError, f"{what}: expected cudaSuccess, got {exc}") from exc

    def event_handle(self, event) -> int:
        return int(event)

    def memcpy_async(self, dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:
        self._call("cudaMemcpyAsync", self._rt.memcpyAsync, dst, src, nbytes, kind, stream)

    def memcpy2d_async(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, kind: int,
                       stream: int) -> None:
        self._call("cudaMemcpy2DAsync", self._rt.memcpy2DAsync, dst, dpitch, src, spitch, width, height, kind,
                   stream)

    def memset_async(self, ptr: int, value: int, nbytes: int, stream: int) -> None:
        self._call("cudaMemsetAsync", self._rt.memsetAsync, ptr, value, nbytes, stream)

    def event_record(self, event: int, stream: int) -> None:
        self._call("cudaEventRecord", self._rt.eventRecord, event, stream)

    def event_done(self, event: int) -> bool:
        try:
            status = self._rt.eventQuery(event)  # CuPy returns the status (raising only for some versions)
        except self._error as exc:
            status = getattr(exc, "status", None)
            if status != _NOT_READY:
                raise fail(RuntimeError, f"cudaEventQuery: expected cudaSuccess or cudaErrorNotReady, got {exc}"
                           ) from exc
        if status == 0:
            return True
        if status == _NOT_READY:
            return False
        raise fail(RuntimeError, f"cudaEventQuery: expected cudaSuccess or cudaErrorNotReady, got error {status}")

    def stream_wait_event(self, stream: int, event: int) -> None:
        self._call("cudaStreamWaitEvent", self._rt.streamWaitEvent, stream, event, 0)

    def event_synchronize(self, event: int) -> None:
        self._call("cudaEventSynchronize", self._rt.eventSynchronize, event)

    def stream_synchronize(self, stream: int) -> None:
        self._call("cudaStreamSynchronize", self._rt.streamSynchronize, stream)

    def device_synchronize(self) -> None:
        self._call("cudaDeviceSynchronize", self._rt.deviceSynchronize)

    def get_device(self) -> int:
        return self._rt.getDevice()

    def set_device(self, ordinal: int) -> None:
        self._call("cudaSetDevice", self._rt.setDevice, ordinal)

    def is_capturing(self, stream: int) -> bool:
        try:
            return self._rt.streamIsCapturing(stream) != _CAPTURE_NONE
        except self._error:  # a handle the runtime refuses captures nothing of ours
            return False

    # CUDA graphs of the manager's own launches (canary/manager/eager.py)
    def stream_create(self) -> int:
        return self._call("cudaStreamCreateWithFlags", self._rt.streamCreateWithFlags, _NON_BLOCKING)

    def stream_destroy(self, stream: int) -> None:
        self._call("cudaStreamDestroy", self._rt.streamDestroy, stream)

    def begin_capture(self, stream: int) -> None:
        self._call("cudaStreamBeginCapture", self._rt.streamBeginCapture, stream, _CAPTURE_THREAD_LOCAL)

    def end_capture(self, stream: int) -> int:
        return self._call("cudaStreamEndCapture", self._rt.streamEndCapture, stream)

    def graph_instantiate(self, graph: int) -> int:
        return self._call("cudaGraphInstantiate", self._rt.graphInstantiate, graph)

    def graph_launch(self, graph_exec: int, stream: int) -> None:
        self._call("cudaGraphLaunch", self._rt.graphLaunch, graph_exec, stream)

    def graph_destroy(self, graph: int) -> None:
        self._call("cudaGraphDestroy", self._rt.graphDestroy, graph)

    def graph_exec_destroy(self, graph_exec: int) -> None:
        self._call("cudaGraphExecDestroy", self._rt.graphExecDestroy, graph_exec)


class _BindingsRuntime:
    name = "cuda.bindings"

    def __init__(self):
        try:
            from cuda.bindings import driver, runtime
        except ImportError as exc:  # pragma: no cover - the GPU backends need cuda-core, which brings it
            raise fail(ImportError, "device: the manager's device transfers need cuda.bindings: pip install "
                                    "'cuda-core[cu13]' (or, in the checkout, pip install '.[cuda13]')") from exc
        self._rt, self._drv = runtime, driver
        self._ok = runtime.cudaError_t.cudaSuccess
        self._not_ready = runtime.cudaError_t.cudaErrorNotReady
        self._kinds = {H2D: runtime.cudaMemcpyKind.cudaMemcpyHostToDevice,
                       D2H: runtime.cudaMemcpyKind.cudaMemcpyDeviceToHost,
                       D2D: runtime.cudaMemcpyKind.cudaMemcpyDeviceToDevice}
        self._capture_none = driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE
        self._drv_ok = driver.CUresult.CUDA_SUCCESS

    def event_handle(self, event):
        return event

    def _check(self, err, what: str) -> None:
        if err != self._ok:
            raise fail(RuntimeError, f"{what}: expected cudaSuccess, got {err}")

    def memcpy_async(self, dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:
        self._check(self._rt.cudaMemcpyAsync(dst, src, nbytes, self._kinds[kind], stream)[0], "cudaMemcpyAsync")

    def memcpy2d_async(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, kind: int,
                       stream: int) -> None:
        """``height`` rows of ``width`` bytes, ``spitch`` apart in ``src``, ``dpitch`` apart in ``dst``."""
        self._check(self._rt.cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, self._kinds[kind],
                                               stream)[0], "cudaMemcpy2DAsync")

    def memset_async(self, ptr: int, value: int, nbytes: int, stream: int) -> None:
        self._check(self._rt.cudaMemsetAsync(ptr, value, nbytes, stream)[0], "cudaMemsetAsync")

    def event_record(self, event: int, stream: int) -> None:
        self._check(self._rt.cudaEventRecord(event, stream)[0], "cudaEventRecord")

    def event_done(self, event: int) -> bool:
        err = self._rt.cudaEventQuery(event)[0]
        if err == self._ok:
            return True
        if err != self._not_ready:
            raise fail(RuntimeError, f"cudaEventQuery: expected cudaSuccess or cudaErrorNotReady, got {err}")
        return False

    def event_synchronize(self, event: int) -> None:
        self._check(self._rt.cudaEventSynchronize(event)[0], "cudaEventSynchronize")

    def stream_synchronize(self, stream: int) -> None:
        self._check(self._rt.cudaStreamSynchronize(stream)[0], "cudaStreamSynchronize")

    def stream_wait_event(self, stream: int, event) -> None:
        self._check(self._rt.cudaStreamWaitEvent(stream, event, 0)[0], "cudaStreamWaitEvent")

    def device_synchronize(self) -> None:
        self._check(self._rt.cudaDeviceSynchronize()[0], "cudaDeviceSynchronize")

    def get_device(self) -> int:
        err, dev = self._rt.cudaGetDevice()
        self._check(err, "cudaGetDevice")
        return dev

    def set_device(self, ordinal: int) -> None:
        self._check(self._rt.cudaSetDevice(ordinal)[0], "cudaSetDevice")

    def is_capturing(self, stream: int) -> bool:
        err, status = self._drv.cuStreamIsCapturing(stream)
        return err == self._drv_ok and status != self._capture_none

    def _value(self, result, what: str):
        self._check(result[0], what)
        return result[1]

    def stream_create(self) -> int:
        return int(self._value(self._rt.cudaStreamCreateWithFlags(_NON_BLOCKING), "cudaStreamCreateWithFlags"))

    def stream_destroy(self, stream: int) -> None:
        self._check(self._rt.cudaStreamDestroy(stream)[0], "cudaStreamDestroy")

    def begin_capture(self, stream: int) -> None:
        mode = self._rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal
        self._check(self._rt.cudaStreamBeginCapture(stream, mode)[0], "cudaStreamBeginCapture")

    def end_capture(self, stream: int):
        return self._value(self._rt.cudaStreamEndCapture(stream), "cudaStreamEndCapture")

    def graph_instantiate(self, graph):
        return self._value(self._rt.cudaGraphInstantiate(graph, 0), "cudaGraphInstantiate")

    def graph_launch(self, graph_exec, stream: int) -> None:
        self._check(self._rt.cudaGraphLaunch(graph_exec, stream)[0], "cudaGraphLaunch")

    def graph_destroy(self, graph) -> None:
        self._check(self._rt.cudaGraphDestroy(graph)[0], "cudaGraphDestroy")

    def graph_exec_destroy(self, graph_exec) -> None:
        self._check(self._rt.cudaGraphExecDestroy(graph_exec)[0], "cudaGraphExecDestroy")


_CHOSEN: dict[str, object] = {}


def runtime():
    """The binding for this process: CuPy's runtime module when CuPy is imported, else ``cuda.bindings``
    (decided once, at the first call: a CUDA :class:`~canary.manager.CanaryManager` resolves its backend, which
    imports CuPy for the CuPy backend, before it makes one)."""
    rt = _CHOSEN.get("rt")
    if rt is None:
        rt = _CupyRuntime() if "cupy" in sys.modules else _BindingsRuntime()
        _CHOSEN["rt"] = rt
    return rt


class OnDevice:
    """Run the enclosed calls with ``ordinal`` as the current device (restored on exit): one device query when
    it already is."""

    __slots__ = ("rt", "ordinal", "prev")

    def __init__(self, rt, ordinal: int):
        self.rt, self.ordinal = rt, ordinal

    def __enter__(self):
        self.prev = self.rt.get_device()
        if self.prev != self.ordinal:
            self.rt.set_device(self.ordinal)

    def __exit__(self, *exc):
        if self.prev != self.ordinal:
            self.rt.set_device(self.prev)
        return False


def on_device(rt, ordinal: int, fn, *args):
    """``fn(*args)`` with ``ordinal`` as the current device: :class:`OnDevice`'s guard, without making its object
    when the device already is current (a per-step call's common case)."""
    if rt.get_device() == ordinal:
        return fn(*args)
    with OnDevice(rt, ordinal):
        return fn(*args)


def _pointer_runtime():
    try:
        from cuda.bindings import runtime as rt
    except ImportError:
        return None
    return rt


def pinned_host(ptr: int) -> bool:
    """Whether ``ptr`` lies in page-locked host memory that CUDA kernels can read through unified addressing
    (``cudaMallocHost`` / ``cudaHostAlloc``, or registered with ``cudaHostRegister``). Called at bind only."""
    rt = _pointer_runtime()
    if rt is None:  # no CUDA runtime: nothing is pinned
        return False
    err, attrs = rt.cudaPointerGetAttributes(int(ptr))
    if err != rt.cudaError_t.cudaSuccess:
        return False
    return attrs.type == rt.cudaMemoryType.cudaMemoryTypeHost
