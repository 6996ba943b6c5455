"""Every benchmark in benchmarks/ runs in its dry mode (no GPU, tiny host workloads) and writes a result that
follows benchmarks/harness.py's schema; a new ``bench_*.py`` is covered by being there. The timings of a dry run
are not tested (they are not results): its argument parsing, its check and the writer are."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
SCRIPTS = sorted(BENCH.glob("bench_*.py"))
HAS_TORCH = importlib.util.find_spec("torch") is not None


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a dataclass looks its module up there
    sys.path.insert(0, str(BENCH))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module


harness = _load("harness")


@pytest.fixture(scope="module")
def dry_runs(tmp_path_factory):
    """Each script's dry run (in parallel: each is a fresh interpreter): name -> (process, its result or None)."""
    out = tmp_path_factory.mktemp("results")

    def run(script: Path):
        proc = subprocess.run([sys.executable, str(script), "--dry", "--out", str(out)], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        return script.stem, proc

    with ThreadPoolExecutor(max_workers=4) as pool:
        done = dict(pool.map(run, SCRIPTS))
    results = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    return done, results


def test_every_benchmark_is_found():
    assert len(SCRIPTS) >= 8, [s.name for s in SCRIPTS]


@pytest.mark.parametrize("script", [s.stem for s in SCRIPTS])
def test_dry_run_writes_a_valid_result(dry_runs, script):
    done, results = dry_runs
    proc = done[script]
    if script == "bench_agree" and not HAS_TORCH:  # its ranks need torch.distributed: refused, saying so
        assert proc.returncode == 2 and "expected torch for the ranks' process group" in proc.stderr, proc.stderr
        assert "kv-canary: argument --ranks:" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        return
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    written = [r for r in results.values() if script == f"bench_{r['benchmark']}"]
    assert len(written) == 1, sorted(results)
    result = written[0]
    harness.validate(result)
    assert result["dry"] is True and result["gpu"]["name"] is None and result["method"].startswith("dry run")
    assert all(f["error"] is None for f in result["figures"]), [f for f in result["figures"] if f["error"]]


def test_the_committed_results_follow_the_schema():
    # <benchmark>.json, or <benchmark>-<variant>.json for a script's other configurations (--name)
    names = {f"bench_{p.stem.split('-')[0]}" for p in (BENCH / "results").glob("*.json")
             if not p.stem.startswith("replay-")}
    assert names <= {s.stem for s in SCRIPTS}, names
    for path in (BENCH / "results").glob("*.json"):
        if not path.stem.startswith("replay-"):
            harness.validate(json.loads(path.read_text()))


def test_validate_refuses_a_figure_without_a_value():
    bad = {"schema": harness.SCHEMA, "benchmark": "x", "commit": "c", "date": "d", "dry": True,
           "gpu": {"name": None, "driver": None, "clocks_mhz": None}, "method": "m", "extra": {},
           "figures": [dict.fromkeys(("name", "value", "unit", "key", "floor", "anchor", "target", "spread",
                                      "error"), None) | {"name": "f", "unit": "us"}]}
    with pytest.raises(ValueError, match="no value and no error"):
        harness.validate(bad)


def test_one_set_of_targets_read_from_performance_md():
    t = harness.targets()
    assert t["plan.bs256_decode"] == ("<=", 7.0, "us") and t["plan.bs4096"] == ("<=", 30.0, "us")
    assert t["plan.swa_bs256"] == ("<=", 15.0, "us") and t["plan.bs1"] == ("<=", 3.5, "us")
    assert t["sampled.ratio"] == ("<=", 1.15, "x") and t["records.hash_bandwidth"] == (">=", 0.6, "fraction")
    assert harness.anchors()["plan.bs256_decode"] == 22.5
    for script in SCRIPTS:  # no benchmark states a target of its own
        assert "TARGET" not in script.read_text(), script.name


def test_the_reference_check_catches_a_wrong_plan():
    bench = _load("bench_reference")
    w = bench.workload(2, 8, seed=3)
    vp, wp = bench.plans(2, 16)
    assert bench.check(w, vp, wp) == "status: expected 0, got 1515870810"  # still poisoned: nothing planned
    bench.CanaryPlanner(verify_plan_out=vp, write_plan_out=wp, req_to_token=w["req_to_token"]).plan(
        **{k: w[k] for k in ("req_pool_indices", "prefix_lens", "extend_seq_lens")})
    assert bench.check(w, vp, wp) is None
    vp.verify_prev_slot_indices[9] += 1
    assert bench.check(w, vp, wp) == "verify_prev_slot_indices: differs from req_to_token at 9"


@pytest.mark.parametrize("name", ["profile_target", "plot", "torch_planner"])
def test_the_other_scripts_compile(name):
    compile((BENCH / f"{name}.py").read_text(), name, "exec")


def test_bench_plan_runs_every_index_form_dry(tmp_path):
    """bench_plan.py --form all (SPEC 3.8): the block table and the page list are built, checked against the
    reference and timed beside req_to_token, each with its ratio figure."""
    proc = subprocess.run([sys.executable, str(BENCH / "bench_plan.py"), "--dry", "--form", "all", "--out",
                           str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    result = json.loads((tmp_path / "plan.json").read_text())
    harness.validate(result)
    names = [f["name"] for f in result["figures"]]
    for form in ("block_table", "page_list"):
        assert f"plan bs8_decode[{form}] reference graph" in names
        assert f"plan bs8_decode[{form}] reference graph / req_to_token" in names
    assert all(f["error"] is None for f in result["figures"])
    bad = subprocess.run([sys.executable, str(BENCH / "bench_plan.py"), "--dry", "--form", "tokens", "--out",
                          str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--form: expected among req_to_token, block_table, page_list" in bad.stderr


@pytest.mark.skipif(not HAS_TORCH, reason="could not import 'torch': its ranks need torch.distributed (gloo)")
def test_bench_agree_counts_the_formula_bytes(dry_runs):
    """bench_agree.py --dry (2 gloo ranks): every workload's bytes all-reduced per step are the docstring's formula
    (one group, one scope: 104), both ranks report, and a run of one rank is refused before any process starts."""
    done, results = dry_runs
    result = next(r for r in results.values() if r["benchmark"] == "agree")
    bytes_ = [f for f in result["figures"] if f["name"].endswith(" bytes")]
    assert len(bytes_) == len(_load("bench_agree").DRY) and all(f["value"] == f["formula"] == 104 for f in bytes_)
    assert len(result["extra"]["per_rank_medians"]) == 2 and result["extra"]["backend"] == "gloo"
    assert {f["name"] for f in result["figures"]} >= {"agree bs1_decode off", "agree bs1_decode on",
                                                      "agree bs1_decode cost", "agree all_reduce alone"}
    bad = subprocess.run([sys.executable, str(BENCH / "bench_agree.py"), "--dry", "--ranks", "1"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--ranks: expected an int >= 2" in bad.stderr, bad.stderr


def test_a_dry_run_without_out_writes_outside_the_committed_results():
    # the README's dry command once overwrote the H200's benchmarks/results/plan.json
    committed = ROOT / "benchmarks" / "results" / "layers.json"
    before = committed.read_bytes() if committed.exists() else None
    proc = subprocess.run([sys.executable, str(BENCH / "bench_layers.py"), "--dry", "--rounds", "1"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    wrote = Path(proc.stdout.rsplit("wrote ", 1)[1].strip())
    assert wrote.exists() and ROOT / "benchmarks" / "results" not in wrote.parents
    assert (committed.read_bytes() if committed.exists() else None) == before
