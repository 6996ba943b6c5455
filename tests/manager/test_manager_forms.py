"""The manager over each index form (SPEC 3.8): a KVGroup bound with ``req_to_token``, a block table, a page list
(bound buffers refilled in place), or a page list the engine builds anew each step and passes to ``before_forward``.
One paged engine runs the same steps and the same faults (a KV byte flipped, a block cleared while still read) in
every form: the violations (slot, position, reasons) and the requests they name are the same. CPU manager,
reference backend.
"""
from __future__ import annotations

import numpy as np
import pytest

from canary import CanaryManager, FailReason, KVGroup, MISSING_SLOT
from canary.contract.kvindex import expand_block_table

S, MAX_REQS, MAX_BLOCKS, NUM_BLOCKS, BYTES, MAX_BS = 4, 6, 4, 40, 16, 4
FORMS = ["req_to_token", "block_table", "page_list", "page_list_per_step"]


class PagedEngine:
    """Pages of ``S`` slots from a free list, a block table per request row; the index handed to the canary in
    ``form``. K and V: ``[NUM_BLOCKS * S, BYTES]`` (slot-level real-KV sources)."""

    def __init__(self, form: str):
        self.form = form
        self.bt = np.zeros((MAX_REQS, MAX_BLOCKS), np.int32)
        self.r2t = np.zeros((MAX_REQS, MAX_BLOCKS * S), np.int32)
        self.indptr = np.zeros(MAX_BS + 1, np.int64)
        self.indices = np.zeros(MAX_BS * MAX_BLOCKS, np.int32)
        self.k = np.zeros((NUM_BLOCKS * S, BYTES), np.uint8)
        self.v = np.zeros((NUM_BLOCKS * S, BYTES), np.uint8)
        self.free = list(range(1, NUM_BLOCKS))
        self.rows = {}  # rid -> (row, tokens, kv_len)
        index = {"req_to_token": dict(req_to_token=self.r2t), "block_table": dict(block_table=self.bt, page_size=S)}
        index = index.get(form) or dict(kv_indptr=self.indptr, kv_indices=self.indices, page_size=S,
                                        max_reqs=MAX_REQS, max_seq_len=MAX_BLOCKS * S)
        self.reports: list = []
        group = KVGroup(name="full", num_slots=NUM_BLOCKS * S, verify_capacity=256,
                        real_kv_sources=[(self.k, 1, BYTES), (self.v, 1, BYTES)], **index)
        self.m = CanaryManager([group], max_batch_size=MAX_BS, device="cpu", on_violation=self.reports.extend)
        self.m.warmup()

    def add(self, rid, row: int, prompt) -> None:
        self.rows[rid] = [row, [], 0]  # the tokens written so far
        self.m.add_request(rid, list(prompt))

    def slot(self, rid, p: int) -> int:
        row = self.rows[rid][0]
        return int(self.bt[row, p // S]) * S + p % S

    def step(self, batch) -> list:
        """``batch``: (rid, new tokens); each request's pages grow as needed. One forward, one report."""
        rpi, pre, ext, ids, loc, tok, pos, pages = [], [], [], [], [], [], [], [0]
        for rid, new in batch:
            row, tokens, p = self.rows[rid]
            tokens += list(new)
            for b in range(p // S, -(-(p + len(new)) // S)):
                if self.bt[row, b] == 0:
                    self.bt[row, b] = self.free.pop(0)
            rpi.append(row), pre.append(p), ext.append(len(new)), ids.append(rid)
            for q in range(p, p + len(new)):
                loc.append(self.slot(rid, q)), tok.append(tokens[q]), pos.append(q)
            self.rows[rid][2] = p + len(new)
            pages.append(pages[-1] + -(-(p + len(new)) // S))
        self.r2t[...] = expand_block_table(self.bt, S)
        flat = [int(b) for rid, _ in batch for b in self.bt[self.rows[rid][0], :-(-self.rows[rid][2] // S)]]
        extra = {}
        if self.form == "page_list":  # the bound buffers, refilled in place
            self.indptr[:len(pages)] = pages
            self.indices[:len(flat)] = flat
        elif self.form == "page_list_per_step":  # new arrays each step (int32 offsets this time)
            extra = dict(kv_indptr=np.asarray(pages, np.int32), kv_indices=np.asarray(flat, np.int32))
        i64 = lambda v: np.asarray(v, np.int64)  # noqa: E731
        self.m.before_forward(req_pool_indices=i64(rpi), prefix_lens=i64(pre), extend_seq_lens=i64(ext),
                              request_ids=ids, **extra)
        for s, t, q in zip(loc, tok, pos):  # the engine's KV store
            self.k[s] = np.random.default_rng(t * 1000 + q).integers(0, 256, BYTES, dtype=np.uint8)
            self.v[s] = self.k[s][::-1]
        self.m.after_kv_store(out_cache_loc=i64(loc), input_ids=i64(tok), positions=i64(pos))
        self.m.flush()
        got, self.reports[:] = list(self.reports), []
        return got


def _scenario(form: str) -> list:
    """Prefill two requests, decode, flip a byte of a's position 2, decode, clear b's second block, decode."""
    e = PagedEngine(form)
    e.add("a", 1, range(10, 16))
    e.add("b", 3, range(20, 27))
    seen = [e.step([("a", range(10, 16)), ("b", range(20, 27))])]
    for t in range(2):
        seen.append(e.step([("a", [30 + t]), ("b", [40 + t])]))
        e.m.accept_tokens("a", [30 + t])
        e.m.accept_tokens("b", [40 + t])
    e.k[e.slot("a", 2), 5] ^= 0x01  # a stray write into a's KV
    seen.append(e.step([("a", [32]), ("b", [42])]))
    e.m.accept_tokens("a", [32])
    e.m.accept_tokens("b", [42])
    e.bt[3, 1] = 0  # b's positions 4..7 lose their block while b still reads them
    seen.append(e.step([("a", [33]), ("b", [43])]))
    e.m.close()
    return [[(v.kernel, v.slot, v.position, int(v.reasons), v.requests) for v in step] for step in seen]


@pytest.mark.parametrize("form", FORMS[1:])
def test_the_same_faults_are_found_in_every_form(form):
    want = _scenario("req_to_token")
    flip_slot = 1 * S + 2  # a's first block is the first page handed out: block 1
    assert [len(s) for s in want[:3]] == [0, 0, 0]
    assert [(k, s, p, r) for k, s, p, r, _ in want[3]] == [("verify", flip_slot, 2, int(FailReason.REAL_KV))]
    assert {(s, p, r) for _k, s, p, r, _ in want[4]} == {(MISSING_SLOT, q, int(FailReason.MISSING)) for q in range(4, 8)}
    assert want[3][0][4] == (("a", 2),)  # the request holding the slot
    # a page list's requests are found by id at their batch rows in the page list of the step decoding the
    # report (here flush: the last planned step's), the same as the forms keyed by request row name them
    assert _scenario(form) == want


def test_per_step_arrays_are_checked_before_the_step_opens():
    e = PagedEngine("block_table")
    e.add("a", 1, [1, 2])
    i64 = lambda v: np.asarray(v, np.int64)  # noqa: E731
    step = dict(req_pool_indices=i64([1]), prefix_lens=i64([0]), extend_seq_lens=i64([2]), request_ids=["a"])
    with pytest.raises(ValueError) as info:
        e.m.before_forward(**step, kv_indices=np.zeros(4, np.int32))
    assert str(info.value) == ("kv-canary: kv_indices: expected a planned group bound with a page list (groups "
                               "['full']), got an array")
    with pytest.raises(ValueError) as info:
        e.m.before_forward(**step, block_table={"swa": e.bt})
    assert str(info.value) == "kv-canary: block_table: expected group names this step plans (['full']), got 'swa'"
    with pytest.raises(ValueError, match=r"^kv-canary: block_table: expected the bound shape \(6, 4\)"):
        e.m.before_forward(**step, block_table=np.zeros((5, 4), np.int32))
    assert e.m._step is None  # nothing was left open
    e.m.before_forward(**step, block_table={"full": e.bt.copy()})  # a dict by group name
    e.m.after_kv_store(out_cache_loc=i64([4, 5]), input_ids=i64([1, 2]), positions=i64([0, 1]))
    e.m.close()


@pytest.mark.parametrize("kw, words", [
    (dict(), "groups[0].req_to_token: expected exactly one index form: req_to_token, or block_table with page_size, "
             "or kv_indptr and kv_indices with page_size, got none"),
    (dict(req_to_token=np.zeros((4, 8), np.int32), block_table=np.zeros((4, 2), np.int32), page_size=4),
     "groups[0].req_to_token: expected exactly one index form: req_to_token, or block_table with page_size, or "
     "kv_indptr and kv_indices with page_size, got req_to_token and block_table"),
    (dict(block_table=np.zeros((4, 2), np.int32)),
     "groups[0].page_size: expected the tokens a page (an int >= 1) with block_table, got None"),
    (dict(block_table=np.zeros((4, 2), np.int32), page_size=4, max_seq_len=8),
     "groups[0].max_seq_len: expected None with block_table (its shape gives it), got 8"),
    (dict(kv_indptr=np.zeros(5, np.int32), kv_indices=np.zeros(8, np.int32), page_size=4, max_seq_len=16),
     "groups[0].max_reqs: expected the rows req_pool_indices names (verify_cursors' rows) with a page list (its "
     "rows are batch rows), got None"),
    (dict(kv_indptr=np.zeros(5, np.int32), page_size=4, max_reqs=4, max_seq_len=16),
     "groups[0].kv_indices: expected a page list's kv_indptr and kv_indices together, got None"),
])
def test_one_form_per_group(kw, words):
    with pytest.raises(ValueError) as info:
        CanaryManager([KVGroup(name="full", num_slots=64, verify_capacity=8, **kw)], max_batch_size=4)
    assert str(info.value) == "kv-canary: " + words


def test_rebind_keeps_the_form_and_the_shape():
    e = PagedEngine("block_table")
    new = e.bt.copy()
    e.m.rebind("full", block_table=new)
    assert e.m.groups[0].spec.block_table is new
    with pytest.raises(ValueError, match=r"expected the bound shape \(6, 16\) .*got shape \(6, 20\)"):
        e.m.rebind("full", block_table=np.zeros((6, 5), np.int32))
    e.bt = new
    e.m.close()


def test_a_rebuilt_block_table_is_caught_without_rebind():
    e = PagedEngine("block_table")
    e.m.groups[0].spec.block_table = np.zeros_like(e.bt)  # the engine assigned a new table
    i64 = lambda v: np.asarray(v, np.int64)  # noqa: E731
    with pytest.raises(RuntimeError, match=r"groups\[0\].block_table \(group 'full'\): expected the buffer bound"):
        e.m.before_forward(req_pool_indices=i64([0]), prefix_lens=i64([0]), extend_seq_lens=i64([0]),
                           request_ids=[None])
    e.m.close()
