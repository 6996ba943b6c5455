"""The Numba kernels under the CUDA simulator, byte for byte against the NumPy reference (CI has no GPU).

Each test is its own id under ``pytest -m sim``: ``tests/helpers/sim_plugin.py`` runs them in a process with
``NUMBA_ENABLE_CUDASIM=1`` (numba reads it once, at its first import). One test::

    python -m pytest -q -m sim tests/numba_sim -k test_simulator_mode

or in this process: ``python -m pytest -q -m sim --numba-sim tests/numba_sim/numba_sim_suite.py``.

The simulator runs one Python thread per CUDA thread, so the backend binds small blocks there
(``LaunchConfig(simulator_threads="gpu")``: same code, more rows per thread, more grid-stride
steps); ``test_gpu_block_sizes`` runs a few cases with the GPU's block sizes. Every case runs through both
launch paths: the fused kernel and the rows + entries pair (``LaunchConfig(fused_max_bs=-1)``).

Cases are bound straight through the backend seam (``bind_static`` + ``numba_backend.bind``), not through
``CanaryPlanner(backend="numba")``: see ``test_planner_with_host_arrays`` for that path.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
    pytest.skip("run with NUMBA_ENABLE_CUDASIM=1 (tests/helpers/sim_plugin.py does)", allow_module_level=True)

from helpers.plan_cases import (  # noqa: E402
    BUFFERS, POISON, POISON_ALT, RULE_KNOBS, PlanCase, assert_same, expected_outputs, hand_case, hand_cases, make_plans,
    plan_cases, poisoned_outputs, random_case,
)

from canary import BackendUnavailableError, LaunchConfig  # noqa: E402
from canary.interop.adapter import as_view  # noqa: E402
from canary.backends import load
from canary.backends.args import StepArgs  # noqa: E402
from canary.plan.planner import bind_static  # noqa: E402

try:
    from canary.backends.numba import plan as nb
except BackendUnavailableError as exc:  # e.g. numba-cuda missing, or numpy >= 2.5
    pytest.skip(str(exc), allow_module_level=True)

# u64 hash arithmetic wraps by design; NumPy scalars (what the simulator computes with) warn when it does.
pytestmark = [pytest.mark.sim, pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")]

FUSED, TWO_PASS = "fused", "two_pass"


def bind_case(case: PlanCase, vp, wp, path: str = FUSED, threads=None) -> "nb.Bound":
    static = bind_static(verify_plan_out=vp, write_plan_out=wp, verify_capacity=case.verify_capacity,
                         max_batch_size=case.max_batch_size, **case.static_kwargs())
    return nb.bind(static, LaunchConfig(fused_max_bs=-1 if path == TWO_PASS else None, simulator_threads=threads))


def step_args(case: PlanCase) -> StepArgs:
    kw = case.step_kwargs()
    vl = kw["req_to_verify_expected_tokens_valid_lens"]
    q = kw.get("expected_token_pool_indices")
    return StepArgs(as_view(kw["req_pool_indices"], "req_pool_indices"), as_view(kw["prefix_lens"], "prefix_lens"),
                    as_view(kw["extend_seq_lens"], "extend_seq_lens"),
                    None if vl is None else as_view(vl, "req_to_verify_expected_tokens_valid_lens"), case.bs,
                    None if q is None else as_view(q, "expected_token_pool_indices"))


def run_numba(case: PlanCase, path: str = FUSED, poison=POISON, threads=None) -> dict[str, np.ndarray]:
    """Poisoned outputs, one plan on the simulated Numba backend; returns copies of the 10 buffers."""
    vp, wp, raw = make_plans(case, "numpy", poison)
    bound = bind_case(case, vp, wp, path, threads)
    bound.warmup()
    bound.launch(step_args(case), 0)
    assert not bound.scratch[:2].any(), f"scratch counters not re-armed: {bound.scratch[:4]}"
    return {k: raw[k].copy() for k in BUFFERS}


def check_case(case: PlanCase, path: str, poison=POISON, threads=None) -> None:
    got = run_numba(case, path, poison, threads)
    assert_same(got, expected_outputs(case, poison), case)
    if case.expect_status is not None:
        assert int(got["status"][0]) == case.expect_status, case.describe()


def test_simulator_mode():
    assert nb.SIMULATOR and not nb.ON_DEVICE
    assert load("numba") is nb


def test_kernel_arguments_are_plan_cu_params():
    """The twin's kernels take PlanParams' fields in plan.cu's order (pinned against the source by
    tests/kernels/test_kernel_compile.py)."""
    from canary.contract.plan_layout import PARAM_FIELDS

    assert nb.plan_numba.PARAM_FIELDS == PARAM_FIELDS


# ---------------------------------------------------------------------------------------------------------------
# Byte-identical to the reference

@pytest.mark.parametrize("path", [FUSED, TWO_PASS])
@pytest.mark.parametrize("case", hand_cases(), ids=lambda c: c.name)
def test_hand_cases(case, path):
    if path == FUSED and case.bs > nb.FUSED_MAX_BS:
        pytest.skip(f"bs {case.bs} > FUSED_MAX_BS: always two launches")
    # The second poison on the two-pass path: a backend writing a constant equal to one poison still fails.
    check_case(case, path, POISON if path == FUSED else POISON_ALT)


RANDOM_KNOBS = RULE_KNOBS + [
    dict(swa=True, pool=True, fault_prob=0.05, strided_r2t=True),
    dict(bs=(30, 70), max_seq_len=(1, 12), capacity="loose"),
    dict(lut=True, fault_prob=0.3, capacity="tight"),
]


@pytest.mark.parametrize("seed", range(30))
def test_random_cases(seed):
    case = random_case(seed, name=f"random-{seed}", **RANDOM_KNOBS[seed % len(RANDOM_KNOBS)])
    check_case(case, (FUSED, TWO_PASS)[(seed // len(RANDOM_KNOBS)) % 2])


def test_random_cases_hypothesis():
    hypothesis = pytest.importorskip("hypothesis")

    @hypothesis.settings(max_examples=12, deadline=None, derandomize=True,
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(case=plan_cases(bs=(0, 10), fault_prob=0.1), two_pass=hypothesis.strategies.booleans())
    def check(case, two_pass):
        check_case(case, TWO_PASS if two_pass else FUSED)

    check()


@pytest.mark.parametrize("path", [FUSED, TWO_PASS])
@pytest.mark.parametrize("seed", range(12))
def test_step_array_widths(seed, path):
    """SPEC 2 (*): each step array int32 or int64 (drawn per array; all int32 where the values fit): the plan of
    the int64 case, on both launch paths, sampled steps and faults included."""
    from helpers.plan_cases import with_widths

    case = random_case(seed, name=f"widths-{seed}", **{"pool_indices": None, **RANDOM_KNOBS[seed % len(RANDOM_KNOBS)]})
    want = expected_outputs(case)
    for narrowed in (with_widths(case, all32=True), with_widths(case, seed)):
        assert_same(run_numba(narrowed, path), want, narrowed)


@pytest.mark.parametrize("path", [FUSED, TWO_PASS])
def test_step_array_int32_extremes(path):
    from helpers.plan_cases import int32_edge_cases, with_widths

    for case in int32_edge_cases():
        assert_same(run_numba(with_widths(case, all32=True), path), expected_outputs(case), case)


def test_pool_indices_hypothesis():
    """``expected_token_pool_indices`` (the pool keyed apart from rp), both launch paths."""
    hypothesis = pytest.importorskip("hypothesis")

    @hypothesis.settings(max_examples=12, deadline=None, derandomize=True,
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(case=plan_cases(bs=(0, 10), pool=True, pool_indices=True, fault_prob=0.15),
                      two_pass=hypothesis.strategies.booleans())
    def check(case, two_pass):
        check_case(case, TWO_PASS if two_pass else FUSED)

    check()


def test_fused_at_max_bs():
    """The largest batch the fused kernel takes (its row offsets fill the shared array)."""
    case = random_case(1024, bs=(nb.FUSED_MAX_BS, nb.FUSED_MAX_BS), max_reqs=(40, 40), max_seq_len=(1, 3),
                       capacity="loose", name="fused-max-bs")
    check_case(case, FUSED)


@pytest.mark.parametrize("name,path", [("seeds_mixed", FUSED), ("all_bits", TWO_PASS),
                                       ("big_batch_4097_swa_pool", TWO_PASS)])
def test_gpu_block_sizes(name, path):
    """The GPU's block sizes (1024-thread rows block, 256-thread entry blocks) under the simulator."""
    check_case(hand_case(name), path, threads="gpu")


# ---------------------------------------------------------------------------------------------------------------
# One bound planner, many calls


def _refill(case: PlanCase, rng: np.random.Generator, bs: int) -> PlanCase:
    """New contents in the same buffers' shapes (a serving loop between steps); ``bs`` may change."""
    r2t = case.req_to_token
    r2t[...] = rng.integers(-2, case.lut.shape[0] + 2, size=r2t.shape, dtype=np.int32)
    rpi = rng.integers(0, case.max_reqs, size=bs).astype(np.int64)
    P = rng.integers(0, case.max_seq_len + 1, size=bs).astype(np.int64)
    E = rng.integers(-1, 5, size=bs).astype(np.int64)
    vl = rng.integers(0, case.pool.shape[1] + 1, size=bs).astype(np.int64)
    return case.replace(req_pool_indices=rpi, prefix_lens=P, extend_seq_lens=E, valid_lens=vl)


def test_refill_in_place_and_switch_paths():
    """Inputs refilled in place between calls, bs changing, fused and two-pass calls alternating on one
    bound planner: every call matches the reference, and the scratch counters are re-armed after each."""
    rng = np.random.default_rng(3)
    case = random_case(3, bs=(6, 6), max_reqs=(6, 6), max_seq_len=(9, 9), lut=True, pool=True, swa=True,
                       strided_r2t=True, capacity="loose", name="refill")
    case = case.replace(verify_capacity=6 * 9, write_req_capacity=8, max_batch_size=8)
    vp, wp, raw = make_plans(case, "numpy")
    bounds = {path: bind_case(case, vp, wp, path) for path in (FUSED, TWO_PASS)}  # one set of buffers
    for call, (bs, path) in enumerate([(6, FUSED), (8, TWO_PASS), (0, FUSED), (5, TWO_PASS), (7, FUSED)]):
        case = _refill(case, rng, bs)
        bound = bounds[path]
        for k, v in poisoned_outputs(case).items():
            raw[k][...] = v
        bound.launch(step_args(case), 0)
        assert not bound.scratch[:2].any(), (call, bound.scratch[:4])
        assert_same({k: raw[k].copy() for k in BUFFERS}, expected_outputs(case), case)


def test_read_only_inputs():
    """Inputs are only read (the simulator copies them in, never back): non-writeable arrays are fine."""
    case = hand_case("expected_swa")
    frozen = {}
    for name in ("req_to_token", "lut", "pool", "req_pool_indices", "prefix_lens", "extend_seq_lens", "valid_lens"):
        a = getattr(case, name).copy() if name != "req_to_token" else case.req_to_token
        a.flags.writeable = False
        frozen[name] = a
    case = case.replace(**frozen)
    check_case(case, FUSED)


def test_grid_size():
    per_block = nb.ENTRY_THREADS * nb.ITEMS  # entries of one block's pass
    assert nb.entry_grid(0, 132, 4) == 1
    assert nb.entry_grid(1, 132, 4) == 1
    assert nb.entry_grid(per_block, 132, 4) == 1
    assert nb.entry_grid(per_block + 1, 132, 4) == 2
    assert nb.entry_grid(10**9, 132, 4) == 132 * 4
    assert nb.entry_grid(10**9, 132, 0) == 132  # occupancy unknown: at least one block per SM
    assert nb.entry_grid(100, 1, 4, threads=32) == 1  # the simulator's blocks: 128 entries a pass


@pytest.mark.parametrize("api", ["planner", "launch"])
def test_planner_with_host_arrays(api):
    """Under the simulator the numba backend's "device" is host memory: the public API takes host arrays."""
    from helpers.plan_cases import run_case

    for case in hand_cases()[:12]:
        assert_same(run_case(case, backend="numba", xp="numpy", api=api), expected_outputs(case), case)


# ---------------------------------------------------------------------------------------------------------------
# The canary twin (kernels/records_numba.py) against the reference, through CanaryRecords(backend="numba")

from helpers import records_cases as cc  # noqa: E402


def _host(a):
    return a.copy()


def _twin(case, launch_config=None):
    want = cc.run_case(case, "reference", _host, np.asarray)
    got = cc.run_case(case, "numba", _host, np.asarray, launch_config=launch_config)
    cc.assert_twin(case, got, want)


@pytest.mark.parametrize("case", cc.hand_cases(), ids=repr)
def test_canary_hand_cases(case):
    _twin(case)


@pytest.mark.parametrize("seed", range(30))
def test_canary_random_cases(seed):
    _twin(cc.random_case(seed))


def test_canary_random_cases_hypothesis():
    hypothesis = pytest.importorskip("hypothesis")

    @hypothesis.settings(max_examples=15, deadline=None, derandomize=True,
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(seed=hypothesis.strategies.integers(0, 2**32 - 1))
    def check(seed):
        _twin(cc.random_case(seed))

    check()


@pytest.mark.parametrize("case", cc.hand_cases() + [cc.int32_edge_case()], ids=repr)
def test_canary_token_array_widths_hand(case):
    """SPEC 2 (*): the token arrays int32 wherever they fit, and widths drawn per array: the numba twin writes what
    the reference writes for the int64 case."""
    want = cc.run_case(case, "reference", _host, np.asarray)
    for narrowed in (cc.with_widths(case, 0, all32=True), cc.with_widths(case, 3)):
        cc.assert_twin(case, cc.run_case(narrowed, "numba", _host, np.asarray), want)


@pytest.mark.parametrize("seed", range(20))
def test_canary_token_array_widths_random(seed):
    case = cc.random_case(seed)
    want = cc.run_case(case, "reference", _host, np.asarray)
    cc.assert_twin(case, cc.run_case(cc.with_widths(case, seed), "numba", _host, np.asarray), want)


@pytest.mark.parametrize("name", ["long_request_many_chunks", "verify_by_hand", "real_kv_pt_all",
                                  "scan_long_runs_split_into_segments", "slot_repeated_in_a_tile"])
def test_canary_gpu_block_sizes(name):
    """The GPU's block sizes (256-entry write tiles, 256-thread verify blocks) on a few cases."""
    _twin(next(c for c in cc.hand_cases() if c.name == name), LaunchConfig(simulator_threads="gpu"))


@pytest.mark.parametrize("case", cc.scatter_cases() + [cc.random_scatter_case(s) for s in range(20)], ids=repr)
def test_canary_scatter(case):
    want = cc.run_scatter(case, "reference", _host, np.asarray)
    got = cc.run_scatter(case, "numba", _host, np.asarray)
    assert got.tobytes() == want.tobytes()


def test_canary_read_only_inputs():
    """Read-only caller inputs are only read (the simulator copies them in, never back)."""
    case = next(c for c in cc.hand_cases() if c.name == "verify_by_hand")
    for launch in case.launches:
        for v in launch.args.values():
            if isinstance(v, np.ndarray):
                v.flags.writeable = False
    _twin(case)


def test_canary_hashes_match_frozen_vectors():
    from helpers.numba_hash_vectors import check_numba_hashes

    check_numba_hashes()


# ---------------------------------------------------------------------------------------------------------------
# Issue 12's blind spots (helpers/blind_spots.py; the reference in tests/records/test_blind_spots.py)


def test_blind_spot_spec_reject():
    from helpers.blind_spots import spec_reject

    from canary import FailReason

    token = int(FailReason.VERIFY_TOKEN)
    assert spec_reject("numba", "numpy") == [(6, token), (7, token)]
    assert spec_reject("numba", "numpy", with_pool=False) == []


def test_blind_spot_row_recycle():
    from helpers.blind_spots import row_recycle

    from canary import FailReason

    token = int(FailReason.VERIFY_TOKEN)
    assert row_recycle("numba", "numpy", keyed_by_identity=True) == [(p, token) for p in range(6)]
    assert row_recycle("numba", "numpy", keyed_by_identity=False) == []
