"""A manager group whose slot 0 is real (``KVGroup(padding_slot=-1)``, SPEC 3.2 "No reserved slot"): the engine
hands out slot 0 / block 0 to its first request and marks padding with -1, as Hugging Face transformers'
continuous batching does. A clean run reports nothing, a corrupted slot-0 record is reported with its request, and
the default still treats slot 0 as padding. CPU manager, reference backend; token table and block table."""
from __future__ import annotations

import numpy as np
import pytest

from canary import MISSING_SLOT, CanaryManager, KVGroup

S = 4  # page size of the block-table engine


class Engine:
    """Rows 1.. of one index (row 0: padding); slots handed out from 0 up; unused entries -1 (the padding marker)."""

    def __init__(self, form: str, padding_slot: int = -1, slots: int = 256):
        self.form = form
        if form == "block_table":
            self.table = np.full((4, 16), -1, dtype=np.int32)
            index = dict(block_table=self.table, page_size=S)
        else:
            self.table = np.full((4, 64), -1, dtype=np.int32)
            index = dict(req_to_token=self.table)
        self.next = 0
        group = KVGroup(name="full", num_slots=slots, verify_capacity=1 << 10, padding_slot=padding_slot, **index)
        self.reports: list = []
        self.m = CanaryManager([group], max_batch_size=4, device="cpu", on_violation=self.reports.extend)
        self.m.warmup()
        self.lengths: dict[int, int] = {}

    def _slots(self, row: int, prefix: int, n: int) -> np.ndarray:
        if self.form == "block_table":
            out = []
            for p in range(prefix, prefix + n):
                if p % S == 0:  # a new block for the row
                    self.table[row, p // S] = self.next
                    self.next += 1
                out.append(int(self.table[row, p // S]) * S + p % S)
            return np.asarray(out, dtype=np.int64)
        slots = np.arange(self.next, self.next + n, dtype=np.int64)
        self.next += n
        self.table[row, prefix:prefix + n] = slots
        return slots

    def step(self, batch):
        rpi, pre, ext, ids, locs, toks, poss = [], [], [], [], [], [], []
        for rid, row, prefix, tokens in batch:
            slots = self._slots(row, prefix, len(tokens))
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

    def records(self) -> np.ndarray:
        """The group's canary records as ``[num_slots, 4]`` int64 fields (a host view: writes go through)."""
        buf = self.m.groups[0].records.state.canary_buffer
        return buf.view(np.int64).reshape(buf.shape[0], -1)


def _run(e: Engine, steps: int = 6, corrupt_at: int | None = None):
    e.m.add_request("A", list(range(10)))
    e.m.add_request("B", list(range(5)))
    got = e.step([("A", 1, 0, list(range(10))), ("B", 2, 0, list(range(5)))])
    for k in range(steps):
        if corrupt_at == k:
            e.records()[0, 1] += 7  # slot 0's stored position: request A's position 0
        got += e.step([("A", 1, 10 + k, [100 + k]), ("B", 2, 5 + k, [200 + k])])
    return got


@pytest.mark.parametrize("form", ["req_to_token", "block_table"])
def test_a_request_on_slot_zero_runs_clean(form):
    e = Engine(form)
    assert _run(e) == []
    assert e.table[1, 0] == 0  # request A owns slot 0 (block 0)


@pytest.mark.parametrize("form", ["req_to_token", "block_table"])
def test_a_corrupted_slot_zero_record_is_reported(form):
    e = Engine(form)
    got = _run(e, corrupt_at=2)
    at0 = [v for v in got if v.slot == 0]
    assert at0, [(v.slot, v.reason_names) for v in got]
    assert all("POSITION" in v.reason_names for v in at0)
    assert {rid for v in at0 for rid in v.request_ids} == {"A"}
    # slot 1's chain check reads slot 0 as its real predecessor: CHAIN on it too, and nothing else
    assert {v.slot for v in got} <= {0, 1}


def test_the_default_reports_a_request_on_slot_zero_missing():
    """Why the option exists: under the default slot 0 is padding, so a request holding it gets MISSING."""
    e = Engine("req_to_token", padding_slot=0)
    got = _run(e, steps=1)
    assert got and all(v.slot == MISSING_SLOT and v.position == 0 for v in got)


def test_a_negative_entry_in_the_window_is_missing():
    e = Engine("block_table")
    e.m.add_request("A", list(range(10)))
    assert e.step([("A", 1, 0, list(range(10)))]) == []
    e.table[1, 1] = -1  # the engine cleared block 1 (positions 4..7) while the request still reads it
    got = e.step([("A", 1, 10, [7])])
    assert sorted(v.position for v in got) == [4, 5, 6, 7]
    assert all(v.slot == MISSING_SLOT and v.reason_names == ("MISSING",) for v in got)


@pytest.mark.parametrize("value,exc", [(1, ValueError), (-2, ValueError), ("0", TypeError), (None, TypeError)])
def test_the_group_option_is_checked(value, exc):
    group = KVGroup(name="full", req_to_token=np.zeros((2, 8), np.int32), num_slots=8, verify_capacity=8,
                    padding_slot=value)
    with pytest.raises(exc, match=r"^kv-canary: groups\[0\]\.padding_slot: expected .*0.*-1.*got"):
        CanaryManager([group], max_batch_size=2, device="cpu")
