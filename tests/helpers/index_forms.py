"""The paged index forms of plan cases (SPEC 3.8): a block table or a page list standing for the same slots.

- :func:`block_twins`: from any case, a block table drawn at random (blocks 0, in range, past the case's LUT), and
  two cases over it: ``tokens``, bound with the token table it stands for (``expand_block_table``), and
  ``blocks``, bound with the block table. Their outputs must be byte-identical.
- :func:`page_twins`: the same, plus ``pages``: a page list holding each active batch row's pages (a prefix of its
  block-table row, as long as its tokens need or all of it), rows keyed by batch row, with junk pages around and
  between them. Where the two forms bound a row differently (a page list bounds ``rp`` only by the tables it
  indexes, and a padding row's ``E`` by all of its pages), the twins are made to agree first: an out-of-range
  ``rp`` becomes -1 and a padding row's too-long ``E`` becomes ``2**62`` in both, which both then flag, and a
  page list whose padding rows carry tokens gets junk pages up to ``max_seq_len`` positions.
- :func:`bad_entry_case`: a paged case with the faults no token table can hold (negative block entries, kv_indptr
  pairs out of order or past ``nnz``): checked against the naive oracle and across backends, not against a twin.
- :func:`paged_hand_cases`: named cases of both forms, each with the status it was built to produce, and
  :func:`padding_slot_hand_cases` (``padding_slot=-1``, SPEC 3.2 "No reserved slot") in all three forms.
"""
from __future__ import annotations

import numpy as np
from helpers.plan_cases import (
    BAD_EXTEND_LEN, BAD_PREFIX_LEN, BAD_REQ_POOL_INDEX, BAD_SLOT, HUGE, OVERFLOW, SAMPLED, PlanCase, make_case,
    random_case, std_lut, std_pool, strided,
)

from canary.contract.kvindex import expand_block_table


def _rng(seed) -> np.random.Generator:
    return seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)


def random_block_table(rows: int, blocks: int, page_size: int, *, lut_len: int | None, rng, zero: float = 0.05,
                       stride_pad: int = 0, padding_slot: int = 0) -> np.ndarray:
    """``[rows, blocks]`` int32 block ids: mostly slots inside the LUT (or below 2**31 without one), some 0 (the
    padding block), with a LUT some past it (BAD_SLOT); row 0 zeros (the padding row). ``padding_slot=-1``
    (SPEC 3.2 "No reserved slot": block 0 is real) also some negative blocks, the engine's padding marker."""
    hi = max(2, (lut_len + page_size) // page_size) if lut_len is not None else max(2, ((1 << 31) - 1) // page_size)
    bt = rng.integers(1, hi, size=(rows, blocks), dtype=np.int64)
    bt[rng.random(bt.shape) < zero] = 0
    if padding_slot == -1:
        neg = rng.random(bt.shape) < zero
        bt[neg] = rng.integers(-(1 << 31), 0, size=int(neg.sum()))
    if rows:
        bt[0] = 0
    return strided(bt.astype(np.int32), stride_pad) if stride_pad else bt.astype(np.int32)


def _carry_fix(case: PlanCase, max_seq_len: int) -> np.ndarray:
    """A padding row's E past ``max_seq_len`` (flagged by the token form) made one every form flags."""
    E = case.extend_seq_lens.copy()
    if case.padding_rows_carry_tokens:
        E[(case.req_pool_indices == 0) & (E > max_seq_len)] = HUGE
    return E


def block_twins(case: PlanCase, page_size: int, seed=0, *, stride_pad: int | None = None) -> tuple[PlanCase, PlanCase]:
    """``(tokens, blocks)`` over one random block table of ``ceil(max_seq_len / page_size)`` blocks a row."""
    rng = _rng(seed)
    blocks = -(-case.max_seq_len // page_size) if case.max_seq_len else 0
    pad = int(rng.integers(0, 3)) if stride_pad is None else stride_pad
    bt = random_block_table(case.max_reqs, blocks, page_size, lut_len=None if case.lut is None else len(case.lut),
                            rng=rng, stride_pad=pad, padding_slot=case.padding_slot)
    r2t = expand_block_table(bt, page_size, case.padding_slot).astype(np.int32)
    tokens = case.replace(req_to_token=r2t, name=f"{case.name}-tokens-s{page_size}")
    return tokens, tokens.replace(form="block_table", block_table=bt, page_size=page_size,
                                  name=f"{case.name}-blocks-s{page_size}")


def page_twins(case: PlanCase, page_size: int, seed=0, *, wide: bool | None = None
               ) -> tuple[PlanCase, PlanCase, PlanCase]:
    """``(tokens, blocks, pages)``: the block twins of ``case`` and a page list of the same slots."""
    rng = _rng(seed)
    tokens, blocks = block_twins(case, page_size, rng)
    bt = np.ascontiguousarray(blocks.block_table)
    L, S = tokens.max_seq_len, page_size
    n_blocks = bt.shape[1]
    pool_rows = None if case.pool is None else case.pool.shape[0]
    keyed_by_rp = case.pool is not None and case.pool_indices is None
    rp_bound = min(case.max_reqs, pool_rows) if keyed_by_rp else case.max_reqs
    rpi = case.req_pool_indices.copy()
    active = rpi != 0
    rpi[active & ((rpi < 0) | (rpi >= rp_bound))] = -1  # flagged by rp < 0 in every form
    E = _carry_fix(case, L)
    P = case.prefix_lens
    pages: list[int] = list(rng.integers(1, 1000, size=int(rng.integers(0, 3))))  # junk before the first row
    indptr = [len(pages)]
    for r in range(case.bs):
        if rpi[r] == 0:  # a padding row: never read, any pages at all
            pages += list(rng.integers(-5, 1000, size=int(rng.integers(0, 3))))
        else:
            p, e = int(P[r]), int(E[r])
            fits = 0 <= p <= L and 0 <= e <= L - p
            need = -(-(p + e) // S) if fits else n_blocks
            k = int(rng.integers(need, n_blocks + 1)) if need <= n_blocks and rng.random() < 0.6 else n_blocks
            row = bt[rpi[r]] if rpi[r] > 0 else rng.integers(1, 1000, size=n_blocks)
            pages += [int(b) for b in row[:k]]
        indptr.append(len(pages))
    pages += list(rng.integers(1, 1000, size=int(rng.integers(0, 3))))  # junk past the last row
    if case.padding_rows_carry_tokens:  # a padding row's E is bounded by all the pages: at least max_seq_len
        pages += [1] * max(0, -(-L // S) - len(pages))
    indptr += list(rng.integers(-1000, 1000, size=int(rng.integers(0, 2))))  # kv_indptr may be longer than bs + 1
    wide = bool(rng.random() < 0.5) if wide is None else wide
    ptr = np.asarray(indptr, dtype=np.int64 if wide else np.int32)
    tokens = tokens.replace(req_pool_indices=rpi, extend_seq_lens=E)
    blocks = blocks.replace(req_pool_indices=rpi, extend_seq_lens=E)
    return tokens, blocks, tokens.replace(form="page_list", kv_indptr=ptr, kv_indices=np.asarray(pages, np.int32),
                                          page_size=S, name=f"{case.name}-pages-s{S}")


def bad_entry_case(case: PlanCase, page_size: int, seed=0, *, form: str = "block_table", negative: float = 0.1,
                   bad_pairs: float = 0.2) -> PlanCase:
    """A paged case with faults no token table holds: negative block entries (``negative``: the chance per block),
    and for a page list kv_indptr values broken at random (``bad_pairs``: the chance per boundary: negative, past
    nnz, or below the one before)."""
    rng = _rng(seed)
    tokens, blocks, pages = page_twins(case, page_size, rng)
    if form == "block_table":
        bt = blocks.block_table.copy()  # keeps the row stride (a strided view's copy is contiguous: fine too)
        neg = rng.random(bt.shape) < negative
        bt[neg] = rng.integers(-(1 << 31), 0, size=int(neg.sum()))
        return blocks.replace(block_table=bt, name=f"{case.name}-bad-blocks")
    idx = pages.kv_indices.copy()
    neg = rng.random(idx.shape) < negative
    idx[neg] = -1 - rng.integers(0, 1 << 20, size=int(neg.sum()))
    ptr = pages.kv_indptr.astype(np.int64)
    nnz = idx.shape[0]
    for j in range(ptr.shape[0]):
        if rng.random() < bad_pairs:
            ptr[j] = rng.choice([-1, nnz + 1, max(0, int(ptr[j - 1]) - 1) if j else -3, -HUGE, HUGE])
    ptr = ptr.astype(pages.kv_indptr.dtype) if pages.kv_indptr.dtype == np.int64 else np.clip(
        ptr, -(1 << 31), (1 << 31) - 1).astype(np.int32)
    return pages.replace(kv_indices=idx, kv_indptr=ptr, name=f"{case.name}-bad-pages")


def _with_blocks(case: PlanCase, bt: np.ndarray, S: int, **kw) -> PlanCase:
    return case.replace(req_to_token=expand_block_table(bt, S).astype(np.int32), form="block_table",
                        block_table=bt.astype(np.int32), page_size=S, **kw)


def _with_pages(case: PlanCase, indptr, indices, S: int, max_seq_len: int, **kw) -> PlanCase:
    """A page-list case; its ``req_to_token`` (shapes only: the oracle reads the page list) has ``max_seq_len``
    columns."""
    r2t = np.zeros((case.max_reqs, max_seq_len), np.int32)
    return case.replace(req_to_token=r2t, form="page_list", kv_indptr=np.asarray(indptr, np.int64),
                        kv_indices=np.asarray(indices, np.int32), page_size=S, **kw)


def paged_hand_cases() -> list[PlanCase]:
    """Named cases of the paged forms (SPEC 3.8), each with the status it was built to produce."""
    S = 4
    # rows: rp 1: blocks 10, 11 (slots 40..47); rp 2: blocks 20, 0 (slots 80..83, then the padding block);
    # rp 3: blocks 30, 31; row 0 padding. max_blocks 2: max_seq_len 8.
    bt = np.array([[0, 0], [10, 11], [20, 0], [30, 31], [5, 6], [7, 8]], np.int32)
    cases = []
    add = cases.append

    def blocks(name, rows, table=bt, expect=0, **kw):
        base = make_case(name, rows, r2t=expand_block_table(table, S).astype(np.int32), expect_status=expect, **kw)
        add(_with_blocks(base, table, S, name="blocks_" + name))

    blocks("decode", [(1, 5, 1), (3, 3, 1)], notes="slots 40..44 (block 10 then 11), seeds 44 and 122")
    blocks("page_boundary", [(1, 4, 1), (3, 8, 0)], notes="P = S: the seed is the last slot of the first block")
    blocks("zero_block_missing", [(2, 6, 0)], notes="positions 4, 5 lie in the padding block: MISSING_SLOT")
    blocks("zero_block_seed", [(2, 6, 1)], notes="the seed in the padding block is 0 (no MISSING for a seed)")
    blocks("past_max_blocks", [(1, 9, 0), (3, 2, 1)], expect=BAD_PREFIX_LEN,
           notes="P = 9 > max_blocks * S = 8: bit 4, as past max_seq_len")
    blocks("extend_past_max_blocks", [(1, 6, 3)], expect=BAD_EXTEND_LEN, notes="6 + 3 > 8")
    blocks("rp_past_rows", [(6, 2, 1), (1, 2, 1)], expect=BAD_REQ_POOL_INDEX)
    neg = bt.copy()
    neg[1, 1] = -3
    neg[3, 0] = -(1 << 31)
    blocks("negative_entry", [(1, 6, 0), (2, 2, 1)], table=neg, expect=BAD_SLOT,
           notes="block -3 at positions 4..7 of rp 1: entries 4, 5 written as -1 (and 5's predecessor), BAD_SLOT")
    blocks("negative_seed", [(1, 3, 0), (1, 6, 1)], table=neg, expect=BAD_SLOT,
           notes="the second row's entries 4, 5 and its seed (position 5) read block -3")
    blocks("negative_not_read", [(1, 4, 0), (3, 0, 2)], table=neg, expect=0,
           notes="rp 1's negative block starts at position 4 = P (not read); rp 3's P = 0 reads no seed")
    blocks("negative_overflow_seed", [(3, 2, 1)], table=neg, C=1, expect=OVERFLOW | BAD_SLOT, on_overflow="skip",
           notes="entries not written; the seed (block -2**31) is read and bad")
    blocks("negative_sampled", [(1, 8, 0), (3, 4, 0)], table=neg, C=3, expect=SAMPLED | BAD_SLOT,
           cursors=[0, 6, 2, 0, 0, 0], notes="a sampled run over rp 1's negative block")
    blocks("lut", [(1, 5, 1), (3, 6, 1)], lut=std_lut(lut_len=122), expect=BAD_SLOT,
           notes="slots then the LUT: rp 1's 40..44 -> 10040..; rp 3's 120, 121 in, 122.. past lut_len 122")
    blocks("swa", [(1, 7, 1), (3, 6, 1)], W=3, lut=True, notes="the window [4, 7): its head's predecessor 43")
    blocks("pool", [(1, 5, 1, 4), (3, 2, 1, 8)], pool=std_pool(6, 8), off=1)

    def pages(name, rows, indptr, indices, S=S, expect=0, max_seq_len=8, **kw):
        base = make_case(name, rows, r2t=np.zeros((6, max_seq_len), np.int32), expect_status=expect,
                         C=kw.pop("C", None), **kw)
        add(_with_pages(base, indptr, indices, S, max_seq_len, name="pages_" + name))

    # batch row 0: pages 10, 11; row 1: page 30; row 2 (padding): none
    pages("decode", [(1, 5, 1), (3, 3, 1), (0, 9, 9)], [0, 2, 3, 3], [10, 11, 30],
          C=8, notes="rows keyed by batch row: row 0's pages [10, 11], row 1's [30]")
    pages("row_capacity", [(1, 4, 0), (3, 2, 2)], [0, 1, 2], [10, 30], C=6,
          notes="each row holds one page (4 positions): P + E = 4 fits")
    pages("prefix_past_pages", [(1, 5, 0), (3, 2, 1)], [0, 1, 3], [10, 30, 31], C=2, expect=BAD_PREFIX_LEN,
          notes="row 0 holds 4 positions, P = 5: bit 4 (not a read of row 1's pages)")
    pages("extend_past_pages", [(1, 3, 2), (3, 2, 1)], [0, 1, 2], [10, 30], C=2, expect=BAD_EXTEND_LEN,
          notes="3 + 2 > 4: the new tokens do not fit the row's pages")
    pages("indptr_backwards", [(1, 2, 1), (3, 2, 1)], [0, 2, 1], [10, 11, 30], C=2, expect=BAD_REQ_POOL_INDEX,
          notes="row 1's pair (2, 1) is out of order: bit 2; its E still counts (it fits nnz * S)")
    pages("indptr_past_nnz", [(1, 2, 1), (3, 2, 1)], [0, 1, 4], [10, 30, 31], C=2, expect=BAD_REQ_POOL_INDEX)
    pages("indptr_negative", [(1, 2, 1), (3, 2, 1)], [-1, 1, 2], [10, 30], C=2, expect=BAD_REQ_POOL_INDEX)
    pages("indptr_huge", [(1, 2, 1)], [HUGE, -HUGE], [10], C=2, expect=BAD_REQ_POOL_INDEX)
    pages("padding_pair_shares_an_end", [(0, 3, 1), (1, 2, 1), (0, 5, 5)], [7, -4, 0, 9], [10, 11], C=2,
          expect=BAD_REQ_POOL_INDEX, notes="a padding row's pair is never looked at, but its ends are its "
                                           "neighbours' too: row 1's pair (-4, 0) is bad")
    pages("padding_pair_garbage_ok", [(0, 3, 1), (1, 2, 1), (0, 5, 5)], [7, 0, 1, -9], [10, 11], C=2,
          notes="the padding rows' other ends (7, -9) are never read")
    pages("token_level", [(1, 3, 1), (2, 2, 1)], [0, 4, 7], [5, 6, 7, 8, 9, 0, 11], S=1, C=5,
          notes="S = 1: a token-level index list; row 1's position 1 maps to slot 0: MISSING_SLOT")
    pages("negative_entry", [(1, 6, 0), (3, 2, 1)], [0, 2, 3], [10, -1, 30], C=8, expect=BAD_SLOT,
          notes="page -1 at positions 4, 5 of row 0: written as -1, BAD_SLOT")
    pages("rp_unbounded_skip", [(99, 2, 1), (1, 1, 1)], [0, 1, 2], [10, 30], C=3, on_overflow="skip",
          notes="no cursors, no pool: rp 99 is only 'active'")
    pages("rp_bounded_by_cursors", [(99, 2, 1), (1, 1, 1)], [0, 1, 2], [10, 30], C=3, expect=BAD_REQ_POOL_INDEX,
          notes="sampling: rp < len(verify_cursors) = 6")
    pages("rp_bounded_by_pool", [(5, 2, 1, 8), (1, 1, 1, 8)], [0, 1, 2], [10, 30], C=3, pool=std_pool(4, 8),
          on_overflow="skip", expect=BAD_REQ_POOL_INDEX, notes="a pool keyed by rp bounds it: 5 >= 4 pool rows")
    pages("carry_e_bound", [(0, HUGE, 12), (1, 2, 1)], [0, 0, 3], [10, 11, 12], C=2, carry=True,
          notes="a padding row's E is bounded by all pages (nnz * S = 12): fits")
    pages("carry_e_too_long", [(0, HUGE, 13), (1, 2, 1)], [0, 0, 3], [10, 11, 12], C=2, carry=True,
          expect=BAD_EXTEND_LEN)
    pages("sampled", [(1, 8, 0), (3, 3, 1)], [0, 2, 3], [10, 11, 30], C=4, cursors=[0, 5, 0, 1, 0, 0],
          expect=SAMPLED)
    pages("empty_indices", [(1, 0, 0), (0, 3, 1)], [0, 0, 0], [], C=0, on_overflow="skip",
          notes="nnz = 0: a row of no pages and P = 0 is fine")
    return cases + padding_slot_hand_cases()


# --------------------------------------------------------------------------------------------------------------
# padding_slot = -1 (SPEC 3.2 "No reserved slot"): slot 0 and block 0 are real, a negative slot is padding

M = -(1 << 62)  # MISSING_SLOT
PS = 2  # the page size of the cases below
# rp 1: blocks 0, 3, -1, 5 -> slots 0 1 | 6 7 | -  - | 10 11; rp 2: blocks 2, -7, 4, 0 -> 4 5 | - - | 8 9 | 0 1
REAL0_BLOCKS = np.array([[0, 0, 0, 0], [0, 3, -1, 5], [2, -7, 4, 0], [1, 1, 1, 1]], np.int32)
# lut[x] = 1000 + x over 10 slots but for 0 -> 0 (a real SWA slot 0) and 9 -> -1 (a freed mapping)
REAL0_LUT = np.array([0, 1001, 1002, 1003, 1004, 1005, 1006, 1007, 1008, -1], np.int64)

# name: (rows (rp, P, E), W, lut?, expected slots, prevs, seeds (per batch row), status)
REAL0_CASES = {
    "real0_decode": ([(1, 4, 1)], 0, False, [0, 1, 6, 7], [-1, 0, 1, 6], [7], 0),
    "real0_missing_in_window": ([(1, 6, 1), (0, 9, 9)], 0, False, [0, 1, 6, 7, M, M], [-1, 0, 1, 6, 7, M],
                                [M, -1], 0),
    "real0_seed_cleared": ([(1, 5, 2)], 1, True, [M], [1007], [M], 0),
    "real0_pred_outside_window": ([(2, 6, 1)], 2, True, [1008, M], [M, 1008], [M], 0),
    "real0_lut_zero": ([(1, 2, 1), (2, 1, 0)], 2, True, [0, 1001, 1004], [-1, 0, -1], [1001, -1], 0),
    "real0_block0_late": ([(2, 8, 0)], 0, False, [4, 5, M, M, 8, 9, 0, 1], [-1, 4, 5, M, M, 8, 9, 0], [-1], 0),
    "real0_bad_slot_past_lut": ([(1, 7, 1)], 2, True, [M, M], [M, M], [M], 8),
}


def _real0_pages(rows) -> tuple[list[int], list[int]]:
    """A page list of REAL0_BLOCKS' rows for the batch rows ``rows`` (a padding row gets junk pages)."""
    indptr, pages = [0], []
    for rp, _p, _e in rows:
        pages += [int(b) for b in REAL0_BLOCKS[rp]] if rp else [-5, 77]
        indptr.append(len(pages))
    return indptr, pages


def padding_slot_hand_cases() -> list[PlanCase]:
    """REAL0_CASES in all three forms, ``padding_slot=-1`` (names ``<form>_<case>``; expected values in
    REAL0_CASES, the same bytes in every form)."""
    r2t = expand_block_table(REAL0_BLOCKS, PS, -1).astype(np.int32)
    out = []
    for name, (rows, W, lut, *_rest) in REAL0_CASES.items():
        expect = _rest[-1]
        base = make_case(name, rows, r2t=r2t, W=W, lut=REAL0_LUT if lut else None, expect_status=expect,
                         on_overflow="skip").replace(padding_slot=-1)
        out.append(base.replace(name="tokens_" + name))
        out.append(base.replace(form="block_table", block_table=REAL0_BLOCKS.copy(), page_size=PS,
                                name="blocks_" + name))
        indptr, pages = _real0_pages(rows)
        out.append(base.replace(form="page_list", kv_indptr=np.asarray(indptr, np.int64),
                                kv_indices=np.asarray(pages, np.int32), page_size=PS, name="pages_" + name))
    return out


def wide_table_edge_cases() -> list[tuple[PlanCase, PlanCase]]:
    """``(case, twin)`` pairs of paged cases with one block entry at an edge (SPEC 3.8): ``case`` holds INT32_MIN,
    -1 or INT32_MAX (in int32 range: :func:`plan_cases.with_widths` narrows it; the same plan either width), or,
    int64 only, 2**31 or INT64_MAX, which must plan as the bad entry -1 does (``twin``, the same case with -1)."""
    lo, hi = int(np.iinfo(np.int32).min), int(np.iinfo(np.int32).max)
    out = []
    for k, v in enumerate((lo, -1, hi, hi + 1, (1 << 63) - 1)):
        for form in ("block_table", "page_list"):
            rng = np.random.default_rng([11, k, form == "page_list"])
            base = random_case(rng, bs=(3, 6), max_seq_len=(4, 16), padding_slot=0, name=f"edge-{form}-{v}")
            _, blocks, pages = page_twins(base, 4, rng)
            case = blocks if form == "block_table" else pages
            field = "block_table" if form == "block_table" else "kv_indices"
            arr = np.array(getattr(case, field), dtype=np.int64)
            if not arr.size:
                continue
            flat = arr.reshape(-1)
            at = int(rng.integers(0, flat.size))
            flat[at] = v
            twin = np.array(arr)
            twin.reshape(-1)[at] = -1 if v > hi else v
            out.append((case.replace(**{field: arr}), case.replace(**{field: twin}, name=case.name + "-twin")))
    return out

