"""The Numba backend on a real GPU (marker ``gpu``: skipped where none is visible).

Complements the shared matrix of ``test_gpu.py`` with what is particular to this backend: hand cases with
Numba device arrays as well as CuPy arrays and torch CUDA tensors, through both launch paths (the fused
kernel and the rows + entries pair, ``fused_max_bs = -1``); random cases; the caller's stream (a Numba
stream, ordering proven against a spinning kernel; a torch stream with another one busy); CUDA-graph capture
with ``torch.cuda.graph`` (on a pre-warmed stream and on torch's own capture stream, which the backend first
sees inside the capture) and replay after refilling the inputs in place; the per-step array cache; no
recompilation after warmup; the device holding the buffers when another one is current.

Every run poisons its outputs and compares all 10 buffers byte for byte with the NumPy reference.
On a machine with numpy >= 2.5 the backend refuses to load (numba-cuda 0.30 cannot compile there):
``test_numpy_25_is_refused`` checks the refusal and everything else skips with its message.
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # before any jax import: JAX would take 75% of GPU memory

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from helpers.plan_cases import (
    GPU_RANDOM_KNOBS,  # noqa: E402
    OUTPUTS, POISON, POISON_ALT, PlanCase, assert_same, expected_outputs, hand_case, hand_cases, make_plans,
    poisoned_outputs, random_case, refill, to_numpy, to_xp,
)

pytestmark = pytest.mark.gpu

FUSED, TWO_PASS = "fused", "two_pass"
XPS = ["numba", "cupy", "torch_cuda"]


def _numpy_too_new() -> bool:
    major, minor = (int("".join(c for c in p if c.isdigit()) or 0) for p in np.__version__.split(".")[:2])
    return (major, minor) >= (2, 5)


@pytest.fixture(scope="module")
def nb():
    """The loaded backend module; skips (with the backend's own message) where it cannot load."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        pytest.skip("NUMBA_ENABLE_CUDASIM=1: the simulator is not a GPU")
    from canary import BackendUnavailableError
    from canary.backends import load

    try:
        module = load("numba")
    except BackendUnavailableError as exc:
        pytest.skip(str(exc))
    assert module.ON_DEVICE and not module.SIMULATOR
    return module


def _need(xp: str) -> None:
    if xp == "cupy":
        pytest.importorskip("cupy")
    elif xp == "torch_cuda":
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip("torch has no CUDA here")


def _sync() -> None:
    from numba import cuda

    cuda.synchronize()


def make_planner(case: PlanCase, xp: str, *, path: str = FUSED, poison=POISON, fast: bool = True):
    """``(planner, raw outputs, step kwargs, static kwargs)`` with every array in ``xp`` on the current device."""
    from canary import CanaryPlanner, LaunchConfig

    vp, wp, raw = make_plans(case, xp, poison)
    conv = lambda a: to_xp(a, xp)  # noqa: E731
    static = case.static_kwargs(conv)
    launch = LaunchConfig(fused_max_bs=-1 if path == TWO_PASS else None, numba_fast_launch=fast)
    planner = CanaryPlanner(backend="numba", verify_plan_out=vp, write_plan_out=wp, launch_config=launch,
                            verify_capacity=case.verify_capacity, max_batch_size=case.max_batch_size, **static)
    assert planner.backend == "numba"
    planner.warmup()
    return planner, raw, case.step_kwargs(conv), static


def outputs(raw) -> dict[str, np.ndarray]:
    _sync()
    return {k: to_numpy(raw[k]) for k in OUTPUTS}


def run(case: PlanCase, xp: str, *, path: str = FUSED, poison=POISON, stream=None) -> dict[str, np.ndarray]:
    planner, raw, step, _ = make_planner(case, xp, path=path, poison=poison)
    planner.plan(**step, stream=stream)
    return outputs(raw)


def test_numpy_25_is_refused():
    if not _numpy_too_new():
        pytest.skip(f"numpy {np.__version__} < 2.5: the backend loads")
    from canary import BackendUnavailableError
    from canary.backends import load

    with pytest.raises(BackendUnavailableError, match=r"^kv-canary: .*pip install 'numba-cuda\[cu13\]'"):
        load("numba")


# ---------------------------------------------------------------------------------------------------------------
# Byte-identical to the reference


@pytest.mark.parametrize("path", [FUSED, TWO_PASS])
@pytest.mark.parametrize("xp", XPS)
@pytest.mark.parametrize("case", hand_cases(), ids=lambda c: c.name)
def test_hand_cases(nb, case, xp, path):
    _need(xp)
    poison = POISON if path == FUSED else POISON_ALT
    got = run(case, xp, path=path, poison=poison)
    assert_same(got, expected_outputs(case, poison), case)
    if case.expect_status is not None:
        assert int(got["status"][0]) == case.expect_status


RANDOM_KNOBS = GPU_RANDOM_KNOBS


@pytest.mark.parametrize("seed", range(330))
def test_random_cases(nb, seed):
    case = random_case(seed, name=f"random-{seed}", **RANDOM_KNOBS[seed % len(RANDOM_KNOBS)])
    xp = XPS[seed % 3]
    _need(xp)
    path = (FUSED, TWO_PASS)[(seed // len(RANDOM_KNOBS)) % 2]
    assert_same(run(case, xp, path=path), expected_outputs(case), case)


@pytest.mark.parametrize("bs", [1, 1023, 1024, 1025, 4096, 65536])
def test_large_batches(nb, bs):
    case = random_case(bs, bs=(bs, bs), max_reqs=(bs // 4 + 2, bs // 4 + 2), max_seq_len=(1, 48), lut=True,
                       pool=True, swa=bs % 2 == 1, capacity="loose", name=f"bs{bs}")
    want = expected_outputs(case)
    for path in (FUSED, TWO_PASS):
        assert_same(run(case, "numba", path=path), want, case)


# ---------------------------------------------------------------------------------------------------------------
# The caller's stream, without a host sync


def _spin_kernel():
    """One thread, a long chain of dependent multiply-adds (a good fraction of a second for 1.5e8 steps)."""
    from numba import cuda, int64

    @cuda.jit("void(int64[::1], int64)")
    def spin(out, n):
        acc = int64(1)
        for i in range(n):
            acc = acc * 6364136223846793005 + i
        out[0] = acc

    return spin


@pytest.mark.parametrize("path", [FUSED, TWO_PASS])
def test_numba_stream_ordering(nb, path):
    """The plan is enqueued on the caller's Numba stream, behind a spinning kernel, and the call returns
    without waiting for it: right after the call the spin (an event recorded behind it) has not completed and
    the outputs (read on another stream) are still poisoned; after the stream drains they are right. No clock:
    the event says whether the call waited, however fast the machine."""
    from numba import cuda

    case = random_case(5, bs=(32, 64), swa=True, pool=True, capacity="loose", name="numba-stream")
    planner, raw, step, _ = make_planner(case, "numba", path=path)
    spin = _spin_kernel()
    mine, other = cuda.stream(), cuda.stream()
    planner.plan(**step, stream=mine)  # warm this stream's launch path
    mine.synchronize()
    for k, v in poisoned_outputs(case).items():
        raw[k].copy_to_device(v)
    _sync()
    sink = cuda.device_array(1, dtype=np.int64)
    early = cuda.pinned_array(raw["status"].shape, dtype=np.int32)  # allocations (may sync) before the spin
    spun = cuda.event()
    spin[1, 1, mine](sink, 150_000_000)  # keeps ``mine`` busy for a good fraction of a second
    spun.record(mine)
    planner.plan(**step, stream=mine)
    waited = spun.query()  # True only if the spin had finished: plan() synchronized with the stream
    raw["status"].copy_to_host(early, stream=other)
    other.synchronize()
    assert not waited, "plan() returned after the spin ahead of it on 'mine' had finished: it waited for the stream"
    assert int(early[0]) == POISON.i32, "status already written: the plan did not run behind the spin on 'mine'"
    mine.synchronize()
    assert_same(outputs(raw), expected_outputs(case), case)


def test_torch_stream_without_device_sync(nb):
    """Plan on one torch stream while another is busy: the plan completes first (no device-wide sync)."""
    torch = pytest.importorskip("torch")
    _need("torch_cuda")
    case = random_case(6, bs=(32, 64), swa=True, pool=True, capacity="loose", name="torch-side-stream")
    planner, raw, step, _ = make_planner(case, "torch_cuda")
    torch.cuda.synchronize()
    busy, mine = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(busy):
        torch.cuda._sleep(2_000_000_000)
    planner.plan(**step, stream=mine)  # an explicit torch stream object
    mine.synchronize()
    assert not busy.query(), "the plan waited for another stream: a device-wide sync happened"
    assert_same({k: to_numpy(raw[k]) for k in OUTPUTS}, expected_outputs(case), case)
    busy.synchronize()


# ---------------------------------------------------------------------------------------------------------------
# CUDA graphs: capture once, refill the inputs in place, replay


def _graph_case(bs: int, seed: int) -> PlanCase:
    base = random_case(seed, bs=(bs, bs), max_reqs=(bs + 6, bs + 6), max_seq_len=(48, 48), lut=True, pool=True,
                       swa=bool(seed % 2), capacity="loose", strided_r2t=False, name=f"graph-{bs}")
    return refill(base.replace(verify_capacity=bs * 48), np.random.default_rng(seed))


@pytest.mark.parametrize("warm_stream", [True, False], ids=["warm_stream", "capture_stream"])
@pytest.mark.parametrize("bs,path", [(24, FUSED), (24, TWO_PASS), (1500, TWO_PASS)])
def test_torch_cuda_graph_capture_and_replay(nb, bs, path, warm_stream):
    torch = pytest.importorskip("torch")
    _need("torch_cuda")
    case = _graph_case(bs, seed=bs + (path == TWO_PASS))
    planner, raw, step, static = make_planner(case, "torch_cuda", path=path)
    graph = torch.cuda.CUDAGraph()
    if warm_stream:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            planner.plan(**step)  # this stream's launchers exist before the capture
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=side):
            planner.plan(**step)
    else:
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):  # torch's capture stream: first seen by the backend inside the capture
            planner.plan(**step)
    rng = np.random.default_rng(99)
    for _ in range(4):
        new = refill(case, rng)
        static["req_to_token"].copy_(torch.from_numpy(np.ascontiguousarray(new.req_to_token)))
        for key, arr in new.step_kwargs().items():
            step[key].copy_(torch.from_numpy(arr))
        for k, v in poisoned_outputs(case).items():
            raw[k].copy_(torch.from_numpy(v))
        graph.replay()
        torch.cuda.synchronize()
        assert_same({k: to_numpy(raw[k]) for k in OUTPUTS}, expected_outputs(new), new)


# ---------------------------------------------------------------------------------------------------------------
# Per-call behaviour


def test_step_arrays_views_and_fresh_arrays(nb):
    """Per-step inputs as views of one preallocated buffer at varying bs (as with CUDA-graph padding), then as
    fresh arrays every call, then more distinct pointers than the cache keeps: every plan is right."""
    from numba import cuda

    rng = np.random.default_rng(8)
    max_bs = 40
    case = random_case(8, bs=(max_bs, max_bs), max_reqs=(30, 30), max_seq_len=(20, 20), lut=True, pool=True,
                       capacity="loose", name="step-cache")
    case = case.replace(verify_capacity=max_bs * 20)
    planner, raw, step, static = make_planner(case, "numba")
    bufs = {k: cuda.device_array(max_bs, dtype=np.int64) for k in step}
    for call in range(3 * nb.STEP_CACHE_SIZE // 2):
        bs = int(rng.integers(0, max_bs + 1))
        new = refill(case, rng).replace(req_to_token=case.req_to_token)
        new = new.replace(**{f: getattr(new, f)[:bs] for f in ("req_pool_indices", "prefix_lens",
                                                                "extend_seq_lens", "valid_lens")})
        host = new.step_kwargs()
        if call < 20:  # views of the same buffers
            args = {}
            for k, v in host.items():
                if bs:
                    bufs[k][:bs].copy_to_device(v)
                args[k] = bufs[k][:bs]
        else:  # fresh arrays (new pointers) every call
            args = {k: cuda.to_device(v) for k, v in host.items()}
        for k, v in poisoned_outputs(case).items():
            raw[k].copy_to_device(v)
        planner.plan(**args)
        assert_same(outputs(raw), expected_outputs(new), new)
    assert len(planner._bound._step_arrays) <= nb.STEP_CACHE_SIZE


@pytest.mark.parametrize("fast", [True, False], ids=["cuda_core_launch", "numba_launch"])
def test_launch_paths(nb, fast):
    """Both host launch paths give the same bytes: the cuda.core launch with arguments marshalled at bind
    (``_FastLaunch``, the default; it must be active on a supported numba-cuda) and numba's own launch."""
    for name in ("expected_swa", "seeds_mixed", "all_bits", "big_batch_4097_swa_pool"):
        case = hand_case(name)
        for path in (FUSED, TWO_PASS):
            planner, raw, step, _ = make_planner(case, "numba", path=path, fast=fast)
            assert (planner._bound._fast is not None) == fast, "cuda.core launch path not built"
            planner.plan(**step)
            assert_same(outputs(raw), expected_outputs(case), case)


def test_no_compilation_after_warmup(nb):
    case = hand_case("expected_swa")
    planners = {path: make_planner(case, "numba", path=path)[:3] for path in (FUSED, TWO_PASS)}
    kernels = [k for p, _, _ in planners.values() for k in (p._bound._fused, p._bound._rows, p._bound._entries)]
    before = [len(k.overloads) for k in kernels]
    assert before == [1] * 6
    for path in (FUSED, TWO_PASS, FUSED):
        planner, raw, step = planners[path]
        planner.plan(**step)
        assert_same(outputs(raw), expected_outputs(case), case)
    assert [len(k.overloads) for k in kernels] == before


def test_buffers_on_another_device(nb):
    """Buffers on cuda:1 while cuda:0 is current: the plan runs where the buffers are, current device kept."""
    cupy = pytest.importorskip("cupy")
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    case = random_case(12, bs=(10, 20), lut=True, pool=True, capacity="loose", name="device-1")
    with cupy.cuda.Device(1):
        planner, raw, step, _ = make_planner(case, "cupy")
    assert planner.static.device_id == 1
    with cupy.cuda.Device(0):
        planner.plan(**step)
        assert cupy.cuda.runtime.getDevice() == 0
    with cupy.cuda.Device(1):
        cupy.cuda.Device(1).synchronize()
        got = {k: to_numpy(raw[k]) for k in OUTPUTS}
    assert_same(got, expected_outputs(case), case)
