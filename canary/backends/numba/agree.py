"""Numba launch of ``kernels/agree_numba.py`` (the twin of ``kernels/agree.cu``): a GPU manager's agreement words
of one group (SPEC 4.3, canary/manager/distributed.py). Compiled at construction; a call wraps the step's arrays
(cached by pointer on a GPU, no copy, no sync) and launches on the caller's stream, as :mod:`.records` does.
Under the simulator the arrays are host memory and ``out`` is written in place."""
from __future__ import annotations

import numpy as np

from ...contract.agree_layout import AGREE_THREADS, AGREE_WIDE, agree_grid
from ..sources import numba_kernels
from . import SIMULATOR
from .records import BLOCKS_PER_SM, SIMULATOR_THREADS, Arrays, launch_kernel, load_kernels

agree_numba = numba_kernels("agree_numba")
_WIDE_BITS = tuple(AGREE_WIDE[k] for k in ("slots", "tokens", "positions"))


class AgreeLaunch:
    """As the CuPy backend's :class:`~canary.backends.cupy.agree.AgreeLaunch`; ``threads``: the block size (default:
    the kernel's on a GPU, a small one under the simulator)."""

    def __init__(self, device_id: int, *, plan: tuple, out, threads: int | None = None):
        self.arrays = arr = Arrays(device_id)
        self.threads = int(threads or (SIMULATOR_THREADS if SIMULATOR else AGREE_THREADS))
        self._kernel = agree_numba.agree_kernel(self.threads)
        self._plan = plan
        self._capacity = int(plan[0].shape[0])
        self._out = arr.words(out.ptr, 2, np.uint64, out.owner, out.host)
        self._resident = 2 if SIMULATOR else int(arr.gpu.MULTIPROCESSOR_COUNT) * BLOCKS_PER_SM
        load_kernels(arr, (self._kernel,))

    def launch(self, slots, tokens, positions, stream: int) -> None:
        arr = self.arrays
        n = slots.shape[0]
        wide = sum(bit for bit, v in zip(_WIDE_BITS, (slots, tokens, positions)) if v.dtype.itemsize == 8)
        ps, pt, pp, nv = self._plan
        args = (arr.int_words(slots), arr.int_words(tokens), arr.int_words(positions), n, wide, arr.vector(ps),
                arr.vector(pt), arr.vector(pp), arr.vector(nv), self._capacity, self._out)
        launch_kernel(arr, self._kernel, agree_grid(n, self._capacity, self._resident, self.threads), self.threads,
                      stream, args)
