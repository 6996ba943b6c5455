"""The backend seam: how a backend is chosen, imported and checked (SPEC 3.5).

Backends are grouped by library: ``reference/`` (NumPy), ``cupy/`` (CUDA C through NVRTC), ``numba/``
(numba-cuda); each holds one module per kernel family (``FAMILIES``): ``plan`` (the planner), ``records``
(write, verify, scatter), ``layers`` (the layer rotation), ``move`` (records that move) and ``digest`` (the block
digest), plus what they share in its ``__init__``; a backend may also have a module of an optional family
(``OPTIONAL_FAMILIES``: ``report``, ``agree``). What each family's module provides is a :class:`typing.Protocol` in
:mod:`.protocols` (``bind`` does everything that does not change between calls; a launch must not allocate,
compile, load modules or sync on the GPU backends); :func:`load` checks a module against it once, when first
loaded. The front objects (``canary/plan``,
``canary/records``) and the manager pick a backend only through :func:`resolve`, :func:`load` and
:func:`optional`. The arguments are in :mod:`.args`, the kernel sources are loaded by :mod:`.sources`, the
launch-argument layouts shared with ``kernels/`` are in ``canary/contract``.
"""
from __future__ import annotations

import importlib
import os

from ..errors import BackendUnavailableError, fail
from ..interop.libs import INSTALL, import_cupy
from . import protocols

BACKENDS = ("reference", "cupy", "numba")
FAMILIES = ("plan", "records", "layers", "move", "digest")  # every backend has one module of each
OPTIONAL_FAMILIES = ("report", "agree")  # families a backend may lack: the manager does without

_CHECKED: dict[str, object] = {}  # module name -> the module object checked (a module imported anew is checked again)


def optional(name: str, family: str):
    """Backend ``name``'s module of an optional family (``OPTIONAL_FAMILIES``), or ``None`` when it has none.

    ``"report"``: the manager's step report written by a kernel into pinned memory (CuPy's ``kernels/report.cu``);
    without one the manager copies the report out itself. ``"agree"``: a GPU manager's agreement words (SPEC 4.3,
    ``kernels/agree.cu`` and its Numba twin); the reference has none (a host manager digests on the host).
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


def check(module, name: str, family: str) -> None:
    """Raise ``TypeError`` (``kv-canary:``, naming the backend, the family and what is missing) unless ``module``
    provides family ``family``'s protocol (:mod:`.protocols`; names only, no call is made)."""
    lacking = protocols.missing(module, family)
    if not lacking and "NAME" in protocols.members(protocols.PROTOCOLS[family].module) and module.NAME != name:
        lacking = [f"NAME = {name!r} (it has {module.NAME!r})"]
    if lacking:
        spec = protocols.PROTOCOLS[family]
        raise fail(TypeError, f"backend {name!r}: its {family} module {getattr(module, '__name__', module)!r} does not "
                              f"provide canary.backends.protocols.{spec.module.__name__}: missing "
                              f"{', '.join(lacking)}")


def load(name: str, family: str = "plan"):
    """Import backend ``name``'s module of a kernel family (``FAMILIES`` or ``OPTIONAL_FAMILIES``), checked against
    its protocol the first time. ``ValueError`` for unknown names or families, ``TypeError`` for a module that
    lacks part of its protocol (:func:`check`), :class:`BackendUnavailableError` when the library is missing;
    ``ModuleNotFoundError`` for an optional family the backend has no module of (:func:`optional` says ``None``)."""
    if name not in BACKENDS:
        raise fail(ValueError, f"backend: expected one of {', '.join(('auto',) + BACKENDS)}, got {name!r}")
    if family not in FAMILIES and family not in OPTIONAL_FAMILIES:
        raise fail(ValueError, f"family: expected one of {', '.join(FAMILIES + OPTIONAL_FAMILIES)}, got {family!r}")
    path = f"{__name__}.{name}.{family}"
    module = importlib.import_module(path)
    if _CHECKED.get(path) is not module:
        check(module, name, family)
        _CHECKED[path] = module
    return module


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
