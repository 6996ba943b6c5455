"""``kv-canary replay --ranks 2`` (canary.replay.ranks): two gloo rank processes, each its own KV heads and
manager agreeing with the other's; a clean run has no violation on either rank, ``rank-diverge`` / ``rank-flip``
(one rank corrupted) are detected on both ranks within a step, and the options that cannot work are refused."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from canary.replay import cli, ranks

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 60  # a hang (a rank missing from a collective) fails the test instead of blocking the run
SHORT = ["replay", "--max-requests", "12", "--backend", "reference"]


def _replay(tmp_path: Path, *argv: str) -> tuple[int, str, dict]:
    """Run ``kv-canary replay --ranks 2 ARGV`` as its own process; its exit status, output and JSON summary."""
    pytest.importorskip("torch")
    out = tmp_path / "summary.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", COLUMNS="200")
    try:
        p = subprocess.run([sys.executable, "-m", "canary", *SHORT, "--ranks", "2", *argv, "--json", str(out)],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"--ranks 2 did not finish within {TIMEOUT_S} s: {exc.stdout!r} {exc.stderr!r}")
    summary = json.loads(out.read_text()) if out.exists() else {}
    return p.returncode, p.stdout + p.stderr, summary


def test_a_clean_run_has_no_violation_on_any_rank(tmp_path):
    rc, log, s = _replay(tmp_path)
    assert rc == 0, log
    c = s["canary"]
    assert s["ranks"] == 2 and s["mismatches"] == 0
    assert c["violations"] == c["unattributed_violations"] == 0 and not c["failed"]
    assert [r["rank"] for r in c["ranks"]] == [0, 1]
    for r in c["ranks"]:
        assert r["violations"] == 0 and r["steps"] == s["steps"] > 0
        assert r["agreement"]["agreed_steps"] == s["steps"] and r["agreement"]["gathers"] == 0
    assert c["manager"]["ranks"]["tp_size"] == 2
    assert "exited" not in log


@pytest.mark.parametrize("kind, reason, delay", [("rank-diverge", "RANK_DIVERGE", 0),
                                                 ("rank-flip", "RANK_VIOLATION", 1)])
def test_a_fault_on_one_rank_is_detected_on_every_rank(tmp_path, kind, reason, delay):
    rc, log, s = _replay(tmp_path, "--inject", f"{kind}@20")
    assert rc == 0, log
    c = s["canary"]
    (f,) = c["faults"]
    assert f["applied_step"] is not None and f["detected_on_ranks"] == [0, 1]
    assert f["rank_delays"] == [delay, delay] and f["steps_to_detection"] == delay
    assert c["unattributed_violations"] == 0
    for r in c["ranks"]:
        assert reason in r["faults"][0]["reasons"] and r["agreement"]["gathers"] >= 1
    assert f"0,1 ({delay})" in log and "ranks (delay)" in log  # the fault table's column


def refused(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exc:
        cli.main(["replay", *argv])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    return captured.err.strip().splitlines()[-1]


@pytest.mark.parametrize("kind", ["rank-diverge", "rank-flip"])
@pytest.mark.parametrize("more", [[], ["--ranks", "1"]])
def test_rank_kinds_need_two_ranks(capsys, kind, more):
    msg = refused(capsys, "--inject", f"{kind}@3", *more)
    assert msg.startswith(f"kv-canary: argument --inject: {kind}@3 needs --ranks >= 2"), msg


def test_ranks_need_the_canary(capsys):
    msg = refused(capsys, "--ranks", "2", "--plan-only")
    assert msg.startswith("kv-canary: argument --ranks: expected the canary") and "--plan-only" in msg, msg


@pytest.mark.parametrize("value", ["0", "65", "x"])
def test_ranks_is_a_small_positive_integer(capsys, value):
    assert refused(capsys, "--ranks", value).startswith("kv-canary: argument --ranks: expected an integer")


def test_ranks_without_torch_say_how_to_install_it(capsys, monkeypatch):
    real = ranks.importlib.util.find_spec
    monkeypatch.setattr(ranks.importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    msg = refused(capsys, "--ranks", "2")
    assert msg.startswith("kv-canary: argument --ranks: expected torch") and "pip install torch" in msg, msg


def test_gpu_ranks_need_a_gpu_each(capsys, monkeypatch):
    monkeypatch.setattr(ranks, "_gpus", lambda: 1)
    args = cli.build_parser().parse_args(["replay", "--ranks", "2"])
    assert ranks.launch(args, "cupy") == 2
    err = capsys.readouterr().err
    assert err.startswith("kv-canary: --ranks 2: expected 2 GPUs (one a rank, NCCL), got 1"), err


@pytest.mark.gpu
def test_gpu_ranks_detect_a_flip_on_every_rank(tmp_path):
    cupy = pytest.importorskip("cupy")
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs 2 GPUs")
    pytest.importorskip("torch")
    out = tmp_path / "summary.json"
    p = subprocess.run([sys.executable, "-m", "canary", "replay", "--max-requests", "30", "--backend", "cupy",
                        "--ranks", "2", "--inject", "rank-flip@20", "--inject", "rank-diverge@25", "--json", str(out)],
                       cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                       timeout=TIMEOUT_S * 3)
    assert p.returncode == 0, p.stdout + p.stderr
    c = json.loads(out.read_text())["canary"]
    assert [f["detected_on_ranks"] for f in c["faults"]] == [[0, 1], [0, 1]] and c["unattributed_violations"] == 0
