"""Call errors of the canary records worded by kv-canary, raised before anything is written: state made read-only
after binding, a stream with host arrays (write, verify, scatter)."""
from __future__ import annotations

import numpy as np
import pytest

from canary import CanaryRecords, CanaryState, VerifyPlan, WritePlan, scatter_expected_tokens

WRITTEN_STATE = ("canary_buffer", "ring", "ring_write_index", "slot_run_counter", "kernel_run_counter")


def _a(*v) -> np.ndarray:
    return np.array(v, dtype=np.int64)


def _write_args():
    plan = WritePlan(write_offsets=_a(0, 2), write_seed_slot_indices=_a(-1),
                     write_num_valid_reqs=np.array([1], np.int32))
    return plan, dict(out_cache_loc=_a(1, 2), input_ids=_a(10, 11), positions=_a(0, 1))


def _verify_plan():
    return VerifyPlan(verify_slot_indices=_a(1, 2), verify_expected_tokens=_a(10, 11),
                      verify_expected_positions=_a(0, 1), verify_prev_slot_indices=_a(-1, 1),
                      verify_num_valid=np.array([2], np.int32), enable=np.array([1], np.int32),
                      status=np.zeros(1, np.int32))


def _state_bytes(state: CanaryState) -> list:
    return [getattr(state, f).tobytes() for f in WRITTEN_STATE + ("check_flags",)]


@pytest.mark.parametrize("call", ["write", "verify"])
@pytest.mark.parametrize("field", WRITTEN_STATE)
def test_state_made_read_only_after_binding(field, call):
    state = CanaryState.allocate(num_slots=8, ring_capacity=4)
    canary = CanaryRecords(state)
    plan, entries = _write_args()
    canary.write(plan, **entries)
    getattr(state, field).flags.writeable = False
    before = _state_bytes(state)
    with pytest.raises(ValueError) as info:
        if call == "write":
            canary.write(plan, **entries)
        else:
            canary.verify(_verify_plan())
    assert str(info.value) == (f"kv-canary: state.{field}: expected a writable array, got a read-only one (its "
                               f"writeable flag was cleared after the canary was bound); set flags.writeable = True "
                               f"again")
    assert _state_bytes(state) == before


_STREAM_MESSAGE = ("kv-canary: stream: expected None for host arrays (host arrays take no stream: the work runs on "
                   "the host, in the call), got 12345; pass CUDA arrays to run on a stream, or drop stream=")


@pytest.mark.parametrize("call", ["write", "verify", "scatter"])
def test_stream_with_host_arrays_is_refused(call):
    state = CanaryState.allocate(num_slots=8, ring_capacity=4)
    canary = CanaryRecords(state)
    pool = np.full((4, 6), -7, np.int32)
    before = _state_bytes(state) + [pool.tobytes()]
    with pytest.raises(ValueError) as info:
        if call == "write":
            plan, entries = _write_args()
            canary.write(plan, **entries, stream=12345)
        elif call == "verify":
            canary.verify(_verify_plan(), stream=12345)
        else:
            scatter_expected_tokens(req_to_verify_expected_tokens=pool, req_pool_indices=_a(1), tokens=_a(5),
                                    token_offsets=_a(0, 1), column_starts=_a(0), stream=12345)
    assert str(info.value) == _STREAM_MESSAGE
    assert _state_bytes(state) + [pool.tobytes()] == before
