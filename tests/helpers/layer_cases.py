"""Cases for the layer rotation's kernels (docs/records.md 10): the reference against its twins, byte for byte.

A :class:`LayerCase` is a canary (poisoned records), per-layer sources (stacked ``[L, rows, stride]`` arrays or
one allocation per layer), a poisoned side table and cursor, and a sequence of launches: ``write`` (a write plan
and ``out_cache_loc``), ``verify`` (a verify plan and launch tag) and ``flip`` (a byte of one layer changed on the
host between launches). :func:`run_case` runs it on a backend and returns every output: the table, the cursor,
the counters, the canary buffer and each launch's ring rows; :func:`assert_twin` compares two runs (ring rows as a
multiset: GPU order is decided by atomics).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from canary import CanaryRecords, CanaryState, VerifyPlan, WritePlan
from canary.interop.hostcopy import to_host
from canary.contract.plans import MISSING_SLOT, SKIP_SEED
from canary.records.layers import CanaryLayers, LayerTable

RING = 512


@dataclass
class LayerCase:
    name: str
    num_slots: int
    num_layers: int
    num_sources: int
    page_size: int
    nbpt: int
    read_bytes: int
    row_stride: int
    stacked: bool
    mode: str
    dwell: int
    cursor: tuple[int, int]
    seed: int
    launches: list = field(default_factory=list)  # ("write", offsets, seeds, nvalid, loc) / ("verify", ...) / ("flip", ...)
    reported: np.ndarray | None = None  # [num_slots] uint8 reported_slots (SPEC 4); None: not given
    padding_slot: int = 0  # the records' (SPEC 4): -1 makes verify_layer fold slot 0 like any slot

    def __repr__(self) -> str:
        return self.name

    @property
    def rows(self) -> int:
        return -(-self.num_slots // self.page_size)


def layer_bytes(case: LayerCase) -> list[np.ndarray]:
    """Per source: a ``[L, rows, row_stride]`` uint8 array of random bytes (the padding past a row poisoned too)."""
    rng = np.random.default_rng(case.seed)
    return [rng.integers(0, 256, (case.num_layers, case.rows, case.row_stride), dtype=np.uint8)
            for _ in range(case.num_sources)]


def _sources(case: LayerCase, arrays: list, place) -> tuple[list, list]:
    """Device copies and the per-layer source lists (stacked: views into one array per source)."""
    row_bytes = case.page_size * case.nbpt
    if case.stacked:
        dev = [place(a) for a in arrays]
        per_layer = [[(d[lay][:, :row_bytes], case.page_size, case.nbpt, case.read_bytes) for d in dev]
                     for lay in range(case.num_layers)]
        return dev, per_layer
    dev = [[place(np.ascontiguousarray(a[lay])) for lay in range(case.num_layers)] for a in arrays]
    per_layer = [[(dev[k][lay][:, :row_bytes], case.page_size, case.nbpt, case.read_bytes)
                  for k in range(case.num_sources)] for lay in range(case.num_layers)]
    return dev, per_layer


def _flip(case: LayerCase, dev: list, k: int, lay: int, row: int, col: int) -> None:
    target = dev[k][lay]  # stacked: a view into source k's [L, rows, stride] array; else layer lay's own array
    target[row, col] = int(to_host(target[row, col:col + 1])[0]) ^ 0x40


@dataclass
class Run:
    layer_hashes: np.ndarray
    cursor: np.ndarray
    slot_runs: np.ndarray
    kernel_runs: np.ndarray
    canary: np.ndarray
    rows: list  # per ring-writing launch: sorted ring rows


def run_case(case: LayerCase, backend: str, place, launch_config=None, loc_dtype=np.int64) -> Run:
    """Run ``case`` on ``backend`` with arrays made by ``place`` (``np.array`` copies for host backends);
    ``loc_dtype``: the writes' out_cache_loc width (int32 or int64, SPEC 2 (*): the same run either way)."""
    from canary.backends.args import DEFAULT_LAUNCH

    rng = np.random.default_rng(case.seed + 1)
    arrays = layer_bytes(case)
    dev, per_layer = _sources(case, arrays, place)
    state = CanaryState(canary_buffer=place(rng.integers(0, 256, (case.num_slots, 32), dtype=np.uint8)),
                        ring=place(np.zeros((RING, 8), dtype=np.int64)),
                        ring_write_index=place(np.zeros(1, dtype=np.int32)),
                        slot_run_counter=place(np.array([5, 7], dtype=np.int64)),
                        kernel_run_counter=place(np.array([11, 13], dtype=np.int64)),
                        check_flags=place(np.array([3], dtype=np.int32)),
                        reported_slots=None if case.reported is None else place(case.reported))
    table = LayerTable(layer_hashes=place(rng.integers(-2**63, 2**63, (case.num_slots, case.num_layers),
                                                       dtype=np.int64)),
                       layer_cursor=place(np.array(case.cursor, dtype=np.int32)))
    records = CanaryRecords(state, None, backend=backend, padding_slot=case.padding_slot)
    layers = CanaryLayers(records, per_layer, mode=case.mode, table=table, dwell=case.dwell, backend=backend,
                          launch_config=launch_config or DEFAULT_LAUNCH)
    layers.warmup()
    rows = []
    for launch in case.launches:
        kind = launch[0]
        if kind == "flip":
            _flip(case, dev, *launch[1:])
            continue
        before = int(to_host(state.ring_write_index)[0])
        if kind == "write":
            _, offsets, seeds, nvalid, loc = launch
            wp = WritePlan(write_offsets=place(offsets), write_seed_slot_indices=place(seeds),
                           write_num_valid_reqs=place(np.array([nvalid], dtype=np.int32)))
            layers.write(wp, out_cache_loc=place(np.asarray(loc).astype(loc_dtype)))
        else:
            _, slots, toks, poss, nvalid, enable, tag = launch
            cap = slots.shape[0]
            vp = VerifyPlan(verify_slot_indices=place(slots), verify_expected_tokens=place(toks),
                            verify_expected_positions=place(poss),
                            verify_prev_slot_indices=place(np.zeros(cap, dtype=np.int64)),
                            verify_num_valid=place(np.array([nvalid], dtype=np.int32)),
                            enable=place(np.array([enable], dtype=np.int32)),
                            status=place(np.zeros(1, dtype=np.int32)))
            layers.verify(vp, launch_tag=tag)
        after = int(to_host(state.ring_write_index)[0])
        ring = np.asarray(to_host(state.ring))
        rows.append(sorted(map(tuple, ring[before:after].tolist())))
    return Run(np.asarray(to_host(table.layer_hashes)).copy(), np.asarray(to_host(table.layer_cursor)).copy(),
               np.asarray(to_host(state.slot_run_counter)).copy(), np.asarray(to_host(state.kernel_run_counter)).copy(),
               np.asarray(to_host(state.canary_buffer)).copy(), rows)


def assert_twin(case: LayerCase, got: Run, want: Run) -> None:
    assert got.layer_hashes.tobytes() == want.layer_hashes.tobytes(), f"{case}: layer_hashes differ"
    assert got.cursor.tolist() == want.cursor.tolist(), f"{case}: cursor {got.cursor} != {want.cursor}"
    assert got.slot_runs.tolist() == want.slot_runs.tolist(), f"{case}: slot counters differ"
    assert got.kernel_runs.tolist() == want.kernel_runs.tolist(), f"{case}: launch counters differ"
    assert got.canary.tobytes() == want.canary.tobytes(), f"{case}: the canary buffer changed"
    assert got.rows == want.rows, f"{case}: ring rows differ"


def random_case(seed: int) -> LayerCase:
    rng = np.random.default_rng(seed)
    ps = int(rng.choice([1, 2, 4]))
    nbpt = int(rng.choice([16, 32, 48]))
    mode = "partial" if rng.random() < 0.25 else "all"
    read = nbpt if rng.random() < 0.6 else 16
    num_slots = int(rng.integers(2, 40))
    layers = int(rng.integers(1, 7))
    case = LayerCase(f"random_{seed}", num_slots, layers, int(rng.integers(1, 4)), ps, nbpt, read,
                     ps * nbpt + 16 * int(rng.integers(0, 3)), bool(rng.random() < 0.5), mode,
                     int(rng.integers(1, 4)), (int(rng.integers(-2, layers + 2)), int(rng.integers(-1, 4))), seed)
    if rng.random() < 0.3:
        case.reported = rng.integers(0, 4, size=num_slots).astype(np.uint8)
    case.padding_slot = int(rng.choice([0, -1]))
    for _ in range(int(rng.integers(2, 9))):
        r = rng.random()
        if r < 0.4:
            case.launches.append(random_write(rng, num_slots))
        elif r < 0.8:
            case.launches.append(random_verify(rng, num_slots))
        else:
            case.launches.append(("flip", int(rng.integers(0, case.num_sources)), int(rng.integers(0, layers)),
                                  int(rng.integers(0, case.rows)), int(rng.integers(0, case.row_stride))))
    return case


def random_write(rng, num_slots: int) -> tuple:
    cap = int(rng.integers(1, 5))
    n = int(rng.integers(0, 12))
    if rng.random() < 0.8:
        lens = rng.integers(0, 5, cap)
        offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    else:  # garbage offsets: the kernels' binary search decides, the same everywhere
        offsets = rng.integers(-3, n + 4, cap + 1).astype(np.int64)
    seeds = rng.integers(-1, num_slots, cap).astype(np.int64)
    seeds[rng.random(cap) < 0.2] = SKIP_SEED
    loc = rng.integers(-2, num_slots + 2, n).astype(np.int64)
    nvalid = int(rng.integers(-1, cap + 2))
    return ("write", offsets, seeds, nvalid, loc)


def random_verify(rng, num_slots: int) -> tuple:
    cap = int(rng.integers(1, 14))
    slots = rng.integers(0, num_slots, cap).astype(np.int64)
    odd = rng.random(cap)
    slots[odd < 0.1] = MISSING_SLOT
    slots[(odd >= 0.1) & (odd < 0.15)] = num_slots + int(rng.integers(0, 3))
    slots[(odd >= 0.15) & (odd < 0.2)] = -3
    toks = rng.integers(-1, 100, cap).astype(np.int64)
    poss = rng.integers(0, 100, cap).astype(np.int64)
    nvalid = int(rng.integers(-1, cap + 2))
    enable = int(rng.random() < 0.9)
    return ("verify", slots, toks, poss, nvalid, enable, int(rng.integers(0, 1 << 20)))


def hand_cases() -> list[LayerCase]:
    """Boundaries: one layer, a cursor out of range, dwell, a slot written twice, padding rows, SKIP_SEED."""
    out = []
    base = dict(num_sources=2, page_size=2, nbpt=32, read_bytes=32, row_stride=64, mode="all", dwell=1, seed=3)
    c = LayerCase("one_layer", 9, 1, stacked=True, cursor=(0, 0), **base)
    w = ("write", np.array([0, 3, 5], dtype=np.int64), np.array([-1, 2], dtype=np.int64), 2,
         np.array([1, 2, 2, 8, 0, 4], dtype=np.int64))
    v = ("verify", np.array([1, 2, 8, 0, 4, MISSING_SLOT, 9], dtype=np.int64), np.full(7, -1, dtype=np.int64),
         np.arange(7, dtype=np.int64), 7, 1, 5)
    c.launches = [w, v, ("flip", 1, 0, 4, 3), v, w, v]
    out.append(c)
    # padding_slot=-1: slot 0 (written by w, entry 3 of v) is folded and checked; a flip of its bytes is reported
    c = LayerCase("real0_slot_zero", 9, 2, stacked=True, cursor=(0, 0), padding_slot=-1, **base)
    c.launches = [w, v, ("flip", 0, 1, 0, 1), v, v]
    out.append(c)
    c = LayerCase("five_layers_separate", 9, 5, stacked=False, cursor=(7, 2), **base)  # a corrupt cursor: layer 0
    c.launches = [w, v, ("flip", 0, 4, 1, 0)] + [v, ("write",) + w[1:4] + (np.zeros(0, dtype=np.int64),)] * 6
    out.append(c)
    c = LayerCase("dwell_3_skip_seed", 9, 2, stacked=True, cursor=(1, 1), **{**base, "dwell": 3})
    ws = ("write", np.array([0, 2, 4], dtype=np.int64), np.array([SKIP_SEED, -1], dtype=np.int64), 2,
          np.array([5, 6, 7, 3], dtype=np.int64))
    c.launches = [ws, v, ("flip", 1, 1, 3, 33)] + [v, ws] * 7
    out.append(c)
    c = LayerCase("disabled_and_num_valid_bounds", 9, 3, stacked=True, cursor=(2, 0), **base)
    c.launches = [w, ("verify",) + v[1:4] + (-1, 1, 0), ("verify",) + v[1:4] + (99, 0, 0), ("flip", 0, 2, 0, 2),
                  ("verify",) + v[1:4] + (99, 1, 3)]
    out.append(c)
    return out
