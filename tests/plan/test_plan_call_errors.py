"""Call errors of the planner worded by kv-canary, raised before anything is written: an output made read-only
after binding, a stream with host arrays, a wrong keyword to CanaryPlanner."""
from __future__ import annotations

import numpy as np
import pytest
from helpers.plan_cases import OUTPUTS, VERIFY_FIELDS, make_case, make_plans

from canary import CanaryPlanner, launch_canary_plan_kernels


def _setup():
    case = make_case("v", ((1, 3, 1, 8), (2, 2, 1, 8)), pool=True, W=2, C=8, R=4)
    vp, wp, raw = make_plans(case)
    return case, dict(verify_plan_out=vp, write_plan_out=wp, **case.static_kwargs()), raw


def _bytes(raw: dict) -> dict:
    return {k: v.tobytes() for k, v in raw.items()}


@pytest.mark.parametrize("planned_before", [False, True], ids=["fresh", "after_a_plan"])
@pytest.mark.parametrize("field", OUTPUTS)
def test_output_made_read_only_after_binding(field, planned_before):
    case, static, raw = _setup()
    planner = CanaryPlanner(**static)
    if planned_before:
        planner.plan(**case.step_kwargs())
    step = case.step_kwargs()
    step["prefix_lens"] = np.array([2, 1], np.int64)  # a plan that would change every output
    raw[field].flags.writeable = False
    before = _bytes(raw)
    with pytest.raises(ValueError) as info:
        planner.plan(**step)
    plan = "verify_plan_out" if field in VERIFY_FIELDS else "write_plan_out"
    assert str(info.value) == (f"kv-canary: {plan}.{field}: expected a writable output array, got a read-only one "
                               f"(its writeable flag was cleared after the planner was bound); set "
                               f"flags.writeable = True again, or bind writable buffers")
    assert _bytes(raw) == before  # no output byte changed
    raw[field].flags.writeable = True
    planner.plan(**step)
    assert raw["verify_num_valid"][0] == 3



def test_cursors_made_read_only_after_binding():
    """The sampling state is written like an output: a read-only flag set after binding is refused before any
    output byte or cursor changes (it was a bare NumPy error at the cursors' update, SPEC 3.7)."""
    case = make_case("s", ((1, 3, 1, 8), (2, 2, 1, 8)), pool=True, C=2, R=4)  # 5 entries over 2: sampled
    vp, wp, raw = make_plans(case)
    planner = CanaryPlanner(verify_plan_out=vp, write_plan_out=wp, **case.static_kwargs())
    vp.verify_cursors.flags.writeable = False
    before, cursors = _bytes(raw), vp.verify_cursors.tobytes()
    with pytest.raises(ValueError, match=r"^kv-canary: verify_plan_out.verify_cursors: expected a writable output "
                                         r"array, got a read-only one"):
        planner.plan(**case.step_kwargs())
    assert _bytes(raw) == before and vp.verify_cursors.tobytes() == cursors


def test_output_reshaped_in_place_after_binding():
    case, static, raw = _setup()
    planner = CanaryPlanner(**static)
    raw["write_offsets"].shape = (1, raw["write_offsets"].shape[0])  # the same memory, another shape
    before = _bytes(raw)
    with pytest.raises(ValueError, match=r"^kv-canary: write_plan_out.write_offsets: expected the shape \(5,\) and "
                                         r"strides \(8,\) it was bound with, got \(1, 5\)"):
        planner.plan(**case.step_kwargs())
    assert _bytes(raw) == before


@pytest.mark.parametrize("check", [np.array([1, 2]), "no", 1, None])
def test_check_must_be_a_bool(check):
    case, static, raw = _setup()
    before = _bytes(raw)
    with pytest.raises(TypeError, match=r"^kv-canary: check: expected a bool, got "):
        CanaryPlanner(**static).plan(**case.step_kwargs(), check=check)
    assert _bytes(raw) == before


@pytest.mark.parametrize("status", [[], None, "OK"])
def test_verify_plan_check_with_a_status_that_is_no_array(status):
    """(A list [1] is host data, read as the status 1 with or without a GPU library installed.)"""
    import dataclasses

    case, static, raw = _setup()
    with pytest.raises(TypeError, match=r"^kv-canary: status: expected a \[1\] int32 array"):
        dataclasses.replace(static["verify_plan_out"], status=status).check()

_STREAM_MESSAGE = ("kv-canary: stream: expected None for host arrays (host arrays take no stream: the work runs on "
                   "the host, in the call), got {}; pass CUDA arrays to run on a stream, or drop stream=")


class _StreamLike:
    def __cuda_stream__(self):
        return (0, 12345)


@pytest.mark.parametrize("stream, shown", [(12345, "12345"), (0, "0"), (_StreamLike(), "_StreamLike")])
@pytest.mark.parametrize("api", ["planner", "launch"])
def test_stream_with_host_arrays_is_refused(api, stream, shown):
    case, static, raw = _setup()
    before = _bytes(raw)
    with pytest.raises(ValueError) as info:
        if api == "planner":
            CanaryPlanner(**static).plan(**case.step_kwargs(), stream=stream)
        else:
            launch_canary_plan_kernels(**static, **case.step_kwargs(), stream=stream)
    assert str(info.value) == _STREAM_MESSAGE.format(shown)
    assert _bytes(raw) == before


_ACCEPTED = ("backend, launch_config, verify_plan_out, write_plan_out, req_to_token, block_table, kv_indptr, "
             "kv_indices, page_size, swa_window_size, "
             "full_to_swa_index_mapping, req_to_verify_expected_tokens, kv_token_id_vs_position_offset, "
             "padding_rows_carry_tokens, verify_capacity, max_batch_size, on_overflow, padding_slot")


def test_unknown_keyword_to_the_planner():
    _case, static, _raw = _setup()
    with pytest.raises(TypeError) as info:
        CanaryPlanner(**static, x=1)
    assert str(info.value) == f"kv-canary: CanaryPlanner: unexpected keyword argument 'x'; expected one of: {_ACCEPTED}"
    with pytest.raises(TypeError, match="^kv-canary: CanaryPlanner: unexpected keyword argument 'req_pool_indices'"):
        CanaryPlanner(**static, req_pool_indices=np.zeros(1, np.int64))  # a per-step argument


def test_missing_keyword_and_positional_arguments_to_the_planner():
    _case, static, _raw = _setup()
    del static["req_to_token"]
    with pytest.raises(TypeError) as info:
        CanaryPlanner(**static)
    assert str(info.value) == ("kv-canary: req_to_token: expected exactly one index form: req_to_token, or "
                               "block_table with page_size, or kv_indptr and kv_indices with page_size, got none")
    with pytest.raises(TypeError) as info:
        CanaryPlanner(static["verify_plan_out"])
    assert str(info.value) == (f"kv-canary: CanaryPlanner: expected keyword arguments only ({_ACCEPTED}), got 1 "
                               f"positional argument(s)")


def test_signature_errors_are_worded_with_the_choices():
    """Python's own errors for a call that does not bind name an internal function and no choices: the public
    calls word them (CanaryPlanner and KVGroup did already)."""
    from canary import CanaryManager, KVGroup, scatter_expected_tokens

    case, static, raw = _setup()
    planner = CanaryPlanner(**static)
    group = KVGroup(name="f", req_to_token=np.zeros((4, 8), np.int32), num_slots=16, verify_capacity=8)
    for call, words in [
        (lambda: launch_canary_plan_kernels(**static, **case.step_kwargs(), bogus=1),
         r"launch_canary_plan_kernels: unexpected keyword argument 'bogus'; expected one of: verify_plan_out, "),
        (lambda: launch_canary_plan_kernels(**static), r"launch_canary_plan_kernels: missing required keyword "
                                                       r"argument 'req_pool_indices'"),
        (lambda: planner.plan(*case.step_kwargs().values()), r"CanaryPlanner.plan: expected keyword arguments only "
                                                             r"\(req_pool_indices, prefix_lens, extend_seq_lens, "
                                                             r".*\), got \d positional argument\(s\)"),
        (lambda: scatter_expected_tokens(1, 2), r"scatter_expected_tokens: expected keyword arguments only "
                                                r"\(req_to_verify_expected_tokens, .*\), got 2 positional"),
        (lambda: CanaryManager([group]), r"CanaryManager: missing required keyword argument 'max_batch_size'"),
        (lambda: CanaryManager([group], 8), r"CanaryManager: expected at most 1 positional argument\(s\) \(groups\), "
                                            r"the rest by keyword, got 2"),
    ]:
        with pytest.raises(TypeError, match="^kv-canary: " + words):
            call()
