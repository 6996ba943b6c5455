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


def test_marks_a_missing_row_by_its_predecessor_and_release_it_with_its_request():
    """suppress.py: a verify row marks its slot (bit 1), a MISSING row its predecessor slot (bit 2), a write row
    nothing; a record naming no request marks nothing; a finished request releases its records' marks."""
    from types import SimpleNamespace

    import numpy as np

    from canary.contract.plans import MISSING_SLOT
    from canary.contract.ring import FailReason, KernelTag, Violation
    from canary.manager.suppress import ReportedSlots

    def row(kernel, slot, aux, reasons):
        return Violation(kernel, 0, slot, 3, 0, -1, 0, aux, reasons)

    marks = ReportedSlots([8], None)
    owned = SimpleNamespace(requests=(("a", 3),), writers=(), prefixes=())
    marks.mark(0, owned, [row(KernelTag.VERIFY, 5, 0, FailReason.CHAIN),
                          row(KernelTag.VERIFY, MISSING_SLOT, 4, FailReason.MISSING),
                          row(KernelTag.WRITE, 6, -1, FailReason.WRITE_TOKEN)])
    marks.mark(0, SimpleNamespace(requests=(), writers=(), prefixes=()), [row(KernelTag.VERIFY, 7, 0, FailReason.CHAIN)])
    assert marks.arrays[0].tolist() == [0, 0, 0, 0, 2, 1, 0, 0] and marks.marked == 2
    marks.release_request("b")
    assert marks.marked == 2
    marks.release_request("a")
    assert not np.any(marks.arrays[0]) and marks.marked == 0
