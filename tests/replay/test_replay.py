"""The scheduler simulator, the replay and the ``kv-canary`` command line (host only, reference backend)."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import canary.manager.groups
import canary.replay.replay
from canary.replay import cli
from canary.replay.scheduler import Scheduler, default_buckets, load_trace


def run_checked(sched: Scheduler) -> dict:
    """Run ``sched`` to the end, asserting the engine invariants at every step; returns a few facts."""
    ps, w, trace = sched.page_size, sched.swa_window, sched.trace
    kv_len = trace.context_tokens + trace.generated_tokens - 1
    r2t, lut = sched.req_to_token, sched.full_to_swa_index_mapping
    live: dict[int, np.ndarray] = {}  # request -> its slots for positions [0, prefix + extend)
    next_prefix: dict[int, int] = {}
    finished: set[int] = set()
    rows_used: dict[int, set[int]] = {}
    facts = dict(steps=0, padded_steps=0, garbage_seen=False, pool_blocked=False, swa_zero_prev=False)
    for step in sched.steps():
        facts["steps"] += 1
        n, bs = step.num_active, step.bs
        rpi, pre, ext = step.req_pool_indices, step.prefix_lens, step.extend_seq_lens
        assert all(a.dtype == np.int64 and a.shape == (bs,) for a in (rpi, pre, ext))
        assert step.req_to_token is r2t and step.full_to_swa_index_mapping is lut
        assert 1 <= n <= sched.max_batch_size
        assert bs == next((b for b in sched.pad_buckets if b >= n), n)
        assert (rpi[:n] >= 1).all() and (rpi[:n] <= sched.max_batch_size).all() and (rpi[n:] == 0).all()
        assert len(set(rpi[:n].tolist())) == n
        if bs > n:
            facts["padded_steps"] += 1
            facts["garbage_seen"] |= bool((pre[n:] != 0).any() or (ext[n:] != 0).any())
        facts["pool_blocked"] |= len(sched.running) < sched.max_batch_size and sched.next_request < len(trace)
        assert step.write_entries == int(ext[:n].sum())
        assert step.verify_entries == int((np.minimum(pre[:n], w) if w else pre[:n]).sum())
        swa_slots = []
        for i in range(n):
            req, row, p, e = int(step.request_ids[i]), int(rpi[i]), int(pre[i]), int(ext[i])
            ctx = int(trace.context_tokens[req])
            assert req not in finished
            assert p == next_prefix.get(req, 0)  # prefix_lens continue where the last step of the request ended
            if p < ctx:
                assert 1 <= e <= min(sched.chunk_size, ctx - p)
                if not sched.token_budget:
                    assert e == min(sched.chunk_size, ctx - p)
            else:
                assert e == 1
            assert p + e <= kv_len[req]
            slots = r2t[row, : p + e].astype(np.int64)
            if req in live:
                assert np.array_equal(slots[:p], live[req][:p])  # cached positions keep their slots
            assert (slots % ps == np.arange(p + e) % ps).all()  # slot = page * page_size + offset
            pages = slots // ps
            assert all(len(set(pages[k : k + ps].tolist())) == 1 for k in range(0, p + e, ps))
            live[req] = slots
            next_prefix[req] = p + e
            rows_used.setdefault(row, set()).add(req)
            if w:
                evicted = max(p - w, 0) // ps * ps
                assert (lut[slots[:evicted]] == 0).all()
                kept = lut[slots[max(p - w, 0) :]]
                assert (kept >= ps).all() and (kept < sched.num_swa_pages * ps).all()
                assert (kept % ps == slots[max(p - w, 0) :] % ps).all()
                swa_slots.append(kept)
                if p > w:
                    facts["swa_zero_prev"] |= bool(lut[slots[p - w - 1]] == 0)
        everything = np.concatenate(list(live.values()))
        assert everything.min() >= ps  # page 0 is reserved: slot 0 is never handed out
        assert everything.max() < sched.num_pages * ps
        assert len(np.unique(everything)) == len(everything)  # no slot held by two live requests
        if w:
            swa = np.concatenate(swa_slots)
            assert len(np.unique(swa)) == len(swa)
        for i in range(n):
            req = int(step.request_ids[i])
            if next_prefix[req] == kv_len[req]:
                finished.add(req)
                del live[req]
    assert finished == set(range(len(trace))) and sched.num_finished == len(trace)
    assert sched.free_pages.size == sched.num_pages - 1  # every page came back
    if w:
        assert sched.swa_free.size == sched.num_swa_pages - 1 and not lut.any()
    facts["rows_reused"] = any(len(reqs) > 1 for reqs in rows_used.values())
    return facts


def test_scheduler_invariants_under_kv_pressure_with_padding():
    sched = Scheduler(load_trace("conv", 60), max_batch_size=16, kv_pool_tokens=16384, chunk_size=512,
                      pad_buckets=default_buckets(16), seed=3)
    facts = run_checked(sched)
    assert facts["steps"] > 300
    assert facts["rows_reused"] and facts["pool_blocked"]
    assert facts["padded_steps"] > 0 and facts["garbage_seen"]


def test_scheduler_swa_lut_token_budget_no_padding():
    sched = Scheduler(load_trace("code", 40), max_batch_size=8, page_size=4, kv_pool_tokens=32768, chunk_size=1024,
                      token_budget=1500, swa_window=64, seed=1)
    lut = sched.full_to_swa_index_mapping
    assert lut.dtype == np.int64 and lut.shape == (sched.num_pages * 4,)
    assert sched.num_swa_pages < sched.num_pages  # a separate, smaller pool
    facts = run_checked(sched)
    assert facts["padded_steps"] == 0 and facts["rows_reused"] and facts["swa_zero_prev"]


def test_scheduler_swa_with_padding():
    facts = run_checked(Scheduler(load_trace("conv", 40), swa_window=100, pad_buckets=default_buckets(64)))
    assert facts["padded_steps"] > 0


def test_scheduler_is_seeded():
    def slots(seed):
        sched = Scheduler(load_trace("conv", 5), seed=seed, pad_buckets=(8,))
        out = [(s.prefix_lens.copy(), s.req_to_token.copy()) for s in sched.steps()]
        return np.concatenate([p for p, _ in out]), out[-1][1]

    (p0, t0), (p1, t1), (_, t2) = slots(0), slots(0), slots(1)
    assert np.array_equal(p0, p1) and np.array_equal(t0, t1)
    assert not np.array_equal(t0, t2)


def test_scheduler_rejects_a_pool_too_small():
    with pytest.raises(ValueError, match="kv_pool_tokens"):
        Scheduler(load_trace("conv", 10), kv_pool_tokens=1024)


def test_default_buckets():
    assert default_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert default_buckets(48) == (1, 2, 4, 8, 16, 32, 48)


def test_load_trace(tmp_path):
    conv = load_trace("conv")
    assert len(conv) > 19000 and conv.name == "conv"
    assert np.array_equal(load_trace("AzureLLMInferenceTrace_code.csv", 7).context_tokens,
                          load_trace("code", 7).context_tokens)
    assert len(load_trace("conv", 25)) == 25
    # Column order is read from the header, and rows are sorted by arrival.
    path = tmp_path / "t.csv"
    path.write_text("GeneratedTokens,TIMESTAMP,ContextTokens\n5,2023-11-16 18:00:02.0,30\n7,2023-11-16 18:00:01.0,10\n")
    t = load_trace(path)
    assert t.context_tokens.tolist() == [10, 30] and t.generated_tokens.tolist() == [7, 5]
    path.write_text("TIMESTAMP,Prompt,Output\n1,2,3\n")
    with pytest.raises(ValueError, match="ContextTokens"):
        load_trace(path)
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n1,0,3\n")
    with pytest.raises(ValueError, match=">= 1"):
        load_trace(path)


def test_cli_replay_check_every_step_with_json(tmp_path, capsys):
    out = tmp_path / "summary.json"
    rc = cli.main(["replay", "--backend", "reference", "--max-requests", "40", "--swa-window", "128", "--check-every",
                   "1", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    s = json.loads(out.read_text())
    assert s["steps"] >= 200 and s["checked_steps"] == s["steps"]
    assert s["requests_finished"] == s["requests"] == 40
    assert s["mismatches"] == 0 and s["backend"] == "reference" and s["swa_window"] == 128
    assert s["verify_entries_per_step"]["max"] <= 40 * 128
    assert s["batch_size"]["mean_padded"] > s["batch_size"]["mean_active"]
    assert "mismatches" in text and "before_forward (plan + verify)" in text  # the manager plans by default


def test_cli_replay_counts_overflow_steps(tmp_path):
    out = tmp_path / "summary.json"
    assert cli.main(["replay", "--max-requests", "30", "--verify-capacity", "4096", "--no-pad", "--check-every", "7",
                     "--token-budget", "1024", "--json", str(out)]) == 0
    s = json.loads(out.read_text())
    assert 0 < s["sampled_steps"] < s["steps"] and s["overflow_steps"] == 0 and s["mismatches"] == 0
    assert s["batch_size"]["mean_padded"] == s["batch_size"]["mean_active"]
    assert s["write_entries_per_step"]["max"] <= 1024


def test_check_every_catches_a_write_into_the_untouched_region(monkeypatch, capsys):
    real = canary.replay.replay.CanaryPlanner

    class Scribbler(real):
        """Plans correctly, then writes past ``verify_num_valid``, where a plan must not write."""

        def plan(self, **kw):
            super().plan(**kw)
            self.static.verify_expected_positions.host[-1] = 12345

    made = []

    def factory(*, backend, **kw):
        made.append(backend)  # the replay builds the planner under test first, then the reference
        return (Scribbler if len(made) == 1 else real)(backend=backend, **kw)

    monkeypatch.setattr(canary.replay.replay, "CanaryPlanner", factory)
    monkeypatch.setattr(canary.manager.groups, "CanaryPlanner", factory)  # the manager's planner, built first
    assert cli.main(["replay", "--backend", "reference", "--max-requests", "10", "--check-every", "5"]) == 1
    text = capsys.readouterr().out
    assert "MISMATCH step 0: verify_expected_positions[77823] = 12345" in text


def test_replay_without_rich(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "rich.console", None)
    assert cli.main(["replay", "--max-requests", "1"]) == 2
    assert 'python -m pip install ".[cli]"' in capsys.readouterr().err


def test_cli_errors(capsys):
    assert cli.main(["replay", "--max-requests", "5", "--kv-pool-tokens", "512"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "kv_pool_tokens" not in captured.err  # the option, not the Python name
    assert captured.err.startswith("kv-canary: --kv-pool-tokens 512: expected room for the longest request of "
                                   "trace conv ("), captured.err
    assert "pages of --page-size 16, plus the reserved page 0): at least " in captured.err
    with pytest.raises(SystemExit) as exc:
        cli.main(["replay", "--check-every", "-1"])
    assert exc.value.code == 2


def test_python_m_canary_replay():
    proc = subprocess.run([sys.executable, "-m", "canary", "replay", "--max-requests", "20"],
                          check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "requests finished" in proc.stdout and "20 / 20" in proc.stdout
    assert "\x1b[" not in proc.stdout  # no terminal: plain text, no progress bar
