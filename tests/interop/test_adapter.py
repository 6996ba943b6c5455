"""The array adapter (``as_view`` / ``check_view``) with NumPy and torch CPU inputs and outputs, and the import
footprint of ``import canary``."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from helpers.plan_cases import (
    OUTPUTS,
    POISON_ALT,
    VERIFY_FIELDS,
    assert_same,
    expected_outputs,
    hand_case,
    hand_cases,
    make_plans,
    random_case,
    run_case,
    to_xp,
)

from canary import CanaryPlanner, VerifyPlan, WritePlan, launch_canary_plan_kernels
from canary.interop.adapter import HOST, as_view, check_view

HAND = hand_cases()


# --------------------------------------------------------------------------------------------------------------
# NumPy views


def test_numpy_view_is_zero_copy():
    a = np.arange(10, dtype=np.int64)
    v = check_view(as_view(a, "a"), dtype=np.int64, ndim=1, length=10, writable=True)
    assert v.ptr == a.ctypes.data and v.host is a and v.owner is a
    assert (v.shape, v.strides, v.device_id, v.readonly, v.on_device, v.where) == ((10,), (1,), HOST, False, False,
                                                                                   "host memory")


def test_numpy_strided_2d_view():
    base = np.zeros((4, 11), np.int32)
    v = check_view(as_view(base[:, :8], "req_to_token"), dtype=np.int32, ndim=2)
    assert v.shape == (4, 8) and v.strides == (11, 1) and v.ptr == base.ctypes.data
    sub = base[1:, 2:7]
    v = check_view(as_view(sub, "x"), dtype=np.int32, ndim=2)
    assert v.ptr == base.ctypes.data + 4 * (11 + 2) and v.strides == (11, 1)


def test_numpy_read_only_refused_as_output_only():
    a = np.zeros(4, np.int64)
    a.flags.writeable = False
    check_view(as_view(a, "input"), dtype=np.int64, ndim=1)  # fine as an input
    with pytest.raises(ValueError, match=r"^kv-canary: out: expected a writable output array, got a read-only one"):
        check_view(as_view(a, "out"), dtype=np.int64, ndim=1, writable=True)


def test_array_interface_object():
    class Exporter:
        def __init__(self, a):
            self._a = a
            self.__array_interface__ = a.__array_interface__

    a = np.arange(6, dtype=np.int64)
    v = as_view(Exporter(a), "x")
    assert v.ptr == a.ctypes.data and v.shape == (6,)
    ro = np.arange(6, dtype=np.int64)
    ro.flags.writeable = False
    assert as_view(Exporter(ro), "x").readonly


@pytest.mark.parametrize("make,msg", [
    (lambda: np.zeros(6, np.int64)[::2], "expected a unit inner stride, got stride 2 elements"),
    (lambda: np.zeros((3, 8), np.int64)[:, ::4], "expected a unit inner stride, got stride 4 elements"),
    (lambda: np.zeros(6, np.int64)[::-1], r"expected non-negative strides, got element strides \(-1,\)"),
    (lambda: np.zeros((3, 4), np.int64).T, "expected a unit inner stride, got stride 4 elements"),
])
def test_numpy_non_unit_inner_stride(make, msg):
    with pytest.raises(ValueError, match="^kv-canary: x: " + msg):
        check_view(as_view(make(), "x"), dtype=np.int64, ndim=make().ndim)


@pytest.mark.parametrize("make,shape,strides", [
    (lambda: np.zeros(1, np.int64)[::1], (1,), (1,)),
    (lambda: np.zeros(0, np.int64), (0,), None),  # zero-size: NumPy's strides (version-dependent), in elements
    (lambda: np.zeros((1, 5), np.int32), (1, 5), (5, 1)),
    (lambda: np.zeros((5, 1), np.int32), (5, 1), (1, 1)),
    (lambda: np.zeros((3, 0), np.int32), (3, 0), None),
], ids=["len1", "len0", "1x5", "5x1", "3x0"])
def test_degenerate_shapes_accepted(make, shape, strides):
    a = make()
    length = a.shape[0] if a.ndim == 1 else None
    v = check_view(as_view(a, "x"), dtype=a.dtype, ndim=a.ndim, length=length, writable=True)
    if strides is None:
        strides = tuple(s // a.itemsize for s in a.strides)
    assert v.ptr == a.ctypes.data and v.host is a and v.owner is a
    assert (v.name, v.shape, v.strides, v.dtype, v.device_id, v.readonly) == ("x", shape, strides, a.dtype, HOST,
                                                                              False)


def test_check_view_type_and_shape_errors():
    v = as_view(np.zeros((2, 3), np.int32), "req_to_token")
    with pytest.raises(TypeError, match="^kv-canary: req_to_token: expected dtype int64, got int32$"):
        check_view(v, dtype=np.int64, ndim=2)
    with pytest.raises(ValueError, match=r"^kv-canary: req_to_token: expected a 1-D array, got shape \(2, 3\)$"):
        check_view(v, dtype=np.int32, ndim=1)
    with pytest.raises(ValueError, match="^kv-canary: req_to_token: expected length 5, got 2$"):
        check_view(v, dtype=np.int32, ndim=2, length=5)


def test_as_view_rejects_non_arrays():
    for obj in ([1, 2], 3, None, "x", memoryview(b"abcd")):
        with pytest.raises(ValueError, match="^kv-canary: thing: expected an array"):
            as_view(obj, "thing")


def test_numpy_plan_writes_callers_arrays():
    case = hand_case("bs1_decode")
    vp, wp, raw = make_plans(case)
    ids = {k: id(v) for k, v in raw.items()}
    CanaryPlanner(verify_plan_out=vp, write_plan_out=wp, **case.static_kwargs()).plan(**case.step_kwargs())
    assert all(getattr(vp if k in VERIFY_FIELDS else wp, k) is raw[k] for k in OUTPUTS)
    assert {k: id(v) for k, v in raw.items()} == ids
    assert raw["verify_slot_indices"].tolist() == [101, 102, 103]


# --------------------------------------------------------------------------------------------------------------
# torch CPU tensors


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


def test_torch_view_is_zero_copy(torch):
    t = torch.arange(10, dtype=torch.int64)
    v = check_view(as_view(t, "t"), dtype=np.int64, ndim=1, writable=True)
    assert v.ptr == t.data_ptr() and v.device_id == HOST and not v.readonly and v.owner is t
    v.host[3] = -7
    assert int(t[3]) == -7


def test_torch_strided_req_to_token_view(torch):
    base = torch.zeros((6, 13), dtype=torch.int32)
    r2t = base[:, :8]
    v = check_view(as_view(r2t, "req_to_token"), dtype=np.int32, ndim=2)
    assert v.strides == (13, 1) and v.ptr == base.data_ptr()


def test_torch_non_unit_inner_stride_refused(torch):
    t = torch.zeros((6, 16), dtype=torch.int32)[:, ::2]
    with pytest.raises(ValueError, match="^kv-canary: req_to_token: expected a unit inner stride, got stride 2"):
        check_view(as_view(t, "req_to_token"), dtype=np.int32, ndim=2)
    out = torch.zeros(8, dtype=torch.int64)[::2]
    with pytest.raises(ValueError, match="unit inner stride"):
        check_view(as_view(out, "o"), dtype=np.int64, ndim=1, writable=True)


def test_torch_dtype_refused(torch):
    with pytest.raises(TypeError, match="^kv-canary: lut: expected dtype int64, got int32$"):
        check_view(as_view(torch.zeros(4, dtype=torch.int32), "lut"), dtype=np.int64, ndim=1)


@pytest.mark.parametrize("case", HAND, ids=lambda c: c.name)
def test_torch_hand_cases(torch, case):
    want = expected_outputs(case)
    assert_same(run_case(case, "reference", "torch"), want, case)
    assert_same(run_case(case, "auto", "torch", api="launch"), want, case)


def test_torch_random_cases(torch):
    rng = np.random.default_rng(11)
    for _ in range(40):
        case = random_case(rng, fault_prob=0.1, strided_r2t=True)
        assert_same(run_case(case, "reference", "torch", POISON_ALT), expected_outputs(case, POISON_ALT), case)


def test_torch_outputs_show_the_result_zero_copy(torch):
    case = hand_case("swa_p_full")
    conv = lambda a: to_xp(a, "torch")
    vp = VerifyPlan(
        verify_slot_indices=torch.full((case.verify_capacity,), 7, dtype=torch.int64),
        verify_expected_tokens=torch.full((case.verify_capacity,), 7, dtype=torch.int64),
        verify_expected_positions=torch.full((case.verify_capacity,), 7, dtype=torch.int64),
        verify_prev_slot_indices=torch.full((case.verify_capacity,), 7, dtype=torch.int64),
        verify_num_valid=torch.zeros(1, dtype=torch.int32),
        enable=torch.zeros(1, dtype=torch.int32),
        status=torch.full((1,), 99, dtype=torch.int32),
        verify_cursors=torch.zeros(case.req_to_token.shape[0], dtype=torch.int64),
    )
    wp = WritePlan(write_offsets=torch.full((case.write_req_capacity + 1,), 7, dtype=torch.int64),
                   write_seed_slot_indices=torch.full((case.write_req_capacity,), 7, dtype=torch.int64),
                   write_num_valid_reqs=torch.zeros(1, dtype=torch.int32))
    static = case.static_kwargs(conv)
    assert static["req_to_token"].stride() == (case.max_seq_len + 3, 1)  # a strided torch view
    planner = CanaryPlanner(verify_plan_out=vp, write_plan_out=wp, **static)
    planner.plan(**case.step_kwargs(conv))
    want = expected_outputs(case)
    assert vp.verify_slot_indices.tolist() == want["verify_slot_indices"].tolist()
    assert vp.verify_prev_slot_indices.tolist() == [10205, 10206, 10207, 10302, 10303, 10304]
    assert (int(vp.verify_num_valid), int(vp.enable), int(vp.status)) == (6, 1, 0)
    assert wp.write_offsets.tolist() == [0, 2, 3, 4, 0, 0]
    assert wp.write_seed_slot_indices.tolist() == [10208, -1, 10305, 7, 7]
    assert int(wp.write_num_valid_reqs) == 3
    # again through the launch API, with torch inputs built in place (a caller refilling its buffers)
    vp.status.fill_(55)
    launch_canary_plan_kernels(verify_plan_out=vp, write_plan_out=wp, **static, **case.step_kwargs(conv))
    assert int(vp.status) == 0


def test_torch_mixed_with_numpy(torch):
    """torch CPU outputs with NumPy inputs (and the reverse) are all host memory: accepted."""
    case = hand_case("expected_off_plus1")
    vp, wp, raw = make_plans(case, "torch")
    CanaryPlanner(verify_plan_out=vp, write_plan_out=wp, **case.static_kwargs()).plan(**case.step_kwargs())
    assert vp.verify_expected_tokens.tolist() == expected_outputs(case)["verify_expected_tokens"].tolist()
    vp, wp, raw = make_plans(case, "numpy")
    conv = lambda a: to_xp(a, "torch")
    CanaryPlanner(verify_plan_out=vp, write_plan_out=wp, **case.static_kwargs(conv)).plan(**case.step_kwargs(conv))
    assert_same(raw, expected_outputs(case))


def test_torch_inputs_wrong_dtype_and_shape(torch):
    case = hand_case("bs1_decode")
    vp, wp, _ = make_plans(case, "torch")
    planner = CanaryPlanner(verify_plan_out=vp, write_plan_out=wp, **case.static_kwargs(lambda a: to_xp(a, "torch")))
    step = case.step_kwargs(lambda a: to_xp(a, "torch"))
    with pytest.raises(TypeError, match="^kv-canary: prefix_lens: expected dtype int32 or int64, got int16$"):
        planner.plan(**{**step, "prefix_lens": step["prefix_lens"].to(torch.int16)})
    with pytest.raises(ValueError, match="^kv-canary: extend_seq_lens: expected length 1, got 2$"):
        planner.plan(**{**step, "extend_seq_lens": torch.ones(2, dtype=torch.int64)})


# --------------------------------------------------------------------------------------------------------------
# Import footprint


HEAVY = ("torch", "cupy", "cupy_backends", "numba", "jax", "jaxlib", "cuda")


def _modules_after(code: str) -> list[str]:
    script = "\n".join([
        "import json, sys",
        textwrap.dedent(code),
        f"heavy = {HEAVY!r}",
        'print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in heavy)))',
    ])
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_import_canary_imports_no_gpu_or_torch_library():
    assert _modules_after("import canary") == []


def test_reference_plan_imports_no_gpu_or_torch_library():
    code = """
        import numpy as np
        import canary
        vp = canary.VerifyPlan.allocate(verify_capacity=4, max_reqs=4)
        wp = canary.WritePlan.allocate(write_req_capacity=2)
        r2t = np.arange(32, dtype=np.int32).reshape(4, 8)
        one = np.ones(1, dtype=np.int64)
        canary.launch_canary_plan_kernels(verify_plan_out=vp, write_plan_out=wp, req_to_token=r2t,
                                          req_pool_indices=one, prefix_lens=one * 2, extend_seq_lens=one,
                                          check=True)
        assert vp.verify_slot_indices[:2].tolist() == [8, 9], vp
    """
    assert _modules_after(code) == []


class _PinnedExport:
    """An exporter of pinned host memory (DLPack kDLCUDAHost = 3), as torch's pin_memory tensors report it: it
    exports only when asked for the CPU (NumPy 2.1's ``device="cpu"``)."""

    def __init__(self, arr):
        self.arr = arr

    def __dlpack_device__(self):
        return (3, 0)

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        if dl_device is None or dl_device[0] != 1:
            raise BufferError("pinned memory: ask for the CPU")
        return self.arr.__dlpack__(max_version=max_version, dl_device=dl_device, copy=copy)


def test_pinned_host_memory_is_viewed_as_host_memory():
    # transformers pins a CPU engine's buffers whenever a GPU is present: the reference backend reads them in place
    arr = np.arange(6, dtype=np.int64)
    view = as_view(_PinnedExport(arr), "kv_indices")
    assert view.device_id == HOST and view.shape == (6,) and view.host.ctypes.data == arr.ctypes.data


@pytest.mark.gpu
def test_a_pinned_torch_tensor_is_a_host_view():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device for torch")
    t = torch.arange(6, dtype=torch.int64).pin_memory()
    view = as_view(t, "kv_indices")
    assert view.device_id == HOST and view.host.ctypes.data == t.data_ptr() and view.host.tolist() == list(range(6))
