"""The one loader of the device code in ``kernels/``: CUDA C sources (CuPy) and Numba kernel modules."""
from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from importlib import resources
from pathlib import Path


def _checkout_kernels() -> Path | None:
    """``kernels/`` beside the ``canary/`` package in use, when that package is a source checkout.

    Looked at first: an editable install of another checkout maps ``canary.kernels`` to *its* folder, so a
    checkout whose ``canary`` shadows it (``PYTHONPATH``, ``python -m canary`` from the root) would otherwise
    run the other checkout's kernels with its own Python code.
    """
    here = Path(__file__).resolve().parents[2] / "kernels"
    return here if (here / "plan.cu").is_file() else None


def kernels_dir():
    """``kernels/`` of this checkout (see ``_checkout_kernels``), else the installed package ``canary.kernels``."""
    local = _checkout_kernels()
    return local if local is not None else resources.files("canary.kernels")


_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([\w./-]+)"[ \t]*(//.*)?$', re.M)


def cuda_source(name: str) -> str:
    """The CUDA C source ``kernels/<name>.cu`` (``"plan"``, ``"records"``, ``"records_move"`` or ``"report"``), with
    each ``#include "<header>"`` of a ``kernels/`` header replaced by the header's text (recursively, each header
    once).

    CuPy's ``RawModule`` and cuda.core's ``Program`` compile one source string, and NVRTC has no include path to
    ``kernels/`` of an installed package, so the headers are inlined here; ``#line`` directives keep the compiler's
    messages pointing at the header's own lines. Raises ``FileNotFoundError`` for a missing header.
    """
    return _inline(kernels_dir(), f"{name}.cu", set())


def _inline(folder, file: str, seen: set) -> str:
    seen.add(file)
    text = folder.joinpath(file).read_text()

    def expand(match: re.Match) -> str:
        header = match.group(1)
        if header in seen:
            return f"// {header}: inlined above"
        line = text.count("\n", 0, match.end()) + 2  # the line after the directive
        body = _inline(folder, header, seen)
        return f'#line 1 "{header}"\n{body.rstrip()}\n#line {line} "{file}"'

    return _INCLUDE.sub(expand, text)


def _load_file(full: str, path) -> object:
    spec = importlib.util.spec_from_file_location(full, str(path))
    module = importlib.util.module_from_spec(spec)
    sys.modules[full] = module
    spec.loader.exec_module(module)
    return module


def numba_kernels(name: str):
    """Import ``kernels/<name>.py`` (``"plan_numba"``, ``"records_numba"`` or ``"records_move_numba"``) as
    ``canary.kernels.<name>``, from the same folder as :func:`kernels_dir`."""
    full = f"canary.kernels.{name}"
    if full in sys.modules:
        return sys.modules[full]
    local = _checkout_kernels()
    if local is not None:
        return _load_file(full, local / f"{name}.py")
    try:
        return importlib.import_module(full)
    except ModuleNotFoundError as exc:
        if exc.name not in (full, "canary.kernels"):
            raise  # a library the kernels need is missing, not the kernels
        return _load_file(full, kernels_dir().joinpath(f"{name}.py"))
