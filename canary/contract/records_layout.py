"""The canary kernels' by-value parameter structs, word by word (``kernels/records.cu``), and launch shapes.

records.cu's ``WriteParams`` / ``VerifyParams`` / ``ScatterParams`` have only 8-byte fields, so the CuPy
backend packs each as a uint64 word array in the order below; ``tests/kernels/test_kernel_compile.py`` pins these
lists (and the constants) against the CUDA source.
"""
from __future__ import annotations

MAX_SOURCES = 4
WRITE_THREADS = 256
WRITE_MAX_SEGMENTS = 32
VERIFY_THREADS = 256
SCATTER_THREADS = 128

STATE_FIELDS = (
    "canary", "num_slots", "slot_stride", "ring", "ring_row_stride", "ring_capacity", "ring_write_index",
    "slot_run_counter", "kernel_run_counter", "check_flags", "tag",
)
_KV_ARRAYS = ("base", "row_stride_bytes", "page_size", "num_bytes_per_token", "read_words")
REAL_KV_FIELDS = ("num_sources",) + tuple(f"{name}{k}" for name in _KV_ARRAYS for k in range(MAX_SOURCES))
WRITE_FIELDS = STATE_FIELDS + REAL_KV_FIELDS + (
    "write_offsets", "write_seed_slot_indices", "write_num_valid_reqs", "write_req_capacity", "out_cache_loc",
    "input_ids", "positions", "num_entries", "expected_input_ids", "expected_positions",
)
VERIFY_FIELDS = STATE_FIELDS + REAL_KV_FIELDS + (
    "verify_slot_indices", "verify_expected_tokens", "verify_expected_positions", "verify_prev_slot_indices",
    "verify_capacity", "verify_num_valid", "enable",
)
SCATTER_FIELDS = (
    "pool", "pool_rows", "pool_cols", "pool_row_stride", "req_pool_indices", "bs", "tokens", "num_tokens",
    "token_offsets", "column_starts", "column_offset",
)
APPEND_FIELDS = ("pool", "pool_rows", "pool_cols", "pool_row_stride", "q", "valid", "tokens", "n")
CONSTANTS = {"MAX_SOURCES": MAX_SOURCES, "WRITE_THREADS": WRITE_THREADS, "WRITE_MAX_SEGMENTS": WRITE_MAX_SEGMENTS, "VERIFY_THREADS": VERIFY_THREADS,
             "SCATTER_THREADS": SCATTER_THREADS}


def verify_grid(verify_capacity: int, sms: int, blocks_per_sm: int, threads: int = VERIFY_THREADS) -> int:
    """Blocks of a verify launch: one thread per entry of a full plan, but no more blocks than are resident at
    once (grid-stride beyond). From the capacity only, so a captured graph stays valid for any input."""
    return max(1, min(-(-int(verify_capacity) // threads), int(sms) * max(1, int(blocks_per_sm))))


def write_grid(write_req_capacity: int, sms: int, blocks_per_sm: int) -> int:
    """Blocks of a write launch: one per work item (a request's segment, at most ``WRITE_MAX_SEGMENTS`` a
    request) of a full plan, but no more than are resident at once (blocks loop over items beyond). From the
    capacity only, so a captured graph stays valid for any input."""
    return max(1, min(int(write_req_capacity) * WRITE_MAX_SEGMENTS, int(sms) * max(1, int(blocks_per_sm))))
