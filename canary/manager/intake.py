"""Token intake: the request ids and expected tokens an engine hands the manager between steps, and the pool
rows a step's batch reads them from (canary/manager/pool.py holds them).

One :class:`TokenIntake` per manager: ``accept_tokens_batch``'s host ints or device token ids (queued zero-copy
when the staging appends on the device, canary/manager/staging.py), request ids turned into one tuple object per
repeated batch (the caches downstream compare by identity), and each step's pool rows (:meth:`TokenIntake.rows`).
:class:`RequestCalls`: the manager's public calls that feed it (``add_request``, ``accept_tokens``,
``accept_tokens_batch``, ``finish_request``).
"""
from __future__ import annotations

from typing import Any, Hashable, Sequence

import numpy as np

from ..errors import fail
from ..interop.adapter import HOST, as_view, identity
from ..interop.hostcopy import to_host
from ..interop.streams import launch_stream
from .guard import request_call
from .pool import RequestPool, host_token_array


class TokenIntake:
    """The intake of a manager over ``requests`` (its :class:`RequestPool`), ``staging`` (its host-to-device side:
    whether it appends device token ids, read at each call), on CUDA device ``ordinal`` (``None``: host),
    for batches of at most ``max_batch_size`` rows."""

    def __init__(self, requests: RequestPool, staging, ordinal: int | None, max_batch_size: int):
        self.requests, self.staging, self.ordinal, self.max_batch_size = requests, staging, ordinal, max_batch_size
        self._tokens_view: tuple | None = None  # (array, identity, view) of the last device token ids
        self._ids_cache: tuple | None = None  # (type, snapshot, tuple) of the last request ids (ids)
        self.rows_cache: tuple | None = None  # (request ids, pool members version, pool rows) of rows

    def accept_batch(self, request_ids: Any, token_ids: Any, stream: Any = None) -> None:
        """The manager's :meth:`~canary.CanaryManager.accept_tokens_batch` (its docstring; the device path's rule:
        canary/manager/accepted.py). ``stream``: where a device array's copy runs (default: the current stream
        of its library)."""
        ids = self.ids(request_ids)
        if token_ids is None:
            raise fail(TypeError, f"token_ids: expected one token id per request ([{len(ids)}] host ints or a device "
                                  f"array), got None")
        if type(token_ids) not in (list, tuple, np.ndarray):
            token_ids = self._device_tokens(ids, token_ids, stream)
            if token_ids is None:
                return
        toks = host_token_array(token_ids, "token_ids")
        if toks.shape[0] != len(ids) or getattr(token_ids, "ndim", 1) != 1:  # a list: host_token_array's 1-D check
            raise fail(ValueError, f"token_ids: expected one token per request ([{len(ids)}]), got shape "
                                   f"{tuple(np.shape(token_ids))}")
        if len(ids):
            self.requests.accept_batch(ids, toks.astype(np.int64, copy=True), self._batch_rows)

    def _device_tokens(self, ids: tuple, token_ids: Any, stream: Any = None) -> Any:
        """accept_tokens_batch's arrays that are not NumPy's: device token ids are copied on ``stream`` into the
        manager's ring when this manager appends on the device (returns ``None``; canary/manager/accepted.py);
        otherwise returns host values for the host path (a device array copied to the host: a sync, e.g. a
        Numba-backend manager)."""
        ident = identity(token_ids)  # an engine's static buffer: its checked view reused while the same array
        last = self._tokens_view
        if ident is not None and last is not None and last[0] is token_ids and last[1] == ident:
            view = last[2]
        else:
            t = type(token_ids)  # the type's attributes: an instance's __cuda_array_interface__ builds a dict
            if not (hasattr(t, "__cuda_array_interface__") or hasattr(t, "__dlpack__")):
                return token_ids  # a sequence of another kind: NumPy reads it
            view = as_view(token_ids, "token_ids")
            self._tokens_view = None
            if view.device_id == HOST:
                return view.host
            if self.staging.device_append is None:
                return to_host(token_ids)
            if len(view.shape) != 1:
                raise fail(ValueError, f"token_ids: expected one token per request ([{len(ids)}]), got shape "
                                       f"{tuple(view.shape)}")
            if view.dtype not in (np.dtype(np.int64), np.dtype(np.int32)):
                raise fail(TypeError, f"token_ids: expected int64 or int32 device token ids, got dtype {view.dtype}")
            if view.device_id != self.ordinal:
                raise fail(ValueError, f"token_ids: expected host ints or an array on cuda:{self.ordinal} (the "
                                       f"manager's device), got an array on cuda:{view.device_id}")
            if view.shape[0] > 1 and view.strides[0] != 1:
                raise fail(ValueError, f"token_ids: expected a contiguous device array (stride 1), got stride "
                                       f"{view.strides[0]}")
            if ident is not None:  # checked: the next call over the same array reuses it
                self._tokens_view = (token_ids, ident, view)
        if view.shape[0] != len(ids):
            raise fail(ValueError, f"token_ids: expected one token per request ([{len(ids)}]), got shape "
                                   f"{tuple(view.shape)}")
        if len(ids):
            self.requests.accept_batch(ids, None, self._batch_rows, device=(view, token_ids))
            ring = self.staging.accept
            if ring is not None:  # copied now, on the accepting stream: the engine may reuse its buffer at once
                update = self.requests.updates[-1]
                update.device = ring.hold(view, launch_stream(self.ordinal, stream, token_ids)[0], update)
        return None

    def ids(self, request_ids: Any) -> tuple:
        """The request ids as a tuple; the same tuple object as last call when the caller passes the same ids in a
        list or tuple (compared with a snapshot, element by element: the caller may refill its list), so that the
        per-batch caches downstream compare by identity."""
        c = self._ids_cache
        t = type(request_ids)
        if c is not None and t is c[0] and request_ids == c[1]:
            return c[2]
        if request_ids is None:
            return ()
        if t is str or t is bytes or t is bytearray:  # tuple() would read "ab" as two ids
            raise fail(TypeError, f"request_ids: expected a sequence of request ids, got {t.__name__} "
                                  f"{request_ids!r}")
        if t is np.ndarray:
            return tuple(request_ids.tolist())
        ids = tuple(request_ids)
        if t is list:
            self._ids_cache = (list, list(request_ids), ids)
        elif t is tuple:
            self._ids_cache = (tuple, request_ids, ids)
        return ids

    def _batch_rows(self, ids: tuple) -> np.ndarray | None:
        # The pool rows rows() holds for this batch: accept_batch adopts the same array, so that the step can tell a
        # decode batch accepting for exactly its own rows by identity (stage_append).
        last = self.rows_cache
        return last[2] if last is not None and last[1] == self.requests.members and last[0] == ids else None

    def rows(self, request_ids: Any) -> tuple[tuple, np.ndarray]:
        """A step's batch: its request ids as :meth:`ids` gives them and their pool rows (``[bs]`` int64, host; the
        same array as last call when the batch repeats with no request added or finished since). Raises
        ``ValueError`` for more than ``max_batch_size`` ids or an id listed twice, ``TypeError`` for an id that is
        not hashable."""
        c = self._ids_cache  # ids()'s common case inline: the same ids as last call (one call less a step)
        if c is not None and type(request_ids) is c[0] and request_ids == c[1]:
            ids = c[2]
        else:
            ids = self.ids(request_ids)
        bs = len(ids)
        if bs > self.max_batch_size:
            raise fail(ValueError, f"request_ids: expected at most max_batch_size = {self.max_batch_size} ids, "
                                   f"got {bs}")
        pool = self.requests
        last = self.rows_cache
        if last is not None and last[1] == pool.members and (last[0] is ids or last[0] == ids):
            return last[0], last[2]  # the same batch, no request added or finished since: the same pool rows
        # RequestPool.lookup inlined (a few hundred ids a step): running, else finished but not reused, else row 0
        # (None itself is never a key), whose count is 0: an id never added has no expected tokens, only chain,
        # position and KV checks.
        live, retired = pool.live.get, pool.retired.get
        q = np.zeros(bs, dtype=np.int64)
        first: dict = {}  # a request listed twice would have one row's prefix verified against the other's tokens
        try:
            for i, rid in enumerate(ids):
                if rid is not None and first.setdefault(rid, i) != i:
                    raise fail(ValueError, f"request_ids[{i}]: expected distinct request ids (None for padding "
                                           f"rows), got {rid!r} again (request_ids[{first[rid]}])")
                r = live(rid) or retired(rid)
                if r is not None:
                    q[i] = r.row
        except TypeError:  # before the step opens: a refused call leaves none
            raise fail(TypeError, f"request_ids[{i}]: expected a hashable request id (or None), got "
                                  f"{type(ids[i]).__name__}") from None
        held = pool.batch_rows(ids)  # accept_batch's rows for these ids: the same array (see _batch_rows)
        if held is not None and np.array_equal(held, q):
            q = held
        self.rows_cache = (ids, pool.members, q)
        return ids, q


class RequestCalls:
    """The manager's request calls (a mixin of :class:`~canary.CanaryManager`): expected tokens kept by request
    identity. Manager state it uses: ``requests`` (the pool), ``_intake``, ``_steps``, ``_decoder``, ``_marks``."""

    @request_call
    def add_request(self, request_id: Hashable, prompt_token_ids: Sequence[int] | np.ndarray) -> None:
        """Start tracking a request: its own expected-token pool row, holding its prompt (``[P]`` int token ids,
        host). Raises ``ValueError`` for a request already running, ``None`` as an id, a prompt longer than
        ``max_seq_len + 1``; ``RuntimeError`` when every pool row is taken (raise ``max_requests``)."""
        self.requests.add(request_id, prompt_token_ids)
        self._decoder.last_rows = None  # a new request under an old id is noted

    @request_call
    def accept_tokens(self, request_id: Hashable, token_ids: Sequence[int] | np.ndarray) -> None:
        """Append a step's accepted tokens (host ints: the sampled token, or a speculative step's accepted drafts
        and bonus token; never rejected drafts). They reach the device at the next :meth:`before_forward`.
        Raises ``KeyError`` for a request not running, ``ValueError`` past ``max_seq_len + 1`` tokens."""
        self.requests.accept(request_id, token_ids)

    @request_call
    def accept_tokens_batch(self, request_ids: Sequence[Hashable], token_ids: Any, *, stream: Any = None,
                            fed_to_last_step: bool = False) -> None:
        """:meth:`accept_tokens` for a whole decode batch at once: ``token_ids[i]`` is the one token request
        ``request_ids[i]`` accepted this step (a plain decode step's sampled tokens). Requests must be running and
        distinct; ``None`` marks a padding row (a batch padded to a graph size), whose token is ignored. One update
        for the batch instead of one per request: the host cost of a step that accepts a token for each of 256
        requests drops from about 1 us a request to a few numpy calls (docs/performance.md). For several tokens a
        request (speculative decoding), call :meth:`accept_tokens` per request.

        ``token_ids``: ``[bs]`` host ints (a list, a NumPy array, a CPU tensor), or the engine's device array of
        sampled token ids (int64 or int32, contiguous, on this manager's device; DLPack / CUDA array interface). A
        device array is copied here, on ``stream`` (default: its library's current stream), into the manager's own
        device ring (CuPy backend; canary/manager/accepted.py): the engine may reuse or zero its buffer at once, and
        each accept before a step keeps its tokens. Numba-backend or CPU manager: copied to the host (a sync).

        ``fed_to_last_step``: these tokens were already the inputs of the step that just closed: the engine accepts
        a step's sampled tokens one step late, behind the next step's forward (docs/integration.md 2; the
        transformers integration does, canary/integrations/hf_accept.py). Then the requests of that step count
        them as planned by it, as if accepted before its ``before_forward``, so that its report names them for the
        positions it wrote (canary/manager/attribution.py ``holds``); requests not in that step, or any request
        when one joined or left since that step began, are not counted so. Detection needs nothing of it: a step
        verifies only positions below its ``prefix_lens``, so a token sampled at step N is first verified at
        N + 2.

        Raises ``KeyError`` for a request not running; ``ValueError`` for a request listed twice, a length
        mismatch, a request past ``max_seq_len + 1`` tokens (nothing is accepted then), a device array on another
        device or not contiguous; ``TypeError`` for token ids that are not integers; ``RuntimeError`` for
        ``fed_to_last_step=True`` with a step open (before its ``after_kv_store``: nothing is accepted)."""
        if fed_to_last_step and self._steps.step is not None:
            raise fail(RuntimeError, f"accept_tokens_batch: expected fed_to_last_step=True after the step's "
                                     f"after_kv_store, got step {self._steps.step.index} still open")
        version = self.requests.version
        self._intake.accept_batch(request_ids, token_ids, stream)
        if fed_to_last_step and self.requests.version != version:  # accepted (none for an empty batch)
            self._count_fed()

    @request_call
    def finish_request(self, request_id: Hashable) -> None:
        """Stop tracking a request. Its pool row keeps its tokens until every other free row was reused, so a
        stale forward naming it is still checked. Raises ``KeyError`` for a request not running."""
        self.requests.finish(request_id)
        self._decoder.last_rows = None
        self._marks.release_request(request_id)

    def _count_fed(self) -> None:
        # accept_tokens_batch(fed_to_last_step=True): the batch just accepted counted as planned by the last closed
        # step for the requests it held (attribution.py holds); none when a request joined or left since that step
        # began (its rows may be another request's now)
        steps, pool = self._steps, self.requests
        if steps.closed is None:
            return
        rec, members = steps.closed
        if pool.members != members:
            return
        request_ids, rows, ends = pool.last_accepted()
        at = steps.group_at[rec.groups]
        if request_ids is rec.request_ids or request_ids == rec.request_ids:
            pool.planned[at, rows] = ends  # padding rows: row 0, count 0
            return
        held = set(rec.request_ids)
        keep = [k for k, rid in enumerate(request_ids) if rid is not None and rid in held]
        if keep:
            pool.planned[at, rows[keep]] = ends[keep]
