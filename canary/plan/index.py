"""The index a planner binds, in one of its three forms, and the one a step may pass instead (SPEC 3.8): the
host checks of SPEC 3.3 for them, and the host reads of ``check=True``'s search for a row that set ``BAD_SLOT``."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..backends.args import KVIndex
from ..contract.kvindex import (
    BAD_RAW, FORM_BLOCKS, FORM_PAGES, FORM_TOKENS, MAX_EXTENT, MAX_PAGE_SIZE, MAX_VIRTUAL, page_rows, paged_raw,
)
from ..contract.rows import bad_slot_rows, first_bad_row, row_checks
from ..errors import PlanStatus, fail
from ..interop.adapter import INT_WIDTHS, ArrayView, as_view, check_view
from ..interop.hostcopy import part_to_host, to_host

INDEX_ARRAYS = ("req_to_token", "block_table", "kv_indptr", "kv_indices")
FORMS_WORDED = ("one index form: req_to_token, or block_table with page_size, or kv_indptr and kv_indices with "
                "page_size")
INT32 = np.dtype(np.int32)
INDPTR_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))


def _page_size(value: Any, form: int) -> int:
    if form == FORM_TOKENS:
        if value is not None:
            raise fail(ValueError, f"page_size: expected None with req_to_token (a token-level table: each entry a "
                                   f"slot), got {value!r}")
        return 1
    if value is None:
        what = "block_table" if form == FORM_BLOCKS else "kv_indptr / kv_indices"
        raise fail(ValueError, f"page_size: expected an int in [1, 2**31 - 1] (tokens a page) with {what}, got None")
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise fail(TypeError, f"page_size: expected an int, got {type(value).__name__} {value!r}")
    if not 1 <= int(value) <= MAX_PAGE_SIZE:
        raise fail(ValueError, f"page_size: expected an int in [1, 2**31 - 1], got {value}")
    return int(value)


def indptr_view(view: ArrayView) -> ArrayView:
    """``kv_indptr``'s view checked: 1-D int32 or int64, unit stride (its length is checked per step)."""
    if view.dtype not in INDPTR_DTYPES:
        raise fail(TypeError, f"{view.name}: expected dtype int32 or int64, got {view.dtype.name}")
    return check_view(view, dtype=view.dtype, ndim=1)


def _check_extent(index: KVIndex) -> KVIndex:
    """The paged forms' index arithmetic stays exact (kvindex.py MAX_VIRTUAL, MAX_EXTENT)."""
    t, s = index.table, index.page_size
    extent = t.shape[0] if index.form == FORM_PAGES else t.shape[0] * index.row_stride
    if index.paged and (extent >= MAX_EXTENT or extent * s >= MAX_VIRTUAL):
        what = "kv_indices.shape[0]" if index.form == FORM_PAGES else "block_table rows * row stride"
        raise fail(ValueError, f"page_size: expected {what} * page_size < 2**62 and {what} < 2**50 (the plan's int64 "
                               f"slot arithmetic), got {extent} * {s}")
    return index


def bind_index(*, req_to_token: Any, block_table: Any, kv_indptr: Any, kv_indices: Any, page_size: Any,
               view: Callable[[Any, str], ArrayView] = as_view) -> KVIndex:
    """The checked index of a planner (SPEC 3.3, 3.8): exactly one form. Raises ``ValueError`` for none or two
    forms, half a page list, a ``page_size`` where it does not belong or missing, an extent too large;
    ``TypeError`` for a wrong dtype or ``page_size`` type."""
    forms = [n for n, v in (("req_to_token", req_to_token), ("block_table", block_table)) if v is not None]
    if kv_indptr is not None or kv_indices is not None:
        forms.append("kv_indptr / kv_indices")
    if len(forms) != 1:  # none is a missing argument (TypeError), two a contradiction (ValueError)
        raise fail(ValueError if forms else TypeError, f"req_to_token: expected exactly {FORMS_WORDED}, got "
                                                       f"{' and '.join(forms) if forms else 'none'}")
    if req_to_token is not None:
        _page_size(page_size, FORM_TOKENS)
        return KVIndex(FORM_TOKENS, check_view(view(req_to_token, "req_to_token"), dtype=INT32, ndim=2))
    if block_table is not None:
        s = _page_size(page_size, FORM_BLOCKS)
        return _check_extent(KVIndex(FORM_BLOCKS, check_view(view(block_table, "block_table"), dtype=INT_WIDTHS, ndim=2),
                                     s))
    for name, value in (("kv_indptr", kv_indptr), ("kv_indices", kv_indices)):
        if value is None:
            raise fail(ValueError, f"{name}: expected a page list's kv_indptr and kv_indices together, got {name}=None")
    s = _page_size(page_size, FORM_PAGES)
    indices = check_view(view(kv_indices, "kv_indices"), dtype=INT_WIDTHS, ndim=1)
    return _check_extent(KVIndex(FORM_PAGES, indices, s, indptr_view(view(kv_indptr, "kv_indptr"))))


def step_index(bound: KVIndex, bs: int, view: Callable[[Any, str], ArrayView], *, block_table: Any = None,
               kv_indptr: Any = None, kv_indices: Any = None) -> KVIndex | None:
    """The index of one step: the arrays it passes in place of the bound ones (only of the bound form; a block
    table of the bound shape, any row stride; a page list's two arrays either or both), ``None`` when it passes
    none. Checks ``kv_indptr``'s length (``>= bs + 1``) every step, bound or passed. Raises ``ValueError`` /
    ``TypeError`` naming the argument."""
    given = [n for n, v in (("block_table", block_table), ("kv_indptr", kv_indptr), ("kv_indices", kv_indices))
             if v is not None]
    step = None
    if given:
        allowed = {FORM_BLOCKS: ("block_table",), FORM_PAGES: ("kv_indptr", "kv_indices")}.get(bound.form, ())
        wrong = [n for n in given if n not in allowed]
        if wrong:
            bound_as = {FORM_TOKENS: "req_to_token", FORM_BLOCKS: "block_table"}.get(bound.form, "a page list")
            raise fail(ValueError, f"{wrong[0]}: expected None: the planner was bound with {bound_as}, and a step may "
                                   f"only pass the bound form's arrays again, got an array")
        if block_table is not None:
            table = check_view(view(block_table, "block_table"), dtype=INT_WIDTHS, ndim=2)
            if table.shape != bound.table.shape:
                raise fail(ValueError, f"block_table: expected the bound shape {bound.table.shape} (rows and blocks a "
                                       f"row), got {table.shape}")
            step = _check_extent(KVIndex(FORM_BLOCKS, table, bound.page_size))
        else:
            table = bound.table if kv_indices is None else check_view(view(kv_indices, "kv_indices"),
                                                                        dtype=INT_WIDTHS, ndim=1)
            ptr = bound.kv_indptr if kv_indptr is None else indptr_view(view(kv_indptr, "kv_indptr"))
            step = _check_extent(KVIndex(FORM_PAGES, table, bound.page_size, ptr))
    index = step if step is not None else bound
    if index.form == FORM_PAGES and index.kv_indptr.shape[0] < bs + 1:
        raise fail(ValueError, f"kv_indptr: expected at least bs + 1 = {bs + 1} entries (row r's pages are "
                               f"kv_indices[kv_indptr[r]:kv_indptr[r + 1]]), got {index.kv_indptr.shape[0]}")
    return step


def row_reader(index: KVIndex, rpi: np.ndarray, padding_slot: int = 0) -> Callable[[int, int, int], np.ndarray]:
    """``read_row(r, lo, hi)``: batch row ``r``'s raw slots at positions ``lo:hi`` copied to the host (a sync each,
    on ``check=True``'s error path only), a bad block entry as ``BAD_RAW`` (past any LUT). Only called for rows
    whose key and prefix the plan trusted (``canary.contract.rows.bad_slot_rows``)."""
    def source(v: ArrayView):
        return v.host if v.host is not None else v.owner

    table = source(index.table)
    if index.form == FORM_TOKENS:
        return lambda r, lo, hi: part_to_host(table, (int(rpi[r]), slice(lo, hi)))
    s = index.page_size
    ptr = None if index.kv_indptr is None else to_host(source(index.kv_indptr))

    def read_row(r: int, lo: int, hi: int) -> np.ndarray:
        if hi <= lo:
            return np.zeros(0, np.int64)
        pos = np.arange(lo, hi, dtype=np.int64)
        b0, b1 = lo // s, (hi - 1) // s + 1
        if index.form == FORM_BLOCKS:
            blocks = part_to_host(table, (int(rpi[r]), slice(b0, b1)))
        else:
            first = int(ptr[r])
            blocks = part_to_host(table, slice(first + b0, first + b1))
        raw, bad = paged_raw(np.asarray(blocks)[pos // s - b0], pos % s, s, padding_slot)
        return np.where(bad, np.int64(BAD_RAW), raw)

    return read_row


def host_page_rows(index: KVIndex | None) -> np.ndarray | None:
    """A page list's ``kv_indptr`` on the host (a sync), for ``check=True``'s row checks; ``None`` otherwise."""
    if index is None or index.form != FORM_PAGES:
        return None
    v = index.kv_indptr
    return to_host(v.host if v.host is not None else v.owner)


def first_bad_row_of(s, step_index: KVIndex | None, status, rpi, prefix, ext, valid_lens,
                     pool_indices=None) -> tuple[int | None, str | None]:
    """The first batch row the plan of planner arguments ``s`` (``StaticArgs``) flagged, recomputed on the host from
    the step's inputs (a sync), and when there is none to name for sure, why (``None``: the default reason).
    ``step_index``: the index the step passed (``None``: the bound one)."""
    index = step_index if step_index is not None else s.index
    pool, lut = s.req_to_verify_expected_tokens, s.full_to_swa_index_mapping
    # int32 or int64 each (SPEC 2 (*)): widened, as the kernels read them
    rpi, prefix, ext = (np.asarray(to_host(a)).astype(np.int64) for a in (rpi, prefix, ext))
    q = None if pool_indices is None else np.asarray(to_host(pool_indices)).astype(np.int64)
    valid_lens = None if valid_lens is None else np.asarray(to_host(valid_lens)).astype(np.int64)
    row_len = bad_key = None
    ptr = host_page_rows(index)
    if ptr is not None:
        _, bad_key, row_len = page_rows(ptr, rpi.shape[0], index.table.shape[0], rpi != 0, index.page_size,
                                        index.max_seq_len)
    c = row_checks(
        rpi, prefix, ext, valid_lens,
        rp_bound=s.req_pool_index_bound if q is None else s.max_reqs, max_seq_len=index.max_seq_len,
        pool_cols=None if pool is None else pool.shape[1], padding_rows_carry_tokens=s.padding_rows_carry_tokens,
        pool_indices=q, pool_rows=s.pool_rows, row_len=row_len, bad_key=bad_key,
    )
    if not (status & PlanStatus.BAD_SLOT and (lut is not None or index.paged)):
        return first_bad_row(c), None
    row_bits = PlanStatus.OVERFLOW | PlanStatus.BAD_REQ_POOL_INDEX | PlanStatus.BAD_PREFIX_LEN | \
        PlanStatus.BAD_VALID_LEN | PlanStatus.BAD_EXTEND_LEN
    read_row = row_reader(index, rpi, s.padding_slot)
    lut_len = BAD_RAW if lut is None else lut.shape[0]  # no LUT: only a bad block entry sets the bit
    verify_ran = not status & row_bits
    # A sampled step translated only the entries it took (SPEC 3.7), which the host cannot tell apart once the
    # cursors have moved: its seeds are certain, its windows only candidates.
    sampled = verify_ran and bool(status & PlanStatus.SAMPLED)
    row = first_bad_row(c, bad_slot_rows(c, rpi, prefix, ext, window=s.swa_window_size, lut_len=lut_len,
                                         verify_ran=verify_ran and not sampled, read_row=read_row))
    if row is not None or not sampled:
        return row, None
    maybe = np.flatnonzero(bad_slot_rows(c, rpi, prefix, ext, window=s.swa_window_size, lut_len=lut_len,
                                         verify_ran=True, read_row=read_row))
    rows = ", ".join(str(int(r)) for r in maybe[:8]) + (", ..." if maybe.size > 8 else "")
    where = "slots outside the LUT" if not index.paged else "slots outside the LUT or negative block entries"
    return None, (f"unknown (a sampled step translates only the entries it takes; batch rows holding {where} in "
                  f"their windows: {rows or 'none'})")
