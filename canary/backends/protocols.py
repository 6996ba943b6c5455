"""What a backend module of each kernel family provides: one :class:`typing.Protocol` per family, the calls the
front objects (``canary/plan/planner.py``, ``canary/records/api.py``, ``canary/records/layers.py``,
``canary/records/move.py``) and the manager (``canary/manager/``) make on it, and nothing more.

A backend module satisfies its family's protocol as a module (PEP 544: the module's top-level names are the
members; a protocol method's ``self`` stands for nothing), and the class ``Bound`` in it satisfies the family's
``Bound`` protocol (what ``bind`` returns). Parameters the callers pass by position are positional-only here
(``/``): an implementation may name them as it likes, and may add parameters of its own only with defaults.
Some members are optional: a backend either has all of an optional protocol's names or none (the callers look
them up with ``getattr(..., None)``).

The registry (:func:`canary.backends.load`) checks each module once, when first loaded, with :func:`missing`
(names only); ``tests/usage/test_backend_protocols.py`` also compares signatures with :func:`call_problems`.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..contract.realkv import RealKV
from ..contract.state import StateViews
from .args import (DigestArgs, LaunchConfig, MoveArgs, MoveTables, RecordVerifyArgs, RecordWriteArgs, ScatterArgs,
                   StaticArgs, StepArgs)


# -- plan: the planner (CanaryPlanner, launch_canary_plan_kernels) ------------------------------------------------

@runtime_checkable
class PlanBound(Protocol):
    """A planner bound to its static buffers. ``launch`` plans one step on the raw stream handle ``stream``
    (0: the default stream; host backends ignore it); on the GPU backends it allocates, compiles, loads and
    syncs nothing once ``warmup`` (compile and load) has run."""

    def launch(self, step: StepArgs, stream: int, /) -> None: ...

    def warmup(self) -> None: ...


@runtime_checkable
class ForgetsStep(Protocol):
    """Optional on a plan ``Bound``: drop the last step's arrays (the one-shot entry point's cached launchers keep
    no caller array alive)."""

    def forget_step(self) -> None: ...


@runtime_checkable
class PlanModule(Protocol):
    NAME: str  # the backend's name, as the caller spells it ("reference", "cupy", "numba")
    ON_DEVICE: bool  # False: host arrays (the reference, Numba's simulator); True: CUDA arrays
    Bound: type[PlanBound]

    def bind(self, static: StaticArgs, launch: LaunchConfig, /) -> PlanBound: ...


# -- records: write, verify (CanaryRecords) and the expected-token scatter ----------------------------------------

@runtime_checkable
class RecordsBound(Protocol):
    """A canary bound to its state and real-KV sources: one launch per call on ``stream`` (as :class:`PlanBound`)."""

    def write(self, args: RecordWriteArgs, stream: int, /) -> None: ...

    def verify(self, args: RecordVerifyArgs, stream: int, /) -> None: ...

    def warmup(self) -> None: ...


@runtime_checkable
class PreparesCalls(Protocol):
    """Optional on a records ``Bound``: a call packed once for arrays that repeat (``callviews.Reuse``, the
    manager's verify): ``prepare_*`` return an opaque handle that ``launch_prepared`` launches."""

    def prepare_write(self, args: RecordWriteArgs, /) -> Any: ...

    def prepare_verify(self, args: RecordVerifyArgs, /) -> Any: ...

    def launch_prepared(self, prepared: Any, stream: int, /) -> None: ...


class PreparedScatter(Protocol):
    def launch(self, bs: int, num_tokens: int, stream: int, /) -> None: ...


class PreparedAppend(Protocol):
    def launch(self, tokens_ptr: int, dtype: np.dtype, n: int, stream: int, /) -> None: ...


@runtime_checkable
class RecordsModule(Protocol):
    """A records module. Optional, beside the groups below: ``EAGER_GRAPHS = True`` where the manager may capture
    an eager step's launches into a CUDA graph and replay it (CuPy; absent means False)."""

    NAME: str
    ON_DEVICE: bool
    Bound: type[RecordsBound]

    def bind(self, state: StateViews, real_kv: RealKV, launch: LaunchConfig, /) -> RecordsBound: ...

    def scatter(self, args: ScatterArgs, stream: int, /) -> None: ...


class ScatterPreparer(Protocol):
    """Optional on a records module: the manager's staging scatter, packed once (``DeviceScatter``)."""

    def prepare_scatter(self, args: ScatterArgs, /) -> PreparedScatter: ...


class AppendPreparer(Protocol):
    """Optional on a records module: decode tokens appended on the device (``kernels/records.cu``'s
    ``canary_append_tokens``) from the plan's staged pool rows ``q`` and valid lengths ``valid`` into ``pool``."""

    def prepare_append(self, pool: Any, q: Any, valid: Any, /) -> PreparedAppend: ...


# -- layers: the layer rotation (CanaryLayers) --------------------------------------------------------------------

@runtime_checkable
class LayersBound(Protocol):
    """The rotation bound to a canary's state and a layer table. ``plan``: the write or verify plan's views;
    ``out_cache_loc``: ``[N]`` int64 view; ``tag``: :func:`canary.contract.ring.encode_layer_tag`'s."""

    def write(self, plan: Any, out_cache_loc: Any, stream: int, /) -> None: ...

    def verify(self, plan: Any, tag: int, stream: int, /) -> None: ...

    def warmup(self) -> None: ...


@runtime_checkable
class LayersModule(Protocol):
    NAME: str
    ON_DEVICE: bool
    Bound: type[LayersBound]

    # views: canary.records.layers.LayerViews (a floor above: not imported here)
    def bind(self, state: StateViews, views: Any, launch: LaunchConfig, /) -> LayersBound: ...


# -- move: records that move (RecordMover, SPEC 4.1) -------------------------------------------------------------

@runtime_checkable
class MoveBound(Protocol):
    """A mover bound to its tables and status word: ``gather`` copies the rows of ``args.slots`` into
    ``args.rows``, ``scatter`` the reverse; one launch each on ``stream`` (as :class:`PlanBound`)."""

    def gather(self, args: MoveArgs, stream: int, /) -> None: ...

    def scatter(self, args: MoveArgs, stream: int, /) -> None: ...


# -- digest: the block digest of KV bytes in flight (BlockDigest, SPEC 4.2) ----------------------------------------

@runtime_checkable
class DigestBound(Protocol):
    """The digest bound to the layers' tensors and a scratch of ``max_blocks`` blocks: one launch per call on
    ``stream`` (as :class:`PlanBound`)."""

    def compute(self, args: DigestArgs, stream: int, /) -> None: ...

    def check(self, args: DigestArgs, stream: int, /) -> None: ...

    def warmup(self) -> None: ...


@runtime_checkable
class MoveModule(Protocol):
    NAME: str
    ON_DEVICE: bool
    Bound: type[MoveBound]

    def bind(self, tables: MoveTables, launch: LaunchConfig, /) -> MoveBound: ...


class DigestModule(Protocol):
    NAME: str
    ON_DEVICE: bool
    Bound: type[DigestBound]

    # layers: canary.contract.digest.DigestLayers
    def bind(self, layers: Any, max_blocks: int, launch: LaunchConfig, /) -> DigestBound: ...


# -- report (optional family): the manager's step report written by a kernel into pinned memory ------------------

@runtime_checkable
class ReportLauncher(Protocol):
    def launch(self, rpi_ptr: int, bs: int, stream: int, /) -> None: ...


@runtime_checkable
class ReportModule(Protocol):
    """``ReportLaunch(device_id, **layout)``: canary/manager/transfer.py's ``report_kernel`` launcher."""

    def ReportLaunch(self, device_id: int, /, *, block_ptr: int, words: int, index_words: int,  # noqa: N802
                     mailbox_ptr: int, slot_words: int, slots: int, counter_ptr: int) -> ReportLauncher: ...


# -- agree (optional family): a GPU manager's agreement words (SPEC 4.3, canary/manager/distributed.py) -----------

@runtime_checkable
class AgreeLauncher(Protocol):
    """``launch(slots, tokens, positions, stream)``: ``[n]`` int32 / int64 device views of the step's entries (unit
    stride); adds the group's plan and entries digests into its two words, on ``stream``. Graph-capturable."""

    def launch(self, slots: Any, tokens: Any, positions: Any, stream: int, /) -> None: ...


@runtime_checkable
class AgreeModule(Protocol):
    """``AgreeLaunch(device_id, plan=(slots, tokens, positions, num_valid), out=words)``: one group's launcher
    over its verify plan's views (``[C]`` int64 each, ``[1]`` int32) and its ``[2]`` int64 report-block words."""

    def AgreeLaunch(self, device_id: int, /, *, plan: tuple, out: Any) -> AgreeLauncher: ...  # noqa: N802


@dataclass(frozen=True)
class Family:
    """One kernel family: the protocol of its module, of the module's ``Bound`` class (``None``: no ``Bound``),
    and the optional protocols of each (all of one's names or none)."""

    module: type
    bound: type | None = None
    module_extras: tuple[type, ...] = ()
    bound_extras: tuple[type, ...] = ()


PROTOCOLS: dict[str, Family] = {
    "plan": Family(PlanModule, PlanBound, bound_extras=(ForgetsStep,)),
    "records": Family(RecordsModule, RecordsBound, (ScatterPreparer, AppendPreparer), (PreparesCalls,)),
    "layers": Family(LayersModule, LayersBound),
    "move": Family(MoveModule, MoveBound),
    "digest": Family(DigestModule, DigestBound),
    "report": Family(ReportModule),
    "agree": Family(AgreeModule),
}

_DATA = ("NAME", "ON_DEVICE", "Bound")  # members that are not called through the module


def members(protocol: type) -> tuple[str, ...]:
    """A protocol's member names, in definition order (annotations first)."""
    names = list(getattr(protocol, "__annotations__", {}))
    names += [k for k, v in vars(protocol).items() if not k.startswith("_") and callable(v) and k not in names]
    return tuple(names)


def _missing_in(obj: Any, protocol: type, prefix: str = "") -> list[str]:
    out = []
    for name in members(protocol):
        value = getattr(obj, name, None)
        if value is None or (name not in _DATA and not callable(value)):
            out.append(prefix + name)
    return out


def _partial(obj: Any, protocol: type, prefix: str = "") -> list[str]:
    """The names of an optional protocol that ``obj`` lacks while it has others (all or none)."""
    names = members(protocol)
    lacking = _missing_in(obj, protocol, prefix)
    if not lacking or len(lacking) == len(names):
        return []
    return [f"{n} (optional, but it has {', '.join(prefix + m for m in names if prefix + m not in lacking)})"
            for n in lacking]


def missing(module: Any, family: str) -> list[str]:
    """What ``module`` lacks of family ``family``'s protocol (names only; empty: it provides it)."""
    spec = PROTOCOLS[family]
    out = _missing_in(module, spec.module)
    for extra in spec.module_extras:
        out += _partial(module, extra)
    bound = getattr(module, "Bound", None)
    if spec.bound is not None and bound is not None:
        out += _missing_in(bound, spec.bound, "Bound.")
        for extra in spec.bound_extras:
            out += _partial(bound, extra, "Bound.")
    return out


def protocol_signature(protocol: type, name: str) -> inspect.Signature:
    """The call a protocol method describes: its signature without ``self``."""
    sig = inspect.signature(getattr(protocol, name))
    return sig.replace(parameters=list(sig.parameters.values())[1:])


def call_problems(have: inspect.Signature, want: inspect.Signature) -> list[str]:
    """Why a call shaped as ``want`` says (its positional-only parameters passed by position, the others by
    keyword; parameters with defaults perhaps left out) would not bind to ``have``; empty: it binds."""
    P = inspect.Parameter
    wp = [p for p in want.parameters.values() if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    wk = {p.name: p for p in want.parameters.values() if p.kind == P.KEYWORD_ONLY}
    hp = [p for p in have.parameters.values() if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    hvar = any(p.kind == P.VAR_POSITIONAL for p in have.parameters.values())
    hkw = any(p.kind == P.VAR_KEYWORD for p in have.parameters.values())
    out = []
    if len(hp) < len(wp) and not hvar:
        out.append(f"takes {len(hp)} positional arguments, the callers pass up to {len(wp)}")
    required = sum(1 for p in wp if p.default is P.empty)
    for i, p in enumerate(hp):
        if i >= required and p.default is P.empty and p.name not in wk:
            out.append(f"parameter {p.name!r} has no default, the callers may leave it out")
    for name, p in wk.items():
        h = have.parameters.get(name)
        if h is None or h.kind not in (P.KEYWORD_ONLY, P.POSITIONAL_OR_KEYWORD):
            if not hkw:
                out.append(f"no keyword parameter {name!r}")
        elif p.default is not P.empty and h.default is P.empty:
            out.append(f"parameter {name!r} has no default, the callers may leave it out")
    for p in have.parameters.values():
        if p.kind == P.KEYWORD_ONLY and p.default is P.empty and p.name not in wk:
            out.append(f"keyword parameter {p.name!r} has no default, the callers never pass it")
    return out


def signature_problems(module: Any, family: str) -> list[str]:
    """Where the calls of family ``family``'s protocols (optional ones included, where ``module`` has them) would
    not bind to ``module``'s functions and its ``Bound``'s methods (:func:`call_problems`); names it lacks are
    :func:`missing`'s to report, and callables without a signature are passed over."""
    spec = PROTOCOLS[family]
    bound = getattr(module, "Bound", None)
    checks = [(p, module, "") for p in (spec.module, *spec.module_extras)]
    if spec.bound is not None and bound is not None:
        checks += [(p, bound, "Bound.") for p in (spec.bound, *spec.bound_extras)]
    out = []
    for protocol, owner, prefix in checks:
        for name in members(protocol):
            impl = getattr(owner, name, None)
            if name in _DATA or impl is None:
                continue
            try:
                have = inspect.signature(impl)
            except (TypeError, ValueError):
                continue
            if prefix and not isinstance(inspect.getattr_static(owner, name), staticmethod):
                have = have.replace(parameters=list(have.parameters.values())[1:])  # a method, read off its class
            out += [f"{prefix}{name}: {p}" for p in call_problems(have, protocol_signature(protocol, name))]
    return out
