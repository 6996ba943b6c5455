"""Constants and the launch-argument layout shared with ``kernels/plan.cu`` (and its twin ``kernels/plan_numba.py``).

The one source of these values: ``kernels/canary_constants.cuh``, which plan.cu includes, is generated from this
module (:mod:`canary.contract.kernel_constants`), and the Numba twin imports them.
"""
from __future__ import annotations

from .cstruct import Member as M
from .cstruct import Struct

# Block sizes and limits both twins and their hosts use (the host launches with them and picks the fused launch
# by FUSED_MAX_BS; entry_grid counts ITEMS entries a thread).
ROWS_THREADS = 1024
ENTRY_THREADS = 256
FUSED_MAX_BS = 512
ITEMS = 4
ENTRY_CHUNK = ITEMS * 32
ROW_SAMPLES = 512
ENTRY_MIN_BLOCKS = 4
# canary_plan_fused_*: 3, i.e. up to 85 registers: at 4 (64) every variant spilled 4-228 bytes, at 3 seven of the
# twelve spill none and the others at most 28 bytes (the LUT with the pool; ptxas -v); run 152: the bs=256 decode plan
# 11.29 -> 10.75 us, bs=1 and the trace mix unchanged. Its grid comes from the occupancy query, so the sampled
# fused launch's co-residency holds at any value.
FUSED_MIN_BLOCKS = 3

# plan.cu's own speed structure and scratch layout (the CuPy host sizes the scratch from them). The Numba twin
# has its own (plan_numba.py NUMBA_ROW_BATCH, NUMBA_SCRATCH_*, NUMBA_TABLE_ARRAYS): no side blocks, no cursor
# block, and a scan of consecutive rows a thread, so neither its table nor its batches are plan.cu's.
ROW_BATCH = 2
SIDE_BATCH = 1
SIDE_ROWS = ROWS_THREADS * SIDE_BATCH  # rows of one side block's tile (kernels/plan_side.cuh side_rows)
SCRATCH_DONE = 0
SCRATCH_BAD_SLOT = 1
SCRATCH_ROW_FLAGS = 2
SCRATCH_TOTAL = 3
SCRATCH_READERS = 4
SCRATCH_SIDE = 5
SCRATCH_TABLE = 6
TABLE_ARRAYS = 11
CONSTANTS = dict(ROWS_THREADS=ROWS_THREADS, ENTRY_THREADS=ENTRY_THREADS, FUSED_MAX_BS=FUSED_MAX_BS, ITEMS=ITEMS,
                 ROW_BATCH=ROW_BATCH, SCRATCH_TABLE=SCRATCH_TABLE, TABLE_ARRAYS=TABLE_ARRAYS, SIDE_BATCH=SIDE_BATCH)

_P64, _P32, _I64 = "const i64*", "const int*", "i64"
_PINT = "const void*"  # an int32 or int64 array (SPEC 2 (*)), read through load_int

# The per-step arrays, each int32 or int64 (SPEC 2 (*)): bit k of PlanParams.step_wide says that array k holds
# int64. The index's block table / kv_indices has its own word, table_wide (req_to_token is int32 only).
STEP_WIDE_ARRAYS = ("req_pool_indices", "prefix_lens", "extend_seq_lens", "valid_lens",
                    "expected_token_pool_indices")
STEP_WIDE = {name: 1 << k for k, name in enumerate(STEP_WIDE_ARRAYS)}
PLAN_PARAMS = Struct("PlanParams", (
    M(_PINT, "req_pool_indices", "[bs] int32 or int64 (step_wide), as the next three"),
    M(_PINT, "prefix_lens"), M(_PINT, "extend_seq_lens"), M(_PINT, "valid_lens"),
    M(_I64, "bs"),
    M(_P32, "req_to_token", "the index's table (SPEC 3.8): req_to_token, a block table or kv_indices (as int32 "
                            "words, two an entry if table_wide)"),
    M(_I64, "r2t_row_stride", "the virtual token index's key stride: v = key * stride + position (KVIndex)"),
    M(_I64, "rp_bound", "max_reqs (the pool's rows bound the pool row q: row_facts)"),
    M(_I64, "max_seq_len"), M(_P64, "lut"), M(_I64, "lut_len"),
    M(_P32, "pool"), M(_I64, "pool_row_stride"), M(_I64, "pool_cols"), M(_I64, "token_offset"),
    M(_I64, "window"),
    M(_I64, "padding_rows_carry_tokens", "0 or 1 (SPEC 3.2): a padding row's E counts in write_offsets"),
    M(_I64, "verify_capacity"), M(_I64, "write_req_capacity"),
    M("i64*", "slots"), M("i64*", "expected"), M("i64*", "positions"), M("i64*", "prevs"),
    M("int*", "num_valid"), M("int*", "enable"), M("int*", "status"),
    M("i64*", "write_offsets"), M("i64*", "seeds"), M("int*", "write_num_valid_reqs"),
    M("i64*", "scratch"),
    M("i64*", "cursors", "[max_reqs] rotation state of the sampled verification (SPEC 3.7)"),
    M(_I64, "sample", '1: on_overflow="sample" (cursors given); 0: "skip"'),
    M(_I64, "pool_rows"),
    M(_I64, "page_size", "the paged forms' tokens a page (SPEC 3.8); 1 for req_to_token"),
    M(_P32, "kv_indptr", "a page list's [>= bs + 1] offsets into kv_indices, as int32 words (two a row if wide)"),
    M(_I64, "kv_indptr_wide", "1: kv_indptr holds int64, 0: int32"),
    M(_I64, "kv_nnz", "a page list's kv_indices length (the bound of kv_indptr)"),
    M(_I64, "table_wide", "1: the paged forms' table holds int64 entries, 0: int32 (req_to_token: always 0)"),
    M(_PINT, "expected_token_pool_indices",
      "per step, HAS_POOL only: the pool row of each batch row (SPEC 3.2); null: req_pool_indices"),
    M(_I64, "step_wide", "per step: bit STEP_WIDE_* set when that step array holds int64 (else int32)"),
), doc="One by-value kernel parameter; every field is 8 bytes, so the host packs it as an array of uint64 words in "
       "this order (canary/contract/plan_layout.py PARAM_FIELDS) and updates only the per-step words per call.")
# struct PlanParams of plan.cu, field by field (each 8 bytes): the CuPy host's word order.
PARAM_FIELDS = PLAN_PARAMS.fields()


def entry_grid(verify_capacity: int, sms: int, blocks_per_sm: int, threads: int = ENTRY_THREADS) -> int:
    """Blocks of an entries grid: enough for a full plan, but no more than fit on the device at once (the
    fused kernel scans the rows once per block, so a second wave would scan them again; grid-stride beyond).
    Depends on the capacity only, never on data, so that a captured CUDA graph stays valid for any input."""
    return max(1, min(-(-int(verify_capacity) // (threads * ITEMS)), int(sms) * max(1, int(blocks_per_sm))))


def fused_grid(verify_capacity: int, sms: int, blocks_per_sm: int, sample: bool) -> int:
    """Blocks of the fused launch: ``entry_grid``, and for a sampling planner one more that emits nothing and moves
    the cursors once every other block has read them (plan.cu ``fused_sampled``). That block spins until the others
    have counted in, so the whole grid must fit on the device at once: the emitting blocks are capped one short of
    a full wave."""
    if not sample:
        return entry_grid(verify_capacity, sms, blocks_per_sm)
    return 1 + max(1, min(-(-int(verify_capacity) // (ENTRY_THREADS * ITEMS)), int(sms) * max(1, int(blocks_per_sm)) - 1))


def side_tiles(write_req_capacity: int) -> int:
    """Side blocks a sampling planner's two-pass rows launch may use: one a tile of ``SIDE_ROWS`` rows of
    ``write_req_capacity`` (kernels/plan_side.cuh ``side_rows``)."""
    return -(-int(write_req_capacity) // SIDE_ROWS)


def rows_grid(write_req_capacity: int, sms: int, blocks_per_sm: int, sample: bool) -> int:
    """Blocks of the two-pass rows launch: block 0 scans the batch; a sampling planner's launch adds the side
    blocks that build a sampled step's table meanwhile on other SMs (kernels/plan_side.cuh ``side_rows``). No block
    waits for another, but each side block reads every row of the batch (for the sums before its tile and the
    totals), so their reads grow as tiles x bs: past one wave of the device (more than ``sms * blocks_per_sm - 1`` tiles) the
    launch is one block, which builds the table itself after its scan. Depends on the capacities only, never on
    data, so that a captured CUDA graph stays valid for any input."""
    tiles = side_tiles(write_req_capacity)
    return 1 + tiles if sample and 1 + tiles <= int(sms) * max(1, int(blocks_per_sm)) else 1


def scratch_words(write_req_capacity: int, max_reqs: int) -> int:
    """int64 words of planner scratch: the head words, the two-pass row tables (TABLE_ARRAYS arrays of R + 1),
    then the side blocks' next cursors (one word a row of ``verify_cursors``: ``max_reqs``, 0 without sampling)."""
    return SCRATCH_TABLE + TABLE_ARRAYS * (write_req_capacity + 1) + int(max_reqs)
