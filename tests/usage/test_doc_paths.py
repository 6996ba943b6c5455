"""Every repository path that a doc, a docstring or a comment names exists in this checkout.

What is scanned: ``README.md`` and ``docs/**/*.md`` (not ``docs/history/``: a record of what was, whose paths
may since have moved); the docstrings and comments of ``canary/**/*.py``, ``kernels/**``, ``examples/**`` and
``benchmarks/**`` (Python files; the comments of ``kernels/*.cu``); the shell scripts of ``tools/``.

What counts as a path: a token that starts with a top-level folder (``canary/``, ``kernels/``, ``tests/``,
``docs/``, ``examples/``, ``benchmarks/``, ``tools/``) and ends in a file extension or a slash, bare, in
backticks or as a markdown link target; in a markdown file also a link target relative to that file
(``[the spec](SPEC.md)`` in ``docs/``). ``{a,b}`` is expanded and ``*`` is matched as a shell glob. A path
that leaves the repository (``../shared/...``) always fails: the repository stands alone, and what lies
beside it in one checkout is not there in another.
"""
from __future__ import annotations

import ast
import io
import os
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOPS = ("canary", "kernels", "tests", "docs", "examples", "benchmarks", "tools")
# A path from the root: a top-level folder, then path characters (braces and globs too). The lookbehind keeps
# URLs (github.com/owner/repo/docs/...), dotted names (canary.docs) and relative paths (../kernels/) out.
PATH = re.compile(r"(?<![\w./@-])((?:%s)/[\w./{},*-]*)" % "|".join(TOPS))
# A path relative to the file that names it: leading ../ hops (docs/x.md -> ../kernels/plan.cu).
RELATIVE = re.compile(r"(?<![\w.-])((?:\.\./)+[\w./{},*-]+)")
LINK = re.compile(r"\]\(([^)\s]+)\)")
EXT = re.compile(r"\.[A-Za-z][A-Za-z0-9]*$")


def _expand(token: str) -> list[str]:
    """``a{b,c}d`` -> ``[abd, acd]``, recursively."""
    m = re.search(r"\{([^{}]*)\}", token)
    if not m:
        return [token]
    return [x for alt in m[1].split(",") for x in _expand(token[: m.start()] + alt + token[m.end():])]


def _clean(token: str) -> str:
    # Prose ends a path with a full stop or a comma; a path never ends so.
    return token.rstrip(".,")


def _looks_like_path(token: str) -> bool:
    return token.endswith("/") or bool(EXT.search(token.rstrip("*")))


def _exists(rel: Path) -> bool:
    text = str(rel)
    if "*" in text:
        return any(ROOT.glob(text))
    return (ROOT / rel).exists()


def _python_texts(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every docstring and comment of a Python file."""
    source = path.read_text()
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                # One entry a line, so that a miss names its own line (a docstring's lines map one to one).
                found += [(body[0].lineno + i, line) for i, line in enumerate(body[0].value.value.splitlines())]
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            found.append((tok.start[0], tok.string))
    return found


def _c_comments(path: Path) -> list[tuple[int, str]]:
    source = path.read_text()
    return [(source.count("\n", 0, m.start()) + 1, m[0])
            for m in re.finditer(r"//[^\n]*|/\*.*?\*/", source, re.S)]


def _whole(path: Path) -> list[tuple[int, str]]:
    return [(i, line) for i, line in enumerate(path.read_text().splitlines(), 1)]


def _sources() -> list[tuple[Path, list[tuple[int, str]]]]:
    docs = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md")
                                        if "history" not in p.relative_to(ROOT / "docs").parts)]
    out = [(p, _whole(p)) for p in docs]
    for top in ("canary", "kernels", "examples", "benchmarks"):
        for p in sorted((ROOT / top).rglob("*.py")):
            out.append((p, _python_texts(p)))
    for p in sorted((ROOT / "kernels").glob("*.cu")):
        out.append((p, _c_comments(p)))
    for p in sorted((ROOT / "tools").glob("*.sh")):
        out.append((p, _whole(p)))
    return out


def _misses(path: Path, texts: list[tuple[int, str]]) -> list[str]:
    rel_file = path.relative_to(ROOT)
    misses = []
    for line, text in texts:
        candidates: list[tuple[str, Path]] = []  # (as written, path from the root before normalizing)
        for m in PATH.finditer(text):
            token = _clean(m[1])
            if _looks_like_path(token):
                candidates += [(token, Path(t)) for t in _expand(token)]
        for m in RELATIVE.finditer(text):
            token = _clean(m[1])
            candidates += [(token, rel_file.parent / t) for t in _expand(token)]
        if path.suffix == ".md":
            for m in LINK.finditer(text):
                target = m[1].split("#")[0]
                if not target or re.match(r"[a-z][a-z0-9+.-]*:", target) \
                        or target.startswith(("../", *(t + "/" for t in TOPS))):
                    continue  # a URL, an anchor, or a path one of the patterns above already has
                candidates.append((target, rel_file.parent / target))
        for written, rel in candidates:
            resolved = Path(os.path.normpath(ROOT / rel))  # not resolve(): a glob or a symlink stays as written
            inside = resolved.is_relative_to(ROOT) and resolved != ROOT
            # shared/ beside (or inside) a checkout belongs to the workplace, not the repository: never a target.
            if not inside or resolved.relative_to(ROOT).parts[0] == "shared":
                misses.append(f"{rel_file}:{line}: `{written}` points outside the repository")
            elif not _exists(resolved.relative_to(ROOT)):
                misses.append(f"{rel_file}:{line}: `{written}` does not exist")
    return misses


def test_named_paths_exist():
    by_file: dict[str, list[str]] = {}
    for path, texts in _sources():
        found = list(dict.fromkeys(_misses(path, texts)))
        if found:
            by_file[str(path.relative_to(ROOT))] = found
    count = sum(map(len, by_file.values()))
    assert not by_file, (
        f"kv-canary: {count} path(s) in {len(by_file)} file(s) named in docs, docstrings or comments do not exist "
        "in this checkout (moved, deleted, or outside the repository); mend the text (or the tree). By file:\n"
        + "\n".join(f"{name} ({len(found)}):\n  " + "\n  ".join(found) for name, found in sorted(by_file.items())))


def test_the_scan_sees_paths():
    """The pattern must find the README's paths: a scan that found none would pass whatever the docs said."""
    readme = dict(_sources())[ROOT / "README.md"]
    found = {m[1] for _, text in readme for m in PATH.finditer(text)}
    assert "docs/SPEC.md" in found and "kernels/plan.cu" in found
    assert _misses(ROOT / "README.md", [(1, "see `canary/nowhere/gone.py` and [x](../shared/x.md)")]) == [
        "README.md:1: `canary/nowhere/gone.py` does not exist",
        "README.md:1: `../shared/x.md` points outside the repository"]
    assert _misses(ROOT / "docs" / "SPEC.md", [(1, "[a](../kernels/plan.cu) [b](records.md) [c](../shared/y.md)")]) == [
        "docs/SPEC.md:1: `../shared/y.md` points outside the repository"]
