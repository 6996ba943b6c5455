"""The manager on the bad day: many more corrupted slots than the ring holds, across many requests (issue 25;
docs/records.md 6.1). The reported-slots marks let each step's ring name slots not named yet, so every corrupted
slot is named exactly once within ``ceil(K / ring_capacity)`` steps. The Numba simulator runs the same scenario
(``manager_sim_suite.py``), the CuPy backend too (``test_manager_gpu.py``)."""
from __future__ import annotations

from helpers.manager_engine import check_mass_corruption, mass_corruption


def test_a_hundred_times_the_ring_across_twenty_requests():
    run = mass_corruption(requests=20, prompt=20, ring_capacity=4)  # 400 slots: 100x the ring
    assert run["bound"] == 100
    check_mass_corruption(run)


def test_a_one_row_ring():
    run = mass_corruption(requests=10, prompt=10, ring_capacity=1)
    check_mass_corruption(run)
    assert run["steps"] <= run["bound"] + 1


def test_without_the_marks_the_first_rows_starve_the_rest():
    """What issue 25 found, kept as the control: the marks off, the ring names the same first slots every step."""
    import pytest

    with pytest.raises(AssertionError, match="never named"):
        run = mass_corruption(requests=4, prompt=10, ring_capacity=4, _no_marks=True)
        check_mass_corruption(run)
