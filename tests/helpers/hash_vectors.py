"""Frozen vectors of the canary records' hashes (SPEC 4), as unsigned 64-bit values, and how the device tests
lay the real-KV fold vectors out."""
from __future__ import annotations

import numpy as np

# (x, splitmix64(x)) as unsigned 64-bit values.
SPLITMIX64_VECTORS = [
    (0x0000000000000000, 0x0000000000000000),
    (0x0000000000000001, 0x5692161D100B05E5),
    (0x0000000000000002, 0xDBD238973A2B148A),
    (0x0000000000000003, 0x1E535EEDE31428F0),
    (0x7FFFFFFFFFFFFFFF, 0x5A682AFE7965DEBD),
    (0x8000000000000000, 0x25C26EA579CEA98A),
    (0xFFFFFFFFFFFFFFFF, 0xB4D055FCF2CBBD7B),
    (0xC0FFEE1234567890, 0xDE7FAE23A9A1B716),  # the chain anchor: link(-1)
    (0x0123456789ABCDEF, 0xB2C058E4EBB5112C),
    (0xDEADBEEFCAFEBABE, 0x7AD6664F09FFE52C),
    (0x0000000000003039, 0xF36CF1164265DD51),
    (0x0000000100000000, 0xD820B7E910B0F93F),
]

# (a, b, c, mix3(a, b, c)) as unsigned 64-bit values.
MIX3_VECTORS = [
    (0x0000000000000000, 0x0000000000000000, 0x0000000000000000, 0x0000000000000000),
    (0x0000000000000001, 0x0000000000000002, 0x0000000000000003, 0xA55BDF37C08724B5),
    (0xC0FFEE1234567890, 0x0000000000000000, 0x0000000000000000, 0xB0CFB7E6FD833012),
    (0xDE7FAE23A9A1B716, 0x0000000000000011, 0x0000000000000000, 0xCE520DD47AC0D651),  # link(-1), token 17, pos 0
    (0xFFFFFFFFFFFFFFFF, 0xFFFFFFFFFFFFFFFF, 0xFFFFFFFFFFFFFFFF, 0x757235CAE19895DB),
    (0x8000000000000000, 0x8000000000000000, 0x8000000000000000, 0xF10CADC5113735C6),
    (0xDE7FAE23A9A1B716, 0xFFFFFFFFFFFFFFFF, 0x0000000000000005, 0xA655CDB26A444C27),  # token -1
    (0x0123456789ABCDEF, 0x0000000000007CFF, 0x0000000000000FFF, 0xE030A3BA10D1C541),
    (0x0000000000000000, 0x0000000000000001, 0x0000000000000002, 0xEF30B01C2974AEEB),
    (0x0000000000000002, 0x0000000000000001, 0x0000000000000000, 0x64950D26293FF4FF),  # argument order matters
]

# The real-KV fold (SPEC 4) of one slot: (sources, real_kv_hash) as unsigned 64-bit values. Each source is the
# tuple of little-endian u64 words the slot reads in it (2 in mode PARTIAL, read_bytes / 8 in mode ALL; always
# even: the GPU reads 16 bytes at a time). Worked out once with the pure-Python oracle
# (helpers/naive_records.py: splitmix64 with explicit 64-bit masking, NaiveState.real_kv_hash) and frozen here;
# the reference, CUDA and Numba folds must reproduce them bit for bit. The fold's lowest bit is forced to 1, so
# all-zero bytes fold to 1, never to 0 (the real_kv_hash of a never-written record); comments give the value
# before the forced bit where it differs, i.e. the value of the format before the change.
_A, _B, _ONES = 0x0123456789ABCDEF, 0xDEADBEEFCAFEBABE, 0xFFFFFFFFFFFFFFFF
REAL_KV_FOLD_VECTORS = [
    (((0, 0),), 0x0000000000000001),  # was 0: 16 zero bytes, one source (mode PARTIAL's read)
    (((0, 0, 0, 0),), 0x0000000000000001),  # was 0: 32 zero bytes (mode ALL)
    ((), 0x0000000000000000),  # no sources (mode NONE): 0, nothing read, nothing compared
    (((0, 0), (0, 0, 0, 0, 0, 0)), 0x0000000000000001),  # was 0: two sources
    (((0, 0), (0, 0), (0, 0), (0, 0)), 0x0000000000000001),  # was 0: four sources
    (((1, 0),), 0x71CAC37448049CE5),  # was ...CE4: s(s(s(1)))
    (((0, 1),), 0x7AB40E090F363A7D),  # odd already: s(s(1)), a leading zero word is absorbed
    (((_A, _B),), 0x8A4C96B52C611817),  # was ...816
    (((_B, _A),), 0xB6BB0AE8A5CBCF1B),  # was ...F1A: word order matters
    (((_A, _B), (0, 0)), 0x979488D87E0A77B5),  # was ...7B4: a trailing all-zero source still changes the hash
    (((0, 0), (_A, _B)), 0x8A4C96B52C611817),  # a leading all-zero source is absorbed (as (_A, _B) alone)
    (((_ONES,) * 4,), 0x80033DE10295978F),  # odd already
    (((_A, _B, 0, 0), (1, 0), (0, 0, _B, _A)), 0xAA7FC0FE9ABE9EF5),  # odd already: three sources, mixed lengths
]

FOLD_POISON = 0xA5A5A5A5A5A5A5A5  # row 0 of every source: a fold that read the wrong row would show it
FOLD_SLOT = 1


def fold_vector_sources(sources: tuple) -> list[np.ndarray]:
    """One flat u64 array per source of a REAL_KV_FOLD_VECTORS entry: two rows of ``len(words)`` words (row
    stride = bytes per token = read bytes, page size 1), row 0 poison and row 1, slot FOLD_SLOT, the words."""
    return [np.array((FOLD_POISON,) * len(words) + tuple(words), dtype=np.uint64) for words in sources]


# A test kernel over records.cu's own fold_slot (appended to its source): thread i folds FOLD_SLOT of vector i,
# described by meta[i] = (num_sources, word offset of source 0 in ``words``, its word count, ... for 4 sources).
FOLD_VECTORS_KERNEL = r"""
extern "C" __global__ void fold_vectors(const u64* words, const i64* meta, int nvec, u64* out) {
    const int i = threadIdx.x;
    if (i >= nvec) return;
    const i64* m = meta + (i64)i * (1 + 2 * MAX_SOURCES);
    RealKVParams kv;
    kv.num_sources = m[0];
    for (int k = 0; k < MAX_SOURCES; ++k) {
        const i64 n = m[2 + 2 * k];
        kv.base[k] = reinterpret_cast<const unsigned char*>(words + m[1 + 2 * k]);
        kv.row_stride_bytes[k] = n * 8;
        kv.page_size[k] = 1;
        kv.num_bytes_per_token[k] = n * 8;
        kv.read_words[k] = n;
    }
    out[i] = fold_slot(kv, 1);
}
"""


def fold_vectors_flat() -> tuple[np.ndarray, np.ndarray]:
    """``(words, meta)`` for FOLD_VECTORS_KERNEL: every vector's sources in one u64 array (each source starts on
    an even word, 16 bytes, as the kernel's loads need) and the ``[nvec, 9]`` int64 descriptions."""
    chunks, meta, at = [], [], 0
    for sources, _ in REAL_KV_FOLD_VECTORS:
        row = [len(sources)] + [0, 2] * 4  # absent sources: never read (num_sources), any valid values
        for k, arr in enumerate(fold_vector_sources(sources)):
            row[1 + 2 * k], row[2 + 2 * k] = at, arr.size // 2
            chunks.append(arr)
            at += arr.size
        meta.append(row)
    words = np.concatenate(chunks) if chunks else np.zeros(2, np.uint64)
    return words, np.array(meta, dtype=np.int64)
