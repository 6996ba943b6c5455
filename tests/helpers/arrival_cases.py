"""Restores checked on arrival, shared blocks and forks (SPEC 4.1), on ``move_engine.Pool``.

:func:`restore` runs one restore: request 1 (16 tokens, four blocks of :data:`PAGE` slots at :data:`A`) is
offloaded (its rows gathered, its KV copied out), its slots reused, and its rows and KV scattered back into other
slots :data:`B`, with one of the faults of :data:`FAULTS` applied to what comes back (the tier returns the wrong
thing); then the request's next step verifies its prefix (the step's verify runs before the attention reads the
KV) and stores position 16, and a check verifies every layer once. :func:`shared_prefix` and :func:`fork` are a
block read by several requests and a fork whose partial block is copied (``RecordMover.copy``).
``tests/records/test_move_arrival.py`` asserts what SPEC 4.1 "Checked on arrival" predicts; the GPU backends are
compared with the reference there (``gpu``).
"""
from __future__ import annotations

import numpy as np

from canary.interop.hostcopy import to_host

from .move_engine import Pool

PAGE = 4  # slots per block; request 1's blocks are positions 0-3, 4-7, 8-11, 12-15
N = 16
A = list(range(10, 10 + N))  # request 1's slots before the offload (request 2's after it)
B = [52, 49, 61, 48, 57, 63, 50, 55, 60, 53, 58, 51, 62, 54, 59, 56]  # the restore's slots, as an allocator hands them
NEXT = 90  # request 1's first slot after the restore
HEAD = 16  # bytes per head: each token's NB = 32 bytes of source k are two heads

# name: what the tier hands back (block 1 = positions 4-7 unless the name says otherwise)
FAULTS = {
    "clean": "every block as it was offloaded",
    "stale": "block 1 as an earlier write left those slots: another request's tokens at the same positions",
    "stale_other_positions": "block 1 as an earlier write left those slots: another request's positions 2-5",
    "swapped": "blocks 1 and 2 restored into each other's places",
    "partial_unwritten": "block 1's last page (positions 6, 7) not restored; the destination was never written",
    "partial_tenant": "block 1's last page not restored; the destination holds a previous tenant's positions 6, 7",
    "foreign_layer": "block 1's K bytes (a source the records fold) those of another layer (of lk), records right",
    "foreign_heads": "block 1's two K heads in each other's places, records right",
    "foreign_second_head": "block 1's second K head (bytes 16-32 of each token) another layer's, records right",
    "foreign_rotation_layer": "block 1's bytes of rotation layer 1 those of layer 2, records right (needs layers)",
    "foreign_unfolded_layer": "block 1's bytes of a layer nothing folds (lk, no rotation) those of K",
    "wrong_key": "request 2's block 1 (its positions 4-7) in place of request 1's",
    "wrong_key_other_positions": "request 2's block 2 (its positions 8-11) in place of request 1's block 1",
    "wrong_key_whole": "request 2's whole prefix (every block, the same positions) in place of request 1's",
    "all_zero": "block 1's KV and records all zero",
    "all_zero_first": "block 0's KV and records all zero",
}
NEEDS_LAYERS = {"foreign_rotation_layer"}
NO_LAYERS = {"foreign_unfolded_layer"}


def _host(x) -> np.ndarray:
    return np.array(to_host(x))


def _blocks(k: int) -> slice:
    return slice(k * PAGE, (k + 1) * PAGE)


def _snapshot(pool: Pool, slots) -> tuple:
    """Rows and KV bytes of ``slots`` copied to host memory: what an offload leaves in the tier."""
    rows = pool.mover.allocate_rows(len(slots))
    pool.mover.gather(pool.slots(slots), rows)
    return _host(rows), [_host(a) for a in pool.kv_of(slots)]


def _prefill(pool: Pool, rp: int, slots, prompt: int) -> list:
    found = pool.step(rp, 0, list(slots[:prompt]))
    for p in range(prompt, len(slots)):
        found += pool.step(rp, p, [slots[p]])
    return found


def restore(fault: str, backend: str, xp=np, num_layers: int = 0, mode: str = "all", tokens: bool = True,
            pool: Pool | None = None) -> dict:
    """Run one restore with ``fault`` (a key of :data:`FAULTS`). Returns the rows (``Pool.found``) each phase
    found: ``before`` (everything up to the restore), ``arrival`` (the next step: verify of positions 0-15 and
    the store of position 16 at :data:`NEXT`), ``after`` (positions 0-16, every layer once), ``other`` (request
    2, which lives at :data:`A`). ``pool``: a fresh one of those arguments (default), or the caller's, to inspect
    afterwards."""
    if fault not in FAULTS:
        raise ValueError(fault)
    if pool is None:
        pool = Pool(backend, xp, num_layers=num_layers, mode=mode, expected_tokens=tokens)
    out = {"before": []}
    if fault == "partial_tenant":  # request 3 lived at B (the same positions in the same order) and finished
        out["before"] += _prefill(pool, 3, B, 12)
    # an earlier request (row 2) wrote A, in request 1's layout or shifted by two positions
    earlier = A[2:] + A[:2] if fault == "stale_other_positions" else A
    out["before"] += _prefill(pool, 2, earlier, N)
    old_rows, old_kv = _snapshot(pool, A[4:8])  # what those slots held: an earlier version of request 1's block 1
    out["before"] += _prefill(pool, 1, A, 12)  # request 1: a prompt of 12, then 4 decode steps
    rows, kv = _snapshot(pool, A)  # the offload
    out["before"] += _prefill(pool, 2, A, N)  # a new request in row 2 reuses the slots
    key_rows, key_kv = _snapshot(pool, A)

    dest = list(range(N))  # the positions restored
    b1, b2 = _blocks(1), _blocks(2)
    k, v, lk = kv
    if fault in ("stale", "stale_other_positions"):
        rows[b1] = old_rows
        k[b1], v[b1], lk[:, b1] = old_kv
    elif fault == "swapped":
        order = list(range(4)) + list(range(8, 12)) + list(range(4, 8)) + list(range(12, N))
        rows, k, v, lk = rows[order], k[order], v[order], lk[:, order]
    elif fault in ("partial_unwritten", "partial_tenant"):
        dest = [p for p in dest if p not in (6, 7)]
    elif fault == "foreign_layer":
        k[b1] = lk[-1, b1]
    elif fault == "foreign_heads":
        k[b1] = np.concatenate([k[b1, HEAD:], k[b1, :HEAD]], axis=1)
    elif fault == "foreign_second_head":
        k[b1, HEAD:] = lk[-1, b1, HEAD:]
    elif fault == "foreign_rotation_layer":
        if num_layers < 3:
            raise ValueError("foreign_rotation_layer needs num_layers >= 3")
        lk[1, b1] = lk[2, b1]
    elif fault == "foreign_unfolded_layer":
        if num_layers:
            raise ValueError("foreign_unfolded_layer is the case without the rotation")
        lk[0, b1] = k[b1]  # the folded layer's bytes in the place of the one nothing folds
    elif fault == "wrong_key":
        rows[b1] = key_rows[b1]
        k[b1], v[b1], lk[:, b1] = key_kv[0][b1], key_kv[1][b1], key_kv[2][:, b1]
    elif fault == "wrong_key_other_positions":
        rows[b1] = key_rows[b2]
        k[b1], v[b1], lk[:, b1] = key_kv[0][b2], key_kv[1][b2], key_kv[2][:, b2]
    elif fault == "wrong_key_whole":
        rows, (k, v, lk) = key_rows, key_kv
    elif fault in ("all_zero", "all_zero_first"):
        b = _blocks(0 if fault == "all_zero_first" else 1)
        rows[b], k[b], v[b], lk[:, b] = 0, 0, 0, 0

    a = xp.asarray
    slots = [B[p] for p in dest]
    pool.put_kv(slots, (a(k[dest]), a(v[dest]), a(lk[:, dest])))  # the KV copy in, then its records
    pool.mover.scatter(pool.slots(slots), a(np.ascontiguousarray(rows[dest])))
    pool.map(1, 0, B)
    out["arrival"] = pool.step(1, N, [NEXT])
    out["after"] = pool.check(1, N + 1)
    out["other"] = pool.check(2, N)
    return out


def tagged(pool: Pool) -> list:
    """The ring's rows since the last call, sorted, with the tokens: ``(slot, position, reason bits, stored token,
    expected token)``: which reader of a shared slot a row is about shows in its expected token."""
    pool.found()
    rows, pool.drained = pool.drained, []
    return sorted((v.slot, v.position, int(v.reasons), v.stored_token, v.expected_token) for v in rows)


S = list(range(10, 18))  # the shared block's slots: request 1's 8 tokens


def shared_prefix(pool: Pool, differ_at: int = 5) -> dict:
    """Request 1 writes 8 tokens at :data:`S`; rows 2 and 3 name the same slots (a prefix-cache hit), each with its
    own expected tokens: row 2's are request 1's, row 3's differ at position ``differ_at``. One verify of all
    three readers (``shared``), then each reader stores its own position 8 (``extend``), then a verify of the
    three (``after``). Rows as :func:`tagged` gives them."""
    assert pool.expected is not None
    out = {"before": pool.step(1, 0, S)}
    for rp in (2, 3):
        pool.map(rp, 0, S)
        pool.expected[rp, :8] = pool.expected[1, :8]
    pool.expected[3, differ_at] = pool.expected[1, differ_at] + 1
    pool.verify_rows([1, 2, 3], [8, 8, 8])
    out["shared"] = tagged(pool)
    for rp, slot in ((1, 18), (2, 70), (3, 71)):  # each reader's own next token, chained from the shared block
        pool.step(rp, 8, [slot])
    out["extend"] = tagged(pool)
    pool.verify_rows([1, 2, 3], [9, 9, 9])
    out["after"] = tagged(pool)
    return out


F = [80, 81]  # the child's copy of the parent's partial block


def fork(pool: Pool) -> dict:
    """Request 1 (the parent: 8 tokens, then 2 decoded, at ``A[:10]``) forks request 2: the child shares the full
    blocks (``A[:8]``, the same slots), and the partial block (``A[8:10]``) is copied into :data:`F`, records
    (``RecordMover.copy``) and KV; the child's expected tokens are the parent's. Both are verified
    (``forked``), then both write on (the child at 82, 83; the parent at ``A[10:12]``) with tokens of their own,
    and both are verified again (``after``)."""
    assert pool.expected is not None
    parent = A[:10]
    out = {"before": _prefill(pool, 1, parent, 8)}
    pool.mover.copy(pool.slots(parent[8:]), pool.slots(F))
    pool.move_kv(parent[8:], F)
    pool.map(2, 0, parent[:8] + F)
    pool.expected[2, :10] = pool.expected[1, :10]
    pool.verify_rows([1, 2], [10, 10])
    out["forked"] = tagged(pool)
    for rp, p, slot in ((2, 10, 82), (1, 10, A[10]), (2, 11, 83), (1, 11, A[11])):
        pool.step(rp, p, [slot])
    out["write"] = tagged(pool)
    pool.verify_rows([1, 2], [12, 12])
    out["after"] = tagged(pool)
    return out
