"""CUDA Array Interface versions 0-2 (no ``stream`` key: torch's own interface is version 2, and an engine's
buffer class often forwards it) accepted like version 3, as inputs and as outputs, eagerly and inside a CUDA
graph capture, on the CuPy and Numba backends: byte for byte the outputs of the same call on plain CuPy arrays.

cuda.core's viewer refuses anything below v3, so the adapter restates an older dict as v3 with
``"stream": None`` (no synchronisation: v2 names no stream). On the CPU: the restatement, its refusals, and
what the viewer is handed. On a GPU (marker ``gpu``): the views and the plans.
"""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from helpers.plan_cases import (
    BUFFERS, GPU_RANDOM_KNOBS, OUTPUTS, assert_same, expected_outputs, make_case, make_plans, poisoned_outputs,
    random_case, refill, run_case, to_numpy, to_xp,
)

from canary import CanaryPlanner, VerifyPlan, WritePlan, launch_canary_plan_kernels
from canary.interop.adapter import as_view, check_view, interface_target, normalized_interface


class CAIWrapper:
    """Only a CUDA Array Interface, version 2 (no ``stream`` key, no DLPack, no library of its own), over a CuPy
    array (CuPy exports v3) or a torch tensor (torch exports v2 today): what an engine's buffer class forwarding
    torch's interface shows."""

    def __init__(self, a, readonly: bool = False, version: int = 2):
        self._a = a
        cai = dict(a.__cuda_array_interface__)
        cai.pop("stream", None)
        cai["version"] = version
        if readonly:
            cai["data"] = (cai["data"][0], True)
        self._cai = cai

    @property
    def __cuda_array_interface__(self):
        return self._cai


# --------------------------------------------------------------------------------------------------------------
# CPU: the restatement as v3


def _v2(**over) -> dict:
    cai = {"shape": (4,), "typestr": "<i8", "data": (0x1000, False), "strides": None, "version": 2}
    cai.update(over)
    return cai


@pytest.mark.parametrize("version", [0, 1, 2, np.int64(2)])
def test_old_versions_restated_as_v3(version):
    cai = _v2(version=version, mask=None)
    before = dict(cai)
    got = normalized_interface("x", cai)
    assert got == {**before, "version": 3, "stream": None}
    assert cai == before  # the exporter's dict is left alone


@pytest.mark.parametrize("stream", [None, 1, 0x7F00])
def test_v3_is_handed_on_as_it_is(stream):
    cai = _v2(version=3, stream=stream)
    assert normalized_interface("x", cai) is cai


def test_a_stream_key_in_an_old_dict_is_not_trusted():
    """v2 defines no ``stream``: whatever an exporter put there, nothing is synchronised on it."""
    assert normalized_interface("x", _v2(stream=0x7F00))["stream"] is None


_PREFIX = "kv-canary: verify_plan_out.verify_slot_indices: expected "


@pytest.mark.parametrize("interface, message", [
    ([1, 2], "__cuda_array_interface__ to be a dict, got list"),
    ({k: v for k, v in _v2().items() if k != "version"},
     "a CUDA Array Interface version (an int >= 0), got no 'version' key"),
    (_v2(version="2"), "a CUDA Array Interface version (an int >= 0), got '2'"),
    (_v2(version=-1), "a CUDA Array Interface version (an int >= 0), got -1"),
    (_v2(version=True), "a CUDA Array Interface version (an int >= 0), got True"),
    (_v2(version=2.0), "a CUDA Array Interface version (an int >= 0), got 2.0"),
    ({k: v for k, v in _v2().items() if k != "data"},
     "a CUDA Array Interface with 'shape', 'typestr' and 'data', got version 2 without 'data'"),
    ({k: v for k, v in _v2(version=3).items() if k not in ("shape", "typestr")},
     "a CUDA Array Interface with 'shape', 'typestr' and 'data', got version 3 without 'shape', 'typestr'"),
    (_v2(data=None), "CUDA Array Interface 'data' to be (pointer, read-only flag), got None"),
    (_v2(data=(0x1000,)), "CUDA Array Interface 'data' to be (pointer, read-only flag), got (4096,)"),
    (_v2(data=("0x1000", False)), "CUDA Array Interface 'data' to be (pointer, read-only flag), got ('0x1000', False)"),
])
def test_bad_interfaces_refused(interface, message):
    with pytest.raises(ValueError) as info:
        normalized_interface("verify_plan_out.verify_slot_indices", interface)
    assert str(info.value) == _PREFIX + message


class _Raw:
    """Whatever dict it is given, as its interface (no DLPack)."""

    def __init__(self, cai):
        self.__cuda_array_interface__ = cai


class _Raising:
    @property
    def __cuda_array_interface__(self):
        raise RuntimeError("freed")


def test_interface_target():
    v3 = _Raw(_v2(version=3, stream=None))
    assert interface_target("x", v3) is v3
    old = _Raw(_v2())
    shim = interface_target("x", old)
    assert shim is not old and shim.exporter is old  # keeps the exporter (and its memory) alive
    assert shim.__cuda_array_interface__ == {**_v2(), "version": 3, "stream": None}
    with pytest.raises(ValueError) as info:
        interface_target("x", _Raising())
    assert str(info.value) == ("kv-canary: x: expected a readable __cuda_array_interface__, got _Raising whose "
                               "property raised RuntimeError: freed")


def _host_plan_arrays():
    """A valid plan on NumPy (the reference backend), except what a test replaces."""
    case = make_case("v", ((1, 3, 1, 8), (2, 2, 1, 8)), pool=True, W=2, C=8, R=4)
    vp, wp, _raw = make_plans(case, "numpy")
    return case.static_kwargs(), case.step_kwargs(), vp, wp


def _has_cuda_core() -> bool:
    try:
        return importlib.util.find_spec("cuda.core") is not None
    except ModuleNotFoundError:  # no "cuda" namespace at all
        return False


# Without cuda-core no CUDA array is viewed at all: the call says so first ("needs cuda-core"), before any check
# of the interface's contents.
needs_cuda_core = pytest.mark.skipif(not _has_cuda_core(), reason="needs cuda-core (the interface is read by it)")


@needs_cuda_core
@pytest.mark.parametrize("field", ["verify_slot_indices", "status"])
def test_a_bad_output_interface_is_named_by_the_call(field):
    static, step, vp, wp = _host_plan_arrays()
    bad = _Raw({k: v for k, v in _v2().items() if k != "data"})
    vp = VerifyPlan(**{**vars(vp), field: bad})
    with pytest.raises(ValueError) as info:
        launch_canary_plan_kernels(verify_plan_out=vp, write_plan_out=wp, **static, **step)
    assert str(info.value) == (f"kv-canary: verify_plan_out.{field}: expected a CUDA Array Interface with 'shape', "
                               f"'typestr' and 'data', got version 2 without 'data'")


@needs_cuda_core
def test_a_bad_input_interface_is_named_by_the_call():
    static, step, vp, wp = _host_plan_arrays()
    bad = _Raw(_v2(version="two"))
    with pytest.raises(ValueError) as info:
        CanaryPlanner(verify_plan_out=vp, write_plan_out=wp, **{**static, "req_to_token": bad})
    assert str(info.value) == ("kv-canary: req_to_token: expected a CUDA Array Interface version (an int >= 0), "
                               "got 'two'")


class _Viewer:
    """cuda.core's ``StridedMemoryView`` as far as the CUDA Array Interface goes (its refusal of v0-v2 too),
    over host memory: records what it is handed."""

    seen: list = []

    def __init__(self, cai, obj):
        ptr, self.readonly = cai["data"]
        self.ptr, self.shape, self.dtype, self.device_id = ptr, tuple(cai["shape"]), np.dtype(cai["typestr"]), 0
        strides = cai.get("strides")
        self.strides = None if strides is None else tuple(s // self.dtype.itemsize for s in strides)

    @classmethod
    def from_any_interface(cls, obj, stream_ptr=None):
        cai = obj.__cuda_array_interface__
        if cai["version"] < 3:
            raise BufferError("only CUDA Array Interface v3 or above is supported")
        cls.seen.append((obj, cai, stream_ptr))
        return cls(cai, obj)


@pytest.fixture
def viewer(monkeypatch):
    utils = pytest.importorskip("cuda.core.utils")
    monkeypatch.setattr(utils, "StridedMemoryView", _Viewer)
    _Viewer.seen = []
    return _Viewer


def _host_cai(a: np.ndarray, version: int, readonly: bool = False) -> _Raw:
    strides = None if a.flags.c_contiguous else a.strides
    return _Raw({"shape": a.shape, "typestr": a.dtype.str, "data": (a.ctypes.data, readonly), "strides": strides,
                 "version": version})


@pytest.mark.parametrize("version", [0, 1, 2, 3])
def test_the_viewer_is_handed_v3(viewer, version):
    """Every check past the restatement is the viewer's, read off the same keys: shape, dtype, strides, the
    read-only flag, the device."""
    base = np.zeros((4, 11), np.int32)
    a = base[:, :8]  # a row stride (11) above the row length: strides are kept
    obj = _host_cai(a, version)
    v = check_view(as_view(obj, "req_to_token", stream_ptr=7), dtype=np.int32, ndim=2)
    assert (v.ptr, v.shape, v.strides, v.dtype, v.device_id, v.readonly) == (a.ctypes.data, (4, 8), (11, 1),
                                                                             np.dtype(np.int32), 0, False)
    assert v.owner is obj  # the caller's object, never the restatement
    (handed, cai, stream_ptr), = viewer.seen
    assert cai["version"] == 3 and stream_ptr == 7
    if version == 3:
        assert handed is obj
    else:
        assert handed is not obj and cai["stream"] is None  # nothing to synchronise on


@pytest.mark.parametrize("version", [2, 3])
def test_the_read_only_flag_is_kept(viewer, version):
    obj = _host_cai(np.zeros(4, np.int64), version, readonly=True)
    v = as_view(obj, "verify_plan_out.status")
    assert v.readonly
    with pytest.raises(ValueError, match="^kv-canary: verify_plan_out.status: expected a writable output array, "
                                         "got a read-only one$"):
        check_view(v, dtype=np.int64, ndim=1, writable=True)


def test_the_real_viewer_no_longer_refuses_v2():
    """With cuda.core itself (no GPU here): a v2 object gets as far as a v3 one (the driver), not refused."""
    pytest.importorskip("cuda.core.utils")
    a = np.zeros(4, np.int64)
    for version in (2, 3):
        try:
            as_view(_host_cai(a, version), "x", stream_ptr=-1)
        except Exception as exc:  # noqa: BLE001 - no driver on a CPU machine; a host pointer on a GPU one
            assert "v3 or above" not in str(exc), exc


# --------------------------------------------------------------------------------------------------------------
# GPU: views, eager plans, captured plans

BACKENDS = ["cupy", "numba"]  # the shared ``backend`` fixture (tests/conftest.py)
WRAPPED = ["inputs", "outputs", "both"]
CASES = [random_case(seed, name=f"cai2-{seed}", **knobs) for seed, knobs in enumerate(GPU_RANDOM_KNOBS)]


def _wrap_plans(vp, wp, wrap):
    vp = VerifyPlan(**{k: None if v is None else wrap(v) for k, v in vars(vp).items()})
    wp = WritePlan(**{k: wrap(v) for k, v in vars(wp).items()})
    return vp, wp


def _wrapped_run(case, backend: str, api: str, wrapped: str, xp: str = "cupy"):
    """``run_case`` with the inputs, the outputs or both handed over as v2-only objects."""
    vp, wp, raw = make_plans(case, xp)
    if wrapped in ("outputs", "both"):
        vp, wp = _wrap_plans(vp, wp, CAIWrapper)
    conv = (lambda a: CAIWrapper(to_xp(a, xp))) if wrapped in ("inputs", "both") else (lambda a: to_xp(a, xp))
    static, step = case.static_kwargs(conv), case.step_kwargs(conv)
    if api == "planner":
        planner = CanaryPlanner(backend=backend, verify_plan_out=vp, write_plan_out=wp,
                                verify_capacity=case.verify_capacity, max_batch_size=case.max_batch_size, **static)
        planner.warmup()
        planner.plan(**step)
    else:
        launch_canary_plan_kernels(verify_plan_out=vp, write_plan_out=wp, verify_capacity=case.verify_capacity,
                                   backend=backend, **static, **step)
    return {name: to_numpy(raw[name]) for name in BUFFERS}


@pytest.mark.gpu
@pytest.mark.parametrize("version", [0, 1, 2])
def test_views_equal_cupys(version):
    cupy = pytest.importorskip("cupy")
    base = cupy.zeros((6, 11), dtype=cupy.int32)
    for a in (base, base[:, :8], cupy.arange(5, dtype=cupy.int64)):
        want, got = as_view(a, "a"), as_view(CAIWrapper(a, version=version), "a")
        assert (got.ptr, got.shape, got.strides, got.dtype, got.device_id, got.readonly) == (
            want.ptr, want.shape, want.strides, want.dtype, want.device_id, False)
    ro = as_view(CAIWrapper(base, readonly=True), "verify_plan_out.status")
    assert ro.readonly


@pytest.mark.gpu
def test_a_read_only_v2_output_is_refused(backend):
    cupy = pytest.importorskip("cupy")
    case = CASES[0]
    vp, wp, raw = make_plans(case, "cupy")
    vp = VerifyPlan(**{**vars(vp), "status": CAIWrapper(raw["status"], readonly=True)})
    with pytest.raises(ValueError, match="^kv-canary: verify_plan_out.status: expected a writable output array, "
                                         "got a read-only one$"):
        launch_canary_plan_kernels(verify_plan_out=vp, write_plan_out=wp, verify_capacity=case.verify_capacity,
                                   backend=backend, **case.static_kwargs(cupy.asarray),
                                   **case.step_kwargs(cupy.asarray))


@pytest.mark.gpu
@pytest.mark.parametrize("wrapped", WRAPPED)
@pytest.mark.parametrize("api", ["planner", "launch"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_eager_plan_equals_cupys(backend, case, api, wrapped):
    want = run_case(case, backend, "cupy", api=api)
    assert_same(want, expected_outputs(case), case)
    assert_same(_wrapped_run(case, backend, api, wrapped), want, case)


@pytest.mark.gpu
@pytest.mark.parametrize("wrapped", WRAPPED)
def test_torch_v2_interface_forwarded(backend, wrapped):
    """torch tensors' interface handed over by a library-less object: eager, then inside a ``torch.cuda.graph``
    capture on its side stream."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    case = CASES[1]
    for api in ("planner", "launch"):
        want = run_case(case, backend, "torch_cuda", api=api)
        assert_same(_wrapped_run(case, backend, api, wrapped, xp="torch_cuda"), want, case)
    _captured_roundtrip(backend, wrapped, "torch")


def _capture(planner, step, library: str):
    """A replay function for ``planner.plan(**step)`` captured by ``library``'s graph API on a side stream."""
    if library == "torch":
        import torch

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            planner.plan(**step, stream=side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            planner.plan(**step, stream=side)
        return lambda: (graph.replay(), torch.cuda.synchronize())
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        planner.plan(**step, stream=stream)
        stream.synchronize()
        stream.begin_capture()
        try:
            planner.plan(**step, stream=stream)
        finally:
            graph = stream.end_capture()
    return lambda: (graph.launch(stream), stream.synchronize())


def _fill(dst, src: np.ndarray, xp: str) -> None:
    if xp == "torch_cuda":
        import torch

        dst.copy_(torch.from_numpy(np.ascontiguousarray(src)))
    else:
        import cupy

        dst[...] = cupy.asarray(src)


def _captured_roundtrip(backend: str, wrapped: str, library: str) -> None:
    """Capture a plan over v2-wrapped arrays, refill the arrays in place, replay: each replay equals the
    reference run (byte for byte) on the refilled inputs."""
    xp = "torch_cuda" if library == "torch" else "cupy"
    rng = np.random.default_rng(3)
    case = random_case(3, bs=(24, 24), max_reqs=(30, 30), max_seq_len=(64, 64), lut=True, pool=True, swa=True,
                       capacity="loose", strided_r2t=True, name="cai2-graph")
    case = refill(case.replace(verify_capacity=24 * 64), rng)
    vp, wp, raw = make_plans(case, xp)
    if wrapped in ("outputs", "both"):
        vp, wp = _wrap_plans(vp, wp, CAIWrapper)
    plain_static, plain_step = case.static_kwargs(lambda a: to_xp(a, xp)), case.step_kwargs(lambda a: to_xp(a, xp))
    pick = (lambda a: None if a is None else CAIWrapper(a)) if wrapped in ("inputs", "both") else (lambda a: a)
    static = {k: pick(v) if k in ("req_to_token", "full_to_swa_index_mapping", "req_to_verify_expected_tokens")
              else v for k, v in plain_static.items()}
    step = {k: pick(v) for k, v in plain_step.items()}
    planner = CanaryPlanner(backend=backend, verify_plan_out=vp, write_plan_out=wp, **static)
    planner.warmup()
    replay = _capture(planner, step, library)
    for _ in range(3):
        new = refill(case, rng)
        _fill(plain_static["req_to_token"], new.req_to_token, xp)
        for key, arr in new.step_kwargs().items():
            _fill(plain_step[key], arr, xp)
        poisoned = poisoned_outputs(case)
        for k in OUTPUTS:
            _fill(raw[k], poisoned[k], xp)
        if xp == "torch_cuda":
            import torch

            torch.cuda.synchronize()
        else:
            import cupy

            cupy.cuda.Device().synchronize()
        cursors = to_numpy(raw["verify_cursors"])  # what this replay starts from (sampled steps advance it)
        replay()
        want = expected_outputs(new.replace(cursors=cursors))
        assert_same({k: to_numpy(raw[k]) for k in OUTPUTS}, {k: want[k] for k in OUTPUTS}, new)


@pytest.mark.gpu
@pytest.mark.parametrize("wrapped", WRAPPED)
def test_cupy_graph_capture(backend, wrapped):
    pytest.importorskip("cupy")
    _captured_roundtrip(backend, wrapped, "cupy")
