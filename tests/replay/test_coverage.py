"""Verify coverage of ``kv-canary replay`` (:mod:`canary.replay.coverage`): exact values on runs small
enough to work out by hand, and the relations that hold on a real trace."""
from __future__ import annotations

import json

import numpy as np
import pytest

from canary import PlanStatus, VerifyPlan
from canary.replay import cli
from canary.replay.coverage import SAMPLED, Coverage
from helpers.replay_engine import Engine
from canary.replay.faults import Fault, Injector
from canary.replay.scheduler import Step

KEYS = {"unverified_steps", "sampled_steps", "verified_fraction", "max_staleness_steps", "cached_token_steps",
        "verified_token_steps"}


def _coverage(tmp_path, *extra: str) -> tuple[int, dict]:
    out = tmp_path / "summary.json"
    rc = cli.main(["replay", "--backend", "reference", *extra, "--json", str(out)])
    return rc, json.loads(out.read_text())


@pytest.fixture
def two_requests(tmp_path):
    """A: 4 prompt + 4 output tokens (cache of 7), B: 2 + 3 (cache of 4); both prefill at step 0, then decode.

    Cached tokens asked per step (P of A, P of B): step 0: (0, 0); 1: (4, 2); 2: (5, 3); 3: (6, -). B
    finishes after step 2, A after step 3: 0 + 6 + 8 + 6 = 20 (token, step) pairs in all.
    """
    path = tmp_path / "two.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n1,4,4\n2,2,3\n")
    return ["--trace", str(path), "--max-batch-size", "2", "--no-pad", "--kv-pool-tokens", "1024"]


@pytest.mark.parametrize("capacity,overflow,unverified,verified,staleness", [
    (8, 0, 0, 20, 0),  # nothing overflows
    (6, 1, 1, 12, 1),  # step 2 (8 entries) overflows
    (5, 3, 3, 0, 3),  # steps 1 to 3 overflow: A's first tokens go unverified in all three
])
def test_two_requests_by_hand_skip(tmp_path, two_requests, capacity, overflow, unverified, verified, staleness):
    """SGLang's ``--on-overflow skip``: an overflowing step verifies nothing."""
    rc, s = _coverage(tmp_path, *two_requests, "--verify-budget", str(capacity), "--on-overflow", "skip")
    c = s["canary"]
    assert rc == 0 and s["steps"] == 4 and s["verify_capacity"] == capacity and s["on_overflow"] == "skip"
    assert s["overflow_steps"] == overflow
    assert (c["unverified_steps"], c["sampled_steps"], c["max_staleness_steps"]) == (unverified, 0, staleness)
    assert (c["cached_token_steps"], c["verified_token_steps"]) == (20, verified)
    assert c["verified_fraction"] == verified / 20


@pytest.mark.parametrize("capacity,sampled,verified,staleness,sweep", [
    (8, 0, 20, 0, 0),
    # Step 2 (L = 5, 3): C - n = 4 shared by L - 1 = 4, 2: takes 3 and 3, from cursors 0. A's 3 and 4 wait a step.
    (6, 1, 18, 1, 2),
    # Step 1 (L = 4, 2): takes 3, 2: A 0-2, B 0-1. Step 2 (L = 5, 3): takes 3, 2: A 3, 4, 0 (wrapping), B 0-1.
    # Step 3 (A alone, L = 6): take 5: A 1-5. Each token waits one step at most: 5 + 5 + 5 verified.
    (5, 3, 15, 1, 2),
])
def test_two_requests_by_hand_sample(tmp_path, two_requests, capacity, sampled, verified, staleness, sweep):
    """The default ``--on-overflow sample``: an overflowing step verifies ``capacity`` entries (SPEC 3.7)."""
    rc, s = _coverage(tmp_path, *two_requests, "--verify-budget", str(capacity))
    c = s["canary"]
    assert rc == 0 and s["on_overflow"] == "sample" and s["sampled_steps"] == sampled and s["mismatches"] == 0
    assert s["overflow_steps"] == 0  # PlanStatus.OVERFLOW: none when sampling
    assert (c["unverified_steps"], c["sampled_steps"], c["max_staleness_steps"]) == (0, sampled, staleness)
    assert (c["cached_token_steps"], c["verified_token_steps"], c["max_sweep_steps"]) == (20, verified, sweep)
    assert c["verified_token_steps"] == c["health"]["verify_slots"]  # the canary's own count


def test_two_requests_sliding_window(tmp_path, two_requests):
    """Window 2: asked 0 + (2 + 2) + (2 + 2) + 2 = 10 pairs; capacity 3 overflows steps 1 and 2. Skipped: A's
    position 3 is cached and unverified in both (position 2 leaves the window after step 1): staleness 2."""
    rc, s = _coverage(tmp_path, *two_requests, "--swa-window", "2", "--verify-capacity", "3", "--on-overflow", "skip")
    c = s["canary"]
    assert rc == 0 and s["overflow_steps"] == 2
    assert (c["unverified_steps"], c["max_staleness_steps"], c["cached_token_steps"]) == (2, 2, 10)
    assert c["verified_fraction"] == 0.2


def test_two_requests_sliding_window_sampled(tmp_path, two_requests):
    """Sampled, the same run: takes 1 (A) and 2 (B) in steps 1 and 2. A's cursor 0 lies below its window [2, 4):
    the run restarts at 2, then continues at 3 in step 2 (window [3, 5)); B's restarts at 1 in step 2. A's 3
    waits one step, its 4 one step, and step 3 verifies both: 3 + 3 + 2 of 10 pairs."""
    rc, s = _coverage(tmp_path, *two_requests, "--swa-window", "2", "--verify-capacity", "3", "--check-every", "1")
    c = s["canary"]
    assert rc == 0 and s["sampled_steps"] == 2 and s["overflow_steps"] == 0 and s["mismatches"] == 0
    assert (c["unverified_steps"], c["sampled_steps"], c["max_staleness_steps"]) == (0, 2, 1)
    assert c["verified_fraction"] == 0.8


def _step(index: int, prefix: int, r2t: np.ndarray) -> Step:
    return Step(index=index, req_pool_indices=np.array([1]), prefix_lens=np.array([prefix]),
                extend_seq_lens=np.array([1]), num_active=1, request_ids=np.array([0]), verify_entries=prefix,
                write_entries=1, req_to_token=r2t, full_to_swa_index_mapping=None)


def _plan(slots: list[int], *, status: int = 0, enable: int = 1, num_valid: int | None = None) -> VerifyPlan:
    """A plan of the request in row 1 verifying ``slots`` (slot of position p = 100 + p)."""
    plan = VerifyPlan.allocate(verify_capacity=8)
    plan.verify_slot_indices[: len(slots)] = slots
    plan.verify_expected_positions[: len(slots)] = np.asarray(slots, dtype=np.int64) - 100
    plan.verify_num_valid[0] = len(slots) if num_valid is None else num_valid
    plan.enable[0], plan.status[0] = enable, status
    return plan


def test_sampled_steps_by_hand():
    """One request, slot of position p = 100 + p. Step 0 (P = 4) verifies positions 0 and 2 (a sample, the
    SAMPLED bit set); step 1 (P = 5) positions 1, 3, 4 (no bit: fewer than asked); step 2 (P = 6) overflows;
    step 3 (P = 7) verifies all. Runs: position 0: 0, 1, 2, 0; position 1: 1, 0, 1, 0; position 2: 0, 1, 2, 0;
    position 3: 1, 0, 1, 0; position 4: 0, 1, 0; position 5: 1, 0. Verified 2 + 3 + 0 + 7 of 4 + 5 + 6 + 7."""
    r2t = np.zeros((2, 16), dtype=np.int32)
    r2t[1] = 100 + np.arange(16)
    cov = Coverage(r2t, None, 0)
    cov.add(_step(0, 4, r2t), _plan([100, 102], status=SAMPLED))
    cov.add(_step(1, 5, r2t), _plan([101, 103, 104]))
    cov.add(_step(2, 6, r2t), _plan([], status=int(PlanStatus.OVERFLOW), enable=0, num_valid=8))
    cov.add(_step(3, 7, r2t), _plan(list(range(100, 107))))
    s = cov.summary()
    assert (s["sampled_steps"], s["unverified_steps"], s["max_staleness_steps"]) == (2, 1, 2)
    assert (s["verified_token_steps"], s["cached_token_steps"]) == (12, 22)


def test_a_reused_row_starts_clean():
    """Request 0 leaves row 1 after two unverified steps; request 1 takes the row and its first cached token
    goes unverified once: its run is 1, not 3."""
    r2t = np.zeros((2, 16), dtype=np.int32)
    r2t[1] = 100 + np.arange(16)
    cov = Coverage(r2t, None, 0)
    overflow = dict(status=int(PlanStatus.OVERFLOW), enable=0, num_valid=8)
    cov.add(_step(0, 3, r2t), _plan([], **overflow))
    cov.add(_step(1, 4, r2t), _plan([], **overflow))
    assert cov.summary()["max_staleness_steps"] == 2
    other = _step(2, 1, r2t)
    object.__setattr__(other, "request_ids", np.array([1]))
    cov.add(other, _plan([], **overflow))
    assert cov.max_staleness == 2 and cov.run[1, 0] == 1


SMALL_BUDGET = ("--max-requests", "30", "--verify-capacity", "4096", "--token-budget", "1024")


def test_skip_leaves_the_overflow_steps_unverified(tmp_path):
    rc, s = _coverage(tmp_path, *SMALL_BUDGET, "--on-overflow", "skip")
    c = s["canary"]
    # An overflow step asked for more than the capacity (> 0 entries), so it has cached tokens, and verified none.
    assert rc == 0 and c["unverified_steps"] == s["overflow_steps"] > 0 and c["sampled_steps"] == 0
    assert c["verified_token_steps"] == c["health"]["verify_slots"]  # the canary's own count
    assert 0 < c["verified_fraction"] < 1 and c["max_staleness_steps"] >= 1


def test_sample_verifies_every_overflow_step(tmp_path):
    """The same run sampled: the overflow steps verify 4096 entries each instead of none."""
    rc, s = _coverage(tmp_path, *SMALL_BUDGET)
    rc_skip, skip = _coverage(tmp_path, *SMALL_BUDGET, "--on-overflow", "skip")
    c, cs = s["canary"], skip["canary"]
    assert rc == rc_skip == 0 and s["sampled_steps"] == skip["overflow_steps"] > 0
    assert s["overflow_steps"] == skip["sampled_steps"] == 0
    assert c["unverified_steps"] == 0 and c["sampled_steps"] == s["sampled_steps"]
    assert c["verified_token_steps"] == c["health"]["verify_slots"]
    assert c["verified_token_steps"] == cs["verified_token_steps"] + 4096 * s["sampled_steps"]
    assert c["max_staleness_steps"] <= c["max_sweep_steps"]


def test_enough_capacity_verifies_everything(tmp_path, capsys):
    rc, s = _coverage(tmp_path, "--max-requests", "20", "--max-batch-size", "8", "--verify-budget", "1000000")
    c = s["canary"]
    assert rc == 0 and s["overflow_steps"] == s["sampled_steps"] == 0 and KEYS <= set(c)
    assert (c["unverified_steps"], c["sampled_steps"], c["verified_fraction"], c["max_staleness_steps"]) == (0, 0, 1.0, 0)
    assert c["verified_token_steps"] == c["cached_token_steps"] == c["health"]["verify_slots"] > 0
    text = capsys.readouterr().out
    assert "steps unverified / sampled" in text and "max staleness (steps)" in text


def test_zero_kv_points_a_cached_position_at_a_never_written_slot():
    eng = Engine(requests=12, max_batch_size=8, chunk_size=512)
    sched, kv = eng.sched, eng.kv
    f = Fault("zero-kv", 5)
    inj = Injector([f])
    while not f.applied:
        eng.step(after_write=inj.after_write)
    ps = sched.page_size
    row = int(np.flatnonzero(sched.row_req == f.requests[0])[0])
    assert int(kv.r2t[row, f.position]) == f.slot != f.slots[1]
    page = f.slot // ps
    assert page not in sched.page_table  # a page no request holds ...
    assert page not in sched.free_pages._pages[: sched.free_pages.size]  # ... and none will: out of the pool
    assert not kv.kv_token_bytes(f.slot).any() and not kv.v[f.slot].any()
    log = eng.step()
    assert log.report.total > 0 and {v.slot for v in log.report.violations} >= {f.slot}
