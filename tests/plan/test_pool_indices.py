"""``expected_token_pool_indices`` (SPEC 3.2-3.4): the expected-token pool keyed apart from ``req_pool_indices``.

An engine that keys its pool by request identity (a pool row owned by the request for its whole life) passes
the pool row of each batch row; without it the pool row is the reusable ``req_to_token`` row. The reference
against the naive oracle, hand-read values, the equivalence of ``q = rp`` with no ``q``, the host validation,
and the GPU backends on the same cases (marker ``gpu``). The hand cases ``pool_q_*`` also run in the Numba
simulator suite (``tests/numba_sim``) and in the GPU matrix of ``test_plan_backends.py``.
"""
from __future__ import annotations

import numpy as np
import pytest
from helpers.naive_plan import naive_plan
from helpers.gpu_guard import backend_or_skip
from helpers.plan_cases import (
    BAD_REQ_POOL_INDEX, POISON, POISON_ALT, assert_same, expected_outputs, hand_case, hand_cases, make_case,
    make_plans, plan_cases, poisoned_outputs, random_case, run_case, std_pool,
)

from canary import CanaryInputError, CanaryPlanner, PlanStatus, launch_canary_plan_kernels

POOL_Q_CASES = [c for c in hand_cases() if c.name.startswith("pool_q_")]


@pytest.mark.parametrize("case", POOL_Q_CASES, ids=lambda c: c.name)
def test_hand_cases_match_the_oracle(case):
    for poison in (POISON, POISON_ALT):
        want = naive_plan(case, poisoned_outputs(case, poison))
        assert_same(expected_outputs(case, poison), want, case)
        assert_same(run_case(case, poison=poison), want, case)
    assert_same(run_case(case, api="launch"), naive_plan(case, poisoned_outputs(case)), case)
    assert int(expected_outputs(case)["status"][0]) == case.expect_status


def test_expected_tokens_come_from_the_pool_row_q():
    """rows (rp 1, q 3) and (rp 2, q 0): pool[q, p] = 50_000 + 100 q + p; rp 5 >= pool_rows 4 is no fault."""
    out = expected_outputs(hand_case("pool_q_by_identity"))
    assert out["status"][0] == 0
    assert out["verify_expected_tokens"][:11].tolist() == [
        50300, 50301, 50302, 50303,  # rp 1, q 3, P 4
        50000, 50001, 50002,  # rp 2, q 0, P 3 (valid_len 3)
        50100, 50101,  # rp 5, q 1, P 2
        50300, 50301,  # rp 3, q 3 (shared with the first row)
    ]
    # Slots still come from req_to_token[rp] (std_r2t: 100 rp + p + 1).
    assert out["verify_slot_indices"][:4].tolist() == [101, 102, 103, 104]
    assert out["verify_slot_indices"][7:9].tolist() == [501, 502]


@pytest.mark.parametrize("q", [-1, 4, 1 << 40, -(1 << 62)])
def test_q_out_of_range_flags_only_its_row(q):
    case = make_case("q", [(1, 2, 1, 8, 2), (2, 3, 2, 8, q)], pool=std_pool(4, 8), expect_status=BAD_REQ_POOL_INDEX)
    out = expected_outputs(case)
    assert (out["status"][0], out["enable"][0]) == (BAD_REQ_POOL_INDEX, 0)
    assert out["write_seed_slot_indices"][:2].tolist() == [102, -1]  # the flagged row: no seed
    assert out["write_offsets"][:3].tolist() == [0, 1, 3]  # its E still counts, as for a bad rp
    assert (out["verify_slot_indices"] == POISON.i64).all()  # entries not written
    with pytest.raises(CanaryInputError, match="first offending batch row: 1"):
        run_case(case, check=True)


@pytest.mark.parametrize("seed", range(40))
def test_q_equal_to_rp_is_the_plan_without_q(seed):
    case = random_case(seed, pool=True, fault_prob=0.1, name=f"q-eq-rp-{seed}")
    with_q = case.replace(pool_indices=case.req_pool_indices.copy())
    assert_same(expected_outputs(with_q), expected_outputs(case), case)
    assert_same(run_case(with_q), expected_outputs(case), case)


@pytest.mark.parametrize("seed", range(60))
def test_random_cases_match_the_oracle(seed):
    case = random_case(seed, pool=True, pool_indices=True, fault_prob=0.1, swa=None, capacity="tight",
                       padding_rows_carry_tokens=None, name=f"q-{seed}")
    assert case.pool_indices is not None
    assert_same(run_case(case), naive_plan(case, poisoned_outputs(case)), case)


def test_random_cases_hypothesis():
    hypothesis = pytest.importorskip("hypothesis")

    @hypothesis.settings(max_examples=60, deadline=None, derandomize=True,
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(case=plan_cases(pool=True, pool_indices=True, bs=(0, 10), fault_prob=0.15))
    def check(case):
        assert_same(run_case(case), naive_plan(case, poisoned_outputs(case)), case)

    check()


def test_planner_reads_q_per_step():
    """The same planner, one step keyed by rp and one by identity: q is a per-step input, not bound."""
    case = hand_case("pool_q_by_identity")
    vp, wp, raw = make_plans(case)
    planner = CanaryPlanner(verify_plan_out=vp, write_plan_out=wp, **case.static_kwargs())
    step = case.step_kwargs()
    assert planner.plan(**step, check=True) == PlanStatus.OK
    assert_same({k: v.copy() for k, v in raw.items()}, expected_outputs(case), case)
    del step["expected_token_pool_indices"]
    with pytest.raises(CanaryInputError):  # keyed by rp again: rp 5 >= pool_rows 4
        planner.plan(**step, check=True)


# --------------------------------------------------------------------------------------------------------------
# Host validation (SPEC 3.3)


def _setup(pool=True):
    case = make_case("v", [(1, 3, 1, 8, 2), (2, 2, 1, 8, 0)] if pool else [(1, 3, 1), (2, 2, 1)],
                     pool=std_pool(4, 8) if pool else None)
    vp, wp, raw = make_plans(case)
    return case, dict(verify_plan_out=vp, write_plan_out=wp, **case.static_kwargs()), raw


def _call(api, static, step):
    if api == "launch":
        return launch_canary_plan_kernels(**static, **step)
    return CanaryPlanner(**static).plan(**step)


def _raises(exc, api, static, step, *needles):
    with pytest.raises(exc) as info:
        _call(api, static, step)
    msg = str(info.value)
    assert msg.startswith("kv-canary: expected_token_pool_indices:"), msg
    for n in needles:
        assert n in msg, (n, msg)


APIS = ["planner", "launch"]


@pytest.mark.parametrize("api", APIS)
def test_valid_q_plans(api):
    case, static, raw = _setup()
    assert _call(api, static, case.step_kwargs()) is None
    assert_same({k: v.copy() for k, v in raw.items()}, expected_outputs(case), case)


@pytest.mark.parametrize("api", APIS)
def test_q_without_a_pool_is_refused(api):
    case, static, _ = _setup(pool=False)
    step = dict(case.step_kwargs(), expected_token_pool_indices=np.array([1, 2], dtype=np.int64))
    _raises(ValueError, api, static, step, "expected None", "no expected-token pool", "got an array")


@pytest.mark.parametrize("api", APIS)
def test_q_dtype_is_checked(api):
    case, static, _ = _setup()
    for bad in (np.int16, np.uint32, np.float32):  # int32 and int64 are both taken (SPEC 2 (*))
        step = dict(case.step_kwargs(), expected_token_pool_indices=np.array([2, 0], dtype=bad))
        _raises(TypeError, api, static, step, "int32 or int64", np.dtype(bad).name)


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("bad", [np.array([2, 0, 1], dtype=np.int64), np.array([2], dtype=np.int64),
                                 np.zeros((2, 1), dtype=np.int64)], ids=["long", "short", "2d"])
def test_q_shape_is_checked(api, bad):
    case, static, _ = _setup()
    step = dict(case.step_kwargs(), expected_token_pool_indices=bad)
    _raises(ValueError, api, static, step)


@pytest.mark.parametrize("api", APIS)
def test_q_strided_is_refused(api):
    case, static, _ = _setup()
    step = dict(case.step_kwargs(), expected_token_pool_indices=np.array([2, 9, 0, 9], dtype=np.int64)[::2])
    _raises(ValueError, api, static, step)


@pytest.mark.parametrize("api", APIS)
def test_q_overlapping_an_output_is_refused(api):
    case, static, raw = _setup()
    step = dict(case.step_kwargs(), expected_token_pool_indices=raw["write_offsets"][:2])
    _raises(ValueError, api, static, step, "write_plan_out.write_offsets")


def test_q_may_share_memory_with_inputs():
    """q = req_pool_indices itself (the same array) is an input like any other."""
    case, static, raw = _setup()
    step = case.step_kwargs()
    step["expected_token_pool_indices"] = step["req_pool_indices"]
    CanaryPlanner(**static).plan(**step)
    assert_same({k: v.copy() for k, v in raw.items()},
                expected_outputs(case.replace(pool_indices=case.req_pool_indices)), case)


# --------------------------------------------------------------------------------------------------------------
# The GPU backends on the same cases


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cupy", "numba"])
@pytest.mark.parametrize("case", POOL_Q_CASES, ids=lambda c: c.name)
def test_gpu_hand_cases(backend, case):
    backend_or_skip(backend)
    for poison in (POISON, POISON_ALT):
        assert_same(run_case(case, backend, "cupy", poison), expected_outputs(case, poison), case)
    assert_same(run_case(case, backend, "cupy", api="launch"), expected_outputs(case), case)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cupy", "numba"])
@pytest.mark.parametrize("seed", range(100))
def test_gpu_random_cases(backend, seed):
    backend_or_skip(backend)
    knobs = dict(bs=(1, 300), max_seq_len=(1, 200), capacity="loose") if seed % 2 else dict(bs=(500, 1100))
    case = random_case(seed, pool=True, pool_indices=True, fault_prob=0.05, name=f"gpu-q-{seed}", **knobs)
    assert_same(run_case(case, backend, "cupy"), expected_outputs(case), case)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cupy", "numba"])
def test_gpu_q_on_another_device_or_host_is_refused(backend):
    backend_or_skip(backend)
    case, _, _ = _setup()
    vp, wp, _raw = make_plans(case, "cupy")
    from helpers.plan_cases import to_xp

    static = dict(verify_plan_out=vp, write_plan_out=wp, **case.static_kwargs(lambda a: to_xp(a, "cupy")))
    step = dict(case.step_kwargs(lambda a: to_xp(a, "cupy")), expected_token_pool_indices=case.pool_indices)
    _raises(ValueError, "planner", dict(static, backend=backend), step, "device")
