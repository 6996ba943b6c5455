"""Records that move, for Numba CUDA: the twin of ``kernels/records_move.cu`` (SPEC 4.1, docs/records.md 11).

Same kernels, same names, same structure: ``canary_gather_rows`` and ``canary_scatter_rows``, one thread per
(entry, word) pair, grid-stride; a copy inside the pool is a gather into scratch then a scatter from it, two
launches. NumPy reference: ``canary/backends/reference/move.py``.

Deliberate differences from records_move.cu (argument passing only; the outputs are the same bytes):

- Arguments are arrays and scalars in ``MoveParams``' order (:data:`MOVE_PARAMS`) instead of one struct. The
  records, the layer table and the buffer arrive as flat ``uint64`` word arrays (strides in words; the values are
  only copied, never computed on, so their signedness does not matter), the slot list as its int32 words (two an
  element when ``slots_wide``: records.cu's ``load_int``), and an absent layer table as a one-element dummy with
  ``num_layers = 0``.
- The block size is the constant ``move_kernels`` closes over (the simulator runs the same code with small blocks).
"""
from __future__ import annotations

import functools
import inspect

import numpy as np
from numba import cuda, int64, uint64

from canary.contract.kernel_constants import (
    MOVE_DEST_RANGE, MOVE_SOURCE_RANGE, MOVE_STATUS_FAULTS, MOVE_STATUS_REFUSED, MOVE_THREADS, RECORD_WORDS,
)

U0 = np.uint64(0)
U1 = np.uint64(1)
SOURCE_RANGE = np.uint64(MOVE_SOURCE_RANGE)  # u64, as the status word: no int64 mixed into its atomics
DEST_RANGE = np.uint64(MOVE_DEST_RANGE)

_AU64, _AI32, _I64 = "uint64[::1]", "int32[::1]", "int64"
MOVE_PARAMS = (
    ("records", _AU64), ("num_slots", _I64), ("slot_stride_words", _I64), ("layer_hashes", _AU64),
    ("num_layers", _I64), ("slots", _AI32), ("num_entries", _I64), ("slots_wide", _I64), ("rows", _AU64),
    ("row_stride", _I64), ("status", _AU64),
)
SIGNATURE = "void({})".format(", ".join(ty for _, ty in MOVE_PARAMS))


@cuda.jit(device=True)
def load_int(words, wide, i):
    """records_move.cu's ``load_int``: element ``i`` of an int32 array, or of an int64 one given as its int32 words
    (little-endian: the low word first), as an int64 (SPEC 2 (*))."""
    if wide != 0:
        return (int64(words[2 * i]) & int64(0xFFFFFFFF)) | (int64(words[2 * i + 1]) << 32)
    return int64(words[i])


@cuda.jit(device=True)
def word_at(records, slot_stride_words, layer_hashes, num_layers, s, w):
    """Where word ``w`` of slot ``s``'s row lives: ``(0, index)`` in the records, ``(1, index)`` in the table."""
    if w < RECORD_WORDS:
        return 0, s * slot_stride_words + w
    return 1, s * num_layers + (w - RECORD_WORDS)


@cuda.jit(device=True)
def refuse(status, fault):
    cuda.atomic.or_(status, MOVE_STATUS_FAULTS, fault)
    cuda.atomic.add(status, MOVE_STATUS_REFUSED, U1)


def _jit_options(threads: int) -> dict:
    try:
        takes = "launch_bounds" in inspect.signature(cuda.jit).parameters
    except (TypeError, ValueError):  # pragma: no cover
        takes = False
    return {"launch_bounds": (int(threads),)} if takes else {}


def canary_gather_rows(records, num_slots, slot_stride_words, layer_hashes, num_layers, slots, num_entries,
                       slots_wide, rows, row_stride, status):
    """Any grid: rows[i] = row(slots[i]), a zero row outside [0, num_slots) (records_move.cu)."""
    words = RECORD_WORDS + num_layers
    total = num_entries * words
    j = int64(cuda.blockIdx.x) * cuda.blockDim.x + cuda.threadIdx.x
    stride = int64(cuda.gridDim.x) * cuda.blockDim.x
    while j < total:
        i = j // words
        w = j - i * words
        s = load_int(slots, slots_wide, i)
        if w == 0 and s >= num_slots:
            refuse(status, SOURCE_RANGE)
        value = U0  # a zero row: a never-written record
        if s >= 0 and s < num_slots:
            table, at = word_at(records, slot_stride_words, layer_hashes, num_layers, s, w)
            value = records[at] if table == 0 else layer_hashes[at]
        rows[i * row_stride + w] = value
        j += stride


def canary_scatter_rows(records, num_slots, slot_stride_words, layer_hashes, num_layers, slots, num_entries,
                        slots_wide, rows, row_stride, status):
    """Any grid: row(slots[i]) = rows[i] for slots in [0, num_slots); negative skipped, too large refused."""
    words = RECORD_WORDS + num_layers
    total = num_entries * words
    j = int64(cuda.blockIdx.x) * cuda.blockDim.x + cuda.threadIdx.x
    stride = int64(cuda.gridDim.x) * cuda.blockDim.x
    while j < total:
        i = j // words
        w = j - i * words
        s = load_int(slots, slots_wide, i)
        if s >= num_slots:
            if w == 0:
                refuse(status, DEST_RANGE)
        elif s >= 0:
            value = uint64(rows[i * row_stride + w])
            table, at = word_at(records, slot_stride_words, layer_hashes, num_layers, s, w)
            if table == 0:
                records[at] = value
            else:
                layer_hashes[at] = value
        j += stride


@functools.lru_cache(maxsize=None)
def move_kernels(threads: int = MOVE_THREADS):
    """``(canary_gather_rows, canary_scatter_rows)`` compiled eagerly once per process and block size
    (records_move.cu's launch bounds)."""
    opts = _jit_options(threads)
    return (cuda.jit(SIGNATURE, **opts)(canary_gather_rows), cuda.jit(SIGNATURE, **opts)(canary_scatter_rows))
