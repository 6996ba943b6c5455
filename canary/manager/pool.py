"""The expected-token pool's host bookkeeping, keyed by request identity (docs/records.md 7).

Each request gets a pool row of its own for its whole life, and keeps it after :meth:`RequestPool.finish` until
the row is handed to another request: freed rows are reused first in, first out, so a stale forward of a
finished request still reads its own tokens (and a recycled ``req_to_token`` row is caught). Pool row 0 is the
padding row (the scatter never writes it, so it holds no request's tokens).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Hashable

import numpy as np

from ..errors import fail


_SEQUENCES = (list, tuple)
TOKEN_MAX = (1 << 31) - 1  # the pool is int32: a token id is in [0, 2**31) (-1 there means "no expected token")


def _check_id(request_id: Any) -> None:
    """A request id is a dict key here: ``TypeError`` naming it for an unhashable one."""
    try:
        hash(request_id)
    except TypeError:
        raise fail(TypeError, f"request_id: expected a hashable engine request id (an int, a str, ...), got "
                              f"{type(request_id).__name__} {request_id!r}") from None


def host_token_array(tokens: Any, name: str) -> np.ndarray:
    """Host token ids as a ``[k]`` int64 array, checked: integers (no float, bool or string is converted), one
    dimension (a single int is one token; ``None`` none), each in ``[0, 2**31)``, the pool's int32 range (a value
    outside would be stored as another token, or as -1, which turns the token check off). ``TypeError`` /
    ``ValueError`` naming ``name``."""
    if tokens is None:
        return np.zeros(0, dtype=np.int64)
    try:
        arr = tokens if isinstance(tokens, np.ndarray) else np.asarray(tokens)
    except (ValueError, TypeError) as exc:  # ragged nesting and the like
        raise fail(TypeError, f"{name}: expected a sequence of integer token ids, got {type(tokens).__name__} "
                              f"({exc})") from None
    if arr.dtype.kind not in "iu":
        raise fail(TypeError, f"{name}: expected integer token ids, got {type(tokens).__name__} of dtype {arr.dtype}")
    if arr.ndim > 1:
        raise fail(ValueError, f"{name}: expected one dimension of token ids, got shape {tuple(arr.shape)}")
    arr = arr.reshape(-1)
    # One reduction for both bounds: a value outside [0, 2**31) has a bit at or above bit 31 set (a negative one
    # its sign bit), so the OR of the values does exactly then (numpy calls are the cost of a decode batch here).
    if arr.size and int(np.bitwise_or.reduce(arr, axis=None)) >> 31:
        bad = arr[(arr < 0) | (arr > TOKEN_MAX)][0]
        raise fail(ValueError, f"{name}: expected token ids in [0, 2**31) (the expected-token pool is int32), got "
                               f"{int(bad)}")
    return arr.astype(np.int64, copy=False)


@dataclass
class _Request:
    row: int
    last_req_pool_index: int = 0  # req_to_token row of its last batch (for naming the requests holding a slot)


@dataclass
class RowTokens:
    """A queued update of one token for each of several pool rows (:meth:`RequestPool.accept_batch`): ``rows``,
    ``cols`` (each row's first free column), ``tokens``, ``ends``, ``[k]`` int64 each. Device token ids (the
    manager's zero-copy path) stay on the device: ``device`` = ``(their view, the caller's array)`` and ``tokens``
    is ``None`` until :meth:`host_tokens` copies them (a sync, off the decode path). ``version``: the pool's
    version before this update (the manager's device staging knows the lengths of that version)."""
    rows: np.ndarray
    cols: np.ndarray
    tokens: np.ndarray | None
    ends: np.ndarray  # cols + 1: the rows' token counts once this update is in
    device: Any = None
    version: int = 0

    def host_tokens(self) -> np.ndarray:
        if self.tokens is None:
            from ..interop.hostcopy import to_host

            held = self.device[1]  # the manager's copy (canary/manager/accepted.py), else the caller's array
            self.tokens = (held.read_host() if hasattr(held, "read_host")
                           else np.asarray(to_host(held)).astype(np.int64).reshape(-1))
        return self.tokens


class RequestPool:
    """``rows`` pool rows of ``cols`` columns; updates queue on the host until :meth:`take_updates`.

    ``counts[row]``: the expected tokens pool row ``row`` holds (the values live only in the device pool; the
    host needs the counts, as the plan's valid lengths). ``version`` changes with any count, ``members`` with the
    requests' rows (a request added, finished or its row reused): what the manager's per-batch caches key on.
    """

    def __init__(self, rows: int, cols: int, groups: int = 1):
        self.rows, self.cols = rows, cols
        self.live: dict[Hashable, _Request] = {}
        self.row_of: dict[Hashable, int] = {None: 0}  # each running request's row (padding rows: None -> 0)
        self.retired: dict[Hashable, _Request] = {}  # finished, row not yet reused
        self._free = deque(range(1, rows))
        self._owner_of_free: dict[int, Hashable] = {}
        # (pool row, first column, tokens: int64 array or int list), or a RowTokens
        self.updates: list[Any] = []
        self.counts = np.zeros(rows, dtype=np.int64)
        # the engine reports accepted tokens (any accept so far): a request's count at its last step then bounds
        # the positions its KV holds (the reports' attributions read no column past it: a reused row's stale tail)
        self.accepting = False
        # per group (a KV group is written by its own steps: a draft's may cover fewer positions than the target's)
        self.planned = np.zeros((groups, rows), dtype=np.int64)  # each pool row's count at the group's last step
        self.written = np.full((groups, rows), -1, dtype=np.int64)  # host arrays: its prefix + extend (-1: unknown)
        self.version = 0
        self.members = 0
        self._batch: tuple | None = None  # (ids, members, rows, padding mask or None) of the last accept_batch
        self._batch_state: tuple | None = None  # (version after it, its rows, their counts, the largest count)

    def add(self, request_id: Hashable, tokens: Any) -> None:
        _check_id(request_id)
        if request_id is None:
            raise fail(ValueError, "request_id: expected an engine request id, got None (None marks padding rows)")
        if request_id in self.live:
            raise fail(ValueError, f"request_id: expected a request not yet added, got {request_id!r} (already "
                                   f"running; call finish_request first)")
        if not self._free:
            raise fail(RuntimeError, f"request_id: expected a free expected-token pool row for {request_id!r}, got "
                                     f"none of {self.rows - 1} free (raise max_requests)")
        tokens = self._host_tokens(tokens, "prompt_token_ids")
        if len(tokens) > self.cols:  # refused before the request is registered: a retry with a shorter prompt works
            raise fail(ValueError, f"prompt_token_ids: expected at most {self.cols} tokens per request (the pool's "
                                   f"columns, max_seq_len + 1), got {len(tokens)} for request {request_id!r}")
        row = self._free.popleft()
        old = self._owner_of_free.pop(row, None)
        if old is not None:
            self.retired.pop(old, None)
        self.retired.pop(request_id, None)
        req = self.live[request_id] = _Request(row)
        self.row_of[request_id] = row
        self.counts[row] = 0
        self.planned[:, row] = 0  # no step has planned it yet: it holds nothing
        self.written[:, row] = -1
        self.version += 1
        self.members += 1
        self._append(request_id, req, tokens, "prompt_token_ids")

    def accept(self, request_id: Hashable, tokens: Any) -> None:
        try:
            req = self.live.get(request_id)
        except TypeError:
            _check_id(request_id)
            raise
        if req is None:
            raise fail(KeyError, f"request_id: expected a running request (add_request first), got {request_id!r}")
        self._append(request_id, req, self._host_tokens(tokens, "token_ids"), "token_ids")
        self.accepting = True

    def finish(self, request_id: Hashable) -> None:
        _check_id(request_id)
        req = self.live.pop(request_id, None)
        if req is None:
            raise fail(KeyError, f"request_id: expected a running request, got {request_id!r}")
        del self.row_of[request_id]
        self.retired[request_id] = req
        self.version += 1
        self.members += 1
        self._owner_of_free[req.row] = request_id
        self._free.append(req.row)

    def lookup(self, request_id: Hashable) -> _Request | None:
        """A running request, or a finished one whose row is not reused yet, or ``None``."""
        if request_id is None:
            return None
        return self.live.get(request_id) or self.retired.get(request_id)

    @staticmethod
    def _host_tokens(tokens: Any, name: str) -> Any:
        if type(tokens) in _SEQUENCES and all(type(t) is int and 0 <= t <= TOKEN_MAX for t in tokens):
            return list(tokens)  # a decode step's token or few: kept as ints, no array made per request
        return host_token_array(tokens, name)

    def _append(self, request_id: Hashable, req: _Request, toks: Any, name: str) -> None:
        # toks: _host_tokens' form (its callers made it: add checks the prompt's length with it first)
        n = len(toks)
        start = int(self.counts[req.row])
        if start + n > self.cols:
            raise fail(ValueError, f"{name}: expected at most {self.cols} tokens per request (the pool's columns, "
                                   f"max_seq_len + 1), got {start + n} for request {request_id!r}")
        if n:
            self.version += 1
            self.counts[req.row] = start + n
            self.updates.append((req.row, start, toks))

    def accept_batch(self, request_ids: tuple, tokens: np.ndarray | None, same_rows=None, device=None) -> None:
        """One token for each running request of ``request_ids`` (distinct; ``None``: a padding row, its token
        ignored), ``tokens`` ``[k]`` int64 (or
        ``None`` and ``device`` = ``(view, array)`` of device token ids, see :class:`RowTokens`): one update for
        the batch. The ids' rows are looked up once per batch (reused while no request is added or finished),
        the counts checked and advanced together. ``same_rows(request_ids)``: an array of these rows the caller
        already holds (or ``None``), adopted when equal, so that the caller can tell its batch by identity."""
        last = self._cached_batch(request_ids)
        if last is not None:
            rows, pad = last[2], last[3]
        else:
            try:  # one lookup a row in a comprehension (a batch's hot path), the errors named below
                got = [self.row_of.get(rid, -1) for rid in request_ids]
            except TypeError:
                got = None
            if got is None or -1 in got:
                self._refuse_batch(request_ids)
                raise AssertionError("kv-canary: request_ids: a batch refused without a reason")  # unreachable
            rows = np.array(got, dtype=np.int64)
            padding = got.count(0)
            if len(set(got)) != len(got) - padding + (1 if padding else 0):
                first: dict = {}  # where each request is first, to name the one listed again
                k = next(k for k, rid in enumerate(request_ids) if rid is not None and first.setdefault(rid, k) != k)
                raise fail(ValueError, f"request_ids[{k}]: expected distinct requests (None for padding rows), got "
                                       f"{request_ids[k]!r} again (request_ids[{first[request_ids[k]]}])")
            pad = None if not padding else rows == 0
            held = same_rows(request_ids) if same_rows is not None else None
            if held is not None and np.array_equal(held, rows):
                rows = held
            self._batch = (request_ids, self.members, rows, pad)
        state = self._batch_state
        if state is not None and state[0] == self.version and state[1] is rows:
            # A decode loop: nothing changed these rows since this batch's last accept, so their counts are its
            # ends and the largest is known (no gather, no reduction)
            cols, top = state[2], state[3]
        else:
            cols = self.counts[rows]
            top = int(cols.max()) if len(cols) else -1
        if top >= self.cols:  # the culprit looked up only on failure
            i = int(np.flatnonzero(cols >= self.cols)[0])
            raise fail(ValueError, f"token_ids: expected at most {self.cols} tokens per request (the pool's "
                                   f"columns, max_seq_len + 1), got {self.cols + 1} for request {request_ids[i]!r}")
        ends = cols + 1
        if pad is not None:
            ends[pad] = 0  # pool row 0 holds no tokens
        self.counts[rows] = ends
        self.version += 1
        self._batch_state = (self.version, rows, ends, top + 1)
        self.updates.append(RowTokens(rows, cols, tokens, ends, device, self.version - 1))
        self.accepting = True

    def last_accepted(self) -> tuple[tuple, np.ndarray, np.ndarray]:
        """``(request ids, pool rows, new counts)`` of the last :meth:`accept_batch` (row 0, count 0: padding)."""
        return self._batch[0], self._batch_state[1], self._batch_state[2]

    def _refuse_batch(self, request_ids: tuple) -> None:
        live = self.live.get
        for i, rid in enumerate(request_ids):
            if rid is None:
                continue
            try:
                req = live(rid)
            except TypeError:
                raise fail(TypeError, f"request_ids[{i}]: expected a hashable request id (or None), got "
                                      f"{type(rid).__name__}") from None
            if req is None:
                raise fail(KeyError, f"request_ids[{i}]: expected a running request (add_request first), got "
                                     f"{rid!r}")

    def _cached_batch(self, request_ids: tuple) -> tuple | None:
        last = self._batch
        if last is not None and last[1] == self.members and (last[0] is request_ids or last[0] == request_ids):
            return last
        return None

    def batch_rows(self, request_ids: tuple) -> np.ndarray | None:
        """The rows :meth:`accept_batch` holds for exactly these ids (no request added or finished since), or
        ``None``."""
        last = self._cached_batch(request_ids)
        return None if last is None else last[2]

    def take_updates(self) -> list[tuple[int, int, Any]]:
        out, self.updates = self.updates, []
        return out

    def protected_tokens(self) -> int:
        """Expected tokens the pool holds for running requests."""
        return sum(int(self.counts[r.row]) for r in self.live.values())
