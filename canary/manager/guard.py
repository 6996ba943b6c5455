"""The manager's calling contract (docs/integration.md, "What an engine can rely on"): which thread may make which
call, no step call inside another, nothing after ``close``, no copy or pickle.

The request calls (``add_request``, ``accept_tokens``, ...) take the manager's lock and may come from any thread;
the step calls (:func:`step_call`) come from the thread that made the first of them, also under the lock, so that
a request call from another thread waits for the step instead of changing the request pool while a report is
decoded. The lock is re-entrant: a violation callback may call the request calls; a step call inside a step call
is refused.
"""
from __future__ import annotations

import functools
import logging
import threading
from threading import get_ident
from typing import Any, Callable

from ..errors import fail


def step_call(bound: bool = True) -> Callable:
    """A step call's guard: on the manager's step thread (the first step call's; ``bound=False``: any thread),
    holding the manager's lock, never inside another step call, never after ``close``. Per call: a thread id
    compare, a lock and two flag checks."""
    def wrap(fn: Callable) -> Callable:
        name = fn.__name__.lstrip("_")

        @functools.wraps(fn)
        def call(self, *args: Any, **kwargs: Any) -> Any:
            if bound and get_ident() != self._thread:
                self._bind(name)
            with self._lock:
                if self._busy is not None or self._closed:
                    self._refuse(name)
                self._busy = name
                try:
                    return fn(self, *args, **kwargs)
                finally:
                    self._busy = None
        return call
    return wrap


def request_call(fn: Callable) -> Callable:
    """A request call's guard: any thread, holding the manager's lock (so it waits for a step in progress),
    never after ``close``."""
    name = fn.__name__

    @functools.wraps(fn)
    def call(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            if self._closed:
                self._refuse(name)
            return fn(self, *args, **kwargs)
    return call


class Guarded:
    """The contract's state and refusals; the manager sets ``_lock`` (an ``RLock``), ``_thread`` (``None`` until
    the first step call), ``_busy`` (the step call in progress) and ``_closed``."""

    _lock: Any
    _thread: int | None
    _busy: str | None
    _closed: bool

    def _bind(self, call: str) -> None:
        # A step call from a thread other than the step thread: the first one binds it, any later one is refused
        with self._lock:
            if self._thread is None:
                self._thread = get_ident()
            elif self._thread != get_ident():
                raise fail(RuntimeError, f"{call}: expected a call from the thread the manager's steps run on "
                                         f"({self._thread}), got one from thread {get_ident()} "
                                         f"({threading.current_thread().name!r}); only add_request, accept_tokens, "
                                         f"accept_tokens_batch, finish_request, cache_prefix, evict_prefix, "
                                         f"allocate_record_rows, stats, open_violations, warmup and close may be "
                                         f"called from other threads")

    def _refuse(self, call: str) -> None:
        if self._closed:
            raise fail(RuntimeError, f"{call}: expected an open manager, got one closed by close() (its device "
                                     f"buffers, streams and pinned host memory are freed)")
        raise fail(RuntimeError, f"{call}: expected no other step call in progress, got {call} called from inside "
                                 f"{self._busy} (from a violation callback or a hook it runs): step calls do not "
                                 f"nest")

    def __enter__(self):
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()  # its delivery may raise, as a step call would
            return
        try:  # an exception is leaving the block: it stays the one raised; the canary's own goes to the log
            self.close()
        except Exception as own:  # noqa: BLE001 - the engine's exception wins
            logging.getLogger("kv_canary").error("kv-canary: close() on leaving a with block that raised %s: %r",
                                                 exc_type.__name__, own)

    def _no_copy(self, *args: Any) -> Any:
        raise fail(TypeError, f"{type(self).__name__}: expected no copy or pickle of a manager, got one asked for: "
                              f"it owns device buffers, CUDA streams and graphs and pinned host memory bound to one "
                              f"engine and device (build a new manager over the engine's KVGroup arrays instead)")

    __copy__ = __deepcopy__ = __reduce_ex__ = __reduce__ = __getstate__ = _no_copy
