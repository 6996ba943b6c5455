"""``kv-canary replay`` as a new user meets it: conflicting or repeated options refused, Ctrl-C, the progress
lines and table width without a terminal, and the ``--json`` file (its up-front check, atomic write, provenance)."""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import tempfile

import pytest

import canary
import canary.replay.replay_manager
import canary.replay.report as report
from canary.replay import cli
from helpers.replay_cli import SHORT, refused



@pytest.mark.parametrize("argv, words", [
    (["--plan-only", "--num-layers", "4"], "kv-canary: argument --num-layers: expected the canary"),
    (["--plan-only", "--layer-dwell", "2"], "kv-canary: argument --layer-dwell: expected the canary"),
    (["--plan-only", "--inject", "kv-flip@3"], "kv-canary: argument --inject: expected the canary, got --plan-only"),
    (["--layer-dwell", "3"], "kv-canary: argument --layer-dwell: expected --num-layers >= 2"),
    (["--layer-dwell", "3", "--num-layers", "1"], "kv-canary: argument --layer-dwell: expected --num-layers >= 2"),
    (["--verify-capacity", "4096", "--verify-budget", "2048"], "kv-canary: argument --verify-budget: expected"),
])
def test_conflicting_options_are_refused(capsys, argv, words):
    assert refused(capsys, *argv).startswith(words)


@pytest.mark.parametrize("argv, words", [
    (["--trace", "conv", "--trace", "code"], "kv-canary: argument --trace: expected once, got it twice"),
    (["--max-requests", "5", "--max-requests", "6"], "argument --max-requests: expected once, got it twice"),
    (["--plan-only", "--plan-only"], "argument --plan-only: expected once, got it twice"),
    (["--no-pad", "--no-pad"], "argument --no-pad: expected once, got it twice"),
    (["--seed=1", "--seed", "1"], "argument --seed: expected once, got it twice"),
])
def test_an_option_given_twice_is_refused(capsys, argv, words):
    assert words in refused(capsys, *argv)


def test_inject_is_repeatable(tmp_path, capsys):
    out = tmp_path / "s.json"
    assert cli.main([*SHORT, "--inject", "token@3", "--inject", "position@3", "--json", str(out)]) in (0, 1)
    assert [f["kind"] for f in json.loads(out.read_text())["canary"]["faults"]] == ["token", "position"]
    capsys.readouterr()


def test_json_may_not_replace_the_trace(capsys, tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n1,20,3\n")
    msg = refused(capsys, "--trace", str(trace), "--json", str(trace))
    assert msg.startswith("kv-canary: argument --json: expected a path other than the trace's"), msg


def test_usage_errors_go_to_stderr_with_the_usage(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["replay", "--chunk-size", "0"])
    captured = capsys.readouterr()
    assert exc.value.code == 2 and captured.out == ""
    lines = captured.err.strip().splitlines()
    assert lines[0].startswith("usage: kv-canary replay")
    assert lines[-1] == "kv-canary: argument --chunk-size: expected an integer >= 1, got 0"


# -- Ctrl-C ---------------------------------------------------------------------------------------------------


def _interrupt_at(monkeypatch, index: int) -> None:
    real = canary.replay.replay_manager.ManagerReplay.run

    def run(self, step, *args, **kw):
        if step.index == index:
            raise KeyboardInterrupt
        return real(self, step, *args, **kw)

    monkeypatch.setattr(canary.replay.replay_manager.ManagerReplay, "run", run)


def test_ctrl_c_prints_the_partial_report_and_exits_130(tmp_path, monkeypatch, capsys):
    _interrupt_at(monkeypatch, 5)
    out = tmp_path / "s.json"
    assert cli.main([*SHORT, "--inject", "token@1000", "--json", str(out)]) == 130
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    assert "kv-canary: interrupted after 5 steps: the report of those steps follows" in captured.err
    assert "steps" in captured.out and "requests finished" in captured.out  # the summary table
    s = json.loads(out.read_text())  # the partial summary is written too
    assert s["interrupted"] is True and s["steps"] == 5 and s["requests_finished"] < s["requests"]
    (f,) = s["canary"]["faults"]
    assert f["what"] == "not applied: the replay was interrupted at step 5, before step 1000"


def test_ctrl_c_before_the_loop_exits_130_without_a_traceback(monkeypatch, capsys):
    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(canary.replay.replay, "load_trace", boom)
    assert cli.main(SHORT) == 130
    captured = capsys.readouterr()
    assert captured.err.strip() == "kv-canary: interrupted" and "Traceback" not in captured.out


# -- output that is not a terminal ------------------------------------------------------------------------------


def test_progress_lines_without_a_terminal(monkeypatch, capsys):
    monkeypatch.setattr(report, "PROGRESS_INTERVAL_S", 0.0)  # a line every step
    assert cli.main(SHORT) == 0
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.startswith("kv-canary replay: step ")]
    assert lines and "kv-canary replay: step " not in captured.out  # progress on stderr, the report on stdout
    assert lines[0].startswith("kv-canary replay: step 1, ") and " requests finished, " in lines[0]
    # (a request counts as finished once the scheduler moves past its last step: the last line may lag by one)
    assert lines[-1].endswith("ETA 0 s") and "100% of the trace's tokens, " in lines[-1]


def test_progress_log_every_interval_and_every_tenth():
    class Clock:
        t = 0.0

        def __call__(self):
            return self.t

    clock, lines = Clock(), []

    class Stream:
        def write(self, text):
            lines.extend(line for line in text.splitlines() if line)

        def flush(self):
            pass

    log = report.ProgressLog(1000, 10, clock=clock, stream=Stream())
    clock.t = 1.0
    log.update(1, 150, 0)  # a tenth crossed, but only 1 s since the start (< interval / 5): nothing
    assert lines == []
    clock.t = 2.5
    log.update(2, 50, 1)  # 20%, 2.5 s: a tenth crossed and 2 s passed
    assert lines == ["kv-canary replay: step 2, 20% of the trace's tokens, 1/10 requests finished, 2.5 s, ETA 10 s"]
    clock.t = 3.0
    log.update(3, 10, 1)  # no new tenth, 0.5 s: nothing
    clock.t = 12.6
    log.update(4, 10, 2)  # the interval passed: a line whatever the share
    assert len(lines) == 2 and lines[1].startswith("kv-canary replay: step 4, 22% ")


def test_tables_do_not_wrap_at_80_columns_without_a_terminal(monkeypatch, capsys):
    monkeypatch.delenv("COLUMNS", raising=False)
    assert cli.main(SHORT) == 0
    out = capsys.readouterr().out
    assert "│ before_forward (plan + verify) / step (us) │" in out  # one line, not wrapped after "step"
    assert max(map(len, out.splitlines())) > 80


# -- --json -----------------------------------------------------------------------------------------------------


def test_json_records_version_commit_and_command(tmp_path, capsys, monkeypatch):
    out = tmp_path / "s.json"
    monkeypatch.setattr(sys, "argv", ["kv-canary", *SHORT, "--json", str(out)])
    assert cli.main(SHORT + ["--json", str(out)]) == 0
    s = json.loads(out.read_text())
    assert s["version"] == canary.__version__ and s["command"] == ["kv-canary", *SHORT, "--json", str(out)]
    assert s["commit"] is None or len(s["commit"]) >= 7
    assert s["interrupted"] is False
    capsys.readouterr()


def test_commit_of_the_checkout(monkeypatch):
    monkeypatch.delenv("KV_CANARY_COMMIT", raising=False)
    root = os.path.dirname(os.path.dirname(canary.__file__))
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True,
                           text=True).stdout.strip()
    assert report.git_commit() == head.stdout.strip() + ("-dirty" if dirty else "")  # a changed tree says so
    monkeypatch.setenv("KV_CANARY_COMMIT", "abc1234")
    assert report.git_commit() == "abc1234"


def test_json_is_written_atomically(tmp_path, monkeypatch):
    out = tmp_path / "s.json"
    out.write_text('{"old": true}\n')
    report.write_json(str(out), {"new": 1})
    assert json.loads(out.read_text()) == {"new": 1} and os.listdir(tmp_path) == ["s.json"]

    def fail(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(json, "dump", fail)
    with pytest.raises(OSError):
        report.write_json(str(out), {"newer": 2})
    assert json.loads(out.read_text()) == {"new": 1} and os.listdir(tmp_path) == ["s.json"]  # old file, no temp


def test_json_follows_a_symbolic_link(tmp_path):
    real = tmp_path / "real.json"
    real.write_text("{}")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    report.write_json(str(link), {"x": 1})
    assert link.is_symlink() and json.loads(real.read_text()) == {"x": 1}


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs")
def test_json_refuses_a_fifo(capsys, tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    assert "(not a regular file: a FIFO, socket or device)" in refused(capsys, "--json", str(fifo))


def test_json_refuses_a_device(capsys):
    assert "(not a regular file: a FIFO, socket or device)" in refused(capsys, "--json", os.devnull)


def test_json_on_a_read_only_mount_is_refused_up_front(capsys, tmp_path, monkeypatch):
    """Root passes every permission test; a read-only mount refuses the file itself (EROFS): the check creates
    one, so the refusal comes before the run."""

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", read_only)
    msg = refused(capsys, "--json", str(tmp_path / "s.json"))
    assert msg.endswith(f"(cannot create a file in {str(tmp_path)!r}: Read-only file system)"), msg


def test_json_write_failing_after_the_run_is_an_error_on_stderr(tmp_path, monkeypatch, capsys):
    def fail(path, summary):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(canary.replay.replay, "write_json", fail)
    out = tmp_path / "s.json"
    assert cli.main([*SHORT, "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kv-canary: --json {out}: cannot write the summary: "), err
