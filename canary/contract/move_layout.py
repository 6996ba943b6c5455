"""Records that move (SPEC 4.1): the row format, the status word, and ``kernels/records_move.cu``'s ``MoveParams``.

A slot's **row** is :data:`RECORD_WORDS` int64 words, the record's four fields in their order (``token``,
``position``, ``prev_hash``, ``real_kv_hash``), then the slot's ``layer_hashes`` row when a layer table moves with
the records: ``row_words(num_layers)`` words in all. A buffer of rows is ``[R, row_words]`` int64.

The **status word** is ``[STATUS_WORDS]`` int64, sticky (the kernels never clear it): word
:data:`STATUS_FAULTS` ORs :class:`MoveFault` bits, word :data:`STATUS_REFUSED` counts the refused entries.

Like :mod:`.records_layout`: every ``MoveParams`` field is 8 bytes, so the CuPy backend packs it as uint64 words in
this order, and the generated ``kernels/canary_constants.cuh`` declares the struct from the same description.
"""
from __future__ import annotations

import enum
from typing import NamedTuple

from .cstruct import Member as M
from .cstruct import Struct
from .ring import CANARY_FIELDS

MOVE_THREADS = 256
RECORD_WORDS = len(CANARY_FIELDS)  # the record's fields that move: bytes 0 to 32 of a slot
STATUS_WORDS = 2
STATUS_FAULTS, STATUS_REFUSED = 0, 1


class MoveFault(enum.IntFlag):
    """Fault bits of a mover's status word (SPEC 4.1): a slot outside ``[0, num_slots)``, never read or written."""

    NONE = 0
    SOURCE_RANGE = 1  # a gathered (or copied-from) slot >= num_slots: its row in the buffer is zeros
    DEST_RANGE = 2  # a scattered (or copied-to) slot >= num_slots: nothing stored

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(b.name for b in MoveFault if b and b in self)


class MoveStatus(NamedTuple):
    """A mover's status word read back: the fault bits since the last clear, and how many entries they refused."""

    faults: MoveFault
    refused: int

    @property
    def ok(self) -> bool:
        return not self.faults and not self.refused

    def __str__(self) -> str:
        if self.ok:
            return "records moved: no fault"
        return f"records moved: {'|'.join(self.faults.names) or 'no fault bit'}, {self.refused} entries refused"


def row_words(num_layers: int) -> int:
    """Words of a slot's row: the record's four fields, then ``num_layers`` layer hashes (0: no layer table)."""
    return RECORD_WORDS + int(num_layers)


MOVE_PARAMS = Struct("MoveParams", (
    M("unsigned char*", "records", "canary_buffer: slot s's fields at s * slot_stride"),
    M("i64", "num_slots"),
    M("i64", "slot_stride", "bytes, a multiple of 8"),
    M("i64*", "layer_hashes", "[num_slots, num_layers] int64, C-contiguous, or null (num_layers = 0)"),
    M("i64", "num_layers"),
    M("const void*", "slots", "[n] int32 or int64 (slots_wide)"),
    M("i64", "num_entries", "n"),
    M("i64", "slots_wide", "1: slots holds int64, 0: int32"),
    M("i64*", "rows", "[>= n, RECORD_WORDS + num_layers] int64: written by gather, read by scatter"),
    M("i64", "row_stride", "elements"),
    M("unsigned long long*", "status", "[STATUS_WORDS]: fault bits (OR), refused entries (count)"),
), doc="records_move.cu canary_gather_rows / canary_scatter_rows: a slot list's rows between the tables and a buffer.")
MOVE_FIELDS = MOVE_PARAMS.fields()
CONSTANTS = {"MOVE_THREADS": MOVE_THREADS}


def move_grid(num_entries: int, words: int, sms: int, blocks_per_sm: int, threads: int = MOVE_THREADS) -> int:
    """Blocks of a move launch: one thread per (entry, word) pair, at most the blocks resident at once (grid-stride
    beyond). From the list's length, a host shape: a captured graph stays valid for lists refilled in place."""
    return max(1, min(-(-int(num_entries) * int(words) // threads), int(sms) * max(1, int(blocks_per_sm))))
