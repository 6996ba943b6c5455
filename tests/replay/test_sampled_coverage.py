"""Sampled verification over the bundled traces (SPEC 3.7, docs/replay.md "Verify coverage"): with the defaults
no step goes unverified; a small ``--verify-budget`` samples most steps and still leaves none unverified, with a
staleness within the sweep bound; ``--on-overflow skip`` (SGLang's) leaves the same steps unverified; and every
injected fault is still caught, later when the budget is small."""
from __future__ import annotations

import json

import pytest

from canary.replay import cli
from canary.replay.faults import KINDS, OFFLOAD_KINDS, PD_KINDS, RANK_KINDS

TRACES = ("conv", "code")


def _replay(tmp_path, *argv: str) -> tuple[int, dict]:
    out = tmp_path / "summary.json"
    rc = cli.main(["replay", "--backend", "reference", *argv, "--json", str(out)])
    return rc, json.loads(out.read_text())


@pytest.mark.parametrize("trace", TRACES)
def test_defaults_leave_no_step_unverified(tmp_path, trace):
    """The replay's defaults (300 requests, capacity 77824): the steps above the capacity are sampled, none is
    unverified, and no token waits longer than the largest sweep bound of a sampled step (measured: conv 1 of 2,
    code 2 of 2)."""
    rc, s = _replay(tmp_path, "--trace", trace)
    c = s["canary"]
    assert rc == 0 and s["on_overflow"] == "sample" and s["mismatches"] == 0 and c["violations"] == 0
    assert c["unverified_steps"] == 0 and c["sampled_steps"] == s["sampled_steps"] > 0
    assert 1 <= c["max_staleness_steps"] <= c["max_sweep_steps"]
    assert c["verified_token_steps"] == c["health"]["verify_slots"]


SMALL = ("--max-requests", "40", "--verify-budget", "1024")


@pytest.mark.parametrize("trace", TRACES)
def test_a_small_budget_samples_and_verifies_every_step(tmp_path, trace):
    """``--check-every 1``: the reference planner, with its own cursors, agrees byte for byte on every step."""
    rc, s = _replay(tmp_path, "--trace", trace, *SMALL, "--check-every", "1")
    c = s["canary"]
    assert rc == 0 and s["mismatches"] == 0 and s["checked_steps"] == s["steps"] and c["violations"] == 0
    assert c["unverified_steps"] == 0 and c["sampled_steps"] == s["sampled_steps"] > s["steps"] // 2
    assert 0 < c["verified_fraction"] < 1 and 1 <= c["max_staleness_steps"] <= c["max_sweep_steps"]


@pytest.mark.parametrize("trace", TRACES)
def test_skip_leaves_the_same_steps_unverified(tmp_path, trace):
    rc, s = _replay(tmp_path, "--trace", trace, *SMALL, "--on-overflow", "skip", "--check-every", "5")
    c = s["canary"]
    assert rc == 0 and s["mismatches"] == 0 and s["on_overflow"] == "skip"
    assert c["unverified_steps"] == s["overflow_steps"] > 0 and c["sampled_steps"] == 0


def test_on_overflow_rejects_other_values(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["replay", "--on-overflow", "drop"])
    assert exc.value.code == 2 and "argument --on-overflow: invalid choice: 'drop'" in capsys.readouterr().err


FAULT_RUN = ("--max-requests", "12", "--max-batch-size", "8", "--chunk-size", "512")


# pd-*, rank-*: tests/replay/test_replay_pd.py, test_replay_ranks.py
@pytest.mark.parametrize("kind", [k for k in KINDS if k not in PD_KINDS + RANK_KINDS])
def test_each_fault_is_detected_with_a_small_budget(tmp_path, kind):
    """Budget 256 of the ~1000 cached tokens of a step: nearly every step is sampled. A fault the write sees is
    caught at once; one only a verify sees waits for the rotation to reach its token, so at most the run's
    longest staleness plus the step it was applied in (measured delays: kv-flip 5, zero-kv 5, swa-evict 6,
    stale-row 9, spec-reject 13, token 13 (the manager's write has no token assert); overwrite and row-recycle
    1; position 0)."""
    extra = ("--swa-window", "256") if kind == "swa-evict" else ()
    # The layer rotation under sampling needs a dwell of at least the sampling bound (measured here: 19 steps;
    # with dwell 1 this fault goes undetected): then within dwell * num_layers steps (docs/integration.md 5c).
    dwell = 20
    if kind == "kv-flip-last":
        extra = ("--num-layers", "3", "--layer-dwell", str(dwell))
    if kind in OFFLOAD_KINDS:
        extra = ("--offload-tier", "8192")
    rc, s = _replay(tmp_path, *FAULT_RUN, "--inject", f"{kind}@20", "--verify-budget", "256", *extra)
    c = s["canary"]
    (f,) = c["faults"]
    assert rc == 0 and f["detected"] and c["unattributed_violations"] == 0, f
    assert c["unverified_steps"] == 0 and c["sampled_steps"] > s["steps"] // 2
    if kind == "kv-flip-last":
        assert c["max_sweep_steps"] <= dwell and f["steps_to_detection"] <= dwell * 3 + 1
    else:
        assert f["steps_to_detection"] <= c["max_staleness_steps"] + 1
