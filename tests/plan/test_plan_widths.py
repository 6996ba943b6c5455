"""SPEC 2 (*): the plan's integer arrays as the engine has them. ``req_pool_indices``, ``prefix_lens``,
``extend_seq_lens``, ``req_to_verify_expected_tokens_valid_lens``, ``expected_token_pool_indices`` and a paged
index's ``block_table`` / ``kv_indices`` (and ``kv_indptr``) are int32 or int64, each independently; the plan of
int32 arrays is byte-identical to the plan of the same values as int64, on the reference here (the Numba twin in
tests/numba_sim, CuPy and Numba on a GPU in test_plan_backends.py). Int32 extremes and negative values keep the
status bits the int64 values give; an int64 block entry past 2**31 - 1 plans as a bad (negative) entry does."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from helpers.index_forms import paged_hand_cases, wide_table_edge_cases
from helpers.plan_cases import (
    POISON_ALT, assert_same, expected_outputs, hand_cases, int32_edge_cases, plan_cases, run_case, with_widths,
)


def _narrowings(case, seed=1):
    return [with_widths(case, all32=True), with_widths(case, seed), with_widths(case, seed + 1)]


@pytest.mark.parametrize("case", hand_cases() + paged_hand_cases(), ids=lambda c: c.name)
def test_hand_cases_in_either_width(case):
    want = expected_outputs(case)
    for narrowed in _narrowings(case):
        assert_same(expected_outputs(narrowed), want, narrowed)  # the reference's own reading
        assert_same(run_case(narrowed, "reference"), want, narrowed)  # through the planner's host checks
    assert_same(run_case(with_widths(case, 3), "reference", api="launch"), want, case)


@pytest.mark.parametrize("case", int32_edge_cases(), ids=lambda c: c.name)
def test_int32_extremes_keep_their_status_bits(case):
    want = expected_outputs(case)
    narrowed = with_widths(case, all32=True)
    assert narrowed.req_pool_indices.dtype == np.int32
    got = run_case(narrowed, "reference", poison=POISON_ALT)
    assert_same(got, expected_outputs(case, POISON_ALT), narrowed)
    assert int(got["status"][0]) == int(want["status"][0])


@pytest.mark.parametrize("pair", wide_table_edge_cases(), ids=lambda p: p[0].name)
def test_a_wide_block_entry_past_int32_is_a_bad_entry(pair):
    case, twin = pair
    want = expected_outputs(twin)
    assert_same(expected_outputs(case), want, case)
    assert_same(run_case(case, "reference"), want, case)
    assert_same(run_case(with_widths(case, all32=True), "reference"), want, case)  # narrowed where it fits


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=plan_cases(fault_prob=0.2, pool_indices=None, padding_fraction=0.3))
def test_random_cases_in_either_width(case):
    want = expected_outputs(case)
    for narrowed in _narrowings(case, 7):
        assert_same(run_case(narrowed, "reference"), want, narrowed)


@pytest.mark.parametrize("bad", [np.int8, np.int16, np.uint16, np.uint32, np.uint64, np.float32, np.bool_])
@pytest.mark.parametrize("name", ["req_pool_indices", "prefix_lens", "extend_seq_lens"])
def test_other_dtypes_are_refused_naming_the_array(name, bad):
    from canary import CanaryPlanner
    from helpers.plan_cases import make_plans

    case = hand_cases()[0]
    vp, wp, _ = make_plans(case)
    planner = CanaryPlanner(verify_plan_out=vp, write_plan_out=wp, backend="reference", **case.static_kwargs())
    step = case.step_kwargs()
    with pytest.raises(TypeError, match=rf"^kv-canary: {name}: expected dtype int32 or int64, got "
                                        rf"{np.dtype(bad).name}$"):
        planner.plan(**{**step, name: step[name].astype(bad)})


def test_torch_cpu_int32_tensors_plan_as_int64():
    pytest.importorskip("torch")
    for case in hand_cases()[:10]:
        want = expected_outputs(case)
        assert_same(run_case(with_widths(case, all32=True), "reference", "torch"), want, case)
