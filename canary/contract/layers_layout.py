"""records.cu's ``LayerParams`` word by word (the layer rotation's kernels), and their launch shape.

Like :mod:`.records_layout`: every field is 8 bytes, so the CuPy backend packs the struct as uint64 words in
this order; ``tests/records/test_layers.py`` pins the list (and the constants) against the CUDA source.
"""
from __future__ import annotations

from .records_layout import REAL_KV_FIELDS, STATE_FIELDS

LAYER_THREADS = 256
LAYER_FIELDS = STATE_FIELDS + REAL_KV_FIELDS + (
    "layer_bases", "num_layers", "dwell", "layer_hashes", "layer_cursor",
    "write_offsets", "write_seed_slot_indices", "write_num_valid_reqs", "write_req_capacity", "out_cache_loc",
    "num_entries",
    "verify_slot_indices", "verify_expected_tokens", "verify_expected_positions", "verify_capacity",
    "verify_num_valid", "enable",
)
CONSTANTS = {"LAYER_THREADS": LAYER_THREADS}


def layer_grid(work_items: int, sms: int, blocks_per_sm: int, threads: int = LAYER_THREADS) -> int:
    """Blocks of a layer launch: one thread per work item (``N * num_layers`` for write_layers, the verify
    capacity for verify_layer), at most the blocks resident at once (grid-stride beyond). From capacities only,
    so a captured graph stays valid."""
    return max(1, min(-(-int(work_items) // threads), int(sms) * max(1, int(blocks_per_sm))))
