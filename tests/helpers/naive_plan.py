"""A deliberately naive oracle for SPEC 3.2 / 3.4: one batch row at a time, one token at a time, plain Python.

Written from the text of SPEC.md (not from ``canary/backends/reference.py``), plus the choices the project
made where the SPEC leaves room (see ``naive_plan``'s docstring). Slow on purpose; use it on small cases.
"""
from __future__ import annotations

import numpy as np

OVERFLOW, BAD_REQ_POOL_INDEX, BAD_PREFIX_LEN, BAD_SLOT, BAD_VALID_LEN, BAD_EXTEND_LEN, SAMPLED = 1, 2, 4, 8, 16, 32, 64
SKIP_SEED = -(1 << 63)
MISSING_SLOT = -(1 << 62)


def naive_plan(case, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Return copies of ``outputs`` (the 10 poisoned buffers, keyed by field name) after one plan of ``case``.

    Choices beyond the SPEC text, as decided for the project:

    - a row flagged BAD_REQ_POOL_INDEX or BAD_PREFIX_LEN contributes no verify entries (``total`` excludes it);
      one flagged BAD_EXTEND_LEN neither (SPEC 3.4 says so), nor write entries, nor a seed;
    - the four entry arrays are written only when ``total <= C`` and none of bits 2, 4, 16, 32 is set;
    - BAD_SLOT is raised only by values actually read: slots and predecessors of written entries, and seeds;
    - ``verify_num_valid = min(total, C)`` whatever the status;
    - with ``case.padding_rows_carry_tokens``, a padding row with ``E > 0`` counts ``E`` write entries and gets
      the seed SKIP_SEED, unless ``E > max_seq_len`` (flagged BAD_EXTEND_LEN, wlen 0, seed -1): SPEC 3.2, 3.4;
    - an entry whose raw slot is 0 (a cleared row), or > 0 and translates to 0 (an SWA page freed inside the
      window), gets the slot MISSING_SLOT; its successor's prev and the seeds keep the 0 (SPEC 3.2);
    - ``on_overflow="sample"`` (SPEC 3.7): ``total > C`` sets SAMPLED (whatever else is set); the entries and the
      cursors (``outputs["verify_cursors"]``, advanced in the returned copy) only when no row is untrusted.
    - with ``case.pool_indices`` (``expected_token_pool_indices``), an active row reads pool row
      ``q = pool_indices[r]``: ``rp < max_reqs`` and ``0 <= q < pool_rows``, else BAD_REQ_POOL_INDEX (SPEC 3.2, 3.4).
    - ``case.form`` (SPEC 3.8): a block table's slot is ``b * S + p % S`` of block ``b = block_table[rp, p // S]``
      (0 for b = 0; b < 0 sets BAD_SLOT and reads as -1), ``max_seq_len = max_blocks * S``; a page list's rows are
      batch rows, row r's pages ``kv_indices[kv_indptr[r]:kv_indptr[r + 1]]`` (a pair out of order or past nnz:
      BAD_REQ_POOL_INDEX, the row then bounded by ``nnz * S``; else its pages' positions replace max_seq_len),
      and ``rp`` is bounded only by the cursors (sampling) and the pool keyed by it.
    - ``case.padding_slot == -1`` (SPEC 3.2 "No reserved slot"): a block b >= 0 is slot ``b * S + p % S`` (block
      0 too), b < 0 reads as -1 without BAD_SLOT; a position whose raw slot or translation is negative is no slot:
      its entry, its successor's predecessor and a seed read there are MISSING_SLOT; 0 is a slot like any other.
    """
    out = {k: np.array(v, copy=True) for k, v in outputs.items()}
    r2t = case.req_to_token
    max_reqs, max_seq_len = int(r2t.shape[0]), int(r2t.shape[1])
    form = getattr(case, "form", "req_to_token")
    S = int(getattr(case, "page_size", 1))
    sample_mode = getattr(case, "on_overflow", "skip") == "sample"
    if form == "block_table":
        max_seq_len = int(case.block_table.shape[1]) * S
    elif form == "page_list":
        nnz = int(case.kv_indices.shape[0])
        max_seq_len = nnz * S
        max_reqs = int(out["verify_cursors"].shape[0]) if sample_mode else (1 << 63) - 1
    lut = case.lut
    pool = case.pool
    qs = getattr(case, "pool_indices", None)
    W = int(case.swa_window_size)
    off = int(case.token_offset)
    carry = bool(getattr(case, "padding_rows_carry_tokens", False))
    real0 = getattr(case, "padding_slot", 0) == -1
    C = int(out["verify_slot_indices"].shape[0])
    R = int(out["write_seed_slot_indices"].shape[0])
    bs = len(case.req_pool_indices)
    status = 0

    def read_slot(r: int, p: int) -> int:
        """R(r, p) of batch row r (SPEC 3.8)."""
        nonlocal status
        rp = int(case.req_pool_indices[r])
        if form == "req_to_token":
            assert 0 <= rp < max_reqs and 0 <= p < max_seq_len, ("out-of-bounds read of req_to_token", rp, p)
            return int(r2t[rp, p])
        if form == "block_table":
            bt = case.block_table
            assert 0 <= rp < bt.shape[0] and 0 <= p // S < bt.shape[1], ("out-of-bounds read of block_table", rp, p)
            b = int(bt[rp, p // S])
        else:
            at = int(case.kv_indptr[r]) + p // S
            assert 0 <= p and p // S < int(case.kv_indptr[r + 1]) - int(case.kv_indptr[r]), ("past the row", r, p)
            assert 0 <= at < nnz, ("out-of-bounds read of kv_indices", r, p)
            b = int(case.kv_indices[at])
        if b < 0:
            if not real0:  # with padding_slot=-1, the engine's padding marker
                status |= BAD_SLOT
            return -1
        return 0 if b == 0 and not real0 else b * S + p % S

    def no_slot(value: int) -> int:
        """A translated value read at a real position: MISSING_SLOT when it is no slot (padding_slot=-1 only)."""
        return MISSING_SLOT if real0 and value < 0 else value

    def T(x: int) -> int:
        nonlocal status
        if x < 0 or lut is None:
            return x
        if x >= len(lut):
            status |= BAD_SLOT
            return -1
        return int(lut[x])

    # Pass 1: per-row checks and the entry list (row, position). Inactive rows: only rp, P, E are looked at.
    entries: list[tuple[int, int]] = []
    row_ok: list[bool] = []
    bad_extend = [False] * bs
    for r in range(bs):
        rp = int(case.req_pool_indices[r])
        P = int(case.prefix_lens[r])
        E = int(case.extend_seq_lens[r])
        if rp == 0:
            if carry and E > max_seq_len:  # the row's tokens are counted: P taken as 0 (never read)
                status |= BAD_EXTEND_LEN
                bad_extend[r] = True
            row_ok.append(False)
            continue
        ok = True
        q = rp if qs is None else int(qs[r])  # the pool row; read for active rows only
        cap = max_seq_len
        key_bad = False
        if form == "page_list":  # the row's kv_indptr pair, read for active rows only
            lo, hi = int(case.kv_indptr[r]), int(case.kv_indptr[r + 1])
            key_bad = lo < 0 or hi < lo or hi > nnz
            cap = max_seq_len if key_bad else (hi - lo) * S
        if rp < 0 or rp >= max_reqs or (pool is not None and not 0 <= q < pool.shape[0]) or key_bad:
            status |= BAD_REQ_POOL_INDEX
            ok = False
        if P < 0 or P > cap:
            status |= BAD_PREFIX_LEN
            ok = False
        if pool is not None and int(case.valid_lens[r]) > pool.shape[1]:
            status |= BAD_VALID_LEN
        # Python ints do not wrap: the SPEC's formula as written.
        if E < 0 or (E > 0 and min(max(P, 0), cap) + E > cap):
            status |= BAD_EXTEND_LEN
            bad_extend[r] = True
            ok = False
        row_ok.append(ok)
        if not ok:
            continue
        window_start = max(0, P - W) if W > 0 else 0
        for p in range(window_start, P):
            entries.append((r, p))

    total = len(entries)
    sample = getattr(case, "on_overflow", "skip") == "sample"
    if total > C:
        status |= SAMPLED if sample else OVERFLOW
    untrusted = status & (BAD_REQ_POOL_INDEX | BAD_PREFIX_LEN | BAD_VALID_LEN | BAD_EXTEND_LEN)
    if total > C and sample and not untrusted:
        entries = _sample(case, entries, C, out["verify_cursors"])

    # Pass 2: the entries, only when they are to be written.
    if (total <= C or sample) and not untrusted:
        for i, (r, p) in enumerate(entries):
            rp = int(case.req_pool_indices[r])
            raw = read_slot(r, p)
            slot = T(raw)
            if real0:
                slot = no_slot(slot)
            elif raw == 0 or (raw > 0 and slot == 0):  # no real slot where the window needs one
                slot = MISSING_SLOT
            prev = no_slot(T(read_slot(r, p - 1))) if p > 0 else -1
            expected = -1
            if pool is not None:
                col = p + off
                if 0 <= col < int(case.valid_lens[r]):
                    assert col < pool.shape[1], "out-of-bounds read of the expected-token pool"
                    expected = int(pool[rp if qs is None else int(qs[r]), col])
            out["verify_slot_indices"][i] = slot
            out["verify_expected_tokens"][i] = expected
            out["verify_expected_positions"][i] = p
            out["verify_prev_slot_indices"][i] = prev

    # Write side.
    for i in range(R + 1):
        out["write_offsets"][i] = 0
    running = 0
    for r in range(bs):
        rp = int(case.req_pool_indices[r])
        P = int(case.prefix_lens[r])
        E = int(case.extend_seq_lens[r])
        out["write_offsets"][r] = running
        wlen = E if (rp != 0 or carry) and E > 0 and not bad_extend[r] else 0
        running += wlen
        seed = -1
        if rp != 0 and row_ok[r] and E > 0 and P > 0:
            seed = no_slot(T(read_slot(r, P - 1)))
        elif rp == 0 and wlen > 0:
            seed = SKIP_SEED
        out["write_seed_slot_indices"][r] = seed
    out["write_offsets"][bs] = running
    out["write_num_valid_reqs"][0] = bs

    out["verify_num_valid"][0] = min(total, C)
    out["enable"][0] = 1 if status & ~SAMPLED == 0 else 0
    out["status"][0] = status
    return out


def _sample(case, entries: list[tuple[int, int]], C: int, cursors: np.ndarray) -> list[tuple[int, int]]:
    """SPEC 3.7, one request at a time: the C entries of a sampled step, in batch-row order; advances
    ``cursors`` in place."""
    rows: dict[int, list[int]] = {}  # batch row -> its window's positions, in order
    for r, p in entries:
        rows.setdefault(r, []).append(p)
    order = sorted(rows)
    n, total = len(order), len(entries)
    take = {}
    if C >= n:
        before = 0
        firsts = []
        for r in order:
            firsts.append(len(firsts) + (C - n) * before // (total - n))
            before += len(rows[r]) - 1
        firsts.append(C)
        take = {r: firsts[k + 1] - firsts[k] for k, r in enumerate(order)}
    else:
        head = int(cursors[0])
        if not 0 <= head < n:
            head = 0
        for k, r in enumerate(order):
            take[r] = 1 if (k - head) % n < C else 0
        cursors[0] = (head + C) % n
    chosen: list[tuple[int, int]] = []
    new_cursor: dict[int, int] = {}
    for r in order:
        window = rows[r]
        rp = int(case.req_pool_indices[r])
        at = int(cursors[rp])
        # The run ends where the last one began (a cursor outside the window: at the window's end)
        run = ((window.index(at) if at in window else 0) - take[r]) % len(window)
        for j in range(take[r]):
            chosen.append((r, window[(run + j) % len(window)]))
        if take[r]:
            cand = window[run]
            new_cursor[rp] = max(new_cursor.get(rp, cand), cand)
    for rp, c in new_cursor.items():
        cursors[rp] = c
    assert len(chosen) == C
    return chosen
