"""Every Python code block of README.md and docs/*.md runs as written.

The scheme, for whoever edits the docs:

- A ```python block is executed. The blocks of one file share one namespace and run in file order, like a
  session: a block may use what an earlier block of the same file defined.
- What the prose leaves to the reader (the engine's arrays, its KV buffers) comes from a setup: an HTML
  comment right before the block (blank lines between are fine), which renders as nothing::

      <!-- test-setup
      req_to_token = xp.zeros((5, 64), dtype=xp.int32)
      -->

  Its body is Python, run first in the block's namespace, where ``xp`` is CuPy when a GPU is visible and
  NumPy otherwise, and ``GPU`` says which.
- Blocks are written for a GPU where that is their point (``device=0``, ``import cupy as cp``). Where no GPU is
  visible they run on the host: ``device=0`` is read as ``device="cpu"`` and ``import cupy as cp`` as
  ``import numpy as cp``; nothing else is rewritten.
- A block that is deliberately a fragment is fenced ```python-fragment: it is compiled, not run. Other fences
  (```bash, ```text, untagged pseudo-code) are not Python and are left alone.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from conftest import has_gpu

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"(?:<!--\s*test-setup\s*\n(?P<setup>.*?)-->\s*\n)?^```(?P<lang>[\w-]*)[^\n]*\n(?P<code>.*?)^```",
                   re.S | re.M)


def blocks(path: Path) -> list[tuple[str, int, str, str]]:
    """``(language, line, setup, code)`` of each fenced block of ``path``."""
    text = path.read_text()
    return [(m["lang"], text.count("\n", 0, m.start("code")), m["setup"] or "", m["code"]) for m in FENCE.finditer(text)]


def on_host(code: str) -> str:
    code = re.sub(r"\bdevice=0\b", 'device="cpu"', code)
    return re.sub(r"^import cupy as cp$", "import numpy as cp", code, flags=re.M)


def python_docs() -> list[Path]:
    return [p for p in DOCS if any(lang.startswith("python") for lang, *_ in blocks(p))]


@pytest.mark.parametrize("path", python_docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_run(path, capsys):
    gpu = has_gpu()
    xp = np
    if gpu:
        import cupy as xp
    namespace: dict = {"__name__": f"docs:{path.name}"}
    for lang, line, setup, code in blocks(path):
        where = f"{path.relative_to(ROOT)}:{line}"
        if lang == "python-fragment":
            compile(code, where, "exec")
            continue
        if lang != "python":
            continue
        if setup:
            namespace.update(xp=xp, GPU=gpu)
            exec(compile(setup, f"{where} (test-setup)", "exec"), namespace)
        try:
            exec(compile(code if gpu else on_host(code), where, "exec"), namespace)
        except Exception as exc:
            raise AssertionError(f"the code block at {where} failed: {type(exc).__name__}: {exc}") from exc
    capsys.readouterr()  # what the blocks print is the reader's, not the test's


def test_every_doc_with_code_is_checked():
    """The fence pattern must see the blocks: a README without any would mean the pattern went wrong."""
    assert ROOT / "README.md" in python_docs()
    assert sum(lang == "python" for lang, *_ in blocks(ROOT / "README.md")) >= 2
