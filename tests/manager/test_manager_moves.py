"""The manager's record moves (SPEC 4.1, canary/manager/moves.py; docs/integration.md 7b) on the reference backend:
an offload then a restore into other slots, a copy-on-write fork, a restore into the wrong slots (reported, naming
the request), out-of-range slots counted in ``stats()["move_faults"]``, argument errors, a group rotating layers,
and the layer table kept across ``rebind``. One ``gpu`` test runs the round trip on CuPy with pinned host rows."""
from __future__ import annotations

import threading

import numpy as np
import pytest
from helpers.manager_engine import NUM_SLOTS, ToyEngine

from canary import FailReason, to_host


def _engine(got: list, **kw) -> ToyEngine:
    e = ToyEngine(on_violation=got.append, **kw)
    e.add("a", [5, 6, 7, 8])
    e.add("b", [9, 10])
    for _ in range(3):
        e.decode_step(["a", "b"])
    return e


def _slots(e: ToyEngine, rid) -> list:
    return [e.slot_of(rid, p) for p in range(e.reqs[rid]["kv_len"])]


def _point(e: ToyEngine, rid, slots) -> None:
    """The engine's index names ``slots`` for ``rid``'s positions (after its KV moved there)."""
    row = e.reqs[rid]["row"]
    e.r2t_host[row, :len(slots)] = slots
    e.req_to_token[row, :len(slots)] = e.xp.asarray(np.asarray(slots, dtype=np.int32))


def _copy_kv(e: ToyEngine, src, dst, group: str = "full") -> None:
    """The engine's KV copy, every layer: ``dst[i]`` gets ``src[i]``'s K and V bytes."""
    k, v = e.layers[group]
    s, d = e.xp.asarray(np.asarray(src)), e.xp.asarray(np.asarray(dst))
    k[:, d] = k[:, s]
    v[:, d] = v[:, s]


def _new_slots(e: ToyEngine, n: int) -> list:
    return [e.free_slots.pop() for _ in range(n)]  # from the far end of the free list: unused so far


def _records(e: ToyEngine, slots, group: int = 0) -> np.ndarray:
    return np.array(to_host(e.manager.groups[group].state.canary_buffer))[np.asarray(slots)]


def _offload_restore(e: ToyEngine, rid, order=None, *, group=None, pinned=True) -> tuple[list, list]:
    """Offload ``rid``'s records (and KV) to host rows, then restore them into new slots (``order``: the rows'
    order of the scatter, a wrong restore when not the identity). Returns (old slots, new slots)."""
    m = e.manager
    old = _slots(e, rid)
    rows = m.allocate_record_rows(len(old), group=group, pinned=pinned)
    m.gather_records(np.array(old, dtype=np.int64), rows, group=group)
    new = _new_slots(e, len(old))
    _copy_kv(e, old, new)
    at = new if order is None else [new[i] for i in order]
    m.scatter_records(rows, np.array(at, dtype=np.int32), group=group)
    _point(e, rid, new)
    return old, new


# -- offload and restore ------------------------------------------------------------------------------------------

def test_offload_then_restore_into_other_slots_verifies_clean_and_leaves_the_old_slots_alone():
    got: list = []
    e = _engine(got)
    m = e.manager
    old = _slots(e, "a")
    before = _records(e, old)
    rows = m.allocate_record_rows(len(old), pinned=True)
    assert rows.shape == (len(old), 4) and rows.dtype == np.int64 and not rows.any()
    m.gather_records(np.array(old), rows)
    assert rows[:, 0].tolist() == e.reqs["a"]["tokens"][:len(old)] and rows[:, 1].tolist() == list(range(len(old)))
    new = _new_slots(e, len(old))
    _copy_kv(e, old, new)
    m.scatter_records(rows, np.array(new))
    _point(e, "a", new)
    for _ in range(3):
        e.decode_step(["a", "b"])
    m.flush()
    assert got == []
    assert (_records(e, old) == before).all()  # a gather reads, nothing else touched the old slots
    assert (_records(e, new)[:, :32] == before[:, :32]).all()
    s = m.stats()
    assert s["move_faults"] == {} and s["violations_by_reason"] == {}
    assert s["verified_entries"]["full"] > 0


def test_a_restore_into_the_wrong_slots_is_reported_naming_the_request():
    got: list = []
    e = _engine(got)
    _offload_restore(e, "a", order=[0, 2, 1, 3, 4, 5])  # positions 1 and 2 swapped, their KV not
    e.decode_step(["a", "b"])
    e.manager.flush()
    found = [v for vs in got for v in vs]
    assert found and all(v.request_ids == ("a",) for v in found)
    assert {v.position for v in found} >= {1, 2}
    # SPEC 4.1: POSITION at both, REAL_KV (their KV was not swapped), CHAIN where the predecessor changed
    for v in found:
        if v.position in (1, 2):
            assert v.reasons & FailReason.POSITION and v.reasons & FailReason.REAL_KV
    assert any(v.reasons & FailReason.CHAIN for v in found)


def test_kv_restored_without_its_records_is_reported():
    got: list = []
    e = _engine(got)
    old = _slots(e, "a")
    new = _new_slots(e, len(old))
    _copy_kv(e, old, new)
    _point(e, "a", new)  # no scatter_records: the new slots hold never-written records
    e.decode_step(["a", "b"])
    e.manager.flush()
    found = [v for vs in got for v in vs]
    assert {v.position for v in found} >= set(range(len(old))) and all(v.request_ids == ("a",) for v in found)
    assert all(v.reasons & FailReason.REAL_KV for v in found if v.position < len(old))


# -- fork ---------------------------------------------------------------------------------------------------------

def test_a_fork_verifies_clean_for_the_child():
    got: list = []
    e = _engine(got)
    m = e.manager
    parent = e.reqs["a"]
    src = _slots(e, "a")
    dst = _new_slots(e, len(src))
    _copy_kv(e, src, dst)  # copy-on-write: the child's copies of the parent's blocks
    m.move_records(np.array(src), np.array(dst, dtype=np.int32))
    e.add("c", list(parent["tokens"]))  # the child's expected tokens: the parent's so far
    e.reqs["c"]["kv_len"] = parent["kv_len"]
    _point(e, "c", dst)
    for _ in range(3):
        e.decode_step(["a", "b", "c"])
    m.flush()
    assert got == [] and m.stats()["move_faults"] == {}
    assert (_records(e, dst)[:, :32] == _records(e, src)[:, :32]).all()


def test_move_records_overlapping_lists_move_what_each_source_held():
    got: list = []
    e = _engine(got)
    a = _slots(e, "a")
    before = _records(e, a)
    e.manager.move_records(np.array(a[:2]), np.array(a[1:3]))  # a0 -> a1, a1 -> a2
    after = _records(e, a)
    assert (after[1] == before[0]).all() and (after[2] == before[1]).all() and (after[0] == before[0]).all()


# -- faults -------------------------------------------------------------------------------------------------------

def test_out_of_range_slots_are_counted_in_move_faults_at_the_next_report():
    got: list = []
    e = _engine(got)
    m = e.manager
    rows = m.allocate_record_rows(3)
    m.gather_records(np.array([e.slot_of("a", 0), NUM_SLOTS, NUM_SLOTS + 7]), rows)
    assert not rows[1:].any()  # out-of-range sources gather zero rows
    assert m.stats()["move_faults"] == {}  # not read until a step's report
    e.decode_step(["a", "b"])
    m.flush()
    assert m.stats()["move_faults"] == {"SOURCE_RANGE": 2}
    m.scatter_records(rows, np.array([NUM_SLOTS, -1, -1]))  # padding skipped silently
    e.decode_step(["a", "b"])
    m.flush()
    assert m.stats()["move_faults"] == {"SOURCE_RANGE": 2, "DEST_RANGE": 1}
    e.decode_step(["a", "b"])  # cleared behind each report: nothing new
    m.move_records(np.array([NUM_SLOTS]), np.array([NUM_SLOTS + 1]))  # both in one report's interval
    e.decode_step(["a", "b"])
    m.flush()
    assert m.stats()["move_faults"] == {"SOURCE_RANGE": 2, "DEST_RANGE": 1, "SOURCE_RANGE|DEST_RANGE": 2}
    assert got == []  # nothing in range was touched


def test_move_faults_of_a_second_group_are_counted_and_multi_group_decode_still_works():
    got: list = []
    e = _engine(got, groups=("full", "swa"))
    m = e.manager
    rows = m.allocate_record_rows(1, group="swa")
    m.gather_records(np.array([NUM_SLOTS + 1]), rows, group=1)
    e.decode_step(["a", "b"])
    m.flush()
    assert m.stats()["move_faults"] == {"SOURCE_RANGE": 1} and got == []


# -- errors and the calling contract ------------------------------------------------------------------------------

def test_argument_errors():
    got: list = []
    e = _engine(got, groups=("full", "swa"))
    m = e.manager
    s = np.array([1, 2])
    with pytest.raises(ValueError, match=r"^kv-canary: group: expected a group name among \['full', 'swa'\] or "
                                         r"its index \(the manager has 2 groups.*got None"):
        m.gather_records(s, np.zeros((2, 4), np.int64))
    with pytest.raises(ValueError, match=r"^kv-canary: group: expected a group name among .*got 'nope'"):
        m.move_records(s, s, group="nope")
    with pytest.raises(ValueError, match=r"^kv-canary: group: expected an index in \[0, 2\), got 2"):
        m.allocate_record_rows(2, group=2)
    with pytest.raises(TypeError, match=r"^kv-canary: group: expected a group name \(str\) or index \(int\)"):
        m.allocate_record_rows(2, group=1.0)
    with pytest.raises(ValueError, match=r"^kv-canary: src_slots: expected at most copy_capacity = 1024 slots"
                                         r".*got 1025"):
        m.move_records(np.arange(1025), np.arange(1025), group="full")
    with pytest.raises(ValueError, match=r"^kv-canary: dst_slots: expected the length of src_slots \(2\), got 1"):
        m.move_records(s, s[:1], group="full")
    with pytest.raises(ValueError, match=r"^kv-canary: out: expected 4 columns \(4 record words\), got shape"):
        m.gather_records(s, np.zeros((2, 5), np.int64), group="full")
    with pytest.raises(TypeError, match=r"^kv-canary: out: expected dtype int64"):
        m.gather_records(s, np.zeros((2, 4), np.int32), group="full")
    with pytest.raises(ValueError, match=r"^kv-canary: rows: expected at least 2 rows"):
        m.scatter_records(np.zeros((1, 4), np.int64), s, group="full")
    with pytest.raises(TypeError, match=r"^kv-canary: rows: expected dtype int64"):
        m.scatter_records(np.zeros((2, 4), np.float64), s, group="full")
    with pytest.raises(TypeError, match=r"^kv-canary: slots: expected dtype int32 or int64"):
        m.gather_records(np.array([1.0]), np.zeros((1, 4), np.int64), group="full")
    with pytest.raises(TypeError, match=r"^kv-canary: pinned: expected True, False or None, got 'yes'"):
        m.allocate_record_rows(2, group="full", pinned="yes")
    with pytest.raises(ValueError, match=r"^kv-canary: n: expected an int >= 0, got -1"):
        m.allocate_record_rows(-1, group="full")
    with pytest.raises(ValueError, match=r"^kv-canary: stream: expected None for a manager on device='cpu'"):
        m.gather_records(s, np.zeros((2, 4), np.int64), group="full", stream=1)
    m.flush()
    assert got == [] and m.stats()["move_faults"] == {}  # nothing launched by a refused call


def test_calls_from_another_thread_and_after_close_are_refused():
    got: list = []
    e = _engine(got)
    m = e.manager
    rows = m.allocate_record_rows(1)
    errors: list = []

    def other():
        try:
            m.gather_records(np.array([1]), rows)
        except RuntimeError as exc:
            errors.append(str(exc))
        m.allocate_record_rows(1)  # a request call: any thread

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert len(errors) == 1 and errors[0].startswith("kv-canary: gather_records: expected a call from the thread")
    m.close()
    for call in (lambda: m.gather_records(np.array([1]), rows), lambda: m.scatter_records(rows, np.array([1])),
                 lambda: m.move_records(np.array([1]), np.array([2])), lambda: m.allocate_record_rows(1)):
        with pytest.raises(RuntimeError, match=r"^kv-canary: \w+: expected an open manager, got one closed"):
            call()
    assert m._movers == {}


# -- layers -------------------------------------------------------------------------------------------------------

def test_a_layered_group_moves_its_layer_hashes_too():
    got: list = []
    num_layers = 3
    e = _engine(got, num_layers=num_layers)
    m = e.manager
    assert m.record_row_words() == 4 + num_layers
    old, new = _offload_restore(e, "a")
    table = np.array(to_host(m.groups[0].layers.table.layer_hashes))
    assert (table[new] == table[old]).all() and table[new].any()
    for _ in range(2 * num_layers):  # every layer under the cursor at least once
        e.decode_step(["a", "b"])
    m.flush()
    assert got == [] and m.stats()["move_faults"] == {}


def test_a_layered_restore_without_the_layer_hashes_is_reported_by_the_rotation():
    got: list = []
    num_layers = 3
    e = _engine(got, num_layers=num_layers)
    m = e.manager
    old = _slots(e, "a")
    rows = m.allocate_record_rows(len(old))
    m.gather_records(np.array(old), rows)
    rows[:, 4:] = 0  # the layer hashes lost on the way
    new = _new_slots(e, len(old))
    _copy_kv(e, old, new)
    m.scatter_records(rows, np.array(new))
    _point(e, "a", new)
    for _ in range(num_layers):
        e.decode_step(["a", "b"])
    m.flush()
    found = [v for vs in got for v in vs]
    assert found and all(v.request_ids == ("a",) and v.reasons == FailReason.REAL_KV for v in found)
    # the rotation's rows (a layer named), at every moved position; later layers of a slot are repeats
    assert all(v.layer is not None for v in found) and {v.position for v in found} == set(range(len(old)))


def test_rebind_keeps_the_layer_table_and_the_moves_bind_again():
    """Before the fix, rebind bound a fresh (zero) layer table: the next verifies reported REAL_KV of kind
    VERIFY_LAYER for every verified slot whose layer the cursor reached."""
    got: list = []
    num_layers = 3
    e = _engine(got, num_layers=num_layers)
    m = e.manager
    e.decode_step(["a", "b"])
    m.allocate_record_rows(1)  # the group's mover, bound to the records and layers of before the rebind
    table, cursor = m.groups[0].layers.table, m.groups[0].layers.cursor()
    m.rebind("full")
    assert m.groups[0].layers.cursor() == cursor and tuple(cursor) != (0, 0)  # carried over, not restarted
    for _ in range(2 * num_layers):
        e.decode_step(["a", "b"])
    m.flush()
    assert [v.line() for vs in got for v in vs] == []
    assert m.groups[0].layers.table is table
    _offload_restore(e, "a")  # a mover bound to the rebound records and layers
    assert m._movers[0].layers is m.groups[0].layers
    for _ in range(num_layers):
        e.decode_step(["a", "b"])
    m.flush()
    assert got == []


def test_rebind_with_another_number_of_layers_binds_a_new_table():
    e = ToyEngine(num_layers=3)
    g = e.manager.groups[0]
    table = g.layers.table
    lk, lv = e.layers["full"]
    fewer = [[(lk[i], 1, lk.shape[2]), (lv[i], 1, lv.shape[2])] for i in range(2)]
    e.manager.rebind("full", layer_sources=fewer)
    assert g.layers.table is not table and g.layers.num_layers == 2 and e.manager.record_row_words() == 6


# -- GPU ----------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("num_layers", [1, 3])
def test_cupy_offload_to_pinned_rows_restore_and_fork(num_layers):
    cupy = pytest.importorskip("cupy")
    got: list = []
    e = _engine(got, xp=cupy, device=0, num_layers=num_layers)
    m = e.manager
    old = _slots(e, "a")
    before = _records(e, old)
    rows = m.allocate_record_rows(len(old), pinned=True)
    assert isinstance(rows, np.ndarray) and rows.shape == (len(old), m.record_row_words())
    stream = cupy.cuda.Stream(non_blocking=True)
    m.gather_records(cupy.asarray(np.array(old)), rows, stream=stream)
    stream.synchronize()
    assert rows[:, 0].tolist() == e.reqs["a"]["tokens"][:len(old)]
    new = _new_slots(e, len(old))
    _copy_kv(e, old, new)
    m.scatter_records(rows, cupy.asarray(np.array(new, dtype=np.int32)))  # the current stream
    _point(e, "a", new)
    src = _slots(e, "b")
    dst = _new_slots(e, len(src))
    _copy_kv(e, src, dst)
    m.move_records(cupy.asarray(np.array(src)), cupy.asarray(np.array(dst)))
    e.add("c", list(e.reqs["b"]["tokens"]))
    e.reqs["c"]["kv_len"] = e.reqs["b"]["kv_len"]
    _point(e, "c", dst)
    m.gather_records(cupy.asarray(np.array([NUM_SLOTS])), rows)
    for _ in range(2 * num_layers + 1):
        e.decode_step(["a", "b", "c"])
    m.flush()
    assert got == [] and m.stats()["move_faults"] == {"SOURCE_RANGE": 1}
    assert (_records(e, old) == before).all() and (_records(e, new)[:, :32] == before[:, :32]).all()
    m.close()
