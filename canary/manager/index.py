"""A group's index in the form its :class:`~canary.manager.KVGroup` gives (SPEC 3.8): ``req_to_token``, a block
table (``block_table``, ``page_size``) or a page list (``kv_indptr``, ``kv_indices``, ``page_size``).

What the manager needs of it: the one-form check and the shape the plans and the expected-token pool are sized by
(:func:`check_index`, :func:`index_shape`), the planner's keywords (:func:`planner_index`), the arrays a step
passes in place of the bound ones (:func:`step_arrays`, ``before_forward(block_table=..., ...)``), and the host
reads of the report's attributions (:func:`host_index`: a :class:`TokenIndex` of a token table or block table, a
:class:`PageIndex` of a page list as the step whose page list is current reads it).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..contract.kvindex import paged_raw
from ..errors import fail
from ..interop.adapter import as_view
from ..interop.hostcopy import part_to_host, to_host

INDEX_ARRAYS = ("req_to_token", "block_table", "kv_indptr", "kv_indices")
FORMS = "req_to_token, or block_table with page_size, or kv_indptr and kv_indices with page_size"


def form_of(spec) -> str:
    """``"req_to_token"``, ``"block_table"`` or ``"page_list"`` (after :func:`check_index`)."""
    if spec.req_to_token is not None:
        return "req_to_token"
    return "block_table" if spec.block_table is not None else "page_list"


def _positive(i: int, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) < 1:
        raise fail(ValueError, f"groups[{i}].{name}: expected an int >= 1, got {value!r}")
    return int(value)


_I32, _WIDTHS = (np.dtype(np.int32),), (np.dtype(np.int32), np.dtype(np.int64))  # SPEC 2 (*), 3.8


def _shape(spec, i: int, name: str, dtypes: tuple) -> tuple:
    """The shape of the group's index array ``name``, its dtype checked in the group's words (the planner would
    name the bare argument)."""
    v = as_view(getattr(spec, name), f"groups[{i}].{name}")
    if np.dtype(v.dtype) not in dtypes:
        raise fail(TypeError, f"groups[{i}].{name}: expected dtype {' or '.join(d.name for d in dtypes)}, got "
                              f"{np.dtype(v.dtype).name}")
    return tuple(v.shape)


def check_index(spec, i: int) -> tuple[int, int]:
    """Exactly one form (SPEC 3.8), and ``(max_reqs, max_seq_len)``: the token table's or block table's rows and
    positions; a page list (rows keyed by batch row) takes both from the KVGroup's ``max_reqs`` and
    ``max_seq_len``, which only it may give. Raises ``ValueError`` / ``TypeError`` naming ``groups[i]``."""
    given = [n for n in ("req_to_token", "block_table") if getattr(spec, n) is not None]
    if spec.kv_indptr is not None or spec.kv_indices is not None:
        given.append("kv_indptr / kv_indices")
    if len(given) != 1:
        raise fail(ValueError, f"groups[{i}].req_to_token: expected exactly one index form: {FORMS}, got "
                               f"{' and '.join(given) if given else 'none'}")
    pages = given[0] == "kv_indptr / kv_indices"
    for name in ("max_reqs", "max_seq_len"):
        if getattr(spec, name) is not None and not pages:
            raise fail(ValueError, f"groups[{i}].{name}: expected None with {given[0]} (its shape gives it), got "
                                   f"{getattr(spec, name)!r}")
    if given[0] == "req_to_token":
        shape = _shape(spec, i, "req_to_token", _I32)
        if len(shape) != 2:
            raise fail(ValueError, f"groups[{i}].req_to_token: expected a [max_reqs, max_seq_len] int32 array, got "
                                   f"shape {shape}")
        return shape
    s = spec.page_size
    if s is None:
        raise fail(ValueError, f"groups[{i}].page_size: expected the tokens a page (an int >= 1) with "
                               f"{given[0]}, got None")
    s = _positive(i, "page_size", s)
    if not pages:
        shape = _shape(spec, i, "block_table", _WIDTHS)
        if len(shape) != 2:
            raise fail(ValueError, f"groups[{i}].block_table: expected a [max_reqs, max_blocks] int32 or int64 "
                                   f"array, got shape {shape}")
        return shape[0], shape[1] * s
    for name in ("kv_indptr", "kv_indices"):
        if getattr(spec, name) is None:
            raise fail(ValueError, f"groups[{i}].{name}: expected a page list's kv_indptr and kv_indices together, "
                                   f"got None")
        _shape(spec, i, name, _WIDTHS)
    for name in ("max_reqs", "max_seq_len"):
        if getattr(spec, name) is None:
            what = ("the rows req_pool_indices names (verify_cursors' rows)" if name == "max_reqs"
                    else "the most tokens a request holds (the expected-token pool's columns)")
            raise fail(ValueError, f"groups[{i}].{name}: expected {what} with a page list (its rows are batch "
                                   f"rows), got None")
    return _positive(i, "max_reqs", spec.max_reqs), _positive(i, "max_seq_len", spec.max_seq_len)


def index_shape(spec) -> tuple[int, int]:
    """``(max_reqs, max_seq_len)`` of a checked group (:func:`check_index`)."""
    return check_index(spec, 0)


def planner_index(spec) -> dict:
    """The :class:`~canary.CanaryPlanner` keywords of the group's index."""
    form = form_of(spec)
    if form == "req_to_token":
        return dict(req_to_token=spec.req_to_token)
    if form == "block_table":
        return dict(block_table=spec.block_table, page_size=spec.page_size)
    return dict(kv_indptr=spec.kv_indptr, kv_indices=spec.kv_indices, page_size=spec.page_size)


_ARRAYS_OF = {"block_table": ("block_table",), "page_list": ("kv_indptr", "kv_indices"), "req_to_token": ()}


def step_arrays(sel, **given: Any) -> dict | None:
    """The index arrays a step passes (``before_forward(block_table=..., kv_indptr=..., kv_indices=...)``), per group
    name: each keyword is an array for every planned group of that form, or a dict ``{group name: array}``.
    ``None`` when none is given. Raises ``ValueError`` for an array no planned group of that form takes, a name
    not planned; shapes and dtypes are the planner's checks (SPEC 3.3)."""
    given = {k: v for k, v in given.items() if v is not None}
    if not given:
        return None
    names = {g.name: g for g in sel}
    out: dict[str, dict] = {}
    for key, value in given.items():
        if isinstance(value, dict):
            targets = list(value.items())
            unknown = [n for n, _ in targets if n not in names]
            if unknown:
                raise fail(ValueError, f"{key}: expected group names this step plans ({sorted(names)}), got "
                                       f"{unknown[0]!r}")
        else:
            targets = [(g.name, value) for g in sel if key in _ARRAYS_OF[form_of(g.spec)]]
            if not targets:
                bound = "a block table" if key == "block_table" else "a page list"
                raise fail(ValueError, f"{key}: expected a planned group bound with {bound} (groups "
                                       f"{sorted(names)}), got an array")
        for name, array in targets:
            form = form_of(names[name].spec)
            if key not in _ARRAYS_OF[form]:
                raise fail(ValueError, f"{key}[{name!r}]: expected None: group {name!r} is bound with {form}, got "
                                       f"an array")
            out.setdefault(name, {})[key] = array
    return out


# What a page row reads at a position it does not hold (past its pages, a bad kv_indptr pair, a row past kv_indptr):
# negative (no translation touches it), never a slot, never MISSING_SLOT (-2**62) nor a bad entry's -1.
NOT_HELD = -(1 << 63)


def host_index(g) -> "TokenIndex | PageIndex | None":
    """The index of bound group ``g`` as the report's attributions read it: a :class:`TokenIndex` of its token
    table or block table, a :class:`PageIndex` of its page list as ``g.page_rows`` holds it (``None``: no step has
    planned the group yet). Makes no copy."""
    spec = g.spec
    form = form_of(spec)
    if form == "page_list":
        held = g.page_rows
        if held is None:
            return None
        ids, kv_indptr, kv_indices = held
        return PageIndex(ids, kv_indptr, kv_indices, int(spec.page_size), int(spec.max_seq_len),
                         spec.padding_slot)
    if form == "block_table":
        return TokenIndex(spec.block_table, int(spec.page_size), True, spec.padding_slot)
    return TokenIndex(spec.req_to_token, 1, False, spec.padding_slot)


def open_pages(groups, request_ids, index: dict | None, captured: dict | None = None) -> None:
    """Set ``page_rows`` of the page-list groups among ``groups`` (bound groups a step opened with ``request_ids``
    plans) to that step's: ``(its request ids, one per batch row, kv_indptr, kv_indices)``, the step's own arrays
    (``index``: :func:`step_arrays`'s answer; ``captured``: a graph replay's, ``{bs: that answer}`` of the
    engine's captures) where given, else the bound ones (refilled in place by the engine)."""
    if request_ids is None:
        ids = ()
    elif type(request_ids) is tuple:
        ids = request_ids
    elif isinstance(request_ids, np.ndarray):
        ids = tuple(request_ids.tolist())
    else:  # a tuple of its own: an engine may refill its list before a later flush
        try:
            ids = tuple(request_ids)
        except TypeError:  # refused by the step's intake (worded), after the reports are decoded
            ids = ()
    if captured is not None:
        index = captured.get(len(ids))
    for g in groups:
        spec = g.spec
        if form_of(spec) != "page_list":
            continue
        own = (index.get(g.name) if index else None) or {}
        g.page_rows = (ids, own.get("kv_indptr", spec.kv_indptr), own.get("kv_indices", spec.kv_indices))


class TokenIndex:
    """A group's token table or block table as token rows on the host, for the report's attributions (copies, a
    sync each, on the error path only): ``column(p)`` (every row's raw slot at position ``p``) and ``row(rp)``
    (row ``rp``'s slots), int64, a negative block entry as -1. Keyed by ``req_pool_indices`` (the reported step's
    rows, a running request's last row), row 0 the padding row. A page list is a :class:`PageIndex`.
    ``padding_slot``: the group's (SPEC 3.2 "No reserved slot": -1 makes block 0 a real block)."""

    by_batch_row = False

    def __init__(self, table: Any, page_size: int, paged: bool, padding_slot: int = 0):
        self.table, self.page_size, self.paged, self.padding_slot = table, page_size, paged, padding_slot
        rows, cols = as_view(table, "req_to_token").shape
        self.shape = (rows, cols * page_size)
        self.max_seq_len = self.shape[1]

    def has(self, rp: int) -> bool:
        """Whether ``rp`` names a request row (not the padding row 0, inside the table)."""
        return 0 < rp < self.shape[0]

    def column(self, p: int) -> np.ndarray:
        if not self.paged:
            return np.asarray(to_host(self.table[:, p])).astype(np.int64)
        s = self.page_size
        blocks = np.asarray(to_host(self.table[:, p // s]))
        return paged_raw(blocks, p % s, s, self.padding_slot)[0]

    def row(self, rp: int) -> np.ndarray:
        if not self.paged:
            return np.asarray(to_host(self.table[rp])).astype(np.int64)
        s = self.page_size
        blocks = np.repeat(np.asarray(to_host(self.table[rp])), s)
        return paged_raw(blocks, np.tile(np.arange(s, dtype=np.int64), blocks.shape[0] // s if s else 0), s,
                         self.padding_slot)[0]


def _host_span(obj: Any, start: int, stop: int, name: str) -> np.ndarray:
    """Entries ``start:stop`` (clamped to its length) of a 1-D integer array as int64 on the host, one copy; empty
    for anything else: the reports are decoded before the opening step's planner checks its arrays."""
    try:
        shape = tuple(as_view(obj, name).shape)
    except (ValueError, TypeError):
        return np.zeros(0, np.int64)
    if len(shape) != 1:
        return np.zeros(0, np.int64)
    start, stop = min(start, shape[0]), min(stop, shape[0])
    got = np.asarray(part_to_host(obj, (slice(start, max(start, stop)),)))
    return got.astype(np.int64) if got.dtype.kind in "iu" else np.zeros(0, np.int64)


class PageIndex:
    """A page list on the host, as the step whose page list is current reads it, for the report's attributions
    (SPEC 3.8: its rows are batch rows, rebuilt by the engine each step). That step is the one being opened when
    its ``before_forward`` / ``begin_step`` decodes the reports (the engine has filled its page list by then), else
    (``poll``, ``flush``, ``close``) the last planned step. Keys are that step's batch rows, found by request id
    (:meth:`key`: rows move between steps, and ``req_pool_indices`` may too): a request not in that batch has no
    row and cannot be attributed.

    ``request_ids``: the step's ids, one per batch row (``bs``); ``kv_indptr`` ``[>= bs + 1]`` int32 / int64 and
    ``kv_indices`` ``[nnz]`` int32 / int64 (host or device arrays), ``page_size`` ``S``. Row ``r`` holds
    positions ``p < (kv_indptr[r + 1] - kv_indptr[r]) * S``, the raw slot ``B(kv_indices[kv_indptr[r] + p // S],
    p % S)`` (SPEC 3.8; -1 for a negative block entry); :data:`NOT_HELD` at a position it does not hold, and at
    every position of a row whose pair is out of order or range or lies past ``kv_indptr``. ``column(p)``
    ``[bs]`` int64 and ``row(r)`` ``[held positions]`` int64, as :class:`TokenIndex`'s. Two host copies (a sync
    each, on the error path only), both at the first read: ``kv_indptr[: bs + 1]``, then the good rows' pages
    (one span of ``kv_indices``)."""

    by_batch_row = True

    def __init__(self, request_ids: tuple, kv_indptr: Any, kv_indices: Any, page_size: int, max_seq_len: int,
                 padding_slot: int = 0):
        self.request_ids, self.kv_indptr, self.kv_indices = request_ids, kv_indptr, kv_indices
        self.padding_slot = padding_slot
        self.page_size, self.max_seq_len = page_size, max_seq_len
        self.bs = len(request_ids)
        self._rows: dict | None = None
        self._pages: np.ndarray | None = None

    def key(self, rid) -> int | None:
        """Request ``rid``'s batch row in the step (its first, when listed twice), ``None`` when not in it."""
        rows = self._rows
        if rows is None:
            rows = self._rows = {}
            for r, got in enumerate(self.request_ids):
                try:
                    rows.setdefault(got, r)
                except TypeError:  # an unhashable id: the step's own call refuses it, and it names no row here
                    pass
        try:
            return rows.get(rid)
        except TypeError:
            return None

    def has(self, r: int) -> bool:
        return 0 <= r < self.bs

    def _load(self) -> None:
        bs, s = self.bs, self.page_size
        ptr = _host_span(self.kv_indptr, 0, bs + 1, "kv_indptr")
        n = max(0, min(bs, ptr.shape[0] - 1))  # rows whose pair kv_indptr holds
        try:
            shape = tuple(as_view(self.kv_indices, "kv_indices").shape)
        except (ValueError, TypeError):
            shape = ()
        nnz = shape[0] if len(shape) == 1 else 0
        lo, hi = ptr[:n], ptr[1:n + 1]
        good = (lo >= 0) & (hi >= lo) & (hi <= nnz) & (hi > lo)
        first, pages = np.zeros(bs, np.int64), np.zeros(bs, np.int64)
        first[:n], pages[:n] = np.where(good, lo, 0), np.where(good, hi - lo, 0)
        if good.any():
            start, stop = int(lo[good].min()), int(hi[good].max())
            self._pages = _host_span(self.kv_indices, start, stop, "kv_indices")
            if self._pages.shape[0] < stop - start:  # not an integer array: the step's planner refuses it
                pages[:] = 0
            first -= start
        else:
            self._pages = np.zeros(0, np.int64)
        self.first, self.pages, self.held = first, pages, pages * np.int64(s)

    def column(self, p: int) -> np.ndarray:
        if self._pages is None:
            self._load()
        s = self.page_size
        held = (p >= 0) & (p < self.held)
        if not held.any():
            return np.full(self.bs, NOT_HELD, np.int64)
        blocks = self._pages[np.where(held, self.first + p // s, 0)]
        return np.where(held, paged_raw(blocks, p % s, s, self.padding_slot)[0], np.int64(NOT_HELD))

    def row(self, r: int) -> np.ndarray:
        if self._pages is None:
            self._load()
        if not self.has(r) or not self.pages[r]:
            return np.zeros(0, np.int64)
        s, first, n = self.page_size, int(self.first[r]), int(self.pages[r])
        blocks = np.repeat(self._pages[first:first + n], s)
        return paged_raw(blocks, np.tile(np.arange(s, dtype=np.int64), n), s, self.padding_slot)[0]
