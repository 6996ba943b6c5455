"""The shared ``backend`` and ``xp`` fixtures (tests/conftest.py) on the planner: each backend, one test id
(``reference`` everywhere; ``cupy`` and ``numba`` on a GPU), plans two hand cases from arrays of its ``xp``
byte for byte like the reference's expected outputs."""
from __future__ import annotations

import pytest
from helpers.plan_cases import assert_same, expected_outputs, hand_cases, run_case

CASES = hand_cases()[:2]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_plan_on_the_shared_backend(backend, xp, case):
    assert_same(run_case(case, backend, xp.__name__), expected_outputs(case), case)
