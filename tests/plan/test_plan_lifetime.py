"""The one-shot entry point keeps nothing of its caller's alive: once the caller drops its arrays they die, and
its cache (GPU backends only: bound launchers over addresses) never serves stale buffers to new ones."""
from __future__ import annotations

import gc
import weakref

import pytest
from helpers.plan_cases import assert_same, expected_outputs, make_plans, random_case, to_numpy, to_xp

from canary import launch_canary_plan_kernels
from canary.plan import planner as planner_module


def _call_and_drop(case, xp: str, check: bool) -> list:
    """One call on fresh arrays of ``xp``; returns weak references to every array passed."""
    def fresh(a):
        out = to_xp(a, xp)
        return out.copy() if out is a else out  # never the case's own array, which the case keeps alive

    vp, wp, raw = make_plans(case, xp)
    static = case.static_kwargs(fresh)
    step = case.step_kwargs(fresh)
    launch_canary_plan_kernels(verify_plan_out=vp, write_plan_out=wp, check=check, **static, **step)
    if xp == "cupy":
        import cupy

        cupy.cuda.get_current_stream().synchronize()
    arrays = list(raw.values()) + [v for v in {**static, **step}.values() if not isinstance(v, (int, str)) and v is not None]
    return [weakref.ref(a) for a in arrays]


@pytest.mark.parametrize("check", [False, True])
@pytest.mark.parametrize("xp", ["numpy", "torch"])
def test_one_shot_call_keeps_no_caller_array_alive(xp, check):
    if xp == "torch":
        pytest.importorskip("torch")
    case = random_case(3, bs=(4, 8), swa=True, pool=True, capacity="loose", name="life")
    for _ in range(3):
        refs = _call_and_drop(case, xp, check)
        gc.collect()
        assert [r() for r in refs] == [None] * len(refs)


def test_numpy_arrays_die_after_one_shot_calls_on_fresh_buffers():
    """The review's case, scaled down: fresh plans each call, all freed (the old cache held the last 8 sets)."""
    case = random_case(11, bs=(2, 4), capacity="loose", name="fresh")
    refs = []
    before = dict(planner_module._BOUND)  # GPU tests earlier in the process may have cached device launchers
    for _ in range(10):
        refs += _call_and_drop(case, "numpy", False)
    gc.collect()
    assert all(r() is None for r in refs)
    assert dict(planner_module._BOUND) == before  # host backends cache nothing


@pytest.mark.parametrize("seed", range(4))
def test_one_shot_results_do_not_depend_on_earlier_calls(seed):
    case = random_case(100 + seed, bs=(1, 16), swa=seed % 2 == 0, pool=seed > 1, name=f"seq{seed}")
    got = None
    for _ in range(2):
        vp, wp, raw = make_plans(case)
        launch_canary_plan_kernels(verify_plan_out=vp, write_plan_out=wp, **case.static_kwargs(),
                                   **case.step_kwargs())
        got = {k: to_numpy(v) for k, v in raw.items()}
        assert_same(got, expected_outputs(case), case)


@pytest.mark.gpu
@pytest.mark.parametrize("xp", ["cupy", "torch_cuda"])
def test_gpu_one_shot_call_keeps_no_caller_array_alive(xp):
    if xp == "torch_cuda":
        pytest.importorskip("torch")
    case = random_case(5, bs=(4, 8), swa=True, pool=True, capacity="loose", name="life-gpu")
    try:
        refs = _call_and_drop(case, xp, False)
    except TypeError as exc:  # an array type without weak references
        pytest.skip(f"{xp} arrays take no weak references: {exc}")
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)
    for _module, bound in planner_module._BOUND.values():  # the cache holds launchers, not arrays
        assert all(getattr(bound.static, f).owner is None for f in planner_module._VIEW_FIELDS
                   if getattr(bound.static, f) is not None)


@pytest.mark.gpu
def test_gpu_cache_entry_reused_for_new_buffers_at_the_same_addresses():
    """Free the buffers, allocate new ones of the same sizes (CuPy's pool hands back the same addresses) with other
    contents: the plan is the new inputs' plan, byte for byte."""
    cupy = pytest.importorskip("cupy")
    first = random_case(21, bs=(8, 8), max_reqs=(12, 12), max_seq_len=(16, 16), swa=True, pool=True,
                        capacity="loose", name="a")
    second = random_case(22, bs=(8, 8), max_reqs=(12, 12), max_seq_len=(16, 16), swa=True, pool=True,
                         capacity="loose", name="b")
    for case in (first, second, first):
        vp, wp, raw = make_plans(case, "cupy")
        launch_canary_plan_kernels(verify_plan_out=vp, write_plan_out=wp, verify_capacity=case.verify_capacity,
                                   **case.static_kwargs(lambda a: to_xp(a, "cupy")),
                                   **case.step_kwargs(lambda a: to_xp(a, "cupy")))
        assert_same({k: to_numpy(v) for k, v in raw.items()}, expected_outputs(case), case)
        del vp, wp, raw
        cupy.cuda.get_current_stream().synchronize()
        gc.collect()
    assert all(getattr(b.static, f).owner is None for _m, b in planner_module._BOUND.values()
               for f in planner_module._VIEW_FIELDS if getattr(b.static, f) is not None)  # whichever index form
