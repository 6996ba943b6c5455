"""Restores checked on arrival, shared blocks and forks (SPEC 4.1 "Checked on arrival", "Shared blocks").

A restore scatters a request's records and KV into new slots; the request's next step verifies its prefix before
the attention reads the KV. Each fault of ``tests/helpers/arrival_cases.py`` (a stale block, two blocks swapped, a
block's last page missing, another layer's or head's bytes, another request's block, all zeros) is reported with
the reasons SPEC 4.1 predicts, at the restored slots only, and a clean restore reports nothing; the faults that
the current semantics cannot see are ``xfail(strict=True)`` with the reason. A block read by several requests is
verified against each reader's expected tokens; a fork's copied block carries its records and the child writes
on from them. The reference here; both GPU backends find exactly what it finds (``gpu``)."""
from __future__ import annotations

import pytest
from helpers import arrival_cases as ac
from helpers import move_engine as me

from canary import FailReason
from canary.contract.hashes import link

C, P, K, T = (int(FailReason.CHAIN), int(FailReason.POSITION), int(FailReason.REAL_KV),
              int(FailReason.VERIFY_TOKEN))
BLOCK1 = range(4, 8)
NUM_LAYERS = 3

# What the records' verify reports, position -> reasons, with the expected-token pool (SPEC 4.1's table)
RECORDS = {
    "clean": {},
    "stale": {4: C | T, 5: T, 6: T, 7: T, 8: C},
    "stale_other_positions": {4: C | P | T, 5: P | T, 6: P | T, 7: P | T, 8: C},
    "swapped": {4: C | P | T, 5: P | T, 6: P | T, 7: P | T, 8: C | P | T, 9: P | T, 10: P | T, 11: P | T, 12: C},
    "partial_unwritten": {6: C | P | K | T, 7: P | K | T, 8: C},
    "partial_tenant": {6: C | T, 7: T, 8: C},
    "foreign_layer": {p: K for p in BLOCK1},
    "foreign_heads": {p: K for p in BLOCK1},
    "foreign_second_head": {p: K for p in BLOCK1},  # mode ALL; PARTIAL: nothing (xfail below)
    "foreign_rotation_layer": {},
    "foreign_unfolded_layer": {},  # nothing reads those bytes (xfail below)
    "wrong_key": {4: C | T, 5: T, 6: T, 7: T, 8: C},
    "wrong_key_other_positions": {4: C | P | T, 5: P | T, 6: P | T, 7: P | T, 8: C},
    "wrong_key_whole": {p: T for p in range(ac.N)},  # without the pool: nothing (xfail below)
    "all_zero": {4: C | P | K | T, 5: P | K | T, 6: P | K | T, 7: P | K | T, 8: C},
    "all_zero_first": {0: C | K | T, 1: P | K | T, 2: P | K | T, 3: P | K | T, 4: C},
}
# What the rotation's verify_layer reports (REAL_KV rows of kind VERIFY_LAYER): (position, layer) pairs
LAYERS = {
    "partial_unwritten": {(p, layer) for p in (6, 7) for layer in range(NUM_LAYERS)},
    "foreign_rotation_layer": {(p, 1) for p in BLOCK1},
    "all_zero": {(p, layer) for p in BLOCK1 for layer in range(NUM_LAYERS)},
    "all_zero_first": {(p, layer) for p in range(4) for layer in range(NUM_LAYERS)},
}
assert set(RECORDS) == set(ac.FAULTS)

PARTIAL_BLIND = ("mode PARTIAL folds only the first 16 bytes of each token of each source (SPEC 4, real-KV fold): "
                 "a foreign second head (bytes 16-32) is never read")
UNFOLDED = ("no rotation and no records source covers that layer (SPEC 4: the records fold their sources only; "
            "the layer rotation is what folds every layer): nothing reads its bytes")
SELF_CONSISTENT = ("another request's whole prefix at the same positions is a self-consistent chain with its own "
                   "KV (SPEC 4.1): without an expected-token pool nothing tells it from the request's own")


def expected_records(fault: str, mode: str, tokens: bool) -> dict:
    want = dict(RECORDS[fault])
    if fault == "foreign_second_head" and mode == "partial":
        want = {}
    if not tokens:  # no pool: every expected token is -1, the token check is skipped
        want = {p: bits & ~T for p, bits in want.items() if bits & ~T}
    return want


def _slot(position: int) -> int:
    return ac.B[position] if position < ac.N else ac.NEXT


def records_of(rows) -> dict:
    """Verify rows as ``{position: reasons}``; each row at the slot the restore put that position in, and a
    position found twice found with the same reasons."""
    out: dict = {}
    for kind, slot, pos, bits, _ in rows:
        if kind != me.VERIFY:
            continue
        assert slot == _slot(pos), (slot, pos)
        assert out.setdefault(pos, bits) == bits, (pos, out[pos], bits)
    return out


def layers_of(rows) -> set:
    found = set()
    for kind, slot, pos, bits, layer in rows:
        if kind == me.VERIFY_LAYER:
            assert slot == _slot(pos) and bits == K, (slot, pos, bits)
            found.add((pos, layer))
    return found


def _cases():
    for fault in ac.FAULTS:
        for num_layers in (0, NUM_LAYERS):
            if (fault in ac.NEEDS_LAYERS and not num_layers) or (fault in ac.NO_LAYERS and num_layers):
                continue
            for mode in ("all", "partial"):
                for tokens in (True, False):
                    marks = []
                    if fault == "foreign_second_head" and mode == "partial":
                        marks = [pytest.mark.xfail(strict=True, reason=PARTIAL_BLIND)]
                    elif fault == "foreign_unfolded_layer":
                        marks = [pytest.mark.xfail(strict=True, reason=UNFOLDED)]
                    elif fault == "wrong_key_whole" and not tokens:
                        marks = [pytest.mark.xfail(strict=True, reason=SELF_CONSISTENT)]
                    name = f"{fault}-L{num_layers}-{mode}-{'tokens' if tokens else 'notokens'}"
                    yield pytest.param(fault, num_layers, mode, tokens, id=name, marks=marks)


@pytest.mark.parametrize("fault, num_layers, mode, tokens", list(_cases()))
def test_a_restore_is_checked_on_arrival(fault, num_layers, mode, tokens):
    out = ac.restore(fault, "reference", num_layers=num_layers, mode=mode, tokens=tokens)
    assert out["before"] == [] and out["other"] == []  # nothing before the restore, nothing at request 2's slots
    if fault != "clean":
        assert out["arrival"] + out["after"], f"{fault}: nothing reported"
    arrival = records_of(out["arrival"])
    assert arrival == expected_records(fault, mode, tokens)
    assert records_of(out["after"]) == arrival  # every layer's check: the same rows, position 16 clean
    assert layers_of(out["arrival"] + out["after"]) == (LAYERS.get(fault, set()) if num_layers else set())


def test_the_next_step_verifies_before_it_stores_and_chains_on_from_the_restored_records():
    """The arrival step's rows are verify rows of positions 0-15 only (its verify ran before its store), and the
    record it stores at position 16 links to the restored record of position 15 (SPEC 4.1: nothing re-keyed)."""
    assert all(kind == me.VERIFY and pos < ac.N for kind, _, pos, _, _ in ac.restore("stale", "reference")["arrival"])
    pool = me.Pool("reference", expected_tokens=True)
    assert all(rows == [] for rows in ac.restore("clean", "reference", pool=pool).values())
    seed, new = pool.fields([ac.B[15], ac.NEXT])
    assert int(seed[1]) == 15 and int(new[1]) == 16
    assert int(new[2]) == int(link(ac.B[15], seed[2], seed[0], seed[1]))


# -- shared blocks and forks ---------------------------------------------------------------------------------------

def test_a_shared_block_is_verified_against_each_readers_tokens():
    pool = me.Pool("reference", expected_tokens=True)
    out = ac.shared_prefix(pool, differ_at=5)
    assert out["before"] == []
    token = int(pool.expected[1, 5])
    row = (ac.S[5], 5, T, token, token + 1)  # reader 3's expected token: the row is about reader 3
    assert out["shared"] == [row]
    assert out["extend"] == [row]  # reader 3's own next step verifies its prefix again; readers 1, 2 store clean
    assert out["after"] == [row]
    # the readers' positions 8 chain from the shared record, each with its own token
    shared = pool.fields([ac.S[7]])[0]
    for slot in (18, 70, 71):
        new = pool.fields([slot])[0]
        assert int(new[1]) == 8 and int(new[2]) == int(link(ac.S[7], shared[2], shared[0], shared[1]))


@pytest.mark.parametrize("differ_at", [0, 7])
def test_only_the_reader_whose_tokens_differ_is_reported(differ_at):
    pool = me.Pool("reference", expected_tokens=True)
    out = ac.shared_prefix(pool, differ_at=differ_at)
    token = int(pool.expected[1, differ_at])
    assert out["shared"] == out["after"] == [(ac.S[differ_at], differ_at, T, token, token + 1)]


def test_a_forks_copied_block_carries_its_records_and_the_child_writes_on():
    pool = me.Pool("reference", expected_tokens=True)
    out = ac.fork(pool)
    assert all(v == [] for v in out.values()), out
    parent, child = pool.fields(ac.A[8:12]), pool.fields(ac.F + [82, 83])
    assert (child[:2] == parent[:2]).all()  # the copied records, verbatim
    # the child's position 10 links to its copy of position 9; the copy is the parent's record, so both link alike
    assert int(child[2, 2]) == int(link(ac.F[1], child[1, 2], child[1, 0], child[1, 1])) == int(parent[2, 2])
    assert int(child[3, 2]) == int(link(82, child[2, 2], child[2, 0], child[2, 1]))
    assert [int(child[i, 0]) for i in (2, 3)] == [int(t) for t in pool.expected[2, 10:12]]  # the child's tokens
    assert [int(parent[i, 0]) for i in (2, 3)] == [int(t) for t in pool.expected[1, 10:12]]


def test_a_child_whose_expected_tokens_differ_is_reported_the_parent_not():
    pool = me.Pool("reference", expected_tokens=True)
    ac.fork(pool)
    pool.expected[2, 3] += 1  # the child's pool row says another token at a shared position
    pool.verify_rows([1, 2], [12, 12])
    token = int(pool.expected[1, 3])
    assert ac.tagged(pool) == [(ac.A[3], 3, T, token, token + 1)]


# -- the GPU backends ---------------------------------------------------------------------------------------------

def _gpu_cases():
    for fault in ac.FAULTS:
        for num_layers in (0, NUM_LAYERS):
            if (fault in ac.NEEDS_LAYERS and not num_layers) or (fault in ac.NO_LAYERS and num_layers):
                continue
            yield fault, num_layers, "all", True
    yield "foreign_second_head", 0, "partial", True
    yield "wrong_key_whole", 0, "all", False


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cupy", "numba"])
@pytest.mark.parametrize("fault, num_layers, mode, tokens", list(_gpu_cases()))
def test_gpu_backends_find_what_the_reference_finds(backend, fault, num_layers, mode, tokens):
    cupy = pytest.importorskip("cupy")
    kw = dict(num_layers=num_layers, mode=mode, tokens=tokens)
    assert ac.restore(fault, backend, cupy, **kw) == ac.restore(fault, "reference", **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cupy", "numba"])
@pytest.mark.parametrize("scenario", ["shared_prefix", "fork"])
def test_gpu_backends_share_and_fork_as_the_reference_does(backend, scenario):
    cupy = pytest.importorskip("cupy")
    run = getattr(ac, scenario)
    assert run(me.Pool(backend, cupy, expected_tokens=True)) == run(me.Pool("reference", expected_tokens=True))
