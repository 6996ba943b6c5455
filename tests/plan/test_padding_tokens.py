"""Padding rows anywhere in the batch (SPEC 3.2, ``padding_rows_carry_tokens``), by hand and end to end.

Two engine conventions for a padding row (``req_pool_indices == 0``) of a fixed-shape batch:

- SGLang's (``padding_rows_carry_tokens=False``, the default): the step's token arrays (``out_cache_loc``,
  ``input_ids``, ``positions``) hold the active rows' tokens back to back; a padding row's tokens, if any, lie
  past ``write_offsets[bs]``.
- In place (``True``): a finished request's row stays where it was, its tokens too, at its place in batch order.

The planner must be told which: with the wrong choice every token after a mid-batch padding row is written
under the wrong request, and a clean run reports violations.
"""
from __future__ import annotations

import numpy as np
import pytest
from helpers.plan_cases import (
    BAD_EXTEND_LEN,
    POISON,
    SKIP_SEED,
    expected_outputs,
    hand_case,
    make_case,
    make_plans,
    run_case,
)

import canary
from canary import CanaryPlanner, CanaryRecords, CanaryState, PlanStatus, VerifyPlan, WritePlan
from canary.errors import CanaryInputError

P64 = POISON.i64


def out_of(name: str):
    return expected_outputs(hand_case(name))


# --------------------------------------------------------------------------------------------------------------
# The plan, by hand (std_r2t: r2t[rp, p] = 100 * rp + p + 1; max_seq_len 8; R = bs + 2)


def test_skip_seed_is_exported_and_is_int64_min():
    assert canary.SKIP_SEED == SKIP_SEED == -(1 << 63)


@pytest.mark.parametrize("where, carried, default", [
    ("first", ([0, 2, 3, 5], [SKIP_SEED, 103, 202]), ([0, 0, 1, 3], [-1, 103, 202])),
    ("middle", ([0, 1, 4, 6], [103, SKIP_SEED, 202]), ([0, 1, 1, 3], [103, -1, 202])),
    ("last", ([0, 1, 3, 4, 8], [103, 202, SKIP_SEED, SKIP_SEED]), ([0, 1, 3, 3, 3], [103, 202, -1, -1])),
])
def test_padding_rows_first_middle_last(where, carried, default):
    for name, (offsets, seeds) in ((f"padding_tokens_{where}", carried), (f"padding_{where}", default)):
        o = out_of(name)
        bs = len(seeds)
        assert o["write_offsets"].tolist() == offsets + [0, 0], name
        assert o["write_seed_slot_indices"].tolist() == seeds + [P64, P64], name
        assert (o["enable"][0], o["status"][0], o["write_num_valid_reqs"][0]) == (1, 0, bs), name
    # The verify side does not depend on the convention.
    a, b = out_of(f"padding_tokens_{where}"), out_of(f"padding_{where}")
    for f in ("verify_slot_indices", "verify_prev_slot_indices", "verify_expected_positions", "verify_num_valid"):
        assert a[f].tolist() == b[f].tolist(), f


def test_padding_row_token_counts():
    o = out_of("padding_tokens_e_nonpositive")  # (0,3,0) (1,2,1) (0,5,-3) (0,HUGE,-HUGE): nothing carried
    assert o["write_offsets"].tolist()[:5] == [0, 0, 1, 1, 1]
    assert o["write_seed_slot_indices"].tolist()[:4] == [-1, 102, -1, -1]
    o = out_of("padding_tokens_e_max_seq_len")  # (0, HUGE, 8): E = max_seq_len fits; P is not read
    assert o["write_offsets"].tolist()[:3] == [0, 8, 9] and o["status"][0] == 0
    o = out_of("padding_tokens_e_too_long")  # (1,2,1) (0,3,9) (2,1,1) (0,-1,2^62)
    assert (o["enable"][0], o["status"][0]) == (0, BAD_EXTEND_LEN)
    assert o["write_offsets"].tolist()[:5] == [0, 1, 1, 2, 2]  # flagged: wlen 0, never a wrapped offset
    assert o["write_seed_slot_indices"].tolist()[:4] == [102, -1, 201, -1]
    o = out_of("padding_tokens_garbage_default")  # the same rows in SGLang's convention: never read
    assert (o["enable"][0], o["status"][0]) == (1, 0)
    o = out_of("padding_tokens_swa_pool")  # valid_len 2^40 on a padding row: not read, no BAD_VALID_LEN
    assert o["status"][0] == 0
    assert o["write_seed_slot_indices"].tolist()[:4] == [SKIP_SEED, 10106, SKIP_SEED, 10205]
    o = out_of("padding_tokens_overflow")
    assert o["status"][0] == PlanStatus.OVERFLOW and o["write_offsets"].tolist()[:4] == [0, 1, 4, 5]


def test_padding_row_first_bad_row_and_check():
    case = hand_case("padding_tokens_e_too_long")
    vp, wp, _raw = make_plans(case)
    planner = CanaryPlanner(verify_plan_out=vp, write_plan_out=wp, **case.static_kwargs())
    with pytest.raises(CanaryInputError, match="BAD_EXTEND_LEN") as info:
        planner.plan(**case.step_kwargs(), check=True)
    assert info.value.first_bad_row == 1  # the padding row: its E is trusted in this convention
    default = case.replace(padding_rows_carry_tokens=False)
    vp, wp, _raw = make_plans(default)
    planner = CanaryPlanner(verify_plan_out=vp, write_plan_out=wp, **default.static_kwargs())
    assert planner.plan(**default.step_kwargs(), check=True) == PlanStatus.OK


def test_padding_rows_carry_tokens_keyword():
    case = make_case("k", [(1, 2, 1), (0, 5, 2), (2, 1, 1)])
    for api in ("planner", "launch"):
        got = run_case(case.replace(padding_rows_carry_tokens=True), api=api)
        assert got["write_offsets"].tolist()[:4] == [0, 1, 3, 4], api
        got = run_case(case, api=api)  # the default keeps SGLang's convention
        assert got["write_offsets"].tolist()[:4] == [0, 1, 1, 2], api
    vp, wp, _ = make_plans(case)
    for bad in (1, "yes", None):
        with pytest.raises(TypeError, match=r"^kv-canary: padding_rows_carry_tokens: expected a bool, got"):
            CanaryPlanner(verify_plan_out=vp, write_plan_out=wp,
                          **case.static_kwargs() | {"padding_rows_carry_tokens": bad})


def test_launch_api_caches_planners_per_convention():
    """The one-shot entry point keeps bound planners keyed by the static buffers: the convention is part of the
    key, so switching it on the same buffers takes effect."""
    case = make_case("k", [(0, 5, 2), (1, 2, 1)])
    vp, wp, raw = make_plans(case)
    kw = dict(verify_plan_out=vp, write_plan_out=wp, **case.static_kwargs(), **case.step_kwargs())
    for carry, offsets in ((True, [0, 2, 3]), (False, [0, 0, 1]), (True, [0, 2, 3])):
        kw["padding_rows_carry_tokens"] = carry
        canary.launch_canary_plan_kernels(**kw)
        assert raw["write_offsets"].tolist()[:3] == offsets, carry


# --------------------------------------------------------------------------------------------------------------
# End to end: plan + write + verify with the reference backend over a few steps of a fixed-shape batch

MAX_SEQ_LEN = 16
NUM_ROWS = 5  # req_to_token rows; row 0 is the padding row
NUM_SLOTS = NUM_ROWS * MAX_SEQ_LEN + 1


def _r2t() -> np.ndarray:
    """``r2t[rp, p] = rp * 16 + p + 1``: every (request, position) its own slot; slot 0 never used."""
    rp = np.arange(NUM_ROWS)[:, None]
    p = np.arange(MAX_SEQ_LEN)[None, :]
    return np.where(rp == 0, 0, rp * MAX_SEQ_LEN + p + 1).astype(np.int32)


def _run_engine(*, finished_row: int, engine_carries: bool, planner_carries: bool, steps: int = 5) -> int:
    """A fixed-shape batch of 4 requests (req_to_token rows 1-4, in batch rows 0-3); the request in batch row
    ``finished_row`` finishes after step 1 and its row stays in place as padding (req_pool_indices 0, garbage
    P, E 1). ``engine_carries``: the engine keeps that row's stale token in the token arrays at its place
    (else it packs the active rows' tokens and appends the padding tokens after them, SGLang's way). The stale
    token names the first slot of a live request, so a write of it would clobber a live record. Returns the number of
    violations the canary reported over all steps (verify before the step's write, as an engine does)."""
    r2t = _r2t()
    rng = np.random.default_rng(finished_row)
    tokens = rng.integers(0, 32000, size=(NUM_ROWS, MAX_SEQ_LEN))  # the token of each (request, position)
    vp = VerifyPlan.allocate(verify_capacity=4 * MAX_SEQ_LEN, max_reqs=r2t.shape[0])
    wp = WritePlan.allocate(write_req_capacity=4)
    planner = CanaryPlanner(verify_plan_out=vp, write_plan_out=wp, req_to_token=r2t,
                            padding_rows_carry_tokens=planner_carries, backend="reference")
    state = CanaryState.allocate(num_slots=NUM_SLOTS, ring_capacity=256)
    records = CanaryRecords(state, backend="reference")
    rows = np.array([1, 2, 3, 4], dtype=np.int64)
    prefix = np.zeros(4, dtype=np.int64)
    extend = np.array([3, 2, 4, 1], dtype=np.int64)  # step 0 prefills; then every request decodes one token
    violations = 0
    for step in range(steps):
        rpi = rows.copy()
        P = prefix.copy()
        E = extend.copy()
        padding = step >= 2
        if padding:
            rpi[finished_row], P[finished_row], E[finished_row] = 0, -7, 1
        live, stale = [], []
        for r in range(4):
            if rpi[r] == 0:
                # The finished request's stale token: a slot that now belongs to a live request, a wrong position.
                stale.append((int(r2t[rows[(r + 1) % 4], 0]), 99, 11))
                if engine_carries:
                    live.append(stale.pop())
                continue
            for p in range(int(P[r]), int(P[r] + E[r])):
                live.append((int(r2t[rpi[r], p]), int(tokens[rpi[r], p]), p))
        loc, ids, pos = (np.array(c, dtype=np.int64) for c in zip(*(live + stale)))
        assert planner.plan(req_pool_indices=rpi, prefix_lens=P, extend_seq_lens=E, check=True) == PlanStatus.OK
        records.verify(vp)
        records.write(wp, out_cache_loc=loc, input_ids=ids, positions=pos)
        violations += len(records.drain())
        active = rpi != 0
        prefix[active] += E[active]
        extend[:] = 1
    return violations


@pytest.mark.parametrize("finished_row", [0, 1, 3], ids=["first", "middle", "last"])
@pytest.mark.parametrize("engine_carries", [True, False], ids=["in_place", "sglang"])
def test_clean_run_has_no_violations_when_the_convention_matches(finished_row, engine_carries):
    assert _run_engine(finished_row=finished_row, engine_carries=engine_carries,
                       planner_carries=engine_carries) == 0


@pytest.mark.parametrize("finished_row", [0, 1], ids=["first", "middle"])
@pytest.mark.parametrize("engine_carries", [True, False], ids=["in_place", "sglang"])
def test_the_wrong_convention_reports_violations(finished_row, engine_carries):
    """A padding row before some active row shifts every later row's tokens under the wrong choice."""
    assert _run_engine(finished_row=finished_row, engine_carries=engine_carries,
                       planner_carries=not engine_carries) > 0


@pytest.mark.parametrize("engine_carries", [True, False], ids=["in_place", "sglang"])
def test_padding_rows_last_hide_the_choice(engine_carries):
    """Why SGLang's convention never needed the option: with the padding rows last, the active rows' offsets
    are the same either way (the padding tokens lie past them, and are skipped or never reached)."""
    assert _run_engine(finished_row=3, engine_carries=engine_carries, planner_carries=not engine_carries) == 0


def test_the_write_must_skip_the_padding_rows_tokens(monkeypatch):
    """Counting the padding row's tokens lines the offsets up; the SKIP_SEED seed keeps its stale token (a live
    request's slot) from being written. Without the skip the same clean run reports violations."""
    from canary.backends.reference import records as reference_records

    monkeypatch.setattr(reference_records, "SKIP_SEED", 12345)  # a seed no plan holds: nothing is skipped
    assert _run_engine(finished_row=1, engine_carries=True, planner_carries=True) > 0
