"""``stream=`` resolution (canary/interop/streams.py, SPEC 3.6): ``stream_handle`` on every accepted kind of stream
object and the refusals, and ``launch_stream``'s choice between the caller's stream and the owner library's
current one. Stream objects are stand-ins with the attributes each library exposes: no GPU needed."""
from __future__ import annotations

import ctypes
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from canary.interop.streams import dlpack_stream, launch_stream, stream_handle

BAD_STREAM = (r"^kv-canary: stream: expected a CuPy/torch/cuda.core/Numba stream, an object with __cuda_stream__ or "
              r"a raw handle, got {}$")


class ProtocolStream:
    """cuda.core-style: ``__cuda_stream__()`` returns ``(version, handle)``."""

    def __init__(self, handle):
        self.handle_value = handle

    def __cuda_stream__(self):
        return (0, self.handle_value)


@pytest.mark.parametrize("value", [0, 1, 2, 0x7F00_DEAD_BEEF, (1 << 64) - 1])
def test_int_is_the_handle(value):
    assert stream_handle(value) == value


@pytest.mark.parametrize("value", [np.int64(5), np.uint64(5)])
def test_numpy_integers_are_not_ints(value):
    """Only Python ints are raw handles: a NumPy scalar is refused, not silently converted."""
    with pytest.raises(TypeError, match=BAD_STREAM.format(type(value).__name__)):
        stream_handle(value)


@pytest.mark.parametrize("value", [True, False])
def test_bool_refused(value):
    with pytest.raises(TypeError, match=BAD_STREAM.format("bool")):
        stream_handle(value)


def test_cuda_stream_protocol():
    assert stream_handle(ProtocolStream(0x1234)) == 0x1234
    assert stream_handle(ProtocolStream(0)) == 0


def test_torch_like_cuda_stream_attribute():
    assert stream_handle(SimpleNamespace(cuda_stream=0xABC)) == 0xABC


def test_cupy_like_ptr_attribute():
    assert stream_handle(SimpleNamespace(ptr=0xDEF)) == 0xDEF


def test_numba_like_handle_value():
    assert stream_handle(SimpleNamespace(handle=ctypes.c_void_p(4096))) == 4096
    assert stream_handle(SimpleNamespace(handle=ctypes.c_void_p(None))) == 0  # the default stream


def test_precedence():
    """``__cuda_stream__`` first, then ``cuda_stream``, then ``ptr``, then ``handle.value``."""
    class All(ProtocolStream):
        cuda_stream = 2
        ptr = 3
        handle = ctypes.c_void_p(4)

    assert stream_handle(All(1)) == 1
    assert stream_handle(SimpleNamespace(cuda_stream=2, ptr=3, handle=ctypes.c_void_p(4))) == 2
    assert stream_handle(SimpleNamespace(ptr=3, handle=ctypes.c_void_p(4))) == 3
    assert stream_handle(SimpleNamespace(cuda_stream="not an int", ptr=3)) == 3  # non-int attributes are skipped


@pytest.mark.parametrize("obj,name", [
    (None, "NoneType"), (1.5, "float"), ("0x10", "str"), (object(), "object"),
    (SimpleNamespace(cuda_stream=1.0), "SimpleNamespace"), (SimpleNamespace(handle=7), "SimpleNamespace"),
])
def test_bad_types_raise_type_error(obj, name):
    with pytest.raises(TypeError, match=BAD_STREAM.format(name)):
        stream_handle(obj)


def test_dlpack_stream_maps_the_legacy_default():
    assert dlpack_stream(0) == 1  # DLPack forbids 0; 1 is the legacy default stream
    assert [dlpack_stream(h) for h in (1, 2, 0xBEEF)] == [1, 2, 0xBEEF]


# --------------------------------------------------------------------------------------------------------------
# launch_stream(device_id, stream, owner)


def _owner_of(module: str):
    """An instance of a class that claims to come from ``module`` (what ``launch_stream`` looks at)."""
    return type("FakeArray", (), {"__module__": module})()


def test_host_launch_takes_no_stream():
    assert launch_stream(-1, None, np.zeros(1)) == (0, None)
    for stream in (0xABC, 0, SimpleNamespace(ptr=5)):
        with pytest.raises(ValueError, match=r"^kv-canary: stream: expected None for host arrays"):
            launch_stream(-1, stream, np.zeros(1))


def test_explicit_stream_wins_and_orders_no_library():
    owner = _owner_of("cupy._core.core")
    assert launch_stream(0, 0xABC, owner) == (0xABC, None)
    assert launch_stream(1, SimpleNamespace(cuda_stream=77), owner) == (77, None)
    with pytest.raises(TypeError, match=BAD_STREAM.format("float")):
        launch_stream(0, 2.5, owner)


def test_default_is_the_cupy_current_stream(monkeypatch):
    asked = []

    def get_current_stream(dev):
        asked.append(dev)
        return SimpleNamespace(ptr=0x5000 + dev)

    fake = SimpleNamespace(cuda=SimpleNamespace(get_current_stream=get_current_stream))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    assert launch_stream(3, None, _owner_of("cupy._core.core")) == (0x5003, "cupy")
    assert asked == [3]


def test_default_is_the_torch_current_stream(monkeypatch):
    fake = SimpleNamespace(cuda=SimpleNamespace(current_stream=lambda dev: SimpleNamespace(cuda_stream=0x7000 + dev)))
    monkeypatch.setitem(sys.modules, "torch", fake)
    assert launch_stream(1, None, _owner_of("torch")) == (0x7001, "torch")


def test_default_for_other_owners_is_the_legacy_stream():
    """Arrays of other libraries (Numba, JAX, anything DLPack): the legacy default stream, handle 0."""
    assert launch_stream(0, None, _owner_of("numba.cuda.cudadrv.devicearray")) == (0, "numba")
    assert launch_stream(2, None, _owner_of("jaxlib.xla_extension")) == (0, "jaxlib")
