"""A stand-in CuPy and CUDA runtime over host memory, so that the GPU backends' host path runs on a machine
without a GPU: what ``benchmarks/bench_host.py --fake`` and ``tests/manager/test_transfer_fake.py`` use.

:func:`install` puts a fake ``cupy`` (NumPy-backed arrays whose "device pointer" is their host address, kernels
that launch nothing) into ``sys.modules`` and stubs what the library asks of the CUDA runtime and driver
(``cuda.bindings``): copies and memsets really move the bytes (every address is host memory), events and
streams complete at once, no stream is ever capturing. Nothing here models device time: what it measures is
the host path's own Python cost, and :data:`COUNTS` counts the calls that cost a driver round trip on a real
GPU (kernel launches, runtime calls, DLPack / CUDA-Array-Interface views), which is what to compare there.

Must be installed before anything imports ``canary.backends.cupy``; never import this next to a real CuPy.
"""
from __future__ import annotations

import ctypes
import sys
import time
import types
from collections import Counter

import numpy as np

COUNTS: Counter = Counter()  # what a real GPU would pay a driver call for, by name


# -- arrays ---------------------------------------------------------------------------------------------------
class _Mem:
    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr


class _Device:
    id = 0
    attributes = {"MultiProcessorCount": 132}

    def __init__(self, ordinal: int = 0):
        self.id = int(ordinal)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def synchronize(self):
        pass


_DEVICE0 = _Device(0)


class ndarray:  # noqa: N801 - CuPy's name, which the library checks
    """A CuPy-like array over a NumPy array (its address stands for the device pointer)."""

    __module__ = "cupy._core.core"
    __slots__ = ("_a", "data")

    def __init__(self, a: np.ndarray):
        self._a = a
        self.data = _Mem(a.__array_interface__["data"][0])  # CuPy keeps its MemoryPointer: a plain attribute
    shape = property(lambda self: self._a.shape)
    strides = property(lambda self: self._a.strides)
    itemsize = property(lambda self: self._a.itemsize)
    dtype = property(lambda self: self._a.dtype)
    size = property(lambda self: self._a.size)
    ndim = property(lambda self: self._a.ndim)
    nbytes = property(lambda self: self._a.nbytes)
    device = property(lambda self: _DEVICE0)

    @property
    def __cuda_array_interface__(self):
        return {"shape": self._a.shape, "strides": self._a.strides, "typestr": self._a.dtype.str,
                "data": (self._a.ctypes.data, False), "version": 3, "stream": None}

    def __dlpack_device__(self):
        return (2, 0)

    def __len__(self):
        return len(self._a)

    def __getitem__(self, index):
        return ndarray(np.asarray(self._a[index]))

    def __setitem__(self, index, value):
        self._a[index] = value._a if isinstance(value, ndarray) else value

    def reshape(self, *shape):
        out = self._a.reshape(*shape)
        assert out.size == 0 or np.shares_memory(out, self._a)
        return ndarray(out)

    def view(self, dtype):
        return ndarray(self._a.view(dtype))

    def fill(self, value):
        self._a.fill(value)

    def get(self):
        return self._a.copy()

    def set(self, host):
        self._a[...] = host

    def copy(self):
        return ndarray(self._a.copy())

    def astype(self, dtype):
        return ndarray(self._a.astype(dtype))

    def __repr__(self):
        return f"fakecupy.ndarray({self._a!r})"


def _wrap(fn):
    def out(*args, **kwargs):
        kwargs.pop("stream", None)
        args = [a._a if isinstance(a, ndarray) else a for a in args]
        return ndarray(np.asarray(fn(*args, **kwargs)))
    return out


def asarray(a, dtype=None):
    return a if isinstance(a, ndarray) and dtype is None else ndarray(np.array(
        a._a if isinstance(a, ndarray) else a, dtype=dtype))


def asnumpy(a):
    return a.get() if isinstance(a, ndarray) else np.asarray(a)


def take(a, indices, out=None):
    np.take(a._a, indices._a, out=None if out is None else out._a)
    return out


class _Stream:
    _made = 0x5000

    def __init__(self, ptr: int | None = None, non_blocking: bool = False):
        if ptr is None:  # a new stream, as cupy.cuda.Stream() makes one
            _Stream._made += 16
            ptr = _Stream._made
        self.ptr = ptr

    def synchronize(self):
        pass


_CURRENT = _Stream(0)  # the legacy default stream


def get_current_stream(device_id: int | None = None):
    COUNTS["cupy.get_current_stream"] += 1
    return _CURRENT


class _Kernel:
    ptr = 1

    def __init__(self, name: str):
        self.name = name

    def __call__(self, grid, block, args, stream=None, shared_mem=0):
        captured = _CAPTURES.get(getattr(stream, "ptr", None))
        if captured is not None:  # recorded into the stream's graph, run by its launches
            # with the parameter words of the capture, as a real graph keeps them (the host rewrites its copy)
            addr = args[0].address
            words = np.array(np.ctypeslib.as_array((ctypes.c_uint64 * _PARAM_WORDS[addr]).from_address(addr)))
            captured.append((self, (CPointer(words.ctypes.data), words)))
            return
        COUNTS["kernel launch"] += 1
        self.run(args)

    def run(self, args):
        _emulated(self._run, args)

    def _run(self, args):
        if self.name in ("canary_write", "canary_verify"):
            _bump_counter(self.name, args)
        elif self.name == "canary_report":
            _report(args)
        elif self.name == "canary_agree":
            _agree(args)
        elif self.name.startswith("canary_scatter") and EMULATE_SCATTER:
            _scatter(args, ctypes.c_int64 if self.name.endswith("i64") else ctypes.c_int32)
        elif self.name.startswith("canary_append_tokens") and EMULATE_SCATTER:
            _append(args, ctypes.c_int64 if self.name.endswith("i64") else ctypes.c_int32)


# This thread's CPU time spent emulating kernels (the report's copy into the mailbox, the counters): the GPU's work,
# not the library's host path, so bench_host --fake subtracts it from each call's time.
EMULATED_NS = 0


def _emulated(fn, *args) -> None:
    global EMULATED_NS
    t0 = time.thread_time_ns()
    try:
        fn(*args)
    finally:
        EMULATED_NS += time.thread_time_ns() - t0

_PARAM_WORDS: dict = {}  # address of a parameter struct's words -> their count (canary.backends.cupy.Params)
# Tests that read the expected-token pool set this: the scatter then runs on host memory, in Python (a benchmark
# leaves it off, so that its figures stay the library's host path alone).
EMULATE_SCATTER = False


def _scatter(args, token_type=ctypes.c_int64) -> None:
    """kernels/records.cu's scatter on host memory (the expected-token pool is host memory here)."""
    from canary.contract.records_layout import SCATTER_FIELDS

    raw = np.ctypeslib.as_array((ctypes.c_uint64 * len(SCATTER_FIELDS)).from_address(args[0].address))
    w = {k: int(v) for k, v in zip(SCATTER_FIELDS, raw)}
    w["column_offset"] = int(np.int64(np.uint64(w["column_offset"]).view(np.int64)))  # an i64 field (-1: appends)

    def vec(ptr, n):
        return np.ctypeslib.as_array((ctypes.c_int64 * n).from_address(ptr)) if n else np.zeros(0, np.int64)

    bs = w["bs"]
    rows, offs = vec(w["req_pool_indices"], bs), vec(w["token_offsets"], bs + 1)
    cols = vec(w["column_starts"], bs)
    n_tok = w["num_tokens"]
    toks = np.ctypeslib.as_array((token_type * n_tok).from_address(w["tokens"])) if n_tok else np.zeros(0, np.int64)
    for i in range(bs):
        if not 0 < rows[i] < w["pool_rows"]:
            continue
        for j in range(int(offs[i]), int(offs[i + 1])):
            col = int(cols[i]) + j - int(offs[i]) + w["column_offset"]
            if 0 <= col < w["pool_cols"]:
                at = w["pool"] + 4 * (w["pool_row_stride"] * int(rows[i]) + col)
                ctypes.c_int32.from_address(at).value = int(toks[j])  # ctypes keeps the low 32 bits


def _append(args, token_type) -> None:
    """kernels/records.cu's canary_append_tokens on host memory: row r's token into pool row q[r] at column
    valid[r], valid[r] advanced."""
    from canary.contract.records_layout import APPEND_FIELDS

    raw = np.ctypeslib.as_array((ctypes.c_uint64 * len(APPEND_FIELDS)).from_address(args[0].address))
    w = {k: int(v) for k, v in zip(APPEND_FIELDS, raw)}
    n = w["n"]
    if not n:
        return
    q = np.ctypeslib.as_array((ctypes.c_int64 * n).from_address(w["q"]))
    valid = np.ctypeslib.as_array((ctypes.c_int64 * n).from_address(w["valid"]))
    tokens = np.ctypeslib.as_array((token_type * n).from_address(w["tokens"]))
    for r in range(n):
        rp, col = int(q[r]), int(valid[r])
        if 0 < rp < w["pool_rows"] and 0 <= col < w["pool_cols"]:
            ctypes.c_int32.from_address(w["pool"] + 4 * (w["pool_row_stride"] * rp + col)).value = int(tokens[r])
            valid[r] = col + 1


def _report(args) -> None:
    """kernels/report.cu on host memory: copy the block and req_pool_indices into the next mailbox slot, clear
    the write indexes, publish the slot's sequence number."""
    from canary.backends.cupy.report import FIELDS

    w = dict(zip(FIELDS, np.ctypeslib.as_array((ctypes.c_uint64 * len(FIELDS)).from_address(args[0].address))))
    w = {k: int(v) for k, v in w.items()}
    counter = ctypes.c_int64.from_address(w["counter"])
    counter.value += 1
    seq = counter.value
    slot = w["mailbox"] + 8 * (seq % w["slots"]) * w["slot_words"]
    ctypes.memmove(slot + 8, w["block"], 8 * w["words"])
    if w["bs"]:
        ctypes.memmove(slot + 8 + 8 * w["words"], w["rpi"], 8 * w["bs"])
    ctypes.memset(w["block"], 0, 8 * w["index_words"])
    ctypes.c_int64.from_address(slot).value = seq


def _agree(args) -> None:
    """kernels/agree.cu on host memory, through the host formula (canary/manager/distributed.py): the plan's and
    the entries' digests added into the group's two report-block words (wrapping)."""
    from types import SimpleNamespace

    from canary.backends.cupy.agree import FIELDS
    from canary.contract.agree_layout import AGREE_WIDE
    from canary.manager.distributed import entries_digest, plan_digest

    raw = np.ctypeslib.as_array((ctypes.c_uint64 * len(FIELDS)).from_address(args[0].address))
    w = {k: int(v) for k, v in zip(FIELDS, raw)}
    n, cap = w["n"], w["plan_capacity"]

    def vec(ptr, k, ctype):
        return np.ctypeslib.as_array((ctype * k).from_address(ptr)).copy() if k else np.zeros(0, np.int64)

    wide = lambda name: ctypes.c_int64 if w["entry_wide"] & AGREE_WIDE[name] else ctypes.c_int32  # noqa: E731
    entries = [vec(w[name], n, wide(name)) for name in ("slots", "tokens", "positions")]
    plan = SimpleNamespace(verify_slot_indices=vec(w["plan_slots"], cap, ctypes.c_int64),
                           verify_expected_tokens=vec(w["plan_tokens"], cap, ctypes.c_int64),
                           verify_expected_positions=vec(w["plan_positions"], cap, ctypes.c_int64),
                           verify_num_valid=vec(w["plan_num_valid"], 1, ctypes.c_int32))
    out = np.ctypeslib.as_array((ctypes.c_uint64 * 2).from_address(w["out"]))
    # the host formula's words have their top bit dropped already: the sum of several launches is then what the
    # device's wrapping sums read with their top bit dropped (the low 63 bits of a sum depend on those alone)
    for k, d in enumerate((plan_digest(plan), entries_digest(*entries))):
        out[k] = (int(out[k]) + d) & ((1 << 64) - 1)


class _Copy:
    """A copy captured into a graph: the GPU's work when the graph runs (emulated, not timed as host work);
    ``rows`` of ``n`` bytes, ``spitch`` / ``dpitch`` apart (a 2-D copy), or one of ``n`` bytes."""

    def __init__(self, dst: int, src: int, n: int, rows: int = 1, dpitch: int = 0, spitch: int = 0):
        self.dst, self.src, self.n, self.rows, self.dpitch, self.spitch = dst, src, n, rows, dpitch, spitch

    def run(self, args) -> None:
        _emulated(self.copy)

    def copy(self) -> None:
        for r in range(self.rows):
            ctypes.memmove(self.dst + r * self.dpitch, self.src + r * self.spitch, self.n)


_CAPTURES: dict = {}  # stream handle -> the launches captured on it so far
_GRAPHS: dict = {}  # graph or graph-exec handle -> its launches


_COUNTER_AT: dict = {}  # kernel name -> (word index of kernel_run_counter, counter index)


def _bump_counter(name: str, args) -> None:
    """What the manager's health check reads: the kernel's launch counter, one more per launch."""
    at = _COUNTER_AT.get(name)
    if at is None:
        from canary.contract.records_layout import VERIFY_FIELDS, WRITE_FIELDS
        from canary.contract.ring import KernelTag

        fields, tag = (WRITE_FIELDS, KernelTag.WRITE) if name == "canary_write" else (VERIFY_FIELDS, KernelTag.VERIFY)
        at = _COUNTER_AT[name] = (fields.index("kernel_run_counter"), tag.counter_index)
    word = ctypes.c_uint64.from_address(args[0].address + 8 * at[0]).value
    ctypes.c_int64.from_address(word + 8 * at[1]).value += 1


class _Function:
    def __init__(self, name: str):
        self.kernel = _Kernel(name)

    def __call__(self, *args, **kwargs):
        self.kernel(*args, **kwargs)


class RawModule:
    def __init__(self, code: str = "", options=()):
        pass

    def get_function(self, name: str):
        return _Function(name)


class CPointer:
    def __init__(self, address: int):
        self.address = address


class CUDARuntimeError(RuntimeError):
    pass


def _get_device():
    COUNTS["cupy.getDevice"] += 1
    return 0


def _module(name: str, **attrs) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    return m


# -- CUDA runtime / driver (cuda.bindings) ----------------------------------------------------------------------
class _Enum:
    def __init__(self, **values):
        self.__dict__.update(values)


class FakeRuntime:
    """The ``cuda.bindings.runtime`` calls the manager makes; each returns ``(err, value...)`` like the real one."""

    cudaError_t = _Enum(cudaSuccess=0, cudaErrorNotReady=600)
    cudaMemcpyKind = _Enum(cudaMemcpyHostToDevice=1, cudaMemcpyDeviceToHost=2, cudaMemcpyDeviceToDevice=3)
    cudaStreamNonBlocking = 1
    cudaEventDisableTiming = 2

    def __init__(self):
        self._host: dict[int, np.ndarray] = {}
        self._next = 1000

    def _count(self, name):
        COUNTS[f"cuda.{name}"] += 1

    def _handle(self):
        self._next += 1
        return self._next

    def cudaMallocHost(self, n):
        buf = np.zeros(int(n) + 64, dtype=np.uint8)
        ptr = -(-buf.ctypes.data // 64) * 64
        self._host[ptr] = buf
        return 0, ptr

    cudaMemoryType = _Enum(cudaMemoryTypeUnregistered=0, cudaMemoryTypeHost=1, cudaMemoryTypeDevice=2)

    def cudaPointerGetAttributes(self, ptr):
        """Host memory this runtime pinned is ``cudaMemoryTypeHost``; anything else unregistered."""
        pinned = any(p <= ptr < p + buf.nbytes - 64 for p, buf in self._host.items())
        kind = self.cudaMemoryType.cudaMemoryTypeHost if pinned else self.cudaMemoryType.cudaMemoryTypeUnregistered
        return 0, _Enum(type=kind)

    def cudaFreeHost(self, ptr):
        self._host.pop(ptr, None)
        return (0,)

    def cudaEventCreateWithFlags(self, flags):
        return 0, self._handle()

    def cudaStreamCreateWithFlags(self, flags):
        return 0, self._handle()

    def cudaEventDestroy(self, e):
        return (0,)

    def cudaStreamDestroy(self, s):
        return (0,)

    def cudaStreamSynchronize(self, s):
        return (0,)

    def cudaGetDevice(self):
        self._count("cudaGetDevice")
        return 0, 0

    def cudaSetDevice(self, d):
        self._count("cudaSetDevice")
        return (0,)

    def cudaMemcpyAsync(self, dst, src, n, kind, stream):
        captured = _CAPTURES.get(int(stream))
        if captured is not None:  # a copy node of the graph, run by its launches (from the buffer as it is then)
            captured.append((_Copy(int(dst), int(src), int(n)), (None, None)))
            return (0,)
        # Device-to-device copies (the manager's req_pool_indices snapshot) apart: the tests count the transfers
        self._count("cudaMemcpyAsync" if int(kind) != 3 else "cudaMemcpyAsync D2D")
        ctypes.memmove(int(dst), int(src), int(n))
        return (0,)

    def cudaMemcpy2DAsync(self, dst, dpitch, src, spitch, width, height, kind, stream):
        copy = _Copy(int(dst), int(src), int(width), int(height), int(dpitch), int(spitch))
        captured = _CAPTURES.get(int(stream))
        if captured is not None:
            captured.append((copy, (None, None)))
            return (0,)
        self._count("cudaMemcpy2DAsync" if int(kind) != 3 else "cudaMemcpy2DAsync D2D")
        copy.copy()
        return (0,)

    def cudaMemsetAsync(self, ptr, value, n, stream):
        self._count("cudaMemsetAsync")
        ctypes.memset(int(ptr), int(value), int(n))
        return (0,)

    def cudaEventRecord(self, event, stream):
        self._count("cudaEventRecord")
        return (0,)

    def cudaStreamWaitEvent(self, stream, event, flags):
        self._count("cudaStreamWaitEvent")
        return (0,)

    def cudaEventQuery(self, event):
        self._count("cudaEventQuery")
        return (0,)

    def cudaEventSynchronize(self, event):
        self._count("cudaEventSynchronize")
        return (0,)


RUNTIME = FakeRuntime()


def _not_capturing(handle):
    COUNTS["cuda.cuStreamIsCapturing"] += 1
    from cuda.bindings import driver

    return driver.CUresult.CUDA_SUCCESS, driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE


def _device_view(name, obj, stream_ptr):
    """``adapter._device_view`` for fake arrays: the same view, read off the CUDA Array Interface (on a GPU this
    is cuda.core's ``StridedMemoryView``, several microseconds a call: counted)."""
    from canary.interop.adapter import ArrayView, negative_strides

    COUNTS["dlpack/CAI view"] += 1
    a = obj._a
    strides = tuple(s // a.itemsize for s in a.strides)
    if strides and min(strides) < 0:
        raise negative_strides(name, strides)
    return ArrayView(name, a.ctypes.data, a.shape, strides, a.dtype, 0, False, obj)


def _cupy_runtime():
    """``cupy_backends.cuda.api.runtime``'s calls that canary/interop/cudart.py makes (ints in, ints out), counted
    under the same names as the ``cuda.bindings`` ones."""
    rt = RUNTIME

    def capturing(stream):
        COUNTS["cuda.cuStreamIsCapturing"] += 1
        return 0

    return _module(
        "cupy_backends.cuda.api.runtime", CUDARuntimeError=CUDARuntimeError,
        memcpyAsync=lambda dst, src, n, kind, stream: rt.cudaMemcpyAsync(dst, src, n, kind, stream) and None,
        memsetAsync=lambda ptr, value, n, stream: rt.cudaMemsetAsync(ptr, value, n, stream) and None,
        memcpy2DAsync=lambda dst, dp, src, sp, w, h, kind, stream: rt.cudaMemcpy2DAsync(dst, dp, src, sp, w, h, kind,
                                                                                      stream) and None,
        eventRecord=lambda event, stream: rt.cudaEventRecord(event, stream) and None,
        eventQuery=lambda event: rt.cudaEventQuery(event)[0],
        eventSynchronize=lambda event: rt.cudaEventSynchronize(event) and None,
        streamWaitEvent=lambda stream, event, flags: rt.cudaStreamWaitEvent(stream, event, flags) and None,
        getDevice=lambda: rt.cudaGetDevice()[1], setDevice=lambda d: rt.cudaSetDevice(d) and None,
        streamIsCapturing=capturing,
        # CUDA graphs (canary/manager/eager.py): a capture records nothing here (the stand-in's launches do
        # nothing either), a graph launch is counted like a kernel launch
        streamCreateWithFlags=lambda flags: rt._handle(), streamDestroy=lambda s: None,
        streamBeginCapture=_begin_capture, streamEndCapture=_end_capture, graphInstantiate=_instantiate,
        graphLaunch=_graph_launch, graphDestroy=lambda g: None, graphExecDestroy=lambda g: None,
        streamSynchronize=lambda s: COUNTS.__setitem__("cuda.cudaStreamSynchronize",
                                                       COUNTS["cuda.cudaStreamSynchronize"] + 1),
        deviceSynchronize=lambda: None)


def _begin_capture(stream, mode=2):
    _CAPTURES[stream] = []


def _end_capture(stream):
    h = RUNTIME._handle()
    _GRAPHS[h] = _CAPTURES.pop(stream)
    return h


def _instantiate(graph):
    h = RUNTIME._handle()
    _GRAPHS[h] = list(_GRAPHS[graph])
    return h


def _graph_launch(graph_exec, stream):
    COUNTS["graph launch"] += 1
    for kernel, (args, _words) in _GRAPHS[graph_exec]:
        kernel.run((args,))


_INSTALLED = False


def install() -> None:
    """Install the fakes (idempotent). Call before importing anything of ``canary`` that imports CuPy."""
    global _INSTALLED
    if _INSTALLED:
        return
    if "cupy" in sys.modules and not getattr(sys.modules["cupy"], "FAKE", False):
        raise RuntimeError("fakecuda: a real CuPy is already imported")
    runtime = _module("cupy.cuda.runtime", getDevice=_get_device, setDevice=lambda d: None,
                      CUDARuntimeError=CUDARuntimeError, getDeviceCount=lambda: 1)
    function = _module("cupy.cuda.function", CPointer=CPointer)
    cuda = _module("cupy.cuda", get_current_stream=get_current_stream, Device=_Device, runtime=runtime,
                   function=function, Stream=_Stream)
    cupy = _module("cupy", FAKE=True, ndarray=ndarray, cuda=cuda, RawModule=RawModule, asarray=asarray,
                   asnumpy=asnumpy, take=take, int64=np.int64, int32=np.int32, uint8=np.uint8,
                   float16=np.float16, zeros=_wrap(np.zeros), ones=_wrap(np.ones), full=_wrap(np.full),
                   arange=_wrap(np.arange), empty=_wrap(np.zeros))
    driver = _module("cupy_backends.cuda.api.driver", occupancyMaxActiveBlocksPerMultiprocessor=lambda *a: 8)
    sys.modules.update({
        "cupy": cupy, "cupy.cuda": cuda, "cupy.cuda.runtime": runtime, "cupy.cuda.function": function,
        "cupy_backends": _module("cupy_backends"), "cupy_backends.cuda": _module("cupy_backends.cuda"),
        "cupy_backends.cuda.api": _module("cupy_backends.cuda.api"), "cupy_backends.cuda.api.driver": driver,
        "cupy_backends.cuda.api.runtime": _cupy_runtime(),
    })
    sys.modules["cupy_backends.cuda.api"].runtime = sys.modules["cupy_backends.cuda.api.runtime"]
    sys.modules["cupy_backends.cuda.api"].driver = driver
    from cuda.bindings import driver as real_driver

    real_driver.cuStreamIsCapturing = _not_capturing
    import canary.interop.adapter as adapter
    import canary.manager.transfer as transfer

    adapter._device_view = _device_view
    import canary.backends.cupy as cupy_backend
    import canary.interop.cudart as cudart

    params_init = cupy_backend.Params.__init__

    def counted_init(self, fields, values):  # so that a capture can copy a struct's words
        params_init(self, fields, values)
        _PARAM_WORDS[self.words.ctypes.data] = len(fields)

    cupy_backend.Params.__init__ = counted_init
    transfer._rt = lambda: RUNTIME
    cudart._pointer_runtime = lambda: RUNTIME
    cudart._CHOSEN.clear()  # chosen again, now that the stand-in CuPy is imported
    _INSTALLED = True
