"""Host-side validation (SPEC 3.3) and the status checks (SPEC 3.4): exception types and messages."""
from __future__ import annotations

import itertools
import re
import sys

import numpy as np
import pytest
from helpers.plan_cases import (
    OUTPUTS,
    POISON,
    VERIFY_FIELDS,
    WRITE_FIELDS,
    assert_same,
    expected_outputs,
    make_case,
    make_plans,
    poisoned_outputs,
    std_lut,
    std_pool,
    std_r2t,
)

from canary import (
    BackendUnavailableError,
    CanaryInputError,
    CanaryPlanner,
    PlanStatus,
    VerifyPlan,
    WritePlan,
    launch_canary_plan_kernels,
)
from canary.interop.adapter import ArrayView

C, R = 8, 4


def setup(rows=((1, 3, 1, 8), (2, 2, 1, 8)), *, pool=True, W=2, **kw):
    """A valid planner setup: (case, static kwargs incl. plans, step kwargs, raw output arrays)."""
    case = make_case("v", rows, pool=pool, W=W, C=kw.pop("C", C), R=kw.pop("R", R), **kw)
    vp, wp, raw = make_plans(case)
    static = dict(verify_plan_out=vp, write_plan_out=wp, **case.static_kwargs())
    return case, static, case.step_kwargs(), raw


def raises(exc_type, fn, *needles, **kwargs):
    """Call ``fn(**kwargs)``; assert it raises ``exc_type`` with a 'kv-canary:' message containing each needle."""
    with pytest.raises(exc_type) as info:
        fn(**kwargs)
    msg = str(info.value)
    assert msg.startswith("kv-canary:"), msg
    for needle in needles:
        assert str(needle) in msg, f"{needle!r} not in {msg!r}"
    return info.value


def plan_with(static, step, *, api="planner", **over):
    """Build a planner from ``static`` and plan ``step`` (``over`` overrides either), or call the launch API."""
    static, step = dict(static), dict(step)
    for k, v in over.items():
        (step if k in step or k == "req_to_verify_expected_tokens_valid_lens" else static)[k] = v
    if api == "launch":
        return launch_canary_plan_kernels(**static, **step)
    backend = static.pop("backend", "auto")
    check = static.pop("check", False)
    return CanaryPlanner(backend=backend, **static).plan(**step, check=check)


APIS = ["planner", "launch"]


def test_valid_setup_plans():
    _case, static, step, raw = setup()
    for api in APIS:
        assert plan_with(static, step, api=api) is None
    # rows (1, P 3) and (2, P 2) with W 2: windows [1, 3) and [0, 2)
    assert (raw["status"][0], raw["enable"][0], raw["verify_num_valid"][0]) == (0, 1, 4)
    assert raw["verify_expected_positions"][:4].tolist() == [1, 2, 0, 1]


# --------------------------------------------------------------------------------------------------------------
# Capacities and batch size


@pytest.mark.parametrize("api", APIS)
def test_verify_capacity_mismatch_names_both_numbers(api):
    _, static, step, _raw = setup()
    e = raises(ValueError, plan_with, "verify_capacity", "verify_slot_indices", "= 8", "got 9",
               static=static, step=step, api=api, verify_capacity=9)
    assert re.search(r"\b8\b", str(e)) and re.search(r"\b9\b", str(e))
    assert plan_with(static, step, api=api, verify_capacity=8) is None
    assert plan_with(static, step, api=api, verify_capacity=np.int64(8)) is None


def test_verify_capacity_must_be_an_int():
    _, static, step, _ = setup()
    raises(TypeError, plan_with, "verify_capacity", static=static, step=step, verify_capacity=8.0)


def test_bs_over_max_batch_size():
    _case, static, step, raw = setup(rows=[(1, 1, 1, 1)] * 3)
    raises(ValueError, plan_with, "max_batch_size", "= 2", "bs = 3", static=static, step=step, max_batch_size=2)
    assert raw["status"][0] == POISON.i32  # raised before any launch


@pytest.mark.parametrize("api", APIS)
def test_bs_over_write_req_capacity(api):
    _case, static, step, raw = setup(rows=[(1, 1, 1, 1)] * 5, R=4)
    extra = {} if api == "launch" else {"max_batch_size": 10}
    # the launch API's max_batch_size defaults to R, so it names that limit; both numbers are in the message
    raises(ValueError, plan_with, "4", "5", "bs", static=static, step=step, api=api, **extra)
    if api == "planner":
        raises(ValueError, plan_with, "write_req_capacity = 4", "bs = 5", static=static, step=step, **extra)
    assert all(raw[k].tobytes() == np.full_like(raw[k], POISON.i32 if raw[k].dtype == np.int32 else POISON.i64)
               .tobytes() for k in OUTPUTS)


def test_bs_equal_to_capacity_is_fine():
    _, static, step, raw = setup(rows=[(1, 1, 1, 1)] * 4, R=4)
    plan_with(static, step)
    assert raw["write_num_valid_reqs"][0] == 4


def test_negative_max_batch_size():
    _, static, step, _ = setup()
    raises(ValueError, plan_with, "max_batch_size", "-1", static=static, step=step, max_batch_size=-1)


# --------------------------------------------------------------------------------------------------------------
# SWA and the expected-token pool


def test_swa_without_lut():
    _, static, step, _ = setup(W=3)
    raises(ValueError, plan_with, "full_to_swa_index_mapping", "swa_window_size = 3", "None",
           static=static, step=step, full_to_swa_index_mapping=None)


def test_negative_swa_window():
    _, static, step, _ = setup()
    raises(ValueError, plan_with, "swa_window_size", "-1", static=static, step=step, swa_window_size=-1)


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("bad", [2**62 + 1, 2**63, 2**80])
def test_window_and_offset_past_int64_arithmetic_are_refused_at_bind(bad, api):
    """Both enter the plan's int64 index arithmetic (a position plus the offset, a prefix minus the window): a
    value past 2**62 is refused before anything is launched or written, not an OverflowError mid-plan."""
    _, static, step, raw = setup(W=3)
    raises(ValueError, plan_with, "swa_window_size", "[1, 2**62]", str(bad), static=static, step=step, api=api,
           swa_window_size=bad)
    for off in (bad, -bad):
        raises(ValueError, plan_with, "kv_token_id_vs_position_offset", "[-2**62, 2**62]", str(off), static=static,
               step=step, api=api, kv_token_id_vs_position_offset=off)
    assert raw["status"][0] == POISON.i32


@pytest.mark.parametrize("bad", [2.0, True, "3", None])
def test_swa_window_and_offset_must_be_ints(bad):
    _, static, step, _ = setup()
    raises(TypeError, plan_with, "swa_window_size", type(bad).__name__, static=static, step=step,
           swa_window_size=bad)
    raises(TypeError, plan_with, "kv_token_id_vs_position_offset", static=static, step=step,
           kv_token_id_vs_position_offset=bad)


@pytest.mark.parametrize("api", APIS)
def test_pool_without_valid_lens(api):
    _, static, step, raw = setup()
    raises(ValueError, plan_with, "req_to_verify_expected_tokens_valid_lens", "None", static=static, step=step,
           api=api, req_to_verify_expected_tokens_valid_lens=None)
    assert raw["status"][0] == POISON.i32


@pytest.mark.parametrize("api", APIS)
def test_valid_lens_without_pool(api):
    _, static, step, _ = setup(pool=False)
    raises(ValueError, plan_with, "req_to_verify_expected_tokens", "None", static=static, step=step, api=api,
           req_to_verify_expected_tokens_valid_lens=np.zeros(2, np.int64))


# --------------------------------------------------------------------------------------------------------------
# dtypes (no silent casts)

STATIC_DTYPES = [
    ("req_to_token", np.int64), ("req_to_token", np.uint32), ("req_to_token", np.float32),
    ("full_to_swa_index_mapping", np.int32), ("full_to_swa_index_mapping", np.uint64),
    ("full_to_swa_index_mapping", np.float64),
    ("req_to_verify_expected_tokens", np.int64), ("req_to_verify_expected_tokens", np.uint32),
]
# Step arrays are int32 or int64 (SPEC 2 (*)): every other dtype, on every step array.
STEP_DTYPES = [(name, dtype) for name in ("req_pool_indices", "prefix_lens", "extend_seq_lens",
                                          "req_to_verify_expected_tokens_valid_lens")
               for dtype in (np.int16, np.uint32, np.uint64, np.float64, np.bool_)]


@pytest.mark.parametrize("name,dtype", STATIC_DTYPES + STEP_DTYPES, ids=lambda x: getattr(x, "__name__", x))
@pytest.mark.parametrize("api", APIS)
def test_wrong_input_dtype_is_a_type_error(name, dtype, api):
    _, static, step, raw = setup()
    src = static.get(name, step.get(name))
    want = np.dtype(src.dtype).name if name in static else "int32 or int64"
    raises(TypeError, plan_with, name, f"expected dtype {want}", f"got {np.dtype(dtype).name}",
           static=static, step=step, api=api, **{name: src.astype(dtype)})
    assert raw["status"][0] == POISON.i32


@pytest.mark.parametrize("field", OUTPUTS)
@pytest.mark.parametrize("api", APIS)
def test_wrong_output_dtype_is_a_type_error(field, api):
    case, _, step, _ = setup()
    vp, wp, _raw = make_plans(case)
    plan = vp if field in VERIFY_FIELDS else wp
    want = getattr(plan, field).dtype
    wrong = np.int32 if want == np.int64 else np.int64
    setattr(plan, field, getattr(plan, field).astype(wrong))
    static = dict(verify_plan_out=vp, write_plan_out=wp, **case.static_kwargs())
    raises(TypeError, plan_with, field, f"expected dtype {want.name}", f"got {np.dtype(wrong).name}",
           static=static, step=step, api=api)


def test_plans_must_be_plan_objects():
    _, static, step, _ = setup()
    raises(TypeError, plan_with, "verify_plan_out", "VerifyPlan", "dict", static=static, step=step,
           verify_plan_out={})
    raises(TypeError, plan_with, "write_plan_out", "WritePlan", "VerifyPlan", static=static, step=step,
           write_plan_out=static["verify_plan_out"])


def test_plans_are_keyword_only():
    arrays = [np.zeros(2, np.int64)] * 4 + [np.zeros(1, np.int32)] * 3
    with pytest.raises(TypeError):
        VerifyPlan(*arrays)
    with pytest.raises(TypeError):
        WritePlan(np.zeros(3, np.int64), np.zeros(2, np.int64), np.zeros(1, np.int32))


# --------------------------------------------------------------------------------------------------------------
# Rank and length


@pytest.mark.parametrize("name,value,needles", [
    ("req_to_token", std_r2t(pad=0).reshape(-1), ["2-D", "(48,)"]),
    ("req_to_token", std_r2t(pad=0).reshape(2, 3, 8), ["2-D", "(2, 3, 8)"]),
    ("full_to_swa_index_mapping", std_lut().reshape(10, 100), ["1-D", "(10, 100)"]),
    ("req_to_verify_expected_tokens", std_pool().reshape(-1), ["2-D", "(48,)"]),
    ("req_pool_indices", np.array([[1, 2]], np.int64), ["1-D", "(1, 2)"]),
    ("prefix_lens", np.array([3, 2, 1], np.int64), ["length 2", "got 3"]),
    ("extend_seq_lens", np.array([1], np.int64), ["length 2", "got 1"]),
    ("req_to_verify_expected_tokens_valid_lens", np.array([8, 8, 8], np.int64), ["length 2", "got 3"]),
    ("prefix_lens", np.int64(3), ["1-D", "()"]),
])
@pytest.mark.parametrize("api", APIS)
def test_wrong_rank_or_length(name, value, needles, api):
    _, static, step, raw = setup()
    raises(ValueError, plan_with, name, *needles, static=static, step=step, api=api, **{name: value})
    assert raw["status"][0] == POISON.i32


@pytest.mark.parametrize("field,size,needles", [
    ("verify_num_valid", 2, ["length 1", "got 2"]),
    ("enable", 0, ["length 1", "got 0"]),
    ("status", 3, ["length 1", "got 3"]),
    ("write_num_valid_reqs", 2, ["length 1", "got 2"]),
    ("write_offsets", R, [f"= {R + 1}", f"got {R}"]),
    ("write_offsets", R + 2, [f"= {R + 1}", f"got {R + 2}"]),
    ("verify_expected_tokens", C + 1, ["capacity 8", "got 9"]),
    ("verify_expected_positions", C - 1, ["capacity 8", "got 7"]),
    ("verify_prev_slot_indices", 0, ["capacity 8", "got 0"]),
])
@pytest.mark.parametrize("api", APIS)
def test_wrong_output_length(field, size, needles, api):
    case, _, step, _ = setup()
    vp, wp, _ = make_plans(case)
    plan = vp if field in VERIFY_FIELDS else wp
    setattr(plan, field, np.zeros(size, getattr(plan, field).dtype))
    static = dict(verify_plan_out=vp, write_plan_out=wp, **case.static_kwargs())
    raises(ValueError, plan_with, field, *needles, static=static, step=step, api=api)


def test_output_rank():
    case, _, step, _ = setup()
    vp, wp, _ = make_plans(case)
    vp.status = np.zeros((1, 1), np.int32)
    raises(ValueError, plan_with, "status", "1-D", "(1, 1)", static=dict(verify_plan_out=vp, write_plan_out=wp,
                                                                          **case.static_kwargs()), step=step)


def test_not_an_array():
    _, static, step, _ = setup()
    raises(ValueError, plan_with, "prefix_lens", "expected an array", "list", static=static, step=step,
           prefix_lens=[3, 2])
    raises(ValueError, plan_with, "req_to_token", "expected an array", "str", static=static, step=step,
           req_to_token="r2t")


# --------------------------------------------------------------------------------------------------------------
# Read-only outputs, strides


@pytest.mark.parametrize("field", OUTPUTS)
@pytest.mark.parametrize("api", APIS)
def test_read_only_output(field, api):
    case, _, step, _ = setup()
    vp, wp, raw = make_plans(case)
    raw[field].flags.writeable = False
    static = dict(verify_plan_out=vp, write_plan_out=wp, **case.static_kwargs())
    raises(ValueError, plan_with, field, "writable", "read-only", static=static, step=step, api=api)
    for k in OUTPUTS:  # raised before any launch: nothing written
        assert raw[k].view(np.uint8).tolist() == make_plans(case)[2][k].view(np.uint8).tolist()


def test_read_only_inputs_are_fine():
    _case, static, step, raw = setup()
    for a in [static["req_to_token"], static["full_to_swa_index_mapping"], static["req_to_verify_expected_tokens"],
              *step.values()]:
        a.flags.writeable = False
    plan_with(static, step)
    assert raw["status"][0] == 0


@pytest.mark.parametrize("name", ["req_to_token", "full_to_swa_index_mapping", "req_to_verify_expected_tokens",
                                  "req_pool_indices", "prefix_lens", "extend_seq_lens",
                                  "req_to_verify_expected_tokens_valid_lens"])
@pytest.mark.parametrize("api", APIS)
def test_non_unit_inner_stride_input(name, api):
    _, static, step, _ = setup()
    src = static.get(name, step.get(name))
    doubled = np.repeat(src, 2, axis=-1)[..., ::2]
    assert np.array_equal(doubled, src) and doubled.strides[-1] == 2 * src.itemsize
    raises(ValueError, plan_with, name, "unit inner stride", "stride 2", static=static, step=step, api=api,
           **{name: doubled})


@pytest.mark.parametrize("field", OUTPUTS)
def test_non_unit_inner_stride_output(field):
    case, _, step, _ = setup()
    vp, wp, raw = make_plans(case)
    plan = vp if field in VERIFY_FIELDS else wp
    a = getattr(plan, field)
    if a.shape[0] < 2:
        a2 = np.repeat(a, 2)[::2]  # a length-1 array's stride is irrelevant: accepted, and written through
        assert a2.shape == (1,) and a2.strides[-1] == 2 * a.itemsize
        setattr(plan, field, a2)
        static = dict(verify_plan_out=vp, write_plan_out=wp, **case.static_kwargs())
        assert plan_with(static, step) is None
        assert_same({**raw, field: a2}, expected_outputs(case), case)
        assert raw[field].tobytes() == poisoned_outputs(case)[field].tobytes()  # the replaced one: untouched
        return
    setattr(plan, field, np.repeat(a, 3)[::3])
    static = dict(verify_plan_out=vp, write_plan_out=wp, **case.static_kwargs())
    raises(ValueError, plan_with, field, "unit inner stride", "stride 3", static=static, step=step)


def test_row_strides():
    _, static, step, raw = setup()
    r2t = static["req_to_token"]
    assert r2t.strides[0] > 4 * r2t.shape[1]  # a strided view is accepted (setup's default)
    plan_with(static, step)
    assert raw["status"][0] == 0
    raises(ValueError, plan_with, "req_to_token: expected non-negative strides, got element strides (-8, 1)",
           static=static, step=step, req_to_token=np.ascontiguousarray(r2t)[::-1])  # negative row stride
    overlapping = np.lib.stride_tricks.as_strided(np.ascontiguousarray(r2t), shape=r2t.shape, strides=(16, 4))
    raises(ValueError, plan_with, "req_to_token", "row stride >= the row length 8", "got 4", static=static,
           step=step, req_to_token=overlapping)
    pool = static["req_to_verify_expected_tokens"]
    raises(ValueError, plan_with, "req_to_verify_expected_tokens", "row stride", static=static, step=step,
           req_to_verify_expected_tokens=np.lib.stride_tricks.as_strided(pool, shape=pool.shape, strides=(8, 4)))


def test_misaligned_strides():
    _, static, step, _ = setup()
    buf = np.zeros(8 * 3 + 2, np.uint8)
    odd = np.ndarray(shape=(2,), dtype=np.int64, buffer=buf, offset=1, strides=(12,))
    raises(ValueError, plan_with, "prefix_lens", "whole elements", static=static, step=step, prefix_lens=odd)


# --------------------------------------------------------------------------------------------------------------
# Backends and devices


@pytest.mark.parametrize("api", APIS)
def test_unknown_backend(api):
    _, static, step, _ = setup()
    raises(ValueError, plan_with, "backend", "'triton'", "reference", "cupy", "numba", static=static, step=step,
           api=api, backend="triton")


@pytest.mark.parametrize("backend", ["cupy", "numba"])
@pytest.mark.parametrize("api", APIS)
def test_host_arrays_with_a_gpu_backend(backend, api):
    """A caller error whatever is installed: ValueError, decided before the backend's library is imported."""
    _, static, step, raw = setup()
    raises(ValueError, plan_with, "backend", repr(backend), "host memory", static=static, step=step, api=api,
           backend=backend)
    assert raw["status"][0] == POISON.i32


def test_host_arrays_with_a_gpu_backend_when_its_library_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)
    for mod in [m for m in sys.modules if m.startswith("canary.backends.cupy")]:
        monkeypatch.delitem(sys.modules, mod)
    _, static, step, _ = setup()
    raises(ValueError, plan_with, "backend", "host memory", static=static, step=step, backend="cupy")


def test_missing_cupy_gives_install_command(monkeypatch):
    from canary.interop.libs import import_cupy

    monkeypatch.setitem(sys.modules, "cupy", None)
    monkeypatch.setitem(sys.modules, "numba", None)  # allocate() falls back to numba-cuda when CuPy is absent
    raises(BackendUnavailableError, import_cupy, "cupy", "pip install")
    raises(BackendUnavailableError, VerifyPlan.allocate, "pip install", verify_capacity=4, device="cuda:0")
    raises(BackendUnavailableError, WritePlan.allocate, "pip install", write_req_capacity=4, device=0)
    assert issubclass(BackendUnavailableError, ImportError)


_FAKE_ADDRESSES = itertools.count(0x7F0000000000, 1 << 20)


def _fake_device_view(a: np.ndarray, name: str, device_id: int = 0) -> ArrayView:
    """A view claiming CUDA memory (never dereferenced: validation fails first), apart from every other fake."""
    return ArrayView(name=name, ptr=next(_FAKE_ADDRESSES), shape=a.shape,
                     strides=tuple(s // a.itemsize for s in a.strides), dtype=a.dtype, device_id=device_id,
                     readonly=False, owner=None)


def test_arrays_on_different_devices():
    _, static, step, raw = setup()
    lut = static["full_to_swa_index_mapping"]
    raises(ValueError, plan_with, "full_to_swa_index_mapping", "same device", "host memory", "cuda:0",
           static=static, step=step, full_to_swa_index_mapping=_fake_device_view(lut, "full_to_swa_index_mapping"))
    raises(ValueError, plan_with, "prefix_lens", "plan's device (host memory)", "cuda:1", static=static, step=step,
           prefix_lens=_fake_device_view(step["prefix_lens"], "prefix_lens", 1))
    assert raw["status"][0] == POISON.i32


def test_device_arrays_with_the_reference_backend():
    _case, static, _step, _ = setup()
    fake = {}
    for key in ("req_to_token", "full_to_swa_index_mapping", "req_to_verify_expected_tokens"):
        fake[key] = _fake_device_view(static[key], key)
    vp = VerifyPlan(**{f: _fake_device_view(getattr(static["verify_plan_out"], f), f)
                       for f in VERIFY_FIELDS + ("verify_cursors",)})
    wp = WritePlan(**{f: _fake_device_view(getattr(static["write_plan_out"], f), f) for f in WRITE_FIELDS})
    raises(ValueError, CanaryPlanner, "backend", "'reference'", "cuda:0", backend="reference", verify_plan_out=vp,
           write_plan_out=wp, **fake)


def test_allocate():
    assert VerifyPlan.allocate(verify_capacity=5).verify_cursors is None  # a plan only the records' verify reads
    vp = VerifyPlan.allocate(verify_capacity=5, max_reqs=6)
    assert [getattr(vp, f).shape for f in VERIFY_FIELDS] == [(5,)] * 4 + [(1,)] * 3
    assert [getattr(vp, f).dtype for f in VERIFY_FIELDS] == [np.int64] * 4 + [np.int32] * 3
    assert vp.verify_cursors.shape == (6,) and vp.verify_cursors.dtype == np.int64 and not vp.verify_cursors.any()
    wp = WritePlan.allocate(write_req_capacity=3, device="cpu")
    assert [getattr(wp, f).shape for f in WRITE_FIELDS] == [(4,), (3,), (1,)]
    assert [getattr(wp, f).dtype for f in WRITE_FIELDS] == [np.int64, np.int64, np.int32]
    planner = CanaryPlanner(verify_plan_out=vp, write_plan_out=wp, req_to_token=std_r2t())
    assert (planner.verify_capacity, planner.write_req_capacity, planner.max_batch_size) == (5, 3, 3)
    raises(ValueError, VerifyPlan.allocate, "verify_capacity", "-1", verify_capacity=-1)
    raises(ValueError, VerifyPlan.allocate, "max_reqs", "-1", verify_capacity=1, max_reqs=-1)
    raises(ValueError, WritePlan.allocate, "write_req_capacity", "-2", write_req_capacity=-2)
    raises(ValueError, VerifyPlan.allocate, "device", "'tpu'", verify_capacity=1, device="tpu")


# --------------------------------------------------------------------------------------------------------------
# check=True and VerifyPlan.check()


def test_check_true_raises_with_bits_and_first_row():
    _, static, step, raw = setup(rows=[(1, 2, 1, 8), (2, 1, 1, 8), (-4, 2, 1, 8), (3, 99, 0, 8)])
    with pytest.raises(CanaryInputError) as info:
        plan_with(static, step, check=True)
    e = info.value
    msg = str(e)
    assert msg.startswith("kv-canary:") and "status" in msg
    assert "BAD_REQ_POOL_INDEX" in msg and "BAD_PREFIX_LEN" in msg and "got 6" in msg
    assert "first offending batch row: 2" in msg
    assert e.status == PlanStatus.BAD_REQ_POOL_INDEX | PlanStatus.BAD_PREFIX_LEN and e.first_bad_row == 2
    assert raw["status"][0] == 6 and raw["enable"][0] == 0  # the plan was still built
    with pytest.raises(CanaryInputError) as info:
        launch_canary_plan_kernels(**static, **step, check=True)
    assert info.value.first_bad_row == 2


def test_check_true_bad_valid_len_row():
    _, static, step, _ = setup(rows=[(1, 2, 1, 8), (0, 2, 1, 99), (2, 1, 1, 9)])
    with pytest.raises(CanaryInputError) as info:
        plan_with(static, step, check=True)
    assert info.value.first_bad_row == 2 and "BAD_VALID_LEN" in str(info.value)
    assert info.value.status == PlanStatus.BAD_VALID_LEN


def test_check_true_bad_slot():
    r2t = std_r2t()
    r2t[1, 1] = 5000
    case = make_case("s", [(2, 1, 1), (1, 2, 1)], r2t=r2t, lut=std_lut(300))
    vp, wp, _raw = make_plans(case)
    with pytest.raises(CanaryInputError) as info:
        CanaryPlanner(verify_plan_out=vp, write_plan_out=wp, **case.static_kwargs()).plan(**case.step_kwargs(),
                                                                                          check=True)
    assert "BAD_SLOT" in str(info.value) and info.value.status == PlanStatus.BAD_SLOT
    with pytest.raises(CanaryInputError):
        vp.check()


@pytest.mark.parametrize("on_overflow, bit, enable", [("skip", PlanStatus.OVERFLOW, 0),
                                                      ("sample", PlanStatus.SAMPLED, 1)])
def test_check_true_overflow_alone_returns_status(on_overflow, bit, enable):
    _, static, step, raw = setup(C=2)
    static = {**static, "on_overflow": on_overflow}
    for api in APIS:
        if api == "launch":
            assert launch_canary_plan_kernels(**static, **step, check=True) == bit
        else:
            assert plan_with(static, step, check=True) == bit
    assert raw["enable"][0] == enable and raw["verify_num_valid"][0] == 2
    assert static["verify_plan_out"].check() == bit


def test_check_true_ok_returns_ok():
    _, static, step, _ = setup()
    assert plan_with(static, step, check=True) == PlanStatus.OK
    assert static["verify_plan_out"].check() == PlanStatus.OK
    assert static["verify_plan_out"].read_status() == PlanStatus.OK


def test_verify_plan_check():
    _, static, step, _raw = setup(rows=[(1, 2, 1, 8), (7, 1, 1, 8)], C=1)
    plan_with(static, step)
    with pytest.raises(CanaryInputError) as info:
        static["verify_plan_out"].check()
    msg = str(info.value)
    assert msg.startswith("kv-canary:") and "SAMPLED" in msg and "BAD_REQ_POOL_INDEX" in msg and "got 66" in msg
    assert info.value.status == PlanStatus.SAMPLED | PlanStatus.BAD_REQ_POOL_INDEX
    assert info.value.first_bad_row is None  # check() has only the status word
    assert isinstance(info.value, RuntimeError)


# --------------------------------------------------------------------------------------------------------------
# on_overflow and verify_cursors (SPEC 3.3, 3.7)


def test_sampling_needs_its_state():
    _, static, step, _raw = setup()
    vp = static["verify_plan_out"]
    bare = VerifyPlan(**{f: getattr(vp, f) for f in VERIFY_FIELDS})
    raises(ValueError, CanaryPlanner, "verify_plan_out.verify_cursors", "max_reqs=6", "got None",
           **{**static, "verify_plan_out": bare})
    CanaryPlanner(**{**static, "verify_plan_out": bare, "on_overflow": "skip"}).plan(**step)  # skip needs none
    raises(ValueError, CanaryPlanner, "on_overflow", "'sample'", "'drop'", **{**static, "on_overflow": "drop"})
    short = VerifyPlan(**{f: getattr(vp, f) for f in VERIFY_FIELDS}, verify_cursors=np.zeros(5, np.int64))
    raises(ValueError, CanaryPlanner, "verify_plan_out.verify_cursors", "6", "5",
           **{**static, "verify_plan_out": short})
    narrow = VerifyPlan(**{f: getattr(vp, f) for f in VERIFY_FIELDS}, verify_cursors=np.zeros(6, np.int32))
    raises(TypeError, CanaryPlanner, "verify_plan_out.verify_cursors", "int64", "int32",
           **{**static, "verify_plan_out": narrow})
    frozen = np.zeros(6, np.int64)
    frozen.flags.writeable = False
    ro = VerifyPlan(**{f: getattr(vp, f) for f in VERIFY_FIELDS}, verify_cursors=frozen)
    raises(ValueError, CanaryPlanner, "verify_plan_out.verify_cursors", **{**static, "verify_plan_out": ro})


def test_sampling_refuses_a_zero_capacity_and_products_past_int64():
    _, static, _step, _raw = setup()
    empty = VerifyPlan.allocate(verify_capacity=0, max_reqs=6)
    raises(ValueError, CanaryPlanner, "verify_capacity", ">= 1", "got 0", **{**static, "verify_plan_out": empty})
    CanaryPlanner(**{**static, "verify_plan_out": empty, "on_overflow": "skip"})
    raises(ValueError, CanaryPlanner, "verify_capacity", "2**62", **{**static, "max_batch_size": 1 << 60})


@pytest.mark.parametrize("kwargs, exc, text", [
    (dict(fused_max_bs=-2), ValueError, r"launch_config\.fused_max_bs: expected >= -1 or None, got -2"),
    (dict(fused_max_bs=True), TypeError, r"launch_config\.fused_max_bs: expected an int or None, got bool"),
    (dict(simulator_threads=0), ValueError, r"launch_config\.simulator_threads: expected >= 1 or None, got 0"),
    (dict(side_blocks=1), TypeError, r"launch_config\.side_blocks: expected a bool, got int"),
    (dict(numba_fast_launch="yes"), TypeError, r"launch_config\.numba_fast_launch: expected a bool, got str"),
])
def test_launch_config_refuses_bad_values(kwargs, exc, text):
    from canary import LaunchConfig

    with pytest.raises(exc, match="^kv-canary: " + text):
        LaunchConfig(**kwargs)
