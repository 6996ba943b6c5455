"""What an engine can rely on (docs/integration.md): nothing decoded is lost to an exception, request calls from
other threads, step calls refused from another thread or from inside a step call, close / context manager, and
no copy or pickle. Reference backend (host arrays); the CUDA manager's close is in test_manager_gpu.py and the
fake-CUDA pinned path in transfer_fake_child.py."""
from __future__ import annotations

import copy
import logging
import pickle
import threading

import numpy as np
import pytest
from helpers.manager_engine import ToyEngine

from canary import CanaryHealthError, CanaryViolationError, FailReason


def engine(groups=("full",), **kw) -> ToyEngine:
    e = ToyEngine(groups=groups, **kw)
    e.add("a", [5, 6, 7, 8, 9, 10, 11, 12, 13, 14])
    e.add("b", [20, 21, 22])
    for _ in range(2):
        e.decode_step(["a", "b"])
    e.manager.flush()
    return e


def stall(e: ToyEngine, group: str) -> None:
    # The group's kernels skipped for the next step (its verify never launched: its counters do not advance)
    records = e.manager._by_name[group].records
    real = records.verify
    records.verify = lambda *a, **k: None
    e.decode_step(["a", "b"])
    records.verify = real


# -- 1. an exception loses nothing already decoded -------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["log", "raise", "callback"])
def test_a_health_failure_delivers_the_violation_decoded_in_its_report(mode, caplog):
    got = []
    e = engine(groups=("full", "swa"), health_steps=1, on_violation=got.append if mode == "callback" else mode)
    m = e.manager
    e.flip("full", e.slot_of("a", 1))
    stall(e, "swa")  # one report: full's verify finds the flip, swa's kernels did not run
    with caplog.at_level(logging.ERROR, logger="kv_canary"), pytest.raises(CanaryHealthError) as info:
        m.poll()
    err = info.value
    assert str(err).startswith("kv-canary: health: expected the kernels of group 'swa'")
    assert [(v.group, v.position, v.reasons) for v in err.violations] == [("full", 1, FailReason.REAL_KV)]
    if mode == "callback":
        assert got == [err.violations]
    elif mode == "log":
        assert [r.getMessage() for r in caplog.records if "violation group=full" in r.getMessage()]
    else:
        assert isinstance(err.__cause__, CanaryViolationError) and err.__cause__.violations == err.violations
    assert m.stats()["violations_by_reason"] == {"REAL_KV": 1}
    # Delivered, so marked seen: the next sighting is a repeat of that record (the kernels run again)
    e.decode_step(["a", "b"])
    m.flush()
    assert len(got) == (1 if mode == "callback" else 0)
    (rec,) = m.open_violations
    assert rec is err.violations[0] and rec.count == 2
    s = m.stats()
    assert s["violations_by_reason"] == {"REAL_KV": 1} and s["repeated_sightings"] == 1


def test_a_health_failure_delivers_the_violations_of_the_earlier_reports_of_the_call():
    got = []
    e = engine(health_steps=2, on_violation=got.append)
    m = e.manager
    e.flip("full", e.slot_of("b", 0))
    m._poll_ready = lambda: None  # the reports stay queued: one poll decodes them all
    e.decode_step(["a", "b"])  # finds the flip
    for _ in range(3):  # a CUDA-graph engine whose graph lost the canary calls
        m.begin_step(["a", "b"])
        m.end_step()
    del m._poll_ready
    with pytest.raises(CanaryHealthError) as info:
        m.poll()
    assert [(v.position, v.requests) for vs in got for v in vs] == [(0, (("b", 0),))] == \
        [(v.position, v.requests) for v in info.value.violations]
    assert len(m._pending) == 1  # decoding stopped at the failing report: the one after it stays queued
    assert m.stats()["violations_by_reason"] == {"REAL_KV": 1}


def test_a_callback_that_raises_leaves_its_violations_unseen_and_uncounted():
    got, calls = [], []

    def callback(new):
        calls.append(new)
        if len(calls) == 1:
            raise ValueError("the engine's callback failed")
        got.append(new)

    e = engine(on_violation=callback)
    m = e.manager
    e.flip("full", e.slot_of("a", 2))
    e.decode_step(["a", "b"])
    with pytest.raises(ValueError, match="callback failed"):
        m.poll()
    assert m.open_violations == [] and m.stats()["violations_by_reason"] == {}
    e.decode_step(["a", "b"])  # still corrupt: reported again, as new
    m.flush()
    assert len(got) == 1 and [(v.position, v.first_step, v.count) for v in got[0]] == [(2, 3, 1)]
    assert m.stats()["violations_by_reason"] == {"REAL_KV": 1} and m.stats()["repeated_sightings"] == 0


def test_raise_mode_delivers_every_groups_violations_of_the_report_in_one_error():
    e = engine(groups=("full", "swa"), on_violation="raise")
    m = e.manager
    e.flip("full", e.slot_of("a", 1))
    e.flip("swa", e.slot_of("a", 9, "swa"))  # inside the window
    e.decode_step(["a", "b"])
    with pytest.raises(CanaryViolationError) as info:
        m.poll()
    assert sorted((v.group, v.position) for v in info.value.violations) == [("full", 1), ("swa", 9)]
    assert m.stats()["violations_by_reason"] == {"REAL_KV": 2}
    e.decode_step(["a", "b"])
    m.flush()  # both delivered (in the error): their next sightings are repeats, nothing raised
    assert m.stats()["repeated_sightings"] == 2


# -- 2. threads ----------------------------------------------------------------------------------------------------
class _SlowItems(dict):
    """The request pool's live dict, whose iteration (the decoder's, naming a slot's holders) pauses at each item
    until another thread changed the dict or ``wait`` seconds passed."""

    def __init__(self, *a, started: threading.Event, changed: threading.Event, wait: float):
        super().__init__(*a)
        self.started, self.changed, self.wait = started, changed, wait

    def items(self):
        self.started.set()
        for kv in super().items():
            self.changed.wait(self.wait)
            yield kv


def test_request_calls_from_another_thread_wait_for_the_report_decoding():
    got = []
    e = engine(on_violation=got.append)
    m = e.manager
    started, changed, errors, order = threading.Event(), threading.Event(), [], []

    def other():
        try:
            started.wait(10)
            m.add_request("c", [1, 2, 3])  # waits for the step: the decoder is iterating the live requests
            order.append("added")
            changed.set()
            m.finish_request("c")
        except BaseException as exc:  # pragma: no cover - the failure this test is about
            errors.append(exc)

    e.flip("full", e.slot_of("a", 3))
    e.decode_step(["a", "b"])
    m.requests.live = _SlowItems(m.requests.live, started=started, changed=changed, wait=0.3)
    t = threading.Thread(target=other)
    t.start()
    m.poll()  # decodes the violation: holders iterates the live requests while the other thread adds one
    order.append("decoded")
    t.join(10)
    assert not t.is_alive() and errors == []
    assert order == ["decoded", "added"]
    assert [(v.position, v.request_ids) for vs in got for v in vs] == [(3, ("a",))]
    assert "c" not in m.requests.live


def test_request_calls_hammered_from_another_thread_never_break_a_step():
    got = []
    e = engine(on_violation=got.append, forget_after=0, max_requests=64)  # every sighting new: holders each step
    m = e.manager
    stop, errors = threading.Event(), []

    def churn():
        try:
            i = 0
            while not stop.is_set():
                ids = [f"x{i}-{k}" for k in range(20)]
                for rid in ids:
                    m.add_request(rid, [7])
                for rid in ids:
                    m.accept_tokens(rid, [8])
                    m.finish_request(rid)
                i += 1
        except BaseException as exc:  # pragma: no cover
            errors.append(exc)

    e.flip("full", e.slot_of("a", 0))
    t = threading.Thread(target=churn)
    t.start()
    try:
        for _ in range(12):
            e.decode_step(["a", "b"])
            m.stats()
    finally:
        stop.set()
        t.join(10)
    m.flush()
    assert errors == [] and len(got) >= 10
    assert all(v.request_ids == ("a",) for vs in got for v in vs)


def test_step_calls_from_another_thread_are_refused_and_close_is_not():
    e = engine()
    m = e.manager
    out = {}

    def other(name, call):
        try:
            call()
            out[name] = None
        except RuntimeError as exc:
            out[name] = str(exc)

    rows = dict(req_pool_indices=np.array([1], np.int64), prefix_lens=np.array([0], np.int64),
                extend_seq_lens=np.array([0], np.int64), request_ids=["a"])
    for name, call in (("before_forward", lambda: m.before_forward(**rows)), ("poll", m.poll),
                       ("flush", m.flush), ("begin_step", lambda: m.begin_step(["a"])), ("sweep", m.sweep),
                       ("add_request", lambda: m.add_request("c", [1])), ("stats", m.stats)):
        t = threading.Thread(target=other, args=(name, call), name="not-the-engine")
        t.start()
        t.join(10)
    for name in ("before_forward", "poll", "flush", "begin_step", "sweep"):
        assert out[name].startswith(f"kv-canary: {name}: expected a call from the thread the manager's steps run "
                                    f"on ({threading.get_ident()}), got one from thread "), out[name]
        assert "'not-the-engine'" in out[name]
    assert out["add_request"] is None and out["stats"] is None and "c" in m.requests.live
    assert m._step is None  # nothing was opened by the refused calls
    e.decode_step(["a", "b"])  # the step thread goes on
    t = threading.Thread(target=other, args=("close", m.close))
    t.start()
    t.join(10)
    assert out["close"] is None and m.stats()["decoded_steps"] == 3  # close flushed the last step


# -- 3. no step call inside a step call ------------------------------------------------------------------------------
def test_step_calls_from_inside_the_violation_callback_are_refused():
    e = engine()
    m = e.manager
    refused, allowed = {}, []
    rows = dict(req_pool_indices=np.array([1], np.int64), prefix_lens=np.array([0], np.int64),
                extend_seq_lens=np.array([0], np.int64), request_ids=["a"])
    empty = np.zeros(0, np.int64)
    calls = {"before_forward": lambda: m.before_forward(**rows),
             "after_kv_store": lambda: m.after_kv_store(out_cache_loc=empty, input_ids=empty, positions=empty),
             "begin_step": lambda: m.begin_step(["a"]), "end_step": m.end_step, "poll": m.poll, "flush": m.flush,
             "sweep": m.sweep, "close": m.close, "warmup": m.warmup}

    def callback(new):
        for name, call in calls.items():
            try:
                call()
            except RuntimeError as exc:
                refused[name] = str(exc)
        m.add_request("c", [1, 2])  # request calls are fine from the callback
        m.finish_request("c")
        allowed.append(m.stats()["decoded_steps"])

    m.on_violation = callback  # takes effect: the decoder reads it per report
    e.flip("full", e.slot_of("b", 1))
    e.decode_step(["a", "b"])
    e.decode_step(["a", "b"])  # its before_forward decodes the flip and calls the callback
    assert sorted(refused) == sorted(calls)
    for name, msg in refused.items():
        assert msg == (f"kv-canary: {name}: expected no other step call in progress, got {name} called from inside "
                       f"before_forward (from a violation callback or a hook it runs): step calls do not nest")
    assert allowed == [3] and "c" not in m.requests.live
    m.flush()  # the outer step was untouched: its report decodes as usual
    assert m.stats()["decoded_steps"] == 4 and m.stats()["steps"] == 4 and not m._closed


# -- 4. shutdown, copy, pickle ---------------------------------------------------------------------------------------
def test_close_delivers_the_last_steps_report_then_refuses_every_call():
    got = []
    e = engine(on_violation=got.append)
    m = e.manager
    e.flip("full", e.slot_of("a", 5))
    e.decode_step(["a", "b"])
    m.close()
    assert [(v.position, v.first_step) for vs in got for v in vs] == [(5, 2)]
    m.close()  # a second close does nothing
    rows = dict(req_pool_indices=np.array([1], np.int64), prefix_lens=np.array([0], np.int64),
                extend_seq_lens=np.array([0], np.int64), request_ids=["a"])
    empty = np.zeros(0, np.int64)
    for name, call in {"before_forward": lambda: m.before_forward(**rows),
                       "after_kv_store": lambda: m.after_kv_store(out_cache_loc=empty, input_ids=empty,
                                                                  positions=empty),
                       "begin_step": lambda: m.begin_step(["a"]), "end_step": m.end_step, "poll": m.poll,
                       "flush": m.flush, "sweep": m.sweep, "warmup": m.warmup,
                       "add_request": lambda: m.add_request("c", [1]), "accept_tokens": lambda: m.accept_tokens("a", [1]),
                       "accept_tokens_batch": lambda: m.accept_tokens_batch(["a"], [1]),
                       "finish_request": lambda: m.finish_request("a"),
                       "cache_prefix": lambda: m.cache_prefix("k", [1], [5]),
                       "evict_prefix": lambda: m.evict_prefix("k"),
                       "staged_expected_tokens": lambda: m.staged_expected_tokens(1)}.items():
        with pytest.raises(RuntimeError, match=rf"^kv-canary: {name}: expected an open manager, got one closed by "
                                               rf"close\(\)"):
            call()
    assert m.stats()["decoded_steps"] == 3 and len(m.open_violations) == 1  # the final figures stay readable


def test_close_in_raise_mode_raises_the_last_violations_and_still_closes():
    e = engine(on_violation="raise")
    m = e.manager
    e.flip("full", e.slot_of("a", 5))
    e.decode_step(["a", "b"])
    with pytest.raises(CanaryViolationError):
        m.close()
    assert m._closed
    m.close()
    with pytest.raises(RuntimeError, match="closed by close"):
        m.poll()


def test_the_manager_is_a_context_manager_that_closes_and_flushes():
    got = []
    e = ToyEngine(on_violation=got.append)
    with e.manager as m:
        assert m is e.manager
        e.add("a", [5, 6, 7])
        e.decode_step(["a"])
        e.flip("full", e.slot_of("a", 0))
        e.decode_step(["a"])
    assert m._closed and [(v.position, v.first_step) for vs in got for v in vs] == [(0, 1)]


def test_leaving_a_with_block_by_an_exception_keeps_the_engines_exception(caplog):
    """close() on the way out still delivers (here: raises the queued violation), but the exception leaving the
    block is the engine's, not the canary's; the canary's goes to the log."""
    e = engine(on_violation="raise")
    e.flip("full", e.slot_of("a", 5))
    e.decode_step(["a", "b"])
    with caplog.at_level(logging.ERROR, logger="kv_canary"):
        with pytest.raises(ZeroDivisionError):
            with e.manager:
                raise ZeroDivisionError("the engine's own fault")
    assert e.manager._closed
    assert any("close() on leaving a with block that raised ZeroDivisionError" in r.getMessage()
               and "CanaryViolationError" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("how", ["copy", "deepcopy", "pickle"])
def test_copy_and_pickle_are_refused_with_the_reason(how):
    m = ToyEngine().manager
    do = {"copy": copy.copy, "deepcopy": copy.deepcopy, "pickle": pickle.dumps}[how]
    with pytest.raises(TypeError, match=r"^kv-canary: CanaryManager: expected no copy or pickle of a manager, got "
                                        r"one asked for: it owns device buffers, CUDA streams"):
        do(m)
    m.close()
