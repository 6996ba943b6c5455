"""The NumPy reference planner: the executable form of SPEC 3.2 and 3.4.

Every GPU backend is tested byte for byte against ``plan_arrays``. It is vectorized (no Python loop per
token or per row) and writes into the caller's host arrays.
"""
from __future__ import annotations

import numpy as np

from ...errors import PlanStatus
from ...contract.kvindex import FORM_BLOCKS, FORM_PAGES, FORM_TOKENS, NO_REQ_BOUND, page_rows, paged_raw
from ...contract.plans import MISSING_SLOT, SKIP_SEED, mark_missing, translate
from ...contract.rows import row_checks
from ..args import DEFAULT_LAUNCH, LaunchConfig, StaticArgs, StepArgs

NAME = "reference"
ON_DEVICE = False


def _flat_rows(a: np.ndarray) -> tuple[np.ndarray, int]:
    """A 2-D array with unit inner stride as one 1-D view over its rows (row stride in elements), so that a
    gather of (row, column) pairs is one ``np.take`` of ``row * stride + column`` (2-D fancy indexing is several
    times slower). The view ends at the last row's last element: it never reaches past the caller's array."""
    rows, cols = a.shape
    stride = a.strides[0] // a.itemsize if rows > 1 else cols
    length = (rows - 1) * stride + cols if rows else 0
    return np.lib.stride_tricks.as_strided(a, shape=(length,), strides=(a.itemsize,), writeable=False), stride


class _Index:
    """The index as this planner reads it (SPEC 3.8): the raw slot at the virtual token index ``v = key * stride + p``
    of a row with key ``key`` (``rp``; a page list's ``kv_indptr[r]``), ``R`` of ``canary.contract.kvindex``."""

    def __init__(self, form: int, table: np.ndarray, page_size: int, padding_slot: int = 0):
        self.form, self.page_size, self.padding_slot = form, int(page_size), int(padding_slot)
        if form == FORM_PAGES:
            self.flat, self.key_stride = table, self.page_size
        else:
            self.flat, stride = _flat_rows(table)
            self.key_stride = stride * self.page_size

    def read(self, v: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """``(raw slots, bad entries)`` at ``v``; ``bad`` (negative block entries) is ``None`` for req_to_token."""
        if self.form == FORM_TOKENS:
            return np.take(self.flat, v).astype(np.int64), None
        s = self.page_size
        return paged_raw(np.take(self.flat, v // s), v % s, s, self.padding_slot)


def _any(bad: np.ndarray | None, where: np.ndarray | None = None) -> bool:
    if bad is None:
        return False
    return bool((bad if where is None else bad & where).any())


def _write_entries(out, index: _Index, lut, pool, token_offset, valid_lens, per_entry, rpi, pos, q=None,
                   keys=None) -> PlanStatus:
    """Entries ``[0, len(pos))`` at positions ``pos`` (SPEC 3.2). ``per_entry(a)`` spreads the batch-row array
    ``a`` over the entries (each entry gets its batch row's value): a ``np.repeat`` when every row's entries
    are consecutive, a gather when sampled. ``rpi``: the request rows; ``q``: the pool rows (``None``: ``rpi``);
    ``keys``: the rows' keys into the index (``None``: ``rpi``)."""
    n = pos.shape[0]
    at = per_entry((rpi if keys is None else keys) * index.key_stride) + pos
    raw, bad_raw = index.read(at)
    slot, bad_slot = translate(raw, lut)
    # A position the window needs whose slot is the padding slot (a cleared row, a freed SWA page): left as 0,
    # verify would skip it. Predecessors and seeds keep the 0 (outside the window, eviction is legitimate).
    # padding_slot=-1: a negative slot is the padding marker, and a predecessor that is one becomes MISSING_SLOT
    # (verify's "no link"), since -1 would be read as position 0's anchor.
    slot = mark_missing(raw, slot, index.padding_slot)
    # The predecessor of an entry whose column follows the previous entry's is that entry's slot, already read;
    # only the others (each row's first entry, a sampled window's wrap) read req_to_token again.
    has_prev = pos > 0
    follows = np.empty(n, dtype=bool)
    follows[:1] = False
    np.equal(at[1:], at[:-1] + 1, out=follows[1:])
    follows &= has_prev
    prev_raw = np.empty(n, dtype=np.int64)
    prev_raw[1:] = raw[:-1]
    other = np.flatnonzero(~follows)
    fh = has_prev[other]
    before, bad_before = index.read(np.where(fh, at[other] - 1, at[other]))
    prev_raw[other] = np.where(fh, before, -1)
    prev, bad_prev = translate(prev_raw, lut)
    if index.padding_slot == -1:
        prev = np.where(has_prev & (prev < 0), np.int64(MISSING_SLOT), prev)
    bad_prev |= _any(bad_raw) or _any(bad_before, fh)  # a negative block entry read as a slot or a predecessor
    out["verify_slot_indices"][:n] = slot
    out["verify_expected_positions"][:n] = pos
    out["verify_prev_slot_indices"][:n] = prev
    expected = out["verify_expected_tokens"][:n]
    if pool is None:
        expected[...] = -1
    else:
        col = pos + int(token_offset) if token_offset else pos
        ok = (col >= 0) & (col < per_entry(np.asarray(valid_lens, dtype=np.int64)))
        qrow = per_entry(rpi if q is None else q)
        if pool.ndim == 2 and pool.size and pool.strides[-1] == pool.itemsize and ok.all():
            pool_flat, pool_stride = _flat_rows(pool)
            expected[...] = np.take(pool_flat, qrow * pool_stride + col)
        else:
            expected[...] = -1
            expected[ok] = pool[qrow[ok], col[ok]]  # gather only in-range columns (pool_cols may be 0)
    return PlanStatus.BAD_SLOT if bad_slot or bad_prev else PlanStatus.OK


def sampled_entries(count: np.ndarray, start: np.ndarray, rpi: np.ndarray, cursors: np.ndarray, cap: int
                    ) -> tuple[np.ndarray, np.ndarray]:
    """The ``cap`` entries of a sampled step (SPEC 3.7) as (batch row, position) pairs; advances ``cursors``.

    ``count[r]`` / ``start[r]``: the verify entries and window start of each batch row (0 entries for padding
    and flagged rows), ``total = count.sum() > cap >= 1``.
    """
    nonempty = count > 0
    n = int(nonempty.sum())
    rank = np.cumsum(nonempty) - nonempty  # nonempty rows before r
    total = int(count.sum())
    if cap >= n:
        # One entry per request, the other cap - n split in proportion to count - 1 by rounding the running sum.
        rest = np.where(nonempty, count - 1, 0)
        before = np.cumsum(rest) - rest
        first = rank + ((cap - n) * before) // (total - n)
        take = np.diff(np.append(first, cap))
    else:
        # One entry for each of cap requests, taken in turn; entry 0 remembers whose turn it is.
        head = int(cursors[0]) if 0 <= int(cursors[0]) < n else 0
        take = (nonempty & ((rank - head) % n < cap)).astype(np.int64)
        first = np.cumsum(take) - take
        cursors[0] = (head + cap) % n
    taking = take > 0
    rp = rpi[taking]
    lo, length, k = start[taking], count[taking], take[taking]
    at = cursors[rp]
    # The walk goes down the window a block at a time: this run ends where the last one began (a cursor outside
    # the window restarts the walk at the window's end), so that positions appended at the end wait behind it.
    run = (np.where((at >= lo) & (at < lo + length), at - lo, 0) - k) % length
    row = np.repeat(np.flatnonzero(taking), k)
    j = np.arange(cap, dtype=np.int64) - np.repeat(first[taking], k)
    pos = np.repeat(lo, k) + (np.repeat(run, k) + j) % np.repeat(length, k)
    # A request row listed twice in one batch (an engine fault) keeps the larger of its new cursors.
    cursors[rp] = np.iinfo(np.int64).min
    np.maximum.at(cursors, rp, lo + run)
    return row, pos


def plan_arrays(
    *,
    req_to_token: np.ndarray | None = None,
    lut: np.ndarray | None,
    pool: np.ndarray | None,
    swa_window_size: int,
    token_offset: int,
    req_pool_indices: np.ndarray,
    prefix_lens: np.ndarray,
    extend_seq_lens: np.ndarray,
    valid_lens: np.ndarray | None,
    out: dict[str, np.ndarray],
    padding_rows_carry_tokens: bool = False,
    padding_slot: int = 0,
    cursors: np.ndarray | None = None,
    pool_indices: np.ndarray | None = None,
    block_table: np.ndarray | None = None,
    kv_indptr: np.ndarray | None = None,
    kv_indices: np.ndarray | None = None,
    page_size: int | None = None,
) -> None:
    """Build one plan into the arrays of ``out`` (keys: the field names of ``VerifyPlan`` and ``WritePlan``).

    The index (SPEC 3.8): ``req_to_token``, or ``block_table`` and ``page_size``, or ``kv_indptr``, ``kv_indices``
    and ``page_size`` (exactly one form; checked by the caller). ``cursors``: the ``[max_reqs]`` int64 rotation
    state of a planner that samples (SPEC 3.7), read and advanced in place; ``None`` for ``on_overflow="skip"``.
    ``pool_indices``: ``expected_token_pool_indices`` (SPEC 3.2), the pool row of each batch row; ``None``: the
    pool is keyed by ``req_pool_indices``. ``padding_slot``: 0 or -1 (SPEC 3.2, "No reserved slot").
    """
    # Every step array is int32 or int64 (SPEC 2 (*)): read widened, as the kernels' load_int reads it.
    rpi = np.asarray(req_pool_indices, dtype=np.int64)
    prefix = np.asarray(prefix_lens, dtype=np.int64)
    ext = np.asarray(extend_seq_lens, dtype=np.int64)
    valid_lens = None if valid_lens is None else np.asarray(valid_lens, dtype=np.int64)
    bs = rpi.shape[0]
    cap = out["verify_slot_indices"].shape[0]
    r_cap = out["write_seed_slot_indices"].shape[0]
    ps = 1 if page_size is None else int(page_size)
    keys = row_len = bad_key = None
    if req_to_token is not None:
        index = _Index(FORM_TOKENS, req_to_token, 1, padding_slot)
        max_reqs, max_seq_len = req_to_token.shape
    elif block_table is not None:
        index = _Index(FORM_BLOCKS, block_table, ps, padding_slot)
        max_reqs, max_seq_len = block_table.shape[0], block_table.shape[1] * ps
    else:  # a page list: keyed by batch row; rp bounds only the tables it indexes (SPEC 3.8)
        index = _Index(FORM_PAGES, kv_indices, ps, padding_slot)
        max_reqs = NO_REQ_BOUND if cursors is None else cursors.shape[0]
        max_seq_len = kv_indices.shape[0] * ps
        keys, bad_key, row_len = page_rows(kv_indptr, bs, kv_indices.shape[0], rpi != 0, ps, max_seq_len)
    q = None if pool is None or pool_indices is None else np.asarray(pool_indices, dtype=np.int64)
    # Keyed by req_pool_indices, one index bounds both tables; keyed apart, each index is bounded by its own.
    rp_bound = max_reqs if pool is None or q is not None else min(max_reqs, pool.shape[0])
    checks = row_checks(
        rpi, prefix, ext, valid_lens, rp_bound=rp_bound, max_seq_len=max_seq_len,
        pool_cols=None if pool is None else pool.shape[1], padding_rows_carry_tokens=padding_rows_carry_tokens,
        pool_indices=q, pool_rows=0 if pool is None else pool.shape[0], row_len=row_len, bad_key=bad_key,
    )
    good = checks.good

    status = PlanStatus.OK
    if checks.bad_req_pool_index.any():
        status |= PlanStatus.BAD_REQ_POOL_INDEX
    if checks.bad_prefix_len.any():
        status |= PlanStatus.BAD_PREFIX_LEN
    if checks.bad_valid_len.any():
        status |= PlanStatus.BAD_VALID_LEN
    if checks.bad_extend_len.any():
        status |= PlanStatus.BAD_EXTEND_LEN
    no_entries = (PlanStatus.BAD_REQ_POOL_INDEX | PlanStatus.BAD_PREFIX_LEN | PlanStatus.BAD_VALID_LEN
                  | PlanStatus.BAD_EXTEND_LEN)

    # Verify side. Rows flagged 2, 4 or 32 contribute no entries: their lengths cannot be trusted.
    w = int(swa_window_size)
    start = np.maximum(prefix - w, 0) if w > 0 else np.zeros_like(prefix)
    count = np.where(good, prefix - start, 0)
    total = int(count.sum())
    rows_ok = not (status & no_entries)
    if total > cap:
        status |= PlanStatus.SAMPLED if cursors is not None else PlanStatus.OVERFLOW
    sampled = total > cap and cursors is not None and rows_ok  # the cursors advance only over trusted rows
    if sampled:
        row, pos = sampled_entries(count, start, rpi, cursors, cap)

        def per_entry(a):
            return a[row]
    elif rows_ok and total <= cap:
        first = np.cumsum(count) - count
        pos = np.arange(total, dtype=np.int64)
        pos -= np.repeat(first - start, count)

        def per_entry(a):
            return np.repeat(a, count)
    if sampled or (rows_ok and total <= cap):
        status |= _write_entries(out, index, lut, pool, token_offset, valid_lens, per_entry, rpi, pos, q, keys)

    # Write side: offsets count every active row with E > 0 except those flagged 32 (their E would wrap the
    # offsets; a negative E, flagged too, counts nothing anyway), and the padding rows' E when their tokens sit
    # among the step's tokens; seeds need a trustworthy row, prefix and extend length.
    counted = checks.active | padding_rows_carry_tokens
    wlen = np.where(counted & (ext > 0) & ~checks.bad_extend_len, ext, 0)
    offsets = out["write_offsets"]
    offsets[: r_cap + 1] = 0
    offsets[1 : bs + 1] = np.cumsum(wlen)
    seeded = good & (ext > 0) & (prefix > 0)
    raw_seed = np.full(bs, -1, dtype=np.int64)
    raw_seed[seeded], bad_block = index.read((rpi if keys is None else keys)[seeded] * index.key_stride
                                             + prefix[seeded] - 1)
    seeds, bad_seed = translate(raw_seed, lut)
    if padding_slot == -1:  # a seed position that is no slot (SPEC 3.2): MISSING_SLOT, chained from the anchor
        seeds[seeded & (seeds < 0)] = MISSING_SLOT
    if bad_seed or _any(bad_block):
        status |= PlanStatus.BAD_SLOT
    seeds[~checks.active & (wlen > 0)] = SKIP_SEED  # padding tokens in the step's arrays: not to be written
    out["write_seed_slot_indices"][:bs] = seeds
    out["write_num_valid_reqs"][0] = bs

    out["verify_num_valid"][0] = min(total, cap)
    out["enable"][0] = 1 if status & ~PlanStatus.SAMPLED == PlanStatus.OK else 0
    out["status"][0] = int(status)


_OUTPUTS = (
    "verify_slot_indices", "verify_expected_tokens", "verify_expected_positions", "verify_prev_slot_indices",
    "verify_num_valid", "enable", "status", "write_offsets", "write_seed_slot_indices", "write_num_valid_reqs",
)


class Bound:
    def __init__(self, static: StaticArgs, launch: LaunchConfig = DEFAULT_LAUNCH):
        self.static = static
        self.out = {name: getattr(static, name).host for name in _OUTPUTS}
        self.lut = None if static.full_to_swa_index_mapping is None else static.full_to_swa_index_mapping.host
        self.pool = None if static.req_to_verify_expected_tokens is None else static.req_to_verify_expected_tokens.host
        self.cursors = None if static.verify_cursors is None else static.verify_cursors.host

    def launch(self, step: StepArgs, stream: int) -> None:
        s = self.static
        index = step.index if step.index is not None else s.index
        plan_arrays(
            **_index_arrays(index),
            lut=self.lut,
            pool=self.pool,
            swa_window_size=s.swa_window_size,
            token_offset=s.kv_token_id_vs_position_offset,
            req_pool_indices=step.req_pool_indices.host,
            prefix_lens=step.prefix_lens.host,
            extend_seq_lens=step.extend_seq_lens.host,
            valid_lens=None if step.valid_lens is None else step.valid_lens.host,
            out=self.out,
            padding_rows_carry_tokens=s.padding_rows_carry_tokens,
            padding_slot=s.padding_slot,
            cursors=self.cursors,
            pool_indices=None if step.pool_indices is None else step.pool_indices.host,
        )

    def warmup(self) -> None:
        pass


def _index_arrays(index) -> dict:
    """``plan_arrays``' index keywords of a bound or step index (``canary.backends.args.KVIndex``)."""
    if index.form == FORM_TOKENS:
        return dict(req_to_token=index.table.host)
    if index.form == FORM_BLOCKS:
        return dict(block_table=index.table.host, page_size=index.page_size)
    return dict(kv_indptr=index.kv_indptr.host, kv_indices=index.table.host, page_size=index.page_size)


def bind(static: StaticArgs, launch: LaunchConfig = DEFAULT_LAUNCH) -> Bound:
    return Bound(static, launch)
