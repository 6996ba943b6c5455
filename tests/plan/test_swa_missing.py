"""A full-to-SWA mapping cleared inside the window (SPEC 3.2, MISSING_SLOT; SPEC 4, FailReason.MISSING), end to
end on the reference: plan, write, then verify after an engine bug frees the SWA slot of a position the window
still needs. Before MISSING_SLOT the cleared mapping translated to the padding slot 0 and verify skipped it.
"""
from __future__ import annotations

import numpy as np
import pytest

import canary
from canary import (
    MISSING_SLOT, CanaryPlanner, CanaryRecords, CanaryState, FailReason, PlanStatus, VerifyPlan, WritePlan,
)

ROWS, MAX_SEQ_LEN, W = 3, 16, 4
NUM_FULL = ROWS * MAX_SEQ_LEN + 1  # full slot 0 is the padding slot


def _run(cleared: tuple[tuple[int, int], ...]) -> tuple[list, np.ndarray, VerifyPlan]:
    """Requests on req_to_token rows 1 and 2 prefill 8 tokens (step 0); then the mappings of ``cleared``
    ((row, position) pairs) are zeroed, and step 1 (a decode) plans and verifies. Returns step 1's violations,
    the LUT and the verify plan."""
    r2t = np.zeros((ROWS, MAX_SEQ_LEN), dtype=np.int32)
    r2t[1:] = np.arange(1, (ROWS - 1) * MAX_SEQ_LEN + 1).reshape(ROWS - 1, MAX_SEQ_LEN)
    lut = np.zeros(NUM_FULL, dtype=np.int64)
    lut[1:] = np.random.default_rng(0).permutation(np.arange(1, NUM_FULL))  # SWA slots, 0 kept for padding
    vp = VerifyPlan.allocate(verify_capacity=64, max_reqs=ROWS)
    wp = WritePlan.allocate(write_req_capacity=2)
    planner = CanaryPlanner(verify_plan_out=vp, write_plan_out=wp, req_to_token=r2t, swa_window_size=W,
                            full_to_swa_index_mapping=lut, backend="reference")
    state = CanaryState.allocate(num_slots=NUM_FULL, ring_capacity=32)
    records = CanaryRecords(state, backend="reference")
    rpi = np.array([1, 2], dtype=np.int64)
    tokens = np.random.default_rng(1).integers(0, 32000, size=(ROWS, MAX_SEQ_LEN))
    for step, (P, E) in enumerate(((0, 8), (8, 1))):
        if step == 1:
            for row, pos in cleared:
                lut[r2t[row, pos]] = 0  # the engine bug: the SWA slot is freed
        prefix = np.full(2, P, dtype=np.int64)
        extend = np.full(2, E, dtype=np.int64)
        assert planner.plan(req_pool_indices=rpi, prefix_lens=prefix, extend_seq_lens=extend,
                            check=True) == PlanStatus.OK  # no status bit: corruption, not an input fault
        records.verify(vp)
        found = list(records.drain())
        loc = np.array([lut[r2t[rp, p]] for rp in rpi for p in range(P, P + E)], dtype=np.int64)
        ids = np.array([tokens[rp, p] for rp in rpi for p in range(P, P + E)], dtype=np.int64)
        pos = np.array([p for _ in rpi for p in range(P, P + E)], dtype=np.int64)
        records.write(wp, out_cache_loc=loc, input_ids=ids, positions=pos)
        assert len(records.drain()) == 0
        if step == 0:
            assert found == []
    return found, lut, vp


def test_missing_slot_is_exported():
    assert canary.MISSING_SLOT == MISSING_SLOT == -(1 << 62)
    assert FailReason.MISSING == 128


def test_intact_mappings_verify_clean():
    found, _, vp = _run(())
    assert found == []
    assert int(vp.verify_num_valid[0]) == 2 * W and MISSING_SLOT not in vp.verify_slot_indices[: 2 * W]


def test_mapping_cleared_inside_the_window_is_reported_once():
    """Row 1's position 6 (window [4, 8)) loses its SWA slot: one MISSING violation, at that position; the next
    entry, whose predecessor it is, is not reported (its chain check is skipped, as for any evicted predecessor)."""
    found, _, vp = _run(((1, 6),))
    assert [(v.slot, v.position, v.reasons) for v in found] == [(MISSING_SLOT, 6, FailReason.MISSING)]
    (v,) = found
    assert v.reason_names == ("MISSING",) and v.stored_token == 0 and v.expected_chain_hash is None
    slots = vp.verify_slot_indices[: 2 * W].tolist()
    assert slots[2] == MISSING_SLOT and vp.verify_prev_slot_indices[3] == 0


@pytest.mark.parametrize("cleared", [((1, 3),), ((2, 0),), ((1, 3), (2, 1))], ids=str)
def test_mapping_cleared_outside_the_window_stays_silent(cleared):
    """Positions before the window start (4) are legitimately evicted: at most a window head's predecessor."""
    found, _, vp = _run(cleared)
    assert found == []
    assert MISSING_SLOT not in vp.verify_slot_indices[: 2 * W]
