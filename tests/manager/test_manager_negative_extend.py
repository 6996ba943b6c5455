"""A negative ``extend_seq_lens`` on an active row: with host arrays the manager refuses it at ``before_forward``
(the device-only case is the plan's input error, SPEC 3.4 bit 32 ``BAD_EXTEND_LEN``, tested with the planners), so
no false violation follows (nothing lost, nothing misattributed). A padding row's negative length is no error at
all (SPEC 3.2). Reference backend, host arrays."""
from __future__ import annotations

import logging

import pytest
from helpers.manager_engine import ToyEngine


def _engine(got: list) -> ToyEngine:
    e = ToyEngine(backend="reference", on_violation=got.append)
    e.add("a", [5, 6, 7, 8])
    e.add("b", [9, 10, 11])
    for _ in range(2):
        e.decode_step(["a", "b"])
    return e


def _step_with_lengths(e: ToyEngine, ext_b: int, *, b_row: int | None = None) -> None:
    """One step: ``a`` decodes its next token (stored and written as the engine always does), the second batch row
    carries ``extend_seq_lens = ext_b`` and no tokens (``b``'s row, or ``b_row``: 0 for a padding row)."""
    a, b = e.reqs["a"], e.reqs["b"]
    p = a["kv_len"]
    e._alloc(a["row"], p, p + 1)
    rows = [a["row"], b["row"] if b_row is None else b_row]
    ids = ["a", "b" if b_row is None else None]
    e.manager.before_forward(req_pool_indices=e.a(rows), prefix_lens=e.a([p, b["kv_len"]]),
                             extend_seq_lens=e.a([1, ext_b]), request_ids=ids)
    loc, tok = [int(e.r2t_host[a["row"], p])], [a["tokens"][p]]
    e.store(["full"], loc, ["a"], tok, [p])
    e.manager.after_kv_store(out_cache_loc=e.a(loc), input_ids=e.a(tok), positions=e.a([p]))
    a["kv_len"] = p + 1
    e.accept("a", [2000 + p])


@pytest.mark.parametrize("ext_b", [-1, -(1 << 62), -(1 << 63)], ids=["minus_one", "minus_2_62", "int64_min"])
def test_negative_extend_on_an_active_row_is_refused_at_the_call(ext_b, caplog):
    """Host arrays: the manager knows the length is negative before anything launches, so before_forward refuses
    it (no step opens); the plan's BAD_EXTEND_LEN bit (tests/plan) is the report where only the device knows. An
    engine that then calls with its real lengths runs clean."""
    got: list = []
    e = _engine(got)
    e.manager.flush()
    before = e.manager.stats()
    a, b = e.reqs["a"], e.reqs["b"]
    p = a["kv_len"]
    with pytest.raises(ValueError, match=rf"^kv-canary: extend_seq_lens\[1\]: expected >= 0 new tokens for an "
                                         rf"active row \(req_pool_indices\[1\] = {b['row']}\), got {ext_b}$"):
        e.manager.before_forward(req_pool_indices=e.a([a["row"], b["row"]]), prefix_lens=e.a([p, b["kv_len"]]),
                                 extend_seq_lens=e.a([1, ext_b]), request_ids=["a", "b"])
    with pytest.raises(RuntimeError, match="expected a step opened by before_forward"):
        e.manager.after_kv_store(out_cache_loc=e.a([1]), input_ids=e.a([1]), positions=e.a([p]))
    with caplog.at_level(logging.WARNING, logger="kv_canary"):
        for _ in range(2):
            e.decode_step(["a", "b"])
        e.manager.flush()
    s = e.manager.stats()
    assert got == [] and s["violations_by_reason"] == {} and s["input_error_steps"]["full"] == 0
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert s["verified_entries"]["full"] > before["verified_entries"]["full"]


@pytest.mark.parametrize("ext_b", [-1, -(1 << 63)], ids=["minus_one", "int64_min"])
def test_negative_extend_on_a_padding_row_is_silent(ext_b, caplog):
    got: list = []
    e = _engine(got)
    e.manager.flush()
    before = e.manager.stats()
    with caplog.at_level(logging.WARNING, logger="kv_canary"):
        _step_with_lengths(e, ext_b, b_row=0)
        e.manager.flush()
    s = e.manager.stats()
    assert s["input_error_steps"]["full"] == 0
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert s["verified_entries"]["full"] == before["verified_entries"]["full"] + e.reqs["a"]["kv_len"] - 1
    assert got == [] and s["violations_by_reason"] == {}


def test_zero_extend_on_an_active_row_is_no_error():
    got: list = []
    e = _engine(got)
    e.manager.flush()
    _step_with_lengths(e, 0)
    e.manager.flush()
    s = e.manager.stats()
    assert s["input_error_steps"]["full"] == 0 and got == [] and s["violations_by_reason"] == {}
