"""``kv-canary replay --offload-tier``: preemption into a host tier and restore into new pages (host, reference
backend), and the ``offload-*`` faults applied at a restore."""
from __future__ import annotations

import json

import numpy as np
import pytest

import canary.replay.scheduler as scheduler
from canary.replay import cli, tier
from canary.replay.faults import OFFLOAD_KINDS
from canary.replay.scheduler import OFFLOAD_EVERY, Scheduler, load_trace

SMALL = ["replay", "--backend", "reference", "--max-requests", "12", "--max-batch-size", "8", "--chunk-size", "512"]
TIER = ["--offload-tier", "8192"]


def _replay(tmp_path, *extra: str) -> tuple[int, dict]:
    out = tmp_path / "summary.json"
    rc = cli.main([*SMALL, *extra, "--json", str(out)])
    return rc, json.loads(out.read_text())


def _written(sched: Scheduler) -> np.ndarray:
    """Tokens written per request over the whole run."""
    out = np.zeros(len(sched.trace), dtype=np.int64)
    for step in sched.steps():
        np.add.at(out, step.request_ids, step.extend_seq_lens[: step.num_active])
    return out


def test_a_clean_run_with_the_tier_has_no_violation(tmp_path):
    rc, s = _replay(tmp_path, *TIER)
    c = s["canary"]
    assert rc == 0 and c["violations"] == 0 and s["mismatches"] == 0, c
    assert s["offload_tier"] == 8192 and s["offloads"] > 0 and s["restores"] == s["offloads"]
    rc, off = _replay(tmp_path)
    assert rc == 0 and off["offloads"] == off["restores"] == 0 and off["offload_tier"] == 0
    assert s["requests_finished"] == off["requests_finished"] == s["requests"]


def test_the_tier_changes_no_request_and_restores_into_other_slots():
    """Every request writes its whole sequence with the tier as without; restores land in other slots than the
    offload read (the victim's pages are handed out last)."""
    trace = load_trace("conv", 30)
    moves = {}
    sched = Scheduler(trace, kv_pool_tokens=1 << 14, offload_tier=8192)
    sched.on_offload = lambda i, req, row, p: moves.setdefault(req, []).append(sched.req_to_token[row, :p].copy())
    sched.on_restore = lambda i, req, row, p: moves[req].append(sched.req_to_token[row, :p].copy())
    with_tier = _written(sched)
    assert np.array_equal(with_tier, _written(Scheduler(trace, kv_pool_tokens=1 << 14)))
    assert np.array_equal(with_tier, sched.kv_len) and sched.num_offloads == sched.num_restores > 0
    pairs = [(a, b) for slots in moves.values() for a, b in zip(slots[::2], slots[1::2])]
    # A pool this small hands some of the victim's pages out again (all of it is in use), but never in place.
    assert len(pairs) == sched.num_restores and not any(np.array_equal(a, b) for a, b in pairs)
    assert sum(not np.isin(b, a).any() for a, b in pairs) > len(pairs) // 2
    assert sched.free_pages.size == sched.num_pages - 1  # every page came back


def test_pool_pressure_preempts_without_the_period(monkeypatch):
    """A pool too small for the queue's head: a decoding request makes room for it, with no periodic trigger."""
    monkeypatch.setattr(scheduler, "OFFLOAD_EVERY", 1 << 30)
    trace = load_trace("conv", 30)
    sched = Scheduler(trace, kv_pool_tokens=1 << 14, offload_tier=8192)
    assert np.array_equal(_written(sched), sched.kv_len) and sched.num_offloads == sched.num_restores > 0
    quiet = Scheduler(trace, offload_tier=8192)  # the default pool: never under pressure
    _written(quiet)
    assert quiet.num_offloads == 0 and OFFLOAD_EVERY == 8


EXPECTED = {  # the reasons at the first detection (the same step: the restore runs before its plan)
    "offload-stale": {"VERIFY_TOKEN", "CHAIN"},
    "offload-swap": {"POSITION", "CHAIN"},
    "offload-partial": {"POSITION", "WRITE_POSITION"},
    "offload-foreign": {"REAL_KV"},
}


@pytest.mark.parametrize("kind", OFFLOAD_KINDS)
def test_each_offload_fault_is_detected_and_attributed(tmp_path, capsys, kind):
    rc, s = _replay(tmp_path, *TIER, "--inject", f"{kind}@20")
    text = capsys.readouterr().out
    c = s["canary"]
    (f,) = c["faults"]
    assert rc == 0, text
    assert f["kind"] == kind and f["applied_step"] >= 20 and f["detected"] and f["steps_to_detection"] == 0, f
    assert EXPECTED[kind] <= set(f["reasons"]) and "verify" in f["kernels"]
    if kind == "offload-foreign":  # the right records over wrong bytes: the real-KV fold alone sees it
        assert f["reasons"] == f["all_reasons"] == ["REAL_KV"]
    assert f["slot"] > 0 and f["position"] >= 0 and len(f["requests"]) == 1 and f["violations"] >= 1
    assert c["violations"] == f["violations"] and c["unattributed_violations"] == 0
    assert f"FAULT {kind}@20: slot {f['slot']}" in text and "offloads / restores" in text


def test_all_offload_faults_at_once_with_layers_and_a_small_budget(tmp_path):
    args = [a for k in OFFLOAD_KINDS for a in ("--inject", f"{k}@20")]
    rc, s = _replay(tmp_path, *TIER, *args, "--num-layers", "2", "--verify-budget", "256")
    faults = s["canary"]["faults"]
    assert rc == 0 and [f["kind"] for f in faults] == list(OFFLOAD_KINDS)
    assert all(f["detected"] for f in faults) and s["canary"]["unattributed_violations"] == 0, faults
    requests = [r for f in faults for r in f["requests"]]
    assert len(requests) == len(set(requests))  # each restore fault on its own request


def _refused(capsys, *extra: str) -> str:
    with pytest.raises(SystemExit) as exc:
        cli.main([*SMALL, *extra])
    captured = capsys.readouterr()
    assert exc.value.code == 2 and captured.out == "", captured
    return captured.err.strip().splitlines()[-1]


@pytest.mark.parametrize("kind", OFFLOAD_KINDS)
def test_offload_kinds_need_the_tier(capsys, kind):
    msg = _refused(capsys, "--inject", f"{kind}@5")
    assert msg == (f"kv-canary: argument --inject: {kind}@5 needs --offload-tier (a host tier: the fault is applied at "
                   "a restore from it), which this run does not have (it could never be applied)"), msg


def test_the_tier_is_refused_with_a_sliding_window(capsys):
    msg = _refused(capsys, *TIER, "--swa-window", "256")
    assert msg.startswith("kv-canary: argument --offload-tier: expected full attention (no --swa-window), got "
                          "--swa-window 256"), msg


def test_the_tier_moves_records_through_the_manager_calls():
    """``_gather`` / ``_scatter`` / ``_rows`` are the manager's record moves, the calls an engine makes."""
    calls = []

    class Manager:
        def gather_records(self, slots, out, *, group=None, stream=None):
            calls.append(("gather", list(slots), out.shape))

        def scatter_records(self, rows, slots, *, group=None, stream=None):
            calls.append(("scatter", rows.shape, list(slots)))

        def allocate_record_rows(self, n, *, group=None, pinned=None):
            calls.append(("rows", n))
            return np.zeros((n, 4), dtype=np.int64)

    m = Manager()
    rows = tier._rows(m, 3)
    tier._gather(m, np.array([5, 6, 7]), rows)
    tier._scatter(m, rows, np.array([1, 2, 3]))
    assert calls == [("rows", 3), ("gather", [5, 6, 7], (3, 4)), ("scatter", (3, 4), [1, 2, 3])]
