"""``padding_slot=-1`` (SPEC 3.2 "No reserved slot", 3.8, 4): an engine whose slot 0 and block 0 are real, padding
marked by a negative slot. Hand cases with their expected bytes in all three index forms, on the reference and the
naive oracle (the Numba and CuPy backends run the same cases in their suites), the default left as it was, the
option's validation, and the records' verify of slot 0 end to end."""
from __future__ import annotations

import numpy as np
import pytest
from helpers.index_forms import REAL0_CASES, padding_slot_hand_cases
from helpers.naive_plan import naive_plan
from helpers.plan_cases import (
    assert_same, expected_outputs, hand_case, make_plans, poisoned_outputs, random_case, run_case,
)

import canary
from canary import (
    MISSING_SLOT, CanaryPlanner, CanaryRecords, CanaryState, FailReason, KernelTag, VerifyPlan, WritePlan,
)

CASES = padding_slot_hand_cases()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_hand_case_bytes(case):
    rows, _w, _lut, slots, prevs, seeds, status = REAL0_CASES[case.name.split("_", 1)[1]]
    got = run_case(case, "reference")
    n = len(slots)
    assert got["verify_slot_indices"][:n].tolist() == slots, case.describe()
    assert got["verify_prev_slot_indices"][:n].tolist() == prevs, case.describe()
    assert got["write_seed_slot_indices"][:len(rows)].tolist() == seeds, case.describe()
    assert int(got["status"][0]) == status
    assert int(got["enable"][0]) == (1 if status == 0 else 0)
    assert_same(got, naive_plan(case, poisoned_outputs(case)), case)
    assert_same(run_case(case, "auto", api="launch"), got, case)


def test_every_form_writes_the_same_bytes():
    by_case: dict[str, list] = {}
    for case in CASES:
        by_case.setdefault(case.name.split("_", 1)[1], []).append(expected_outputs(case))
    for name, outs in by_case.items():
        assert len(outs) == 3
        for other in outs[1:]:
            assert_same(other, outs[0])


@pytest.mark.parametrize("name", ["bs1_decode", "swa_missing_in_window", "swa_missing_no_lut", "seeds_mixed"])
def test_default_is_unchanged_and_minus_one_differs_only_at_slot_zero(name):
    """The default's bytes are the hand case's (SPEC: the option changes nothing by default); the same case under
    -1 moves the 0 raw slots from MISSING to real slots, and nothing else."""
    case = hand_case(name)
    default = run_case(case, "reference")
    assert_same(default, naive_plan(case, poisoned_outputs(case)), case)
    real0 = run_case(case.replace(padding_slot=-1), "reference")
    r2t = case.req_to_token
    if not (r2t[1:] <= 0).any() and (case.lut is None or not (case.lut <= 0).any()):
        assert_same(real0, default, case)  # no 0 and no negative: the same plan


def test_negative_block_is_not_bad_slot():
    case = next(c for c in CASES if c.name == "blocks_real0_missing_in_window")
    assert int(run_case(case, "reference")["status"][0]) == 0
    default = case.replace(padding_slot=0)
    assert int(run_case(default, "reference")["status"][0]) & canary.PlanStatus.BAD_SLOT


@pytest.mark.parametrize("seed", range(40))
def test_random_minus_one_matches_the_oracle(seed):
    case = random_case(seed, padding_slot=-1, fault_prob=0.1, name=f"real0-{seed}")
    if case.bs > 12:
        return
    assert_same(expected_outputs(case), naive_plan(case, poisoned_outputs(case)), case)


@pytest.mark.parametrize("value,exc", [(1, ValueError), (-2, ValueError), (2**40, ValueError), (0.0, TypeError),
                                       (True, TypeError), ("0", TypeError), (None, TypeError)])
def test_padding_slot_is_checked(value, exc):
    case = hand_case("bs1_decode")
    vp, wp, _ = make_plans(case)
    kw = case.static_kwargs() | {"padding_slot": value}
    with pytest.raises(exc, match=r"^kv-canary: padding_slot: expected .*0.*-1.*got"):
        CanaryPlanner(verify_plan_out=vp, write_plan_out=wp, **kw)
    with pytest.raises(exc, match=r"^kv-canary: (launch_canary_plan_kernels: )?padding_slot: expected"):
        canary.launch_canary_plan_kernels(verify_plan_out=vp, write_plan_out=wp, **kw, **case.step_kwargs())
    state = CanaryState.allocate(num_slots=8, ring_capacity=4)
    with pytest.raises(exc, match=r"^kv-canary: padding_slot: expected"):
        CanaryRecords(state, padding_slot=value)
    if exc is ValueError:
        with pytest.raises(ValueError, match=f"got {value}$"):
            CanaryRecords(state, padding_slot=value)


# ---- end to end: write then verify, slot 0 real -----------------------------------------------------------------

def _plan_and_verify(padding_slot: int, corrupt=None, lut_zero: bool = False):
    """One request on row 1 owning slots 0..5 (slot 0 first): prefill 6 tokens, then a decode step verifies them.
    ``corrupt(state_fields)`` runs between the steps. Returns the decode step's violations."""
    r2t = np.zeros((2, 8), np.int32)
    r2t[1] = [0, 1, 2, 3, 4, 5, 6, 7]
    vp = VerifyPlan.allocate(verify_capacity=16, max_reqs=2)
    wp = WritePlan.allocate(write_req_capacity=1)
    planner = CanaryPlanner(verify_plan_out=vp, write_plan_out=wp, req_to_token=r2t, padding_slot=padding_slot)
    state = CanaryState.allocate(num_slots=8, ring_capacity=16)
    records = CanaryRecords(state, padding_slot=padding_slot)
    rpi = np.array([1], np.int64)
    found = []
    for step, (P, E) in enumerate(((0, 6), (6, 1))):
        if step == 1 and corrupt is not None:
            corrupt(state.canary_buffer.view(np.int64).reshape(8, -1))
        planner.plan(req_pool_indices=rpi, prefix_lens=np.array([P], np.int64), extend_seq_lens=np.array([E], np.int64))
        records.verify(vp)
        found += list(records.drain())
        loc = np.arange(P, P + E, dtype=np.int64)
        records.write(wp, out_cache_loc=loc, input_ids=1000 + loc, positions=loc)
        assert len(records.drain()) == 0
    return found


def test_slot_zero_verified_clean():
    assert _plan_and_verify(-1) == []


def test_slot_zero_corruption_is_reported():
    def corrupt(fields):
        fields[0, 1] += 1  # slot 0's stored position
    found = sorted(_plan_and_verify(-1, corrupt), key=lambda v: v.slot)
    assert [(v.slot, v.kernel) for v in found] == [(0, KernelTag.VERIFY), (1, KernelTag.VERIFY)]
    assert found[0].reasons == FailReason.POSITION
    assert found[1].reasons == FailReason.CHAIN  # slot 1's chain check reads slot 0 as its real predecessor


def test_default_still_skips_slot_zero_and_reports_it_missing():
    """Under the default a request on slot 0 gets MISSING every verify (why the option exists)."""
    found = _plan_and_verify(0)
    assert found and all(v.slot == MISSING_SLOT for v in found)
    assert {v.position for v in found} == {0}
