"""The CuPy planner's two-launch path (rows + entries) at every batch size, and both ways its rows launch builds a
sampled step's table (SPEC 3.7): in side blocks on other SMs while block 0 scans (the default), and in block 0
after its scan (``LaunchConfig(side_blocks=False)``, also what a batch capacity too large for the side grid gets).
Byte for byte against the reference, cursors included, outputs poisoned. Marker ``gpu``."""
from __future__ import annotations

import numpy as np
import pytest

from helpers.gpu_guard import backend_or_skip
from helpers.plan_cases import (
    POISON_ALT, assert_same, expected_outputs, hand_cases, random_case, run_case,
)

pytestmark = pytest.mark.gpu


@pytest.fixture(params=[True, False], ids=["side_blocks", "block0"])
def launch(request):
    backend_or_skip("cupy")
    from canary import LaunchConfig

    return LaunchConfig(fused_max_bs=-1, side_blocks=request.param)


@pytest.mark.parametrize("case", hand_cases(), ids=lambda c: c.name)
def test_hand_cases(case, launch):
    assert_same(run_case(case, "cupy", "cupy", POISON_ALT, launch_config=launch), expected_outputs(case, POISON_ALT),
                case)


SAMPLED_KNOBS = [
    dict(bs=(1, 40), max_seq_len=(1, 60)),
    dict(bs=(900, 1100), max_seq_len=(1, 40), max_reqs=(50, 1200)),  # one or two side tiles
    dict(bs=(2000, 4500), max_seq_len=(1, 30), max_reqs=(50, 5000)),  # several tiles, rows sharing a request row
    dict(bs=(1000, 3000), max_seq_len=(1, 30), max_reqs=(3000, 3000), swa=True, pool=True, fault_prob=0.02),
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
    from helpers.plan_cases import OUTPUTS, make_plans, to_xp

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
        got = {name: cupy.asnumpy(raw[name]) for name in OUTPUTS + ("verify_cursors",)}
        n = int(want["verify_num_valid"][0])
        for name in OUTPUTS + ("verify_cursors",):  # what this step wrote: the buffers hold earlier steps too
            end = {"verify_slot_indices": n, "verify_expected_tokens": n, "verify_expected_positions": n,
                   "verify_prev_slot_indices": n, "write_seed_slot_indices": k}.get(name)
            np.testing.assert_array_equal(got[name][:end], want[name][:end], err_msg=f"{c.name}: {name}")
        sampled += bool(int(want["status"][0]) & 64)
        cursors = want["verify_cursors"]
    assert 2 <= sampled < len(sizes)
