"""A reused ``req_to_token`` row keeps its previous request's slots past the new request's length (SGLang does not
clear a freed row, nor does the replay's scheduler). Those columns are not the request's KV: nothing reads or
writes them. A report that names a request through them (``SlotViolation.requests`` / ``writers``, hence
``request_ids``, the requests docs/integration.md 4 tells the engine to evict or abort) blames an innocent
request. Found by the replay sweep (``--max-requests 40 --max-batch-size 16 --inject position@250``: the
violation of request 24 also named requests 26 and 36 through their rows' stale tails); the decoder now reads
no column at or past a request's planned length (``ReportDecoder.holds``)."""
from __future__ import annotations

import numpy as np
import pytest
from helpers.manager_engine import ToyEngine

import canary.replay.replay_manager as rm
from canary.replay import cli

@pytest.mark.parametrize("same_position", [False, True], ids=["writers", "requests"])
def test_a_flipped_byte_names_no_request_through_a_stale_row_tail(same_position):
    got: list = []
    e = ToyEngine(on_violation=got.append)
    e.add("a", [5, 6, 7, 8, 9, 10, 11, 12])
    e.add("b", [9, 10])
    for _ in range(2):
        e.decode_step(["a", "b"])
    e.manager.flush()
    assert got == []
    pos = e.reqs["b"]["kv_len"] + 1  # past b's length, inside a's
    assert pos < e.reqs["a"]["kv_len"] - 1
    s = e.slot_of("a", pos)
    # b's row held a longer request before b: a column past b's length still names a slot that is a's now (at
    # a's position: b looks like an owner; elsewhere: a writer)
    e.r2t_host[e.reqs["b"]["row"], pos if same_position else 30] = s
    e.flip("full", s)
    e.decode_step(["a", "b"])
    e.manager.flush()
    found = [v for vs in got for v in vs]
    assert [(v.slot, v.position) for v in found] == [(s, pos)], [v.line() for v in found]
    (v,) = found
    assert v.requests == (("a", pos),) and v.writers == () and v.request_ids == ("a",), v.line()


def test_replay_names_no_request_past_its_length(monkeypatch, tmp_path):
    seen = []
    collect = rm.ManagerReplay._collect

    def spy(self, new):
        st = self._step
        n = st.num_active
        length = {int(r): int(p + x) for r, p, x in
                  zip(st.request_ids[:n], st.prefix_lens[:n], st.extend_seq_lens[:n])}
        for v in new:
            for rid, pos in tuple(getattr(v, "requests", ())) + tuple(getattr(v, "writers", ())):
                if rid in length and pos >= length[rid]:
                    seen.append((st.index, v.slot, v.position, rid, pos, length[rid]))
        return collect(self, new)

    monkeypatch.setattr(rm.ManagerReplay, "_collect", spy)
    rc = cli.main(["replay", "--backend", "reference", "--max-requests", "40", "--max-batch-size", "16",
                   "--inject", "position@250", "--json", str(tmp_path / "s.json")])
    assert rc == 0
    # (step, slot, position, named request, its position, its length)
    assert seen == [], seen[:4]


def test_the_stale_tail_is_there_to_be_misread():
    """The premise of the two tests above: without the stale column, the flip names a alone."""
    got: list = []
    e = ToyEngine(on_violation=got.append)
    e.add("a", [5, 6, 7, 8])
    e.add("b", [9, 10])
    for _ in range(2):
        e.decode_step(["a", "b"])
    s = e.slot_of("a", 1)
    e.flip("full", s)
    e.decode_step(["a", "b"])
    e.manager.flush()
    (v,) = [v for vs in got for v in vs]
    assert v.writers == () and v.request_ids == ("a",)
    assert np.count_nonzero(e.r2t_host == s) == 1
