"""The Numba-simulator suites (files named ``*_sim_suite.py``): each simulator test is an ordinary test id.

numba reads ``NUMBA_ENABLE_CUDASIM`` once, when it is first imported, so the simulator is a property of the
whole process: the NVVM compile checks (``tests/numba_sim/test_numba_sim.py``) and the GPU runs need the real
numba-cuda, the suites need the simulator. Two process modes:

- **simulator process** (``pytest --numba-sim``, or ``NUMBA_ENABLE_CUDASIM=1`` in the environment): the
  variable is set in ``pytest_configure``, before any test module imports numba (a process that already
  imported numba without it is a usage error), and the suite files are collected as plain test modules. The
  tests that need numba's compiler skip ("the simulator has no compiler"). ``KV_CANARY_REQUIRE_GPU=1`` with
  it is a usage error (tests/helpers/gpu_guard.py).
- **any other process** (the README's ``pytest``, CI's ``pytest -m "sim or slow"``, the GPU runs): numba stays
  real and the environment is not touched. When the ``-m`` expression can select ``sim`` tests, each suite
  file is collected through a child ``pytest --numba-sim --collect-only`` and each of its tests becomes a
  proxy item with the same name, marks and node id. The first proxy that runs starts one child
  ``pytest --numba-sim`` per suite file for the proxies left after ``-m`` / ``-k`` / ``--deselect`` (node ids
  passed in a file, not on the command line), as many at once as the machine has CPUs, each killed past
  ``TIMEOUT_S``; every proxy then reports its own test's outcome: passed, skipped with the child's reason, or
  failed with the child's traceback and captured output (a killed child's proxies fail with its tail). No pass is counted: a test added
  to a suite is one more id. The children run without ``KV_CANARY_REQUIRE_GPU`` (a simulator run is a CPU
  run, even inside a GPU run). Where ``-m`` cannot select ``sim`` (the default ``not sim and not slow``),
  the suites collect nothing and no child starts.

By hand, one test: ``python -m pytest -q -m sim tests/numba_sim -k test_simulator_mode`` (proxied), or in
this process: ``python -m pytest -q -m sim --numba-sim tests/numba_sim/numba_sim_suite.py -k ...``.
"""
from __future__ import annotations

import fnmatch
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from helpers import gpu_guard

SIM_ENV = "NUMBA_ENABLE_CUDASIM"
SUITE_GLOB = "*_sim_suite.py"  # also in pyproject.toml's python_files
RESULTS_ENV = "KV_CANARY_SIM_RESULTS"  # child: write what it collected / how each test ended, as JSON, here
SELECT_ENV = "KV_CANARY_SIM_SELECT"  # child: run only the node ids listed (JSON) in this file
OWN_MARKS = ("gpu", "sim", "slow")  # the marks a proxy carries over (pyproject.toml declares them)
TIMEOUT_S = 1800
PLUGIN_NAME = "kv-canary-sim-suites"


def addoption(parser) -> None:
    parser.addoption("--numba-sim", action="store_true", default=False,
                     help="kv-canary: run this process under the Numba CUDA simulator (NUMBA_ENABLE_CUDASIM=1): "
                          "the *_sim_suite.py files are collected directly")


def simulator_mode(config) -> bool:
    return bool(config.getoption("numba_sim")) or os.environ.get(SIM_ENV, "0") not in ("", "0")


def configure(config) -> None:
    """Enter the simulator mode if asked (before any test module imports numba); register the plugin."""
    if simulator_mode(config):
        real = [m for m in ("numba", "numba.cuda") if m in sys.modules] if os.environ.get(SIM_ENV) != "1" else []
        if real:
            raise pytest.UsageError(f"kv-canary: --numba-sim: {real[0]} was imported before {SIM_ENV} could be "
                                    f"set; run with {SIM_ENV}=1 in the environment")
        os.environ[SIM_ENV] = "1"
    config.pluginmanager.register(SimSuites(config), PLUGIN_NAME)


def _may_select_sim(config) -> bool:
    """Whether the run's ``-m`` expression can select a test marked ``sim`` (and nothing else of ours)."""
    expr = config.option.markexpr
    if not expr:
        return True
    try:
        from _pytest.mark.expression import Expression

        return bool(Expression.compile(expr).evaluate(lambda name, **_: name == "sim"))
    except Exception:  # noqa: BLE001 - a pytest without that (private) API: collect, -m still filters
        return True


class SimulatorFailure(Exception):
    """A proxied simulator test failed in the child; the message is the child's report of it."""


class SimSuites:
    """The hooks (one instance per session; ``simulator`` fixes the process mode)."""

    def __init__(self, config):
        self.config = config
        self.simulator = simulator_mode(config)
        self.collected: dict[str, dict] = {}  # suite path -> {"items": [[nodeid, marks]], "skipped": reason}
        self.outcomes: dict[str, dict] | None = None
        self.child_tails: dict[str, str] = {}  # suite path -> how its child ended
        self.records: dict[str, dict] = {}  # child: what it writes to RESULTS_ENV

    # -- parent: suites as proxies -------------------------------------------------------------------------

    @pytest.hookimpl(tryfirst=True)
    def pytest_pycollect_makemodule(self, module_path, parent):
        if self.simulator or not fnmatch.fnmatch(module_path.name, SUITE_GLOB):
            return None  # a plain Module
        return SuiteProxy.from_parent(parent, path=module_path)

    def child(self, args: list[str], select: list[str] | None = None) -> tuple[dict, str]:
        """Run one child ``pytest --numba-sim``: what it wrote to RESULTS_ENV and its exit, as text. A child past
        TIMEOUT_S is killed and reported, never retried (its proxies fail with that tail, not one timeout each)."""
        env = dict(os.environ, **{SIM_ENV: "1"})
        env.pop(gpu_guard.ENV, None)
        with tempfile.TemporaryDirectory(prefix="kv-canary-sim-") as tmp:
            env[RESULTS_ENV] = str(Path(tmp, "results.json"))
            if select is not None:
                env[SELECT_ENV] = str(Path(tmp, "select.json"))
                Path(env[SELECT_ENV]).write_text(json.dumps(select))
            cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--numba-sim", "-m", "sim",
                   *args]
            try:
                proc = subprocess.run(cmd, cwd=self.config.rootpath, env=env, capture_output=True, text=True,
                                      timeout=TIMEOUT_S)
                tail = f"the simulator child exited with {proc.returncode}:\n{_tail(proc.stdout, proc.stderr)}"
            except subprocess.TimeoutExpired as exc:
                tail = (f"the simulator child ran past {TIMEOUT_S} s and was killed:\n"
                        f"{_tail(_text(exc.stdout), _text(exc.stderr))}")
            path = Path(env[RESULTS_ENV])
            got = json.loads(path.read_text()) if path.exists() else {}
            return got, tail

    def collect_suite(self, path: Path) -> dict:
        if str(path) not in self.collected:
            # One child collects every suite of the tree at once (each child pays numba's import).
            paths = sorted({str(path), *map(str, Path(self.config.rootpath, "tests").rglob(SUITE_GLOB))})
            got, tail = self.child(["--collect-only", *paths])
            if "items" not in got:
                pytest.fail(f"kv-canary: collecting the simulator suites failed: {tail}", pytrace=False)
            for p in paths:
                self.collected[p] = {"items": [], "skipped": got.get("skipped", {}).get(p)}
            for nodeid, marks, file in got.get("items", []):
                self.collected.setdefault(file, {"items": [], "skipped": None})["items"].append((nodeid, marks))
        return self.collected[str(path)]

    def outcome(self, item: "SimProxy") -> dict | None:
        """The child's outcome for ``item``. On the first call every selected proxy runs: one child per suite
        file, as many at once as there are CPUs (the simulator is one busy Python thread per process), so a
        slow suite neither serializes the rest nor, past TIMEOUT_S, takes the other files' results with it."""
        if self.outcomes is None:
            self.outcomes = {}
            proxies = [i for i in item.session.items if isinstance(i, SimProxy)]
            by_file: dict[str, list[str]] = {}
            for proxy in proxies:
                by_file.setdefault(str(proxy.path), []).append(proxy.child_nodeid)
            workers = max(1, min(len(by_file), os.cpu_count() or 1))
            with ThreadPoolExecutor(max_workers=workers) as pool:
                runs = {file: pool.submit(self.child, [file], select=ids) for file, ids in by_file.items()}
                for file, run in runs.items():
                    got, tail = run.result()
                    self.outcomes.update(got.get("outcomes", {}))
                    self.child_tails[file] = tail
        return self.outcomes.get(item.child_nodeid)

    # -- child: what the parent reads ----------------------------------------------------------------------

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items):
        if not self.simulator:
            return
        if os.environ.get(SELECT_ENV):
            keep = set(json.loads(Path(os.environ[SELECT_ENV]).read_text()))
            dropped = [i for i in items if i.nodeid not in keep]
            if dropped:
                config.hook.pytest_deselected(items=dropped)
                items[:] = [i for i in items if i.nodeid in keep]
        self.records["items"] = [[i.nodeid, sorted({m.name for m in i.iter_markers()} & set(OWN_MARKS)),
                                  str(i.path)] for i in items]

    def pytest_collectreport(self, report):
        if self.simulator and report.skipped and report.nodeid:
            reason = gpu_guard.skip_reason(report)
            self.records.setdefault("skipped", {})[str(Path(self.config.rootpath, report.nodeid))] = reason

    def pytest_runtest_logreport(self, report):
        if not self.simulator:
            return
        got = self.records.setdefault("outcomes", {}).setdefault(report.nodeid, {"outcome": "passed"})
        if report.failed:
            sections = "\n".join(f"{'-' * 20} {title} {'-' * 20}\n{text}" for title, text in report.sections)
            got.update(outcome="failed", text=f"{report.longreprtext}\n{sections}".rstrip(), when=report.when)
        elif report.skipped and got["outcome"] == "passed":
            got.update(outcome="skipped", text=gpu_guard.skip_reason(report) or "skipped in the simulator")

    def pytest_sessionfinish(self, session):
        if self.simulator and os.environ.get(RESULTS_ENV):
            Path(os.environ[RESULTS_ENV]).write_text(json.dumps(self.records))


def _text(out) -> str:
    return out.decode(errors="replace") if isinstance(out, bytes) else (out or "")


def _tail(stdout: str, stderr: str) -> str:
    return (stdout + stderr)[-20000:]


class SuiteProxy(pytest.File):
    """A ``*_sim_suite.py`` outside the simulator: its tests, as the child collected them (nothing is imported
    here)."""

    def collect(self):
        if not _may_select_sim(self.config):
            return
        plugin: SimSuites = self.config.pluginmanager.get_plugin(PLUGIN_NAME)
        suite = plugin.collect_suite(self.path)
        if suite["skipped"] and not suite["items"]:
            pytest.skip(suite["skipped"])  # a module-level skip in the child: the same skip here
        prefix = self.nodeid + "::"
        for nodeid, marks in suite["items"]:
            item = SimProxy.from_parent(self, name=nodeid.removeprefix(prefix), child_nodeid=nodeid)
            for mark in marks:
                item.add_marker(mark)
            yield item


class SimProxy(pytest.Item):
    """One simulator test, run in the child; reports the child's outcome for it."""

    def __init__(self, *, child_nodeid: str, **kwargs):
        super().__init__(**kwargs)
        self.child_nodeid = child_nodeid

    def runtest(self):
        plugin: SimSuites = self.config.pluginmanager.get_plugin(PLUGIN_NAME)
        got = plugin.outcome(self)
        if got is None:
            raise SimulatorFailure(f"kv-canary: {self.child_nodeid} did not run in the simulator child; "
                                   f"{plugin.child_tails.get(str(self.path), 'no child ran it')}")
        if got["outcome"] == "skipped":
            try:  # the skip reported at the suite file (reportinfo), not at this line
                raise pytest.skip.Exception(got["text"], _use_item_location=True)
            except TypeError:  # a pytest without that keyword
                pytest.skip(got["text"])
        if got["outcome"] == "failed":
            raise SimulatorFailure(f"(in the Numba simulator child, {got['when']})\n{got['text']}")

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, SimulatorFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self):
        return self.path, 0, self.name
