"""Host entry points of the canary write and verify kernels and of the expected-token scatter (SPEC 4).

:class:`KVCanary` binds a :class:`~canary.ring.CanaryState` and a :class:`~canary.realkv.RealKV` once, then
launches per step: :meth:`KVCanary.write` after the step's KV stores, :meth:`KVCanary.verify` on a verify
plan, :meth:`KVCanary.drain` to read violations. Every argument is validated on the host before any launch
(``kv-canary:`` messages naming the argument, expected and actual values; no silent casts). Semantics:
``docs/canary.md``.

Only the NumPy reference exists so far; the CuPy and Numba twins plug in behind the same arguments (see the
kernel argument lists in ``docs/canary.md``).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .adapter import HOST, ArrayView, as_view, check_same_device, check_view
from .errors import BackendUnavailableError, fail
from .plans import VerifyPlan, WritePlan
from .realkv import RealKV
from .realkv import real_kv as make_real_kv
from .ring import CanaryState, KernelTag, RingReport, bind_state, encode_tag

INT64 = np.dtype(np.int64)
INT32 = np.dtype(np.int32)


def _backend(name: str, device_id: int):
    if name not in ("auto", "reference", "cupy", "numba"):
        raise fail(ValueError, f"backend: expected one of auto, reference, cupy, numba, got {name!r}")
    if device_id == HOST:
        if name in ("cupy", "numba"):
            raise fail(ValueError, f"backend: {name!r} runs on a CUDA device, but the canary arrays are in host memory")
        from .backends import reference_canary

        return reference_canary
    if name == "reference":
        raise fail(ValueError, f"backend: 'reference' runs on the host, but the canary arrays are on cuda:{device_id}")
    raise BackendUnavailableError(
        "kv-canary: backend: the CUDA write and verify kernels are not available yet; "
        "pass host (NumPy) arrays to use the reference backend"
    )


def _same_device(views: list[ArrayView], device_id: int, what: str) -> None:
    for v in views:
        if v.device_id != device_id:
            where = "host memory" if device_id == HOST else f"cuda:{device_id}"
            raise fail(ValueError, f"{v.name}: expected the device of {what} ({where}), got {v.where}")


def _vec(obj: Any, name: str, dtype, length: int | None = None, writable: bool = False) -> ArrayView:
    return check_view(as_view(obj, name), dtype=dtype, ndim=1, length=length, writable=writable)


def _host(v: ArrayView | None) -> np.ndarray | None:
    return None if v is None else v.host


class KVCanary:
    """A bound canary: ``state`` (:class:`CanaryState`), ``real_kv`` (:class:`RealKV`, a sequence of sources
    for :func:`canary.realkv.real_kv` in mode ALL, or ``None`` for mode NONE), ``backend`` ("auto",
    "reference"; "cupy" / "numba" later).

    Raises ``ValueError`` / ``TypeError`` for bad arguments (including sources that do not cover every slot).
    """

    def __init__(self, state: CanaryState, real_kv: RealKV | Any = None, *, backend: str = "auto"):
        self.state = state
        self.views = bind_state(state)
        if real_kv is None:
            real_kv = make_real_kv(())
        elif not isinstance(real_kv, RealKV):
            real_kv = make_real_kv(real_kv)
        self.real_kv = real_kv
        if real_kv.sources and real_kv.device_id != self.views.device_id:
            raise fail(ValueError, f"{real_kv.sources[0].name}: expected the canary's device, got "
                                   f"{'host memory' if real_kv.device_id == HOST else f'cuda:{real_kv.device_id}'}")
        real_kv.check_covers(self.views.num_slots, "state.canary_buffer")
        self._module = _backend(backend, self.views.device_id)
        self.backend = self._module.NAME

    @property
    def num_slots(self) -> int:
        return self.views.num_slots

    def write(
        self,
        write_plan: WritePlan,
        *,
        out_cache_loc: Any,
        input_ids: Any,
        positions: Any,
        expected_input_ids: Any = None,
        expected_positions: Any = None,
        launch_tag: int = 0,
    ) -> None:
        """Write the canary records of a step's new tokens (docs/canary.md, "Write").

        ``write_plan``: the step's :class:`WritePlan` (``write_offsets`` index the entry arrays).
        ``out_cache_loc``, ``input_ids``, ``positions``: ``[N]`` int64 (KV slot, token id, position of each new
        token; slot < 0 = skip). ``expected_input_ids`` / ``expected_positions``: optional ``[N]`` int64 asserts
        (-1 = no expectation). ``launch_tag``: call-site id recorded in ring rows, in [0, 2**55).
        """
        if not isinstance(write_plan, WritePlan):
            raise fail(TypeError, f"write_plan: expected a WritePlan, got {type(write_plan).__name__}")
        encode_tag(KernelTag.WRITE, launch_tag)
        seeds = _vec(write_plan.write_seed_slot_indices, "write_plan.write_seed_slot_indices", INT64)
        r_cap = seeds.shape[0]
        offsets = _vec(write_plan.write_offsets, "write_plan.write_offsets", INT64)
        if offsets.shape[0] != r_cap + 1:
            raise fail(ValueError, f"write_plan.write_offsets: expected length write_req_capacity + 1 = {r_cap + 1}, "
                                   f"got {offsets.shape[0]}")
        num_reqs = _vec(write_plan.write_num_valid_reqs, "write_plan.write_num_valid_reqs", INT32, length=1)
        loc = _vec(out_cache_loc, "out_cache_loc", INT64)
        n = loc.shape[0]
        ids = _vec(input_ids, "input_ids", INT64, length=n)
        pos = _vec(positions, "positions", INT64, length=n)
        exp_ids = None if expected_input_ids is None else _vec(expected_input_ids, "expected_input_ids", INT64, length=n)
        exp_pos = None if expected_positions is None else _vec(expected_positions, "expected_positions", INT64, length=n)
        views = [seeds, offsets, num_reqs, loc, ids, pos] + [v for v in (exp_ids, exp_pos) if v is not None]
        _same_device(views, self.views.device_id, "state.canary_buffer")
        self._module.write(
            self.views,
            write_offsets=offsets.host, write_seed_slot_indices=seeds.host, write_num_valid_reqs=num_reqs.host,
            out_cache_loc=loc.host, input_ids=ids.host, positions=pos.host,
            expected_input_ids=_host(exp_ids), expected_positions=_host(exp_pos),
            real_kv=self.real_kv, launch_tag=int(launch_tag),
        )

    def verify(self, verify_plan: VerifyPlan, *, launch_tag: int = 0) -> None:
        """Verify the entries of a :class:`VerifyPlan` (docs/canary.md, "Verify")."""
        if not isinstance(verify_plan, VerifyPlan):
            raise fail(TypeError, f"verify_plan: expected a VerifyPlan, got {type(verify_plan).__name__}")
        encode_tag(KernelTag.VERIFY, launch_tag)
        names = ("verify_slot_indices", "verify_expected_tokens", "verify_expected_positions",
                 "verify_prev_slot_indices")
        entries = [_vec(getattr(verify_plan, f), f"verify_plan.{f}", INT64) for f in names]
        cap = entries[0].shape[0]
        for v in entries[1:]:
            if v.shape[0] != cap:
                raise fail(ValueError, f"{v.name}: expected capacity {cap} like verify_slot_indices, got {v.shape[0]}")
        num_valid = _vec(verify_plan.verify_num_valid, "verify_plan.verify_num_valid", INT32, length=1)
        enable = _vec(verify_plan.enable, "verify_plan.enable", INT32, length=1)
        _same_device(entries + [num_valid, enable], self.views.device_id, "state.canary_buffer")
        self._module.verify(
            self.views,
            verify_slot_indices=entries[0].host, verify_expected_tokens=entries[1].host,
            verify_expected_positions=entries[2].host, verify_prev_slot_indices=entries[3].host,
            verify_num_valid=num_valid.host, enable=enable.host, real_kv=self.real_kv, launch_tag=int(launch_tag),
        )

    def drain(self) -> RingReport:
        """Read and reset the violation ring (syncs): see :meth:`CanaryState.drain`."""
        return self.state.drain()


def scatter_expected_tokens(
    *,
    req_to_verify_expected_tokens: Any,
    req_pool_indices: Any,
    tokens: Any,
    token_offsets: Any,
    column_starts: Any,
    column_offset: int = 0,
    backend: str = "auto",
) -> None:
    """Scatter a flat per-request token stream into the expected-token pool (docs/canary.md, "Scatter").

    For each batch row ``r < bs`` with ``rp = req_pool_indices[r]`` in ``[1, pool_rows)`` and each ``j`` in
    ``[0, token_offsets[r+1] - token_offsets[r])``: ``pool[rp, column_starts[r] + column_offset + j] =
    tokens[token_offsets[r] + j]``; columns outside ``[0, pool_cols)`` and token indices outside ``[0, N)`` are
    skipped. Arguments: ``req_to_verify_expected_tokens`` ``[pool_rows, pool_cols]`` int32 (written),
    ``req_pool_indices`` ``[bs]`` int64, ``tokens`` ``[N]`` int64 or int32 (stored as their low 32 bits),
    ``token_offsets`` ``[>= bs+1]`` int64 (a :class:`WritePlan`'s ``write_offsets`` fits: ``tokens`` is then the
    step's ``input_ids``), ``column_starts`` ``[bs]`` int64 (``prefix_lens`` fits), ``column_offset`` (the
    ``kv_token_id_vs_position_offset``).
    """
    pool = check_view(as_view(req_to_verify_expected_tokens, "req_to_verify_expected_tokens"), dtype=INT32, ndim=2,
                      writable=True)
    rpi = _vec(req_pool_indices, "req_pool_indices", INT64)
    bs = rpi.shape[0]
    tok_view = as_view(tokens, "tokens")
    if tok_view.dtype not in (INT64, INT32):
        raise fail(TypeError, f"tokens: expected dtype int64 or int32, got {tok_view.dtype.name}")
    tok = check_view(tok_view, dtype=tok_view.dtype, ndim=1)
    offs = _vec(token_offsets, "token_offsets", INT64)
    if offs.shape[0] < bs + 1:
        raise fail(ValueError, f"token_offsets: expected length >= bs + 1 = {bs + 1}, got {offs.shape[0]}")
    starts = _vec(column_starts, "column_starts", INT64, length=bs)
    if isinstance(column_offset, bool) or not isinstance(column_offset, (int, np.integer)):
        raise fail(TypeError, f"column_offset: expected an int, got {type(column_offset).__name__}")
    device = check_same_device([pool, rpi, tok, offs, starts])
    module = _backend(backend, device)
    module.scatter_expected_tokens(
        req_to_verify_expected_tokens=pool.host, req_pool_indices=rpi.host, tokens=tok.host,
        token_offsets=offs.host, column_starts=starts.host, column_offset=int(column_offset),
    )
