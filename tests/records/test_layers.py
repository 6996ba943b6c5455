"""The layer rotation (canary/records/layers.py, docs/records.md 10): the reference by hand, argument errors, the
CUDA struct layout, the GPU twins (``gpu``); the Numba twin in the simulator is
``layers_sim_suite.py`` (its own test ids under ``pytest -m sim``, tests/helpers/sim_plugin.py)."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest
from helpers import layer_cases as lc

from canary import CanaryRecords, CanaryState, FailReason, KernelTag, VerifyPlan, WritePlan
from canary.backends.reference.layers import owner_search
from canary.backends.sources import cuda_source
from canary.records.layers import CanaryLayers, LayerTable, layer_kv
from canary.contract.realkv import fold, real_kv
from canary.contract.ring import decode_row, encode_layer_tag

NB = 32


class Toy:
    """``num_layers`` layers of K and V (``[L, slots, 32]`` bytes), a canary over ``slots`` slots, one request
    whose tokens sit in slots ``1..n``: ``step()`` verifies them (the cursor's layer) then writes nothing new
    (write_layers with no entries: only the cursor moves)."""

    def __init__(self, num_layers: int, slots: int = 8, n: int = 5, dwell: int = 1, reported: bool = False):
        rng = np.random.default_rng(num_layers)
        self.k = rng.integers(0, 256, (num_layers, slots, NB), dtype=np.uint8)
        self.v = rng.integers(0, 256, (num_layers, slots, NB), dtype=np.uint8)
        self.state = CanaryState.allocate(num_slots=slots, ring_capacity=64, reported_slots=reported)
        self.records = CanaryRecords(self.state, [(self.k[0], 1, NB), (self.v[0], 1, NB)])
        self.layers = CanaryLayers(self.records, [[(self.k[i], 1, NB), (self.v[i], 1, NB)] for i in range(num_layers)],
                                   dwell=dwell)
        self.wp = WritePlan.allocate(write_req_capacity=1)
        self.wp.write_offsets[:] = [0, n]
        self.wp.write_seed_slot_indices[:] = [-1]
        self.wp.write_num_valid_reqs[0] = 1
        self.vp = VerifyPlan.allocate(verify_capacity=n)
        self.vp.verify_slot_indices[:] = np.arange(1, n + 1)
        self.vp.verify_expected_tokens[:] = -1
        self.vp.verify_expected_positions[:] = np.arange(n)
        self.vp.verify_num_valid[0] = n
        self.vp.enable[0] = 1
        self.layers.write(self.wp, out_cache_loc=np.arange(1, n + 1, dtype=np.int64))  # the prefill

    def step(self) -> list:
        self.layers.verify(self.vp, launch_tag=3)
        self.layers.write(self.wp, out_cache_loc=np.zeros(0, dtype=np.int64))
        return list(self.state.drain())


def test_a_reported_slot_takes_no_layer_row():
    """SPEC 4's reported slots filter layer rows too (bit 1; bit 2 is for MISSING rows only)."""
    t = Toy(2, reported=True)
    t.k[0, 3, 5] ^= 1
    t.k[1, 3, 5] ^= 1
    t.k[1, 4, 5] ^= 1
    t.state.reported_slots[3] = 1
    t.state.reported_slots[4] = 2
    rows = t.step() + t.step()
    assert sorted((v.slot, v.layer) for v in rows) == [(4, 1)]
    t.state.reported_slots[3] = 0
    assert sorted((v.slot, v.layer) for v in t.step() + t.step()) == [(3, 0), (3, 1), (4, 1)]


@pytest.mark.parametrize("num_layers", [1, 2, 5])
def test_a_flip_in_the_last_layer_is_found_exactly_when_the_cursor_reaches_it(num_layers):
    t = Toy(num_layers)
    last = num_layers - 1
    assert t.layers.cursor() == (1 % num_layers, 0)  # the prefill's write advanced it once
    for _ in range(2 * num_layers):
        assert t.step() == []
    layer_now = t.layers.cursor()[0]
    t.k[last, 3, 17] ^= 0x01
    wait = (last - layer_now) % num_layers
    for _ in range(wait):
        assert t.step() == []  # not before: the cursor is on another layer
    found = t.step()
    assert [(v.kernel, v.layer, v.slot, v.position, v.reasons, v.launch_tag) for v in found] == \
        [(KernelTag.VERIFY_LAYER, last, 3, 2, FailReason.REAL_KV, 3)]
    v = found[0]
    # The stored fold, then the fresh one (of the changed bytes).
    assert v.stored_chain_hash == int(t.layers.table.layer_hashes[3, last])
    assert v.expected_aux == int(fold(real_kv([(t.k[last], 1, NB), (t.v[last], 1, NB)]), [3])[0])
    assert "layer" in str(v) and f"layer {last}" in str(v)
    for _ in range(num_layers - 1):
        assert t.step() == []
    assert [x.layer for x in t.step()] == [last]  # every num_layers steps while the bytes stay changed
    # A write of the slot (new KV stored there) refreshes every layer: clean again.
    t.layers.write(t.wp, out_cache_loc=np.array([3], dtype=np.int64))
    for _ in range(num_layers):
        assert t.step() == []


def test_the_table_holds_each_layer_fold_and_layer_zero_equals_the_records_hash():
    t = Toy(3)
    for lay in range(3):
        want = fold(real_kv([(t.k[lay], 1, NB), (t.v[lay], 1, NB)]), np.arange(1, 6))
        assert t.layers.table.layer_hashes[1:6, lay].tolist() == want.tolist()
    assert t.layers.table.layer_hashes[0].tolist() == [0, 0, 0] and t.layers.table.layer_hashes[6:].sum() == 0
    assert (t.layers.table.layer_hashes[1:6] & 1).all()  # SPEC 4's forced bit


def test_dwell_holds_each_layer_for_dwell_steps():
    t = Toy(3, dwell=2)
    seen = []
    for _ in range(7):
        seen.append(t.layers.cursor())
        t.step()
    assert seen == [(0, 1), (1, 0), (1, 1), (2, 0), (2, 1), (0, 0), (0, 1)]


def test_skip_rules_and_counters():
    t = Toy(2)
    t.k[0, :] ^= 0xFF  # every slot changed in both layers
    t.k[1, :] ^= 0xFF
    t.vp.enable[0] = 0
    health0 = t.state.health()
    assert t.step() == []  # disabled: nothing read, the launch counted
    h = t.state.health()
    assert (h.verify_launches, h.verify_slots) == (health0.verify_launches + 1, health0.verify_slots)
    t.vp.enable[0] = 1
    t.vp.verify_slot_indices[:] = [0, -(1 << 62), 8, -3, 2]
    found = t.step()
    assert [(v.slot, v.reasons) for v in found] == [(2, FailReason.REAL_KV)]
    h2 = t.state.health()
    assert h2.verify_slots == h.verify_slots + 4  # every non-padding entry, as verify counts


def test_write_layers_follows_the_write_rules():
    """Padding rows seeded SKIP_SEED, slots < 0 or past the canary, requests past write_num_valid_reqs and
    entries outside every request's range keep their old hashes."""
    t = Toy(2, slots=12)
    table = t.layers.table.layer_hashes
    table[:] = 77
    wp = WritePlan.allocate(write_req_capacity=3)
    wp.write_offsets[:] = [0, 2, 4, 6]
    wp.write_seed_slot_indices[:] = [-1, -(1 << 63), 5]
    wp.write_num_valid_reqs[0] = 2
    loc = np.array([1, -1, 2, 3, 9, 10, 11], dtype=np.int64)
    t.layers.write(wp, out_cache_loc=loc)
    assert table[:, 0].tolist() == [77, int(fold(t.records.real_kv, [1])[0])] + [77] * 10


def test_owner_search_is_a_binary_search_over_clamped_starts():
    offsets = np.array([0, 2, 2, 5, 9], dtype=np.int64)
    assert owner_search(offsets, 4, 7).tolist() == [0, 0, 2, 2, 2, 3, 3]
    assert owner_search(offsets, 0, 3).tolist() == [-1, -1, -1]
    assert owner_search(np.array([3, 1, 0], dtype=np.int64), 2, 4).tolist() == [-1, 1, 1, 1]


def test_layer_tag_round_trip_and_range():
    tag = encode_layer_tag(5) | (9 << 8)
    row = np.array([tag, 1, 2, 3, 4, 5, 6, int(FailReason.REAL_KV)], dtype=np.int64)
    v = decode_row(row)
    assert (v.kernel, v.launch_tag, v.layer) == (KernelTag.VERIFY_LAYER, 5, 9)
    assert KernelTag.VERIFY_LAYER.counter_index == KernelTag.VERIFY.counter_index == 1
    with pytest.raises(ValueError, match=r"^kv-canary: launch_tag: expected an int in \[0, 549755813887\]"):
        encode_layer_tag(1 << 39)


def test_argument_errors_name_the_argument():
    k = np.zeros((3, 8, NB), dtype=np.uint8)
    state = CanaryState.allocate(num_slots=8)
    rec = CanaryRecords(state)
    with pytest.raises(ValueError, match=r"^kv-canary: layer_sources\[1\]: expected 1 sources, as layer 0 has, got 2"):
        CanaryLayers(rec, [[(k[0], 1, NB)], [(k[1], 1, NB), (k[2], 1, NB)]])
    with pytest.raises(ValueError, match=r"^kv-canary: layer_sources\[1\]\[0\]: expected page_size = 1"):
        CanaryLayers(rec, [[(k[0], 1, NB)], [(k[1].reshape(4, 64), 2, NB)]])
    with pytest.raises(TypeError, match=r"^kv-canary: layer_sources\[0\]: expected a list of sources"):
        CanaryLayers(rec, [(k[0], 1, NB)])
    with pytest.raises(ValueError, match=r"^kv-canary: layer_sources\[2\]\[0\]: expected rows \* page_size >= the 9"):
        big = np.zeros((2, 9, NB), dtype=np.uint8)
        CanaryLayers(CanaryRecords(CanaryState.allocate(num_slots=9)), [[(big[0], 1, NB)], [(big[1], 1, NB)],
                                                                         [(k[2], 1, NB)]])
    with pytest.raises(ValueError, match=r"^kv-canary: mode: expected 'partial' or 'all'"):
        layer_kv([[(k[0], 1, NB)]], "none")
    with pytest.raises(ValueError, match=r"^kv-canary: table.layer_hashes: expected shape \(8, 3\)"):
        CanaryLayers(rec, [[(k[i], 1, NB)] for i in range(3)], table=LayerTable.allocate(8, 2))
    with pytest.raises(ValueError, match=r"^kv-canary: dwell: expected an int in \[1, 2\*\*31\), got 0"):
        CanaryLayers(rec, [[(k[i], 1, NB)] for i in range(3)], dwell=0)
    lay = CanaryLayers(rec, [[(k[i], 1, NB)] for i in range(3)])
    wp = WritePlan.allocate(write_req_capacity=1)
    with pytest.raises(ValueError, match=r"^kv-canary: out_cache_loc: .*layer_hashes"):
        lay.write(wp, out_cache_loc=lay.table.layer_hashes.reshape(-1))
    with pytest.raises(ValueError, match=r"^kv-canary: layer_sources\[0\]\[0\]\.array: .*state"):
        CanaryLayers(rec, [[(state.canary_buffer, 1, NB)]])


@pytest.mark.parametrize("case", lc.hand_cases() + [lc.random_case(s) for s in range(12)], ids=repr)
def test_reference_is_deterministic_on_the_twin_cases(case):
    """The twin cases' reference runs (the simulator suite compares Numba against these)."""
    a = lc.run_case(case, "reference", np.array)
    b = lc.run_case(case, "reference", np.array)
    lc.assert_twin(case, a, b)
    lc.assert_twin(case, lc.run_case(case, "reference", np.array, loc_dtype=np.int32), a)  # SPEC 2 (*)


def test_the_hand_cases_find_their_flips():
    runs = {c.name: lc.run_case(c, "reference", np.array) for c in lc.hand_cases()}
    one = [[(v.layer, v.slot) for v in map(decode_row, map(np.array, rows))] for rows in runs["one_layer"].rows]
    # Slot 4 sits outside every request's range of the write: never hashed, it fails every verify (poisoned table).
    # The second write stores slot 8 again: its hashes are refreshed from the changed bytes.
    assert one == [[], [(0, 4)], [(0, 4), (0, 8)], [], [(0, 4)]]
    five = [decode_row(np.array(r)) for rows in runs["five_layers_separate"].rows for r in rows]
    # The flip in layer 4 (slot 2): found by the verifies whose cursor is on layer 4, never by another layer's.
    assert {v.layer for v in five if v.slot == 2} == {4}
    # The corrupt cursor (7) reads as layer 0; the verifies after the flip see layers 2, 3, 4, 0, 1, 2.
    assert sum(1 for v in five if v.slot == 2) == 1
    # padding_slot=-1: slot 0 is written, folded and verified clean, then its flip in layer 1 is found (the
    # default would skip slot 0 and never see it)
    real0 = [sorted((v.layer, v.slot) for v in map(decode_row, map(np.array, rows)))
             for rows in runs["real0_slot_zero"].rows]
    assert real0 == [[], [(1, 4)], [(1, 0), (1, 4)], [(1, 0), (1, 4)]]


# -- the CUDA source -----------------------------------------------------------------------------------------------

def _struct_fields(src: str, name: str) -> tuple:
    body = src[src.index(f"struct {name} {{"):]
    body = body[body.index("{") + 1: body.index("};")]
    out: list = []
    for line in body.splitlines():
        decl = line.split("//")[0].strip()
        if not decl:
            continue
        m = re.fullmatch(r"(.*?)(\w+)(\[\w+\])?;", decl)
        ty, fld, arr = m.group(1).strip(), m.group(2), m.group(3)
        if ty in ("StateParams", "RealKVParams"):
            out += list(_struct_fields(src, ty))
        elif arr:
            out += [f"{fld}{k}" for k in range(4)]
        else:
            assert "*" in ty or ty in ("i64", "u64"), decl  # every field 8 bytes
            out.append(fld)
    return tuple(out)


def test_layer_params_layout_matches_the_cuda_struct():
    from canary.contract.layers_layout import CONSTANTS, LAYER_FIELDS

    src = cuda_source("records")
    assert _struct_fields(src, "LayerParams") == LAYER_FIELDS
    for name, value in CONSTANTS.items():
        assert re.search(rf"#define {name} {value}\b", src), name
    from canary.contract import kernel_constants  # the Numba twin imports both from there

    assert kernel_constants.LAYER_THREADS == CONSTANTS["LAYER_THREADS"]
    assert re.search(rf"#define LAYER_KIND_SHIFT {kernel_constants.LAYER_KIND_SHIFT}\b", src)


def _has_cuda_core() -> bool:
    try:
        return importlib.util.find_spec("cuda.core") is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.sim
@pytest.mark.skipif(not _has_cuda_core(), reason="needs cuda-core for NVRTC: pip install -e '.[sim]'")
def test_layer_kernels_compile():
    from cuda.core import Program, ProgramOptions

    cubin = Program(cuda_source("records"), "c++", ProgramOptions(arch="sm_90", std="c++17")).compile("cubin").code
    assert b"canary_write_layers" in cubin and b"canary_verify_layer" in cubin


# -- the GPU twins -------------------------------------------------------------------------------------------------

def _gpu_place():
    cupy = pytest.importorskip("cupy")
    return cupy.asarray


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cupy", "numba"])
@pytest.mark.parametrize("case", lc.hand_cases() + [lc.random_case(s) for s in range(40)], ids=repr)
def test_gpu_twins_match_the_reference(backend, case):
    place = _gpu_place()
    want = lc.run_case(case, "reference", np.array)
    got = lc.run_case(case, backend, place)
    lc.assert_twin(case, got, want)
    lc.assert_twin(case, lc.run_case(case, backend, place, loc_dtype=np.int32), want)  # SPEC 2 (*)


@pytest.mark.gpu
def test_gpu_many_layers_and_a_large_step():
    """64 layers, a 4096-token write (grid-stride beyond the resident blocks) and a 16384-entry verify."""
    cupy = pytest.importorskip("cupy")
    L, S = 64, 8192
    k = cupy.random.randint(0, 256, (L, S, 256), dtype=cupy.uint8)
    v = cupy.random.randint(0, 256, (L, S, 256), dtype=cupy.uint8)
    state = CanaryState.allocate(num_slots=S, ring_capacity=64, device=0)
    rec = CanaryRecords(state)
    lay = CanaryLayers(rec, [[(k[i], 1, 256), (v[i], 1, 256)] for i in range(L)])
    wp = WritePlan.allocate(write_req_capacity=1, device=0)
    wp.write_offsets[:] = cupy.asarray([0, 4096])
    wp.write_seed_slot_indices[:] = -1
    wp.write_num_valid_reqs[:] = 1
    lay.write(wp, out_cache_loc=cupy.arange(1, 4097, dtype=cupy.int64))
    host_k, host_v = cupy.asnumpy(k), cupy.asnumpy(v)
    want = np.stack([fold(real_kv([(host_k[i], 1, 256), (host_v[i], 1, 256)]), np.arange(1, 4097))
                     for i in range(L)], axis=1)
    assert (cupy.asnumpy(lay.table.layer_hashes)[1:4097] == want).all()
    vp = VerifyPlan.allocate(verify_capacity=16384, device=0)
    vp.verify_slot_indices[:] = cupy.asarray(np.resize(np.arange(1, 4097), 16384))
    vp.verify_num_valid[:] = 16384
    vp.enable[:] = 1
    k[L - 1, 100, 7] ^= 1
    hits = []
    for _ in range(L):
        lay.verify(vp, launch_tag=1)
        lay.write(wp, out_cache_loc=cupy.zeros(0, dtype=cupy.int64))
        hits += [(x.layer, x.slot) for x in state.drain()]
    assert hits == [(L - 1, 100)] * 4  # slot 100 appears 4 times in the plan


@pytest.mark.gpu
def test_gpu_graph_capture_rotates_on_replay():
    """verify_layer and write_layers captured once in a CUDA graph: each replay checks the next layer."""
    cupy = pytest.importorskip("cupy")
    L, S = 4, 64
    k = cupy.random.randint(0, 256, (L, S, 32), dtype=cupy.uint8)
    state = CanaryState.allocate(num_slots=S, ring_capacity=64, device=0)
    rec = CanaryRecords(state)
    lay = CanaryLayers(rec, [[(k[i], 1, 32)] for i in range(L)])
    lay.warmup()
    wp = WritePlan.allocate(write_req_capacity=1, device=0)
    wp.write_offsets[:] = cupy.asarray([0, 8])
    wp.write_seed_slot_indices[:] = -1
    wp.write_num_valid_reqs[:] = 1
    loc = cupy.arange(1, 9, dtype=cupy.int64)
    lay.write(wp, out_cache_loc=loc)
    vp = VerifyPlan.allocate(verify_capacity=8, device=0)
    vp.verify_slot_indices[:] = loc
    vp.verify_num_valid[:] = 8
    vp.enable[:] = 1
    empty = cupy.zeros(0, dtype=cupy.int64)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        lay.verify(vp, launch_tag=2, stream=stream)
        lay.write(wp, out_cache_loc=empty, stream=stream)
        graph = stream.end_capture()
    k[L - 1, 5, 0] ^= 1
    seen = []
    for _ in range(L):
        c = lay.cursor()
        graph.launch(stream)
        stream.synchronize()
        seen.append((c[0], [(x.layer, x.slot) for x in state.drain()]))
    assert sorted(layer for layer, _ in seen) == list(range(L))
    assert [hits for layer, hits in seen if hits] == [[(L - 1, 5)]]


@pytest.mark.sim
@pytest.mark.skipif(importlib.util.find_spec("numba_cuda") is None, reason="needs numba-cuda: pip install -e '.[sim]'")
def test_numba_layer_kernels_compile_for_sm90(monkeypatch):
    """The twin's layer kernels type and compile (the simulator runs them as Python and cannot tell), in u64
    arithmetic only, for a tuple of 2 and of 128 word arrays. Runs in a child: this process may hold the simulator."""
    import subprocess
    import sys

    code = (
        "import re\n"
        "from types import SimpleNamespace\n"
        "from numba import cuda\n"
        "import numba.cuda.dispatcher as dispatcher\n"
        "from numba.cuda.cudadrv import nvvm\n"
        "if not nvvm.is_available():\n"
        "    print('NO-NVVM'); raise SystemExit(0)\n"
        "from canary.backends.sources import numba_kernels\n"
        "cn = numba_kernels('records_numba')\n"
        "dispatcher.get_current_device = lambda: SimpleNamespace(compute_capability=(9, 0))\n"
        "for n in (2, 128):\n"
        "    sig = 'void({})'.format(', '.join(ty.format(n) for _, ty in cn.LAYER_PARAMS))\n"
        "    for kernel in cn.layer_kernel_functions() + cn.layer_kernel_functions(padding_slot=-1):\n"
        "        ptx, _ = cuda.compile_ptx(kernel, sig, cc=(9, 0))\n"
        "        assert kernel.__name__ in ptx\n"
        "        assert not re.search(r'\\bcvt\\.rn\\.f64|\\.f64\\b', ptx), kernel.__name__\n"
        "print('OK')\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = f"{root}"
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    if proc.stdout.strip().endswith("NO-NVVM"):
        pytest.skip("NVVM unavailable")
    assert proc.stdout.strip().endswith("OK")
