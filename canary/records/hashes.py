"""The canary's 64-bit hashes (SPEC 4): ``splitmix64``, the 3-input chain step ``mix3``, the chain anchor, ``link``.

All arithmetic is unsigned 64-bit with wraparound; values are exchanged as **int64 bit patterns** (the canary
buffer and the violation ring are int64), so every function takes integers of any NumPy integer dtype (or
Python ints, masked to 64 bits) and returns an ``int64`` ndarray of the broadcast shape (0-d for scalars;
``int(...)`` gives a Python int). Vectorized: no Python loop per element.

The CUDA and Numba twins compute exactly the same bits with ``unsigned long long`` / ``uint64`` arithmetic;
``tests/records/test_hashes.py`` pins the definitions with frozen vectors.
"""
from __future__ import annotations

from typing import Any

import numpy as np

MASK64 = 0xFFFF_FFFF_FFFF_FFFF

# Chain anchor: the predecessor hash of a request's first token. The constant is kept for format
# compatibility with SGLang canary buffers (SPEC 4): a buffer written by SGLang's canary chains identically.
CHAIN_ANCHOR = 0xC0FFEE1234567890

SPLITMIX64_MUL1 = 0xBF58476D1CE4E5B9
SPLITMIX64_MUL2 = 0x94D049BB133111EB

_M1 = np.uint64(SPLITMIX64_MUL1)
_M2 = np.uint64(SPLITMIX64_MUL2)
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)


def to_signed(value: int) -> int:
    """The int64 bit pattern of an unsigned 64-bit Python int (``value & MASK64``) as a signed Python int."""
    value &= MASK64
    return value - (1 << 64) if value >> 63 else value


def as_u64(x: Any) -> np.ndarray:
    """View integers as uint64 bit patterns (a fresh array; never a float cast, never a Python loop over arrays).

    Signed values are sign-extended to 64 bits first (an int32 -1 becomes ``2**64 - 1``, as the int64 -1 does).
    Python ints are masked to 64 bits. Raises ``TypeError`` for non-integer input.
    """
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        return np.array(int(x) & MASK64, dtype=np.uint64)
    a = np.asarray(x)
    if a.dtype == np.uint64:
        return a.copy()
    if a.dtype.kind in "iu":
        return a.astype(np.int64).view(np.uint64)
    if a.dtype == object:
        flat = [int(v) & MASK64 for v in a.ravel()]  # lists of Python ints beyond int64: rare, host only
        return np.array(flat, dtype=np.uint64).reshape(a.shape)
    raise TypeError(f"kv-canary: hash input: expected integers, got dtype {a.dtype}")


def splitmix64_inplace(v: np.ndarray) -> np.ndarray:
    """``v`` is a uint64 ndarray, updated in place. Array ufuncs wrap silently (only NumPy scalars warn on
    overflow), so no errstate: entering one costs more than a small array's whole hash in the write chain."""
    if not isinstance(v, np.ndarray):
        with np.errstate(over="ignore"):
            return _splitmix64_steps(v)
    return _splitmix64_steps(v)


def _splitmix64_steps(v):
    v ^= v >> _S30
    v *= _M1
    v ^= v >> _S27
    v *= _M2
    v ^= v >> _S31
    return v


def splitmix64_into(v: np.ndarray, tmp: np.ndarray) -> np.ndarray:
    """:func:`splitmix64_inplace` with a caller's scratch array ``tmp`` (same shape) for the shifted copies: no
    allocation, which matters for the reference's large per-step folds (fresh pages cost more than the math)."""
    np.right_shift(v, _S30, out=tmp)
    v ^= tmp
    v *= _M1
    np.right_shift(v, _S27, out=tmp)
    v ^= tmp
    v *= _M2
    np.right_shift(v, _S31, out=tmp)
    v ^= tmp
    return v


def _u64_flat(x: Any) -> tuple[np.ndarray, tuple[int, ...]]:
    a = as_u64(x)
    return a.reshape(-1), a.shape


def splitmix64_u64(x: Any) -> np.ndarray:
    """``splitmix64`` returning uint64 (for chaining without reinterpreting twice)."""
    v, shape = _u64_flat(x)
    return splitmix64_inplace(v).reshape(shape)


def splitmix64(x: Any) -> np.ndarray:
    """SPEC 4: ``x ^= x >> 30; x *= 0xBF58476D1CE4E5B9; x ^= x >> 27; x *= 0x94D049BB133111EB; x ^= x >> 31``.

    (The splitmix64 finalizer alone: no golden-ratio increment, so ``splitmix64(0) == 0``.)
    """
    return splitmix64_u64(x).view(np.int64)


def mix3_u64(a: Any, b: Any, c: Any) -> np.ndarray:
    """``mix3`` on broadcast uint64 bit patterns, returning uint64."""
    ua, ub, uc = np.broadcast_arrays(as_u64(a), as_u64(b), as_u64(c))
    shape = ua.shape
    v = ua.reshape(-1).copy()
    splitmix64_inplace(v)
    v ^= ub.reshape(-1)
    splitmix64_inplace(v)
    v ^= uc.reshape(-1)
    return splitmix64_inplace(v).reshape(shape)


def mix3(a: Any, b: Any, c: Any) -> np.ndarray:
    """The chain step ``mix3(a, b, c) = s(s(s(a) ^ b) ^ c)`` with ``s = splitmix64`` (broadcasting)."""
    return mix3_u64(a, b, c).view(np.int64)


ANCHOR_LINK = to_signed(int(splitmix64(CHAIN_ANCHOR)))
"""``link(-1) = splitmix64(CHAIN_ANCHOR)`` as an int64 bit pattern: the stored ``prev_hash`` of position 0."""


def link(slot: Any, prev_hash: Any, token: Any, position: Any) -> np.ndarray:
    """The chain hash a successor of ``slot`` must store as its ``prev_hash`` (SPEC 4), broadcasting.

    ``prev_hash``, ``token``, ``position`` are the fields stored at ``slot`` (the caller gathers them; their
    values are ignored where ``slot < 0``). ``link(slot) = mix3(prev_hash, token, position)``; a negative slot
    (``-1``: no predecessor) gives :data:`ANCHOR_LINK`. Returns int64 bit patterns.
    """
    s = np.asarray(slot)
    if s.dtype.kind not in "iu":
        raise TypeError(f"kv-canary: link: expected integer slots, got dtype {s.dtype}")
    h = mix3(prev_hash, token, position)
    h, s = np.broadcast_arrays(h, s)
    return np.where(s < 0, np.int64(ANCHOR_LINK), h)
