"""Constants and the launch-argument layout shared with ``kernels/plan.cu`` (checked against it in CI)."""

# Block sizes and limits, as #defined in plan.cu.
ROWS_THREADS = 1024
ENTRY_THREADS = 256
FUSED_MAX_BS = 512
ITEMS = 4
ENTRY_CHUNK = ITEMS * 32
ROW_BATCH = 2
SCRATCH_TABLE = 6
TABLE_ARRAYS = 11
SIDE_BATCH = 1
SIDE_ROWS = ROWS_THREADS * SIDE_BATCH  # rows of one side block's tile (plan.cu side_rows)
CONSTANTS = dict(ROWS_THREADS=ROWS_THREADS, ENTRY_THREADS=ENTRY_THREADS, FUSED_MAX_BS=FUSED_MAX_BS, ITEMS=ITEMS,
                 ROW_BATCH=ROW_BATCH, SCRATCH_TABLE=SCRATCH_TABLE, TABLE_ARRAYS=TABLE_ARRAYS, SIDE_BATCH=SIDE_BATCH)

# struct PlanParams of plan.cu, field by field (each 8 bytes).
PARAM_FIELDS = (
    "req_pool_indices", "prefix_lens", "extend_seq_lens", "valid_lens", "bs",
    "req_to_token", "r2t_row_stride", "rp_bound", "max_seq_len", "lut", "lut_len",
    "pool", "pool_row_stride", "pool_cols", "token_offset", "window", "padding_rows_carry_tokens",
    "verify_capacity", "write_req_capacity",
    "slots", "expected", "positions", "prevs", "num_valid", "enable", "status",
    "write_offsets", "seeds", "write_num_valid_reqs", "scratch", "cursors", "sample",
    "pool_rows", "expected_token_pool_indices",
)


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
    ``write_req_capacity`` (plan.cu ``side_rows``)."""
    return -(-int(write_req_capacity) // SIDE_ROWS)


def rows_grid(write_req_capacity: int, sms: int, blocks_per_sm: int, sample: bool) -> int:
    """Blocks of the two-pass rows launch: block 0 scans the batch; a sampling planner's launch adds the side
    blocks that build a sampled step's table meanwhile on other SMs (plan.cu ``side_rows``). No block waits for
    another, but each side block reads every row of the batch (for the sums before its tile and the totals), so
    their reads grow as tiles x bs: past one wave of the device (more than ``sms * blocks_per_sm - 1`` tiles) the
    launch is one block, which builds the table itself after its scan. Depends on the capacities only, never on
    data, so that a captured CUDA graph stays valid for any input."""
    tiles = side_tiles(write_req_capacity)
    return 1 + tiles if sample and 1 + tiles <= int(sms) * max(1, int(blocks_per_sm)) else 1


def scratch_words(write_req_capacity: int, max_reqs: int) -> int:
    """int64 words of planner scratch: the head words, the two-pass row tables (TABLE_ARRAYS arrays of R + 1),
    then the side blocks' next cursors (one word a request row of ``req_to_token``)."""
    return SCRATCH_TABLE + TABLE_ARRAYS * (write_req_capacity + 1) + int(max_reqs)
