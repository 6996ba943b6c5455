"""Turn any array the caller hands us into a typed, zero-copy view, and check it (SPEC 3.3).

Host arrays (NumPy, anything with ``__array_interface__``, CPU DLPack exporters such as torch CPU tensors)
are viewed through NumPy itself; device arrays (DLPack or CUDA Array Interface: torch, CuPy, JAX, Numba)
through ``cuda.core``'s ``StridedMemoryView``. Neither path copies: a view's ``ptr`` is the caller's memory,
and ``owner`` keeps the exporter alive for as long as the view lives.
"""
from __future__ import annotations

import sys
from typing import Any, NamedTuple

import numpy as np

from ..errors import BackendUnavailableError, fail
from .streams import is_capturing

HOST = -1  # device_id of host memory

_DLPACK_CPU = 1
_DLPACK_CUDA = 2
_DLPACK_CUDA_MANAGED = 13


class ArrayView(NamedTuple):
    """A typed view of a caller's array.

    ``strides`` are in elements, not bytes. ``host`` is a NumPy array aliasing the caller's memory for host
    arrays (``None`` for device arrays). ``device_id`` is -1 for host memory, else the CUDA device ordinal.
    """

    name: str
    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: np.dtype
    device_id: int
    readonly: bool
    owner: Any
    host: np.ndarray | None = None

    @property
    def on_device(self) -> bool:
        return self.device_id != HOST

    @property
    def where(self) -> str:
        return "host memory" if self.device_id == HOST else f"cuda:{self.device_id}"


def _dlpack_device(obj: Any) -> tuple[int, int] | None:
    get = getattr(obj, "__dlpack_device__", None)
    if get is None:
        return None
    dev_type, dev_id = get()
    return int(dev_type), int(dev_id)


def _is_jax(obj: Any) -> bool:
    return type(obj).__module__.split(".")[0] in ("jax", "jaxlib")


def _host_view(name: str, obj: Any, arr: np.ndarray) -> ArrayView:
    itemsize = arr.dtype.itemsize
    if itemsize == 0:
        raise fail(TypeError, f"{name}: expected an array of sized elements, got dtype {arr.dtype}")
    if any(s % itemsize for s in arr.strides):
        raise fail(ValueError, f"{name}: expected strides that are whole elements, got byte strides {arr.strides}")
    return ArrayView(
        name=name,
        ptr=int(arr.__array_interface__["data"][0]),
        shape=tuple(int(n) for n in arr.shape),
        strides=tuple(int(s) // itemsize for s in arr.strides),
        dtype=arr.dtype,
        device_id=HOST,
        readonly=(not arr.flags.writeable) or _is_jax(obj),
        owner=obj,
        host=arr,
    )


def _device_view(name: str, obj: Any, stream_ptr: int) -> ArrayView:
    try:
        from cuda.core.utils import StridedMemoryView
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise BackendUnavailableError(
            f"kv-canary: {name} is a CUDA array, and viewing it needs cuda-core: "
            "pip install 'kv-canary[cuda13]' (or [cuda12], or [numba])"
        ) from exc
    if stream_ptr == -1 and _is_jax(obj):
        # JAX hands -1 to the driver as a stream handle (CUDA_ERROR_INVALID_HANDLE): order on the legacy
        # default stream instead, which waits for JAX's pending writes without a host sync.
        stream_ptr = 1
    try:
        smv = StridedMemoryView.from_any_interface(obj, stream_ptr=stream_ptr)
    except (BufferError, TypeError, ValueError) as exc:
        raise fail(ValueError, f"{name}: expected an array viewable through DLPack or the CUDA Array Interface, "
                               f"got {type(obj).__name__} that refused: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - e.g. the CUDA driver library missing on this machine
        raise BackendUnavailableError(f"kv-canary: {name}: a CUDA array needs a working CUDA driver to be viewed, "
                                      f"got {type(exc).__name__}: {exc}") from exc
    shape = tuple(int(n) for n in smv.shape)
    if smv.strides is None:
        strides, acc = [], 1
        for n in reversed(shape):
            strides.append(acc)
            acc *= max(n, 1)
        strides = tuple(reversed(strides))
    else:
        strides = tuple(int(s) for s in smv.strides)
    return ArrayView(
        name=name,
        ptr=int(smv.ptr),
        shape=shape,
        strides=strides,
        dtype=np.dtype(smv.dtype),
        device_id=int(smv.device_id),
        readonly=bool(smv.readonly) or _is_jax(obj),
        owner=obj,
    )


_TORCH_DTYPES: dict = {}


def _fast_device_view(obj: Any, name: str, launch_stream: int, ordered_lib: str | None) -> ArrayView | None:
    """CuPy arrays and torch tensors whose library's current stream is the launch stream, by attribute reads.

    DLPack's stream handshake would add no ordering there (producer and consumer stream are the same), so
    the result equals ``StridedMemoryView``'s at a fraction of the per-call cost. ``ordered_lib`` names a
    library already known to be current on the launch stream (no need to ask it). Anything else: ``None``.
    """
    module = type(obj).__module__
    if module.startswith("cupy") and type(obj).__name__ == "ndarray":
        dev = obj.device.id
        if ordered_lib != "cupy" and sys.modules["cupy"].cuda.get_current_stream(dev).ptr != launch_stream:
            return None
        itemsize = obj.itemsize
        return ArrayView(name, obj.data.ptr, obj.shape, tuple(s // itemsize for s in obj.strides), obj.dtype, dev,
                         False, obj)
    if module == "torch" and type(obj).__name__ == "Tensor" and obj.is_cuda:
        torch = sys.modules["torch"]
        if not _TORCH_DTYPES:
            _TORCH_DTYPES.update({torch.int64: np.dtype(np.int64), torch.int32: np.dtype(np.int32)})
        dtype = _TORCH_DTYPES.get(obj.dtype)
        dev = obj.device.index
        if dtype is None or (ordered_lib != "torch" and torch.cuda.current_stream(dev).cuda_stream != launch_stream):
            return None
        return ArrayView(name, obj.data_ptr(), tuple(obj.shape), tuple(obj.stride()), dtype, dev, False, obj)
    return None


def identity(obj: Any) -> tuple | None:
    """``(data pointer, shape)`` of a CuPy array or torch tensor, read cheaply; ``None`` for other types.

    Lets a caller that keeps static step buffers (as CUDA-graph engines do) reuse last call's view of the same
    object: same object, same pointer, same shape means the same view.
    """
    module = type(obj).__module__
    if module.startswith("cupy") and type(obj).__name__ == "ndarray":
        return obj.data.ptr, obj.shape
    if module == "torch" and type(obj).__name__ == "Tensor":
        return obj.data_ptr(), obj.shape
    return None


def as_view(obj: Any, name: str, *, stream_ptr: int = -1, launch_stream: int | None = None,
            ordered_lib: str | None = None) -> ArrayView:
    """View ``obj`` without copying it.

    ``stream_ptr`` is the consumer stream handed to ``__dlpack__`` for device arrays (-1: no ordering; the
    planner passes its launch stream). ``launch_stream`` (the raw handle the kernels run on) enables the
    attribute fast path for CuPy and torch arrays already ordered on it (``ordered_lib``: the library whose
    current stream it is, when the caller knows). Raises ``ValueError`` (naming
    ``name``) for objects that are not arrays, and :class:`BackendUnavailableError` for device arrays when
    cuda-core is not installed.
    """
    if isinstance(obj, ArrayView):
        return obj
    if launch_stream is not None:
        fast = _fast_device_view(obj, name, launch_stream, ordered_lib)
        if fast is not None:
            return fast
        if stream_ptr not in (-1, None) and is_capturing(launch_stream):
            # Inside a graph capture the producer cannot be asked to order its stream against ours: it would
            # record an event on a stream outside the capture, which invalidates it. The captured graph's own
            # dependencies order the work; ask for no synchronization.
            stream_ptr = -1
    if isinstance(obj, np.ma.MaskedArray):
        raise fail(TypeError, f"{name}: expected a plain array, got a masked array (its mask would be ignored)")
    if isinstance(obj, np.ndarray):
        return _host_view(name, obj, obj)
    try:
        dev = _dlpack_device(obj)
    except (ValueError, TypeError, RuntimeError) as exc:  # e.g. torch's meta device
        raise fail(ValueError, f"{name}: expected host or CUDA memory, got {type(obj).__name__} whose DLPack device "
                               f"is unknown: {exc}") from exc
    if dev is not None and dev[0] == _DLPACK_CPU:
        try:
            arr = np.from_dlpack(obj)
        except (BufferError, TypeError, RuntimeError) as exc:  # e.g. a torch tensor that requires grad
            raise fail(ValueError, f"{name}: expected an array NumPy can view through DLPack, got "
                                   f"{type(obj).__name__} that refused: {exc}") from exc
        return _host_view(name, obj, arr)
    if dev is not None or hasattr(obj, "__cuda_array_interface__"):
        if dev is not None and dev[0] not in (_DLPACK_CUDA, _DLPACK_CUDA_MANAGED):
            raise fail(ValueError, f"{name}: expected host or CUDA memory, got DLPack device type {dev[0]}")
        return _device_view(name, obj, stream_ptr)
    if hasattr(obj, "__array_interface__"):
        return _host_view(name, obj, np.asarray(obj))
    raise fail(
        ValueError,
        f"{name}: expected an array (NumPy, DLPack or CUDA Array Interface), got {type(obj).__name__}",
    )


def check_view(
    view: ArrayView,
    *,
    dtype: np.dtype | type,
    ndim: int,
    length: int | None = None,
    writable: bool = False,
) -> ArrayView:
    """Enforce dtype (no silent casts), rank, leading length, unit inner stride and writability."""
    want = np.dtype(dtype)
    if view.dtype != want:
        got = view.dtype.name if view.dtype.name != want.name else f"{view.dtype.str} (non-native byte order)"
        raise fail(TypeError, f"{view.name}: expected dtype {want.name}, got {got}")
    if len(view.shape) != ndim:
        raise fail(ValueError, f"{view.name}: expected a {ndim}-D array, got shape {view.shape}")
    if length is not None and view.shape[0] != length:
        raise fail(ValueError, f"{view.name}: expected length {length}, got {view.shape[0]}")
    empty = 0 in view.shape  # an empty array's strides are arbitrary (0 from some slicing): nothing is accessed
    if view.ptr % want.itemsize and not empty:  # the kernels load whole elements; misaligned loads fault on a GPU
        raise fail(ValueError, f"{view.name}: expected an address aligned to {want.itemsize} bytes (its element size), "
                               f"got {view.ptr:#x}")
    if ndim >= 1 and view.shape[-1] > 1 and view.strides[-1] != 1 and not empty:
        raise fail(ValueError, f"{view.name}: expected a unit inner stride, got stride {view.strides[-1]} elements")
    if ndim == 2 and view.shape[0] > 1 and view.strides[0] < view.shape[1] and not empty:
        raise fail(
            ValueError,
            f"{view.name}: expected a row stride >= the row length {view.shape[1]}, got {view.strides[0]} elements",
        )
    if writable and view.readonly:
        raise fail(ValueError, f"{view.name}: expected a writable output array, got a read-only one")
    return view


def check_same_device(views: list[ArrayView]) -> int:
    """All views on one device; returns its id (-1 for host)."""
    first = views[0]
    for v in views[1:]:
        if v.device_id != first.device_id:
            raise fail(
                ValueError,
                f"{v.name}: expected the same device as {first.name} ({first.where}), got {v.where}",
            )
    return first.device_id


def span_bytes(view: ArrayView) -> int:
    """Bytes from ``view.ptr`` to one past the last element the view reaches (0 when empty).

    Strides are taken as they are (non-negative: ``check_view`` refuses others before any span is asked for).
    """
    if 0 in view.shape or not view.shape:
        return view.dtype.itemsize if not view.shape else 0
    last = sum((n - 1) * abs(s) for n, s in zip(view.shape, view.strides))
    return (last + 1) * view.dtype.itemsize


def check_disjoint(spans: list[tuple[ArrayView, int]]) -> None:
    """Refuse memory shared between arrays that must be separate: ``(view, byte length)`` pairs on one device.

    An output overlapping another output or an input would make a kernel read its own writes or clobber an
    input mid-launch (SPEC 3.3). Raises ``ValueError`` naming both arrays.
    """
    ranges = sorted((v.device_id, v.ptr, v.ptr + n, v.name) for v, n in spans if n > 0)
    reach = None  # the range reaching furthest so far on the current device
    for r in ranges:
        if reach is not None and reach[0] == r[0] and r[1] < reach[2]:
            _, a0, a1, an = reach
            raise fail(ValueError, f"{r[3]}: expected memory separate from {an}, got an overlap at {r[1]:#x} "
                                   f"({an} spans [{a0:#x}, {a1:#x}))")
        if reach is None or reach[0] != r[0] or r[2] > reach[2]:
            reach = r
