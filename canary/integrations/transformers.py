"""The KV canary inside Hugging Face transformers' continuous batching, switched on by one call.

::

    import canary.integrations.transformers as kv_canary

    handle = kv_canary.enable(model)          # a PreTrainedModel, or a ContinuousBatchingManager
    out = model.generate_batch(prompts, generation_config=gen,
                               continuous_batching_config=ContinuousBatchingConfig())
    print(handle.stats()["violations"], handle.violations)
    handle.close()

Every step of the engine's generation loop (``model.generate_batch``, ``continuous_batching_context_manager``,
``init_continuous_batching`` + ``start()``) is then planned, verified and written by a
:class:`canary.CanaryManager` bound over the engine's ``PagedAttentionCache``: a stray write into any layer's K /
V, a block handed to two requests, a block freed while still read, a token the engine did not sample, KV
changed in the engine's CPU offload pool or restored into the wrong blocks, a fork's (``num_return_sequences >
1``) KV copied into other blocks than its child's are reported one step later, naming the requests. Written
against transformers 5.17 (``pip install "kv-canary[transformers]"``) and tested there with paged ``sdpa``
attention (tests/integrations/: fp32 on the CPU; bf16 with the engine's CUDA graphs, sync and async batching, on
a GPU); docs/integrations/transformers.md says what it protects, what it refuses, the patches it installs and
what it costs.

This module imports neither torch nor transformers until :func:`enable` is called.
"""
from __future__ import annotations

import logging
import weakref
from typing import Any, Callable

import numpy as np

from canary import CanaryViolationError, Violations

from .hf_patches import PATCHES, Attachment, PatchSet
from .hf_ranks import refusals as distributed_refusals
from .hf_session import Options

__all__ = ["PATCHES", "SUPPORTED_VERSIONS", "CanaryHandle", "enable"]

SUPPORTED_VERSIONS = ("5.17",)  # the transformers versions the patch set was written against and tested with
INSTALL_HINT = 'pip install "kv-canary[transformers]" (transformers>=5.17,<5.18 and psutil)'
log = logging.getLogger("kv_canary")
_ENABLED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model or manager -> its open handle


def _fail(exc: type, message: str) -> Exception:
    return exc(f"kv-canary: {message}")


def _modules(force: bool) -> tuple[Any, Any]:
    """torch and transformers, imported now; the version checked against :data:`SUPPORTED_VERSIONS`."""
    try:
        import torch
        import transformers
        import transformers.generation.continuous_batching  # noqa: F401 - the engine, or its ImportError now
    except ImportError as exc:
        raise _fail(ImportError, f"enable: expected torch and transformers installed, got {exc}: {INSTALL_HINT}") \
            from exc
    version = transformers.__version__
    if not force and not any(version == v or version.startswith(v + ".") for v in SUPPORTED_VERSIONS):
        raise _fail(RuntimeError, f"enable: expected transformers {' or '.join(v + '.x' for v in SUPPORTED_VERSIONS)} "
                                  f"(the patches of docs/integrations/transformers.md are pinned to it), got "
                                  f"{version}; pass force=True to try it anyway")
    return torch, transformers


def refusals(generation_config: Any, cb_config: Any, model: Any) -> list[str]:
    """What the canary cannot protect yet in this configuration: one line per refusal (empty: supported)."""
    out = []
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    types = getattr(text, "layer_types", None)
    if types is None:
        types = ["sliding_attention"] if getattr(text, "sliding_window", None) is not None else ["full_attention"]
    if any(t != "full_attention" for t in types):
        out.append(f"sliding-window or hybrid attention layers ({sorted(set(types))}): full attention only")
    return out + distributed_refusals(model)  # tensor parallelism is protected: hf_ranks.py


def _refuse(where: str, found: list[str]) -> None:
    if found:
        raise _fail(ValueError, f"{where}: expected a continuous-batching setup the canary can protect, got "
                                + "; ".join(found))


class CanaryHandle:
    """What :func:`enable` returns: the canary's reports and counters over every generation session.

    - ``violations``: every new :class:`canary.SlotViolation` so far (``requests`` / ``request_ids`` are the
      engine's request ids, ``"req_0"``...), across sessions.
    - ``errors``: exceptions the canary raised on the engine's thread (a refusal found at cache creation, a
      failure while closing a session); the engine fails its requests with the same message.
    - ``sessions``: generation loops run with the canary.
    - :meth:`stats`, :meth:`close`; ``with enable(...) as handle:`` closes on exit.
    """

    def __init__(self, options: Options, on_violation: Any, log_limit: int, torch: Any, version: str):
        self.options, self.on_violation, self.log_limit = options, on_violation, log_limit
        self.torch, self.version = torch, version
        self.violations: list = []
        self.errors: list[BaseException] = []
        self.sessions = 0
        self.dropped = 0
        self._retired: dict[str, Any] = {}
        self._host_s: list[float] = []
        self._glue_s: list[float] = []
        self._exposed_s: list[float] = []
        self._decode: list[bool] = []
        self._attachments: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._model_patches = PatchSet()
        self._model: weakref.ref | None = None
        self._closed = False

    # -- wiring -----------------------------------------------------------------------------------------------
    def attach(self, manager: Any) -> None:
        """Put the canary on ``manager`` (idempotent). Refuses a running manager and what :func:`refusals` names."""
        if self._closed:
            raise _fail(RuntimeError, "enable: expected an open handle, got one closed by close()")
        if manager in self._attachments:
            return
        _claim(manager, self)
        if manager.is_running():
            raise _fail(RuntimeError, "enable: expected a ContinuousBatchingManager not started yet, got a running "
                                      "one (call enable() before start(); a warmed-up manager is fine)")
        _refuse("enable", refusals(manager.generation_config, manager.continuous_batching_config, manager.model))
        self._attachments[manager] = Attachment(self, manager)
        _ENABLED[manager] = self

    def patch_model(self, model: Any) -> None:
        """Make every manager ``model`` creates from now on carry the canary."""
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        handle = self

        def make(orig: Callable) -> Callable:
            def init_continuous_batching(generation_config=None, continuous_batching_config=None,
                                         workload_hints=None):
                cached = getattr(model, "_cached_continuous_batching_manager", None)
                if cached is None:  # what init_continuous_batching will build with: checked before it is built
                    gen = generation_config if generation_config is not None else model.generation_config
                    cb = continuous_batching_config
                    if cb is None:
                        cb = getattr(gen, "continuous_batching_config", None)
                        cb = cb if isinstance(cb, ContinuousBatchingConfig) else ContinuousBatchingConfig()
                    _refuse("init_continuous_batching", refusals(gen, cb, model))
                manager = orig(generation_config=generation_config,
                               continuous_batching_config=continuous_batching_config, workload_hints=workload_hints)
                if not handle._closed:
                    handle.attach(manager)
                return manager
            return init_continuous_batching

        _claim(model, self)
        self._model_patches.wrap(model, "init_continuous_batching", make)
        _ENABLED[model] = self
        self._model = weakref.ref(model)

    # -- reports ----------------------------------------------------------------------------------------------
    def deliver(self, found: Violations) -> None:
        """The managers' ``on_violation``: keep, then log, raise or call the user's callback."""
        self.violations.extend(found)
        self.dropped += found.dropped
        mode = self.on_violation
        if callable(mode):
            mode(found)
        elif mode == "raise" and (found or found.dropped):
            raise CanaryViolationError(f"kv-canary: {len(found)} KV-cache violation(s) in step {found.step}"
                                       + (f" (+{found.dropped} dropped)" if found.dropped else "")
                                       + (f": {found[0].line()}" if found else ""), list(found), found.dropped,
                                       found.step)
        elif mode == "log":
            for v in found[:self.log_limit]:
                log.error(v.line())
            if len(found) > self.log_limit:
                log.error(f"kv-canary: {len(found) - self.log_limit} more violations of step {found.step} not "
                          f"logged (log_limit={self.log_limit})")

    def retire(self, session: Any) -> None:
        final = getattr(session, "final", None)
        if final is not None:
            self._retired = _merged(self._retired, final)
        for mine, theirs in ((self._host_s, session.host_s), (self._glue_s, session.glue_s),
                             (self._exposed_s, session.exposed_s), (self._decode, session.decode_steps)):
            mine.extend(theirs)
            del mine[:max(0, len(mine) - 65536)]

    # -- the user's calls -------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Totals over every session (the open one as of its last decoded report): ``sessions``,
        ``violations`` (new violations so far), ``violations_by_reason``, ``steps``, ``verified_entries`` /
        ``written_entries`` (per canary group), ``protected_requests`` / ``unprotected_requests`` (requests the
        canary could not protect: no table row left, longer than ``max_seq_len``, or first seen mid-sequence),
        ``ring_dropped``, ``offloaded_requests`` / ``restored_requests`` (CPU offload), ``prefix_hits`` /
        ``swapped_blocks`` (prefix block sharing), ``forked_requests`` (fork children protected from their fork)
        / ``copied_blocks`` (blocks whose records were copied with a fork's KV), ``host_us_per_step`` (host time
        the canary adds per engine step: ``mean``, ``p50``, ``p99``, ``steps``), ``glue_us_per_step`` (of which
        outside the CanaryManager's calls: this integration's own), ``exposed_us_per_step`` (of which with no
        forward queued on the GPU: before the forward's launch and after the engine's sync on it, the time a
        step's wall clock pays for; the rest runs while the GPU runs the forward), ``host_us_per_decode_step`` /
        ``glue_us_per_decode_step`` / ``exposed_us_per_decode_step`` (the same over decode steps: one token
        every batch row), the manager's
        ``graph_replays`` / ``graph_captures`` / ``direct_calls`` (how its step calls launched), ``errors`` and
        ``transformers`` (the version)."""
        total = dict(self._retired)
        host, glue, exposed = list(self._host_s), list(self._glue_s), list(self._exposed_s)
        decode = list(self._decode)
        for att in list(self._attachments.values()):
            session = att.session
            if session is not None and not session.closed:
                total = _merged(total, session.stats())
                n = min(len(session.host_s), len(session.glue_s), len(session.exposed_s), len(session.decode_steps))
                host += session.host_s[:n]
                glue += session.glue_s[:n]
                exposed += session.exposed_s[:n]
                decode += session.decode_steps[:n]
        flags = np.asarray(decode, dtype=bool)
        total.update(sessions=self.sessions, violations=len(self.violations), transformers=self.version,
                     errors=[repr(e) for e in self.errors], host_us_per_step=_summary(host),
                     glue_us_per_step=_summary(glue),
                     host_us_per_decode_step=_summary(np.asarray(host)[flags] if flags.size else []),
                     glue_us_per_decode_step=_summary(np.asarray(glue)[flags] if flags.size else []),
                     exposed_us_per_step=_summary(exposed),
                     exposed_us_per_decode_step=_summary(np.asarray(exposed)[flags] if flags.size else []))
        return total

    def close(self) -> None:
        """Undo every patch (stop the engine's managers first); reports and stats stay readable."""
        if self._closed:
            return
        for manager, att in list(self._attachments.items()):
            att.detach()
            _ENABLED.pop(manager, None)
        self._model_patches.undo()
        model = self._model() if self._model is not None else None
        if model is not None:
            _ENABLED.pop(model, None)
        self._closed = True

    def __enter__(self) -> CanaryHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _claim(target: Any, handle: CanaryHandle) -> None:
    other = _ENABLED.get(target)
    if other is not None and other is not handle and not other._closed:
        raise _fail(RuntimeError, f"enable: expected a {type(target).__name__} without the canary, got one another "
                                  f"handle enabled (close() that one first)")


def _merged(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        if k == "ranks":  # a label, not a count: the last session's
            out[k] = dict(v)
        elif isinstance(v, dict):
            out[k] = _merged(out.get(k, {}), v)
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = out.get(k, 0) + v
    return out


def _summary(samples) -> dict[str, float]:
    if not len(samples):
        return {"mean": 0.0, "p50": 0.0, "p99": 0.0, "steps": 0}
    us = np.asarray(samples) * 1e6
    return {"mean": round(float(us.mean()), 1), "p50": round(float(np.percentile(us, 50)), 1),
            "p99": round(float(np.percentile(us, 99)), 1), "steps": int(us.size)}


def enable(target: Any, *, on_violation: str | Callable = "log", layers: str = "all", real_kv_mode: str = "all",
           verify_capacity: int | None = None, max_requests: int | None = None, max_seq_len: int | None = None,
           backend: str = "auto", ring_capacity: int = 256, log_limit: int = 8, force: bool = False) -> CanaryHandle:
    """Switch the KV canary on for a transformers model or continuous-batching manager; returns a :class:`CanaryHandle`.

    ``target``: a ``PreTrainedModel`` (every ``ContinuousBatchingManager`` it creates from now on, as
    ``generate_batch`` does, carries the canary) or a ``ContinuousBatchingManager`` not started yet.

    - ``on_violation``: ``"log"`` (default: one ``kv_canary`` ERROR line per new violation, at most ``log_limit``
      a step), ``"raise"`` (:class:`canary.CanaryViolationError` on the engine's thread: the engine stops and
      fails its requests with that message) or a callable taking a :class:`canary.Violations` list (on the
      engine's thread; it may call ``manager.cancel_request(rid)`` for ``v.request_ids``). Every violation is
      also kept in ``handle.violations``.
    - ``layers``: ``"all"`` (default: the first layer's K / V are hashed every step and every layer in turn,
      one a step: docs/integration.md 5c) or ``"first"``. ``real_kv_mode``: ``"all"``, ``"partial"`` (the first
      16 bytes of each token) or ``"none"``.
    - ``verify_capacity``: verify entries per step (default ``min(rows * max_seq_len, 2**20)``);
      ``max_requests``: requests protected at once (default ``min(num_blocks, max(64, 2 *
      max_requests_per_batch))``); ``max_seq_len``: tokens per protected request (default ``min(num_pages,
      max_position_embeddings)``); the expected-token pool costs about ``2 * 4 * max_requests * max_seq_len``
      bytes.
    - ``backend``: the canary's (``"auto"``: reference on CPU, CuPy, else Numba on a GPU); ``ring_capacity``.
    - ``force``: try a transformers version other than :data:`SUPPORTED_VERSIONS`.

    Raises ``ImportError`` without torch / transformers, ``RuntimeError`` for another transformers version or a
    running manager, ``ValueError`` for a setup it cannot protect (sliding-window or hybrid layers, pipeline or
    expert parallelism) or a bad option, ``TypeError`` for another ``target``; every message starts with
    ``kv-canary:``. Under tensor parallelism call it on every rank (each rank's canary protects its own KV heads
    and agrees with the others each step: canary/integrations/hf_ranks.py).
    """
    if not (callable(on_violation) or on_violation in ("log", "raise")):
        raise _fail(ValueError, f"on_violation: expected 'log', 'raise' or a callable, got {on_violation!r}")
    for name, value, allowed in (("layers", layers, ("all", "first")),
                                 ("real_kv_mode", real_kv_mode, ("all", "partial", "none"))):
        if value not in allowed:
            raise _fail(ValueError, f"{name}: expected one of {allowed}, got {value!r}")
    for name, value in (("verify_capacity", verify_capacity), ("max_requests", max_requests),
                        ("max_seq_len", max_seq_len), ("ring_capacity", ring_capacity), ("log_limit", log_limit)):
        low = 0 if name == "log_limit" else 1
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
            raise _fail(ValueError, f"{name}: expected an int >= {low}, got {value!r}")
    torch, transformers = _modules(force)
    from transformers.generation.continuous_batching import ContinuousBatchingManager

    options = Options(layers=layers, real_kv_mode=real_kv_mode, verify_capacity=verify_capacity,
                      max_requests=max_requests, max_seq_len=max_seq_len, backend=backend,
                      ring_capacity=ring_capacity)
    handle = CanaryHandle(options, on_violation, log_limit, torch, transformers.__version__)
    if isinstance(target, ContinuousBatchingManager):
        handle.attach(target)
    elif callable(getattr(target, "init_continuous_batching", None)):
        cached = getattr(target, "_cached_continuous_batching_manager", None)
        if isinstance(cached, ContinuousBatchingManager):
            handle.attach(cached)
        handle.patch_model(target)
    else:
        raise _fail(TypeError, f"target: expected a transformers PreTrainedModel or ContinuousBatchingManager, got "
                               f"{type(target).__name__}")
    return handle
