"""Engine misuse the manager refuses at the call, instead of reporting it a step later as CHAIN / POSITION /
REAL_KV / VERIFY_TOKEN / MISSING violations of real requests (which an engine would take for memory corruption):

- ``after_kv_store`` with more or fewer tokens than its step planned (host ``extend_seq_lens``);
- the engine's ``req_pool_indices`` buffer refilled before ``after_kv_store``: the report still names the step's
  own rows (the manager copies them at ``before_forward``), on the host here and on a GPU (``gpu`` marker);
- a bound buffer rebuilt (``req_to_token``, the KV pool): ``CanaryManager.rebind``, and a refusal naming it when
  the KVGroup holds another buffer than the one bound;
- ``request_ids`` given as a str or bytes; a 2-D ``req_pool_indices``.
"""
from __future__ import annotations

import numpy as np
import pytest

from canary import FailReason
from tests.helpers.manager_engine import BYTES, ToyEngine

i64 = lambda v: np.asarray(v, dtype=np.int64)  # noqa: E731


def _engine(**kw):
    got: list = []
    eng = ToyEngine(on_violation=got.append, **kw)
    return eng, got


def _found(got):
    return [v for vs in got for v in vs]


# -- (1) the step's token count --------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 4])
def test_after_kv_store_with_another_token_count_is_refused(n):
    eng, got = _engine()
    eng.add("a", [1, 2, 3])
    m = eng.manager
    row = eng.reqs["a"]["row"]
    eng._alloc(row, 0, 4)
    slots = eng.r2t_host[row, :4].tolist()
    m.before_forward(req_pool_indices=i64([row]), prefix_lens=i64([0]), extend_seq_lens=i64([3]), request_ids=["a"])
    eng.store(["full"], slots[:3], ["a"] * 3, [1, 2, 3], [0, 1, 2])
    with pytest.raises(ValueError, match=rf"^kv-canary: after_kv_store: out_cache_loc: expected 3 tokens \(the "
                                         rf"step's extend_seq_lens sum\), got {n}$"):
        m.after_kv_store(out_cache_loc=i64(slots[:n]), input_ids=i64([1, 2, 3, 4][:n]),
                         positions=i64([0, 1, 2, 3][:n]))
    with pytest.raises(ValueError, match=rf"after_kv_store: positions: expected 3 tokens .*got {n}"):
        m.after_kv_store(out_cache_loc=i64(slots[:3]), input_ids=i64([1, 2, 3]), positions=i64([0, 1, 2, 3][:n]))
    # Refused before any write: the step is still open, and the right call closes it cleanly
    m.after_kv_store(out_cache_loc=i64(slots[:3]), input_ids=i64([1, 2, 3]), positions=i64([0, 1, 2]))
    eng.reqs["a"]["kv_len"] = 3
    eng.accept("a", [9])
    eng.decode_step(["a"])
    m.flush()
    assert _found(got) == [] and m.stats()["written_entries"]["full"] == 4


# -- (2) the rows of a step are the rows of its before_forward ------------------------------------------------
def _refill_case(xp=np, device="cpu"):
    eng, got = _engine(xp=xp, device=device)
    eng.add("a", [1, 2, 3])
    eng.add("b", [4, 5, 6])
    eng.forward([("a", 3), ("b", 3)])
    m = eng.manager
    ra, rb = eng.reqs["a"]["row"], eng.reqs["b"]["row"]
    bad = eng.slot_of("a", 1)
    eng.flip("full", bad)  # a's KV at position 1 corrupt: the next step over a's row reports it
    eng.accept("a", [7])
    eng._alloc(ra, 3, 4)
    slot = int(eng.r2t_host[ra, 3])
    rpi = xp.asarray(i64([ra]))  # the engine's buffer, refilled for its next batch before after_kv_store
    m.before_forward(req_pool_indices=rpi, prefix_lens=xp.asarray(i64([3])), extend_seq_lens=xp.asarray(i64([1])),
                     request_ids=["a"])
    eng.store(["full"], [slot], ["a"], [3], [3])
    rpi[0] = rb
    m.after_kv_store(out_cache_loc=xp.asarray(i64([slot])), input_ids=xp.asarray(i64([3])),
                     positions=xp.asarray(i64([3])))
    m.flush()
    return _found(got), bad


def test_refilled_req_pool_indices_do_not_change_attribution():
    found, bad = _refill_case()
    assert [(v.slot, v.position, v.requests) for v in found] == [(bad, 1, (("a", 1),))], [v.line() for v in found]
    assert found[0].reasons & FailReason.REAL_KV


@pytest.mark.gpu
def test_refilled_req_pool_indices_do_not_change_attribution_gpu():
    cupy = pytest.importorskip("cupy")
    found, bad = _refill_case(xp=cupy, device=0)
    assert [(v.slot, v.position, v.requests) for v in found] == [(bad, 1, (("a", 1),))], [v.line() for v in found]


# -- (3) rebind -------------------------------------------------------------------------------------------------
def _rebuild_r2t(eng):
    new = eng.r2t_host.copy()  # the same rows, in a new table (an engine that reallocated it)
    eng.r2t_host = eng.req_to_token = new
    return new


def test_rebuilt_req_to_token_without_rebind_is_refused_naming_rebind():
    eng, got = _engine()
    eng.add("a", [1, 2, 3])
    eng.forward([("a", 3)])
    new = _rebuild_r2t(eng)
    eng.manager.groups[0].spec.req_to_token = new
    eng.accept("a", [4])
    with pytest.raises(RuntimeError, match=r"^kv-canary: groups\[0\]\.req_to_token \(group 'full'\): expected the "
                                           r"buffer bound .*another object.*CanaryManager\.rebind\('full', "
                                           r"req_to_token=\.\.\.\)"):
        eng.forward([("a", 1)])
    assert eng.manager._step is None  # refused before the step opened
    eng.manager.rebind("full")  # the KVGroup already holds the new table: read again
    eng.reqs["a"]["kv_len"] = 3
    for _ in range(4):
        eng.decode_step(["a"])
    eng.manager.flush()
    assert _found(got) == []


def test_rebind_req_to_token_clean_engine_has_no_violations():
    eng, got = _engine(groups=("full", "swa"))
    eng.add("a", [1, 2, 3])
    eng.add("b", [5, 6])
    eng.forward([("a", 3), ("b", 2)])
    new = _rebuild_r2t(eng)
    eng.manager.rebind(req_to_token=new)  # every group (they share the table)
    assert all(g.spec.req_to_token is new for g in eng.manager.groups)
    for _ in range(6):  # new slots land in the new table only: the old one would read as MISSING
        eng.decode_step(["a", "b"])
    eng.manager.flush()
    assert _found(got) == [] and eng.manager.stats()["steps"] == 7


def test_rebind_kv_pool_keeps_real_kv_checked():
    eng, got = _engine()
    eng.add("a", [1, 2, 3, 4])
    eng.forward([("a", 4)])
    k, v = (x.copy() for x in eng.layers["full"])  # the pool rebuilt, its contents carried over
    eng.layers["full"] = (k, v)
    eng.manager.rebind("full", real_kv_sources=[(k[0], 1, BYTES), (v[0], 1, BYTES)])
    eng.decode_step(["a"])
    eng.manager.flush()
    assert _found(got) == []
    bad = eng.slot_of("a", 2)
    eng.flip("full", bad)  # in the new pool: seen
    eng.decode_step(["a"])
    eng.manager.flush()
    found = _found(got)
    assert [(v.slot, v.requests) for v in found] == [(bad, (("a", 2),))] and found[0].reasons & FailReason.REAL_KV


def test_rebuilt_kv_pool_assigned_without_rebind_is_refused():
    eng, _ = _engine()
    eng.add("a", [1, 2])
    eng.forward([("a", 2)])
    spec = eng.manager.groups[0].spec
    spec.real_kv_sources = list(spec.real_kv_sources)
    with pytest.raises(RuntimeError, match=r"groups\[0\]\.real_kv_sources \(group 'full'\).*rebind\('full', "
                                           r"real_kv_sources=\.\.\.\)"):
        eng.decode_step(["a"])


def test_rebind_refusals_change_nothing():
    eng, _ = _engine()
    m = eng.manager
    g = m.groups[0]
    planner, r2t = g.planner, g.spec.req_to_token
    with pytest.raises(ValueError, match=r"groups\[0\]\.req_to_token: expected the bound shape \(8, 32\)"):
        m.rebind(req_to_token=np.zeros((4, 32), np.int32))
    with pytest.raises(TypeError, match=r"rebind: expected keywords among"):
        m.rebind(kv=1)
    with pytest.raises(ValueError, match=r"groups: expected names among"):
        m.rebind("nope")
    eng.add("a", [1])
    m.before_forward(req_pool_indices=i64([eng.reqs["a"]["row"]]), prefix_lens=i64([0]), extend_seq_lens=i64([0]),
                     request_ids=["a"])
    with pytest.raises(RuntimeError, match=r"rebind: expected no open step"):
        m.rebind(req_to_token=r2t.copy())
    assert g.planner is planner and g.spec.req_to_token is r2t


# -- (4) request ids and batch shapes -------------------------------------------------------------------------
@pytest.mark.parametrize("ids", ["ab", b"ab"])
def test_request_ids_as_a_string_is_refused(ids):
    eng, _ = _engine()
    m = eng.manager
    eng.add("a", [1])
    eng.add("b", [2])
    kind = type(ids).__name__
    with pytest.raises(TypeError, match=rf"^kv-canary: request_ids: expected a sequence of request ids, got {kind} "):
        m.before_forward(req_pool_indices=i64([1, 2]), prefix_lens=i64([0, 0]), extend_seq_lens=i64([0, 0]),
                         request_ids=ids)
    assert m._step is None
    with pytest.raises(TypeError, match=rf"request_ids: expected a sequence of request ids, got {kind}"):
        m.accept_tokens_batch(ids, np.array([3, 4]))
    with pytest.raises(TypeError, match=rf"request_ids: expected a sequence of request ids, got {kind}"):
        m.begin_step(ids)
    assert m._step is None


def test_str_message_quotes_the_value():
    eng, _ = _engine()
    with pytest.raises(TypeError, match=r"got str 'ab'$"):
        eng.manager.before_forward(req_pool_indices=i64([1, 2]), prefix_lens=i64([0, 0]),
                                   extend_seq_lens=i64([0, 0]), request_ids="ab")


@pytest.mark.parametrize("shape", [(2, 1), (1, 2)])
def test_2d_req_pool_indices_is_blamed_on_req_pool_indices(shape):
    eng, _ = _engine()
    rpi = np.ones(shape, np.int64)
    with pytest.raises(ValueError, match=rf"^kv-canary: req_pool_indices: expected a \[bs\] int32 or int64 array, "
                                         rf"got shape \({shape[0]}, {shape[1]}\)$"):
        eng.manager.before_forward(req_pool_indices=rpi, prefix_lens=i64([0] * shape[0]),
                                   extend_seq_lens=i64([0] * shape[0]), request_ids=[None] * shape[0])
    assert eng.manager._step is None


def test_padding_rows_allow_trailing_padding_tokens_but_not_fewer():
    eng, got = _engine()
    eng.add("a", [1, 2])
    m = eng.manager
    row = eng.reqs["a"]["row"]
    eng._alloc(row, 0, 2)
    slots = eng.r2t_host[row, :2].tolist()
    m.before_forward(req_pool_indices=i64([row, 0]), prefix_lens=i64([0, 99]), extend_seq_lens=i64([2, -7]),
                     request_ids=["a", None])
    eng.store(["full"], slots, ["a"] * 2, [1, 2], [0, 1])
    with pytest.raises(ValueError, match=r"out_cache_loc: expected at least 2 tokens \(the step's extend_seq_lens "
                                         r"sum over its non-padding rows\), got 1"):
        m.after_kv_store(out_cache_loc=i64(slots[:1]), input_ids=i64([1]), positions=i64([0]))
    m.after_kv_store(out_cache_loc=i64(slots + [-1]), input_ids=i64([1, 2, 0]), positions=i64([0, 1, 0]))
    m.flush()
    assert _found(got) == []


@pytest.mark.parametrize("where", ["real_kv_sources", "layer_sources"])
def test_num_slots_past_a_kv_source_is_refused_naming_the_group(where):
    """A group's num_slots larger than a real-KV source holds (or a layer's source): refused at the constructor
    in the group's words (its num_slots and the source), not the records' internal buffer's."""
    from canary import CanaryManager, KVGroup

    r2t = np.arange(4 * 8, dtype=np.int32).reshape(4, 8)
    k, small = np.zeros((4, 16, 64), np.uint8), np.zeros((2, 16, 64), np.uint8)
    kw = (dict(real_kv_sources=[(k, 16, 64), (small, 16, 64)]) if where == "real_kv_sources"
          else dict(layer_sources=[[(k, 16, 64)], [(small, 16, 64)]], real_kv_sources=[(k, 16, 64)]))
    want = (r"kv-canary: groups\[0\]\.num_slots: expected at most the slots of groups\[0\]\."
            + (r"real_kv_sources\[1\]" if where == "real_kv_sources" else r"layer_sources\[1\]\[0\]")
            + r" \(rows \* page_size = 2 \* 16 = 32\), got 64")
    with pytest.raises(ValueError, match=want):
        CanaryManager(KVGroup(name="f", req_to_token=r2t, num_slots=64, verify_capacity=32, **kw), max_batch_size=4)


@pytest.mark.parametrize("where", ["real_kv_sources", "layer_sources"])
def test_rebind_to_a_kv_source_smaller_than_num_slots_is_refused_naming_the_group(where):
    """rebind's KV pool checked as the constructor's: a rebuilt source of fewer slots than the group's num_slots is
    refused in the group's words (not the records' internal canary buffer's), and nothing is rebound."""
    eng, _ = _engine(num_layers=2)
    m = eng.manager
    g = m.groups[0]
    small = np.zeros((10, BYTES), np.uint8)
    k, v = eng.kv["full"]
    kw = (dict(real_kv_sources=[(small, 1, BYTES), (v, 1, BYTES)]) if where == "real_kv_sources"
          else dict(layer_sources=[[(k, 1, BYTES), (v, 1, BYTES)], [(small, 1, BYTES)]]))
    want = (r"^kv-canary: groups\[0\]\.num_slots: expected at most the slots of groups\[0\]\."
            + (r"real_kv_sources\[0\]" if where == "real_kv_sources" else r"layer_sources\[1\]\[0\]")
            + r" \(rows \* page_size = 10 \* 1 = 10\), got 256$")
    records = g.records
    with pytest.raises(ValueError, match=want):
        m.rebind("full", **kw)
    assert g.records is records
