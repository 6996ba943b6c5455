"""Cases for records that move (SPEC 4.1): the reference against its twins, byte for byte.

A :class:`MoveCase` is a canary (poisoned records, bytes past 32 of a slot included), an optional poisoned layer
table, a poisoned scratch and status word, and a sequence of operations: ``("gather", slots, rows, pad)`` into a
poisoned buffer of ``rows`` rows (``pad`` extra columns of row stride), ``("scatter", slots, src)`` and
``("copy", src_slots, dst_slots)``. :func:`run_case` runs it on a backend and returns every output; :func:`assert_twin`
compares two runs. Destination lists hold no in-range slot twice (SPEC 4.1: a caller error whose GPU result is
undefined); source lists may.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from canary import CanaryRecords, CanaryState, MISSING_SLOT, RecordMover
from canary.interop.hostcopy import to_host
from canary.records.layers import CanaryLayers, LayerTable

NB = 16  # bytes per token of the layer sources (their content is never read by the move kernels)
STATUS0 = (8, 3)  # a poisoned start: the word is sticky, so every later bit ORs into it and the count adds to 3


@dataclass
class MoveCase:
    name: str
    num_slots: int
    stride: int  # slot_stride_bytes
    num_layers: int  # 0: no layer table
    capacity: int  # copy_capacity
    seed: int
    ops: list = field(default_factory=list)

    def __repr__(self) -> str:
        return self.name

    @property
    def words(self) -> int:
        return 4 + self.num_layers


@dataclass
class Run:
    canary: np.ndarray
    layer_hashes: np.ndarray | None
    cursor: np.ndarray | None
    status: np.ndarray
    scratch: np.ndarray
    outs: list  # each gather's whole buffer, after it


def _slots(values, dtype) -> np.ndarray:
    return np.asarray(values, dtype=np.int64).astype(dtype)


def run_case(case: MoveCase, backend: str, place, launch_config=None, slot_dtype=None) -> Run:
    """Run ``case`` on ``backend`` with arrays made by ``place`` (``np.array`` copies for host backends);
    ``slot_dtype``: every list's width (``None``: each op's own)."""
    from canary.backends.args import DEFAULT_LAUNCH

    rng = np.random.default_rng(case.seed)
    state = CanaryState(canary_buffer=place(rng.integers(0, 256, (case.num_slots, case.stride), dtype=np.uint8)),
                        ring=place(np.zeros((4, 8), dtype=np.int64)), ring_write_index=place(np.zeros(1, np.int32)),
                        slot_run_counter=place(np.zeros(2, np.int64)), kernel_run_counter=place(np.zeros(2, np.int64)),
                        check_flags=place(np.array([3], dtype=np.int32)))
    records = CanaryRecords(state, None, backend=backend)
    layers = table = None
    if case.num_layers:
        kv = place(rng.integers(0, 256, (case.num_layers, case.num_slots, NB), dtype=np.uint8))
        table = LayerTable(layer_hashes=place(rng.integers(-2**63, 2**63, (case.num_slots, case.num_layers),
                                                           dtype=np.int64)),
                           layer_cursor=place(np.array([1, 0], dtype=np.int32)))
        layers = CanaryLayers(records, [[(kv[i], 1, NB)] for i in range(case.num_layers)], table=table,
                              backend=backend)
    scratch = place(rng.integers(-2**63, 2**63, (case.capacity, case.words), dtype=np.int64))
    status = place(np.array(STATUS0, dtype=np.int64))
    mover = RecordMover(records, layers, scratch=scratch, status=status, backend=backend,
                        launch_config=launch_config or DEFAULT_LAUNCH)
    mover.warmup()
    outs = []
    for op in case.ops:
        kind, a, b = op[0], op[1], op[2]
        dtype = slot_dtype or (op[4] if len(op) > 4 else np.int64)
        if kind == "gather":
            pad = op[3]
            out = place(rng.integers(-2**63, 2**63, (b, case.words + pad), dtype=np.int64))
            mover.gather(place(_slots(a, dtype)), out[:, :case.words])
            outs.append(np.asarray(to_host(out)).copy())
        elif kind == "scatter":
            mover.scatter(place(_slots(a, dtype)), place(np.asarray(b, dtype=np.int64)))
        else:
            mover.copy(place(_slots(a, dtype)), place(_slots(b, dtype)))
    return Run(np.asarray(to_host(state.canary_buffer)).copy(),
               None if table is None else np.asarray(to_host(table.layer_hashes)).copy(),
               None if table is None else np.asarray(to_host(table.layer_cursor)).copy(),
               np.asarray(to_host(status)).copy(), np.asarray(to_host(scratch)).copy(), outs)


def assert_twin(case: MoveCase, got: Run, want: Run) -> None:
    assert got.canary.tobytes() == want.canary.tobytes(), f"{case}: canary buffers differ"
    if want.layer_hashes is not None:
        assert got.layer_hashes.tobytes() == want.layer_hashes.tobytes(), f"{case}: layer tables differ"
        assert got.cursor.tolist() == want.cursor.tolist(), f"{case}: the layer cursor moved"
    assert got.status.tolist() == want.status.tolist(), f"{case}: status {got.status} != {want.status}"
    assert got.scratch.tobytes() == want.scratch.tobytes(), f"{case}: scratch differs"
    assert len(got.outs) == len(want.outs)
    for k, (g, w) in enumerate(zip(got.outs, want.outs)):
        assert g.tobytes() == w.tobytes(), f"{case}: gather {k}'s buffer differs"


def _rows(rng, n: int, words: int) -> np.ndarray:
    return rng.integers(-2**63, 2**63, (n, words), dtype=np.int64)


def hand_cases() -> list[MoveCase]:
    rng = np.random.default_rng(7)
    out = []

    def case(name, num_slots=12, stride=32, num_layers=0, capacity=8):
        c = MoveCase(name, num_slots, stride, num_layers, capacity, len(out) + 100)
        out.append(c)
        return c

    c = case("empty_lists")
    c.ops += [("gather", [], 3, 0), ("scatter", [], _rows(rng, 0, 4)), ("copy", [], [])]
    c = case("empty_lists_layers", num_layers=2)
    c.ops += [("gather", [], 0, 0), ("scatter", [], _rows(rng, 2, 6)), ("copy", [], [])]
    c = case("one_slot")
    c.ops += [("gather", [5], 1, 0), ("scatter", [7], _rows(rng, 1, 4)), ("copy", [3], [9])]
    c = case("one_slot_layers", num_layers=3)
    c.ops += [("gather", [5], 2, 1), ("scatter", [7], _rows(rng, 1, 7)), ("copy", [3], [9])]
    c = case("negative_slots")  # padding: a zero row gathered, nothing stored
    c.ops += [("gather", [-1, 2, -2**31, MISSING_SLOT, -2**63], 6, 0), ("scatter", [-1, 4, -7], _rows(rng, 3, 4)),
              ("copy", [-1, 3, 6], [5, -1, 8])]
    c = case("negative_slots_int32")
    c.ops += [("gather", [-1, 2, -2**31], 3, 0, np.int32), ("scatter", [-1, 4], _rows(rng, 2, 4), 0, np.int32),
              ("copy", [-1, 3], [5, -2**31], 0, np.int32)]
    c = case("out_of_range_by_one", num_layers=1)  # num_slots: refused, counted once per list
    c.ops += [("gather", [12, 11, 0, 12], 4, 0), ("scatter", [12, 0, 11], _rows(rng, 3, 5)),
              ("copy", [12, 1, 2], [3, 12, 13])]
    c = case("out_of_range_int32", num_slots=5)
    c.ops += [("gather", [5, 2**31 - 1, 4], 3, 0, np.int32), ("scatter", [5, 4], _rows(rng, 2, 4), 0, np.int32),
              ("copy", [2**31 - 1, 0], [1, 5], 0, np.int32)]
    c = case("int64_huge")
    c.ops += [("gather", [2**62, 2**63 - 1, 3], 3, 0), ("scatter", [2**40, 3], _rows(rng, 2, 4)),
              ("copy", [2**62], [3])]
    c = case("copy_chain")  # a -> b, b -> c: b's old row lands in c
    c.ops += [("copy", [1, 2], [2, 3]), ("copy", [4, 5, 6], [5, 6, 7]), ("gather", [1, 2, 3, 4, 5, 6, 7], 7, 0)]
    c = case("copy_chain_layers", num_layers=2)
    c.ops += [("copy", [1, 2, 3], [2, 3, 4]), ("gather", [1, 2, 3, 4], 4, 0)]
    c = case("copy_cycle")  # a permutation: every row moves one place round
    c.ops += [("copy", [1, 2, 3, 4], [2, 3, 4, 1]), ("copy", [8, 9], [9, 8])]
    c = case("copy_self_and_fork", num_layers=1)  # a -> a; a forked into two slots
    c.ops += [("copy", [3, 5, 5], [3, 6, 7])]
    c = case("copy_full_capacity", capacity=4)
    c.ops += [("copy", [0, 1, 2, 3], [4, 5, 6, 7])]
    c = case("copy_zero_capacity", capacity=0)
    c.ops += [("copy", [], [])]
    c = case("wide_slots", stride=48, num_layers=2)  # bytes past 32 of each slot are the engine's: untouched
    c.ops += [("scatter", [1, 2, 11], _rows(rng, 3, 6)), ("copy", [1, 2], [3, 4]), ("gather", [3, 4, 11], 5, 3)]
    c = case("slot_zero")  # slot 0 moves like any slot
    c.ops += [("gather", [0], 1, 0), ("scatter", [0], _rows(rng, 1, 4)), ("copy", [0], [1])]
    c = case("many_entries", num_slots=70, num_layers=3, capacity=80)  # several blocks and grid-stride rounds
    perm = np.random.default_rng(3).permutation(70)
    c.ops += [("copy", list(range(70)), perm.tolist()), ("gather", list(perm[::-1]) + [-1, 70], 75, 2),
              ("scatter", perm[:40].tolist(), _rows(rng, 40, 7))]
    c = case("buffer_longer_than_list", num_layers=1)
    c.ops += [("gather", [1, 2], 9, 4), ("scatter", [3], _rows(rng, 6, 5))]
    c = case("one_slot_pool", num_slots=1)
    c.ops += [("gather", [0, 1, -1], 3, 0), ("scatter", [0, 1], _rows(rng, 2, 4)), ("copy", [0, 1], [0, -1])]
    return out


def _dests(rng, num_slots: int, n: int) -> list:
    """``n`` destinations: distinct in-range slots, padding, out-of-range ones (which may repeat)."""
    picks = list(rng.permutation(num_slots)[:n])
    outs = []
    for k in range(n):
        r = rng.random()
        if r < 0.1:
            outs.append(-int(rng.integers(1, 4)))
        elif r < 0.2:
            outs.append(num_slots + int(rng.integers(0, 3)))
        elif k < len(picks):
            outs.append(int(picks[k]))
        else:
            outs.append(-1)
    return outs


def random_case(seed: int) -> MoveCase:
    rng = np.random.default_rng(seed)
    num_slots = int(rng.integers(1, 40))
    case = MoveCase(f"random_{seed}", num_slots, int(rng.choice([32, 40, 64])), int(rng.choice([0, 0, 1, 3])),
                    int(rng.integers(0, 24)), seed + 1)
    for _ in range(int(rng.integers(1, 6))):
        dtype = np.int32 if rng.random() < 0.3 else np.int64
        r = rng.random()
        if r < 0.35:
            n = int(rng.integers(0, 20))
            slots = rng.integers(-3, num_slots + 3, n).tolist()
            case.ops.append(("gather", slots, n + int(rng.integers(0, 3)), int(rng.integers(0, 3)), dtype))
        elif r < 0.65:
            n = int(rng.integers(0, 20))
            case.ops.append(("scatter", _dests(rng, num_slots, n),
                             _rows(rng, n + int(rng.integers(0, 3)), case.words), 0, dtype))
        else:
            n = int(rng.integers(0, case.capacity + 1))
            case.ops.append(("copy", rng.integers(-3, num_slots + 3, n).tolist(), _dests(rng, num_slots, n), 0,
                             dtype))
    return case
