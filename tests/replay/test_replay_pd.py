"""``kv-canary replay --pd``: the prefill-to-decode split (host, reference backend) and the ``pd-*`` faults."""
from __future__ import annotations

import json

import pytest

from canary.replay import cli
from canary.replay.scheduler import load_trace

SMALL = ["replay", "--backend", "reference", "--max-requests", "12", "--max-batch-size", "8", "--chunk-size", "512"]


def _replay(tmp_path, *extra: str) -> tuple[int, dict]:
    out = tmp_path / "summary.json"
    rc = cli.main([*SMALL, *extra, "--json", str(out)])
    return rc, json.loads(out.read_text())


def test_a_clean_pd_run_has_no_violation_and_writes_every_token(tmp_path):
    rc, s = _replay(tmp_path, "--pd")
    c, d = s["canary"], s["pd"]
    assert rc == 0 and c["violations"] == 0 and s["mismatches"] == 0, c
    trace = load_trace("conv", 12)
    assert d["transfers"] == d["digest_checks"] == int((trace.generated_tokens > 1).sum()) > 0
    assert d["digest_mismatches"] == 0 and d["digest_blocks"] >= d["transfers"]
    # The same tokens per request as a run without --pd: each writes context + generated - 1.
    assert d["tokens_written"] == int((trace.context_tokens + trace.generated_tokens - 1).sum())
    rc, off = _replay(tmp_path)
    assert rc == 0 and s["requests_finished"] == off["requests_finished"] == s["requests"]


@pytest.mark.parametrize("kind, extra, reasons", [
    ("pd-flip", (), {"DIGEST", "REAL_KV"}),
    ("pd-zero", (), {"DIGEST", "REAL_KV"}),
    ("pd-drop-layer", ("--num-layers", "2"), {"DIGEST"}),
])
def test_each_pd_fault_is_detected_and_attributed(tmp_path, kind, extra, reasons):
    rc, s = _replay(tmp_path, "--pd", "--inject", f"{kind}@3", *extra)
    c = s["canary"]
    f = c["faults"][0]
    assert rc == 0 and f["detected"] and f["applied_step"] >= 3 and f["steps_to_detection"] == 0, f
    assert reasons <= set(f["reasons"]) and "digest" in f["kernels"]
    assert c["unattributed_violations"] == 0 and s["pd"]["digest_mismatches"] == 1


@pytest.mark.parametrize("argv, message", [
    (["--inject", "pd-flip@3"], "needs --pd"),
    (["--pd", "--inject", "pd-drop-layer@3"], "needs --num-layers >= 2"),
    (["--pd", "--offload-tier", "8192"], "--offload-tier: expected it off with --pd"),
    (["--pd", "--swa-window", "64"], "--swa-window: expected it off with --pd"),
    (["--pd", "--check-every", "4"], "--check-every: expected it off with --pd"),
])
def test_refusals(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        cli.main([*SMALL, *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_kv_flip_still_caught_with_pd(tmp_path):
    rc, s = _replay(tmp_path, "--pd", "--inject", "kv-flip@20")
    assert rc == 0 and s["canary"]["faults"][0]["detected"], s["canary"]["faults"]
