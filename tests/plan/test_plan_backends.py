"""The GPU test matrix (SPEC 3.5, 3.6), shared by the CuPy and Numba backends. Marker ``gpu``: skipped without
a CUDA device. Every run poisons its outputs and compares all 10 buffers byte for byte with the reference."""
from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # before any jax import: JAX would take 75% of GPU memory
os.environ.setdefault("JAX_ENABLE_X64", "1")  # int64 arrays, not silently int32

import numpy as np
import pytest

from helpers.plan_cases import (
    GPU_RANDOM_KNOBS,
    OUTPUTS, POISON, POISON_ALT, PlanCase, assert_same, expected_outputs, hand_cases, make_plans, poisoned_outputs,
    random_case, refill, run_case, to_numpy, to_xp,
)

pytestmark = pytest.mark.gpu
BACKENDS = ["cupy", "numba"]  # the shared ``backend`` fixture (tests/conftest.py) runs these


# ---------------------------------------------------------------------------------------------------------------
# Byte-identical to the reference


@pytest.mark.parametrize("case", hand_cases(), ids=lambda c: c.name)
@pytest.mark.parametrize("xp", ["cupy", "torch_cuda"])
def test_hand_cases(backend, case, xp):
    if xp == "torch_cuda":
        pytest.importorskip("torch")
    for poison in (POISON, POISON_ALT):
        assert_same(run_case(case, backend, xp, poison), expected_outputs(case, poison), case)
    assert_same(run_case(case, backend, xp, api="launch"), expected_outputs(case), case)


RANDOM_KNOBS = GPU_RANDOM_KNOBS


@pytest.mark.parametrize("seed", range(120))
def test_array_widths(backend, seed):
    """SPEC 2 (*): every step array and a paged table int32 or int64, drawn per array (all int32 where they fit
    on every fourth seed), against the reference's plan of the int64 case; cupy / torch / numba arrays."""
    from helpers.index_forms import page_twins
    from helpers.plan_cases import with_widths

    knobs = RANDOM_KNOBS[seed % len(RANDOM_KNOBS)]
    case = random_case(seed, name=f"widths-{seed}", **knobs)
    if seed % 3:
        case = page_twins(case, (1, 4, 16)[seed % 3], seed)[seed % 3]
    want = expected_outputs(case)
    narrowed = with_widths(case, all32=True) if seed % 4 == 0 else with_widths(case, seed)
    xp = ("cupy", "torch_cuda", "numba")[seed % 3] if backend == "numba" else ("cupy", "torch_cuda")[seed % 2]
    if xp == "torch_cuda":
        pytest.importorskip("torch")
    assert_same(run_case(narrowed, backend, xp), want, narrowed)


@pytest.mark.parametrize("xp", ["cupy", "torch_cuda"])
def test_array_width_edges(backend, xp):
    from helpers.index_forms import wide_table_edge_cases
    from helpers.plan_cases import int32_edge_cases, with_widths

    if xp == "torch_cuda":
        pytest.importorskip("torch")
    for case in int32_edge_cases():
        assert_same(run_case(with_widths(case, all32=True), backend, xp), expected_outputs(case), case)
    for case, twin in wide_table_edge_cases():
        assert_same(run_case(case, backend, xp), expected_outputs(twin), case)


@pytest.mark.parametrize("seed", range(600))
def test_random_cases(backend, seed):
    knobs = RANDOM_KNOBS[seed % len(RANDOM_KNOBS)]
    case = random_case(seed, name=f"random-{seed}", **knobs)
    xp = ("cupy", "torch_cuda", "numba")[seed % 3] if backend == "numba" else ("cupy", "torch_cuda")[seed % 2]
    if xp == "torch_cuda":
        pytest.importorskip("torch")
    assert_same(run_case(case, backend, xp), expected_outputs(case), case)


@pytest.mark.parametrize("bs", [1, 4096, 4097, 65536])
def test_large_batches(backend, bs):
    case = random_case(bs, bs=(bs, bs), max_reqs=(bs // 4 + 2, bs // 4 + 2), max_seq_len=(1, 48), capacity="loose",
                       name=f"bs{bs}")
    assert_same(run_case(case, backend, "cupy"), expected_outputs(case), case)


def test_jax_inputs(backend):
    pytest.importorskip("jax")
    import jax.numpy as jnp

    case = random_case(7, bs=(20, 40), swa=True, pool=True, name="jax")
    vp, wp, raw = make_plans(case, "cupy")
    from canary import CanaryPlanner

    conv = lambda a: jnp.asarray(np.ascontiguousarray(a))  # noqa: E731 - JAX has no strided views
    static = case.replace(req_to_token=np.ascontiguousarray(case.req_to_token))
    planner = CanaryPlanner(backend=backend, verify_plan_out=vp, write_plan_out=wp, **static.static_kwargs(conv))
    planner.plan(**case.step_kwargs(conv))
    assert_same({k: to_numpy(raw[k]) for k in OUTPUTS}, expected_outputs(case), case)


def test_jax_output_is_refused(backend):
    pytest.importorskip("jax")
    import jax.numpy as jnp

    from canary import VerifyPlan

    case = random_case(3, bs=(2, 4))
    vp, wp, _ = make_plans(case, "cupy")
    vp = VerifyPlan(**{**vp.__dict__, "verify_slot_indices": jnp.zeros(case.verify_capacity, jnp.int64)})
    from canary import CanaryPlanner

    with pytest.raises((ValueError, TypeError), match="kv-canary:"):
        CanaryPlanner(backend=backend, verify_plan_out=vp, write_plan_out=wp, **case.static_kwargs(lambda a: to_xp(a, "cupy")))


# ---------------------------------------------------------------------------------------------------------------
# Calling contract: zero copy, the caller's stream, CUDA graphs


def test_torch_output_shows_result_without_copy(backend):
    torch = pytest.importorskip("torch")
    case = random_case(11, bs=(8, 16), pool=True, name="torch-zero-copy")
    vp, wp, raw = make_plans(case, "torch_cuda")
    ptrs = {k: raw[k].data_ptr() for k in OUTPUTS}
    from canary import CanaryPlanner

    planner = CanaryPlanner(backend=backend, verify_plan_out=vp, write_plan_out=wp,
                            **case.static_kwargs(lambda a: to_xp(a, "torch_cuda")))
    planner.plan(**case.step_kwargs(lambda a: to_xp(a, "torch_cuda")))
    torch.cuda.current_stream().synchronize()
    assert {k: raw[k].data_ptr() for k in OUTPUTS} == ptrs
    assert_same({k: raw[k].cpu().numpy() for k in OUTPUTS}, expected_outputs(case), case)


def test_non_default_torch_stream_without_device_sync(backend):
    """The plan runs on the caller's stream: it completes while another stream is still busy."""
    torch = pytest.importorskip("torch")
    case = random_case(5, bs=(32, 64), swa=True, pool=True, capacity="loose", name="side-stream")
    conv = lambda a: to_xp(a, "torch_cuda")  # noqa: E731
    vp, wp, raw = make_plans(case, "torch_cuda")
    from canary import CanaryPlanner

    planner = CanaryPlanner(backend=backend, verify_plan_out=vp, write_plan_out=wp, **case.static_kwargs(conv))
    planner.warmup()
    step = case.step_kwargs(conv)
    torch.cuda.synchronize()
    busy, mine = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(busy):
        torch.cuda._sleep(2_000_000_000)  # ~1 s of spinning on another stream
    with torch.cuda.stream(mine):
        planner.plan(**step)  # default stream = torch's current stream = ``mine``
    mine.synchronize()
    assert not busy.query(), "the plan waited for another stream: a device-wide sync happened"
    assert_same({k: to_numpy(raw[k]) for k in OUTPUTS}, expected_outputs(case), case)
    busy.synchronize()


def _graph_case(seed: int) -> PlanCase:
    rng = np.random.default_rng(seed)
    base = random_case(seed, bs=(24, 24), max_reqs=(30, 30), max_seq_len=(64, 64), lut=True, pool=True,
                       swa=bool(seed % 2), capacity="loose", strided_r2t=False, name=f"graph-{seed}")
    base = base.replace(verify_capacity=24 * 64)
    return refill(base, rng)


def _copy_into(dst, src: np.ndarray, xp: str) -> None:
    if xp == "torch_cuda":
        import torch

        dst.copy_(torch.from_numpy(np.ascontiguousarray(src)))
    else:
        import cupy

        dst[...] = cupy.asarray(src)


def _sync_device(xp: str) -> None:
    if xp == "torch_cuda":
        import torch

        torch.cuda.synchronize()
    else:
        import cupy

        cupy.cuda.Device().synchronize()


def _graph_roundtrip(backend: str, xp: str, capture):
    case = _graph_case(1)
    conv = lambda a: to_xp(a, xp)  # noqa: E731
    vp, wp, raw = make_plans(case, xp)
    static = case.static_kwargs(conv)
    step = case.step_kwargs(conv)
    from canary import CanaryPlanner

    planner = CanaryPlanner(backend=backend, verify_plan_out=vp, write_plan_out=wp, **static)
    planner.warmup()
    replay = capture(planner, step)
    rng = np.random.default_rng(99)
    for i in range(4):
        new = refill(case, rng)
        _copy_into(static["req_to_token"], new.req_to_token, xp)
        for key, arr in new.step_kwargs().items():
            _copy_into(step[key], arr, xp)
        poisoned = poisoned_outputs(case)
        for k in OUTPUTS:
            _copy_into(raw[k], poisoned[k], xp)
        _sync_device(xp)  # the refills ran on the library's current stream; the replay's stream may not wait
        replay()
        assert_same({k: to_numpy(raw[k]) for k in OUTPUTS}, expected_outputs(new), new)


def _torch_capture(planner, step):
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        planner.plan(**step)  # warm the launch path outside the capture too
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        planner.plan(**step)

    def replay():
        graph.replay()
        torch.cuda.synchronize()

    return replay


def _cupy_capture(planner, step):
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        planner.plan(**step, stream=stream)
        stream.synchronize()
        stream.begin_capture()
        planner.plan(**step, stream=stream)
        graph = stream.end_capture()

    def replay():
        graph.launch(stream)
        stream.synchronize()

    return replay


@pytest.mark.parametrize("xp", ["cupy", "torch_cuda"])
@pytest.mark.parametrize("bs, capacity", [(24, 200), (24, 7), (700, 900), (3000, 20000), (3000, 1000)],
                         ids=["share", "rotation", "two_pass", "side_tiles_share", "side_tiles_rotation"])
def test_sampled_rotation_advances_inside_a_graph(backend, xp, bs, capacity):
    """SPEC 3.7 inside a replayed graph: the cursors advance on the device at every replay (nothing on the host),
    and each replay equals the reference run from the cursors the previous one left."""
    if xp == "torch_cuda":
        pytest.importorskip("torch")
    base = random_case(5, bs=(bs, bs), max_reqs=(bs + 6, bs + 6), max_seq_len=(64, 64), lut=True, pool=True,
                       swa=False, capacity="loose", strided_r2t=False, padding_fraction=0.1, name="sampled-graph")
    case = base.replace(verify_capacity=capacity, on_overflow="sample", cursors=None)
    conv = lambda a: to_xp(a, xp)  # noqa: E731
    vp, wp, raw = make_plans(case, xp)
    from canary import CanaryPlanner, PlanStatus

    planner = CanaryPlanner(backend=backend, verify_plan_out=vp, write_plan_out=wp, **case.static_kwargs(conv))
    planner.warmup()
    step = case.step_kwargs(conv)
    replay = (_torch_capture if xp == "torch_cuda" else _cupy_capture)(planner, step)
    # The capture's warm-up call and the captured launch itself did not run the plan twice: reset the state.
    _copy_into(raw["verify_cursors"], np.zeros(case.max_reqs, np.int64), xp)
    _sync_device(xp)
    cursors = np.zeros(case.max_reqs, np.int64)
    seen = set()
    for i in range(6):
        poisoned = poisoned_outputs(case)
        for k in OUTPUTS:
            _copy_into(raw[k], poisoned[k], xp)
        _sync_device(xp)
        replay()
        want = expected_outputs(case.replace(cursors=cursors))
        assert int(want["status"][0]) & PlanStatus.SAMPLED, want["status"]
        assert_same({k: to_numpy(raw[k]) for k in OUTPUTS + ("verify_cursors",)}, want, case)
        cursors = want["verify_cursors"]
        seen.update(zip(want["verify_slot_indices"].tolist(), want["verify_expected_positions"].tolist()))
    assert len(seen) > capacity  # the replays verified different entries


def test_torch_cuda_graph_capture_and_replay(backend):
    pytest.importorskip("torch")
    _graph_roundtrip(backend, "torch_cuda", _torch_capture)


def test_cupy_stream_capture_and_replay(backend):
    _graph_roundtrip(backend, "cupy", _cupy_capture)


def test_check_raises_on_device_status(backend):
    from canary import CanaryInputError, PlanStatus

    case = hand_cases()[0]
    bad = case.replace(req_pool_indices=np.array([case.max_reqs + 5] + [1] * (case.bs - 1), dtype=np.int64)[: max(case.bs, 1)],
                       prefix_lens=np.ones(max(case.bs, 1), np.int64), extend_seq_lens=np.ones(max(case.bs, 1), np.int64),
                       valid_lens=None if case.pool is None else np.zeros(max(case.bs, 1), np.int64),
                       write_req_capacity=max(case.write_req_capacity, 1))
    with pytest.raises(CanaryInputError, match="BAD_REQ_POOL_INDEX") as info:
        run_case(bad, backend, "cupy", check=True)
    assert info.value.first_bad_row == 0
    assert info.value.status & PlanStatus.BAD_REQ_POOL_INDEX


@pytest.mark.parametrize("xp", ["cupy", "torch_cuda"])
def test_planner_reuses_and_refreshes_step_views(backend, xp):
    """One planner, many steps: the same step buffers refilled in place, fresh buffers, a resized batch."""
    if xp == "torch_cuda":
        pytest.importorskip("torch")
    from canary import CanaryPlanner

    base = _graph_case(3)
    conv = lambda a: to_xp(a, xp)  # noqa: E731
    vp, wp, raw = make_plans(base, xp)
    static = base.static_kwargs(conv)
    planner = CanaryPlanner(backend=backend, verify_plan_out=vp, write_plan_out=wp, **static)
    step = base.step_kwargs(conv)
    rng = np.random.default_rng(5)
    for i in range(6):
        new = refill(base, rng)
        if i == 4:  # a smaller batch in fresh buffers
            keep = slice(0, 7)
            new = new.replace(req_pool_indices=new.req_pool_indices[keep], prefix_lens=new.prefix_lens[keep],
                              extend_seq_lens=new.extend_seq_lens[keep], valid_lens=new.valid_lens[keep])
        _copy_into(static["req_to_token"], new.req_to_token, xp)
        if i % 2 or i == 4:
            step = new.step_kwargs(conv)  # fresh objects
        else:
            for key, arr in new.step_kwargs().items():
                _copy_into(step[key], arr, xp)  # same objects, new contents
        for k, v in poisoned_outputs(base).items():
            _copy_into(raw[k], v, xp)
        planner.plan(**step)
        assert_same({k: to_numpy(raw[k]) for k in OUTPUTS}, expected_outputs(new), new)


def test_launches_on_the_device_holding_the_buffers(backend):
    """Buffers on cuda:1 while cuda:0 is current: the plan runs there, and the current device is left alone."""
    import cupy

    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    case = random_case(21, bs=(16, 32), swa=True, pool=True, name="second-device")
    with cupy.cuda.Device(1):
        vp, wp, raw = make_plans(case, "cupy")
        static = case.static_kwargs(lambda a: to_xp(a, "cupy"))
        step = case.step_kwargs(lambda a: to_xp(a, "cupy"))
    from canary import CanaryPlanner

    with cupy.cuda.Device(0):
        planner = CanaryPlanner(backend=backend, verify_plan_out=vp, write_plan_out=wp, **static)
        planner.warmup()
        planner.plan(**step)
        assert cupy.cuda.runtime.getDevice() == 0
    with cupy.cuda.Device(1):
        cupy.cuda.Device(1).synchronize()
        assert_same({k: to_numpy(raw[k]) for k in OUTPUTS}, expected_outputs(case), case)
