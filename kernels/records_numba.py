"""kv-canary write / verify / scatter kernels for Numba CUDA: the twin of ``kernels/records.cu`` (SPEC 4).

Same kernels, same names, same structure as records.cu (``canary_write``: work items = segments of requests,
``WRITE_MAX_SEGMENTS`` at most a request, taken by blocks in turn; a segment composes the affine chain of the
entries before it, then per tile of ``write_threads`` entries one block scan gives every entry its running hash,
and every thread checks, reports and stores its own entry (the last occurrence of a slot in a tile stores it);
``canary_verify``: one
thread per entry, grid-stride, processed entries summed per block; ``canary_scatter_*``: one block per batch
row). Semantics: ``docs/records.md``; NumPy reference: ``canary/backends/reference/records.py``.

Deliberate differences from records.cu (argument passing only; the outputs are the same bytes):

- Arguments are arrays and scalars instead of one by-value struct, in the struct's order (``WRITE_PARAMS``,
  ``VERIFY_PARAMS``, ``SCATTER_PARAMS``). Byte buffers arrive as flat ``uint64`` word arrays: the canary
  buffer (slot stride in words), the ring (row stride in elements) and each real-KV source (row stride and
  bytes per token in words); an absent source or optional input is a one-element dummy, with
  ``num_sources`` / ``has_expected_*`` saying so (records.cu gets a null pointer or ``num_sources``).
- Every data value is hashed, compared and stored as ``uint64`` (the ring and the canary words are ``uint64``
  views of the caller's int64 memory): Numba, like NumPy, would promote a uint64 / int64 mix to float64.
- Real-KV words are read one at a time (records.cu: 16-byte loads). The simulator, which CI runs, cannot do
  vector loads, and the fold is not the bottleneck of this kernel.
- Block sizes are the constants ``canary_kernels`` closes over (the simulator, one Python thread per CUDA
  thread, runs the same code with small blocks).
- The write's speed paths are records.cu's only: a request of at most 32 entries by one warp (``write_warp``:
  shuffles, which the simulator lacks), the decoupled look-back across a request's segments (``look_back``:
  the simulator runs one block at a time, so a segment could never wait for another) and the strided
  composition (``compose_range``). Here every request takes the tile path and every segment composes the
  entries before it as contiguous runs; the maps compose associatively in the field, so the bytes are the same.
- The write's block scan runs through shared memory (a Hillis-Steele scan; records.cu scans each warp with
  shuffles first, which the simulator lacks), and ``mulmod_p`` multiplies 32-bit limbs (records.cu:
  ``__umul64hi``): the same field arithmetic, exact either way.
"""
from __future__ import annotations

import functools
import inspect

import numpy as np
from numba import cuda, int32, int64, uint32, uint64

# Block sizes, fail reasons, check flags, counters and sentinels: the ones records.cu has
# (kernels/canary_constants.cuh is generated from the same source), not restated here.
from canary.contract import kernel_constants as _K
from canary.contract.kernel_constants import (
    CHECK_VERIFY_TOKEN, CHECK_WRITE_POSITION_CHAIN, COUNTER_VERIFY, COUNTER_WRITE, ENTRY_WIDE_EXPECTED_INPUT_IDS,
    ENTRY_WIDE_EXPECTED_POSITIONS, ENTRY_WIDE_INPUT_IDS, ENTRY_WIDE_OUT_CACHE_LOC, ENTRY_WIDE_POSITIONS, FAIL_CHAIN,
    FAIL_MISSING,
    FAIL_POSITION, FAIL_REAL_KV, FAIL_SLOT_RANGE, FAIL_VERIFY_TOKEN, FAIL_WRITE_POSITION, FAIL_WRITE_TOKEN,
    LAYER_KIND_SHIFT, LAYER_THREADS, SCATTER_THREADS, VERIFY_THREADS, WRITE_MAX_SEGMENTS, WRITE_THREADS,
)

# A request whose seed is CANARY_SKIP_SEED (INT64_MIN) writes nothing: a padding row whose tokens sit among the
# step's tokens (canary/contract/plans.py SKIP_SEED). Its slots may be stale. An int64, so that the comparison
# with the seeds is int64.
SKIP_SEED = np.int64(_K.CANARY_SKIP_SEED)
# A verify slot of CANARY_MISSING_SLOT (-2^62) is a position the window needs whose SWA mapping was cleared
# (canary/contract/plans.py MISSING_SLOT): reported FAIL_MISSING, nothing read.
MISSING_SLOT = _K.CANARY_MISSING_SLOT

# u64 constants: a Python int literal would make Numba mix int64 into u64 arithmetic (float64 promotion).
# The affine chain (SPEC 4, canary/contract/hashes.py): chain values CHAIN_TAG | h, h in [0, FIELD_P),
# link = CHAIN_TAG | (A h + g) mod P.
FIELD_P = np.uint64(_K.FIELD_P)  # 2^61 - 1
CHAIN_TAG = np.uint64(_K.CHAIN_TAG)
CHAIN_MUL = np.uint64(_K.CHAIN_MUL)  # A
G_KEY = np.uint64(_K.G_KEY)  # splitmix64(CHAIN_ANCHOR)
ANCHOR_LINK = np.uint64(_K.ANCHOR_LINK)  # CHAIN_TAG | (G_KEY mod FIELD_P): link(-1)
NOT_A_LINK = np.uint64(_K.NOT_A_LINK)
ALL_ONES = np.uint64(0xFFFFFFFFFFFFFFFF)  # -1 as u64: "no expectation" / "no predecessor"
U0 = np.uint64(0)
U1 = np.uint64(1)
FIB_HASH = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing of the write's dedup table
DEDUP_EMPTY = np.int64(-1)  # a free bucket (slots < 0 are never inserted)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S27 = np.uint64(27)
_S30 = np.uint64(30)
_S31 = np.uint64(31)
_S29 = np.uint64(29)
_S32 = np.uint64(32)
_S61 = np.uint64(61)
_U2 = np.uint64(2)
_U3 = np.uint64(3)
_LO32 = np.uint64(0xFFFFFFFF)
_LO29 = np.uint64((1 << 29) - 1)

# Real-KV description per source, ``kvp[k * KV_FIELDS + field]`` (int64; strides in u64 words).
KV_ROW_STRIDE_WORDS, KV_PAGE_SIZE, KV_WORDS_PER_TOKEN, KV_READ_WORDS = range(4)
KV_FIELDS = 4

_AU64, _AI64, _AI32, _AU32, _AU8, _I64, _U64 = ("uint64[::1]", "int64[::1]", "int32[::1]", "uint32[::1]", "uint8[::1]",
                                               "int64", "uint64")
STATE_PARAMS = (
    ("canary", _AU64), ("num_slots", _I64), ("slot_stride_words", _I64), ("ring", _AU64),
    ("ring_row_stride", _I64), ("ring_capacity", _I64), ("ring_write_index", _AU32),
    ("slot_run_counter", _AU64), ("kernel_run_counter", _AU64), ("check_flags", _AI32),
    # records.cu's reported_slots pointer: the array and whether it is given (a null pointer there)
    ("reported_slots", _AU8), ("has_reported_slots", _I64), ("tag", _U64),
)
REAL_KV_PARAMS = (("kv0", _AU64), ("kv1", _AU64), ("kv2", _AU64), ("kv3", _AU64), ("kvp", _AI64),
                  ("num_sources", _I64))
WRITE_PARAMS = STATE_PARAMS + REAL_KV_PARAMS + (
    ("write_offsets", _AI64), ("write_seed_slot_indices", _AI64), ("write_num_valid_reqs", _AI32),
    # The token arrays as int32 words, two an element for an int64 array (entry_wide: records.cu's load_int)
    ("write_req_capacity", _I64), ("out_cache_loc", _AI32), ("input_ids", _AI32), ("positions", _AI32),
    ("num_entries", _I64), ("expected_input_ids", _AI32), ("expected_positions", _AI32),
    ("has_expected_input_ids", _I64), ("has_expected_positions", _I64), ("entry_wide", _I64),
)
VERIFY_PARAMS = STATE_PARAMS + REAL_KV_PARAMS + (
    ("verify_slot_indices", _AI64), ("verify_expected_tokens", _AI64), ("verify_expected_positions", _AI64),
    ("verify_prev_slot_indices", _AI64), ("verify_capacity", _I64), ("verify_num_valid", _AI32),
    ("enable", _AI32),
)


def scatter_params(token_type: str):
    return (("pool", _AI32), ("pool_rows", _I64), ("pool_cols", _I64), ("pool_row_stride", _I64),
            ("req_pool_indices", _AI64), ("bs", _I64), ("tokens", token_type), ("num_tokens", _I64),
            ("token_offsets", _AI64), ("column_starts", _AI64), ("column_offset", _I64))


def _signature(params) -> str:
    return "void({})".format(", ".join(ty for _, ty in params))


@cuda.jit(device=True)
def load_int(words, wide, i):
    """records.cu's ``load_int``: element ``i`` of an int32 array, or of an int64 one given as its int32 words
    (little-endian: the low word first), as an int64 (SPEC 2 (*))."""
    if wide != 0:
        return (int64(words[2 * i]) & int64(0xFFFFFFFF)) | (int64(words[2 * i + 1]) << 32)
    return int64(words[i])


@cuda.jit(device=True)
def splitmix64(x):
    x = x ^ (x >> _S30)
    x = x * _M1
    x = x ^ (x >> _S27)
    x = x * _M2
    return x ^ (x >> _S31)


@cuda.jit(device=True)
def mix3(a, b, c):
    return splitmix64(splitmix64(splitmix64(a) ^ b) ^ c)


@cuda.jit(device=True)
def mulmod_p(a, b):
    """``a * b mod P`` for ``a, b < 2**61`` from 32-bit limbs: ``8 a1 b1 + (a1 b0 + a0 b1) 2**32 + a0 b0`` mod P,
    the middle term split at bit 29 (every partial below 2**62), then two folds at bit 61."""
    a0 = a & _LO32
    a1 = a >> _S32
    b0 = b & _LO32
    b1 = b >> _S32
    mid = a1 * b0 + a0 * b1
    low = a0 * b0
    x = ((a1 * b1) << _U3) + (mid >> _S29) + ((mid & _LO29) << _S32) + (low & FIELD_P) + (low >> _S61)
    r = (x & FIELD_P) + (x >> _S61)
    return r - FIELD_P if r >= FIELD_P else r


@cuda.jit(device=True)
def addmod_p(a, b):
    x = a + b
    return x - FIELD_P if x >= FIELD_P else x


@cuda.jit(device=True)
def chain_g(tok, pos):
    """``g(t, p) = mix3(CHAIN_ANCHOR, t, p) mod P``."""
    x = splitmix64(splitmix64(G_KEY ^ tok) ^ pos)
    x = (x & FIELD_P) + (x >> _S61)
    return x - FIELD_P if x >= FIELD_P else x


@cuda.jit(device=True)
def powmod_p(a, e):
    """``a ** e mod P`` by squaring (records.cu ``powmod_p``; ``e`` a count of entries)."""
    r = U1
    while e > 0:
        if e & 1:
            r = mulmod_p(r, a)
        a = mulmod_p(a, a)
        e >>= 1
    return r


@cuda.jit(device=True)
def chain_valid(v):
    """Whether ``v`` is a chain value ``CHAIN_TAG | h`` with ``h < P`` (its field value is ``v & FIELD_P``)."""
    return (v >> _S61) == _U2 and (v & FIELD_P) != FIELD_P


@cuda.jit(device=True)
def chain_link(prev_hash, tok, pos):
    if not chain_valid(prev_hash):
        return NOT_A_LINK
    return CHAIN_TAG | addmod_p(mulmod_p(CHAIN_MUL, prev_hash & FIELD_P), chain_g(tok, pos))


@cuda.jit(device=True)
def clamp64(v, lo, hi):
    return lo if v < lo else (hi if v > hi else v)


@cuda.jit(device=True)
def fold_source(words, kvp, k, slot):
    """One source's hash of ``slot``: ``h = s(h ^ w)`` over its words (docs/records.md 3)."""
    b = k * KV_FIELDS
    ps = kvp[b + KV_PAGE_SIZE]
    at = (slot // ps) * kvp[b + KV_ROW_STRIDE_WORDS] + (slot % ps) * kvp[b + KV_WORDS_PER_TOKEN]
    h = U0
    for w in range(kvp[b + KV_READ_WORDS]):
        h = splitmix64(h ^ words[at + w])
    return h


@cuda.jit(device=True)
def fold_slot(kv0, kv1, kv2, kv3, kvp, num_sources, slot):
    """SPEC 4's real-KV fold of a slot in [0, num_slots): ``acc = s(acc ^ h_source)`` over the sources, then
    ``acc | 1`` (never the 0 of a never-written record, which all-zero bytes would fold to); 0 without sources."""
    acc = U0
    if num_sources > 0:
        acc = splitmix64(acc ^ fold_source(kv0, kvp, 0, slot))
    if num_sources > 1:
        acc = splitmix64(acc ^ fold_source(kv1, kvp, 1, slot))
    if num_sources > 2:
        acc = splitmix64(acc ^ fold_source(kv2, kvp, 2, slot))
    if num_sources > 3:
        acc = splitmix64(acc ^ fold_source(kv3, kvp, 3, slot))
    if num_sources > 0:
        acc = acc | U1
    return acc


@cuda.jit(device=True)
def reported(reported_slots, has_reported_slots, num_slots, s, bit):
    """records.cu's ``reported``: whether slot ``s``'s byte has ``bit`` (SPEC 4, reported slots)."""
    return has_reported_slots != 0 and s >= 0 and s < num_slots and (int64(reported_slots[s]) & bit) != 0


@cuda.jit(device=True)
def append_row(ring, ring_row_stride, ring_capacity, ring_write_index, tag, slot, position, stored_token,
               expected_token, stored_hash, expected_aux, reasons):
    """Fill-once ring: claim an index (uint32, keeps counting past capacity); write the row iff it fits."""
    k = int64(cuda.atomic.add(ring_write_index, 0, uint32(1)))
    if k < ring_capacity:
        at = k * ring_row_stride
        ring[at] = tag
        ring[at + 1] = slot
        ring[at + 2] = position
        ring[at + 3] = stored_token
        ring[at + 4] = expected_token
        ring[at + 5] = stored_hash
        ring[at + 6] = expected_aux
        ring[at + 7] = reasons


@functools.lru_cache(maxsize=None)
def make_block_count(threads: int):
    """records.cu's ``add_block_count`` for one block size: the block's processed entries, added once to a
    run counter. A tree sum through shared memory (records.cu sums each warp with shuffles first, which the
    simulator lacks); either way no longer one shared atomic per thread, the verify kernel's main stall."""

    @cuda.jit(device=True)
    def add_block_count(mine, counter, index):
        part = cuda.shared.array(threads, uint64)
        t = cuda.threadIdx.x
        part[t] = mine
        cuda.syncthreads()
        d = threads // 2
        while d > 0:
            if t < d:
                part[t] += part[t + d]
            cuda.syncthreads()
            d //= 2
        if t == 0 and part[0] != U0:
            cuda.atomic.add(counter, index, part[0])

    return add_block_count


def _jit_options(threads: int) -> dict:
    try:
        takes = "launch_bounds" in inspect.signature(cuda.jit).parameters
    except (TypeError, ValueError):  # pragma: no cover
        takes = False
    return {"launch_bounds": (int(threads),)} if takes else {}


@functools.lru_cache(maxsize=None)
def kernel_functions(write_threads: int = WRITE_THREADS, verify_threads: int = VERIFY_THREADS,
                     scatter_threads: int = SCATTER_THREADS, padding_slot: int = 0):
    """The plain Python kernels ``(canary_write, canary_verify, canary_scatter)`` for the given block sizes
    (constants to Numba: they size shared arrays) and the records' ``padding_slot`` (0 or -1: records.cu's
    ``CANARY_PADDING_NEG``, SPEC 3.2 "No reserved slot"; verify only)."""
    PAD_NEG = int(padding_slot) == -1  # noqa: N806 - slot 0 is real: verified, and a predecessor 0 has a link
    FIRST_SLOT = 0 if PAD_NEG else 1  # noqa: N806
    NO_LINK = MISSING_SLOT if PAD_NEG else 0  # noqa: N806 - the predecessor that has no link
    WT = int(write_threads)
    VT = int(verify_threads)
    for name, value in (("write_threads", WT), ("verify_threads", VT)):
        if value < 1 or value & (value - 1):  # the block sums halve the block
            raise ValueError(f"{name}: expected a power of two, got {value}")


    def make_block_scan(threads):
        """records.cu's ``block_scan`` of ``ChainElem`` ``(a, b, pos, has)``: a Hillis-Steele scan in shared
        memory. Returns the thread's exclusive prefix and the block's total (8 values); every thread calls it."""

        @cuda.jit(device=True)
        def block_scan(a, b, pos, has):
            sa = cuda.shared.array(threads, uint64)
            sb = cuda.shared.array(threads, uint64)
            sp = cuda.shared.array(threads, uint64)
            sh = cuda.shared.array(threads, int32)
            t = cuda.threadIdx.x
            sa[t] = a
            sb[t] = b
            sp[t] = pos
            sh[t] = has
            cuda.syncthreads()
            d = 1
            while d < threads:
                oa = U1
                ob = U0
                op = U0
                oh = 0
                if t >= d:
                    oa = sa[t - d]
                    ob = sb[t - d]
                    op = sp[t - d]
                    oh = sh[t - d]
                cuda.syncthreads()
                if t >= d:  # combine(earlier, mine)
                    ca = sa[t]
                    sa[t] = mulmod_p(ca, oa)
                    sb[t] = addmod_p(mulmod_p(ca, ob), sb[t])
                    if sh[t] == 0:
                        sp[t] = op
                        sh[t] = oh
                cuda.syncthreads()
                d *= 2
            ea = U1
            eb = U0
            ep = U0
            eh = 0
            if t > 0:
                ea = sa[t - 1]
                eb = sb[t - 1]
                ep = sp[t - 1]
                eh = sh[t - 1]
            ta = sa[threads - 1]
            tb = sb[threads - 1]
            tp = sp[threads - 1]
            th = sh[threads - 1]
            cuda.syncthreads()  # the next scan rewrites the arrays
            return ea, eb, ep, eh, ta, tb, tp, th

        return block_scan

    WT2 = 2 * WT  # noqa: N806 - the dedup table's size (records.cu DEDUP_SIZE: two tiles), a constant to Numba
    DMASK = WT2 - 1  # noqa: N806

    @cuda.jit(device=True)
    def dedup_home(slot):
        return int64((uint64(slot) * FIB_HASH) >> _S32) & DMASK

    @cuda.jit(device=True)
    def dedup_insert(key, owner, slot, tid):
        """records.cu's ``dedup_insert``: claim the slot's bucket (open addressing), keep the highest thread."""
        b = dedup_home(slot)
        while True:
            old = cuda.atomic.cas(key, b, DEDUP_EMPTY, slot)
            if old == DEDUP_EMPTY or old == slot:
                cuda.atomic.max(owner, b, int32(tid))
                return
            b = (b + 1) & DMASK

    @cuda.jit(device=True)
    def dedup_last(key, owner, slot, tid):
        """Whether thread ``tid`` is the last occurrence of ``slot`` in the tile (records.cu ``dedup_last``)."""
        b = dedup_home(slot)
        while key[b] != slot:
            b = (b + 1) & DMASK
        return owner[b] == tid

    write_block_count = make_block_count(WT)
    block_scan = make_block_scan(WT)
    K = WRITE_MAX_SEGMENTS

    @cuda.jit(device=True)
    def segment_len(n):
        """records.cu's ``segment_len``: at most K segments of whole tiles."""
        per = (n + K - 1) // K
        return (per + WT - 1) // WT * WT
    verify_block_count = make_block_count(VT)

    def canary_write(canary, num_slots, slot_stride_words, ring, ring_row_stride, ring_capacity, ring_write_index,
                     slot_run_counter, kernel_run_counter, check_flags, reported_slots, has_reported_slots, tag, kv0, kv1, kv2, kv3, kvp, num_sources,
                     write_offsets, write_seed_slot_indices, write_num_valid_reqs, write_req_capacity,
                     out_cache_loc, input_ids, positions, num_entries, expected_input_ids, expected_positions,
                     has_expected_input_ids, has_expected_positions, entry_wide):
        """Any grid, block WT: work items (request, segment) taken in turn (records.cu's canary_write)."""
        s_items = cuda.shared.array(WT, int64)
        s_nitems = cuda.shared.array(1, int32)
        s_key = cuda.shared.array(WT2, int64)  # records.cu's dedup table: slot -> its last thread
        s_owner = cuda.shared.array(WT2, int32)
        tid = cuda.threadIdx.x
        if cuda.blockIdx.x == 0 and tid == 0:
            cuda.atomic.add(kernel_run_counter, COUNTER_WRITE, U1)
        nreq = clamp64(int64(write_num_valid_reqs[0]), int64(0), write_req_capacity)
        n = num_entries
        items = nreq * K
        grid = int64(cuda.gridDim.x)
        blk = int64(cuda.blockIdx.x)
        chain_on = (check_flags[0] & CHECK_WRITE_POSITION_CHAIN) != 0
        processed = U0
        c = int64(0)
        while c * grid + blk < items:  # block-uniform
            if tid == 0:
                s_nitems[0] = 0
            cuda.syncthreads()
            w = (c + tid) * grid + blk
            if w < items:  # segment-major, as records.cu: decode's one-segment requests spread over the blocks
                r = w % nreq
                k = w // nreq
                if write_seed_slot_indices[r] != SKIP_SEED:  # a padding row's tokens: nothing of them is looked at
                    ln = clamp64(write_offsets[r + 1], int64(0), n) - clamp64(write_offsets[r], int64(0), n)
                    if ln > 0 and k * segment_len(ln) < ln:
                        s_items[cuda.atomic.add(s_nitems, 0, 1)] = w
            cuda.syncthreads()
            m_items = s_nitems[0]
            for q in range(m_items):
                w2 = s_items[q]
                r = w2 % nreq
                k = w2 // nreq
                start = clamp64(write_offsets[r], int64(0), n)
                end = clamp64(write_offsets[r + 1], int64(0), n)
                seg = segment_len(end - start)
                lo = start + k * seg
                hi = min(lo + seg, end)
                # The seed, read by every thread before any store of this segment (the scans' barriers order them).
                h = ANCHOR_LINK & FIELD_P
                valid = True
                prev_pos = ALL_ONES
                seed = write_seed_slot_indices[r]
                if seed >= 0 and seed < num_slots:
                    at = seed * slot_stride_words
                    link0 = chain_link(canary[at + 2], canary[at], canary[at + 1])
                    valid = chain_valid(link0)
                    h = link0 & FIELD_P
                    prev_pos = canary[at + 1]
                if lo > start:  # compose the chain of the request's entries before this segment
                    per = (lo - start + WT - 1) // WT
                    i0 = start + tid * per
                    i1 = min(i0 + per, lo)
                    rb = U0
                    rp = U0
                    rc = int64(0)
                    for i in range(i0, i1):  # only b is serial: the multiplier is A^count (records.cu compose_run)
                        sl = load_int(out_cache_loc, entry_wide & ENTRY_WIDE_OUT_CACHE_LOC, i)
                        if sl >= 0 and sl < num_slots:
                            pi = uint64(load_int(positions, entry_wide & ENTRY_WIDE_POSITIONS, i))
                            rb = addmod_p(mulmod_p(CHAIN_MUL, rb),
                                          chain_g(uint64(load_int(input_ids, entry_wide & ENTRY_WIDE_INPUT_IDS, i)), pi))
                            rp = pi
                            rc += 1
                    ra = powmod_p(CHAIN_MUL, rc)
                    rh = 1 if rc > 0 else 0
                    _, _, _, _, ta, tb, tp, th = block_scan(ra, rb, rp, rh)
                    h = addmod_p(mulmod_p(ta, h), tb)
                    if th != 0:
                        prev_pos = tp
                base = lo
                while base < hi:
                    i = base + tid
                    dedup = hi - base > 1  # block-uniform
                    if dedup:  # the previous tile's lookups are behind the loop's closing barrier
                        s_key[tid] = DEDUP_EMPTY
                        s_key[tid + WT] = DEDUP_EMPTY
                        s_owner[tid] = -1
                        s_owner[tid + WT] = -1
                    slot = int64(-1)
                    tok = U0
                    pos = U0
                    et = ALL_ONES
                    ep = ALL_ONES
                    kvh = U0
                    ea = U1
                    eb = U0
                    eh = 0
                    if i < hi:
                        slot = load_int(out_cache_loc, entry_wide & ENTRY_WIDE_OUT_CACHE_LOC, i)
                        tok = uint64(load_int(input_ids, entry_wide & ENTRY_WIDE_INPUT_IDS, i))
                        pos = uint64(load_int(positions, entry_wide & ENTRY_WIDE_POSITIONS, i))
                        if has_expected_input_ids != 0:
                            et = uint64(load_int(expected_input_ids, entry_wide & ENTRY_WIDE_EXPECTED_INPUT_IDS, i))
                        if has_expected_positions != 0:
                            ep = uint64(load_int(expected_positions, entry_wide & ENTRY_WIDE_EXPECTED_POSITIONS, i))
                        if slot >= 0 and slot < num_slots:  # out-of-range entries neither store nor advance the chain
                            kvh = fold_slot(kv0, kv1, kv2, kv3, kvp, num_sources, slot)
                            ea = CHAIN_MUL
                            eb = chain_g(tok, pos)
                            eh = 1
                    if dedup:
                        cuda.syncthreads()  # the table is clear
                        if slot >= 0 and slot < num_slots:
                            dedup_insert(s_key, s_owner, slot, tid)
                    xa, xb, xp, xh, ta, tb, tp, th = block_scan(ea, eb, pos, eh)  # its barriers publish the table
                    if i < hi and slot >= 0:
                        processed += U1
                        stored = slot < num_slots
                        run = NOT_A_LINK
                        if valid:
                            run = CHAIN_TAG | addmod_p(mulmod_p(xa, h), xb)
                        chain_exp = (xp if xh != 0 else prev_pos) + U1
                        bits = 0 if stored else FAIL_SLOT_RANGE
                        if et != ALL_ONES and tok != et:
                            bits |= FAIL_WRITE_TOKEN
                        arr_fail = ep != ALL_ONES and pos != ep
                        chain_fail = chain_on and pos != chain_exp
                        if arr_fail or chain_fail:
                            bits |= FAIL_WRITE_POSITION
                        if arr_fail:
                            aux = ep
                        elif chain_fail:
                            aux = chain_exp
                        elif ep != ALL_ONES:
                            aux = ep
                        elif chain_on:
                            aux = chain_exp
                        else:
                            aux = ALL_ONES
                        if bits != 0:
                            append_row(ring, ring_row_stride, ring_capacity, ring_write_index, tag, uint64(slot), pos,
                                       tok, et, run, aux, uint64(bits))
                        last = stored
                        if last and dedup:
                            last = dedup_last(s_key, s_owner, slot, tid)
                        if last:
                            at = slot * slot_stride_words
                            canary[at] = tok
                            canary[at + 1] = pos
                            canary[at + 2] = run
                            canary[at + 3] = kvh
                    h = addmod_p(mulmod_p(ta, h), tb)
                    if th != 0:
                        prev_pos = tp
                    cuda.syncthreads()  # the next tile reuses the table
                    base += WT
            cuda.syncthreads()  # s_items and s_nitems are rewritten next round
            c += WT
        write_block_count(processed, slot_run_counter, COUNTER_WRITE)

    def canary_verify(canary, num_slots, slot_stride_words, ring, ring_row_stride, ring_capacity, ring_write_index,
                      slot_run_counter, kernel_run_counter, check_flags, reported_slots, has_reported_slots, tag, kv0, kv1, kv2, kv3, kvp, num_sources,
                      verify_slot_indices, verify_expected_tokens, verify_expected_positions,
                      verify_prev_slot_indices, verify_capacity, verify_num_valid, enable):
        """Any grid: one thread per entry, grid-stride (records.cu's canary_verify)."""
        if cuda.blockIdx.x == 0 and cuda.threadIdx.x == 0:
            cuda.atomic.add(kernel_run_counter, COUNTER_VERIFY, U1)
        if enable[0] == 0:
            return
        n = clamp64(int64(verify_num_valid[0]), int64(0), verify_capacity)
        token_on = (check_flags[0] & CHECK_VERIFY_TOKEN) != 0
        processed = U0
        i = int64(cuda.blockIdx.x) * cuda.blockDim.x + cuda.threadIdx.x
        stride = int64(cuda.gridDim.x) * cuda.blockDim.x
        while i < n:
            slot = verify_slot_indices[i]
            if PAD_NEG or slot != 0:  # 0: padding
                processed += U1
                ep = uint64(verify_expected_positions[i])
                et = uint64(verify_expected_tokens[i])
                if slot < 0 or slot >= num_slots:
                    # A MISSING row's expected_aux is the entry's predecessor slot (it names the request)
                    missing = slot == MISSING_SLOT
                    prev = verify_prev_slot_indices[i]
                    if not (missing and reported(reported_slots, has_reported_slots, num_slots, prev, 2)):
                        append_row(ring, ring_row_stride, ring_capacity, ring_write_index, tag, uint64(slot), ep, U0,
                                   et, U0, uint64(prev) if missing else U0,
                                   uint64(FAIL_MISSING if missing else FAIL_SLOT_RANGE))
                else:
                    prev = verify_prev_slot_indices[i]
                    at = slot * slot_stride_words
                    tok = canary[at]
                    pos = canary[at + 1]
                    stored_hash = canary[at + 2]
                    kvh = canary[at + 3]
                    bits = 0
                    expected = U0
                    checked = True
                    if prev == -1:
                        expected = ANCHOR_LINK
                    elif prev >= FIRST_SLOT and prev < num_slots:
                        pat = prev * slot_stride_words
                        expected = chain_link(canary[pat + 2], canary[pat], canary[pat + 1])
                    else:
                        checked = False  # NO_LINK: the predecessor page was freed (SWA); anything else: out of range
                        if prev != NO_LINK:
                            bits |= FAIL_SLOT_RANGE
                    if checked and stored_hash != expected:
                        bits |= FAIL_CHAIN
                    if pos != ep:
                        bits |= FAIL_POSITION
                    if token_on and et != ALL_ONES and tok != et:
                        bits |= FAIL_VERIFY_TOKEN
                    if num_sources > 0 and kvh != fold_slot(kv0, kv1, kv2, kv3, kvp, num_sources, slot):
                        bits |= FAIL_REAL_KV
                    if bits != 0 and not reported(reported_slots, has_reported_slots, num_slots, slot, 1):
                        append_row(ring, ring_row_stride, ring_capacity, ring_write_index, tag, uint64(slot), ep,
                                   tok, et, stored_hash, expected, uint64(bits))
            i += stride
        verify_block_count(processed, slot_run_counter, COUNTER_VERIFY)

    def canary_scatter(pool, pool_rows, pool_cols, pool_row_stride, req_pool_indices, bs, tokens, num_tokens,
                       token_offsets, column_starts, column_offset):
        """Grid bs (at least 1): one block per batch row (records.cu's scatter)."""
        r = int64(cuda.blockIdx.x)
        if r >= bs:
            return
        rp = req_pool_indices[r]
        if rp <= 0 or rp >= pool_rows:
            return  # 0: padding row
        start = clamp64(token_offsets[r], int64(0), num_tokens)
        end = clamp64(token_offsets[r + 1], int64(0), num_tokens)
        # Column arithmetic in u64: the reference's int64 wraparound, without signed overflow.
        col0 = uint64(column_starts[r]) + uint64(column_offset)
        row = rp * pool_row_stride
        j = int64(cuda.threadIdx.x)
        while j < end - start:
            col = int64(col0 + uint64(j))
            if col >= 0 and col < pool_cols:
                pool[row + col] = int32(tokens[start + j])
            j += cuda.blockDim.x

    return canary_write, canary_verify, canary_scatter


@functools.lru_cache(maxsize=None)
def canary_kernels(write_threads: int = WRITE_THREADS, verify_threads: int = VERIFY_THREADS,
                   scatter_threads: int = SCATTER_THREADS, padding_slot: int = 0):
    """``(canary_write, canary_verify, canary_scatter_i64, canary_scatter_i32)``, compiled eagerly once per
    process and ``padding_slot`` (records.cu's launch bounds)."""
    write, verify, scatter = kernel_functions(int(write_threads), int(verify_threads), int(scatter_threads),
                                              int(padding_slot))
    out = [cuda.jit(_signature(WRITE_PARAMS), **_jit_options(write_threads))(write),
           cuda.jit(_signature(VERIFY_PARAMS), **_jit_options(verify_threads))(verify)]
    for ty in ("int64[::1]", "int32[::1]"):
        out.append(cuda.jit(_signature(scatter_params(ty)), **_jit_options(scatter_threads))(scatter))
    return tuple(out)


# ---- The layer rotation: the twin of records.cu's canary_write_layers / canary_verify_layer (docs/records.md 10).
# Deliberate difference: records.cu reads a device table of per-layer base pointers; Numba has no raw pointers,
# so the layers' word arrays arrive as one tuple ``layer_words`` (source k of layer l at ``l * num_sources + k``),
# a kernel argument whose length is part of the compiled signature (compiled once per tuple length).
_AU64_TUPLE = "UniTuple(uint64[::1], {})"
LAYER_PARAMS = STATE_PARAMS + (
    ("kvp", _AI64), ("num_sources", _I64), ("layer_words", _AU64_TUPLE), ("num_layers", _I64), ("dwell", _I64),
    ("layer_hashes", _AU64), ("layer_cursor", _AI32),
    ("write_offsets", _AI64), ("write_seed_slot_indices", _AI64), ("write_num_valid_reqs", _AI32),
    ("write_req_capacity", _I64), ("out_cache_loc", _AI32), ("num_entries", _I64),
    ("verify_slot_indices", _AI64), ("verify_expected_tokens", _AI64), ("verify_expected_positions", _AI64),
    ("verify_capacity", _I64), ("verify_num_valid", _AI32), ("enable", _AI32), ("entry_wide", _I64),
)


@cuda.jit(device=True)
def cursor_layer(layer_cursor, num_layers):
    """A corrupt cursor (outside [0, num_layers)) reads as layer 0 (records.cu's cursor_layer)."""
    c = int64(layer_cursor[0])
    return c if c >= 0 and c < num_layers else int64(0)


@cuda.jit(device=True)
def fold_layer(layer_words, kvp, num_sources, layer, slot):
    """fold_slot over layer ``layer``'s sources (absent ones are a repeat of the first: never read)."""
    b = layer * num_sources
    last = num_sources - 1
    return fold_slot(layer_words[b], layer_words[b + min(1, last)], layer_words[b + min(2, last)],
                     layer_words[b + min(3, last)], kvp, num_sources, slot)


@cuda.jit(device=True)
def owner_of(write_offsets, nreq, num_entries, i):
    """The last request r < nreq whose clamped start is <= i (-1: none), records.cu's binary search."""
    lo = int64(0)
    hi = nreq
    while lo < hi:
        mid = (lo + hi) >> 1
        if clamp64(write_offsets[mid], int64(0), num_entries) <= i:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@functools.lru_cache(maxsize=None)
def layer_kernel_functions(threads: int = LAYER_THREADS, padding_slot: int = 0):
    """The plain Python kernels ``(canary_write_layers, canary_verify_layer)`` for a block size (a power of two)
    and the records' ``padding_slot`` (0 or -1: whether verify_layer skips slot 0)."""
    PAD_NEG = int(padding_slot) == -1  # noqa: N806
    FIRST_SLOT = 0 if PAD_NEG else 1  # noqa: N806
    T = int(threads)
    if T < 1 or T & (T - 1):
        raise ValueError(f"threads: expected a power of two, got {T}")

    add_block_count = make_block_count(T)

    def canary_write_layers(canary, num_slots, slot_stride_words, ring, ring_row_stride, ring_capacity,
                            ring_write_index, slot_run_counter, kernel_run_counter, check_flags, reported_slots, has_reported_slots, tag, kvp, num_sources,
                            layer_words, num_layers, dwell, layer_hashes, layer_cursor, write_offsets,
                            write_seed_slot_indices, write_num_valid_reqs, write_req_capacity, out_cache_loc,
                            num_entries, verify_slot_indices, verify_expected_tokens, verify_expected_positions,
                            verify_capacity, verify_num_valid, enable, entry_wide):
        """Any grid: grid-stride over (entry, layer) pairs; thread 0 advances the cursor (records.cu)."""
        if cuda.blockIdx.x == 0 and cuda.threadIdx.x == 0:
            layer = cursor_layer(layer_cursor, num_layers)
            spent = int64(layer_cursor[1]) + 1
            if spent >= dwell or spent < 1:
                layer = (layer + 1) % num_layers
                spent = int64(0)
            layer_cursor[0] = int32(layer)
            layer_cursor[1] = int32(spent)
        nreq = clamp64(int64(write_num_valid_reqs[0]), int64(0), write_req_capacity)
        total = num_entries * num_layers
        j = int64(cuda.blockIdx.x) * cuda.blockDim.x + cuda.threadIdx.x
        stride = int64(cuda.gridDim.x) * cuda.blockDim.x
        while j < total:
            i = j // num_layers
            layer = j % num_layers
            r = owner_of(write_offsets, nreq, num_entries, i)
            if r >= 0 and i < clamp64(write_offsets[r + 1], int64(0), num_entries) and \
                    write_seed_slot_indices[r] != SKIP_SEED:
                slot = load_int(out_cache_loc, entry_wide & ENTRY_WIDE_OUT_CACHE_LOC, i)
                if slot >= 0 and slot < num_slots:
                    layer_hashes[slot * num_layers + layer] = fold_layer(layer_words, kvp, num_sources, layer, slot)
            j += stride

    def canary_verify_layer(canary, num_slots, slot_stride_words, ring, ring_row_stride, ring_capacity,
                            ring_write_index, slot_run_counter, kernel_run_counter, check_flags, reported_slots, has_reported_slots, tag, kvp, num_sources,
                            layer_words, num_layers, dwell, layer_hashes, layer_cursor, write_offsets,
                            write_seed_slot_indices, write_num_valid_reqs, write_req_capacity, out_cache_loc,
                            num_entries, verify_slot_indices, verify_expected_tokens, verify_expected_positions,
                            verify_capacity, verify_num_valid, enable, entry_wide):
        """Any grid: one thread per verify entry, grid-stride (records.cu's canary_verify_layer)."""
        if cuda.blockIdx.x == 0 and cuda.threadIdx.x == 0:
            cuda.atomic.add(kernel_run_counter, COUNTER_VERIFY, U1)
        if enable[0] == 0:
            return
        n = clamp64(int64(verify_num_valid[0]), int64(0), verify_capacity)
        layer = cursor_layer(layer_cursor, num_layers)
        row_tag = tag | (uint64(layer) << uint64(LAYER_KIND_SHIFT))
        processed = U0
        i = int64(cuda.blockIdx.x) * cuda.blockDim.x + cuda.threadIdx.x
        stride = int64(cuda.gridDim.x) * cuda.blockDim.x
        while i < n:
            slot = verify_slot_indices[i]
            if PAD_NEG or slot != 0:
                processed += U1
                if slot >= FIRST_SLOT and slot < num_slots:
                    stored = layer_hashes[slot * num_layers + layer]
                    fresh = fold_layer(layer_words, kvp, num_sources, layer, slot)
                    if stored != fresh and not reported(reported_slots, has_reported_slots, num_slots, slot, 1):
                        append_row(ring, ring_row_stride, ring_capacity, ring_write_index, row_tag, uint64(slot),
                                   uint64(verify_expected_positions[i]), canary[slot * slot_stride_words],
                                   uint64(verify_expected_tokens[i]), stored, fresh, uint64(FAIL_REAL_KV))
            i += stride
        add_block_count(processed, slot_run_counter, COUNTER_VERIFY)

    return canary_write_layers, canary_verify_layer


@functools.lru_cache(maxsize=None)
def layer_kernels(num_arrays: int, threads: int = LAYER_THREADS, padding_slot: int = 0):
    """``(canary_write_layers, canary_verify_layer)`` compiled eagerly for a ``layer_words`` tuple of
    ``num_arrays`` arrays (``num_layers * num_sources``) and ``padding_slot``."""
    sig = "void({})".format(", ".join(ty.format(int(num_arrays)) for _, ty in LAYER_PARAMS))
    write, verify = layer_kernel_functions(int(threads), int(padding_slot))
    return (cuda.jit(sig, **_jit_options(threads))(write), cuda.jit(sig, **_jit_options(threads))(verify))
