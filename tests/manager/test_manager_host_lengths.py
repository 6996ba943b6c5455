"""What the plan would flag one step late, refused where the host can see it: with host arrays, a negative
``extend_seq_lens``, a ``req_pool_indices`` outside ``[0, max_reqs)`` or a ``prefix_lens`` outside
``[0, max_seq_len]`` on an active row, and a request listed twice, are refused at ``before_forward`` (the
device-only case is the plan's input error, SPEC 3.4 bits 2, 4, 32, tested with the planners), so no false
violation follows (nothing lost, nothing misattributed). A padding row's negative length is no error at
all (SPEC 3.2). Reference backend, host arrays."""
from __future__ import annotations

import logging
import re

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


BAD = {  # (array, batch row 1's value given the request's row, its pool's max_reqs and max_seq_len, the words)
    "extend_minus_one": ("extend_seq_lens", lambda row, r, s: -1, ">= 0 new tokens for an active row"),
    "extend_minus_2_62": ("extend_seq_lens", lambda row, r, s: -(1 << 62), ">= 0 new tokens for an active row"),
    "extend_int64_min": ("extend_seq_lens", lambda row, r, s: -(1 << 63), ">= 0 new tokens for an active row"),
    "row_past_max_reqs": ("req_pool_indices", lambda row, r, s: r, "a row in [0, max_reqs = {r})"),
    "row_plus_100": ("req_pool_indices", lambda row, r, s: row + 100, "a row in [0, max_reqs = {r})"),
    "row_minus_one": ("req_pool_indices", lambda row, r, s: -1, "a row in [0, max_reqs = {r})"),
    "prefix_minus_five": ("prefix_lens", lambda row, r, s: -5,
                          "a prefix length in [0, max_seq_len = {s}] for an active row"),
    "prefix_past_max_seq_len": ("prefix_lens", lambda row, r, s: s + 1,
                                "a prefix length in [0, max_seq_len = {s}] for an active row"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_length_or_row_on_an_active_row_is_refused_at_the_call(case, caplog):
    """Host arrays: the manager knows the value is out of range before anything launches, so before_forward
    refuses it (no step opens), naming the array, the batch row, the range and the value; the plan's status bits
    (SPEC 3.4 bits 2, 4, 32; tests/plan) are the report where only the device knows. An engine that then calls
    with its real values runs clean."""
    got: list = []
    e = _engine(got)
    e.manager.flush()
    before = e.manager.stats()
    a, b = e.reqs["a"], e.reqs["b"]
    p = a["kv_len"]
    max_reqs, max_seq = e.r2t_host.shape
    name, value, words = BAD[case]
    arrays = {"req_pool_indices": [a["row"], b["row"]], "prefix_lens": [p, b["kv_len"]], "extend_seq_lens": [1, 0]}
    v = value(b["row"], max_reqs, max_seq)
    arrays[name][1] = v
    shown = arrays["req_pool_indices"][1]
    want = re.escape(f"kv-canary: {name}[1]: expected {words.format(r=max_reqs, s=max_seq)} "
                     f"(req_pool_indices[1] = {shown}), got {v}")
    with pytest.raises(ValueError, match=f"^{want}$"):
        e.manager.before_forward(request_ids=["a", "b"], **{k: e.a(x) for k, x in arrays.items()})
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


def test_a_request_listed_twice_in_a_step_is_refused_at_the_call():
    """Two batch rows of one request id would verify one row's prefix against the other's expected tokens (false
    VERIFY_TOKEN, each named after the wrong request): refused before the step opens, before_forward and
    begin_step alike; the next step runs clean. Padding (None) may repeat."""
    got: list = []
    e = _engine(got)
    e.manager.flush()
    a, b = e.reqs["a"], e.reqs["b"]
    step = dict(req_pool_indices=e.a([a["row"], b["row"]]), prefix_lens=e.a([a["kv_len"], b["kv_len"]]),
                extend_seq_lens=e.a([0, 0]))
    want = r"^kv-canary: request_ids\[1\]: expected distinct request ids \(None for padding rows\), got 'a' again " \
           r"\(request_ids\[0\]\)$"
    for call in (e.manager.before_forward, lambda **kw: e.manager.begin_step(kw.pop("request_ids"))):
        with pytest.raises(ValueError, match=want):
            call(request_ids=["a", "a"], **step)
        assert e.manager._step is None
    e.manager.before_forward(request_ids=[None, None], req_pool_indices=e.a([0, 0]), prefix_lens=e.a([0, 0]),
                             extend_seq_lens=e.a([0, 0]))
    e.manager.after_kv_store(out_cache_loc=e.a([]), input_ids=e.a([]), positions=e.a([]))
    for _ in range(2):
        e.decode_step(["a", "b"])
    e.manager.flush()
    assert got == [] and e.manager.stats()["violations_by_reason"] == {}


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


def test_new_tokens_past_the_row_on_an_active_row_are_refused_at_the_call():
    """SPEC 3.4 bit 32's other half, ``prefix_lens + extend_seq_lens > max_seq_len``: the write plan drops the
    flagged row's tokens, so the next row's records would land in its entries' slots (false CHAIN / REAL_KV /
    VERIFY_TOKEN naming that next, innocent request). Refused at the call, naming the room left; the tokens that
    fit exactly are no error."""
    got: list = []
    e = _engine(got)
    e.manager.flush()
    a, b = e.reqs["a"], e.reqs["b"]
    max_seq = e.r2t_host.shape[1]
    room = max_seq - b["kv_len"]
    want = re.escape(f"kv-canary: extend_seq_lens[0]: expected at most max_seq_len - prefix_lens = {room} new tokens "
                     f"for an active row (req_pool_indices[0] = {b['row']}), got {room + 1}")
    with pytest.raises(ValueError, match=f"^{want}$"):
        e.manager.before_forward(req_pool_indices=e.a([b["row"], a["row"]]), prefix_lens=e.a([b["kv_len"], 0]),
                                 extend_seq_lens=e.a([room + 1, 1]), request_ids=["b", "a"])
    assert e.manager._step is None
    e.manager.before_forward(req_pool_indices=e.a([b["row"], 0]), prefix_lens=e.a([max_seq, 0]),
                             extend_seq_lens=e.a([0, 0]), request_ids=["b", None])  # a full row, no new token
    assert e.manager._step is not None
