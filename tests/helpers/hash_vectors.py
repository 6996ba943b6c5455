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

# The affine chain (SPEC 4): (prev_hash, token, position, link) of a record, as unsigned 64-bit values, worked out
# once with the pure-Python oracle (helpers/naive_records.py chain_link: Python ints, P = 2**61 - 1, TAG = 2**62,
# A = 0x1E5F3A9C7B2D4861, g = mix3(0xC0FFEE1234567890, token, position) mod P) and frozen here. A prev_hash that
# is no chain value (bits 63..61 not 010, or its field value equal to P) links to 0, NOT_A_LINK.
CHAIN_ANCHOR_LINK = 0x5E7FAE23A9A1B71C  # link(-1) = TAG | (splitmix64(0xC0FFEE1234567890) mod P)
CHAIN_LINK_VECTORS = [
    (0x0000000000000000, 0x0000000000000000, 0x0000000000000000, 0x0000000000000000),  # a never-written record
    (0x5E7FAE23A9A1B71C, 0x0000000000000011, 0x0000000000000000, 0x4AE9F285094DFF1C),  # anchor, token 17, pos 0
    (0x5E7FAE23A9A1B71C, 0xFFFFFFFFFFFFFFFF, 0x0000000000000005, 0x4EBA4121FBED08C3),  # token -1
    (0x4000000000000000, 0x0000000000000000, 0x0000000000000000, 0x50CFB7E6FD833017),  # h = 0: TAG | g(0, 0)
    (0x5FFFFFFFFFFFFFFE, 0x0000000000000001, 0x0000000000000002, 0x4B853EBC8FCEC2BF),  # h = P - 1
    (0x5FFFFFFFFFFFFFFF, 0x0000000000000001, 0x0000000000000002, 0x0000000000000000),  # h = P: no chain value
    (0x1FFFFFFFFFFFFFFF, 0x0000000000000001, 0x0000000000000002, 0x0000000000000000),  # no tag
    (0xC000000000000000, 0x0000000000000001, 0x0000000000000002, 0x0000000000000000),  # bit 63 set
    (0x6000000000000001, 0x0000000000000001, 0x0000000000000002, 0x0000000000000000),  # bit 61 set
    (0x4123456789ABCDEF, 0x0000000000007CFF, 0x0000000000000FFF, 0x5A79B6AF9349942E),
    (0x4123456789ABCDEF, 0x0000000000007CFF, 0x0000000000001000, 0x56FD217740DC92B6),  # position + 1
    (0x4123456789ABCDEF, 0x0000000000007CFE, 0x0000000000000FFF, 0x453B58036DA88633),  # token - 1
    (0x4123456789ABCDEE, 0x0000000000007CFF, 0x0000000000000FFF, 0x5C1A7C13181C4BCC),  # prev_hash - 1
    (0x4000000000000001, 0xFFFFFFFFFFFFFFFF, 0x8000000000000000, 0x5ED1F054FE998CB9),
    (0xC0FFEE1234567890, 0x0000000000000001, 0x0000000000000001, 0x0000000000000000),  # the old anchor: no value
]

# (a, b, a * b mod P) for a, b < 2**61 (Python ints): the field product of every backend.
MULMOD_VECTORS = [
    (0x0000000000000000, 0x0000000000000000, 0x0000000000000000),
    (0x0000000000000001, 0x1FFFFFFFFFFFFFFE, 0x1FFFFFFFFFFFFFFE),
    (0x1FFFFFFFFFFFFFFE, 0x1FFFFFFFFFFFFFFE, 0x0000000000000001),
    (0x1000000000000000, 0x1000000000000000, 0x0800000000000000),
    (0x1E5F3A9C7B2D4861, 0x1E5F3A9C7B2D4861, 0x10125F118FFB350C),  # A * A
    (0x082C9B079F767C45, 0x0B791F77BDE5C099, 0x1525E2F4E5F2C2DB),
    (0x161823FBCB91CE37, 0x1AEDA866F1446BEA, 0x1F906E5178C74ED7),
    (0x14DD7193BD69FE29, 0x10F61624EC1D7DA0, 0x106ABC7A099CB52E),
]

# A test kernel over records.cu's own chain_link and mulmod_p (appended to its source).
CHAIN_VECTORS_KERNEL = r"""
extern "C" __global__ void chain_vectors(const u64* ph, const u64* tok, const u64* pos, u64* link, int n,
                                         const u64* a, const u64* b, u64* ab, int nm) {
    const int i = threadIdx.x;
    if (i < n) link[i] = chain_link(ph[i], tok[i], pos[i]);
    if (i < nm) ab[i] = mulmod_p(a[i], b[i]);
}
"""

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
