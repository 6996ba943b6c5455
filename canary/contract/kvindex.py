"""The index the attention reads, in its three forms (SPEC 3.8), as rules on host arrays.

The plan reads the raw slot ``R(r, p)`` of batch row ``r`` at position ``p`` through exactly one of:

- ``req_to_token`` ``[max_reqs, max_seq_len]`` int32: ``R = req_to_token[rp, p]`` (``FORM_TOKENS``);
- a block table ``[max_reqs, max_blocks]`` int32 or int64 and ``page_size`` ``S``: the block ``b = block_table[rp, p // S]``
  (``FORM_BLOCKS``);
- a page list, ``kv_indptr`` ``[>= bs + 1]`` int32 / int64 and ``kv_indices`` ``[nnz]`` int32 / int64, and ``S``: the block
  ``b = kv_indices[kv_indptr[r] + p // S]``, rows keyed by batch row (``FORM_PAGES``);

and for both paged forms ``R = 0`` for ``b == 0`` (the padding block: what a 0 of ``req_to_token`` means),
``b * S + p % S`` for ``0 < b <= MAX_BLOCK``, and a bad entry (``BAD_SLOT``, written as -1) for ``b < 0`` or
``b > MAX_BLOCK`` (only an int64 table holds those). Shared by the NumPy
reference, ``check=True``'s row search, the manager's attributions and the tests; the kernels take the form as a
compile-time specialization (its number is ``FORM_*``, generated into ``kernels/canary_constants.cuh``).
"""
from __future__ import annotations

import numpy as np

FORM_TOKENS, FORM_BLOCKS, FORM_PAGES = 0, 1, 2
FORM_NAMES = {FORM_TOKENS: "req_to_token", FORM_BLOCKS: "block_table", FORM_PAGES: "page_list"}
# page_size: a block entry is at most MAX_BLOCK (an int32's range; an int64 table's larger entries are bad ones) and
# a slot b * S + p % S < 2**31 * S must stay far from the int64 sentinels (MISSING_SLOT = -2**62 is negative
# anyway; the bound keeps the slot arithmetic well inside int64).
MAX_PAGE_SIZE = (1 << 31) - 1
MAX_BLOCK = (1 << 31) - 1
# The index arithmetic (kernels: a virtual token index v = key * stride + p, a page v // S by a double
# reciprocal, exact for v < 2**62 and v // S < 2**50): extent * S below the first, extent below the second.
MAX_VIRTUAL = 1 << 62
MAX_EXTENT = 1 << 50
# The bound of req_pool_indices when no table of the plan is indexed by it (a page list without sampling cursors
# or a pool keyed by it): rp only tells active rows from padding.
NO_REQ_BOUND = (1 << 63) - 1
# What a bad block entry reads as in check=True's host search (far past any LUT, never a raw slot: raw slots are
# int32 values or b * S + p % S < 2**62).
BAD_RAW = (1 << 63) - 1


def paged_raw(blocks: np.ndarray, offsets: np.ndarray, page_size: int, padding_slot: int = 0
              ) -> tuple[np.ndarray, np.ndarray]:
    """``(R, bad)`` of block entries ``blocks`` at in-page offsets ``offsets``: ``R`` = 0 for a 0 block,
    ``b * S + offset`` for ``0 < b <= MAX_BLOCK``, -1 for a negative block or one past MAX_BLOCK, which ``bad``
    marks (``BAD_SLOT``, SPEC 3.8). ``blocks`` int32 or int64, read widened (SPEC 2 (*)). ``padding_slot=-1``
    (SPEC 3.2, "No reserved slot"): block 0 is real (``R = offset``) and a negative block is the engine's padding
    marker, ``R = -1`` with no ``bad``; a block past MAX_BLOCK is still bad."""
    b = np.asarray(blocks).astype(np.int64)
    over = b > MAX_BLOCK
    if padding_slot == -1:
        return np.where((b >= 0) & ~over, b * np.int64(page_size) + offsets, np.int64(-1)), over
    bad = (b < 0) | over
    raw = np.where(b > 0, b * np.int64(page_size) + offsets, np.where(bad, np.int64(-1), np.int64(0)))
    return raw, bad


def expand_block_table(block_table: np.ndarray, page_size: int, padding_slot: int = 0) -> np.ndarray:
    """The token table ``[rows, max_blocks * S]`` int64 a block table stands for: ``R`` at every position (-1 at the
    positions of a negative block, which the plan reports as ``BAD_SLOT``, or with ``padding_slot=-1`` as no slot)."""
    bt = np.asarray(block_table)
    rows, blocks = bt.shape
    offsets = np.tile(np.arange(page_size, dtype=np.int64), blocks)
    raw, _ = paged_raw(np.repeat(bt, page_size, axis=1), offsets[None, :], page_size, padding_slot)
    return raw.reshape(rows, blocks * page_size)


def page_rows(kv_indptr: np.ndarray, bs: int, nnz: int, active: np.ndarray, page_size: int,
              max_seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A page list's rows (SPEC 3.8): ``(first, bad_key, row_len)`` per batch row. An active row's key is
    ``lo = kv_indptr[r]``, ``hi = kv_indptr[r + 1]``; ``bad_key`` where ``lo < 0``, ``hi < lo`` or ``hi > nnz``
    (``BAD_REQ_POOL_INDEX``); ``first`` = ``lo`` (0 for a padding row or a bad key); ``row_len`` = ``(hi - lo) * S``,
    the positions the row holds, in place of ``max_seq_len`` in its checks (``max_seq_len`` for a padding row or a
    bad key). Padding rows' entries of ``kv_indptr`` are never looked at."""
    ptr = np.asarray(kv_indptr)[: bs + 1].astype(np.int64)
    lo, hi = ptr[:bs], ptr[1:bs + 1]
    bad_key = active & ((lo < 0) | (hi < lo) | (hi > nnz))
    good = active & ~bad_key
    first = np.where(good, lo, 0)
    row_len = np.where(good, (np.where(good, hi, 0) - first) * np.int64(page_size), np.int64(max_seq_len))
    return first, bad_key, row_len
