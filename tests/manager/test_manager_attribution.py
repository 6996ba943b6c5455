"""Who a report names (docs/integration.md 4): the owner of the position (``requests``) and, where a write
landed in another request's slot, the writer (``writers``), on the reference backend through the toy engine; and
one record per slot, step and group when the main verify and the layer rotation both see a flipped byte."""
from __future__ import annotations

import numpy as np
import pytest
from helpers.manager_engine import ToyEngine

from canary import FailReason, KernelTag, Violation
from canary.manager.report import sightings


def _engine(got: list, **kw) -> ToyEngine:
    e = ToyEngine(on_violation=got.append, **kw)
    e.add("a", [5, 6, 7, 8])
    e.add("b", [9, 10])
    for _ in range(2):
        e.decode_step(["a", "b"])
    e.manager.flush()
    assert got == []
    return e


def _found(got: list) -> list:
    return [v for vs in got for v in vs]


def _shift_position(e: ToyEngine, entry: int, by: int) -> None:
    """The next after_kv_store claims position + ``by`` for entry ``entry`` (the forward wrote it elsewhere)."""
    real = e.manager.after_kv_store

    def once(**kw):
        pos = np.array(kw["positions"])
        pos[entry] += by
        kw["positions"] = pos
        e.manager.after_kv_store = real
        return real(**kw)

    e.manager.after_kv_store = once


def test_a_token_written_at_the_wrong_position_names_its_writer():
    got: list = []
    e = _engine(got)
    pb = e.reqs["b"]["kv_len"]  # b's entry (the second) writes its slot at pb, claiming pb + 5
    _shift_position(e, 1, 5)
    e.decode_step(["a", "b"])
    e.manager.flush()
    writes = [v for v in _found(got) if v.kernel == "write"]
    assert len(writes) == 1, [v.line() for v in _found(got)]
    (w,) = writes
    assert w.reasons == FailReason.WRITE_POSITION and (w.slot, w.position) == (e.slot_of("b", pb), pb + 5)
    assert w.requests == () and w.writers == (("b", pb),) and w.request_ids == ("b",)
    assert f" writers=b@{pb} " in w.line()


@pytest.mark.parametrize("group", ["full", "swa"])
def test_a_block_handed_to_a_second_request_names_the_reader_and_the_writer(group):
    got: list = []
    e = _engine(got, groups=("full", group) if group != "full" else ("full",))
    s = e.slot_of("a", 1)
    pb = e.reqs["b"]["kv_len"]
    e.r2t_host[e.reqs["b"]["row"], pb] = s  # the allocator hands a's slot to b as well: b writes it next
    e.decode_step(["a", "b"])
    e.decode_step(["a", "b"])  # a reads its position 1: b's record
    e.manager.flush()
    found = [v for v in _found(got) if v.group == group]
    s = e.slot_of("a", 1, group)
    # a's slot, and its next one by CHAIN: a's own, with no writer
    assert [(v.kernel, v.slot, v.position) for v in found] == [("verify", s, 1), ("verify", e.slot_of("a", 2, group), 2)]
    v, nxt = found
    assert nxt.reasons == FailReason.CHAIN and nxt.requests == (("a", 2),) and nxt.writers == ()
    assert v.requests == (("a", 1),) and v.writers == (("b", pb),) and v.request_ids == ("a", "b")
    assert FailReason.POSITION in v.reasons and f"requests=a@1 writers=b@{pb} " in v.line()


def test_a_block_freed_while_still_read_names_the_request_that_wrote_it():
    got: list = []
    e = _engine(got)
    s = e.slot_of("a", 2)
    e.free_slots.insert(0, s)  # freed while a still reads it: c's prefill gets it
    e.add("c", [21, 22])
    e.forward([("c", 2)])
    e.accept("c", [23])
    e.decode_step(["a", "b"])  # c not in this batch: named by its last row
    e.manager.flush()
    found = _found(got)
    assert [(v.kernel, v.slot, v.position) for v in found] == [("verify", s, 2), ("verify", e.slot_of("a", 3), 3)]
    v = found[0]
    assert v.requests == (("a", 2),) and v.writers == (("c", 0),) and v.request_ids == ("a", "c")


def test_a_flipped_byte_seen_by_the_main_verify_and_the_rotation_is_one_record():
    got: list = []
    e = _engine(got, num_layers=2)
    g = e.manager.groups[0]
    while g.layers.cursor()[0] != 0:  # the next step's rotation checks layer 0, which the main verify reads too
        e.decode_step(["a", "b"])
    e.manager.flush()
    assert got == []
    s = e.slot_of("b", 0)
    e.flip("full", s, layer=0)
    e.decode_step(["a", "b"])
    e.manager.flush()
    found = _found(got)
    assert len(found) == 1, [v.line() for v in found]
    (v,) = found
    assert (v.slot, v.position, v.reasons, v.layer, v.kernel) == (s, 0, FailReason.REAL_KV, 0, "verify")
    assert [r.kernel for r in v.rows] == [KernelTag.VERIFY, KernelTag.VERIFY_LAYER] and v.raw is v.rows[0]
    assert v.requests == (("b", 0),) and v.writers == ()
    assert e.manager.stats()["repeated_sightings"] == 0 and e.manager.stats()["violations_by_reason"] == {"REAL_KV": 1}
    e.decode_step(["a", "b"])  # the main verify alone: a repeat of the same record
    e.manager.flush()
    assert len(_found(got)) == 1 and v.count == 2


def _row(kernel, slot, position, reasons, aux=0, layer=None) -> Violation:
    return Violation(kernel=kernel, launch_tag=0, slot=slot, position=position, stored_token=1, expected_token=1,
                     stored_chain_hash=0, expected_aux=aux, reasons=reasons, layer=layer)


def test_sightings_merge_one_slot_and_position_of_one_kind_only():
    main = _row(KernelTag.VERIFY, 7, 3, FailReason.CHAIN | FailReason.REAL_KV)
    layer = _row(KernelTag.VERIFY_LAYER, 7, 3, FailReason.REAL_KV, layer=2)
    write = _row(KernelTag.WRITE, 7, 3, FailReason.WRITE_POSITION, aux=4)
    other = _row(KernelTag.VERIFY, 7, 5, FailReason.POSITION)
    lost_a = _row(KernelTag.VERIFY, -1, 9, FailReason.MISSING, aux=11)
    lost_b = _row(KernelTag.VERIFY, -1, 9, FailReason.MISSING, aux=12)
    got = sightings([layer, write, main, other, lost_a, lost_b])
    assert [(v, r, rows) for v, r, rows in got] == [
        (main, FailReason.CHAIN | FailReason.REAL_KV, (main, layer)), (write, write.reasons, (write,)),
        (other, other.reasons, (other,)), (lost_a, lost_a.reasons, (lost_a,)), (lost_b, lost_b.reasons, (lost_b,))]


def test_clean_runs_padding_and_a_flip_name_no_writer():
    got: list = []
    e = _engine(got)
    for _ in range(3):
        e.forward([("a", 1), (None, 0), ("b", 1), (None, 0)])
        e.accept("a", [40]), e.accept("b", [41])
    e.manager.flush()
    assert got == []
    e.flip("full", e.slot_of("a", 3))
    e.forward([(None, 0), ("a", 1), ("b", 1)])
    e.forward([("a", 0), (None, 0), ("b", 0)])
    e.manager.flush()
    found = _found(got)
    assert [(v.position, v.reasons, v.requests, v.writers) for v in found] == [(3, FailReason.REAL_KV, (("a", 3),), ())]
    assert " writers=" not in found[0].line()


def test_a_draft_step_covering_fewer_positions_leaves_the_target_groups_holders_named():
    """A request's bound is its last step in the violated group: a draft forward (groups=["draft"]) that wrote
    fewer positions than the target's KV holds (a lagging or chunked draft extend) does not unname the request
    in the target group. x's position 4 is shared with y (a prefix hit): the flip there names both."""
    got: list = []
    e = ToyEngine(groups=("full", "draft"), on_violation=got.append)
    px = [11, 12, 13, 14, 15, 16]
    e.add("x", px)
    e.forward([("x", 6)])
    e.accept("x", [17])
    e.draft_forward([("x", 3)])  # the draft's positions 0..2 only
    e.add("y", px[:5] + [99])
    xrow, yrow = e.reqs["x"]["row"], e.reqs["y"]["row"]
    e.r2t_host[yrow, :5] = e.r2t_host[xrow, :5]
    e.req_to_token[yrow, :5] = e.r2t_host[yrow, :5]
    e.reqs["y"]["kv_len"] = 5
    e.flip("full", e.slot_of("x", 4))
    e.forward([("y", 1)], group_names=["full"])
    e.manager.flush()
    assert [(v.group, v.position, v.requests) for v in _found(got)] == [("full", 4, (("y", 4), ("x", 4)))]


def test_a_draft_step_after_an_accept_does_not_extend_the_target_groups_bound():
    """Without host lengths (a device manager's bound: the counts alone, emulated here by forgetting the host's
    prefix + extend), the target group's bound is the count at the target's last step: a draft step after the
    accept of token 6 plans 7 tokens, but the target's KV holds positions 0..5 only (position 6 is a reused row's
    stale column until the target's next step writes it)."""
    e = ToyEngine(groups=("full", "draft"), on_violation=lambda v: None)
    e.add("x", [11, 12, 13, 14, 15, 16])
    e.forward([("x", 6)])
    e.accept("x", [17])
    e.draft_forward([("x", 6)])
    m = e.manager
    m.requests.written[:] = -1
    full, draft = m.groups
    holds = m._decoder.names.holds
    assert [holds(full, "x", p) for p in (5, 6)] == [True, False]
    assert [holds(draft, "x", p) for p in (5, 6)] == [True, False]  # position 5's draft KV holds token 6


def _late_steps(e: ToyEngine, rids: list, n: int, kept: tuple | None, fed: bool, before_last=None) -> tuple:
    """``n`` decode steps of an engine that accepts a step's sampled tokens one step late, after the next step's
    after_kv_store (``fed``: with ``fed_to_last_step=True``); ``before_last()`` runs before the last forward.
    Returns the tokens still kept."""
    for i in range(n):
        if before_last is not None and i == n - 1:
            before_last()
        e.forward([(rid, len(e.reqs[rid]["tokens"]) - e.reqs[rid]["kv_len"]) for rid in rids])
        if kept is not None:
            e.manager.accept_tokens_batch(*kept, fed_to_last_step=fed)
        toks = [1000 + len(e.reqs[rid]["tokens"]) for rid in rids]
        for rid, t in zip(rids, toks):
            e.reqs[rid]["tokens"].append(t)  # the engine knows them now; the canary after the next forward
        kept = (list(rids), np.array(toks, dtype=np.int64))
    return kept


@pytest.mark.parametrize("fed", [True, False])
def test_tokens_accepted_one_step_late_still_name_the_writer(fed):
    # An engine that accepts a step's tokens behind the next forward (the transformers integration's order):
    # the step that wrote position pb was planned before b's token there was accepted. fed_to_last_step counts it
    # as planned by that step, so the write row names b as when the accept came first; without it, nobody.
    got: list = []
    e = _engine(got)
    kept = _late_steps(e, ["a", "b"], 2, None, fed)
    e.manager.flush()
    assert got == []
    pb = e.reqs["b"]["kv_len"]
    kept = _late_steps(e, ["a", "b"], 1, kept, fed, before_last=lambda: _shift_position(e, 1, 5))
    e.manager.accept_tokens_batch(*kept, fed_to_last_step=fed)
    e.manager.flush()
    (w,) = [v for v in _found(got) if v.kernel == "write"]
    assert w.reasons == FailReason.WRITE_POSITION and (w.slot, w.position) == (e.slot_of("b", pb), pb + 5)
    assert w.writers == ((("b", pb),) if fed else ())


def test_fed_to_last_step_refuses_an_open_step_and_skips_a_changed_batch():
    got: list = []
    e = _engine(got)
    kept = _late_steps(e, ["a", "b"], 2, None, True)
    m = e.manager
    m.before_forward(req_pool_indices=e.a([e.reqs["a"]["row"]], name="rpi1"), prefix_lens=e.a([0], name="p1"),
                     extend_seq_lens=e.a([0], name="x1"), request_ids=["a"])
    counts = m.requests.counts.copy()
    with pytest.raises(RuntimeError, match=r"^kv-canary: accept_tokens_batch: expected fed_to_last_step=True after "
                                           r"the step's after_kv_store, got step \d+ still open"):
        m.accept_tokens_batch(*kept, fed_to_last_step=True)
    assert (m.requests.counts == counts).all()  # nothing accepted
    m.after_kv_store(out_cache_loc=e.a([], name="l1"), input_ids=e.a([], name="t1"), positions=e.a([], name="q1"))
    # a request joined since the step began: its row may be one the step read for another; nothing is counted
    e.add("c", [3, 4])
    planned = m.requests.planned.copy()
    m.accept_tokens_batch(*kept, fed_to_last_step=True)
    assert (m.requests.planned == planned).all()
    m.flush()
    assert got == []
