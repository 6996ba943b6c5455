"""Exceptions and the device-side status bitmask (SPEC 3.3, 3.4)."""
from __future__ import annotations

import enum


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
