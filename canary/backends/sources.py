"""The one loader of the device code in ``kernels/``: CUDA C sources (CuPy) and Numba kernel modules."""
from __future__ import annotations

import importlib
import importlib.util
import sys
from importlib import resources
from pathlib import Path


def kernels_dir():
    """``kernels/``: the package ``canary.kernels`` once installed, or the folder beside ``canary/`` in a checkout
    whose ``canary`` shadows the installed one (``python -m canary`` from the repository root)."""
    try:
        return resources.files("canary.kernels")
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[2] / "kernels"


def cuda_source(name: str) -> str:
    """The CUDA C source ``kernels/<name>.cu`` (``"plan"`` or ``"records"``)."""
    return kernels_dir().joinpath(f"{name}.cu").read_text()


def numba_kernels(name: str):
    """Import ``kernels/<name>.py`` (``"plan_numba"`` or ``"records_numba"``) as ``canary.kernels.<name>``."""
    full = f"canary.kernels.{name}"
    try:
        return importlib.import_module(full)
    except ModuleNotFoundError as exc:
        if exc.name not in (full, "canary.kernels"):
            raise  # a library the kernels need is missing, not the kernels
        if full in sys.modules:
            return sys.modules[full]
        path = kernels_dir().joinpath(f"{name}.py")
        spec = importlib.util.spec_from_file_location(full, str(path))
        module = importlib.util.module_from_spec(spec)
        sys.modules[full] = module
        spec.loader.exec_module(module)
        return module
