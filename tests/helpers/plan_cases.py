"""Plan cases as plain data, and one runner that plays them on any backend and array library.

Shared by the reference tests (CPU) and the GPU backend test matrix. Import it from any file under
``tests/`` (pytest puts ``tests/`` on ``sys.path``)::

    from helpers.plan_cases import POISON, hand_cases, random_case, run_case, expected_outputs, assert_same

    @pytest.mark.gpu
    @pytest.mark.parametrize("case", hand_cases(), ids=lambda c: c.name)
    def test_cupy_matches_reference(case):
        got = run_case(case, backend="cupy", xp="cupy")          # or backend="numba", xp="numba"/"torch_cuda"
        assert_same(got, expected_outputs(case))                 # byte for byte, untouched regions included

The pieces:

- :class:`PlanCase`: every input of one plan as NumPy arrays (``req_to_token`` int32 2-D, possibly a strided
  view whose row stride exceeds its width; ``lut`` int64 or None; ``pool`` int32 2-D or None; the ``[bs]``
  int64 step arrays; ``valid_lens`` int64 iff ``pool`` is given), the capacities, and a ``name``.
  ``expect_status`` (hand cases only) is the status the case was built to produce.
- :func:`hand_cases`: named cases covering every rule of SPEC 3.2-3.4 (boundaries, padding rows in both
  conventions of ``padding_rows_carry_tokens``, SWA, seeds, expected-token edges, each status bit, bs = 0, 1
  and 5000). :func:`hand_case` picks one by name.
- :func:`random_case`: a random case from a ``numpy.random.Generator``, an int seed, or a Hypothesis
  ``draw`` (inside ``@st.composite``; structure is drawn so Hypothesis shrinks it, bulk slot values come
  from a drawn seed). Knobs: batch size range, SWA, LUT, pool (keyed by rp or apart), token offsets, padding fraction, fault
  probability (bad rp / P / E / valid_len / slot), capacity tightness, strided ``req_to_token``.
- :func:`plan_cases` wraps it as a Hypothesis strategy.
- The index forms (SPEC 3.8): a case's ``form`` is ``"req_to_token"`` (default), ``"block_table"`` or
  ``"page_list"``; a paged case carries its ``block_table`` or ``kv_indptr`` / ``kv_indices`` and ``page_size``,
  and its ``req_to_token`` is the token table they stand for (shapes, the oracle's reading of the rules).
  ``tests/helpers/index_forms.py`` builds the paged twins of a case and the bad-entry cases.
- :func:`run_case`: converts the case to an array library (``xp`` = ``"numpy"``, ``"torch"`` (CPU),
  ``"cupy"``, ``"torch_cuda"``, ``"numba"``; the last three put every array on the current CUDA device, and
  keep ``req_to_token``'s row stride), fills the 10 output buffers with the ``poison`` pattern, runs the
  plan through :class:`canary.CanaryPlanner` (``api="planner"``) or :func:`canary.launch_canary_plan_kernels`
  (``api="launch"``), and returns the 10 buffers as NumPy arrays (dict keyed by :data:`OUTPUTS`).
- :func:`expected_outputs`: the same dict computed by the NumPy reference (``plan_arrays``) on poisoned
  NumPy buffers: what every backend must reproduce byte for byte.
- :func:`assert_same`: byte-for-byte comparison of two such dicts, failing with the first differing index of
  every differing buffer.

The poison (:data:`POISON`: int64 ``0x5A5A5A5A5A5A5A5A``, int32 ``0x5A5A5A5A``) marks regions a plan must
leave untouched; :data:`POISON_ALT` is a second pattern (negative values) to catch a backend that writes a
constant which happens to equal the first.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

OUTPUTS = (
    "verify_slot_indices", "verify_expected_tokens", "verify_expected_positions", "verify_prev_slot_indices",
    "verify_num_valid", "enable", "status", "write_offsets", "write_seed_slot_indices", "write_num_valid_reqs",
)
VERIFY_FIELDS = OUTPUTS[:7]
WRITE_FIELDS = OUTPUTS[7:]
# The planner's state, read and advanced by a sampled step (SPEC 3.7): compared like an output, but it starts
# from the case's ``cursors``, not from the poison.
STATE = ("verify_cursors",)
BUFFERS = OUTPUTS + STATE
_INT32_OUTPUTS = ("verify_num_valid", "enable", "status", "write_num_valid_reqs")

# Bits of the status word (SPEC 3.4), repeated here as plain ints so that cases stay plain data.
OVERFLOW, BAD_REQ_POOL_INDEX, BAD_PREFIX_LEN, BAD_SLOT, BAD_VALID_LEN, BAD_EXTEND_LEN, SAMPLED = 1, 2, 4, 8, 16, 32, 64
SKIP_SEED = -(1 << 63)  # the write seed of a padding row that carries tokens (canary.SKIP_SEED)


@dataclass(frozen=True)
class Poison:
    """Fill values for output buffers before a run (``i64`` for the int64 buffers, ``i32`` for the int32 ones)."""

    i64: int
    i32: int


POISON = Poison(i64=0x5A5A5A5A5A5A5A5A, i32=0x5A5A5A5A)
POISON_ALT = Poison(i64=-0x2B2B2B2B2B2B2B2C, i32=-0x2B2B2B2C)

# Written into the columns of a strided req_to_token beyond its width: far outside any LUT, so that a backend
# reading past the row shows up as a wrong slot (or a BAD_SLOT bit).
STRIDE_JUNK = 0x7EADBEEF


@dataclass(eq=False)
class PlanCase:
    """All inputs of one plan, as NumPy arrays (see the module docstring)."""

    name: str
    req_to_token: np.ndarray  # [max_reqs, max_seq_len] int32, row stride >= max_seq_len
    req_pool_indices: np.ndarray  # [bs] int64
    prefix_lens: np.ndarray  # [bs] int64
    extend_seq_lens: np.ndarray  # [bs] int64
    verify_capacity: int
    write_req_capacity: int
    lut: np.ndarray | None = None  # [lut_len] int64
    pool: np.ndarray | None = None  # [pool_rows, pool_cols] int32
    valid_lens: np.ndarray | None = None  # [bs] int64, iff pool is given
    pool_indices: np.ndarray | None = None  # [bs] int64 expected_token_pool_indices, only with a pool
    swa_window_size: int = 0
    token_offset: int = 0  # kv_token_id_vs_position_offset
    padding_rows_carry_tokens: bool = False  # planner option (SPEC 3.2): padding rows' E counts in write_offsets
    padding_slot: int = 0  # planner option (SPEC 3.2 "No reserved slot"): -1 when slot 0 is real
    max_batch_size: int | None = None  # planner option (None: write_req_capacity)
    on_overflow: str = "sample"  # planner option (SPEC 3.7)
    cursors: np.ndarray | None = None  # [max_reqs] int64 rotation state before the plan (None: zeros)
    expect_status: int | None = None  # what a hand case was built to produce
    notes: str = ""
    # The index form the planner is bound with (SPEC 3.8); req_to_token is then the token table it stands for
    form: str = "req_to_token"  # or "block_table", "page_list"
    block_table: np.ndarray | None = None  # [max_reqs, max_blocks] int32
    kv_indptr: np.ndarray | None = None  # [>= bs + 1] int32 or int64
    kv_indices: np.ndarray | None = None  # [nnz] int32
    page_size: int = 1

    def __post_init__(self):
        r2t = self.req_to_token
        assert r2t.dtype == np.int32 and r2t.ndim == 2, (r2t.dtype, r2t.shape)
        assert r2t.strides[1] == 4 and (r2t.shape[0] <= 1 or r2t.strides[0] >= 4 * r2t.shape[1]), r2t.strides
        bs = self.req_pool_indices.shape[0]
        for a in (self.req_pool_indices, self.prefix_lens, self.extend_seq_lens):  # int32 or int64: SPEC 2 (*)
            assert a.dtype in WIDTHS and a.shape == (bs,), (a.dtype, a.shape)
        assert (self.pool is None) == (self.valid_lens is None)
        if self.pool is not None:
            assert self.pool.dtype == np.int32 and self.pool.ndim == 2
            assert self.valid_lens.dtype in WIDTHS and self.valid_lens.shape == (bs,)
        if self.pool_indices is not None:
            assert self.pool is not None
            assert self.pool_indices.dtype in WIDTHS and self.pool_indices.shape == (bs,)
        if self.lut is not None:
            assert self.lut.dtype == np.int64 and self.lut.ndim == 1
        assert self.swa_window_size == 0 or self.lut is not None
        assert self.verify_capacity >= 0 and self.write_req_capacity >= 0  # bs > R: a host-side error case
        assert self.on_overflow in ("sample", "skip")
        if self.cursors is not None:
            assert self.cursors.dtype == np.int64 and self.cursors.shape == (r2t.shape[0],)
        assert self.form in ("req_to_token", "block_table", "page_list"), self.form
        assert (self.block_table is not None) == (self.form == "block_table")
        assert (self.kv_indices is not None) == (self.kv_indptr is not None) == (self.form == "page_list")
        if self.form == "block_table":
            assert self.block_table.dtype in WIDTHS and self.block_table.ndim == 2
            assert self.block_table.shape[0] == r2t.shape[0]
        if self.form == "page_list":
            assert self.kv_indices.dtype in WIDTHS and self.kv_indices.ndim == 1
            assert self.kv_indptr.dtype in (np.int32, np.int64) and self.kv_indptr.shape[0] >= bs + 1

    @property
    def initial_cursors(self) -> np.ndarray:
        return np.zeros(self.max_reqs, np.int64) if self.cursors is None else self.cursors.copy()

    @property
    def bs(self) -> int:
        return int(self.req_pool_indices.shape[0])

    @property
    def max_reqs(self) -> int:
        return int(self.req_to_token.shape[0])

    @property
    def max_seq_len(self) -> int:
        return int(self.req_to_token.shape[1])

    def replace(self, **changes) -> "PlanCase":
        return dataclasses.replace(self, **changes)

    def index_kwargs(self, conv: Callable[[np.ndarray], Any] = lambda a: a) -> dict[str, Any]:
        """The index keywords of the case's form (SPEC 3.8)."""
        if self.form == "block_table":
            return dict(block_table=conv(self.block_table), page_size=self.page_size)
        if self.form == "page_list":
            return dict(kv_indptr=conv(self.kv_indptr), kv_indices=conv(self.kv_indices), page_size=self.page_size)
        return dict(req_to_token=conv(self.req_to_token))

    def static_kwargs(self, conv: Callable[[np.ndarray], Any] = lambda a: a) -> dict[str, Any]:
        """The static keyword arguments of ``CanaryPlanner`` / ``launch_canary_plan_kernels`` (no plans)."""
        return dict(
            **self.index_kwargs(conv),
            swa_window_size=self.swa_window_size,
            full_to_swa_index_mapping=None if self.lut is None else conv(self.lut),
            req_to_verify_expected_tokens=None if self.pool is None else conv(self.pool),
            kv_token_id_vs_position_offset=self.token_offset,
            padding_rows_carry_tokens=self.padding_rows_carry_tokens,
            on_overflow=self.on_overflow,
            padding_slot=self.padding_slot,
        )

    def step_kwargs(self, conv: Callable[[np.ndarray], Any] = lambda a: a) -> dict[str, Any]:
        """The per-step keyword arguments of ``CanaryPlanner.plan`` (``expected_token_pool_indices`` only when
        the case has them)."""
        kw = dict(
            req_pool_indices=conv(self.req_pool_indices),
            prefix_lens=conv(self.prefix_lens),
            extend_seq_lens=conv(self.extend_seq_lens),
            req_to_verify_expected_tokens_valid_lens=None if self.valid_lens is None else conv(self.valid_lens),
        )
        if self.pool_indices is not None:
            kw["expected_token_pool_indices"] = conv(self.pool_indices)
        return kw

    def describe(self) -> str:
        lines = [
            f"PlanCase {self.name!r}: bs={self.bs} C={self.verify_capacity} R={self.write_req_capacity} "
            f"W={self.swa_window_size} off={self.token_offset} carry={self.padding_rows_carry_tokens} "
            f"padding_slot={self.padding_slot} "
            f"on_overflow={self.on_overflow} form={self.form} page_size={self.page_size} "
            f"r2t={self.req_to_token.shape} "
            f"(row stride {self.req_to_token.strides[0] // 4}) lut={None if self.lut is None else self.lut.shape} "
            f"pool={None if self.pool is None else self.pool.shape}",
            f"  rp={self.req_pool_indices.tolist()[:32]}",
            f"  P ={self.prefix_lens.tolist()[:32]}",
            f"  E ={self.extend_seq_lens.tolist()[:32]}",
        ]
        if self.valid_lens is not None:
            lines.append(f"  vl={self.valid_lens.tolist()[:32]}")
        if self.cursors is not None:
            lines.append(f"  cursors={self.cursors.tolist()[:32]}")
        if self.pool_indices is not None:
            lines.append(f"  q ={self.pool_indices.tolist()[:32]}")
        if self.block_table is not None:
            lines.append(f"  block_table={self.block_table.tolist()[:8]}")
        if self.kv_indptr is not None:
            lines.append(f"  kv_indptr={self.kv_indptr.tolist()[:33]} kv_indices={self.kv_indices.tolist()[:64]}")
        return "\n".join(lines)

    __repr__ = describe


# --------------------------------------------------------------------------------------------------------------
# Building blocks


def _i64(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int64).reshape(-1)


def strided(arr: np.ndarray, pad: int, junk: int = STRIDE_JUNK) -> np.ndarray:
    """A view of a copy of 2-D ``arr`` whose row stride is ``pad`` elements more than its width."""
    rows, cols = arr.shape
    base = np.full((rows, cols + pad), junk, dtype=arr.dtype)
    base[:, :cols] = arr
    return base[:, :cols]


def std_r2t(max_reqs: int = 6, max_seq_len: int = 8, pad: int = 3) -> np.ndarray:
    """The hand cases' ``req_to_token``: ``r2t[rp, p] = 100 * rp + p + 1`` for ``rp >= 1``; row 0 all zeros.

    ``pad > 0`` gives a strided view (row stride ``max_seq_len + pad``, junk beyond the width).
    """
    rp = np.arange(max_reqs, dtype=np.int64)[:, None]
    p = np.arange(max_seq_len, dtype=np.int64)[None, :]
    a = np.where(rp == 0, 0, 100 * rp + p + 1).astype(np.int32)
    return strided(a, pad) if pad else a


def std_lut(lut_len: int = 1000, base: int = 10_000) -> np.ndarray:
    """The hand cases' LUT: ``lut[x] = base + x`` (slot 204 -> 10204)."""
    return base + np.arange(lut_len, dtype=np.int64)


def std_pool(pool_rows: int = 6, pool_cols: int = 8) -> np.ndarray:
    """The hand cases' expected-token pool: ``pool[rp, c] = 50_000 + 100 * rp + c`` (rp 2, col 3 -> 50203)."""
    rp = np.arange(pool_rows, dtype=np.int64)[:, None]
    c = np.arange(pool_cols, dtype=np.int64)[None, :]
    return (50_000 + 100 * rp + c).astype(np.int32)


def _with(a: np.ndarray, updates: dict[tuple[int, int], int]) -> np.ndarray:
    """Copy of a (possibly strided) 2-D view with some elements changed, keeping the row stride."""
    pad = a.strides[0] // a.itemsize - a.shape[1] if a.shape[0] > 1 else 0
    out = strided(np.ascontiguousarray(a), pad) if pad > 0 else a.copy()
    for (i, j), v in updates.items():
        out[i, j] = v
    return out


def _lut_without(*freed: int) -> np.ndarray:
    """:func:`std_lut` with the mappings of the raw slots ``freed`` cleared (their SWA pages freed)."""
    lut = std_lut()
    lut[list(freed)] = 0
    return lut


def make_case(
    name: str,
    rows: Sequence[tuple],
    *,
    r2t: np.ndarray | None = None,
    lut: np.ndarray | None | bool = None,
    pool: np.ndarray | None | bool = None,
    W: int = 0,
    off: int = 0,
    C: int | None = None,
    R: int | None = None,
    max_batch_size: int | None = None,
    carry: bool = False,
    on_overflow: str = "sample",
    cursors: Sequence[int] | None = None,
    expect_status: int | None = 0,
    notes: str = "",
) -> PlanCase:
    """A case from ``rows`` = ``(rp, P, E)``, ``(rp, P, E, valid_len)`` or ``(rp, P, E, valid_len, q)`` tuples
    (``q``: ``expected_token_pool_indices``, given when any row has one; a row without one reads ``q = rp``).

    Defaults: :func:`std_r2t`; ``lut=True`` / ``pool=True`` take :func:`std_lut` / :func:`std_pool`; ``C``
    defaults to the exact number of verify entries (rows with a bad rp or P counted as 0), ``R`` to bs + 2
    (so that the untouched seed tail and the zeroed offsets tail are visible). ``carry``: the planner's
    ``padding_rows_carry_tokens``.
    """
    r2t = std_r2t() if r2t is None else r2t
    lut = std_lut() if lut is True else (None if lut is False else lut)
    if W > 0 and lut is None:
        lut = std_lut()
    pool = std_pool() if pool is True else (None if pool is False else pool)
    rows = [tuple(r) for r in rows]
    rpi = _i64([r[0] for r in rows])
    P = _i64([r[1] for r in rows])
    E = _i64([r[2] for r in rows])
    vl = q = None
    if pool is not None:
        vl = _i64([r[3] if len(r) > 3 else pool.shape[1] for r in rows])
        if any(len(r) > 4 for r in rows):
            q = _i64([r[4] if len(r) > 4 else r[0] for r in rows])
    if C is None:
        C = count_entries(rpi, P, W, r2t.shape, None if pool is None else pool.shape[0], E=E, q=q)
    if int(C) == 0:
        on_overflow = "skip"  # a planner that samples needs C >= 1 (SPEC 3.3)
    return PlanCase(
        name=name, req_to_token=r2t, req_pool_indices=rpi, prefix_lens=P, extend_seq_lens=E,
        verify_capacity=int(C), write_req_capacity=int(len(rows) + 2 if R is None else R),
        lut=lut, pool=pool, valid_lens=vl, pool_indices=q, swa_window_size=W, token_offset=off,
        max_batch_size=max_batch_size, padding_rows_carry_tokens=carry, on_overflow=on_overflow,
        cursors=None if cursors is None else _i64(cursors), expect_status=expect_status, notes=notes,
    )


def count_entries(rpi, P, W, r2t_shape, pool_rows=None, *, E=None, q=None) -> int:
    """Number of verify entries (``total``): rows that are active with a valid rp and P (and, when ``E`` is
    given, a new-token count >= 0 that fits the row: SPEC 3.4 bit 32), window-clipped. ``q``: the pool rows
    (``expected_token_pool_indices``); ``None``: the pool is keyed by ``rp``."""
    max_reqs, max_seq_len = r2t_shape
    bound = max_reqs if pool_rows is None or q is not None else min(max_reqs, pool_rows)
    total = 0
    E = [0] * len(np.asarray(rpi)) if E is None else np.asarray(E).tolist()
    Q = np.asarray(rpi if q is None else q).tolist()
    for rp, p, e, qr in zip(np.asarray(rpi).tolist(), np.asarray(P).tolist(), E, Q):
        if rp == 0 or rp < 0 or rp >= bound or p < 0 or p > max_seq_len:
            continue
        if q is not None and pool_rows is not None and not 0 <= qr < pool_rows:
            continue
        if e < 0 or (e > 0 and min(max(p, 0), max_seq_len) + e > max_seq_len):
            continue
        total += p - (max(0, p - W) if W > 0 else 0)
    return total


# --------------------------------------------------------------------------------------------------------------
# Hand cases

HUGE = 1 << 62


def hand_cases() -> list[PlanCase]:
    """Named cases covering every rule of SPEC 3.2-3.4 (see each case's ``name`` and ``notes``)."""
    cases: list[PlanCase] = []
    add = cases.append
    S, B = 0, BAD_SLOT

    # ---- batch sizes and basic rows
    add(make_case("bs0", [], C=4, R=3, notes="empty batch: offsets all 0, num_valid 0, enable 1"))
    add(make_case("bs0_R0_C0", [], C=0, R=0))
    add(make_case("bs1_decode", [(1, 3, 1)], notes="entries p=0,1,2 of row 1; seed r2t[1,2]"))
    add(make_case("bs1_prefill_p0", [(2, 0, 5)], C=2, notes="P=0: no entries, seed -1, offsets [0,5]"))
    add(make_case("p1", [(1, 1, 1)], notes="one entry at p=0, prev -1"))
    add(make_case("p_full_row", [(3, 8, 0)], notes="P = max_seq_len: the last column is read (E must be 0: the "
                                                   "row has no room left)"))
    add(make_case("contiguous_r2t", [(1, 4, 2), (2, 2, 1)], r2t=std_r2t(pad=0)))
    add(make_case("duplicate_rp", [(2, 3, 1), (2, 5, 1)], notes="two batch rows on the same req_to_token row"))
    add(make_case("R_equals_bs", [(1, 2, 1), (2, 1, 3)], R=2))
    add(make_case("max_batch_size_bigger", [(1, 2, 1)], R=4, max_batch_size=3))
    add(make_case("e_zero", [(1, 3, 0), (2, 2, 0), (3, 1, 2)], notes="E = 0: wlen 0 and seed -1"))
    add(make_case("seeds_mixed", [(1, 0, 3), (2, 4, 1), (3, 2, 0), (4, 1, 1), (5, 7, 0)]))

    # ---- SWA windows (W = 3)
    add(make_case("swa_p_lt_w", [(1, 2, 1)], W=3, notes="window_start 0"))
    add(make_case("swa_p_eq_w", [(1, 3, 1)], W=3, notes="window_start 0, first prev -1"))
    add(make_case("swa_p_eq_w_plus_1", [(1, 4, 1)], W=3, notes="window starts at p=1; its prev is T(r2t[rp,0])"))
    add(make_case("swa_p_full", [(2, 8, 2), (1, 0, 1), (3, 5, 1)], W=3, r2t=std_r2t(max_seq_len=10),
                  notes="max_seq_len 10: room for the first row's 2 new tokens"))
    add(make_case("swa_w1", [(1, 5, 1), (2, 1, 1)], W=1, notes="only p=P-1, prev T(r2t[rp,P-2])"))
    add(make_case("swa_w_huge", [(1, 5, 1)], W=100, notes="window larger than the row"))
    add(make_case("lut_without_swa", [(1, 3, 1), (2, 2, 2)], lut=True, notes="W=0 with a LUT: still translated"))
    add(make_case("lut_big_values", [(1, 3, 1)], lut=std_lut(base=(1 << 40) + 7), W=2,
                  notes="translated slots above 2^31"))

    # ---- SWA mappings cleared (an SWA page freed): MISSING_SLOT for a position the window needs (SPEC 3.2)
    lut_freed = _lut_without(103, 105, 203)  # rp 1: p=2 (outside a window of 3 at P=6) and p=4; rp 2: p=2
    add(make_case("swa_missing_in_window", [(1, 6, 1), (2, 4, 1)], lut=lut_freed, W=3,
                  notes="rp 1 p=4: MISSING_SLOT, p=5's prev stays 0 and the window head's prev T(r2t[1,2]) = 0 "
                        "(outside: not reported); rp 2 p=2: MISSING_SLOT"))
    add(make_case("swa_missing_just_outside", [(1, 5, 1)], lut=_lut_without(102), W=3,
                  notes="window [2,5): r2t[1,1] maps to 0, read only as the window head's prev: unchanged"))
    add(make_case("swa_missing_seed", [(1, 6, 2), (3, 2, 1)], lut=_lut_without(106, 301), W=3,
                  notes="the last window entry is MISSING_SLOT, the seed T(r2t[1,5]) stays 0; rp 3 p=0 too"))
    add(make_case("swa_missing_raw_zero", [(1, 6, 1), (0, 3, 1)], r2t=_with(std_r2t(), {(1, 4): 0}),
                  lut=_lut_without(0), W=3, notes="a raw 0 in an active row's window: no real slot, MISSING_SLOT too; the "
                        "padding row reads nothing"))
    add(make_case("swa_missing_lut_without_swa", [(1, 3, 1)], lut=_lut_without(102), notes="W = 0 with a LUT: "
                  "every position is needed, p=1 is MISSING_SLOT"))
    add(make_case("swa_missing_no_lut", [(1, 4, 1)], r2t=_with(std_r2t(), {(1, 2): 0, (1, 3): 0}),
                  notes="no LUT: a raw 0 inside the window is MISSING_SLOT (p=2, 3); p=3's and p=4's prevs keep 0"))
    add(make_case("swa_missing_overflow", [(1, 6, 1)], lut=lut_freed, W=3, C=2, expect_status=OVERFLOW,
                  notes="entries not written, nothing else changes"))

    # ---- capacity boundaries
    rows = [(1, 3, 1), (2, 2, 1)]  # total 5
    add(make_case("cap_exact", rows, C=5))
    add(make_case("cap_one_spare", rows, C=6, notes="entry 5 untouched"))
    add(make_case("cap_overflow_by_one", rows, C=4, expect_status=OVERFLOW,
                  notes="total 5 > C 4: entries untouched, num_valid 4, enable 0"))
    add(make_case("cap_zero_total_zero", [(1, 0, 1), (0, 9, 9)], C=0))
    add(make_case("cap_zero_overflow", [(1, 1, 1)], C=0, expect_status=OVERFLOW))
    add(make_case("swa_cap_overflow", [(1, 8, 0), (2, 8, 0)], W=3, C=5, expect_status=OVERFLOW))

    # ---- padding rows (rp == 0) with garbage P/E/valid_len
    add(make_case("padding_garbage", [(1, 2, 1), (0, HUGE, HUGE), (0, -5, -HUGE), (2, 1, 2), (0, 3, 7)],
                  notes="inactive rows: no entries, wlen 0, seed -1, no status bits"))
    add(make_case("padding_only", [(0, 4, 1), (0, -1, 1)]))
    add(make_case("padding_garbage_swa", [(0, -HUGE, 1), (1, 4, 1), (0, HUGE, -1)], W=2))
    add(make_case("padding_garbage_valid_len", [(0, 3, 1, 1 << 40), (1, 2, 1, 8), (0, -7, 2, -3)], pool=True,
                  notes="valid_len of inactive rows is never read: no BAD_VALID_LEN"))

    # ---- raw slot values
    r2t_neg = _with(std_r2t(), {(1, 0): -1, (1, 2): -7, (2, 1): -123456, (3, 0): 0})
    add(make_case("negative_raw_slots_lut", [(1, 3, 1), (2, 2, 1), (3, 1, 1)], r2t=r2t_neg, lut=True,
                  notes="negative raw slots pass the LUT unchanged (also as prev and seed); slot 0 -> lut[0]"))
    add(make_case("negative_raw_slots_nolut", [(1, 3, 1), (2, 2, 1), (3, 1, 1)], r2t=r2t_neg))
    add(make_case("negative_raw_slots_swa", [(1, 3, 1), (2, 3, 1)], r2t=r2t_neg, W=2))
    add(make_case("nolut_huge_slots", [(1, 2, 1)], r2t=_with(std_r2t(), {(1, 0): 2**31 - 1, (1, 1): 999_999}),
                  notes="no LUT: identity, no range check"))

    # ---- expected tokens
    add(make_case("expected_off0", [(1, 4, 1, 8), (2, 3, 1, 2)], pool=True))
    add(make_case("expected_off_plus1", [(1, 4, 1, 8), (2, 3, 1, 3)], pool=True, off=1,
                  notes="EAGLE: pool[rp, p+1]; p+1 == valid_len -> -1"))
    add(make_case("expected_off_minus1", [(1, 3, 1, 8)], pool=True, off=-1, notes="p=0 -> col -1 -> -1"))
    add(make_case("expected_valid_len0", [(1, 3, 1, 0)], pool=True))
    add(make_case("expected_valid_len_negative", [(1, 3, 1, -2)], pool=True))
    add(make_case("expected_valid_len_eq_cols", [(1, 8, 0, 8), (2, 8, 0, 8)], pool=True, off=0))
    add(make_case("expected_narrow_pool", [(1, 7, 1, 5), (2, 3, 1, 5)], pool=std_pool(6, 5),
                  notes="p+off >= pool_cols: -1"))
    add(make_case("expected_narrow_pool_off1", [(1, 7, 1, 5)], pool=std_pool(6, 5), off=1))
    add(make_case("expected_huge_offset", [(1, 3, 1, 8)], pool=True, off=1 << 40))
    add(make_case("expected_huge_negative_offset", [(1, 3, 1, 8)], pool=True, off=-(1 << 40)))
    add(make_case("expected_pool_zero_cols", [(1, 3, 1, 0), (2, 1, 1, -1)], pool=std_pool(6, 0),
                  notes="a pool with no columns: every expected token is -1, nothing read"))
    add(make_case("expected_swa", [(1, 6, 1, 6), (2, 5, 1, 4)], pool=True, W=3, off=1))
    add(make_case("expected_valid_len_int64_min", [(1, 8, 0, -(1 << 63)), (5, 8, 0, 8)], pool=True, off=1,
                  notes="an active row's valid_len of INT64_MIN with offset +1: no token valid, no wrap, no read"))
    add(make_case("expected_strided_pool", [(1, 4, 1, 6), (2, 2, 1, 8)], pool=strided(std_pool(), 5)))

    # ---- expected-token pool keyed apart from rp (expected_token_pool_indices q, SPEC 3.2): pool rows 4
    pool4 = std_pool(4, 8)
    Q = BAD_REQ_POOL_INDEX
    add(make_case("pool_q_by_identity", [(1, 4, 1, 8, 3), (2, 3, 1, 3, 0), (5, 2, 2, 8, 1), (3, 2, 1, 8, 3)],
                  pool=pool4, notes="q differs from rp: pool[q, p]; q = 0 is a pool row like any other; rp 5 >= "
                                    "pool_rows is no fault when the pool is keyed apart; two rows share q = 3"))
    add(make_case("pool_q_equals_rp", [(1, 4, 1, 8, 1), (3, 2, 2, 5, 3)], pool=pool4, off=1,
                  notes="q = rp: the plan of the same rows without q"))
    add(make_case("pool_q_last_row", [(2, 3, 1, 8, 3)], pool=pool4, notes="q = pool_rows - 1: in range"))
    add(make_case("pool_q_minus_one", [(1, 2, 1, 8, 2), (2, 3, 1, 8, -1)], pool=pool4, expect_status=Q,
                  notes="q = -1 (out of range by one below): bit 2, no entries, seed -1 for that row"))
    add(make_case("pool_q_eq_pool_rows", [(2, 3, 1, 8, 4), (1, 2, 1, 8, 0)], pool=pool4, expect_status=Q,
                  notes="q = pool_rows (out of range by one above): bit 2"))
    add(make_case("pool_q_huge", [(1, 2, 1, 8, HUGE), (2, 1, 1, 8, -HUGE)], pool=pool4, expect_status=Q))
    add(make_case("pool_q_rp_out_of_range", [(6, 2, 1, 8, 1), (1, 2, 1, 8, 1)], pool=pool4, expect_status=Q,
                  notes="rp = max_reqs with a valid q: still bit 2 (rp < max_reqs)"))
    add(make_case("pool_q_padding_ignored", [(0, 3, 1, 8, -1), (1, 3, 1, 8, 2), (0, HUGE, 2, -5, HUGE)],
                  pool=pool4, notes="padding rows never read q: no bit"))
    add(make_case("pool_q_padding_tokens", [(0, 3, 2, 8, 99), (1, 3, 1, 8, 2), (0, 1, 1, 1 << 40, -7)],
                  pool=pool4, carry=True, notes="padding rows carrying tokens: SKIP seeds, q still never read"))
    add(make_case("pool_q_swa_off1", [(1, 6, 1, 6, 3), (2, 5, 1, 4, 0)], pool=pool4, W=3, off=1))
    add(make_case("pool_q_and_bad_valid_len", [(1, 3, 1, 9, 2), (2, 2, 1, 4, 5)], pool=pool4,
                  expect_status=BAD_VALID_LEN | Q))

    # ---- status bits
    add(make_case("bad_rp_negative", [(1, 2, 1), (-1, 3, 1), (2, 1, 1)], expect_status=BAD_REQ_POOL_INDEX,
                  notes="flagged row: 0 entries, seed -1; others' entries not written"))
    add(make_case("bad_rp_eq_max_reqs", [(6, 2, 1), (1, 1, 1)], expect_status=BAD_REQ_POOL_INDEX))
    add(make_case("bad_rp_huge", [(1, 1, 1), (HUGE, 2, 1)], expect_status=BAD_REQ_POOL_INDEX))
    add(make_case("bad_rp_ge_pool_rows", [(1, 2, 1, 4), (4, 2, 1, 4)], pool=std_pool(4, 8),
                  expect_status=BAD_REQ_POOL_INDEX, notes="rp 4 < max_reqs 6 but >= pool_rows 4"))
    add(make_case("bad_prefix_negative", [(1, 2, 1), (2, -1, 1)], expect_status=BAD_PREFIX_LEN))
    add(make_case("bad_prefix_gt_max_seq_len", [(1, 9, 0), (2, 2, 3)], expect_status=BAD_PREFIX_LEN))
    add(make_case("bad_prefix_huge_swa", [(1, HUGE, 1), (2, 2, 3)], W=3, expect_status=BAD_PREFIX_LEN | BAD_EXTEND_LEN,
                  notes="P clamped to max_seq_len leaves no room: E = 1 is flagged too"))
    add(make_case("bad_prefix_min_int64_swa", [(1, -(1 << 63), 1), (2, 4, 3)], W=3, expect_status=BAD_PREFIX_LEN))
    add(make_case("bad_rp_and_prefix", [(-3, -3, 1), (1, 100, 0), (2, 1, 1)],
                  expect_status=BAD_REQ_POOL_INDEX | BAD_PREFIX_LEN))
    add(make_case("bad_valid_len", [(1, 3, 2, 5), (2, 2, 1, 9)], pool=True, expect_status=BAD_VALID_LEN,
                  notes="valid_len 9 > pool_cols 8: entries not written, seeds written"))
    add(make_case("bad_valid_len_overflow", [(1, 3, 2, 5), (2, 2, 1, 9)], pool=True, C=4,
                  expect_status=BAD_VALID_LEN | OVERFLOW))
    add(make_case("overflow_and_bad_rp", [(1, 5, 1), (7, 2, 1), (2, 3, 1)], C=7,
                  expect_status=OVERFLOW | BAD_REQ_POOL_INDEX))

    lut_small = std_lut(lut_len=300)  # valid raw slots: 0..299 (rows 1 and 2 of std_r2t)
    r2t_bad = _with(std_r2t(), {(1, 1): 5000, (2, 3): 300, (2, 6): 777_777, (3, 0): -9})
    add(make_case("bad_slot_verify_entry", [(1, 3, 0), (2, 2, 1)], r2t=r2t_bad, lut=lut_small, expect_status=B,
                  notes="r2t[1,1] = 5000 >= lut_len 300: entry slot and next entry's prev -> -1"))
    add(make_case("bad_slot_eq_lut_len", [(2, 4, 0)], r2t=r2t_bad, lut=lut_small, expect_status=B,
                  notes="raw 300 == lut_len is out of range"))
    add(make_case("bad_slot_prev_only", [(1, 4, 0)], r2t=r2t_bad, lut=lut_small, W=2, expect_status=B,
                  notes="window [2,4): p=2's prev r2t[1,1] is bad; no bad entry slot"))
    add(make_case("bad_slot_not_read", [(1, 1, 1), (2, 3, 1)], r2t=r2t_bad, lut=lut_small, W=2, expect_status=S,
                  notes="bad values beyond P or before the predecessor are never read: no BAD_SLOT"))
    add(make_case("bad_slot_not_read_swa", [(2, 8, 0)], r2t=_with(r2t_bad, {(2, 6): 200}), lut=lut_small, W=1,
                  expect_status=S, notes="window [7,8): r2t[2,3]=300 is before the predecessor"))
    add(make_case("bad_slot_seed_only_overflow", [(1, 2, 1)], r2t=r2t_bad, lut=lut_small, C=1,
                  expect_status=OVERFLOW | B, notes="entries not written; the seed r2t[1,1] is still read"))
    add(make_case("bad_slot_seed_only_bad_valid_len", [(1, 2, 1, 3), (2, 1, 1, 20)], r2t=r2t_bad,
                  lut=lut_small, pool=True, expect_status=BAD_VALID_LEN | B))
    add(make_case("bad_slot_masked_by_bad_rp", [(1, 2, 0), (-2, 1, 1)], r2t=r2t_bad, lut=lut_small,
                  expect_status=BAD_REQ_POOL_INDEX,
                  notes="the bad slot would be read by a verify entry, but entries are not built: no bit 8"))
    add(make_case("bad_slot_seed_and_bad_rp", [(1, 2, 1), (-2, 1, 1)], r2t=r2t_bad, lut=lut_small,
                  expect_status=BAD_REQ_POOL_INDEX | B))
    add(make_case("bad_slot_negative_ok", [(3, 2, 1)], r2t=r2t_bad, lut=std_lut(400), expect_status=S,
                  notes="r2t[3,0] = -9 passes unchanged, no bit"))
    add(make_case("bad_slot_empty_lut", [(1, 2, 1), (0, 3, 1)], lut=np.zeros(0, np.int64), expect_status=B))
    add(make_case("bad_slot_overflow_no_seed", [(1, 3, 0), (2, 1, 0)], r2t=r2t_bad, lut=lut_small, C=2,
                  expect_status=OVERFLOW, notes="overflow: entries (and their bad slot) not read, E=0: no seed"))
    add(make_case("all_bits", [(1, 2, 1, 3), (9, 1, 1, 0), (2, 99, 1, 0), (3, 1, 1, 100), (1, 3, 1, 0)],
                  r2t=r2t_bad, lut=lut_small, pool=True, C=1,
                  expect_status=OVERFLOW | BAD_REQ_POOL_INDEX | BAD_PREFIX_LEN | BAD_SLOT | BAD_VALID_LEN
                  | BAD_EXTEND_LEN, notes="(2, 99, 1): P > max_seq_len leaves no room for E = 1"))

    # ---- extend lengths (bit 32): the new tokens must fit the row, max_seq_len 8
    X = BAD_EXTEND_LEN
    add(make_case("extend_fits_exactly", [(1, 5, 3), (2, 0, 8), (3, 7, 1)],
                  notes="P + E = max_seq_len: not flagged; seeds r2t[1,4], -1, r2t[3,6]"))
    add(make_case("extend_over_by_one", [(1, 5, 4), (2, 3, 1)], expect_status=X,
                  notes="5 + 4 = 9 > 8: no entries, wlen 0, seed -1; the other row's entries are not written, "
                        "its seed is"))
    add(make_case("extend_2_62_twice", [(1, 2, HUGE), (2, 1, HUGE), (3, 1, 2)], expect_status=X,
                  notes="summed, the two would wrap write_offsets to INT64_MIN; flagged, they count 0"))
    add(make_case("extend_int64_max", [(1, 0, (1 << 63) - 1), (2, 8, 0)], expect_status=X,
                  notes="E = INT64_MAX with P = 0: room 8, no wrap in the comparison"))
    add(make_case("extend_padding_not_flagged", [(0, 3, HUGE), (0, 9, (1 << 63) - 1), (1, 2, 1), (0, -HUGE, 9)],
                  notes="padding rows: E is never trusted, never flagged"))
    add(make_case("extend_e_zero_full_row", [(1, 8, 0), (3, 9, 0)],
                  expect_status=BAD_PREFIX_LEN, notes="E = 0 is never flagged, even with P > max_seq_len"))
    # A negative E on an active row: no row has a negative count of new tokens, so its lengths cannot be trusted
    # (bit 32: no entries, wlen 0, seed -1, enable 0; the other rows keep their offsets and seeds, entries unwritten).
    add(make_case("extend_negative_active", [(1, 3, 0), (2, 2, -4), (3, 1, 2)], expect_status=X,
                  notes="next to valid rows: offsets [0, 0, 0, 2], seeds [-1, -1, 301]; C counts rows 0 and 2 only"))
    add(make_case("extend_negative_one", [(1, 4, -1)], expect_status=X, notes="E = -1 alone: total 0"))
    add(make_case("extend_negative_int64_min", [(1, 2, 1), (2, 5, -(1 << 63)), (3, 1, 1)], expect_status=X,
                  notes="E = INT64_MIN: flagged, no wrap; offsets [0, 1, 1, 2], seeds [102, -1, 301]"))
    add(make_case("extend_negative_full_row", [(1, 8, 0), (2, 8, -HUGE), (3, 9, -1)],
                  expect_status=BAD_PREFIX_LEN | X, notes="row 1: bit 32 alone; row 2: bits 4 and 32"))
    add(make_case("extend_negative_bad_seed_not_read", [(1, 2, -1), (2, 1, 1)], r2t=r2t_bad, lut=lut_small,
                  expect_status=X, notes="the flagged row's r2t[1,1] = 5000 is outside the LUT but never read"))
    add(make_case("extend_negative_overflow", [(1, 4, -2), (2, 3, 1)], C=2, expect_status=OVERFLOW | X,
                  notes="the flagged row's 4 entries are not counted: total 3 > C 2"))
    add(make_case("extend_negative_excluded_from_total", [(1, 4, -2), (2, 3, 1)], C=3, expect_status=X,
                  notes="total 3 = C without the flagged row: no OVERFLOW; num_valid 3, entries untouched"))
    add(make_case("extend_negative_padding_silent", [(0, 3, -1), (1, 2, 1), (0, -HUGE, -(1 << 63)), (0, 9, -HUGE)],
                  notes="padding rows: a negative E is never trusted, never flagged"))
    add(make_case("extend_negative_padding_tokens_silent", [(0, 3, -1), (1, 2, 1), (0, 5, -(1 << 63))], carry=True,
                  notes="padding rows carrying tokens: E < 0 carries nothing (wlen 0, seed -1), no bit"))
    add(make_case("extend_negative_prefix_clamped_fits", [(1, -(1 << 63), 8), (2, 1, 1)], expect_status=BAD_PREFIX_LEN,
                  notes="P clamped to 0: 0 + 8 fits; only bit 4, and the row's E still counts"))
    add(make_case("extend_negative_prefix_clamped_over", [(1, -1, 9), (2, 1, 1)],
                  expect_status=BAD_PREFIX_LEN | X, notes="P clamped to 0: 0 + 9 > 8"))
    add(make_case("extend_prefix_over_max_seq_len", [(1, 9, 1), (2, 2, 3)], expect_status=BAD_PREFIX_LEN | X,
                  notes="P clamped to 8 leaves no room: both bits, wlen 0"))
    add(make_case("extend_and_bad_rp", [(-1, 2, 7), (1, 1, 1), (9, 1, 2)], expect_status=BAD_REQ_POOL_INDEX | X,
                  notes="bit 2 alone keeps wlen = E (row 2); with bit 32 too, wlen 0 (row 0)"))
    add(make_case("extend_overflow", [(1, 4, 5), (2, 3, 1)], C=2, expect_status=OVERFLOW | X,
                  notes="the flagged row gives no entries: total 3 > C 2"))
    add(make_case("extend_excluded_from_total", [(1, 4, 5), (2, 3, 1)], C=3, expect_status=X,
                  notes="total 3 = C without the flagged row's 4: no OVERFLOW; num_valid 3, entries untouched"))
    add(make_case("extend_and_bad_valid_len", [(1, 3, 6, 9), (2, 2, 1, 4), (3, 2, 7, 2)], pool=True,
                  expect_status=BAD_VALID_LEN | X))
    add(make_case("extend_bad_seed_not_read", [(1, 2, 7), (2, 1, 1)], r2t=r2t_bad, lut=lut_small, expect_status=X,
                  notes="the flagged row's seed r2t[1,1] = 5000 is outside the LUT but never read: no bit 8"))
    add(make_case("extend_bad_seed_read", [(1, 2, 6), (2, 8, 1)], r2t=r2t_bad, lut=lut_small,
                  expect_status=X | B, notes="row 0 fits (2 + 6 = 8): its seed r2t[1,1] is read and out of range"))
    add(make_case("extend_swa", [(1, 6, 3), (2, 4, 1), (3, 8, 0)], W=3, expect_status=X))
    add(make_case("extend_swa_fits", [(1, 6, 2), (2, 4, 4), (3, 8, 0)], W=3))

    # ---- padding rows that carry tokens (planner bound with padding_rows_carry_tokens, SPEC 3.2), first, in the
    # middle and last, and the same rows in SGLang's convention (the default): the write side differs
    first = [(0, 99, 2), (1, 3, 1), (2, 2, 2)]
    middle = [(1, 3, 1), (0, -5, 3), (2, 2, 2)]
    last = [(1, 3, 1), (2, 2, 2), (0, 7, 1), (0, 0, 4)]
    add(make_case("padding_first", first, notes="offsets [0, 0, 1, 3], seeds [-1, 103, 202]"))
    add(make_case("padding_middle", middle, notes="offsets [0, 1, 1, 3], seeds [103, -1, 202]"))
    add(make_case("padding_last", last, notes="offsets [0, 1, 3, 3, 3], seeds [103, 202, -1, -1]"))
    add(make_case("padding_tokens_first", first, carry=True,
                  notes="the padding row's 2 tokens come first: offsets [0, 2, 3, 5], seeds [SKIP, 103, 202]"))
    add(make_case("padding_tokens_middle", middle, carry=True,
                  notes="offsets [0, 1, 4, 6], seeds [103, SKIP, 202]; the padding row's P is never read"))
    add(make_case("padding_tokens_last", last, carry=True,
                  notes="offsets [0, 1, 3, 4, 8], seeds [103, 202, SKIP, SKIP]"))
    add(make_case("padding_tokens_e_nonpositive", [(0, 3, 0), (1, 2, 1), (0, 5, -3), (0, HUGE, -HUGE)], carry=True,
                  notes="a padding row with E <= 0 carries nothing: wlen 0, seed -1 (not SKIP)"))
    add(make_case("padding_tokens_e_max_seq_len", [(0, HUGE, 8), (1, 2, 1)], carry=True,
                  notes="E = max_seq_len fits (P is garbage and not read: taken as 0)"))
    add(make_case("padding_tokens_e_too_long", [(1, 2, 1), (0, 3, 9), (2, 1, 1), (0, -1, HUGE)], carry=True,
                  expect_status=BAD_EXTEND_LEN,
                  notes="no row holds 9 tokens: the padding row is flagged 32, wlen 0, seed -1"))
    add(make_case("padding_tokens_garbage_default", [(1, 2, 1), (0, 3, 9), (2, 1, 1), (0, -1, HUGE)],
                  notes="the same rows without carry: padding E is never read, nothing flagged"))
    add(make_case("padding_tokens_swa_pool", [(0, 4, 2, 1 << 40), (1, 6, 1, 8), (0, -1, 1, -9), (2, 5, 2, 3)],
                  W=3, pool=True, off=1, carry=True,
                  notes="padding rows' valid_len is never read (no bit 16); SKIP seeds bypass the LUT"))
    add(make_case("padding_tokens_lut_small", [(0, 1, 3), (1, 1, 1)], lut=std_lut(lut_len=150), carry=True,
                  notes="SKIP is never translated: no BAD_SLOT from a padding row"))
    add(make_case("padding_tokens_overflow", [(1, 4, 1), (0, 2, 3), (2, 3, 1)], C=5, carry=True,
                  expect_status=OVERFLOW, notes="the write side is built anyway, SKIP included"))
    add(make_case("padding_tokens_with_bad_rows", [(0, 1, 2), (-1, 2, 1), (1, 9, 1), (0, 1, 1), (2, 6, 3)],
                  carry=True, expect_status=BAD_REQ_POOL_INDEX | BAD_PREFIX_LEN | BAD_EXTEND_LEN,
                  notes="offsets [0, 2, 3, 3, 4, 4]: bit 2 keeps E, bits 4+32 and 32 drop it; padding rows carry"))
    add(make_case("padding_tokens_only", [(0, 1, 2), (0, 1, 1), (0, 0, 0)], carry=True))
    add(_big_batch("big_batch_4500_padding_tokens", 4500, seed=4500, carry=True))

    # ---- big batches
    add(_big_batch("big_batch_5000", 5000, seed=5000))
    add(_big_batch("big_batch_4097_swa_pool", 4097, seed=4097, W=5, pool=True, off=1))

    # Every overflow case above runs as SGLang's skip; its twin samples (SPEC 3.7). A twin whose sample reads an
    # entry the skip never reads sets that entry's bits too.
    read_by_sample = {"bad_slot_overflow_no_seed": BAD_SLOT}  # rp 1 takes its window's end, p=2: prev r2t[1,1] bad
    for c in list(cases):
        if c.expect_status is not None and c.expect_status & OVERFLOW:
            cases[cases.index(c)] = c.replace(on_overflow="skip")
            if c.verify_capacity > 0:
                add(c.replace(name=c.name + "_sampled",
                              expect_status=(c.expect_status & ~OVERFLOW) | SAMPLED | read_by_sample.get(c.name, 0),
                              notes="on_overflow='sample': " + c.notes))
    cases.extend(sampled_hand_cases())
    return cases


def sampled_hand_cases() -> list[PlanCase]:
    """SPEC 3.7: budgets from 1 entry to total - 1 on a few layouts, cursors inside, at the edge of and outside
    the windows, the request rotation (C < n), SWA, pools, a request row listed twice."""
    cases: list[PlanCase] = []
    S = SAMPLED
    r2t = std_r2t(max_reqs=6, max_seq_len=8)
    layouts = {
        "decode": [(1, 5, 1), (2, 3, 1), (3, 8, 0), (4, 1, 1)],  # total 17, n = 4
        "padding": [(0, 9, 9), (1, 4, 1), (0, -1, 2), (2, 6, 2), (3, 0, 1), (4, 2, 1)],  # total 12, n = 3
    }
    cursor_sets = {
        "zero": [0] * 6,
        "inside": [0, 3, 2, 7, 0, 1],
        "edge": [5, 4, 2, 0, 1, 0],  # row 1 at its last position, row 2 one past its window, head 5 (>= n)
        "garbage": [-(1 << 63), (1 << 63) - 1, -1, 1 << 40, 8, -(1 << 62)],
    }
    for lname, rows in layouts.items():
        total = count_entries(_i64([r[0] for r in rows]), _i64([r[1] for r in rows]), 0, r2t.shape)
        for C in range(1, total):
            for cname, cur in cursor_sets.items():
                if cname != "zero" and C not in (1, 2, 3, 4, total // 2, total - 1):
                    continue
                cases.append(make_case(f"sampled_{lname}_C{C}_{cname}", rows, r2t=r2t, C=C, cursors=cur,
                                       expect_status=S))
    lut_freed = _lut_without(103)
    cases += [
        make_case("sampled_swa_window_wrap", [(1, 8, 0), (2, 6, 1)], W=3, C=4, cursors=[0, 7, 4, 0, 0, 0],
                  expect_status=S, notes="windows [5, 8) and [3, 6): row 1 from 7 wraps to 5, keeping 4 as 5's "
                                         "predecessor"),
        make_case("sampled_swa_missing", [(1, 6, 1), (2, 7, 1)], lut=lut_freed, W=4, C=3, cursors=[0, 3, 0, 0, 0, 0],
                  expect_status=S, notes="position 3 of row 1 maps to 0 inside the window: MISSING_SLOT"),
        make_case("sampled_pool_offset", [(1, 6, 1, 4), (2, 7, 1, 8)], pool=True, off=1, C=5,
                  cursors=[0, 5, 2, 0, 0, 0], expect_status=S),
        make_case("sampled_lut_bad_slot", [(1, 4, 1), (2, 3, 1)], lut=std_lut(lut_len=120), C=3,
                  expect_status=S | BAD_SLOT, notes="slots r2t[1, *] = 10x; r2t[2, *] = 20x > lut_len"),
        make_case("sampled_duplicate_row", [(1, 6, 1), (1, 4, 1), (2, 5, 1)], C=6, cursors=[0, 2, 0, 0, 0, 0],
                  expect_status=S, notes="row 1 twice (an engine fault): the larger new cursor wins"),
        make_case("sampled_bad_rows_keep_cursors", [(1, 6, 1), (-1, 4, 1), (2, 5, 1)], C=3,
                  cursors=[0, 2, 3, 0, 0, 0], expect_status=S | BAD_REQ_POOL_INDEX,
                  notes="an untrusted row: no entries, the cursors stay"),
        make_case("sampled_rotation_wraps", [(1, 3, 1), (2, 3, 1), (3, 3, 1), (4, 3, 1), (5, 3, 1)], C=2,
                  cursors=[4, 0, 0, 0, 0, 0], expect_status=S, notes="C < n, head 4: ranks 4 and 0 take one each"),
        make_case("sampled_four_rows", [(1, 8, 0), (2, 7, 1), (3, 6, 1), (4, 5, 1)], C=9, max_batch_size=4,
                  cursors=[0, 6, 6, 1, 4, 0], expect_status=S),
    ]
    cases.append(_big_batch("big_batch_5000_sampled", 5000, seed=5001).replace(
        verify_capacity=777, expect_status=S, cursors=np.random.default_rng(7).integers(-3, 30, 301)))
    cases.append(_big_batch("big_batch_4097_swa_pool_sampled", 4097, seed=4098, W=5, pool=True, off=1).replace(
        verify_capacity=3001, expect_status=S))
    cases.append(_big_batch("big_batch_600_rotation", 600, seed=600).replace(verify_capacity=200, expect_status=S))
    return cases


def _big_batch(name: str, bs: int, *, seed: int, W: int = 0, pool: bool = False, off: int = 0,
               carry: bool = False) -> PlanCase:
    """More rows than SGLang's 4096 lanes: mixed decode/prefill/padding rows, exact capacity. ``carry``: the
    padding rows carry tokens (their E in [0, 5]), anywhere in the batch."""
    rng = np.random.default_rng(seed)
    max_reqs, max_seq_len = 301, 24
    r2t = strided(rng.integers(1, 1 << 20, size=(max_reqs, max_seq_len), dtype=np.int32), 2)
    lut = rng.integers(0, 1 << 40, size=1 << 20, dtype=np.int64) if W > 0 else None
    rpi = rng.integers(1, max_reqs, size=bs)
    rpi[rng.random(bs) < 0.1] = 0
    P = rng.integers(0, max_seq_len + 1, size=bs)
    E = np.minimum(rng.integers(-1, 6, size=bs), max_seq_len - P)  # the new tokens fit their row
    E[(rpi != 0) & (E < 0)] = 0  # a negative count is an active row's fault (bit 32); padding rows keep theirs
    P[rpi == 0] = rng.integers(-HUGE, HUGE, size=int((rpi == 0).sum()))
    if carry:
        E[rpi == 0] = rng.integers(0, 6, size=int((rpi == 0).sum()))
    pool_arr = vl = None
    if pool:
        pool_arr = rng.integers(0, 1 << 31, size=(max_reqs, max_seq_len), dtype=np.int32)
        vl = rng.integers(0, max_seq_len + 1, size=bs)
    C = count_entries(rpi, P, W, r2t.shape)
    return PlanCase(name=name, req_to_token=r2t, req_pool_indices=_i64(rpi), prefix_lens=_i64(P),
                    extend_seq_lens=_i64(E), verify_capacity=C, write_req_capacity=bs + 3, lut=lut,
                    pool=pool_arr, valid_lens=None if vl is None else _i64(vl), swa_window_size=W,
                    token_offset=off, padding_rows_carry_tokens=carry, expect_status=0)


def hand_case(name: str) -> PlanCase:
    for c in hand_cases():
        if c.name == name:
            return c
    raise KeyError(name)


# --------------------------------------------------------------------------------------------------------------
# Random cases


class _RngSource:
    """Choices from a NumPy Generator."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng

    def int(self, lo: int, hi: int) -> int:  # inclusive
        return int(self.rng.integers(lo, hi + 1))

    def chance(self, p: float) -> bool:
        return p > 0 and bool(self.rng.random() < p)

    def pick(self, seq: Sequence):
        return seq[self.int(0, len(seq) - 1)]

    def seed(self) -> int:
        return int(self.rng.integers(0, 2**32))


class _DrawSource(_RngSource):
    """Choices drawn from Hypothesis (so that they shrink: ints toward ``lo``, chances toward False)."""

    def __init__(self, draw):
        from hypothesis import strategies as st

        self.draw, self.st = draw, st

    def int(self, lo: int, hi: int) -> int:
        return int(self.draw(self.st.integers(lo, hi)))

    def chance(self, p: float) -> bool:
        if p <= 0:
            return False
        return self.draw(self.st.integers(0, 999)) >= 1000 - round(p * 1000)

    def seed(self) -> int:
        return self.int(0, 2**32 - 1)


def _source(src) -> _RngSource:
    if isinstance(src, _RngSource):
        return src
    if isinstance(src, np.random.Generator):
        return _RngSource(src)
    if src is None or isinstance(src, (int, np.integer)):
        return _RngSource(np.random.default_rng(src))
    if callable(src):
        return _DrawSource(src)
    raise TypeError(f"expected a numpy Generator, a seed or a Hypothesis draw, got {type(src).__name__}")


def _maybe(src: _RngSource, knob: bool | None, p: float = 0.5) -> bool:
    return src.chance(p) if knob is None else bool(knob)


def random_case(
    rng_or_draw: Any = None,
    *,
    bs: tuple[int, int] = (0, 12),
    swa: bool | None = None,
    lut: bool | None = None,
    pool: bool | None = None,
    pool_indices: bool | None = False,
    offsets: Sequence[int] = (0, 1, -1),
    padding_fraction: float = 0.25,
    padding_rows_carry_tokens: bool | None = None,
    fault_prob: float = 0.0,
    capacity: str = "any",
    on_overflow: str | None = None,
    strided_r2t: bool | None = None,
    max_reqs: tuple[int, int] = (2, 10),
    max_seq_len: tuple[int, int] = (1, 40),
    padding_slot: int | None = None,
    name: str = "random",
) -> PlanCase:
    """A random, valid-on-the-host plan case.

    ``rng_or_draw``: a ``numpy.random.Generator``, an int seed (or None), or a Hypothesis ``draw``.
    Knobs: ``bs`` (inclusive range), ``swa`` / ``lut`` / ``pool`` / ``strided_r2t`` (True, False, or None for a
    coin flip; SWA implies a LUT), ``pool_indices`` (with a pool: ``expected_token_pool_indices`` given, pool
    rows drawn apart from ``rp``; True, False (default, draws nothing) or None), ``offsets`` (token-offset choices), ``padding_fraction`` (chance a row is
    padding, with garbage P/E/valid_len), ``padding_rows_carry_tokens`` (the planner option, True, False or
    None for a coin flip; when on, padding rows get token counts that fit a row, E too long being a fault),
    ``fault_prob`` (per-row chance of a bad rp / P / E / valid_len, and a
    tenth of it per slot value of one beyond the LUT), ``capacity``: ``"tight"`` (total-1, total or total+1),
    ``"loose"`` (total .. total+16), ``"any"`` (0 .. 2*total+2), ``"sampled"`` (1 .. total-1 when total > 1);
    ``on_overflow``: ``"sample"``, ``"skip"`` or None (mostly sample; skip when C = 0, which cannot sample). The
    rotation state starts zero, inside the rows' windows, or as garbage. ``padding_slot``: the planner option
    (SPEC 3.2 "No reserved slot"), 0, -1 or None (either, drawn last: the rest of the case is the same either way);
    with -1 the LUT also maps some slots to 0 (a real slot) and to MISSING_SLOT (a freed mapping).
    """
    src = _source(rng_or_draw)
    bulk = np.random.default_rng(src.seed())  # bulk values: not worth shrinking element by element

    n_reqs = src.int(*max_reqs)
    seq_len = src.int(*max_seq_len)
    use_swa = _maybe(src, swa)
    use_lut = use_swa or _maybe(src, lut)
    use_pool = _maybe(src, pool)
    use_q = use_pool and _maybe(src, pool_indices)
    carry = _maybe(src, padding_rows_carry_tokens)
    W = src.int(1, seq_len + 2) if use_swa else 0
    off = int(src.pick(list(offsets)))
    lut_len = src.int(1, 4 * n_reqs * seq_len + 8) if use_lut else 0
    pool_rows = max(1, n_reqs + src.int(-2, 2)) if use_pool else 0
    pool_cols = src.pick([0, seq_len, seq_len + 1, src.int(0, seq_len + 3)]) if use_pool else 0

    # req_to_token: varied slots (random, some 0, some negative, some beyond the LUT when faults are on).
    slot_hi = lut_len if use_lut else (1 << 31) - 1
    r2t = bulk.integers(1 if slot_hi > 1 else 0, slot_hi, size=(n_reqs, seq_len), dtype=np.int64)
    u = bulk.random(r2t.shape)
    r2t[u < 0.04] = -1
    r2t[(u >= 0.04) & (u < 0.07)] = bulk.integers(-(1 << 31), 0, size=int(((u >= 0.04) & (u < 0.07)).sum()))
    r2t[(u >= 0.07) & (u < 0.09)] = 0
    if use_lut and fault_prob > 0:
        bad = bulk.random(r2t.shape) < fault_prob / 10
        r2t[bad] = bulk.integers(lut_len, (1 << 31) - 1, size=int(bad.sum()))
        r2t[bad & (bulk.random(r2t.shape) < 0.5)] = lut_len  # the first value out of range
    r2t[0] = 0 if src.chance(0.7) else r2t[0]  # row 0 is the padding row (usually zeros; never read anyway)
    r2t = r2t.astype(np.int32)
    if _maybe(src, strided_r2t):
        r2t = strided(r2t, src.int(1, 5))

    lut_arr = None
    if use_lut:
        lut_arr = bulk.integers(0, 1 << src.pick([20, 31, 40, 62]), size=lut_len, dtype=np.int64)
        lut_arr[bulk.random(lut_len) < 0.03] = -1
    pool_arr = None
    if use_pool:
        pool_arr = bulk.integers(-(1 << 31), (1 << 31) - 1, size=(pool_rows, pool_cols), dtype=np.int64).astype(
            np.int32)
        if src.chance(0.3):
            pool_arr = strided(pool_arr, src.int(1, 3))

    rp_bound = n_reqs if not use_pool or use_q else min(n_reqs, pool_rows)
    n = src.int(*bs)
    rpi, P, E, VL, Q = [], [], [], [], []
    garbage = [0, 1, -1, HUGE, -HUGE, (1 << 63) - 1, -(1 << 63), 1 << 31]
    for _ in range(n):
        if src.chance(padding_fraction) or rp_bound <= 1:
            rpi.append(0)
            P.append(src.pick(garbage + [src.int(-5, seq_len + 5)]))
            if carry:  # a real token count (a finished request's last step), or too long as a fault
                e = src.pick([-1, 0, 1, 1, src.int(0, seq_len)])
                if src.chance(fault_prob):
                    e = src.pick([seq_len + 1, HUGE, (1 << 63) - 1])
                E.append(e)
            else:
                E.append(src.pick(garbage + [src.int(-5, 9)]))
            VL.append(src.pick(garbage + [pool_cols + 1]))
            if use_q:
                Q.append(src.pick(garbage + [pool_rows]))  # never read
            continue
        rp = src.int(1, rp_bound - 1)
        p = src.pick([0, 1, seq_len, max(W, 0), W + 1, src.int(0, seq_len), src.int(0, seq_len)])
        p = min(p, seq_len)
        e = src.pick([0, 1, 1, src.int(0, 9)])  # a negative E is a fault (SPEC 3.4 bit 32)
        if e > seq_len - p:  # the new tokens must fit the row (SPEC 3.4 bit 32): a shorter prefix or E
            if e <= seq_len and src.chance(0.5):
                p = seq_len - e
            else:
                e = seq_len - p
        vl = src.pick([0, pool_cols, p, p + off, src.int(-2, pool_cols)])
        vl = min(vl, pool_cols)
        q = src.pick([0, rp if rp < pool_rows else 0, src.int(0, pool_rows - 1)]) if use_q else rp
        if src.chance(fault_prob):
            kind = src.int(0, 4 if use_q else (3 if use_pool else 2))
            if kind == 0:
                rp = src.pick([-1, n_reqs, rp_bound, src.int(rp_bound, max(rp_bound, n_reqs - 1)), -(1 << 62), 1 << 40])
            elif kind == 1:
                p = src.pick([-1, seq_len + 1, HUGE, -HUGE])
            elif kind == 2:  # too long by one, garbage that would wrap write_offsets if it were summed, negative
                e = src.pick([seq_len - max(p, 0) + 1, seq_len + 1, HUGE, (1 << 63) - 1, -1, -HUGE, -(1 << 63)])
            elif kind == 3:
                vl = src.pick([pool_cols + 1, 1 << 40])
            else:  # a pool row out of range by one on either side, or far
                q = src.pick([-1, pool_rows, -(1 << 62), 1 << 40])
        rpi.append(rp)
        P.append(p)
        E.append(e)
        VL.append(vl)
        Q.append(q)

    rpi_a, P_a, E_a = _i64(rpi), _i64(P), _i64(E)
    q_a = _i64(Q) if use_q else None
    total = count_entries(rpi_a, P_a, W, r2t.shape, pool_rows if use_pool else None, E=E_a, q=q_a)
    if capacity == "tight":
        C = max(0, total + src.int(-1, 1))
    elif capacity == "loose":
        C = total + src.int(0, 16)
    elif capacity == "any":
        C = src.int(0, 2 * total + 2)
    elif capacity == "sampled":
        C = src.int(1, total - 1) if total > 1 else src.int(0, 2)
    else:
        raise ValueError(f"capacity: expected 'tight', 'loose', 'any' or 'sampled', got {capacity!r}")
    mode = on_overflow or ("skip" if src.chance(0.2) else "sample")
    if C == 0:
        mode = "skip"
    cursors = None
    kind = src.int(0, 2)
    if kind == 1:
        cursors = bulk.integers(-1, seq_len + 1, size=n_reqs).astype(np.int64)
    elif kind == 2:
        cursors = bulk.choice(np.array(garbage + [0, 1, 2, 3], dtype=np.int64), size=n_reqs)
    R = n + src.int(0, 3)
    pad = src.pick([0, -1]) if padding_slot is None else int(padding_slot)
    if pad == -1 and lut_arr is not None:  # slot 0 of the SWA pool is real; other negatives are freed mappings
        u = bulk.random(lut_len)
        lut_arr[u < 0.03] = 0
        lut_arr[(u >= 0.03) & (u < 0.05)] = -(1 << 62)
    return PlanCase(
        name=name, req_to_token=r2t, req_pool_indices=rpi_a, prefix_lens=P_a, extend_seq_lens=E_a,
        verify_capacity=C, write_req_capacity=R, lut=lut_arr, pool=pool_arr,
        valid_lens=_i64(VL) if use_pool else None, pool_indices=q_a, swa_window_size=W, token_offset=off,
        padding_rows_carry_tokens=carry, on_overflow=mode, cursors=cursors, padding_slot=pad,
    )


def refill(case: PlanCase, rng: np.random.Generator) -> PlanCase:
    """New random contents, same shapes: what a serving loop writes into its buffers between graph replays."""
    r2t = case.req_to_token.copy()
    hi = case.lut.shape[0] + 2 if case.lut is not None else 1 << 20
    r2t[...] = rng.integers(-2, hi, size=r2t.shape, dtype=np.int32)
    bs = case.bs
    rpi = rng.integers(0, case.max_reqs, size=bs).astype(np.int64)
    P = rng.integers(0, case.max_seq_len + 1, size=bs).astype(np.int64)
    E = rng.integers(-1, 5, size=bs).astype(np.int64)
    vl = None
    if case.pool is not None:
        vl = rng.integers(0, case.pool.shape[1] + 1, size=bs).astype(np.int64)
    return case.replace(req_to_token=r2t, req_pool_indices=rpi, prefix_lens=P, extend_seq_lens=E, valid_lens=vl,
                        name=case.name + "-refill")


# Knob sets (random_case's keywords) that take every rule of SPEC 3.2-3.4 in turn; the GPU matrices and the
# simulator suite each add their own batch sizes.
RULE_KNOBS = [
    dict(),
    dict(swa=True),
    dict(pool=True, offsets=(0,)),
    dict(pool=True, offsets=(1,)),
    dict(padding_fraction=0.6),
    dict(padding_fraction=0.6, padding_rows_carry_tokens=True, fault_prob=0.1),
    dict(capacity="tight"),
    dict(fault_prob=0.15),
    dict(capacity="sampled", on_overflow="sample"),
    dict(capacity="sampled", on_overflow="sample", swa=True, pool=True, padding_fraction=0.4),
    dict(pool=True, pool_indices=True, fault_prob=0.1),
    dict(padding_slot=-1, fault_prob=0.1),  # SPEC 3.2 "No reserved slot"
    dict(padding_slot=-1, swa=True, pool=True, padding_fraction=0.4),
    dict(padding_slot=-1, capacity="sampled", on_overflow="sample", swa=True),
]
# The GPU matrices: the rules, and batch sizes on both sides of the fused / two-pass boundary.
GPU_RANDOM_KNOBS = RULE_KNOBS + [
    dict(bs=(1, 300), max_seq_len=(1, 600), capacity="loose"),
    dict(bs=(900, 1100), max_seq_len=(1, 40), max_reqs=(50, 400), capacity="tight"),
    dict(bs=(4000, 5000), max_seq_len=(1, 30), max_reqs=(50, 400)),
    dict(bs=(2000, 2500), max_seq_len=(1, 30), max_reqs=(50, 400), padding_fraction=0.3,
         padding_rows_carry_tokens=True),
    dict(bs=(1, 300), max_seq_len=(1, 600), capacity="sampled", on_overflow="sample"),
    dict(bs=(900, 1100), max_seq_len=(1, 40), max_reqs=(50, 400), capacity="sampled", on_overflow="sample"),
    dict(swa=True, pool=True, fault_prob=0.05, strided_r2t=True),
]


WIDTHS = (np.dtype(np.int32), np.dtype(np.int64))
# The arrays that take int32 or int64 (SPEC 2 (*)), each independently.
WIDE_ARRAYS = ("req_pool_indices", "prefix_lens", "extend_seq_lens", "valid_lens", "pool_indices", "block_table",
               "kv_indices", "kv_indptr")
_I32 = np.iinfo(np.int32)


def with_widths(case: PlanCase, seed: int | None = None, *, all32: bool = False, all64: bool = False) -> PlanCase:
    """``case`` with each array of ``WIDE_ARRAYS`` int32 or int64, drawn independently (``all32``: int32 wherever
    the values fit; ``all64``: int64 everywhere). An array whose values do not fit int32 stays int64. Its plan
    must be byte-identical to ``case``'s."""
    rng = np.random.default_rng(seed)
    changes = {}
    for name in WIDE_ARRAYS:
        a = getattr(case, name)
        if a is None:
            continue
        fits = a.size == 0 or (int(a.min()) >= _I32.min and int(a.max()) <= _I32.max)
        if all64:
            changes[name] = a.astype(np.int64)
        elif fits and (all32 or rng.random() < 0.5):
            changes[name] = a.astype(np.int32)
        else:
            changes[name] = a.astype(np.int64)
    return case.replace(name=f"{case.name}-w{'32' if all32 else '64' if all64 else seed}", **changes)


def int32_edge_cases() -> list[PlanCase]:
    """Step arrays holding int32's extremes and negative values (every row check's edge: rp, prefix, extend,
    valid_lens, the pool row, a block entry), in int32 range, so that :func:`with_widths` narrows them: the same
    status bits and outputs as the int64 values."""
    lo, hi = int(_I32.min), int(_I32.max)
    out = []
    for k, (field, values) in enumerate([
        ("req_pool_indices", (lo, -1, hi)), ("prefix_lens", (lo, -1, hi)), ("extend_seq_lens", (lo, -1, hi)),
        ("valid_lens", (lo, -1, hi)), ("pool_indices", (lo, -1, hi)),
    ]):
        for j, v in enumerate(values):
            rng = np.random.default_rng([k, j])
            base = random_case(rng, bs=(3, 6), pool=field in ("valid_lens", "pool_indices") or None,
                               pool_indices=True if field == "pool_indices" else False, name=f"edge-{field}-{v}")
            arr = getattr(base, field)
            if arr is None:
                continue
            arr = arr.astype(np.int64)
            arr[int(rng.integers(0, arr.shape[0]))] = v
            out.append(base.replace(**{field: arr}))
    return out


def plan_cases(**knobs):
    """Hypothesis strategy of :func:`random_case` with the given knobs."""
    from hypothesis import strategies as st

    @st.composite
    def strategy(draw):
        return random_case(draw, **knobs)

    return strategy()


# --------------------------------------------------------------------------------------------------------------
# Array libraries


def _xp_module(xp: str):
    if xp == "numpy":
        return np
    if xp in ("torch", "torch_cuda"):
        import torch

        return torch
    if xp == "cupy":
        import cupy

        return cupy
    if xp == "numba":
        from numba import cuda

        return cuda
    raise ValueError(f"xp: expected numpy, torch, torch_cuda, cupy or numba, got {xp!r}")


def _contiguous_to(xp: str, a: np.ndarray):
    a = np.ascontiguousarray(a)
    if xp == "numpy":
        return a
    mod = _xp_module(xp)
    if xp == "torch":
        return mod.from_numpy(a)  # shares memory: writes through the tensor land in ``a``
    if xp == "torch_cuda":
        return mod.as_tensor(a, device="cuda")
    if xp == "cupy":
        return mod.asarray(a)
    return mod.to_device(a)  # numba


def to_xp(a: np.ndarray, xp: str):
    """``a`` in array library ``xp`` (device arrays for cupy / torch_cuda / numba), keeping a 2-D row stride.

    A 2-D view whose row stride exceeds its width is rebuilt as the same-shaped view of a padded array.
    """
    if a.ndim == 2 and a.shape[0] > 1 and a.strides[0] > a.itemsize * a.shape[1]:
        rows, cols = a.shape
        stride = a.strides[0] // a.itemsize
        base = np.full((rows, stride), STRIDE_JUNK, dtype=a.dtype)
        base[:, :cols] = a
        return _contiguous_to(xp, base)[:, :cols]
    return _contiguous_to(xp, a)


def to_numpy(obj: Any) -> np.ndarray:
    """A NumPy copy of an array of any supported library (syncs for device arrays)."""
    if isinstance(obj, np.ndarray):
        return obj.copy()
    module = type(obj).__module__.split(".")[0]
    if module == "torch":
        return obj.detach().cpu().numpy().copy()
    if module == "cupy":
        return obj.get()
    if hasattr(obj, "copy_to_host"):
        return obj.copy_to_host()
    return np.asarray(obj).copy()


def poisoned_outputs(case: PlanCase, poison: Poison = POISON) -> dict[str, np.ndarray]:
    """The 10 output buffers as NumPy arrays filled with ``poison``, and the state (``STATE``) as the case
    gives it."""
    C, R = case.verify_capacity, case.write_req_capacity
    sizes = dict(verify_slot_indices=C, verify_expected_tokens=C, verify_expected_positions=C,
                 verify_prev_slot_indices=C, verify_num_valid=1, enable=1, status=1, write_offsets=R + 1,
                 write_seed_slot_indices=R, write_num_valid_reqs=1)
    out = {}
    for name in OUTPUTS:
        if name in _INT32_OUTPUTS:
            out[name] = np.full(sizes[name], poison.i32, dtype=np.int32)
        else:
            out[name] = np.full(sizes[name], poison.i64, dtype=np.int64)
    out["verify_cursors"] = case.initial_cursors
    return out


def make_plans(case: PlanCase, xp: str = "numpy", poison: Poison = POISON):
    """``(VerifyPlan, WritePlan, raw)``: poisoned output buffers in ``xp``; ``raw`` maps field name -> array."""
    from canary import VerifyPlan, WritePlan

    raw = {name: to_xp(a, xp) for name, a in poisoned_outputs(case, poison).items()}
    vp = VerifyPlan(**{k: raw[k] for k in VERIFY_FIELDS}, verify_cursors=raw["verify_cursors"])
    wp = WritePlan(**{k: raw[k] for k in WRITE_FIELDS})
    return vp, wp, raw


def run_case(
    case: PlanCase,
    backend: str = "reference",
    xp: str = "numpy",
    poison: Poison = POISON,
    *,
    api: str = "planner",
    check: bool = False,
    stream: Any = None,
    warmup: bool = True,
    launch_config: Any = None,
) -> dict[str, np.ndarray]:
    """Run ``case`` on ``backend`` with arrays of library ``xp``; return the 10 output buffers as NumPy.

    ``api="planner"``: ``CanaryPlanner(...)`` (+ ``warmup()``), then ``plan(...)``; ``api="launch"``:
    ``launch_canary_plan_kernels(...)``. ``check``, ``stream`` and ``launch_config`` (a ``LaunchConfig``; the
    planner API only) are passed through (``check=True`` may raise ``CanaryInputError``). Output buffers are
    poisoned before the run.
    """
    from canary import CanaryPlanner, launch_canary_plan_kernels

    vp, wp, raw = make_plans(case, xp, poison)
    conv = lambda a: to_xp(a, xp)
    static = case.static_kwargs(conv)
    step = case.step_kwargs(conv)
    if api == "planner":
        launch = {} if launch_config is None else {"launch_config": launch_config}
        planner = CanaryPlanner(backend=backend, verify_plan_out=vp, write_plan_out=wp,
                                verify_capacity=case.verify_capacity, max_batch_size=case.max_batch_size, **launch,
                                **static)
        if warmup:
            planner.warmup()
        planner.plan(**step, stream=stream, check=check)
    elif api == "launch":
        launch_canary_plan_kernels(verify_plan_out=vp, write_plan_out=wp, verify_capacity=case.verify_capacity,
                                   backend=backend, stream=stream, check=check, **static, **step)
    else:
        raise ValueError(f"api: expected 'planner' or 'launch', got {api!r}")
    return {name: to_numpy(raw[name]) for name in BUFFERS}


def expected_outputs(case: PlanCase, poison: Poison = POISON) -> dict[str, np.ndarray]:
    """The reference's outputs for ``case`` (``plan_arrays`` on poisoned NumPy buffers)."""
    from canary.backends.reference.plan import plan_arrays

    out = poisoned_outputs(case, poison)
    plan_arrays(
        **case.index_kwargs(), lut=case.lut, pool=case.pool, swa_window_size=case.swa_window_size,
        token_offset=case.token_offset, req_pool_indices=case.req_pool_indices, prefix_lens=case.prefix_lens,
        extend_seq_lens=case.extend_seq_lens, valid_lens=case.valid_lens, out=out,
        padding_rows_carry_tokens=case.padding_rows_carry_tokens, pool_indices=case.pool_indices,
        cursors=out["verify_cursors"] if case.on_overflow == "sample" else None, padding_slot=case.padding_slot,
    )
    return out


def _fmt(v) -> str:
    v = int(v)
    return f"{v} (0x{v & 0xFFFFFFFFFFFFFFFF:x})" if abs(v) > 1 << 24 else str(v)


def diff_outputs(got: dict[str, np.ndarray], want: dict[str, np.ndarray], names: Sequence[str] | None = None
                 ) -> list[str]:
    """Readable differences between two output dicts (empty when byte-identical). ``names``: the buffers to
    compare (default: the 10 outputs, and the state when ``got`` has it)."""
    lines = []
    if names is None:
        names = OUTPUTS + tuple(n for n in STATE if n in got)
    for name in names:
        a, b = np.asarray(got[name]), np.asarray(want[name])
        if a.dtype != b.dtype or a.shape != b.shape:
            lines.append(f"{name}: got {a.dtype}{list(a.shape)}, want {b.dtype}{list(b.shape)}")
            continue
        if a.tobytes() == b.tobytes():
            continue
        idx = np.flatnonzero(a.reshape(-1) != b.reshape(-1))
        i = int(idx[0])
        lines.append(
            f"{name}: {idx.size} of {a.size} differ; first at [{i}]: got {_fmt(a.reshape(-1)[i])}, "
            f"want {_fmt(b.reshape(-1)[i])}; got[{max(0, i - 2)}:{i + 3}]={a.reshape(-1)[max(0, i - 2):i + 3].tolist()} "
            f"want[...]={b.reshape(-1)[max(0, i - 2):i + 3].tolist()}"
        )
    return lines


def assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray], case: PlanCase | None = None,
                names: Sequence[str] | None = None) -> None:
    """Assert two output dicts are byte-identical; the message names the first differing index per buffer."""
    lines = diff_outputs(got, want, names)
    if lines:
        head = f"outputs differ{'' if case is None else ' for ' + case.describe()}"
        raise AssertionError(head + "\n  " + "\n  ".join(lines))
