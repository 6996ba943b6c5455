"""``kernels/agree.cu``'s ``AgreeParams`` word by word (the ranks' agreement words of a GPU manager, SPEC 4.3), the
salts of the summary's digests and the launch shape.

A GPU manager with a communicator digests each group's written entries and verify plan on the device: one launch
per group per step, after the group's write, adding ``mix3(slot, token, position ^ salt)`` of every counted entry
into the group's two words of the report block (cleared behind every report), one atomic per block and word.
Wrapping addition is associative and commutative: the words do not depend on the grid or the schedule. The host
drops their top bit when it reads them, as the host formula does (``canary/manager/distributed.py``).

Every field is 8 bytes, so the CuPy backend packs the struct as uint64 words in this order; the generated
``kernels/canary_constants.cuh`` declares it from the same description. The grid comes from the call's entry
count (the step arrays' length) and the plan's capacity only; the plan's valid count is read on the device.
"""
from __future__ import annotations

from .cstruct import Member as M
from .cstruct import Struct

AGREE_THREADS = 256
ENTRY_SALT = 0x6B76_6361_6E61_7279  # entries: so that the entry (0, 0, 0) does not hash to 0
PLAN_SALT = 0x7665_7269_6679_506C  # the verify plan's entries
BATCH_SALT = 0x6261_7463_6852_6F77  # the batch rows (host only: the report brings them back)
MASK63 = (1 << 63) - 1  # the words' top bit is dropped: they stay non-negative int64

# The step's entry arrays, each int32 or int64 (SPEC 2 (*)): bit k of AgreeParams.entry_wide says it holds int64.
AGREE_WIDE_ARRAYS = ("slots", "tokens", "positions")
AGREE_WIDE = {name: 1 << k for k, name in enumerate(AGREE_WIDE_ARRAYS)}

AGREE_PARAMS = Struct("AgreeParams", (
    M("const void*", "slots", "[n] int32 or int64 (entry_wide): out_cache_loc (a slot < 0 is not counted)"),
    M("const void*", "tokens", "[n] input_ids"),
    M("const void*", "positions", "[n] positions"),
    M("i64", "n", "entries of the call (the arrays' length)"),
    M("i64", "entry_wide", "bit AGREE_WIDE_*: that array holds int64 (else int32)"),
    M("const i64*", "plan_slots", "[plan_capacity] the verify plan's verify_slot_indices"),
    M("const i64*", "plan_tokens", "[plan_capacity] verify_expected_tokens"),
    M("const i64*", "plan_positions", "[plan_capacity] verify_expected_positions"),
    M("const int*", "plan_num_valid", "[1] int32: entries counted, clamped to [0, plan_capacity]"),
    M("i64", "plan_capacity"),
    M("u64*", "out", "[2] the group's report-block words (plan, entries), added to (wrapping)"),
), doc="agree.cu canary_agree: a group's plan and entries digests of one step into its report-block words.")
STRUCTS = (AGREE_PARAMS,)
AGREE_FIELDS = AGREE_PARAMS.fields()


def agree_grid(n: int, plan_capacity: int, resident: int, threads: int = AGREE_THREADS) -> int:
    """Blocks of a launch: enough for the larger of the two spans, at most ``resident`` (a grid-stride loop covers
    the rest), at least 1 (the launch runs with nothing to count too)."""
    need = -(-max(int(n), int(plan_capacity)) // int(threads))
    return max(1, min(need, int(resident)))
