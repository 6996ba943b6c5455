"""Every backend module provides its kernel family's protocol (``canary/backends/protocols.py``), and the registry
refuses one that does not.

The reference imports everywhere: it is checked as imported, signatures by :func:`inspect.signature`. CuPy and
numba-cuda may be missing (and numba may not be imported into this process: it reads ``NUMBA_ENABLE_CUDASIM`` once),
so the CuPy and Numba modules are checked from their source: parsed with :mod:`ast` into stand-ins whose top-level
names, ``Bound`` methods and signatures are the source's, then put through the same checks. Where numba-cuda is
installed, a child process under the CUDA simulator checks the imported Numba modules too.
"""
from __future__ import annotations

import ast
import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import canary.backends as backends
from canary.backends import protocols

ROOT = Path(__file__).resolve().parents[2]
BACKENDS_DIR = ROOT / "canary" / "backends"
ALL_FAMILIES = backends.FAMILIES + backends.OPTIONAL_FAMILIES


def test_every_family_has_a_protocol():
    assert set(protocols.PROTOCOLS) == set(ALL_FAMILIES)
    assert not set(backends.FAMILIES) & set(backends.OPTIONAL_FAMILIES)


# --------------------------------------------------------------------------------------------------------------
# The reference, imported


@pytest.mark.parametrize("family", backends.FAMILIES)
def test_the_reference_provides_every_family(family):
    module = backends.load("reference", family)
    assert protocols.missing(module, family) == []
    assert protocols.signature_problems(module, family) == []
    assert module.NAME == "reference" and module.ON_DEVICE is False


def test_the_reference_has_no_report():
    assert backends.optional("reference", "report") is None


def test_the_reference_has_no_agreement_kernel():  # a host manager digests on the host (distributed.py)
    assert backends.optional("reference", "agree") is None


# --------------------------------------------------------------------------------------------------------------
# CuPy and Numba, from their source

_SENTINEL = object()  # a top-level name whose value the source does not spell out as a literal


def _signature(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> inspect.Signature:
    """The signature ``fn`` declares (defaults stand in as ``...``, annotations dropped)."""
    P = inspect.Parameter
    a = fn.args
    pos = a.posonlyargs + a.args
    defaults = [None] * (len(pos) - len(a.defaults)) + list(a.defaults)
    params = [P(arg.arg, P.POSITIONAL_ONLY if i < len(a.posonlyargs) else P.POSITIONAL_OR_KEYWORD,
                default=P.empty if d is None else ...) for i, (arg, d) in enumerate(zip(pos, defaults))]
    if a.vararg:
        params.append(P(a.vararg.arg, P.VAR_POSITIONAL))
    params += [P(arg.arg, P.KEYWORD_ONLY, default=P.empty if d is None else ...)
               for arg, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        params.append(P(a.kwarg.arg, P.VAR_KEYWORD))
    return inspect.Signature(params)


def _stub_function(fn) -> object:
    def stub(*args, **kwargs):
        raise AssertionError("a stand-in, never called")

    stub.__signature__ = _signature(fn)
    return stub


def _stub_class(node: ast.ClassDef) -> type:
    body = {}
    init = None
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            stub = _stub_function(item)
            static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in item.decorator_list)
            body[item.name] = staticmethod(stub) if static else stub
            if item.name == "__init__":
                init = stub.__signature__
    cls = type(node.name, (), body)
    if init is not None:
        cls.__signature__ = init.replace(parameters=list(init.parameters.values())[1:])
    return cls


def module_from_source(path: Path) -> SimpleNamespace:
    """A stand-in for the module at ``path``: its top-level functions and classes (with their declared signatures),
    its assigned and imported names (string literals as themselves)."""
    ns = {"__name__": path.name}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            ns[node.name] = _stub_function(node)
        elif isinstance(node, ast.ClassDef):
            ns[node.name] = _stub_class(node)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            value = node.value.value if isinstance(node.value, ast.Constant) else _SENTINEL
            for t in targets:
                for name in ([t] if isinstance(t, ast.Name) else getattr(t, "elts", [])):
                    if isinstance(name, ast.Name):
                        ns[name.id] = value
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                ns.setdefault((alias.asname or alias.name).split(".")[0], _SENTINEL)
    return SimpleNamespace(**ns)


SOURCE_CASES = [(b, f) for b in ("cupy", "numba") for f in ALL_FAMILIES
                if (BACKENDS_DIR / b / f"{f}.py").exists() or f in backends.FAMILIES]


@pytest.mark.parametrize("backend,family", SOURCE_CASES)
def test_gpu_backends_provide_their_families_in_source(backend, family):
    path = BACKENDS_DIR / backend / f"{family}.py"
    assert path.exists(), f"{path.relative_to(ROOT)}: every backend has a module of each family"
    module = module_from_source(path)
    assert protocols.missing(module, family) == []
    assert protocols.signature_problems(module, family) == []
    if "NAME" in protocols.members(protocols.PROTOCOLS[family].module):
        assert module.NAME in (backend, _SENTINEL)


def test_the_source_check_sees_a_wrong_signature(tmp_path):
    # The stand-ins carry what the checks compare: a Bound.write taking one argument, a bind gone, are caught.
    src = (BACKENDS_DIR / "cupy" / "layers.py").read_text()
    bad = tmp_path / "layers.py"
    bad.write_text(src.replace("def write(self, plan, out_cache_loc, stream: int)", "def write(self, plan)")
                   .replace("def bind(", "def bind_it("))
    module = module_from_source(bad)
    assert any(p.startswith("Bound.write:") for p in protocols.signature_problems(module, "layers"))
    assert protocols.missing(module, "layers") == ["bind"]


@pytest.mark.skipif(importlib.util.find_spec("numba_cuda") is None, reason="numba-cuda is not installed")
def test_numba_modules_as_imported_under_the_simulator():
    code = ("import json, canary.backends as b\n"
            "from canary.backends import protocols as p\n"
            "out = {f: p.missing(b.load('numba', f), f) + p.signature_problems(b.load('numba', f), f)"
            " for f in b.FAMILIES}\n"
            "out['report'] = b.optional('numba', 'report') is None\n"
            "out['agree'] = p.missing(b.optional('numba', 'agree'), 'agree')\n"
            "print(json.dumps(out))\n")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    if done.returncode and "BackendUnavailableError" in done.stderr:
        pytest.skip(done.stderr.strip().splitlines()[-1])
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out == {**{f: [] for f in backends.FAMILIES}, "report": True, "agree": []}


# --------------------------------------------------------------------------------------------------------------
# The registry's check on load


class _Bound:
    def __init__(self, static, launch=None):
        pass

    def launch(self, step, stream):
        pass

    def warmup(self):
        pass


def _plan_module(**changes):
    ns = dict(__name__="fake.plan", NAME="reference", ON_DEVICE=False, Bound=_Bound, bind=lambda static, launch: None)
    ns.update(changes)
    return SimpleNamespace(**{k: v for k, v in ns.items() if v is not None})


@pytest.fixture
def importer(monkeypatch):
    """``importlib.import_module`` in the registry replaced: ``put(module)`` is what the next loads import."""
    box = {}
    monkeypatch.setattr(backends, "importlib", SimpleNamespace(import_module=lambda path: box["module"]))

    def put(module):
        box["module"] = module

    yield put


def test_load_accepts_a_module_that_provides_the_protocol(importer):
    fake = _plan_module()
    importer(fake)
    assert backends.load("reference", "plan") is fake


def test_load_checks_a_module_once(importer, monkeypatch):
    calls = []
    real = protocols.missing
    monkeypatch.setattr(protocols, "missing", lambda m, f: calls.append(f) or real(m, f))
    fake = _plan_module()
    importer(fake)
    for _ in range(3):
        backends.load("reference", "plan")
    assert calls == ["plan"]
    importer(_plan_module())  # a module imported anew is checked again
    backends.load("reference", "plan")
    assert calls == ["plan", "plan"]


@pytest.mark.parametrize("changes,what", [
    (dict(bind=None), "bind"),
    (dict(ON_DEVICE=None), "ON_DEVICE"),
    (dict(bind=3), "bind"),  # not callable
    (dict(Bound=type("B", (), {"launch": lambda self, s, t: None})), "Bound.warmup"),
    (dict(NAME="cupy"), "NAME = 'reference'"),
])
def test_load_refuses_a_module_missing_part_of_its_protocol(importer, changes, what):
    importer(_plan_module(**changes))
    with pytest.raises(TypeError) as info:
        backends.load("reference", "plan")
    msg = str(info.value)
    assert msg.startswith("kv-canary: backend 'reference': its plan module") and "PlanModule" in msg, msg
    assert f"missing {what}" in msg, msg


def test_load_refuses_half_an_optional_protocol(importer):
    bound = type("Bound", (), {"write": lambda self, a, s: None, "verify": lambda self, a, s: None,
                               "warmup": lambda self: None, "prepare_write": lambda self, a: None})
    importer(SimpleNamespace(__name__="fake.records", NAME="reference", ON_DEVICE=False, Bound=bound,
                             bind=lambda s, r, l: None, scatter=lambda a, s: None))
    with pytest.raises(TypeError, match=r"records module .*missing Bound\.prepare_verify \(optional, but it has "
                                        r"Bound\.prepare_write\), Bound\.launch_prepared"):
        backends.load("reference", "records")


def test_load_refuses_an_unknown_family():
    with pytest.raises(ValueError, match="kv-canary: family: expected one of plan, records, layers, move, digest, "
                                         "report, agree, got 'x'"):
        backends.load("reference", "x")


@pytest.mark.parametrize("have,problem", [
    ("def f(a): ...", "takes 1 positional arguments, the callers pass up to 2"),
    ("def f(a, b, c): ...", "parameter 'c' has no default"),
    ("def f(a, b, *, c): ...", "keyword parameter 'c' has no default"),
    ("def f(*args): ...", None),
    ("def f(x, y, z=1, *, w=2): ...", None),
])
def test_call_problems(have, problem):
    want = inspect.Signature([inspect.Parameter(n, inspect.Parameter.POSITIONAL_ONLY) for n in "ab"])
    ns: dict = {}
    exec(have, ns)  # noqa: S102 - a test's own literal
    got = protocols.call_problems(inspect.signature(ns["f"]), want)
    assert (got == []) if problem is None else any(problem in p for p in got), got


# --------------------------------------------------------------------------------------------------------------
# The front objects choose through the registry only

FRONT = sorted((ROOT / "canary" / "plan").glob("*.py")) + sorted((ROOT / "canary" / "records").glob("*.py"))


@pytest.mark.parametrize("path", FRONT, ids=lambda p: str(p.relative_to(ROOT)))
def test_front_objects_pick_backends_through_the_registry(path):
    text = path.read_text()
    wrong = [f"{path.relative_to(ROOT)}:{i}: {line.strip()}" for i, line in enumerate(text.splitlines(), 1)
             if re.search(r"backends?\.(cupy|numba|reference)\b|backend\s*[!=]=|NAME\s*[!=]=", line)]
    assert not wrong, "a front object choosing a backend module itself:\n" + "\n".join(wrong)
