"""A group's index in the form its :class:`~canary.manager.KVGroup` gives (SPEC 3.8): ``req_to_token``, a block
table (``block_table``, ``page_size``) or a page list (``kv_indptr``, ``kv_indices``, ``page_size``).

What the manager needs of it: the one-form check and the shape the plans and the expected-token pool are sized by
(:func:`check_index`, :func:`index_shape`), the planner's keywords (:func:`planner_index`), the arrays a step
passes in place of the bound ones (:func:`step_arrays`, ``before_forward(block_table=..., ...)``), and the host
reads of the report's attributions (:class:`TokenIndex`: a token table's columns and rows).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..contract.kvindex import paged_raw
from ..errors import fail
from ..interop.adapter import as_view
from ..interop.hostcopy import to_host

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
        shape = tuple(as_view(spec.req_to_token, f"groups[{i}].req_to_token").shape)
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
        shape = tuple(as_view(spec.block_table, f"groups[{i}].block_table").shape)
        if len(shape) != 2:
            raise fail(ValueError, f"groups[{i}].block_table: expected a [max_reqs, max_blocks] int32 array, got "
                                   f"shape {shape}")
        return shape[0], shape[1] * s
    for name in ("kv_indptr", "kv_indices"):
        if getattr(spec, name) is None:
            raise fail(ValueError, f"groups[{i}].{name}: expected a page list's kv_indptr and kv_indices together, "
                                   f"got None")
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


class TokenIndex:
    """A group's index as token rows on the host, for the report's attributions (copies, a sync each, on the
    error path only): ``column(p)`` (every row's raw slot at position ``p``) and ``row(rp)`` (row ``rp``'s slots),
    int64, a negative block entry as -1. ``None`` from :meth:`of` for a page list: its rows are the batch rows of
    the step it was built for, which the engine has rebuilt by the time a report is read (SPEC 3.8).
    ``padding_slot``: the group's (SPEC 3.2 "No reserved slot": -1 makes block 0 a real block)."""

    def __init__(self, table: Any, page_size: int, paged: bool, padding_slot: int = 0):
        self.table, self.page_size, self.paged, self.padding_slot = table, page_size, paged, padding_slot
        rows, cols = as_view(table, "req_to_token").shape
        self.shape = (rows, cols * page_size)

    @classmethod
    def of(cls, spec) -> "TokenIndex | None":
        form = form_of(spec)
        if form == "page_list":
            return None
        if form == "block_table":
            return cls(spec.block_table, int(spec.page_size), True, spec.padding_slot)
        return cls(spec.req_to_token, 1, False, spec.padding_slot)

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
