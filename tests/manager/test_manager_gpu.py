"""CanaryManager on CuPy arrays (GPU only): the device transfers (pinned memory, side stream, events), the CuPy
backend, and CUDA-graph capture of the two per-step calls with torch and with CuPy (child processes)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers.manager_engine import ToyEngine, accept_batch_runs, check_accept_batch_runs

from canary import FailReason

CHILD = Path(__file__).resolve().parent / "manager_capture_child.py"
ROOT = Path(__file__).resolve().parents[2]


def _engine(got, **kw) -> ToyEngine:
    """With static step buffers, the tokens accepted through accept_tokens_batch (the graph-ready engine's way)."""
    cupy = pytest.importorskip("cupy")
    e = ToyEngine(xp=cupy, device=0, on_violation=got.append, **kw)
    e.add("a", [5, 6, 7, 8, 9, 10, 11, 12, 13, 14])
    e.add("b", [20, 21, 22])
    for _ in range(3):
        e.decode_step(["a", "b"], batch=e.static)
    return e


@pytest.mark.gpu
@pytest.mark.parametrize("static", [False, True], ids=["fresh-arrays", "static-buffers"])
def test_cupy_clean_run_and_detection_one_step_late(static):
    """static: the same step arrays every step, so that the manager replays its calls as CUDA graphs."""
    got = []
    e = _engine(got, static=static)
    e.manager.flush()
    s = e.manager.stats()
    assert got == [] and s["decoded_steps"] == 3 and s["verified_entries"]["full"] == (10 + 3) + (11 + 4)
    e.flip("full", e.slot_of("a", 4))
    e.decode_step(["a", "b"], batch=static)  # step 3
    assert got == []  # nothing is read back inside the step
    e.forward([("a", 1), ("b", 1)])  # decodes step 3's report if its copy has landed, never waits
    e.manager.flush()
    v = got[0][0]
    assert (v.group, v.position, v.first_step, v.reasons, v.requests) == ("full", 4, 3, FailReason.REAL_KV,
                                                                          (("a", 4),))
    assert (e.manager._eager.replays > 0) == static
    e.manager.close()


@pytest.mark.gpu
@pytest.mark.parametrize("static", [False, True], ids=["fresh-arrays", "static-buffers"])
def test_numba_backend_reports_through_copies(static):
    """The Numba backend: no eager graphs, the report copied (not written by the report kernel)."""
    pytest.importorskip("numba.cuda")
    got = []
    e = _engine(got, static=static, backend="numba")
    assert e.manager._eager is None and e.manager._transfer.report_launch is None
    e.flip("full", e.slot_of("b", 1))
    e.decode_step(["a", "b"])
    e.manager.flush()
    assert [(v.group, v.position, v.requests) for vs in got for v in vs] == [("full", 1, (("b", 1),))]
    assert e.manager.stats()["decoded_steps"] == 4
    e.manager.close()


@pytest.mark.gpu
@pytest.mark.parametrize("static", [False, True], ids=["fresh-arrays", "static-buffers"])
def test_cupy_full_swa_and_draft_groups_and_blind_spots(static):
    got = []
    e = _engine(got, groups=("full", "swa", "draft"), static=static)
    e.draft_forward([("a", 5), ("b", 2)])
    e.draft_forward([("a", 2)])
    e.manager.flush()
    assert got == []
    e.flip("swa", e.slot_of("a", 11, "swa"))
    e.flip("draft", e.slot_of("a", 3))
    e.decode_step(["a", "b"])
    e.draft_forward([("a", 0)])
    e.manager.flush()
    found = sorted((v.group, v.position) for vs in got for v in vs)
    assert found == [("draft", 3), ("swa", 11)]
    # More decode steps of the same batch: the target forwards' before_forward calls (the staged token scatter
    # included) replay as graphs with static buffers; the SWA group's writes stay direct. The corrupt slots are
    # repeats by now, not new reports.
    for _ in range(8):  # a graph per staging buffer (3): captured at its second sighting
        e.decode_step(["a", "b"], batch=static)
    e.manager.flush()
    assert sorted((v.group, v.position) for vs in got for v in vs) == found
    assert (e.manager._eager.replays > 0) == static
    e.manager.close()


@pytest.mark.gpu
def test_cupy_expected_tokens_reach_the_device_pool():
    """Rejected drafts: only the accepted tokens are expected, staged through pinned memory."""
    cupy = pytest.importorskip("cupy")
    got = []
    e = ToyEngine(xp=cupy, device=0, on_violation=got.append)
    e.add("r", [10, 11, 12, 13])
    e.forward([("r", 4)])
    e.accept("r", [14])
    e.forward([("r", 4)], write_tokens={"r": [14, 15, 16, 17]})
    e.reqs["r"]["tokens"] += [15, 26]
    e.manager.accept_tokens("r", [15, 26])
    e.reqs["r"]["tokens"] += [27]
    e.forward([("r", 1)], prefix_override={"r": 7}, write_tokens={"r": [27]})
    e.forward([("r", 0)])
    e.manager.flush()
    found = [(v.position, v.reasons, v.stored_token, v.expected_token) for vs in got for v in vs]
    assert found == [(6, FailReason.VERIFY_TOKEN, 16, 26)]
    e.manager.close()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", [True, "device"], ids=["host-tokens", "device-tokens"])
@pytest.mark.parametrize("static", [False, True], ids=["fresh-arrays", "static-buffers"])
def test_cupy_accept_tokens_batch_is_accept_tokens_for_each_request(static, kind):
    """On the device: a decode batch's tokens through accept_tokens_batch, host ints (the append scatter) or a
    device array (canary_append_tokens, which advances the valid lengths on the device), inside the replayed
    before-graph with static buffers, fill the pool as accept_tokens per request does, and as the host manager."""
    cupy = pytest.importorskip("cupy")
    runs = accept_batch_runs(kind, xp=cupy, device=0, static=static)
    check_accept_batch_runs(runs)
    host = accept_batch_runs()
    assert np.array_equal(runs[1][0], host[1][0]) and runs[1][1:] == host[1][1:]


def _capture(library: str, *extra: str) -> str:
    pytest.importorskip("torch")
    pytest.importorskip("cupy")
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    done = subprocess.run([sys.executable, str(CHILD), library, *extra], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.gpu
@pytest.mark.parametrize("library", ["torch", "cupy"])
def test_graph_capture_of_the_two_per_step_calls(library):
    assert _capture(library) == "OK"


@pytest.mark.gpu
@pytest.mark.parametrize("library", ["torch", "cupy"])
def test_graph_capture_with_the_layer_rotation(library):
    """The layer rotation inside the captured calls: the device cursor moves on each replay (issue 13)."""
    assert _capture(library, "layers") == "OK"


@pytest.mark.gpu
@pytest.mark.parametrize("static", [False, True], ids=["fresh-arrays", "static-buffers"])
def test_cupy_close_delivers_the_last_step_then_refuses_calls_instead_of_touching_freed_pinned_memory(static):
    """close() flushes the last step's report, frees the pinned staging and mailbox, and every later call raises
    (a write into the freed pinned buffers would be a host use-after-free)."""
    got = []
    e = _engine(got, static=static)
    m = e.manager
    e.flip("full", e.slot_of("a", 2))
    e.decode_step(["a", "b"], batch=static)
    m.close()
    assert [(v.position, v.requests) for vs in got for v in vs] == [(2, (("a", 2),))]
    m.close()
    for call in (lambda: e.decode_step(["a", "b"], batch=static), lambda: m.accept_tokens("a", [1]),
                 lambda: m.accept_tokens_batch(["a", "b"], e.a([1, 2], name="sampled")), m.flush, m.poll,
                 lambda: m.begin_step(["a", "b"]), m.end_step, m.sweep, m.warmup):
        with pytest.raises(RuntimeError, match=r"expected an open manager, got one closed by close\(\)"):
            call()
    assert m.stats()["decoded_steps"] == 4


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cupy", "numba"])
@pytest.mark.parametrize("static", [False, True], ids=["fresh-arrays", "static-buffers"])
def test_mass_corruption_names_every_slot_once_within_the_bound(backend, static):
    """100x the ring across 20 requests (docs/records.md 6.1): the marks live in pinned host memory that the
    kernels read in place; a GPU manager reads a step's report a few steps late (the mailbox depth, 3), so the
    bound is ``ceil(K / C) * (1 + 3)`` steps."""
    cupy = pytest.importorskip("cupy")
    if backend == "numba":
        pytest.importorskip("numba.cuda")
    from helpers.manager_engine import check_mass_corruption, mass_corruption

    run = mass_corruption(requests=20, prompt=20, ring_capacity=4, xp=cupy, device=0, backend=backend,
                          static=static)
    check_mass_corruption(run, latency=3)
    run["engine"].manager.close()


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["current", "other", "torch-other"])
def test_an_explicit_stream_takes_the_fast_path(which):
    """issue 26: ``stream=`` given (the engine's compute stream) costs what no stream costs: the arrays of the
    manager's library are ordered on it once per call (an event when that library's current stream is another),
    so their views and the eager graphs take the fast path; a violation is still found, one step late."""
    import functools

    cupy = pytest.importorskip("cupy")
    if which == "torch-other":
        torch = pytest.importorskip("torch")
        s = torch.cuda.Stream()
    else:
        s = cupy.cuda.get_current_stream() if which == "current" else cupy.cuda.Stream(non_blocking=True)
    got = []
    e = ToyEngine(xp=cupy, device=0, on_violation=got.append, static=True)
    for name in ("before_forward", "after_kv_store"):
        setattr(e.manager, name, functools.partial(getattr(e.manager, name), stream=s))
    e.add("a", [5, 6, 7, 8, 9, 10, 11, 12])
    e.add("b", [20, 21, 22])
    for _ in range(4):
        e.decode_step(["a", "b"], batch=True)
    e.flip("full", e.slot_of("a", 3))
    e.decode_step(["a", "b"], batch=True)
    e.manager.flush()
    st = e.manager.stats()
    assert [(v.position, v.requests) for vs in got for v in vs] == [(3, (("a", 3),))]
    assert st["graph_replays"] > 0 and st["graph_captures"] > 0 and st["direct_calls"] > 0
    assert (st["stream_handshakes"] > 0) == (which != "current")
    e.manager.close()


@pytest.mark.gpu
def test_graph_replays_survive_a_batch_size_that_changes_every_few_steps():
    """issue 26: requests joining and leaving change the batch size every few steps; the eager graphs are kept
    per batch size, so the sizes seen before replay again."""
    cupy = pytest.importorskip("cupy")
    got = []
    e = ToyEngine(xp=cupy, device=0, on_violation=got.append, static=True)
    for rid in "abcd":
        e.add(rid, [1, 2, 3])
    sizes = [2, 2, 3, 3, 4, 4]
    for bs in sizes:
        e.decode_step(list("abcd"[:bs]), batch=True)
    first = e.manager.stats()["graph_replays"]
    for bs in sizes + sizes:
        e.decode_step(list("abcd"[:bs]), batch=True)
    e.manager.flush()
    st = e.manager.stats()
    # Every size seen before replays its after_kv_store graph again (6 measured on the H200, run 115, in 12
    # steps); a before_forward whose accepted tokens came from a batch of another size scatters them itself,
    # a call of its own shape
    assert got == [] and st["graph_replays"] - first >= 6 and st["graph_captures"] <= 12, st
    e.manager.close()


@pytest.mark.gpu
@pytest.mark.parametrize("lib", ["cupy", "torch"])
@pytest.mark.parametrize("static", [False, True], ids=["fresh-arrays", "static-buffers"])
def test_a_device_accept_survives_the_engine_zeroing_its_buffer(lib, static):
    """canary/manager/accepted.py: device token ids are copied at the accept, so an engine that zeroes (or
    refills) its sampled-id buffer before the next forward, as transformers does, gets no false VERIFY_TOKEN; two
    accepts before one step keep both; int32 and int64 buffers."""
    got = []
    e = _engine(got, static=static)
    if lib == "torch":
        torch = pytest.importorskip("torch")
        bufs = [torch.zeros(2, dtype=dt, device="cuda:0") for dt in (torch.int64, torch.int32)]
    else:
        cupy = pytest.importorskip("cupy")
        bufs = [cupy.zeros(2, dtype=dt) for dt in (cupy.int64, cupy.int32)]
    for n in range(6):
        e.forward([(rid, len(e.reqs[rid]["tokens"]) - e.reqs[rid]["kv_len"]) for rid in ("a", "b")])
        for j in range(2 if n == 3 else 1):
            toks = [2000 + 10 * n + j, 3000 + 10 * n + j]
            for rid, t in zip(("a", "b"), toks):
                e.reqs[rid]["tokens"].append(t)
            buf = bufs[(n + j) % 2]
            buf.copy_(torch.as_tensor(toks, device="cuda:0")) if lib == "torch" else buf.set(np.array(toks, dtype=buf.dtype))
            e.manager.accept_tokens_batch(["a", "b"], buf)
            buf.zero_() if lib == "torch" else buf.fill(0)  # the engine reuses its buffer at once
    e.forward([(rid, len(e.reqs[rid]["tokens"]) - e.reqs[rid]["kv_len"]) for rid in ("a", "b")])
    e.manager.flush()
    assert got == [], got
    pool = e.manager.pool_array.get()
    for rid in ("a", "b"):
        req = e.manager.requests.live[rid]
        n = int(e.manager.requests.counts[req.row])
        assert pool[req.row, :n].tolist() == e.reqs[rid]["tokens"][:n]
    e.manager.close()
