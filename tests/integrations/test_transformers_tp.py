"""canary.integrations.transformers under tensor parallelism: transformers 5.17's continuous batching over a tiny
Llama sharded over 2 ranks (tp_child.py, one process a rank), the canary enabled on each. A clean run reports
nothing on either rank and changes no token; a K byte flipped in rank 1's KV cache only is reported on both ranks
at the same step boundary (rank 1 its REAL_KV, both a RANK_VIOLATION naming tp rank 1). CPU: gloo, fp32 (about
10 s); ``gpu``: NCCL, bf16, the engine's CUDA graphs, 2 GPUs.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if not transformers.__version__.startswith("5.17."):
    pytest.skip(f"transformers {transformers.__version__}: the integration is pinned to 5.17",
                allow_module_level=True)

from canary.integrations.hf_ranks import refusals  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).resolve().parent / "tp_child.py"
# a rank left in a collective the other skipped fails the test instead of hanging the run (a GPU's first session
# compiles the canary's kernels)
TIMEOUT_S = {"cpu": 120, "cuda": 600, "cuda-shared": 600}
WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(out: Path, mode: str) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, str(CHILD), str(r), str(WORLD), port, str(out), mode], cwd=ROOT,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(WORLD)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=TIMEOUT_S[mode])[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"the ranks did not finish within {TIMEOUT_S[mode]} s (a collective missed): {logs}")
    for r, p in enumerate(procs):
        if p.returncode != 0 and "off" not in _done(out, r):
            # the engine died before the canary was ever on (run 135: torch 2.11's gloo all_gather of CUDA tensors,
            # in transformers' TP forward, segfaults with both ranks on one GPU): the engine's fault, not ours
            pytest.xfail(f"rank {r} exited {p.returncode} in the canary-off run (an engine fault): "
                         f"{(logs[r] if r < len(logs) else '')[-2000:]}")
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{logs[r] if r < len(logs) else ''}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _done(out: Path, rank: int) -> list[str]:
    """The runs (off, clean, flip) rank ``rank`` finished (tp_child.py appends each name as it ends)."""
    f = out / f"rank{rank}.done"
    return f.read_text().split() if f.exists() else []


def check_clean(ranks: list[dict]) -> None:
    for r, res in enumerate(ranks):
        off, clean = res["off"], res["clean"]
        assert len(off["tokens"]) == 4 and clean["tokens"] == off["tokens"] == ranks[0]["off"]["tokens"], r
        st = clean["stats"]
        assert clean["violations"] == [] and clean["delivered"] == [] and st["violations"] == 0, (r, clean)
        assert st["errors"] == [] and st["sessions"] == 1 and st["protected_requests"] == 4
        assert st["ranks"] == {"tp_rank": r, "tp_size": WORLD, "pp_rank": 0, "pp_size": 1, "dp_rank": 0,
                               "dp_size": 1}
        # every step agreed over the gloo group, none reported: one MAX of 13 words a step, no gather
        ag = st["agreement"]
        assert ag["agreed_steps"] == st["steps"] > 20 and ag["gathers"] == 0
        assert ag["bytes_reduced"] == 8 * 13 * st["steps"]
        assert st["written_entries"] == ranks[0]["clean"]["stats"]["written_entries"]


def check_flip(ranks: list[dict]) -> None:
    (slot,) = ranks[1]["flip"]["flipped"]
    assert ranks[0]["flip"]["flipped"] == []
    own = [v for v in ranks[1]["flip"]["violations"] if v["kernel"] != "rank"]
    assert own and all(v["reasons"] == ["REAL_KV"] and v["slot"] == slot and v["requests"] == ["req_0"]
                       for v in own), own
    step = own[0]["first_step"]
    for r, res in enumerate(ranks):
        flip = res["flip"]
        rank_records = [v for v in flip["violations"] if v["kernel"] == "rank"]
        assert [(v["reasons"], v["scope"], v["peers"], v["first_step"]) for v in rank_records] == \
            [(["RANK_VIOLATION"], "tp", [1], step)], (r, flip["violations"])
        if r != 1:
            assert [v for v in flip["violations"] if v["kernel"] != "rank"] == [], r
        assert flip["stats"]["errors"] == [] and flip["tokens"] == ranks[0]["off"]["tokens"]
    # the same report on both ranks: rank 1's own violation and the rank record together, rank 0's alone
    first = [res["flip"]["delivered"][0] for res in ranks]
    assert first[0] == [first[1][0], ["RANK_VIOLATION"]], first
    assert first[1][1] == ["RANK_VIOLATION", "REAL_KV"], first


@pytest.fixture(scope="module")
def cpu_ranks(tmp_path_factory):
    return _spawn(tmp_path_factory.mktemp("tp_cpu"), "cpu")


def test_a_clean_tp_run_reports_nothing_on_either_rank(cpu_ranks):
    check_clean(cpu_ranks)


def test_a_flip_on_one_rank_is_reported_on_both_at_the_same_step(cpu_ranks):
    check_flip(cpu_ranks)


def test_what_is_still_refused():
    def model(mesh=None, **dc):
        return SimpleNamespace(config=SimpleNamespace(distributed_config=SimpleNamespace(**dc) if dc else None),
                               _device_mesh=mesh)

    assert refusals(model()) == [] and refusals(model(tp_size=2, pp_size=1)) == []
    (pp,) = refusals(model(pp_size=2))
    assert pp.startswith("pipeline parallelism (distributed_config.pp_size=2)")
    (ep,) = refusals(model(enable_expert_parallel=True))
    assert ep.startswith("expert parallelism")

    class Mesh:  # a 2-D mesh of another dimension beside tp (the engine reads only the tp one)
        mesh_dim_names, shape = ("fsdp", "tp"), (2, 2)

        def __getitem__(self, name):
            return SimpleNamespace(size=lambda: 2)
    (other,) = refusals(model(Mesh()))
    assert other.startswith("a device mesh with fsdp dimensions ({'fsdp': 2, 'tp': 2})")


@pytest.mark.gpu
def test_two_gpus_nccl_cuda_graphs_clean_and_flipped(tmp_path):
    if torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} CUDA GPUs for torch (one a rank), got {torch.cuda.device_count()}")
    ranks = _spawn(tmp_path, "cuda")
    check_clean(ranks)
    check_flip(ranks)


@pytest.mark.gpu
def test_two_ranks_on_one_gpu_over_gloo(tmp_path):
    # The canary's GPU path under TP (device reports decoded two steps late, the staging copies, CuPy / Numba
    # kernels) where only one GPU is: both ranks on GPU 0, the model's collectives over gloo, no CUDA graphs
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device for torch")
    ranks = _spawn(tmp_path, "cuda-shared")
    check_clean(ranks)
    check_flip(ranks)
