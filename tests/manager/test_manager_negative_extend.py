"""A negative ``extend_seq_lens`` on an active row reaches the manager as an input error (SPEC 3.4 bit 32,
``BAD_EXTEND_LEN``): the step verifies nothing, ``input_error_steps`` counts it, the warning names the bit, and no
violation is reported, then or at the next steps (nothing lost, nothing misattributed). A padding row's negative
length is no error at all (SPEC 3.2). Reference backend, host arrays."""
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
def test_negative_extend_on_an_active_row_is_an_input_error_not_a_violation(ext_b, caplog):
    got: list = []
    e = _engine(got)
    e.manager.flush()
    before = e.manager.stats()
    assert before["input_error_steps"]["full"] == 0
    with caplog.at_level(logging.WARNING, logger="kv_canary"):
        _step_with_lengths(e, ext_b)
        e.manager.flush()
    s = e.manager.stats()
    assert s["input_error_steps"]["full"] == 1
    assert s["verified_entries"]["full"] == before["verified_entries"]["full"]  # enable = 0: nothing verified
    assert s["written_entries"]["full"] == before["written_entries"]["full"] + 1  # a's token, at its offset
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "plan input error" in warnings[0] and "BAD_EXTEND_LEN" in warnings[0], warnings
    assert warnings[0].startswith("kv-canary:")
    # The next steps are clean: the rows' KV was neither lost nor attributed to the wrong request.
    for _ in range(2):
        e.decode_step(["a", "b"])
    e.manager.flush()
    s = e.manager.stats()
    assert got == [] and s["violations_by_reason"] == {} and e.manager.open_violations == []
    assert s["input_error_steps"]["full"] == 1
    assert s["verified_entries"]["full"] > before["verified_entries"]["full"]  # verifying again


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
