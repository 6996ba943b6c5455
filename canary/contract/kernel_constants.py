"""Every constant both sides of a kernel boundary use, in one place, and the generator of
``kernels/canary_constants.cuh``, the header plan.cu and records.cu include.

The values are defined where their meaning is (``canary/errors.py`` :class:`~canary.errors.PlanStatus`,
:mod:`.ring` fail reasons, kernel tags and check flags, :mod:`.plans` sentinels, :mod:`.hashes` chain constants,
the block sizes and parameter structs of :mod:`.plan_layout`, :mod:`.records_layout`, :mod:`.layers_layout`,
:mod:`.move_layout`);
this module names them as the kernels do (``CANARY_BAD_SLOT``, ``FAIL_CHAIN``, ``ROWS_THREADS`` ...), prints them
as C (:func:`render_header`) and offers them, as plain ints, to the Numba twins in ``kernels/*_numba.py``, which
import them from here instead of restating them. Every name of :data:`DEFINES` is a module attribute.

Regenerate the header after changing any of them: ``python -m canary.contract.kernel_constants`` (``--check``
only compares); ``tests/kernels/test_kernel_constants.py`` fails while the checked-in header is stale.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import NamedTuple

from ..errors import PlanStatus
from . import digest as DG
from . import agree_layout as AL
from . import digest_layout as DL
from . import hashes
from . import layers_layout as LL
from . import move_layout as ML
from . import plan_layout as PL
from . import records_layout as RL
from . import report_layout as RPL
from .kvindex import FORM_BLOCKS, FORM_PAGES, FORM_TOKENS
from .plans import MISSING_SLOT, SKIP_SEED
from .ring import KIND_BITS, CheckFlags, FailReason, KernelTag

HEADER = "canary_constants.cuh"
REGENERATE = "python -m canary.contract.kernel_constants"
_MASK64 = (1 << 64) - 1


class Define(NamedTuple):
    """``#define name c``: ``value`` is what the Python side uses (u64 constants unsigned), ``c`` its C text (the
    literal's type, ``LL`` / ``ULL``, is part of the contract); ``note`` ends the line, ``doc`` goes above it."""

    name: str
    value: int
    c: str
    note: str = ""
    doc: str = ""


def _int(name: str, value: int, note: str = "", doc: str = "") -> Define:
    return Define(name, int(value), str(int(value)), note, doc)


def _expr(name: str, value: int, c: str, note: str = "", doc: str = "") -> Define:
    return Define(name, int(value), c, note, doc)


def _i64(name: str, value: int, note: str = "", doc: str = "") -> Define:
    """A negative int64 as the kernels spell it (INT64_MIN has no literal of its own)."""
    value = int(value)
    assert -(1 << 63) <= value < 0, name
    c = "(-0x7fffffffffffffffLL - 1)" if value == -(1 << 63) else f"(-0x{-value:x}LL)"
    return Define(name, value, c, note, doc)


def _u64(name: str, value: int, note: str = "", doc: str = "") -> Define:
    value = int(value) & _MASK64
    return Define(name, value, f"0x{value:016X}ULL" if value else "0ULL", note, doc)


def _flags(prefix: str, flag_type, notes: dict | None = None) -> list[Define]:
    """One define a non-zero member, in the enum's order (``__members__``: the same on every Python version)."""
    notes = notes or {}
    return [_int(f"{prefix}{name}", member, notes.get(name, ""))
            for name, member in flag_type.__members__.items() if int(member)]


_NO_ENTRIES = ("BAD_REQ_POOL_INDEX", "BAD_PREFIX_LEN", "BAD_VALID_LEN", "BAD_EXTEND_LEN")

PLAN_STATUS = _flags("CANARY_", PlanStatus, {
    "SAMPLED": 'total > capacity, on_overflow="sample": capacity entries verified (SPEC 3.7)'}) + [
    _expr("CANARY_NO_ENTRIES", sum(int(PlanStatus[n]) for n in _NO_ENTRIES),
          "(" + " | ".join(f"CANARY_{n}" for n in _NO_ENTRIES) + ")",
          doc="The per-row lengths cannot be trusted: no verify entry is written."),
]

SENTINELS = [
    _i64("CANARY_SKIP_SEED", SKIP_SEED,
         doc="Seed of a padding row whose tokens sit among the step's tokens (padding_rows_carry_tokens): the canary "
             "write skips its entries (canary/contract/plans.py SKIP_SEED). INT64_MIN: no int32 req_to_token value "
             "can produce it."),
    _i64("CANARY_MISSING_SLOT", MISSING_SLOT,
         doc="Verify slot of an entry of an active row whose slot is the padding slot (a req_to_token 0, or a real "
             "slot whose SWA page was freed inside the window), which verify must report as FAIL_MISSING, reading "
             "nothing, not skip as padding (canary/contract/plans.py MISSING_SLOT). -2^62: no int32 req_to_token "
             "value."),
]

PLAN_SHARED = [
    _int("ROWS_THREADS", PL.ROWS_THREADS, "canary_plan_rows_*: one block owns every row",
         doc="Planner block sizes and limits (canary/contract/plan_layout.py), the same in both twins and their "
             "hosts."),
    _int("ENTRY_THREADS", PL.ENTRY_THREADS, "canary_plan_fused_* and canary_plan_entries_*"),
    _int("FUSED_MAX_BS", PL.FUSED_MAX_BS, "the fused kernel keeps its row table in shared memory"),
    _int("ITEMS", PL.ITEMS, "verify entries per thread per pass: independent loads in flight"),
    _expr("ENTRY_CHUNK", PL.ENTRY_CHUNK, "(ITEMS * 32)", "entries of one warp pass"),
    _int("ROW_SAMPLES", PL.ROW_SAMPLES,
         "two-pass: row offsets sampled into shared memory to shorten the row search"),
    _int("ENTRY_MIN_BLOCKS", PL.ENTRY_MIN_BLOCKS,
         "resident blocks per SM the register budget must allow (__launch_bounds__)"),
    _int("FUSED_MIN_BLOCKS", PL.FUSED_MIN_BLOCKS,
         "the same for canary_plan_fused_* (a larger register budget, fewer spills)"),
    _int("CANARY_FORM_TOKENS", FORM_TOKENS, "req_to_token",
         doc="The index forms, the planner's FORM specialization (canary/contract/kvindex.py, SPEC 3.8)."),
    _int("CANARY_FORM_BLOCKS", FORM_BLOCKS, "a block table and page_size"),
    _int("CANARY_FORM_PAGES", FORM_PAGES, "a page list: kv_indptr, kv_indices and page_size"),
] + [_int(f"STEP_WIDE_{name.upper()}", bit, doc="PlanParams.step_wide's bits (plan_layout.py STEP_WIDE): that step "
                                              "array holds int64, else int32 (SPEC 2 (*))." if not k else "")
     for k, (name, bit) in enumerate(PL.STEP_WIDE.items())]

PLAN_CUDA = [
    _int("ROW_BATCH", PL.ROW_BATCH,
         "row tiles whose loads the rows kernel issues together (4 spilled: 64 registers at 1024 threads)",
         doc="plan.cu's own speed structure and scratch layout (the CuPy host sizes the scratch from them; the "
             "Numba twin has its own, plan_numba.py NUMBA_*)."),
    _int("SIDE_BATCH", PL.SIDE_BATCH, "rows a thread of a side block owns (2 spilled in the rows kernel)"),
    _expr("SIDE_ROWS", PL.SIDE_ROWS, "(ROWS_THREADS * SIDE_BATCH)", "rows of one side block's tile"),
    _int("SCRATCH_DONE", PL.SCRATCH_DONE,
         "blocks finished (low 32 bits; the last one finalizes) and blocks that found a BAD_SLOT (high 32 bits)",
         doc="Scratch words (int64, owned by the planner, zeroed once at bind, re-armed by every launch)."),
    _int("SCRATCH_BAD_SLOT", PL.SCRATCH_BAD_SLOT, "the Numba twin's BAD_SLOT bits; unused by plan.cu (SCRATCH_DONE)"),
    _int("SCRATCH_ROW_FLAGS", PL.SCRATCH_ROW_FLAGS, "two-pass only: row checks of the rows kernel"),
    _int("SCRATCH_TOTAL", PL.SCRATCH_TOTAL, "two-pass only: verify entries in all"),
    _int("SCRATCH_READERS", PL.SCRATCH_READERS, "fused, sampled steps: emitting blocks done reading the cursors"),
    _int("SCRATCH_SIDE", PL.SCRATCH_SIDE,
         "two-pass: side blocks of the rows launch (0: block 0 builds a sampled table)"),
    _int("SCRATCH_TABLE", PL.SCRATCH_TABLE,
         "two-pass only: the row tables, TABLE_ARRAYS arrays of R + 1 (RowTable), then the side blocks' next "
         "cursors, max_reqs words (next_cursors; zero between launches)"),
    _int("TABLE_ARRAYS", PL.TABLE_ARRAYS,
         "the scan's table (8 arrays), then a side-built sampled table's off, base, pdelta"),
]

RECORDS = [
    _int("MAX_SOURCES", RL.MAX_SOURCES,
         doc="Canary kernel block sizes and limits (canary/contract/records_layout.py, layers_layout.py)."),
    _int("WRITE_THREADS", RL.WRITE_THREADS, "entries per tile of a write segment: one block-wide scan per tile"),
    _int("WRITE_MIN_BLOCKS", RL.WRITE_MIN_BLOCKS, "canary_write's resident blocks per SM (__launch_bounds__)"),
    _int("WRITE_MAX_SEGMENTS", RL.WRITE_MAX_SEGMENTS,
         "a request's entries split into at most this many segments, one block each"),
    _int("LOOKBACK_ITEM_WORDS", RL.LOOKBACK_ITEM_WORDS,
         "a write look-back item: flag, own map (a, b, position), inclusive map (a, b, position), done counter"),
    _int("VERIFY_THREADS", RL.VERIFY_THREADS),
    _int("SCATTER_THREADS", RL.SCATTER_THREADS),
    _int("LAYER_THREADS", LL.LAYER_THREADS),
    _int("REPORT_THREADS", RPL.REPORT_THREADS, "report.cu canary_report's one block (report_layout.py)"),
    _int("REPORT_SLOT_HEADER_WORDS", RPL.REPORT_SLOT_HEADER_WORDS,
         "a mailbox slot's sequence number, before its block and rows (report_layout.py)"),
    _int("LAYER_KIND_SHIFT", KIND_BITS,
         "a VERIFY_LAYER row's tag: the layer sits just above the kernel-kind byte (ring.py KIND_BITS)"),
] + [_int(f"ENTRY_WIDE_{name.upper()}", bit, doc="WriteParams.entry_wide's bits (records_layout.py ENTRY_WIDE): "
                                               "that token array holds int64, else int32 (SPEC 2 (*))." if not k
          else "") for k, (name, bit) in enumerate(RL.ENTRY_WIDE.items())]

RING = (
    [d._replace(doc="Fail-reason bits of a ring row (canary/contract/ring.py FailReason).") if i == 0 else d
     for i, d in enumerate(_flags("FAIL_", FailReason))]
    + [d._replace(doc="Optional checks of the check_flags word (ring.py CheckFlags).") if i == 0 else d
       for i, d in enumerate(_flags("CHECK_", CheckFlags))]
    + [_int(f"KERNEL_TAG_{tag.name}", tag, doc="Kernel tags (ring.py KernelTag): the low byte of a ring row's tag "
                                               "column, which the host passes in") if i == 0
       else _int(f"KERNEL_TAG_{tag.name}", tag) for i, tag in enumerate(KernelTag)]
    + [_int("COUNTER_WRITE", KernelTag.WRITE.counter_index,
            doc="Element of slot_run_counter / kernel_run_counter a kernel counts in (KernelTag.counter_index)."),
       _int("COUNTER_VERIFY", KernelTag.VERIFY.counter_index, "verify and verify_layer")]
)

MOVE = [
    _int("MOVE_THREADS", ML.MOVE_THREADS, "canary_gather_rows / canary_scatter_rows: one thread an (entry, word)",
         doc="Records that move (records_move.cu, records_move_numba.py; canary/contract/move_layout.py, SPEC 4.1)."),
    _int("RECORD_WORDS", ML.RECORD_WORDS, "a row's first words: the record's fields (token ... real_kv_hash)"),
    _int("MOVE_STATUS_FAULTS", ML.STATUS_FAULTS, "status word: MoveFault bits, ORed"),
    _int("MOVE_STATUS_REFUSED", ML.STATUS_REFUSED, "status word: entries refused, counted"),
] + [_int(f"MOVE_{name}", bit) for name, bit in ML.MoveFault.__members__.items() if int(bit)]

CHAIN = [
    _u64("FIELD_P", hashes.FIELD_P, "2^61 - 1, a Mersenne prime",
         doc="The affine chain (SPEC 4, canary/contract/hashes.py): a chain value is CHAIN_TAG | h, h in [0, "
             "FIELD_P); link(record) = CHAIN_TAG | (CHAIN_MUL * h + g(token, position)) mod FIELD_P with h the "
             "field value of the record's prev_hash, or NOT_A_LINK when that prev_hash is no chain value (a "
             "never-written record's, among others)."),
    _u64("CHAIN_TAG", hashes.CHAIN_TAG),
    _u64("CHAIN_MUL", hashes.CHAIN_MUL, "A"),
    _u64("G_KEY", hashes.G_KEY, f"splitmix64(CHAIN_ANCHOR = 0x{hashes.CHAIN_ANCHOR:X}): g's first step"),
    _u64("ANCHOR_LINK", hashes.ANCHOR_LINK, "CHAIN_TAG | (G_KEY mod FIELD_P): link(-1)"),
    _u64("NOT_A_LINK", hashes.NOT_A_LINK),
]

DIGEST = [
    _int("DIGEST_THREADS", DL.DIGEST_THREADS, "threads of a digest block",
         doc="The block digest (SPEC 4.2; canary/contract/digest.py, digest_layout.py)."),
    _int("DIGEST_UNROLL", DL.DIGEST_UNROLL, "16-byte loads a thread issues before hashing them"),
    _int("DIGEST_MAX_KINDS", DG.MAX_KINDS, "K and V"),
    _int("DIGEST_MAX_HEADS", DG.MAX_HEADS, "heads of a tensor: an item's head keys sit in shared memory"),
    _int("DIGEST_LANE_BITS", DG.LANE_BITS, "lane_key = head_key + (p << DIGEST_LANE_BITS | i) * DIGEST_LANE_MUL"),
    _int("DIGEST_SCRATCH_HEAD_WORDS", DL.SCRATCH_HEAD_WORDS, "scratch: done counter, then per-block sums, statuses"),
    _u64("DIGEST_ANCHOR", DG.DIGEST_ANCHOR, "A"),
    _u64("DIGEST_KEY0", DG.DIGEST_KEY0, "splitmix64(DIGEST_ANCHOR): head_key's first step"),
    _u64("DIGEST_LANE_MUL", DG.DIGEST_LANE_MUL, "M, odd"),
    _u64("BAD_DIGEST", DG.BAD_DIGEST, "the digest of a block whose status is not 0"),
] + _flags("DIGEST_", DG.DigestStatus) + [
    _int(f"DIGEST_WIDE_{name.upper()}", bit, doc="DigestParams.index_wide's bits (digest_layout.py DIGEST_WIDE): "
                                                "that array holds int64, else int32 (SPEC 2 (*))." if not k else "")
    for k, (name, bit) in enumerate(DL.DIGEST_WIDE.items())]

AGREE = [
    _int("AGREE_THREADS", AL.AGREE_THREADS, "threads of an agreement block",
         doc="The ranks' agreement words of a GPU manager (SPEC 4.3; agree.cu, agree_numba.py; agree_layout.py)."),
    _u64("AGREE_ENTRY_SALT", AL.ENTRY_SALT, "entries: mix3(slot, token, position ^ AGREE_ENTRY_SALT)"),
    _u64("AGREE_PLAN_SALT", AL.PLAN_SALT, "the verify plan: mix3(slot mod 2^63, token, position ^ salt)"),
] + [_int(f"AGREE_WIDE_{name.upper()}", bit, doc="AgreeParams.entry_wide's bits (agree_layout.py AGREE_WIDE): "
                                               "that array holds int64, else int32 (SPEC 2 (*))." if not k else "")
     for k, (name, bit) in enumerate(AL.AGREE_WIDE.items())]

SECTIONS = (
    ("Plan status bits (canary/errors.py PlanStatus, SPEC 3.4)", PLAN_STATUS),
    ("Plan sentinels (canary/contract/plans.py)", SENTINELS),
    ("The planner (plan.cu, plan_numba.py)", PLAN_SHARED + PLAN_CUDA),
    ("The canary kernels (records.cu, records_numba.py)", RECORDS + RING + CHAIN),
    ("Records that move (records_move.cu, records_move_numba.py)", MOVE),
    ("The block digest (digest.cu, digest_numba.py)", DIGEST),
    ("The ranks' agreement words (agree.cu, agree_numba.py)", AGREE),
)
DEFINES = tuple(d for _, section in SECTIONS for d in section)
VALUES = {d.name: d.value for d in DEFINES}
STRUCTS = ((PL.PLAN_PARAMS,) + RL.STRUCTS + (LL.LAYER_PARAMS,) + RPL.STRUCTS + (ML.MOVE_PARAMS, DL.DIGEST_PARAMS)
           + AL.STRUCTS)
globals().update(VALUES)
assert len(VALUES) == len(DEFINES), "a define named twice"


def _comment(text: str, width: int = 118) -> list[str]:
    lines, line = [], "//"
    for word in text.split():
        if len(line) + 1 + len(word) > width and line != "//":
            lines.append(line)
            line = "//"
        line += " " + word
    return lines + [line]


def render_header() -> str:
    """The text of ``kernels/canary_constants.cuh``: the banner, the typedefs, every :data:`DEFINES` and
    :data:`STRUCTS`, in order."""
    out = [
        f"// Generated by `{REGENERATE}` from canary/errors.py (PlanStatus) and canary/contract/",
        "// (ring.py, plans.py, hashes.py and the *_layout.py files): do not edit.",
        "// Change the Python source and regenerate: tests/kernels/test_kernel_constants.py fails while this file is",
        "// stale.",
        "// Included by kernels/plan.cu, records.cu, records_move.cu, report.cu and digest.cu (canary/backends/sources.py",
        "// inlines it for NVRTC).",
        "#ifndef CANARY_CONSTANTS_CUH",
        "#define CANARY_CONSTANTS_CUH",
        "",
        "typedef long long i64;",
        "typedef unsigned long long u64;",
    ]
    for title, section in SECTIONS:
        out += ["", f"// ---- {title}"]
        for d in section:
            line = f"#define {d.name} {d.c}"
            noted = f"{line:<40}  // {d.note}" if d.note else line
            if len(noted) > 118:  # too long for the line: the note goes above it
                out += _comment(f"{d.doc} {d.name}: {d.note}" if d.doc else f"{d.name}: {d.note}")
                out.append(line)
            else:
                out += _comment(d.doc) if d.doc else []
                out.append(noted)
    for struct in STRUCTS:
        out += ["", struct.render()]
    out += ["", "#endif  // CANARY_CONSTANTS_CUH", ""]
    return "\n".join(out)


def header_path() -> Path:
    """``kernels/canary_constants.cuh`` of the checkout this module is in (the generator runs in a checkout)."""
    return Path(__file__).resolve().parents[2] / "kernels" / HEADER


def main(argv: list[str] | None = None) -> int:
    """Write the header (``--check``: only say whether the checked-in one is current; exit status 1 if not)."""
    argv = sys.argv[1:] if argv is None else argv
    path, text = header_path(), render_header()
    current = path.is_file() and path.read_text() == text
    if "--check" in argv:
        print(f"{path}: {'up to date' if current else f'stale, run {REGENERATE}'}")
        return 0 if current else 1
    if not current:
        path.write_text(text)
    print(f"{path}: {'unchanged' if current else 'written'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
