"""Records that move (SPEC 4.1, canary/records/move.py): the reference against a serial oracle on hand and random
cases, argument errors, the CUDA struct layout and NVRTC compile (``sim``), the Numba kernels' sm_90 compile
(``sim``), and the GPU twins (``gpu``). The Numba twin in the simulator is ``move_sim_suite.py``; the round trips
through the planner and verify are ``test_move_roundtrip.py``."""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import move_cases as mc

from canary import CanaryLayers, CanaryRecords, CanaryState, MoveFault, MoveStatus, RecordMover
from canary.backends.sources import cuda_source

ROOT = Path(__file__).resolve().parents[2]


# -- the reference against a serial oracle -------------------------------------------------------------------------

class Oracle:
    """SPEC 4.1 one entry at a time, in Python ints: rows as lists of ``W`` words."""

    def __init__(self, case: mc.MoveCase, run_start: mc.Run):
        self.n = case.num_slots
        words = run_start.canary.reshape(case.num_slots, case.stride)[:, :32].copy().view(np.int64)
        self.table = [list(map(int, words[s])) + ([] if run_start.layer_hashes is None
                                                  else list(map(int, run_start.layer_hashes[s])))
                      for s in range(case.num_slots)]
        self.words = case.words
        self.faults, self.refused = mc.STATUS0

    def row(self, s: int) -> list:
        if 0 <= s < self.n:
            return list(self.table[s])
        if s >= self.n:
            self.faults |= int(MoveFault.SOURCE_RANGE)
            self.refused += 1
        return [0] * self.words

    def store(self, s: int, row: list) -> None:
        if 0 <= s < self.n:
            self.table[s] = list(row)
        elif s >= self.n:
            self.faults |= int(MoveFault.DEST_RANGE)
            self.refused += 1

    def gather(self, slots) -> list:
        return [self.row(int(s)) for s in slots]

    def scatter(self, slots, rows) -> None:
        for s, row in zip(slots, rows):
            self.store(int(s), row)


def _wrap(values) -> list:
    return [int(np.int64(np.uint64(v & (2**64 - 1)))) for v in values]


@pytest.mark.parametrize("case", mc.hand_cases() + [mc.random_case(s) for s in range(60)], ids=repr)
def test_reference_against_the_oracle(case):
    start = mc.run_case(mc.MoveCase(case.name, case.num_slots, case.stride, case.num_layers, case.capacity,
                                    case.seed), "reference", np.array)
    got = mc.run_case(case, "reference", np.array)
    oracle = Oracle(case, start)
    scratch = start.scratch.copy()
    outs = []
    for k, op in enumerate(case.ops):
        dtype = op[4] if len(op) > 4 else np.int64
        a = np.asarray(op[1], dtype=np.int64).astype(dtype).tolist()
        if op[0] == "gather":
            outs.append(oracle.gather(a))
        elif op[0] == "scatter":
            oracle.scatter(a, np.asarray(op[2]).tolist())
        else:
            b = np.asarray(op[2], dtype=np.int64).astype(dtype).tolist()
            rows = oracle.gather(a)
            oracle.scatter(b, rows)
            if rows:
                scratch[:len(rows)] = rows
    fields = got.canary.reshape(case.num_slots, case.stride)[:, :32].copy().view(np.int64)
    for s in range(case.num_slots):
        want = oracle.table[s]
        assert list(map(int, fields[s])) == want[:4], (case, s)
        if case.num_layers:
            assert list(map(int, got.layer_hashes[s])) == want[4:], (case, s)
    # Bytes past 32 of a slot are never touched.
    assert (got.canary.reshape(case.num_slots, case.stride)[:, 32:]
            == start.canary.reshape(case.num_slots, case.stride)[:, 32:]).all()
    assert got.status.tolist() == [oracle.faults, oracle.refused]
    assert got.scratch.tolist() == scratch.tolist()
    for g, w in zip(got.outs, outs):
        assert g[:len(w), :case.words].tolist() == [_wrap(r) for r in w]


def test_gather_leaves_the_buffer_past_n_untouched():
    case = [c for c in mc.hand_cases() if c.name == "buffer_longer_than_list"][0]
    got = mc.run_case(case, "reference", np.array)
    rng = np.random.default_rng(case.seed)
    rng.integers(0, 256, (case.num_slots, case.stride), dtype=np.uint8)  # the canary
    rng.integers(0, 256, (case.num_layers, case.num_slots, mc.NB), dtype=np.uint8)  # the layer sources
    rng.integers(-2**63, 2**63, (case.num_slots, case.num_layers), dtype=np.int64)  # the table
    rng.integers(-2**63, 2**63, (case.capacity, case.words), dtype=np.int64)  # the scratch
    poison = rng.integers(-2**63, 2**63, (9, case.words + 4), dtype=np.int64)
    assert got.outs[0][2:].tolist() == poison[2:].tolist()  # rows past n
    assert got.outs[0][:, case.words:].tolist() == poison[:, case.words:].tolist()  # the row stride's padding


def test_the_reference_keeps_the_last_of_duplicate_destinations():
    state = CanaryState.allocate(num_slots=4)
    mover = RecordMover(CanaryRecords(state), copy_capacity=4)
    src = np.arange(12, dtype=np.int64).reshape(3, 4)
    mover.scatter(np.array([2, 1, 2]), src)
    assert state.canary_buffer.view(np.int64)[2].tolist() == [8, 9, 10, 11]
    mover.copy(np.array([1, 2]), np.array([3, 3]))
    assert state.canary_buffer.view(np.int64)[3].tolist() == [8, 9, 10, 11]


def test_status_is_sticky_until_cleared():
    state = CanaryState.allocate(num_slots=4)
    mover = RecordMover(CanaryRecords(state))
    assert mover.status() == MoveStatus(MoveFault.NONE, 0) and mover.status().ok
    out = mover.allocate_rows(2)
    mover.gather(np.array([4, 1]), out)
    mover.scatter(np.array([9, 9]), out)
    st = mover.status()
    assert st == MoveStatus(MoveFault.SOURCE_RANGE | MoveFault.DEST_RANGE, 3) and not st.ok
    assert "SOURCE_RANGE|DEST_RANGE" in str(st) and "3 entries refused" in str(st)
    mover.gather(np.array([1]), out)
    assert mover.status().refused == 3  # a clean call leaves it as it was
    mover.clear_status()
    assert mover.status().ok


def test_rows_are_the_record_fields_then_the_layer_hashes():
    k = np.random.default_rng(0).integers(0, 256, (3, 8, 16), dtype=np.uint8)
    state = CanaryState.allocate(num_slots=8)
    records = CanaryRecords(state)
    layers = CanaryLayers(records, [[(k[i], 1, 16)] for i in range(3)])
    state.canary_buffer.view(np.int64)[5] = [10, 11, 12, 13]
    layers.table.layer_hashes[5] = [20, 21, 22]
    mover = RecordMover(records, layers)
    assert mover.row_words == 7 and mover.num_layers == 3
    out = mover.allocate_rows(1)
    mover.gather(np.array([5], dtype=np.int32), out)
    assert out.tolist() == [[10, 11, 12, 13, 20, 21, 22]]


# -- argument errors -----------------------------------------------------------------------------------------------

def _mover(layers: int = 0, **kw):
    state = CanaryState.allocate(num_slots=8)
    records = CanaryRecords(state)
    lay = None
    if layers:
        k = np.zeros((layers, 8, 16), dtype=np.uint8)
        lay = CanaryLayers(records, [[(k[i], 1, 16)] for i in range(layers)])
    return RecordMover(records, lay, **kw), state, lay


@pytest.mark.parametrize("call,exc,match", [
    (lambda m: m.gather(np.array([1.0]), m.allocate_rows(1)), TypeError, "slots: expected dtype int32 or int64"),
    (lambda m: m.gather(np.array([1]), np.zeros((1, 4), np.int32)), TypeError, "out: expected dtype int64"),
    (lambda m: m.gather(np.array([1]), np.zeros((1, 5), np.int64)), ValueError,
     r"out: expected 6 columns \(4 record words \+ 2 layer hashes\), got shape \(1, 5\)"),
    (lambda m: m.gather(np.array([1]), np.zeros(6, np.int64)), ValueError, "out: expected a 2-D array"),
    (lambda m: m.gather(np.array([1, 2, 3]), m.allocate_rows(2)), ValueError,
     r"out: expected at least 3 rows \(one per slot of the list\), got 2"),
    (lambda m: m.scatter(np.array([1, 2]), m.allocate_rows(1)), ValueError, "src: expected at least 2 rows"),
    (lambda m: m.gather(np.array([[1]]), m.allocate_rows(1)), ValueError, "slots: expected a 1-D array"),
    (lambda m: m.copy(np.array([1, 2]), np.array([3])), ValueError,
     r"dst_slots: expected the length of src_slots \(2\), got 1"),
    (lambda m: m.copy(np.arange(5), np.arange(5)), ValueError,
     r"src_slots: expected at most copy_capacity = 4 slots \(the scratch's rows\), got 5"),
    (lambda m: m.copy(np.array([1], np.uint32), np.array([2])), TypeError, "src_slots: expected dtype int32 or int64"),
])
def test_call_errors_name_the_argument(call, exc, match):
    mover, _, _ = _mover(layers=2, copy_capacity=4)
    with pytest.raises(exc, match=f"^kv-canary: {match}"):
        call(mover)


def test_a_read_only_out_is_refused():
    mover, _, _ = _mover()
    out = mover.allocate_rows(1)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="^kv-canary: out: expected a writable output array"):
        mover.gather(np.array([1]), out)
    mover.scatter(np.array([1]), out)  # a scatter only reads it


def test_memory_shared_with_what_a_call_writes_is_refused():
    mover, state, lay = _mover(layers=1, copy_capacity=2)
    with pytest.raises(ValueError, match="^kv-canary: out: expected memory separate from state.canary_buffer"):
        mover.gather(np.array([1]), _alias(state.canary_buffer, 5))
    with pytest.raises(ValueError, match="^kv-canary: src: expected memory separate from table.layer_hashes"):
        mover.scatter(np.array([1]), _alias(lay.table.layer_hashes, 5))
    with pytest.raises(ValueError, match="^kv-canary: src_slots: expected memory separate from scratch"):
        mover.copy(mover.scratch.reshape(-1)[:1], np.array([2]))
    with pytest.raises(ValueError, match="^kv-canary: slots: expected memory separate from status"):
        mover.gather(mover.status_word[:1], mover.allocate_rows(1))
    out = mover.allocate_rows(2)
    with pytest.raises(ValueError, match="^kv-canary: slots: expected memory separate from out"):
        mover.gather(out.reshape(-1)[:2], out)


def _alias(array, words: int) -> np.ndarray:
    """A ``[1, words]`` int64 view of ``array``'s first bytes (shared memory)."""
    return np.frombuffer(array.reshape(-1).view(np.uint8), dtype=np.int64, count=words).reshape(1, words)


def test_bind_errors():
    state = CanaryState.allocate(num_slots=8)
    records = CanaryRecords(state)
    with pytest.raises(TypeError, match="^kv-canary: records: expected a CanaryRecords, got CanaryState"):
        RecordMover(state)
    other = CanaryRecords(CanaryState.allocate(num_slots=8))
    k = np.zeros((1, 8, 16), dtype=np.uint8)
    with pytest.raises(ValueError, match="^kv-canary: layers: expected the CanaryLayers bound to these records"):
        RecordMover(records, CanaryLayers(other, [[(k[0], 1, 16)]]))
    with pytest.raises(TypeError, match="^kv-canary: copy_capacity: expected an int, got float"):
        RecordMover(records, copy_capacity=2.0)
    with pytest.raises(ValueError, match="^kv-canary: copy_capacity: expected an int >= 0, got -1"):
        RecordMover(records, copy_capacity=-1)
    with pytest.raises(ValueError, match=r"^kv-canary: copy_capacity: expected the rows of scratch \(3\) or None"):
        RecordMover(records, copy_capacity=2, scratch=np.zeros((3, 4), np.int64))
    with pytest.raises(ValueError, match=r"^kv-canary: scratch: expected 4 columns"):
        RecordMover(records, scratch=np.zeros((3, 6), np.int64))
    with pytest.raises(ValueError, match="^kv-canary: status: expected length 2"):
        RecordMover(records, status=np.zeros(3, np.int64))
    with pytest.raises(TypeError, match="^kv-canary: status: expected dtype int64"):
        RecordMover(records, status=np.zeros(2, np.int32))
    shared = np.zeros(16, np.int64)
    with pytest.raises(ValueError, match="expected memory separate from"):
        RecordMover(records, scratch=shared[:8].reshape(2, 4), status=shared[7:9])
    with pytest.raises(ValueError, match="^kv-canary: status: expected memory separate from state.canary_buffer"):
        RecordMover(records, status=state.canary_buffer.view(np.int64)[0, :2])
    assert RecordMover(records, scratch=np.zeros((3, 4), np.int64)).copy_capacity == 3
    assert RecordMover(records).copy_capacity == 1024


def test_layer_table_width_is_checked_between_movers():
    """Rows gathered with a layer table do not fit a mover without one (or with another number of layers)."""
    with_layers, _, _ = _mover(layers=2)
    without, _, _ = _mover()
    rows = with_layers.allocate_rows(3)
    with_layers.gather(np.array([1, 2, 3]), rows)
    with pytest.raises(ValueError, match=r"^kv-canary: src: expected 4 columns \(4 record words\), got shape \(3, 6\)"):
        without.scatter(np.array([1, 2, 3]), rows)


# -- the CUDA source -----------------------------------------------------------------------------------------------

def test_move_params_layout_matches_the_cuda_struct():
    from canary.contract import kernel_constants as K
    from canary.contract.move_layout import CONSTANTS, MOVE_FIELDS, RECORD_WORDS, STATUS_FAULTS, STATUS_REFUSED

    src = cuda_source("records_move")
    body = src[src.index("struct MoveParams {"):]
    body = body[body.index("{") + 1: body.index("};")]
    decls = [line.split("//")[0].strip() for line in body.splitlines() if line.split("//")[0].strip()]
    fields = []
    for decl in decls:
        ty, name = re.fullmatch(r"(.*?)(\w+);", decl).groups()
        assert "*" in ty or ty.strip() in ("i64", "u64"), decl  # every field 8 bytes
        fields.append(name)
    assert tuple(fields) == MOVE_FIELDS
    for name, value in CONSTANTS.items():
        assert re.search(rf"#define {name} {value}\b", src), name
    assert (K.RECORD_WORDS, K.MOVE_STATUS_FAULTS, K.MOVE_STATUS_REFUSED) == (RECORD_WORDS, STATUS_FAULTS,
                                                                            STATUS_REFUSED)
    assert (K.MOVE_SOURCE_RANGE, K.MOVE_DEST_RANGE) == (int(MoveFault.SOURCE_RANGE), int(MoveFault.DEST_RANGE))


def _has_cuda_core() -> bool:
    try:
        return importlib.util.find_spec("cuda.core") is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.sim
@pytest.mark.skipif(not _has_cuda_core(), reason="needs cuda-core for NVRTC: pip install -e '.[sim]'")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_move_kernels_compile(arch):
    from cuda.core import Program, ProgramOptions

    cubin = Program(cuda_source("records_move"), "c++", ProgramOptions(arch=arch, std="c++17")).compile("cubin").code
    assert b"canary_gather_rows" in cubin and b"canary_scatter_rows" in cubin


@pytest.mark.sim
@pytest.mark.skipif(importlib.util.find_spec("numba_cuda") is None, reason="needs numba-cuda: pip install -e '.[sim]'")
def test_numba_move_kernels_compile_for_sm90():
    """The twin's kernels type and compile (the simulator runs them as Python and cannot tell), with no float64 and
    no local memory. Runs in a child: this process may hold the simulator."""
    code = (
        "import re\n"
        "from types import SimpleNamespace\n"
        "from numba import cuda\n"
        "import numba.cuda.dispatcher as dispatcher\n"
        "from numba.cuda.cudadrv import nvvm\n"
        "if not nvvm.is_available():\n"
        "    print('NO-NVVM'); raise SystemExit(0)\n"
        "from canary.backends.sources import numba_kernels\n"
        "cn = numba_kernels('records_move_numba')\n"
        "dispatcher.get_current_device = lambda: SimpleNamespace(compute_capability=(9, 0))\n"
        "for kernel in (cn.canary_gather_rows, cn.canary_scatter_rows):\n"
        "    ptx, _ = cuda.compile_ptx(kernel, cn.SIGNATURE, cc=(9, 0))\n"
        "    assert kernel.__name__ in ptx\n"
        "    assert not re.search(r'\\bcvt\\.rn\\.f64|\\.f64\\b', ptx), kernel.__name__\n"
        "    assert '.local' not in ptx, kernel.__name__\n"
        "print('OK')\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    if proc.stdout.strip().endswith("NO-NVVM"):
        pytest.skip("NVVM unavailable")
    assert proc.stdout.strip().endswith("OK")


# -- the GPU twins -------------------------------------------------------------------------------------------------

def _gpu_place():
    cupy = pytest.importorskip("cupy")
    return cupy.asarray


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cupy", "numba"])
@pytest.mark.parametrize("case", mc.hand_cases() + [mc.random_case(s) for s in range(60)], ids=repr)
def test_gpu_twins_match_the_reference(backend, case):
    place = _gpu_place()
    want = mc.run_case(case, "reference", np.array)
    mc.assert_twin(case, mc.run_case(case, backend, place), want)
    for dtype in (np.int32, np.int64):  # SPEC 2 (*): either width moves the same rows
        if all(-2**31 <= v < 2**31 for op in case.ops for v in np.asarray(op[1], np.int64).tolist()
               + (np.asarray(op[2], np.int64).tolist() if op[0] == "copy" else [])):
            mc.assert_twin(case, mc.run_case(case, backend, place, slot_dtype=dtype), want)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cupy", "numba"])
def test_gpu_twins_hypothesis(backend):
    hypothesis = pytest.importorskip("hypothesis")
    place = _gpu_place()

    @hypothesis.settings(max_examples=100, deadline=None, suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(seed=hypothesis.strategies.integers(1000, 2**32 - 1))
    def check(seed):
        case = mc.random_case(seed)
        mc.assert_twin(case, mc.run_case(case, backend, place), mc.run_case(case, "reference", np.array))

    check()


def _gpu_mover(backend: str, num_slots: int, num_layers: int, capacity: int):
    cupy = pytest.importorskip("cupy")
    state = CanaryState.allocate(num_slots=num_slots, device=0)
    state.canary_buffer[:] = cupy.random.randint(0, 256, state.canary_buffer.shape, dtype=cupy.uint8)
    records = CanaryRecords(state, backend=backend)
    layers = None
    if num_layers:
        k = cupy.zeros((num_layers, num_slots, 16), dtype=cupy.uint8)
        layers = CanaryLayers(records, [[(k[i], 1, 16)] for i in range(num_layers)], backend=backend)
        layers.table.layer_hashes[:] = cupy.random.randint(-2**62, 2**62, layers.table.layer_hashes.shape,
                                                           dtype=cupy.int64)
    mover = RecordMover(records, layers, copy_capacity=capacity, backend=backend)
    mover.warmup()
    return cupy, state, layers, mover


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cupy", "numba"])
def test_gpu_large_copy_and_pinned_round_trip(backend):
    """A 200k-slot permutation with 32 layers (grid-stride beyond the resident blocks), then an offload into pinned
    host memory and a restore from it."""
    cupy, state, layers, mover = _gpu_mover(backend, 300_000, 32, 200_000)
    before = cupy.asnumpy(state.canary_buffer).view(np.int64).copy(), cupy.asnumpy(layers.table.layer_hashes)
    perm = np.random.default_rng(0).permutation(200_000)
    mover.copy(cupy.arange(200_000), cupy.asarray(perm))
    after = cupy.asnumpy(state.canary_buffer).view(np.int64), cupy.asnumpy(layers.table.layer_hashes)
    assert (after[0][perm] == before[0][:200_000]).all() and (after[1][perm] == before[1][:200_000]).all()
    import cupyx

    pinned = cupyx.zeros_pinned((1000, mover.row_words), dtype=np.int64)
    slots = cupy.arange(5000, 6000, dtype=cupy.int32)
    mover.gather(slots, pinned)
    cupy.cuda.get_current_stream().synchronize()
    assert (pinned[:, :4] == after[0][5000:6000]).all() and (pinned[:, 4:] == after[1][5000:6000]).all()
    mover.scatter(slots + 100_000, pinned)
    got = cupy.asnumpy(state.canary_buffer).view(np.int64)
    assert (got[105_000:106_000] == after[0][5000:6000]).all()
    assert mover.status().ok


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cupy"])
def test_gpu_graph_capture_and_replay_after_refill(backend):
    """gather / scatter / copy captured once in a CUDA graph: a replay moves the slots the lists hold now."""
    cupy, state, layers, mover = _gpu_mover(backend, 64, 2, 8)
    src, dst = cupy.asarray([1, 2, 3], dtype=cupy.int64), cupy.asarray([2, 3, 4], dtype=cupy.int64)
    out = mover.allocate_rows(3)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        mover.copy(src, dst, stream=stream)
        mover.gather(dst, out, stream=stream)
        graph = stream.end_capture()
    for shift in (0, 10, 20):
        src[:] = cupy.arange(1, 4) + shift
        dst[:] = cupy.arange(2, 5) + shift
        old = cupy.asnumpy(state.canary_buffer).view(np.int64)[1 + shift:4 + shift].copy()
        graph.launch(stream)
        stream.synchronize()
        assert (cupy.asnumpy(out)[:, :4] == old).all()
    assert mover.status().ok
