"""Canary write / verify / scatter cases, run on any backend and compared with the reference (docs/canary.md 6).

A :class:`CanaryCase` is an initial state (canary records, padding bytes, ring contents and write index, check
flags, real-KV sources) and a sequence of launches. :func:`run_case` runs it on one backend with arrays placed
by a ``place`` function (identity for host NumPy, ``cupy.asarray`` on a GPU, ...) and records, per launch, the
write index before and after and the ring rows it claimed. :func:`assert_twin` compares a backend's run with
the reference's under the byte-identity contract: canary buffer, padding bytes, counters and write indices
byte for byte; each launch's ring rows as a multiset (GPU order is decided by atomics), or, when the launch
overflowed the ring, a sub-multiset of the rows it would have written (:func:`all_rows`). Every buffer starts
poisoned (random records, random padding, a sentinel ring) so that a missed or stray store shows.

Random cases avoid the two documented races (docs/records.md 6): within one write launch, no slot is written
twice (different requests write disjoint slots, a request each slot once), and no request's seed is written in
the launch (its own request's included: a request's segments may run in different blocks).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from canary import MISSING_SLOT, VerifyPlan, WritePlan
from canary.contract.hashes import ANCHOR_LINK
from canary.contract.realkv import RealKVMode, real_kv
from canary.contract.ring import RING_ROW_WORDS, CheckFlags, FailReason
from canary.contract.state import CanaryState
from canary import CanaryRecords, scatter_expected_tokens

I64_MIN, I64_MAX = -(1 << 63), (1 << 63) - 1
RING_SENTINEL = 0x5A5A_5A5A_5A5A_5A5A
ALL_FLAGS = int(CheckFlags.WRITE_POSITION_CHAIN | CheckFlags.VERIFY_TOKEN)
F = FailReason


@dataclass
class Launch:
    kind: str  # "write" or "verify"
    args: dict  # NumPy arrays (and launch_tag)


@dataclass
class CanaryCase:
    name: str
    num_slots: int
    launches: list[Launch]
    slot_stride_bytes: int = 32
    ring_capacity: int = 64
    ring_row_stride: int = RING_ROW_WORDS
    check_flags: int = ALL_FLAGS
    write_index: int = 0  # the int32 word's initial value (negative: a uint32 count near 2**32)
    records: np.ndarray | None = None  # [num_slots, 4] int64 initial fields; None: random
    sources: list = field(default_factory=list)  # (array, page_size, num_bytes_per_token, read_bytes)
    mode: RealKVMode = RealKVMode.ALL
    seed: int = 0  # of the poison
    reported: np.ndarray | None = None  # [num_slots] uint8 reported_slots (SPEC 4); None: not given
    padding_slot: int = 0  # CanaryRecords' option (SPEC 3.2 "No reserved slot", 4)
    # Worked out by hand (some hand cases): the (slot, reasons) of the last launch's ring rows, in entry order.
    expect: list[tuple[int, FailReason]] | None = None

    def __repr__(self) -> str:
        return f"CanaryCase({self.name})"


def _initial_buffer(case: CanaryCase) -> np.ndarray:
    rng = np.random.default_rng([case.seed, 7])
    buf = rng.integers(0, 256, size=(case.num_slots, case.slot_stride_bytes), dtype=np.uint8)
    if case.records is not None:
        buf[:, :32] = np.ascontiguousarray(case.records, dtype=np.int64).view(np.uint8).reshape(case.num_slots, 32)
    return buf


def make_state(case: CanaryCase, place: Callable) -> tuple[CanaryState, object]:
    """The case's state on the device of ``place``; also returns the wide ring array (row stride > 8 views)."""
    wide = np.full((case.ring_capacity, case.ring_row_stride), RING_SENTINEL, dtype=np.int64)
    dev_wide = place(wide)
    state = CanaryState(
        canary_buffer=place(_initial_buffer(case)),
        ring=dev_wide[:, :RING_ROW_WORDS],
        ring_write_index=place(np.array([case.write_index], dtype=np.int32)),
        slot_run_counter=place(np.array([5, 7], dtype=np.int64)),
        kernel_run_counter=place(np.array([11, 13], dtype=np.int64)),
        check_flags=place(np.array([case.check_flags], dtype=np.int32)),
        reported_slots=None if case.reported is None else place(np.asarray(case.reported, dtype=np.uint8)),
    )
    return state, dev_wide


@dataclass
class Run:
    """What a backend left: per launch (kind, index before, index after, claimed rows); final buffers."""

    launches: list[tuple[str, int, int, np.ndarray]]
    canary_buffer: np.ndarray
    ring: np.ndarray  # the wide ring, all columns
    slot_runs: np.ndarray
    kernel_runs: np.ndarray


def _u32(word) -> int:
    return int(np.asarray(word).reshape(-1)[0]) % (1 << 32)


def run_case(case: CanaryCase, backend: str, place: Callable, to_host: Callable, *, sync: Callable = lambda: None,
             ring_capacity: int | None = None, write_index: int | None = None, stream=None,
             launch_config=None) -> Run:
    """Run every launch of ``case`` through :class:`CanaryRecords` (``backend``), arrays placed with ``place``."""
    if ring_capacity is not None or write_index is not None:
        case = replace(case, ring_capacity=case.ring_capacity if ring_capacity is None else ring_capacity,
                       write_index=case.write_index if write_index is None else write_index)
    state, wide = make_state(case, place)
    sources = [(place(a), ps, nb, rb) for a, ps, nb, rb in case.sources]
    canary = CanaryRecords(state, real_kv(sources, case.mode) if sources else None, backend=backend,
                           padding_slot=case.padding_slot,
                           **({} if launch_config is None else {"launch_config": launch_config}))
    out = []
    for launch in case.launches:
        placed = {k: (place(v) if isinstance(v, np.ndarray) else v) for k, v in launch.args.items()}
        sync()
        w0 = _u32(to_host(state.ring_write_index))
        if launch.kind == "write":
            plan = WritePlan(write_offsets=placed.pop("write_offsets"),
                             write_seed_slot_indices=placed.pop("write_seed_slot_indices"),
                             write_num_valid_reqs=placed.pop("write_num_valid_reqs"))
            canary.write(plan, stream=stream, **placed)
        else:
            tag = placed.pop("launch_tag", 0)
            plan = VerifyPlan(status=place(np.zeros(1, np.int32)), **placed)
            canary.verify(plan, launch_tag=tag, stream=stream)
        sync()
        w1 = _u32(to_host(state.ring_write_index))
        ring = to_host(wide)
        cap = case.ring_capacity
        idx = [k % (1 << 32) for k in range(w0, w0 + ((w1 - w0) % (1 << 32)))]
        rows = np.array([ring[k, :RING_ROW_WORDS] for k in idx if k < cap], dtype=np.int64).reshape(-1, RING_ROW_WORDS)
        out.append((launch.kind, w0, w1, rows))
    return Run(out, to_host(state.canary_buffer), to_host(wide), to_host(state.slot_run_counter),
               to_host(state.kernel_run_counter))


def _sorted_rows(rows: np.ndarray) -> list:
    return sorted(map(tuple, np.asarray(rows).tolist()))


def all_rows(case: CanaryCase) -> list[list]:
    """Every ring row each launch of ``case`` produces (the reference with a ring that never overflows)."""
    total = 0
    for _ in range(3):
        big = max(64, 4 * total + 64)
        run = run_case(case, "reference", lambda a: a.copy(), np.asarray, ring_capacity=big, write_index=0)
        total = run.launches[-1][2] if run.launches else 0
        if total < big:
            return [_sorted_rows(r) for _, _, _, r in run.launches]
    raise AssertionError("all_rows: the ring kept overflowing")


def assert_twin(case: CanaryCase, got: Run, want: Run) -> None:
    """``got`` (a GPU twin) against ``want`` (the reference) under docs/canary.md 6's contract."""
    assert got.canary_buffer.tobytes() == want.canary_buffer.tobytes(), _first_diff(case, got, want)
    assert got.slot_runs.tolist() == want.slot_runs.tolist(), (got.slot_runs, want.slot_runs)
    assert got.kernel_runs.tolist() == want.kernel_runs.tolist(), (got.kernel_runs, want.kernel_runs)
    full = None
    cap = case.ring_capacity
    touched = np.zeros(cap, dtype=bool)
    for i, ((kind, g0, g1, grows), (_, w0, w1, wrows)) in enumerate(zip(got.launches, want.launches, strict=True)):
        assert (g0, g1) == (w0, w1), f"launch {i} ({kind}): write index {g0}->{g1}, reference {w0}->{w1}"
        claimed = (w1 - w0) % (1 << 32)
        for k in range(claimed):
            j = (w0 + k) % (1 << 32)
            if j < cap:
                touched[j] = True
        if len(wrows) == claimed:  # every claimed row fitted: the same multiset
            assert _sorted_rows(grows) == _sorted_rows(wrows), f"launch {i} ({kind}) ring rows differ"
        else:  # overflow: a sub-multiset, of the right size, of what the launch produces
            if full is None:
                full = all_rows(case)
            pool = list(full[i])
            assert len(grows) == len(wrows)
            for row in _sorted_rows(grows):
                assert row in pool, f"launch {i} ({kind}): row {row} is not one the launch produces"
                pool.remove(row)
    # Rows no launch claimed keep the sentinel; columns past the row's 8 words too.
    assert (got.ring[~touched] == RING_SENTINEL).all()
    assert (got.ring[:, RING_ROW_WORDS:] == RING_SENTINEL).all()


def _first_diff(case: CanaryCase, got: Run, want: Run) -> str:
    a, b = got.canary_buffer, want.canary_buffer
    slot, byte = (int(x[0]) for x in np.nonzero(a != b))
    return (f"{case.name}: canary buffer differs first at slot {slot} byte {byte}: "
            f"got {a[slot, :32].view(np.int64).tolist()}, reference {b[slot, :32].view(np.int64).tolist()}")


# ----------------------------------------------------------------------------------------------------------------
# Builders


def _rep(num_slots: int, bits: dict[int, int]) -> np.ndarray:
    out = np.zeros(num_slots, dtype=np.uint8)
    for k, b in bits.items():
        out[k] = b
    return out


def _a(*v) -> np.ndarray:
    return np.array(v, dtype=np.int64)


def write_launch(offsets, seeds, loc, ids, pos, *, nreq=None, exp_ids=None, exp_pos=None, tag=0) -> Launch:
    seeds = np.asarray(seeds, dtype=np.int64)
    args = {
        "write_offsets": np.asarray(offsets, dtype=np.int64), "write_seed_slot_indices": seeds,
        "write_num_valid_reqs": np.array([len(seeds) if nreq is None else nreq], dtype=np.int32),
        "out_cache_loc": np.asarray(loc, dtype=np.int64), "input_ids": np.asarray(ids, dtype=np.int64),
        "positions": np.asarray(pos, dtype=np.int64), "launch_tag": tag,
    }
    if exp_ids is not None:
        args["expected_input_ids"] = np.asarray(exp_ids, dtype=np.int64)
    if exp_pos is not None:
        args["expected_positions"] = np.asarray(exp_pos, dtype=np.int64)
    return Launch("write", args)


def verify_launch(slots, tokens, positions, prev, *, num_valid=None, enable=1, capacity=None, tag=0) -> Launch:
    n = len(slots)
    cap = n if capacity is None else capacity

    def col(v, fill):
        out = np.full(cap, fill, dtype=np.int64)
        out[:n] = v
        return out

    return Launch("verify", {
        "verify_slot_indices": col(slots, 0), "verify_expected_tokens": col(tokens, -1),
        "verify_expected_positions": col(positions, 0), "verify_prev_slot_indices": col(prev, 0),
        "verify_num_valid": np.array([n if num_valid is None else num_valid], dtype=np.int32),
        "enable": np.array([enable], dtype=np.int32), "launch_tag": tag,
    })


def chain_then_verify(slots, *, tokens=None, start=0, seed=-1, tag=0) -> list[Launch]:
    """One request writing ``slots`` at positions start.., then a verify of the same chain (clean)."""
    n = len(slots)
    tokens = np.arange(100, 100 + n) if tokens is None else np.asarray(tokens)
    pos = np.arange(start, start + n)
    prev = np.concatenate([[seed], slots[:-1]]) if n else np.zeros(0, np.int64)
    return [write_launch([0, n], [seed], slots, tokens, pos, tag=tag),
            verify_launch(slots, tokens, pos, prev, tag=tag + 1)]


def _sources(rng, num_slots: int, kinds: str) -> list:
    """Real-KV sources covering ``num_slots``: 'p' paged uint8 (page 4, 32 B/token), 't' token-major float16
    (64 B/token, reads 48), 'w' wide rows with a row stride > row bytes (page 2, 16 B/token)."""
    out = []
    for k in kinds:
        if k == "p":
            pages = -(-num_slots // 4)
            out.append((rng.integers(0, 256, size=(pages, 4, 32), dtype=np.uint8), 4, 32, 32))
        elif k == "t":
            out.append((rng.standard_normal((num_slots, 32)).astype(np.float16), 1, 64, 48))
        elif k == "w":
            rows = -(-num_slots // 2)
            wide = rng.integers(0, 256, size=(rows, 48), dtype=np.uint8)
            out.append((wide[:, :32], 2, 16, 16))
    return out


def hand_cases() -> list[CanaryCase]:
    """Boundaries, padding rows, clamps, asserts, ring overflow and wrap, real-KV modes (named)."""
    rng = np.random.default_rng(1234)
    cases: list[CanaryCase] = []
    S = 16

    def add(name, launches, **kw):
        kw.setdefault("num_slots", S)
        cases.append(CanaryCase(name=name, launches=launches, seed=len(cases), **kw))

    add("chain_clean", chain_then_verify(_a(3, 4, 9, 15, 1)))
    add("chain_from_seed", [write_launch([0, 2], [5], _a(6, 7), _a(1, 2), _a(8, 9)),
                            verify_launch(_a(6, 7), _a(1, 2), _a(8, 9), _a(5, 6))],
        records=np.tile(_a(40, 7, 123, 0), (S, 1)))
    add("seeds_padding_and_out_of_range", [write_launch([0, 1, 2, 3, 4], [0, S, -2, S - 1], _a(1, 2, 3, 4),
                                                        _a(9, 9, 9, 9), _a(0, 0, 0, 5))])
    add("skip_negative_and_out_of_range_slots", [
        write_launch([0, 6], [-1], _a(2, -1, S, 3, -7, S + 4), _a(1, 2, 3, 4, 5, 6), _a(0, 1, 1, 1, 2, 2)),
        verify_launch(_a(2, 3), _a(1, 4), _a(0, 1), _a(-1, 2))])
    add("slot_written_twice_in_one_request", [write_launch([0, 4], [-1], _a(5, 6, 5, 7), _a(1, 2, 3, 4), _a(0, 1, 2, 3)),
                                               verify_launch(_a(5, 6, 7), _a(3, 2, 4), _a(2, 1, 3), _a(6, -1, 5))])
    # More entries than a warp, so the GPU's tile path with its hashed last-occurrence table (the case above is the
    # warp path's): slot 4 three times and slot 8 twice, all in the simulator's first 32-entry tile; the last
    # write of each is kept on every backend.
    dup = np.arange(1, 41)
    dup[[10, 20]] = dup[3]
    dup[25] = dup[7]
    add("slot_repeated_in_a_tile", [write_launch([0, 40], [-1], dup, np.arange(100, 140), np.arange(40)),
                                    verify_launch(_a(4, 8), _a(120, 125), _a(20, 25), _a(20, 25))], num_slots=64)
    add("own_seed_rewritten", [write_launch([0, 2], [4], _a(4, 5), _a(1, 2), _a(3, 4))],
        records=np.tile(_a(1, 2, 3, 4), (S, 1)))
    add("write_asserts", [write_launch([0, 6], [-1], _a(1, 2, 3, 4, 5, 6), _a(10, 11, 12, 13, 14, 15),
                                       _a(0, 1, 5, 6, 6, 7), exp_ids=_a(10, -1, 99, 13, -1, 0),
                                       exp_pos=_a(0, -1, 2, -1, 9, 7), tag=77)])
    add("write_asserts_chain_off", [write_launch([0, 4], [-1], _a(1, 2, 3, 4), _a(1, 2, 3, 4), _a(0, 3, 5, 5),
                                                 exp_pos=_a(-1, 3, -1, 6))],
        check_flags=int(CheckFlags.VERIFY_TOKEN))
    add("write_position_wraps_int64", [write_launch([0, 2], [3], _a(4, 5), _a(1, 1), _a(I64_MIN, I64_MIN + 1))],
        records=np.tile(_a(0, I64_MAX, 0, 0), (S, 1)))
    add("write_tokens_extreme", [write_launch([0, 3], [-1], _a(1, 2, 3), _a(I64_MIN, I64_MAX, -1), _a(0, 1, 2),
                                              exp_ids=_a(I64_MAX, I64_MAX, -1))])
    add("write_nreq_clamped_low", [write_launch([0, 2, 4], [-1, -1], _a(1, 2, 3, 4), _a(1, 2, 3, 4), _a(0, 1, 0, 1),
                                                nreq=-1)])
    add("write_nreq_clamped_high", [write_launch([0, 2, 4], [-1, -1], _a(1, 2, 3, 4), _a(1, 2, 3, 4), _a(0, 1, 0, 1),
                                                 nreq=3)])
    add("write_nreq_partial", [write_launch([0, 2, 4], [-1, -1], _a(1, 2, 3, 4), _a(1, 2, 3, 4), _a(0, 1, 0, 1),
                                            nreq=1)])
    add("write_offsets_garbage", [write_launch([3, 1, -5, 9, 2], [-1, -1, -1, -1], _a(1, 2, 3, 4, 5, 6),
                                               _a(1, 2, 3, 4, 5, 6), _a(0, 1, 2, 3, 4, 5))])
    add("write_empty", [write_launch(np.zeros(1), [], [], [], []), write_launch([0, 0], [-1], [], [], [])])
    add("write_request_without_entries", [write_launch([0, 0, 2, 2], [-1, -1, -1], _a(1, 2), _a(1, 2), _a(0, 1))])
    # Requests seeded SKIP_SEED (padding rows whose tokens sit among the step's): stale slots (another request's,
    # out of range), wrong tokens and positions, none of it processed, counted, asserted or stored.
    add("write_skip_seed", [
        write_launch([0, 2, 5, 7, 9, 11], [I64_MIN, -1, I64_MIN, 9, I64_MIN], _a(4, 5, 1, 2, 3, 2, S, 6, -1, 7, 1),
                     _a(7, 7, 10, 11, 12, 99, 98, 13, 97, 96, 95), _a(9, 9, 0, 1, 2, 40, -5, 4, 0, 8, 8),
                     exp_ids=_a(0, 0, 10, 11, 12, 0, 0, 13, 0, 0, 0), exp_pos=_a(0, 0, 0, 1, 2, 0, 0, 4, 0, 0, 0)),
        verify_launch(_a(1, 2, 3, 6, 4, 7), _a(10, 11, 12, 13, -1, -1), _a(0, 1, 2, 4, 3, 3), _a(-1, 1, 2, 9, 0, 0))],
        records=np.tile(_a(0, 3, 0, 0), (S, 1)))
    long_slots = rng.permutation(np.arange(1, 600))[:300]
    add("long_request_many_chunks", chain_then_verify(long_slots, start=7), num_slots=600, ring_capacity=8)
    add("verify_by_hand", [
        write_launch([0, 3], [-1], _a(1, 2, 3), _a(10, 11, 12), _a(0, 1, 2)),
        verify_launch(_a(1, 2, 3, 0, 2, 3, 3, 1, 2), _a(10, 11, -1, 5, 99, 12, 12, 10, 11),
                      _a(0, 1, 2, 9, 1, 2, 7, 0, 1), _a(-1, 1, 2, 4, 1, 0, 2, 5, S), tag=5)])
    # An in-window position whose SWA mapping was cleared (MISSING_SLOT, SPEC 3.2) among clean entries: processed,
    # nothing read, one row each, [tag, MISSING_SLOT, expected position, 0, expected token, 0, 0, MISSING]. Slot 3's
    # predecessor is the evicted position (prev 0: chain not checked); entry 3 is padding; entry 6 lies past
    # num_valid. Rows, in entry order: (MISSING_SLOT, pos 1, token 11), (MISSING_SLOT, pos 5, token -1).
    add("verify_missing_slot", [
        write_launch([0, 4], [-1], _a(1, 2, 3, 4), _a(10, 11, 12, 13), _a(0, 1, 2, 3)),
        verify_launch(_a(1, MISSING_SLOT, 3, 0, 4, MISSING_SLOT, MISSING_SLOT), _a(10, 11, 12, 5, 13, -1, 99),
                      _a(0, 1, 2, 9, 3, 5, 6), _a(-1, 1, 0, 4, 3, 0, 0), num_valid=6, tag=3)],
        expect=[(MISSING_SLOT, F.MISSING), (MISSING_SLOT, F.MISSING)])
    add("verify_token_check_off", [write_launch([0, 2], [-1], _a(1, 2), _a(10, 11), _a(0, 1)),
                                   verify_launch(_a(1, 2), _a(99, 98), _a(0, 1), _a(-1, 1))],
        check_flags=int(CheckFlags.WRITE_POSITION_CHAIN))
    add("verify_slots_out_of_range", [verify_launch(_a(-1, S, S + 3, -9, 0, S - 1), _a(1, -1, 3, 4, 5, 6),
                                                    _a(0, 1, 2, 3, 4, 5), _a(-1, -1, -1, -1, -1, -2))])
    add("verify_prev_out_of_range", [verify_launch(_a(1, 2, 3), _a(-1, -1, -1), _a(0, 0, 0), _a(S, -2, I64_MIN))])
    add("verify_num_valid_clamps", [verify_launch(_a(1, 2, 3), _a(-1, -1, -1), _a(5, 5, 5), _a(0, 0, 0), num_valid=-3),
                                    verify_launch(_a(1, 2, 3), _a(-1, -1, -1), _a(5, 5, 5), _a(0, 0, 0), num_valid=9),
                                    verify_launch(_a(1, 2, 3), _a(-1, -1, -1), _a(5, 5, 5), _a(0, 0, 0), num_valid=2,
                                                  capacity=8)])
    add("verify_disabled_still_counts", [verify_launch(_a(1, 2, 3), _a(-1, -1, -1), _a(5, 5, 5), _a(0, 0, 0),
                                                       enable=0)])
    add("verify_capacity_zero", [verify_launch([], [], [], [], num_valid=4)])
    add("verify_all_padding", [verify_launch(np.zeros(40, np.int64), np.zeros(40), np.zeros(40), np.zeros(40))])
    bad = verify_launch(np.arange(1, 9), np.full(8, -1), np.full(8, 99), np.full(8, -1))  # 8 violations
    add("ring_exactly_full", [bad], ring_capacity=8)
    add("ring_overflow_by_one", [bad], ring_capacity=7)
    add("ring_capacity_zero", [bad], ring_capacity=0)
    add("ring_overflow_across_launches", [bad, bad], ring_capacity=12)
    add("ring_index_wraps", [bad, bad], ring_capacity=6, write_index=-3)
    add("ring_row_stride_wider", [bad], ring_row_stride=11, ring_capacity=9)
    # Reported slots (SPEC 4): slots 1-4 already reported, so a 4-row ring takes slots 5-8, not 1-4 again
    known = np.tile(_a(40, 7, 123, 0), (S, 1))  # every verify of `bad` fails POSITION and CHAIN
    add("reported_slots_make_room", [bad], ring_capacity=4, reported=_rep(S, {1: 1, 2: 1, 3: 3, 4: 1}), records=known,
        expect=[(s, F.POSITION | F.CHAIN) for s in (5, 6, 7, 8)])
    add("reported_slots_bit_2_keeps_slot_rows", [bad], reported=_rep(S, {k: 2 for k in range(1, 9)}), records=known,
        expect=[(s, F.POSITION | F.CHAIN) for s in range(1, 9)])
    add("reported_slots_all", [bad], reported=_rep(S, {k: 1 for k in range(S)}), expect=[])
    # MISSING rows are filtered by their predecessor's bit 2; an out-of-range predecessor (-1) never is
    add("reported_slots_missing_predecessor", [verify_launch(
        _a(MISSING_SLOT, MISSING_SLOT, MISSING_SLOT, MISSING_SLOT, S + 2), _a(1, 2, 3, 4, 5), _a(1, 2, 3, 0, 4),
        _a(3, 4, 5, -1, 2))], reported=_rep(S, {3: 2, 4: 1, 5: 3, 2: 3}),
        expect=[(MISSING_SLOT, F.MISSING), (MISSING_SLOT, F.MISSING), (S + 2, F.SLOT_RANGE)])
    add("slot_stride_padding_untouched", chain_then_verify(_a(3, 4, 9, 15, 1)), slot_stride_bytes=56)
    add("one_slot_canary", [write_launch([0, 2], [-1], _a(0, 1), _a(1, 2), _a(0, 1)),
                            verify_launch(_a(0, 1), _a(1, 2), _a(0, 1), _a(-1, 0))], num_slots=1)
    # padding_slot=-1 (SPEC 3.2 "No reserved slot", 4): slot 0 is verified like any slot, a predecessor 0 is chain
    # checked, a MISSING_SLOT predecessor has no link (no CHAIN, no SLOT_RANGE), a seed of MISSING_SLOT chains from
    # the anchor. One request writes slots 0, 1, 2 (positions 0-2); verify: slot 0 (position wrong: POSITION), 1
    # (chain from 0: clean), 2 with predecessor MISSING_SLOT (clean), 2 with predecessor 0 (CHAIN: 2's link is 1's),
    # MISSING_SLOT with predecessor MISSING_SLOT (MISSING), slot 0 with predecessor -2 (SLOT_RANGE).
    add("real0_verify_by_hand", [
        write_launch([0, 3], [-1], _a(0, 1, 2), _a(10, 11, 12), _a(0, 1, 2)),
        verify_launch(_a(0, 1, 2, 2, MISSING_SLOT, 0), _a(10, 11, 12, 12, 13, 10), _a(5, 1, 2, 2, 3, 0),
                      _a(-1, 0, MISSING_SLOT, 0, MISSING_SLOT, -2))],
        padding_slot=-1, expect=[(0, F.POSITION), (2, F.CHAIN), (MISSING_SLOT, F.MISSING), (0, F.SLOT_RANGE)])
    add("real0_default_skips_the_same", [
        write_launch([0, 3], [-1], _a(0, 1, 2), _a(10, 11, 12), _a(0, 1, 2)),
        verify_launch(_a(0, 1, 2, 2, MISSING_SLOT, 0), _a(10, 11, 12, 12, 13, 10), _a(5, 1, 2, 2, 3, 0),
                      _a(-1, 0, MISSING_SLOT, 0, MISSING_SLOT, -2))],
        expect=[(2, F.SLOT_RANGE), (MISSING_SLOT, F.MISSING)])
    add("real0_seed_missing_chains_from_anchor", [
        write_launch([0, 2], [MISSING_SLOT], _a(3, 4), _a(10, 11), _a(5, 6)),
        verify_launch(_a(3, 4), _a(10, 11), _a(5, 6), _a(MISSING_SLOT, 3))], padding_slot=-1,
        check_flags=int(CheckFlags.VERIFY_TOKEN), expect=[])
    add("real0_reported_slot_zero", [
        verify_launch(_a(0, 1, MISSING_SLOT), _a(-1, -1, -1), _a(99, 99, 0), _a(-1, 0, 0))],
        padding_slot=-1, reported=_rep(S, {0: 3}), records=np.tile(_a(40, 7, 123, 0), (S, 1)),
        expect=[(1, F.POSITION | F.CHAIN)])
    scan_cases(add)
    for kinds, mode in (("p", RealKVMode.ALL), ("pt", RealKVMode.ALL), ("ptw", RealKVMode.PARTIAL),
                        ("tw", RealKVMode.NONE), ("ptwp", RealKVMode.ALL)):
        launches = chain_then_verify(_a(3, 4, 9, 15, 1, 2))
        launches.append(verify_launch(_a(3, 4, 9), _a(-1, -1, -1), _a(0, 1, 2), _a(-1, 3, 4)))
        add(f"real_kv_{kinds}_{mode.name.lower()}", launches, sources=_sources(rng, S, kinds), mode=mode)
    # A source changed after the write: verify reports REAL_KV for the changed slots only.
    srcs = _sources(rng, S, "pt")
    changed = [(a.copy(), ps, nb, rb) for a, ps, nb, rb in srcs]
    changed[0][0][1, 0, 5] ^= 1  # slot 4's first K byte... page 1, token 0
    changed[1][0][9, 3] += 1  # slot 9's V
    case = CanaryCase(name="real_kv_flip_detected", num_slots=S, sources=changed, mode=RealKVMode.ALL,
                      launches=[Launch("verify", {})], seed=99, expect=[(4, F.REAL_KV), (9, F.REAL_KV)])
    cases.append(_real_kv_flip(case, srcs))
    # Mode PARTIAL hashes the first 16 bytes of each token only: a byte flipped at offset 15 of a token is seen, one
    # at offset 16 is not. Mode ALL hashes read_bytes: it sees both, but not a flip past read_bytes. Sources: 'p'
    # (32 B per token, reads 32) and 't' (64 B per token, reads 48). Flips: (source, slot, byte of the token).
    srcs = _sources(rng, S, "pt")
    flips = [(0, 5, 15), (0, 6, 16), (1, 9, 3), (1, 11, 40), (1, 12, 50)]
    for mode, seen in ((RealKVMode.PARTIAL, (5, 9)), (RealKVMode.ALL, (5, 6, 9, 11))):
        case = CanaryCase(name=f"real_kv_{mode.name.lower()}_byte_flips", num_slots=S, sources=_flip(srcs, flips),
                          mode=mode, launches=[], seed=100 + int(mode), expect=[(slot, F.REAL_KV) for slot in seen])
        cases.append(_real_kv_flip(case, srcs))
    # All-zero KV bytes fold to 1, never to the 0 of a never-written record. Records start zeroed (never
    # written); every source's bytes of slots 2, 5 (then written) and 7, 11 (never written) are zero. One request
    # writes slots 1-5 (positions 0-4, tokens 100-104) and verifies them clean (2 and 5 stored the fold 1); then
    # a prefix hit on never-written slots: 7 continuing the chain (position 5 after slot 5, token 105), 11 and 9
    # (9's bytes are not zero) with nothing but REAL_KV to see them (position 0, prev_slot 0, no token), and 2, 5
    # again (clean). Fail reasons by hand, in entry order: 7 CHAIN | POSITION | VERIFY_TOKEN | REAL_KV, 11 REAL_KV
    # (missed when zero bytes folded to 0), 9 REAL_KV.
    srcs = _zero_slots(_sources(rng, S, "ptw"), (2, 5, 7, 11))
    for mode in (RealKVMode.PARTIAL, RealKVMode.ALL):
        launches = chain_then_verify(_a(1, 2, 3, 4, 5))
        launches.append(verify_launch(_a(7, 11, 9, 2, 5), _a(105, -1, -1, 101, 104), _a(5, 0, 0, 1, 4),
                                      _a(5, 0, 0, 1, 4)))
        add(f"real_kv_zero_bytes_{mode.name.lower()}", launches, sources=srcs, mode=mode,
            records=np.zeros((S, 4), np.int64),
            expect=[(7, F.CHAIN | F.POSITION | F.VERIFY_TOKEN | F.REAL_KV), (11, F.REAL_KV), (9, F.REAL_KV)])
    return cases


def scan_cases(add) -> None:
    """The write scan's boundaries (docs/records.md 8): one-token requests, many requests per tile, requests
    crossing tiles and split into segments (blocks), skipped and out-of-range slots inside runs, SKIP_SEED rows
    between runs, a position jump before a segment boundary, a seed that is no chain value. Each write is
    followed by a verify of what it wrote (clean except where a case says)."""
    rng = np.random.default_rng(77)
    S = 64
    # Twelve one-token requests in one tile, seeds from the anchor, from slots, from out of range.
    slots = _a(*range(1, 13))
    seeds = _a(-1, 20, -1, 21, S, -1, 22, -2, 23, -1, -1, 24)
    add("scan_one_token_requests", [
        write_launch(np.arange(13), seeds, slots, slots + 100, np.full(12, 5)),
        verify_launch(slots, slots + 100, np.full(12, 5), np.where(seeds >= S, -1, seeds))],
        num_slots=S, records=np.tile(_a(7, 4, 0, 0), (S, 1)) | np.array([0, 0, 1 << 62, 0]))
    # Many short requests in one tile, SKIP_SEED rows (stale slots, garbage) between them.
    lens = [3, 2, 1, 4, 2, 5, 1, 3]
    skip = [False, True, False, False, True, False, True, False]
    offs = np.concatenate([[0], np.cumsum(lens)])
    loc = rng.permutation(np.arange(1, S))[: offs[-1]]
    pos = np.concatenate([np.arange(n) for n in lens])
    ids = rng.integers(0, 1000, size=loc.size)
    seeds = np.where(skip, I64_MIN, -1)
    keep = np.repeat(~np.array(skip), lens)
    prev = np.where(pos == 0, -1, np.roll(loc, 1))
    add("scan_many_requests_skip_seed_between", [
        write_launch(offs, seeds, loc, ids, pos),
        verify_launch(loc[keep], ids[keep], pos[keep], prev[keep])], num_slots=S)
    # Long runs: 1,100 and 300 entries (split into segments of several tiles under the simulator's 32 threads and
    # into 2+ segments on a GPU), with skipped (-1) and out-of-range slots inside the runs, a position jump
    # (reported once, by the chain-position check, at the entry after it) and a request of 1 between them.
    n1, n2 = 1100, 300
    S2 = 2000
    perm = rng.permutation(np.arange(1, S2))
    loc1, loc2 = perm[:n1].copy(), perm[n1 : n1 + n2].copy()
    loc1[[0, 31, 32, 63, 64, 500, 1099]] = -1
    loc1[[33, 700]] = S2 + 3
    loc2[[5, 299]] = -1
    one = perm[n1 + n2 : n1 + n2 + 1]
    pos1 = np.arange(n1) + 40
    pos1[640:] += 7
    loc = np.concatenate([loc1, one, loc2])
    pos = np.concatenate([pos1, [0], np.arange(n2)])
    ids = rng.integers(-5, 1 << 40, size=loc.size)
    offs = [0, n1, n1 + 1, n1 + 1 + n2]
    seed = int(perm[-1])
    records = np.zeros((S2, 4), np.int64)
    records[seed] = [9, 39, ANCHOR_LINK, 0]  # a chained predecessor at position 39
    ok = (loc > 0) & (loc < S2)
    vslots = loc[ok]
    owner = np.repeat(np.arange(3), np.diff(offs))[ok]
    vprev = np.concatenate([[seed], vslots[:-1]])
    vprev[np.flatnonzero(np.diff(owner)) + 1] = -1
    vprev[np.flatnonzero(owner == 2)[0]] = -1
    add("scan_long_runs_split_into_segments", [
        write_launch(offs, [seed, -1, -1], loc, ids, pos),
        verify_launch(vslots, ids[ok], pos[ok], vprev)], num_slots=S2, records=records, ring_capacity=16)
    # A seed whose prev_hash is no chain value (a never-written record): the request stores NOT_A_LINK (0)
    # throughout, and its verify passes the chain check (it was chained to that seed) but sees the positions.
    add("scan_seed_not_a_link", [
        write_launch([0, 40], [3], _a(*range(10, 50)), np.arange(40), np.arange(1, 41)),
        verify_launch(_a(*range(10, 50)), np.arange(40), np.arange(1, 41), _a(3, *range(10, 49)))],
        num_slots=S, records=np.zeros((S, 4), np.int64))


def _zero_slots(sources: list, slots: tuple[int, ...]) -> list:
    """``sources`` with every byte of the given slots' tokens set to 0, in place (row strides kept)."""
    for arr, ps, nb, _ in sources:
        row_bytes = arr.view(np.uint8).reshape(arr.shape[0], -1)
        assert np.shares_memory(row_bytes, arr)
        for slot in slots:
            row_bytes[slot // ps, (slot % ps) * nb : (slot % ps + 1) * nb] = 0
    return sources


def _flip(sources: list, flips: list[tuple[int, int, int]]) -> list:
    """Copies of ``sources`` with bit 0 of one byte flipped per ``(source index, slot, byte offset in the token)``."""
    out = [(np.ascontiguousarray(a).copy(), ps, nb, rb) for a, ps, nb, rb in sources]
    for k, slot, byte in flips:
        arr, ps, nb, _ = out[k]
        assert 0 <= byte < nb
        row_bytes = arr.view(np.uint8).reshape(arr.shape[0], -1)  # a view: the flip lands in ``arr``
        row_bytes[slot // ps, (slot % ps) * nb + byte] ^= 1
    return out


def _real_kv_flip(case: CanaryCase, written_sources: list) -> CanaryCase:
    """Records as a write over ``written_sources`` would leave them, then a verify over changed sources."""
    from canary.contract.realkv import fold

    kv = real_kv(written_sources, case.mode)
    slots = np.arange(1, case.num_slots, dtype=np.int64)
    records = np.zeros((case.num_slots, 4), dtype=np.int64)
    records[:, 1] = np.arange(case.num_slots)
    records[1:, 3] = fold(kv, slots)
    case.records = records
    case.launches = [verify_launch(slots, np.full(slots.size, -1), slots, np.zeros(slots.size))]
    return case


TOKEN_ARRAYS = ("out_cache_loc", "input_ids", "positions", "expected_input_ids", "expected_positions")
_I32 = np.iinfo(np.int32)


def with_widths(case: CanaryCase, seed: int, *, all32: bool = False) -> CanaryCase:
    """``case`` with each write launch's token arrays (SPEC 2 (*)) int32 or int64, drawn independently per array
    and launch (``all32``: int32 wherever the values fit); an array whose values do not fit int32 stays int64. The
    records written must be byte-identical to ``case``'s."""
    rng = np.random.default_rng(seed)
    launches = []
    for launch in case.launches:
        args = dict(launch.args)
        if launch.kind == "write":
            for name in TOKEN_ARRAYS:
                a = args.get(name)
                fits = a is not None and (a.size == 0 or (a.min() >= _I32.min and a.max() <= _I32.max))
                if fits and (all32 or rng.random() < 0.5):
                    args[name] = a.astype(np.int32)
        launches.append(Launch(launch.kind, args))
    return replace(case, name=f"{case.name}_w{seed}", launches=launches)


def int32_edge_case() -> CanaryCase:
    """Token arrays at int32's edges (negative slots and tokens, INT32_MIN / INT32_MAX positions and ids): run as
    int64 and through :func:`with_widths` (``all32``), the same ring rows and records."""
    lo, hi = int(_I32.min), int(_I32.max)
    w = write_launch([0, 3, 6], [-1, -1], [1, -1, 2, 3, lo, 4], [hi, lo, -1, 5, 7, -2], [0, 1, 2, hi - 1, hi, lo],
                     exp_ids=[hi, -1, lo, 5, 0, -2], exp_pos=[0, -1, 3, hi - 1, -1, lo])
    return CanaryCase(name="int32_edges", num_slots=6, launches=[w, verify_launch([1, 2, 3, 4], [hi, -1, 5, -2],
                                                                              [0, 2, hi - 1, lo], [-1, 1, -1, 3])],
                      ring_capacity=64, check_flags=3)


def random_case(seed: int, *, max_slots: int = 40, max_entries: int = 80) -> CanaryCase:
    """A random sequence of write and verify launches, garbage included, free of the documented races."""
    rng = np.random.default_rng(seed)
    num_slots = int(rng.integers(1, max_slots))
    kinds = "".join(rng.choice(list("ptw"), size=int(rng.integers(0, 5))))
    case = CanaryCase(
        name=f"random_{seed}", num_slots=num_slots, launches=[], seed=seed,
        slot_stride_bytes=int(rng.choice([32, 40, 64])), ring_capacity=int(rng.choice([0, 3, 16, 256])),
        ring_row_stride=int(rng.choice([8, 8, 9])), check_flags=int(rng.integers(0, 4)),
        write_index=int(rng.choice([0, 0, 0, 5, -2])), sources=_sources(rng, num_slots, kinds),
        mode=RealKVMode(int(rng.integers(0, 3))),
    )
    if rng.random() < 0.3:
        case.records = rng.integers(-2, 6, size=(num_slots, 4))
    if rng.random() < 0.3:
        case.reported = rng.integers(0, 4, size=num_slots).astype(np.uint8)
    case.padding_slot = int(rng.choice([0, -1]))  # SPEC 4: whether slot 0 is real
    written: list[int] = []
    for _ in range(int(rng.integers(1, 5))):
        if rng.random() < 0.55:
            case.launches.append(_random_write(rng, num_slots, max_entries))
            written += case.launches[-1].args["out_cache_loc"].tolist()
        else:
            case.launches.append(_random_verify(rng, num_slots, written, max_entries))
    return case


def _random_write(rng, num_slots: int, max_entries: int) -> Launch:
    r_cap = int(rng.integers(0, 6))
    owners = rng.integers(0, max(r_cap, 1), size=num_slots)  # disjoint slot sets per request
    unowned = rng.random(num_slots) < 0.2  # slots nobody writes: safe seeds for anyone
    counts = rng.integers(0, max_entries // max(r_cap, 1) + 1, size=r_cap)
    loc, ids, pos, seeds = [], [], [], []
    for r in range(r_cap):
        mine = np.flatnonzero((owners == r) & ~unowned)
        n = int(counts[r])
        # No slot twice in one request, and no seed among the request's own new slots: a request's segments
        # may run in different blocks, which race on those (docs/records.md 6).
        s = np.full(n, -1)
        take = min(n, mine.size)
        s[rng.permutation(n)[:take]] = rng.choice(mine, size=take, replace=False)
        s = np.where(rng.random(n) < 0.1, rng.choice([-1, -3, num_slots, num_slots + 5], size=n), s)
        p0 = int(rng.integers(-1, 4))
        p = np.arange(p0, p0 + n)
        p = np.where(rng.random(n) < 0.1, rng.integers(-2, 9, size=n), p)
        loc.append(s)
        ids.append(rng.integers(-2, 50, size=n))
        pos.append(p)
        seed_pool = np.concatenate([np.setdiff1d(mine, s), np.flatnonzero(unowned), [-1, -1, -2, num_slots, I64_MIN]])
        seeds.append(int(rng.choice(seed_pool)))
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    loc_a = np.concatenate(loc) if loc else np.zeros(0, np.int64)
    n_all = loc_a.size
    if rng.random() < 0.3 and r_cap:
        # Garbage offsets that keep request ranges disjoint (overlapping ranges would race): a first start below
        # 0 and a last end past N (both clamped), or a reversed (empty) first or last request.
        offsets[0] -= int(rng.integers(0, 3))
        offsets[-1] += int(rng.integers(0, 3))
        if rng.random() < 0.3:
            offsets[0] = offsets[1] + 1
        elif rng.random() < 0.3:
            offsets[-1] = offsets[-2] - 1
    ids_a = np.concatenate(ids) if ids else np.zeros(0, np.int64)
    pos_a = np.concatenate(pos) if pos else np.zeros(0, np.int64)
    nreq = int(rng.choice([r_cap, r_cap, r_cap, -1, r_cap + 1, max(r_cap - 1, 0)]))
    exp_ids = exp_pos = None
    if rng.random() < 0.6:
        exp_ids = np.where(rng.random(n_all) < 0.3, -1, np.where(rng.random(n_all) < 0.15, ids_a + 1, ids_a))
    if rng.random() < 0.6:
        exp_pos = np.where(rng.random(n_all) < 0.3, -1, np.where(rng.random(n_all) < 0.15, pos_a + 1, pos_a))
    return write_launch(offsets, seeds, loc_a, ids_a, pos_a, nreq=nreq, exp_ids=exp_ids, exp_pos=exp_pos,
                        tag=int(rng.integers(0, 1000)))


def _random_verify(rng, num_slots: int, written: list[int], max_entries: int) -> Launch:
    cap = int(rng.integers(0, max_entries))
    pool = np.array(written + [0, 1, num_slots - 1], dtype=np.int64)
    slots = np.where(rng.random(cap) < 0.8, rng.choice(pool, size=cap), rng.integers(-2, num_slots + 2, size=cap))
    prev = np.where(rng.random(cap) < 0.6, np.roll(slots, 1),
                    rng.choice([-1, 0, -2, num_slots, 1, MISSING_SLOT], size=cap))
    toks = np.where(rng.random(cap) < 0.3, -1, rng.integers(-2, 50, size=cap))
    pos = rng.integers(-1, 9, size=cap)
    return verify_launch(slots, toks, pos, prev, num_valid=int(rng.choice([cap, cap, -1, cap + 3, cap // 2])),
                         enable=int(rng.choice([1, 1, 1, 0])), tag=int(rng.integers(0, 1000)))


# ----------------------------------------------------------------------------------------------------------------
# Scatter


@dataclass
class ScatterCase:
    name: str
    pool_shape: tuple[int, int]
    pool_row_stride: int
    req_pool_indices: np.ndarray
    tokens: np.ndarray
    token_offsets: np.ndarray
    column_starts: np.ndarray
    column_offset: int = 0

    def __repr__(self) -> str:
        return f"ScatterCase({self.name})"


def scatter_cases() -> list[ScatterCase]:
    out = [
        ScatterCase("basic", (6, 10), 10, _a(1, 3, 0, 5), _a(1, 2, 3, 4, 5, 6, 7), _a(0, 2, 5, 6, 7), _a(0, 4, 0, 8)),
        ScatterCase("padded_stride_and_offset", (5, 7), 9, _a(2, 4), _a(9, 8, 7, 6), _a(0, 3, 4), _a(1, -1), 2),
        ScatterCase("columns_clipped", (4, 5), 5, _a(1, 2, 3), _a(1, 2, 3, 4, 5, 6, 7, 8, 9), _a(0, 3, 6, 9),
                    _a(-2, 3, I64_MAX - 1), 1),
        ScatterCase("bad_rows_and_offsets", (4, 8), 8, _a(-1, 4, 9, 2, 1), _a(5, 6, 7), _a(-3, 1, 2, 9, 1, 2),
                    _a(0, 0, 0, 0, 2)),
        ScatterCase("tokens_int32_and_wide_values", (3, 4), 4, _a(1, 2), np.array([7, -8, 2**31 - 1, 3], np.int32),
                    _a(0, 2, 4), _a(0, 1)),
        ScatterCase("tokens_low_32_bits", (3, 4), 4, _a(1,), _a(2**40 + 5, -(2**33) - 1), _a(0, 2), _a(1,)),
        ScatterCase("empty_batch", (3, 4), 4, np.zeros(0, np.int64), np.zeros(0, np.int64), _a(0), np.zeros(0, np.int64)),
        ScatterCase("long_row", (3, 700), 700, _a(2,), np.arange(650, dtype=np.int64), _a(0, 650), _a(20,), 3),
    ]
    return out


def random_scatter_case(seed: int) -> ScatterCase:
    """Random rows with distinct pool rows (two batch rows on one cell race on a GPU: docs/canary.md 6.4)."""
    rng = np.random.default_rng(seed)
    rows, cols = int(rng.integers(1, 9)), int(rng.integers(1, 40))
    bs = int(rng.integers(0, rows + 2))
    rpi = np.where(rng.random(bs) < 0.8, rng.permutation(np.arange(bs)) + 1, rng.choice([0, -1, rows], size=bs))
    lens = rng.integers(0, cols + 3, size=bs)
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    tokens = rng.integers(-(2**40), 2**40, size=int(offsets[-1])).astype(rng.choice([np.int64, np.int32]))
    if rng.random() < 0.2 and bs:
        offsets = offsets + rng.integers(-2, 3, size=offsets.size)
    starts = rng.integers(-3, cols, size=bs)
    return ScatterCase(f"random_scatter_{seed}", (rows, cols), cols + int(rng.integers(0, 3)), rpi.astype(np.int64),
                       tokens, offsets, starts.astype(np.int64), int(rng.integers(-2, 3)))


def run_scatter(case: ScatterCase, backend: str, place: Callable, to_host: Callable, stream=None) -> np.ndarray:
    """The whole pool storage (row padding included: it must stay poisoned) after one scatter."""
    rows, cols = case.pool_shape
    storage = np.full((rows, case.pool_row_stride), -777, dtype=np.int32)
    dev = place(storage)
    scatter_expected_tokens(req_to_verify_expected_tokens=dev[:, :cols], req_pool_indices=place(case.req_pool_indices),
                            tokens=place(case.tokens), token_offsets=place(case.token_offsets),
                            column_starts=place(case.column_starts), column_offset=case.column_offset,
                            backend=backend, stream=stream)
    return to_host(dev)
