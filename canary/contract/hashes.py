"""The canary's hashes (SPEC 4): ``splitmix64``, ``mix3``, the chain anchor, and the affine chain ``link``.

The chain is an affine recurrence over the prime field ``P = 2**61 - 1``: a record's link is
``TAG | (A * h + g(token, position)) mod P`` where ``h`` is the field value of its stored ``prev_hash``.
Affine maps compose, so a request's chain is a parallel scan (the write kernels scan it per request).

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

# Chain anchor: the key of g (the chain's token / position mix) and, through it, of link(-1), the predecessor
# hash of a request's first token (SPEC 4). SGLang's value; the chain it anchors is no longer SGLang's.
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


# The affine chain (SPEC 4). A chain value is TAG | h with h in [0, P): bit 62 set, bits 61 and 63 clear.
FIELD_P = (1 << 61) - 1
CHAIN_TAG = 1 << 62
CHAIN_MUL = 0x1E5F3A9C7B2D4861  # A: odd, in (1, P)
G_KEY = int(splitmix64(CHAIN_ANCHOR)) & MASK64  # g's first splitmix64, of the anchor: a constant
NOT_A_LINK = 0  # link() of a record whose prev_hash is no chain value (a never-written record among them)

ANCHOR_LINK = to_signed(CHAIN_TAG | (G_KEY % FIELD_P))
"""``link(-1) = TAG | (splitmix64(CHAIN_ANCHOR) mod P)`` as an int64 bit pattern: the ``prev_hash`` of position 0."""

_P = np.uint64(FIELD_P)
_TAG = np.uint64(CHAIN_TAG)
_S29, _S32, _S61 = np.uint64(29), np.uint64(32), np.uint64(61)
_LO32 = np.uint64(0xFFFF_FFFF)
_LO29 = np.uint64((1 << 29) - 1)


def reduce_p(x: np.ndarray) -> np.ndarray:
    """``x mod P`` of uint64 ``x`` (exact, vectorized): ``2**61 = 1`` mod P folds the top three bits once."""
    return _fold_inplace((x & _P) + (x >> _S61))


def mulmod_p(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a * b mod P`` for uint64 ``a, b < 2**61``, exact, from 32-bit limbs (NumPy has no 128-bit product).

    ``a = a1 2**32 + a0``: the product is ``8 a1 b1 + (a1 b0 + a0 b1) 2**32 + a0 b0`` mod P (``2**64 = 8``);
    the middle term ``m`` splits as ``m = m1 2**29 + m0``, ``m 2**32 = m1 + m0 2**32`` mod P. Every partial is
    below ``2**62``, so their sum fits a uint64 before the last two folds.
    """
    a0, a1 = a & _LO32, a >> _S32
    b0, b1 = b & _LO32, b >> _S32
    mid = a1 * b0 + a0 * b1
    low = a0 * b0
    s = (a1 * b1 << np.uint64(3)) + (mid >> _S29) + ((mid & _LO29) << _S32) + (low & _P) + (low >> _S61)
    return reduce_p((s & _P) + (s >> _S61))


def chain_field(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(h, valid)`` of uint64 chain values ``v = TAG | h``: valid iff bits 63..61 are ``010`` and ``h < P``."""
    h = v & _P
    return h, ((v >> _S61) == np.uint64(2)) & (h != _P)


def chain_g_u64(token: Any, position: Any) -> np.ndarray:
    """``g(t, p) = mix3(CHAIN_ANCHOR, t, p) mod P = s(s(G_KEY ^ t) ^ p) mod P`` on broadcast bit patterns, as
    uint64 in ``[0, P)``."""
    ut, up = np.broadcast_arrays(as_u64(token), as_u64(position))
    v = ut.copy()
    v ^= np.uint64(G_KEY)
    splitmix64_inplace(v)
    v ^= up
    splitmix64_inplace(v)
    return _fold_inplace((v & _P) + (v >> _S61))


def _fold_inplace(r: np.ndarray) -> np.ndarray:
    """``r mod P`` for ``r < 2P`` (one subtraction), in place where ``r`` is an array."""
    if isinstance(r, np.ndarray) and r.ndim:
        # min(r, r - P): r - P wraps above r exactly when r < P. Branch-free (a masked subtract is 10x slower
        # on mixed masks); array ufuncs wrap silently.
        return np.minimum(r, r - _P, out=r)
    return r - np.where(r >= _P, _P, np.uint64(0))


_A0 = np.uint64(CHAIN_MUL & 0xFFFF_FFFF)
_A1 = np.uint64(CHAIN_MUL >> 32)
_A1X8 = np.uint64((CHAIN_MUL >> 32) * 8)


def _mul_a(h: np.ndarray) -> np.ndarray:
    """``A * h mod P`` for uint64 ``h < 2**61`` (overwritten): :func:`mulmod_p` with the constant's limbs
    precomputed and the partials summed in place (the verify's hot path in the reference)."""
    h1 = h >> _S32
    h &= _LO32
    mid = h * _A1
    mid += h1 * _A0
    h *= _A0
    h1 *= _A1X8
    h1 += mid >> _S29
    mid &= _LO29
    mid <<= _S32
    h1 += mid
    h1 += h >> _S61
    h &= _P
    h1 += h
    h1 = (h1 & _P) + (h1 >> _S61)
    return _fold_inplace(h1)


def chain_step_u64(prev_hash: Any, token: Any, position: Any) -> np.ndarray:
    """``link`` of records ``(token, position, prev_hash)`` as uint64: ``TAG | (A h + g) mod P`` where
    ``prev_hash = TAG | h`` with ``h < P``, else :data:`NOT_A_LINK` (0: no write ever stores it)."""
    g = chain_g_u64(token, position)
    ph, g = np.broadcast_arrays(as_u64(prev_hash), g)
    h, valid = chain_field(ph)
    v = _mul_a(np.where(valid, h, np.uint64(0)))
    v += g
    v = _fold_inplace(v)
    v |= _TAG
    return np.where(valid, v, np.uint64(NOT_A_LINK))


def link(slot: Any, prev_hash: Any, token: Any, position: Any) -> np.ndarray:
    """The chain hash a successor of ``slot`` must store as its ``prev_hash`` (SPEC 4), broadcasting.

    ``prev_hash``, ``token``, ``position`` are the fields stored at ``slot`` (the caller gathers them; their
    values are ignored where ``slot < 0``). ``link(slot) = TAG | (A h + g(token, position)) mod P`` when the
    stored ``prev_hash`` is a chain value ``TAG | h`` (``h < P``), else ``NOT_A_LINK`` (0: a never-written
    record's link, which no write stores after a chain value); a negative slot (``-1``: no predecessor) gives
    :data:`ANCHOR_LINK`. Returns int64 bit patterns.
    """
    s = np.asarray(slot)
    if s.dtype.kind not in "iu":
        raise TypeError(f"kv-canary: link: expected integer slots, got dtype {s.dtype}")
    h = chain_step_u64(prev_hash, token, position).view(np.int64)
    h, s = np.broadcast_arrays(h, s)
    return np.where(s < 0, np.int64(ANCHOR_LINK), h)


def chain_values(head: Any, counts: Any, token: Any, position: Any) -> np.ndarray:
    """The write's running hashes of many requests at once (a vectorized scan; no loop per token).

    ``head`` ``[R]``: each request's first running hash (``link(seed)``, int64 bit patterns); ``counts`` ``[R]``:
    its number of chain-advancing entries; ``token`` / ``position`` ``[sum(counts)]``: those entries, request by
    request. Returns uint64 ``[sum(counts + 1)]``: request ``r``'s running hashes before each of its entries and
    after the last, at ``base[r] .. base[r] + counts[r]`` with ``base = cumsum(counts + 1) - (counts + 1)``. A
    head that is no chain value (``NOT_A_LINK`` or damage) keeps the whole request at ``NOT_A_LINK``, as
    repeated ``link`` would. Log-step (Hillis-Steele) scan of affine maps ``h -> a h + b`` over ``[0, P)``:
    every request starts with a constant map (``a = 0``), so no segment flags are needed.
    """
    head_u = as_u64(head).reshape(-1)
    counts = np.asarray(counts, dtype=np.int64).reshape(-1)
    nreq = counts.shape[0]
    total = int(counts.sum()) + nreq
    base = np.cumsum(counts + 1) - (counts + 1)
    a = np.full(total, np.uint64(CHAIN_MUL))
    b = np.empty(total, dtype=np.uint64)
    h0, ok = chain_field(head_u)
    a[base] = 0
    b[base] = np.where(ok, h0, 0)
    step = np.ones(total, dtype=bool)
    step[base] = False
    b[step] = chain_g_u64(token, position).reshape(-1)
    d = 1
    longest = int(counts.max(initial=0)) + 1  # a request's own run: after that, its head's constant absorbs all
    while d < longest:
        a_hi, b_hi = a[d:], b[d:]
        na = mulmod_p(a_hi, a[:-d])
        nb = reduce_p(mulmod_p(a_hi, b[:-d]) + b_hi)
        a[d:], b[d:] = na, nb
        d *= 2
    out = b | _TAG
    owner = np.repeat(np.arange(nreq), counts + 1)
    out[~ok[owner]] = np.uint64(NOT_A_LINK)
    return out
