"""records.cu's ``LayerParams`` word by word (the layer rotation's kernels), and their launch shape.

Like :mod:`.records_layout`: every field is 8 bytes, so the CuPy backend packs the struct as uint64 words in
this order; the generated ``kernels/canary_constants.cuh`` declares the struct from the same description.
"""
from __future__ import annotations

from .cstruct import Member as M
from .cstruct import Struct
from .records_layout import REAL_KV_PARAMS, STATE_PARAMS

LAYER_THREADS = 256
_P64, _I64 = "const i64*", "i64"
LAYER_PARAMS = Struct("LayerParams", (
    M(STATE_PARAMS, "st"),
    M(REAL_KV_PARAMS, "kv", "the layout shared by every layer; its base[] is replaced per layer"),
    M(_P64, "layer_bases", "[num_layers * num_sources]: source k of layer l at l * num_sources + k"),
    M(_I64, "num_layers"),
    M(_I64, "dwell", "steps a layer stays under the cursor (>= 1)"),
    M("i64*", "layer_hashes", "[num_slots, num_layers] int64, C-contiguous"),
    M("int*", "layer_cursor", "[2]: the layer verify_layer checks, the steps already spent on it"),
    M(_P64, "write_offsets", "write_layers: the step's write plan and out_cache_loc"),
    M(_P64, "write_seed_slot_indices"),
    M("const int*", "write_num_valid_reqs"),
    M(_I64, "write_req_capacity"),
    M("const void*", "out_cache_loc", "int32 or int64: entry_wide bit ENTRY_WIDE_OUT_CACHE_LOC"),
    M(_I64, "num_entries"),
    M(_P64, "verify_slot_indices", "verify_layer: the step's verify plan"),
    M(_P64, "verify_expected_tokens"),
    M(_P64, "verify_expected_positions"),
    M(_I64, "verify_capacity"),
    M("const int*", "verify_num_valid"),
    M("const int*", "enable"),
    M(_I64, "entry_wide", "write_layers: records_layout.ENTRY_WIDE bits (out_cache_loc's only)"),
))
LAYER_FIELDS = LAYER_PARAMS.fields()
CONSTANTS = {"LAYER_THREADS": LAYER_THREADS}


def layer_grid(work_items: int, sms: int, blocks_per_sm: int, threads: int = LAYER_THREADS) -> int:
    """Blocks of a layer launch: one thread per work item (``N * num_layers`` for write_layers, the verify
    capacity for verify_layer), at most the blocks resident at once (grid-stride beyond). From capacities only,
    so a captured graph stays valid."""
    return max(1, min(-(-int(work_items) // threads), int(sms) * max(1, int(blocks_per_sm))))
