"""``kv-canary replay --plot PATH``: the picture of a run (entries verified per step against the budget,
staleness, the injected faults), its series, and the refusals before the run (no matplotlib, an unknown
suffix, a path that cannot be written or that another output names)."""
from __future__ import annotations

import importlib.util
import json
import sys

import pytest

import canary.replay.replay as replay
from canary.replay import cli, plot
from helpers.replay_cli import SHORT, refused

PNG = b"\x89PNG\r\n\x1a\n"
# The --plot checks that follow matplotlib's own (its formats, the drawing) need it: CI's bare venv has none.
needs_mpl = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                               reason="needs matplotlib: pip install matplotlib (the plot extra)")


@pytest.fixture
def drawn(monkeypatch):
    """The series and summary each write_plot was given (the plot is still written)."""
    seen = []

    def spy(path, series, summary):
        seen.append((series, summary))
        real(path, series, summary)

    real = replay.write_plot
    monkeypatch.setattr(replay, "write_plot", spy)
    return seen


@needs_mpl
def test_plot_of_a_run_with_a_fault(tmp_path, capsys, drawn):
    out, js = tmp_path / "run.png", tmp_path / "s.json"
    rc = cli.main([*SHORT, "--verify-budget", "256", "--inject", "kv-flip@5", "--plot", str(out), "--json", str(js)])
    capsys.readouterr()
    assert rc == 0
    assert out.read_bytes()[:8] == PNG
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # the atomic write's temporary is gone
    (series, summary), = drawn
    assert summary == json.loads(js.read_text())
    n = summary["steps"]
    assert n > 5 and len(series.asked) == len(series.verified) == len(series.staleness) == n
    assert max(series.verified) <= summary["verify_capacity"] == 256
    assert all(v <= a for v, a in zip(series.verified, series.asked))
    assert max(series.asked) == summary["verify_entries_per_step"]["max"]
    assert max(series.staleness) == summary["canary"]["max_staleness_steps"] > 0  # the budget left some unverified
    (f,) = summary["canary"]["faults"]
    assert f["detected"] and plot._fault_label(f).startswith(f"kv-flip@5: applied {f['applied_step']}, detected ")


@needs_mpl
def test_plot_only_plan_draws_the_entries(tmp_path, capsys, drawn):
    out = tmp_path / "run.svg"
    assert cli.main([*SHORT, "--plan-only", "--plot", str(out)]) == 0
    capsys.readouterr()
    assert out.read_bytes().lstrip().startswith(b"<?xml")
    (series, summary), = drawn
    assert len(series.asked) == len(series.verified) == summary["steps"] and series.staleness == []


def test_fault_labels():
    base = {"kind": "token", "requested_step": 9}
    assert plot._fault_label({**base, "applied_step": None, "detected": False}) == "token@9: NOT APPLIED"
    assert plot._fault_label({**base, "applied_step": 9, "detected": False}) == "token@9: applied 9, NOT DETECTED"
    assert plot._fault_label({**base, "applied_step": 9, "detected": True, "first_violation_step": 10,
                              "steps_to_detection": 1}) == "token@9: applied 9, detected 10 (+1)"


def test_without_matplotlib_refused_before_the_run(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    monkeypatch.setattr(replay, "run", lambda args: pytest.fail("the run started"))
    msg = refused(capsys, "--plot", str(tmp_path / "run.png"))
    assert msg == ("kv-canary: --plot: needs matplotlib: pip install matplotlib (or, in the checkout, "
                   "pip install '.[plot]')")
    assert not (tmp_path / "run.png").exists()


@needs_mpl
@pytest.mark.parametrize("name", ["run.xyz", "run"])
def test_unknown_suffix_refused(tmp_path, capsys, name):
    msg = refused(capsys, "--plot", str(tmp_path / name))
    assert msg.startswith("kv-canary: argument --plot: expected a file name ending in a format matplotlib writes ("
                          ) and ".png" in msg and ".pdf" in msg


@needs_mpl
def test_unwritable_paths_refused(tmp_path, capsys):
    assert "(a directory)" in refused(capsys, "--plot", str(tmp_path))
    assert "(no directory " in refused(capsys, "--plot", str(tmp_path / "missing" / "run.png"))
    both = str(tmp_path / "same.png")
    assert refused(capsys, "--plot", both, "--json", both).startswith(
        "kv-canary: argument --plot: expected a path other than --json's")
    trace = tmp_path / "t.png"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n1,20,3\n")
    assert refused(capsys, "--trace", str(trace), "--plot", str(trace)).startswith(
        "kv-canary: argument --plot: expected a path other than the trace's")
    assert "expected once, got it twice" in refused(capsys, "--plot", both, "--plot", both)


@needs_mpl
def test_a_failed_write_after_the_run_exits_2(tmp_path, capsys, monkeypatch):
    def gone(path, fill):
        raise FileNotFoundError(2, "No such file or directory")

    monkeypatch.setattr(plot, "write_atomic", gone)
    assert cli.main([*SHORT, "--plot", str(tmp_path / "run.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"kv-canary: --plot {tmp_path / 'run.png'}: cannot write the plot: ")
