"""Turn any array the caller hands us into a typed, zero-copy view, and check it (SPEC 3.3).

Host arrays (NumPy, anything with ``__array_interface__``, CPU DLPack exporters such as torch CPU tensors)
are viewed through NumPy itself; device arrays (DLPack or CUDA Array Interface: torch, CuPy, JAX, Numba)
through ``cuda.core``'s ``StridedMemoryView``. Neither path copies: a view's ``ptr`` is the caller's memory,
and ``owner`` keeps the exporter alive for as long as the view lives.
"""
from __future__ import annotations

import operator
import sys
from typing import Any, NamedTuple

import numpy as np

from ..errors import BackendUnavailableError, fail
from .libs import library_of
from .streams import is_capturing

HOST = -1  # device_id of host memory

_DLPACK_CPU = 1
_DLPACK_CUDA = 2
_DLPACK_CUDA_HOST = 3  # pinned host memory (torch's pin_memory tensors): host memory, viewed as such
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
    return library_of(obj) in ("jax", "jaxlib")


def negative_strides(name: str, strides: tuple[int, ...]) -> Exception:
    """The one refusal of negative strides, worded the same on the host and device paths.

    Spans, row strides and the kernels' address arithmetic all assume memory grows with the index; a flipped
    array would make them read and write below the base pointer.
    """
    return fail(ValueError, f"{name}: expected non-negative strides, got element strides {tuple(strides)}")


def _host_view(name: str, obj: Any, arr: np.ndarray) -> ArrayView:
    itemsize = arr.dtype.itemsize
    if itemsize == 0:
        raise fail(TypeError, f"{name}: expected an array of sized elements, got dtype {arr.dtype}")
    if any(s % itemsize for s in arr.strides):
        raise fail(ValueError, f"{name}: expected strides that are whole elements, got byte strides {arr.strides}")
    strides = tuple(int(s) // itemsize for s in arr.strides)
    if strides and min(strides) < 0:
        raise negative_strides(name, strides)
    return ArrayView(
        name=name,
        ptr=int(arr.__array_interface__["data"][0]),
        shape=tuple(int(n) for n in arr.shape),
        strides=strides,
        dtype=arr.dtype,
        device_id=HOST,
        readonly=(not arr.flags.writeable) or _is_jax(obj),
        owner=obj,
        host=arr,
    )


class _InterfaceV3:
    """A CUDA Array Interface v0-v2 dict restated as v3, for viewers that read only v3 (cuda.core refuses older
    versions outright). Holds the exporter, so the memory outlives any view made through it."""

    __slots__ = ("__cuda_array_interface__", "exporter")

    def __init__(self, interface: dict, exporter: Any):
        self.__cuda_array_interface__ = interface
        self.exporter = exporter


def _whole(value: Any) -> int | None:
    """``value`` as an int if it is a whole number (a NumPy integer too; not a bool), else ``None``."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def normalized_interface(name: str, interface: Any) -> dict:
    """A ``__cuda_array_interface__`` dict as version 3, or a ``ValueError`` naming ``name``.

    Versions 0-2 carry the same ``shape`` / ``typestr`` / ``data`` / ``strides`` (v1 on) / ``mask`` keys as v3 and
    lack only ``stream``: they come back as a copy with ``"version": 3`` and ``"stream": None``, which v3 defines
    as "no synchronization needed". Nothing is synchronised for them: v2 names no stream to order against, so
    the caller orders the producer's writes before the launch stream (as with any v2 consumer; inside a graph
    capture the capture's own dependencies do). A v3 dict comes back as it is. Every other check (dtype, shape,
    strides, the read-only flag ``data[1]``, the device, a mask) is the viewer's, the same for every version.
    """
    if not isinstance(interface, dict):
        raise fail(ValueError, f"{name}: expected __cuda_array_interface__ to be a dict, got "
                               f"{type(interface).__name__}")
    raw = interface.get("version")
    version = _whole(raw)
    if version is None or version < 0:
        shown = repr(raw) if "version" in interface else "no 'version' key"
        raise fail(ValueError, f"{name}: expected a CUDA Array Interface version (an int >= 0), got {shown}")
    missing = [k for k in ("shape", "typestr", "data") if k not in interface]
    if missing:
        raise fail(ValueError, f"{name}: expected a CUDA Array Interface with 'shape', 'typestr' and 'data', got "
                               f"version {version} without {', '.join(repr(k) for k in missing)}")
    data = interface["data"]
    if not (isinstance(data, (tuple, list)) and len(data) == 2 and _whole(data[0]) is not None):
        raise fail(ValueError, f"{name}: expected CUDA Array Interface 'data' to be (pointer, read-only flag), "
                               f"got {data!r}")
    if version >= 3:
        return interface
    return {**interface, "version": 3, "stream": None}


def interface_target(name: str, obj: Any) -> Any:
    """What the viewer is handed for an object seen through its CUDA Array Interface: ``obj`` itself for v3,
    else an :class:`_InterfaceV3` over :func:`normalized_interface` (refusals alike for every version)."""
    try:
        interface = obj.__cuda_array_interface__
    except Exception as exc:  # noqa: BLE001 - an exporter's property may raise anything
        raise fail(ValueError, f"{name}: expected a readable __cuda_array_interface__, got {type(obj).__name__} "
                               f"whose property raised {type(exc).__name__}: {exc}") from exc
    normal = normalized_interface(name, interface)
    return obj if normal is interface else _InterfaceV3(normal, obj)


def _device_view(name: str, obj: Any, stream_ptr: int) -> ArrayView:
    try:
        from cuda.core.utils import StridedMemoryView
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise BackendUnavailableError(
            f"kv-canary: {name} is a CUDA array, and viewing it needs cuda-core: "
            "pip install 'cuda-core[cu13]' ('cuda-core[cu12]' for CUDA 12; in the checkout, the .[cuda13], .[cuda12] "
            "or .[numba] extra)"
        ) from exc
    if stream_ptr == -1 and _is_jax(obj):
        # JAX hands -1 to the driver as a stream handle (CUDA_ERROR_INVALID_HANDLE): order on the legacy
        # default stream instead, which waits for JAX's pending writes without a host sync.
        stream_ptr = 1
    target = obj
    if not (hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__")):
        target = interface_target(name, obj)  # cuda.core's own rule for taking the CUDA Array Interface
    try:
        smv = StridedMemoryView.from_any_interface(target, stream_ptr=stream_ptr)
        ptr, shape, raw_strides = int(smv.ptr), tuple(int(n) for n in smv.shape), smv.strides
        dtype, device_id, readonly = np.dtype(smv.dtype), int(smv.device_id), bool(smv.readonly)
    except Exception as exc:  # noqa: BLE001 - sorted below
        # cuda.core raises SystemError on negative strides (a flipped CuPy array), and an exporter may refuse
        # them itself: word that as the host path does, whatever was raised.
        declared = _declared_strides(obj)
        if declared and min(declared) < 0:
            raise negative_strides(name, declared) from exc
        if isinstance(exc, (BufferError, TypeError, ValueError, SystemError)):
            raise fail(ValueError, f"{name}: expected an array viewable through DLPack or the CUDA Array Interface, "
                                   f"got {type(obj).__name__} that refused: {type(exc).__name__}: {exc}") from exc
        # e.g. the CUDA driver library missing on this machine
        raise BackendUnavailableError(f"kv-canary: {name}: a CUDA array needs a working CUDA driver to be viewed, "
                                      f"got {type(exc).__name__}: {exc}") from exc
    if raw_strides is None:
        strides, acc = [], 1
        for n in reversed(shape):
            strides.append(acc)
            acc *= max(n, 1)
        strides = tuple(reversed(strides))
    else:
        # cuda.core reports a negative byte stride as its unsigned 64-bit pattern divided by the item size (a
        # flipped CuPy array views with stride 2**61 - 1): undo that, so a flip is named as one.
        itemsize = dtype.itemsize or 1
        strides = tuple(((int(s) * itemsize) - (1 << 64)) // itemsize if int(s) * itemsize >= 1 << 63 else int(s)
                        for s in raw_strides)
    if strides and min(strides) < 0:
        raise negative_strides(name, strides)
    allocated_on = numba_device(obj)
    if allocated_on is not None:
        # The CUDA Array Interface names no device, and the viewer falls back on the current one: a Numba array
        # on cuda:1 viewed while cuda:0 is current would launch on the wrong device. Its allocation knows.
        device_id = allocated_on
    return ArrayView(
        name=name,
        ptr=ptr,
        shape=shape,
        strides=strides,
        dtype=dtype,
        device_id=device_id,
        readonly=readonly or _is_jax(obj),
        owner=obj,
    )


def numba_device(obj: Any) -> int | None:
    """The device of a Numba device array's allocation (its context's device), or ``None`` for other objects."""
    if not type(obj).__module__.startswith("numba"):
        return None
    device = getattr(getattr(getattr(obj, "gpu_data", None), "context", None), "device", None)
    return int(device.id) if device is not None and hasattr(device, "id") else None


def _declared_strides(obj: Any) -> tuple[int, ...] | None:
    """Element strides an exporter states without exporting anything (CUDA Array Interface, or the
    ``strides`` / ``stride()`` of CuPy, Numba and torch arrays); ``None`` when it states none."""
    try:
        cai = getattr(obj, "__cuda_array_interface__", None)
        if isinstance(cai, dict) and cai.get("strides") is not None:
            itemsize = np.dtype(cai["typestr"]).itemsize
            return tuple(int(s) // itemsize for s in cai["strides"])
        if library_of(obj) == "torch":
            return tuple(int(s) for s in obj.stride())
        strides, itemsize = getattr(obj, "strides", None), getattr(obj, "itemsize", None)
        if strides is not None and itemsize:
            return tuple(int(s) // int(itemsize) for s in strides)
    except Exception:  # noqa: BLE001 - only a diagnosis: the caller words a generic refusal instead
        return None
    return None


def check_layout(obj: Any, name: str) -> None:
    """Refuse torch tensors that are not dense (sparse, MKLDNN...): they have no data pointer and no strides."""
    if type(obj).__module__ == "torch" and "torch" in sys.modules:
        layout = getattr(obj, "layout", None)
        if layout is not None and layout is not sys.modules["torch"].strided:
            raise fail(ValueError, f"{name}: expected a dense tensor (layout torch.strided), got layout {layout}: "
                                   f"pass tensor.to_dense()")


_TORCH_DTYPES: dict = {}


def fast_device_view(obj: Any, name: str, launch_stream: int, ordered_lib: str | None) -> ArrayView | None:
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
        strides = tuple(s // itemsize for s in obj.strides)
        if strides and min(strides) < 0:
            raise negative_strides(name, strides)
        return ArrayView(name, obj.data.ptr, obj.shape, strides, obj.dtype, dev, False, obj)
    if module == "torch" and type(obj).__name__ == "Tensor" and obj.is_cuda:
        torch = sys.modules["torch"]
        if not _TORCH_DTYPES:
            _TORCH_DTYPES.update({torch.int64: np.dtype(np.int64), torch.int32: np.dtype(np.int32)})
        dtype = _TORCH_DTYPES.get(obj.dtype)
        dev = obj.device.index
        if dtype is None or (ordered_lib != "torch" and torch.cuda.current_stream(dev).cuda_stream != launch_stream):
            return None
        try:
            return ArrayView(name, obj.data_ptr(), tuple(obj.shape), tuple(obj.stride()), dtype, dev, False, obj)
        except RuntimeError:  # a sparse or other non-strided tensor: the general path words the refusal
            return None
    return None


_IDENTITY_KIND: dict = {}  # type -> 1 (CuPy ndarray), 2 (torch Tensor), 0 (neither): decided once per type


def identity(obj: Any) -> tuple | None:
    """``(data pointer, shape, dtype)`` of a CuPy array or torch tensor, read cheaply; ``None`` for other types.

    Lets a caller that keeps static step buffers (as CUDA-graph engines do) reuse last call's view of the same
    object: same object, same pointer, same shape and dtype means the same view (the dtype too: an array may be
    int32 or int64, SPEC 2 (*), and a launch or graph bakes in the width it read).
    """
    t = type(obj)
    kind = _IDENTITY_KIND.get(t)
    if kind is None:
        module, name = t.__module__, t.__name__
        kind = _IDENTITY_KIND[t] = (1 if module.startswith("cupy") and name == "ndarray"
                                    else 2 if module == "torch" and name == "Tensor" else 0)
    if kind == 1:
        return obj.data.ptr, obj.shape, obj.dtype
    if kind == 2:
        try:
            return obj.data_ptr(), obj.shape, obj.dtype
        except RuntimeError:  # no storage (a sparse tensor): never cached, as_view refuses it
            return None
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
        fast = fast_device_view(obj, name, launch_stream, ordered_lib)
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
    check_layout(obj, name)
    try:
        dev = _dlpack_device(obj)
    except (ValueError, TypeError, RuntimeError) as exc:  # e.g. torch's meta device
        raise fail(ValueError, f"{name}: expected host or CUDA memory, got {type(obj).__name__} whose DLPack device "
                               f"is unknown: {exc}") from exc
    if dev is not None and dev[0] in (_DLPACK_CPU, _DLPACK_CUDA_HOST):
        try:
            arr = np.from_dlpack(obj) if dev[0] == _DLPACK_CPU else _pinned_host(obj)
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


def _pinned_host(obj: Any) -> np.ndarray:
    """A NumPy view of pinned host memory (DLPack device kDLCUDAHost: a CPU engine on a machine with a GPU pins
    its buffers, as transformers does): exported for the CPU where the producer can (NumPy 2.1's ``device=``),
    else through ``__array__`` (torch's, a view of a CPU tensor's memory)."""
    try:
        return np.from_dlpack(obj, device="cpu")
    except (BufferError, TypeError, ValueError, RuntimeError):
        arr = np.asarray(obj)
        if arr.size and getattr(obj, "data_ptr", None) is not None and arr.ctypes.data != obj.data_ptr():
            raise BufferError("a copy, not a view") from None
        return arr


# The integer arrays an engine keeps in either width (SPEC 2 (*)): check_view's dtype=INT_WIDTHS.
INT_WIDTHS = (np.dtype(np.int32), np.dtype(np.int64))


def check_view(
    view: ArrayView,
    *,
    dtype: np.dtype | type | tuple,
    ndim: int,
    length: int | None = None,
    writable: bool = False,
) -> ArrayView:
    """Enforce dtype (no silent casts; a tuple of dtypes: any one of them, native byte order), rank, leading
    length, unit inner stride and writability."""
    if isinstance(dtype, tuple):
        allowed = tuple(np.dtype(d) for d in dtype)
        want = view.dtype if view.dtype in allowed else None
        if want is None:
            names = " or ".join(d.name for d in allowed)
            native = any(view.dtype.name == d.name for d in allowed)
            got = view.dtype.name if not native else f"{view.dtype.str} (non-native byte order)"
            raise fail(TypeError, f"{view.name}: expected dtype {names}, got {got}")
    else:
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
        raise fail(ValueError, f"{view.name}: expected a writable output array, got a read-only one"
                               f"{_readonly_reason(view)}")
    return view


def _dlpack_versioned(obj: Any) -> bool:
    """Whether ``obj.__dlpack__`` hands out a versioned capsule (DLPack >= 1.0, which carries a read-only flag).

    Asked only to explain a refusal: the capsule made here is never consumed, and its exporter frees it.
    """
    import ctypes

    try:
        capsule = obj.__dlpack__(max_version=(1, 0))
    except Exception:  # noqa: BLE001 - TypeError from exporters without max_version, anything else alike
        return False
    get_name = ctypes.pythonapi.PyCapsule_GetName
    get_name.restype, get_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
    try:
        return get_name(capsule) == b"dltensor_versioned"
    except Exception:  # noqa: BLE001 - not a capsule at all
        return False


def _readonly_reason(view: ArrayView) -> str:
    """Why a view is read-only, when that is not the caller's own flag (appended to the refusal)."""
    owner = view.owner
    if _is_jax(owner):
        return " (JAX arrays are immutable: pass a CuPy, torch, Numba or NumPy array)"
    if view.host is None or isinstance(owner, np.ndarray) or not hasattr(owner, "__dlpack__"):
        return ""
    if _dlpack_versioned(owner):
        return ""  # the exporter itself flagged the memory read-only
    return (f" (it came through an unversioned DLPack capsule: {type(owner).__name__}.__dlpack__ hands out no "
            "DLPack >= 1.0 capsule, and an unversioned one carries no writable flag, so NumPy imports it read-only; "
            "pass an object whose __dlpack__ supports max_version >= (1, 0), or the NumPy, CuPy or torch array "
            "itself)")


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
