"""The Numba backend: the twins of ``kernels/*.cu`` in ``kernels/*_numba.py``, through numba-cuda; ``plan`` and
``records``.

What both share: the install guards (imported only when the backend is requested, ``import canary`` never
imports numba; a numpy that numba-cuda cannot compile under (>= 2.5) and a missing numba-cuda raise
:class:`BackendUnavailableError` with the install command, before anything is compiled), whether Numba's CUDA
simulator runs (``NUMBA_ENABLE_CUDASIM=1``, what CI runs: the "device" is host memory, ``ON_DEVICE`` False),
and zero-copy, non-syncing device arrays over caller pointers.
"""
from __future__ import annotations

import numpy as np

from ...errors import BackendUnavailableError
from ...interop.libs import INSTALL

# numba-cuda 0.30 registers np.row_stack, which numpy 2.5 removed: every kernel compile fails with
# AttributeError. Refuse here, before importing numba or compiling anything (the [numba] extra pins numpy<2.5).
NUMPY_TOO_NEW = (2, 5)


def _version_tuple(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a version string such as ``"2.5.0rc1"`` or ``"2.4.6"``."""
    out = []
    for piece in version.split(".")[:2]:
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        out.append(int(digits or 0))
    while len(out) < 2:
        out.append(0)
    return out[0], out[1]


if _version_tuple(np.__version__) >= NUMPY_TOO_NEW:
    raise BackendUnavailableError(
        f"kv-canary: backend 'numba' cannot run with numpy {np.__version__}: numba-cuda cannot compile kernels "
        f"with numpy >= {NUMPY_TOO_NEW[0]}.{NUMPY_TOO_NEW[1]} (it registers np.row_stack, which numpy 2.5 "
        f"removed): {INSTALL['numba']}"
    )

try:
    from numba import cuda
except ImportError as exc:  # numba, numba-cuda or the CUDA Python bindings missing
    raise BackendUnavailableError(f"kv-canary: backend 'numba' needs numba-cuda ({exc}): {INSTALL['numba']}") from exc


def _simulator_enabled() -> bool:
    try:
        from numba.cuda.core import config  # numba-cuda keeps its own copy of the configuration
    except ImportError:  # pragma: no cover - older numba-cuda
        from numba.core import config
    return bool(config.ENABLE_CUDASIM)


SIMULATOR = _simulator_enabled()
ON_DEVICE = not SIMULATOR

try:
    from numba.cuda.core.errors import NumbaPerformanceWarning as PerformanceWarning
except ImportError:  # pragma: no cover - older numba-cuda
    PerformanceWarning = Warning



def device_array(ptr: int, n: int, dtype, owner=None):
    """A 1-D contiguous Numba device array of ``n`` elements at ``ptr`` in the current context.

    No copy, and no sync: the interface dict has no ``stream`` entry and ``sync=False``.
    """
    dtype = np.dtype(dtype)
    desc = {"shape": (n,), "strides": None, "typestr": dtype.str, "data": (ptr, False), "version": 3}
    return cuda.from_cuda_array_interface(desc, owner=owner, sync=False)


def flat_len(view) -> int:
    """Elements spanned by a 2-D view with unit inner stride: ``(rows - 1) * row_stride + cols``."""
    rows, cols = view.shape
    return 0 if rows == 0 or cols == 0 else (rows - 1) * view.strides[0] + cols
