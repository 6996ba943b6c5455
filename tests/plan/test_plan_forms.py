"""The index forms (SPEC 3.8): a block table and a page list give the plan of the token table they stand for, byte
for byte; their own faults set status bits and never read out of bounds; the host checks of each form.

Twins (``helpers/index_forms.py``): every hand case and random case is replayed over a random block table and a
page list of the same slots, and the three plans are compared buffer by buffer. Bad entries (negative blocks,
``kv_indptr`` pairs out of order or range) have no token twin: they are checked against the naive oracle (which
asserts every read in bounds) and across backends. The GPU tests (``gpu``) run the same on CuPy and Numba; the
Numba simulator runs them in ``tests/numba_sim/forms_sim_suite.py``.
"""
from __future__ import annotations

import numpy as np
import pytest
from helpers.index_forms import bad_entry_case, page_twins, paged_hand_cases
from helpers.naive_plan import naive_plan
from helpers.plan_cases import (
    BAD_REQ_POOL_INDEX, BAD_SLOT, RULE_KNOBS, assert_same, expected_outputs, hand_cases, make_plans, plan_cases,
    poisoned_outputs, random_case, run_case,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from canary import CanaryInputError, CanaryPlanner, PlanStatus, launch_canary_plan_kernels

PAGED_HAND = paged_hand_cases()
HAND = hand_cases()
PAGE_SIZES = (1, 2, 4, 7, 16)


def _twins(case, seed: int):
    return page_twins(case, PAGE_SIZES[seed % len(PAGE_SIZES)], seed)


# --------------------------------------------------------------------------------------------------------------
# The reference: paged hand cases against the naive oracle, every hand case against its twins


@pytest.mark.parametrize("case", PAGED_HAND, ids=lambda c: c.name)
def test_paged_hand_case_matches_the_oracle(case):
    want = naive_plan(case, poisoned_outputs(case))
    assert_same(expected_outputs(case), want, case)
    assert_same(run_case(case, "reference"), want, case)
    assert_same(run_case(case, "auto", api="launch"), want, case)
    assert int(want["status"][0]) == case.expect_status, case.describe()


def test_paged_hand_cases_cover_both_forms_and_their_faults():
    statuses = {(c.form, int(expected_outputs(c)["status"][0])) for c in PAGED_HAND}
    for form in ("block_table", "page_list"):
        assert any(f == form and s & BAD_SLOT for f, s in statuses), form
    assert any(f == "page_list" and s & BAD_REQ_POOL_INDEX for f, s in statuses)


@pytest.mark.parametrize("index", range(len(HAND)), ids=lambda i: HAND[i].name)
def test_hand_case_twins_are_byte_identical(index):
    tokens, blocks, pages = _twins(HAND[index], index)
    want = expected_outputs(tokens)
    for twin in (blocks, pages):
        assert_same(expected_outputs(twin), want, twin)
    if tokens.bs <= 64:  # the oracle reads every form its own way
        for twin in (tokens, blocks, pages):
            assert_same(naive_plan(twin, poisoned_outputs(twin)), want, twin)
    for twin in (blocks, pages):  # both entry points
        assert_same(run_case(twin, "reference", api="launch"), want, twin)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=plan_cases(bs=(0, 12), fault_prob=0.1), seed=st.integers(0, 2**32 - 1))
def test_random_twins_are_byte_identical(case, seed):
    tokens, blocks, pages = _twins(case, seed)
    want = expected_outputs(tokens)
    assert_same(expected_outputs(blocks), want, blocks)
    assert_same(expected_outputs(pages), want, pages)
    assert_same(naive_plan(pages, poisoned_outputs(pages)), want, pages)


@pytest.mark.parametrize("seed", range(len(RULE_KNOBS) * 4))
def test_rule_knob_twins(seed):
    case = random_case(seed, name=f"knobs-{seed}", **RULE_KNOBS[seed % len(RULE_KNOBS)])
    tokens, blocks, pages = _twins(case, seed)
    want = expected_outputs(tokens)
    assert_same(run_case(blocks, "reference"), want, blocks)
    assert_same(run_case(pages, "reference"), want, pages)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=plan_cases(bs=(0, 10), fault_prob=0.1), seed=st.integers(0, 2**32 - 1),
       form=st.sampled_from(["block_table", "page_list"]))
def test_bad_entries_match_the_oracle(case, seed, form):
    """Negative block entries and broken kv_indptr: the oracle asserts every read is in bounds."""
    bad = bad_entry_case(case, PAGE_SIZES[seed % len(PAGE_SIZES)], seed, form=form)
    assert_same(expected_outputs(bad), naive_plan(bad, poisoned_outputs(bad)), bad)


def test_composes_with_the_swa_mapping():
    """slot = lut[R(r, p)]: the block table's slot first, then full_to_swa_index_mapping (SPEC 3.8)."""
    case = next(c for c in PAGED_HAND if c.name == "blocks_swa")
    out = expected_outputs(case)
    n = int(out["verify_num_valid"][0])
    raw = case.req_to_token  # the token table the block table stands for
    want = [int(case.lut[raw[1, p]]) for p in range(4, 7)] + [int(case.lut[raw[3, p]]) for p in range(3, 6)]
    assert out["verify_slot_indices"][:n].tolist() == want


# --------------------------------------------------------------------------------------------------------------
# A step's own index (SPEC 3.8: an engine that rebuilds it each step)


def _planner(case, xp="numpy", backend="reference"):
    vp, wp, raw = make_plans(case, xp)
    conv = (lambda a: a) if xp == "numpy" else None
    return CanaryPlanner(backend=backend, verify_plan_out=vp, write_plan_out=wp, max_batch_size=case.max_batch_size,
                         **case.static_kwargs(conv or (lambda a: a))), raw


def _outputs(raw):
    return {k: np.asarray(v).copy() for k, v in raw.items()}


@pytest.mark.parametrize("form", ["block_table", "page_list"])
def test_a_step_passes_its_own_index(form):
    base = random_case(11, bs=(6, 6), max_reqs=(6, 6), max_seq_len=(16, 16), capacity="loose", name="own")
    _t1, b1, p1 = page_twins(base, 4, 1)
    _t2, b2, p2 = page_twins(base, 4, 2)
    first, second = (b1, b2) if form == "block_table" else (p1, p2)
    if form == "block_table":
        second = second.replace(block_table=np.ascontiguousarray(second.block_table))  # any row stride
    planner, raw = _planner(first)
    step = first.step_kwargs()
    planner.plan(**step, **{k: v for k, v in second.index_kwargs().items() if k != "page_size"})
    assert_same(_outputs(raw), expected_outputs(second.replace(cursors=first.cursors)), second)
    cursors = raw["verify_cursors"].copy()
    planner.plan(**step)  # the next step without one reads the bound index again
    assert_same(_outputs(raw), expected_outputs(first.replace(cursors=cursors)), first)


def test_a_step_passes_half_a_page_list():
    """kv_indptr or kv_indices alone: the other stays the bound one."""
    base = random_case(5, bs=(4, 4), max_reqs=(5, 5), max_seq_len=(8, 8), capacity="loose", on_overflow="skip")
    _t, _b, pages = page_twins(base, 2, 3)
    planner, raw = _planner(pages)
    other = pages.replace(kv_indices=pages.kv_indices + 1)  # other slots, the same rows
    planner.plan(**pages.step_kwargs(), kv_indices=other.kv_indices)
    assert_same(_outputs(raw), expected_outputs(other), other)


# --------------------------------------------------------------------------------------------------------------
# Host checks (SPEC 3.3, 3.8)


def _setup(form="block_table"):
    base = random_case(2, bs=(3, 3), max_reqs=(4, 4), max_seq_len=(8, 8), capacity="loose", on_overflow="skip")
    tokens, blocks, pages = page_twins(base, 4, 0)
    case = {"req_to_token": tokens, "block_table": blocks, "page_list": pages}[form]
    vp, wp, _raw = make_plans(case)
    return case, dict(verify_plan_out=vp, write_plan_out=wp, on_overflow="skip")


ONE_FORM = ("kv-canary: req_to_token: expected exactly one index form: req_to_token, or block_table with page_size, "
            "or kv_indptr and kv_indices with page_size, got ")


@pytest.mark.parametrize("api", ["planner", "launch"])
def test_exactly_one_form(api):
    case, plans = _setup("page_list")
    _c, blocks_plans = _setup("block_table")
    bt = np.zeros((4, 2), np.int32)
    r2t = np.zeros((4, 8), np.int32)

    def call(**index):
        if api == "planner":
            CanaryPlanner(**plans, **index)
        else:
            launch_canary_plan_kernels(**plans, **index, **case.step_kwargs())

    with pytest.raises(TypeError) as info:
        call()
    assert str(info.value) == ONE_FORM + "none"
    with pytest.raises(ValueError) as info:
        call(req_to_token=r2t, block_table=bt, page_size=4)
    assert str(info.value) == ONE_FORM + "req_to_token and block_table"
    with pytest.raises(ValueError) as info:
        call(block_table=bt, kv_indptr=case.kv_indptr, kv_indices=case.kv_indices, page_size=4)
    assert str(info.value) == ONE_FORM + "block_table and kv_indptr / kv_indices"
    with pytest.raises(ValueError) as info:
        call(kv_indptr=case.kv_indptr, page_size=4)
    assert str(info.value) == ("kv-canary: kv_indices: expected a page list's kv_indptr and kv_indices together, got "
                               "kv_indices=None")


@pytest.mark.parametrize("page_size, exc, words", [
    (None, ValueError, "page_size: expected an int in [1, 2**31 - 1] (tokens a page) with block_table, got None"),
    (0, ValueError, "page_size: expected an int in [1, 2**31 - 1], got 0"),
    (1 << 31, ValueError, "page_size: expected an int in [1, 2**31 - 1], got 2147483648"),
    (4.0, TypeError, "page_size: expected an int, got float 4.0"),
    (True, TypeError, "page_size: expected an int, got bool True"),
])
def test_page_size_is_checked(page_size, exc, words):
    case, plans = _setup("block_table")
    with pytest.raises(exc) as info:
        CanaryPlanner(**plans, block_table=case.block_table, page_size=page_size)
    assert str(info.value) == "kv-canary: " + words


def test_page_size_with_req_to_token_is_refused():
    case, plans = _setup("req_to_token")
    with pytest.raises(ValueError) as info:
        CanaryPlanner(**plans, req_to_token=case.req_to_token, page_size=16)
    assert str(info.value) == ("kv-canary: page_size: expected None with req_to_token (a token-level table: each "
                               "entry a slot), got 16")


def test_dtypes_and_ranks_are_checked():
    case, plans = _setup("page_list")
    for bad in (np.int16, np.uint32, np.float32):  # SPEC 2 (*): int32 or int64, nothing else
        with pytest.raises(TypeError, match=rf"^kv-canary: block_table: expected dtype int32 or int64, got "
                                            rf"{np.dtype(bad).name}$"):
            CanaryPlanner(**plans, block_table=np.zeros((4, 2), bad), page_size=4)
    with pytest.raises(ValueError, match=r"^kv-canary: block_table: expected a 2-D array, got shape \(8,\)$"):
        CanaryPlanner(**plans, block_table=np.zeros(8, np.int32), page_size=4)
    with pytest.raises(TypeError, match=r"^kv-canary: kv_indptr: expected dtype int32 or int64, got uint32$"):
        CanaryPlanner(**plans, kv_indptr=case.kv_indptr.astype(np.uint32), kv_indices=case.kv_indices, page_size=4)
    with pytest.raises(TypeError, match=r"^kv-canary: kv_indices: expected dtype int32 or int64, got uint64$"):
        CanaryPlanner(**plans, kv_indptr=case.kv_indptr, kv_indices=case.kv_indices.astype(np.uint64), page_size=4)
    with pytest.raises(ValueError, match=r"^kv-canary: kv_indptr: expected a unit inner stride, got stride 2"):
        CanaryPlanner(**plans, kv_indptr=np.zeros(16, np.int64)[::2], kv_indices=case.kv_indices, page_size=4)


def test_kv_indptr_length_is_checked_every_step():
    case, plans = _setup("page_list")
    planner = CanaryPlanner(**plans, **case.index_kwargs())
    with pytest.raises(ValueError) as info:
        planner.plan(**case.step_kwargs(), kv_indptr=case.kv_indptr[:case.bs])
    assert str(info.value) == (f"kv-canary: kv_indptr: expected at least bs + 1 = {case.bs + 1} entries (row r's pages "
                               f"are kv_indices[kv_indptr[r]:kv_indptr[r + 1]]), got {case.bs}")
    with pytest.raises(ValueError, match="kv_indptr: expected at least bs"):
        launch_canary_plan_kernels(**plans, kv_indptr=case.kv_indptr[:case.bs], kv_indices=case.kv_indices,
                                   page_size=case.page_size, **case.step_kwargs())


def test_a_step_index_of_another_form_or_shape_is_refused():
    case, plans = _setup("block_table")
    planner = CanaryPlanner(**plans, **case.index_kwargs())
    with pytest.raises(ValueError) as info:
        planner.plan(**case.step_kwargs(), kv_indices=np.zeros(4, np.int32))
    assert str(info.value) == ("kv-canary: kv_indices: expected None: the planner was bound with block_table, and a "
                               "step may only pass the bound form's arrays again, got an array")
    with pytest.raises(ValueError) as info:
        planner.plan(**case.step_kwargs(), block_table=np.zeros((5, 2), np.int32))
    assert str(info.value) == ("kv-canary: block_table: expected the bound shape (4, 2) (rows and blocks a row), "
                               "got (5, 2)")
    tokens, tplans = _setup("req_to_token")
    planner = CanaryPlanner(**tplans, **tokens.index_kwargs())
    with pytest.raises(ValueError, match="^kv-canary: block_table: expected None: the planner was bound with "
                                         "req_to_token"):
        planner.plan(**tokens.step_kwargs(), block_table=np.zeros((4, 2), np.int32))


def test_an_index_sharing_an_output_is_refused():
    case, plans = _setup("page_list")
    alias = plans["write_plan_out"].write_offsets.view(np.int32)  # the write offsets' memory as int32
    with pytest.raises(ValueError, match="^kv-canary: .*expected memory separate from kv_indices, got an overlap"):
        CanaryPlanner(**plans, kv_indptr=case.kv_indptr, kv_indices=alias, page_size=4)


def test_the_extent_bound():
    """extent * page_size < 2**62 (the kernels' virtual index): a block table that wide is refused."""
    case, plans = _setup("page_list")
    s = (1 << 31) - 1
    CanaryPlanner(**plans, block_table=np.zeros((4, 2), np.int32), page_size=s)  # 4 * 2 * (2**31 - 1) fits
    tiny = np.zeros(2, np.int32)  # views far wider than their memory: the check reads shapes and strides only
    wide = np.lib.stride_tricks.as_strided(tiny, shape=(2, 1), strides=(1 << 33, 4))
    with pytest.raises(ValueError) as info:
        CanaryPlanner(**plans, block_table=wide, page_size=s)
    assert str(info.value) == ("kv-canary: page_size: expected block_table rows * row stride * page_size < 2**62 "
                               "and block_table rows * row stride < 2**50 (the plan's int64 slot arithmetic), got "
                               f"{1 << 32} * {s}")
    long = np.lib.stride_tricks.as_strided(tiny, shape=(1 << 32,), strides=(4,))
    with pytest.raises(ValueError, match=r"page_size: expected kv_indices.shape\[0\] \* page_size < 2\*\*62"):
        CanaryPlanner(**plans, kv_indptr=case.kv_indptr, kv_indices=long, page_size=s)


def test_sampling_cursors_of_a_page_list_may_have_any_length():
    base = random_case(9, bs=(3, 3), max_reqs=(4, 4), max_seq_len=(8, 8), capacity="sampled", on_overflow="sample")
    _t, _b, pages = page_twins(base, 2, 0)
    vp, wp, _raw = make_plans(pages)
    planner = CanaryPlanner(verify_plan_out=vp, write_plan_out=wp, **pages.index_kwargs())
    assert planner.static.max_reqs == base.max_reqs  # rp is bounded by the cursors' rows
    vp.verify_cursors = None
    with pytest.raises(ValueError, match=r"verify_plan_out.verify_cursors: expected a \[max_reqs\] = \[max_reqs\] "
                                         r"int64 array"):
        CanaryPlanner(verify_plan_out=vp, write_plan_out=wp, **pages.index_kwargs())


# --------------------------------------------------------------------------------------------------------------
# check=True names the first offending batch row of a paged form's own faults


def test_check_names_the_row_of_a_negative_block():
    case = next(c for c in PAGED_HAND if c.name == "blocks_negative_entry")
    with pytest.raises(CanaryInputError) as info:
        run_case(case, "reference", check=True)
    assert info.value.first_bad_row == 0
    assert info.value.status == PlanStatus.BAD_SLOT


def test_check_names_the_row_of_a_bad_kv_indptr():
    case = next(c for c in PAGED_HAND if c.name == "pages_indptr_backwards")
    with pytest.raises(CanaryInputError) as info:
        run_case(case, "reference", check=True)
    assert info.value.first_bad_row == 1
    case = next(c for c in PAGED_HAND if c.name == "pages_negative_entry")
    with pytest.raises(CanaryInputError) as info:
        run_case(case, "reference", check=True)
    assert info.value.first_bad_row == 0


# --------------------------------------------------------------------------------------------------------------
# The GPU backends: every twin and bad-entry case byte for byte against the reference


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cupy", "numba"])
@pytest.mark.parametrize("case", PAGED_HAND, ids=lambda c: c.name)
def test_gpu_paged_hand_cases(backend, case):
    from helpers import gpu_guard

    gpu_guard.backend_or_skip(backend, "plan")
    assert_same(run_case(case, backend, "cupy"), expected_outputs(case), case)
    assert_same(run_case(case, backend, "cupy", api="launch"), expected_outputs(case), case)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cupy", "numba"])
@pytest.mark.parametrize("seed", range(200))
def test_gpu_random_twins_and_bad_entries(backend, seed):
    from helpers import gpu_guard
    from helpers.plan_cases import GPU_RANDOM_KNOBS

    gpu_guard.backend_or_skip(backend, "plan")
    case = random_case(seed, name=f"gpu-{seed}", **GPU_RANDOM_KNOBS[seed % len(GPU_RANDOM_KNOBS)])
    tokens, blocks, pages = _twins(case, seed)
    want = expected_outputs(tokens)
    xp = ("cupy", "torch_cuda")[seed % 2]
    if xp == "torch_cuda":
        pytest.importorskip("torch")
    for twin in (blocks, pages):
        assert_same(run_case(twin, backend, xp), want, twin)
    for form in ("block_table", "page_list"):
        bad = bad_entry_case(case, PAGE_SIZES[seed % len(PAGE_SIZES)], seed, form=form)
        assert_same(run_case(bad, backend, "cupy"), expected_outputs(bad), bad)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cupy", "numba"])
@pytest.mark.parametrize("form", ["block_table", "page_list"])
def test_gpu_a_step_passes_its_own_index(backend, form):
    from helpers import gpu_guard
    from helpers.plan_cases import to_xp

    gpu_guard.backend_or_skip(backend, "plan")
    base = random_case(21, bs=(600, 600), max_reqs=(700, 700), max_seq_len=(16, 16), capacity="sampled",
                       on_overflow="sample", name="own-gpu")  # two-pass: bs > FUSED_MAX_BS
    _t1, b1, p1 = page_twins(base, 4, 1)
    _t2, b2, p2 = page_twins(base, 4, 2)
    first, second = (b1, b2) if form == "block_table" else (p1, p2)
    vp, wp, raw = make_plans(first, "cupy")
    conv = lambda a: to_xp(a, "cupy")  # noqa: E731
    planner = CanaryPlanner(backend=backend, verify_plan_out=vp, write_plan_out=wp, **first.static_kwargs(conv))
    arrays = {k: v for k, v in second.index_kwargs(conv).items() if k != "page_size"}
    planner.plan(**first.step_kwargs(conv), **arrays)
    from helpers.plan_cases import to_numpy

    got = {k: to_numpy(v) for k, v in raw.items()}
    assert_same(got, expected_outputs(second.replace(cursors=first.cursors)), second)
