"""A manager per rank (SPEC 4.3): 2 and 4 gloo processes (ranks_child.py), each a ToyEngine whose manager agrees
with the others each step; a clean run agrees, a flip on one rank is reported on every rank in the same step
naming it, a lost write on one rank is a RANK_DIVERGE naming it; the rank labels are on the records and metrics.
The communicator adapters and the summary are tested in-process too (no torch needed for those)."""
from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from helpers.fake_child import needs_cuda_bindings, run_fake_child
from helpers.manager_engine import ToyEngine

from canary import LocalCommunicator, Ranks, RankViolation
from canary.manager.distributed import batch_digest, check_distributed, entries_digest

ROOT = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).resolve().parent / "ranks_child.py"
TIMEOUT_S = 50  # a hang (a rank missing a collective) fails the test instead of blocking the run


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(world: int, tp: int, out: Path) -> list[dict]:
    pytest.importorskip("torch")
    pytest.importorskip("prometheus_client")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, str(CHILD), str(r), str(world), str(port), str(out), str(tp)],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=TIMEOUT_S)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"ranks did not finish within {TIMEOUT_S} s (a collective missed): {logs}")
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{logs[r] if r < len(logs) else ''}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module", params=[(2, 2), (4, 2)], ids=["tp2", "tp2xpp2"])
def world(request, tmp_path_factory):
    n, tp = request.param
    return n, tp, _spawn(n, tp, tmp_path_factory.mktemp(f"ranks{n}"))


def _records(result: dict, scenario: str) -> list[dict]:
    return [r for rep in result[scenario]["reports"] for r in rep["records"]]


def test_a_clean_run_agrees_on_every_rank(world):
    n, tp, results = world
    for r, res in enumerate(results):
        clean = res["clean"]
        assert clean["reports"] == [], (r, clean["reports"])
        s = clean["stats"]
        assert s["agreement"]["agreed_steps"] == s["decoded_steps"] == 4 and s["agreement"]["gathers"] == 0
        assert s["ranks"] == {"tp_rank": r % tp, "tp_size": tp, "pp_rank": r // tp, "pp_size": n // tp,
                              "dp_rank": 0, "dp_size": 1}
        # one MAX of [flag, 6 words, -6 words] per group per scope per step
        assert s["agreement"]["bytes_reduced"] == 4 * 8 * 13 * (1 if n == tp else 2)


def test_a_flip_on_one_rank_is_reported_on_every_rank_in_the_same_step(world):
    n, tp, results = world
    for r, res in enumerate(results):
        reports = res["flip"]["reports"]
        assert [rep["step"] for rep in reports] == [3], (r, reports)  # one report, the step of the flip, everywhere
        recs = reports[0]["records"]
        slot = [x for x in recs if x["type"] == "SlotViolation"]
        assert len(slot) == (1 if r == 1 else 0) and all(x["reasons"] == ["REAL_KV"] for x in slot)
        ranked = {(x["scope"], tuple(x["peers"])) for x in recs if x["type"] == "RankViolation"}
        assert all(x["reasons"] == ["RANK_VIOLATION"] and x["step"] == 3 for x in recs if x["type"] == "RankViolation")
        if r // tp == 0:  # the faulty rank's stage: its tensor-parallel peers name tp_rank 1
            assert ("tp", (1,)) in ranked, (r, recs)
        if n > tp:  # every rank of the faulty rank's tp column hears it from stage 0; the other stage's ranks too
            assert ("pp", (0,)) in ranked, (r, recs)
        assert all(x["ranks"]["tp_rank"] == str(r % tp) and f"tp_rank={r % tp} " in x["line"] for x in recs)


def test_a_lost_write_on_one_rank_is_a_divergence_naming_it(world):
    n, tp, results = world
    for r, res in enumerate(results):
        recs = [x for x in _records(res, "lost_write") if x["step"] == 3]
        diverge = [x for x in recs if x["reasons"] == ["RANK_DIVERGE"]]
        if r // tp == 0:
            assert len(diverge) == 1, (r, recs)
            d = diverge[0]
            assert (d["scope"], d["peers"], d["group"]) == ("tp", [1], "full")
            assert "written" in d["fields"] and "entries" in d["fields"] and "verified" not in d["fields"]
        else:
            assert diverge == [], (r, recs)  # the other stage's ranks wrote alike; stages agree on batch and plan


def test_raise_mode_raises_on_every_rank_at_the_same_boundary(world):
    n, tp, results = world
    for r, res in enumerate(results):
        got = res["raise"]
        assert got is not None and got["step"] == 1, (r, got)
        assert "RANK_VIOLATION" in got["reasons"] and ("REAL_KV" in got["reasons"]) == (r == 1)


def test_the_metrics_carry_the_rank_labels(world):
    n, tp, results = world
    for r, res in enumerate(results):
        (name, labels, value), = res["clean"]["metrics"]
        assert labels == {"tp_rank": str(r % tp), "pp_rank": str(r // tp), "dp_rank": "0"} and value == 4


# -- in process -------------------------------------------------------------------------------------------------
class _Mirror:
    """A fake communicator of ``size`` ranks whose other ranks hold ``others`` (a function of the words)."""

    def __init__(self, size: int, others):
        self.rank, self.size, self.others, self.calls = 0, size, others, []

    def all_reduce(self, words, op):
        self.calls.append((op, words.shape[0]))
        rest = [self.others(words, op, r) for r in range(1, self.size)]
        return {"max": np.maximum, "sum": np.add}[op].reduce([words, *rest])


def test_one_rank_agrees_with_itself_and_labels_its_records():
    got = []
    e = ToyEngine(ranks=Ranks(tp_rank=0, tp_size=1, dp_rank=3, dp_size=4), communicator=LocalCommunicator(),
                  on_violation=got.append)
    e.add("a", [5, 6, 7])
    for _ in range(2):
        e.decode_step(["a"])
    e.flip("full", e.slot_of("a", 0))
    e.decode_step(["a"])
    e.manager.flush()
    (rep,) = got
    kinds = sorted(type(v).__name__ for v in rep)
    assert kinds == ["RankViolation", "SlotViolation"] and rep.step == 2
    rv = next(v for v in rep if isinstance(v, RankViolation))
    assert rv.peers == (0,) and rv.scope == "tp" and rv.line().endswith("tp_rank=0 pp_rank=0 dp_rank=3")
    assert next(v for v in rep if not isinstance(v, RankViolation)).line().endswith("dp_rank=3")
    assert e.manager.stats()["violations_by_reason"] == {"REAL_KV": 1, "RANK_VIOLATION": 1}


def test_a_divergent_peer_is_named_through_the_gather():
    def others(words, op, r):
        if op == "max":  # the peer's written count one lower: its words are this rank's but one
            peer = words.copy()
            w = (words.shape[0] - 1) // 2
            peer[1], peer[1 + w] = words[1] - 1, -(words[1] - 1)
            return peer
        peer = np.zeros_like(words)
        row = words.reshape(2, -1)[0].copy()
        row[1] -= 1
        peer.reshape(2, -1)[1] = row
        return peer

    comm = _Mirror(2, others)
    got = []
    e = ToyEngine(communicator=comm, on_violation=got.append)
    e.add("a", [5, 6, 7])
    e.decode_step(["a"])
    e.manager.flush()
    (rep,) = got
    (rv,) = rep
    assert (rv.reason_names, rv.peers, rv.fields, rv.first_step) == (("RANK_DIVERGE",), (1,), ("written",), 0)
    assert rv.values == {"written": (3, 2)}  # a tie of two: the lowest rank's is the reference, the other named
    assert comm.calls == [("max", 13), ("sum", 14)]
    assert e.manager.ranks == Ranks(tp_rank=0, tp_size=2)


def test_digests_are_order_independent_and_exclude_skipped_entries():
    loc, tok, pos = np.array([4, 9, -1, 7]), np.array([1, 2, 3, 4]), np.array([0, 1, 2, 3])
    d = entries_digest(loc, tok, pos)
    order = [3, 0, 2, 1]
    assert d == entries_digest(loc[order], tok[order], pos[order]) and 0 <= d < 2 ** 63
    assert d != entries_digest(np.array([4, 9, -1, -1]), tok, pos) != entries_digest(np.array([4, 9, 5, 7]), tok, pos)
    assert entries_digest(loc.tolist(), tok, pos) is None  # not host arrays: not digested (no sync)
    assert batch_digest(np.array([1, 2])) != batch_digest(np.array([2, 1])) and batch_digest(None) == 0


def test_bad_ranks_and_communicators_are_refused():
    with pytest.raises(ValueError, match="kv-canary: ranks: expected tp_rank < tp_size = 2, got 2"):
        Ranks(tp_rank=2, tp_size=2)
    with pytest.raises(TypeError, match="kv-canary: ranks: expected None or a canary.Ranks"):
        check_distributed({"tp_rank": 0}, None)
    with pytest.raises(ValueError, match=r"communicator\['tp'\]: expected rank 1 of 2"):
        check_distributed(Ranks(tp_rank=1, tp_size=2), LocalCommunicator())
    with pytest.raises(ValueError, match="expected scopes 'tp' and 'pp', got 'dp'"):
        check_distributed(None, {"dp": LocalCommunicator()})
    with pytest.raises(TypeError, match="all_reduce"):
        check_distributed(None, object())


def test_import_canary_imports_no_torch():
    code = "import sys, canary; assert 'torch' not in sys.modules and 'cupy' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))


@pytest.mark.gpu
def test_a_gpu_manager_agrees_with_a_lag_of_two():  # pragma: no cover - needs a GPU
    cupy = pytest.importorskip("cupy")
    got = []
    e = ToyEngine(xp=cupy, device=0, communicator=LocalCommunicator(), on_violation=got.append)
    assert e.manager._agreement.lag == 2
    e.add("a", [5, 6, 7, 8])
    for _ in range(2):
        e.decode_step(["a"])
    e.flip("full", e.slot_of("a", 1))
    e.decode_step(["a"])  # step 2 sees the flip
    e.decode_step(["a"])  # step 3's boundary decodes step 1 only
    assert got == []
    e.forward([("a", 1)])  # step 4's boundary decodes step 2, waiting for it if need be
    assert [v.step for v in got] == [2] and sorted(type(v).__name__ for v in got[0]) == ["RankViolation",
                                                                                        "SlotViolation"]
    e.manager.flush()


@pytest.mark.gpu
def test_torch_nccl_adapter_reduces_on_one_gpu(tmp_path):  # pragma: no cover - needs a GPU and torch with CUDA
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    code = (f"import torch.distributed as dist, numpy as np\n"
            f"from canary import TorchDistributedCommunicator\n"
            f"dist.init_process_group('nccl', init_method='tcp://127.0.0.1:{_free_port()}', rank=0, world_size=1)\n"
            f"c = TorchDistributedCommunicator()\n"
            f"w = np.array([3, -5, 1 << 62], np.int64)\n"
            f"assert c.backend == 'nccl' and (c.all_reduce(w, 'max') == w).all()\n"
            f"assert (c.all_reduce(w, 'min') == w).all()\n"
            f"dist.destroy_process_group()\n")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=TIMEOUT_S,
                   env=dict(os.environ, PYTHONPATH=str(ROOT)))


@pytest.mark.gpu
def test_nccl_and_cupy_adapters_reduce_on_one_gpu():  # pragma: no cover - needs a GPU
    cupy = pytest.importorskip("cupy")
    from cupy.cuda import nccl

    from canary import CupyNcclCommunicator

    comm = CupyNcclCommunicator(nccl.NcclCommunicator(1, nccl.get_unique_id(), 0))
    words = np.array([3, -5, 1 << 62], np.int64)
    assert (comm.all_reduce(words, "max") == words).all() and (comm.all_reduce(words, "sum") == words).all()
    assert cupy.cuda.runtime.getDeviceCount() >= 1


def test_a_lag_of_two_decodes_every_report_but_the_newest(caplog):
    # A GPU manager's lag (2): the report of step n - 2 is decoded, waited for if need be, at step n's boundary
    got = []
    e = ToyEngine(ranks=Ranks(dp_rank=1, dp_size=2), communicator=LocalCommunicator(), on_violation=got.append,
                  ring_capacity=1)
    e.manager._agreement.lag = 2
    e.add("a", [5, 6, 7, 8])
    for _ in range(3):
        e.decode_step(["a"])  # steps 0, 1, 2
    for p in range(2):
        e.flip("full", e.slot_of("a", p))
    e.decode_step(["a"])  # step 3 sees the flips
    e.decode_step(["a"])  # step 4's boundary decodes step 2 only
    assert got == [] and e.manager.stats()["decoded_steps"] == 3
    with caplog.at_level(logging.WARNING, logger="kv_canary"):
        e.forward([("a", 1)])  # step 5's boundary decodes step 3
    assert [v.step for v in got] == [3] and got[0].dropped == 1
    assert any(r.getMessage().startswith("kv-canary: ring overflow") and r.getMessage().endswith("dp_rank=1")
               for r in caplog.records)
    e.manager.flush()
    assert e.manager.stats()["decoded_steps"] == 6


# -- two GPU managers on one GPU: the plan and entries words from the device (SPEC 4.3) ------------------------
class _ThreadPair:
    """Two in-process ranks, one thread each, reducing through a barrier: ``comm(r)`` is rank ``r``'s
    communicator; ``calls[r]``: ``(op, words)`` of each of its reductions."""

    def __init__(self):
        self.barrier = threading.Barrier(2, timeout=TIMEOUT_S)
        self.box: list = [None, None]
        self.calls: list = [[], []]

    def comm(self, r: int):
        pair = self

        class _Rank:
            rank, size = r, 2

            def all_reduce(self, words, op):
                pair.box[r] = (words.copy(), op)
                pair.barrier.wait()
                (a, op_a), (b, op_b) = pair.box
                assert op_a == op_b and a.shape == b.shape, (op_a, op_b, a.shape, b.shape)
                out = {"max": np.maximum, "min": np.minimum, "sum": np.add}[op](a, b)
                pair.barrier.wait()  # both have read the box before either call writes it again
                pair.calls[r].append((op, words.copy()))
                return out

        return _Rank()


def _two_gpu_ranks(script, **engine_kw) -> tuple[list, _ThreadPair]:
    """Run ``script(engine, rank)`` on two GPU managers (CuPy, device 0, one thread each: a manager's step calls
    stay on its thread) agreeing through a :class:`_ThreadPair`, then flush both; returns each rank's
    ``(violations, stats)`` and the pair."""
    cupy = pytest.importorskip("cupy")
    pair, out, errors = _ThreadPair(), [None, None], []

    def run(r):
        try:
            got = []
            e = ToyEngine(xp=cupy, device=0, communicator=pair.comm(r), on_violation=got.extend, **engine_kw)
            assert e.manager._steps.agree is not None and e.manager._agreement.device
            script(e, r)
            e.manager.flush()
            out[r] = (got, e.manager.stats())
            e.manager.close()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(exc)
            pair.barrier.abort()  # the other rank's collective fails instead of waiting

    threads = [threading.Thread(target=run, args=(r,), name=f"rank{r}") for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S * 2)
    if errors:
        raise errors[0]
    return out, pair


def _steps(e, r, last=None, n=4):
    e.add("a", [5, 6, 7, 8])
    e.add("b", [20, 21])
    for _ in range(n):
        e.decode_step(["a", "b"], batch=e.static)
    if last is not None:
        last(e, r)


def _rank_records(result) -> list:
    return [v for v in result[0] if isinstance(v, RankViolation)]


@pytest.mark.gpu
@pytest.mark.parametrize("static", [False, True], ids=["fresh-arrays", "static-buffers"])
def test_two_gpu_ranks_agree_on_device_words(static):  # pragma: no cover - needs a GPU
    (r0, r1), pair = _two_gpu_ranks(_steps, static=static)
    assert r0[0] == [] and r1[0] == []
    # The words compared were the device's: G = 1, [flag, written, verified, status, batch, plan, entries, -w]
    maxes = [w for op, w in pair.calls[0] if op == "max"]
    assert len(maxes) == 4 and all(w[6] != 0 for w in maxes) and all(w[5] != 0 for w in maxes[1:])  # 0: a prefill
    assert [w[5:7].tolist() for w in maxes] == [w[5:7].tolist() for op, w in pair.calls[1] if op == "max"]
    assert len({w[6] for w in maxes}) == 4  # every step's entries differ from the last's
    if static:
        assert r0[1]["graph_replays"] > 0  # the words were added inside replayed graphs too


@pytest.mark.gpu
@pytest.mark.parametrize("static,backend,groups", [
    (False, "cupy", ("full",)), (True, "cupy", ("full",)), (False, "numba", ("full",)),
    (True, "cupy", ("full", "swa")), (False, "numba", ("full", "swa"))],
    ids=["fresh-arrays", "static-buffers", "numba", "static-full-swa", "numba-full-swa"])
def test_one_token_written_otherwise_is_an_entries_divergence(static, backend, groups):  # pragma: no cover - GPU
    if backend == "numba":
        pytest.importorskip("numba.cuda")

    def last(e, r):  # the last step: rank 1 writes another token at one position (nothing verifies it later)
        n = {rid: len(q["tokens"]) - q["kv_len"] for rid, q in e.reqs.items()}
        e.forward([("a", n["a"]), ("b", n["b"])], write_tokens={"a": [777] * n["a"]} if r == 1 else None)

    (r0, r1), _ = _two_gpu_ranks(lambda e, r: _steps(e, r, last), static=static, backend=backend, groups=groups)
    for res in (r0, r1):
        rvs = _rank_records(res)
        assert sorted(rv.group for rv in rvs) == sorted(groups)  # every group wrote the token
        for rv in rvs:
            assert (rv.reason, rv.fields, rv.peers, rv.first_step) == ("RANK_DIVERGE", ("entries",), (1,), 4)
            assert len(set(rv.values["entries"])) == 2
        assert [v for v in res[0] if not isinstance(v, RankViolation)] == []


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cupy", "numba"])
def test_a_verify_plan_that_differs_is_a_plan_divergence(backend):  # pragma: no cover - needs a GPU
    if backend == "numba":
        pytest.importorskip("numba.cuda")

    def last(e, r):  # the last step: rank 1's plan edited after its verify ran (only the plan word can differ)
        if r == 1:
            real = e.manager.after_kv_store

            def edited(**kw):  # on the manager's stream (CuPy's current one), behind the verify
                e.manager.groups[0].verify_plan.verify_expected_tokens[0] += 1
                real(**kw)

            e.manager.after_kv_store = edited
        e.decode_step(["a", "b"])

    (r0, r1), _ = _two_gpu_ranks(lambda e, r: _steps(e, r, last), backend=backend)
    for res in (r0, r1):
        (rv,) = _rank_records(res)
        assert (rv.reason, rv.fields, rv.peers, rv.first_step) == ("RANK_DIVERGE", ("plan",), (1,), 4)
        assert [v for v in res[0] if not isinstance(v, RankViolation)] == []


@needs_cuda_bindings
@pytest.mark.parametrize("report", ["kernel", "copy"])
def test_a_gpu_managers_agreement_words_on_the_fake_device(report):
    """The device words' plumbing without a GPU (agree_fake_child.py): the launch's packing, direct and inside
    replayed graphs, the words' place in the report block, their reset behind each report, the decoder's read."""
    run_fake_child(Path(__file__).resolve().parent / "agree_fake_child.py", report)
