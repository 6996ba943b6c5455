"""The backend seam: how a backend is chosen and imported (SPEC 3.5).

Backends are grouped by library: ``reference/`` (NumPy), ``cupy/`` (CUDA C through NVRTC), ``numba/``
(numba-cuda); each holds a ``plan`` module (the planner) and a ``records`` module (write, verify, scatter),
plus what the two share in its ``__init__``. A ``plan`` module has ``NAME``, ``ON_DEVICE`` and
``bind(static: StaticArgs, launch: LaunchConfig) -> Bound`` with ``Bound.launch(step: StepArgs, stream: int)``
and ``Bound.warmup()``; a ``records`` module has ``bind(state, real_kv) -> Bound`` (``write``, ``verify``,
``warmup``) and ``scatter(args, stream)``. ``bind`` does everything that does not change between calls;
a launch must not allocate, compile, load modules or sync on the GPU backends. The arguments are in
:mod:`.args`, the kernel sources are loaded by :mod:`.sources`, the launch-argument layouts shared with
``kernels/`` are :mod:`.plan_layout` and :mod:`.records_layout`.
"""
from __future__ import annotations

import importlib
import os

from ..errors import BackendUnavailableError, fail
from ..interop.libs import INSTALL, import_cupy

BACKENDS = ("reference", "cupy", "numba")
FAMILIES = ("plan", "records")


OPTIONAL_FAMILIES = ("report",)  # families a backend may lack: the manager falls back to host copies


def optional(name: str, family: str):
    """Backend ``name``'s module of an optional family (``OPTIONAL_FAMILIES``), or ``None`` when it has none.

    ``"report"``: the manager's step report written by a kernel into pinned memory (CuPy's ``kernels/report.cu``);
    without one the manager copies the report out itself.
    """
    if family not in OPTIONAL_FAMILIES:
        raise fail(ValueError, f"family: expected one of {', '.join(OPTIONAL_FAMILIES)}, got {family!r}")
    try:
        return load(name, family)
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{name}.{family}":
            raise
        return None


def _numba_simulator() -> bool:
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")


def load(name: str, family: str = "plan"):
    """Import backend ``name``'s module of a kernel family ("plan" or "records"); ``ValueError`` for unknown names."""
    if name not in BACKENDS:
        raise fail(ValueError, f"backend: expected one of {', '.join(('auto',) + BACKENDS)}, got {name!r}")
    return importlib.import_module(f"{__name__}.{name}.{family}")


def _placement_message(name: str, what: str, where: str, fits: str, on_device: bool) -> str:
    runs = "on a CUDA device" if on_device else "on the host"
    return f"backend: expected a backend for {what} in {where} ({fits}), got {name!r}, which runs {runs}"


def resolve(name: str, device_id: int, family: str = "plan"):
    """Pick the backend module for ``name`` ("auto" included) and arrays living on ``device_id``.

    "auto": the reference for host arrays; on a CUDA device CuPy if it imports, else Numba.
    """
    what = f"the {family} arrays"
    if name == "auto":
        if device_id < 0:
            return load("reference", family)
        try:
            import_cupy()
            return load("cupy", family)
        except BackendUnavailableError:
            try:
                return load("numba", family)
            except BackendUnavailableError as exc:
                raise BackendUnavailableError(
                    f"kv-canary: backend 'auto' found CUDA arrays but neither CuPy nor numba-cuda: "
                    f"{INSTALL['cupy']}, or {INSTALL['numba']}"
                ) from exc
    if device_id < 0 and (name == "cupy" or (name == "numba" and not _numba_simulator())):
        # A caller error whatever is installed: say so before importing the backend's library. (Numba's CUDA
        # simulator runs on host memory: there the numba backend takes host arrays.)
        raise fail(ValueError, _placement_message(name, what, "host memory", "'reference' or 'auto'", True))
    module = load(name, family)
    if module.ON_DEVICE and device_id < 0:
        raise fail(ValueError, _placement_message(name, what, "host memory", "'reference' or 'auto'", True))
    if not module.ON_DEVICE and device_id >= 0:
        raise fail(ValueError, _placement_message(name, what, f"cuda:{device_id}", "'cupy', 'numba' or 'auto'",
                                                  False))
    return module
