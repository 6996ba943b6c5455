"""kv-canary planning kernels for Numba CUDA: the twin of ``kernels/plan.cu`` (SPEC 3.2, 3.4).

Same kernels, same structure, same names as plan.cu, so a reader finds each piece in both files:

- ``canary_plan_fused`` (bs <= ``FUSED_MAX_BS``, one launch): every block scans the rows itself
  (``scan_rows``) into a row table in shared memory, then emits its share of the verify entries
  (``emit_entries``); block 0 also writes the write side.
- ``canary_plan_rows`` + ``canary_plan_entries`` (larger batches, two launches): one block of
  ``ROWS_THREADS`` scans all rows into the row table in the scratch; then a grid emits the entries, each warp
  pass finding its rows through ``ROW_SAMPLES`` row offsets sampled into shared memory. A sampled step's
  cursors are reset by the rows kernel (their only reader) and advanced by the entries kernel's threads.
- The row table (plan.cu's ``RowTable``, in kernels/plan_rows.cuh: off, base, pdelta, pbase, vlim per row)
  gives an entry everything it needs of its row after one search: position = i + pdelta[r], req_to_token index = base[r] + i, expected
  token at pbase[r] + col while 0 <= col < vlim[r] (col = position + token_offset, compared raw as the
  reference does: valid_lens may be garbage such as INT64_MIN).
- ``emit_entries``: warp passes of ``ENTRY_CHUNK`` = ITEMS * 32 consecutive entries (lane-major inside each of
  the ITEMS groups, so stores stay coalesced), all loads of a pass issued before its stores; the rows of the
  pass's first and last entries are found once per pass, and each entry searches only between them (no step
  at all when the pass lies in one row, as in decode).
- With a LUT, the last block to finish (``finalize``) composes status / enable / verify_num_valid and re-arms
  the scratch counters, so a launch leaves the scratch as it found it (CUDA-graph replays stay correct).
  Without a LUT the row scan alone decides the status and one block writes it: no atomics.

All three kernels take the same arguments: the fields of plan.cu's ``PlanParams`` (declared in
``canary/contract/plan_layout.py``, generated into ``kernels/canary_constants.cuh``), in its order
(``PARAMS``; one ``SIGNATURE``). Grids are sized from verify_capacity by the caller, never from data
(``canary/contract/plan_layout.py`` ``entry_grid``: occupancy-bounded, as plan.cu's host side).

Deliberate differences from plan.cu (speed structure only; the outputs are the same bytes):

- No warp shuffles (the Numba CUDA simulator, which CI runs, has neither shuffles nor ``syncwarp``):
  ``block_scan2`` scans through shared memory (Hillis-Steele, ping-pong buffers: one barrier per step); the
  rows of a pass's first and last entries are found by every lane (two interleaved searches over the same
  addresses, broadcast reads) instead of lanes 0 and 1 plus a shuffle; and each entry re-reads its
  predecessor from ``req_to_token`` (the neighbouring word, mostly an L1 hit) and translates it, instead of
  taking the left lane's slot by shuffle.
- ``scan_rows`` gives each thread ``NUMBA_ROW_BATCH`` consecutive rows per batch (plan.cu: one row per thread in
  each of ROW_BATCH tiles). The loads of a batch are still issued together, and a batch needs one block
  scan instead of ROW_BATCH: barriers, not bandwidth, dominate a shared-memory scan here.
- The scratch (this backend's own, ``NUMBA_SCRATCH_*``) has plan.cu's first head words but not its
  ``SCRATCH_READERS`` / ``SCRATCH_SIDE``, then the two-pass row table, ``NUMBA_TABLE_ARRAYS`` arrays of
  ``write_req_capacity + 1`` (``scratch_words``). A sampled fused step moves the cursors in the last block to
  finish (``finalize``), where plan.cu gives its
  fused grid one extra block that moves them once the others have read them: the same cursors, no block more.
- Compile-time specializations are the constants ``kernel_functions`` closes over (Numba folds them):
  ``HAS_LUT``, ``HAS_POOL``, ``FORM`` (the index form, SPEC 3.8: plan_index.cuh) and ``PAD_NEG`` (plan.cu's
  ``CANARY_PADDING_NEG``: ``padding_slot = -1``, SPEC 3.2 "No reserved slot") as in plan.cu, and the two
  block sizes, which size shared arrays (the
  simulator, one Python thread per CUDA thread, runs the same code with small blocks, at least one warp).
  plan.cu's ``WRITE_SIDE`` template flag is a runtime argument. An absent LUT / pool / valid_lens is a
  one-element dummy array (plan.cu gets a null pointer); the specialization never reads it.
- ``expected_token_pool_indices``, absent, is ``req_pool_indices`` itself (plan.cu: a null pointer, read as
  that array, its ``step_wide`` bit then req_pool_indices'); an absent ``kv_indptr`` is a one-element dummy.
  ``kv_indptr`` is an int32 array in both: an int64 one arrives as its int32 words (two a row, ``kv_indptr_wide``),
  read back into an int64 here (``load_int``), cast there. So do the step arrays (``step_wide``) and a paged
  table (``table_wide``), which plan.cu reads through untyped pointers (canary_ints.cuh ``load_int``).
- A sampled table's base moves by the run's shift (``sample_rows``), so it keeps the row's key as the scan wrote
  it; plan.cu rebuilds it from the key (``rp``, a page list's ``kv_indptr[r]``).
- Output parameters become returned tuples (``translate`` returns ``(value, bad)``); the row table is one
  int64 array with a base index and a stride (``tab[t0 + k * tn + r]``) instead of a struct of pointers.

As in plan.cu, 2-D inputs arrive flat (1-D, unit stride) with their row stride in elements, and every index
is int64 (pools over 2^31 slots exist). Keep these kernels simple: numba-cuda is in maintenance mode.
"""
from __future__ import annotations

import functools
import inspect

from numba import cuda, float64, int32, int64

# Status bits, sentinels and block sizes: the ones plan.cu has (kernels/canary_constants.cuh is generated from the
# same source), not restated here.
from canary.contract.kernel_constants import (
    CANARY_BAD_EXTEND_LEN, CANARY_BAD_PREFIX_LEN, CANARY_BAD_REQ_POOL_INDEX, CANARY_BAD_SLOT, CANARY_BAD_VALID_LEN,
    CANARY_FORM_BLOCKS, CANARY_FORM_PAGES, CANARY_FORM_TOKENS, CANARY_MISSING_SLOT, CANARY_NO_ENTRIES,
    CANARY_OVERFLOW, CANARY_SAMPLED, CANARY_SKIP_SEED, ENTRY_CHUNK, ENTRY_MIN_BLOCKS, ENTRY_THREADS, FUSED_MAX_BS,
    ITEMS, ROW_SAMPLES, ROWS_THREADS, STEP_WIDE_EXPECTED_TOKEN_POOL_INDICES, STEP_WIDE_EXTEND_SEQ_LENS,
    STEP_WIDE_PREFIX_LENS, STEP_WIDE_REQ_POOL_INDICES, STEP_WIDE_VALID_LENS,
)

INT64_MIN = -(1 << 63)  # a sampled row's cursor reset (SPEC 3.7), as plan.cu's reset_cursors

# This backend's own speed structure and scratch (deliberately not plan.cu's: the outputs are the same bytes):
# NUMBA_ROW_BATCH consecutive rows a thread per scan batch (plan.cu: ROW_BATCH tiles of one row a thread), and a
# scratch without plan.cu's SCRATCH_READERS / SCRATCH_SIDE words and side-built table, as this twin has neither a
# cursor block nor side blocks. Sized and read by this file only (scratch_words).
NUMBA_ROW_BATCH = 4  # rows per thread whose loads a scan issues together
# Scratch words (int64, owned by the planner, zeroed once at bind, re-armed by every launch).
NUMBA_SCRATCH_DONE = 0  # blocks finished (the last one finalizes; LUT only)
NUMBA_SCRATCH_BAD_SLOT = 1  # BAD_SLOT bits from entries and seeds (LUT only)
NUMBA_SCRATCH_ROW_FLAGS = 2  # two-pass only: row checks of the rows kernel
NUMBA_SCRATCH_TOTAL = 3  # two-pass only: verify entries in all
NUMBA_SCRATCH_TABLE = 4  # two-pass only: the row table, NUMBA_TABLE_ARRAYS arrays of write_req_capacity + 1
NUMBA_TABLE_ARRAYS = 8  # off, base, pdelta, pbase, vlim, lo, len, rank
_FUSED_STRIDE = FUSED_MAX_BS + 1  # a shared array's shape must be a plain constant for Numba
_SAMPLES_LEN = ROW_SAMPLES + 1


def scratch_words(write_req_capacity: int) -> int:
    """int64 words of planner scratch: the head words, then the two-pass row table (as plan.cu's host)."""
    return NUMBA_SCRATCH_TABLE + NUMBA_TABLE_ARRAYS * (int(write_req_capacity) + 1)


# plan.cu's PlanParams, field by field: the arguments of every kernel here, and their Numba types
# (``int64[::1]`` for ``i64*``, ``int32[::1]`` for ``int*``; ``req_to_token`` and ``pool`` are flat views).
_A64, _A32, _I64 = "int64[::1]", "int32[::1]", "int64"
PARAMS = (
    ("req_pool_indices", _A32), ("prefix_lens", _A32), ("extend_seq_lens", _A32), ("valid_lens", _A32),
    ("bs", _I64), ("req_to_token", _A32), ("r2t_row_stride", _I64), ("rp_bound", _I64), ("max_seq_len", _I64),
    ("lut", _A64), ("lut_len", _I64), ("pool", _A32), ("pool_row_stride", _I64), ("pool_cols", _I64),
    ("token_offset", _I64), ("window", _I64), ("padding_rows_carry_tokens", _I64), ("verify_capacity", _I64),
    ("write_req_capacity", _I64),
    ("slots", _A64), ("expected", _A64), ("positions", _A64), ("prevs", _A64), ("num_valid", _A32),
    ("enable", _A32), ("status", _A32), ("write_offsets", _A64), ("seeds", _A64),
    ("write_num_valid_reqs", _A32), ("scratch", _A64), ("cursors", _A64), ("sample", _I64), ("pool_rows", _I64),
    ("page_size", _I64), ("kv_indptr", _A32), ("kv_indptr_wide", _I64), ("kv_nnz", _I64), ("table_wide", _I64),
    ("expected_token_pool_indices", _A32), ("step_wide", _I64),
)
PARAM_FIELDS = tuple(name for name, _ in PARAMS)
SIGNATURE = "void({})".format(", ".join(ty for _, ty in PARAMS))
STEP_FIELDS = PARAM_FIELDS[:5]  # what changes per call; the rest is bound once, but for STEP_TAIL
# Per step too, appended to the struct after the bound fields. No null pointer here: when absent, the host
# passes req_pool_indices itself, which is what plan.cu reads for a null pointer.
STEP_TAIL = PARAM_FIELDS[-2:]
# A step that passes its own index (SPEC 3.8) changes these bound fields too: the host then launches with every
# argument laid out again.
INDEX_FIELDS = ("req_to_token", "r2t_row_stride", "max_seq_len", "page_size", "kv_indptr", "kv_indptr_wide",
                "kv_nnz", "table_wide")


_FORM_SUFFIX = {CANARY_FORM_TOKENS: "", CANARY_FORM_BLOCKS: "_blocks", CANARY_FORM_PAGES: "_pages"}


def suffix(has_lut: bool, has_pool: bool, form: int = CANARY_FORM_TOKENS) -> str:
    """plan.cu's specialization suffix (``canary_plan_fused_<suffix>`` there)."""
    return f"lut{int(has_lut)}_pool{int(has_pool)}{_FORM_SUFFIX[form]}"


def launch_bounds(kernel_name: str, rows_threads: int = ROWS_THREADS, entry_threads: int = ENTRY_THREADS):
    """plan.cu's ``__launch_bounds__`` of a kernel (by its name, with or without the suffix)."""
    if kernel_name.startswith("canary_plan_rows"):
        return (int(rows_threads),)
    return (int(entry_threads), ENTRY_MIN_BLOCKS)


def _jit_options(kernel_name: str, rows_threads: int, entry_threads: int) -> dict:
    """``cuda.jit`` options of a kernel: its launch bounds where this numba-cuda takes them (the simulator's
    ``jit`` does not)."""
    try:
        takes = "launch_bounds" in inspect.signature(cuda.jit).parameters
    except (TypeError, ValueError):  # pragma: no cover
        takes = False
    return {"launch_bounds": launch_bounds(kernel_name, rows_threads, entry_threads)} if takes else {}


def _power_of_two(name: str, value: int, minimum: int = 1) -> int:
    value = int(value)
    if value < minimum or value & (value - 1):
        raise ValueError(f"{name}: expected a power of two >= {minimum}, got {value}")
    return value


@functools.lru_cache(maxsize=None)
def kernel_functions(has_lut: bool, has_pool: bool, rows_threads: int = ROWS_THREADS,
                     entry_threads: int = ENTRY_THREADS, form: int = CANARY_FORM_TOKENS, padding_slot: int = 0):
    """The plain Python kernels of one specialization: ``(canary_plan_fused, canary_plan_rows,
    canary_plan_entries)``, not yet compiled (``plan_kernels`` compiles them; ``cuda.compile_ptx`` can compile
    them on a machine without a GPU). The block sizes are compile-time constants because they size shared
    arrays; launch each kernel with exactly its block size (entry blocks: whole warps). ``padding_slot``: 0 or -1
    (SPEC 3.2)."""
    HAS_LUT = bool(has_lut)  # noqa: N806 - compile-time constants, named like plan.cu's template parameters
    HAS_POOL = bool(has_pool)  # noqa: N806
    FORM = int(form)  # noqa: N806
    PAGES = FORM == CANARY_FORM_PAGES  # noqa: N806
    PAGED = FORM != CANARY_FORM_TOKENS  # noqa: N806
    CAN_BAD = HAS_LUT or PAGED  # noqa: N806 - plan.cu's: a bad slot past the row scan, so finalize composes status
    PAD_NEG = int(padding_slot) == -1  # noqa: N806 - plan.cu's CANARY_PADDING_NEG
    ROWS_T = _power_of_two("rows_threads", rows_threads)  # noqa: N806
    ENTRY_T = _power_of_two("entry_threads", entry_threads, 32)  # noqa: N806
    FUSED_TABLE = NUMBA_TABLE_ARRAYS * _FUSED_STRIDE  # noqa: N806

    @cuda.jit(device=True)
    def translate(raw, lut, lut_len):
        """T of SPEC 3.2: negative ids pass through; ids past the LUT become -1 and are reported (bad = 1)."""
        if not HAS_LUT or raw < 0:
            return raw, int64(0)
        if raw >= lut_len:
            return int64(-1), int64(1)
        return lut[raw], int64(0)

    @cuda.jit(device=True)
    def floor_div(a, b, inv_b):
        """plan.cu's ``floor_div``: a // b for 0 <= a < 2^62, 1 <= b < 2^62, a / b < 2^50, from the double
        reciprocal ``inv_b`` and one correction (why one suffices: plan_index.cuh). A 64-bit ``//`` is a long
        subroutine on the GPU, and Python's floor semantics add sign fix-ups to it."""
        q = int64(float64(a) * inv_b)
        rem = a - q * b
        if rem < 0:
            q -= 1
        elif rem >= b:
            q += 1
        return q

    @cuda.jit(device=True)
    def load_int(words, wide, r):
        """plan.cu's ``load_int`` (and ``load_indptr``): element ``r`` of an int32 array, or of an int64 one as its
        int32 words (little-endian: the low word first), as an int64 (SPEC 2 (*)); every step array, the paged
        table and kv_indptr arrive so."""
        if wide != 0:
            return (int64(words[2 * r]) & int64(0xFFFFFFFF)) | (int64(words[2 * r + 1]) << 32)
        return int64(words[r])

    @cuda.jit(device=True)
    def row_key(rp, lo, hi, kv_nnz, page_size, max_seq_len):
        """plan.cu's ``row_key`` for a page list (SPEC 3.8): ``(key, cap, key_bad)`` of an active row from its
        kv_indptr pair: its first page (0 when bad), the positions it holds (max_seq_len when bad), whether the
        pair is out of order or past kv_indices."""
        if rp == 0:
            return int64(0), max_seq_len, False
        if lo < 0 or hi < lo or hi > kv_nnz:
            return int64(0), max_seq_len, True
        return lo, (hi - lo) * page_size, False

    @cuda.jit(device=True)
    def load_raw(req_to_token, v, page_size, inv_ps, table_wide):
        """plan.cu's ``load_raw``: ``(R, bad)`` at virtual index ``v``: req_to_token's value; for a paged form's
        block b (int32 or, ``table_wide``, int64 entries), 0 for b = 0, b * page_size + v % page_size for
        0 < b <= INT32_MAX, -1 and bad = 1 for b < 0 or b > INT32_MAX (PAD_NEG: block 0 real, b < 0 -1 not bad)."""
        if not PAGED:
            return int64(req_to_token[v]), int64(0)
        page = floor_div(v, page_size, inv_ps)
        b = load_int(req_to_token, table_wide, page)
        if b > int64(0x7FFFFFFF):
            return int64(-1), int64(1)
        if PAD_NEG:  # block 0 is real; a negative block is the engine's padding marker, not bad
            if b < 0:
                return int64(-1), int64(0)
            return b * page_size + (v - page * page_size), int64(0)
        if b < 0:
            return int64(-1), int64(1)
        if b == 0:
            return int64(0), int64(0)
        return b * page_size + (v - page * page_size), int64(0)

    @cuda.jit(device=True)
    def row_facts(rp, e, length, vl, rp_bound, max_seq_len, pool_cols, window, padding_rows_carry_tokens, q,
                  pool_rows, cap, key_bad):
        """plan.cu's Row: ``(vcount, wlen, flags)``: verify entries, write entries, status bits the row raises.
        A padding row (rp == 0) has none, except its write entries when its tokens are among the step's (its
        lengths may be stale garbage otherwise). ``cap``: the positions the row holds (max_seq_len; a page list's
        row its pages), ``key_bad``: a page list's kv_indptr pair out of order or range."""
        if rp == 0:
            if padding_rows_carry_tokens != 0 and e > 0:
                if e > max_seq_len:  # no row holds that many tokens
                    return int64(0), int64(0), int64(CANARY_BAD_EXTEND_LEN)
                return int64(0), e, int64(0)
            return int64(0), int64(0), int64(0)
        flags = int64(0)
        if rp < 0 or rp >= rp_bound:
            flags |= CANARY_BAD_REQ_POOL_INDEX
        if HAS_POOL:
            if q < 0 or q >= pool_rows:
                flags |= CANARY_BAD_REQ_POOL_INDEX
        if key_bad:
            flags |= CANARY_BAD_REQ_POOL_INDEX
        if length < 0 or length > cap:
            flags |= CANARY_BAD_PREFIX_LEN
        if HAS_POOL:
            if vl > pool_cols:
                flags |= CANARY_BAD_VALID_LEN
        # The new tokens must fit the row: e > room, never length + e, which garbage such as 2^62 would wrap.
        # room >= 0, so a negative e (lengths not to be trusted, SPEC 3.4) is the one other case flagged.
        room = cap - min(max(length, int64(0)), cap)
        wlen = int64(0)
        if e < 0 or e > room:
            flags |= CANARY_BAD_EXTEND_LEN
        else:
            wlen = e
        vcount = int64(0)
        if (flags & (CANARY_BAD_REQ_POOL_INDEX | CANARY_BAD_PREFIX_LEN | CANARY_BAD_EXTEND_LEN)) == 0:
            vcount = window if (window > 0 and length > window) else length
        return vcount, wlen, flags

    def make_scan_rows(THREADS):  # noqa: N803 - plan.cu's template parameter
        """``scan_rows<THREADS>`` (with its ``block_scan2<THREADS>``) for one block size."""
        SCAN_BUF = 6 * THREADS  # noqa: N806 - [ping-pong][a, b, c][THREADS]; a shared shape must be a constant

        @cuda.jit(device=True)
        def block_scan3(a, b, c):
            """Exclusive block-wide scan of three int64 per thread:
            ``(excl_a, excl_b, excl_c, tot_a, tot_b, tot_c)``.

            Hillis-Steele through shared memory, reading one buffer and writing the other (one barrier per
            step; the simulator has no warp shuffles). Every thread calls it.
            """
            buf = cuda.shared.array(SCAN_BUF, int64)
            t = cuda.threadIdx.x
            buf[t] = a
            buf[THREADS + t] = b
            buf[2 * THREADS + t] = c
            cuda.syncthreads()
            src = 0
            d = 1
            while d < THREADS:
                s = src * 3 * THREADS
                ua = buf[s + t]
                ub = buf[s + THREADS + t]
                uc = buf[s + 2 * THREADS + t]
                if t >= d:
                    ua += buf[s + t - d]
                    ub += buf[s + THREADS + t - d]
                    uc += buf[s + 2 * THREADS + t - d]
                s = (1 - src) * 3 * THREADS
                buf[s + t] = ua
                buf[s + THREADS + t] = ub
                buf[s + 2 * THREADS + t] = uc
                cuda.syncthreads()
                src = 1 - src
                d *= 2
            s = src * 3 * THREADS
            excl_a = buf[s + t] - a
            excl_b = buf[s + THREADS + t] - b
            excl_c = buf[s + 2 * THREADS + t] - c
            tot_a = buf[s + THREADS - 1]
            tot_b = buf[s + 2 * THREADS - 1]
            tot_c = buf[s + 3 * THREADS - 1]
            cuda.syncthreads()  # the totals are read before anyone reuses the buffers
            return excl_a, excl_b, excl_c, tot_a, tot_b, tot_c

        @cuda.jit(device=True)
        def scan_rows(req_pool_indices, prefix_lens, extend_seq_lens, valid_lens, bs, req_to_token,
                      r2t_row_stride, rp_bound, max_seq_len, lut, lut_len, pool_row_stride, pool_cols, window,
                      padding_rows_carry_tokens, write_req_capacity, write_offsets, seeds, write_num_valid_reqs,
                      tab, t0, tn, write_side, pool_rows, pool_indices, cursors, sample, page_size, kv_indptr,
                      kv_indptr_wide, kv_nnz, table_wide, step_wide):
            """Scan all rows with THREADS threads, NUMBA_ROW_BATCH consecutive rows per thread per batch, carrying
            the running sums across batches; a batch's loads (then its seeds) are issued together.

            Fills the row table ``tab[t0 + k * tn + r]`` (shared or global memory) and, when ``write_side``,
            the write offsets, the zeroed tail and the seeds. Returns ``(vtotal, row_flags, seed_bad,
            requests)``: the verify total, the block's OR of row flags, whether a seed fell outside the LUT, the
            rows with verify entries (every thread gets the same values).
            """
            s_flags = cuda.shared.array(1, int32)
            tid = int64(cuda.threadIdx.x)
            rp = cuda.local.array(NUMBA_ROW_BATCH, int64)
            e = cuda.local.array(NUMBA_ROW_BATCH, int64)
            ln = cuda.local.array(NUMBA_ROW_BATCH, int64)
            vl = cuda.local.array(NUMBA_ROW_BATCH, int64)
            vc = cuda.local.array(NUMBA_ROW_BATCH, int64)
            wl = cuda.local.array(NUMBA_ROW_BATCH, int64)
            seed = cuda.local.array(NUMBA_ROW_BATCH, int64)
            q = cuda.local.array(NUMBA_ROW_BATCH, int64)
            lo = cuda.local.array(NUMBA_ROW_BATCH, int64)
            hi = cuda.local.array(NUMBA_ROW_BATCH, int64)
            key = cuda.local.array(NUMBA_ROW_BATCH, int64)
            inv_ps = 1.0 / float64(page_size)
            pool_wide = step_wide & STEP_WIDE_EXPECTED_TOKEN_POOL_INDICES  # of the array passed (rpi when absent)
            vcarry = int64(0)
            wcarry = int64(0)
            ncarry = int64(0)
            flags = int64(0)
            bad = int64(0)
            group = int64(0)
            while group < bs:  # uniform: the scans have barriers
                r0 = group + tid * NUMBA_ROW_BATCH
                for k in range(NUMBA_ROW_BATCH):
                    r = r0 + k
                    rp[k] = 0
                    e[k] = 0
                    ln[k] = 0
                    vl[k] = 0
                    q[k] = 0
                    if r < bs:
                        rp[k] = load_int(req_pool_indices, step_wide & STEP_WIDE_REQ_POOL_INDICES, r)
                        e[k] = load_int(extend_seq_lens, step_wide & STEP_WIDE_EXTEND_SEQ_LENS, r)
                        ln[k] = load_int(prefix_lens, step_wide & STEP_WIDE_PREFIX_LENS, r)
                if HAS_POOL:  # valid_lens only for active rows: after rp is known
                    for k in range(NUMBA_ROW_BATCH):
                        if r0 + k < bs and rp[k] != 0:
                            vl[k] = load_int(valid_lens, step_wide & STEP_WIDE_VALID_LENS, r0 + k)
                            q[k] = load_int(pool_indices, pool_wide, r0 + k)
                for k in range(NUMBA_ROW_BATCH):
                    lo[k] = 0
                    hi[k] = 0
                    if PAGES and r0 + k < bs and rp[k] != 0:  # a page list's pair: active rows only
                        lo[k] = load_int(kv_indptr, kv_indptr_wide, r0 + k)
                        hi[k] = load_int(kv_indptr, kv_indptr_wide, r0 + k + 1)
                vsum = int64(0)
                wsum = int64(0)
                nsum = int64(0)
                for k in range(NUMBA_ROW_BATCH):
                    cap = max_seq_len
                    key_bad = False
                    key[k] = rp[k]
                    if PAGES:
                        key[k], cap, key_bad = row_key(rp[k], lo[k], hi[k], kv_nnz, page_size, max_seq_len)
                    v, w, f = row_facts(rp[k], e[k], ln[k], vl[k], rp_bound, max_seq_len, pool_cols, window,
                                        padding_rows_carry_tokens, q[k], pool_rows, cap, key_bad)
                    vc[k] = v
                    wl[k] = w
                    vsum += v
                    wsum += w
                    nsum += 1 if v > 0 else 0
                    flags |= f
                    seed[k] = -1
                    if write_side and w > 0 and rp[k] == 0:
                        seed[k] = CANARY_SKIP_SEED
                    elif (write_side and w > 0 and ln[k] > 0
                            and (f & (CANARY_BAD_REQ_POOL_INDEX | CANARY_BAD_PREFIX_LEN)) == 0):
                        sv, b = load_raw(req_to_token, key[k] * r2t_row_stride + (ln[k] - 1), page_size, inv_ps,
                                         table_wide)
                        seed[k] = int64(CANARY_MISSING_SLOT) if (PAD_NEG and sv < 0) else sv
                        bad |= b
                voff, woff, noff, vtot, wtot, ntot = block_scan3(vsum, wsum, nsum)
                voff += vcarry
                woff += wcarry
                noff += ncarry
                for k in range(NUMBA_ROW_BATCH):
                    r = r0 + k
                    if r < bs:
                        tab[t0 + r] = voff
                        tab[t0 + 5 * tn + r] = ln[k] - vc[k] if vc[k] > 0 else int64(0)
                        tab[t0 + 6 * tn + r] = vc[k]
                        tab[t0 + 7 * tn + r] = noff
                        if vc[k] > 0:
                            start = ln[k] - vc[k]
                            tab[t0 + tn + r] = key[k] * r2t_row_stride + start - voff
                            tab[t0 + 2 * tn + r] = start - voff
                            if HAS_POOL:
                                tab[t0 + 3 * tn + r] = q[k] * pool_row_stride
                                tab[t0 + 4 * tn + r] = vl[k]
                        if write_side:
                            write_offsets[r] = woff
                            sv, b = translate(seed[k], lut, lut_len)
                            if PAD_NEG and seed[k] >= 0 and sv < 0:  # a seed read from the index that is no slot
                                sv = int64(CANARY_MISSING_SLOT)
                            seeds[r] = sv
                            bad |= b
                    voff += vc[k]
                    woff += wl[k]
                    noff += 1 if vc[k] > 0 else 0
                vcarry += vtot
                wcarry += wtot
                ncarry += ntot
                group += THREADS * NUMBA_ROW_BATCH
            if tid == 0:
                tab[t0 + bs] = vcarry
            if write_side:
                r = bs + 1 + tid
                while r <= write_req_capacity:
                    write_offsets[r] = 0
                    r += THREADS
                if tid == 0:
                    write_offsets[bs] = wcarry
                    write_num_valid_reqs[0] = bs
            if tid == 0:
                s_flags[0] = 0
            seed_bad = cuda.syncthreads_or(int32(bad))  # also publishes s_flags = 0 and the row table
            if flags != 0:
                cuda.atomic.or_(s_flags, 0, int32(flags))
            cuda.syncthreads()
            row_flags = int64(s_flags[0])
            return vcarry, row_flags, int64(seed_bad != 0), ncarry

        return scan_rows

    scan_rows_rows = make_scan_rows(ROWS_T)  # scan_rows<ROWS_THREADS, ...> in plan.cu
    scan_rows_entry = make_scan_rows(ENTRY_T)  # scan_rows<ENTRY_THREADS, ...>

    @cuda.jit(device=True)
    def rotation_head(cursors, requests):
        """Head of the request rotation of a step with fewer entries than requests (SPEC 3.7)."""
        head = cursors[0]
        return head if (head >= 0 and head < requests) else int64(0)

    @cuda.jit(device=True)
    def first_entry(cap, requests, total, head, inv, m, off):
        """plan.cu's ``first_entry``: the first output entry of a row with m rows with entries and ``off`` entries
        (unsampled) before it; with (m + 1, off + its length), the next row's, which gives the row's take. The
        quotient is at most cap - requests < 2^31 (capacities are int32), within floor_div's bound."""
        if cap >= requests:  # one entry each, the rest in proportion to len - 1 (the running sum rounded)
            return m + floor_div((cap - requests) * (off - m), total - requests, inv)
        if head + cap <= requests:  # the requests of ranks [head, head + cap) take one entry each
            return min(max(m - head, int64(0)), cap)
        # ... and the range wraps: ranks [head, requests) and [0, head + cap - requests)
        return min(m, head + cap - requests) + max(m - head, int64(0))

    @cuda.jit(device=True)
    def sample_rows(req_pool_indices, rp_wide, bs, cursors, verify_capacity, tab, t0, tn, total, requests):
        """plan.cu's ``sample_rows``: the row table becomes a sampled step's (off[r] = the row's first output
        entry; base / pdelta start the row at its run, which ends where its cursor says the last run began).
        Each thread rewrites only its own rows."""
        cap = verify_capacity
        head = rotation_head(cursors, requests) if cap < requests else int64(0)
        inv = 1.0 / float64(total - requests) if cap >= requests else 0.0
        r = int64(cuda.threadIdx.x)
        while r < bs:
            m = tab[t0 + 7 * tn + r]
            off = tab[t0 + r]
            first = first_entry(cap, requests, total, head, inv, m, off)
            ln = tab[t0 + 6 * tn + r]
            if ln > 0:  # a row with entries is trusted: 0 < rp < max_reqs
                take = first_entry(cap, requests, total, head, inv, m + 1, off + ln) - first
                lo = tab[t0 + 5 * tn + r]
                at = cursors[load_int(req_pool_indices, rp_wide, r)]
                run = (at - lo if (at >= lo and at < lo + ln) else int64(0)) - take
                if run < 0:  # take <= ln: one addition wraps
                    run += ln
                shift = off - first + run  # base and pdelta were relative to off[r] and lo
                tab[t0 + tn + r] += shift
                tab[t0 + 2 * tn + r] += shift
            tab[t0 + r] = first
            r += cuda.blockDim.x
        if cuda.threadIdx.x == 0:
            tab[t0 + bs] = cap
        cuda.syncthreads()

    @cuda.jit(device=True)
    def reset_cursors(req_pool_indices, rp_wide, bs, cursors, verify_capacity, tab, t0, tn, requests):
        """plan.cu's ``reset_cursors`` (after every reader has read the cursors): each sampled row's cursor to
        INT64_MIN, the rotation head moved (thread 0 alone reads and writes cursors[0])."""
        r = int64(cuda.threadIdx.x)
        while r < bs:
            if tab[t0 + r + 1] > tab[t0 + r]:
                cursors[load_int(req_pool_indices, rp_wide, r)] = INT64_MIN
            r += cuda.blockDim.x
        if cuda.threadIdx.x == 0 and verify_capacity < requests:  # head < requests, cap < requests: no modulo
            nxt = rotation_head(cursors, requests) + verify_capacity
            cursors[0] = nxt - requests if nxt >= requests else nxt

    @cuda.jit(device=True)
    def advance_cursor(req_pool_indices, rp_wide, cursors, tab, t0, tn, r):
        """plan.cu's ``advance_cursor`` (after the reset): a request row in two batch rows keeps the larger new
        cursor, whatever the order of the atomics."""
        if tab[t0 + r + 1] > tab[t0 + r]:  # the next run ends where this one began: lo + run = pdelta + first
            cuda.atomic.max(cursors, load_int(req_pool_indices, rp_wide, r), tab[t0 + 2 * tn + r] + tab[t0 + r])

    @cuda.jit(device=True)
    def update_cursors(req_pool_indices, rp_wide, bs, cursors, verify_capacity, tab, t0, tn, requests):
        """plan.cu's ``update_cursors``: both halves with one block (the fused launch)."""
        reset_cursors(req_pool_indices, rp_wide, bs, cursors, verify_capacity, tab, t0, tn, requests)
        cuda.syncthreads()
        r = int64(cuda.threadIdx.x)
        while r < bs:
            advance_cursor(req_pool_indices, rp_wide, cursors, tab, t0, tn, r)
            r += cuda.blockDim.x

    @cuda.jit(device=True)
    def owning_row(off, o0, lo, hi, i):
        """The row holding entry i, given off[o0 + lo] <= i < off[o0 + hi]: the last r with off[o0 + r] <= i
        (empty rows are skipped: the last of equal offsets wins)."""
        while hi - lo > 1:
            mid = (lo + hi) >> 1
            if off[o0 + mid] <= i:
                lo = mid
            else:
                hi = mid
        return lo

    @cuda.jit(device=True)
    def owning_rows2(off, o0, lo_i, hi_i, i, lo_j, hi_j, j):
        """``owning_row`` for two entries at once (two independent searches, interleaved)."""
        while hi_i - lo_i > 1 or hi_j - lo_j > 1:
            if hi_i - lo_i > 1:
                mid = (lo_i + hi_i) >> 1
                if off[o0 + mid] <= i:
                    lo_i = mid
                else:
                    hi_i = mid
            if hi_j - lo_j > 1:
                mid = (lo_j + hi_j) >> 1
                if off[o0 + mid] <= j:
                    lo_j = mid
                else:
                    hi_j = mid
        return lo_i, lo_j

    @cuda.jit(device=True)
    def emit_entries(bs, req_to_token, lut, lut_len, pool, token_offset, slots, expected, positions, prevs,
                     tab, t0, tn, samples, step, count, total, sampled, page_size, table_wide):
        """The verify entries of this block. Each pass of a warp covers ENTRY_CHUNK consecutive entries
        (lane-major inside each of the ITEMS groups); all loads of a pass are issued before any store.

        The rows of the pass's first and last entries are found first (every lane, same addresses); each
        entry then searches only between them. ``samples`` (two-pass, ``count`` > 0): every ``step``-th row
        offset in shared memory, so a search is a short one there, then at most ``step`` rows of the table.
        Returns whether a translated slot fell outside the LUT.
        """
        bad = int64(0)
        lane = int64(cuda.threadIdx.x & 31)
        warps = int64(cuda.gridDim.x) * int64(cuda.blockDim.x >> 5)
        warp = int64(cuda.blockIdx.x) * int64(cuda.blockDim.x >> 5) + int64(cuda.threadIdx.x >> 5)
        r_of = cuda.local.array(ITEMS, int64)
        idx = cuda.local.array(ITEMS, int64)
        pos = cuda.local.array(ITEMS, int64)
        raw = cuda.local.array(ITEMS, int64)
        praw = cuda.local.array(ITEMS, int64)
        tok = cuda.local.array(ITEMS, int64)
        inv_ps = 1.0 / float64(page_size)
        first = warp * ENTRY_CHUNK
        while first < total:
            last = min(first + ENTRY_CHUNK, total) - 1
            if count > 0:
                ja, jb = owning_rows2(samples, 0, int64(0), count, first, int64(0), count, last)
                r_lo, r_hi = owning_rows2(tab, t0, ja * step, min((ja + 1) * step, bs), first,
                                          jb * step, min((jb + 1) * step, bs), last)
            else:
                r_lo, r_hi = owning_rows2(tab, t0, int64(0), bs, first, int64(0), bs, last)
            for k in range(ITEMS):
                i = first + k * 32 + lane
                r = owning_row(tab, t0, r_lo, r_hi + 1, i) if i < total else r_lo
                r_of[k] = r
                idx[k] = tab[t0 + tn + r] + i
                pos[k] = i + tab[t0 + 2 * tn + r]
                if sampled and pos[k] >= tab[t0 + 5 * tn + r] + tab[t0 + 6 * tn + r]:  # the run wrapped
                    pos[k] -= tab[t0 + 6 * tn + r]
                    idx[k] -= tab[t0 + 6 * tn + r]
            for k in range(ITEMS):
                live = first + k * 32 + lane < total
                raw[k] = int64(0)
                praw[k] = int64(-1)
                if live:
                    raw[k], b1 = load_raw(req_to_token, idx[k], page_size, inv_ps, table_wide)
                    bad |= b1
                    # The window does not reset the chain: a window head keeps its real predecessor.
                    if pos[k] > 0:
                        praw[k], b2 = load_raw(req_to_token, idx[k] - 1, page_size, inv_ps, table_wide)
                        bad |= b2
            if HAS_POOL:
                for k in range(ITEMS):
                    live = first + k * 32 + lane < total
                    tok[k] = -1
                    col = pos[k] + token_offset
                    if live and col >= 0 and col < tab[t0 + 4 * tn + r_of[k]]:
                        tok[k] = int64(pool[tab[t0 + 3 * tn + r_of[k]] + col])
            for k in range(ITEMS):
                i = first + k * 32 + lane
                if i < total:
                    slot, b1 = translate(raw[k], lut, lut_len)
                    prev, b2 = translate(praw[k], lut, lut_len)  # -1 (no predecessor) passes through
                    bad |= b1 | b2
                    if PAD_NEG:  # any negative translation is no slot; a predecessor that is none: no link
                        if slot < 0:
                            slot = int64(CANARY_MISSING_SLOT)
                        if pos[k] > 0 and prev < 0:
                            prev = int64(CANARY_MISSING_SLOT)
                    elif raw[k] == 0 or (HAS_LUT and raw[k] > 0 and slot == 0):
                        slot = int64(CANARY_MISSING_SLOT)  # the predecessor (prev) keeps its plain translation
                    slots[i] = slot
                    prevs[i] = prev
                    positions[i] = pos[k]
                    expected[i] = tok[k] if HAS_POOL else int64(-1)
            first += warps * ENTRY_CHUNK
        return bad

    @cuda.jit(device=True)
    def write_status(status, enable, num_valid, verify_capacity, sample, st, total):
        if total > verify_capacity:
            st |= CANARY_SAMPLED if sample != 0 else CANARY_OVERFLOW
        status[0] = st
        enable[0] = 1 if (st & ~CANARY_SAMPLED) == 0 else 0
        num_valid[0] = total if total < verify_capacity else verify_capacity

    @cuda.jit(device=True)
    def sampling(sample, verify_capacity, row_flags, total):
        """A sampled step's rows: sample on, over the capacity, and every row trusted (SPEC 3.7)."""
        return sample != 0 and total > verify_capacity and (row_flags & CANARY_NO_ENTRIES) == 0

    @cuda.jit(device=True)
    def finalize(scratch, status, enable, num_valid, verify_capacity, sample, row_flags, total, bad_slot,
                 req_pool_indices, rp_wide, bs, cursors, tab, t0, tn, requests, move_cursors):
        """With a LUT, any block may find a BAD_SLOT; with sampling, the cursors may move only once every block
        has read them. Then every block calls this once, last thing, and the last block to arrive composes the
        status, advances the cursors (its whole block, over its own row table) and re-arms the scratch words."""
        s_last = cuda.shared.array(1, int32)
        any_bad = cuda.syncthreads_or(int32(bad_slot))  # also: every thread of the block has finished its stores
        if cuda.threadIdx.x == 0:
            if any_bad != 0:
                cuda.atomic.or_(scratch, NUMBA_SCRATCH_BAD_SLOT, int64(CANARY_BAD_SLOT))
            cuda.threadfence()
            s_last[0] = 0
            if cuda.atomic.add(scratch, NUMBA_SCRATCH_DONE, int64(1)) == int64(cuda.gridDim.x) - 1:
                s_last[0] = 1
                cuda.threadfence()
                st = row_flags | cuda.atomic.exch(scratch, NUMBA_SCRATCH_BAD_SLOT, int64(0))
                write_status(status, enable, num_valid, verify_capacity, sample, st, total)
                scratch[NUMBA_SCRATCH_DONE] = 0
        cuda.syncthreads()
        if move_cursors and s_last[0] != 0:
            update_cursors(req_pool_indices, rp_wide, bs, cursors, verify_capacity, tab, t0, tn, requests)

    # The kernels. Every one takes PlanParams' fields in order (see PARAMS).

    def canary_plan_fused(req_pool_indices, prefix_lens, extend_seq_lens, valid_lens, bs, req_to_token,
                          r2t_row_stride, rp_bound, max_seq_len, lut, lut_len, pool, pool_row_stride, pool_cols,
                          token_offset, window, padding_rows_carry_tokens, verify_capacity, write_req_capacity,
                          slots, expected, positions, prevs, num_valid, enable, status, write_offsets, seeds,
                          write_num_valid_reqs, scratch, cursors, sample, pool_rows, page_size, kv_indptr,
                          kv_indptr_wide, kv_nnz, table_wide, expected_token_pool_indices, step_wide):
        """bs <= FUSED_MAX_BS; any grid of ENTRY_THREADS-thread blocks."""
        rp_wide = step_wide & STEP_WIDE_REQ_POOL_INDICES
        tab = cuda.shared.array(FUSED_TABLE, int64)  # the row table, stride FUSED_MAX_BS + 1
        total, row_flags, seed_bad, requests = scan_rows_entry(
            req_pool_indices, prefix_lens, extend_seq_lens, valid_lens, bs, req_to_token, r2t_row_stride,
            rp_bound, max_seq_len, lut, lut_len, pool_row_stride, pool_cols, window, padding_rows_carry_tokens,
            write_req_capacity, write_offsets, seeds, write_num_valid_reqs, tab, 0, _FUSED_STRIDE,
            cuda.blockIdx.x == 0, pool_rows, expected_token_pool_indices, cursors, sample, page_size, kv_indptr,
            kv_indptr_wide, kv_nnz, table_wide, step_wide)
        sampled = sampling(sample, verify_capacity, row_flags, total)
        if not CAN_BAD and not sampled:  # the row scan alone decides everything: block 0 writes it
            if cuda.blockIdx.x == 0 and cuda.threadIdx.x == 0:
                write_status(status, enable, num_valid, verify_capacity, sample, row_flags, total)
        if sampled:
            sample_rows(req_pool_indices, rp_wide, bs, cursors, verify_capacity, tab, 0, _FUSED_STRIDE, total, requests)
        bad = seed_bad
        if (total <= verify_capacity or sampled) and (row_flags & CANARY_NO_ENTRIES) == 0:
            bad |= emit_entries(bs, req_to_token, lut, lut_len, pool, token_offset, slots, expected, positions,
                                prevs, tab, 0, _FUSED_STRIDE, tab, 0, 0,
                                verify_capacity if sampled else total, sampled, page_size, table_wide)
        if CAN_BAD or sampled:
            finalize(scratch, status, enable, num_valid, verify_capacity, sample, row_flags, total, bad,
                     req_pool_indices, rp_wide, bs, cursors, tab, 0, _FUSED_STRIDE, requests, sampled)

    def canary_plan_rows(req_pool_indices, prefix_lens, extend_seq_lens, valid_lens, bs, req_to_token,
                         r2t_row_stride, rp_bound, max_seq_len, lut, lut_len, pool, pool_row_stride, pool_cols,
                         token_offset, window, padding_rows_carry_tokens, verify_capacity, write_req_capacity,
                         slots, expected, positions, prevs, num_valid, enable, status, write_offsets, seeds,
                         write_num_valid_reqs, scratch, cursors, sample, pool_rows, page_size, kv_indptr,
                         kv_indptr_wide, kv_nnz, table_wide, expected_token_pool_indices, step_wide):
        """Grid 1, block ROWS_THREADS: scans, seeds, row table and row flags into the scratch; for a sampled
        step also the sampled table and the cursors' reset (this block is the cursors' only reader; the entries
        kernel advances them)."""
        tn = write_req_capacity + 1
        rp_wide = step_wide & STEP_WIDE_REQ_POOL_INDICES
        total, row_flags, seed_bad, requests = scan_rows_rows(
            req_pool_indices, prefix_lens, extend_seq_lens, valid_lens, bs, req_to_token, r2t_row_stride,
            rp_bound, max_seq_len, lut, lut_len, pool_row_stride, pool_cols, window, padding_rows_carry_tokens,
            write_req_capacity, write_offsets, seeds, write_num_valid_reqs, scratch, NUMBA_SCRATCH_TABLE, tn, True,
            pool_rows, expected_token_pool_indices, cursors, sample, page_size, kv_indptr, kv_indptr_wide, kv_nnz,
            table_wide, step_wide)
        row_flags |= CANARY_BAD_SLOT if seed_bad != 0 else 0
        if sampling(sample, verify_capacity, row_flags, total):
            sample_rows(req_pool_indices, rp_wide, bs, cursors, verify_capacity, scratch, NUMBA_SCRATCH_TABLE, tn, total, requests)
            reset_cursors(req_pool_indices, rp_wide, bs, cursors, verify_capacity, scratch, NUMBA_SCRATCH_TABLE, tn, requests)
        if cuda.threadIdx.x == 0:
            scratch[NUMBA_SCRATCH_ROW_FLAGS] = row_flags
            scratch[NUMBA_SCRATCH_TOTAL] = total
            if not CAN_BAD:
                write_status(status, enable, num_valid, verify_capacity, sample, row_flags, total)

    def canary_plan_entries(req_pool_indices, prefix_lens, extend_seq_lens, valid_lens, bs, req_to_token,
                            r2t_row_stride, rp_bound, max_seq_len, lut, lut_len, pool, pool_row_stride, pool_cols,
                            token_offset, window, padding_rows_carry_tokens, verify_capacity, write_req_capacity,
                            slots, expected, positions, prevs, num_valid, enable, status, write_offsets, seeds,
                            write_num_valid_reqs, scratch, cursors, sample, pool_rows, page_size, kv_indptr,
                            kv_indptr_wide, kv_nnz, table_wide, expected_token_pool_indices, step_wide):
        """After canary_plan_rows; any grid of ENTRY_THREADS-thread blocks."""
        rp_wide = step_wide & STEP_WIDE_REQ_POOL_INDICES
        s_samples = cuda.shared.array(_SAMPLES_LEN, int64)
        row_flags = scratch[NUMBA_SCRATCH_ROW_FLAGS]
        total = scratch[NUMBA_SCRATCH_TOTAL]
        sampled = sampling(sample, verify_capacity, row_flags, total)
        emitted = verify_capacity if sampled else total
        step = max((bs + ROW_SAMPLES - 1) // ROW_SAMPLES, int64(1))
        count = (bs + step - 1) // step
        j = int64(cuda.threadIdx.x)
        while j < count:
            s_samples[j] = scratch[NUMBA_SCRATCH_TABLE + j * step]
            j += cuda.blockDim.x
        if cuda.threadIdx.x == 0:
            s_samples[count] = emitted
        cuda.syncthreads()
        bad = int64(0)
        if (total <= verify_capacity or sampled) and (row_flags & CANARY_NO_ENTRIES) == 0:
            bad = emit_entries(bs, req_to_token, lut, lut_len, pool, token_offset, slots, expected, positions,
                               prevs, scratch, NUMBA_SCRATCH_TABLE, write_req_capacity + 1, s_samples, step, count,
                               emitted, sampled, page_size, table_wide)
        if sampled:  # the cursors' second half (canary_plan_rows reset them), a row a thread over the grid
            r = int64(cuda.blockIdx.x) * cuda.blockDim.x + cuda.threadIdx.x
            while r < bs:
                advance_cursor(req_pool_indices, rp_wide, cursors, scratch, NUMBA_SCRATCH_TABLE, write_req_capacity + 1, r)
                r += int64(cuda.gridDim.x) * cuda.blockDim.x
        if CAN_BAD:
            finalize(scratch, status, enable, num_valid, verify_capacity, sample, row_flags, total, bad,
                     req_pool_indices, rp_wide, bs, cursors, scratch, NUMBA_SCRATCH_TABLE, write_req_capacity + 1, int64(0), False)

    sfx = suffix(HAS_LUT, HAS_POOL, FORM)
    kernels = (canary_plan_fused, canary_plan_rows, canary_plan_entries)
    for k in kernels:
        k.__name__ = k.__qualname__ = f"{k.__name__}_{sfx}"
    return kernels


@functools.lru_cache(maxsize=None)
def plan_kernels(has_lut: bool, has_pool: bool, rows_threads: int = ROWS_THREADS,
                 entry_threads: int = ENTRY_THREADS, form: int = CANARY_FORM_TOKENS, padding_slot: int = 0):
    """``(canary_plan_fused, canary_plan_rows, canary_plan_entries)`` of one specialization (``form``: the index
    form, SPEC 3.8), compiled eagerly (``SIGNATURE``, plan.cu's launch bounds) once per process for the current
    device's compute capability. The module is loaded per device on first launch or by
    ``kernel.overloads[...].bind()``."""
    rows_threads, entry_threads = int(rows_threads), int(entry_threads)
    return tuple(cuda.jit(SIGNATURE, **_jit_options(k.__name__, rows_threads, entry_threads))(k)
                 for k in kernel_functions(bool(has_lut), bool(has_pool), rows_threads, entry_threads, int(form),
                                           int(padding_slot)))
