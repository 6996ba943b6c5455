"""The expected-token pool's host bookkeeping, keyed by request identity (docs/records.md 7).

Each request gets a pool row of its own for its whole life, and keeps it after :meth:`RequestPool.finish` until
the row is handed to another request: freed rows are reused first in, first out, so a stale forward of a
finished request still reads its own tokens (and a recycled ``req_to_token`` row is caught). Pool row 0 is the
padding row (the scatter never writes it, so it holds no request's tokens).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Hashable

import numpy as np

from ..errors import fail


_SEQUENCES = (list, tuple)
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1


@dataclass
class _Request:
    row: int
    tokens: list[int] = field(default_factory=list)
    last_req_pool_index: int = 0  # req_to_token row of its last batch (for naming the requests holding a slot)


class RequestPool:
    """``rows`` pool rows of ``cols`` columns; updates queue on the host until :meth:`take_updates`."""

    def __init__(self, rows: int, cols: int):
        self.rows, self.cols = rows, cols
        self.live: dict[Hashable, _Request] = {}
        self.retired: dict[Hashable, _Request] = {}  # finished, row not yet reused
        self._free = deque(range(1, rows))
        self._owner_of_free: dict[int, Hashable] = {}
        self.updates: list[tuple[int, int, Any]] = []  # (pool row, first column, tokens: int64 array or int list)

    def add(self, request_id: Hashable, tokens: Any) -> None:
        if request_id is None:
            raise fail(ValueError, "request_id: expected an engine request id, got None (None marks padding rows)")
        if request_id in self.live:
            raise fail(ValueError, f"request_id: expected a request not yet added, got {request_id!r} (already "
                                   f"running; call finish_request first)")
        if not self._free:
            raise fail(RuntimeError, f"request_id: expected a free expected-token pool row for {request_id!r}, got "
                                     f"none of {self.rows - 1} free (raise max_requests)")
        row = self._free.popleft()
        old = self._owner_of_free.pop(row, None)
        if old is not None:
            self.retired.pop(old, None)
        self.retired.pop(request_id, None)
        req = self.live[request_id] = _Request(row)
        self._append(request_id, req, tokens, "prompt_token_ids")

    def accept(self, request_id: Hashable, tokens: Any) -> None:
        req = self.live.get(request_id)
        if req is None:
            raise fail(KeyError, f"request_id: expected a running request (add_request first), got {request_id!r}")
        self._append(request_id, req, tokens, "token_ids")

    def finish(self, request_id: Hashable) -> None:
        req = self.live.pop(request_id, None)
        if req is None:
            raise fail(KeyError, f"request_id: expected a running request, got {request_id!r}")
        self.retired[request_id] = req
        self._owner_of_free[req.row] = request_id
        self._free.append(req.row)

    def lookup(self, request_id: Hashable) -> _Request | None:
        """A running request, or a finished one whose row is not reused yet, or ``None``."""
        if request_id is None:
            return None
        return self.live.get(request_id) or self.retired.get(request_id)

    def _append(self, request_id: Hashable, req: _Request, tokens: Any, name: str) -> None:
        if type(tokens) in _SEQUENCES and all(type(t) is int and _I64_MIN <= t <= _I64_MAX for t in tokens):
            toks: Any = list(tokens)  # a decode step's token or few: kept as ints, no array made per request
        else:
            arr = np.asarray(tokens if tokens is not None else [], dtype=np.int64).reshape(-1) if not isinstance(
                tokens, np.ndarray) else tokens.astype(np.int64, copy=False).reshape(-1)
            toks = arr
        n = len(toks)
        start = len(req.tokens)
        if start + n > self.cols:
            raise fail(ValueError, f"{name}: expected at most {self.cols} tokens per request (the pool's columns, "
                                   f"max_seq_len + 1), got {start + n} for request {request_id!r}")
        if n:
            req.tokens.extend(toks if type(toks) is list else toks.tolist())
            self.updates.append((req.row, start, toks))

    def take_updates(self) -> list[tuple[int, int, Any]]:
        out, self.updates = self.updates, []
        return out

    def protected_tokens(self) -> int:
        """Expected tokens the pool holds for running requests."""
        return sum(len(r.tokens) for r in self.live.values())
