"""Exceptions and the device-side status bitmask (SPEC 3.3, 3.4)."""
from __future__ import annotations

import enum
import functools
import inspect
from typing import Any, Callable


class PlanStatus(enum.IntFlag):
    """Bits of the int32 ``status`` output, set on the device by each plan launch (SPEC 3.4).

    ``OVERFLOW`` is a sizing signal (``total > verify_capacity`` under ``on_overflow="skip"``: nothing verified,
    ``enable = 0``); ``SAMPLED`` says the step verified ``verify_capacity`` of its ``total`` entries, chosen by
    the rotation of SPEC 3.7 (``on_overflow="sample"``, the default; not an error, ``enable`` stays 1). Every
    other bit is an input fault and forces ``enable = 0``.
    """

    OK = 0
    OVERFLOW = 1
    BAD_REQ_POOL_INDEX = 2
    BAD_PREFIX_LEN = 4
    BAD_SLOT = 8
    BAD_VALID_LEN = 16
    BAD_EXTEND_LEN = 32
    SAMPLED = 64


INPUT_ERROR_BITS = (
    PlanStatus.BAD_REQ_POOL_INDEX | PlanStatus.BAD_PREFIX_LEN | PlanStatus.BAD_SLOT | PlanStatus.BAD_VALID_LEN
    | PlanStatus.BAD_EXTEND_LEN
)


class CanaryInputError(RuntimeError):
    """A plan's device-side checks found bad input (raised by ``check()``, which syncs).

    Attributes: ``status`` (:class:`PlanStatus`) and ``first_bad_row`` (batch row index, or ``None`` when it
    could not be located).
    """

    def __init__(self, message: str, status: PlanStatus, first_bad_row: int | None = None):
        super().__init__(message)
        self.status = status
        self.first_bad_row = first_bad_row


class BackendUnavailableError(ImportError):
    """The requested backend's library is missing or unusable; the message says what to install."""


def fail(exc_type: type[Exception], message: str) -> Exception:
    """Build an exception whose message carries the library prefix every user-facing error has."""
    return exc_type(f"kv-canary: {message}")


def worded(owner: str, method: bool = False) -> Callable:
    """Decorate a public call so that Python's own argument errors (a signature that does not bind) are worded as
    this library's, naming the call and its choices. Free for a call that binds: the call is made as is, and only
    a ``TypeError`` raised by the binding itself (no frame below the call's) is looked at again."""
    def wrap(fn: Callable) -> Callable:
        params = [p for p in inspect.signature(fn).parameters.values()][1 if method else 0:]
        positional = [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
        keywords = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        required = [p.name for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD,
                                                                                 p.KEYWORD_ONLY)]

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except TypeError as exc:
                if exc.__traceback__ is None or exc.__traceback__.tb_next is not None:
                    raise  # raised inside the call: not a binding error
                given, named = (args[1:] if method else args), kwargs
                if positional:  # the positional ones count as named; too many is this call's own error
                    if len(given) > len(positional):
                        raise fail(TypeError, f"{owner}: expected at most {len(positional)} positional argument(s) "
                                              f"({', '.join(positional)}), the rest by keyword, got {len(given)}"
                                   ) from None
                    given, named = (), {**dict.fromkeys(positional[:len(given)]), **kwargs}
                try:
                    check_keywords(owner, given, named, keywords, required)
                except TypeError as worded_exc:
                    raise worded_exc from None
                raise
        return call
    return wrap


def check_keywords(owner: str, args: tuple, given, accepted, required) -> None:
    """Word a keyword-only call's argument errors as this library's: Python's own would name no choices (and, for
    a wrapper, an internal function). ``given``: the keywords passed; ``accepted``: every keyword the call
    takes, in the order the message lists them; ``required``: those it cannot do without."""
    if args:
        raise fail(TypeError, f"{owner}: expected keyword arguments only ({', '.join(accepted)}), got "
                              f"{len(args)} positional argument(s)")
    for key in given:
        if key not in accepted:
            raise fail(TypeError, f"{owner}: unexpected keyword argument {key!r}; expected one of: "
                                  f"{', '.join(accepted)}")
    for key in required:
        if key not in given:
            raise fail(TypeError, f"{owner}: missing required keyword argument {key!r}")
