"""Arrays the adapter refuses with a kv-canary message naming the argument and the fix, identical on every path:
negative strides (host NumPy, and on a GPU CuPy through both the cuda.core view and the attribute fast path),
non-dense torch tensors, writable memory imported through an unversioned DLPack capsule."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from helpers.plan_cases import make_case, make_plans, to_xp

from canary import CanaryPlanner, CanaryRecords, CanaryState, WritePlan, real_kv
from canary.interop.adapter import as_view

# --------------------------------------------------------------------------------------------------------------
# Negative strides

XPS = ["numpy", pytest.param("cupy", marks=pytest.mark.gpu)]


def _negative(name: str, strides: tuple) -> str:
    return f"kv-canary: {name}: expected non-negative strides, got element strides {strides}"


def _setup(xp: str):
    case = make_case("v", ((1, 3, 1, 8), (2, 2, 1, 8)), pool=True, W=2, C=8, R=4)
    vp, wp, raw = make_plans(case, xp)
    conv = lambda a: to_xp(a, xp)  # noqa: E731
    return case, dict(verify_plan_out=vp, write_plan_out=wp, **case.static_kwargs(conv)), case.step_kwargs(conv), raw


class _InterfaceOnly:
    """Only a CUDA Array Interface (no DLPack, no library of its own): the cuda.core view path on a GPU."""

    def __init__(self, a):
        self._a = a

    @property
    def __cuda_array_interface__(self):
        return self._a.__cuda_array_interface__


@pytest.mark.parametrize("xp", XPS)
@pytest.mark.parametrize("name, strides", [("req_to_token", (-11, 1)), ("full_to_swa_index_mapping", (-1,)),
                                           ("req_to_verify_expected_tokens", (-8, 1))])
def test_flipped_static_input(name, strides, xp):
    """req_to_token is a strided view (row stride 11): flipped, its row stride is -11."""
    _case, static, step, raw = _setup(xp)
    with pytest.raises(ValueError) as info:
        CanaryPlanner(**{**static, name: static[name][::-1]})
    assert str(info.value) == _negative(name, strides)


@pytest.mark.parametrize("xp", XPS)
@pytest.mark.parametrize("name", ["req_pool_indices", "prefix_lens", "extend_seq_lens",
                                  "req_to_verify_expected_tokens_valid_lens"])
def test_flipped_step_input(name, xp):
    """Step arrays: the host view, and on a GPU CuPy's attribute fast path (launch stream known)."""
    _case, static, step, raw = _setup(xp)
    planner = CanaryPlanner(**static)
    planner.plan(**step)
    with pytest.raises(ValueError) as info:
        planner.plan(**{**step, name: step[name][::-1]})
    assert str(info.value) == _negative(name, (-1,))


@pytest.mark.gpu
def test_flipped_interface_only_step_input():
    """The cuda.core StridedMemoryView path for a step array: the same message."""
    _case, static, step, raw = _setup("cupy")
    with pytest.raises(ValueError) as info:
        CanaryPlanner(**static).plan(**{**step, "prefix_lens": _InterfaceOnly(step["prefix_lens"][::-1])})
    assert str(info.value) == _negative("prefix_lens", (-1,))


@pytest.mark.parametrize("xp", XPS)
@pytest.mark.parametrize("field", ["verify_slot_indices", "write_offsets"])
def test_flipped_plan_output(field, xp):
    _case, static, step, raw = _setup(xp)
    plan = "verify_plan_out" if field.startswith("verify") else "write_plan_out"
    static[plan] = dataclasses.replace(static[plan], **{field: raw[field][::-1]})
    before = {k: np.asarray(to_numpy(v)).tobytes() for k, v in raw.items()}
    with pytest.raises(ValueError) as info:
        CanaryPlanner(**static)
    assert str(info.value) == _negative(f"{plan}.{field}", (-1,))
    assert {k: np.asarray(to_numpy(v)).tobytes() for k, v in raw.items()} == before


def to_numpy(a):
    from helpers.plan_cases import to_numpy as convert

    return convert(a)


@pytest.mark.parametrize("xp", XPS)
def test_flipped_real_kv_source(xp):
    kv = to_xp(np.zeros((8, 64), np.uint8), xp)[::-1]
    with pytest.raises(ValueError) as info:
        real_kv([(kv, 1, 64)])
    assert str(info.value) == _negative("real_kv_sources[0].array", (-64, 1))


@pytest.mark.parametrize("xp", XPS)
@pytest.mark.parametrize("field, strides", [("canary_buffer", (-32, 1)), ("ring", (-8, 1)),
                                            ("slot_run_counter", (-1,)), ("kernel_run_counter", (-1,))])
def test_flipped_state_array(field, strides, xp):
    device = "cpu" if xp == "numpy" else 0
    state = CanaryState.allocate(num_slots=8, ring_capacity=4, device=device)
    with pytest.raises(ValueError) as info:
        CanaryRecords(dataclasses.replace(state, **{field: getattr(state, field)[::-1]}))
    assert str(info.value) == _negative(f"state.{field}", strides)


@pytest.mark.parametrize("xp", XPS)
def test_flipped_records_call_array(xp):
    device = "cpu" if xp == "numpy" else 0
    canary = CanaryRecords(CanaryState.allocate(num_slots=8, device=device))
    i = lambda *v: to_xp(np.array(v, np.int64), xp)  # noqa: E731
    plan = WritePlan(write_offsets=i(0, 2), write_seed_slot_indices=i(-1),
                     write_num_valid_reqs=to_xp(np.array([1], np.int32), xp))
    with pytest.raises(ValueError) as info:
        canary.write(plan, out_cache_loc=i(2, 1)[::-1], input_ids=i(10, 11), positions=i(0, 1))
    assert str(info.value) == _negative("out_cache_loc", (-1,))


def test_length_one_flip_is_refused_alike():
    """One element: its stride is never used, but the rule is the same everywhere (no special case)."""
    with pytest.raises(ValueError) as info:
        as_view(np.zeros(1, np.int64)[::-1], "x")
    assert str(info.value) == _negative("x", (-1,))


# --------------------------------------------------------------------------------------------------------------
# Non-dense torch tensors


def _dense_message(name: str, layout: str) -> str:
    return f"kv-canary: {name}: expected a dense tensor (layout torch.strided), got layout {layout}: pass tensor.to_dense()"


@pytest.mark.parametrize("where", ["step", "static", "output", "records", "real_kv", "as_view"])
def test_sparse_tensor_is_refused(where):
    torch = pytest.importorskip("torch")
    sparse = lambda a: torch.from_numpy(np.asarray(a)).to_sparse()  # noqa: E731
    case, static, step, raw = _setup("numpy")
    with pytest.raises(ValueError) as info:
        if where == "step":
            CanaryPlanner(**static).plan(**{**step, "prefix_lens": sparse(step["prefix_lens"])})
        elif where == "static":
            CanaryPlanner(**{**static, "req_to_token": sparse(np.ascontiguousarray(case.req_to_token))})
        elif where == "output":
            vp = dataclasses.replace(static["verify_plan_out"], status=sparse(raw["status"]))
            CanaryPlanner(**{**static, "verify_plan_out": vp})
        elif where == "records":
            canary = CanaryRecords(CanaryState.allocate(num_slots=8))
            plan = WritePlan(write_offsets=np.array([0, 1], np.int64), write_seed_slot_indices=np.array([-1]),
                             write_num_valid_reqs=np.array([1], np.int32))
            canary.write(plan, out_cache_loc=sparse(np.array([1], np.int64)), input_ids=np.array([1]),
                         positions=np.array([0]))
        elif where == "real_kv":
            real_kv([(sparse(np.zeros((8, 64), np.uint8)), 1, 64)])
        else:
            as_view(sparse(np.zeros(3, np.int64)), "x")
    name = {"step": "prefix_lens", "static": "req_to_token", "output": "verify_plan_out.status",
            "records": "out_cache_loc", "real_kv": "real_kv_sources[0].array", "as_view": "x"}[where]
    assert str(info.value) == _dense_message(name, "torch.sparse_coo")


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_sparse_csr_tensor_is_refused():
    torch = pytest.importorskip("torch")
    csr = torch.zeros((3, 4), dtype=torch.int32).to_sparse_csr()
    with pytest.raises(ValueError) as info:
        as_view(csr, "req_to_token")
    assert str(info.value) == _dense_message("req_to_token", "torch.sparse_csr")


@pytest.mark.gpu
def test_sparse_cuda_tensor_is_refused_on_the_step_path():
    torch = pytest.importorskip("torch")
    _case, static, step, raw = _setup("cupy")
    prefix = torch.as_tensor(np.array([3, 2], np.int64), device="cuda").to_sparse()
    with pytest.raises(ValueError) as info:
        CanaryPlanner(**static).plan(**{**step, "prefix_lens": prefix})
    assert str(info.value) == _dense_message("prefix_lens", "torch.sparse_coo")


# --------------------------------------------------------------------------------------------------------------
# Writable memory through an unversioned DLPack capsule


class _Unversioned:
    """A CPU DLPack exporter of the old protocol: ``__dlpack__`` takes no ``max_version``."""

    def __init__(self, a: np.ndarray):
        self.a = a

    def __dlpack__(self, stream=None):
        return self.a.__dlpack__()

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()


class _Versioned(_Unversioned):
    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        return self.a.__dlpack__(stream=stream, max_version=max_version, dl_device=dl_device, copy=copy)


def test_unversioned_capsule_output_says_why_and_how():
    _case, static, step, raw = _setup("numpy")
    vp = dataclasses.replace(static["verify_plan_out"], status=_Unversioned(raw["status"]))
    with pytest.raises(ValueError) as info:
        CanaryPlanner(**{**static, "verify_plan_out": vp})
    assert str(info.value) == (
        "kv-canary: verify_plan_out.status: expected a writable output array, got a read-only one (it came through an "
        "unversioned DLPack capsule: _Unversioned.__dlpack__ hands out no DLPack >= 1.0 capsule, and an unversioned "
        "one carries no writable flag, so NumPy imports it read-only; pass an object whose __dlpack__ supports "
        "max_version >= (1, 0), or the NumPy, CuPy or torch array itself)")


def test_versioned_capsule_output_is_written_and_unversioned_inputs_are_fine():
    _case, static, step, raw = _setup("numpy")
    vp = dataclasses.replace(static["verify_plan_out"], status=_Versioned(raw["status"]))
    planner = CanaryPlanner(**{**static, "verify_plan_out": vp,
                               "req_to_verify_expected_tokens": _Unversioned(static["req_to_verify_expected_tokens"])})
    planner.plan(**{**step, "prefix_lens": _Unversioned(step["prefix_lens"])})
    assert raw["status"][0] == 0 and raw["verify_num_valid"][0] == 4


def test_really_read_only_memory_keeps_the_plain_message():
    _case, static, step, raw = _setup("numpy")
    frozen = raw["status"].copy()
    frozen.flags.writeable = False
    vp = dataclasses.replace(static["verify_plan_out"], status=_Versioned(frozen))
    with pytest.raises(ValueError) as info:
        CanaryPlanner(**{**static, "verify_plan_out": vp})
    assert str(info.value) == "kv-canary: verify_plan_out.status: expected a writable output array, got a read-only one"
