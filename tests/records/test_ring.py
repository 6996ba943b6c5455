"""The canary state: layouts, validation, the fill-once violation ring, decode and drain (SPEC 4)."""
from __future__ import annotations

import numpy as np
import pytest

from canary.contract.ring import DEFAULT_CHECK_FLAGS, RING_FIELDS, CheckFlags, FailReason, KernelTag, Violation, append_rows, decode, encode_tag
from canary.contract.state import CanaryState, bind_state


def _rows(k: int, start: int = 0) -> np.ndarray:
    rows = np.zeros((k, 8), dtype=np.int64)
    rows[:, 0] = int(KernelTag.VERIFY)
    rows[:, 1] = np.arange(start, start + k)
    rows[:, 7] = int(FailReason.CHAIN)
    return rows


def test_enum_values_follow_the_spec():
    assert [int(FailReason[n]) for n in ("CHAIN", "POSITION", "REAL_KV", "WRITE_TOKEN", "WRITE_POSITION",
                                          "VERIFY_TOKEN", "SLOT_RANGE", "MISSING")] == [1, 2, 4, 8, 16, 32, 64, 128]
    assert (int(KernelTag.WRITE), int(KernelTag.VERIFY)) == (1, 2)
    assert (KernelTag.WRITE.counter_index, KernelTag.VERIFY.counter_index) == (0, 1)
    assert RING_FIELDS == ("tag", "slot", "position", "stored_token", "expected_token", "stored_chain_hash",
                           "expected_aux", "fail_reasons")
    assert (FailReason.CHAIN | FailReason.REAL_KV).names == ("CHAIN", "REAL_KV")


def test_allocate_layout():
    st = CanaryState.allocate(num_slots=10, slot_stride_bytes=48, ring_capacity=5)
    assert st.canary_buffer.shape == (10, 48) and st.canary_buffer.dtype == np.uint8
    assert st.ring.shape == (5, 8) and st.ring.dtype == np.int64
    assert st.ring_write_index.shape == (1,) and st.ring_write_index.dtype == np.int32
    assert st.slot_run_counter.shape == st.kernel_run_counter.shape == (2,)
    assert st.slot_run_counter.dtype == st.kernel_run_counter.dtype == np.int64
    assert int(st.check_flags[0]) == int(DEFAULT_CHECK_FLAGS)
    assert not st.canary_buffer.any() and not st.ring.any()


def test_fields_view_is_the_byte_layout():
    st = CanaryState.allocate(num_slots=4, slot_stride_bytes=48)
    v = bind_state(st)
    assert v.fields.shape == (4, 4) and np.shares_memory(v.fields, st.canary_buffer)
    v.fields[2] = [0x0102030405060708, -1, 7, 1 << 62]
    row = st.canary_buffer[2]
    assert int.from_bytes(row[0:8].tobytes(), "little") == 0x0102030405060708  # token at byte 0
    assert row[8:16].tolist() == [0xFF] * 8  # position at byte 8
    assert int.from_bytes(row[16:24].tobytes(), "little") == 7  # prev_hash at byte 16
    assert int.from_bytes(row[24:32].tobytes(), "little") == 1 << 62  # real_kv_hash at byte 24
    assert not row[32:].any() and not st.canary_buffer[[0, 1, 3]].any()


@pytest.mark.parametrize(
    "kwargs, exc, message",
    [
        ({"num_slots": 0}, ValueError, r"num_slots: expected >= 1, got 0"),
        ({"num_slots": 4, "slot_stride_bytes": 24}, ValueError, r"slot_stride_bytes: expected >= 32, got 24"),
        ({"num_slots": 4, "slot_stride_bytes": 36}, ValueError, r"slot_stride_bytes: expected a multiple of 8, got 36"),
        ({"num_slots": 4, "ring_capacity": -1}, ValueError, r"ring_capacity: expected >= 0, got -1"),
        ({"num_slots": 4.0}, TypeError, r"num_slots: expected an int, got float"),
        ({"num_slots": 4, "device": "tpu"}, ValueError, r"device: expected 'cpu'"),
    ],
)
def test_allocate_validation(kwargs, exc, message):
    with pytest.raises(exc, match="kv-canary: " + message):
        CanaryState.allocate(**kwargs)


def _state(**over) -> CanaryState:
    from dataclasses import replace

    return replace(CanaryState.allocate(num_slots=8, ring_capacity=4), **over)


@pytest.mark.parametrize(
    "over, exc, message",
    [
        ({"canary_buffer": np.zeros((8, 4), np.int64)}, TypeError, r"state.canary_buffer: expected dtype uint8, got int64"),
        ({"canary_buffer": np.zeros((8, 24), np.uint8)}, ValueError, r"expected rows of >= 32 bytes, got 24"),
        ({"canary_buffer": np.zeros((8, 44), np.uint8)}, ValueError, r"expected 8-byte aligned slots, .*slot stride 44"),
        ({"canary_buffer": np.zeros((0, 32), np.uint8)}, ValueError, r"expected at least 1 slot"),
        ({"ring": np.zeros((4, 7), np.int64)}, ValueError, r"state.ring: expected shape \[ring_capacity, 8\], got \(4, 7\)"),
        ({"ring": np.zeros((4, 8), np.int32)}, TypeError, r"state.ring: expected dtype int64, got int32"),
        ({"ring_write_index": np.zeros(1, np.int64)}, TypeError, r"state.ring_write_index: expected dtype int32"),
        ({"slot_run_counter": np.zeros(3, np.int64)}, ValueError, r"state.slot_run_counter: expected length 2, got 3"),
        ({"check_flags": np.zeros(2, np.int32)}, ValueError, r"state.check_flags: expected length 1, got 2"),
    ],
)
def test_bind_state_validation(over, exc, message):
    with pytest.raises(exc, match="kv-canary: .*" + message):
        bind_state(_state(**over))


def test_bind_state_rejects_read_only_outputs():
    ring = np.zeros((4, 8), np.int64)
    ring.flags.writeable = False
    with pytest.raises(ValueError, match="kv-canary: state.ring: expected a writable output array"):
        bind_state(_state(ring=ring))
    with pytest.raises(TypeError, match="kv-canary: state: expected a CanaryState, got dict"):
        bind_state({})


def test_strided_canary_buffer():
    big = np.zeros((8, 64), np.uint8)
    v = bind_state(_state(canary_buffer=big[:, :40]))
    assert (v.num_slots, v.slot_stride_bytes) == (8, 64)
    v.fields[1, 3] = -1
    assert big[1, 24:32].tolist() == [0xFF] * 8 and not big[1, 32:].any()


def test_ring_fill_once_and_counts_past_capacity():
    ring = np.zeros((4, 8), np.int64)
    widx = np.zeros(1, np.int32)
    append_rows(ring, widx, _rows(3, 0))
    assert int(widx[0]) == 3 and ring[:3, 1].tolist() == [0, 1, 2] and not ring[3].any()
    append_rows(ring, widx, _rows(3, 10))
    assert int(widx[0]) == 6 and ring[:, 1].tolist() == [0, 1, 2, 10]  # row 3 filled, 11 and 12 dropped
    append_rows(ring, widx, _rows(5, 20))  # nothing overwrites a filled row
    assert int(widx[0]) == 11 and ring[:, 1].tolist() == [0, 1, 2, 10]
    append_rows(ring, widx, _rows(0))
    assert int(widx[0]) == 11
    rep = decode(ring, int(widx[0]))
    assert (rep.total, rep.capacity, len(rep), rep.dropped) == (11, 4, 4, 7)


def test_write_index_is_a_uint32_count():
    ring = np.zeros((2, 8), np.int64)
    widx = np.array([(1 << 31) - 1], np.int32)
    append_rows(ring, widx, _rows(3))
    assert int(widx[0]) == -(1 << 31) + 2  # the int32 word holds the uint32 count 2**31 + 2
    assert decode(ring, int(widx[0])).total == (1 << 31) + 2 and not ring.any()


def test_decode_rows():
    ring = np.zeros((3, 8), np.int64)
    ring[0] = [encode_tag(KernelTag.WRITE, 5), 17, 4, 100, 101, -3, 3, int(FailReason.WRITE_TOKEN | FailReason.WRITE_POSITION)]
    ring[1] = [encode_tag(KernelTag.VERIFY), 9, 2, 7, -1, 11, 12, int(FailReason.CHAIN)]
    ring[2] = [99, 0, 0, 0, 0, 0, 0, 0]
    rep = decode(ring, 3)
    w, v, odd = rep.violations
    assert w == Violation(kernel=KernelTag.WRITE, launch_tag=5, slot=17, position=4, stored_token=100,
                          expected_token=101, stored_chain_hash=-3, expected_aux=3,
                          reasons=FailReason.WRITE_TOKEN | FailReason.WRITE_POSITION)
    assert w.reason_names == ("WRITE_TOKEN", "WRITE_POSITION") and w.expected_position == 3
    assert w.expected_chain_hash is None
    assert v.kernel is KernelTag.VERIFY and v.launch_tag == 0 and v.expected_chain_hash == 12
    assert v.expected_position is None and v.reason_names == ("CHAIN",)
    assert odd.kernel == 99 and odd.reasons == FailReason.NONE
    assert str(w) == "write[5] slot 17 pos 4: WRITE_TOKEN|WRITE_POSITION, token 100, expected token 101, expected pos 3"
    assert str(v).startswith("verify slot 9 pos 2: CHAIN, token 7, prev_hash 0x000000000000000b")


def test_decode_keeps_missing_and_drops_unknown_bits():
    """Bit 128 (MISSING) survives decoding (it used to be masked off with 0x7F); bits above it are no reason."""
    from canary import MISSING_SLOT

    row = np.array([encode_tag(KernelTag.VERIFY, 2), MISSING_SLOT, 6, 0, 41, 0, 0, 128 | 256 | 1], np.int64)
    (v,) = decode(row[None, :], 1).violations
    assert v.reasons == FailReason.MISSING | FailReason.CHAIN and v.slot == MISSING_SLOT and v.position == 6
    assert str(v).startswith(f"verify[2] slot {MISSING_SLOT} pos 6: CHAIN|MISSING, token 0, expected token 41")


def test_encode_tag_validation():
    assert encode_tag(KernelTag.VERIFY, 3) == (3 << 8) | 2
    with pytest.raises(ValueError, match=r"kv-canary: launch_tag: expected an int in \[0, "):
        encode_tag(KernelTag.WRITE, -1)
    with pytest.raises(TypeError, match="kv-canary: launch_tag: expected an int, got str"):
        encode_tag(KernelTag.WRITE, "a")


def test_drain_resets_the_ring_not_the_counters():
    st = CanaryState.allocate(num_slots=4, ring_capacity=2)
    append_rows(st.ring, st.ring_write_index, _rows(3))
    st.slot_run_counter[:] = [5, 6]
    st.kernel_run_counter[:] = [1, 2]
    peek = st.read()
    assert peek.total == 3 and int(st.ring_write_index[0]) == 3
    rep = st.drain()
    assert (rep.total, len(rep), rep.dropped) == (3, 2, 1)
    assert [v.slot for v in rep] == [0, 1]
    assert (rep.health.write_slots, rep.health.verify_slots, rep.health.write_launches,
            rep.health.verify_launches) == (5, 6, 1, 2)
    assert int(st.ring_write_index[0]) == 0 and not st.ring.any()
    assert st.drain().total == 0 and st.slot_run_counter.tolist() == [5, 6]


def test_set_check_flags():
    st = CanaryState.allocate(num_slots=4, check_flags=CheckFlags.NONE)
    assert int(st.check_flags[0]) == 0
    st.set_check_flags(CheckFlags.VERIFY_TOKEN)
    assert int(st.check_flags[0]) == 2
