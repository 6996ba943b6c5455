"""CanaryManager on the reference backend (host arrays): modes, one-step-late reporting, health, blind spots,
groups, deduplication, ring overflow, stats and Prometheus metrics, argument errors."""
from __future__ import annotations

import logging
import subprocess
import sys

import numpy as np
import pytest
from helpers.manager_engine import ToyEngine, accept_batch_runs, check_accept_batch_runs

from canary import CanaryHealthError, CanaryManager, CanaryViolationError, FailReason, KVGroup


def clean_run(**kw) -> ToyEngine:
    e = ToyEngine(**kw)
    e.add("a", [5, 6, 7, 8])
    e.add("b", [9, 10])
    for _ in range(3):
        e.decode_step(["a", "b"])
    return e


@pytest.mark.parametrize("mode", ["log", "raise", "callback"])
def test_clean_run_reports_nothing_in_every_mode(mode, caplog):
    got = []
    e = clean_run(on_violation=got.append if mode == "callback" else mode)
    with caplog.at_level(logging.INFO, logger="kv_canary"):
        e.manager.flush()
    assert got == [] and not [r for r in caplog.records if r.levelno >= logging.WARNING]
    s = e.manager.stats()
    assert s["steps"] == s["decoded_steps"] == 3
    assert s["written_entries"]["full"] == 4 + 2 + 1 + 1 + 1 + 1  # prefills, then one token per request per step
    assert s["verified_entries"]["full"] == (4 + 2) + (5 + 3)  # decode steps verify the cached prefixes
    assert s["violations_by_reason"] == {} and s["ring_dropped"] == 0 and s["protected_tokens"] == 12


def test_violation_at_step_n_is_reported_at_step_n_plus_1_not_before():
    got = []
    e = clean_run(on_violation=got.append)
    e.flip("full", e.slot_of("a", 1))
    e.decode_step(["a", "b"])  # step 3: its verify sees the flipped bit
    assert got == []  # queued for the host, not decoded yet: no read of the step's results inside it
    e.forward([("a", 1), ("b", 1)])  # step 4's before_forward decodes step 3's report
    assert len(got) == 1 and len(got[0]) == 1
    v = got[0][0]
    assert (v.group, v.kernel, v.position, v.first_step, v.reasons) == ("full", "verify", 1, 3, FailReason.REAL_KV)
    assert v.slot == e.slot_of("a", 1) and v.requests == (("a", 1),) and v.request_ids == ("a",)


def test_raise_mode_raises_at_the_next_step_boundary():
    e = clean_run(on_violation="raise")
    e.flip("full", e.slot_of("b", 0))
    e.decode_step(["a", "b"])
    with pytest.raises(CanaryViolationError) as info:
        e.forward([("a", 1), ("b", 1)])
    err = info.value
    assert str(err).startswith("kv-canary: violations: expected none, got 1 new")
    assert err.step == 3 and err.violations[0].requests == (("b", 0),) and err.dropped == 0


def test_log_mode_writes_one_fixed_format_line_rate_limited(caplog):
    e = clean_run(on_violation="log", log_limit=2)
    for p in range(4):
        e.flip("full", e.slot_of("a", p))
    with caplog.at_level(logging.INFO, logger="kv_canary"):
        e.decode_step(["a", "b"])
        e.manager.flush()
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(lines) == 3, lines
    assert lines[0].startswith("kv-canary: violation group=full kernel=verify step=3 slot=")
    assert "reasons=REAL_KV" in lines[0] and "requests=a@" in lines[0] and lines[0].endswith("count=1")
    assert lines[2] == "kv-canary: 2 more violations of step 3 not logged (log_limit=2): REAL_KV=2"


def test_repeated_corruption_is_reported_once_with_count_and_steps():
    got = []
    e = clean_run(on_violation=got.append)
    e.flip("full", e.slot_of("a", 2))
    for _ in range(4):
        e.decode_step(["a", "b"])
    e.manager.flush()
    assert len(got) == 1 and len(got[0]) == 1
    v = got[0][0]
    assert (v.count, v.steps, v.first_step, v.last_step) == (4, [3, 4, 5, 6], 3, 6)
    s = e.manager.stats()
    assert s["violations_by_reason"] == {"REAL_KV": 1} and s["repeated_sightings"] == 3
    assert e.manager.open_violations == [v]


def test_the_callback_gets_the_dropped_count_every_step():
    """A ring too small for the corruption: the callback is called every step with the rows dropped, also when
    every kept row is a repeat (an empty list then), so an engine knows that more slots are corrupt than named."""
    got = []
    e = clean_run(on_violation=got.append, ring_capacity=2)
    # The reported-slots marks off (suppress.py): the steps a GPU manager runs before it has read a report, whose
    # rings still hold the slots already named
    e.manager._marks.mark = lambda *a: None
    for p in range(4):
        e.flip("full", e.slot_of("a", p))
    for _ in range(3):
        e.decode_step(["a", "b"])
    e.manager.flush()
    assert [len(v) for v in got] == [2, 0, 0] and all(v.dropped == 2 for v in got)
    assert [v.step for v in got] == [3, 4, 5] and all(isinstance(v, list) for v in got)


def test_a_small_ring_names_the_other_slots_next_step():
    """With the marks on, the slots a step's overflow named are left out of the next rings: the two slots the
    first ring could not hold are named one step later, then nothing repeats (docs/records.md 6.1)."""
    got = []
    e = clean_run(on_violation=got.append, ring_capacity=2)
    slots = {e.slot_of("a", p) for p in range(4)}
    for s in slots:
        e.flip("full", s)
    for _ in range(3):
        e.decode_step(["a", "b"])
    e.manager.flush()
    assert [(len(v), v.dropped) for v in got] == [(2, 2), (2, 0)]
    assert {v.slot for batch in got for v in batch} == slots
    assert e.manager.stats()["reported_slots_marked"] == 2  # only a step that dropped rows marks its slots
    e.manager.finish_request("a")  # its slots may go to another request: their violations must be named again
    assert e.manager.stats()["reported_slots_marked"] == 0
    assert not e.manager._marks.arrays[0].any()


@pytest.mark.parametrize("mode", ["log", "raise"])
def test_ring_overflow_is_counted_and_reported(mode, caplog):
    e = clean_run(on_violation=mode, ring_capacity=2)
    for p in range(4):
        e.flip("full", e.slot_of("a", p))
    e.decode_step(["a", "b"])
    with caplog.at_level(logging.WARNING, logger="kv_canary"):
        if mode == "raise":
            with pytest.raises(CanaryViolationError) as info:
                e.manager.flush()
            assert info.value.dropped == 2 and len(info.value.violations) == 2
        else:
            e.manager.flush()
    assert e.manager.stats()["ring_dropped"] == 2
    assert any(r.getMessage().startswith("kv-canary: ring overflow group=full step=3 dropped=2 ring_capacity=2")
               for r in caplog.records)


@pytest.mark.parametrize("mode", ["log", "raise", "callback"])
def test_health_failure_when_the_kernels_are_not_launched(mode):
    e = clean_run(on_violation=(lambda v: None) if mode == "callback" else mode, health_steps=3)
    m = e.manager
    # A CUDA-graph engine whose graph lost the canary calls: the host halves run, the kernels never do.
    for _ in range(3):
        m.begin_step(["a", "b"])
        m.end_step()
    with pytest.raises(CanaryHealthError, match=r"^kv-canary: health: expected the kernels of group 'full'"):
        m.begin_step(["a", "b"])


def test_rejected_drafts_left_in_the_kv_are_caught_through_accept_tokens():
    got = []
    e = ToyEngine(on_violation=got.append)
    e.add("r", [10, 11, 12, 13])
    e.forward([("r", 4)])  # prefill
    e.reqs["r"]["tokens"] += [14]  # the last sampled token, accepted
    e.manager.accept_tokens("r", [14])
    # Target-verify forward: token 14 then drafts 15, 16, 17 at positions 4..7.
    e.forward([("r", 4)], write_tokens={"r": [14, 15, 16, 17]})
    e.reqs["r"]["tokens"] += [15, 26]  # draft 15 accepted, 16 rejected: the target's own 26 at position 6
    e.manager.accept_tokens("r", [15, 26])
    # The engine bug: it keeps the rejected drafts' KV and decodes on top of position 7 (prefix 7 keeps draft 16).
    e.reqs["r"]["tokens"] += [27]
    e.forward([("r", 1)], prefix_override={"r": 7}, write_tokens={"r": [27]})
    e.forward([("r", 0)])
    e.manager.flush()
    found = [v for vs in got for v in vs]
    assert [(v.position, v.reasons, v.stored_token, v.expected_token) for v in found] == [
        (6, FailReason.VERIFY_TOKEN, 16, 26)]
    assert found[0].requests == (("r", 6),)


def test_a_recycled_req_to_token_row_read_by_a_stale_forward_is_caught_by_request_id():
    got = []
    e = ToyEngine(on_violation=got.append)
    e.add("A", [100, 101, 102, 103, 104, 105])
    e.forward([("A", 6)])
    row = e.reqs["A"]["row"]
    stale = dict(e.reqs["A"])
    e.finish("A")  # row freed and handed to B at once
    e.add("B", [200, 201, 202, 203, 204, 205])
    assert e.reqs["B"]["row"] == row
    e.r2t_host[row] = 0
    e.forward([("B", 6)])  # B's prefill allocates new slots in the same row
    e.reqs["A"] = stale  # a stale forward of A, overlap-scheduled, still reads row `row` with A's length
    e.forward([("A", 0)])
    e.manager.flush()
    found = [v for vs in got for v in vs]
    assert sorted(v.position for v in found) == list(range(6))
    assert all(v.reasons == FailReason.VERIFY_TOKEN for v in found)
    assert all(set(v.request_ids) == {"A", "B"} for v in found)  # the stale reader and the row's new owner


def test_accept_tokens_batch_is_accept_tokens_for_each_request():
    """The same steps with one accept_tokens_batch per step or one accept_tokens per request: the same pool, the
    same valid lengths, the same violation (a token stored that no accepted token matches)."""
    check_accept_batch_runs(accept_batch_runs())


def test_accept_tokens_batch_takes_any_host_array():
    """Token ids in an array of another library (here a torch CPU tensor, through DLPack) are host values: the
    same pool as NumPy's."""
    torch = pytest.importorskip("torch")
    pools = []
    for wrap in (np.asarray, torch.as_tensor):
        e = ToyEngine()
        e.add("a", [1, 2])
        e.add("b", [3])
        e.manager.accept_tokens_batch(["a", "b"], wrap(np.array([7, 8], dtype=np.int64)))
        e.forward([("a", 0), ("b", 0)])
        pools.append(np.array(e.manager.pool_array))
    assert np.array_equal(*pools) and pools[0].sum() == 1 + 2 + 3 + 7 + 8


def test_accept_tokens_batch_skips_padding_rows():
    """A batch padded to a graph size (None ids): the padding rows' tokens are ignored, pool row 0 stays empty, and
    the pool is the one accept_tokens per request gives."""
    pools = []
    for padded in (False, True):
        e = ToyEngine()
        e.add("a", [1, 2])
        e.add("b", [3])
        m = e.manager
        if padded:
            m.accept_tokens_batch(["a", None, "b", None], [7, 99, 8, 98])
        else:
            m.accept_tokens("a", [7])
            m.accept_tokens("b", [8])
        e.forward([("a", 0), (None, 0), ("b", 0), (None, 0)])
        pools.append(np.array(m.pool_array))
        assert m.requests.counts[0] == 0
    assert np.array_equal(*pools) and not pools[1][0].any()


def test_add_request_refuses_a_long_prompt_before_registering_it():
    e = ToyEngine()
    cols = e.manager.requests.cols
    with pytest.raises(ValueError, match="kv-canary: prompt_token_ids: expected at most"):
        e.manager.add_request("x", list(range(cols + 1)))
    e.manager.add_request("x", [1, 2])  # a retry with a shorter prompt: not "already running"


def test_accept_tokens_batch_refuses_bad_batches_and_accepts_nothing():
    e = ToyEngine()
    e.add("a", [1, 2])
    e.add("b", [3])
    m = e.manager
    before = m.requests.counts.copy()
    for ids, toks, exc, words in [
        (["a", "x"], [4, 5], KeyError, "request_ids[1]"),
        (["a", "a"], [4, 5], ValueError, "request_ids[1]: expected distinct requests (None for padding rows), got "
                                         "'a' again (request_ids[0])"),
        (["a", "b"], [4], ValueError, "token_ids: expected one token per request ([2])"),
        (["a", "b"], [[4], [5]], ValueError, "token_ids"),
        (["a", "b"], [4.0, 5.0], TypeError, "token_ids: expected integer"),
    ]:
        with pytest.raises(exc, match=r"kv-canary: .*" + words.replace("[", r"\[").replace("]", r"\]")
                           .replace("(", r"\(").replace(")", r"\)")):
            m.accept_tokens_batch(ids, toks)
    assert np.array_equal(m.requests.counts, before) and not m.requests.updates[2:]
    # Past the pool's columns (max_seq_len + 1): nothing accepted, for any request of the batch.
    cols = m.requests.cols
    m.accept_tokens("b", list(range(cols - 1)))
    before = m.requests.counts.copy()
    with pytest.raises(ValueError, match="kv-canary: token_ids: expected at most .* for request 'b'"):
        m.accept_tokens_batch(["a", "b"], [4, 5])
    assert np.array_equal(m.requests.counts, before)


def test_full_swa_and_draft_groups_in_one_manager():
    got = []
    e = ToyEngine(groups=("full", "swa", "draft"), on_violation=got.append)
    e.add("a", [5, 6, 7, 8, 9, 10, 11, 12, 13, 14])
    e.add("b", [20, 21, 22])
    e.forward([("a", 10), ("b", 3)])
    e.draft_forward([("a", 5), ("b", 2)])
    for _ in range(2):
        e.decode_step(["a", "b"])
    e.draft_forward([("a", 4)])  # verifies the draft KV of positions 0..4 against tokens 1..5
    e.manager.flush()
    assert got == []
    s = e.manager.stats()
    assert s["verified_entries"]["draft"] == 5 and s["written_entries"]["draft"] == 5 + 2 + 4
    assert s["verified_entries"]["swa"] > 0 and s["verified_entries"]["swa"] < s["verified_entries"]["full"]
    e.flip("swa", e.slot_of("a", 10, "swa"))  # inside the window of a (positions 3..10)
    e.flip("draft", e.slot_of("b", 1))
    e.decode_step(["a", "b"])
    e.draft_forward([("b", 0)])
    e.manager.flush()
    found = sorted((v.group, v.position, tuple(v.request_ids)) for vs in got for v in vs)
    assert found == [("draft", 1, ("b",)), ("swa", 10, ("a",))]


def test_prometheus_metrics():
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    e = clean_run(on_violation=lambda v: None, metrics=registry)
    e.flip("full", e.slot_of("a", 0))
    e.decode_step(["a", "b"])
    e.manager.flush()
    get = registry.get_sample_value
    assert get("kv_canary_violations_total", {"group": "full", "reason": "REAL_KV"}) == 1
    assert get("kv_canary_verified_entries_total", {"group": "full"}) == e.manager.stats()["verified_entries"]["full"]
    assert get("kv_canary_written_entries_total", {"group": "full"}) == e.manager.stats()["written_entries"]["full"]
    assert get("kv_canary_steps_total") == 4
    assert get("kv_canary_protected_tokens") == e.manager.stats()["protected_tokens"]


def test_sampled_steps_are_counted():
    e = ToyEngine(on_violation="raise")
    e.manager.groups[0].spec  # noqa: B018 - the group exists
    small = CanaryManager([KVGroup(name="full", req_to_token=e.req_to_token, num_slots=256, verify_capacity=3)],
                          max_batch_size=4)
    small.add_request("x", list(range(10)))
    r2t = e.req_to_token
    r2t[1, :11] = np.arange(1, 12)
    one = lambda v: np.array([v], dtype=np.int64)  # noqa: E731
    small.before_forward(req_pool_indices=one(1), prefix_lens=one(0), extend_seq_lens=one(10), request_ids=["x"])
    small.after_kv_store(out_cache_loc=np.arange(1, 11), input_ids=np.arange(10), positions=np.arange(10))
    small.before_forward(req_pool_indices=one(1), prefix_lens=one(10), extend_seq_lens=one(0), request_ids=["x"])
    small.after_kv_store(out_cache_loc=np.zeros(0, np.int64), input_ids=np.zeros(0, np.int64),
                         positions=np.zeros(0, np.int64))
    small.flush()
    s = small.stats()
    assert s["sampled_steps"]["full"] == 1 and s["verified_entries"]["full"] == 3


def test_argument_errors_name_the_argument():
    r2t = np.zeros((4, 8), dtype=np.int32)
    g = KVGroup(name="full", req_to_token=r2t, num_slots=16, verify_capacity=8)
    with pytest.raises(ValueError, match=r"^kv-canary: on_violation: expected 'log', 'raise' or a callable"):
        CanaryManager(g, max_batch_size=2, on_violation="print")
    with pytest.raises(ValueError, match=r"^kv-canary: max_batch_size: expected an int >= 1, got 0"):
        CanaryManager(g, max_batch_size=0)
    with pytest.raises(ValueError, match=r"^kv-canary: groups\[1\].name: expected a name unique"):
        CanaryManager([g, g], max_batch_size=2)
    with pytest.raises(TypeError, match=r"^kv-canary: KVGroup: unexpected keyword argument 'realkv_sources'; "
                                        r"expected one of: name, req_to_token, num_slots"):
        KVGroup(name="full", req_to_token=r2t, num_slots=16, realkv_sources=[])
    with pytest.raises(TypeError, match=r"^kv-canary: KVGroup: missing required keyword argument 'num_slots'"):
        KVGroup(name="full", req_to_token=r2t)
    m = CanaryManager(g, max_batch_size=2)
    with pytest.raises(KeyError, match=r"kv-canary: request_id: expected a running request"):
        m.accept_tokens("nope", [1])
    with pytest.raises(ValueError, match=r"^kv-canary: groups: expected names among \['full'\], got 'swa'"):
        m.before_forward(req_pool_indices=np.zeros(1, np.int64), prefix_lens=np.zeros(1, np.int64),
                         extend_seq_lens=np.zeros(1, np.int64), request_ids=[None], groups=["swa"])
    with pytest.raises(ValueError, match=r"^kv-canary: request_ids: expected one id per batch row \(bs = 1\), got 2"):
        m.before_forward(req_pool_indices=np.zeros(1, np.int64), prefix_lens=np.zeros(1, np.int64),
                         extend_seq_lens=np.zeros(1, np.int64), request_ids=[None, None])


def test_a_refused_before_forward_leaves_no_step_open():
    """A before_forward that raises opens no step: after_kv_store then writes nothing (it used to write with the
    last step's plan and report a false WRITE_POSITION), and a retry with good arguments runs normally."""
    got = []
    e = clean_run(on_violation=got.append)
    m = e.manager
    steps = m.stats()["steps"]
    one = np.ones(1, np.int64)
    with pytest.raises(ValueError, match=r"^kv-canary: request_ids: expected one id per batch row \(bs = 1\), got 2"):
        m.before_forward(req_pool_indices=one, prefix_lens=one, extend_seq_lens=one, request_ids=["a", "b"])
    with pytest.raises(RuntimeError, match=r"^kv-canary: after_kv_store: expected a step opened"):
        m.after_kv_store(out_cache_loc=np.full(1, 3, np.int64), input_ids=one, positions=one)
    with pytest.raises((TypeError, ValueError), match=r"^kv-canary: prefix_lens"):  # the planner's, inside the step
        m.before_forward(req_pool_indices=one, prefix_lens=one.astype(np.int16), extend_seq_lens=one,
                         request_ids=["a"])
    with pytest.raises(RuntimeError, match=r"^kv-canary: after_kv_store: expected a step opened"):
        m.after_kv_store(out_cache_loc=np.full(1, 3, np.int64), input_ids=one, positions=one)
    assert m.stats()["steps"] == steps
    e.decode_step(["a", "b"])  # the retry: a normal step
    m.flush()
    assert got == [] and m.stats()["steps"] == steps + 1


def test_import_canary_imports_no_prometheus_client():
    code = "import sys, canary; print(canary.CanaryManager.__name__, 'prometheus_client' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["CanaryManager", "False"]
