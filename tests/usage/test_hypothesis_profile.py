"""Every Hypothesis test replays: the ``ci`` profile of tests/conftest.py derandomizes them (no database, the
same examples on every run and machine), and no test's own ``@settings`` turns that off."""
from __future__ import annotations

import pytest
from hypothesis import settings


def _profile_chosen(config) -> str | None:
    try:
        return config.getoption("hypothesis_profile")
    except ValueError:  # the hypothesis pytest plugin is not loaded
        return None


def test_hypothesis_tests_are_derandomized(request):
    chosen = _profile_chosen(request.config)
    if chosen not in (None, "ci"):
        pytest.skip(f"--hypothesis-profile={chosen}: random examples asked for")
    assert settings.default.derandomize and settings.default.database is None
    for item in request.session.items:
        fn = getattr(item, "obj", None)
        if getattr(fn, "is_hypothesis_test", False):
            used = getattr(fn, "_hypothesis_internal_use_settings", settings.default)
            assert used.derandomize, f"{item.nodeid}: its @settings draw random examples (set derandomize=True)"
