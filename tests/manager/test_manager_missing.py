"""MISSING reports name their requests (SPEC 3.2's cleared mappings, docs/records.md's MISSING rows): a position
of a running request with no real slot (a 0 in its req_to_token row, or an SWA page freed inside the window) is
reported with the request that lost it, and another request losing the same position is a report of its own,
in the same step or a later one. CPU manager, reference backend."""
from __future__ import annotations

import numpy as np

from canary import MISSING_SLOT, CanaryManager, KVGroup

W = 4  # sliding window of the SWA group


class Engine:
    """A toy engine: one req_to_token table, a full-attention group and/or an SWA group with its LUT, page size 1."""

    def __init__(self, *, full: bool, swa: bool, slots: int = 512):
        self.r2t = np.zeros((8, 64), dtype=np.int32)
        self.lut = np.zeros(slots, dtype=np.int64) if swa else None
        self.next = 1
        groups = []
        if full:
            groups.append(KVGroup(name="full", req_to_token=self.r2t, num_slots=slots, verify_capacity=1 << 12))
        if swa:
            groups.append(KVGroup(name="swa", req_to_token=self.r2t, num_slots=slots, verify_capacity=1 << 12,
                                  swa_window_size=W, full_to_swa_index_mapping=self.lut))
        self.reports: list = []
        self.m = CanaryManager(groups, max_batch_size=4, device="cpu", on_violation=self.reports.extend)
        self.m.warmup()

    def step(self, batch):
        """batch: (request id, row, prefix length, tokens); new slots for the tokens, one KV store, one report."""
        rpi, pre, ext, ids, locs, toks, poss = [], [], [], [], [], [], []
        for rid, row, prefix, tokens in batch:
            slots = np.arange(self.next, self.next + len(tokens))
            self.next += len(tokens)
            if self.lut is not None:
                self.lut[slots] = slots  # the SWA pool mirrors the full one
            self.r2t[row, prefix:prefix + len(tokens)] = slots
            rpi.append(row)
            pre.append(prefix)
            ext.append(len(tokens))
            ids.append(rid)
            locs += slots.tolist()
            toks += list(tokens)
            poss += list(range(prefix, prefix + len(tokens)))
        i64 = lambda v: np.asarray(v, dtype=np.int64)  # noqa: E731
        self.m.before_forward(req_pool_indices=i64(rpi), prefix_lens=i64(pre), extend_seq_lens=i64(ext),
                              request_ids=ids)
        self.m.after_kv_store(out_cache_loc=i64(locs), input_ids=i64(toks), positions=i64(poss))
        self.m.flush()
        got, self.reports[:] = list(self.reports), []
        return got


def _prefill(e: Engine, rows: dict[str, int]) -> None:
    for rid in rows:
        e.m.add_request(rid, list(range(10)))
    assert e.step([(rid, row, 0, list(range(10))) for rid, row in rows.items()]) == []


def _decode(e: Engine, rows: dict[str, int], n: int):
    return e.step([(rid, row, n, [n]) for rid, row in rows.items()])


def _evict(e: Engine, row: int, prefix: int) -> None:
    # The positions the window (now [prefix - W, prefix)) has left: a legitimate eviction
    e.lut[e.r2t[row, :prefix - W].astype(np.int64)] = 0


def test_swa_pages_freed_in_two_requests_at_one_position_are_two_reports():
    e = Engine(full=False, swa=True)
    rows = {"A": 1, "B": 2}
    _prefill(e, rows)
    for row in rows.values():
        _evict(e, row, 10)
        e.lut[int(e.r2t[row, 8])] = 0  # freed inside the window [6, 10)
    got = _decode(e, rows, 10)
    assert sorted((v.position, v.reason_names, v.request_ids) for v in got) == [
        (8, ("MISSING",), ("A",)), (8, ("MISSING",), ("B",))]
    assert all(v.slot == MISSING_SLOT and v.raw.predecessor_slot == int(e.r2t[r, 7])
               for v, r in zip(sorted(got, key=lambda v: v.request_ids), (1, 2)))


def test_a_later_request_losing_the_same_position_is_reported_again():
    e = Engine(full=False, swa=True)
    _prefill(e, {"A": 1})
    _evict(e, 1, 10)
    e.lut[int(e.r2t[1, 8])] = 0
    assert [v.request_ids for v in _decode(e, {"A": 1}, 10)] == [("A",)]
    e.m.finish_request("A")
    _prefill(e, {"C": 2})
    _evict(e, 2, 10)
    e.lut[int(e.r2t[2, 8])] = 0
    got = _decode(e, {"C": 2}, 10)  # within forget_after of A's record: a new record all the same
    assert [(v.position, v.request_ids, v.count) for v in got] == [(8, ("C",), 1)]


def test_a_zero_in_a_running_rows_window_is_missing_in_both_groups():
    e = Engine(full=True, swa=True)
    _prefill(e, {"A": 1, "B": 2})
    _evict(e, 1, 10)
    _evict(e, 2, 10)
    e.r2t[1, 8] = 0  # A's row cleared at a position both windows need (9, the write's seed, would also fail the write)
    got = _decode(e, {"A": 1, "B": 2}, 10)
    assert sorted((v.group, v.position, v.reason_names, v.request_ids) for v in got) == [
        ("full", 8, ("MISSING",), ("A",)), ("swa", 8, ("MISSING",), ("A",))]


def test_padding_rows_and_evicted_positions_stay_silent():
    e = Engine(full=True, swa=True)
    _prefill(e, {"A": 1})
    _evict(e, 1, 10)
    assert e.step([("A", 1, 10, [10]), (None, 0, 7, [])]) == []
