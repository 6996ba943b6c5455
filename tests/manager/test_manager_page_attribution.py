"""Who a page list's reports name (docs/integration.md 4, SPEC 3.8): the page list as the step whose page list is
current reads it (the step being opened when its before_forward decodes the report, else the last planned step at
flush / close), each request found by id at its batch row there. One paged engine runs the same faults over a
token table and over a page list (bound buffers refilled in place, or arrays of the step's own; page size 1 and
4; int32 and int64 ``kv_indptr``): a flipped KV byte, a block handed to two requests, a block cleared while still
read; the reports name the same requests and writers in every form, whether decoded at the next step (whose
batch rows are in another order) or at flush. A request that left the batch is named by a token table only. CPU
manager, reference backend.
"""
from __future__ import annotations

import numpy as np
import pytest
from helpers.page_engine import PageListEngine as Engine

from canary import FailReason, MISSING_SLOT
from canary.manager.index import NOT_HELD, PageIndex

PAGE_LISTS = [("page_list", np.int64), ("page_list", np.int32), ("page_list_per_step", np.int64),
              ("page_list_per_step", np.int32)]


def _seen(vs) -> list:
    return [(v.group, v.kernel, v.slot, v.position, int(v.reasons), v.requests, v.writers) for v in vs]


def _engine(form, s, dtype, swa: bool = False) -> Engine:
    e = Engine(form, s, dtype, swa)
    e.add("a", 1, range(10, 10 + 2 * s + 1))
    e.add("b", 3, range(40, 40 + s + 2))
    e.add("c", 2, range(70, 73))
    assert e.step([("a", 2 * s + 1), ("b", s + 2), ("c", 3)]) == []
    assert e.decode(["a", "b", "c"]) == []
    return e


def _flip(form, s, dtype, flush: bool) -> list:
    """A byte of a's position 1 flipped; the report decoded at flush, or at the next step, whose rows are in
    another order; then a's verify names its slot again at a later step (a repeat)."""
    e = _engine(form, s, dtype)
    e.k[e.slot("a", 1), 3] ^= 0x10
    out = [_seen(e.decode(["a", "b", "c"], flush))]
    out.append(_seen(e.decode(["c", "b", "a"], flush)))  # a at another batch row
    out.append(_seen(e.decode(["b", "a"])))
    e.m.close()
    return out


def _shared_block(form, s, dtype, flush: bool, swa: bool = False) -> list:
    """The allocator hands a's first block to b as b's next page: b writes over a's slots, a reads them."""
    e = _engine(form, s, dtype, swa)
    p = e.rows["b"][2]
    e.bt[e.rows["b"][0], p // s] = e.bt[e.rows["a"][0], 0]  # the page b writes next
    out = [_seen(e.decode(["a", "b", "c"], flush))]
    out.append(_seen(e.decode(["b", "c", "a"], flush)))  # a reads b's record
    out.append(_seen(e.decode(["c", "a", "b"])))
    e.m.close()
    return out


def _cleared(form, s, dtype, flush: bool) -> list:
    """b's first block cleared while b still reads it: MISSING at its positions."""
    e = _engine(form, s, dtype)
    e.bt[e.rows["b"][0], 0] = 0
    out = [_seen(e.decode(["a", "b", "c"], flush))]
    out.append(_seen(e.decode(["b", "a", "c"], flush)))
    e.m.close()
    out.append(_seen(e.reports))
    return out


@pytest.mark.parametrize("s", [1, 4])
@pytest.mark.parametrize("form,dtype", PAGE_LISTS)
@pytest.mark.parametrize("flush", [True, False], ids=["flush", "next_step"])
def test_a_flipped_byte_names_the_same_request_as_a_token_table(form, dtype, s, flush):
    want = _flip("req_to_token", s, np.int64, flush)
    found = [v for step in want for v in step]
    assert [v[1] for v in found] == ["verify"] and found[0][3:] == (1, int(FailReason.REAL_KV), (("a", 1),), ())
    assert _flip(form, s, dtype, flush) == want


@pytest.mark.parametrize("s", [1, 4])
@pytest.mark.parametrize("form,dtype", PAGE_LISTS)
@pytest.mark.parametrize("flush", [True, False], ids=["flush", "next_step"])
def test_a_block_handed_to_two_requests_names_the_reader_and_the_writer(form, dtype, s, flush):
    want = _shared_block("req_to_token", s, np.int64, flush)
    found = [v for step in want for v in step]
    shared = [v for v in found if v[5] and v[6]]  # a reader and another request mapping the slot elsewhere
    assert shared and {v[5][0][0] for v in shared} | {v[6][0][0] for v in shared} == {"a", "b"}
    assert _shared_block(form, s, dtype, flush) == want


@pytest.mark.parametrize("s", [1, 4])
@pytest.mark.parametrize("form,dtype", PAGE_LISTS)
@pytest.mark.parametrize("flush", [True, False], ids=["flush", "next_step"])
def test_a_cleared_block_names_the_request_missing_it(form, dtype, s, flush):
    want = _cleared("req_to_token", s, np.int64, flush)
    found = [v for step in want for v in step]
    missing = [v for v in found if v[2] == MISSING_SLOT]
    assert missing and all(v[4] == int(FailReason.MISSING) and v[5] == (("b", v[3]),) for v in missing)
    assert {v[3] for v in missing} >= set(range(min(s, 3)))
    assert _cleared(form, s, dtype, flush) == want


@pytest.mark.parametrize("form", ["page_list", "page_list_per_step"])
def test_a_sliding_window_group_translates_the_page_list_slots(form):
    def run(f):
        e = _engine(f, 4, np.int64, swa=True)
        flipped = int(e.lut[e.slot("c", 1)])
        e.swa_k[flipped, 2] ^= 0x08  # c's byte in the SWA pool only
        out = [_seen(e.decode(["a", "b", "c"], flush=False)), _seen(e.decode(["c", "a", "b"]))]
        e.m.close()
        return out, flipped

    want, flipped = run("req_to_token")
    assert [v for step in want for v in step] == [("swa", "verify", flipped, 1, int(FailReason.REAL_KV),
                                                   (("c", 1),), ())]
    assert run(form) == (want, flipped)
    want = _shared_block("req_to_token", 4, np.int64, False, swa=True)
    swa = [v for step in want for v in step if v[0] == "swa"]
    assert swa and any(v[5] and v[6] for v in swa)
    assert _shared_block(form, 4, np.int64, False, swa=True) == want


@pytest.mark.parametrize("form", ["page_list", "page_list_per_step"])
def test_a_request_that_left_the_batch_is_named_by_a_token_table_only(form):
    """a's byte flipped; a is not in the next step, whose before_forward decodes the report: the page list it
    opens has no row of a's (SPEC 3.8), so only the token table names a."""
    got = {}
    for f in ("req_to_token", form):
        e = _engine(f, 4, np.int64)
        e.k[e.slot("a", 1), 0] ^= 0x01
        assert e.decode(["a", "b", "c"], flush=False) == []
        got[f] = e.decode(["b", "c"], flush=False)
        e.m.close()
    (want,), (v,) = got["req_to_token"], got[form]
    assert want.requests == (("a", 1),) and (v.slot, v.position, v.reasons) == (want.slot, want.position, want.reasons)
    assert v.requests == () and v.request_ids == ()


def test_reports_decoded_at_close_name_the_last_steps_rows():
    e = _engine("page_list", 4, np.int32)
    e.k[e.slot("c", 2), 1] ^= 0x04
    assert e.decode(["c", "a"], flush=False) == []  # c's flip is verified here, its report still queued
    e.indptr[:] = 0  # refilled after the last step: "now" is what the bound buffers hold
    e.indptr[:3] = [0, 1, 4]
    e.m.close()
    (v,) = e.reports
    assert v.reasons == FailReason.REAL_KV and v.position == 2
    # the last step's rows are (c, a): batch row 0, one page [0, 1), is still c's first page
    assert v.requests == (("c", 2),) and v.request_ids == ("c",)


@pytest.mark.parametrize("indices_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("indptr_dtype", [np.int32, np.int64])
def test_page_index_reads_rows_by_request_id(indptr_dtype, indices_dtype):
    s = 2
    ptr = np.array([0, 2, 2, 3, 9], indptr_dtype)  # rows: x (2 pages), padding (none), y (1 page), z (bad: past nnz)
    idx = np.array([5, 0, -3, 7], indices_dtype)
    pi = PageIndex(("x", None, "y", "z"), ptr, idx, s, 16)
    assert [pi.key(r) for r in ("x", "y", "z", "w", None)] == [0, 2, 3, None, 1]
    assert pi.column(0).tolist() == [10, NOT_HELD, -1, NOT_HELD]  # y's block is negative: a bad entry
    assert pi.column(3).tolist() == [0, NOT_HELD, NOT_HELD, NOT_HELD]  # x's second page is the padding block
    assert pi.column(-1).tolist() == pi.column(4).tolist() == [NOT_HELD] * 4
    assert pi.row(0).tolist() == [10, 11, 0, 0] and pi.row(2).tolist() == [-1, -1]
    assert pi.row(1).tolist() == pi.row(3).tolist() == pi.row(9).tolist() == []
    short = PageIndex(("x", "y"), ptr[:2], idx, s, 16)  # kv_indptr holds row 0's pair only
    assert short.column(1).tolist() == [11, NOT_HELD]
    bad = PageIndex(("x",), np.zeros((2, 2), indptr_dtype), idx, s, 16)  # not 1-D: the planner refuses it later
    assert bad.column(0).tolist() == [NOT_HELD] and bad.row(0).tolist() == []


def test_a_graph_replay_reads_the_page_list_its_capture_was_given():
    """begin_step (before the replay of an engine's graph) takes the step arrays captured for its batch size,
    else the bound ones; a step of other groups keeps the page list of the last step that planned it."""
    e = _engine("page_list", 4, np.int64)
    g = e.m.groups[0]
    own = dict(kv_indptr=np.zeros(3, np.int32), kv_indices=np.zeros(4, np.int32))
    e.m._steps.graph_index[2] = {"full": own}  # what before_forward's capture of a bs-2 graph records
    e.m.begin_step(["b", "a"])
    assert g.page_rows == (("b", "a"), own["kv_indptr"], own["kv_indices"])
    e.m.end_step()
    e.m.begin_step(["c"])
    assert g.page_rows[0] == ("c",) and g.page_rows[1] is e.indptr and g.page_rows[2] is e.indices
    e.m.end_step()
    e.m.sweep()  # plans no group
    assert g.page_rows[0] == ("c",)
    e.m.close()
