"""The ranks' agreement words for Numba CUDA: the twin of ``kernels/agree.cu`` (SPEC 4.3). The host formula
(``canary/manager/distributed.py`` ``entries_digest`` / ``plan_digest``) is the reference: the same bits.

Same kernel, same name, same structure as agree.cu: a grid-stride loop over the verify plan's valid entries (their
count read on the device) and over the call's entries with a slot >= 0, each adding ``mix3(slot, token, position ^
salt)``; the block's two sums go to the group's two report-block words with one atomic each (wrapping: any order
gives the same bits).

Deliberate differences from agree.cu (argument passing and speed only; the words are the same bits):

- Arguments are arrays and scalars instead of one by-value struct, in the struct's order (``AGREE_ARGS``). The
  step's entry arrays arrive as int32 words (two an element for an int64 array: ``entry_wide``), absent ones as
  one-element dummies.
- The block sums run through shared memory (agree.cu shuffles within warps first, which the simulator lacks).
- The block size is a constant the kernel closes over (the simulator runs the same code with small blocks).
"""
from __future__ import annotations

import functools
import inspect

import numpy as np
from numba import cuda, int64, uint64

from canary.contract import kernel_constants as _K
from canary.contract.kernel_constants import AGREE_THREADS, AGREE_WIDE_POSITIONS, AGREE_WIDE_SLOTS, AGREE_WIDE_TOKENS

# u64 constants: a Python int would make Numba mix int64 into u64 arithmetic (float64 promotion).
ENTRY_SALT = np.uint64(_K.AGREE_ENTRY_SALT)
PLAN_SALT = np.uint64(_K.AGREE_PLAN_SALT)
MASK63 = np.uint64((1 << 63) - 1)
U0 = np.uint64(0)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S27 = np.uint64(27)
_S30 = np.uint64(30)
_S31 = np.uint64(31)

_AU64, _AI64, _AI32, _I64 = "uint64[::1]", "int64[::1]", "int32[::1]", "int64"
AGREE_ARGS = (
    ("slots", _AI32), ("tokens", _AI32), ("positions", _AI32), ("n", _I64), ("entry_wide", _I64),
    ("plan_slots", _AI64), ("plan_tokens", _AI64), ("plan_positions", _AI64), ("plan_num_valid", _AI32),
    ("plan_capacity", _I64), ("out", _AU64),
)


@cuda.jit(device=True)
def load_int(words, wide, i):
    """Element ``i`` of an int32 array, or of an int64 one given as its int32 words (low word first), as int64."""
    if wide != 0:
        return (int64(words[2 * i]) & int64(0xFFFFFFFF)) | (int64(words[2 * i + 1]) << 32)
    return int64(words[i])


@cuda.jit(device=True)
def splitmix64(x):
    x = x ^ (x >> _S30)
    x = x * _M1
    x = x ^ (x >> _S27)
    x = x * _M2
    return x ^ (x >> _S31)


@cuda.jit(device=True)
def mix3(a, b, c):
    """``s(s(s(a) ^ b) ^ c)`` on uint64."""
    return splitmix64(splitmix64(splitmix64(a) ^ b) ^ c)


def _jit_options(threads: int) -> dict:
    try:
        takes = "launch_bounds" in inspect.signature(cuda.jit).parameters
    except (TypeError, ValueError):  # pragma: no cover
        takes = False
    return {"launch_bounds": (int(threads),)} if takes else {}


@functools.lru_cache(maxsize=None)
def kernel_function(threads: int = AGREE_THREADS):
    """The plain Python kernel ``canary_agree`` for a block size (a power of two)."""
    T = int(threads)  # noqa: N806
    if T < 1 or T & (T - 1):
        raise ValueError(f"threads: expected a power of two, got {T}")

    def canary_agree(slots, tokens, positions, n, entry_wide, plan_slots, plan_tokens, plan_positions,
                     plan_num_valid, plan_capacity, out):
        part = cuda.shared.array((2, T), uint64)
        t = cuda.threadIdx.x
        ws, wt, wp = entry_wide & AGREE_WIDE_SLOTS, entry_wide & AGREE_WIDE_TOKENS, entry_wide & AGREE_WIDE_POSITIONS
        nv = int64(plan_num_valid[0])
        if nv < 0:
            nv = int64(0)
        if nv > plan_capacity:
            nv = plan_capacity
        stride = int64(cuda.gridDim.x) * T
        plan = U0
        entries = U0
        i = int64(cuda.blockIdx.x) * T + t
        while i < nv:
            plan += mix3(uint64(plan_slots[i]) & MASK63, uint64(plan_tokens[i]), uint64(plan_positions[i]) ^ PLAN_SALT)
            i += stride
        i = int64(cuda.blockIdx.x) * T + t
        while i < n:
            slot = load_int(slots, ws, i)
            if slot >= 0:
                entries += mix3(uint64(slot), uint64(load_int(tokens, wt, i)),
                                uint64(load_int(positions, wp, i)) ^ ENTRY_SALT)
            i += stride
        part[0, t] = plan
        part[1, t] = entries
        cuda.syncthreads()
        d = T // 2
        while d > 0:
            if t < d:
                part[0, t] = part[0, t] + part[0, t + d]
                part[1, t] = part[1, t] + part[1, t + d]
            cuda.syncthreads()
            d //= 2
        if t == 0:
            # Adding 0 changes nothing: a block with no share skips its atomics
            if part[0, 0] != U0:
                cuda.atomic.add(out, 0, part[0, 0])
            if part[1, 0] != U0:
                cuda.atomic.add(out, 1, part[1, 0])

    return canary_agree


@functools.lru_cache(maxsize=None)
def agree_kernel(threads: int = AGREE_THREADS):
    """``canary_agree`` compiled eagerly for a block size."""
    sig = "void({})".format(", ".join(ty for _, ty in AGREE_ARGS))
    return cuda.jit(sig, **_jit_options(threads))(kernel_function(int(threads)))
