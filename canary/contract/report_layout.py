"""report.cu's ``ReportParams`` word by word (the manager's step report into pinned memory), its launch shape and
the layout of a mailbox slot.

The report is the manager's plumbing (no Numba twin, no reference: ``docs/architecture.md``), but its struct
crosses the kernel boundary like any other: declared here once, printed into the generated
``kernels/canary_constants.cuh`` and packed from the same field list by ``canary/backends/cupy/report.py``.
"""
from __future__ import annotations

from .cstruct import Member as M
from .cstruct import Struct

REPORT_THREADS = 256  # one block: the copy of a report block is a few thousand words at most
# A mailbox slot: the sequence number (written last: the host polls it), then the report block, then the step's
# req_pool_indices.
REPORT_SLOT_HEADER_WORDS = 1
REPORT_PARAMS = Struct("ReportParams", (
    M("const i64*", "block", "[words] device"),
    M("i64", "words"),
    M("const i64*", "rpi", "[bs] device, or null"),
    M("i64", "bs"),
    M("i64", "index_words", "block[0, index_words) are cleared after the copy"),
    M("i64*", "mailbox", "[slots][slot_words] pinned host memory: REPORT_SLOT_HEADER_WORDS, the block, the rpi"),
    M("i64", "slot_words"),
    M("i64", "slots"),
    M("i64*", "counter", "[1] device: reports launched so far (the sequence number of the last)"),
), doc="report.cu canary_report: one report block and the step's rows into the next mailbox slot.")
STRUCTS = (REPORT_PARAMS,)
REPORT_FIELDS = REPORT_PARAMS.fields()
