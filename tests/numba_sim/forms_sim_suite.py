"""The index forms (SPEC 3.8) on the Numba kernels under the CUDA simulator, byte for byte against the reference.

Run by ``pytest -m sim`` (``tests/helpers/sim_plugin.py``; one test: ``pytest -q -m sim tests/numba_sim -k
forms``). Every paged hand case, the twins of hand and random cases (``helpers/index_forms.py``) and the
bad-entry cases, through the fused launch and the rows + entries pair; a step that passes its own index.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
    pytest.skip("run with NUMBA_ENABLE_CUDASIM=1 (tests/helpers/sim_plugin.py does)", allow_module_level=True)

from helpers.index_forms import bad_entry_case, page_twins, paged_hand_cases  # noqa: E402
from helpers.plan_cases import (  # noqa: E402
    BUFFERS, POISON, POISON_ALT, RULE_KNOBS, PlanCase, assert_same, expected_outputs, hand_case, make_plans,
    random_case,
)

from canary import BackendUnavailableError, CanaryPlanner, LaunchConfig  # noqa: E402
from canary.backends.args import StepArgs  # noqa: E402
from canary.interop.adapter import as_view  # noqa: E402
from canary.plan.index import step_index  # noqa: E402
from canary.plan.planner import bind_static  # noqa: E402

try:
    from canary.backends.numba import plan as nb
except BackendUnavailableError as exc:
    pytest.skip(str(exc), allow_module_level=True)

pytestmark = [pytest.mark.sim, pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")]

FUSED, TWO_PASS = "fused", "two_pass"
PAGE_SIZES = (1, 3, 4, 16)


def _step(case: PlanCase, index=None) -> StepArgs:
    kw = case.step_kwargs()
    vl, q = kw["req_to_verify_expected_tokens_valid_lens"], kw.get("expected_token_pool_indices")
    return StepArgs(as_view(kw["req_pool_indices"], "req_pool_indices"), as_view(kw["prefix_lens"], "prefix_lens"),
                    as_view(kw["extend_seq_lens"], "extend_seq_lens"),
                    None if vl is None else as_view(vl, "valid_lens"), case.bs,
                    None if q is None else as_view(q, "expected_token_pool_indices"), index)


def run_numba(case: PlanCase, path: str, poison=POISON, step_case: PlanCase | None = None) -> dict:
    """One plan of ``case`` on the simulated Numba backend (``step_case``: a step that passes that case's index
    arrays instead of the bound ones)."""
    vp, wp, raw = make_plans(case, "numpy", poison)
    static = bind_static(verify_plan_out=vp, write_plan_out=wp, verify_capacity=case.verify_capacity,
                         max_batch_size=case.max_batch_size, **case.static_kwargs())
    bound = nb.bind(static, LaunchConfig(fused_max_bs=-1 if path == TWO_PASS else None))
    index = None
    if step_case is not None:
        arrays = {k: v for k, v in step_case.index_kwargs().items() if k != "page_size"}
        index = step_index(static.index, case.bs, as_view, **arrays)
    bound.launch(_step(case, index), 0)
    assert not bound.scratch[:2].any(), f"scratch counters not re-armed: {bound.scratch[:4]}"
    return {k: raw[k].copy() for k in BUFFERS}


def check(case: PlanCase, path: str, poison=POISON) -> None:
    assert_same(run_numba(case, path, poison), expected_outputs(case, poison), case)


@pytest.mark.parametrize("path", [FUSED, TWO_PASS])
@pytest.mark.parametrize("case", paged_hand_cases(), ids=lambda c: c.name)
def test_forms_paged_hand_cases(case, path):
    check(case, path, POISON if path == FUSED else POISON_ALT)


HAND_NAMES = ["bs1_decode", "seeds_mixed", "swa_missing_in_window", "swa_p_full", "padding_tokens_middle",
              "bad_slot_verify_entry", "all_bits", "pool_q_by_identity", "extend_negative_active",
              "sampled_decode_C4_inside", "sampled_padding_C3_edge", "sampled_swa_window_wrap",
              "sampled_lut_bad_slot", "sampled_duplicate_row", "big_batch_600_rotation"]


@pytest.mark.parametrize("name", HAND_NAMES)
def test_forms_hand_case_twins(name):
    seed = HAND_NAMES.index(name)
    _tokens, blocks, pages = page_twins(hand_case(name), PAGE_SIZES[seed % len(PAGE_SIZES)], seed)
    for i, twin in enumerate((blocks, pages)):
        check(twin, (FUSED, TWO_PASS)[(seed + i) % 2])


@pytest.mark.parametrize("seed", range(24))
def test_forms_random_twins_and_bad_entries(seed):
    case = random_case(seed, name=f"forms-{seed}", **RULE_KNOBS[seed % len(RULE_KNOBS)])
    s = PAGE_SIZES[seed % len(PAGE_SIZES)]
    tokens, blocks, pages = page_twins(case, s, seed)
    want = expected_outputs(tokens)
    path = (FUSED, TWO_PASS)[seed % 2]
    assert_same(run_numba(blocks, path), want, blocks)
    assert_same(run_numba(pages, path), want, pages)
    for form in ("block_table", "page_list"):
        check(bad_entry_case(case, s, seed, form=form), (FUSED, TWO_PASS)[(seed + 1) % 2])


@pytest.mark.parametrize("path", [FUSED, TWO_PASS])
@pytest.mark.parametrize("form", ["block_table", "page_list"])
def test_forms_a_step_passes_its_own_index(form, path):
    base = random_case(31, bs=(6, 6), max_reqs=(7, 7), max_seq_len=(12, 12), capacity="sampled",
                       on_overflow="sample", name="own")
    _t1, b1, p1 = page_twins(base, 4, 1)
    _t2, b2, p2 = page_twins(base, 4, 2)
    first, second = (b1, b2) if form == "block_table" else (p1, p2)
    got = run_numba(first, path, step_case=second)
    assert_same(got, expected_outputs(second.replace(cursors=first.cursors)), second)


def test_forms_through_the_planner():
    """CanaryPlanner(backend="numba") with host arrays (the simulator's device), both forms, a step's own index."""
    base = random_case(4, bs=(5, 5), max_reqs=(6, 6), max_seq_len=(10, 10), capacity="loose", name="planner")
    _t, blocks, pages = page_twins(base, 2, 4)
    _t2, blocks2, pages2 = page_twins(base, 2, 5)
    for first, second in ((blocks, blocks2), (pages, pages2)):
        vp, wp, raw = make_plans(first)
        planner = CanaryPlanner(backend="numba", verify_plan_out=vp, write_plan_out=wp, **first.static_kwargs())
        planner.plan(**first.step_kwargs())
        assert_same({k: np.asarray(v).copy() for k, v in raw.items()}, expected_outputs(first), first)
        cursors = raw["verify_cursors"].copy()
        arrays = {k: v for k, v in second.index_kwargs().items() if k != "page_size"}
        planner.plan(**first.step_kwargs(), **arrays)
        assert_same({k: np.asarray(v).copy() for k, v in raw.items()},
                    expected_outputs(second.replace(cursors=cursors)), second)


@pytest.mark.parametrize("path", [FUSED, TWO_PASS])
def test_forms_wide_tables(path):
    """SPEC 2 (*), 3.8: an int64 block table / kv_indices plans as the int32 one does; an int64 entry past
    2**31 - 1 as a negative (bad) one; every array's width drawn on its own."""
    from helpers.index_forms import wide_table_edge_cases
    from helpers.plan_cases import with_widths

    for case, twin in wide_table_edge_cases():
        want = expected_outputs(twin)
        assert_same(run_numba(case, path), want, case)
        assert_same(run_numba(with_widths(case, all32=True), path), want, case)
    for case in paged_hand_cases():
        want = expected_outputs(case)
        for narrowed in (with_widths(case, all64=True), with_widths(case, 5)):
            assert_same(run_numba(narrowed, path), want, narrowed)


@pytest.mark.parametrize("form", ["block_table", "page_list"])
def test_forms_a_step_index_of_the_other_width(form):
    """A planner bound to an int32 table, a step passing an int64 one (and back): the index words follow."""
    from helpers.plan_cases import with_widths

    base = random_case(31, bs=(6, 6), max_reqs=(7, 7), max_seq_len=(12, 12), capacity="loose", name="own")
    _t1, b1, p1 = page_twins(base, 4, 1)
    _t2, b2, p2 = page_twins(base, 4, 2)
    first, second = (b1, b2) if form == "block_table" else (p1, p2)
    got = run_numba(first, FUSED, step_case=with_widths(second, all64=True))
    assert_same(got, expected_outputs(second.replace(cursors=first.cursors)), second)
