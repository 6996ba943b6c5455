"""The reference write / verify / scatter (docs/canary.md): against a naive oracle, by hand, and end to end.

End to end: the simulated engine (canary/engine.py) plans every step of the replay scheduler with the
``CanaryPlanner`` (reference backend), verifies, stores KV bytes, writes the canary records and drains the
ring; a clean replay has zero violations, and each fault of canary/faults.py is detected with the right bits
and tags.
"""
from __future__ import annotations

import dataclasses

from helpers import naive_records as naive
from helpers import records_cases as cc
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from canary import MISSING_SLOT, SKIP_SEED, VerifyPlan, WritePlan
from canary.backends.reference import records as reference_canary
from helpers.replay_engine import Engine
from canary.errors import BackendUnavailableError
from canary.replay.faults import Fault, Injector
from canary.contract.hashes import ANCHOR_LINK, link
from canary.contract.realkv import RealKVMode, real_kv
from canary.contract.ring import CheckFlags, FailReason, KernelTag, decode_row, encode_tag
from canary.contract.state import CanaryState, bind_state
from canary import CanaryRecords, scatter_expected_tokens

F = FailReason


# --------------------------------------------------------------------------------------------------------------
# Against the naive oracle: random launches, including garbage (skips, out-of-range slots, reversed offsets,
# clamped counts, a ring that overflows and a write index that wraps).


def _random_sources(rng, num_slots):
    a = rng.integers(0, 256, size=(num_slots, 32), dtype=np.uint8)
    b = rng.integers(0, 256, size=((num_slots + 1) // 2, 48), dtype=np.uint8)
    specs = [(a, 1, 32, int(rng.choice([16, 32]))), (b, 2, 16, 16)][: int(rng.integers(0, 3))]
    mode = RealKVMode(int(rng.integers(0, 3)))
    kv = real_kv(specs, mode)
    srcs = [naive.Source(arr.tobytes(), arr.shape[1], ps, nb, rb) for arr, ps, nb, rb in specs]
    return kv, srcs, int(kv.mode)


def _naive_state(views) -> naive.NaiveState:
    return naive.NaiveState(
        fields=[[int(x) for x in row] for row in views.fields],
        ring=[[int(x) for x in row] for row in views.ring.host],
        write_index=int(views.ring_write_index.host[0]) % (1 << 32),
        slot_runs=[int(x) for x in views.slot_run_counter.host],
        kernel_runs=[int(x) for x in views.kernel_run_counter.host],
        check_flags=int(views.check_flags.host[0]),
    )


def _assert_same(views, ns: naive.NaiveState) -> None:
    assert views.fields.tolist() == ns.fields
    assert views.ring.host.tolist() == ns.ring
    assert int(views.ring_write_index.host[0]) % (1 << 32) == ns.write_index
    assert views.slot_run_counter.host.tolist() == ns.slot_runs
    assert views.kernel_run_counter.host.tolist() == ns.kernel_runs


def _pick(rng, choices, p=None):
    return int(rng.choice(choices, p=p))


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_reference_matches_naive_oracle(seed):
    rng = np.random.default_rng(seed)
    num_slots = int(rng.integers(1, 10))
    state = CanaryState.allocate(num_slots=num_slots, slot_stride_bytes=_pick(rng, [32, 40, 48]),
                                 ring_capacity=int(rng.integers(0, 6)), check_flags=int(rng.integers(0, 4)),
                                 reported_slots=bool(rng.random() < 0.4))
    if state.reported_slots is not None:
        state.reported_slots[:] = rng.integers(0, 4, size=num_slots)
    padding_slot = _pick(rng, [0, -1])  # SPEC 4: -1 verifies slot 0, MISSING_SLOT predecessors have no link
    views = dataclasses.replace(bind_state(state), padding_slot=padding_slot)
    views.fields[:] = rng.integers(-1, 4, size=views.fields.shape)
    state.ring_write_index[0] = _pick(rng, [0, 0, 3, -2])  # -2: the uint32 count 2**32 - 2, about to wrap
    kv, srcs, mode = _random_sources(rng, num_slots)
    ns = _naive_state(views)
    ns.sources, ns.mode, ns.padding_slot = srcs, mode, padding_slot
    ns.reported = None if state.reported_slots is None else state.reported_slots.tolist()

    for _ in range(2):  # write, then write again over the same slots
        r_cap = int(rng.integers(0, 5))
        n = int(rng.integers(0, 12))
        offsets = np.sort(rng.integers(0, n + 1, size=r_cap + 1))
        if rng.random() < 0.2:
            offsets = rng.integers(-2, n + 3, size=r_cap + 1)  # garbage: reversed and out-of-range ranges
        seeds = rng.integers(-2, num_slots + 2, size=r_cap)
        seeds = np.where(rng.random(r_cap) < 0.15, SKIP_SEED, seeds)  # padding rows' tokens: skipped
        nreq = np.array([rng.integers(-1, r_cap + 2)], dtype=np.int32)
        loc = rng.integers(-2, num_slots + 2, size=n)
        ids = rng.integers(-1, 4, size=n)
        pos = np.arange(n) + rng.integers(-1, 2)  # consecutive: chain-position checks mostly pass
        pos = np.where(rng.random(n) < 0.2, rng.integers(-1, 5, size=n), pos)
        exp_ids = None if rng.random() < 0.3 else np.where(rng.random(n) < 0.2, -1, np.where(rng.random(n) < 0.2, ids + 1, ids))
        exp_pos = None if rng.random() < 0.3 else np.where(rng.random(n) < 0.2, -1, np.where(rng.random(n) < 0.2, pos + 1, pos))
        reference_canary.write(views, write_offsets=offsets, write_seed_slot_indices=seeds, write_num_valid_reqs=nreq,
                               out_cache_loc=loc, input_ids=ids, positions=pos, expected_input_ids=exp_ids,
                               expected_positions=exp_pos, real_kv=kv, launch_tag=3)
        naive.write(ns, offsets=offsets.tolist(), seeds=seeds.tolist(), num_valid_reqs=int(nreq[0]), loc=loc.tolist(),
                    ids=ids.tolist(), positions=pos.tolist(), exp_ids=None if exp_ids is None else exp_ids.tolist(),
                    exp_pos=None if exp_pos is None else exp_pos.tolist(), tag=(3 << 8) | 1)
        _assert_same(views, ns)

    # Verify entries mostly follow the written slots, so that chains and positions often match.
    cap = int(rng.integers(0, 12))
    slots = np.where(rng.random(cap) < 0.7, rng.choice(np.append(loc, 0), size=cap) if n else 0,
                     rng.integers(-2, num_slots + 2, size=cap))
    prev = np.where(rng.random(cap) < 0.5, np.roll(slots, 1), rng.integers(-2, num_slots + 2, size=cap))
    prev = np.where(rng.random(cap) < 0.1, MISSING_SLOT, prev)
    slots = np.where(rng.random(cap) < 0.1, MISSING_SLOT, slots)
    exp_pos = views.fields[np.clip(slots, 0, num_slots - 1), 1] + (rng.random(cap) < 0.2)
    exp_tok = views.fields[np.clip(slots, 0, num_slots - 1), 0] + (rng.random(cap) < 0.2)
    exp_tok = np.where(rng.random(cap) < 0.3, -1, exp_tok)
    num_valid = np.array([rng.integers(-1, cap + 2)], dtype=np.int32)
    enable = np.array([_pick(rng, [0, 1, 1, 1])], dtype=np.int32)
    reference_canary.verify(views, verify_slot_indices=slots, verify_expected_tokens=exp_tok,
                            verify_expected_positions=exp_pos, verify_prev_slot_indices=prev,
                            verify_num_valid=num_valid, enable=enable, real_kv=kv)
    naive.verify(ns, slots=slots.tolist(), exp_tokens=exp_tok.tolist(), exp_positions=exp_pos.tolist(),
                 prev_slots=prev.tolist(), num_valid=int(num_valid[0]), enable=int(enable[0]))
    _assert_same(views, ns)


# --------------------------------------------------------------------------------------------------------------
# By hand.


def _canary(num_slots=16, ring_capacity=16, flags=CheckFlags.WRITE_POSITION_CHAIN | CheckFlags.VERIFY_TOKEN, kv=None):
    state = CanaryState.allocate(num_slots=num_slots, ring_capacity=ring_capacity, check_flags=flags)
    return state, CanaryRecords(state, kv)


def _write_plan(offsets, seeds):
    wp = WritePlan.allocate(write_req_capacity=len(seeds))
    wp.write_offsets[:] = offsets
    wp.write_seed_slot_indices[:] = seeds
    wp.write_num_valid_reqs[0] = len(seeds)
    return wp


def _verify_plan(slots, tokens, positions, prev, capacity=None, enable=1):
    n = len(slots)
    vp = VerifyPlan.allocate(verify_capacity=capacity or n)
    vp.verify_slot_indices[:n] = slots
    vp.verify_expected_tokens[:n] = tokens
    vp.verify_expected_positions[:n] = positions
    vp.verify_prev_slot_indices[:n] = prev
    vp.verify_num_valid[0] = n
    vp.enable[0] = enable
    return vp


def _step(prev_hash, token, position) -> int:
    """The chain value a record ``(token, position, prev_hash)`` links to (SPEC 4)."""
    return int(link(1, prev_hash, token, position))


def _a(*v):
    return np.array(v, dtype=np.int64)


def test_write_chain_by_hand():
    _state, c = _canary()
    c.write(_write_plan([0, 3, 5], [-1, 2]), out_cache_loc=_a(1, 2, 3, 7, 8), input_ids=_a(10, 11, 12, 20, 21),
            positions=_a(0, 1, 2, 3, 4))
    f = c.views.fields
    h1 = int(_step(ANCHOR_LINK, 10, 0))
    h2 = int(_step(h1, 11, 1))
    assert f[1, :3].tolist() == [10, 0, ANCHOR_LINK]
    assert f[2, :3].tolist() == [11, 1, h1]
    assert f[3, :3].tolist() == [12, 2, h2]
    # Request 1 is seeded by slot 2, written by request 0 in the same launch: seeds are read first (all zero).
    assert f[7, :3].tolist() == [20, 3, int(_step(0, 0, 0))]
    rep = c.drain()
    # ... so its chain-position check expects 0 + 1 at position 3.
    assert [(v.kernel, v.slot, v.position, v.reasons, v.expected_aux) for v in rep] == [
        (KernelTag.WRITE, 7, 3, F.WRITE_POSITION, 1)]
    assert rep.health.write_slots == 5 and rep.health.write_launches == 1


def test_write_skips_negative_slots_and_flags_out_of_range():
    _state, c = _canary(num_slots=8)
    c.write(_write_plan([0, 4], [-1]), out_cache_loc=_a(1, -1, 9, 2), input_ids=_a(5, 6, 7, 8),
            positions=_a(0, 1, 1, 1), expected_input_ids=_a(5, 0, 7, -1))
    f = c.views.fields
    h1 = int(_step(ANCHOR_LINK, 5, 0))
    assert f[1, :3].tolist() == [5, 0, ANCHOR_LINK]
    assert f[2, :3].tolist() == [8, 1, h1]  # the skipped and the out-of-range entry did not advance the chain
    rep = c.drain()
    assert [(v.slot, v.position, v.reasons, v.stored_chain_hash, v.expected_aux) for v in rep] == [
        (9, 1, F.SLOT_RANGE, h1, 1)]
    assert rep.health.write_slots == 3  # the slot -1 entry is not processed


def test_write_skips_requests_seeded_skip_seed():
    _state, c = _canary(num_slots=8)
    before = c.views.fields.copy()
    # Request 1 is a padding row's tokens: a stale slot of request 0, an out-of-range slot, a wrong token.
    c.write(_write_plan([0, 2, 5, 6], [-1, SKIP_SEED, SKIP_SEED]), out_cache_loc=_a(1, 2, 2, 9, 3, 4),
            input_ids=_a(5, 6, 77, 78, 79, 80), positions=_a(0, 1, 40, 41, 42, 43),
            expected_input_ids=_a(5, 6, 0, 0, 0, 0), expected_positions=_a(0, 1, 0, 0, 0, 0))
    f = c.views.fields
    assert f[1, :3].tolist() == [5, 0, ANCHOR_LINK]
    assert f[2, :3].tolist() == [6, 1, int(_step(ANCHOR_LINK, 5, 0))]  # request 0's write stands
    np.testing.assert_array_equal(f[3:], before[3:])  # the skipped requests stored nothing
    rep = c.drain()
    assert len(rep) == 0  # nor asserted anything
    assert rep.health.write_slots == 2 and rep.health.write_launches == 1  # nor counted anything


def test_write_asserts():
    state, c = _canary()
    c.write(_write_plan([0, 3], [-1]), out_cache_loc=_a(1, 2, 3), input_ids=_a(5, 6, 7), positions=_a(0, 2, 3),
            expected_input_ids=_a(5, 9, -1), expected_positions=_a(0, 1, 3))
    rows = [(v.slot, v.position, v.stored_token, v.expected_token, v.reasons, v.expected_aux) for v in c.drain()]
    # Entry 1: wrong token and a position that fails both the array assert and the chain (aux: the array's).
    # Entry 2: position 3 follows the stored 2, and matches the array: no violation.
    assert rows == [(2, 2, 6, 9, F.WRITE_TOKEN | F.WRITE_POSITION, 1)]
    state.set_check_flags(CheckFlags.NONE)
    c.write(_write_plan([0, 2], [3]), out_cache_loc=_a(4, 5), input_ids=_a(1, 1), positions=_a(9, 9))
    assert len(c.drain()) == 0  # chain-position check off, no arrays: nothing to assert


def test_verify_by_hand():
    state, c = _canary(num_slots=8)
    c.write(_write_plan([0, 3], [-1]), out_cache_loc=_a(1, 2, 3), input_ids=_a(5, 6, 7), positions=_a(0, 1, 2))
    vp = _verify_plan(slots=[1, 2, 3, 0, 3, 2], tokens=[5, -1, 8, 1, 7, 6], positions=[0, 1, 2, 0, 2, 1],
                      prev=[-1, 1, 2, 5, 0, 1], capacity=8)
    c.verify(vp, launch_tag=7)
    rep = c.drain()
    # Entry 2: wrong expected token. Entry 3: slot 0 is skipped. Entry 4: prev_slot 0 skips the chain check.
    assert [(v.kernel, v.launch_tag, v.slot, v.position, v.reasons, v.expected_token, v.stored_token) for v in rep] == [
        (KernelTag.VERIFY, 7, 3, 2, F.VERIFY_TOKEN, 8, 7)]
    assert rep.health.verify_slots == 5 and rep.health.verify_launches == 1
    state.set_check_flags(CheckFlags.NONE)  # token check off
    c.verify(vp)
    assert len(c.drain()) == 0
    # Chain and position faults, a prev_slot outside the buffer, a slot outside the buffer.
    c.verify(_verify_plan(slots=[2, 3, 9], tokens=[-1, -1, -1], positions=[5, 2, 0], prev=[3, 12, 1]))
    rows = [(v.slot, v.position, v.reasons, v.expected_aux) for v in c.drain()]
    want_chain = int(_step(c.views.fields[3, 2], 7, 2))
    assert rows == [(2, 5, F.CHAIN | F.POSITION, want_chain), (3, 2, F.SLOT_RANGE, 0), (9, 0, F.SLOT_RANGE, 0)]


def test_disabled_verify_still_counts_a_launch():
    state, c = _canary()
    vp = _verify_plan(slots=[1, 2], tokens=[3, 3], positions=[9, 9], prev=[4, 4], enable=0)
    c.verify(vp)
    c.verify(vp)
    rep = c.drain()
    assert rep.total == 0
    assert (rep.health.verify_launches, rep.health.verify_slots) == (2, 0)
    vp.verify_num_valid[0] = 7  # clamped to the capacity (2)
    vp.enable[0] = 1
    c.verify(vp)
    assert c.drain().total == 2 and state.health().verify_slots == 2


def test_real_kv_in_write_and_verify():
    kvbytes = np.random.default_rng(0).integers(0, 256, size=(16, 32), dtype=np.uint8)
    _state, c = _canary(kv=real_kv([(kvbytes, 1, 32)], "all"))
    c.write(_write_plan([0, 2], [-1]), out_cache_loc=_a(4, 5), input_ids=_a(1, 2), positions=_a(0, 1))
    vp = _verify_plan(slots=[4, 5], tokens=[-1, -1], positions=[0, 1], prev=[-1, 4])
    c.verify(vp)
    assert c.drain().total == 0
    kvbytes[5, 31] ^= 0x80
    c.verify(vp)
    assert [(v.slot, v.reasons) for v in c.drain()] == [(5, F.REAL_KV)]


@pytest.mark.parametrize("mode", ["partial", "all", "none"])
def test_prefix_hit_on_never_written_zero_kv(mode):
    """The engine bug the forced bit of the fold catches: a block registered for prefix reuse before its KV store
    ran. The KV pool starts zeroed; slots 3, 4, 5 get their KV bytes and their canary records (positions 0-2,
    tokens 10-12); slot 6 of the same block, and slot 8, get neither, so their records are the zeroed
    never-written ones (token 0, position 0, prev_hash 0, real_kv_hash 0) over all-zero KV bytes, whose fold is 1.

    A later request hits the prefix: its verify plan covers 3, 4, 5, 6 at positions 0-3 (tokens 10-13), and 8 as an
    entry no other check can see: expected position 0 (the zeroed field), prev_slot 0 (predecessor page freed: no
    chain check), no expected token. Expected rows, by hand: 3, 4, 5 clean; 6: CHAIN (stored 0 != link(5)),
    POSITION (0 != 3), VERIFY_TOKEN (0 != 13) and REAL_KV (0 != 1); 8: REAL_KV alone (before the format change,
    when zero bytes folded to 0, slot 8 reported nothing and slot 6 lacked REAL_KV). Mode NONE compares nothing:
    slot 6 without REAL_KV, slot 8 silent."""
    kvbytes = np.zeros((16, 32), dtype=np.uint8)
    kvbytes[3:6] = np.random.default_rng(12).integers(1, 256, size=(3, 32), dtype=np.uint8)
    _state, c = _canary(kv=real_kv([(kvbytes, 1, 32)], mode))
    c.write(_write_plan([0, 3], [-1]), out_cache_loc=_a(3, 4, 5), input_ids=_a(10, 11, 12), positions=_a(0, 1, 2))
    fields = c.views.fields
    assert fields[6].tolist() == fields[8].tolist() == [0, 0, 0, 0]  # never written
    if mode != "none":
        assert all(int(h) & 1 for h in fields[3:6, 3])  # every stored fold is odd
    c.verify(_verify_plan(slots=[3, 4, 5, 6, 8], tokens=[10, 11, 12, 13, -1], positions=[0, 1, 2, 3, 0],
                          prev=[-1, 3, 4, 5, 0]))
    kv_bit = F.NONE if mode == "none" else F.REAL_KV
    want = [(6, 3, F.CHAIN | F.POSITION | F.VERIFY_TOKEN | kv_bit)] + ([(8, 0, F.REAL_KV)] if mode != "none" else [])
    assert [(v.slot, v.position, v.reasons) for v in c.drain()] == want


def test_written_zero_kv_verifies_clean_and_then_catches_a_change():
    """A slot written over all-zero KV bytes stores the fold 1: it verifies clean, and bytes stored later fire
    REAL_KV, in both modes that read."""
    for mode in ("partial", "all"):
        kvbytes = np.zeros((16, 32), dtype=np.uint8)
        _state, c = _canary(kv=real_kv([(kvbytes, 1, 32)], mode))
        c.write(_write_plan([0, 2], [-1]), out_cache_loc=_a(2, 7), input_ids=_a(1, 2), positions=_a(0, 1))
        assert c.views.fields[[2, 7], 3].tolist() == [1, 1]
        vp = _verify_plan(slots=[2, 7], tokens=[1, 2], positions=[0, 1], prev=[-1, 2])
        c.verify(vp)
        assert c.drain().total == 0
        kvbytes[7, 0] = 1
        c.verify(vp)
        assert [(v.slot, v.reasons) for v in c.drain()] == [(7, F.REAL_KV)]


# Real-KV modes, by hand (hand cases of helpers/records_cases.py: records as a write over the clean KV bytes left
# them, then a verify of slots 1..15 over bytes with some flipped; only REAL_KV can fire). Flips, as (source, slot,
# byte of the token): (p, 5, 15), (p, 6, 16), (t, 9, 3), (t, 11, 40), (t, 12, 50); p reads 32 of 32 bytes per token
# in mode ALL, t 48 of 64; mode PARTIAL reads the first 16 of each.
REAL_KV_BY_HAND = {
    "real_kv_partial_byte_flips": [(5, F.REAL_KV), (9, F.REAL_KV)],  # bytes 15 and 3: inside the first 16
    "real_kv_all_byte_flips": [(5, F.REAL_KV), (6, F.REAL_KV), (9, F.REAL_KV), (11, F.REAL_KV)],  # not 12: byte 50
    "real_kv_flip_detected": [(4, F.REAL_KV), (9, F.REAL_KV)],  # mode ALL: slot 4's K byte 5, slot 9's V bytes 6-7
}


@pytest.mark.parametrize("name", sorted(REAL_KV_BY_HAND))
def test_real_kv_hand_cases_fail_reasons(name):
    case = next(c for c in cc.hand_cases() if c.name == name)
    want = REAL_KV_BY_HAND[name]
    assert case.expect == want  # the case states the same (the GPU twins are compared with this reference)
    run = cc.run_case(case, "reference", lambda a: a.copy(), np.asarray)
    ((kind, w0, w1, rows),) = run.launches
    assert (kind, w0, w1) == ("verify", 0, len(want))
    assert [(int(row[1]), F(int(row[7]))) for row in rows] == want


@pytest.mark.parametrize("name", ["reported_slots_make_room", "reported_slots_bit_2_keeps_slot_rows",
                                  "reported_slots_all", "reported_slots_missing_predecessor"])
def test_reported_slots_hand_cases(name):
    """SPEC 4's reported slots: a reported slot's failing rows claim no ring index, so a small ring fills with
    the slots not reported yet; bit 2 filters MISSING rows by their predecessor, never a slot's own rows."""
    case = next(c for c in cc.hand_cases() if c.name == name)
    run = cc.run_case(case, "reference", lambda a: a.copy(), np.asarray)
    ((kind, w0, w1, rows),) = run.launches
    assert (kind, w0, w1) == ("verify", 0, len(case.expect))
    assert [(int(r[1]), F(int(r[7]))) for r in rows] == case.expect
    unfiltered = cc.run_case(dataclasses.replace(case, reported=None), "reference", lambda a: a.copy(), np.asarray)
    assert unfiltered.launches[0][2] >= w1
    assert run.slot_runs.tolist() == unfiltered.slot_runs.tolist()  # filtered entries still count as processed


def test_missing_slot_hand_case_rows():
    """helpers/records_cases.py's verify_missing_slot, row by row: a MISSING_SLOT entry is processed (counted),
    reads nothing and reports MISSING with the plan's position and token, and its predecessor slot (the
    request's own, which names it) as expected_aux; its neighbours verify clean."""
    case = next(c for c in cc.hand_cases() if c.name == "verify_missing_slot")
    run = cc.run_case(case, "reference", lambda a: a.copy(), np.asarray)
    (_, _, _, written), (_, w0, w1, rows) = run.launches
    assert written.shape[0] == 0 and (w0, w1) == (0, 2)
    tag = encode_tag(KernelTag.VERIFY, 3)
    assert rows.tolist() == [[tag, MISSING_SLOT, 1, 0, 11, 0, 1, int(F.MISSING)],
                             [tag, MISSING_SLOT, 5, 0, -1, 0, 0, int(F.MISSING)]]
    assert [(int(r[1]), F(int(r[7]))) for r in rows] == case.expect
    assert run.slot_runs.tolist() == [5 + 4, 7 + 5]  # initial counters 5, 7; entries 0-2, 4, 5 processed
    v = decode_row(rows[0])
    assert v.reasons == F.MISSING and v.reason_names == ("MISSING",) and v.slot == MISSING_SLOT
    assert v.predecessor_slot == 1 and v.expected_chain_hash is None
    assert decode_row(rows[1]).predecessor_slot == 0  # its predecessor maps to nothing either


@pytest.mark.parametrize("name", ["real_kv_zero_bytes_partial", "real_kv_zero_bytes_all"])
def test_zero_kv_hand_cases_fail_reasons(name):
    """The zero-KV hand cases (helpers/records_cases.py states the reasons): written slots over zero bytes store
    1 and verify clean; never-written slots over zero bytes fail REAL_KV."""
    case = next(c for c in cc.hand_cases() if c.name == name)
    run = cc.run_case(case, "reference", lambda a: a.copy(), np.asarray)
    (_, _, _, written), (_, _, _, clean), (_, _, _, hit) = run.launches
    assert written.shape[0] == clean.shape[0] == 0
    assert [(int(row[1]), F(int(row[7]))) for row in hit] == case.expect == [
        (7, F.CHAIN | F.POSITION | F.VERIFY_TOKEN | F.REAL_KV), (11, F.REAL_KV), (9, F.REAL_KV)]
    fields = run.canary_buffer[:, :32].copy().view(np.int64)
    assert fields[[2, 5], 3].tolist() == [1, 1]  # written over zero bytes: the fold of zeros
    assert fields[[7, 9, 11]].tolist() == [[0, 0, 0, 0]] * 3  # never written


def test_partial_mode_reads_exactly_the_first_16_bytes():
    """The same bytes under PARTIAL: every byte of a token's first 16 changes the slot's hash, none after them."""
    kvbytes = np.random.default_rng(4).integers(0, 256, size=(4, 48), dtype=np.uint8)
    _state, c = _canary(num_slots=4, kv=real_kv([(kvbytes, 1, 48)], "partial"))
    c.write(_write_plan([0, 3], [-1]), out_cache_loc=_a(1, 2, 3), input_ids=_a(1, 2, 3), positions=_a(0, 1, 2))
    vp = _verify_plan(slots=[1, 2, 3], tokens=[-1, -1, -1], positions=[0, 1, 2], prev=[-1, 1, 2])
    c.verify(vp)
    assert c.drain().total == 0
    for byte in range(48):
        kvbytes[2, byte] ^= 0x80
        c.verify(vp)
        assert [(v.slot, v.reasons) for v in c.drain()] == ([(2, F.REAL_KV)] if byte < 16 else []), byte
        kvbytes[2, byte] ^= 0x80


def test_ring_overflow_keeps_counting():
    state, c = _canary(ring_capacity=3)
    vp = _verify_plan(slots=list(range(1, 9)), tokens=[-1] * 8, positions=[1] * 8, prev=[0] * 8)
    c.verify(vp)
    c.verify(vp)
    assert int(state.ring_write_index[0]) == 16  # all slots hold position 0: 8 POSITION rows a launch
    rep = c.drain()
    assert (rep.total, len(rep), rep.dropped) == (16, 3, 13)
    assert [v.slot for v in rep] == [1, 2, 3]  # fill-once: the first three rows stay


# --------------------------------------------------------------------------------------------------------------
# The expected-token scatter.


def test_scatter_expected_tokens():
    pool = np.full((4, 6), -7, dtype=np.int32)
    scatter_expected_tokens(
        req_to_verify_expected_tokens=pool,
        req_pool_indices=_a(2, 0, 3, 9, 1),  # row 0: padding; 9: outside the pool
        tokens=_a(10, 11, 12, 99, 20, 21, 30, 40, 41),
        token_offsets=_a(0, 3, 4, 6, 7, 9),
        column_starts=_a(4, 0, -1, 0, 1),
        column_offset=1,
    )
    assert pool.tolist() == [
        [-7] * 6,
        [-7, -7, 40, 41, -7, -7],  # row 1: columns 1 + 1 + [0, 1]
        [-7, -7, -7, -7, -7, 10],  # row 2: columns 5, 6, 7: only 5 is inside
        [20, 21, -7, -7, -7, -7],  # row 3: columns 0, 1
    ]
    scatter_expected_tokens(req_to_verify_expected_tokens=pool, req_pool_indices=_a(3),
                            tokens=np.array([(1 << 32) + 5], dtype=np.int64), token_offsets=_a(0, 1),
                            column_starts=_a(2))
    assert pool[3, 2] == 5  # low 32 bits
    scatter_expected_tokens(req_to_verify_expected_tokens=pool, req_pool_indices=_a(3),
                            tokens=np.array([8], dtype=np.int32), token_offsets=_a(0, 1, 5), column_starts=_a(3))
    assert pool[3, :4].tolist() == [20, 21, 5, 8]


def test_scatter_validation():
    pool = np.zeros((4, 6), dtype=np.int32)
    kw = {"req_to_verify_expected_tokens": pool, "req_pool_indices": _a(1), "tokens": _a(1), "token_offsets": _a(0, 1),
              "column_starts": _a(0)}
    for bad, exc, msg in [
        ({"req_to_verify_expected_tokens": pool.astype(np.int64)}, TypeError,
         "req_to_verify_expected_tokens: expected dtype int32, got int64"),
        ({"tokens": np.array([1.0])}, TypeError, "tokens: expected dtype int64 or int32, got float64"),
        ({"token_offsets": _a(0)}, ValueError, "token_offsets: expected length >= bs \\+ 1 = 2, got 1"),
        ({"column_starts": _a(0, 1)}, ValueError, "column_starts: expected length 1, got 2"),
        ({"column_offset": 1.5}, TypeError, "column_offset: expected an int, got float"),
        ({"column_offset": 2**62 + 1}, ValueError, r"column_offset: expected an int in \[-2\*\*62, 2\*\*62\], got "
                                                   r"4611686018427387905"),
        ({"backend": "cupy"}, ValueError, r"backend: expected a backend for the records arrays in host memory \('reference' or 'auto'\), got 'cupy'"),
    ]:
        with pytest.raises(exc, match="kv-canary: " + msg):
            scatter_expected_tokens(**{**kw, **bad})


# --------------------------------------------------------------------------------------------------------------
# Host validation of the entry points.


def test_write_verify_validation():
    _state, c = _canary(num_slots=8)
    wp = _write_plan([0, 1], [-1])
    ok = {"out_cache_loc": _a(1), "input_ids": _a(1), "positions": _a(0)}
    for bad, exc, msg in [
        ({"out_cache_loc": np.array([1], np.int16)}, TypeError,
         "out_cache_loc: expected dtype int32 or int64, got int16"),
        ({"input_ids": _a(1, 2)}, ValueError, "input_ids: expected length 1, got 2"),
        ({"positions": np.zeros((1, 1), np.int64)}, ValueError, "positions: expected a 1-D array"),
        ({"expected_positions": _a()}, ValueError, "expected_positions: expected length 1, got 0"),
        ({"launch_tag": -1}, ValueError, "launch_tag: expected an int in"),
    ]:
        with pytest.raises(exc, match="kv-canary: " + msg):
            c.write(wp, **{**ok, **bad})
    with pytest.raises(TypeError, match="kv-canary: write_plan: expected a WritePlan, got VerifyPlan"):
        c.write(VerifyPlan.allocate(verify_capacity=1), **ok)
    wp.write_offsets = _a(0, 1, 2)
    with pytest.raises(ValueError, match="kv-canary: write_plan.write_offsets: expected length write_req_capacity "
                                         "\\+ 1 = 2, got 3"):
        c.write(wp, **ok)
    vp = VerifyPlan.allocate(verify_capacity=4)
    vp.verify_prev_slot_indices = _a(0, 0)
    with pytest.raises(ValueError, match="kv-canary: verify_plan.verify_prev_slot_indices: expected capacity 4"):
        c.verify(vp)
    vp = VerifyPlan.allocate(verify_capacity=4)
    vp.enable = np.zeros(1, np.int64)
    with pytest.raises(TypeError, match="kv-canary: verify_plan.enable: expected dtype int32, got int64"):
        c.verify(vp)


@pytest.mark.parametrize("name", cc.TOKEN_ARRAYS)
@pytest.mark.parametrize("dtype", [np.int16, np.uint32, np.uint64, np.float32, np.float64, np.bool_])
def test_write_token_arrays_take_int32_or_int64_only(name, dtype):
    """SPEC 2 (*): each token array is int32 or int64; any other dtype is a TypeError naming it (no cast)."""
    _state, c = _canary(num_slots=8)
    wp = _write_plan([0, 1], [-1])
    args = {"out_cache_loc": _a(1), "input_ids": _a(1), "positions": _a(0)}
    for width in (np.int32, np.int64):  # either width, alone or mixed, is accepted
        c.write(wp, **{**args, name: np.array([1], width)})
    with pytest.raises(TypeError, match=f"kv-canary: {name}: expected dtype int32 or int64, got "
                                        f"{np.dtype(dtype).name}"):
        c.write(wp, **{**args, name: np.array([1], dtype)})
    big = np.array([1], np.dtype(np.int32).newbyteorder())
    with pytest.raises(TypeError, match=f"kv-canary: {name}: expected dtype int32 or int64, got >i4 "
                                        "\\(non-native byte order\\)"):
        c.write(wp, **{**args, name: big})


def _reference_run(case):
    return cc.run_case(case, "reference", lambda a: a.copy(), np.asarray)


@pytest.mark.parametrize("case", cc.hand_cases() + [cc.int32_edge_case()], ids=repr)
def test_int32_token_arrays_write_what_int64_writes_hand(case):
    """Every hand case with its token arrays int32 wherever the values fit, and with widths drawn per array:
    the same records, ring rows and counters as int64 (SPEC 2 (*))."""
    want = _reference_run(case)
    for seed in (None, 1, 2):
        narrowed = cc.with_widths(case, 0, all32=True) if seed is None else cc.with_widths(case, seed)
        cc.assert_twin(case, _reference_run(narrowed), want)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_int32_token_arrays_write_what_int64_writes_random(seed):
    case = cc.random_case(seed)
    cc.assert_twin(case, _reference_run(cc.with_widths(case, seed)), _reference_run(case))


def test_kvcanary_binding_validation():
    state = CanaryState.allocate(num_slots=8)
    small = np.zeros((4, 32), np.uint8)
    with pytest.raises(ValueError, match="kv-canary: real_kv_sources\\[0\\]: expected rows \\* page_size >= the 8 "
                                         "slots of state.canary_buffer, got 4 \\* 1 = 4"):
        CanaryRecords(state, real_kv([(small, 1, 32)]))
    with pytest.raises(ValueError, match="kv-canary: backend: expected a backend for the records arrays in host memory.*got 'numba', which runs on a CUDA device"):
        CanaryRecords(state, backend="numba")
    with pytest.raises(ValueError, match="kv-canary: backend: expected one of auto, reference, cupy, numba, got 'x'"):
        CanaryRecords(state, backend="x")
    c = CanaryRecords(state, [(np.zeros((8, 32), np.uint8), 1, 32)])  # a plain source list: mode ALL
    assert c.real_kv.mode == RealKVMode.ALL and c.backend == "reference"
    assert issubclass(BackendUnavailableError, ImportError)


# --------------------------------------------------------------------------------------------------------------
# End to end over the replay scheduler.


def rows_of(log):
    return [(v.kernel, v.slot, v.position, v.reasons) for v in log.report]


@pytest.mark.slow  # a soak: test_clean_replay_variants covers the same ground in 300 steps
def test_clean_replay_1000_steps():
    e = Engine(requests=80)
    logs = e.run(1000)
    assert len(logs) == 1000
    assert all(log.report.total == 0 for log in logs), [str(v) for log in logs for v in log.report][:5]
    assert any(log.bs > log.num_active for log in logs)  # CUDA-graph padding rows with garbage lens
    h = e.state.health()
    assert (h.write_launches, h.verify_launches) == (1000, 1000)
    assert h.verify_slots == sum(log.verify_entries for log in logs) > 1_000_000
    assert h.write_slots == sum(log.write_entries for log in logs)
    assert all(log.enable == 1 for log in logs)


@pytest.mark.parametrize("kw", [{"swa_window": 64, "with_pool": False, "requests": 60},
                                {"trace": "code", "mode": "partial", "requests": 30, "chunk_size": 256}])
def test_clean_replay_variants(kw):
    e = Engine(**kw)
    logs = e.run(300)
    assert len(logs) >= 150 and all(log.report.total == 0 for log in logs)
    assert e.state.health().verify_slots == sum(log.verify_entries for log in logs) > 0


def _inject(e: Engine, kind: str, min_step=10, max_steps=300):
    """Run clean steps until the package's injector applies ``kind`` (at step >= min_step); return (fault,
    injection log, next log)."""
    fault = Fault(kind, min_step)
    inj = Injector([fault])
    for _ in range(max_steps):
        log = e.step(inj.before_write, inj.after_write)
        assert log is not None, "trace ended before the fault could be injected"
        if fault.applied:
            assert fault.applied_step == log.index >= min_step
            return fault, log, e.step()
        assert log.report.total == 0, [str(v) for v in log.report]
    raise AssertionError("no step accepted the fault")


def test_fault_spec_reject_is_seen_by_the_pool_only():
    """A rejected draft token's record: the write's assert agrees with it (the forward was fed the draft); the
    next verify reports VERIFY_TOKEN at its position, nothing else (the chain is self-consistent)."""
    f, log, nxt = _inject(Engine(requests=40), "spec-reject")
    assert log.report.total == 0 and f.written_token != f.expected_token
    assert rows_of(nxt) == [(KernelTag.VERIFY, f.slot, f.position, F.VERIFY_TOKEN)]


@pytest.mark.parametrize("pool_by_request", [True, False])
def test_fault_row_recycle_needs_the_pool_keyed_by_request(pool_by_request):
    """A running request's row handed to another running request while still read: keyed by request, the next
    verify reports VERIFY_TOKEN on the recycled positions; keyed by the row, the other request's tokens are in
    that pool row too, and nothing fires (the blind spot expected_token_pool_indices closes)."""
    f, _, nxt = _inject(Engine(requests=40, pool_by_request=pool_by_request), "row-recycle")
    rows = rows_of(nxt)
    if not pool_by_request:
        assert rows == []
        return
    assert rows and {r[3] for r in rows} == {F.VERIFY_TOKEN} and {r[1] for r in rows} <= set(f.slots)


def test_fault_flipped_kv_byte():
    f, _, nxt = _inject(Engine(requests=40), "kv-flip")
    assert rows_of(nxt) == [(KernelTag.VERIFY, f.slot, f.position, F.REAL_KV)]


def test_fault_slot_overwritten_by_another_request():
    e = Engine(requests=40)
    f, _, nxt = _inject(e, "overwrite")
    hits = [v for v in nxt.report if v.slot == f.slot and v.kernel == KernelTag.VERIFY]
    assert len(hits) == 1 and hits[0].position == f.position
    want = (F.CHAIN | (F.POSITION if f.written_position != f.position else F.NONE)
            | (F.VERIFY_TOKEN if f.written_token != f.expected_token else F.NONE))
    assert hits[0].reasons == want and hits[0].stored_token == f.written_token
    assert hits[0].expected_token == f.expected_token  # the pool's token, scattered when it was written
    assert len(f.requests) == 2 and f.slots[0] == f.slot != f.slots[1]


def test_fault_wrong_position():
    f, log, nxt = _inject(Engine(requests=40), "position")
    slot, q = f.slot, f.position
    assert f.written_position == q + 1
    assert [(v.kernel, v.slot, v.position, v.reasons, v.expected_aux) for v in log.report] == [
        (KernelTag.WRITE, slot, q + 1, F.WRITE_POSITION, q)]
    assert (KernelTag.VERIFY, slot, q, F.POSITION) in rows_of(nxt)


def test_fault_wrong_token_with_expected_token_pool():
    f, log, nxt = _inject(Engine(requests=40), "token")
    slot, q, tok = f.slot, f.position, f.expected_token
    assert f.written_token == (tok + 1) & 0x7FFF
    assert [(v.kernel, v.slot, v.position, v.reasons, v.expected_token, v.stored_token) for v in log.report] == [
        (KernelTag.WRITE, slot, q, F.WRITE_TOKEN, tok, (tok + 1) & 0x7FFF)]
    # Chain, position and real KV are self-consistent: only the expected-token pool catches it on verify.
    assert [(v.kernel, v.slot, v.position, v.reasons, v.expected_token) for v in nxt.report] == [
        (KernelTag.VERIFY, slot, q, F.VERIFY_TOKEN, tok)]


def test_fault_stale_req_to_token_row():
    e = Engine(requests=40)
    f, _, nxt = _inject(e, "stale-row")
    assert f.slots[0] == f.slot != f.slots[1]
    hits = [v for v in nxt.report if v.slot == f.slot and v.position == f.position]
    assert len(hits) == 1 and hits[0].kernel == KernelTag.VERIFY and F.CHAIN in hits[0].reasons


def test_injector_waits_for_an_applicable_step():
    e = Engine(requests=40)
    faults = [Fault("stale-row", 0), Fault("token", 0), Fault("kv-flip", 3)]
    inj = Injector(faults)
    for _ in range(200):
        e.step(inj.before_write, inj.after_write)
    assert faults[1].applied_step == 0  # a running request is there at once
    assert faults[2].applied_step == 3
    assert faults[0].applied_step > 0  # no row has been reused at step 0
    touched = [set(f.requests) for f in faults]
    assert all(not (a & b) for i, a in enumerate(touched) for b in touched[i + 1:])  # one fault per request


def test_ring_overflow_end_to_end():
    e = Engine(requests=40, ring_capacity=4)
    hit = {}

    def smash(kv, data):
        if data.step.index < 10 or hit:
            return
        for i in range(len(data.rows)):
            p_end = int(data.prefix[i] + data.extend[i])
            if p_end >= 10 and data.continues[i]:
                slots = kv.r2t[data.rows[i], :p_end].astype(np.int64)
                for s in slots:
                    kv.kv_token_bytes(int(s))[0] ^= 1
                hit["slots"] = set(slots.tolist())
                return

    for _ in range(300):
        log = e.step(after_write=smash)
        if hit:
            break
        assert log.report.total == 0
    slots, rep = hit["slots"], e.step().report
    assert rep.total >= len(slots) >= 10 and len(rep) == 4 and rep.dropped == rep.total - 4
    assert all(v.kernel == KernelTag.VERIFY and v.reasons == F.REAL_KV and v.slot in slots for v in rep)


def test_disabled_verify_end_to_end():
    e = Engine(requests=40, verify_capacity=2048, on_overflow="skip")
    logs = e.run(120)
    disabled = [log for log in logs if log.enable == 0]
    assert disabled and len(disabled) < len(logs)
    assert all(log.report.total == 0 for log in logs)
    h = e.state.health()
    assert h.verify_launches == len(logs)  # disabled launches count
    assert h.verify_slots == sum(log.verify_entries for log in logs)


def test_sampled_verify_end_to_end():
    """The same run sampled (the default): no step is disabled, the steps above 2048 entries verify 2048 of them,
    and a clean run stays clean (a sample wrapping round a window keeps each entry's real predecessor)."""
    e = Engine(requests=40, verify_capacity=2048)
    logs = e.run(120)
    assert all(log.enable == 1 for log in logs) and all(log.report.total == 0 for log in logs)
    assert any(log.verify_entries == 2048 for log in logs)
    assert e.state.health().verify_slots == sum(log.verify_entries for log in logs)


# --------------------------------------------------------------------------------------------------------------
# The hand cases without real-KV sources, the write scan's boundaries among them, against the naive oracle.


@pytest.mark.parametrize("case", [c for c in cc.hand_cases() if not c.sources], ids=repr)
def test_hand_cases_match_naive_oracle(case):
    state = CanaryState.allocate(num_slots=case.num_slots, ring_capacity=case.ring_capacity,
                                 check_flags=case.check_flags, reported_slots=case.reported is not None)
    if case.reported is not None:
        state.reported_slots[:] = case.reported
    views = bind_state(state)
    if case.records is not None:
        views.fields[:] = case.records
    state.ring_write_index[0] = case.write_index
    ns = _naive_state(views)
    ns.reported = None if case.reported is None else [int(x) for x in case.reported]
    kv = real_kv([], RealKVMode.NONE)
    for launch in case.launches:
        a = launch.args
        if launch.kind == "write":
            reference_canary.write(views, write_offsets=a["write_offsets"],
                                   write_seed_slot_indices=a["write_seed_slot_indices"],
                                   write_num_valid_reqs=a["write_num_valid_reqs"], out_cache_loc=a["out_cache_loc"],
                                   input_ids=a["input_ids"], positions=a["positions"],
                                   expected_input_ids=a.get("expected_input_ids"),
                                   expected_positions=a.get("expected_positions"), real_kv=kv,
                                   launch_tag=a.get("launch_tag", 0))
            opt = {k: (None if a.get(k) is None else a[k].tolist()) for k in ("expected_input_ids", "expected_positions")}
            naive.write(ns, offsets=a["write_offsets"].tolist(), seeds=a["write_seed_slot_indices"].tolist(),
                        num_valid_reqs=int(a["write_num_valid_reqs"][0]), loc=a["out_cache_loc"].tolist(),
                        ids=a["input_ids"].tolist(), positions=a["positions"].tolist(),
                        exp_ids=opt["expected_input_ids"], exp_pos=opt["expected_positions"],
                        tag=(a.get("launch_tag", 0) << 8) | 1)
        else:
            reference_canary.verify(views, verify_slot_indices=a["verify_slot_indices"],
                                    verify_expected_tokens=a["verify_expected_tokens"],
                                    verify_expected_positions=a["verify_expected_positions"],
                                    verify_prev_slot_indices=a["verify_prev_slot_indices"],
                                    verify_num_valid=a["verify_num_valid"], enable=a["enable"], real_kv=kv,
                                    launch_tag=a.get("launch_tag", 0))
            naive.verify(ns, slots=a["verify_slot_indices"].tolist(), exp_tokens=a["verify_expected_tokens"].tolist(),
                         exp_positions=a["verify_expected_positions"].tolist(),
                         prev_slots=a["verify_prev_slot_indices"].tolist(), num_valid=int(a["verify_num_valid"][0]),
                         enable=int(a["enable"][0]), tag=(a.get("launch_tag", 0) << 8) | 2)
        _assert_same(views, ns)


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 40), st.data(), st.sampled_from(["token", "position", "prev_hash"]),
       st.integers(-(1 << 63), (1 << 63) - 1))
def test_verify_flags_a_changed_link_field(n, data, field, value):
    """A changed token, position or prev_hash of record j breaks the link its successor j + 1 stored: verify
    reports CHAIN on j + 1 (a changed prev_hash also on j itself, against link(j - 1))."""
    j = data.draw(st.integers(0, n - 2))
    state, c = _canary(num_slots=64, ring_capacity=64, flags=CheckFlags.WRITE_POSITION_CHAIN)
    slots = np.arange(1, n + 1) * 3 % 61 + 1
    ids = np.arange(n) * 7 + 5
    c.write(_write_plan([0, n], [-1]), out_cache_loc=slots, input_ids=ids, positions=np.arange(n))
    f = c.views.fields
    col = {"token": 0, "position": 1, "prev_hash": 2}[field]
    if int(f[slots[j], col]) == value:
        value ^= 1
    f[slots[j], col] = value
    prev = np.concatenate([[-1], slots[:-1]])
    c.verify(_verify_plan(slots=slots.tolist(), tokens=[-1] * n, positions=list(range(n)), prev=prev.tolist()))
    chain = {v.slot for v in c.drain() if v.reasons & F.CHAIN}
    assert int(slots[j + 1]) in chain
    assert (int(slots[j]) in chain) == (field == "prev_hash")
