"""Memory shared with what the canary kernels write (SPEC 3.3, docs/records.md 8): a real-KV source inside the
state (refused at bind), a write or verify call's arrays inside the state, a scatter input inside the pool
(refused per call, before any launch). Each refusal is a ``ValueError`` naming both arrays."""
from __future__ import annotations

import re

import numpy as np
import pytest
from helpers.overlap import place, share, to_numpy

from canary import CanaryRecords, CanaryState, VerifyPlan, WritePlan, real_kv, scatter_expected_tokens

STATE_FIELDS = ("canary_buffer", "ring", "ring_write_index", "slot_run_counter", "kernel_run_counter", "check_flags")
WRITE_ARRAYS = ("write_offsets", "write_seed_slot_indices", "write_num_valid_reqs", "out_cache_loc", "input_ids",
                "positions", "expected_input_ids", "expected_positions")
VERIFY_ARRAYS = ("verify_slot_indices", "verify_expected_tokens", "verify_expected_positions",
                 "verify_prev_slot_indices", "verify_num_valid", "enable")
SCATTER_INPUTS = ("req_pool_indices", "tokens", "token_offsets", "column_starts")
XPS = ["numpy", "torch", pytest.param("cupy", marks=pytest.mark.gpu)]
_TAIL = r", got an overlap at 0x[0-9a-f]+ \(\S+ spans \[0x[0-9a-f]+, 0x[0-9a-f]+\)\)$"


def refused(name: str, other: str) -> str:
    return rf"^kv-canary: {re.escape(name)}: expected memory separate from {re.escape(other)}{_TAIL}"


def _xp(xp: str) -> str:
    if xp == "torch":
        pytest.importorskip("torch")
    return xp


def state_arrays(xp: str) -> dict:
    s = CanaryState.allocate(num_slots=8, ring_capacity=4)
    return {f: place(getattr(s, f), xp) for f in STATE_FIELDS}


def _a(*v) -> np.ndarray:
    return np.array(v, dtype=np.int64)


def call_arrays(xp: str) -> dict:
    """A valid write (two tokens of one request, slots 1 and 2) and a verify of them, by argument name."""
    a = dict(write_offsets=_a(0, 2), write_seed_slot_indices=_a(-1), write_num_valid_reqs=np.array([1], np.int32),
             out_cache_loc=_a(1, 2), input_ids=_a(10, 11), positions=_a(0, 1), expected_input_ids=_a(10, 11),
             expected_positions=_a(0, 1), verify_slot_indices=_a(1, 2), verify_expected_tokens=_a(10, 11),
             verify_expected_positions=_a(0, 1), verify_prev_slot_indices=_a(-1, 1),
             verify_num_valid=np.array([2], np.int32), enable=np.array([1], np.int32), status=np.zeros(1, np.int32))
    return {k: place(v, xp) for k, v in a.items()}


def write(canary: CanaryRecords, a: dict) -> None:
    canary.write(WritePlan(**{f: a[f] for f in WRITE_ARRAYS[:3]}), **{f: a[f] for f in WRITE_ARRAYS[3:]})


def verify(canary: CanaryRecords, a: dict) -> None:
    canary.verify(VerifyPlan(status=a["status"], **{f: a[f] for f in VERIFY_ARRAYS}))


def snapshot(*dicts) -> list:
    return [to_numpy(v).tobytes() for d in dicts for v in d.values()]


# --------------------------------------------------------------------------------------------------------------
# Real-KV sources against the state, at bind


def test_source_that_is_the_canary_buffer_is_refused():
    """Hashing the canary buffer itself: every write changes the bytes its own hash covers (false REAL_KV)."""
    state = CanaryState.allocate(num_slots=8)
    ptr = state.canary_buffer.ctypes.data
    with pytest.raises(ValueError) as info:
        CanaryRecords(state, real_kv([(state.canary_buffer, 1, 32)]))
    assert str(info.value) == (f"kv-canary: real_kv_sources[0].array: expected memory separate from "
                               f"state.canary_buffer, got an overlap at {ptr:#x} (state.canary_buffer spans "
                               f"[{ptr:#x}, {ptr + 8 * 32:#x}))")


@pytest.mark.parametrize("xp", XPS)
@pytest.mark.parametrize("field", STATE_FIELDS)
def test_source_overlapping_a_state_array_is_refused(field, xp):
    s = state_arrays(_xp(xp))
    source = place(np.zeros((8, 64), np.uint8), xp)
    source, s[field] = share(source, s[field], xp)
    with pytest.raises(ValueError, match=refused("real_kv_sources[1].array", f"state.{field}")):
        CanaryRecords(CanaryState(**s), real_kv([(place(np.zeros((8, 64), np.uint8), xp), 1, 64), (source, 1, 64)]))


def test_sources_may_share_memory_and_a_clean_run_has_no_violation():
    """Sources are only read: two views of one KV buffer are fine, and a clean run stays clean."""
    kv = np.arange(8 * 64, dtype=np.uint8).reshape(8, 64)
    state = CanaryState.allocate(num_slots=8)
    canary = CanaryRecords(state, real_kv([(kv, 1, 64), (kv[:, :32], 1, 32)]))
    a = call_arrays("numpy")
    write(canary, a)
    verify(canary, a)
    report = canary.drain()
    assert report.total == 0, report


# --------------------------------------------------------------------------------------------------------------
# A call's arrays against the state, per call


@pytest.mark.parametrize("xp", XPS)
@pytest.mark.parametrize("field", STATE_FIELDS)
@pytest.mark.parametrize("arg", WRITE_ARRAYS + VERIFY_ARRAYS)
def test_call_array_overlapping_the_state_is_refused(arg, field, xp):
    s = state_arrays(_xp(xp))
    a = call_arrays(xp)
    a[arg], s[field] = share(a[arg], s[field], xp)
    canary = CanaryRecords(CanaryState(**s))
    before = snapshot(s, a)
    name = f"write_plan.{arg}" if arg in WRITE_ARRAYS[:3] else f"verify_plan.{arg}" if arg in VERIFY_ARRAYS else arg
    with pytest.raises(ValueError, match=refused(name, f"state.{field}")):
        (write if arg in WRITE_ARRAYS else verify)(canary, a)
    assert snapshot(s, a) == before  # refused before the launch: nothing written


@pytest.mark.parametrize("xp", XPS)
def test_apart_call_arrays_run(xp):
    s = state_arrays(_xp(xp))
    a = call_arrays(xp)
    canary = CanaryRecords(CanaryState(**s))
    for _ in range(2):  # the second call reuses the first call's views where the library allows it
        write(canary, a)
        verify(canary, a)
    assert canary.drain().total == 0


# --------------------------------------------------------------------------------------------------------------
# The scatter: the pool against its inputs


def scatter_arrays(xp: str) -> dict:
    a = dict(req_to_verify_expected_tokens=np.full((6, 8), -7, np.int32), req_pool_indices=_a(1, 2),
             tokens=_a(10, 11, 12), token_offsets=_a(0, 2, 3), column_starts=_a(0, 4))
    return {k: place(v, xp) for k, v in a.items()}


@pytest.mark.parametrize("xp", XPS)
@pytest.mark.parametrize("arg", SCATTER_INPUTS)
def test_scatter_input_overlapping_the_pool_is_refused(arg, xp):
    a = scatter_arrays(_xp(xp))
    a["req_to_verify_expected_tokens"], a[arg] = share(a["req_to_verify_expected_tokens"], a[arg], xp)
    before = snapshot(a)
    with pytest.raises(ValueError, match=refused(arg, "req_to_verify_expected_tokens")):
        scatter_expected_tokens(**a)
    assert snapshot(a) == before


@pytest.mark.parametrize("xp", XPS)
def test_scatter_apart_arrays_run(xp):
    a = scatter_arrays(_xp(xp))
    scatter_expected_tokens(**a)
    pool = to_numpy(a["req_to_verify_expected_tokens"])
    assert pool[1, :2].tolist() == [10, 11] and pool[2, 4] == 12
