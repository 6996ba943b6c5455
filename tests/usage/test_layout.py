"""The package's architecture, enforced: floors that only point down, rooms of a readable size.

Floors, lowest first (``canary/contract/__init__.py`` and ``docs/architecture.md`` say what each holds):
``errors`` < ``interop`` < ``contract`` < ``backends`` (and the Numba twins in ``kernels/``) < ``plan`` /
``records`` (the front objects) < ``manager`` < ``canary`` itself (the public names) < ``replay`` (the app) and
``integrations`` (engine integrations, beside the replay). A module may import from its own subpackage and from
floors below it, never from a floor above or a sibling on its own floor; a private name (a leading underscore)
never crosses a subpackage; the replay reads the library through public names only (``canary`` and the
contract), the integrations through ``canary`` alone.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FLOORS = {
    "canary.errors": 0, "canary.data": 0,
    "canary.interop": 1,
    "canary.contract": 2,
    "canary.backends": 3, "canary.kernels": 3,
    "canary.plan": 4, "canary.records": 4,
    "canary.manager": 5,
    "canary": 6,  # the public names, which the app below reads
    "canary.replay": 7, "canary.integrations": 7, "canary.__main__": 8,
}
MAX_LINES = 500  # "no Python module in canary/ over about 500 lines (kernels aside)"
# Within backends/ each library's folder is its own room: the reference, CuPy and Numba backends share only
# what backends/ itself holds (the registry, the argument bundles, the source loader).
ROOMS = ("canary.backends.reference", "canary.backends.cupy", "canary.backends.numba")


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted((ROOT / "canary").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    for path in sorted((ROOT / "kernels").glob("*.py")):
        name = path.stem
        found["canary.kernels" + ("" if name == "__init__" else f".{name}")] = path
    return found


MODULES = _modules()


def _floor_key(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def _room(module: str) -> str:
    for room in ROOMS:
        if module == room or module.startswith(room + "."):
            return room
    return _floor_key(module)


def _imports(module: str, path: Path):
    """(line, imported module, imported name or None) for every import of a ``canary`` module by ``module``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "canary":
                    yield node.lineno, alias.name, None
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "canary":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in MODULES:  # `from .. import backends`: the name is a module
                    yield node.lineno, sub, None
                else:
                    yield node.lineno, target, alias.name


def _edges():
    for module, path in MODULES.items():
        for line, target, name in _imports(module, path):
            yield module, path, line, target, name


def _where(path: Path, line: int) -> str:
    return f"{path.relative_to(ROOT)}:{line}"


def test_every_module_has_a_floor():
    missing = sorted({_floor_key(m) for m in MODULES} - set(FLOORS))
    assert not missing, f"modules outside the floors of this test: {missing}"


def test_imports_point_down():
    wrong = []
    for module, path, line, target, name in _edges():
        a, b = _floor_key(module), _floor_key(target)
        if a == b:
            continue
        if FLOORS[b] >= FLOORS[a]:
            wrong.append(f"{_where(path, line)}: {module} (floor {FLOORS[a]}) imports {target} (floor {FLOORS[b]})")
    assert not wrong, "imports that do not point down:\n" + "\n".join(dict.fromkeys(wrong))


def test_backend_rooms_do_not_import_each_other():
    wrong = [f"{_where(path, line)}: {module} imports {target}"
             for module, path, line, target, name in _edges()
             if _room(module) in ROOMS and _room(target) in ROOMS and _room(module) != _room(target)]
    assert not wrong, "backends importing each other:\n" + "\n".join(wrong)


def test_no_private_name_crosses_a_room():
    wrong = [f"{_where(path, line)}: {module} imports {name} from {target}"
             for module, path, line, target, name in _edges()
             if name and name.startswith("_") and not name.startswith("__") and _room(module) != _room(target)]
    assert not wrong, "private names imported across subpackages:\n" + "\n".join(wrong)


def test_the_replay_uses_public_names_only():
    wrong = []
    for module, path, line, target, name in _edges():
        if _floor_key(module) != "canary.replay" or _floor_key(target) == "canary.replay":
            continue
        public = target == "canary" or _floor_key(target) == "canary.contract"
        if not public or (name or "").startswith("_") or target.rpartition(".")[2].startswith("_"):
            wrong.append(f"{_where(path, line)}: imports {name or ''} from {target}")
        if name == "__version__" and target == "canary":
            wrong.pop()  # the package's version is public
    assert not wrong, "the replay reaching past the public API:\n" + "\n".join(wrong)


def test_the_integrations_use_the_public_names_only():
    """An integration is what an engine author could write: it imports ``canary``'s public names, nothing deeper
    (torch and the engine only lazily, which this test does not see: they are no ``canary`` imports)."""
    wrong = [f"{_where(path, line)}: imports {name or ''} from {target}"
             for module, path, line, target, name in _edges()
             if _floor_key(module) == "canary.integrations" and _floor_key(target) != "canary.integrations"
             and (target != "canary" or (name or "_").startswith("_"))]
    assert not wrong, "an integration reaching past the public API:\n" + "\n".join(wrong)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if not m.startswith("canary.kernels")))
def test_rooms_stay_readable(module):
    lines = MODULES[module].read_text().count("\n")
    assert lines <= MAX_LINES, f"{MODULES[module].relative_to(ROOT)}: {lines} lines (at most about {MAX_LINES})"
