"""NumPy reference of the canary write and verify kernels and of the expected-token scatter (SPEC 4).

The executable form of ``docs/records.md``: the CUDA and Numba twins must leave the same canary buffer, the
same ring write index, the same counters and the same *set* of ring rows (GPU row order is decided by
atomics; this reference appends in the order documented below). Inputs are host NumPy arrays that have
already been validated (``canary.records.api`` does that); outputs are updated in place.

Vectorized: verify is one pass over the entries (then the failure bits of the few suspect ones); the write
chain is an affine recurrence, computed for every request at once by a log-step scan
(``hashes.chain_values``); everything that does not depend on the running hash (real-KV folds, asserts,
stores) is computed for all entries at once.
"""
from __future__ import annotations

import numpy as np

from ...contract.plans import MISSING_SLOT, SKIP_SEED
from ...contract.hashes import ANCHOR_LINK, MASK64, chain_step_u64, chain_values
from ...contract.realkv import RealKV, rows_of, fold
from ...contract.state import StateViews
from ..args import DEFAULT_LAUNCH, LaunchConfig
from ...contract.ring import (
    POSITION,
    PREV_HASH,
    REAL_KV_HASH,
    RING_ROW_WORDS,
    TOKEN,
    CheckFlags,
    FailReason,
    KernelTag,
    append_rows,
    encode_tag,
)

NAME = "reference"
ON_DEVICE = False

_I64 = np.int64


def _ranges(starts: np.ndarray, lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Concatenated ``[starts[r], starts[r] + lens[r])`` and the owner ``r`` of each element."""
    lens = np.maximum(lens, 0)
    total = int(lens.sum())
    owner = np.repeat(np.arange(lens.shape[0], dtype=_I64), lens)
    first = np.cumsum(lens) - lens
    return starts[owner] + (np.arange(total, dtype=_I64) - first[owner]), owner


def ring_rows(tag: int, *cols: np.ndarray) -> np.ndarray:
    """``[n, RING_ROW_WORDS]`` int64 ring rows: word 0 ``tag``, words 1.. the ``[n]`` columns ``cols`` in order."""
    n = cols[0].shape[0]
    out = np.empty((n, RING_ROW_WORDS), dtype=_I64)
    out[:, 0] = tag
    for j, c in enumerate(cols, start=1):
        out[:, j] = c
    return out


def gather_fields(fields: np.ndarray, slots: np.ndarray, ok: np.ndarray) -> np.ndarray:
    """``fields[slots]`` where ``ok``, zeros elsewhere (never reads out of bounds)."""
    rec = rows_of(fields, np.where(ok, slots, 0))
    rec[~ok] = 0
    return rec


def unreported(state: StateViews, slot: np.ndarray, prev: np.ndarray) -> np.ndarray:
    """Which of these failing verify rows the ring takes (SPEC 4, reported slots): a slot's row unless its byte
    has bit 1; a MISSING row unless its in-range predecessor's byte has bit 2; any other row always."""
    rep = state.reported_slots.host
    n = state.num_slots
    in_range = (slot >= 0) & (slot < n)
    keep = ~in_range | ((rep[np.where(in_range, slot, 0)] & 1) == 0)
    missing = slot == MISSING_SLOT
    prev_in = (prev >= 0) & (prev < n)
    keep &= ~(missing & prev_in) | ((rep[np.where(prev_in, prev, 0)] & 2) == 0)
    return keep


def _link_of(fields_rows: np.ndarray) -> np.ndarray:
    """``link`` of each gathered record ``[n, 4]`` (uint64; SPEC 4)."""
    return chain_step_u64(fields_rows[:, PREV_HASH], fields_rows[:, TOKEN], fields_rows[:, POSITION])


def _links(fields: np.ndarray, num_slots: int, slot: np.ndarray, slot_ok: np.ndarray, rec: np.ndarray,
           prev: np.ndarray, first_slot: int = 1) -> np.ndarray:
    """``link`` of each entry: the link of its predecessor's record when ``prev`` is a slot (in ``[first_slot,
    num_slots)``: 1, or 0 when slot 0 is real), else ``ANCHOR_LINK``.

    An entry's predecessor is nearly always the previous entry's slot (a request's positions in order), whose
    record is already in ``rec``: those links come from one ``link`` over ``rec``, shifted by one, and only the
    other entries (each request's first, sampled windows) gather their predecessor's record."""
    n = slot.shape[0]
    link = np.empty(n, dtype=np.uint64)
    if n > 1:
        link[1:] = _link_of(rec[:-1])
    reuse = np.zeros(n, dtype=bool)
    reuse[1:] = (prev[1:] == slot[:-1]) & slot_ok[:-1]  # slot_ok: rec holds the real record, not zeros
    other = np.flatnonzero(~reuse)
    p = prev[other]
    inside = (p >= first_slot) & (p < num_slots)
    anchor = np.uint64(ANCHOR_LINK & MASK64)
    if inside.any():
        link[other] = np.where(inside, _link_of(rows_of(fields, np.where(inside, p, 0))), anchor)
    else:
        link[other] = anchor
    return link.view(_I64)


def verify(
    state: StateViews,
    *,
    verify_slot_indices: np.ndarray,
    verify_expected_tokens: np.ndarray,
    verify_expected_positions: np.ndarray,
    verify_prev_slot_indices: np.ndarray,
    verify_num_valid: np.ndarray,
    enable: np.ndarray,
    real_kv: RealKV,
    launch_tag: int = 0,
) -> None:
    """One verify launch (docs/records.md, "Verify").

    Two passes: every check reduced to one "suspect" mask over all entries (cheap comparisons), then the
    failure bits computed exactly on the suspects alone (a clean step has almost none)."""
    kernel_runs = state.host("kernel_run_counter")
    slot_runs = state.host("slot_run_counter")
    ci = KernelTag.VERIFY.counter_index
    kernel_runs[ci] += 1  # every launch counts, enabled or not
    if int(enable[0]) == 0:
        return
    fields = state.fields
    num_slots = state.num_slots
    cap = verify_slot_indices.shape[0]
    n = min(max(int(verify_num_valid[0]), 0), cap)
    # SPEC 4: slot 0 (padding) is skipped, not processed, unless slot 0 is real (padding_slot=-1), and the
    # predecessor that has no link is 0, or MISSING_SLOT when slot 0 is real.
    real0 = state.padding_slot == -1
    first_slot, no_link = (0, MISSING_SLOT) if real0 else (1, 0)
    nonzero = np.ones(n, dtype=bool) if real0 else verify_slot_indices[:n] != 0
    count = int(np.count_nonzero(nonzero))
    slot_runs[ci] += count
    if count == 0:
        return
    if count == n:  # no padding entry: views, not copies
        slot, prev = verify_slot_indices[:n], verify_prev_slot_indices[:n]
        exp_pos, exp_tok = verify_expected_positions[:n], verify_expected_tokens[:n]
    else:
        live = np.flatnonzero(nonzero)
        slot, prev = verify_slot_indices[live], verify_prev_slot_indices[live]
        exp_pos, exp_tok = verify_expected_positions[live], verify_expected_tokens[live]
    flags = CheckFlags(int(state.host("check_flags")[0]) & int(CheckFlags.WRITE_POSITION_CHAIN | CheckFlags.VERIFY_TOKEN))

    all_ok = int(slot.min()) >= first_slot and int(slot.max()) < num_slots
    if all_ok:
        slot_ok = np.ones(count, dtype=bool)
        rec = rows_of(fields, slot)
    else:
        slot_ok = (slot >= first_slot) & (slot < num_slots)
        rec = gather_fields(fields, slot, slot_ok)
    link = _links(fields, num_slots, slot, slot_ok, rec, prev, first_slot)
    check_token = CheckFlags.VERIFY_TOKEN in flags
    fresh = None
    if real_kv.active:
        fresh = fold(real_kv, slot) if all_ok else np.where(slot_ok, fold(real_kv, np.where(slot_ok, slot, 0)), 0)

    # A superset of the failing entries: every failure bit below needs one of these.
    suspect = rec[:, PREV_HASH] != link
    suspect |= rec[:, POSITION] != exp_pos
    if check_token:
        suspect |= rec[:, TOKEN] != exp_tok
    if fresh is not None:
        suspect |= rec[:, REAL_KV_HASH] != fresh
    if not all_ok:
        suspect |= ~slot_ok
    if int(prev.min()) < -1 or int(prev.max()) >= num_slots:  # a predecessor that is no slot, -1 or 0
        suspect |= (prev < -1) | (prev >= num_slots)
    at = np.flatnonzero(suspect)
    if at.shape[0] == 0:
        return
    slot, prev, exp_pos, exp_tok, rec, link = slot[at], prev[at], exp_pos[at], exp_tok[at], rec[at], link[at]
    slot_ok = slot_ok[at]
    prev_in = (prev >= first_slot) & (prev < num_slots)
    prev_none = prev == -1
    prev_bad = ~(prev_in | prev_none | (prev == no_link))

    missing = slot == MISSING_SLOT  # the position has no SWA slot at all (SPEC 3.2): nothing is read
    bits = np.where(slot_ok, 0, np.where(missing, int(FailReason.MISSING), int(FailReason.SLOT_RANGE))).astype(_I64)
    chain_checked = slot_ok & (prev_in | prev_none)
    # A MISSING row's expected_aux is the entry's predecessor slot: the request's own slot, which names it
    expected_link = np.where(chain_checked, link, np.where(missing, prev, 0))
    bits |= np.where(chain_checked & (rec[:, PREV_HASH] != link), int(FailReason.CHAIN), 0)
    bits |= np.where(slot_ok & prev_bad, int(FailReason.SLOT_RANGE), 0)
    bits |= np.where(slot_ok & (rec[:, POSITION] != exp_pos), int(FailReason.POSITION), 0)
    if check_token:
        bits |= np.where(slot_ok & (exp_tok != -1) & (rec[:, TOKEN] != exp_tok), int(FailReason.VERIFY_TOKEN), 0)
    if fresh is not None:
        bits |= np.where(slot_ok & (rec[:, REAL_KV_HASH] != fresh[at]), int(FailReason.REAL_KV), 0)

    bad = np.flatnonzero(bits)
    if bad.shape[0] and state.reported_slots is not None:
        bad = bad[unreported(state, slot[bad], prev[bad])]
    if bad.shape[0]:
        rows = ring_rows(encode_tag(KernelTag.VERIFY, launch_tag), slot[bad], exp_pos[bad], rec[bad, TOKEN],
                         exp_tok[bad], rec[bad, PREV_HASH], expected_link[bad], bits[bad])
        append_rows(state.host("ring"), state.host("ring_write_index"), rows)


def write(
    state: StateViews,
    *,
    write_offsets: np.ndarray,
    write_seed_slot_indices: np.ndarray,
    write_num_valid_reqs: np.ndarray,
    out_cache_loc: np.ndarray,
    input_ids: np.ndarray,
    positions: np.ndarray,
    expected_input_ids: np.ndarray | None,
    expected_positions: np.ndarray | None,
    real_kv: RealKV,
    launch_tag: int = 0,
) -> None:
    """One write launch (docs/records.md, "Write"). The token arrays are int32 or int64 each: read widened to int64
    (SPEC 2 (*)), which is what the kernels' load_int reads."""
    out_cache_loc, input_ids, positions = (np.asarray(a).astype(_I64) for a in (out_cache_loc, input_ids, positions))
    if expected_input_ids is not None:
        expected_input_ids = np.asarray(expected_input_ids).astype(_I64)
    if expected_positions is not None:
        expected_positions = np.asarray(expected_positions).astype(_I64)
    kernel_runs = state.host("kernel_run_counter")
    slot_runs = state.host("slot_run_counter")
    ci = KernelTag.WRITE.counter_index
    kernel_runs[ci] += 1
    fields = state.fields
    num_slots = state.num_slots
    r_cap = write_seed_slot_indices.shape[0]
    nreq = min(max(int(write_num_valid_reqs[0]), 0), r_cap)
    n_entries = out_cache_loc.shape[0]
    flags = CheckFlags(int(state.host("check_flags")[0]) & int(CheckFlags.WRITE_POSITION_CHAIN | CheckFlags.VERIFY_TOKEN))

    # Request r owns entries [start, end) clamped to [0, n_entries); a reversed range is empty, and so is the
    # range of a request seeded SKIP_SEED (a padding row's tokens: its slots may belong to someone else now).
    starts = np.clip(write_offsets[:nreq], 0, n_entries)
    ends = np.clip(write_offsets[1 : nreq + 1], 0, n_entries)
    ends = np.where(write_seed_slot_indices[:nreq] == SKIP_SEED, starts, ends)
    idx, req = _ranges(starts, ends - starts)
    slot = out_cache_loc[idx]
    keep = slot >= 0  # slot < 0: "skip this write", not processed
    idx, req, slot = idx[keep], req[keep], slot[keep]
    slot_runs[ci] += idx.shape[0]

    # Seeds are read before anything is stored (a GPU block reads its seed first).
    seed = write_seed_slot_indices[:nreq]
    seed_ok = (seed >= 0) & (seed < num_slots)
    srec = gather_fields(fields, seed, seed_ok)
    running0 = np.where(seed_ok, _link_of(srec).view(_I64), _I64(ANCHOR_LINK))
    seed_pos = np.where(seed_ok, srec[:, POSITION], -1)
    if idx.shape[0] == 0:
        return

    tok = input_ids[idx]
    pos = positions[idx]
    stored = slot < num_slots
    counts = np.bincount(req[stored], minlength=nreq).astype(_I64)
    run = chain_values(running0, counts, tok[stored], pos[stored])
    base = np.cumsum(counts + 1) - (counts + 1)
    # ks: stored entries of the same request before each entry; stored_before(r) = first[r].
    first = np.cumsum(counts) - counts
    ks = (np.cumsum(stored) - stored) - first[req]
    running = run[base[req] + ks].view(_I64)
    stored_pos = pos[stored]
    prev_pos = np.where(ks > 0, stored_pos[np.maximum(first[req] + ks - 1, 0)] if stored_pos.size else 0,
                        seed_pos[req])

    bits = np.where(stored, 0, int(FailReason.SLOT_RANGE)).astype(_I64)
    exp_tok = np.full(idx.shape[0], -1, dtype=_I64)
    if expected_input_ids is not None:
        exp_tok = expected_input_ids[idx].astype(_I64)
        bits |= np.where((exp_tok != -1) & (tok != exp_tok), int(FailReason.WRITE_TOKEN), 0)
    has_exp_pos = np.zeros(idx.shape[0], dtype=bool)
    exp_pos = np.full(idx.shape[0], -1, dtype=_I64)
    if expected_positions is not None:
        exp_pos = expected_positions[idx].astype(_I64)
        has_exp_pos = exp_pos != -1
    arr_fail = has_exp_pos & (pos != exp_pos)
    chain_on = CheckFlags.WRITE_POSITION_CHAIN in flags
    with np.errstate(over="ignore"):
        chain_exp = prev_pos + 1  # int64 wraparound, as on the GPU
    chain_fail = (pos != chain_exp) if chain_on else np.zeros(idx.shape[0], dtype=bool)
    bits |= np.where(arr_fail | chain_fail, int(FailReason.WRITE_POSITION), 0)
    aux = np.where(arr_fail, exp_pos,
                   np.where(chain_fail, chain_exp,
                            np.where(has_exp_pos, exp_pos, chain_exp if chain_on else -1)))

    # Stores: in request-major entry order, so a slot written twice keeps its last write.
    st = np.flatnonzero(stored)
    if st.shape[0]:
        kv_hash = fold(real_kv, slot[st])
        last = st.shape[0] - 1 - np.unique(slot[st][::-1], return_index=True)[1]
        w = st[last]
        fields[slot[w], TOKEN] = tok[w]
        fields[slot[w], POSITION] = pos[w]
        fields[slot[w], PREV_HASH] = running[w]
        fields[slot[w], REAL_KV_HASH] = kv_hash[last]

    bad = np.flatnonzero(bits)
    if bad.shape[0]:
        rows = ring_rows(encode_tag(KernelTag.WRITE, launch_tag), slot[bad], pos[bad], tok[bad], exp_tok[bad],
                         running[bad], aux[bad], bits[bad])
        append_rows(state.host("ring"), state.host("ring_write_index"), rows)


def scatter_expected_tokens(
    *,
    req_to_verify_expected_tokens: np.ndarray,
    req_pool_indices: np.ndarray,
    tokens: np.ndarray,
    token_offsets: np.ndarray,
    column_starts: np.ndarray,
    column_offset: int = 0,
) -> None:
    """``pool[rp[r], column_starts[r] + column_offset + j] = tokens[token_offsets[r] + j]`` (docs/records.md)."""
    pool = req_to_verify_expected_tokens
    bs = req_pool_indices.shape[0]
    pool_rows, pool_cols = pool.shape
    n_tok = tokens.shape[0]
    rp = req_pool_indices
    row_ok = (rp > 0) & (rp < pool_rows)
    starts = np.clip(token_offsets[:bs], 0, n_tok)
    ends = np.clip(token_offsets[1 : bs + 1], 0, n_tok)
    lens = np.where(row_ok, ends - starts, 0)
    src, r = _ranges(starts, lens)
    with np.errstate(over="ignore"):
        col = column_starts[r] + int(column_offset) + (src - starts[r])
    ok = (col >= 0) & (col < pool_cols)
    pool[rp[r[ok]], col[ok]] = tokens[src[ok]].astype(np.int32)  # low 32 bits (a C cast)


class Bound:
    """The reference behind :class:`canary.CanaryRecords` (the backend seam of docs/records.md 8)."""

    def __init__(self, state: StateViews, real_kv: RealKV, launch: LaunchConfig = DEFAULT_LAUNCH):
        self.state = state
        self.real_kv = real_kv

    def warmup(self) -> None:
        pass

    def write(self, a, stream: int = 0) -> None:
        write(self.state, write_offsets=a.plan.write_offsets.host, write_seed_slot_indices=a.plan.write_seed_slot_indices.host,
              write_num_valid_reqs=a.plan.write_num_valid_reqs.host, out_cache_loc=a.out_cache_loc.host,
              input_ids=a.input_ids.host, positions=a.positions.host,
              expected_input_ids=None if a.expected_input_ids is None else a.expected_input_ids.host,
              expected_positions=None if a.expected_positions is None else a.expected_positions.host,
              real_kv=self.real_kv, launch_tag=a.launch_tag)

    def verify(self, a, stream: int = 0) -> None:
        verify(self.state, verify_slot_indices=a.plan.verify_slot_indices.host,
               verify_expected_tokens=a.plan.verify_expected_tokens.host,
               verify_expected_positions=a.plan.verify_expected_positions.host,
               verify_prev_slot_indices=a.plan.verify_prev_slot_indices.host, verify_num_valid=a.plan.verify_num_valid.host,
               enable=a.plan.enable.host, real_kv=self.real_kv, launch_tag=a.launch_tag)


def bind(state: StateViews, real_kv: RealKV, launch: LaunchConfig = DEFAULT_LAUNCH) -> Bound:
    return Bound(state, real_kv, launch)


def scatter(a, stream: int = 0) -> None:
    scatter_expected_tokens(req_to_verify_expected_tokens=a.pool.host, req_pool_indices=a.req_pool_indices.host,
                            tokens=a.tokens.host, token_offsets=a.token_offsets.host,
                            column_starts=a.column_starts.host, column_offset=a.column_offset)
