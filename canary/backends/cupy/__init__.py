"""The CuPy backend: CUDA C of ``kernels/`` compiled by NVRTC through ``cupy.RawModule``; ``plan`` and ``records``.

What both share: CuPy itself (imported here, with the install command when missing), the compiled modules
(one compile per process and source; CuPy also caches it on disk), the stream wrapper CuPy launches on,
by-value parameter structs packed as uint64 words, and running on the buffers' device.
"""
from __future__ import annotations

import functools

import numpy as np

from ...interop import cudart
from ...interop.libs import import_cupy
from ..sources import cuda_source

cupy = import_cupy()
from cupy.cuda.function import CPointer  # noqa: E402 - what CuPy launches with: the address of one argument


@functools.lru_cache(maxsize=None)
def raw_module(name: str, defines: tuple = ()) -> "cupy.RawModule":
    """``kernels/<name>.cu`` compiled once per process and set of ``defines`` (``(("NAME", "value"), ...)``: the
    plan's index form, one module each)."""
    options = ("--std=c++17",) + tuple(f"-D{k}={v}" for k, v in defines)
    return cupy.RawModule(code=cuda_source(name), options=options)


class Stream:
    """All ``cupy.cuda.function.Function`` reads of a stream: its raw handle."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr


class Streams(dict):
    """Raw handle -> :class:`Stream`, made once per handle (a launch then allocates nothing)."""

    def get_stream(self, handle: int) -> Stream:
        st = self.get(handle)
        if st is None:
            st = self[handle] = Stream(handle)
        return st


def word(value: int) -> int:
    """int64 fields travel as their two's-complement bit pattern."""
    return int(value) & 0xFFFFFFFFFFFFFFFF


class Params:
    """One by-value struct's uint64 words and the argument tuple pointing at them. cuLaunchKernel copies the
    bytes at launch, so rewriting the words for the next call is safe; the words live as long as this object."""

    def __init__(self, fields: tuple, values: dict):
        self.index = {name: i for i, name in enumerate(fields)}
        self.words = np.zeros(len(fields), dtype=np.uint64)
        self.set(values)
        self.args = (CPointer(self.words.ctypes.data),)

    def set(self, values: dict) -> None:
        w, index = self.words, self.index
        for name, value in values.items():
            w[index[name]] = word(value)


class OnDevice(cudart.OnDevice):
    """Run on ``device_id`` whatever the current device is (restored on exit): the runtime's own guard."""

    __slots__ = ()

    def __init__(self, device_id: int):
        super().__init__(cudart.runtime(), device_id)


def load_functions(device_id: int, source: str, launches, defines: tuple = ()) -> tuple:
    """``kernels/<source>.cu``'s functions loaded on a device: ``launches`` = ``((name, block size), ...)``;
    returns ``(functions, resident blocks per SM of each at its block size, the device's SM count)``.
    ``defines``: as :func:`raw_module` takes them."""
    with cupy.cuda.Device(device_id):
        module = raw_module(source, defines)
        fns = tuple(module.get_function(name).kernel for name, _ in launches)
        per_sm = tuple(occupancy(fn, threads) for fn, (_, threads) in zip(fns, launches))
        sms = cupy.cuda.Device(device_id).attributes["MultiProcessorCount"]
    return fns, per_sm, sms


def occupancy(kernel, threads: int) -> int:
    """Resident blocks per SM of a loaded kernel (driver occupancy API)."""
    from cupy_backends.cuda.api.driver import occupancyMaxActiveBlocksPerMultiprocessor

    return occupancyMaxActiveBlocksPerMultiprocessor(kernel.ptr, threads, 0)
