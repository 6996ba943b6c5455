"""Input checks added after a hostile review: state aliasing, frozen state, check-flag values, alignment, odd
arrays and sources. Every refusal is a ``kv-canary:`` message naming the argument with expected and actual."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from canary import CanaryState, CheckFlags, CanaryRecords, VerifyPlan, WritePlan, real_kv
from canary.interop.adapter import as_view, check_view
from canary.contract.state import bind_state


def test_state_is_frozen():
    s = CanaryState.allocate(num_slots=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.ring_write_index = np.zeros(1, np.int32)


@pytest.mark.parametrize("field, other", [("ring_write_index", "check_flags"),
                                          ("slot_run_counter", "kernel_run_counter")])
def test_state_arrays_must_not_alias(field, other):
    s = CanaryState.allocate(num_slots=4)
    bad = dataclasses.replace(s, **{field: getattr(s, other)})
    with pytest.raises(ValueError, match=r"kv-canary: state\.\w+: expected memory separate from state\.\w+"):
        bind_state(bad)


def test_state_array_inside_the_canary_buffer_is_refused():
    s = CanaryState.allocate(num_slots=4)
    inside = s.canary_buffer.reshape(-1)[8:12].view(np.int32)
    with pytest.raises(ValueError, match="expected memory separate from state.canary_buffer"):
        bind_state(dataclasses.replace(s, check_flags=inside))


@pytest.mark.parametrize("value, want", [("verify_token", 2), ("WRITE_POSITION_CHAIN|VERIFY_TOKEN", 3), ("all", 3),
                                         ("none", 0), (CheckFlags.VERIFY_TOKEN, 2), (np.int32(1), 1), (0, 0)])
def test_check_flags_values(value, want):
    s = CanaryState.allocate(num_slots=4, check_flags=value)
    assert int(s.check_flags[0]) == want
    s.set_check_flags("all")
    assert int(s.check_flags[0]) == 3


@pytest.mark.parametrize("value, exc, message", [
    (1.7, TypeError, r"check_flags: expected CheckFlags, an int or flag names, got float 1.7"),
    (True, TypeError, r"check_flags: expected CheckFlags, an int or flag names, got bool"),
    (None, TypeError, r"check_flags: expected .* got NoneType"),
    (-1, ValueError, r"check_flags: expected bits of 3 \(an int in \[0, 3\]\), got -1"),
    (2**40, ValueError, r"check_flags: expected bits of 3 .* got 1099511627776"),
    ("verify", ValueError, r"check_flags: expected flag names NONE, WRITE_POSITION_CHAIN, VERIFY_TOKEN or 'all', joined "
                         r"by '\|', got 'verify'"),
])
def test_check_flags_refused(value, exc, message):
    with pytest.raises(exc, match="kv-canary: " + message):
        CanaryState.allocate(num_slots=4, check_flags=value)
    s = CanaryState.allocate(num_slots=4)
    with pytest.raises(exc, match="kv-canary: " + message.replace("check_flags", "flags")):
        s.set_check_flags(value)
    assert int(s.check_flags[0]) == 3  # untouched


def test_read_only_check_flags():
    s = CanaryState.allocate(num_slots=4)
    s.check_flags.flags.writeable = False
    with pytest.raises(ValueError, match="kv-canary: state.check_flags: expected a writable array"):
        s.set_check_flags(0)


def test_single_slot_and_single_row_need_no_stride():
    s = dataclasses.replace(CanaryState.allocate(num_slots=1), canary_buffer=np.zeros((1, 36), np.uint8))
    kv = np.zeros((1, 40), np.uint8)
    c = CanaryRecords(s, real_kv([(kv, 1, 32)]))
    i = lambda *v: np.array(v, np.int64)  # noqa: E731
    c.write(WritePlan(write_offsets=i(0, 1), write_seed_slot_indices=i(-1),
                      write_num_valid_reqs=np.array([1], np.int32)), out_cache_loc=i(0), input_ids=i(5), positions=i(0))
    assert s.canary_buffer[0, :8].view(np.int64)[0] == 5 and s.canary_buffer[0, 32:].tolist() == [0, 0, 0, 0]


def test_misaligned_and_byte_swapped_arrays():
    mis = np.zeros(9 * 8, np.uint8)[1:65].view(np.int64)
    with pytest.raises(ValueError, match=r"kv-canary: x: expected an address aligned to 8 bytes .* got 0x"):
        check_view(as_view(mis, "x"), dtype=np.int64, ndim=1)
    with pytest.raises(TypeError, match=r"kv-canary: x: expected dtype int64, got >i8 \(non-native byte order\)"):
        check_view(as_view(np.zeros(3, ">i8"), "x"), dtype=np.int64, ndim=1)
    with pytest.raises(TypeError, match="kv-canary: x: expected a plain array, got a masked array"):
        as_view(np.ma.masked_array(np.zeros(3, np.int64)), "x")


def test_misaligned_ring_is_refused():
    s = CanaryState.allocate(num_slots=4, ring_capacity=2)
    ring = np.zeros(17 * 8, np.uint8)[4 : 4 + 128].view(np.int64).reshape(2, 8)
    with pytest.raises(ValueError, match="kv-canary: state.ring: expected an address aligned to 8 bytes"):
        bind_state(dataclasses.replace(s, ring=ring))


@pytest.mark.parametrize("sources, exc, message", [
    ([(np.zeros((8, 64), object), 1, 32)], TypeError, r"real_kv_sources\[0\].array: expected an array of plain "
                                                      r"values .* got dtype object"),
    ([(np.zeros((0, 64), np.uint8), 1, 32)], ValueError, r"real_kv_sources\[0\].array: expected at least one row, "
                                                         r"got shape \(0, 64\)"),
    ([{"array": np.zeros((8, 64), np.uint8), "page_size": 1, "nbpt": 64}], TypeError,
     r"real_kv_sources\[0\]: expected keys array, page_size, num_bytes_per_token\[, read_bytes\], got"),
    (np.zeros((8, 64), np.uint8), TypeError, r"real_kv_sources: expected a sequence of sources .* got one ndarray"),
])
def test_bad_sources(sources, exc, message):
    with pytest.raises(exc, match="kv-canary: " + message):
        real_kv(sources)


def test_kvcanary_with_a_bare_array():
    with pytest.raises(TypeError, match="kv-canary: real_kv_sources: expected a sequence of sources"):
        CanaryRecords(CanaryState.allocate(num_slots=8), np.zeros((8, 64), np.uint8))


@pytest.mark.parametrize("kw, exc, message", [
    ({"verify_capacity": 2.5}, TypeError, "verify_capacity: expected an int, got float 2.5"),
    ({"verify_capacity": True}, TypeError, "verify_capacity: expected an int, got bool"),
    ({"verify_capacity": 4, "device": "cuda:x"}, ValueError, "device: expected 'cpu', a CUDA ordinal or 'cuda:N', "
                                                             "got 'cuda:x'"),
])
def test_plan_allocate_checks(kw, exc, message):
    with pytest.raises(exc, match="kv-canary: " + message):
        VerifyPlan.allocate(**kw)


def test_write_plan_allocate_checks():
    with pytest.raises(TypeError, match="kv-canary: write_req_capacity: expected an int, got bool"):
        WritePlan.allocate(write_req_capacity=True)


def test_zero_size_dtype_is_refused():
    with pytest.raises(TypeError, match="kv-canary: x: expected an array of sized elements, got dtype"):
        as_view(np.zeros(3, "V0"), "x")


@pytest.mark.parametrize("make, exc, message", [
    (lambda n: np.zeros(n, np.int8), TypeError, r"state\.reported_slots: expected dtype uint8, got int8"),
    (lambda n: np.zeros(n + 1, np.uint8), ValueError, r"state\.reported_slots: expected length 4"),
    (lambda n: np.zeros((n, 1), np.uint8), ValueError, r"state\.reported_slots: expected a 1-D array, got shape \(4, 1\)"),
    (lambda n: np.zeros(2 * n, np.uint8)[::2], ValueError, r"state\.reported_slots"),
])
def test_bad_reported_slots(make, exc, message):
    s = dataclasses.replace(CanaryState.allocate(num_slots=4), reported_slots=make(4))
    with pytest.raises(exc, match="^kv-canary: " + message):
        bind_state(s)


def test_reported_slots_allocated_zeroed_and_inside_the_state_refused():
    s = CanaryState.allocate(num_slots=4, reported_slots=True)
    assert s.reported_slots.dtype == np.uint8 and s.reported_slots.tolist() == [0, 0, 0, 0]
    assert bind_state(s).reported_slots.shape == (4,)
    inside = dataclasses.replace(s, reported_slots=s.canary_buffer.reshape(-1)[:4])
    with pytest.raises(ValueError, match=r"^kv-canary: state\.\w+: expected memory separate from state\.\w+"):
        bind_state(inside)
