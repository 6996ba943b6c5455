"""The CuPy planner's two-launch path (rows + entries) at every batch size, and both ways its rows launch builds a
sampled step's table (SPEC 3.7): in side blocks on other SMs while block 0 scans (the default), and in block 0
after its scan (``LaunchConfig(side_blocks=False)``, also what a batch capacity too large for the side grid gets).
Byte for byte against the reference, cursors included, outputs poisoned. Marker ``gpu``."""
from __future__ import annotations

import numpy as np
import pytest

from canary.errors import PlanStatus

from helpers.gpu_guard import backend_or_skip
from helpers.plan_cases import (
    OUTPUTS, POISON_ALT, assert_same, expected_outputs, hand_cases, random_case, run_case,
)

pytestmark = pytest.mark.gpu


@pytest.fixture(params=[True, False], ids=["side_blocks", "block0"])
def launch(request):
    backend_or_skip("cupy")
    from canary import LaunchConfig

    return LaunchConfig(fused_max_bs=-1, side_blocks=request.param)


# SPEC 3.4: rows that cannot be trusted; a step with any of these bits writes no verify entry
NO_ENTRIES = int(PlanStatus.BAD_REQ_POOL_INDEX | PlanStatus.BAD_PREFIX_LEN | PlanStatus.BAD_VALID_LEN
                 | PlanStatus.BAD_EXTEND_LEN)


def assert_step_wrote(raw, want, entries: int, bs: int, label: str) -> None:
    """The device buffers equal the reference ``want`` where one step of a planner stepped repeatedly writes:
    ``entries`` verify entries, ``bs`` seeds, every other output and the cursors whole (the buffers hold earlier
    steps' values past those)."""
    import cupy

    for name in OUTPUTS + ("verify_cursors",):
        end = {"verify_slot_indices": entries, "verify_expected_tokens": entries,
               "verify_expected_positions": entries, "verify_prev_slot_indices": entries,
               "write_seed_slot_indices": bs}.get(name)
        np.testing.assert_array_equal(cupy.asnumpy(raw[name])[:end], want[name][:end], err_msg=f"{label}: {name}")


@pytest.mark.parametrize("case", hand_cases(), ids=lambda c: c.name)
def test_hand_cases(case, launch):
    assert_same(run_case(case, "cupy", "cupy", POISON_ALT, launch_config=launch), expected_outputs(case, POISON_ALT),
                case)


SAMPLED_KNOBS = [
    dict(bs=(1, 40), max_seq_len=(1, 60)),
    dict(bs=(900, 1100), max_seq_len=(1, 40), max_reqs=(50, 1200)),  # one or two side tiles
    dict(bs=(2000, 4500), max_seq_len=(1, 30), max_reqs=(50, 5000)),  # several tiles, rows sharing a request row
    dict(bs=(1000, 3000), max_seq_len=(1, 30), max_reqs=(3000, 3000), swa=True, pool=True, pool_indices=None),
    # faults: a flagged row stops sampling (SPEC 3.7: the state advances only on steps whose rows are trusted)
    dict(bs=(1000, 3000), max_seq_len=(1, 30), max_reqs=(3000, 3000), swa=True, pool=True, fault_prob=0.001),
    dict(bs=(1500, 2500), max_seq_len=(2, 20), max_reqs=(2600, 2600), padding_fraction=0.5,
         padding_rows_carry_tokens=True),
]


@pytest.mark.parametrize("seed", range(60))
def test_random_sampled_cases(seed, launch):
    """Budgets from one entry to just below the total (``capacity="sampled"``), so both rules of SPEC 3.7 (C < n,
    C >= n) and the rotation head run; cursors start zero, inside the windows, or as garbage."""
    knobs = SAMPLED_KNOBS[seed % len(SAMPLED_KNOBS)]
    case = random_case(1000 + seed, capacity="sampled", on_overflow="sample", name=f"sampled-{seed}", **knobs)
    assert_same(run_case(case, "cupy", "cupy", launch_config=launch), expected_outputs(case), case)


def test_sampled_steps_follow_each_other(launch):
    """One planner stepped over sampled and full steps of changing batch sizes (one to three side tiles) stays
    byte-identical to the reference, each step from the cursors the step before left: the side blocks' next
    cursors in the scratch are moved and zeroed by every sampled step (a word left behind would move a cursor in a
    later step)."""
    import cupy

    from canary import CanaryPlanner
    from helpers.plan_cases import make_plans, to_xp

    base = random_case(2024, bs=(2900, 2900), max_reqs=(3000, 3000), max_seq_len=(1, 30), swa=False, lut=False,
                       pool=False, padding_fraction=0.1, capacity="loose", on_overflow="sample", name="steps")
    sizes = [2900, 1200, 2048, 600, 1025, 2900, 1]
    counts = np.minimum(base.prefix_lens, base.max_seq_len) * (base.req_pool_indices > 0)
    capacity = max(1, int(counts[:1200].sum()))  # the smaller steps fit, the larger ones sample
    base = base.replace(verify_capacity=capacity)
    vp, wp, raw = make_plans(base, "cupy")
    conv = lambda a: to_xp(a, "cupy")  # noqa: E731
    planner = CanaryPlanner(backend="cupy", verify_plan_out=vp, write_plan_out=wp, launch_config=launch,
                            verify_capacity=capacity, max_batch_size=base.max_batch_size, **base.static_kwargs(conv))
    cursors = base.initial_cursors  # make_plans' starting state
    sampled = 0
    for k in sizes:
        c = base.replace(req_pool_indices=base.req_pool_indices[:k], prefix_lens=base.prefix_lens[:k],
                         extend_seq_lens=base.extend_seq_lens[:k], cursors=cursors, name=f"steps-bs{k}")
        want = expected_outputs(c)
        planner.plan(**c.step_kwargs(conv))
        cupy.cuda.Device().synchronize()
        assert_step_wrote(raw, want, int(want["verify_num_valid"][0]), k, c.name)
        sampled += bool(int(want["status"][0]) & PlanStatus.SAMPLED)
        cursors = want["verify_cursors"]
    assert 2 <= sampled < len(sizes)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("side_blocks", [True, False], ids=["side_blocks", "block0"])
def test_hostile_step_sequences(seed, side_blocks):
    """One planner (default launch: fused and two-pass launches alternate with the batch size) over 14 steps of
    random subsets of one batch, request rows repeated, a bad row now and then, the rotation head overwritten
    with garbage between steps, budgets below, at and above the number of requests: every step byte-identical to
    the reference from the cursors the step before left, and the side blocks' next cursors all zero after each."""
    backend_or_skip("cupy")
    import cupy

    from canary import CanaryPlanner, LaunchConfig
    from canary.contract.plan_layout import SCRATCH_TABLE, TABLE_ARRAYS
    from helpers.plan_cases import make_plans, to_xp

    rng = np.random.default_rng(seed)
    base = random_case(seed, bs=(3000, 3000), max_reqs=(150, 400), max_seq_len=(2, 30), padding_fraction=0.2,
                       capacity="loose", on_overflow="sample", name=f"hostile-{seed}")
    rpi, R = base.req_pool_indices, base.write_req_capacity
    n = int((base.prefix_lens[rpi > 0] > 0).sum())
    C = int(rng.choice([max(1, n // 3), n, n + 1, n + 50, 2 * n, 1]))
    base = base.replace(verify_capacity=C)
    vp, wp, raw = make_plans(base, "cupy")
    conv = lambda a: to_xp(a, "cupy")  # noqa: E731
    planner = CanaryPlanner(backend="cupy", verify_plan_out=vp, write_plan_out=wp, verify_capacity=C,
                            launch_config=LaunchConfig(side_blocks=side_blocks), max_batch_size=R,
                            **base.static_kwargs(conv))
    next_words = SCRATCH_TABLE + TABLE_ARRAYS * (R + 1)
    cursors = base.initial_cursors
    for step in range(14):
        k = int(rng.choice([3000, 2999, 2048, 1025, 1024, 700, 513, 512, 100, 1, 0]))
        idx = rng.choice(3000, k, replace=False) if rng.random() < 0.5 else np.arange(k)
        rows = rpi[idx].copy()
        if k and rng.random() < 0.15:
            rows[rng.integers(k)] = -1  # BAD_REQ_POOL_INDEX: nothing sampled, the state left alone
        if rng.random() < 0.3:
            head = int(rng.choice([-5, 0, 1, n - 1, n, 10**18]))
            cursors = cursors.copy()
            cursors[0] = head
            raw["verify_cursors"][0] = head
        c = base.replace(req_pool_indices=rows, prefix_lens=base.prefix_lens[idx], cursors=cursors,
                         extend_seq_lens=base.extend_seq_lens[idx],
                         valid_lens=None if base.valid_lens is None else base.valid_lens[idx],
                         pool_indices=None if base.pool_indices is None else base.pool_indices[idx],
                         name=f"hostile-{seed}-step{step}-bs{k}")
        want = expected_outputs(c)
        planner.plan(**c.step_kwargs(conv))
        cupy.cuda.Device().synchronize()
        m = 0 if int(want["status"][0]) & NO_ENTRIES else int(want["verify_num_valid"][0])
        assert_step_wrote(raw, want, m, k, c.name)
        assert not cupy.asnumpy(planner._bound.scratch[next_words:]).any(), c.name
        cursors = want["verify_cursors"]
