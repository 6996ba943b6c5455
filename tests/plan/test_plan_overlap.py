"""Overlapping plan buffers (SPEC 3.3): two outputs sharing memory, or an output sharing memory with any input
(the static ones at bind, the per-step ones when first seen), is a ``ValueError`` naming both, raised before
anything is written. Every pair, with NumPy and torch CPU arrays here, CuPy on a GPU."""
from __future__ import annotations

import itertools
import re

import numpy as np
import pytest
from helpers.overlap import overlap_message, place, share, to_numpy
from helpers.plan_cases import BUFFERS as OUTPUTS, VERIFY_FIELDS, WRITE_FIELDS, make_case, poisoned_outputs

from canary import CanaryPlanner, VerifyPlan, WritePlan, launch_canary_plan_kernels

STATIC_INPUTS = ("req_to_token", "full_to_swa_index_mapping", "req_to_verify_expected_tokens")
STEP_INPUTS = ("req_pool_indices", "prefix_lens", "extend_seq_lens", "req_to_verify_expected_tokens_valid_lens")
PAIRS = list(itertools.combinations(OUTPUTS, 2)) + [(o, i) for o in OUTPUTS for i in STATIC_INPUTS + STEP_INPUTS]
XPS = ["numpy", "torch", pytest.param("cupy", marks=pytest.mark.gpu)]
APIS = ["planner", "launch"]


def qualified(field: str) -> str:
    if field in VERIFY_FIELDS + ("verify_cursors",):
        return f"verify_plan_out.{field}"
    if field in WRITE_FIELDS:
        return f"write_plan_out.{field}"
    return field


def arrays(xp: str) -> dict:
    """Every array of a valid plan call, by field name, in library ``xp``."""
    if xp == "torch":
        pytest.importorskip("torch")
    case = make_case("v", ((1, 3, 1, 8), (2, 2, 1, 8)), pool=True, W=2, C=8, R=4)
    out = {k: place(v, xp) for k, v in poisoned_outputs(case).items()}
    out.update({k: place(v, xp) for k, v in case.static_kwargs().items() if k in STATIC_INPUTS})
    out.update({k: place(v, xp) for k, v in case.step_kwargs().items()})
    out["swa_window_size"] = case.swa_window_size
    return out


def call(a: dict, api: str):
    vp = VerifyPlan(**{f: a[f] for f in VERIFY_FIELDS}, verify_cursors=a["verify_cursors"])
    wp = WritePlan(**{f: a[f] for f in WRITE_FIELDS})
    static = dict(verify_plan_out=vp, write_plan_out=wp, swa_window_size=a["swa_window_size"],
                  **{k: a[k] for k in STATIC_INPUTS})
    step = {k: a[k] for k in STEP_INPUTS}
    if api == "launch":
        return launch_canary_plan_kernels(**static, **step)
    return CanaryPlanner(**static).plan(**step)


def snapshot(a: dict) -> dict:
    return {k: to_numpy(v).tobytes() for k, v in a.items() if not isinstance(v, int)}


@pytest.mark.parametrize("xp", XPS)
@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("first, second", PAIRS, ids=lambda f: f)
def test_overlap_is_refused_naming_both(first, second, api, xp):
    a = arrays(xp)
    a[first], a[second] = share(a[first], a[second], xp)
    before = snapshot(a)
    with pytest.raises(ValueError, match=overlap_message(qualified(first), qualified(second))):
        call(a, api)
    assert snapshot(a) == before  # refused before anything was written


@pytest.mark.parametrize("xp", XPS)
@pytest.mark.parametrize("api", APIS)
def test_apart_buffers_plan(api, xp):
    a = arrays(xp)
    call(a, api)
    assert int(to_numpy(a["status"])[0]) == 0 and int(to_numpy(a["verify_num_valid"])[0]) == 4


def test_one_array_as_three_verify_outputs():
    """The review's case: one array passed as the slots, the positions and the predecessor slots."""
    a = arrays("numpy")
    a["verify_expected_positions"] = a["verify_prev_slot_indices"] = a["verify_slot_indices"]
    with pytest.raises(ValueError) as info:
        call(a, "planner")
    ptr = a["verify_slot_indices"].ctypes.data
    assert str(info.value) == (
        f"kv-canary: verify_plan_out.verify_prev_slot_indices: expected memory separate from "
        f"verify_plan_out.verify_expected_positions, got an overlap at {ptr:#x} "
        f"(verify_plan_out.verify_expected_positions spans [{ptr:#x}, {ptr + 64:#x}))")


def test_one_int32_as_count_enable_and_status():
    a = arrays("numpy")
    a["enable"] = a["status"] = a["verify_num_valid"]
    ptr = a["enable"].ctypes.data
    with pytest.raises(ValueError) as info:
        call(a, "launch")
    assert str(info.value) == (f"kv-canary: verify_plan_out.status: expected memory separate from "
                               f"verify_plan_out.enable, got an overlap at {ptr:#x} (verify_plan_out.enable spans "
                               f"[{ptr:#x}, {ptr + 4:#x}))")


def test_partial_overlap_inside_one_allocation():
    """Offsets overlapping the seeds' tail by one element, both carved from one buffer."""
    a = arrays("numpy")
    buf = np.zeros(4 + 5 - 1, np.int64)
    a["write_seed_slot_indices"], a["write_offsets"] = buf[:4], buf[3:]
    with pytest.raises(ValueError, match=re.escape(
            f"kv-canary: write_plan_out.write_offsets: expected memory separate from "
            f"write_plan_out.write_seed_slot_indices, got an overlap at {buf[3:].ctypes.data:#x}")):
        call(a, "planner")


def test_adjacent_buffers_in_one_allocation_are_fine():
    a = arrays("numpy")
    buf = np.zeros(4 + 5, np.int64)
    a["write_seed_slot_indices"], a["write_offsets"] = buf[:4], buf[4:]
    call(a, "planner")
    assert a["write_offsets"][:3].tolist() == [0, 1, 2]


def test_inputs_may_share_memory():
    """Inputs are only read: extend_seq_lens may be a view of req_pool_indices' memory ([1, 2] for both)."""
    a = arrays("numpy")
    a["extend_seq_lens"] = a["req_pool_indices"][:]
    call(a, "planner")
    assert int(a["status"][0]) == 0 and a["write_offsets"][:3].tolist() == [0, 1, 3]


def test_step_buffer_checked_again_when_it_changes():
    """The per-step check runs on each new buffer: a planner that planned fine refuses a later overlapping step."""
    a = arrays("numpy")
    vp = VerifyPlan(**{f: a[f] for f in VERIFY_FIELDS}, verify_cursors=a["verify_cursors"])
    wp = WritePlan(**{f: a[f] for f in WRITE_FIELDS})
    planner = CanaryPlanner(verify_plan_out=vp, write_plan_out=wp, swa_window_size=2,
                            **{k: a[k] for k in STATIC_INPUTS})
    step = {k: a[k] for k in STEP_INPUTS}
    planner.plan(**step)
    inside = a["verify_expected_tokens"][:2]
    with pytest.raises(ValueError, match=overlap_message("prefix_lens", "verify_plan_out.verify_expected_tokens")):
        planner.plan(**{**step, "prefix_lens": inside})


@pytest.mark.gpu
def test_cached_step_view_still_refuses_a_new_overlapping_tensor():
    """CuPy step arrays are cached by identity: a new object over an output's memory is seen and refused."""
    cupy = pytest.importorskip("cupy")
    a = arrays("cupy")
    vp = VerifyPlan(**{f: a[f] for f in VERIFY_FIELDS}, verify_cursors=a["verify_cursors"])
    wp = WritePlan(**{f: a[f] for f in WRITE_FIELDS})
    planner = CanaryPlanner(verify_plan_out=vp, write_plan_out=wp, swa_window_size=2,
                            **{k: a[k] for k in STATIC_INPUTS})
    step = {k: a[k] for k in STEP_INPUTS}
    planner.plan(**step)
    planner.plan(**step)  # cached views
    inside = cupy.ndarray((2,), np.int64, memptr=a["verify_slot_indices"].data)
    with pytest.raises(ValueError, match=overlap_message("req_pool_indices", "verify_plan_out.verify_slot_indices")):
        planner.plan(**{**step, "req_pool_indices": inside})
    planner.plan(**step)
    assert int(a["status"][0]) == 0
