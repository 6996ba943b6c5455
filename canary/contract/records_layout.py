"""The canary kernels' by-value parameter structs, word by word (``kernels/records.cu``), and launch shapes.

records.cu's ``WriteParams`` / ``VerifyParams`` / ``ScatterParams`` / ``AppendParams`` have only 8-byte fields, so
the CuPy backend packs each as a uint64 word array in the order below. The structs are declared here once: the
generated ``kernels/canary_constants.cuh`` (:mod:`canary.contract.kernel_constants`) prints them for records.cu,
and the field lists are read off the same declarations.
"""
from __future__ import annotations

from .cstruct import Member as M
from .cstruct import Struct

MAX_SOURCES = 4
WRITE_THREADS = 256
# canary_write's __launch_bounds__ minimum resident blocks: 2 caps ptxas at 128 registers, which it then meets
# without spilling (the default bounds gave 128 with 120 bytes spilled around the look-back; 1 gives 180 and a
# slower decode write: run 145, docs/performance.md)
WRITE_MIN_BLOCKS = 2
WRITE_MAX_SEGMENTS = 128
VERIFY_THREADS = 256
SCATTER_THREADS = 128
# The write's look-back (records.cu look_back, docs/records.md 8): a segment of a long request publishes its chain
# map in a scratch item of LOOKBACK_ITEM_WORDS words (flag; its own map a, b, position; the map of its request up
# to and including it; a done counter used by segment 0's item), so later segments read it instead of composing
# every entry before them. Items are w = k * R + r (segment k of request r); w >= LOOKBACK_ITEMS composes instead
# (the pre-look-back way). 8192 items = 512 KiB of device memory a canary: 64 requests of 128 segments each.
LOOKBACK_ITEMS = 8192
LOOKBACK_ITEM_WORDS = 8

_P64, _I64 = "const i64*", "i64"
_PINT = "const void*"  # an int32 or int64 array (SPEC 2 (*)), read through load_int

# The write's token arrays, each int32 or int64 (SPEC 2 (*)): bit k of WriteParams.entry_wide (and of
# LayerParams.entry_wide, which has out_cache_loc only) says that array k holds int64.
ENTRY_WIDE_ARRAYS = ("out_cache_loc", "input_ids", "positions", "expected_input_ids", "expected_positions")
ENTRY_WIDE = {name: 1 << k for k, name in enumerate(ENTRY_WIDE_ARRAYS)}


def wide_bits(bits: dict, views: dict) -> int:
    """The width word of a launch: ``bits[name]`` for each present view of ``views`` whose dtype is 8 bytes."""
    return sum(bits[name] for name, v in views.items() if v is not None and v.dtype.itemsize == 8)
STATE_PARAMS = Struct("StateParams", (
    M("unsigned char*", "canary",
      "canary_buffer: slot s at s * slot_stride (int64 token, position, prev_hash, real_kv_hash)"),
    M(_I64, "num_slots"),
    M(_I64, "slot_stride", "bytes, a multiple of 8"),
    M("i64*", "ring", "[ring_capacity, >= 8] int64"),
    M(_I64, "ring_row_stride", "elements"),
    M(_I64, "ring_capacity"),
    M("unsigned int*", "ring_write_index", "the int32 word, counted as uint32"),
    M("unsigned long long*", "slot_run_counter"),
    M("unsigned long long*", "kernel_run_counter"),
    M("const int*", "check_flags"),
    M("const unsigned char*", "reported_slots",
      "[num_slots] uint8 (SPEC 4: bit 1 drops a slot's verify rows, bit 2 its MISSING rows), or null"),
    M(_I64, "tag", "(launch_tag << 8) | kernel"),
), doc="Where violations and health go; shared by write and verify. Fixed at bind except `tag`.")
_SOURCES = ("MAX_SOURCES", MAX_SOURCES)
REAL_KV_PARAMS = Struct("RealKVParams", (
    M(_I64, "num_sources"),
    M("const unsigned char*", "base", "16-byte aligned", _SOURCES),
    M(_I64, "row_stride_bytes", "multiple of 16", _SOURCES),
    M(_I64, "page_size", "", _SOURCES),
    M(_I64, "num_bytes_per_token", "multiple of 16", _SOURCES),
    M(_I64, "read_words", "PARTIAL: 2; ALL: read_bytes / 8 (even)", _SOURCES),
), doc="Real-KV sources; num_sources = 0 for mode NONE. Coverage (rows * page_size >= num_slots) is checked on the "
       "host, so only slots in [0, num_slots) are ever folded and no row count is needed here.")
WRITE_PARAMS = Struct("WriteParams", (
    M(STATE_PARAMS, "st"), M(REAL_KV_PARAMS, "kv"),
    M(_P64, "write_offsets", "[R + 1]"),
    M(_P64, "write_seed_slot_indices"),
    M("const int*", "write_num_valid_reqs"),
    M(_I64, "write_req_capacity", "R"),
    M(_PINT, "out_cache_loc", "[N] int32 or int64 (entry_wide), as each of the next four"),
    M(_PINT, "input_ids"),
    M(_PINT, "positions"),
    M(_I64, "num_entries", "N"),
    M(_PINT, "expected_input_ids", "null: not given"),
    M(_PINT, "expected_positions", "null: not given"),
    M(_I64, "entry_wide", "bit ENTRY_WIDE_*: that token array holds int64 (else int32)"),
    M("unsigned long long*", "lookback",
      "[lookback_items, LOOKBACK_ITEM_WORDS] zeroed scratch; every flag and counter zero again after each "
      "launch (values stay behind cleared flags); null: every segment composes the entries before it"),
    M(_I64, "lookback_items"),
))
VERIFY_PARAMS = Struct("VerifyParams", (
    M(STATE_PARAMS, "st"), M(REAL_KV_PARAMS, "kv"),
    M(_P64, "verify_slot_indices", "[C]"),
    M(_P64, "verify_expected_tokens"),
    M(_P64, "verify_expected_positions"),
    M(_P64, "verify_prev_slot_indices"),
    M(_I64, "verify_capacity", "C"),
    M("const int*", "verify_num_valid"),
    M("const int*", "enable"),
))
SCATTER_PARAMS = Struct("ScatterParams", (
    M("int*", "pool", "req_to_verify_expected_tokens"),
    M(_I64, "pool_rows"),
    M(_I64, "pool_cols"),
    M(_I64, "pool_row_stride", "elements"),
    M(_P64, "req_pool_indices", "[bs]"),
    M(_I64, "bs"),
    M("const void*", "tokens", "[N] int64 or int32 (the kernel's suffix says which)"),
    M(_I64, "num_tokens"),
    M(_P64, "token_offsets", "[>= bs + 1]"),
    M(_P64, "column_starts", "[bs]"),
    M(_I64, "column_offset"),
))
APPEND_PARAMS = Struct("AppendParams", (
    M("int*", "pool"),
    M(_I64, "pool_rows"),
    M(_I64, "pool_cols"),
    M(_I64, "pool_row_stride", "elements"),
    M(_P64, "q", "[n] pool rows"),
    M("i64*", "valid", "[n] tokens each row holds, advanced here"),
    M("const void*", "tokens", "[n] int64 or int32 (the kernel's suffix says which)"),
    M(_I64, "n"),
), doc="records.cu canary_append_tokens_*: a decode batch's accepted tokens appended to the pool rows.")
STRUCTS = (STATE_PARAMS, REAL_KV_PARAMS, WRITE_PARAMS, VERIFY_PARAMS, SCATTER_PARAMS, APPEND_PARAMS)

STATE_FIELDS = STATE_PARAMS.fields()
REAL_KV_FIELDS = REAL_KV_PARAMS.fields()
WRITE_FIELDS = WRITE_PARAMS.fields()
VERIFY_FIELDS = VERIFY_PARAMS.fields()
SCATTER_FIELDS = SCATTER_PARAMS.fields()
APPEND_FIELDS = APPEND_PARAMS.fields()
CONSTANTS = {"MAX_SOURCES": MAX_SOURCES, "WRITE_THREADS": WRITE_THREADS, "WRITE_MIN_BLOCKS": WRITE_MIN_BLOCKS, "WRITE_MAX_SEGMENTS": WRITE_MAX_SEGMENTS, "VERIFY_THREADS": VERIFY_THREADS,
             "SCATTER_THREADS": SCATTER_THREADS, "LOOKBACK_ITEM_WORDS": LOOKBACK_ITEM_WORDS}


def lookback_words(items: int = LOOKBACK_ITEMS) -> int:
    """uint64 words of a write's look-back scratch of ``items`` items (``WriteParams.lookback``)."""
    return int(items) * LOOKBACK_ITEM_WORDS


def verify_grid(verify_capacity: int, sms: int, blocks_per_sm: int, threads: int = VERIFY_THREADS) -> int:
    """Blocks of a verify launch: one thread per entry of a full plan, but no more blocks than are resident at
    once (grid-stride beyond). From the capacity only, so a captured graph stays valid for any input."""
    return max(1, min(-(-int(verify_capacity) // threads), int(sms) * max(1, int(blocks_per_sm))))


def write_grid(write_req_capacity: int, sms: int, blocks_per_sm: int) -> int:
    """Blocks of a write launch: one per work item (a request's segment, at most ``WRITE_MAX_SEGMENTS`` a
    request) of a full plan, but no more than are resident at once (blocks loop over items beyond). From the
    capacity only, so a captured graph stays valid for any input."""
    return max(1, min(int(write_req_capacity) * WRITE_MAX_SEGMENTS, int(sms) * max(1, int(blocks_per_sm))))
