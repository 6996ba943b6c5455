"""``canary.to_host`` (canary/interop/hostcopy.py) on host arrays, and ``check=True`` with torch CPU tensors (the
planner reads the status and the offending row back through ``to_host``)."""
from __future__ import annotations

import numpy as np
import pytest
from helpers.plan_cases import expected_outputs, make_case, make_plans, to_numpy, to_xp

from canary import CanaryInputError, CanaryPlanner, PlanStatus, launch_canary_plan_kernels, to_host


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


class CpuDLPackOnly:
    """Exposes a NumPy array through DLPack only (no ``__array_interface__``, not a NumPy or torch type)."""

    def __init__(self, a: np.ndarray):
        self._a = a

    def __dlpack__(self, **kwargs):
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return (1, 0)  # kDLCPU


class CopyToHost:
    """A Numba-device-array look-alike: ``copy_to_host()`` is the only way to read it."""

    def __init__(self, a: np.ndarray):
        self._a = a
        self.calls = 0

    def copy_to_host(self):
        self.calls += 1
        return self._a.copy()



@pytest.mark.parametrize("obj, want", [([1, 2], np.array([1, 2])), (7, np.array(7)), ([], np.array([]))])
def test_host_objects_come_back_as_numpy_without_asking_a_gpu_library(obj, want, monkeypatch):
    """A list or a scalar is host data: no CuPy or Numba import (a fresh install has neither: ``check()`` on such
    a status raised ModuleNotFoundError instead of its kv-canary error)."""
    import builtins

    real_import = builtins.__import__

    def no_gpu_libraries(name, *args, **kwargs):
        if name.split(".")[0] in ("cupy", "numba"):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_gpu_libraries)
    got = to_host(obj)
    assert isinstance(got, np.ndarray) and np.array_equal(got, want)

def test_numpy_is_returned_as_is():
    a = np.arange(5, dtype=np.int64)
    assert to_host(a) is a  # already host memory: no copy


def test_torch_cpu_tensor(torch):
    t = torch.tensor([3, -1, 7], dtype=torch.int32)
    h = to_host(t)
    assert isinstance(h, np.ndarray) and h.dtype == np.int32 and h.tolist() == [3, -1, 7]
    g = torch.tensor([0.5, 1.5], requires_grad=True)  # detached first: numpy() refuses tensors that need grad
    h = to_host(g)
    assert h.dtype == np.float32 and h.tolist() == [0.5, 1.5]


def test_cpu_dlpack_only_object():
    a = np.array([[1, 2], [3, 4]], dtype=np.int64)
    h = to_host(CpuDLPackOnly(a))
    assert isinstance(h, np.ndarray) and h.dtype == np.int64 and h.tolist() == [[1, 2], [3, 4]]


def test_copy_to_host_object():
    a = np.array([9, 8], dtype=np.int32)
    obj = CopyToHost(a)
    h = to_host(obj)
    assert obj.calls == 1 and h.tolist() == [9, 8] and h.dtype == np.int32


# --------------------------------------------------------------------------------------------------------------
# check=True with torch CPU tensors (inputs and outputs)


def _torch_plan(case, *, api: str):
    vp, wp, raw = make_plans(case, "torch")
    conv = lambda a: to_xp(a, "torch")  # noqa: E731
    kwargs = dict(verify_plan_out=vp, write_plan_out=wp, **case.static_kwargs(conv))
    step = case.step_kwargs(conv)
    if api == "launch":
        return launch_canary_plan_kernels(**kwargs, **step, check=True), raw
    return CanaryPlanner(**kwargs).plan(**step, check=True), raw


@pytest.mark.parametrize("api", ["planner", "launch"])
def test_check_true_with_torch_cpu_ok_and_overflow(torch, api):
    ok = make_case("ok", [(1, 3, 1), (2, 2, 1)])
    status, raw = _torch_plan(ok, api=api)
    assert status == PlanStatus.OK
    assert {k: to_numpy(v).tolist() for k, v in raw.items()} == {k: v.tolist() for k, v in expected_outputs(ok).items()}
    over = make_case("over", [(1, 3, 1), (2, 2, 1)], C=4, on_overflow="skip")
    status, raw = _torch_plan(over, api=api)
    assert status == PlanStatus.OVERFLOW
    assert (int(raw["enable"][0]), int(raw["verify_num_valid"][0])) == (0, 4)
    sampled = make_case("sampled", [(1, 3, 1), (2, 2, 1)], C=4)
    status, raw = _torch_plan(sampled, api=api)
    assert status == PlanStatus.SAMPLED
    assert (int(raw["enable"][0]), int(raw["verify_num_valid"][0])) == (1, 4)


@pytest.mark.parametrize("api", ["planner", "launch"])
def test_check_true_with_torch_cpu_names_the_row(torch, api):
    # Row 2 has a req_pool_index past req_to_token's 6 rows; row 3 a prefix past its 8 columns (and no new
    # tokens, which would also set BAD_EXTEND_LEN).
    case = make_case("bad", [(1, 2, 1), (2, 1, 1), (6, 2, 1), (3, 99, 0)], expect_status=None)
    msg = (r"^kv-canary: status: expected no input-error bits, got 6 \(BAD_REQ_POOL_INDEX\|BAD_PREFIX_LEN\); "
           r"first offending batch row: 2$")
    with pytest.raises(CanaryInputError, match=msg):
        _torch_plan(case, api=api)
    vp, wp, raw = make_plans(case, "torch")
    conv = lambda a: to_xp(a, "torch")  # noqa: E731
    with pytest.raises(CanaryInputError) as info:
        CanaryPlanner(verify_plan_out=vp, write_plan_out=wp, **case.static_kwargs(conv)).plan(
            **case.step_kwargs(conv), check=True)
    assert info.value.status == PlanStatus.BAD_REQ_POOL_INDEX | PlanStatus.BAD_PREFIX_LEN
    assert info.value.first_bad_row == 2
    assert (int(raw["status"][0]), int(raw["enable"][0])) == (6, 0)  # the plan was still built, in the tensors
