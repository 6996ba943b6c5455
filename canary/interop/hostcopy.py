"""Copy a (small) caller array, or part of one, to host memory with the array's own library: the status reads of
``check()`` and ``check=True``, the manager's host-side reads and :func:`canary.to_host` (a sync for device
arrays; never on a step's hot path)."""
from __future__ import annotations

from typing import Any

import numpy as np

from .libs import library_of


def to_host(obj: Any) -> np.ndarray:
    """``obj`` as a NumPy array: a NumPy array is returned as it is (no copy), anything else is copied to the host
    with its own library (a sync for device arrays, so never call this on the hot path)."""
    if isinstance(obj, np.ndarray):
        return obj
    module = library_of(obj)
    if module == "torch":
        return obj.detach().cpu().numpy()
    if module == "cupy":
        return obj.get()
    if hasattr(obj, "copy_to_host"):  # numba device arrays
        return obj.copy_to_host()
    dev = getattr(obj, "__dlpack_device__", None)
    if dev is not None and int(dev()[0]) == 1:
        return np.from_dlpack(obj)
    if module in ("jax", "jaxlib"):
        return np.asarray(obj)
    if not hasattr(obj, "__cuda_array_interface__") and dev is None:
        return np.asarray(obj)  # a host object (a list, a scalar): no GPU library to ask, and none needed
    try:
        import cupy

        return cupy.asnumpy(cupy.asarray(obj))
    except ImportError:
        from numba import cuda

        return cuda.as_cuda_array(obj).copy_to_host()


def part_to_host(obj: Any, index: tuple) -> np.ndarray:
    """A NumPy copy of ``obj[index]``, indexed by the array's own library so that only that part is copied.

    Objects that only expose an interface (no indexing of their own) are wrapped zero-copy by CuPy or Numba first.
    """
    if isinstance(obj, np.ndarray):
        return obj[index]
    if not hasattr(obj, "__getitem__"):
        try:
            import cupy

            obj = cupy.asarray(obj)
        except ImportError:
            from numba import cuda

            obj = cuda.as_cuda_array(obj)
    return to_host(obj[index])
