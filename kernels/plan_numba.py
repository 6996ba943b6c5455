"""kv-canary planning kernels for Numba CUDA: the twin of ``kernels/plan.cu`` (SPEC 3.2, 3.4).

Same kernels, same structure, same names as plan.cu, so a reader finds each piece in both files:

- ``canary_plan_fused`` (bs <= ``FUSED_MAX_BS``, one launch): every block scans the rows itself
  (``scan_rows``, into shared memory), then emits its share of the verify entries (``emit_entries``); block 0
  also writes the write side.
- ``canary_plan_rows`` + ``canary_plan_entries`` (larger batches, two launches): one block of
  ``ROWS_THREADS`` scans all rows (thread t owns a contiguous chunk, so any bs up to the caller's capacity
  fits) into the scratch; then a grid emits the entries, each finding its row by binary search
  (``owning_row``) in the scratch's row offsets.
- In both, the last block to finish (``finalize``) composes status / enable / verify_num_valid and re-arms
  the scratch counters, so a launch leaves the scratch as it found it (CUDA-graph replays stay correct).

All three kernels take the same arguments: the fields of plan.cu's ``PlanParams``, in its order
(``PARAMS``; one ``SIGNATURE``). Grids are sized from verify_capacity by the caller, never from data.

Deliberate differences from plan.cu:

- Warp shuffles are not used anywhere (the Numba CUDA simulator, which CI runs, has none): ``block_scan2``
  scans through shared memory (Hillis-Steele), and ``emit_entries`` is the plain loop, one entry per thread
  per grid-stride step, reading each predecessor from ``req_to_token``. plan.cu's later GPU-only refinements
  (several entries per thread, the row table and sampled row search, predecessors by shuffle, tiled row
  loads, occupancy-sized grids) are not mirrored: they change speed, not output.
- ``FUSED_MAX_BS`` is 1024 here: a Numba launch costs tens of microseconds of host time, so one launch
  instead of two matters more than the re-scan each fused block does.
- The scratch (this backend's own) keeps plan.cu's four head words (``SCRATCH_*``), then just the row
  offsets ``[max_batch_size + 1]``.
- Compile-time specializations are the constants ``kernel_functions`` closes over (Numba folds them):
  ``HAS_LUT`` and ``HAS_POOL`` as in plan.cu, and the two block sizes, which size shared arrays (the
  simulator, one Python thread per CUDA thread, runs the same code with small blocks). plan.cu's
  ``WRITE_SIDE`` template flag is a runtime argument. An absent LUT / pool / valid_lens is a one-element
  dummy array (plan.cu gets a null pointer); the specialization never reads it.
- Output parameters become returned tuples (``translate`` returns ``(value, bad)``); offset arrays come as
  ``(array, base)`` pairs instead of ``p.scratch + SCRATCH_OFFSETS`` pointer arithmetic.

As in plan.cu, 2-D inputs arrive flat (1-D, unit stride) with their row stride in elements, and every index
is int64 (pools over 2^31 slots exist). Keep these kernels simple: numba-cuda is in maintenance mode.
"""
from __future__ import annotations

import functools

from numba import cuda, int32, int64

CANARY_OVERFLOW = 1
CANARY_BAD_REQ_POOL_INDEX = 2
CANARY_BAD_PREFIX_LEN = 4
CANARY_BAD_SLOT = 8
CANARY_BAD_VALID_LEN = 16
# The per-row lengths cannot be trusted: no verify entry is written.
CANARY_NO_ENTRIES = CANARY_BAD_REQ_POOL_INDEX | CANARY_BAD_PREFIX_LEN | CANARY_BAD_VALID_LEN

ROWS_THREADS = 1024  # canary_plan_rows: one block owns every row
ENTRY_THREADS = 256  # canary_plan_fused and canary_plan_entries
FUSED_MAX_BS = 1024  # row offsets of the fused kernel live in shared memory
_FUSED_OFFSETS = FUSED_MAX_BS + 1  # a shared array's shape must be a plain constant for Numba

# Scratch words (int64, owned by the planner, zeroed once at bind, re-armed by every launch).
SCRATCH_DONE = 0  # blocks finished (the last one finalizes)
SCRATCH_BAD_SLOT = 1  # BAD_SLOT bits from entries and seeds
SCRATCH_ROW_FLAGS = 2  # two-pass only: row checks of the rows kernel
SCRATCH_TOTAL = 3  # two-pass only: verify entries in all
SCRATCH_OFFSETS = 4  # two-pass only: row offsets [bs + 1]

# plan.cu's PlanParams, field by field: the arguments of every kernel here, and their Numba types
# (``int64[::1]`` for ``i64*``, ``int32[::1]`` for ``int*``; ``req_to_token`` and ``pool`` are flat views).
_A64, _A32, _I64 = "int64[::1]", "int32[::1]", "int64"
PARAMS = (
    ("req_pool_indices", _A64), ("prefix_lens", _A64), ("extend_seq_lens", _A64), ("valid_lens", _A64),
    ("bs", _I64), ("req_to_token", _A32), ("r2t_row_stride", _I64), ("rp_bound", _I64), ("max_seq_len", _I64),
    ("lut", _A64), ("lut_len", _I64), ("pool", _A32), ("pool_row_stride", _I64), ("pool_cols", _I64),
    ("token_offset", _I64), ("window", _I64), ("verify_capacity", _I64), ("write_req_capacity", _I64),
    ("slots", _A64), ("expected", _A64), ("positions", _A64), ("prevs", _A64), ("num_valid", _A32),
    ("enable", _A32), ("status", _A32), ("write_offsets", _A64), ("seeds", _A64),
    ("write_num_valid_reqs", _A32), ("scratch", _A64),
)
PARAM_FIELDS = tuple(name for name, _ in PARAMS)
SIGNATURE = "void({})".format(", ".join(ty for _, ty in PARAMS))
STEP_FIELDS = PARAM_FIELDS[:5]  # what changes per call; the rest is bound once


def suffix(has_lut: bool, has_pool: bool) -> str:
    """plan.cu's specialization suffix (``canary_plan_fused_<suffix>`` there)."""
    return f"lut{int(has_lut)}_pool{int(has_pool)}"


def _power_of_two(name: str, value: int) -> int:
    value = int(value)
    if value < 1 or value & (value - 1):
        raise ValueError(f"{name}: expected a power of two, got {value}")
    return value


@functools.lru_cache(maxsize=None)
def kernel_functions(has_lut: bool, has_pool: bool, rows_threads: int = ROWS_THREADS,
                     entry_threads: int = ENTRY_THREADS):
    """The plain Python kernels of one specialization: ``(canary_plan_fused, canary_plan_rows,
    canary_plan_entries)``, not yet compiled (``plan_kernels`` compiles them; ``cuda.compile_ptx`` can compile
    them on a machine without a GPU). The block sizes are compile-time constants because they size shared
    arrays; launch each kernel with exactly its block size."""
    HAS_LUT = bool(has_lut)  # noqa: N806 - compile-time constants, named like plan.cu's template parameters
    HAS_POOL = bool(has_pool)  # noqa: N806
    ROWS_T = _power_of_two("rows_threads", rows_threads)  # noqa: N806
    ENTRY_T = _power_of_two("entry_threads", entry_threads)  # noqa: N806

    @cuda.jit(device=True)
    def translate(raw, lut, lut_len):
        """T of SPEC 3.2: negative ids pass through; ids past the LUT become -1 and are reported (bad = 1)."""
        if not HAS_LUT or raw < 0:
            return raw, int64(0)
        if raw >= lut_len:
            return int64(-1), int64(1)
        return lut[raw], int64(0)

    @cuda.jit(device=True)
    def row_facts(r, req_pool_indices, prefix_lens, extend_seq_lens, valid_lens, rp_bound, max_seq_len,
                  pool_cols, window):
        """plan.cu's Row: ``(vcount, wlen, flags)``: verify entries, write entries, status bits the row raises."""
        rp = req_pool_indices[r]
        if rp == 0:  # padding row: its lengths may be stale garbage and are not read further
            return int64(0), int64(0), int64(0)
        e = extend_seq_lens[r]
        length = prefix_lens[r]
        wlen = e if e > 0 else int64(0)
        flags = int64(0)
        if rp < 0 or rp >= rp_bound:
            flags |= CANARY_BAD_REQ_POOL_INDEX
        if length < 0 or length > max_seq_len:
            flags |= CANARY_BAD_PREFIX_LEN
        if HAS_POOL:
            if valid_lens[r] > pool_cols:
                flags |= CANARY_BAD_VALID_LEN
        vcount = int64(0)
        if (flags & (CANARY_BAD_REQ_POOL_INDEX | CANARY_BAD_PREFIX_LEN)) == 0:
            vcount = window if (window > 0 and length > window) else length
        return vcount, wlen, flags

    def make_scan_rows(THREADS):  # noqa: N803 - plan.cu's template parameter
        """``scan_rows<THREADS>`` (with its ``block_scan2<THREADS>``) for one block size."""

        @cuda.jit(device=True)
        def block_scan2(a, b):
            """Exclusive block-wide scan of two int64 per thread: ``(excl_a, excl_b, tot_a, tot_b)``.

            Hillis-Steele through shared memory (the simulator has no warp shuffles). Every thread calls it.
            """
            scan_a = cuda.shared.array(THREADS, int64)
            scan_b = cuda.shared.array(THREADS, int64)
            t = cuda.threadIdx.x
            scan_a[t] = a
            scan_b[t] = b
            cuda.syncthreads()
            d = 1
            while d < THREADS:
                ua = int64(0)
                ub = int64(0)
                if t >= d:
                    ua = scan_a[t - d]
                    ub = scan_b[t - d]
                cuda.syncthreads()
                scan_a[t] += ua
                scan_b[t] += ub
                cuda.syncthreads()
                d *= 2
            excl_a = scan_a[t] - a
            excl_b = scan_b[t] - b
            tot_a = scan_a[THREADS - 1]
            tot_b = scan_b[THREADS - 1]
            cuda.syncthreads()  # the totals are read before anyone reuses the arrays
            return excl_a, excl_b, tot_a, tot_b

        @cuda.jit(device=True)
        def scan_rows(req_pool_indices, prefix_lens, extend_seq_lens, valid_lens, bs, req_to_token,
                      r2t_row_stride, rp_bound, max_seq_len, lut, lut_len, pool_cols, window, write_req_capacity,
                      write_offsets, seeds, write_num_valid_reqs, voff_out, voff_base, write_side):
            """Scan all rows with THREADS threads, each owning a contiguous chunk of rows.

            Writes the verify row offsets to ``voff_out[voff_base + 0 .. voff_base + bs]`` (shared or global
            memory) and, when ``write_side``, the write offsets, the zeroed tail and the seeds. Returns
            ``(vtotal, row_flags, seed_bad)``: the verify total, the block's OR of row flags, whether a seed
            fell outside the LUT (all threads get the same values).
            """
            s_flags = cuda.shared.array(1, int32)
            tid = int64(cuda.threadIdx.x)
            if tid == 0:
                s_flags[0] = 0
            chunk = (bs + THREADS - 1) // THREADS
            lo = min(tid * chunk, bs)
            hi = min(lo + chunk, bs)
            vsum = int64(0)
            wsum = int64(0)
            flags = int64(0)
            for r in range(lo, hi):
                vcount, wlen, f = row_facts(r, req_pool_indices, prefix_lens, extend_seq_lens, valid_lens,
                                            rp_bound, max_seq_len, pool_cols, window)
                vsum += vcount
                wsum += wlen
                flags |= f
            voff, woff, vtotal, wtotal = block_scan2(vsum, wsum)  # its barriers publish s_flags = 0
            bad = int64(0)
            for r in range(lo, hi):
                vcount, wlen, f = row_facts(r, req_pool_indices, prefix_lens, extend_seq_lens, valid_lens,
                                            rp_bound, max_seq_len, pool_cols, window)
                voff_out[voff_base + r] = voff
                if write_side:
                    write_offsets[r] = woff
                    seed = int64(-1)
                    length = prefix_lens[r]
                    if wlen > 0 and (f & (CANARY_BAD_REQ_POOL_INDEX | CANARY_BAD_PREFIX_LEN)) == 0 and length > 0:
                        raw = int64(req_to_token[req_pool_indices[r] * r2t_row_stride + (length - 1)])
                        seed, b = translate(raw, lut, lut_len)
                        bad |= b
                    seeds[r] = seed
                voff += vcount
                woff += wlen
            if flags != 0:
                cuda.atomic.or_(s_flags, 0, int32(flags))
            if tid == 0:
                voff_out[voff_base + bs] = vtotal
            if write_side:
                r = bs + 1 + tid
                while r <= write_req_capacity:
                    write_offsets[r] = 0
                    r += THREADS
                if tid == 0:
                    write_offsets[bs] = wtotal
                    write_num_valid_reqs[0] = bs
            seed_bad = cuda.syncthreads_or(int32(bad))
            row_flags = int64(s_flags[0])
            return vtotal, row_flags, int64(seed_bad != 0)

        return scan_rows

    scan_rows_rows = make_scan_rows(ROWS_T)  # scan_rows<ROWS_THREADS, ...> in plan.cu
    scan_rows_entry = make_scan_rows(ENTRY_T)  # scan_rows<ENTRY_THREADS, ...>

    @cuda.jit(device=True)
    def owning_row(off, base, bs, i):
        """Last r in [0, bs) with off[base + r] <= i: the row holding entry i (empty rows are skipped: the
        last of equal offsets wins)."""
        lo = int64(0)
        hi = bs  # off[base + lo] <= i < off[base + hi]
        while hi - lo > 1:
            mid = (lo + hi) >> 1
            if off[base + mid] <= i:
                lo = mid
            else:
                hi = mid
        return lo

    @cuda.jit(device=True)
    def emit_entries(req_pool_indices, prefix_lens, valid_lens, bs, req_to_token, r2t_row_stride, lut, lut_len,
                     pool, pool_row_stride, token_offset, window, slots, expected, positions, prevs, off, base,
                     total):
        """The verify entries of this block (grid-stride, so consecutive threads write consecutive entries).
        Returns whether a translated slot fell outside the LUT."""
        bad = int64(0)
        stride = int64(cuda.gridDim.x) * int64(cuda.blockDim.x)
        i = int64(cuda.blockIdx.x) * int64(cuda.blockDim.x) + int64(cuda.threadIdx.x)
        while i < total:
            r = owning_row(off, base, bs, i)
            length = prefix_lens[r]
            start = length - window if (window > 0 and length > window) else int64(0)
            pos = start + (i - off[base + r])
            rp = req_pool_indices[r]
            row = rp * r2t_row_stride
            slot, b1 = translate(int64(req_to_token[row + pos]), lut, lut_len)
            # The window does not reset the chain: its first entry keeps its real predecessor.
            prev = int64(-1)
            b2 = int64(0)
            if pos > 0:
                prev, b2 = translate(int64(req_to_token[row + pos - 1]), lut, lut_len)
            slots[i] = slot
            prevs[i] = prev
            positions[i] = pos
            tok = int64(-1)
            if HAS_POOL:
                col = pos + token_offset
                if col >= 0 and col < valid_lens[r]:
                    tok = int64(pool[rp * pool_row_stride + col])
            expected[i] = tok
            bad |= b1 | b2
            i += stride
        return bad

    @cuda.jit(device=True)
    def finalize(scratch, status, enable, num_valid, verify_capacity, row_flags, total, bad_slot):
        """Every block calls this once, last thing. The last block to arrive composes the status and re-arms
        the scratch."""
        any_bad = cuda.syncthreads_or(int32(bad_slot))  # also: every thread of the block has finished its stores
        if cuda.threadIdx.x == 0:
            if any_bad != 0:
                cuda.atomic.or_(scratch, SCRATCH_BAD_SLOT, int64(CANARY_BAD_SLOT))
            cuda.threadfence()
            if cuda.atomic.add(scratch, SCRATCH_DONE, int64(1)) == int64(cuda.gridDim.x) - 1:
                cuda.threadfence()
                st = row_flags | cuda.atomic.exch(scratch, SCRATCH_BAD_SLOT, int64(0))
                if total > verify_capacity:
                    st |= CANARY_OVERFLOW
                status[0] = st
                enable[0] = 1 if st == 0 else 0
                num_valid[0] = total if total < verify_capacity else verify_capacity
                scratch[SCRATCH_DONE] = 0

    # The kernels. Every one takes PlanParams' fields in order (see PARAMS).

    def canary_plan_fused(req_pool_indices, prefix_lens, extend_seq_lens, valid_lens, bs, req_to_token,
                          r2t_row_stride, rp_bound, max_seq_len, lut, lut_len, pool, pool_row_stride, pool_cols,
                          token_offset, window, verify_capacity, write_req_capacity, slots, expected, positions,
                          prevs, num_valid, enable, status, write_offsets, seeds, write_num_valid_reqs, scratch):
        """bs <= FUSED_MAX_BS; any grid of ENTRY_THREADS-thread blocks."""
        s_off = cuda.shared.array(_FUSED_OFFSETS, int64)
        total, row_flags, seed_bad = scan_rows_entry(
            req_pool_indices, prefix_lens, extend_seq_lens, valid_lens, bs, req_to_token, r2t_row_stride,
            rp_bound, max_seq_len, lut, lut_len, pool_cols, window, write_req_capacity, write_offsets, seeds,
            write_num_valid_reqs, s_off, 0, cuda.blockIdx.x == 0)
        bad = seed_bad
        if total <= verify_capacity and (row_flags & CANARY_NO_ENTRIES) == 0:
            bad |= emit_entries(req_pool_indices, prefix_lens, valid_lens, bs, req_to_token, r2t_row_stride, lut,
                                lut_len, pool, pool_row_stride, token_offset, window, slots, expected, positions,
                                prevs, s_off, 0, total)
        finalize(scratch, status, enable, num_valid, verify_capacity, row_flags, total, bad)

    def canary_plan_rows(req_pool_indices, prefix_lens, extend_seq_lens, valid_lens, bs, req_to_token,
                         r2t_row_stride, rp_bound, max_seq_len, lut, lut_len, pool, pool_row_stride, pool_cols,
                         token_offset, window, verify_capacity, write_req_capacity, slots, expected, positions,
                         prevs, num_valid, enable, status, write_offsets, seeds, write_num_valid_reqs, scratch):
        """Grid 1, block ROWS_THREADS: scans, seeds and row flags into the scratch."""
        total, row_flags, seed_bad = scan_rows_rows(
            req_pool_indices, prefix_lens, extend_seq_lens, valid_lens, bs, req_to_token, r2t_row_stride,
            rp_bound, max_seq_len, lut, lut_len, pool_cols, window, write_req_capacity, write_offsets, seeds,
            write_num_valid_reqs, scratch, SCRATCH_OFFSETS, True)
        if cuda.threadIdx.x == 0:
            scratch[SCRATCH_ROW_FLAGS] = row_flags | (CANARY_BAD_SLOT if seed_bad != 0 else 0)
            scratch[SCRATCH_TOTAL] = total

    def canary_plan_entries(req_pool_indices, prefix_lens, extend_seq_lens, valid_lens, bs, req_to_token,
                            r2t_row_stride, rp_bound, max_seq_len, lut, lut_len, pool, pool_row_stride, pool_cols,
                            token_offset, window, verify_capacity, write_req_capacity, slots, expected, positions,
                            prevs, num_valid, enable, status, write_offsets, seeds, write_num_valid_reqs, scratch):
        """After canary_plan_rows; any grid of ENTRY_THREADS-thread blocks."""
        row_flags = scratch[SCRATCH_ROW_FLAGS]
        total = scratch[SCRATCH_TOTAL]
        bad = int64(0)
        if total <= verify_capacity and (row_flags & CANARY_NO_ENTRIES) == 0:
            bad = emit_entries(req_pool_indices, prefix_lens, valid_lens, bs, req_to_token, r2t_row_stride, lut,
                               lut_len, pool, pool_row_stride, token_offset, window, slots, expected, positions,
                               prevs, scratch, SCRATCH_OFFSETS, total)
        finalize(scratch, status, enable, num_valid, verify_capacity, row_flags, total, bad)

    sfx = suffix(HAS_LUT, HAS_POOL)
    kernels = (canary_plan_fused, canary_plan_rows, canary_plan_entries)
    for k in kernels:
        k.__name__ = k.__qualname__ = f"{k.__name__}_{sfx}"
    return kernels


@functools.lru_cache(maxsize=None)
def plan_kernels(has_lut: bool, has_pool: bool, rows_threads: int = ROWS_THREADS,
                 entry_threads: int = ENTRY_THREADS):
    """``(canary_plan_fused, canary_plan_rows, canary_plan_entries)`` of one specialization, compiled eagerly
    (``SIGNATURE``) once per process for the current device's compute capability. The module is loaded per
    device on first launch or by ``kernel.overloads[...].bind()``."""
    return tuple(cuda.jit(SIGNATURE)(k) for k in kernel_functions(bool(has_lut), bool(has_pool),
                                                                   int(rows_threads), int(entry_threads)))
