"""The NumPy reference planner (SPEC 3.2, 3.4) against the naive oracle, hand-read values, and properties."""
from __future__ import annotations

import numpy as np
import pytest
from helpers.plan_cases import (
    BAD_EXTEND_LEN,
    BAD_PREFIX_LEN,
    BAD_REQ_POOL_INDEX,
    BAD_SLOT,
    BAD_VALID_LEN,
    OVERFLOW,
    POISON,
    POISON_ALT,
    SAMPLED,
    SKIP_SEED,
    PlanCase,
    assert_same,
    count_entries,
    expected_outputs,
    hand_case,
    hand_cases,
    make_case,
    make_plans,
    plan_cases,
    poisoned_outputs,
    random_case,
    run_case,
    std_r2t,
    strided,
)
from hypothesis import HealthCheck, given, settings
from helpers.naive_plan import naive_plan

from canary import MISSING_SLOT, CanaryPlanner, PlanStatus

P64, P32 = POISON.i64, POISON.i32
HAND = hand_cases()


def naive(case: PlanCase, poison=POISON):
    return naive_plan(case, poisoned_outputs(case, poison))


# --------------------------------------------------------------------------------------------------------------
# Every hand case: reference == naive == planner (both entry points), under two poisons


@pytest.mark.parametrize("case", HAND, ids=lambda c: c.name)
def test_hand_case_reference_matches_naive(case):
    for poison in (POISON, POISON_ALT):
        want = naive(case, poison)
        assert_same(expected_outputs(case, poison), want, case)
        assert_same(run_case(case, "reference", "numpy", poison), want, case)
    assert_same(run_case(case, "auto", "numpy", api="launch"), naive(case), case)
    if case.expect_status is not None:
        got = PlanStatus(int(want["status"][0]))
        assert got == PlanStatus(case.expect_status), f"{case.name}: status {got!r}"


def test_hand_cases_cover_every_status_bit_and_size():
    statuses = [int(expected_outputs(c)["status"][0]) for c in HAND]
    for bit in (OVERFLOW, BAD_REQ_POOL_INDEX, BAD_PREFIX_LEN, BAD_SLOT, BAD_VALID_LEN, BAD_EXTEND_LEN, SAMPLED):
        assert any(s & bit for s in statuses), bit
    sizes = {c.bs for c in HAND}
    assert {0, 1}.issubset(sizes) and max(sizes) > 4096
    assert len({c.name for c in HAND}) == len(HAND)


def test_hand_cases_do_not_modify_inputs():
    for case in HAND:
        before = [None if a is None else a.copy() for a in _inputs(case)]
        run_case(case)
        for a, b in zip(_inputs(case), before):
            assert (a is None and b is None) or np.array_equal(a, b)


def _inputs(case):
    return [case.req_to_token, case.lut, case.pool, case.req_pool_indices, case.prefix_lens, case.extend_seq_lens,
            case.valid_lens]


# --------------------------------------------------------------------------------------------------------------
# Targeted values, read off by hand. std_r2t: r2t[rp, p] = 100*rp + p + 1; std_lut: lut[x] = 10000 + x;
# std_pool: pool[rp, c] = 50000 + 100*rp + c. R = bs + 2 unless said otherwise.


def out_of(name: str):
    return expected_outputs(hand_case(name))


def test_decode_row():
    o = out_of("bs1_decode")  # rp 1, P 3, E 1, C 3
    assert o["verify_slot_indices"].tolist() == [101, 102, 103]
    assert o["verify_prev_slot_indices"].tolist() == [-1, 101, 102]
    assert o["verify_expected_positions"].tolist() == [0, 1, 2]
    assert o["verify_expected_tokens"].tolist() == [-1, -1, -1]
    assert (o["verify_num_valid"][0], o["enable"][0], o["status"][0]) == (3, 1, 0)
    assert o["write_offsets"].tolist() == [0, 1, 0, 0]
    assert o["write_seed_slot_indices"].tolist() == [103, P64, P64]
    assert o["write_num_valid_reqs"].tolist() == [1]


def test_prefill_from_zero_has_no_entries_and_no_seed():
    o = out_of("bs1_prefill_p0")  # rp 2, P 0, E 5, C 2
    assert o["verify_slot_indices"].tolist() == [P64, P64]
    assert (o["verify_num_valid"][0], o["enable"][0], o["status"][0]) == (0, 1, 0)
    assert o["write_offsets"].tolist() == [0, 5, 0, 0]
    assert o["write_seed_slot_indices"].tolist() == [-1, P64, P64]


def test_p1_and_full_row():
    o = out_of("p1")
    assert o["verify_slot_indices"].tolist() == [101] and o["verify_prev_slot_indices"].tolist() == [-1]
    assert o["write_seed_slot_indices"][0] == 101
    o = out_of("p_full_row")  # rp 3, P 8 = max_seq_len, E 0 (no room left)
    assert o["verify_slot_indices"].tolist() == list(range(301, 309))
    assert o["verify_prev_slot_indices"].tolist() == [-1] + list(range(301, 308))
    assert o["write_seed_slot_indices"][0] == -1


def test_empty_batch():
    o = out_of("bs0")  # C 4, R 3
    assert o["verify_slot_indices"].tolist() == [P64] * 4
    assert (o["verify_num_valid"][0], o["enable"][0], o["status"][0]) == (0, 1, 0)
    assert o["write_offsets"].tolist() == [0, 0, 0, 0]
    assert o["write_seed_slot_indices"].tolist() == [P64] * 3
    assert o["write_num_valid_reqs"][0] == 0


def test_swa_window_keeps_real_predecessor():
    o = out_of("swa_p_eq_w_plus_1")  # rp 1, P 4, W 3: window [1, 4)
    assert o["verify_expected_positions"].tolist() == [1, 2, 3]
    assert o["verify_slot_indices"].tolist() == [10102, 10103, 10104]
    assert o["verify_prev_slot_indices"].tolist() == [10101, 10102, 10103]  # p=1's prev is T(r2t[1, 0])
    assert o["write_seed_slot_indices"][0] == 10104
    o = out_of("swa_p_eq_w")  # P 3, W 3: window [0, 3)
    assert o["verify_prev_slot_indices"].tolist() == [-1, 10101, 10102]
    o = out_of("swa_w1")  # (1, 5, 1), (2, 1, 1), W 1
    assert o["verify_expected_positions"].tolist() == [4, 0]
    assert o["verify_slot_indices"].tolist() == [10105, 10201]
    assert o["verify_prev_slot_indices"].tolist() == [10104, -1]
    o = out_of("swa_p_full")  # (2, 8, 2), (1, 0, 1), (3, 5, 1), W 3, max_seq_len 10
    assert o["verify_expected_positions"].tolist() == [5, 6, 7, 2, 3, 4]
    assert o["verify_prev_slot_indices"].tolist() == [10205, 10206, 10207, 10302, 10303, 10304]
    assert o["write_offsets"].tolist()[:4] == [0, 2, 3, 4]
    assert o["write_seed_slot_indices"].tolist()[:3] == [10208, -1, 10305]


def test_lut_translation_with_big_values_and_without_swa():
    o = out_of("lut_big_values")  # lut[x] = 2^40 + 7 + x, (1, 3, 1), W 2
    base = (1 << 40) + 7
    assert o["verify_slot_indices"].tolist() == [base + 102, base + 103]
    assert o["verify_prev_slot_indices"].tolist() == [base + 101, base + 102]
    o = out_of("lut_without_swa")  # (1, 3, 1), (2, 2, 2), W 0 with a LUT
    assert o["verify_slot_indices"].tolist() == [10101, 10102, 10103, 10201, 10202]


def test_capacity_boundaries():
    # rows (1, 3, 1), (2, 2, 1): total 5
    o = out_of("cap_exact")
    assert o["verify_slot_indices"].tolist() == [101, 102, 103, 201, 202]
    assert (o["verify_num_valid"][0], o["enable"][0], o["status"][0]) == (5, 1, 0)
    o = out_of("cap_one_spare")
    assert o["verify_slot_indices"].tolist() == [101, 102, 103, 201, 202, P64]
    assert o["verify_expected_positions"].tolist() == [0, 1, 2, 0, 1, P64]
    assert o["verify_num_valid"][0] == 5
    o = out_of("cap_overflow_by_one")  # C 4
    for f in ("verify_slot_indices", "verify_expected_tokens", "verify_expected_positions",
              "verify_prev_slot_indices"):
        assert o[f].tolist() == [P64] * 4, f
    assert (o["verify_num_valid"][0], o["enable"][0], o["status"][0]) == (4, 0, OVERFLOW)
    assert o["write_offsets"].tolist() == [0, 1, 2, 0, 0]  # the write side is built anyway
    assert o["write_seed_slot_indices"].tolist() == [103, 202, P64, P64]
    o = out_of("cap_zero_overflow")
    assert (o["verify_num_valid"][0], o["enable"][0], o["status"][0]) == (0, 0, OVERFLOW)
    o = out_of("cap_zero_total_zero")
    assert (o["verify_num_valid"][0], o["enable"][0], o["status"][0]) == (0, 1, 0)


def test_padding_rows_with_garbage():
    o = out_of("padding_garbage")  # (1,2,1) (0,HUGE,HUGE) (0,-5,-HUGE) (2,1,2) (0,3,7); R 7
    assert o["verify_slot_indices"].tolist() == [101, 102, 201]
    assert (o["verify_num_valid"][0], o["enable"][0], o["status"][0]) == (3, 1, 0)
    assert o["write_offsets"].tolist() == [0, 1, 1, 1, 3, 3, 0, 0]
    assert o["write_seed_slot_indices"].tolist() == [102, -1, -1, 201, -1, P64, P64]
    assert o["write_num_valid_reqs"][0] == 5  # padding rows included
    o = out_of("padding_garbage_valid_len")
    assert o["status"][0] == 0 and o["enable"][0] == 1
    assert o["verify_expected_tokens"].tolist() == [50100, 50101]


def test_negative_raw_slots_pass_the_lut_unchanged():
    # r2t[1,0] = -1, r2t[1,2] = -7, r2t[2,1] = -123456, r2t[3,0] = 0; rows (1,3,1) (2,2,1) (3,1,1). The raw 0
    # is the padding slot inside rp 3's window: MISSING_SLOT as an entry, whatever the LUT maps 0 to; the seed
    # translates it as ever.
    o = out_of("negative_raw_slots_lut")
    assert o["verify_slot_indices"].tolist() == [-1, 10102, -7, 10201, -123456, MISSING_SLOT]
    assert o["verify_prev_slot_indices"].tolist() == [-1, -1, 10102, -1, 10201, -1]
    assert o["write_seed_slot_indices"].tolist()[:3] == [-7, -123456, 10000]
    assert o["status"][0] == 0
    o = out_of("negative_raw_slots_nolut")
    assert o["verify_slot_indices"].tolist() == [-1, 102, -7, 201, -123456, MISSING_SLOT]


def test_expected_tokens():
    o = out_of("expected_off0")  # (1,4,1,vl 8), (2,3,1,vl 2)
    assert o["verify_expected_tokens"].tolist() == [50100, 50101, 50102, 50103, 50200, 50201, -1]
    o = out_of("expected_off_plus1")  # off +1: (1,4,1,8), (2,3,1,3)
    assert o["verify_expected_tokens"].tolist() == [50101, 50102, 50103, 50104, 50201, 50202, -1]
    assert o["verify_expected_positions"].tolist() == [0, 1, 2, 3, 0, 1, 2]  # positions are not offset
    o = out_of("expected_off_minus1")  # off -1: p=0 -> col -1
    assert o["verify_expected_tokens"].tolist() == [-1, 50100, 50101]
    assert out_of("expected_valid_len0")["verify_expected_tokens"].tolist() == [-1, -1, -1]
    assert out_of("expected_valid_len_negative")["verify_expected_tokens"].tolist() == [-1, -1, -1]
    o = out_of("expected_valid_len_eq_cols")
    assert o["verify_expected_tokens"].tolist() == list(range(50100, 50108)) + list(range(50200, 50208))
    o = out_of("expected_narrow_pool")  # pool 6x5; (1,7,1,5), (2,3,1,5)
    assert o["verify_expected_tokens"].tolist() == [50100, 50101, 50102, 50103, 50104, -1, -1, 50200, 50201, 50202]
    o = out_of("expected_narrow_pool_off1")
    assert o["verify_expected_tokens"].tolist() == [50101, 50102, 50103, 50104, -1, -1, -1]
    assert out_of("expected_huge_offset")["verify_expected_tokens"].tolist() == [-1, -1, -1]
    assert out_of("expected_huge_negative_offset")["verify_expected_tokens"].tolist() == [-1, -1, -1]
    o = out_of("expected_pool_zero_cols")
    assert o["verify_expected_tokens"].tolist() == [-1, -1, -1, -1] and o["status"][0] == 0
    o = out_of("expected_swa")  # W 3, off 1: (1,6,1,6) window [3,6) cols 4,5,6; (2,5,1,4) window [2,5) cols 3,4,5
    assert o["verify_expected_positions"].tolist() == [3, 4, 5, 2, 3, 4]
    assert o["verify_expected_tokens"].tolist() == [50104, 50105, -1, 50203, -1, -1]


def test_bad_req_pool_index():
    o = out_of("bad_rp_negative")  # (1,2,1) (-1,3,1) (2,1,1); C 3 (flagged row counts 0)
    assert o["verify_slot_indices"].tolist() == [P64] * 3
    assert (o["verify_num_valid"][0], o["enable"][0], o["status"][0]) == (3, 0, BAD_REQ_POOL_INDEX)
    assert o["write_offsets"].tolist() == [0, 1, 2, 3, 0, 0]  # the flagged row's E still counts
    assert o["write_seed_slot_indices"].tolist() == [102, -1, 201, P64, P64]
    o = out_of("bad_rp_ge_pool_rows")
    assert o["status"][0] == BAD_REQ_POOL_INDEX
    assert o["write_seed_slot_indices"].tolist()[:2] == [102, -1]


def test_bad_prefix_len():
    o = out_of("bad_prefix_gt_max_seq_len")  # (1, 9, 0) with max_seq_len 8, (2, 2, 3)
    assert (o["verify_num_valid"][0], o["enable"][0], o["status"][0]) == (2, 0, BAD_PREFIX_LEN)
    assert o["write_offsets"].tolist()[:3] == [0, 0, 3]
    assert o["write_seed_slot_indices"].tolist()[:2] == [-1, 202]
    o = out_of("extend_negative_prefix_clamped_fits")  # (1, INT64_MIN, 8), (2, 1, 1): bit 4 alone
    assert o["write_offsets"].tolist()[:3] == [0, 8, 9]  # the flagged row's E still counts
    assert o["write_seed_slot_indices"].tolist()[:2] == [-1, 201]
    o = out_of("bad_rp_and_prefix")
    assert o["status"][0] == BAD_REQ_POOL_INDEX | BAD_PREFIX_LEN
    assert o["write_seed_slot_indices"].tolist()[:3] == [-1, -1, 201]


def test_bad_valid_len():
    o = out_of("bad_valid_len")  # (1,3,2,vl 5), (2,2,1,vl 9 > pool_cols 8)
    assert o["verify_slot_indices"].tolist() == [P64] * 5
    assert (o["verify_num_valid"][0], o["enable"][0], o["status"][0]) == (5, 0, BAD_VALID_LEN)
    assert o["write_offsets"].tolist() == [0, 2, 3, 0, 0]
    assert o["write_seed_slot_indices"].tolist() == [103, 202, P64, P64]
    assert out_of("bad_valid_len_overflow")["status"][0] == BAD_VALID_LEN | OVERFLOW


def test_bad_slot():
    # r2t[1,1] = 5000, r2t[2,3] = 300, r2t[2,6] = 777777, r2t[3,0] = -9; lut_len 300, lut[x] = 10000 + x
    o = out_of("bad_slot_verify_entry")  # (1,3,0), (2,2,1)
    assert o["verify_slot_indices"].tolist() == [10101, -1, 10103, 10201, 10202]
    assert o["verify_prev_slot_indices"].tolist() == [-1, 10101, -1, -1, 10201]
    assert (o["verify_num_valid"][0], o["enable"][0], o["status"][0]) == (5, 0, BAD_SLOT)
    assert o["write_seed_slot_indices"].tolist()[:2] == [-1, 10202]
    o = out_of("bad_slot_eq_lut_len")  # (2, 4, 0): r2t[2,3] = 300 == lut_len
    assert o["verify_slot_indices"].tolist() == [10201, 10202, 10203, -1]
    assert o["status"][0] == BAD_SLOT
    o = out_of("bad_slot_prev_only")  # (1,4,0) W 2: window [2,4), p=2's prev is r2t[1,1]
    assert o["verify_slot_indices"].tolist() == [10103, 10104]
    assert o["verify_prev_slot_indices"].tolist() == [-1, 10103]
    assert o["status"][0] == BAD_SLOT and o["enable"][0] == 0
    assert out_of("bad_slot_not_read")["status"][0] == 0
    assert out_of("bad_slot_not_read_swa")["status"][0] == 0
    o = out_of("bad_slot_seed_only_overflow")  # (1,2,1), C 1: entries not built, seed r2t[1,1] is bad
    assert o["verify_slot_indices"].tolist() == [P64]
    assert (o["verify_num_valid"][0], o["enable"][0], o["status"][0]) == (1, 0, OVERFLOW | BAD_SLOT)
    assert o["write_seed_slot_indices"].tolist()[:1] == [-1]
    assert out_of("bad_slot_masked_by_bad_rp")["status"][0] == BAD_REQ_POOL_INDEX
    assert out_of("bad_slot_seed_and_bad_rp")["status"][0] == BAD_REQ_POOL_INDEX | BAD_SLOT
    o = out_of("bad_slot_negative_ok")
    assert o["verify_slot_indices"].tolist()[:2] == [-9, 10302] and o["status"][0] == 0
    assert out_of("bad_slot_overflow_no_seed")["status"][0] == OVERFLOW


def test_bad_extend_len():
    # max_seq_len 8: a row is flagged when E > 0 and min(max(P, 0), 8) + E > 8
    o = out_of("extend_fits_exactly")  # (1,5,3) (2,0,8) (3,7,1): P + E = 8 everywhere
    assert (o["verify_num_valid"][0], o["enable"][0], o["status"][0]) == (12, 1, 0)
    assert o["write_offsets"].tolist() == [0, 3, 11, 12, 0, 0]
    assert o["write_seed_slot_indices"].tolist()[:3] == [105, -1, 307]
    o = out_of("extend_over_by_one")  # (1,5,4) (2,3,1); C 3: the flagged row's 5 entries are not counted
    assert o["verify_slot_indices"].tolist() == [P64] * 3  # the good row's entries are not written either
    assert (o["verify_num_valid"][0], o["enable"][0], o["status"][0]) == (3, 0, BAD_EXTEND_LEN)
    assert o["write_offsets"].tolist() == [0, 0, 1, 0, 0]  # wlen 0 for the flagged row
    assert o["write_seed_slot_indices"].tolist() == [-1, 203, P64, P64]
    o = out_of("extend_2_62_twice")  # (1,2,2^62) (2,1,2^62) (3,1,2): no wrap to INT64_MIN
    assert o["write_offsets"].tolist() == [0, 0, 0, 2, 0, 0]
    assert o["write_seed_slot_indices"].tolist()[:3] == [-1, -1, 301]
    assert (o["enable"][0], o["status"][0]) == (0, BAD_EXTEND_LEN)
    o = out_of("extend_padding_not_flagged")
    assert (o["enable"][0], o["status"][0]) == (1, 0)
    assert o["write_offsets"].tolist()[:5] == [0, 0, 0, 1, 1]
    o = out_of("extend_excluded_from_total")  # (1,4,5) (2,3,1), C 3: total 3 without the flagged row
    assert (o["verify_num_valid"][0], o["status"][0]) == (3, BAD_EXTEND_LEN)
    assert out_of("extend_overflow")["status"][0] == BAD_EXTEND_LEN | OVERFLOW
    o = out_of("extend_and_bad_rp")  # (-1,2,7) (1,1,1) (9,1,2): bit 2 alone keeps wlen, with bit 32 it is 0
    assert o["write_offsets"].tolist()[:4] == [0, 0, 1, 3]
    assert o["status"][0] == BAD_REQ_POOL_INDEX | BAD_EXTEND_LEN
    assert out_of("extend_bad_seed_not_read")["status"][0] == BAD_EXTEND_LEN
    assert out_of("extend_bad_seed_read")["status"][0] == BAD_EXTEND_LEN | BAD_SLOT


def test_negative_extend_len():
    # An active row's E < 0 joins bit 32 (SPEC 3.4): no entries, wlen 0, seed -1, enable 0; padding rows stay silent
    o = out_of("extend_negative_active")  # (1,3,0) (2,2,-4) (3,1,2); C 4: the flagged row's 2 entries not counted
    assert o["verify_slot_indices"].tolist() == [P64] * 4  # the good rows' entries are not written either
    assert (o["verify_num_valid"][0], o["enable"][0], o["status"][0]) == (4, 0, BAD_EXTEND_LEN)
    assert o["write_offsets"].tolist() == [0, 0, 0, 2, 0, 0]
    assert o["write_seed_slot_indices"].tolist() == [-1, -1, 301, P64, P64]
    assert o["write_num_valid_reqs"][0] == 3
    o = out_of("extend_negative_one")  # (1,4,-1)
    assert (o["verify_num_valid"][0], o["enable"][0], o["status"][0]) == (0, 0, BAD_EXTEND_LEN)
    assert o["write_offsets"].tolist() == [0, 0, 0, 0] and o["write_seed_slot_indices"].tolist()[0] == -1
    o = out_of("extend_negative_int64_min")  # (1,2,1) (2,5,INT64_MIN) (3,1,1)
    assert (o["verify_num_valid"][0], o["enable"][0], o["status"][0]) == (3, 0, BAD_EXTEND_LEN)
    assert o["write_offsets"].tolist()[:4] == [0, 1, 1, 2]
    assert o["write_seed_slot_indices"].tolist()[:3] == [102, -1, 301]
    assert out_of("extend_negative_full_row")["status"][0] == BAD_PREFIX_LEN | BAD_EXTEND_LEN
    assert out_of("extend_negative_bad_seed_not_read")["status"][0] == BAD_EXTEND_LEN
    assert out_of("extend_negative_overflow")["status"][0] == BAD_EXTEND_LEN | OVERFLOW
    assert out_of("extend_negative_excluded_from_total")["status"][0] == BAD_EXTEND_LEN
    o = out_of("extend_negative_padding_silent")  # (0,3,-1) (1,2,1) (0,-HUGE,INT64_MIN) (0,9,-HUGE)
    assert (o["verify_num_valid"][0], o["enable"][0], o["status"][0]) == (2, 1, 0)
    assert o["write_offsets"].tolist()[:5] == [0, 0, 1, 1, 1]
    assert o["write_seed_slot_indices"].tolist()[:4] == [-1, 102, -1, -1]
    o = out_of("extend_negative_padding_tokens_silent")  # carry: (0,3,-1) (1,2,1) (0,5,INT64_MIN)
    assert (o["enable"][0], o["status"][0]) == (1, 0)
    assert o["write_offsets"].tolist()[:4] == [0, 0, 1, 1]
    assert o["write_seed_slot_indices"].tolist()[:3] == [-1, 102, -1]


def test_bad_extend_len_on_the_first_offending_row():
    from canary import CanaryInputError

    case = make_case("x", [(1, 2, 1), (0, 1, 1 << 62), (2, 5, 4), (3, 9, 1)])
    vp, wp, _raw = make_plans(case)
    planner = CanaryPlanner(verify_plan_out=vp, write_plan_out=wp, **case.static_kwargs())
    with pytest.raises(CanaryInputError, match="BAD_EXTEND_LEN") as info:
        planner.plan(**case.step_kwargs(), check=True)
    assert info.value.first_bad_row == 2  # the padding row's garbage E is not an error
    assert info.value.status == PlanStatus.BAD_EXTEND_LEN | PlanStatus.BAD_PREFIX_LEN


def test_strided_req_to_token_junk_is_never_read():
    # hand cases use a row stride of max_seq_len + 3 with STRIDE_JUNK beyond the width; P = max_seq_len reads
    # the last column of the row, never the junk.
    case = hand_case("p_full_row")
    assert case.req_to_token.strides[0] == 4 * (case.max_seq_len + 3)
    assert out_of("p_full_row")["verify_slot_indices"][-1] == 308


# --------------------------------------------------------------------------------------------------------------
# Plan reuse


def test_reuse_with_smaller_batch_zeroes_offsets_tail_and_resets_status():
    r2t = std_r2t()
    big = make_case("big", [(1, 3, 2), (2, 2, 1), (3, 1, 4), (4, 2, 1), (5, 1, 1)], r2t=r2t, C=12, R=6)
    vp, wp, raw = make_plans(big)
    planner = CanaryPlanner(verify_plan_out=vp, write_plan_out=wp, req_to_token=r2t)
    assert planner.backend == "reference" and planner.max_batch_size == 6
    planner.plan(**big.step_kwargs())
    assert raw["write_offsets"].tolist() == [0, 2, 3, 7, 8, 9, 0]
    assert raw["write_seed_slot_indices"].tolist() == [103, 202, 301, 402, 501, P64]
    assert raw["verify_num_valid"][0] == 9

    small = make_case("small", [(2, 1, 3), (1, 2, 1)], r2t=r2t, C=12, R=6)
    planner.plan(**small.step_kwargs())
    assert raw["write_offsets"].tolist() == [0, 3, 4, 0, 0, 0, 0]  # tail zeroed over [bs+1, R]
    assert raw["write_seed_slot_indices"].tolist() == [201, 102, 301, 402, 501, P64]  # rows >= bs untouched
    assert raw["write_num_valid_reqs"][0] == 2
    assert raw["verify_num_valid"][0] == 3
    assert raw["verify_slot_indices"].tolist()[:4] == [201, 101, 102, 201]  # [3, 9) keeps the old plan
    assert raw["verify_slot_indices"].tolist()[3:9] == [201, 202, 301, 401, 402, 501]

    bad = make_case("bad", [(-1, 1, 1)], r2t=r2t, C=12, R=6)
    planner.plan(**bad.step_kwargs())
    assert (raw["status"][0], raw["enable"][0]) == (BAD_REQ_POOL_INDEX, 0)
    planner.plan(**small.step_kwargs())  # status is zeroed by each launch
    assert (raw["status"][0], raw["enable"][0]) == (0, 1)

    empty = make_case("empty", [], r2t=r2t, C=12, R=6)
    planner.plan(**empty.step_kwargs())
    assert raw["write_offsets"].tolist() == [0] * 7 and raw["write_num_valid_reqs"][0] == 0


def test_planner_reuse_matches_fresh_runs():
    """A sequence of random cases on one bound planner == each case run fresh on a copy of the state."""
    rng = np.random.default_rng(7)
    r2t = strided(rng.integers(1, 1 << 20, size=(9, 30), dtype=np.int32), 4)
    lut = rng.integers(0, 1 << 40, size=1 << 20, dtype=np.int64)
    base = make_case("seq", [], r2t=r2t, lut=lut, W=7, C=200, R=40)
    vp, wp, raw = make_plans(base)
    planner = CanaryPlanner(verify_plan_out=vp, write_plan_out=wp, req_to_token=r2t, swa_window_size=7,
                            full_to_swa_index_mapping=lut)
    state = {k: v.copy() for k, v in raw.items()}
    for _ in range(30):
        bs = int(rng.integers(0, 41))
        rpi = rng.integers(0, 9, size=bs)
        case = base.replace(req_pool_indices=rpi.astype(np.int64),
                            prefix_lens=rng.integers(0, 31, size=bs).astype(np.int64),
                            extend_seq_lens=rng.integers(-1, 5, size=bs).astype(np.int64))
        want = naive_plan(case, state)
        planner.plan(**case.step_kwargs())
        assert_same(raw, want, case)
        state = {k: v.copy() for k, v in raw.items()}


# --------------------------------------------------------------------------------------------------------------
# Big plans


def test_more_than_4096_rows():
    case = hand_case("big_batch_5000")
    o = run_case(case)
    assert_same(o, naive(case), case)
    active = case.req_pool_indices != 0
    wl = np.where(active & (case.extend_seq_lens > 0), case.extend_seq_lens, 0)
    assert o["write_offsets"][case.bs] == wl.sum()
    assert o["write_offsets"].tolist()[: case.bs + 1] == [0] + np.cumsum(wl).tolist()
    assert o["write_num_valid_reqs"][0] == 5000
    assert o["verify_num_valid"][0] == case.verify_capacity > 4096
    assert (o["enable"][0], o["status"][0]) == (1, 0)


def test_million_entry_plan():
    rng = np.random.default_rng(1)
    bs, L = 256, 4096
    r2t = rng.integers(1, 1 << 31, size=(bs + 1, L + 1), dtype=np.int32)  # a column of room for the decode token
    rpi = rng.permutation(np.arange(1, bs + 1)).astype(np.int64)
    P = np.full(bs, L, dtype=np.int64)
    E = np.ones(bs, dtype=np.int64)
    C = bs * L
    case = PlanCase(name="1M", req_to_token=r2t, req_pool_indices=rpi, prefix_lens=P, extend_seq_lens=E,
                    verify_capacity=C, write_req_capacity=bs)
    vp, wp, raw = make_plans(case)
    planner = CanaryPlanner(verify_plan_out=vp, write_plan_out=wp, req_to_token=r2t)
    # Correctness only: its time on this workload is benchmarks/bench_reference.py's (the same 256 x 4096 step).
    assert planner.plan(**case.step_kwargs()) is None
    assert raw["verify_num_valid"][0] == C == 1 << 20 and raw["enable"][0] == 1
    np.testing.assert_array_equal(raw["verify_slot_indices"], r2t[rpi, :L].reshape(-1))
    np.testing.assert_array_equal(raw["verify_expected_positions"], np.tile(np.arange(L), bs))
    prev = np.concatenate([np.full((bs, 1), -1), r2t[rpi, : L - 1]], axis=1).reshape(-1)
    np.testing.assert_array_equal(raw["verify_prev_slot_indices"], prev)
    assert (raw["verify_expected_tokens"] == -1).all()
    np.testing.assert_array_equal(raw["write_offsets"], np.arange(bs + 1))
    np.testing.assert_array_equal(raw["write_seed_slot_indices"], r2t[rpi, L - 1])


# --------------------------------------------------------------------------------------------------------------
# Properties: reference == naive on random cases

PROP = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROP
@given(plan_cases())
def test_random_cases_match_naive(case):
    assert_same(expected_outputs(case), naive(case), case)


@PROP
@given(plan_cases(fault_prob=0.3, capacity="tight", padding_fraction=0.3))
def test_random_faulty_cases_match_naive(case):
    want = naive(case, POISON_ALT)
    assert_same(expected_outputs(case, POISON_ALT), want, case)
    status = int(want["status"][0])
    assert want["enable"][0] == (1 if status & ~SAMPLED == 0 else 0)
    assert want["verify_num_valid"][0] == min(count_entries(case.req_pool_indices, case.prefix_lens,
                                                            case.swa_window_size, case.req_to_token.shape,
                                                            None if case.pool is None else case.pool.shape[0],
                                                            E=case.extend_seq_lens),
                                              case.verify_capacity)


@settings(max_examples=60, deadline=None)
@given(plan_cases(swa=True, pool=True, capacity="tight", bs=(0, 40)))
def test_random_swa_pool_cases_through_the_planner(case):
    assert_same(run_case(case, "reference", "numpy"), naive(case), case)


def test_random_cases_with_numpy_rng():
    rng = np.random.default_rng(2024)
    for i in range(300):
        case = random_case(rng, fault_prob=(0.0, 0.05, 0.3)[i % 3], capacity=("tight", "loose", "any")[i % 3])
        assert_same(expected_outputs(case), naive(case), case)


def test_random_case_generator_is_varied():
    rng = np.random.default_rng(0)
    cases = [random_case(rng, fault_prob=0.3) for _ in range(300)]
    statuses = {int(expected_outputs(c)["status"][0]) for c in cases}
    for bit in (OVERFLOW, BAD_REQ_POOL_INDEX, BAD_PREFIX_LEN, BAD_SLOT, BAD_VALID_LEN, BAD_EXTEND_LEN, SAMPLED):
        assert any(s & bit for s in statuses), bit
    assert 0 in statuses
    slots = np.concatenate([c.req_to_token.reshape(-1) for c in cases])
    assert (slots < 0).any() and (slots == 0).any() and len(np.unique(slots)) > 1000
    assert any(c.lut is not None and (c.req_to_token >= c.lut.shape[0]).any() for c in cases)
    assert any(c.req_to_token.strides[0] > 4 * c.max_seq_len for c in cases)
    assert any(c.swa_window_size > 0 for c in cases) and any(c.pool is not None for c in cases)
    assert any((c.req_pool_indices == 0).any() for c in cases)
    carried = [c for c in cases if c.padding_rows_carry_tokens]
    assert 0 < len(carried) < len(cases)
    assert any((expected_outputs(c)["write_seed_slot_indices"][: c.bs] == SKIP_SEED).any() for c in carried)
    # no faults: no input-error bits
    clean = [random_case(rng, fault_prob=0.0) for _ in range(200)]
    assert all(int(expected_outputs(c)["status"][0]) & ~(OVERFLOW | SAMPLED) == 0 for c in clean)
