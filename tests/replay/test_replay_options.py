"""``kv-canary replay``'s options are checked when they are parsed: a bad value exits 2 before any work, with
argparse's ``argument --OPTION: ...`` message naming the option and the constraint."""
from __future__ import annotations

import json
import os
import re

import pytest

from canary.replay import cli
from canary.replay.options import INT32_MAX


def refused(capsys, *argv: str) -> str:
    """Run ``kv-canary replay ARGV``; assert that argparse refuses it (exit 2); return its message."""
    with pytest.raises(SystemExit) as exc:
        cli.main(["replay", *argv])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing ran: no banner, no table
    return captured.err.strip().splitlines()[-1]


SIZES = ["--max-batch-size", "--kv-pool-tokens", "--chunk-size", "--page-size"]  # >= 1, int32
ZERO_MEANS_DEFAULT = ["--verify-capacity", "--verify-budget", "--token-budget", "--swa-window"]  # >= 0, int32
COUNTS = ["--max-requests", "--seed", "--check-every"]  # >= 0, no upper bound


@pytest.mark.parametrize("option", SIZES)
@pytest.mark.parametrize("value", ["0", "-3"])
def test_sizes_must_be_positive(capsys, option, value):
    msg = refused(capsys, option, value)
    assert msg.endswith(f"argument {option}: expected an integer >= 1, got {int(value)}"), msg


@pytest.mark.parametrize("option", ZERO_MEANS_DEFAULT + COUNTS)
def test_counts_must_not_be_negative(capsys, option):
    msg = refused(capsys, option, "-1")
    assert msg.endswith(f"argument {option}: expected an integer >= 0, got -1"), msg


@pytest.mark.parametrize("option", SIZES + ZERO_MEANS_DEFAULT)
def test_sizes_stay_in_the_int32_range(capsys, option):
    msg = refused(capsys, option, str(INT32_MAX + 1))
    assert f"argument {option}: expected an integer <= {INT32_MAX}" in msg and str(INT32_MAX + 1) in msg, msg


@pytest.mark.parametrize("option", SIZES + ZERO_MEANS_DEFAULT + COUNTS)
@pytest.mark.parametrize("value", ["abc", "1.5", ""])
def test_integers_only(capsys, option, value):
    msg = refused(capsys, option, value)
    assert re.search(rf"argument {option}: expected an integer >= [01], got {re.escape(repr(value))}$", msg), msg


def test_pool_needs_two_pages(capsys):
    msg = refused(capsys, "--kv-pool-tokens", "63", "--page-size", "32")
    assert msg.endswith("argument --kv-pool-tokens: expected at least 2 pages of --page-size 32 (64 tokens), got 63")


def test_trace_must_be_bundled_or_a_file(capsys, tmp_path):
    msg = refused(capsys, "--trace", str(tmp_path / "missing.csv"))
    assert "argument --trace: expected conv, code or a trace CSV file" in msg and "(no such file)" in msg, msg
    msg = refused(capsys, "--trace", str(tmp_path))
    assert "argument --trace:" in msg and "(not a file)" in msg, msg


def test_malformed_trace_is_a_setup_error(capsys, tmp_path):
    path = tmp_path / "short.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n1,2,3\n2,4\n")
    assert cli.main(["replay", "--trace", str(path)]) == 2
    captured = capsys.readouterr()
    err = captured.err
    assert captured.out == "" and err.startswith("kv-canary: trace ") and "short.csv: expected integer " \
        "ContextTokens" in err, err
    assert "(line 3)" in err  # the file's line, header = line 1: the one way a row is named


def test_rows_are_named_by_their_line_whatever_the_arrival_order(capsys, tmp_path):
    path = tmp_path / "t.csv"
    # The bad row arrives first (timestamp 0) but is the file's line 3.
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n5,2,3\n0,0,4\n")
    assert cli.main(["replay", "--trace", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.strip().endswith("expected token counts >= 1, got [0, 4] (line 3)"), err



@pytest.mark.parametrize("content, words", [
    (b"TIMESTAMP,ContextTokens,GeneratedTokens\n", "expected at least one request row after the header, got none"),
    (b"TIMESTAMP,ContextTokens,GeneratedTokens\n1,2,3\n\xff\xfe,4,5\n", "expected a UTF-8 CSV text file, got "
                                                                       "undecodable bytes"),
])
def test_an_empty_or_binary_trace_is_a_setup_error(capsys, tmp_path, content, words):
    path = tmp_path / "t.csv"
    path.write_bytes(content)
    assert cli.main(["replay", "--trace", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kv-canary: trace ") and words in err, err

@pytest.mark.parametrize("value", ["kv-flip", "nope@3", "kv-flip@x", "kv-flip@-1"])
def test_inject(capsys, value):
    msg = refused(capsys, "--inject", value)
    assert msg.startswith("kv-canary: argument --inject: expected KIND@STEP with KIND one of kv-flip"), msg
    assert repr(value) in msg


def test_backend(capsys):
    assert "argument --backend: invalid choice: 'gpu'" in refused(capsys, "--backend", "gpu")


def test_json_directory_must_exist(capsys, tmp_path):
    msg = refused(capsys, "--json", str(tmp_path / "missing" / "x.json"))
    assert msg.startswith("kv-canary: argument --json: expected a regular file path in an existing, writable "
                          "directory"), msg
    assert "(no directory" in msg


def test_json_must_not_be_a_directory_or_under_a_file(capsys, tmp_path):
    assert "(a directory)" in refused(capsys, "--json", str(tmp_path))
    (tmp_path / "file").write_text("")
    assert "argument --json:" in refused(capsys, "--json", str(tmp_path / "file" / "x.json"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_json_directory_must_be_writable(capsys, tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        assert "(cannot create a file in " in refused(capsys, "--json", str(folder / "x.json"))
    finally:
        folder.chmod(0o755)


def test_verify_budget_and_capacity_must_agree(capsys, tmp_path):
    msg = refused(capsys, "--verify-capacity", "4096", "--verify-budget", "2048")
    assert msg.endswith("argument --verify-budget: expected the value of --verify-capacity (4096) when both are "
                        "given, got 2048"), msg
    out = tmp_path / "s.json"
    for argv in (["--verify-budget", "2048"], ["--verify-budget", "2048", "--verify-capacity", "2048"]):
        assert cli.main(["replay", "--max-requests", "3", *argv, "--json", str(out)]) == 0
        assert json.loads(out.read_text())["verify_capacity"] == 2048
    capsys.readouterr()


def test_zero_keeps_meaning_default_or_none(capsys, tmp_path):
    out = tmp_path / "s.json"
    assert cli.main(["replay", "--max-requests", "3", "--verify-capacity", "0", "--token-budget", "0",
                     "--swa-window", "0", "--seed", "0", "--check-every", "0", "--json", str(out)]) == 0
    assert out.is_file()
    capsys.readouterr()


def test_json_written_in_the_current_directory(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["replay", "--max-requests", "2", "--json", "s.json"]) == 0
    assert (tmp_path / "s.json").is_file()
    capsys.readouterr()


def test_sizes_the_host_cannot_hold_name_the_options(capsys, monkeypatch):
    import canary.replay.replay as replay

    def too_big(*args, **kwargs):
        raise MemoryError("Unable to allocate 4.00 TiB")

    monkeypatch.setattr(replay, "_replay", too_big)
    assert cli.main(["replay", "--max-batch-size", "2147483647"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kv-canary: the replay's arrays do not fit in memory (Unable to allocate 4.00 "
                          "TiB): lower --max-batch-size (now 2147483647), --kv-pool-tokens (131072)"), err
