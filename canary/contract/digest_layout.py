"""``kernels/digest.cu``'s ``DigestParams`` word by word (the block digest, SPEC 4.2), its scratch and its launch
shape.

Like :mod:`.records_layout`: every field is 8 bytes, so the CuPy backend packs the struct as uint64 words in this
order; the generated ``kernels/canary_constants.cuh`` declares it from the same description.

Work items: ``(block, layer, kind, split)``, ``num_blocks * num_layers * num_kinds * splits`` of them, taken by
the blocks of the grid in turn (``item = b (mod grid)``). ``splits`` cuts one (block, layer, kind) into
interleaved shares so that few blocks still fill the GPU; like the grid it comes from the arrays' shapes only
(graph-safe), and the digest does not depend on it (a sum, every lane counted once).
"""
from __future__ import annotations

from .cstruct import Member as M
from .cstruct import Struct
from .digest import MAX_KINDS

DIGEST_THREADS = 256
DIGEST_UNROLL = 4  # 16-byte loads a thread issues before it hashes them
MAX_SPLITS = 4096
SCRATCH_HEAD_WORDS = 2  # [0]: blocks of the grid done (the last one finalizes), [1]: unused, zero

# The block arrays, each int32 or int64 (SPEC 2 (*)): bit k of DigestParams.index_wide says that array holds int64.
DIGEST_WIDE_ARRAYS = ("kv_indptr", "kv_indices", "block_positions", "block_lens", "count_out")
DIGEST_WIDE = {name: 1 << k for k, name in enumerate(DIGEST_WIDE_ARRAYS)}

_P, _I64 = "const void*", "i64"
_KINDS = ("DIGEST_MAX_KINDS", MAX_KINDS)
DIGEST_PARAMS = Struct("DigestParams", (
    M(_I64, "num_layers"),
    M(_I64, "num_kinds", "1 (K) or 2 (K, V)"),
    M(_I64, "layer_offset", "global layer of layer 0"),
    M(_I64, "head_offset", "global head of head 0"),
    M("const i64*", "layer_bases", "[num_layers * num_kinds]: kind k of layer l at l * num_kinds + k"),
    M(_I64, "num_pages"),
    M(_I64, "page_size"),
    M(_I64, "heads", "per kind", _KINDS),
    M(_I64, "head_vecs", "16-byte vectors of a head, per kind", _KINDS),
    M(_I64, "page_stride", "bytes, a multiple of 16", _KINDS),
    M(_I64, "token_stride", "bytes", _KINDS),
    M(_I64, "head_stride", "bytes", _KINDS),
    M(_P, "kv_indptr", "[>= num_blocks + 1] int32 or int64 (index_wide), as each of the next three"),
    M(_P, "kv_indices", "[nnz] page ids"),
    M(_P, "block_positions", "[num_blocks]: position of each block's first token"),
    M(_P, "block_lens", "[num_blocks] tokens, or null: all of the block's pages"),
    M(_I64, "num_blocks"),
    M(_I64, "nnz"),
    M(_I64, "index_wide", "bit DIGEST_WIDE_*: that array holds int64 (else int32)"),
    M(_I64, "splits", "shares of one (block, layer, kind)"),
    M("u64*", "out", "compute: [num_blocks] digests"),
    M("unsigned char*", "status_out", "compute: [num_blocks] status bytes, or null"),
    M("const u64*", "expected", "check: [num_blocks]"),
    M("unsigned char*", "mismatch", "check: [num_blocks]"),
    M("void*", "count_out", "check: [1] int32 or int64 (index_wide)"),
    M("u64*", "scratch", "[DIGEST_SCRATCH_HEAD_WORDS + 2 * scratch_blocks], zero between launches"),
    M(_I64, "scratch_blocks", "blocks the scratch holds (>= num_blocks)"),
), doc="The block digest (SPEC 4.2); one struct for canary_digest (compute) and canary_digest_check.")
DIGEST_FIELDS = DIGEST_PARAMS.fields()
CONSTANTS = {"DIGEST_THREADS": DIGEST_THREADS}


def scratch_words(max_blocks: int) -> int:
    """u64 words of a scratch for ``max_blocks`` blocks: the head words, then per block its sum, then its status."""
    return SCRATCH_HEAD_WORDS + 2 * int(max_blocks)


def digest_splits(num_blocks: int, num_layers: int, num_kinds: int, token_capacity: int, units_per_token: int,
                  resident_blocks: int, threads: int = DIGEST_THREADS) -> int:
    """Shares of one (block, layer, kind): enough items to fill ``resident_blocks`` blocks, but no share under
    ``DIGEST_UNROLL`` loads a thread (``token_capacity``: tokens the index can name, ``kv_indices`` entries times
    the page size; ``units_per_token``: the 16-byte vectors of a token of the widest kind). Shapes only."""
    base = max(1, int(num_blocks) * int(num_layers) * int(num_kinds))
    want = -(-int(resident_blocks) // base)
    tokens = -(-int(token_capacity) // max(1, int(num_blocks)))
    worth = -(-tokens * int(units_per_token) // (threads * DIGEST_UNROLL))
    return max(1, min(want, worth, MAX_SPLITS))


def digest_grid(num_blocks: int, num_layers: int, num_kinds: int, splits: int, resident_blocks: int) -> int:
    """Blocks of a launch: one per item, at most the blocks resident at once (items beyond are taken in turn)."""
    return max(1, min(int(num_blocks) * int(num_layers) * int(num_kinds) * int(splits), int(resident_blocks)))
