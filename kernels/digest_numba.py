"""The block digest for Numba CUDA: the twin of ``kernels/digest.cu`` (SPEC 4.2, docs/records.md 12).

Same kernels, same names, same structure as digest.cu: work items ``(block, layer, kind, split)`` taken by the
grid's blocks in turn; per item the head keys in shared memory, then every thread walks its units (token, head,
16-byte vector) by adding the stride's digits with carries, ``DIGEST_UNROLL`` at a time, and the block's sum goes
to the scratch with one atomic; the grid's last block writes the outputs and zeroes the scratch. NumPy reference:
``canary/backends/reference/digest.py``.

Deliberate differences from digest.cu (argument passing and speed only; the outputs are the same bytes):

- Arguments are arrays and scalars instead of one by-value struct, in the struct's order (``DIGEST_ARGS``). The
  tensors arrive as a tuple ``layer_words`` of flat ``uint64`` word arrays (kind ``k`` of layer ``l`` at ``l *
  num_kinds + k``; compiled once per tuple length), their layout per kind as an int64 descriptor ``kp`` (strides
  in words), the block arrays as int32 words (two an element for an int64 array: ``index_wide``), ``count_out`` as
  an int32 and an int64 array (the one ``index_wide`` names is written), absent arrays as one-element dummies
  with a flag.
- A vector's two words are read one at a time (digest.cu: one 16-byte load); the block sums run through shared
  memory (digest.cu shuffles within warps first, which the simulator lacks).
- The block size is a constant the kernels close over (the simulator runs the same code with small blocks).
"""
from __future__ import annotations

import functools
import inspect

import numpy as np
from numba import cuda, int32, int64, uint64

from canary.contract import kernel_constants as _K
from canary.contract.kernel_constants import (
    DIGEST_BAD_PAGE, DIGEST_BAD_RANGE, DIGEST_DIFFERS, DIGEST_EXPECTED_BAD, DIGEST_LANE_BITS, DIGEST_MAX_HEADS,
    DIGEST_MAX_KINDS, DIGEST_SCRATCH_HEAD_WORDS, DIGEST_THREADS, DIGEST_UNROLL, DIGEST_WIDE_BLOCK_LENS,
    DIGEST_WIDE_BLOCK_POSITIONS, DIGEST_WIDE_COUNT_OUT, DIGEST_WIDE_KV_INDICES, DIGEST_WIDE_KV_INDPTR,
)

# u64 constants: a Python int would make Numba mix int64 into u64 arithmetic (float64 promotion).
KEY0 = np.uint64(_K.DIGEST_KEY0)
LANE_MUL = np.uint64(_K.DIGEST_LANE_MUL)
BAD = np.uint64(_K.BAD_DIGEST)
LANE_SHIFT = np.uint64(DIGEST_LANE_BITS)
U0 = np.uint64(0)
U1 = np.uint64(1)
U2 = np.uint64(2)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S27 = np.uint64(27)
_S30 = np.uint64(30)
_S31 = np.uint64(31)

# The layout per kind, ``kp[k * KP_FIELDS + field]`` (int64; strides in u64 words).
KP_HEADS, KP_HEAD_VECS, KP_PAGE_STRIDE, KP_TOKEN_STRIDE, KP_HEAD_STRIDE = range(5)
KP_FIELDS = 5

_AU64, _AI64, _AI32, _AU8, _I64 = "uint64[::1]", "int64[::1]", "int32[::1]", "uint8[::1]", "int64"
DIGEST_ARGS = (
    ("num_layers", _I64), ("num_kinds", _I64), ("layer_offset", _I64), ("head_offset", _I64),
    ("layer_words", "UniTuple(uint64[::1], {})"), ("num_pages", _I64), ("page_size", _I64), ("kp", _AI64),
    ("kv_indptr", _AI32), ("kv_indices", _AI32), ("block_positions", _AI32), ("block_lens", _AI32),
    ("has_block_lens", _I64), ("num_blocks", _I64), ("nnz", _I64), ("index_wide", _I64), ("splits", _I64),
    ("out", _AU64), ("status_out", _AU8), ("has_status", _I64), ("expected", _AU64), ("mismatch", _AU8),
    ("count32", _AI32), ("count64", _AI64), ("scratch", _AU64), ("scratch_blocks", _I64),
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
def head_key(layer_kind, head):
    """``mix3(DIGEST_ANCHOR, 2 l + k, h) = s(s(DIGEST_KEY0 ^ (2 l + k)) ^ h)``."""
    return splitmix64(splitmix64(KEY0 ^ layer_kind) ^ head)


def _jit_options(threads: int) -> dict:
    try:
        takes = "launch_bounds" in inspect.signature(cuda.jit).parameters
    except (TypeError, ValueError):  # pragma: no cover
        takes = False
    return {"launch_bounds": (int(threads),)} if takes else {}


@functools.lru_cache(maxsize=None)
def kernel_functions(threads: int = DIGEST_THREADS):
    """The plain Python kernels ``(canary_digest, canary_digest_check)`` for a block size (a power of two)."""
    T = int(threads)  # noqa: N806
    if T < 1 or T & (T - 1):
        raise ValueError(f"threads: expected a power of two, got {T}")
    UNROLL = DIGEST_UNROLL  # noqa: N806

    @cuda.jit(device=True)
    def block_sum(v):
        """The block's wrapping sum of one value per thread, in every thread (a tree through shared memory)."""
        part = cuda.shared.array(T, uint64)
        t = cuda.threadIdx.x
        part[t] = v
        cuda.syncthreads()
        d = T // 2
        while d > 0:
            if t < d:
                part[t] = part[t] + part[t + d]
            cuda.syncthreads()
            d //= 2
        total = part[0]
        cuda.syncthreads()  # the next call rewrites part
        return total

    def make(check: bool):
        def kernel(num_layers, num_kinds, layer_offset, head_offset, layer_words, num_pages, page_size, kp,
                   kv_indptr, kv_indices, block_positions, block_lens, has_block_lens, num_blocks, nnz, index_wide,
                   splits, out, status_out, has_status, expected, mismatch, count32, count64, scratch,
                   scratch_blocks):
            keys = cuda.shared.array(DIGEST_MAX_HEADS, uint64)
            last = cuda.shared.array(1, int32)
            tid = cuda.threadIdx.x
            acc_at = int64(DIGEST_SCRATCH_HEAD_WORDS)
            stat_at = acc_at + scratch_blocks
            S = page_size  # noqa: N806
            per_block = num_layers * num_kinds * splits
            items = num_blocks * per_block
            stride = splits * T
            w = int64(cuda.blockIdx.x)
            while w < items:
                split = w % splits
                t = w // splits
                k = t % num_kinds
                t //= num_kinds
                lay = t % num_layers
                b = t // num_layers
                lo = load_int(kv_indptr, index_wide & DIGEST_WIDE_KV_INDPTR, b)
                hi = load_int(kv_indptr, index_wide & DIGEST_WIDE_KV_INDPTR, b + 1)
                ok = lo >= 0 and hi >= lo and hi <= nnz
                cap = (hi - lo) * S if ok else int64(0)
                n = load_int(block_lens, index_wide & DIGEST_WIDE_BLOCK_LENS, b) if has_block_lens != 0 else cap
                ok = ok and n >= 0 and n <= cap
                if not ok:
                    if tid == 0 and w % per_block == 0:
                        cuda.atomic.or_(scratch, stat_at + b, uint64(DIGEST_BAD_RANGE))
                elif n > 0:
                    H = kp[k * KP_FIELDS + KP_HEADS]  # noqa: N806
                    V = kp[k * KP_FIELDS + KP_HEAD_VECS]  # noqa: N806
                    ps = kp[k * KP_FIELDS + KP_PAGE_STRIDE]
                    ts = kp[k * KP_FIELDS + KP_TOKEN_STRIDE]
                    hs = kp[k * KP_FIELDS + KP_HEAD_STRIDE]
                    layer_kind = uint64(2) * uint64(layer_offset + lay) + uint64(k)
                    h = int64(tid)
                    while h < H:
                        keys[h] = head_key(layer_kind, uint64(head_offset + h))
                        h += T
                    cuda.syncthreads()
                    words = layer_words[lay * num_kinds + k]
                    pos0 = uint64(load_int(block_positions, index_wide & DIGEST_WIDE_BLOCK_POSITIONS, b))
                    # digest.cu's unit_step and digest_share: the stride's digits, then the walk with carries.
                    dr = stride // V
                    dv = stride % V
                    dh = dr % H
                    dj = dr // H
                    djo = dj % S
                    djp = dj // S
                    u0 = split * T + tid
                    v = u0 % V
                    h = (u0 // V) % H
                    j = u0 // V // H
                    jo = j % S
                    jp = j // S
                    acc = U0
                    bad = False
                    while j < n:
                        for _ in range(UNROLL):
                            if j < n:
                                page = load_int(kv_indices, index_wide & DIGEST_WIDE_KV_INDICES, lo + jp)
                                if page >= 0 and page < num_pages:
                                    at = page * ps + jo * ts + h * hs + 2 * v
                                    key = keys[h] + (((pos0 + uint64(j)) << LANE_SHIFT) + U2 * uint64(v)) * LANE_MUL
                                    acc += splitmix64(words[at] ^ key) + splitmix64(words[at + 1] ^ (key + LANE_MUL))
                                else:
                                    bad = True
                                v += dv
                                c = 0
                                if v >= V:
                                    v -= V
                                    c = 1
                                h += dh + c
                                c = 0
                                if h >= H:
                                    h -= H
                                    c = 1
                                j += dj + c
                                jo += djo + c
                                if jo >= S:
                                    jo -= S
                                    jp += 1
                                jp += djp
                    if bad:
                        cuda.atomic.or_(scratch, stat_at + b, uint64(DIGEST_BAD_PAGE))
                    total = block_sum(acc)  # its barriers also end this item's reads of keys
                    if tid == 0 and total != U0:
                        cuda.atomic.add(scratch, acc_at + b, total)
                w += cuda.gridDim.x

            cuda.threadfence()
            cuda.syncthreads()
            if tid == 0:
                done = cuda.atomic.add(scratch, 0, U1)
                last[0] = 1 if done == uint64(cuda.gridDim.x - 1) else 0
            cuda.syncthreads()
            if last[0] == 0:
                return
            cuda.threadfence()
            flagged = U0
            b = int64(tid)
            while b < num_blocks:
                a = cuda.atomic.exch(scratch, acc_at + b, U0)
                st = cuda.atomic.exch(scratch, stat_at + b, U0)
                d = BAD if st != U0 else a
                if check:
                    e = expected[b]
                    f = st
                    if d != e:
                        f |= uint64(DIGEST_DIFFERS)
                    if e == BAD:
                        f |= uint64(DIGEST_EXPECTED_BAD)
                    mismatch[b] = f
                    if f != U0:
                        flagged += U1
                else:
                    out[b] = d
                    if has_status != 0:
                        status_out[b] = st
                b += T
            if check:
                count = block_sum(flagged)
                if tid == 0:
                    if index_wide & DIGEST_WIDE_COUNT_OUT:
                        count64[0] = int64(count)
                    else:
                        count32[0] = int32(count)
            if tid == 0:
                cuda.atomic.exch(scratch, 0, U0)

        kernel.__name__ = kernel.__qualname__ = "canary_digest_check" if check else "canary_digest"
        return kernel

    return make(False), make(True)


@functools.lru_cache(maxsize=None)
def digest_kernels(num_arrays: int, threads: int = DIGEST_THREADS):
    """``(canary_digest, canary_digest_check)`` compiled eagerly for a ``layer_words`` tuple of ``num_arrays``
    arrays (``num_layers * num_kinds``) and a block size."""
    assert DIGEST_MAX_KINDS == 2
    sig = "void({})".format(", ".join(ty.format(int(num_arrays)) for _, ty in DIGEST_ARGS))
    compute, check = kernel_functions(int(threads))
    return (cuda.jit(sig, **_jit_options(threads))(compute), cuda.jit(sig, **_jit_options(threads))(check))
