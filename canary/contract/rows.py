"""The per-row rules of SPEC 3.4 on host arrays: which batch rows are active, and which are flagged.

Shared by the NumPy reference planner and by ``check=True``'s search for the first offending batch row, which
recomputes on the host, from the step's inputs, what the device flagged (the status word only has bits).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np


@dataclass
class RowChecks:
    """Per-row facts shared by the planner and ``check()``'s search for the first offending row."""

    active: np.ndarray
    bad_req_pool_index: np.ndarray
    bad_prefix_len: np.ndarray
    bad_valid_len: np.ndarray
    bad_extend_len: np.ndarray

    @property
    def good(self) -> np.ndarray:
        """Rows whose prefix can be trusted: they give verify entries and a seed."""
        return self.active & ~self.bad_req_pool_index & ~self.bad_prefix_len & ~self.bad_extend_len


def extend_too_long(prefix, ext, max_seq_len: int) -> np.ndarray:
    """SPEC 3.4 bit 32: ``E > 0`` and ``min(max(P, 0), max_seq_len) + E > max_seq_len``.

    Compared as ``E > max_seq_len - clamped P``: both sides stay in int64 whatever the garbage in ``P`` and ``E``
    (``E = 2**62`` is flagged, never wrapped).
    """
    room = max_seq_len - np.clip(prefix, 0, max_seq_len)
    return (ext > 0) & (ext > room)


def row_checks(rpi, prefix, ext, valid_lens, *, rp_bound, max_seq_len, pool_cols,
               padding_rows_carry_tokens: bool = False, pool_indices=None, pool_rows: int = 0, row_len=None,
               bad_key=None) -> RowChecks:
    """The checks of every batch row. An active row's ``E < 0`` is flagged 32 too (its lengths cannot be trusted).
    With ``padding_rows_carry_tokens``, a padding row's ``E`` is trusted (it counts in ``write_offsets``), so it is
    checked too, as a row with ``P = 0`` (its ``P`` is never read), and a negative one is silent (it carries nothing).

    ``pool_indices`` (``expected_token_pool_indices``, SPEC 3.2): the pool row of each batch row, checked against
    ``pool_rows`` under the same bit as ``rp``, whose own bound ``rp_bound`` is then ``max_reqs`` alone.
    A page list (SPEC 3.8): ``row_len``, each row's positions, replaces ``max_seq_len`` in an active row's checks
    (padding rows keep ``max_seq_len``), and ``bad_key``, its ``kv_indptr`` pair out of order or range, joins bit 2."""
    active = rpi != 0
    bad_rp = active & ((rpi < 0) | (rpi >= rp_bound))
    if pool_indices is not None:
        bad_rp |= active & ((pool_indices < 0) | (pool_indices >= pool_rows))
    if bad_key is not None:
        bad_rp |= bad_key
    cap = max_seq_len if row_len is None else row_len
    bad_p = active & ((prefix < 0) | (prefix > cap))
    bad_vl = active & (valid_lens > pool_cols) if valid_lens is not None else np.zeros_like(active)
    # A negative E on an active row joins bit 32: its lengths cannot be trusted (a padding row's stays silent).
    bad_e = active & ((ext < 0) | extend_too_long(prefix, ext, cap))
    if padding_rows_carry_tokens:
        bad_e |= ~active & extend_too_long(np.zeros_like(ext), ext, max_seq_len)
    return RowChecks(active, bad_rp, bad_p, bad_vl, bad_e)


def bad_slot_rows(checks: RowChecks, rpi, prefix, ext, *, window: int, lut_len: int, verify_ran: bool,
                  read_row: Callable[[int, int, int], np.ndarray]) -> np.ndarray:
    """Rows that set ``BAD_SLOT`` (SPEC 3.4): a slot of theirs that the LUT is asked to translate is outside it, or
    (a block table or page list, SPEC 3.8) whose block entry is negative.

    ``verify_ran``: whether the plan built its verify entries (no ``OVERFLOW`` and no row-level bit), so that each
    good row's window slots and their predecessors were translated; seeds are translated in every plan.
    ``read_row(r, lo, hi)`` returns the raw slots of batch row ``r`` at positions ``lo:hi`` on the host
    (``req_to_token[rpi[r], lo:hi]``; a bad block entry as a value ``>= lut_len``). Only good rows are read (their
    request index and prefix are in range), and only the columns the plan itself read.
    """
    bad = np.zeros(checks.active.shape, dtype=bool)
    for r in np.flatnonzero(checks.good):
        p, e = int(prefix[r]), int(ext[r])
        if p <= 0:
            continue  # no window, no predecessor, no seed
        if verify_ran:
            start = max(p - window, 0) if window > 0 else 0
            lo = max(start - 1, 0)  # the first entry's predecessor; the seed (column p - 1) is inside too
        elif e > 0:
            lo = p - 1  # the seed alone
        else:
            continue
        values = np.asarray(read_row(int(r), lo, p))
        bad[r] = bool((values >= lut_len).any())  # negatives pass the LUT untranslated
    return bad


def first_bad_row(checks: RowChecks, bad_slot: np.ndarray | None = None) -> int | None:
    """The first batch row flagged by a per-row check (``bad_slot``: :func:`bad_slot_rows`), or ``None``."""
    flagged = checks.bad_req_pool_index | checks.bad_prefix_len | checks.bad_valid_len | checks.bad_extend_len
    if bad_slot is not None:
        flagged = flagged | bad_slot
    bad = np.flatnonzero(flagged)
    return int(bad[0]) if bad.size else None
