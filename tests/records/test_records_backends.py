"""The canary write / verify / scatter kernels on a GPU, CuPy and Numba, against the reference (docs/canary.md 6).

Marker ``gpu``: skipped without a CUDA device. Every run starts from poisoned buffers (random records and slot
padding, a sentinel ring) and is compared with the reference under the byte-identity contract
(``canary_cases.assert_twin``).
"""
from __future__ import annotations

import dataclasses

from helpers import records_cases as cc
import numpy as np
import pytest

from canary import SKIP_SEED
from canary.contract.realkv import RealKVMode
from canary.contract.records_layout import LOOKBACK_ITEM_WORDS

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
BACKENDS = ["cupy", "numba"]  # the shared ``backend`` fixture (tests/conftest.py) runs these
BACKEND_FAMILY = "records"


def _cupy():
    import cupy

    return cupy


def _placement(xp: str):
    """(place, to_host, sync) for arrays of library ``xp`` on the current GPU."""
    if xp == "cupy":
        cupy = _cupy()
        return cupy.asarray, cupy.asnumpy, lambda: cupy.cuda.Device().synchronize()
    torch = pytest.importorskip("torch")

    def place(a):
        return torch.from_numpy(np.ascontiguousarray(a)).cuda() if a.size else torch.empty(
            a.shape, dtype=getattr(torch, a.dtype.name), device="cuda")

    def to_host(t):
        return t.cpu().numpy() if t.dtype != torch.float16 else t.cpu().view(torch.int16).numpy()

    return place, to_host, torch.cuda.synchronize


def _reference(case):
    return cc.run_case(case, "reference", lambda a: a.copy(), np.asarray)


def _twin(case, backend, xp="cupy", **kw):
    place, to_host, sync = _placement(xp)
    got = cc.run_case(case, backend, place, to_host, sync=sync, **kw)
    cc.assert_twin(case, got, _reference(case))


@pytest.mark.parametrize("case", cc.hand_cases(), ids=repr)
@pytest.mark.parametrize("xp", ["cupy", "torch"])
def test_hand_cases(backend, case, xp):
    _twin(case, backend, xp)


@pytest.mark.parametrize("seed", range(300))
def test_random_cases(backend, seed):
    _twin(cc.random_case(seed, max_slots=300, max_entries=600), backend, ("cupy", "torch")[seed % 2])


@pytest.mark.parametrize("case", cc.hand_cases() + [cc.int32_edge_case()], ids=repr)
@pytest.mark.parametrize("xp", ["cupy", "torch"])
def test_token_array_widths_hand(backend, case, xp):
    """SPEC 2 (*): int32 token arrays (all where they fit, and drawn per array) write what int64 writes."""
    place, to_host, sync = _placement(xp)
    want = _reference(case)
    for narrowed in (cc.with_widths(case, 0, all32=True), cc.with_widths(case, 5)):
        cc.assert_twin(case, cc.run_case(narrowed, backend, place, to_host, sync=sync), want)


@pytest.mark.parametrize("seed", range(60))
def test_token_array_widths_random(backend, seed):
    place, to_host, sync = _placement(("cupy", "torch")[seed % 2])
    case = cc.random_case(seed, max_slots=300, max_entries=600)
    cc.assert_twin(case, cc.run_case(cc.with_widths(case, seed), backend, place, to_host, sync=sync),
                   _reference(case))


def test_random_cases_hypothesis(backend):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    @settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.integers(0, 2**32 - 1))
    def check(seed):
        _twin(cc.random_case(seed), backend)

    check()


@pytest.mark.parametrize("case", cc.scatter_cases() + [cc.random_scatter_case(s) for s in range(100)], ids=repr)
def test_scatter(backend, case):
    place, to_host, _ = _placement("cupy")
    want = cc.run_scatter(case, "reference", lambda a: a.copy(), np.asarray)
    assert cc.run_scatter(case, backend, place, to_host).tobytes() == want.tobytes()


def test_large_launches(backend):
    """Many requests with long chunks, and a verify larger than the resident grid (grid-stride loop)."""
    rng = np.random.default_rng(5)
    num_slots = 400_001
    slots = rng.permutation(np.arange(1, num_slots))
    lens = np.full(1000, 400)
    offsets = np.concatenate([[0], np.cumsum(lens)])
    pos = np.concatenate([np.arange(n) for n in lens])
    ids = rng.integers(0, 50000, size=slots.size)
    seeds = np.full(lens.size, -1)
    write = cc.write_launch(offsets, seeds, slots, ids, pos)
    prev = np.where(pos == 0, -1, np.roll(slots, 1))
    tokens = np.where(rng.random(slots.size) < 1e-4, ids + 1, ids)  # a few VERIFY_TOKEN rows
    verify = cc.verify_launch(slots, tokens, pos, prev)
    case = cc.CanaryCase(name="large", num_slots=num_slots, launches=[write, verify], ring_capacity=4096,
                         records=np.zeros((num_slots, 4), np.int64))
    _twin(case, backend)


@pytest.mark.parametrize("shape", ["bs1_32k", "bs8_2k", "mixed"])
@pytest.mark.parametrize("mode", [RealKVMode.NONE, RealKVMode.ALL])
def test_long_requests_split_across_blocks(backend, shape, mode):
    """The write scan at the GPU's sizes: one 32,768-token request (128 segments of 256 entries, each reading its
    predecessors' maps from the look-back scratch), 8 x 2,048 (8 segments of 256 each), and a mix of long and one-token requests (the
    warp path) with skips (the contiguous composition: some entries do not advance the chain) and SKIP_SEED rows,
    seeded from chained records; then a verify of everything written (clean)."""
    rng = np.random.default_rng(11)
    lens = {"bs1_32k": [32768], "bs8_2k": [2048] * 8, "mixed": [1, 9000, 1, 1, 257, 0, 3000, 1]}[shape]
    n = int(sum(lens))
    num_slots = n + 1000
    slots = 1 + rng.permutation(num_slots - 1)
    loc, seed_slots = slots[:n].copy(), slots[n : n + len(lens)]
    if shape == "mixed":
        loc[rng.random(n) < 0.01] = -1
    offsets = np.concatenate([[0], np.cumsum(lens)])
    pos = np.concatenate([np.arange(m) + 5 for m in lens])
    ids = rng.integers(0, 1 << 40, size=n)
    records = np.zeros((num_slots, 4), np.int64)
    records[seed_slots] = np.stack([np.full(len(lens), 3), np.full(len(lens), 4), np.full(len(lens), 1 << 62),
                                    np.zeros(len(lens), np.int64)], axis=1)
    seeds = seed_slots.copy()
    if shape == "mixed":
        seeds[[2, 5]] = SKIP_SEED
    write = cc.write_launch(offsets, seeds, loc, ids, pos)
    owner = np.repeat(np.arange(len(lens)), lens)
    ok = (loc > 0) & (seeds[owner] != SKIP_SEED)
    v_slots, v_owner = loc[ok], owner[ok]
    prev = np.concatenate([[0], v_slots[:-1]])
    first = np.concatenate([[True], v_owner[1:] != v_owner[:-1]])
    prev[first] = seeds[v_owner[first]]
    verify = cc.verify_launch(v_slots, ids[ok], pos[ok], prev)
    srcs = [] if mode == RealKVMode.NONE else [(rng.integers(0, 256, size=(num_slots, 64), dtype=np.uint8), 1, 64, 64)]
    case = cc.CanaryCase(name=f"long_{shape}", num_slots=num_slots, launches=[write, verify], ring_capacity=4096,
                         records=records, sources=srcs, mode=mode, expect=None)
    _twin(case, backend)


@pytest.mark.parametrize("items", [None, 0, 3])
def test_long_writes_chained_on_one_canary(backend, items, monkeypatch):
    """Four chunked prefills of three requests (3,000, 700 and 1,500 tokens: 12, 3 and 6 segments) on one canary,
    each chunk seeded by the previous chunk's last slot, then a verify of everything: the look-back scratch is
    reused by every launch, so a flag one launch left behind would give the next a wrong chain. ``items`` caps
    the scratch (CuPy: ``LOOKBACK_ITEMS``): None the default, 0 none (every segment composes its predecessors),
    3 only the first items (segments beyond them look back and are composed by their successors). Every item's
    flag and done counter are zero after the run (the values behind a cleared flag are never read)."""
    bounds = []
    if backend == "cupy":
        import canary.backends.cupy.records as cr

        if items is not None:
            monkeypatch.setattr(cr, "LOOKBACK_ITEMS", items)
        init = cr.Bound.__init__

        def spy(self, *a, **kw):
            init(self, *a, **kw)
            bounds.append(self)

        monkeypatch.setattr(cr.Bound, "__init__", spy)
    elif items is not None:
        pytest.skip("the look-back scratch is the CuPy kernel's (Numba composes every segment's predecessors)")
    rng = np.random.default_rng(23)
    lens = np.array([3000, 700, 1500])
    chunks = 4
    num_slots = int(lens.sum()) * chunks + 100
    slots = 1 + rng.permutation(num_slots - 1)
    launches, used = [], 0
    last = np.full(lens.size, -1)
    v_slots, v_ids, v_pos, v_prev = [], [], [], []
    for c in range(chunks):
        loc = slots[used:used + int(lens.sum())]
        used += loc.size
        offsets = np.concatenate([[0], np.cumsum(lens)])
        pos = np.concatenate([np.arange(m) + c * m for m in lens])
        ids = rng.integers(0, 1 << 40, size=loc.size)
        launches.append(cc.write_launch(offsets, last.copy(), loc, ids, pos))
        for r in range(lens.size):
            seg = slice(offsets[r], offsets[r + 1])
            v_slots.append(loc[seg]), v_ids.append(ids[seg]), v_pos.append(pos[seg])
            v_prev.append(np.concatenate([[last[r]], loc[seg][:-1]]))
            last[r] = loc[seg][-1]
    launches.append(cc.verify_launch(*(np.concatenate(v) for v in (v_slots, v_ids, v_pos, v_prev))))
    case = cc.CanaryCase(name=f"chained_{items}", num_slots=num_slots, launches=launches, ring_capacity=256,
                         records=np.zeros((num_slots, 4), np.int64), expect=None)
    want = _reference(case)
    assert all(w0 == w1 for _, w0, w1, _ in want.launches), "the reference reports a violation: the case is wrong"
    place, to_host, sync = _placement("cupy")
    cc.assert_twin(case, cc.run_case(case, backend, place, to_host, sync=sync), want)
    for b in bounds:
        left = to_host(b._lookback).reshape(-1, LOOKBACK_ITEM_WORDS)[:, [0, LOOKBACK_ITEM_WORDS - 1]]
        assert not left.any(), f"look-back items left set after the launches: {np.flatnonzero(left.any(axis=1))}"


def test_side_stream_without_device_sync(backend):
    """Launches go to the given stream: they finish while the default stream is still busy."""
    cupy = _cupy()
    spin = cupy.RawKernel(r'''
    extern "C" __global__ void spin(long long cycles) {
        long long t0 = clock64(); while (clock64() - t0 < cycles) {}
    }''', "spin")
    case = next(c for c in cc.hand_cases() if c.name == "verify_by_hand")
    side = cupy.cuda.Stream(non_blocking=True)
    place, to_host, _ = _placement("cupy")
    state, wide = cc.make_state(case, place)
    from canary import VerifyPlan, WritePlan
    from canary import CanaryRecords

    canary = CanaryRecords(state, backend=backend)
    canary.warmup()
    placed = [{k: (place(v) if isinstance(v, np.ndarray) else v) for k, v in launch.args.items()}
              for launch in case.launches]
    cupy.cuda.Device().synchronize()
    # A third stream kept busy for ~1 s: a device-wide sync, or a launch on the wrong stream, would wait for it.
    # (Not the arrays' own stream: DLPack rightly orders the side stream after that one.)
    other = cupy.cuda.Stream(non_blocking=True)
    busy = cupy.cuda.Event()
    spin((1,), (1,), (np.int64(2_000_000_000),), stream=other)
    busy.record(other)
    w = placed[0]
    canary.write(WritePlan(write_offsets=w.pop("write_offsets"), write_seed_slot_indices=w.pop("write_seed_slot_indices"),
                           write_num_valid_reqs=w.pop("write_num_valid_reqs")), stream=side, **w)
    v = placed[1]
    tag = v.pop("launch_tag")
    canary.verify(VerifyPlan(status=place(np.zeros(1, np.int32)), **v), launch_tag=tag, stream=side)
    side.synchronize()
    assert not busy.done, "the busy stream finished first: the launches waited for it"
    report = state.read()  # syncs the device
    want = _reference(case)
    assert report.total == want.launches[-1][2]


def test_graph_capture_and_replay_after_refill(backend):
    """Capture verify + write + scatter once; refill the inputs in place; replays give the reference's results."""
    cupy = _cupy()
    from canary import VerifyPlan, WritePlan
    from canary import CanaryRecords, scatter_expected_tokens

    rng = np.random.default_rng(3)
    cases = [cc.CanaryCase(name=f"refill{i}", num_slots=64, ring_capacity=256, records=np.zeros((64, 4), np.int64),
                           launches=[_write_launch(rng, 64), cc.verify_launch(*_verify_args(rng, 64), tag=2)])
             for i in range(3)]
    state, wide = cc.make_state(cases[0], cupy.asarray)
    state.ring_write_index[0] = 0
    canary = CanaryRecords(state, backend=backend)
    canary.warmup()
    w_args = {k: cupy.asarray(v) for k, v in cases[0].launches[0].args.items() if isinstance(v, np.ndarray)}
    v_args = {k: cupy.asarray(v) for k, v in cases[0].launches[1].args.items() if isinstance(v, np.ndarray)}
    wp = WritePlan(write_offsets=w_args["write_offsets"], write_seed_slot_indices=w_args["write_seed_slot_indices"],
                   write_num_valid_reqs=w_args["write_num_valid_reqs"])
    vp = VerifyPlan(status=cupy.zeros(1, np.int32), **v_args)
    pool = cupy.zeros((8, 32), np.int32)
    sc = dict(req_pool_indices=cupy.asarray(np.array([1, 2], np.int64)), tokens=w_args["input_ids"][:8],
              token_offsets=cupy.asarray(np.array([0, 3, 8], np.int64)),
              column_starts=cupy.asarray(np.array([0, 5], np.int64)))
    entry = dict(out_cache_loc=w_args["out_cache_loc"], input_ids=w_args["input_ids"], positions=w_args["positions"],
                 expected_input_ids=w_args["expected_input_ids"], expected_positions=w_args["expected_positions"])
    stream = cupy.cuda.Stream(non_blocking=True)

    def step():
        canary.verify(vp, launch_tag=2, stream=stream)
        canary.write(wp, launch_tag=1, stream=stream, **entry)
        scatter_expected_tokens(req_to_verify_expected_tokens=pool, backend=backend, stream=stream, **sc)

    step()  # warm every path (module loads, cached views) outside the capture
    stream.synchronize()
    with stream:
        stream.begin_capture()
        step()
        graph = stream.end_capture()
    for case in cases:
        fresh, _ = cc.make_state(case, np.asarray)
        for name in ("canary_buffer", "ring_write_index", "slot_run_counter", "kernel_run_counter"):
            getattr(state, name)[...] = cupy.asarray(getattr(fresh, name))
        wide[...] = cc.RING_SENTINEL
        state.ring_write_index[0] = case.write_index
        for k, v in case.launches[0].args.items():
            if isinstance(v, np.ndarray):
                w_args[k][...] = cupy.asarray(v)
        for k, v in case.launches[1].args.items():
            if isinstance(v, np.ndarray):
                v_args[k][...] = cupy.asarray(v)
        pool[...] = 0
        # The refills ran on CuPy's current stream, which a non-blocking stream does not wait for.
        cupy.cuda.Device().synchronize()
        graph.launch(stream)
        stream.synchronize()
        want = cc.run_case(dataclasses.replace(case, launches=[case.launches[1], case.launches[0]]),
                           "reference", lambda a: a.copy(), np.asarray)
        assert cupy.asnumpy(state.canary_buffer).tobytes() == want.canary_buffer.tobytes()
        assert cupy.asnumpy(state.slot_run_counter).tolist() == want.slot_runs.tolist()
        assert cupy.asnumpy(state.kernel_run_counter).tolist() == want.kernel_runs.tolist()
        got_rows = cupy.asnumpy(wide)[: want.launches[-1][2], :8]
        want_rows = np.concatenate([r for _, _, _, r in want.launches])
        assert sorted(map(tuple, got_rows.tolist())) == sorted(map(tuple, want_rows.tolist()))
        pool_want = np.zeros((8, 32), np.int32)
        from canary.backends.reference import records as reference_canary

        reference_canary.scatter_expected_tokens(
            req_to_verify_expected_tokens=pool_want, req_pool_indices=np.array([1, 2], np.int64),
            tokens=case.launches[0].args["input_ids"][:8], token_offsets=np.array([0, 3, 8], np.int64),
            column_starts=np.array([0, 5], np.int64))
        assert (cupy.asnumpy(pool) == pool_want).all()


def _write_launch(rng, num_slots, r_cap=4, n=24):
    """One write launch: disjoint slots per request, consecutive positions, a few failing asserts."""
    slots = rng.permutation(np.arange(1, num_slots))[:n]
    cuts = np.sort(rng.choice(np.arange(1, n), size=r_cap - 1, replace=False))
    offsets = np.concatenate([[0], cuts, [n]])
    pos = np.concatenate([np.arange(b - a) for a, b in zip(offsets[:-1], offsets[1:])])
    ids = rng.integers(0, 100, size=n)
    exp_ids = np.where(rng.random(n) < 0.1, ids + 1, ids)
    exp_pos = np.where(rng.random(n) < 0.1, -1, pos)
    return cc.write_launch(offsets, np.full(r_cap, -1), slots, ids, pos, exp_ids=exp_ids, exp_pos=exp_pos, tag=1)


def _verify_args(rng, num_slots, n=24):
    slots = rng.integers(0, num_slots, size=n)
    return (slots, rng.integers(-1, 100, size=n), rng.integers(0, 8, size=n), rng.integers(-1, num_slots, size=n))


def test_drain_decodes_gpu_rows(backend):
    """Allocate on the GPU, detect a wrong token, drain into readable records, and the ring is reset."""
    from canary import VerifyPlan, WritePlan
    from canary.contract.ring import FailReason, KernelTag
    from canary.contract.state import CanaryState
    from canary import CanaryRecords

    cupy = _cupy()
    state = CanaryState.allocate(num_slots=16, ring_capacity=4, device=0)
    canary = CanaryRecords(state, backend=backend)
    a = cupy.asarray
    wp = WritePlan(write_offsets=a(np.array([0, 3])), write_seed_slot_indices=a(np.array([-1])),
                   write_num_valid_reqs=a(np.array([1], np.int32)))
    canary.write(wp, out_cache_loc=a(np.array([4, 5, 6])), input_ids=a(np.array([7, 8, 9])),
                 positions=a(np.array([0, 1, 2])), launch_tag=3)
    vp = VerifyPlan(verify_slot_indices=a(np.array([4, 5, 6])), verify_expected_tokens=a(np.array([7, 80, 9])),
                    verify_expected_positions=a(np.array([0, 1, 2])), verify_prev_slot_indices=a(np.array([-1, 4, 5])),
                    verify_num_valid=a(np.array([3], np.int32)), enable=a(np.array([1], np.int32)),
                    status=a(np.zeros(1, np.int32)))
    canary.verify(vp, launch_tag=9)
    report = canary.drain()
    assert report.total == 1 and report.dropped == 0
    (v,) = report.violations
    assert v.kernel == KernelTag.VERIFY and v.launch_tag == 9 and v.slot == 5 and v.reasons == FailReason.VERIFY_TOKEN
    assert (v.stored_token, v.expected_token) == (8, 80)
    assert report.health.write_slots == 3 and report.health.verify_slots == 3
    assert canary.drain().total == 0


def test_launches_on_the_device_holding_the_buffers(backend):
    cupy = _cupy()
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    case = next(c for c in cc.hand_cases() if c.name == "real_kv_pt_all")
    with cupy.cuda.Device(1):
        got = cc.run_case(case, backend, lambda a: _on(1, a), cupy.asnumpy, sync=lambda: cupy.cuda.Device(1).synchronize())
    cc.assert_twin(case, got, _reference(case))
    # And with device 0 current while the buffers live on device 1.
    got = cc.run_case(case, backend, lambda a: _on(1, a), cupy.asnumpy, sync=lambda: cupy.cuda.Device(1).synchronize())
    cc.assert_twin(case, got, _reference(case))


def _on(device: int, a):
    cupy = _cupy()
    with cupy.cuda.Device(device):
        return cupy.asarray(a)


# ---------------------------------------------------------------------------------------------------------------
# End to end on the GPU: the simulated engine (canary/engine.py) with CuPy arrays, planner and canary on device


def test_engine_clean_replay_on_gpu(backend):
    from helpers.replay_engine import Engine

    cupy = _cupy()
    e = Engine(requests=60, xp=cupy, backend=backend)
    logs = e.run(1000)
    assert len(logs) >= 500
    assert all(log.report.total == 0 for log in logs), [str(v) for log in logs for v in log.report][:5]
    h = e.state.health()
    assert (h.write_launches, h.verify_launches) == (len(logs), len(logs))
    assert h.verify_slots == sum(log.verify_entries for log in logs) > 100_000


@pytest.mark.parametrize("kind", ["kv-flip", "overwrite", "position", "token", "stale-row"])
def test_engine_detects_each_fault_on_gpu(backend, kind):
    from helpers.replay_engine import Engine
    from canary.replay.faults import Fault, Injector

    cupy = _cupy()
    e = Engine(requests=40, xp=cupy, backend=backend)
    fault = Fault(kind, 10)
    inj = Injector([fault])
    for _ in range(300):
        log = e.step(inj.before_write, inj.after_write)
        assert log is not None
        if fault.applied:
            break
        assert log.report.total == 0
    assert fault.applied
    seen = list(log.report) + list(e.step().report)
    assert any(v.slot == fault.slot for v in seen), [str(v) for v in seen]


# ---------------------------------------------------------------------------------------------------------------
# The device hash functions themselves, on the frozen vectors (helpers/hash_vectors.py, pinned by test_hashes.py)


def test_cuda_hashes_match_frozen_vectors():
    from helpers.hash_vectors import MIX3_VECTORS, SPLITMIX64_VECTORS

    from canary.backends.sources import cuda_source

    cupy = _cupy()
    src = cuda_source("records") + r'''
    extern "C" __global__ void hash_vectors(const u64* x, u64* sx, int n, const u64* a, const u64* b, const u64* c,
                                            u64* m, int n3) {
        const int i = threadIdx.x;
        if (i < n) sx[i] = splitmix64(x[i]);
        if (i < n3) m[i] = mix3(a[i], b[i], c[i]);
    }'''
    fn = cupy.RawModule(code=src, options=("--std=c++17",)).get_function("hash_vectors")
    x = cupy.asarray(np.array([v for v, _ in SPLITMIX64_VECTORS], dtype=np.uint64))
    a, b, c = (cupy.asarray(np.array(col, dtype=np.uint64)) for col in list(zip(*MIX3_VECTORS))[:3])
    sx, m = cupy.zeros_like(x), cupy.zeros_like(a)
    fn((1,), (32,), (x, sx, np.int32(x.size), a, b, c, m, np.int32(a.size)))
    assert cupy.asnumpy(sx).tolist() == [y for _, y in SPLITMIX64_VECTORS]
    assert cupy.asnumpy(m).tolist() == [w for *_, w in MIX3_VECTORS]


def test_cuda_chain_matches_frozen_vectors():
    """records.cu's chain_link and mulmod_p on CHAIN_LINK_VECTORS and MULMOD_VECTORS."""
    from helpers.hash_vectors import CHAIN_LINK_VECTORS, CHAIN_VECTORS_KERNEL, MULMOD_VECTORS

    from canary.backends.sources import cuda_source

    cupy = _cupy()
    fn = cupy.RawModule(code=cuda_source("records") + CHAIN_VECTORS_KERNEL, options=("--std=c++17",)).get_function(
        "chain_vectors")
    ph, tok, pos = (cupy.asarray(np.array(col, dtype=np.uint64)) for col in list(zip(*CHAIN_LINK_VECTORS))[:3])
    a, b = (cupy.asarray(np.array(col, dtype=np.uint64)) for col in list(zip(*MULMOD_VECTORS))[:2])
    link, ab = cupy.zeros_like(ph), cupy.zeros_like(a)
    fn((1,), (32,), (ph, tok, pos, link, np.int32(ph.size), a, b, ab, np.int32(a.size)))
    assert cupy.asnumpy(link).tolist() == [w for *_, w in CHAIN_LINK_VECTORS]
    assert cupy.asnumpy(ab).tolist() == [w for *_, w in MULMOD_VECTORS]


def test_cuda_fold_matches_frozen_vectors():
    """records.cu's fold_slot on REAL_KV_FOLD_VECTORS (all-zero bytes fold to 1, never to an unwritten record's 0)."""
    from helpers.hash_vectors import FOLD_VECTORS_KERNEL, REAL_KV_FOLD_VECTORS, fold_vectors_flat

    from canary.backends.sources import cuda_source

    cupy = _cupy()
    fn = cupy.RawModule(code=cuda_source("records") + FOLD_VECTORS_KERNEL, options=("--std=c++17",)).get_function(
        "fold_vectors")
    words, meta = fold_vectors_flat()
    out = cupy.full(len(meta), 0xDEAD, dtype=cupy.uint64)
    fn((1,), (32,), (cupy.asarray(words), cupy.asarray(meta), np.int32(len(meta)), out))
    assert cupy.asnumpy(out).tolist() == [h for _, h in REAL_KV_FOLD_VECTORS]


def test_numba_hashes_match_frozen_vectors():
    from helpers.numba_hash_vectors import check_numba_hashes

    check_numba_hashes()


def test_torch_bfloat16_source_zero_copy(backend):
    """A torch bfloat16 KV buffer on the GPU is hashed in place (viewed as bytes): a flipped bit is caught."""
    torch = pytest.importorskip("torch")
    from canary import CanaryState, FailReason, CanaryRecords, VerifyPlan, WritePlan, real_kv

    dev = "cuda"
    gen = torch.Generator().manual_seed(6)  # drawn on the host: the same values on every GPU
    kv = torch.randn(32, 2, 64, dtype=torch.bfloat16, generator=gen).to(dev)  # [slots, heads, head_dim]: 256 B
    state = CanaryState(canary_buffer=torch.zeros(32, 32, dtype=torch.uint8, device=dev),
                        ring=torch.zeros(8, 8, dtype=torch.int64, device=dev),
                        ring_write_index=torch.zeros(1, dtype=torch.int32, device=dev),
                        slot_run_counter=torch.zeros(2, dtype=torch.int64, device=dev),
                        kernel_run_counter=torch.zeros(2, dtype=torch.int64, device=dev),
                        check_flags=torch.full((1,), 3, dtype=torch.int32, device=dev))
    canary = CanaryRecords(state, real_kv([(kv, 1, 256)]), backend=backend)
    t = lambda v, dt=torch.int64: torch.tensor(v, dtype=dt, device=dev)  # noqa: E731
    canary.write(WritePlan(write_offsets=t([0, 3]), write_seed_slot_indices=t([-1]),
                           write_num_valid_reqs=t([1], torch.int32)),
                 out_cache_loc=t([5, 9, 2]), input_ids=t([1, 2, 3]), positions=t([0, 1, 2]))
    kv.view(torch.uint8)[9, 0, 7] ^= 1  # in place: the canary must see the caller's memory, not a copy
    canary.verify(VerifyPlan(verify_slot_indices=t([5, 9, 2]), verify_expected_tokens=t([1, 2, 3]),
                             verify_expected_positions=t([0, 1, 2]), verify_prev_slot_indices=t([-1, 5, 9]),
                             verify_num_valid=t([3], torch.int32), enable=t([1], torch.int32),
                             status=t([0], torch.int32)))
    report = canary.drain()
    assert [(v.slot, v.reasons) for v in report] == [(9, FailReason.REAL_KV)]
