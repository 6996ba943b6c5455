"""``check=True`` names the first offending batch row for every input-error bit, BAD_SLOT included (a row whose
slot, predecessor slot or seed is outside the LUT), recomputed on the host from the step's inputs.
``VerifyPlan.check()`` has only the status word: its message says the row is unknown and how to get it."""
from __future__ import annotations

import numpy as np
import pytest
from helpers.plan_cases import make_case, make_plans, std_lut, std_r2t, to_xp

from canary import CanaryInputError, CanaryPlanner, PlanStatus, launch_canary_plan_kernels

B = PlanStatus
XPS = ["numpy", "torch", pytest.param("cupy", marks=pytest.mark.gpu)]
APIS = ["planner", "launch"]
LUT = std_lut(300)  # r2t slots are 100 * rp + p + 1: requests 1 and 2 stay inside, 5000 is outside


def r2t_with(**cells) -> np.ndarray:
    """std_r2t with cells named ``rRP_pP`` set (e.g. ``r2_p1=5000``)."""
    r2t = std_r2t()
    for key, value in cells.items():
        rp, p = (int(part[1:]) for part in key.split("_"))
        r2t[rp, p] = value
    return r2t


# (name, rows (rp, P, E[, valid_len]), make_case keywords, expected status, expected first row)
CASES = [
    ("bad_req_pool_index", [(1, 2, 1, 8), (2, 1, 1, 8), (-4, 2, 1, 8), (3, 99, 0, 8)], {"pool": True},
     B.BAD_REQ_POOL_INDEX | B.BAD_PREFIX_LEN, 2),
    ("bad_prefix_len", [(1, 2, 1, 8), (2, 1, 1, 8), (3, 99, 0, 8)], {"pool": True}, B.BAD_PREFIX_LEN, 2),
    ("bad_valid_len", [(1, 2, 1, 8), (0, 2, 1, 99), (2, 1, 1, 9)], {"pool": True}, B.BAD_VALID_LEN, 2),
    ("bad_slot_in_the_window", [(1, 3, 1), (2, 3, 0)], {"r2t": r2t_with(r2_p1=5000), "lut": LUT}, B.BAD_SLOT, 1),
    ("bad_slot_predecessor_only", [(1, 3, 1), (2, 4, 0)], {"r2t": r2t_with(r2_p1=5000), "lut": LUT, "W": 2},
     B.BAD_SLOT, 1),
    ("bad_slot_seed_only", [(1, 3, 1), (2, 4, 1)],
     {"r2t": r2t_with(r2_p3=5000), "lut": LUT, "C": 1, "on_overflow": "skip"}, B.OVERFLOW | B.BAD_SLOT, 1),
    ("bad_slot_seed_only_sampled", [(1, 3, 1), (2, 4, 1)], {"r2t": r2t_with(r2_p3=5000), "lut": LUT, "C": 1},
     B.SAMPLED | B.BAD_SLOT, 1),
    ("bad_slot_before_a_bad_prefix", [(2, 4, 1), (1, 99, 0)], {"r2t": r2t_with(r2_p3=5000), "lut": LUT},
     B.BAD_PREFIX_LEN | B.BAD_SLOT, 0),
    ("bad_prefix_before_a_bad_slot", [(1, 99, 0), (2, 4, 1)], {"r2t": r2t_with(r2_p3=5000), "lut": LUT},
     B.BAD_PREFIX_LEN | B.BAD_SLOT, 0),
    ("negative_slots_pass_the_lut", [(1, 3, 1), (2, 2, 1), (2, 3, 0)],
     {"r2t": r2t_with(r1_p0=-1, r2_p2=300), "lut": LUT}, B.BAD_SLOT, 2),
    ("padding_rows_are_never_flagged", [(0, 99, 7), (0, -5, 1), (2, 3, 0)], {"r2t": r2t_with(r2_p2=301), "lut": LUT},
     B.BAD_SLOT, 2),
    ("negative_extend_len", [(1, 2, 1), (0, 3, -1), (2, 1, -1), (3, 1, -(1 << 63))], {}, B.BAD_EXTEND_LEN, 2),
    ("negative_extend_len_carry", [(0, 3, -(1 << 63)), (1, 2, 1), (2, 4, -7)], {"carry": True},
     B.BAD_EXTEND_LEN, 2),
]


def _plan(case, api: str, xp: str):
    if xp == "torch":
        pytest.importorskip("torch")
    vp, wp, raw = make_plans(case, xp)
    conv = lambda a: to_xp(a, xp)  # noqa: E731
    static = dict(verify_plan_out=vp, write_plan_out=wp, **case.static_kwargs(conv))
    step = case.step_kwargs(conv)
    if api == "launch":
        return vp, lambda: launch_canary_plan_kernels(**static, **step, check=True)
    planner = CanaryPlanner(**static)
    return vp, lambda: planner.plan(**step, check=True)


def _message(status: PlanStatus, row) -> str:
    names = "|".join(b.name for b in PlanStatus if b and b in status)
    return f"kv-canary: status: expected no input-error bits, got {int(status)} ({names}); first offending batch row: {row}"


@pytest.mark.parametrize("xp", XPS)
@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("name, rows, kw, status, row", CASES, ids=[c[0] for c in CASES])
def test_check_true_names_the_first_offending_row(name, rows, kw, status, row, api, xp):
    case = make_case(name, rows, **kw)
    _vp, run = _plan(case, api, xp)
    with pytest.raises(CanaryInputError) as info:
        run()
    assert str(info.value) == _message(status, row)
    assert info.value.status == status and info.value.first_bad_row == row


@pytest.mark.parametrize("xp", XPS)
def test_verify_plan_check_says_the_row_is_unknown_and_how_to_get_it(xp):
    case = make_case("slot", [(1, 3, 1), (2, 3, 0)], r2t=r2t_with(r2_p1=5000), lut=LUT)
    vp, run = _plan(case, "planner", xp)
    with pytest.raises(CanaryInputError):
        run()
    with pytest.raises(CanaryInputError) as info:
        vp.check()
    assert str(info.value) == _message(B.BAD_SLOT, "unknown (VerifyPlan.check() sees only the status word, not the "
                                                   "step's inputs: plan with check=True to have the row named)")
    assert info.value.first_bad_row is None


def test_inputs_changed_after_the_plan_make_the_row_unknown(monkeypatch):
    """The row is recomputed from the inputs as they are at the check: if they no longer show it, say so."""
    from canary.plan import index as planner_module  # check=True's row search (canary/plan/index.py)

    case = make_case("slot", [(1, 3, 1), (2, 3, 0)], r2t=r2t_with(r2_p1=5000), lut=LUT)
    vp, wp, _raw = make_plans(case)
    planner = CanaryPlanner(verify_plan_out=vp, write_plan_out=wp, **case.static_kwargs())
    monkeypatch.setattr(planner_module, "bad_slot_rows", lambda checks, *a, **k: np.zeros_like(checks.active))
    with pytest.raises(CanaryInputError) as info:
        planner.plan(**case.step_kwargs(), check=True)
    assert str(info.value).endswith("first offending batch row: unknown (the step's inputs, read back now, show no "
                                    "offending row: were they changed after the plan was launched?)")


@pytest.mark.parametrize("xp", XPS)
@pytest.mark.parametrize("api", APIS)
def test_a_sampled_step_names_no_row_it_cannot_be_sure_of(api, xp):
    """A sampled step translates only the entries it takes (SPEC 3.7), which the host cannot tell apart once the
    cursors have moved: both rows hold a slot outside the LUT at position 3, the step samples row 0 at position 0
    and row 1 at position 3, and the message lists both candidates instead of naming row 0."""
    case = make_case("sampled_bad_slot", [(1, 4, 0), (2, 4, 0)], r2t=r2t_with(r1_p3=5000, r2_p3=5000), lut=LUT, C=2,
                     cursors=[0, 0, 3, 0, 0, 0], expect_status=B.SAMPLED | B.BAD_SLOT)
    _vp, run = _plan(case, api, xp)
    with pytest.raises(CanaryInputError) as info:
        run()
    assert str(info.value) == _message(B.SAMPLED | B.BAD_SLOT, "unknown (a sampled step translates only the entries "
                                                               "it takes; batch rows holding slots outside the LUT "
                                                               "in their windows: 0, 1)")
    assert info.value.first_bad_row is None
