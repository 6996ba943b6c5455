"""Records that move, end to end (SPEC 4.1): requests written through the planner and the canary, their KV and
records moved as an engine moves them (offload and restore, copy-on-write, defragmentation), then verified through
the planner with the index naming the new slots. Moved together they verify clean and decode on; the KV moved
without its records, records in the wrong slots, or records without their KV are reported. The scenarios are
``tests/helpers/move_engine.py``'s; the reference here, the Numba twins in ``move_sim_suite.py`` (simulator) and
both GPU backends below (``gpu``) find exactly what the reference finds."""
from __future__ import annotations

import pytest
from helpers import move_engine as me

from canary import FailReason

CHAIN, POSITION, REAL_KV = int(FailReason.CHAIN), int(FailReason.POSITION), int(FailReason.REAL_KV)


def _run(name: str) -> dict:
    return me.run_scenario(name, "reference")


@pytest.mark.parametrize("name", ["offload_restore", "offload_restore_layers", "cow_fork", "defrag_down",
                                  "defrag_up"])
def test_kv_and_records_moved_together_verify_clean(name):
    found = _run(name)
    assert all(rows == [] for rows in found.values()), found


def test_the_restore_chains_on_from_the_moved_records():
    """The decode after the restore seeds its chain from the new slot of position 9, which holds the moved record:
    the token stored at slot 50 links to it (SPEC 4.1: nothing re-keyed, the chain continues)."""
    from canary.contract.hashes import link

    pool = me.Pool("reference")
    assert me.offload_restore(pool)["decode"] == []
    seed, new = pool.fields([me.B[9], 50])
    assert int(seed[1]) == 9 and int(new[1]) == 10
    assert int(new[2]) == int(link(me.B[9], seed[2], seed[0], seed[1]))


def test_kv_moved_without_its_records_is_reported():
    found = _run("kv_moved_records_not")
    assert found["before"] == [] and found["reuse"] == [] and found["other"] == []
    rows = found["restored"]
    # B holds never-written records: REAL_KV everywhere, POSITION past position 0, CHAIN at position 0.
    assert sorted((slot, pos) for _, slot, pos, _, _ in rows) == sorted(zip(me.B, range(10)))
    for _, slot, pos, bits, _ in rows:
        assert bits & REAL_KV
        assert bool(bits & POSITION) == (pos > 0)
        assert bool(bits & CHAIN) == (pos == 0)


def test_records_in_the_wrong_slots_are_reported():
    rows = _run("records_swapped")["restored"]
    by_pos = {pos: bits for _, _, pos, bits, _ in rows}
    assert set(by_pos) == {3, 4, 5}  # the swapped pair, and the position whose predecessor changed
    assert by_pos[3] & POSITION and by_pos[4] & POSITION and by_pos[3] & REAL_KV and by_pos[4] & REAL_KV
    assert by_pos[4] & CHAIN and by_pos[5] == CHAIN


def test_records_moved_without_their_kv_are_reported():
    rows = _run("records_moved_kv_not")["restored"]
    assert sorted((slot, pos, bits) for _, slot, pos, bits, _ in rows) == sorted(
        (s, p, REAL_KV) for s, p in zip(me.B, range(10)))


def test_a_layer_table_left_behind_is_reported_by_the_rotation():
    found = _run("layer_table_left_behind")
    layer_rows = [r for r in found["restored"] if r[0] == me.VERIFY_LAYER]
    assert [r for r in found["restored"] if r[0] != me.VERIFY_LAYER] == []  # the records themselves moved
    assert sorted({(slot, layer) for _, slot, _, _, layer in layer_rows}) == sorted(
        (s, layer) for s in me.B for layer in range(3))
    assert all(bits == REAL_KV for _, _, _, bits, _ in layer_rows)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cupy", "numba"])
@pytest.mark.parametrize("name", me.SCENARIOS)
def test_gpu_backends_find_what_the_reference_finds(backend, name):
    cupy = pytest.importorskip("cupy")
    assert me.run_scenario(name, backend, cupy) == _run(name)
