"""The per-row rules of SPEC 3.4 on host arrays: which batch rows are active, and which are flagged.

Shared by the NumPy reference planner and by ``check()``'s search for the first offending batch row.
"""
from __future__ import annotations

from dataclasses import dataclass

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
               padding_rows_carry_tokens: bool = False) -> RowChecks:
    """The checks of every batch row. With ``padding_rows_carry_tokens``, a padding row's ``E`` is trusted
    (it counts in ``write_offsets``), so it is checked too, as a row with ``P = 0`` (its ``P`` is never read)."""
    active = rpi != 0
    bad_rp = active & ((rpi < 0) | (rpi >= rp_bound))
    bad_p = active & ((prefix < 0) | (prefix > max_seq_len))
    bad_vl = active & (valid_lens > pool_cols) if valid_lens is not None else np.zeros_like(active)
    bad_e = active & extend_too_long(prefix, ext, max_seq_len)
    if padding_rows_carry_tokens:
        bad_e |= ~active & extend_too_long(np.zeros_like(ext), ext, max_seq_len)
    return RowChecks(active, bad_rp, bad_p, bad_vl, bad_e)


def first_bad_row(checks: RowChecks) -> int | None:
    """The first batch row flagged by a per-row check, or ``None``."""
    bad = np.flatnonzero(checks.bad_req_pool_index | checks.bad_prefix_len | checks.bad_valid_len
                         | checks.bad_extend_len)
    return int(bad[0]) if bad.size else None
