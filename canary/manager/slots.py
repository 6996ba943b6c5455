"""An SWA group's slots for the step's new tokens: ``full_to_swa_index_mapping[out_cache_loc]``, safely.

``after_kv_store`` takes the full pool's slots; a sliding-window group writes its records at the SWA pool's. The
translation follows the plan's ``T`` (SPEC 3.2) on every value an engine may pass: a negative slot (-1: a token
whose KV is not stored, e.g. a padding token) stays as it is, so the write skips it; a slot past the mapping
becomes :data:`OUT_OF_MAPPING`, a slot of no pool, which the write reports as ``SLOT_RANGE`` (docs/records.md).
A plain gather would index the mapping with -1 (NumPy, CuPy: its last entry, a real SWA slot whose record the
write would then overwrite) or past its end (torch: a device-side assert).

Into the group's preallocated ``[max_step_tokens]`` buffer, on the call's launch stream: NumPy and torch through
their own operations, CuPy through one elementwise kernel (no temporary: graph capture allocates nothing).
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import numpy as np

from ..errors import fail
from ..interop.libs import library_of

OUT_OF_MAPPING = 1 << 62  # no pool has this many slots (the write's slot_range check reports it)

_CUPY_KERNEL: Any = None


def _cupy_kernel() -> Any:
    global _CUPY_KERNEL
    if _CUPY_KERNEL is None:
        import cupy

        _CUPY_KERNEL = cupy.ElementwiseKernel(
            "raw int64 lut, int64 n, T loc", "int64 out",  # T: int32 or int64 (one instantiation each, lazily)
            f"const long long s = (long long)loc; out = s < 0 ? s : (s < n ? lut[s] : {OUT_OF_MAPPING}LL)",
            "kv_canary_swa_slots")
    return _CUPY_KERNEL


def translate(lut: Any, loc: Any, out: Any, stream_handle: int) -> Any:
    """``out[:n] = T(loc)`` (module docstring) for ``loc`` ``[n]`` int32 or int64 (SPEC 2 (*)) of the library of
    ``out`` (int64); returns the filled ``out[:n]`` (``loc`` of another array library is viewed zero-copy). Raises
    ``ValueError`` past ``out``'s length (``max_step_tokens``), ``TypeError`` for a ``loc`` of another dtype."""
    n, cap = int(loc.shape[0]), int(out.shape[0])
    if n > cap:
        raise fail(ValueError, f"out_cache_loc: expected at most max_step_tokens = {cap} tokens, got {n}")
    dtype = str(getattr(loc, "dtype", ""))
    if dtype not in ("int64", "torch.int64", "int32", "torch.int32"):
        raise fail(TypeError, f"out_cache_loc: expected dtype int32 or int64 slots, got "
                              f"{dtype or type(loc).__name__}")
    out = out[:n]
    size = int(lut.shape[0])
    module = library_of(out)
    if module == "torch":
        torch = __import__("torch")
        if not isinstance(loc, torch.Tensor):  # another library's device array: a zero-copy view of it
            loc = torch.as_tensor(loc, device=out.device)
        on_device = out.is_cuda
        with torch.cuda.stream(torch.cuda.ExternalStream(stream_handle, device=out.device)) if on_device else \
                nullcontext():
            if size:
                torch.index_select(lut, 0, loc.clamp(0, size - 1), out=out)
            big = torch.full_like(out, OUT_OF_MAPPING)  # int64 whatever loc's width
            out.copy_(torch.where(loc < 0, loc, torch.where(loc < size, out, big)))
    elif module == "cupy":
        cupy = __import__("cupy")
        with cupy.cuda.ExternalStream(stream_handle):
            if not isinstance(loc, cupy.ndarray):  # another library's device array: a zero-copy view of it
                loc = cupy.asarray(loc)
            _cupy_kernel()(lut, size, loc, out)
    elif isinstance(out, np.ndarray):
        loc = np.asarray(loc)
        if size:
            np.take(lut, np.clip(loc, 0, size - 1), out=out)
        np.copyto(out, loc, where=loc < 0)
        out[loc >= size] = OUT_OF_MAPPING
    else:
        raise fail(TypeError, f"out_cache_loc_by_group: expected the SWA group's slots for {type(out).__name__} "
                              f"arrays (the manager translates torch, CuPy and NumPy only)")
    return out


def warmup(lut: Any, out: Any, stream_handle: int) -> None:
    """Compile and load what :func:`translate` launches (CuPy's kernel), so that a step only launches it."""
    if library_of(out) == "cupy":
        cupy = __import__("cupy")
        with cupy.cuda.ExternalStream(stream_handle):
            translate(lut, cupy.full(1, -1, dtype=cupy.int64), out, stream_handle)

